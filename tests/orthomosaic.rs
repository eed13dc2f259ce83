//! Orthomosaics as people export them (issue #47), on the corpus `tools/fixtures/orthomosaic.py`
//! writes: JPEG-in-TIFF (YCbCr 2×2 with JPEGTables, RGB strips, progressive tiles), ZSTD with the horizontal predictor
//! (8 and 16 bits), WebP, a COG-like file (overview, internal mask, tiles in reverse order), PNG and
//! JPEG (with and without restart markers) beyond the image limits, what stays unsupported and hostile files.
mod common;

use std::path::PathBuf;

use common::fixture;
use edgerun::geotiff::GeoReference;
use edgerun::imageio::{load_rgb, ImageLimits};
use edgerun::tiling::{open_raster, RasterSource, Rect, TiffRaster};
use image::RgbImage;

fn corpus(name: &str) -> PathBuf {
    fixture("orthomosaic").join(name)
}

fn read_all(name: &str) -> RgbImage {
    let mut r = TiffRaster::open(&corpus(name), None).unwrap();
    let (w, h) = r.dimensions();
    r.read_window(Rect { x: 0, y: 0, w, h }).unwrap().rgb
}

/// Largest difference of one sample, and how many samples differ.
fn diff(a: &RgbImage, b: &RgbImage) -> (u8, usize) {
    assert_eq!(a.dimensions(), b.dimensions());
    let d = a.as_raw().iter().zip(b.as_raw()).map(|(&x, &y)| x.abs_diff(y));
    d.fold((0, 0), |(m, n), v| (m.max(v), n + (v > 0) as usize))
}

/// Windows straddling tile and strip borders, as tiling reads them.
const WINDOWS: [Rect; 4] =
    [Rect { x: 0, y: 0, w: 80, h: 72 }, Rect { x: 10, y: 5, w: 50, h: 40 }, Rect { x: 31, y: 31, w: 2, h: 2 }, Rect { x: 40, y: 60, w: 40, h: 12 }];

fn windows_match(name: &str, reference: &str, bound: u8) -> (u8, usize) {
    let mut a = TiffRaster::open(&corpus(name), None).unwrap();
    let mut b = TiffRaster::open(&corpus(reference), None).unwrap();
    assert_eq!(a.dimensions(), (80, 72), "{name}");
    let mut worst = (0, 0);
    for r in WINDOWS {
        let (m, n) = diff(&a.read_window(r).unwrap().rgb, &b.read_window(r).unwrap().rgb);
        assert!(m <= bound, "{name} window {r:?}: differs from {reference} by {m} (bound {bound})");
        worst = (worst.0.max(m), worst.1 + n);
    }
    worst
}

#[test]
fn lossless_files_equal_the_source_exactly() {
    for name in ["zstd.tif", "zstd16.tif", "cog_mask.tif", "lzw.tif", "packbits16_be.tif"] {
        assert_eq!(windows_match(name, "source.tif", 0), (0, 0), "{name}");
    }
}

#[test]
fn jpeg_and_webp_equal_the_reference_decoders_pixels_within_their_rounding() {
    for (name, reference, bound) in [
        ("jpeg_ycbcr.tif", "jpeg_ycbcr.decoded.tif", 0),
        ("jpeg_rgb.tif", "jpeg_rgb.decoded.tif", 0),
        ("webp.tif", "webp.decoded.tif", 0),
    ] {
        let (m, n) = windows_match(name, reference, bound);
        eprintln!("{name}: max difference {m}, {n} samples differ");
    }
}

#[test]
fn progressive_jpeg_tiles_are_decoded_by_zune_jpeg_within_its_rounding() {
    // zune-jpeg's upsampling and IDCT round differently from libjpeg's: a few levels apart.
    let (m, n) = windows_match("jpeg_progressive.tif", "jpeg_progressive.decoded.tif", 4);
    eprintln!("jpeg_progressive.tif: max difference {m}, {n} samples differ");
}

