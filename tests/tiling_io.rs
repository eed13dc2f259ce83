//! Windowed raster input and tiled GeoTIFF output: windows equal the full decode (tiled, striped,
//! BigTIFF, 16-bit, alpha), the writer round-trips values and georeferencing, and truncated or lying
//! TIFFs are clear errors naming the file.
mod common;

use std::path::Path;

use common::fixture;
use edgerun::geotiff::{read_f32, GeoReference};
use edgerun::tiling::writer::{SampleKind, TiledTiffWriter, WriterOptions};
use edgerun::tiling::{RasterSource, Rect, TiffRaster};
use image::RgbImage;
use tiff::encoder::{colortype, TiffEncoder};

/// Deterministic pseudo-random RGB pixels.
fn noise(w: u32, h: u32, seed: u32) -> RgbImage {
    let mut s = seed.wrapping_mul(2654435761).wrapping_add(1);
    RgbImage::from_fn(w, h, |_, _| {
        let mut px = [0u8; 3];
        for p in &mut px {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            *p = (s >> 24) as u8;
        }
        image::Rgb(px)
    })
}

/// Writes `img` as a tiled RGB TIFF with `block`-pixel tiles.
fn write_tiled(path: &Path, img: &RgbImage, block: usize, deflate: bool, bigtiff: Option<bool>) {
    let (w, h) = (img.width() as usize, img.height() as usize);
    let mut t = TiledTiffWriter::create(path, w, h, SampleKind::Rgb8, None, None, WriterOptions { block, deflate, bigtiff }).unwrap();
    for by in 0..h.div_ceil(block) {
        for bx in 0..w.div_ceil(block) {
            let mut data = vec![0u8; block * block * 3];
            for r in 0..block.min(h - by * block) {
                let y = by * block + r;
                let x0 = bx * block;
                let x1 = (x0 + block).min(w);
                data[r * block * 3..r * block * 3 + (x1 - x0) * 3].copy_from_slice(&img.as_raw()[(y * w + x0) * 3..(y * w + x1) * 3]);
            }
            t.write_block(bx, by, &data).unwrap();
        }
    }
    t.finish().unwrap();
}

/// Writes `img` as a striped RGB TIFF with `rows` rows per strip.
fn write_striped(path: &Path, img: &RgbImage, rows: u32) {
    let f = std::fs::File::create(path).unwrap();
    let mut enc = TiffEncoder::new(f).unwrap();
    let mut im = enc.new_image::<colortype::RGB8>(img.width(), img.height()).unwrap();
    im.rows_per_strip(rows).unwrap();
    im.write_data(img.as_raw()).unwrap();
}

fn crop(img: &RgbImage, r: Rect) -> RgbImage {
    image::imageops::crop_imm(img, r.x as u32, r.y as u32, r.w as u32, r.h as u32).to_image()
}

const RECTS: [Rect; 5] = [
    Rect { x: 0, y: 0, w: 97, h: 61 },
    Rect { x: 13, y: 7, w: 1, h: 1 },
    Rect { x: 30, y: 40, w: 40, h: 21 },
    Rect { x: 63, y: 0, w: 34, h: 61 },
    Rect { x: 31, y: 31, w: 33, h: 2 },
];

#[test]
fn windows_of_tiled_striped_and_bigtiff_files_equal_the_full_decode() {
    let dir = tempfile::tempdir().unwrap();
    let img = noise(97, 61, 1);
    let files = [
        ("tiled_deflate.tif", 0),
        ("tiled_raw.tif", 1),
        ("big.tif", 2),
        ("strips7.tif", 3),
        ("one_strip.tif", 4),
    ];
    for (name, kind) in files {
        let p = dir.path().join(name);
        match kind {
            0 => write_tiled(&p, &img, 32, true, None),
            1 => write_tiled(&p, &img, 16, false, None),
            2 => write_tiled(&p, &img, 48, true, Some(true)),
            3 => write_striped(&p, &img, 7),
            _ => write_striped(&p, &img, 61),
        }
        // The image crate decodes the whole file: the reference.
        let full = image::open(&p).unwrap().into_rgb8();
        assert_eq!(full, img, "{name}: full decode");
        let mut r = TiffRaster::open(&p, None).unwrap();
        assert_eq!(r.dimensions(), (97, 61));
        for rect in RECTS {
            let w = r.read_window(rect).unwrap();
            assert_eq!(w.rgb, crop(&img, rect), "{name}: window {rect:?}");
            assert!(w.nodata.is_none());
        }
        assert!(r.read_window(Rect { x: 90, y: 0, w: 8, h: 1 }).is_err(), "{name}: a window past the edge");
    }
    let mut head = [0u8; 4];
    std::io::Read::read_exact(&mut std::fs::File::open(dir.path().join("big.tif")).unwrap(), &mut head).unwrap();
    assert_eq!(&head, b"II+\0", "BigTIFF header");
}

