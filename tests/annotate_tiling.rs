//! `annotate` with `tile` / `overlap` in a stage: tiled inputs get one tiled GeoTIFF per stage,
//! equal to `edgerun chm/segment --tile`'s, journalled and skipped on a rerun; edges of a tiled depth
//! map are recorded as failed with the reason; untiled stages of the same input run as before.
mod common;

use std::path::Path;
use std::process::Command;

use common::{device_arg, fixture};
use edgerun::annotate::journal::{journal_path, read_records};
use edgerun::annotate::{self, Config, RunOptions, Shard, StageKind, Status};
use edgerun::geotiff::{read_f32, GeoReference};

fn input_tree(root: &Path) {
    std::fs::create_dir_all(root.join("tiles")).unwrap();
    std::fs::copy(fixture("chmv2_geotiff").join("scene.tif"), root.join("tiles/scene.tif")).unwrap();
    std::fs::copy(fixture("chmv2_geotiff").join("plain.png"), root.join("plain.png")).unwrap();
}

fn config() -> Config {
    let mut c = Config {
        stages: vec![StageKind::Depth, StageKind::Edges, StageKind::Segmentation, StageKind::Chm],
        device: device_arg(),
        batch: edgerun::runner::BatchSetting::Fixed(2),
        ..Default::default()
    };
    c.depth.model = fixture("da2_relative_p14").to_string_lossy().into_owned();
    c.segmentation.model = fixture("segformer_tiny").to_string_lossy().into_owned();
    c.segmentation.input_size = vec![32, 32];
    c.chm.model = fixture("chmv2_tiny").to_string_lossy().into_owned();
    c.progress.mode = "none".into();
    c
}

fn run(cfg: &Config, input: &Path, out: &Path) -> annotate::Summary {
    annotate::run(&RunOptions { config: cfg.clone(), input: input.into(), output: out.into(), shard: Shard::default(), retry_failed: false, rescan: false }).unwrap()
}

/// `edgerun <cmd> --tile 32 --overlap 8` on one input, into `out`.
fn direct(cmd: &str, model: &str, input: &Path, out: &Path) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_edgerun"));
    c.args([cmd, "--tile", "32", "--overlap", "8", "--batch", "2", "--progress", "none", "--device"]).arg(device_arg()).arg("--model").arg(fixture(model));
    if cmd == "segment" {
        c.args(["--size", "32x32"]);
    }
    let o = c.arg(input).arg("--out").arg(out).output().unwrap();
    assert!(o.status.success(), "{cmd}: {}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn tiled_stages_write_the_direct_commands_geotiffs_and_resume() {
    let t = tempfile::tempdir().unwrap();
    let input = t.path().join("in");
    input_tree(&input);
    let mut cfg = config();
    (cfg.chm.tile, cfg.chm.overlap) = (Some(32), Some(8));
    (cfg.segmentation.tile, cfg.segmentation.overlap) = (Some(32), Some(8));
    let out = t.path().join("out");
    let s = run(&cfg, &input, &out);
    assert_eq!((s.processed, s.failed), (2, 0), "{}", s.render());
    for st in ["depth", "edges", "segmentation", "chm"] {
        assert_eq!(s.stages[st].done, 2, "{st}");
    }
    // Depth is not tiled (a 50×37 GeoTIFF is far under the automatic threshold): the usual outputs.
    assert!(out.join("depth/tiles/scene.npy").is_file() && out.join("edges/tiles/scene.npy").is_file());
    assert!(!out.join("depth/tiles/scene.tif").exists());

    // The tiled outputs equal the direct commands' and keep the georeferencing.
    let direct_out = t.path().join("direct");
    let scene = input.join("tiles/scene.tif");
    direct("chm", "chmv2_tiny", &scene, &direct_out);
    direct("segment", "segformer_tiny", &scene, &direct_out);
    let (w, h, got) = read_f32(&out.join("chm/tiles/scene.tif")).unwrap();
    let (_, _, want) = read_f32(&direct_out.join("scene.chm.tif")).unwrap();
    assert_eq!((w, h, got.len()), (50, 37, want.len()));
    for (a, b) in got.iter().zip(&want) {
        assert!(a == b || (a - b).abs() <= 1e-5 * b.abs().max(1.0), "{a} vs {b}");
    }
    let seg = std::fs::read(out.join("segmentation/tiles/scene.tif")).unwrap();
    assert_eq!(seg, std::fs::read(direct_out.join("scene.seg.tif")).unwrap(), "segmentation GeoTIFF bytes");
    let g_in = GeoReference::read(&scene).unwrap().unwrap();
    let g_out = GeoReference::read(&out.join("chm/tiles/scene.tif")).unwrap().unwrap();
    assert_eq!((g_out.pixel_scale(), g_out.tiepoints()), (g_in.pixel_scale(), g_in.tiepoints()));
    // A tile set in the config tiles every input of the stage, PNGs included (no georeferencing).
    assert!(GeoReference::read(&out.join("chm/plain.tif")).unwrap().is_none());
    assert!(!out.join("chm/plain.npy").exists() && !out.join("chm/tiles/scene.npy").exists());

    let recs = read_records(&journal_path(&out, StageKind::Chm, "")).unwrap();
    let r = recs.iter().find(|r| r.input == "tiles/scene.tif").unwrap();
    assert_eq!(r.status, Status::Ok);
    assert_eq!(r.outputs, vec!["chm/tiles/scene.tif".to_string()]);

    // A rerun finds every stage done, tiled ones included.
    let again = run(&cfg, &input, &out);
    assert_eq!((again.processed, again.skipped), (0, 2), "{}", again.render());
    assert!(!again.stages["chm"].model_loaded);
}

#[test]
fn edges_of_a_tiled_depth_map_fail_with_the_reason_and_depth_is_written() {
    let t = tempfile::tempdir().unwrap();
    let input = t.path().join("in");
    input_tree(&input);
    let mut cfg = config();
    cfg.stages = vec![StageKind::Depth, StageKind::Edges];
    (cfg.depth.tile, cfg.depth.overlap) = (Some(32), Some(8));
    let out = t.path().join("out");
    let s = run(&cfg, &input, &out);
    assert_eq!((s.processed, s.failed, s.stages["depth"].done, s.stages["edges"].failed), (2, 2, 2, 2), "{}", s.render());
    let (_, _, v) = read_f32(&out.join("depth/tiles/scene.tif")).unwrap();
    assert!(v.iter().any(|x| x.is_finite()));
    let recs = read_records(&journal_path(&out, StageKind::Edges, "")).unwrap();
    assert_eq!(recs.len(), 2);
    for r in recs {
        assert_eq!(r.status, Status::Failed);
        assert!(r.reason.as_deref().unwrap_or("").contains("tiled depth map"), "{:?}", r.reason);
    }
    assert!(s.failures.iter().all(|f| f.stage == "edges"));
}
