//! Drives `config.json` → model construction → one tiny forward pass. The first byte picks a tiny
//! fixture model (its weights are used as they are); the rest, when it parses as a JSON object, is
//! merged into that model's config (two levels deep), so the fuzzer mutates the numbers a hostile
//! config could carry. Errors are fine; panics and aborts are not.
#![no_main]
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock};

use candle_core::{DType, Device, Tensor};
use edgerun::weights::WeightStore;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures");
const MODELS: [&str; 6] = ["da2_tiny", "segformer_tiny", "chmv2_tiny", "da3_mono", "lgatr_tiny", "lgatr_slim_tiny"];

struct Slot {
    dir: PathBuf,
    base: Value,
}

// One directory per model, reused: the weights are linked (or copied) once, config.json is
// rewritten per input. On tmpfs when there is one.
static SLOTS: LazyLock<(tempfile::TempDir, Vec<Slot>)> = LazyLock::new(|| {
    let tmp = tempfile::tempdir_in("/dev/shm").or_else(|_| tempfile::tempdir()).expect("temp dir");
    let slots = MODELS
        .iter()
        .map(|name| {
            let src = Path::new(FIXTURES).join(name);
            let dir = tmp.path().join(name);
            std::fs::create_dir_all(&dir).expect("model dir");
            let w = dir.join("model.safetensors");
            if std::fs::hard_link(src.join("model.safetensors"), &w).is_err() {
                std::fs::copy(src.join("model.safetensors"), &w).expect("weights");
            }
            let base = serde_json::from_slice(&std::fs::read(src.join("config.json")).expect("config")).expect("config json");
            Slot { dir, base }
        })
        .collect();
    (tmp, slots)
});

/// `patch` merged into `base`: objects key by key (recursively), anything else replaced.
fn merge(base: &mut Value, patch: Value, depth: usize) {
    match (base, patch) {
        (Value::Object(b), Value::Object(p)) if depth > 0 => {
            for (k, v) in p {
                match b.get_mut(&k) {
                    Some(slot) => merge(slot, v, depth - 1),
                    None => {
                        b.insert(k, v);
                    }
                }
            }
        }
        (b, p) => *b = p,
    }
}

/// Tiny inputs for the model's forward pass.
fn inputs(model: usize) -> BTreeMap<String, Tensor> {
    let cpu = &Device::Cpu;
    let ramp = |shape: &[usize]| {
        let n: usize = shape.iter().product();
        Tensor::from_vec((0..n).map(|i| ((i * 37) % 17) as f32 / 17.0 - 0.5).collect::<Vec<f32>>(), shape, cpu).expect("input")
    };
    let mut m = BTreeMap::new();
    match MODELS[model] {
        "lgatr_tiny" => {
            m.insert("multivectors".into(), ramp(&[1, 4, 1, 16]));
            m.insert("scalars".into(), ramp(&[1, 4, 2]));
        }
        "lgatr_slim_tiny" => {
            m.insert("vectors".into(), ramp(&[1, 4, 1, 4]));
            m.insert("scalars".into(), ramp(&[1, 4, 2]));
        }
        "da3_mono" => {
            m.insert("pixel_values".into(), ramp(&[1, 3, 28, 28]));
        }
        _ => {
            m.insert("pixel_values".into(), ramp(&[1, 3, 32, 32]));
        }
    }
    m
}

fuzz_target!(|data: &[u8]| {
    let Some((&pick, rest)) = data.split_first() else { return };
    let model = pick as usize % MODELS.len();
    let slot = &SLOTS.1[model];
    let mut cfg = slot.base.clone();
    if let Ok(patch @ Value::Object(_)) = serde_json::from_slice::<Value>(rest) {
        merge(&mut cfg, patch, 2);
    }
    let Ok(text) = serde_json::to_vec(&cfg) else { return };
    if std::fs::write(slot.dir.join("config.json"), text).is_err() {
        return;
    }
    let Ok(store) = WeightStore::open(&slot.dir) else { return };
    let Ok(m) = edgerun::models::load(Arc::new(store), &Device::Cpu, DType::F32) else { return };
    if let Ok(out) = m.forward_named(&inputs(model)) {
        for t in out.values() {
            assert!(t.elem_count() > 0, "{}: a model accepted its config and produced an empty output {:?}", MODELS[model], t.dims());
        }
    }
});
