//! A streaming GGUF v3 writer: the header is laid out from shapes and types up front, then tensor
//! data is written one tensor at a time, so the whole model is never held in memory.
use std::io::{Seek, Write};

use candle_core::quantized::GgmlDType;

use crate::weights::dtype::ggml_id;
use crate::weights::gguf::{MetaValue, DEFAULT_ALIGNMENT, MAGIC};

/// One tensor's planned record.
#[derive(Debug, Clone)]
pub struct PlannedTensor {
    /// Name written into the file.
    pub name: String,
    /// Shape, outermost first (Candle order).
    pub shape: Vec<usize>,
    /// Stored type.
    pub dtype: GgmlDType,
    /// Offset of its data within the data section.
    pub offset: u64,
    /// Its data length in bytes.
    pub len: u64,
}

fn align(x: u64) -> u64 {
    x.div_ceil(DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT
}

/// Assigns aligned offsets to tensors in order; returns None when a shape does not fit its type.
pub fn plan(tensors: Vec<(String, Vec<usize>, GgmlDType)>) -> Option<Vec<PlannedTensor>> {
    let mut offset = 0u64;
    let mut out = Vec::with_capacity(tensors.len());
    for (name, shape, dtype) in tensors {
        let numel: usize = shape.iter().product();
        if !numel.is_multiple_of(dtype.block_size()) {
            return None;
        }
        let len = (numel / dtype.block_size() * dtype.type_size()) as u64;
        out.push(PlannedTensor { name, shape, dtype, offset, len });
        offset = align(offset + len);
    }
    Some(out)
}

fn write_str<W: Write>(w: &mut W, s: &str) -> std::io::Result<()> {
    w.write_all(&(s.len() as u64).to_le_bytes())?;
    w.write_all(s.as_bytes())
}

fn type_id(v: &MetaValue) -> u32 {
    match v {
        MetaValue::U8(_) => 0,
        MetaValue::I8(_) => 1,
        MetaValue::U16(_) => 2,
        MetaValue::I16(_) => 3,
        MetaValue::U32(_) => 4,
        MetaValue::I32(_) => 5,
        MetaValue::F32(_) => 6,
        MetaValue::Bool(_) => 7,
        MetaValue::String(_) => 8,
        MetaValue::Array(_) => 9,
        MetaValue::U64(_) => 10,
        MetaValue::I64(_) => 11,
        MetaValue::F64(_) => 12,
    }
}

fn write_value<W: Write>(w: &mut W, v: &MetaValue) -> std::io::Result<()> {
    match v {
        MetaValue::U8(x) => w.write_all(&[*x]),
        MetaValue::I8(x) => w.write_all(&x.to_le_bytes()),
        MetaValue::U16(x) => w.write_all(&x.to_le_bytes()),
        MetaValue::I16(x) => w.write_all(&x.to_le_bytes()),
        MetaValue::U32(x) => w.write_all(&x.to_le_bytes()),
        MetaValue::I32(x) => w.write_all(&x.to_le_bytes()),
        MetaValue::F32(x) => w.write_all(&x.to_le_bytes()),
        MetaValue::Bool(x) => w.write_all(&[*x as u8]),
        MetaValue::String(s) => write_str(w, s),
        MetaValue::U64(x) => w.write_all(&x.to_le_bytes()),
        MetaValue::I64(x) => w.write_all(&x.to_le_bytes()),
        MetaValue::F64(x) => w.write_all(&x.to_le_bytes()),
        MetaValue::Array(items) => {
            let elem = items.first().map(type_id).unwrap_or(0);
            w.write_all(&elem.to_le_bytes())?;
            w.write_all(&(items.len() as u64).to_le_bytes())?;
            items.iter().try_for_each(|i| write_value(w, i))
        }
    }
}

/// Writes a GGUF file tensor by tensor.
pub struct GgufWriter<W: Write + Seek> {
    out: W,
    data_start: u64,
    next: usize,
    planned: Vec<PlannedTensor>,
}

impl<W: Write + Seek> GgufWriter<W> {
    /// Writes the header (metadata and tensor infos) and positions at the data section.
    pub fn new(mut out: W, metadata: &[(String, MetaValue)], planned: Vec<PlannedTensor>) -> std::io::Result<Self> {
        out.write_all(MAGIC)?;
        out.write_all(&3u32.to_le_bytes())?;
        out.write_all(&(planned.len() as u64).to_le_bytes())?;
        out.write_all(&(metadata.len() as u64).to_le_bytes())?;
        for (k, v) in metadata {
            write_str(&mut out, k)?;
            out.write_all(&type_id(v).to_le_bytes())?;
            write_value(&mut out, v)?;
        }
        for t in &planned {
            write_str(&mut out, &t.name)?;
            out.write_all(&(t.shape.len() as u32).to_le_bytes())?;
            for d in t.shape.iter().rev() {
                out.write_all(&(*d as u64).to_le_bytes())?;
            }
            out.write_all(&ggml_id(t.dtype).to_le_bytes())?;
            out.write_all(&t.offset.to_le_bytes())?;
        }
        let pos = out.stream_position()?;
        let data_start = align(pos);
        out.write_all(&vec![0u8; (data_start - pos) as usize])?;
        Ok(GgufWriter { out, data_start, next: 0, planned })
    }

    /// The tensor expected next, if any.
    pub(crate) fn next_tensor(&self) -> Option<&PlannedTensor> {
        self.planned.get(self.next)
    }

    /// Writes the next tensor's bytes, which must match the planned length.
    pub fn write_tensor(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        let t = self
            .planned
            .get(self.next)
            .ok_or_else(|| std::io::Error::other("more tensors written than planned"))?;
        if bytes.len() as u64 != t.len {
            return Err(std::io::Error::other(format!("tensor `{}`: {} bytes, planned {}", t.name, bytes.len(), t.len)));
        }
        let pos = self.out.stream_position()?;
        let want = self.data_start + t.offset;
        if pos != want {
            return Err(std::io::Error::other(format!("tensor `{}` at byte {pos}, planned {want}", t.name)));
        }
        self.out.write_all(bytes)?;
        let end = t.offset + t.len;
        let pad = align(end) - end;
        if self.next + 1 < self.planned.len() {
            self.out.write_all(&vec![0u8; pad as usize])?;
        }
        self.next += 1;
        Ok(())
    }

    /// Checks every planned tensor was written and returns the inner writer.
    pub fn finish(mut self) -> std::io::Result<W> {
        if self.next != self.planned.len() {
            return Err(std::io::Error::other("fewer tensors written than planned"));
        }
        self.out.flush()?;
        Ok(self.out)
    }
}
