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

/// One batch handed to [`for_each_batch`]: the inputs with their output stems, and the decoded images.
pub struct Batch<'a> {
    /// `(path, stem)` of each image.
    pub items: &'a [(PathBuf, String)],
    /// The decoded images, in the same order.
    pub images: Vec<&'a image::RgbImage>,
}

impl Batch<'_> {
    /// The input paths, comma-separated (for messages).
    pub fn names(&self) -> String {
        self.items.iter().map(|(p, _)| p.display().to_string()).collect::<Vec<_>>().join(", ")
    }
}

/// Decodes `items` (under the default size limits) `batch` at a time and hands each batch to `f`,
/// then reports it on stderr as `<command>: <paths>`.
pub fn for_each_batch(
    command: &str,
    items: &[(PathBuf, String)],
    batch: usize,
    mut f: impl FnMut(&Batch) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    anyhow::ensure!(batch >= 1, "--batch must be at least 1");
    let limits = edgerun::imageio::ImageLimits::default();
    for chunk in items.chunks(batch) {
        let decoded = chunk.iter().map(|(p, _)| edgerun::imageio::load_rgb(p, &limits)).collect::<Result<Vec<_>, _>>()?;
        let b = Batch { items: chunk, images: decoded.iter().collect() };
        f(&b)?;
        eprintln!("{command}: {}", b.names());
    }
    Ok(())
}
