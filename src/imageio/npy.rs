//! Writing `.npy` arrays (NumPy format 1.0), atomically.
use std::path::Path;

use crate::error::Result;
use crate::fsutil::write_atomic;

fn header(descr: &str, shape: &[usize]) -> Vec<u8> {
    let dims = match shape {
        [one] => format!("({one},)"),
        _ => format!("({})", shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ")),
    };
    let mut h = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {dims}, }}");
    // Magic (6) + version (2) + length (2) + header + '\n' must be a multiple of 64.
    let total = 10 + h.len() + 1;
    h.push_str(&" ".repeat((64 - total % 64) % 64));
    h.push('\n');
    let mut out = Vec::with_capacity(10 + h.len());
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&(h.len() as u16).to_le_bytes());
    out.extend_from_slice(h.as_bytes());
    out
}

/// Writes `values` (row-major, `shape`) as a little-endian float16 `.npy` file.
pub fn write_npy_f16(path: &Path, shape: &[usize], values: &[f32]) -> Result<()> {
    let mut bytes = header("<f2", shape);
    bytes.reserve(values.len() * 2);
    for v in values {
        bytes.extend_from_slice(&half::f16::from_f32(*v).to_le_bytes());
    }
    write_atomic(path, &bytes)
}

/// Writes `values` (row-major, `shape`) as a little-endian float32 `.npy` file.
pub fn write_npy_f32(path: &Path, shape: &[usize], values: &[f32]) -> Result<()> {
    let mut bytes = header("<f4", shape);
    bytes.reserve(values.len() * 4);
    for v in values {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    write_atomic(path, &bytes)
}
