//! `edgerun depth --model M [--batch N] [--tile PX --overlap PX] <images or dirs…> --out DIR`.
use std::path::PathBuf;

use anyhow::Context;
use argh::FromArgs;
use edgerun::edges::sobel_magnitude;
use edgerun::imageio::npy::write_npy_f32;
use edgerun::imageio::{colormap::colorize, write_npy_f16, write_png_gray8, write_png_rgb8, ImageLimits};
use edgerun::runner::BatchSetting;
use edgerun::inputs::{collect_inputs, InputItem, IMAGE_SUFFIXES};
use edgerun::models::da3::SKY_THRESHOLD;
use edgerun::tasks::depth::{DepthEstimator, DepthPrediction};
use edgerun::tasks::tiles::{depth_default, DepthTiles};
use edgerun::tiling::Output;

use super::common::{compute, usage};
use super::run_inputs::{create_out_dir, output_path, progress_mode, resolve_budget, run_items, state_file, RunSpec};
use super::tiled::{self, Loaded};

/// Monocular depth for images: `<stem>.depth.npy` (float16) and optional PNG, mirroring the input tree under --out.
#[derive(FromArgs, Debug)]
#[argh(subcommand, name = "depth")]
pub struct Args {
    /// depth model directory or `.gguf` (required)
    #[argh(option)]
    model: PathBuf,
    /// images or directories of images (searched recursively)
    #[argh(positional, arg_name = "INPUTS")]
    inputs: Vec<PathBuf>,
    /// output directory (required); a directory input's tree is mirrored under it
    #[argh(option)]
    out: PathBuf,
    /// images per forward pass: `auto` (default: planned from --mem-budget and the model's
    /// per-image estimate, halved when a pass runs out of memory) or a number from 1 to 256
    #[argh(option, default = "BatchSetting::Auto")]
    batch: BatchSetting,
    /// memory for activations in MiB (default: what the device can spare after loading the model,
    /// less 10 %)
    #[argh(option)]
    mem_budget: Option<u64>,
    /// also write colour-mapped `<stem>.depth.png`
    #[argh(switch)]
    png: bool,
    /// also write Sobel edges of the depth as `<stem>.edges.npy` (and `.edges.png` with --png)
    #[argh(switch)]
    edges: bool,
    /// focal length in pixels of the input images (DA3Metric: metric depth = focal·output/300, with
    /// the focal rescaled to the network input size; required for DA3Metric, ignored otherwise)
    #[argh(option)]
    focal: Option<f32>,
    /// tiled inference, tile side in pixels: 0 = off; default: the model's input size (518 DA-V2,
    /// 504 DA3) for GeoTIFFs over 4096 px per side and TIFFs over the image limits, which then get only
    /// `<stem>.depth.tif` (float32 tiled GeoTIFF; relative depth aligned across tiles)
    #[argh(option)]
    tile: Option<usize>,
    /// overlap between tiles in pixels (default 96, at most half the tile)
    #[argh(option)]
    overlap: Option<usize>,
    /// stop at the first input that fails (default: report it, go on, exit 2 at the end)
    #[argh(switch)]
    fail_fast: bool,
    /// progress display: auto (a bar on a terminal, else lines), bar, lines or none
    #[argh(option, default = "String::from(\"auto\")")]
    progress: String,
    /// device: cpu, cuda[:N], metal or auto (default auto)
    #[argh(option, default = "String::from(\"auto\")")]
    device: String,
    /// compute dtype: f32 (default), f16, bf16
    #[argh(option, default = "String::from(\"f32\")")]
    dtype: String,
}

/// Everything written for one image, computed before any file is written so that a failing item
/// leaves no partial set of outputs.
struct Outputs {
    prediction: DepthPrediction,
    edges: Option<Vec<f32>>,
}

fn compute_outputs(a: &Args, p: DepthPrediction) -> anyhow::Result<Outputs> {
    let d = &p.depth;
    let edges = if a.edges {
        let t = candle_core::Tensor::from_slice(&d.values, (1, 1, d.height, d.width), &candle_core::Device::Cpu)?;
        Some(sobel_magnitude(&t).context("edges of the depth map")?.flatten_all()?.to_vec1::<f32>()?)
    } else {
        None
    };
    Ok(Outputs { prediction: p, edges })
}

