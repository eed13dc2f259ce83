//! A validating parser for GGUF (v2/v3) headers over untrusted bytes.
use std::collections::BTreeMap;

use super::dtype::StoredDType;
use super::entry::{check_no_overlap, checked_numel, TensorEntry};
use super::limits::Limits;

/// A GGUF metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    /// Unsigned 8-bit integer.
    U8(u8),
    /// Signed 8-bit integer.
    I8(i8),
    /// Unsigned 16-bit integer.
    U16(u16),
    /// Signed 16-bit integer.
    I16(i16),
    /// Unsigned 32-bit integer.
    U32(u32),
    /// Signed 32-bit integer.
    I32(i32),
    /// Unsigned 64-bit integer.
    U64(u64),
    /// Signed 64-bit integer.
    I64(i64),
    /// 32-bit float.
    F32(f32),
    /// 64-bit float.
    F64(f64),
    /// Boolean.
    Bool(bool),
    /// UTF-8 string.
    String(String),
    /// Array of values of one type.
    Array(Vec<MetaValue>),
}

impl MetaValue {
    /// Bytes one decoded value takes in memory, besides a string's bytes.
    pub const SIZE: u64 = std::mem::size_of::<MetaValue>() as u64;

    /// Bytes this value takes in memory decoded (what [`Limits::max_metadata_bytes`] counts).
    pub fn decoded_bytes(&self) -> u64 {
        Self::SIZE
            + match self {
                MetaValue::String(s) => s.len() as u64,
                MetaValue::Array(v) => v.iter().map(MetaValue::decoded_bytes).sum(),
                _ => 0,
            }
    }

    /// The value as a string, when it is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value as an unsigned integer, when it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v as u64),
            MetaValue::U16(v) => Some(v as u64),
            MetaValue::U32(v) => Some(v as u64),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) if v >= 0 => Some(v as u64),
            MetaValue::I16(v) if v >= 0 => Some(v as u64),
            MetaValue::I32(v) if v >= 0 => Some(v as u64),
            MetaValue::I64(v) if v >= 0 => Some(v as u64),
            _ => None,
        }
    }

    /// A short rendering for listings (long arrays and strings are elided).
    pub fn summary(&self) -> String {
        match self {
            MetaValue::String(s) if s.len() > 120 => {
                // `str::floor_char_boundary` is newer than the crate's MSRV.
                let cut = (0..=100).rev().find(|&i| s.is_char_boundary(i)).unwrap_or(0);
                format!("{:?}… ({} bytes)", &s[..cut], s.len())
            }
            MetaValue::String(s) => format!("{s:?}"),
            MetaValue::Array(v) if v.len() > 8 => format!("[{} elements]", v.len()),
            MetaValue::Array(v) => format!("[{}]", v.iter().map(|x| x.summary()).collect::<Vec<_>>().join(", ")),
            MetaValue::U8(v) => v.to_string(),
            MetaValue::I8(v) => v.to_string(),
            MetaValue::U16(v) => v.to_string(),
            MetaValue::I16(v) => v.to_string(),
            MetaValue::U32(v) => v.to_string(),
            MetaValue::I32(v) => v.to_string(),
            MetaValue::U64(v) => v.to_string(),
            MetaValue::I64(v) => v.to_string(),
            MetaValue::F32(v) => v.to_string(),
            MetaValue::F64(v) => v.to_string(),
            MetaValue::Bool(v) => v.to_string(),
        }
    }
}

