//! `edgerun segment --model M [--classes map.toml] [--palette] <images or dirs…> --out DIR`.
//!
//! Writes `<stem>.seg.png` (8-bit grayscale class ids, lossless; metadata `edgerun:classes` holds the
//! class names and, with `--classes`, the checkpoint labels each output class takes) and, with
//! `--palette`, `<stem>.seg.color.png`.
use std::path::PathBuf;

use anyhow::Context;
use edgerun::imageio::{write_png_gray8, write_png_rgb8};
use edgerun::models::segformer::{ClassMap, Segmenter};

use super::common::{ensure_dir, for_each_batch, images_with_stems, Compute};

/// Arguments of `segment`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// SegFormer model directory (config.json + model.safetensors [+ preprocessor_config.json]) or `.gguf`.
    #[arg(long)]
    model: PathBuf,
    /// Class map (TOML) from the checkpoint's labels (id2label names or ids) onto a project scheme.
    #[arg(long)]
    classes: Option<PathBuf>,
    /// Also write a palette visualisation `<stem>.seg.color.png`.
    #[arg(long)]
    palette: bool,
    /// Network input size HxW (default: preprocessor_config.json, else 512x512).
    #[arg(long, value_parser = parse_size)]
    size: Option<(usize, usize)>,
    /// Largest number of images per forward pass.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Images or directories of images.
    #[arg(required = true)]
    inputs: Vec<PathBuf>,
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
    #[command(flatten)]
    compute: Compute,
}

fn parse_size(s: &str) -> Result<(usize, usize), String> {
    let (h, w) = s.split_once(['x', 'X']).ok_or_else(|| format!("`{s}` is not HxW"))?;
    let p = |v: &str| v.trim().parse::<usize>().ok().filter(|&n| n > 0).ok_or_else(|| format!("`{s}` is not HxW"));
    Ok((p(h)?, p(w)?))
}

/// Runs `segment`.
pub fn run(a: Args) -> anyhow::Result<()> {
    let (device, dtype) = a.compute.resolve()?;
    let items = images_with_stems(&a.inputs)?;
    let mut seg = Segmenter::load(&a.model, &device, dtype).with_context(|| format!("cannot load model {}", a.model.display()))?;
    if let Some(s) = a.size {
        seg.set_input_size(Some(s));
    }
    let map = match &a.classes {
        Some(p) => ClassMap::load(p, seg.labels()).with_context(|| format!("cannot use class map {}", p.display()))?,
        None => ClassMap::identity(seg.labels()).with_context(|| format!("cannot write uint8 masks for {}", a.model.display()))?,
    };
    let meta = map.metadata_json();
    let model_name = a.model.display().to_string();
    ensure_dir(&a.out)?;
    for_each_batch("segment", &items, a.batch, |b| {
        let masks = seg.segment(&b.images).with_context(|| format!("segmentation failed on {}", b.names()))?;
        for (((path, stem), img), ids) in b.items.iter().zip(&b.images).zip(&masks) {
            let (w, h) = img.dimensions();
            let out = map.apply(ids)?;
            let text = [("Software", "edgerun segment"), ("edgerun:model", model_name.as_str()), ("edgerun:classes", meta.as_str())];
            write_png_gray8(&a.out.join(format!("{stem}.seg.png")), w, h, &out, &text)
                .with_context(|| format!("writing the mask of {}", path.display()))?;
            if a.palette {
                write_png_rgb8(&a.out.join(format!("{stem}.seg.color.png")), w, h, &map.colorize(&out))
                    .with_context(|| format!("writing the palette image of {}", path.display()))?;
            }
        }
        Ok(())
    })
}
