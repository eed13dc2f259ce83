//! `edgerun chm --model M [--batch N] [--tile PX --overlap PX] <images or dirs…> --out DIR`: canopy height (CHMv2).
use std::path::PathBuf;

use anyhow::Context;
use argh::FromArgs;
use edgerun::device::parse_dtype;
use edgerun::geotiff::{write_f32, GeoReference};
use edgerun::imageio::{write_npy_f16, ImageLimits};
use edgerun::runner::BatchSetting;
use edgerun::inputs::{collect_inputs, InputItem, IMAGE_SUFFIXES};
use edgerun::models::chmv2::Precision;
use edgerun::tasks::chm::{precision_name, ChmEstimator, HeightMap};
use edgerun::tasks::tiles::{ChmTiles, CHM_DEFAULT};
use edgerun::tiling::Output;
use image::RgbImage;

use super::common::{compute, usage};
use super::run_inputs::{create_out_dir, output_path, progress_mode, resolve_budget, run_items, state_file, RunSpec};
use super::tiled::{self, Loaded};

/// Canopy height (CHMv2) in metres: `<stem>.chm.npy` (float16) and, for GeoTIFF input, a georeferenced float32 `<stem>.chm.tif`.
#[derive(FromArgs, Debug)]
#[argh(subcommand, name = "chm")]
pub struct Args {
    /// CHMv2 model directory (config.json + model.safetensors, e.g. facebook/dinov3-vitl16-chmv2-dpt-head) or `.gguf` (required)
    #[argh(option)]
    model: PathBuf,
    /// images or directories of images (GeoTIFF inputs also get a georeferenced `<stem>.chm.tif`)
    #[argh(positional, arg_name = "INPUTS")]
    inputs: Vec<PathBuf>,
    /// output directory (required); a directory input's tree is mirrored under it
    #[argh(option)]
    out: PathBuf,
    /// images per forward pass: `auto` (default: planned from --mem-budget and the model's
    /// per-image estimate, halved when a pass runs out of memory) or a number from 1 to 256 (images of equal padded size are batched)
    #[argh(option, default = "BatchSetting::Auto")]
    batch: BatchSetting,
    /// memory for activations in MiB (default: what the device can spare after loading the model,
    /// less 10 %)
    #[argh(option)]
    mem_budget: Option<u64>,
    /// compute dtype of the DPT head when it should differ from --dtype (e.g. `--dtype f16 --head-dtype f32`)
    #[argh(option)]
    head_dtype: Option<String>,
    /// do not write `<stem>.chm.tif` for GeoTIFF inputs (tiled inputs always get it: it is their only output)
    #[argh(switch)]
    no_geotiff: bool,
    /// tiled inference, tile side in pixels: 0 = off; default: 416-px tiles for GeoTIFFs over 4096 px per
    /// side and TIFFs over the image limits, which then get only `<stem>.chm.tif` (tiled GeoTIFF)
    #[argh(option)]
    tile: Option<usize>,
    /// overlap between tiles in pixels (default 64, at most half the tile)
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

/// The heights for the GeoTIFF: pixels whose source is `nodata` in every band become `nodata`
/// (8-bit sources with an integral nodata in 0..=255 only).
fn masked(values: &[f32], img: &RgbImage, geo: &GeoReference) -> Vec<f32> {
    let mut out = values.to_vec();
    let Some(nd) = geo.nodata() else { return out };
    if geo.bits_per_sample != 8 || nd.fract() != 0.0 || !(0.0..=255.0).contains(&nd) {
        return out;
    }
    let v = nd as u8;
    for (o, px) in out.iter_mut().zip(img.pixels()) {
        if px.0 == [v, v, v] {
            *o = nd as f32;
        }
    }
    out
}

fn write_outputs(a: &Args, item: &InputItem, img: &RgbImage, m: &HeightMap) -> anyhow::Result<()> {
    // The georeference is read (and checked) before anything is written.
    let geo = if a.no_geotiff { None } else { GeoReference::read(&item.path)? };
    write_npy_f16(&output_path(&a.out, item, ".chm.npy")?, &[m.height, m.width], &m.values)?;
    if let Some(g) = &geo {
        let tif = output_path(&a.out, item, ".chm.tif")?;
        write_f32(&tif, m.width as u32, m.height as u32, &masked(&m.values, img, g), Some(g))
            .with_context(|| format!("writing {} (georeferenced like {})", tif.display(), item.path.display()))?;
    }
    Ok(())
}

/// Runs `chm`.
pub fn run(a: Args) -> anyhow::Result<()> {
    usage(!a.inputs.is_empty(), || "chm: give at least one image or directory".into())?;
    let progress = progress_mode(&a.progress)?;
    let (device, dtype) = compute(&a.device, &a.dtype)?;
    let head = match &a.head_dtype {
        Some(s) => parse_dtype(s)?,
        None => dtype,
    };
    let precision = Precision { backbone: dtype, head };
    let req = tiled::request(a.tile, a.overlap, CHM_DEFAULT)?;
    let items = collect_inputs(&a.inputs, IMAGE_SUFFIXES, Some(&a.out))?;
    let est = ChmEstimator::load(&a.model, &device, precision).with_context(|| format!("cannot load CHMv2 model {}", a.model.display()))?;
    create_out_dir(&a.out)?;
    let budget = resolve_budget("chm", a.batch, a.mem_budget, &device)?;
    let state = Some(state_file(&a.out, "chm"));
    let spec = RunSpec { command: "chm", batch: a.batch, budget, device: device.clone(), fail_fast: a.fail_fast, progress, state };
    let limits = ImageLimits::default();
    run_items(
        &spec,
        &items,
        |it| tiled::load(it, req, CHM_DEFAULT, &limits),
        |l| tiled::loaded_bytes(l, |img| est.activation_bytes(img)),
        |its, loaded| {
            let labels: Vec<String> = its.iter().zip(loaded).filter(|(_, l)| matches!(l, Loaded::Image(_))).map(|(it, _)| it.path.display().to_string()).collect();
            tiled::predict_images(loaded, |imgs| {
                est.predict(imgs, &labels, imgs.len()).with_context(|| format!("canopy height failed ({})", precision_name(precision)))
            })
        },
        |it, loaded, m| match (loaded, m) {
            (Loaded::Image(img), Some(m)) => write_outputs(&a, it, img, &m),
            (Loaded::Tiled(t, o), _) => {
                let per_tile = est.activation_bytes(&RgbImage::new(*t as u32, *t as u32));
                // Heights where the source is no-data get its GDAL_NODATA value, as untiled.
                let output = Output::Float { nodata: None };
                tiled::run(&spec, &a.out, it, ".chm.tif", &ChmTiles { est: &est }, &output, (*t, *o), per_tile)
                    .with_context(|| format!("tiled canopy height failed ({})", precision_name(precision)))
            }
            (Loaded::Image(_), None) => anyhow::bail!("no canopy height for an image (a bug)"),
        },
    )
}
