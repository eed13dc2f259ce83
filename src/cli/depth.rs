//! `edgerun depth --model M [--batch N] <images or dirs…> --out DIR`.
use std::path::PathBuf;

use anyhow::Context;
use edgerun::edges::sobel_magnitude;
use edgerun::imageio::npy::write_npy_f32;
use edgerun::imageio::{colormap::colorize, write_npy_f16, write_png_gray8, write_png_rgb8};
use edgerun::models::da3::SKY_THRESHOLD;
use edgerun::tasks::depth::{DepthEstimator, DepthPrediction};

use super::common::{ensure_dir, for_each_batch, images_with_stems, Compute};

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
    /// Focal length in pixels of the input images (DA3Metric: metric depth = focal·output/300, with
    /// the focal rescaled to the network input size; required for DA3Metric, ignored otherwise).
    #[arg(long)]
    focal: Option<f32>,
    #[command(flatten)]
    compute: Compute,
}

/// Writes the depth map (and optional visualisation / edges) of one image, plus `<stem>.conf.npy`
/// (DA3 any-view confidence, f32) and `<stem>.sky.png` (DA3Mono/Metric sky mask, 255 = sky).
fn write_outputs(a: &Args, stem: &str, p: &DepthPrediction) -> anyhow::Result<()> {
    let d = &p.depth;
    let shape = [d.height, d.width];
    if let Some(c) = &p.confidence {
        write_npy_f32(&a.out.join(format!("{stem}.conf.npy")), &[c.height, c.width], &c.values)?;
    }
    if let Some(s) = &p.sky {
        let mask: Vec<u8> = s.values.iter().map(|v| if *v >= SKY_THRESHOLD { 255 } else { 0 }).collect();
        write_png_gray8(&a.out.join(format!("{stem}.sky.png")), s.width as u32, s.height as u32, &mask, &[])?;
    }
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
    let (device, dtype) = a.compute.resolve()?;
    let items = images_with_stems(&a.inputs)?;
    let est = DepthEstimator::load(&a.model, &device, dtype)
        .and_then(|e| e.with_focal(a.focal))
        .with_context(|| format!("cannot load depth model {}", a.model.display()))?;
    ensure_dir(&a.out)?;
    for_each_batch("depth", &items, a.batch, |b| {
        let maps = est.predict_all(&b.images, a.batch).with_context(|| format!("depth failed on {}", b.names()))?;
        for ((path, stem), d) in b.items.iter().zip(&maps) {
            write_outputs(&a, stem, d).with_context(|| format!("writing outputs of {}", path.display()))?;
        }
        Ok(())
    })
}
