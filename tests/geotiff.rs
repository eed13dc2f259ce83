//! GeoTIFF georeferencing round trip (tags preserved bit-exactly) and the `edgerun chm` outputs.
mod common;

use std::path::Path;
use std::process::Command;

use common::{device_arg, fixture};
use edgerun::geotiff::{read_f32, write_f32, GeoReference, RawTag, GDAL_NODATA, MODEL_PIXEL_SCALE, MODEL_TIEPOINT};

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

/// The tags of `file` as tifffile recorded them (little-endian value bytes).
fn recorded(file: &str) -> Vec<RawTag> {
    let j: serde_json::Value = serde_json::from_slice(&std::fs::read(fixture("chmv2_geotiff").join("geotags.json")).unwrap()).unwrap();
    let tags = j["files"][file]["tags"].as_object().unwrap();
    let mut out: Vec<RawTag> = tags
        .iter()
        .map(|(code, t)| RawTag {
            code: code.parse().unwrap(),
            field_type: t["type"].as_u64().unwrap() as u16,
            count: t["count"].as_u64().unwrap(),
            bytes: unhex(t["le_hex"].as_str().unwrap()),
        })
        .collect();
    out.sort_by_key(|t| t.code);
    out
}

fn roundtrip(file: &str) {
    let src = fixture("chmv2_geotiff").join(file);
    let geo = GeoReference::read(&src).unwrap().expect("georeferenced");
    let want = recorded(file);
    assert_eq!(geo.tags, want, "{file}: tags as read differ from what tifffile wrote");
    assert_eq!(geo.bits_per_sample, 8);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.tif");
    let (w, h) = (geo.width, geo.height);
    let values: Vec<f32> = (0..w * h).map(|i| i as f32 * 0.25 - 3.0).collect();
    write_f32(&out, w, h, &values, Some(&geo)).unwrap();
    let back = GeoReference::read(&out).unwrap().expect("output is georeferenced");
    assert_eq!(back.tags, want, "{file}: output tags differ");
    assert_eq!((back.width, back.height), (w, h));
    let (w2, h2, v2) = read_f32(&out).unwrap();
    assert_eq!((w2, h2), (w, h));
    assert_eq!(v2.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), values.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
}

#[test]
fn little_endian_tiepoint_scale_tags_survive_bit_exactly() {
    roundtrip("scene.tif");
    let geo = GeoReference::read(&fixture("chmv2_geotiff").join("scene.tif")).unwrap().unwrap();
    assert_eq!(geo.pixel_scale().unwrap()[0].to_bits(), (0.1f64 + 0.2).to_bits());
    assert_eq!(geo.tiepoints().unwrap()[3], 500000.1 + 1e-9);
    assert_eq!(geo.geo_keys().unwrap()[..4], [1, 1, 0, 7]);
    assert_eq!(geo.nodata(), Some(0.0));
    assert!(geo.tag(MODEL_PIXEL_SCALE).is_some() && geo.tag(MODEL_TIEPOINT).is_some());
}

#[test]
fn big_endian_transformation_tags_survive_bit_exactly() {
    roundtrip("rotated_be.tif");
    let geo = GeoReference::read(&fixture("chmv2_geotiff").join("rotated_be.tif")).unwrap().unwrap();
    assert_eq!(geo.transformation().unwrap()[..4], [0.25, 0.1, 0.0, 300000.5]);
    assert_eq!(geo.tag(GDAL_NODATA).unwrap().bytes, b"255\0");
}

#[test]
fn non_geotiffs_have_no_georeference() {
    assert!(GeoReference::read(&fixture("chmv2_geotiff").join("plain.png")).unwrap().is_none());
    let dir = tempfile::tempdir().unwrap();
    let plain = dir.path().join("plain.tif");
    write_f32(&plain, 3, 2, &[0.0; 6], None).unwrap();
    assert!(GeoReference::read(&plain).unwrap().is_none());
    let geo = GeoReference::read(&fixture("chmv2_geotiff").join("scene.tif")).unwrap().unwrap();
    let e = write_f32(&dir.path().join("x.tif"), 3, 2, &[0.0; 6], Some(&geo)).unwrap_err();
    assert!(e.to_string().contains("differs from the georeferenced source"), "{e}");
    let e = write_f32(&dir.path().join("y.tif"), 3, 2, &[0.0; 5], None).unwrap_err();
    assert!(e.to_string().contains("5 values"), "{e}");
    let junk = dir.path().join("junk.tif");
    std::fs::write(&junk, b"II*\0garbage").unwrap();
    let e = GeoReference::read(&junk).unwrap_err();
    assert!(e.to_string().contains("junk.tif"), "{e}");
}

fn npy_shape(p: &Path) -> (usize, usize) {
    edgerun::imageio::npy::read_npy_2d(p).unwrap().0
}

#[test]
fn chm_cli_writes_npy_and_georeferenced_tif() {
    let dir = tempfile::tempdir().unwrap();
    let g = fixture("chmv2_geotiff");
    let status = Command::new(env!("CARGO_BIN_EXE_edgerun"))
        .args(["chm", "--device", &device_arg(), "--batch", "2", "--model"])
        .arg(fixture("chmv2_tiny"))
        .arg(g.join("scene.tif"))
        .arg(g.join("plain.png"))
        .arg("--out")
        .arg(dir.path())
        .status()
        .unwrap();
    assert!(status.success());
    assert_eq!(npy_shape(&dir.path().join("scene.chm.npy")), (37, 50));
    assert_eq!(npy_shape(&dir.path().join("plain.chm.npy")), (20, 24));
    assert!(!dir.path().join("plain.chm.tif").exists());
    let tif = dir.path().join("scene.chm.tif");
    let geo = GeoReference::read(&tif).unwrap().unwrap();
    assert_eq!(geo.tags, recorded("scene.tif"));
    let (w, h, v) = read_f32(&tif).unwrap();
    assert_eq!((w, h), (50, 37));
    // The source is 0 in every band in its top-left 3×4 corner and its left 6 columns: nodata there
    // (GDAL_NODATA "0"), heights (≥ 0.008 m) elsewhere.
    let at = |y: usize, x: usize| v[y * 50 + x];
    assert_eq!((at(0, 0), at(2, 3), at(20, 5)), (0.0, 0.0, 0.0));
    assert!(at(0, 4) > 0.0 && at(20, 6) > 0.0 && at(20, 25) > 0.0);
    assert!(v.iter().all(|x| x.is_finite()));
    let (_, npy) = edgerun::imageio::npy::read_npy_2d(&dir.path().join("scene.chm.npy")).unwrap();
    for (a, b) in npy.iter().zip(&v).skip(20 * 50 + 6).take(40) {
        assert!((a - b).abs() <= 0.06, "npy (f16) {a} vs tif {b}");
    }
}

#[test]
fn chm_cli_rejects_a_non_chm_model_and_bf16_on_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let img = fixture("chmv2_geotiff").join("plain.png");
    let run = |model: &Path, dtype: &str| {
        Command::new(env!("CARGO_BIN_EXE_edgerun"))
            .args(["chm", "--device", "cpu", "--dtype", dtype, "--model"])
            .arg(model)
            .arg(&img)
            .arg("--out")
            .arg(dir.path())
            .output()
            .unwrap()
    };
    let o = run(&fixture("da2_tiny"), "f32");
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("not a CHMv2"), "{}", String::from_utf8_lossy(&o.stderr));
    let o = run(&fixture("chmv2_tiny"), "bf16");
    assert_eq!(o.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&o.stderr).contains("bf16"), "{}", String::from_utf8_lossy(&o.stderr));
}
