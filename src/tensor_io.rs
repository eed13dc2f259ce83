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
    let mut sink = SafetensorsSink::create(path)?;
    write_all(&mut sink, tensors)?;
    sink.commit()
}

/// Declares `tensors` to `sink` and writes each whole.
pub fn write_all(sink: &mut dyn OutputSink, tensors: &NamedTensors) -> Result<()> {
    sink.declare(&tensors.iter().map(|(n, t)| (n.clone(), t.dtype(), t.dims().to_vec())).collect::<Vec<_>>())?;
    tensors.iter().try_for_each(|(n, t)| sink.write(n, 0, t))
}

/// Where a forward pass hands its outputs as it makes them: every output declared (name, dtype,
/// shape) before the first write, then written in blocks of leading rows.
pub trait OutputSink {
    /// Declares every output before any is written.
    fn declare(&mut self, outputs: &[(String, DType, Vec<usize>)]) -> Result<()>;
    /// Writes `rows`, the declared output `name`'s rows `at..at + rows.dim(0)` (its first dimension).
    fn write(&mut self, name: &str, at: usize, rows: &Tensor) -> Result<()>;
}

/// Byte range of each declared output and how many of its rows were written.
#[derive(Debug)]
struct Slot {
    start: u64,
    row_bytes: u64,
    rows: usize,
    row_shape: Vec<usize>,
    dtype: DType,
    written: usize,
}

/// Checks `rows` against the declared `slot` at row `at`: its trailing shape and the row range.
fn check_rows(slot: &Slot, name: &str, at: usize, rows: &Tensor) -> Result<usize> {
    let dims = rows.dims();
    let n = dims.first().copied().unwrap_or(1);
    let trailing = if dims.is_empty() { &[][..] } else { &dims[1..] };
    if trailing != slot.row_shape.as_slice() || at.checked_add(n).is_none_or(|end| end > slot.rows) {
        return Err(Error::Input(format!("output `{name}`: rows {at}..{} of shape {dims:?} do not fit its declared [{}, {:?}]", at + n, slot.rows, slot.row_shape)));
    }
    Ok(n)
}

/// The declared slot of `name`.
fn slot<'a>(slots: &'a mut std::collections::BTreeMap<String, Slot>, name: &str) -> Result<&'a mut Slot> {
    slots.get_mut(name).ok_or_else(|| Error::Input(format!("output `{name}` was not declared")))
}

/// An [`OutputSink`] writing a safetensors file in place (each block at its offset, nothing held),
/// committed atomically only when every declared row was written.
pub struct SafetensorsSink {
    path: std::path::PathBuf,
    file: AtomicFile,
    slots: std::collections::BTreeMap<String, Slot>,
    declared: bool,
    busy: std::time::Duration,
}

impl SafetensorsSink {
    /// A sink for `path` (written to a temporary file beside it until [`Self::commit`]).
    pub fn create(path: &Path) -> Result<Self> {
        Ok(SafetensorsSink { path: path.to_path_buf(), file: AtomicFile::create(path)?, slots: Default::default(), declared: false, busy: Default::default() })
    }

    /// Time spent writing so far (a timed pass subtracts it).
    pub fn busy(&self) -> std::time::Duration {
        self.busy
    }

    /// Replaces the destination with the file, once every declared row is written.
    pub fn commit(self) -> Result<()> {
        if let Some((name, s)) = self.slots.iter().find(|(_, s)| s.written != s.rows) {
            return Err(Error::bad_file(&self.path, format!("output `{name}`: {} of its {} rows were written", s.written, s.rows)));
        }
        self.file.commit()
    }
}

