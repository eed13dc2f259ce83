//! Inputs that `annotate` runs as tiled inference (a stage's `tile`, or a GeoTIFF too large to
//! decode whole): each (input, stage) is run by `edgerun::tiling` into one tiled GeoTIFF
//! `<stage>/<name>.tif`, through the stage's fallback chain, and journalled like any other output.
//! Edges are not computed from a tiled depth map: such an item's edges are recorded as failed with
//! the reason.
use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::time::{Duration, Instant};

use image::RgbImage;

use super::config::{Config, StageKind};
use super::journal::{Journal, Status};
use super::layout::{output_rel, OutputKind};
use super::summary::{Failure, StageSummary};
use super::scheduler::{record, ItemInfo};
use super::stages::{stage_runner, Devices, ModelChain};
use crate::error::Result;
use crate::imageio::ImageLimits;
use crate::tiling::{decide, tile_file, wants_tiles, TilingOptions};

/// One input's stage to run in tiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TiledWork {
    /// Index into the items.
    pub item: usize,
    /// The stage (edges: recorded as failed).
    pub stage: StageKind,
}

/// Whether `stage` runs `path` in tiles: its own `tile` / `overlap` for a model stage, the depth
/// stage's for edges (which follow their depth map). Unless a tile is set, only the header is read
/// (a large GeoTIFF, or any image beyond the limits, is tiled); an unreadable header means "not
/// tiled" (decoding then reports the file).
pub(crate) fn is_tiled(cfg: &Config, stage: StageKind, path: &Path, limits: &ImageLimits) -> bool {
    let req = cfg.tile_request(if stage == StageKind::Edges { StageKind::Depth } else { stage });
    match req.tile {
        Some(0) => false,
        Some(_) => true,
        None => wants_tiles(path, req, limits).unwrap_or(false),
    }
}

/// What the tiled runs did.
#[derive(Debug, Default)]
pub struct TiledOut {
    /// Per stage: done, failed, model seconds, outputs by model.
    pub stages: HashMap<StageKind, StageSummary>,
    /// Items with a failed tiled stage.
    pub failed_items: BTreeSet<usize>,
    /// Failures (input, stage, reason).
    pub failures: Vec<Failure>,
}

/// Everything a tiled run needs from `annotate`.
pub(crate) struct TiledRun<'a> {
    /// The configuration.
    pub cfg: &'a Config,
    /// The input root.
    pub input_root: &'a Path,
    /// The output root.
    pub output: &'a Path,
    /// All items of the list.
    pub items: &'a [ItemInfo],
    /// `K/N`.
    pub shard: &'a str,
    /// Log progress lines.
    pub verbose: bool,
}

/// Runs every `work` entry in list order, appending one record per entry to its stage's journal.
pub(crate) fn run_tiled(
    x: &TiledRun<'_>,
    work: &[TiledWork],
    chains: &mut [ModelChain],
    devices: &mut Devices,
    journals: &mut HashMap<StageKind, Journal>,
    log: &mut dyn FnMut(String),
) -> Result<TiledOut> {
    let mut out = TiledOut::default();
    let limits = x.cfg.image_limits();
    for w in work {
        let it = &x.items[w.item];
        let path = x.input_root.join(&it.file.rel);
        let rel = output_rel(w.stage, &it.stem, OutputKind::GeoTiff);
        let t0 = Instant::now();
        let result = match chains.iter_mut().find(|c| c.kind() == w.stage) {
            None if w.stage == StageKind::Edges => Err(format!(
                "edges are not computed from a tiled depth map ({}); run `edgerun edges` on a depth map that fits in memory",
                output_rel(StageKind::Depth, &it.stem, OutputKind::GeoTiff)
            )),
            None => Err(format!("no {} model is loaded", w.stage.name())),
            Some(chain) => {
                let dest = x.output.join(&rel);
                let name = it.file.rel.clone();
                let mut last = Instant::now();
                let verbose = x.verbose;
                let stage_name = w.stage.name();
                chain
                    .first_success(x.cfg, devices, &mut |m| log(m), |stage| {
                        let tiling = stage.tiling();
                        let (tile, overlap) = decide(&path, x.cfg.tile_request(w.stage), tiling.default, &limits)?.unwrap_or(tiling.default);
                        let per_tile = stage.activation_bytes(&RgbImage::new(tile as u32, tile as u32));
                        let mut note = |m: String| super::log(&format!("{stage_name}: {m}"));
                        let mut runner = stage_runner(x.cfg, stage, &mut note);
                        let batch = runner.plan(per_tile, usize::MAX, &mut note);
                        let opts = TilingOptions::new(tile, overlap);
                        let mut progress = |done: usize, total: usize| {
                            if verbose && last.elapsed() >= Duration::from_secs(10) {
                                last = Instant::now();
                                super::log(&format!("{stage_name}: {name}: {done}/{total} tiles"));
                            }
                        };
                        let s = tile_file(&path, &dest, tiling.model.as_ref(), &tiling.output, &opts, &limits, &mut runner, &mut note, &mut progress)?;
                        Ok(format!(
                            "{stage_name}: {name}: {}×{} px in {} tiles of {tile} px (overlap {overlap}, {batch} per pass), {:.1} s → {rel}",
                            s.size.0, s.size.1, s.tiles, s.seconds
                        ))
                    })
                    .map(|(line, m)| (line, chain.model_name(m).to_string()))
            }
        };
        let st = out.stages.entry(w.stage).or_default();
        st.model_s += t0.elapsed().as_secs_f64();
        let rec = match result {
            Ok((line, model)) => {
                if x.verbose {
                    log(line);
                }
                st.done += 1;
                *st.by_model.entry(model.clone()).or_default() += 1;
                record(x.items, x.shard, w.item, Status::Ok, Some(model), vec![rel], None)
            }
            Err(reason) => {
                st.failed += 1;
                out.failed_items.insert(w.item);
                out.failures.push(Failure { stage: w.stage.name().into(), input: it.file.rel.clone(), reason: reason.clone() });
                record(x.items, x.shard, w.item, Status::Failed, None, vec![], Some(reason))
            }
        };
        if let Some(j) = journals.get_mut(&w.stage) {
            j.append(&rec)?;
        }
    }
    for j in journals.values_mut() {
        j.sync()?;
    }
    Ok(out)
}
