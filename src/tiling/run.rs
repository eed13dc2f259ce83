//! The tiled-inference driver. The raster is cut into column stripes of whole output blocks; each
//! stripe is processed top to bottom one tile row at a time: read the window under the tile row,
//! predict its tiles in batches, (relative depth) align them, then blend and write every output row
//! that no later tile row covers. Tiles straddling a stripe border are computed in both stripes
//! (identically; depth alignments are remembered per tile), which is what bounds memory by the
//! stripe instead of the raster width.
use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::rc::Rc;
use std::time::Instant;

use image::RgbImage;

use super::align::{add_overlap, apply, Fit, Placed as AlignPlaced};
use super::blend::{OutBand, Output, Placed, RowBlender};
use super::plan::{axis_weights, stripes, TilePlan};
use super::window_io::{open_raster, RasterSource, Rect};
use super::writer::TiledTiffWriter;
use super::{Combine, TileModel, TilingOptions};
use crate::error::{Error, Result};
use crate::geotiff::GeoReference;
use crate::imageio::ImageLimits;
use crate::runner::ItemRunner;

/// What a tiled run did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TiledStats {
    /// Raster `(width, height)`.
    pub size: (usize, usize),
    /// Tiles in the plan.
    pub tiles: usize,
    /// Forward passes of single tiles (more than `tiles` when stripes share tile columns).
    pub predicted: usize,
    /// Column stripes.
    pub stripes: usize,
    /// Whether the output is a BigTIFF.
    pub bigtiff: bool,
    /// Wall time in seconds.
    pub seconds: f64,
}

/// One tile row of a stripe, kept while later rows still overlap it.
struct TileRow {
    r: usize,
    tiles: Vec<(usize, Placed)>,
}

/// Runs `model` over `src` in tiles and writes `dest` (a tiled GeoTIFF carrying `geo`; GDAL_NODATA
/// when the source marks no-data). Each tile row runs through `runner` (its planned batch, halved
/// when a pass runs out of memory; `log` gets each change). `progress(done, total)` is called after
/// each tile row.
#[allow(clippy::too_many_arguments)]
pub fn run_tiled(
    src: &mut dyn RasterSource,
    model: &dyn TileModel,
    output: &Output,
    dest: &Path,
    geo: Option<&GeoReference>,
    opts: &TilingOptions,
    runner: &mut ItemRunner,
    log: &mut dyn FnMut(String),
    progress: &mut dyn FnMut(usize, usize),
) -> Result<TiledStats> {
    let start = Instant::now();
    let (width, height) = src.dimensions();
    let plan = TilePlan::new(width, height, opts.tile, opts.overlap)?;
    let channels = model.channels();
    match output {
        Output::Float { .. } if channels != 1 => return Err(Error::Input(format!("a float output needs one plane, the model gives {channels}"))),
        Output::Classes { lut, .. } if lut.len() != channels => {
            return Err(Error::Input(format!("the class map covers {} classes, the model gives {channels}", lut.len())))
        }
        _ => {}
    }
    let output = &output.resolved(geo.and_then(|g| g.nodata()));
    let nodata = src.has_mask().then(|| output.nodata_text());
    let mut writer = TiledTiffWriter::create(dest, width, height, output.kind(), geo, nodata.as_deref(), opts.writer)?;
    if let Output::Classes { description: Some(d), .. } = output {
        writer.set_description(d);
    }
    let block = writer.block();
    let stripe_list = stripes(width, opts.max_stripe, block);
    let total: usize = stripe_list.iter().map(|&(a, b)| plan.columns_touching(a, b).len() * plan.ys.len()).sum();
    let mut stats = TiledStats { size: (width, height), tiles: plan.len(), stripes: stripe_list.len(), bigtiff: writer.is_bigtiff(), ..Default::default() };
    let mut aligned: HashMap<(usize, usize), (f32, f32)> = HashMap::new();
    let wy: Vec<Rc<[f32]>> = (0..plan.ys.len()).map(|r| axis_weights(&plan.ys, plan.tile_h, r).into()).collect();
    let label = src.path().display().to_string();
    for &(x0, x1) in &stripe_list {
        let cols = plan.columns_touching(x0, x1);
        let wx: Vec<Rc<[f32]>> = cols.clone().map(|c| axis_weights(&plan.xs, plan.tile_w, c).into()).collect();
        let win_x = plan.xs[cols.start];
        let win_w = plan.xs[cols.end - 1] + plan.tile_w - win_x;
        let mut alive: VecDeque<TileRow> = VecDeque::new();
        let mut blender = RowBlender::new(x0, x1, channels);
        let mut band = OutBand::new(x0, x1, output.kind(), block);
        let mut row_bytes = Vec::new();
        let mut emitted = 0;
        for (r, &y) in plan.ys.iter().enumerate() {
            let window = src.read_window(Rect { x: win_x, y, w: win_w, h: plan.tile_h })?;
            let row_cols: Vec<usize> = cols.clone().collect();
            let misfit = || Error::Input(format!("{label}: the model returned maps that do not fit the {}×{} tiles", plan.tile_w, plan.tile_h));
            let results = runner.batch().run(&row_cols, model.device(), |_, _| misfit(), log, |chunk| {
                let crops: Vec<RgbImage> = chunk
                    .iter()
                    .map(|&c| image::imageops::crop_imm(&window.rgb, (plan.xs[c] - win_x) as u32, 0, plan.tile_w as u32, plan.tile_h as u32).to_image())
                    .collect();
                let refs: Vec<&RgbImage> = crops.iter().collect();
                let labels: Vec<String> = chunk.iter().map(|&c| format!("{label} (tile at x {}, y {y})", plan.xs[c])).collect();
                let out = model.predict(&refs, &labels)?;
                if out.iter().any(|m| m.size() != (plan.tile_h, plan.tile_w) || m.channels() != channels) {
                    return Err(misfit());
                }
                Ok(out)
            });
            let maps = results.into_iter().collect::<Result<Vec<_>>>()?;
            stats.predicted += row_cols.len();
            progress(stats.predicted, total);
            let mut row = TileRow { r, tiles: Vec::with_capacity(maps.len()) };
            for (k, (c, mut map)) in cols.clone().zip(maps).enumerate() {
                if model.combine() == Combine::ScaleShift {
                    let ab = match aligned.get(&(r, c)) {
                        Some(&ab) => ab,
                        None => {
                            let ab = fit_to_neighbours(&map, &plan, r, c, &alive, &row.tiles);
                            aligned.insert((r, c), ab);
                            ab
                        }
                    };
                    let plane = map.plane_mut().ok_or_else(|| Error::Input("depth alignment needs one-plane tile maps".into()))?;
                    apply(plane, ab);
                }
                let placed = Placed {
                    map,
                    rows: y..y + plan.tile_h,
                    cols: plan.xs[c]..plan.xs[c] + plan.tile_w,
                    wx: wx[k].clone(),
                    wy: wy[r].clone(),
                    taps: Vec::new(),
                };
                row.tiles.push((c, placed));
            }
            alive.push_back(row);
            let end = plan.rows_final_after(r);
            for yy in emitted..end {
                blender.blend(yy, alive.iter_mut().flat_map(|t| t.tiles.iter_mut().map(|(_, p)| p)));
                let mask = window.nodata.as_ref().map(|m| &m[(yy - y) * win_w + (x0 - win_x)..(yy - y) * win_w + (x1 - win_x)]);
                blender.finish_row(output, mask, &mut row_bytes)?;
                band.push(&row_bytes);
            }
            emitted = end;
            band.flush(&mut writer, end == height)?;
            alive.retain(|t| plan.ys[t.r] + plan.tile_h > end);
        }
    }
    writer.finish()?;
    stats.seconds = start.elapsed().as_secs_f64();
    Ok(stats)
}

