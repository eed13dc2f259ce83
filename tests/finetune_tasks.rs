//! `edgerun finetune` for `task = "segmentation"` (SegFormer, PNG class maps) and `task = "chm"`
//! (CHMv2, `.npy` heights): the bundled examples learn and their outputs run in `edgerun segment` /
//! `edgerun chm`; the training forward paths equal the inference ones; bad class maps are refused.
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use edgerun::models::chmv2::{self, Chmv2};
use edgerun::models::training::Trainee;
use edgerun::models::Checkpoint;
use edgerun::models::segformer::{self, SegformerForSemanticSegmentation};
use edgerun::tensor_io::read_tensors;
use edgerun::train::select::{select, TrainSpec};
use edgerun::weights::{Trainable, Vb, WeightStore};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn edgerun(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_edgerun")).args(["--threads", "1"]).args(args).output().unwrap()
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// An example config with `model`, `data` and `out` made absolute (`data` replaced when given).
fn config(dir: &Path, example: &str, data: Option<&Path>, extra: &str) -> PathBuf {
    let text = std::fs::read_to_string(root().join("examples").join(example)).unwrap();
    let mut lines = Vec::new();
    for l in text.lines() {
        let key = l.split('=').next().unwrap_or("").trim();
        let value = l.split_once('=').map(|(_, v)| v.trim().trim_matches('"')).unwrap_or("");
        match key {
            "model" => lines.push(format!("model = {:?}", root().join("examples").join(value))),
            "data" => lines.push(format!("data = {:?}", data.map(Path::to_path_buf).unwrap_or_else(|| root().join("examples").join(value)))),
            "out" => lines.push(format!("out = {:?}", dir.join("out"))),
            k if extra.lines().any(|e| e.split('=').next().unwrap_or("").trim() == k) => {}
            _ => lines.push(l.to_string()),
        }
    }
    let p = dir.join("finetune.toml");
    std::fs::write(&p, format!("{}\n{extra}\n", lines.join("\n"))).unwrap();
    p
}

fn val_losses(out: &Path) -> Vec<f64> {
    std::fs::read_to_string(out.join("log.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["val_loss"].as_f64())
        .collect()
}

fn tensor(dir: &Path, name: &str) -> Vec<f32> {
    let store = WeightStore::open(dir).unwrap();
    store.tensor(name, DType::F32, &Device::Cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

/// Runs an example to the end; checks that it learns and that `best/` serves `command`.
fn example_learns(example: &str, command: &str, image: &str, suffix: &str) -> (tempfile::TempDir, PathBuf) {
    let t = tempfile::tempdir().unwrap();
    let o = edgerun(&["finetune", "--config", config(t.path(), example, None, "").to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    let out = t.path().join("out");
    let val = val_losses(&out);
    assert!(val.len() >= 4, "{val:?}");
    let best = val.iter().cloned().fold(f64::INFINITY, f64::min);
    assert!(best < 0.5 * val[0], "{example}: the validation loss does not halve: {val:?}");
    let served = t.path().join("served");
    let o = edgerun(&[command, "--model", out.join("best").to_str().unwrap(), root().join(image).to_str().unwrap(), "--out", served.to_str().unwrap()]);
    assert!(o.status.success(), "{command} on the fine-tuned model: {}", text(&o));
    let stem = Path::new(image).file_stem().unwrap().to_str().unwrap();
    assert!(served.join(format!("{stem}{suffix}")).is_file(), "{}", text(&o));
    (t, out)
}

#[test]
fn segmentation_example_learns_and_its_model_segments() {
    let (_t, out) = example_learns("finetune_segmentation.toml", "segment", "examples/finetune/segmentation/images/tile_00.png", ".seg.png");
    let miou: Vec<f64> = std::fs::read_to_string(out.join("log.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["val_miou"].as_f64())
        .collect();
    assert!(miou.len() >= 4 && miou[miou.len() - 1] > 0.7 && miou[miou.len() - 1] > miou[0] + 0.3, "validation mIoU {miou:?}");
    let fixture = root().join("tests/fixtures/segformer_tiny");
    let best = out.join("best");
    // Integer buffers keep their dtype (transformers' `num_batches_tracked` is int64).
    let store = WeightStore::open(&best).unwrap();
    assert_eq!(store.entries()["decode_head.batch_norm.num_batches_tracked"].dtype.plain(), Some(DType::I64));
    // BatchNorm statistics never train; every parameter moved.
    assert_eq!(tensor(&best, "decode_head.batch_norm.running_var"), tensor(&fixture, "decode_head.batch_norm.running_var"));
    for n in ["decode_head.classifier.weight", "decode_head.batch_norm.weight", "segformer.encoder.patch_embeddings.0.proj.weight"] {
        assert_ne!(tensor(&best, n), tensor(&fixture, n), "{n}");
    }
}

/// Label smoothing, CutMix + MixUp and hard-example sampling on the segmentation example: the run
/// finishes, still learns, logs and shows mIoU with the validation curve.
#[test]
fn segmentation_learns_with_smoothing_mixing_and_hard_examples() {
    let t = tempfile::tempdir().unwrap();
    let extra = "epochs = 20\nlabel_smoothing = 0.1\nmixup_alpha = 0.4\ncutmix_alpha = 1.0\nhard_examples = 0.5";
    let o = edgerun(&["finetune", "--config", config(t.path(), "finetune_segmentation.toml", None, extra).to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    let val = val_losses(&t.path().join("out"));
    // 9 training images, batch 3: 3 steps per epoch; validated after each of the 20 epochs and at
    // steps 10, 20, 40 and 50 (val_every = 10).
    assert_eq!(val.len(), 24, "{val:?}");
    let best = val.iter().cloned().fold(f64::INFINITY, f64::min);
    assert!(best < 0.7 * val[0], "{val:?}");
    assert!(text(&o).contains("validation curve (last 5 of 24 points)") && text(&o).contains("val_miou"), "{}", text(&o));
}

#[test]
fn chm_example_learns_and_its_model_maps_heights() {
    let (_t, out) = example_learns("finetune_chm.toml", "chm", "examples/finetune/chm/images/plot_00.png", ".chm.npy");
    let fixture = root().join("tests/fixtures/chmv2_tiny");
    for n in ["head.conv_depth.head.4.weight", "backbone.layer.0.attention.k_proj.weight"] {
        assert_ne!(tensor(&out.join("best"), n), tensor(&fixture, n), "{n}");
    }
}

/// Copies the example's segmentation data into `dir/data`.
fn segmentation_data(dir: &Path) -> PathBuf {
    let data = dir.join("data");
    for sub in ["images", "targets"] {
        std::fs::create_dir_all(data.join(sub)).unwrap();
        for e in std::fs::read_dir(root().join("examples/finetune/segmentation").join(sub)).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), data.join(sub).join(e.file_name())).unwrap();
        }
    }
    data
}

fn write_png(path: &Path, color: png::ColorType, w: u32, h: u32, data: &[u8]) {
    let mut enc = png::Encoder::new(std::fs::File::create(path).unwrap(), w, h);
    enc.set_color(color);
    enc.set_depth(png::BitDepth::Eight);
    enc.write_header().unwrap().write_image_data(data).unwrap();
}

#[test]
fn bad_class_maps_are_refused_naming_the_file() {
    let cases: [(&str, png::ColorType, Vec<u8>, &str); 3] = [
        ("a class the model lacks", png::ColorType::Grayscale, vec![7u8; 64 * 64], "class id 7 is not one of the model's 3 classes"),
        ("an RGB class map", png::ColorType::Rgb, vec![1u8; 3 * 64 * 64], "8-bit grayscale or palette PNG"),
        ("a map of another size", png::ColorType::Grayscale, vec![1u8; 32 * 64], "target is 32×64"),
    ];
    for (what, color, bytes, expect) in cases {
        let t = tempfile::tempdir().unwrap();
        let data = segmentation_data(t.path());
        let bad = data.join("targets/tile_05.png");
        let h = (bytes.len() / if color == png::ColorType::Rgb { 3 * 64 } else { 64 }) as u32;
        write_png(&bad, color, 64, h, &bytes);
        let o = edgerun(&["finetune", "--config", config(t.path(), "finetune_segmentation.toml", Some(&data), "epochs = 1").to_str().unwrap()]);
        let e = text(&o);
        assert_eq!(o.status.code(), Some(2), "{what}: {e}");
        assert!(e.contains(bad.to_str().unwrap()) && e.contains(expect), "{what}: {e}");
        assert!(!e.contains("panicked"), "{e}");
        assert!(!t.path().join("out/last").exists() && !t.path().join("out/best").exists(), "{what}: no model written");
    }
}

#[test]
fn settings_that_do_not_fit_the_task_are_refused() {
    let t = tempfile::tempdir().unwrap();
    for (extra, expect) in [
        ("loss = \"silog\"", "`silog` does not fit task `segmentation`"),
        ("checkpoint_activations = true", "checkpoint_activations / offload: supported for the ViT backbones of tasks `depth` and `chm`"),
        ("loss = \"focal\"\nlabel_smoothing = 0.1", "label_smoothing: is defined for loss `cross_entropy` only"),
    ] {
        let o = edgerun(&["finetune", "--config", config(t.path(), "finetune_segmentation.toml", None, extra).to_str().unwrap()]);
        assert_eq!(o.status.code(), Some(2), "{extra}: {}", text(&o));
        assert!(text(&o).contains(expect), "{extra}: {}", text(&o));
    }
    let o = edgerun(&["finetune", "--config", config(t.path(), "finetune_segmentation.toml", None, "").to_str().unwrap(), "--task", "chm"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("task `chm` fine-tunes CHMv2 checkpoints") && text(&o).contains("`segformer`"), "{}", text(&o));
}

/// `fixture` loaded for training (`spec`'s tensors as Vars) as a task model.
fn training_model(fixture: &str, spec: TrainSpec) -> Box<dyn Trainee> {
    let ckpt = Checkpoint::open(&root().join(fixture)).unwrap();
    let names: Vec<String> = ckpt.store().entries().keys().cloned().collect();
    let chosen = select(&ckpt.family().training().unwrap(), spec, &names).unwrap();
    let vb = Vb::new(ckpt.store().clone(), DType::F32, Device::Cpu).with_trainable(Trainable::new(move |n| chosen.contains(n)));
    ckpt.trainee(&vb).unwrap()
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> (f32, f32) {
    assert_eq!(a.dims(), b.dims());
    let a = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let b = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let err = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    (err, b.iter().fold(1f32, |m, v| m.max(v.abs())))
}

/// The unfolded SegFormer head (separate `linear_fuse` and eval-mode BatchNorm) that training uses
/// reproduces transformers' logits on the fixture, as the folded inference head does.
#[test]
fn segformer_training_head_matches_transformers() {
    let dir = root().join("tests/fixtures/segformer_tiny");
    let input = read_tensors(&dir.join("input.safetensors"), DType::F32, &Device::Cpu).unwrap();
    let expected = read_tensors(&dir.join("expected.safetensors"), DType::F32, &Device::Cpu).unwrap();
    let x = &input["pixel_values"];
    for spec in [TrainSpec::Head, TrainSpec::All] {
        let m = training_model("tests/fixtures/segformer_tiny", spec);
        let got = m.decode(&m.features(x).unwrap()).unwrap();
        let (err, scale) = max_abs_diff(&got, &expected["logits"]);
        assert!(err <= 1e-4 * scale, "{spec:?}: max error {err} (scale {scale})");
    }
    let store = Arc::new(WeightStore::open(&dir).unwrap());
    let inference = SegformerForSemanticSegmentation::load(&Vb::new(store.clone(), DType::F32, Device::Cpu), &segformer::Config::from_json(store.config()).unwrap()).unwrap();
    let (err, scale) = max_abs_diff(&inference.forward(x).unwrap(), &expected["logits"]);
    assert!(err <= 1e-4 * scale, "inference head: {err}");
}

/// CHMv2's training path (backbone features, then the head and bins) equals its inference forward.
#[test]
fn chmv2_training_path_equals_inference() {
    let dir = root().join("tests/fixtures/chmv2_tiny");
    let input = read_tensors(&dir.join("input.safetensors"), DType::F32, &Device::Cpu).unwrap();
    let x = input.values().next().unwrap();
    let store = Arc::new(WeightStore::open(&dir).unwrap());
    let inference = Chmv2::load(&Vb::new(store.clone(), DType::F32, Device::Cpu), &chmv2::Config::from_json(store.config()).unwrap()).unwrap();
    let want = inference.forward(x).unwrap();
    let m = training_model("tests/fixtures/chmv2_tiny", TrainSpec::Last(1));
    let (err, scale) = max_abs_diff(&m.decode(&m.features(x).unwrap()).unwrap(), &want);
    assert!(err <= 1e-5 * scale, "max error {err} (scale {scale})");
}
