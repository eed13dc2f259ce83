//! `edgerun chm --model M [--batch N] <images or dirs…> --out DIR`: canopy height (CHMv2).
use std::path::{Path, PathBuf};

use anyhow::Context;
use edgerun::device::parse_dtype;
use edgerun::geotiff::{write_f32, GeoReference};
use edgerun::imageio::write_npy_f16;
use edgerun::models::chmv2::Precision;
use edgerun::tasks::chm::{precision_name, ChmEstimator, HeightMap};
use image::RgbImage;

use super::common::{ensure_dir, for_each_batch, images_with_stems, Compute};

/// Arguments of `chm`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// CHMv2 model directory (config.json + model.safetensors, e.g. facebook/dinov3-vitl16-chmv2-dpt-head) or `.gguf`.
    #[arg(long)]
    model: PathBuf,
    /// Images or directories of images (GeoTIFF inputs also get a georeferenced `<stem>.chm.tif`).
    #[arg(required = true)]
    inputs: Vec<PathBuf>,
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
    /// Largest number of images per forward pass (images of equal padded size are batched).
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Compute dtype of the DPT head when it should differ from --dtype (e.g. `--dtype f16 --head-dtype f32`).
    #[arg(long)]
    head_dtype: Option<String>,
    /// Do not write `<stem>.chm.tif` for GeoTIFF inputs.
    #[arg(long)]
    no_geotiff: bool,
    #[command(flatten)]
    compute: Compute,
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

fn write_outputs(a: &Args, path: &Path, stem: &str, img: &RgbImage, m: &HeightMap, geo: Option<&GeoReference>) -> anyhow::Result<()> {
    write_npy_f16(&a.out.join(format!("{stem}.chm.npy")), &[m.height, m.width], &m.values)?;
    if let Some(g) = geo {
        let tif = a.out.join(format!("{stem}.chm.tif"));
        write_f32(&tif, m.width as u32, m.height as u32, &masked(&m.values, img, g), Some(g))
            .with_context(|| format!("writing {} (georeferenced like {})", tif.display(), path.display()))?;
    }
    Ok(())
}

/// Runs `chm`.
pub fn run(a: Args) -> anyhow::Result<()> {
    let (device, dtype) = a.compute.resolve()?;
    let head = match &a.head_dtype {
        Some(s) => parse_dtype(s)?,
        None => dtype,
    };
    let precision = Precision { backbone: dtype, head };
    let items = images_with_stems(&a.inputs)?;
    let est = ChmEstimator::load(&a.model, &device, precision).with_context(|| format!("cannot load CHMv2 model {}", a.model.display()))?;
    ensure_dir(&a.out)?;
    for_each_batch("chm", &items, a.batch, |b| {
        let geos = b
            .items
            .iter()
            .map(|(p, _)| if a.no_geotiff { Ok(None) } else { GeoReference::read(p) })
            .collect::<Result<Vec<_>, _>>()?;
        let labels: Vec<String> = b.items.iter().map(|(p, _)| p.display().to_string()).collect();
        let maps = est.predict(&b.images, &labels, a.batch).with_context(|| format!("canopy height failed ({})", precision_name(precision)))?;
        for ((((path, stem), m), img), geo) in b.items.iter().zip(&maps).zip(&b.images).zip(&geos) {
            write_outputs(&a, path, stem, img, m, geo.as_ref()).with_context(|| format!("writing outputs of {}", path.display()))?;
        }
        Ok(())
    })
}