/// The scale and shift bringing tile `(r, c)` to the already-aligned tiles it overlaps: alive tiles
/// of earlier rows and the tiles to its left in its own row.
fn fit_to_neighbours(map: &super::TileMap, plan: &TilePlan, r: usize, c: usize, alive: &VecDeque<TileRow>, left: &[(usize, Placed)]) -> (f32, f32) {
    let Some(values) = map.plane() else { return (1.0, 0.0) };
    let me = AlignPlaced { values, rows: plan.ys[r]..plan.ys[r] + plan.tile_h, cols: plan.xs[c]..plan.xs[c] + plan.tile_w };
    let mut fit = Fit::default();
    for (_, n) in alive.iter().flat_map(|t| t.tiles.iter()).chain(left.iter()) {
        if let Some(nv) = n.map.plane() {
            add_overlap(&mut fit, &me, &AlignPlaced { values: nv, rows: n.rows.clone(), cols: n.cols.clone() });
        }
    }
    fit.solve()
}

/// Tiles the raster at `input` into `dest`: opens it for windowed reading (a TIFF; other formats
/// decoded whole within `limits`), carries its georeferencing over, and marks no-data pixels.
/// `runner`, `log` and `progress` as [`run_tiled`].
#[allow(clippy::too_many_arguments)]
pub fn tile_file(
    input: &Path,
    dest: &Path,
    model: &dyn TileModel,
    output: &Output,
    opts: &TilingOptions,
    limits: &ImageLimits,
    runner: &mut ItemRunner,
    log: &mut dyn FnMut(String),
    progress: &mut dyn FnMut(usize, usize),
) -> Result<TiledStats> {
    let geo = GeoReference::read(input)?;
    let mut src = open_raster(input, limits, geo.as_ref().and_then(|g| g.nodata()))?;
    run_tiled(src.as_mut(), model, output, dest, geo.as_ref(), opts, runner, log, progress)
}