#[test]
fn untiled_decode_reads_tiffs_as_the_tiled_path_does() {
    for name in ["jpeg_ycbcr.tif", "jpeg_rgb.tif", "jpeg_progressive.tif", "zstd.tif", "zstd16.tif", "webp.tif", "cog_mask.tif", "lzw.tif", "packbits16_be.tif"] {
        let whole = load_rgb(&corpus(name), &ImageLimits::default()).unwrap();
        assert_eq!(whole, read_all(name), "{name}");
    }
}

#[test]
fn georeferencing_and_nodata_are_read_from_every_kind() {
    let src = GeoReference::read(&corpus("source.tif")).unwrap().unwrap();
    for name in ["jpeg_ycbcr.tif", "jpeg_rgb.tif", "jpeg_progressive.tif", "zstd.tif", "zstd16.tif", "webp.tif", "cog_mask.tif"] {
        let g = GeoReference::read(&corpus(name)).unwrap().unwrap();
        assert_eq!((g.width, g.height), (80, 72), "{name}");
        assert_eq!((g.pixel_scale(), g.tiepoints(), g.geo_keys()), (src.pixel_scale(), src.tiepoints(), src.geo_keys()), "{name}");
    }
    assert_eq!(GeoReference::read(&corpus("jpeg_ycbcr.tif")).unwrap().unwrap().nodata(), Some(0.0));
}

#[test]
fn a_cogs_overview_is_skipped_and_its_internal_mask_is_nodata() {
    let mut r = TiffRaster::open(&corpus("cog_mask.tif"), None).unwrap();
    assert!(r.has_mask());
    let w = r.read_window(Rect { x: 0, y: 0, w: 80, h: 72 }).unwrap();
    let mask = w.nodata.unwrap();
    for y in 0..72 {
        for x in 0..80 {
            assert_eq!(mask[y * 80 + x], x < 24 && y < 20, "({x}, {y})");
        }
    }
}

fn open_err(name: &str) -> String {
    let path = corpus(name);
    let e = match TiffRaster::open(&path, None) {
        Ok(mut r) => r.read_window(Rect { x: 0, y: 0, w: r.dimensions().0, h: r.dimensions().1 }).expect_err("an error"),
        Err(e) => e,
    }
    .to_string();
    assert!(e.contains(&path.display().to_string()), "{name}: the error names the file: {e}");
    assert!(!e.contains("Unknown(") && !e.contains("Unsupported"), "{name}: no decoder enum in {e}");
    e
}

#[test]
fn unsupported_kinds_are_named_in_plain_words_with_the_conversion() {
    for (name, words, command) in [
        ("lzma.tif", "LZMA compression", "-co COMPRESS=DEFLATE"),
        ("palette.tif", "palette (colour-mapped) images", "-expand rgb"),
        ("cmyk.tif", "CMYK (separated) colour", "export it as RGB"),
        ("float_rgb.tif", "floating-point samples", "-ot Byte -scale"),
        ("int16_rgb.tif", "signed integer samples", "-ot Byte -scale"),
    ] {
        let e = open_err(name);
        assert!(e.contains(words) && e.contains("not supported") && e.contains(command), "{name}: {e}");
        // The untiled path gives the same words.
        let e = load_rgb(&corpus(name), &ImageLimits::default()).unwrap_err().to_string();
        assert!(e.contains(words) && e.contains(command), "{name} untiled: {e}");
    }
}

#[test]
fn hostile_new_decoder_inputs_end_in_clear_errors() {
    for (name, want) in [
        ("hostile_jpeg_tables.tif", "the JPEG tables (tag 347) are truncated or corrupt"),
        ("hostile_jpeg_huge.tif", "60000"),
        ("hostile_zstd_bomb.tif", "decompresses to more than the 3072 bytes its pixels take"),
        ("hostile_deflate_bomb.tif", "decompresses to more than the 3072 bytes its pixels take"),
    ] {
        let e = open_err(name);
        assert!(e.contains(want) && e.contains("tile 0"), "{name}: {e}");
    }
}

