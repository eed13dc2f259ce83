//! Tiled inference: one tile equals the untiled prediction (canopy height, depth, segmentation),
//! blending leaves no seams (a stand-in model with per-tile offsets; relative depth with per-tile
//! scale and shift; the tiny CHMv2), stripes do not change the result, georeferencing and no-data
//! survive.
mod common;

use std::path::Path;

use candle_core::{DType, Device};
use common::fixture;
use edgerun::geotiff::{read_f32, GeoReference};
use edgerun::models::chmv2::Precision;
use edgerun::tasks::segment::{ClassMap, Segmenter};
use edgerun::tasks::chm::ChmEstimator;
use edgerun::models::depth_anything::DptProcessor;
use edgerun::models::processor::Size;
use edgerun::tasks::depth::DepthEstimator;
use edgerun::tasks::tiles::{ChmTiles, DepthTiles, SegTiles};
use edgerun::tiling::{run_tiled, tile_file, Combine, MemoryRaster, Output, TileMap, TileModel, TilePlan, TilingOptions};
use edgerun::runner::ItemRunner;
use edgerun::Result;
use image::RgbImage;

fn smooth(w: u32, h: u32) -> RgbImage {
    RgbImage::from_fn(w, h, |x, y| {
        let r = (x as f32 * 255.0 / (w - 1) as f32).round() as u8;
        let g = (y as f32 * 255.0 / (h - 1) as f32).round() as u8;
        image::Rgb([r, g, 100])
    })
}

fn noise(w: u32, h: u32) -> RgbImage {
    let mut s = 12345u32;
    RgbImage::from_fn(w, h, |_, _| {
        let mut px = [0u8; 3];
        for p in &mut px {
            s = s.wrapping_mul(1664525).wrapping_add(1013904223);
            *p = (s >> 24) as u8;
        }
        image::Rgb(px)
    })
}

fn chm() -> ChmEstimator {
    ChmEstimator::load(&fixture("chmv2_tiny"), &Device::Cpu, Precision { backbone: DType::F32, head: DType::F32 }).unwrap()
}

/// Runs `model` tiled over an in-memory `img` and reads the float output back.
fn tiled_f32(img: &RgbImage, model: &dyn TileModel, opts: &TilingOptions, dir: &Path) -> Vec<f32> {
    tiled_f32_batched(img, model, opts, dir, 1)
}

/// [`tiled_f32`] with `batch` tiles per forward pass.
fn tiled_f32_batched(img: &RgbImage, model: &dyn TileModel, opts: &TilingOptions, dir: &Path, batch: usize) -> Vec<f32> {
    let dest = dir.join("out.tif");
    let mut src = MemoryRaster { path: "mem.png".into(), image: img.clone() };
    run_tiled(&mut src, model, &Output::Float { nodata: None }, &dest, None, opts, &mut ItemRunner::fixed(batch), &mut |_| {}, &mut |_, _| {}).unwrap();
    let (w, h, v) = read_f32(&dest).unwrap();
    assert_eq!((w, h), img.dimensions());
    v
}

fn read_u8(p: &Path) -> Vec<u8> {
    let mut d = tiff::decoder::Decoder::new(std::fs::File::open(p).unwrap()).unwrap();
    match d.read_image().unwrap() {
        tiff::decoder::DecodingResult::U8(v) => v,
        _ => panic!("not uint8"),
    }
}

#[test]
fn one_tile_equals_untiled_chm_depth_and_segmentation() {
    let dir = tempfile::tempdir().unwrap();
    let img = noise(50, 37);
    let opts = TilingOptions::new(64, 16);

    let est = chm();
    let want = est.predict(&[&img], &["x".into()], 1).unwrap().remove(0).values;
    let got = tiled_f32(&img, &ChmTiles { est: &est }, &opts, dir.path());
    assert_eq!(got, want, "canopy height");

    let pre = DptProcessor { size: Size { height: 70, width: 70 }, ..Default::default() };
    let depth = DepthEstimator::load(&fixture("da2_relative_p14"), &Device::Cpu, DType::F32).unwrap().with_processor(std::sync::Arc::new(pre));
    let want = depth.predict(&[&img], 1).unwrap().remove(0).values;
    let got = tiled_f32(&img, &DepthTiles { est: &depth }, &opts, dir.path());
    assert_eq!(got, want, "depth");

    let mut seg = Segmenter::load(&fixture("segformer_tiny"), &Device::Cpu, DType::F32).unwrap();
    seg.set_input_size(Some((64, 64)));
    let map = ClassMap::identity(seg.labels()).unwrap();
    let want = map.apply(&seg.segment(&[&img]).unwrap()[0]).unwrap();
    let dest = dir.path().join("seg.tif");
    let mut src = MemoryRaster { path: "mem.png".into(), image: img.clone() };
    run_tiled(&mut src, &SegTiles { seg: &seg }, &Output::Classes { lut: map.lut.clone(), description: None, floor: None }, &dest, None, &opts, &mut ItemRunner::fixed(1), &mut |_| {}, &mut |_, _| {}).unwrap();
    assert_eq!(read_u8(&dest), want, "segmentation");
}

