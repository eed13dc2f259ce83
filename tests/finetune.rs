//! `edgerun finetune` end to end on the bundled example: outputs, log, frozen weights untouched,
//! resume after SIGKILL bit-identical to an uninterrupted run, and bad input refused cleanly.
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use candle_core::{DType, Device};
use edgerun::weights::WeightStore;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Removes a scratch directory when the test passes (kept for inspection when it fails).
struct Cleanup(PathBuf);

impl Drop for Cleanup {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// A fresh scratch directory.
fn tmp(name: &str) -> (PathBuf, Cleanup) {
    let d = std::env::temp_dir().join(format!("edgerun-finetune-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    (d.clone(), Cleanup(d))
}

/// The example's settings with `out` replaced (and `extra` lines appended).
fn config(dir: &Path, out: &Path, extra: &str) -> PathBuf {
    let text = std::fs::read_to_string(root().join("examples/finetune.toml")).unwrap();
    let text: String = text
        .lines()
        .filter(|l| {
            let key = l.split('=').next().unwrap_or("").trim();
            !["out", "model", "data"].contains(&key) && !extra.lines().any(|e| e.split('=').next().unwrap_or("").trim() == key)
        })
        .map(|l| format!("{l}\n"))
        .collect();
    let p = dir.join("finetune.toml");
    let model = root().join("tests/fixtures/da2_metric_p14");
    let data = root().join("examples/finetune/data");
    std::fs::write(&p, format!("model = {model:?}\ndata = {data:?}\nout = {out:?}\n{text}{extra}\n")).unwrap();
    p
}

fn edgerun(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_edgerun"));
    c.args(["--threads", "1", "finetune"]).args(args);
    c
}

fn run(args: &[&str]) -> Output {
    edgerun(args).output().unwrap()
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn tensor_bytes(dir: &Path, name: &str) -> Vec<u8> {
    let store = WeightStore::open(dir).unwrap();
    let t = store.tensor(name, DType::F32, &Device::Cpu).unwrap();
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().flat_map(|v| v.to_le_bytes()).collect()
}

#[test]
fn the_example_trains_the_head_and_writes_loadable_models() {
    let (dir, _cleanup) = tmp("example");
    let out = dir.join("out");
    let o = run(&["--config", config(&dir, &out, "").to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    let log = std::fs::read_to_string(out.join("log.jsonl")).unwrap();
    let steps: Vec<serde_json::Value> = log.lines().map(|l| serde_json::from_str(l).unwrap()).filter(|v: &serde_json::Value| v.get("loss").is_some()).collect();
    // 9 training images, batch 2 → 5 micro-batches, accumulate 2 → 3 steps per epoch, 20 epochs.
    assert_eq!(steps.len(), 60);
    assert!(steps.iter().all(|s| s["lr"].as_f64().unwrap() > 0.0 && s["loss"].as_f64().unwrap().is_finite()));
    let val_lines: Vec<serde_json::Value> = log.lines().filter(|l| l.contains("val_loss")).map(|l| serde_json::from_str(l).unwrap()).collect();
    let val: Vec<f64> = val_lines.iter().map(|v| v["val_loss"].as_f64().unwrap()).collect();
    // Validated at the end of every epoch (every 3 steps) and every val_every = 10 steps.
    let val_steps: Vec<u64> = val_lines.iter().map(|v| v["step"].as_u64().unwrap()).collect();
    let want: Vec<u64> = (1..=60).filter(|s| s % 3 == 0 || s % 10 == 0).collect();
    assert_eq!(val_steps, want);
    // The task is learnable: the validation loss at least halves.
    assert!(val[val.len() - 1] < 0.5 * val[0], "validation losses {val:?}");
    // The end of the run shows the last five points of the validation curve.
    let shown = text(&o);
    assert!(shown.contains(&format!("validation curve (last 5 of {} points)", val.len())), "{shown}");
    for (s, v) in val_steps.iter().zip(&val).skip(val.len() - 5) {
        assert!(shown.contains(&format!("step {s:>6}  val_loss {v:.5}")), "step {s}: {shown}");
    }
    let fixture = root().join("tests/fixtures/da2_metric_p14");
    for d in ["last", "best"] {
        let m = out.join(d);
        let store = std::sync::Arc::new(WeightStore::open(&m).unwrap());
        edgerun::models::load(store, &Device::Cpu, DType::F32).unwrap();
        // Frozen backbone bit-identical; the head moved.
        let frozen = "backbone.encoder.layer.0.attention.attention.query.weight";
        assert_eq!(tensor_bytes(&m, frozen), tensor_bytes(&fixture, frozen));
        assert_ne!(tensor_bytes(&m, "head.conv3.weight"), tensor_bytes(&fixture, "head.conv3.weight"));
    }
    // Running again finds the finished state and changes nothing.
    let before = std::fs::read(out.join("last/model.safetensors")).unwrap();
    let o = run(&["--config", config(&dir, &out, "").to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("0 of 60 steps taken"), "{}", text(&o));
    assert!(text(&o).contains("validation curve (last 5 of 24 points)"), "the curve is read back from the log: {}", text(&o));
    assert_eq!(std::fs::read(out.join("last/model.safetensors")).unwrap(), before);
}

/// Kills a run with SIGKILL once its log has `lines` lines, then reruns it to the end.
fn killed_then_resumed(dir: &Path, out: &Path, cfg: &Path, lines: usize) {
    let mut child = edgerun(&["--config", cfg.to_str().unwrap()]).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    let start = Instant::now();
    loop {
        let n = std::fs::read_to_string(out.join("log.jsonl")).map(|s| s.lines().count()).unwrap_or(0);
        if n >= lines || start.elapsed() > Duration::from_secs(60) {
            break;
        }
        assert!(child.try_wait().unwrap().is_none(), "the run finished before it could be killed after {lines} log lines");
        std::thread::sleep(Duration::from_millis(5));
    }
    let _ = child.kill();
    let _ = child.wait();
    let o = run(&["--config", cfg.to_str().unwrap()]);
    assert!(o.status.success(), "resume in {}: {}", dir.display(), text(&o));
    assert!(!text(&o).contains(" 0 of "), "the killed run had already finished: {}", text(&o));
}

#[test]
fn a_run_killed_at_any_point_resumes_to_bit_identical_weights() {
    let (dir, _cleanup) = tmp("resume");
    let extra = "epochs = 6\nsave_every = 2\nval_every = 3\naugment = true";
    let whole = dir.join("whole");
    let o = run(&["--config", config(&dir, &whole, extra).to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    let want_last = std::fs::read(whole.join("last/model.safetensors")).unwrap();
    let want_best = std::fs::read(whole.join("best/model.safetensors")).unwrap();
    let want_log = std::fs::read_to_string(whole.join("log.jsonl")).unwrap();
    for lines in [1, 4, 9, 15] {
        let out = dir.join(format!("killed-{lines}"));
        let cfg = config(&dir, &out, extra);
        killed_then_resumed(&dir, &out, &cfg, lines);
        assert!(std::fs::read(out.join("last/model.safetensors")).unwrap() == want_last, "killed after {lines} log lines: last/ differs");
        assert!(std::fs::read(out.join("best/model.safetensors")).unwrap() == want_best, "killed after {lines} log lines: best/ differs");
        assert_eq!(std::fs::read_to_string(out.join("log.jsonl")).unwrap(), want_log, "killed after {lines} log lines");
    }
}

/// CutMix, MixUp and hard-example sampling on: a run killed at any point and resumed ends
/// bit-identical (the mix of a step is drawn from the seed, the per-sample losses are in the state);
/// and the techniques change the run.
#[test]
fn mixing_and_hard_examples_resume_to_bit_identical_weights() {
    let (dir, _cleanup) = tmp("techniques");
    let plain = "epochs = 6\nsave_every = 2\nval_every = 4\naugment = true";
    let extra = format!("{plain}\nmixup_alpha = 0.4\ncutmix_alpha = 1.0\nswitch_prob = 0.5\nhard_examples = 0.6");
    let whole = dir.join("whole");
    let o = run(&["--config", config(&dir, &whole, &extra).to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    let want_last = std::fs::read(whole.join("last/model.safetensors")).unwrap();
    let want_log = std::fs::read_to_string(whole.join("log.jsonl")).unwrap();
    let state = WeightStore::open(whole.join("state/state.safetensors")).unwrap();
    for k in ["hard.latest", "hard.epoch"] {
        let v = state.tensor(k, DType::F32, &Device::Cpu).unwrap().to_vec1::<f32>().unwrap();
        assert!(v.len() == 9 && v.iter().all(|&l| l >= 0.0), "{k}: {v:?}");
    }
    for lines in [5, 13] {
        let out = dir.join(format!("killed-{lines}"));
        let cfg = config(&dir, &out, &extra);
        killed_then_resumed(&dir, &out, &cfg, lines);
        assert!(std::fs::read(out.join("last/model.safetensors")).unwrap() == want_last, "killed after {lines} log lines: last/ differs");
        assert_eq!(std::fs::read_to_string(out.join("log.jsonl")).unwrap(), want_log, "killed after {lines} log lines");
    }
    let off = dir.join("off");
    let o = run(&["--config", config(&dir, &off, plain).to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(std::fs::read(off.join("last/model.safetensors")).unwrap() != want_last, "mixing and hard examples change the run");
}

#[test]
fn new_settings_are_bounded_and_named() {
    let (dir, _cleanup) = tmp("techniques-bad");
    let out = dir.join("out");
    for (extra, says) in [
        ("label_smoothing = 0.1", "label_smoothing: smooths the segmentation cross-entropy; task `depth`"),
        ("label_smoothing = 1.0", "label_smoothing: 1 is outside [0, 1)"),
        ("hard_examples = 1.0", "hard_examples: 1 is outside [0, 1)"),
        ("hard_examples = -0.1", "hard_examples"),
        ("mix_prob = 1.5", "mix_prob: 1.5 is outside [0, 1]"),
        ("switch_prob = -0.5", "switch_prob"),
        ("mixup_alpha = -1.0", "mixup_alpha: -1 is outside [0, 100]"),
        ("cutmix_alpha = 1e9", "cutmix_alpha"),
        ("cutmix_alpha = nan", "cutmix_alpha"),
        ("mixup_alpha = 0.2\nbatch = 1", "batch must be at least 2"),
    ] {
        let o = run(&["--config", config(&dir, &out, extra).to_str().unwrap()]);
        assert_eq!(o.status.code(), Some(2), "{extra}: {}", text(&o));
        assert!(text(&o).contains(says), "{extra}: {}", text(&o));
        assert!(!out.join("last").exists(), "{extra}");
    }
}

#[test]
fn command_line_settings_win_over_the_file() {
    let (dir, _cleanup) = tmp("flags");
    let out = dir.join("out");
    let cfg = config(&dir, &out, "");
    let o = run(&["--config", cfg.to_str().unwrap(), "--epochs", "1", "--accumulate", "1", "--train", "last:1", "--input-size", "28x42"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("5 of 5 steps taken"), "{}", text(&o));
    let m = out.join("last");
    let fixture = root().join("tests/fixtures/da2_metric_p14");
    let last_block = "backbone.encoder.layer.3.mlp.fc1.weight";
    assert_ne!(tensor_bytes(&m, last_block), tensor_bytes(&fixture, last_block), "last:1 trains the last block");
    let first_block = "backbone.encoder.layer.2.mlp.fc1.weight";
    assert_eq!(tensor_bytes(&m, first_block), tensor_bytes(&fixture, first_block));
}

/// Copies the example data into `dir/data` for a test to damage.
fn copy_data(dir: &Path) -> PathBuf {
    let src = root().join("examples/finetune/data");
    let data = dir.join("data");
    for sub in ["images", "targets"] {
        std::fs::create_dir_all(data.join(sub)).unwrap();
        for e in std::fs::read_dir(src.join(sub)).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), data.join(sub).join(e.file_name())).unwrap();
        }
    }
    data
}

#[test]
fn bad_input_is_refused_with_the_file_or_setting_named() {
    let (dir, _cleanup) = tmp("bad");
    let out = dir.join("out");
    let cfg = config(&dir, &out, "");
    let cfg = cfg.to_str().unwrap();

    let data = copy_data(&dir.join("missing"));
    std::fs::remove_file(data.join("targets/scene_03.npy")).unwrap();
    let o = run(&["--config", cfg, "--data", data.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("scene_03.npy is missing"), "{}", text(&o));

    let data = copy_data(&dir.join("size"));
    edgerun::imageio::npy::write_npy_f32(&data.join("targets/scene_05.npy"), &[10, 12], &[1.0; 120]).unwrap();
    let o = run(&["--config", cfg, "--data", data.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("scene_05.npy: target is 10×12"), "{}", text(&o));

    for (flag, value, says) in [("--train", "last:9", "the backbone has 4 blocks"), ("--train", "tail", "train = `tail`"), ("--input-size", "50x70", "multiple of the patch size 14"), ("--epochs", "0", "epochs"), ("--task", "segmentation", "task")] {
        let o = run(&["--config", cfg, flag, value]);
        assert_eq!(o.status.code(), Some(2), "{flag} {value}: {}", text(&o));
        assert!(text(&o).contains(says), "{flag} {value}: {}", text(&o));
    }
    assert!(!out.join("last").exists() && !out.join("best").exists());
}

#[test]
fn a_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint() {
    let (dir, _cleanup) = tmp("nan");
    let out = dir.join("out");
    let data = copy_data(&dir);
    let cfg = config(&dir, &out, "");
    let o = run(&["--config", cfg.to_str().unwrap(), "--data", data.to_str().unwrap(), "--epochs", "2"]);
    assert!(o.status.success(), "{}", text(&o));
    let good = std::fs::read(out.join("last/model.safetensors")).unwrap();
    // A model with a NaN weight over the same out dir is refused as a changed setting, so nothing
    // is written; in a fresh out dir it shows the NaN-loss error itself.
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    // The metric model ends in a sigmoid, which passes a NaN on (a ReLU would turn it into 0).
    let fixture = root().join("tests/fixtures/da2_metric_p14");
    std::fs::copy(fixture.join("config.json"), model.join("config.json")).unwrap();
    let mut tensors = edgerun::tensor_io::read_tensors(&fixture.join("model.safetensors"), DType::F32, &Device::Cpu).unwrap();
    let w = tensors["head.conv3.bias"].clone();
    tensors.insert("head.conv3.bias".into(), (w * f64::NAN).unwrap());
    edgerun::tensor_io::write_tensors(&model.join("model.safetensors"), &tensors).unwrap();
    let o = run(&["--config", cfg.to_str().unwrap(), "--data", data.to_str().unwrap(), "--epochs", "2", "--model", model.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("other settings"), "{}", text(&o));
    assert_eq!(std::fs::read(out.join("last/model.safetensors")).unwrap(), good);
    let fresh = dir.join("fresh");
    let o = run(&["--config", cfg.to_str().unwrap(), "--data", data.to_str().unwrap(), "--model", model.to_str().unwrap(), "--out", fresh.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("the loss is NaN at step 0"), "{}", text(&o));
    assert!(!fresh.join("last").exists());
}

#[test]
fn print_config_is_a_valid_config() {
    let o = run(&["--print-config"]);
    assert!(o.status.success());
    let text = String::from_utf8(o.stdout).unwrap();
    let c = edgerun::train::config::FinetuneConfig::from_toml(&text, Path::new(".")).unwrap();
    c.validate().unwrap();
}

#[test]
fn checkpointed_and_offloaded_runs_finish_and_leave_no_spill_file() {
    let (dir, _cleanup) = tmp("offload");
    for flag in ["--checkpoint-activations", "--offload"] {
        let out = dir.join(flag.trim_start_matches('-'));
        let cfg = config(&dir, &out, "");
        let o = run(&["--config", cfg.to_str().unwrap(), "--epochs", "1", "--train", "last:2", flag]);
        assert!(o.status.success(), "{flag}: {}", text(&o));
        assert!(text(&o).contains("3 of 3 steps taken"), "{flag}: {}", text(&o));
        assert!(!out.join("state/activations.spill").exists(), "{flag}: the spill file is removed");
        let m = out.join("last");
        let fixture = root().join("tests/fixtures/da2_metric_p14");
        let trained = "backbone.encoder.layer.2.mlp.fc1.weight";
        assert_ne!(tensor_bytes(&m, trained), tensor_bytes(&fixture, trained), "{flag}: last:2 trains block 2");
    }
}

#[test]
fn a_quantized_backbone_stays_quantized_and_the_head_trains() {
    let (dir, _cleanup) = tmp("gguf");
    let gguf = dir.join("model-q8_0.gguf");
    let fixture = root().join("tests/fixtures/da2_metric_p14");
    let q = Command::new(env!("CARGO_BIN_EXE_edgerun")).args(["quantize", fixture.to_str().unwrap(), gguf.to_str().unwrap(), "--type", "q8_0"]).output().unwrap();
    assert!(q.status.success(), "{}", text(&q));
    let out = dir.join("out");
    let o = run(&["--config", config(&dir, &out, "").to_str().unwrap(), "--model", gguf.to_str().unwrap(), "--epochs", "2"]);
    assert!(o.status.success(), "{}", text(&o));
    // The output is a safetensors model directory with the hub names; the head moved.
    let m = out.join("best");
    let store = WeightStore::open(&m).unwrap();
    assert_eq!(store.entries().len(), WeightStore::open(&fixture).unwrap().entries().len());
    assert_ne!(tensor_bytes(&m, "head.conv3.weight"), tensor_bytes(&fixture, "head.conv3.weight"));
}