/// Limits small enough that the 80×72 corpus images are beyond them.
fn tiny_limits() -> ImageLimits {
    ImageLimits { max_side: 64, max_pixels: 4096, max_alloc: 1 << 20 }
}

#[test]
fn a_png_beyond_the_limits_is_read_by_rows_with_the_pixels_of_the_whole_decode() {
    let path = corpus("rows.png");
    let mut rows = open_raster(&path, &tiny_limits(), None).unwrap();
    let mut whole = open_raster(&path, &ImageLimits::default(), None).unwrap();
    // Two column stripes top to bottom, as tiling reads them, then a window above the last one.
    let mut seq = Vec::new();
    for x in [0, 40] {
        for y in [0, 20, 40, 52] {
            seq.push(Rect { x, y, w: 40, h: 20 });
        }
    }
    seq.push(Rect { x: 5, y: 3, w: 70, h: 60 });
    for r in seq {
        assert_eq!(rows.read_window(r).unwrap().rgb, whole.read_window(r).unwrap().rgb, "{r:?}");
    }
}

#[test]
fn a_baseline_jpeg_beyond_the_limits_is_read_by_rows_with_libjpegs_pixels() {
    for name in ["baseline.jpg", "baseline422.jpg", "gray.jpg", "restart_rows.jpg", "restart_blocks.jpg"] {
        let mut rows = open_raster(&corpus(name), &tiny_limits(), None).unwrap();
        let reference = image::open(corpus(&name.replace(".jpg", ".decoded.png"))).unwrap().into_rgb8();
        for r in [Rect { x: 0, y: 0, w: 40, h: 30 }, Rect { x: 0, y: 25, w: 40, h: 47 }, Rect { x: 40, y: 0, w: 40, h: 72 }, Rect { x: 0, y: 0, w: 80, h: 72 }] {
            let want = image::imageops::crop_imm(&reference, r.x as u32, r.y as u32, r.w as u32, r.h as u32).to_image();
            assert_eq!(diff(&rows.read_window(r).unwrap().rgb, &want), (0, 0), "{name} {r:?}");
        }
    }
}

#[test]
fn a_file_read_by_rows_is_taken_for_what_its_bytes_are_not_its_name() {
    // A PNG named `.jpg` (and a JPEG named `.png`) beyond the limits: read by rows as what they are.
    let dir = tempfile::tempdir().unwrap();
    let whole = Rect { x: 0, y: 0, w: 80, h: 72 };
    for (src, misnamed) in [("rows.png", "rows.jpg"), ("baseline.jpg", "baseline.png")] {
        let p = dir.path().join(misnamed);
        std::fs::copy(corpus(src), &p).unwrap();
        let rows = open_raster(&p, &tiny_limits(), None).unwrap().read_window(whole).unwrap().rgb;
        assert_eq!(rows, open_raster(&corpus(src), &tiny_limits(), None).unwrap().read_window(whole).unwrap().rgb, "{misnamed}");
    }
}

#[test]
fn a_progressive_jpeg_beyond_the_limits_is_refused_naming_the_limit() {
    let e = open_raster(&corpus("progressive.jpg"), &tiny_limits(), None).err().unwrap().to_string();
    assert!(e.contains("progressive JPEG cannot be read by rows") && e.contains("64 px per side") && e.contains("gdal_translate"), "{e}");
}


fn chm(input: &std::path::Path, out: &std::path::Path, extra: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_edgerun"))
        .arg("chm")
        .args(extra)
        .args(["--device", "cpu", "--progress", "none", "--model"])
        .arg(fixture("chmv2_tiny"))
        .arg(input)
        .arg("--out")
        .arg(out)
        .output()
        .unwrap()
}