/// A smooth stand-in: `a · f(pixel) + b` with `f = (R + G) / 25.5 + 1` and `(a, b)` set by the
/// tile's top-left pixel, as a model whose output level differs from tile to tile.
struct StandIn {
    combine: Combine,
    scale: bool,
}

fn f(px: [u8; 3]) -> f32 {
    (px[0] as f32 + px[1] as f32) / 25.5 + 1.0
}

impl TileModel for StandIn {
    fn channels(&self) -> usize {
        1
    }
    fn combine(&self) -> Combine {
        self.combine
    }
    fn predict(&self, tiles: &[&RgbImage], _: &[String]) -> Result<Vec<TileMap>> {
        tiles
            .iter()
            .map(|t| {
                let p0 = t.get_pixel(0, 0).0;
                let a = if self.scale { 1.0 + p0[0] as f32 / 255.0 } else { 1.0 };
                let b = (p0[0] as f32 + p0[1] as f32) * 0.05;
                TileMap::dense(t.height() as usize, t.width() as usize, t.pixels().map(|p| a * f(p.0) + b).collect())
            })
            .collect()
    }
}

/// Largest absolute difference between horizontally or vertically adjacent pixels.
fn max_jump(v: &[f32], w: usize) -> f32 {
    let h = v.len() / w;
    let mut m = 0f32;
    for y in 0..h {
        for x in 0..w {
            if x + 1 < w {
                m = m.max((v[y * w + x + 1] - v[y * w + x]).abs());
            }
            if y + 1 < h {
                m = m.max((v[(y + 1) * w + x] - v[y * w + x]).abs());
            }
        }
    }
    m
}

#[test]
fn per_tile_offsets_blend_without_seams() {
    let dir = tempfile::tempdir().unwrap();
    let (w, h) = (300u32, 200u32);
    let img = smooth(w, h);
    let (tile, ov) = (64, 16);
    let plan = TilePlan::new(w as usize, h as usize, tile, ov).unwrap();
    let got = tiled_f32(&img, &StandIn { combine: Combine::Direct, scale: false }, &TilingOptions::new(tile, ov), dir.path());
    // The offsets of neighbouring tiles differ by up to `db`: a hard cut would jump by that much.
    let bias = |x: usize, y: usize| f([img.get_pixel(x as u32, y as u32).0[0], img.get_pixel(x as u32, y as u32).0[1], 0]) - 1.0;
    let mut db = 0f32;
    for (i, &x) in plan.xs.iter().enumerate().skip(1) {
        db = db.max((bias(x, 0) - bias(plan.xs[i - 1], 0)).abs() * 25.5 * 0.05);
    }
    let smooth_step = max_jump(&img.pixels().map(|p| f(p.0)).collect::<Vec<_>>(), w as usize);
    let jump = max_jump(&got, w as usize);
    // Raised-cosine ramps over ≥ ov pixels: the offset step is spread at most π/(2·ov) per pixel.
    let bound = db * std::f32::consts::PI / (2.0 * ov as f32) + 2.0 * smooth_step;
    eprintln!("offset step {db}, smooth step {smooth_step}, max jump {jump}, bound {bound}");
    assert!(db > 1.0, "the stand-in has real per-tile offsets ({db})");
    assert!(jump <= bound, "max jump {jump} > {bound}");
    assert!(jump < db / 4.0);
}

#[test]
fn relative_depth_tiles_are_brought_to_one_scale() {
    let dir = tempfile::tempdir().unwrap();
    let (w, h) = (300u32, 200u32);
    let img = smooth(w, h);
    let truth: Vec<f32> = img.pixels().map(|p| f(p.0)).collect();
    for stripe in [4096, 96] {
        let mut opts = TilingOptions::new(64, 16);
        opts.max_stripe = stripe;
        opts.writer.block = 32;
        let got = tiled_f32(&img, &StandIn { combine: Combine::ScaleShift, scale: true }, &opts, dir.path());
        // Tile (0, 0) has a = 1, b = 0: every tile is brought to f itself.
        let err = got.iter().zip(&truth).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(err < 1e-3, "stripe {stripe}: max error {err}");
    }
}

