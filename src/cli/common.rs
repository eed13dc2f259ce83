//! Options and helpers shared by the image subcommands.
use std::collections::HashSet;
use std::path::{Path, PathBuf};

use anyhow::Context;
use candle_core::{DType, Device};
use edgerun::device::{parse_device, parse_dtype};
use edgerun::imageio::{collect_images, stem};

/// `--device` and `--dtype`.
#[derive(clap::Args, Debug, Clone)]
pub struct Compute {
    /// cpu, cuda[:N], metal or auto.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Compute dtype: f32, f16, bf16.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
}

impl Compute {
    /// The parsed device and dtype.
    pub fn resolve(&self) -> anyhow::Result<(Device, DType)> {
        Ok((parse_device(&self.device)?, parse_dtype(&self.dtype)?))
    }
}

/// Expands inputs into image files and checks their output stems do not collide.
pub fn images_with_stems(inputs: &[PathBuf]) -> anyhow::Result<Vec<(PathBuf, String)>> {
    let files = collect_images(inputs)?;
    anyhow::ensure!(!files.is_empty(), "no input images found");
    let mut seen = HashSet::new();
    let mut out = Vec::with_capacity(files.len());
    for f in files {
        let s = stem(&f);
        anyhow::ensure!(seen.insert(s.clone()), "two inputs share the output name `{s}` (e.g. {}); give them distinct names", f.display());
        out.push((f, s));
    }
    Ok(out)
}

/// Creates the output directory.
pub fn ensure_dir(dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create output directory {}", dir.display()))
}
