//! What fine-tuning writes: model directories in the checkpoint's own layout (`config.json` +
//! `model.safetensors`, hub key names) swapped in whole, and the resume state as one atomic file.
use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::fsutil::{write_atomic, DirSwap};
use crate::models::NamedTensors;
use crate::weights::WeightStore;

/// Writes `dir` (e.g. `<out>/best`) as a model directory: every tensor of `store` under its stored
/// name, replaced by `updated` where it trains, plus `extra` files (the model's preprocessing). The
/// directory is built beside `dir` and swapped in whole ([`DirSwap`]: never over an input, nothing left
/// behind on an error), so `dir` is at every moment either the previous complete model or the new one.
/// Non-finite weights are never written.
pub(crate) fn save_model_dir(store: &WeightStore, updated: &HashMap<String, Tensor>, extra: &[(&str, &[u8])], dir: &Path) -> Result<()> {
    if let Some(name) = first_non_finite(updated.iter().map(|(n, t)| (n.as_str(), t)))? {
        return Err(non_finite(dir, name));
    }
    let swap = DirSwap::create(dir)?;
    let tmp = swap.path();
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
    let config = serde_json::to_vec_pretty(store.config()).map_err(|e| Error::bad_file(tmp, e.to_string()))?;
    write_atomic(tmp.join("config.json"), &config)?;
    for (name, bytes) in extra {
        write_atomic(tmp.join(name), bytes)?;
    }
    crate::tensor_io::write_tensors(&tmp.join("model.safetensors"), &tensors)?;
    swap.commit()
}

/// The name of the first tensor holding a NaN or an infinity, if any. A sum is cheap on any device;
/// only a tensor whose sum is not finite is read back and looked at value by value (a sum of finite
/// values can overflow).
pub(crate) fn first_non_finite<'a>(tensors: impl IntoIterator<Item = (&'a str, &'a Tensor)>) -> Result<Option<&'a str>> {
    for (name, t) in tensors {
        if !t.dtype().is_float() {
            continue;
        }
        let sum = t.to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>()?;
        if !sum.is_finite() && t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?.iter().any(|v| !v.is_finite()) {
            return Ok(Some(name));
        }
    }
    Ok(None)
}

/// The refusal to save non-finite weights.
fn non_finite(path: &Path, tensor: &str) -> Error {
    Error::Input(format!("{}: not saved: tensor `{tensor}` holds NaN or infinite values", path.display()))
}

/// Everything besides tensors that resume needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StateMeta {
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

impl StateMeta {
    /// Refuses a state that does not belong to a run of `total` steps with `fingerprint`: other
    /// settings, a step beyond the run, more optimiser steps than steps, a non-finite loss.
    pub fn check(&self, path: &Path, total: usize, fingerprint: &str) -> Result<()> {
        if self.fingerprint != fingerprint {
            return Err(Error::bad_file(path, "saved by a run with other settings (model, data, schedule…); use another --out or delete it to start over"));
        }
        if self.step > total {
            return Err(Error::bad_file(path, format!("is at step {}, beyond this run's {total} steps: saved by another run or altered; delete it to start over", self.step)));
        }
        if self.adam_steps > self.step as u64 {
            return Err(Error::bad_file(path, format!("optimiser step count {} is beyond the step {}: altered; delete it to start over", self.adam_steps, self.step)));
        }
        if self.best_val.is_some_and(|v| !v.is_finite()) {
            return Err(Error::bad_file(path, "best validation loss is not finite: altered; delete it to start over"));
        }
        Ok(())
    }
}

/// Writes the state (tensors + meta) atomically to `path`; non-finite tensors are never written.
pub(crate) fn save_state(path: &Path, tensors: &[(String, Tensor)], meta: &StateMeta) -> Result<()> {
    if let Some(name) = first_non_finite(tensors.iter().map(|(n, t)| (n.as_str(), t)))? {
        return Err(non_finite(path, name));
    }
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

/// Reads a state written by [`save_state`] (validated like any weight file; a non-finite tensor is
/// refused). [`StateMeta::check`] says whether it belongs to a run.
pub fn load_state(path: &Path, device: &Device) -> Result<(HashMap<String, Tensor>, StateMeta)> {
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
    if let Some(name) = first_non_finite(tensors.iter().map(|(n, t)| (n.as_str(), t)))? {
        return Err(Error::bad_tensor(path, name, "holds NaN or infinite values: altered; delete the state to start over"));
    }
    Ok((tensors, meta))
}