/// Writes the depth map (and optional visualisation / edges) of one image, plus `<stem>.conf.npy`
/// (DA3 any-view confidence, f32) and `<stem>.sky.png` (DA3Mono/Metric sky mask, 255 = sky).
fn write_outputs(a: &Args, item: &InputItem, o: &Outputs) -> anyhow::Result<()> {
    let p = &o.prediction;
    let d = &p.depth;
    let shape = [d.height, d.width];
    if let Some(c) = &p.confidence {
        write_npy_f32(&output_path(&a.out, item, ".conf.npy")?, &[c.height, c.width], &c.values)?;
    }
    if let Some(s) = &p.sky {
        let mask: Vec<u8> = s.values.iter().map(|v| if *v >= SKY_THRESHOLD { 255 } else { 0 }).collect();
        write_png_gray8(&output_path(&a.out, item, ".sky.png")?, s.width as u32, s.height as u32, &mask, &[])?;
    }
    write_npy_f16(&output_path(&a.out, item, ".depth.npy")?, &shape, &d.values)?;
    if a.png {
        write_png_rgb8(&output_path(&a.out, item, ".depth.png")?, d.width as u32, d.height as u32, &colorize(&d.values))?;
    }
    if let Some(e) = &o.edges {
        write_npy_f16(&output_path(&a.out, item, ".edges.npy")?, &shape, e)?;
        if a.png {
            write_png_rgb8(&output_path(&a.out, item, ".edges.png")?, d.width as u32, d.height as u32, &colorize(e))?;
        }
    }
    Ok(())
}

/// Runs `depth`.
pub fn run(a: Args) -> anyhow::Result<()> {
    usage(!a.inputs.is_empty(), || "depth: give at least one image or directory".into())?;
    let progress = progress_mode(&a.progress)?;
    let (device, dtype) = compute(&a.device, &a.dtype)?;
    let items = collect_inputs(&a.inputs, IMAGE_SUFFIXES, Some(&a.out))?;
    let est = DepthEstimator::load(&a.model, &device, dtype)
        .and_then(|e| e.with_focal(a.focal))
        .with_context(|| format!("cannot load depth model {}", a.model.display()))?;
    usage(!est.needs_focal() || a.focal.is_some(), || {
        format!("{} is a DA3Metric model: pass --focal <pixels> (the input images' focal length) to get metric depth", a.model.display())
    })?;
    let default = depth_default(&est);
    let req = tiled::request(a.tile, a.overlap, default)?;
    create_out_dir(&a.out)?;
    let budget = resolve_budget("depth", a.batch, a.mem_budget, &device)?;
    let state = Some(state_file(&a.out, "depth"));
    let spec = RunSpec { command: "depth", batch: a.batch, budget, device: device.clone(), fail_fast: a.fail_fast, progress, state };
    let limits = ImageLimits::default();
    run_items(
        &spec,
        &items,
        |it| tiled::load(it, req, default, &limits),
        |l| tiled::loaded_bytes(l, |img| est.activation_bytes(img)),
        |_, loaded| tiled::predict_images(loaded, |imgs| Ok(est.predict_all(imgs, imgs.len())?)),
        |it, loaded, p| match (loaded, p) {
            (Loaded::Image(_), Some(p)) => write_outputs(&a, it, &compute_outputs(&a, p)?),
            (Loaded::Tiled(t, o), _) => {
                let output = Output::Float { nodata: Some(f32::NAN) };
                let per_tile = est.activation_bytes(&image::RgbImage::new(*t as u32, *t as u32));
                tiled::run(&spec, &a.out, it, ".depth.tif", &DepthTiles { est: &est }, &output, (*t, *o), per_tile)
            }
            (Loaded::Image(_), None) => anyhow::bail!("no depth for an image (a bug)"),
        },
    )
}
