//! What fine-tuning writes: model directories in the checkpoint's own layout (`config.json` +
//! `model.safetensors`, hub key names) swapped in whole, and the resume state as one atomic file.
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::fsutil::write_atomic;
use crate::models::NamedTensors;
use crate::weights::WeightStore;

/// Writes `dir` (e.g. `<out>/best`) as a model directory: every tensor of `store` under its stored
/// name, replaced by `updated` where it trains, plus `extra` files (the model's preprocessing). The
/// directory is built beside `dir` and swapped in with renames, so `dir` is at every moment either
/// the previous complete model or the new one.
pub(crate) fn save_model_dir(store: &WeightStore, updated: &HashMap<String, Tensor>, extra: &[(&str, &[u8])], dir: &Path) -> Result<()> {
    let (tmp, old) = siblings(dir)?;
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    let mut tensors = NamedTensors::new();
    for (name, entry) in store.entries() {
        let t = match updated.get(name) {
            Some(t) => t.clone(),
            None => {
                // Floats and integer buffers (BatchNorm's `num_batches_tracked`) keep their dtype;
                // quantized blocks are written as f32.
                let keep = entry.dtype.plain().filter(|d| matches!(d, DType::F32 | DType::F16 | DType::BF16 | DType::I64 | DType::U32 | DType::U8)).unwrap_or(DType::F32);
                store.tensor(name, keep, &Device::Cpu)?
            }
        };
        tensors.insert(name.clone(), t);
    }
    let config = serde_json::to_vec_pretty(store.config()).map_err(|e| Error::bad_file(&tmp, e.to_string()))?;
    write_atomic(tmp.join("config.json"), &config)?;
    for (name, bytes) in extra {
        write_atomic(tmp.join(name), bytes)?;
    }
    crate::tensor_io::write_tensors(&tmp.join("model.safetensors"), &tensors)?;
    if dir.exists() {
        if old.exists() {
            std::fs::remove_dir_all(&old).map_err(|e| Error::io(&old, e))?;
        }
        std::fs::rename(dir, &old).map_err(|e| Error::io(dir, e))?;
    }
    std::fs::rename(&tmp, dir).map_err(|e| Error::io(dir, e))?;
    if old.exists() {
        std::fs::remove_dir_all(&old).map_err(|e| Error::io(&old, e))?;
    }
    Ok(())
}

/// Finishes a swap that a crash interrupted: `dir` missing but its `.old` copy present → put it back.
pub(crate) fn recover_model_dir(dir: &Path) -> Result<()> {
    let (tmp, old) = siblings(dir)?;
    if !dir.exists() && old.is_dir() {
        std::fs::rename(&old, dir).map_err(|e| Error::io(dir, e))?;
    }
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    }
    Ok(())
}

fn siblings(dir: &Path) -> Result<(PathBuf, PathBuf)> {
    let name = dir.file_name().and_then(|n| n.to_str()).ok_or_else(|| Error::bad_file(dir, "not a directory name"))?;
    let parent = dir.parent().unwrap_or(Path::new("."));
    Ok((parent.join(format!(".{name}.tmp")), parent.join(format!(".{name}.old"))))
}

/// Everything besides tensors that resume needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct StateMeta {
    /// Optimiser steps taken.
    pub step: usize,
    /// AdamW's own step count.
    pub adam_steps: u64,
    /// Best validation loss so far (None before the first validation).
    pub best_val: Option<f64>,
    /// Length of `log.jsonl` when the state was saved (later lines are dropped on resume).
    pub log_len: u64,
    /// The training-relevant config, which a resume must match.
    pub fingerprint: String,
}

const META_KEY: &str = "edgerun.finetune";

/// Writes the state (tensors + meta) atomically to `path`.
pub(crate) fn save_state(path: &Path, tensors: &[(String, Tensor)], meta: &StateMeta) -> Result<()> {
    let mut cpu = Vec::with_capacity(tensors.len());
    for (n, t) in tensors {
        cpu.push((n.clone(), t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.contiguous()?));
    }
    let json = serde_json::to_string(meta).map_err(|e| Error::bad_file(path, e.to_string()))?;
    let info = HashMap::from([(META_KEY.to_string(), json)]);
    let views: Vec<(&str, &Tensor)> = cpu.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let bytes = safetensors::serialize(views, Some(info)).map_err(|e| Error::bad_file(path, e.to_string()))?;
    write_atomic(path, &bytes)
}

/// Reads a state written by [`save_state`] (validated like any weight file).
pub(crate) fn load_state(path: &Path, device: &Device) -> Result<(HashMap<String, Tensor>, StateMeta)> {
    let store = WeightStore::open(path)?;
    let json = match store.metadata().get(META_KEY) {
        Some(crate::weights::MetaValue::String(s)) => s.clone(),
        _ => return Err(Error::bad_file(path, format!("no `{META_KEY}` metadata: not an edgerun finetune state"))),
    };
    let meta: StateMeta = serde_json::from_str(&json).map_err(|e| Error::bad_file(path, format!("bad state metadata: {e}")))?;
    let mut tensors = HashMap::new();
    for name in store.entries().keys() {
        tensors.insert(name.clone(), store.tensor(name, DType::F32, device)?);
    }
    Ok((tensors, meta))
}