/// The parsed header of one GGUF file.
#[derive(Debug)]
pub struct GgufHeader {
    /// Format version (2 or 3).
    pub version: u32,
    /// Metadata key/value pairs.
    pub metadata: BTreeMap<String, MetaValue>,
    /// Validated tensor records (shapes in Candle order, outermost first).
    pub tensors: Vec<TensorEntry>,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    limits: &'a Limits,
    /// Decoded metadata bytes still allowed ([`Limits::max_metadata_bytes`]).
    budget: u64,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], String> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len()).ok_or_else(|| {
            format!("{what} at byte {} runs past the end of the file ({} bytes): truncated?", self.pos, self.buf.len())
        })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn arr<const N: usize>(&mut self, what: &str) -> Result<[u8; N], String> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }
    fn u32(&mut self, what: &str) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.arr(what)?))
    }
    fn u64(&mut self, what: &str) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.arr(what)?))
    }
    /// Takes `n` bytes of decoded metadata from the budget, or says the whole is too large.
    fn charge(&mut self, n: u64, what: &str) -> Result<(), String> {
        self.budget = self.budget.checked_sub(n).ok_or_else(|| {
            format!("{what}: the metadata takes more than {} bytes decoded (the limit on all of a file's metadata)", self.limits.max_metadata_bytes)
        })?;
        Ok(())
    }
    fn string(&mut self, what: &str) -> Result<String, String> {
        let len = self.u64(what)?;
        if len > self.limits.max_string_bytes {
            return Err(format!("{what} is {len} bytes long, over the limit of {}", self.limits.max_string_bytes));
        }
        let bytes = self.take(len as usize, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| format!("{what} is not valid UTF-8"))
    }
    fn value(&mut self, ty: u32, depth: usize, what: &str) -> Result<MetaValue, String> {
        self.charge(MetaValue::SIZE, what)?;
        Ok(match ty {
            0 => MetaValue::U8(self.arr::<1>(what)?[0]),
            1 => MetaValue::I8(self.arr::<1>(what)?[0] as i8),
            2 => MetaValue::U16(u16::from_le_bytes(self.arr(what)?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.arr(what)?)),
            4 => MetaValue::U32(self.u32(what)?),
            5 => MetaValue::I32(i32::from_le_bytes(self.arr(what)?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.arr(what)?)),
            7 => match self.arr::<1>(what)?[0] {
                0 => MetaValue::Bool(false),
                1 => MetaValue::Bool(true),
                b => return Err(format!("{what}: invalid boolean byte {b}")),
            },
            8 => {
                let s = self.string(what)?;
                self.charge(s.len() as u64, what)?;
                MetaValue::String(s)
            }
            9 => {
                if depth >= self.limits.max_array_depth {
                    return Err(format!("{what}: arrays nested deeper than {}", self.limits.max_array_depth));
                }
                let elem_ty = self.u32(what)?;
                let n = self.u64(what)?;
                if n > self.limits.max_array_len {
                    return Err(format!("{what}: array of {n} elements exceeds the limit of {}", self.limits.max_array_len));
                }
                let min_elem = match elem_ty {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    10..=12 => 8,
                    8 => 8,
                    9 => 12,
                    t => return Err(format!("{what}: unknown array element type {t}")),
                };
                let remaining = (self.buf.len() - self.pos) as u64;
                if n.saturating_mul(min_elem) > remaining {
                    return Err(format!("{what}: array of {n} elements cannot fit in the {remaining} bytes left: truncated?"));
                }
                // Refused before any element is read when even bare values would not fit.
                if n.saturating_mul(MetaValue::SIZE) > self.budget {
                    return Err(format!(
                        "{what}: array of {n} elements takes more than the {} bytes all of a file's metadata may take decoded",
                        self.limits.max_metadata_bytes
                    ));
                }
                // Grows as elements are actually read; the declared count only sizes a bounded hint.
                let mut v = Vec::with_capacity(n.min(4096) as usize);
                for _ in 0..n {
                    v.push(self.value(elem_ty, depth + 1, what)?);
                }
                MetaValue::Array(v)
            }
            10 => MetaValue::U64(self.u64(what)?),
            11 => MetaValue::I64(i64::from_le_bytes(self.arr(what)?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.arr(what)?)),
            t => return Err(format!("{what}: unknown metadata value type {t}")),
        })
    }
}

/// The magic bytes that open every GGUF file.
pub(crate) const MAGIC: &[u8; 4] = b"GGUF";
/// Data alignment used when the file does not set `general.alignment`.
pub(crate) const DEFAULT_ALIGNMENT: u64 = 32;

