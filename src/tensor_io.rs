//! Reading input tensors from, and writing outputs to, safetensors files.
use std::io::Write;
use std::path::Path;

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};
use crate::fsutil::AtomicFile;
use crate::kernels::cpu_slice::with_contiguous;
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

/// Writes tensors (converted to f32 unless integer) to a safetensors file atomically, one tensor at
/// a time: the file is never built whole in memory (a SAM 3 pass's masks alone are 530 MB).
pub fn write_tensors(path: &Path, tensors: &NamedTensors) -> Result<()> {
    let stored = |t: &Tensor| if t.dtype().is_float() { DType::F32 } else { t.dtype() };
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for (name, t) in tensors {
        let dtype = stored(t);
        let name_of = safetensors_dtype(dtype).ok_or_else(|| Error::bad_file(path, format!("`{name}`: no safetensors type for {dtype:?}")))?;
        let end = offset + t.elem_count() * dtype.size_in_bytes();
        header.insert(name.clone(), serde_json::json!({"dtype": name_of, "shape": t.dims(), "data_offsets": [offset, end]}));
        offset = end;
    }
    let mut text = serde_json::Value::Object(header).to_string().into_bytes();
    text.resize(text.len().next_multiple_of(8), b' ');
    let io = |e: std::io::Error| Error::io(path, e);
    let mut file = AtomicFile::create(path)?;
    {
        let mut w = std::io::BufWriter::with_capacity(1 << 20, file.file().map_err(io)?);
        w.write_all(&(text.len() as u64).to_le_bytes()).map_err(io)?;
        w.write_all(&text).map_err(io)?;
        for t in tensors.values() {
            let t = t.to_dtype(stored(t))?.to_device(&Device::Cpu)?;
            let written = match t.dtype() {
                DType::F32 => with_contiguous(&t, |s: &[f32]| write_le(&mut w, s, f32::to_le_bytes))?,
                DType::U8 => with_contiguous(&t, |s: &[u8]| write_le(&mut w, s, u8::to_le_bytes))?,
                DType::U32 => with_contiguous(&t, |s: &[u32]| write_le(&mut w, s, u32::to_le_bytes))?,
                DType::I64 => with_contiguous(&t, |s: &[i64]| write_le(&mut w, s, i64::to_le_bytes))?,
                other => return Err(Error::bad_file(path, format!("cannot write {other:?} tensors"))),
            };
            written.ok_or_else(|| Error::bad_file(path, "a tensor left the CPU"))?.map_err(io)?;
        }
        w.flush().map_err(io)?;
    }
    file.commit()
}

/// The safetensors name of `dtype`, for the types [`write_tensors`] writes.
fn safetensors_dtype(dtype: DType) -> Option<&'static str> {
    Some(match dtype {
        DType::F32 => "F32",
        DType::U8 => "U8",
        DType::U32 => "U32",
        DType::I64 => "I64",
        _ => return None,
    })
}

/// Writes `values` little-endian through a small buffer.
fn write_le<T: Copy, const N: usize>(w: &mut impl Write, values: &[T], le: fn(T) -> [u8; N]) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(N << 14);
    for chunk in values.chunks(1 << 14) {
        buf.clear();
        buf.extend(chunk.iter().flat_map(|&v| le(v)));
        w.write_all(&buf)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_tensors_read_back_as_written() {
        let dev = Device::Cpu;
        let mut t = NamedTensors::new();
        t.insert("a".into(), Tensor::randn(0f32, 1.0, (3, 70_000), &dev).unwrap());
        t.insert("b16".into(), Tensor::new(&[1.5f32, -2.0, 3.25], &dev).unwrap().to_dtype(DType::F16).unwrap());
        t.insert("ids".into(), Tensor::new(&[7u32, 0, 49407], &dev).unwrap());
        t.insert("mask".into(), Tensor::new(&[1u8, 0], &dev).unwrap());
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.safetensors");
        write_tensors(&path, &t).unwrap();
        let back = read_tensors(&path, DType::F32, &dev).unwrap();
        assert_eq!(back.len(), 4);
        let a = |x: &Tensor| x.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for k in ["a", "b16", "ids", "mask"] {
            assert_eq!(back[k].dims(), t[k].dims(), "{k}");
            assert_eq!(a(&back[k]), a(&t[k]), "{k}");
        }
        assert_eq!(back["ids"].dtype(), DType::U32);
    }
}
