//! A validating parser for safetensors headers over untrusted bytes.
use std::collections::BTreeMap;
use std::fmt;

use serde::de::{Deserializer, MapAccess, Visitor};
use serde::Deserialize;

use super::dtype::StoredDType;
use super::entry::{check_no_overlap, checked_numel, TensorEntry};
use super::limits::Limits;

/// The parsed header of one safetensors file.
#[derive(Debug)]
pub struct SafetensorsHeader {
    /// Validated tensor records, in header order.
    pub tensors: Vec<TensorEntry>,
    /// The free-form `__metadata__` strings.
    pub metadata: BTreeMap<String, String>,
}

/// A JSON object kept as ordered entries so that duplicate keys can be detected.
struct Entries(Vec<(String, serde_json::Value)>);

impl<'de> Deserialize<'de> for Entries {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Entries;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Entries, A::Error> {
                let mut out = Vec::new();
                while let Some((k, v)) = map.next_entry::<String, serde_json::Value>()? {
                    out.push((k, v));
                }
                Ok(Entries(out))
            }
        }
        d.deserialize_map(V)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawInfo {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: (u64, u64),
}

impl fmt::Debug for Entries {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "{} entries", self.0.len())
    }
}

/// Parses and validates the header of a safetensors file whose whole contents are `bytes`.
/// `file` is the shard index recorded in each entry.
pub fn parse(bytes: &[u8], file: usize, limits: &Limits) -> Result<SafetensorsHeader, String> {
    if bytes.len() < 8 {
        return Err(format!("file is {} bytes, too short for a safetensors header", bytes.len()));
    }
    let mut len8 = [0u8; 8];
    len8.copy_from_slice(&bytes[..8]);
    let header_len = u64::from_le_bytes(len8);
    if header_len > limits.max_header_bytes {
        return Err(format!("header length {header_len} exceeds the limit of {} bytes", limits.max_header_bytes));
    }
    let header_end = 8usize
        .checked_add(header_len as usize)
        .filter(|&e| e <= bytes.len())
        .ok_or_else(|| format!("header length {header_len} runs past the end of the file ({} bytes): truncated?", bytes.len()))?;
    let json = &bytes[8..header_end];
    let entries: Entries =
        serde_json::from_slice(json).map_err(|e| format!("header is not a valid JSON object: {e}"))?;
    let n_tensors = entries.0.iter().filter(|(k, _)| k != "__metadata__").count();
    if n_tensors as u64 > limits.max_tensors {
        return Err(format!("header declares {n_tensors} tensors, more than the limit of {}", limits.max_tensors));
    }
    let data = &bytes[header_end..];
    let mut seen = std::collections::HashSet::new();
    let mut tensors = Vec::with_capacity(entries.0.len());
    let mut metadata = BTreeMap::new();
    for (name, value) in entries.0 {
        if !seen.insert(name.clone()) {
            return Err(format!("duplicate tensor name `{name}`"));
        }
        if name == "__metadata__" {
            metadata = serde_json::from_value::<BTreeMap<String, String>>(value)
                .map_err(|e| format!("`__metadata__` must map strings to strings: {e}"))?;
            continue;
        }
        if name.len() as u64 > limits.max_string_bytes {
            return Err(format!("a tensor name is {} bytes long, over the limit", name.len()));
        }
        let info: RawInfo =
            serde_json::from_value(value).map_err(|e| format!("tensor `{name}`: malformed entry: {e}"))?;
        let dtype = StoredDType::from_safetensors(&info.dtype)
            .ok_or_else(|| format!("tensor `{name}`: unknown or unsupported dtype `{}`", info.dtype))?;
        let numel = checked_numel(&info.shape, limits).map_err(|m| format!("tensor `{name}`: {m}"))?;
        let need = dtype
            .bytes_for(numel)
            .ok_or_else(|| format!("tensor `{name}`: byte size overflows"))?;
        let (b, e) = info.data_offsets;
        if b > e {
            return Err(format!("tensor `{name}`: data offsets [{b}, {e}] are reversed"));
        }
        if e > data.len() as u64 {
            return Err(format!(
                "tensor `{name}`: data offsets [{b}, {e}] run past the end of the data section ({} bytes): truncated?",
                data.len()
            ));
        }
        if e - b != need as u64 {
            return Err(format!(
                "tensor `{name}`: data is {} bytes but dtype {} and shape {:?} need {need}",
                e - b,
                info.dtype,
                info.shape
            ));
        }
        tensors.push(TensorEntry {
            name,
            dtype,
            shape: info.shape.iter().map(|&d| d as usize).collect(),
            file,
            start: header_end + b as usize,
            len: need,
        });
    }
    let mut refs: Vec<&TensorEntry> = tensors.iter().collect();
    check_no_overlap(&mut refs)?;
    Ok(SafetensorsHeader { tensors, metadata })
}
