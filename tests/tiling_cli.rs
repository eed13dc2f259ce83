//! `--tile` / `--overlap` on `chm`, `depth` and `segment`: tiled inputs get one tiled GeoTIFF with
//! the source's georeferencing; `--tile 0` keeps the untiled outputs; bad values are usage errors.
mod common;

use std::process::Command;

use common::fixture;
use edgerun::geotiff::{read_f32, GeoReference};

fn edgerun(args: &[&str], model: &str, out: &std::path::Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_edgerun"))
        .args(args)
        .args(["--device", "cpu", "--progress", "none", "--model"])
        .arg(fixture(model))
        .arg(fixture("chmv2_geotiff").join("scene.tif"))
        .arg("--out")
        .arg(out)
        .output()
        .unwrap()
}

#[test]
fn tiled_chm_depth_and_segment_write_georeferenced_tiffs() {
    let dir = tempfile::tempdir().unwrap();
    let src = GeoReference::read(&fixture("chmv2_geotiff").join("scene.tif")).unwrap().unwrap();
    for (cmd, model, suffix) in [("chm", "chmv2_tiny", "chm"), ("depth", "da2_relative_p14", "depth"), ("segment", "segformer_tiny", "seg")] {
        let out = dir.path().join(cmd);
        let mut args = vec![cmd, "--tile", "32", "--overlap", "8", "--batch", "2"];
        if cmd == "segment" {
            args.extend(["--size", "32x32"]);
        }
        let o = edgerun(&args, model, &out);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{cmd}: {err}");
        assert!(err.contains("in 4 tiles of 32 px (overlap 8)"), "{cmd}: {err}");
        let tif = out.join(format!("scene.{suffix}.tif"));
        let geo = GeoReference::read(&tif).unwrap().unwrap();
        assert_eq!((geo.width, geo.height), (50, 37));
        assert_eq!(geo.pixel_scale(), src.pixel_scale(), "{cmd}");
        assert_eq!(geo.tiepoints(), src.tiepoints(), "{cmd}");
        assert_eq!(geo.geo_keys(), src.geo_keys(), "{cmd}");
        // Besides the command's state file of its passes (OUT/.edgerun-<command>.passes.jsonl).
        let files: Vec<_> =
            std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).filter(|n| !n.starts_with(".edgerun-")).collect();
        assert_eq!(files, vec![format!("scene.{suffix}.tif")], "{cmd}: the tiled GeoTIFF is the only output");
        if cmd != "segment" {
            let (_, _, v) = read_f32(&tif).unwrap();
            // No-data pixels (0 in every band) are the source's 0 for CHM, NaN for depth.
            assert!(if cmd == "chm" { v[0] == 0.0 } else { v[0].is_nan() }, "{cmd}: {}", v[0]);
            assert!(v[20 * 50 + 25].is_finite());
        }
    }
    // --tile 0: the untiled outputs.
    let out = dir.path().join("off");
    let o = edgerun(&["chm", "--tile", "0"], "chmv2_tiny", &out);
    assert!(o.status.success());
    assert!(out.join("scene.chm.npy").exists() && out.join("scene.chm.tif").exists());
}

#[test]
fn bad_tile_values_are_usage_errors() {
    let dir = tempfile::tempdir().unwrap();
    for (args, want) in [
        (vec!["chm", "--tile", "16"], "tile size 16 px: expected 32 to 8192"),
        (vec!["chm", "--tile", "64", "--overlap", "40"], "overlap 40 px is more than half the tile (64 px)"),
        (vec!["depth", "--overlap", "400"], "overlap 400 px is more than half the tile"),
    ] {
        let o = edgerun(&args, if args[0] == "chm" { "chmv2_tiny" } else { "da2_relative_p14" }, dir.path());
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}