impl OutputSink for SafetensorsSink {
    fn declare(&mut self, outputs: &[(String, DType, Vec<usize>)]) -> Result<()> {
        let t0 = std::time::Instant::now();
        if self.declared {
            return Err(Error::Input("outputs declared twice".into()));
        }
        let bad = |m: String| Error::bad_file(&self.path, m);
        let mut header = serde_json::Map::new();
        let mut offset = 0u64;
        for (name, dtype, shape) in outputs {
            let stored = if dtype.is_float() { DType::F32 } else { *dtype };
            let tag = safetensors_dtype(stored).ok_or_else(|| bad(format!("`{name}`: no safetensors type for {dtype:?}")))?;
            let count = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d as u64)).ok_or_else(|| bad(format!("`{name}`: shape {shape:?} overflows")))?;
            let bytes = count * stored.size_in_bytes() as u64;
            let rows = shape.first().copied().unwrap_or(1);
            let row_bytes = if rows == 0 { 0 } else { bytes / rows as u64 };
            header.insert(name.clone(), serde_json::json!({"dtype": tag, "shape": shape, "data_offsets": [offset, offset + bytes]}));
            let row_shape = shape.get(1..).unwrap_or(&[]).to_vec();
            if self.slots.insert(name.clone(), Slot { start: offset, row_bytes, rows, row_shape, dtype: stored, written: 0 }).is_some() {
                return Err(bad(format!("output `{name}` declared twice")));
            }
            offset += bytes;
        }
        let mut text = serde_json::Value::Object(header).to_string().into_bytes();
        text.resize(text.len().next_multiple_of(8), b' ');
        let data = 8 + text.len() as u64;
        for s in self.slots.values_mut() {
            s.start += data;
        }
        let io = |e: std::io::Error| Error::io(&self.path, e);
        let f = self.file.file().map_err(io)?;
        f.set_len(data + offset).map_err(io)?;
        f.write_all(&(text.len() as u64).to_le_bytes()).map_err(io)?;
        f.write_all(&text).map_err(io)?;
        self.declared = true;
        self.busy += t0.elapsed();
        Ok(())
    }

    fn write(&mut self, name: &str, at: usize, rows: &Tensor) -> Result<()> {
        let t0 = std::time::Instant::now();
        let path = self.path.clone();
        let s = slot(&mut self.slots, name)?;
        let n = check_rows(s, name, at, rows)?;
        let (start, dtype) = (s.start + at as u64 * s.row_bytes, s.dtype);
        s.written += n;
        let t = rows.to_dtype(dtype)?.to_device(&Device::Cpu)?;
        let io = |e: std::io::Error| Error::io(&path, e);
        let mut w = PositionedWriter { file: self.file.file().map_err(io)?, at: start };
        let written = match dtype {
            DType::F32 => with_contiguous(&t, |s: &[f32]| write_le(&mut w, s, f32::to_le_bytes))?,
            DType::U8 => with_contiguous(&t, |s: &[u8]| write_le(&mut w, s, u8::to_le_bytes))?,
            DType::U32 => with_contiguous(&t, |s: &[u32]| write_le(&mut w, s, u32::to_le_bytes))?,
            DType::I64 => with_contiguous(&t, |s: &[i64]| write_le(&mut w, s, i64::to_le_bytes))?,
            other => return Err(Error::bad_file(&path, format!("cannot write {other:?} tensors"))),
        };
        written.ok_or_else(|| Error::bad_file(&path, "a tensor left the CPU"))?.map_err(io)?;
        self.busy += t0.elapsed();
        Ok(())
    }
}

/// Writes at a moving file offset (`pwrite`), leaving the file's own position alone.
struct PositionedWriter<'a> {
    file: &'a mut std::fs::File,
    at: u64,
}

impl Write for PositionedWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        use std::io::{Seek, SeekFrom};
        self.file.seek(SeekFrom::Start(self.at))?;
        let n = self.file.write(buf)?;
        self.at += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

/// An [`OutputSink`] that keeps the outputs in memory, as tensors of the declared shapes.
#[derive(Default)]
pub struct CollectSink {
    tensors: NamedTensors,
    slots: std::collections::BTreeMap<String, Slot>,
    device: Option<Device>,
}

impl CollectSink {
    /// A sink that allocates its outputs on `device`.
    pub fn on(device: &Device) -> Self {
        CollectSink { device: Some(device.clone()), ..Default::default() }
    }

    /// The outputs, once every declared row was written.
    pub fn into_tensors(self) -> Result<NamedTensors> {
        if let Some((name, s)) = self.slots.iter().find(|(_, s)| s.written != s.rows) {
            return Err(Error::Input(format!("output `{name}`: {} of its {} rows were written", s.written, s.rows)));
        }
        Ok(self.tensors)
    }
}