#[test]
fn chm_on_a_jpeg_ycbcr_geotiff_equals_chm_on_its_decoded_pixels_tiled_and_untiled() {
    let dir = tempfile::tempdir().unwrap();
    let src = GeoReference::read(&corpus("source.tif")).unwrap().unwrap();
    for (args, file) in [(&["--tile", "32", "--overlap", "8"][..], "chm.tif"), (&["--tile", "0"][..], "chm.npy")] {
        let mut outputs = Vec::new();
        for name in ["jpeg_ycbcr.tif", "jpeg_ycbcr.decoded.tif"] {
            let out = dir.path().join(format!("{}-{}", args[1], name));
            let o = chm(&corpus(name), &out, args);
            assert!(o.status.success(), "{name} {args:?}: {}", String::from_utf8_lossy(&o.stderr));
            let stem = name.trim_end_matches(".tif");
            let path = out.join(format!("{stem}.{file}"));
            if file == "chm.tif" {
                let geo = GeoReference::read(&path).unwrap().unwrap();
                assert_eq!((geo.pixel_scale(), geo.tiepoints(), geo.geo_keys()), (src.pixel_scale(), src.tiepoints(), src.geo_keys()));
                outputs.push(edgerun::geotiff::read_f32(&path).unwrap().2);
            } else {
                outputs.push(std::fs::read(&path).unwrap().into_iter().map(f32::from).collect());
            }
        }
        assert_eq!(outputs[0], outputs[1], "{args:?}: the JPEG GeoTIFF gives the output of its decoded pixels");
    }
}

#[test]
fn chm_reads_zstd_webp_and_cog_geotiffs_and_names_what_it_cannot_read() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["zstd.tif", "zstd16.tif", "webp.tif", "cog_mask.tif", "jpeg_rgb.tif"] {
        let o = chm(&corpus(name), dir.path(), &["--tile", "32"]);
        assert!(o.status.success(), "{name}: {}", String::from_utf8_lossy(&o.stderr));
    }
    let o = chm(&corpus("palette.tif"), dir.path(), &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("palette (colour-mapped) images: not supported by edgerun") && err.contains("gdal_translate -expand rgb"), "{err}");
}

#[test]
fn an_image_beyond_the_limits_is_tiled_automatically() {
    use edgerun::tiling::{decide, TileRequest};
    for name in ["rows.png", "baseline.jpg", "zstd.tif"] {
        let d = decide(&corpus(name), TileRequest::default(), (416, 64), &tiny_limits()).unwrap();
        assert_eq!(d, Some((416, 64)), "{name}");
        assert_eq!(decide(&corpus(name), TileRequest::default(), (416, 64), &ImageLimits::default()).unwrap(), None, "{name}");
    }
}

/// `bytes` with `flips` bytes at pseudo-random places changed (a linear congruential `seed`).
fn flipped(bytes: &[u8], seed: &mut u32, flips: usize) -> Vec<u8> {
    let mut b = bytes.to_vec();
    for _ in 0..flips {
        *seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        let at = (*seed >> 8) as usize % b.len();
        b[at] ^= (*seed & 0xFF) as u8 | 1;
    }
    b
}

#[test]
fn truncated_and_corrupted_jpegs_read_by_rows_are_errors_never_panics() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(corpus("baseline.jpg")).unwrap();
    let whole = Rect { x: 0, y: 0, w: 80, h: 72 };
    let cut = dir.path().join("cut.jpg");
    std::fs::write(&cut, &bytes[..bytes.len() * 2 / 3]).unwrap();
    let e = open_raster(&cut, &tiny_limits(), None).unwrap().read_window(whole).unwrap_err().to_string();
    assert!(e.contains("truncated") && e.contains("cut.jpg"), "{e}");
    // Flip bytes all over the file (headers and scan): an error or some pixels, never a panic.
    let mut seed = 47u32;
    for i in 0..300 {
        let b = flipped(&bytes, &mut seed, 3);
        let p = dir.path().join(format!("flip{i}.jpg"));
        std::fs::write(&p, &b).unwrap();
        if let Ok(mut r) = open_raster(&p, &tiny_limits(), None) {
            let (w, h) = r.dimensions();
            let _ = r.read_window(Rect { x: 0, y: 0, w, h });
        }
    }
}

