//! One tensor's location and layout inside a mapped weight file.
use super::dtype::StoredDType;
use super::limits::Limits;

/// A validated tensor record: where its bytes are and how to read them.
#[derive(Debug, Clone)]
pub struct TensorEntry {
    /// The tensor name as stored in the file.
    pub name: String,
    /// How its elements are stored.
    pub dtype: StoredDType,
    /// Its shape, outermost dimension first (Candle order).
    pub shape: Vec<usize>,
    /// Index of the file (shard) that holds it.
    pub file: usize,
    /// Absolute byte offset of its data in that file.
    pub start: usize,
    /// Length of its data in bytes.
    pub len: usize,
}

impl TensorEntry {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Checks a declared shape against the limits and returns its element count.
pub(crate) fn checked_numel(shape: &[u64], limits: &Limits) -> Result<usize, String> {
    if shape.len() > limits.max_rank {
        return Err(format!("rank {} exceeds the limit of {}", shape.len(), limits.max_rank));
    }
    let mut numel: u64 = 1;
    for &d in shape {
        if d == 0 {
            return Err(format!("zero dimension in shape {shape:?}"));
        }
        if d > limits.max_dim {
            return Err(format!("dimension {d} in shape {shape:?} exceeds the limit of {}", limits.max_dim));
        }
        numel = numel
            .checked_mul(d)
            .ok_or_else(|| format!("element count of shape {shape:?} overflows"))?;
    }
    usize::try_from(numel).map_err(|_| format!("element count of shape {shape:?} does not fit in memory"))
}

/// Checks that no two entries of the same file overlap.
pub(crate) fn check_no_overlap(entries: &mut [&TensorEntry]) -> Result<(), String> {
    entries.sort_by_key(|e| e.start);
    for pair in entries.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        if a.start + a.len > b.start {
            return Err(format!("tensors `{}` and `{}` overlap", a.name, b.name));
        }
    }
    Ok(())
}