/// Parses and validates a GGUF file whose whole contents are `bytes`.
pub fn parse(bytes: &[u8], file: usize, limits: &Limits) -> Result<GgufHeader, String> {
    let mut c = Cursor { buf: bytes, pos: 0, limits, budget: limits.max_metadata_bytes };
    if c.take(4, "magic")? != MAGIC {
        return Err("not a GGUF file (bad magic)".into());
    }
    let version = c.u32("version")?;
    if version != 2 && version != 3 {
        return Err(format!("unsupported GGUF version {version} (2 and 3 are supported)"));
    }
    let n_tensors = c.u64("tensor count")?;
    if n_tensors > limits.max_tensors {
        return Err(format!("declares {n_tensors} tensors, more than the limit of {}", limits.max_tensors));
    }
    let n_kv = c.u64("metadata count")?;
    if n_kv > limits.max_metadata_entries {
        return Err(format!("declares {n_kv} metadata entries, more than the limit of {}", limits.max_metadata_entries));
    }
    let mut metadata = BTreeMap::new();
    for i in 0..n_kv {
        let key = c.string(&format!("metadata key #{i}"))?;
        c.charge(key.len() as u64 + MetaValue::SIZE, &format!("metadata key #{i}"))?;
        let ty = c.u32(&format!("type of metadata `{key}`"))?;
        let v = c.value(ty, 0, &format!("metadata `{key}`"))?;
        if metadata.insert(key.clone(), v).is_some() {
            return Err(format!("duplicate metadata key `{key}`"));
        }
    }
    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u64() {
            Some(a) if a.is_power_of_two() && a <= 1 << 20 => a,
            _ => return Err(format!("general.alignment {} is not a power of two ≤ 1 MiB", v.summary())),
        },
    };
    struct Raw {
        name: String,
        shape: Vec<usize>,
        dtype: StoredDType,
        offset: u64,
        len: usize,
    }
    let mut raws = Vec::with_capacity(n_tensors.min(4096) as usize);
    let mut names = std::collections::HashSet::new();
    for i in 0..n_tensors {
        let name = c.string(&format!("name of tensor #{i}"))?;
        if !names.insert(name.clone()) {
            return Err(format!("duplicate tensor name `{name}`"));
        }
        let rank = c.u32(&format!("tensor `{name}`: rank"))? as usize;
        if rank == 0 || rank > limits.max_rank.min(4) {
            return Err(format!("tensor `{name}`: rank {rank} is outside 1..=4"));
        }
        let mut dims = Vec::with_capacity(rank);
        for _ in 0..rank {
            dims.push(c.u64(&format!("tensor `{name}`: dims"))?);
        }
        let numel = checked_numel(&dims, limits).map_err(|m| format!("tensor `{name}`: {m}"))?;
        let ty = c.u32(&format!("tensor `{name}`: type"))?;
        let dtype = StoredDType::from_ggml_id(ty).ok_or_else(|| format!("tensor `{name}`: unknown GGML type {ty}"))?;
        if let StoredDType::Ggml(g) = dtype {
            if !(dims[0] as usize).is_multiple_of(g.block_size()) {
                return Err(format!(
                    "tensor `{name}`: inner dimension {} is not a multiple of the {} block size {}",
                    dims[0],
                    dtype.name(),
                    g.block_size()
                ));
            }
        }
        let len = dtype.bytes_for(numel).ok_or_else(|| format!("tensor `{name}`: byte size overflows"))?;
        let offset = c.u64(&format!("tensor `{name}`: offset"))?;
        if offset % alignment != 0 {
            return Err(format!("tensor `{name}`: offset {offset} is not aligned to {alignment}"));
        }
        // GGUF lists dims innermost first; Candle wants outermost first.
        let shape = dims.iter().rev().map(|&d| d as usize).collect();
        raws.push(Raw { name, shape, dtype, offset, len });
    }
    let data_start = (c.pos as u64).div_ceil(alignment) * alignment;
    let data_len = (bytes.len() as u64).saturating_sub(data_start);
    let mut tensors = Vec::with_capacity(raws.len());
    for r in raws {
        let end = r.offset.checked_add(r.len as u64).filter(|&e| e <= data_len).ok_or_else(|| {
            format!(
                "tensor `{}`: data at offset {} ({} bytes) runs past the end of the data section ({data_len} bytes): truncated?",
                r.name, r.offset, r.len
            )
        })?;
        let _ = end;
        let start = data_start + r.offset;
        // Candle reinterprets GGML block bytes in place (blocks hold f16/f32 fields), so quantized data
        // must start on a 4-byte boundary of the (page-aligned) mapping; `general.alignment` 1 or 2 allows less.
        if r.dtype.is_quantized() && start % 4 != 0 {
            return Err(format!("tensor `{}`: quantized data at byte {start} is not 4-byte aligned", r.name));
        }
        tensors.push(TensorEntry { name: r.name, dtype: r.dtype, shape: r.shape, file, start: start as usize, len: r.len });
    }
    let mut refs: Vec<&TensorEntry> = tensors.iter().collect();
    check_no_overlap(&mut refs)?;
    Ok(GgufHeader { version, metadata, tensors })
}
