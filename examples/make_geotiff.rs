//! Writes a synthetic georeferenced RGB GeoTIFF (tiled 256², deflate or uncompressed) block by
//! block, for tiled-inference measurements (`docs/tiling.md`):
//!
//! `cargo run --release --example make_geotiff -- OUT.tif SIZE [none|deflate]`
use std::path::PathBuf;

use edgerun::geotiff::{GeoReference, RawTag, GEO_KEY_DIRECTORY, MODEL_PIXEL_SCALE, MODEL_TIEPOINT};
use edgerun::tiling::writer::{SampleKind, TiledTiffWriter, WriterOptions};

fn doubles(code: u16, v: &[f64]) -> RawTag {
    RawTag { code, field_type: 12, count: v.len() as u64, bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect() }
}

/// A smooth field with some texture: canopy-like blobs over a gradient, plus hashed noise.
fn pixel(x: usize, y: usize) -> [u8; 3] {
    let (fx, fy) = (x as f32, y as f32);
    let blobs = ((fx / 37.0).sin() * (fy / 29.0).cos() + (fx / 211.0 + fy / 173.0).sin()) * 0.25 + 0.5;
    let h = (x as u32).wrapping_mul(73856093) ^ (y as u32).wrapping_mul(19349663);
    let n = ((h >> 8) & 15) as f32;
    let g = (blobs * 200.0 + n).clamp(0.0, 255.0);
    [(g * 0.6) as u8, g as u8, (g * 0.45) as u8]
}

fn main() -> edgerun::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(out), Some(size)) = (args.first(), args.get(1).and_then(|s| s.parse::<usize>().ok())) else {
        eprintln!("usage: make_geotiff OUT.tif SIZE [none|deflate]");
        std::process::exit(2);
    };
    let deflate = args.get(2).map(|s| s != "none").unwrap_or(true);
    let geo = GeoReference {
        width: size as u32,
        height: size as u32,
        bits_per_sample: 8,
        tags: vec![
            doubles(MODEL_PIXEL_SCALE, &[0.5, 0.5, 0.0]),
            doubles(MODEL_TIEPOINT, &[0.0, 0.0, 0.0, 500000.0, 4500000.0, 0.0]),
            // GeoKey directory: projected (1024 = 1), pixel is area (1025 = 1), EPSG:32633 (3072).
            RawTag {
                code: GEO_KEY_DIRECTORY,
                field_type: 3,
                count: 16,
                bytes: [1u16, 1, 0, 3, 1024, 0, 1, 1, 1025, 0, 1, 1, 3072, 0, 1, 32633].iter().flat_map(|v| v.to_le_bytes()).collect(),
            },
        ],
    };
    let block = 256;
    let path = PathBuf::from(out);
    let mut w = TiledTiffWriter::create(&path, size, size, SampleKind::Rgb8, Some(&geo), None, WriterOptions { block, deflate, bigtiff: None })?;
    let mut data = vec![0u8; block * block * 3];
    for by in 0..size.div_ceil(block) {
        for bx in 0..size.div_ceil(block) {
            for r in 0..block {
                for c in 0..block {
                    let (y, x) = (by * block + r, bx * block + c);
                    let px = if x < size && y < size { pixel(x, y) } else { [0; 3] };
                    data[(r * block + c) * 3..][..3].copy_from_slice(&px);
                }
            }
            w.write_block(bx, by, &data)?;
        }
    }
    w.finish()?;
    eprintln!("{}: {size}×{size} RGB, tiled {block}², {}", path.display(), if deflate { "deflate" } else { "uncompressed" });
    Ok(())
}
