//! `edgerun edges --depth DIR --out DIR`: Sobel edges of existing `.depth.npy` maps.
use std::path::PathBuf;

use anyhow::Context;
use candle_core::{Device, Tensor};
use edgerun::edges::sobel_magnitude;
use edgerun::imageio::{colormap::colorize, npy::read_npy_2d, write_npy_f16, write_png_rgb8};

use super::common::ensure_dir;

/// Arguments of `edges`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Directory of `<stem>.depth.npy` files.
    #[arg(long)]
    depth: PathBuf,
    /// Output directory for `<stem>.edges.npy`.
    #[arg(long)]
    out: PathBuf,
    /// Also write colour-mapped `<stem>.edges.png`.
    #[arg(long)]
    png: bool,
}

/// Runs `edges`.
pub fn run(a: Args) -> anyhow::Result<()> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(&a.depth)
        .with_context(|| format!("cannot read {}", a.depth.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.to_string_lossy().ends_with(".depth.npy"))
        .collect();
    files.sort();
    anyhow::ensure!(!files.is_empty(), "no .depth.npy files in {}", a.depth.display());
    ensure_dir(&a.out)?;
    for f in files {
        let ((h, w), v) = read_npy_2d(&f)?;
        let t = Tensor::from_vec(v, (1, 1, h, w), &Device::Cpu)?;
        let e = sobel_magnitude(&t).with_context(|| format!("edges of {}", f.display()))?.flatten_all()?.to_vec1::<f32>()?;
        let name = f.file_name().map(|n| n.to_string_lossy().replace(".depth.npy", "")).unwrap_or_default();
        write_npy_f16(&a.out.join(format!("{name}.edges.npy")), &[h, w], &e)?;
        if a.png {
            write_png_rgb8(&a.out.join(format!("{name}.edges.png")), w as u32, h as u32, &colorize(&e))?;
        }
    }
    Ok(())
}