#[test]
fn corrupted_jpeg_zstd_and_webp_geotiffs_are_errors_never_panics() {
    let dir = tempfile::tempdir().unwrap();
    let mut seed = 7u32;
    for name in ["jpeg_ycbcr.tif", "jpeg_rgb.tif", "zstd.tif", "webp.tif", "cog_mask.tif"] {
        let bytes = std::fs::read(corpus(name)).unwrap();
        for i in 0..120 {
            let b = flipped(&bytes, &mut seed, 4);
            let p = dir.path().join(format!("{i}-{name}"));
            std::fs::write(&p, &b).unwrap();
            if let Ok(mut r) = TiffRaster::open(&p, None) {
                let (w, h) = r.dimensions();
                let _ = r.read_window(Rect { x: 0, y: 0, w: w.min(4096), h: h.min(4096) });
            }
            let _ = load_rgb(&p, &ImageLimits::default());
        }
    }
}

#[test]
fn a_sixteen_bit_png_read_by_rows_equals_its_whole_decode_and_an_interlaced_one_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let p16 = dir.path().join("sixteen.png");
    let img = image::ImageBuffer::<image::Rgb<u16>, _>::from_fn(80, 72, |x, y| image::Rgb([(x * 811 + y * 7) as u16, (y * 907) as u16, ((x ^ y) * 1013) as u16]));
    img.save(&p16).unwrap();
    let whole = Rect { x: 0, y: 0, w: 80, h: 72 };
    let rows = open_raster(&p16, &tiny_limits(), None).unwrap().read_window(whole).unwrap().rgb;
    assert_eq!(rows, load_rgb(&p16, &ImageLimits::default()).unwrap());
    // The same PNG marked interlaced (IHDR's last byte, CRC recomputed): refused from its header.
    let mut b = std::fs::read(corpus("rows.png")).unwrap();
    b[28] = 1;
    let mut crc = flate2::Crc::new();
    crc.update(&b[12..29]);
    b[29..33].copy_from_slice(&crc.sum().to_be_bytes());
    let inter = dir.path().join("interlaced.png");
    std::fs::write(&inter, &b).unwrap();
    let e = open_raster(&inter, &tiny_limits(), None).err().unwrap().to_string();
    assert!(e.contains("an interlaced PNG cannot be read by rows") && e.contains("64 px per side"), "{e}");
}

#[test]
fn geotiffs_written_by_gdal_equal_gdals_own_decode_pixels_and_masks() {
    let src = GeoReference::read(&corpus("source.tif")).unwrap().unwrap();
    for name in ["jpeg_ycbcr", "jpeg_ycbcr_strips", "jpeg_rgb", "zstd", "webp", "cog_jpeg_mask", "cog_webp_alpha"] {
        let file = corpus(&format!("gdal/{name}.tif"));
        let mut a = TiffRaster::open(&file, None).unwrap();
        let mut b = TiffRaster::open(&corpus(&format!("gdal/{name}.decoded.tif")), None).unwrap();
        assert_eq!(a.dimensions(), (80, 72), "{name}");
        assert_eq!(a.has_mask(), name.starts_with("cog"), "{name}");
        for r in WINDOWS {
            let (wa, wb) = (a.read_window(r).unwrap(), b.read_window(r).unwrap());
            assert_eq!(diff(&wa.rgb, &wb.rgb), (0, 0), "{name} {r:?}");
            assert_eq!(wa.nodata, wb.nodata, "{name} {r:?}: the mask or alpha as GDAL reads it");
        }
        let g = GeoReference::read(&file).unwrap().unwrap();
        assert_eq!((g.pixel_scale(), g.tiepoints()), (src.pixel_scale(), src.tiepoints()), "{name}");
        assert_eq!(load_rgb(&file, &ImageLimits::default()).unwrap(), read_all(&format!("gdal/{name}.tif")), "{name} untiled");
    }
    // The masked corner is exactly the 30×20 px GDAL was told to hide.
    let w = TiffRaster::open(&corpus("gdal/cog_jpeg_mask.tif"), None).unwrap().read_window(WINDOWS[0]).unwrap();
    assert_eq!(w.nodata.unwrap().iter().filter(|&&m| m).count(), 30 * 20);
}