#[test]
fn sixteen_bit_gray_and_alpha_and_nodata_are_converted_and_masked() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("gray16.tif");
    let (w, h) = (40u32, 30u32);
    let data: Vec<u16> = (0..w * h).map(|i| (i * 53 % 65536) as u16).collect();
    {
        let f = std::fs::File::create(&p).unwrap();
        let mut enc = TiffEncoder::new(f).unwrap();
        let mut im = enc.new_image::<colortype::Gray16>(w, h).unwrap();
        im.rows_per_strip(4).unwrap();
        im.write_data(&data).unwrap();
    }
    // Pixel (5, 3) holds 6625 (= 125 · 53): the no-data value.
    let mut r = TiffRaster::open(&p, Some(6625.0)).unwrap();
    let win = r.read_window(Rect { x: 3, y: 2, w: 20, h: 10 }).unwrap();
    let mask = win.nodata.unwrap();
    for y in 0..10 {
        for x in 0..20 {
            let v = data[((y + 2) * w as usize) + x + 3];
            let want = ((v as u32 * 255 + 32767) / 65535) as u8;
            assert_eq!(win.rgb.get_pixel(x as u32, y as u32).0, [want; 3]);
            assert_eq!(mask[y * 20 + x], v == 6625);
        }
    }
    assert_eq!(mask.iter().filter(|m| **m).count(), 1);

    let p = dir.path().join("rgba.tif");
    let rgba: Vec<u8> = (0..w * h).flat_map(|i| [i as u8, (i / 2) as u8, 7, if i % 5 == 0 { 0 } else { 255 }]).collect();
    {
        let f = std::fs::File::create(&p).unwrap();
        let mut enc = TiffEncoder::new(f).unwrap();
        enc.write_image::<colortype::RGBA8>(w, h, &rgba).unwrap();
    }
    let mut r = TiffRaster::open(&p, None).unwrap();
    let win = r.read_window(Rect { x: 0, y: 0, w: w as usize, h: h as usize }).unwrap();
    let mask = win.nodata.unwrap();
    for i in 0..(w * h) as usize {
        assert_eq!(win.rgb.as_raw()[i * 3..i * 3 + 3], rgba[i * 4..i * 4 + 3]);
        assert_eq!(mask[i], i % 5 == 0, "alpha 0 is no-data");
    }
}

#[test]
fn float_writer_round_trips_values_and_georeferencing_in_classic_and_bigtiff() {
    let dir = tempfile::tempdir().unwrap();
    let geo = GeoReference::read(&fixture("chmv2_geotiff").join("scene.tif")).unwrap().unwrap();
    let (w, h) = (geo.width as usize, geo.height as usize);
    let values: Vec<f32> = (0..w * h).map(|i| i as f32 * 0.5 - 7.0).collect();
    for big in [false, true] {
        let p = dir.path().join(format!("out{big}.tif"));
        let block = 16;
        let mut t = TiledTiffWriter::create(&p, w, h, SampleKind::F32, Some(&geo), Some("-1"), WriterOptions { block, deflate: true, bigtiff: Some(big) }).unwrap();
        assert_eq!(t.is_bigtiff(), big);
        // Blocks in column-major order, as stripes produce them.
        for bx in 0..w.div_ceil(block) {
            for by in 0..h.div_ceil(block) {
                let mut data = vec![0u8; block * block * 4];
                for r in 0..block {
                    for c in 0..block {
                        let (y, x) = (by * block + r, bx * block + c);
                        if y < h && x < w {
                            data[(r * block + c) * 4..][..4].copy_from_slice(&values[y * w + x].to_le_bytes());
                        }
                    }
                }
                t.write_block(bx, by, &data).unwrap();
            }
        }
        t.finish().unwrap();
        let (w2, h2, v2) = read_f32(&p).unwrap();
        assert_eq!((w2 as usize, h2 as usize), (w, h));
        assert_eq!(v2, values);
        let back = GeoReference::read(&p).unwrap().unwrap();
        let mut want: Vec<_> = geo.tags.iter().filter(|t| t.code != edgerun::geotiff::GDAL_NODATA).cloned().collect();
        want.push(edgerun::geotiff::RawTag { code: edgerun::geotiff::GDAL_NODATA, field_type: 2, count: 3, bytes: b"-1\0".to_vec() });
        assert_eq!(back.tags, want);
    }
    // A missing block is an error and leaves no file.
    let p = dir.path().join("partial.tif");
    let t = TiledTiffWriter::create(&p, 20, 20, SampleKind::U8, None, None, WriterOptions { block: 16, ..Default::default() }).unwrap();
    assert!(t.finish().unwrap_err().to_string().contains("never written"));
    assert!(!p.exists());
}