impl OutputSink for CollectSink {
    fn declare(&mut self, outputs: &[(String, DType, Vec<usize>)]) -> Result<()> {
        for (name, dtype, shape) in outputs {
            let rows = shape.first().copied().unwrap_or(1);
            self.slots.insert(name.clone(), Slot { start: 0, row_bytes: 0, rows, row_shape: shape.get(1..).unwrap_or(&[]).to_vec(), dtype: *dtype, written: 0 });
        }
        Ok(())
    }

    fn write(&mut self, name: &str, at: usize, rows: &Tensor) -> Result<()> {
        let s = slot(&mut self.slots, name)?;
        let n = check_rows(s, name, at, rows)?;
        s.written += n;
        let rows = rows.to_dtype(s.dtype)?;
        // Written whole: kept as it is; in blocks: into a tensor of the declared shape, made once.
        if rows.rank() == 0 || n == s.rows {
            self.tensors.insert(name.to_string(), rows);
            return Ok(());
        }
        if !self.tensors.contains_key(name) {
            let shape: Vec<usize> = std::iter::once(s.rows).chain(s.row_shape.iter().copied()).collect();
            let device = self.device.clone().unwrap_or_else(|| rows.device().clone());
            self.tensors.insert(name.to_string(), Tensor::zeros(shape, s.dtype, &device)?);
        }
        if let Some(dest) = self.tensors.get(name) {
            dest.slice_set(&rows.contiguous()?, 0, at)?;
        }
        Ok(())
    }
}

/// An [`OutputSink`] that drops what it is given (untimed warm-up passes).
pub struct DiscardSink;

impl OutputSink for DiscardSink {
    fn declare(&mut self, _: &[(String, DType, Vec<usize>)]) -> Result<()> {
        Ok(())
    }

    fn write(&mut self, _: &str, _: usize, _: &Tensor) -> Result<()> {
        Ok(())
    }
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

    #[test]
    fn a_sink_writes_blocks_in_place_and_commits_only_when_complete() {
        let dev = Device::Cpu;
        let a = Tensor::arange(0f32, 24.0, &dev).unwrap().reshape((4, 3, 2)).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.safetensors");
        let spec = vec![("a".to_string(), DType::F32, vec![4, 3, 2]), ("n".to_string(), DType::U32, vec![2])];
        let mut sink = SafetensorsSink::create(&path).unwrap();
        sink.declare(&spec).unwrap();
        sink.write("a", 2, &a.narrow(0, 2, 2).unwrap()).unwrap();
        sink.write("n", 0, &Tensor::new(&[5u32, 6], &dev).unwrap()).unwrap();
        sink.write("a", 0, &a.narrow(0, 0, 1).unwrap()).unwrap();
        assert!(sink.write("a", 3, &a.narrow(0, 0, 2).unwrap()).is_err(), "rows past the end");
        assert!(sink.write("a", 0, &a.narrow(2, 0, 1).unwrap()).is_err(), "a different row shape");
        assert!(sink.write("b", 0, &a).is_err(), "not declared");
        assert!(sink.commit().unwrap_err().to_string().contains("`a`: 3 of its 4 rows"));
        assert!(!path.exists(), "an incomplete output is not left behind");

        let mut sink = SafetensorsSink::create(&path).unwrap();
        let mut collect = CollectSink::on(&dev);
        for s in [&mut sink as &mut dyn OutputSink, &mut collect] {
            s.declare(&spec).unwrap();
            s.write("a", 1, &a.narrow(0, 1, 3).unwrap()).unwrap();
            s.write("a", 0, &a.narrow(0, 0, 1).unwrap()).unwrap();
            s.write("n", 0, &Tensor::new(&[5u32, 6], &dev).unwrap()).unwrap();
        }
        sink.commit().unwrap();
        let back = read_tensors(&path, DType::F32, &dev).unwrap();
        let kept = collect.into_tensors().unwrap();
        for t in [&back["a"], &kept["a"]] {
            assert_eq!(t.flatten_all().unwrap().to_vec1::<f32>().unwrap(), a.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        }
        assert_eq!(back["n"].to_vec1::<u32>().unwrap(), [5, 6]);
    }
}
