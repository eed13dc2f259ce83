//! `edgerun depth --model M [--batch N] <images or dirs…> --out DIR`.
use std::path::PathBuf;

use anyhow::Context;
use edgerun::edges::sobel_magnitude;
use edgerun::imageio::{colormap::colorize, load_rgb, write_npy_f16, write_png_rgb8, ImageLimits};
use edgerun::tasks::depth::{DepthEstimator, DepthMap};

use super::common::{ensure_dir, images_with_stems, Compute};

/// Arguments of `depth`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Depth model directory or `.gguf`.
    #[arg(long)]
    model: PathBuf,
    /// Images or directories of images.
    #[arg(required = true)]
    inputs: Vec<PathBuf>,
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
    /// Largest number of images per forward pass.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Also write colour-mapped `<stem>.depth.png`.
    #[arg(long)]
    png: bool,
    /// Also write Sobel edges of the depth as `<stem>.edges.npy` (and `.edges.png` with --png).
    #[arg(long)]
    edges: bool,
    #[command(flatten)]
    compute: Compute,
}

/// Writes the depth map (and optional visualisation / edges) of one image.
fn write_outputs(a: &Args, stem: &str, d: &DepthMap) -> anyhow::Result<()> {
    let shape = [d.height, d.width];
    write_npy_f16(&a.out.join(format!("{stem}.depth.npy")), &shape, &d.values)?;
    if a.png {
        write_png_rgb8(&a.out.join(format!("{stem}.depth.png")), d.width as u32, d.height as u32, &colorize(&d.values))?;
    }
    if a.edges {
        let t = candle_core::Tensor::from_slice(&d.values, (1, 1, d.height, d.width), &candle_core::Device::Cpu)?;
        let e = sobel_magnitude(&t)?.flatten_all()?.to_vec1::<f32>()?;
        write_npy_f16(&a.out.join(format!("{stem}.edges.npy")), &shape, &e)?;
        if a.png {
            write_png_rgb8(&a.out.join(format!("{stem}.edges.png")), d.width as u32, d.height as u32, &colorize(&e))?;
        }
    }
    Ok(())
}

/// Runs `depth`.
pub fn run(a: Args) -> anyhow::Result<()> {
    anyhow::ensure!(a.batch >= 1, "--batch must be at least 1");
    let (device, dtype) = a.compute.resolve()?;
    let items = images_with_stems(&a.inputs)?;
    let est = DepthEstimator::load(&a.model, &device, dtype).with_context(|| format!("cannot load depth model {}", a.model.display()))?;
    ensure_dir(&a.out)?;
    let limits = ImageLimits::default();
    for chunk in items.chunks(a.batch) {
        let imgs = chunk.iter().map(|(p, _)| load_rgb(p, &limits)).collect::<Result<Vec<_>, _>>()?;
        let refs: Vec<&image::RgbImage> = imgs.iter().collect();
        let names = || chunk.iter().map(|(p, _)| p.display().to_string()).collect::<Vec<_>>().join(", ");
        let maps = est.predict(&refs, a.batch).with_context(|| format!("depth failed on {}", names()))?;
        for ((path, stem), d) in chunk.iter().zip(&maps) {
            write_outputs(&a, stem, d).with_context(|| format!("writing outputs of {}", path.display()))?;
        }
        eprintln!("depth: {}", names());
    }
    Ok(())
}