/// Byte position of the value (or value offset) of `tag` in a classic little-endian TIFF's first IFD,
/// with the entry's count.
fn tag_value_at(bytes: &[u8], tag: u16) -> (usize, u32) {
    let ifd = u32::from_le_bytes(bytes[4..8].try_into().unwrap()) as usize;
    let n = u16::from_le_bytes(bytes[ifd..ifd + 2].try_into().unwrap()) as usize;
    for i in 0..n {
        let e = ifd + 2 + i * 12;
        if u16::from_le_bytes(bytes[e..e + 2].try_into().unwrap()) == tag {
            return (e + 8, u32::from_le_bytes(bytes[e + 4..e + 8].try_into().unwrap()));
        }
    }
    panic!("no tag {tag}");
}

fn set_u32(bytes: &mut [u8], at: usize, v: u32) {
    bytes[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn open_err(p: &Path) -> String {
    let e = match TiffRaster::open(p, None) {
        Err(e) => e,
        Ok(mut r) => {
            let (w, h) = r.dimensions();
            r.read_window(Rect { x: 0, y: 0, w, h }).expect_err("a broken file reads")
        }
    };
    let msg = e.to_string();
    assert!(msg.contains(&p.display().to_string()), "the error names the file: {msg}");
    msg
}

#[test]
fn truncated_and_lying_tiffs_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let img = noise(64, 64, 3);
    let good = dir.path().join("good.tif");
    write_tiled(&good, &img, 16, false, None);
    let bytes = std::fs::read(&good).unwrap();

    // A tile offset past the end of the file.
    let mut b = bytes.clone();
    let (at, count) = tag_value_at(&b, 324);
    assert_eq!(count, 16);
    let first = u32::from_le_bytes(b[at..at + 4].try_into().unwrap()) as usize;
    set_u32(&mut b, first + 5 * 4, 0x7fff_0000);
    let p = dir.path().join("offset_past_end.tif");
    std::fs::write(&p, &b).unwrap();
    let m = open_err(&p);
    assert!(m.contains("past the end of the file"), "{m}");

    // Tile data cut short (the directory, at the end, kept): byte counts reach past the end.
    let p = dir.path().join("truncated.tif");
    let mut b = bytes.clone();
    let (at, _) = tag_value_at(&b, 325);
    let counts = u32::from_le_bytes(b[at..at + 4].try_into().unwrap()) as usize;
    set_u32(&mut b, counts + 15 * 4, 1 << 30);
    std::fs::write(&p, &b).unwrap();
    let m = open_err(&p);
    assert!(m.contains("truncated"), "{m}");

    // A plainly truncated file (directory lost).
    let p = dir.path().join("cut.tif");
    std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    open_err(&p);

    // An absurd declared size in a tiled file: the tile count no longer matches.
    let p = dir.path().join("huge_tiled.tif");
    let mut b = bytes.clone();
    let (at, _) = tag_value_at(&b, 256);
    set_u32(&mut b, at, 3_000_000);
    std::fs::write(&p, &b).unwrap();
    let m = open_err(&p);
    assert!(m.contains("inconsistent sizes"), "{m}");

    // Sizes patched into a one-strip file (ImageWidth, ImageLength, RowsPerStrip may be SHORT: made LONG).
    let striped = dir.path().join("one_strip.tif");
    write_striped(&striped, &img, 64);
    let one_strip = std::fs::read(&striped).unwrap();
    let patched = |name: &str, w: u32, h: u32| {
        let mut b = one_strip.clone();
        for (tag, v) in [(256u16, w), (257, h), (278, h)] {
            let (at, _) = tag_value_at(&b, tag);
            b[at - 6..at - 4].copy_from_slice(&4u16.to_le_bytes());
            set_u32(&mut b, at, v);
        }
        let p = dir.path().join(name);
        std::fs::write(&p, &b).unwrap();
        open_err(&p)
    };
    // Beyond the windowed-reading limits.
    let m = patched("huge.tif", 3_000_000, 64);
    assert!(m.contains("3000000×64") && m.contains("beyond"), "{m}");
    // Within them, but one strip of gigabytes.
    let m = patched("giant_strip.tif", 100_000, 100_000);
    assert!(m.contains("strips") && m.contains("MiB"), "{m}");
    // A strip too short for its declared rows.
    let m = patched("long_strip.tif", 64, 2000);
    assert!(m.contains("holds 12288 bytes") && m.contains("truncated"), "{m}");

    // Not a TIFF at all.
    let p = dir.path().join("junk.tif");
    std::fs::write(&p, b"II*\0junk").unwrap();
    open_err(&p);
}
