//! Reading input tensors from, and writing outputs to, safetensors files.
use std::path::Path;

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};
use crate::fsutil::write_atomic;
use crate::models::NamedTensors;
use crate::weights::WeightStore;

/// Reads every tensor of a safetensors file (validated like weights) in `dtype` on `device`.
pub fn read_tensors(path: &Path, dtype: DType, device: &Device) -> Result<NamedTensors> {
    let store = WeightStore::open(path)?;
    let mut out = NamedTensors::new();
    for (name, e) in store.entries() {
        let float = e.dtype.plain().is_none_or(|d| d.is_float());
        let target = if float { dtype } else { e.dtype.plain().unwrap_or(dtype) };
        out.insert(name.clone(), store.tensor(name, target, device)?);
    }
    Ok(out)
}

/// Writes tensors (converted to f32 unless integer) to a safetensors file atomically.
pub fn write_tensors(path: &Path, tensors: &NamedTensors) -> Result<()> {
    let mut cpu = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        let t = if t.dtype().is_float() { t.to_dtype(DType::F32)? } else { t.clone() };
        cpu.push((name.clone(), t.to_device(&Device::Cpu)?.contiguous()?));
    }
    let views: Vec<(&str, &Tensor)> = cpu.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let bytes = safetensors::serialize(views, None).map_err(|e| Error::bad_file(path, e.to_string()))?;
    write_atomic(path, &bytes)
}
