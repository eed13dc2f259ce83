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

/// Reads a 2-D float16 or float32 `.npy` file (C order) as `(shape, values)`, validating its header.
pub fn read_npy_2d(path: &Path) -> Result<((usize, usize), Vec<f32>)> {
    use crate::error::Error;
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    let bad = |m: &str| Error::bad_file(path, m.to_string());
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err(bad("not a .npy file"));
    }
    let (hlen, off): (usize, usize) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 if bytes.len() >= 12 => (u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize, 12),
        _ => return Err(bad("unsupported .npy version")),
    };
    let end = off.checked_add(hlen).filter(|&e| e <= bytes.len()).ok_or_else(|| bad("truncated .npy header"))?;
    let header = std::str::from_utf8(&bytes[off..end]).map_err(|_| bad("header is not text"))?;
    let elem = if header.contains("'<f2'") {
        2
    } else if header.contains("'<f4'") {
        4
    } else {
        return Err(bad("only little-endian float16/float32 arrays are supported"));
    };
    if header.contains("'fortran_order': True") {
        return Err(bad("Fortran-order arrays are not supported"));
    }
    let shape_txt = header
        .split("'shape':")
        .nth(1)
        .and_then(|s| s.split(')').next())
        .map(|s| s.trim().trim_start_matches('('))
        .ok_or_else(|| bad("no shape in header"))?;
    let dims: Vec<usize> = shape_txt
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<usize>().map_err(|_| bad("bad shape in header")))
        .collect::<Result<_>>()?;
    let [h, w] = dims[..] else { return Err(bad("expected a 2-D array")) };
    let n = h.checked_mul(w).filter(|&n| n > 0).ok_or_else(|| bad("bad array size"))?;
    let data = &bytes[end..];
    if data.len() != n * elem {
        return Err(bad(&format!("data is {} bytes, shape ({h}, {w}) needs {}", data.len(), n * elem)));
    }
    let values = if elem == 2 {
        data.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect()
    } else {
        data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    };
    Ok(((h, w), values))
}