#[test]
fn tiny_chmv2_shows_no_seam_and_stripes_do_not_change_the_result() {
    let dir = tempfile::tempdir().unwrap();
    let (w, h) = (200usize, 150usize);
    let img = smooth(w as u32, h as u32);
    let est = chm();
    let model = ChmTiles { est: &est };
    let (tile, ov) = (64, 16);
    let mut opts = TilingOptions::new(tile, ov);
    let one = tiled_f32(&img, &model, &opts, dir.path());
    opts.max_stripe = 64;
    opts.writer.block = 32;
    let striped = tiled_f32(&img, &model, &opts, dir.path());
    assert_eq!(one, striped, "stripes recompute shared tiles identically");
    // Batches of two group different tiles in different stripes: equal up to float rounding.
    let batched = tiled_f32_batched(&img, &model, &opts, dir.path(), 2);
    let diff = one.iter().zip(&batched).map(|(a, b)| (a - b).abs() / b.abs().max(1.0)).fold(0f32, f32::max);
    assert!(diff < 1e-3, "batched: max relative difference {diff}");
    // Jumps across the edges of tiles (where an unblended mosaic would have seams) against the
    // jumps inside tiles.
    let plan = TilePlan::new(w, h, tile, ov).unwrap();
    let edges: Vec<usize> = plan.xs.iter().flat_map(|&x| [x, x + tile]).filter(|&x| x > 0 && x < w).collect();
    let (mut at_edges, mut inside) = (0f32, 0f32);
    for y in 0..h {
        for x in 1..w {
            let d = (one[y * w + x] - one[y * w + x - 1]).abs();
            if edges.contains(&x) {
                at_edges = at_edges.max(d);
            } else {
                inside = inside.max(d);
            }
        }
    }
    // An unblended mosaic: each pixel from the tile whose centre is nearest.
    let maps = est.predict(&plan.xs.iter().map(|&x| image::imageops::crop_imm(&img, x as u32, 0, tile as u32, tile as u32).to_image()).collect::<Vec<_>>().iter().collect::<Vec<_>>(), &vec![String::new(); plan.xs.len()], 1).unwrap();
    let hard: Vec<f32> = (0..w)
        .map(|x| {
            let i = (0..plan.xs.len()).min_by_key(|&i| (plan.xs[i] + tile / 2).abs_diff(x)).unwrap();
            maps[i].values[10 * tile + x - plan.xs[i]]
        })
        .collect();
    let hard_jump = hard.windows(2).map(|p| (p[1] - p[0]).abs()).fold(0f32, f32::max);
    eprintln!("max jump at tile edges {at_edges}, inside tiles {inside}, unblended mosaic row {hard_jump}");
    assert!(at_edges <= inside, "jump at tile edges {at_edges} > inside {inside}");
}

#[test]
fn georeferencing_and_nodata_survive_tiling() {
    let dir = tempfile::tempdir().unwrap();
    let src = fixture("chmv2_geotiff").join("scene.tif");
    let geo = GeoReference::read(&src).unwrap().unwrap();
    let est = chm();
    let dest = dir.path().join("scene.chm.tif");
    let opts = TilingOptions::new(32, 8);
    let stats = tile_file(&src, &dest, &ChmTiles { est: &est }, &Output::Float { nodata: None }, &opts, &Default::default(), &mut ItemRunner::fixed(1), &mut |_| {}, &mut |_, _| {}).unwrap();
    assert_eq!(stats.tiles, 2 * 2);
    let back = GeoReference::read(&dest).unwrap().unwrap();
    assert_eq!(back.tags, geo.tags, "every georeferencing tag, GDAL_NODATA \"0\" included");
    let (w, h, v) = read_f32(&dest).unwrap();
    assert_eq!((w, h), (50, 37));
    // The source is 0 in every band in its top-left 3×4 corner and its left 6 columns.
    let at = |y: usize, x: usize| v[y * 50 + x];
    assert_eq!((at(0, 0), at(2, 3), at(20, 5)), (0.0, 0.0, 0.0));
    assert!(at(0, 4) > 0.0 && at(20, 6) > 0.0 && at(20, 25) > 0.0);

    // Segmentation: no-data pixels get the ignore id 255, and GDAL_NODATA says so.
    let mut seg = Segmenter::load(&fixture("segformer_tiny"), &Device::Cpu, DType::F32).unwrap();
    seg.set_input_size(Some((32, 32)));
    let map = ClassMap::identity(seg.labels()).unwrap();
    let dest = dir.path().join("scene.seg.tif");
    tile_file(&src, &dest, &SegTiles { seg: &seg }, &Output::Classes { lut: map.lut.clone(), description: None, floor: None }, &opts, &Default::default(), &mut ItemRunner::fixed(1), &mut |_| {}, &mut |_, _| {}).unwrap();
    let back = GeoReference::read(&dest).unwrap().unwrap();
    assert_eq!(back.nodata_text().as_deref(), Some("255"));
    assert_eq!(back.pixel_scale(), geo.pixel_scale());
    let ids = read_u8(&dest);
    assert_eq!((ids[0], ids[20 * 50 + 5]), (255, 255));
    assert!(ids[20 * 50 + 25] < 255);
}
