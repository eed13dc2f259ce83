//! `--tile` / `--overlap` of `chm`, `depth` and `segment`: which inputs go through tiled inference
//! (`edgerun::tiling`) and running one. A tiled input is not decoded by the run loop; its one output,
//! a tiled GeoTIFF, is written where the other outputs would be written.
use std::time::{Duration, Instant};

use anyhow::Context;
use edgerun::imageio::{load_rgb, ImageLimits};
use edgerun::inputs::InputItem;
use edgerun::progress::{log, Mode};
use edgerun::tiling::{decide, tile_file, Output, TileModel, TileRequest, TilingOptions};
use image::RgbImage;

use super::common::UsageError;
use super::run_inputs::{output_path, RunSpec};

/// An input as the run loop holds it: decoded, or to be tiled with `(tile, overlap)`.
pub enum Loaded {
    /// Decoded whole.
    Image(RgbImage),
    /// Run in tiles.
    Tiled(usize, usize),
}

/// The request of `--tile` / `--overlap`, checked against the model's default `(tile, overlap)`.
pub fn request(tile: Option<usize>, overlap: Option<usize>, default: (usize, usize)) -> anyhow::Result<TileRequest> {
    let req = TileRequest { tile, overlap };
    req.validate(default).map_err(|e| UsageError(format!("--tile/--overlap: {}", e.to_string().trim_start_matches("input: "))))?;
    Ok(req)
}

/// Decodes `it`, or marks it for tiling when `req` says so.
pub fn load(it: &InputItem, req: TileRequest, default: (usize, usize), limits: &ImageLimits) -> anyhow::Result<Loaded> {
    Ok(match decide(&it.path, req, default, limits)? {
        Some((t, o)) => Loaded::Tiled(t, o),
        None => Loaded::Image(load_rgb(&it.path, limits)?),
    })
}

/// The bytes a loaded input takes in a pass: `activations(image)` plus the decoded image; `None`
/// for a tiled input (its tiles are planned apart) or a model without an estimate.
pub fn loaded_bytes(l: &Loaded, activations: impl Fn(&RgbImage) -> Option<u64>) -> Option<u64> {
    match l {
        Loaded::Image(img) => activations(img).map(|b| b + img.as_raw().len() as u64),
        Loaded::Tiled(..) => None,
    }
}

/// Runs `predict` on the decoded images of a batch; tiled inputs get `None`.
pub fn predict_images<P>(loaded: &[&Loaded], predict: impl FnOnce(&[&RgbImage]) -> anyhow::Result<Vec<P>>) -> anyhow::Result<Vec<Option<P>>> {
    let images: Vec<&RgbImage> = loaded.iter().filter_map(|l| if let Loaded::Image(i) = l { Some(i) } else { None }).collect();
    let mut out = if images.is_empty() { Vec::new() } else { predict(&images)? }.into_iter();
    loaded.iter().map(|l| Ok(if matches!(l, Loaded::Image(_)) { Some(out.next().context("no result for an image")?) } else { None })).collect()
}

/// Runs one input in `(tile, overlap)` tiles, as many per forward pass as `--batch` and the
/// model's estimate for one tile (`per_tile`) allow, into `OUT/<stem><suffix>`, logging progress every 10 s (unless `--progress none`) and a summary line.
#[allow(clippy::too_many_arguments)]
pub fn run(
    spec: &RunSpec,
    out: &std::path::Path,
    it: &InputItem,
    suffix: &str,
    model: &dyn TileModel,
    output: &Output,
    (tile, overlap): (usize, usize),
    per_tile: Option<u64>,
) -> anyhow::Result<()> {
    let command = spec.command;
    let dest = output_path(out, it, suffix)?;
    let opts = TilingOptions::new(tile, overlap);
    let mut runner = spec.runner();
    runner.plan(per_tile, usize::MAX, &mut |m| log(command, &m));
    let mut last = Instant::now();
    let name = it.path.display().to_string();
    let quiet = spec.progress == Mode::None;
    let mut progress = |done: usize, total: usize| {
        if !quiet && last.elapsed() >= Duration::from_secs(10) {
            last = Instant::now();
            log(command, &format!("{name}: {done}/{total} tiles"));
        }
    };
    let s = tile_file(&it.path, &dest, model, output, &opts, &ImageLimits::default(), &mut runner, &mut |m| log(command, &m), &mut progress)?;
    log(
        command,
        &format!(
            "{name}: {}×{} px in {} tiles of {tile} px (overlap {overlap}), {} stripe(s), {} forward passes, {:.1} s → {}{}",
            s.size.0,
            s.size.1,
            s.tiles,
            s.stripes,
            s.predicted,
            s.seconds,
            dest.display(),
            if s.bigtiff { " (BigTIFF)" } else { "" }
        ),
    );
    Ok(())
}
