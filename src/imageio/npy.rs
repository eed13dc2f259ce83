//! Writing `.npy` arrays (NumPy format 1.0) atomically, and reading 2-D float maps back.
use std::io::Read;
use std::path::Path;

use crate::error::{Error, Result};
use crate::fsutil::write_atomic;

mod header;
pub use header::{parse_header, NpyDtype, NpyHeader};

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

/// Largest accepted header (the dict text), in bytes.
const MAX_HEADER_BYTES: usize = 1 << 20;

/// Reads the magic, version and header of a `.npy` stream; returns the header and the data offset.
pub(crate) fn read_header(r: &mut impl Read) -> std::result::Result<(NpyHeader, u64), String> {
    let mut pre = [0u8; 10];
    r.read_exact(&mut pre).map_err(|_| "not a .npy file (too short)".to_string())?;
    if &pre[..6] != b"\x93NUMPY" {
        return Err("not a .npy file".into());
    }
    let (hlen, off) = match pre[6] {
        1 => (u16::from_le_bytes([pre[8], pre[9]]) as usize, 10),
        2 | 3 => {
            let mut more = [0u8; 2];
            r.read_exact(&mut more).map_err(|_| "truncated .npy header".to_string())?;
            (u32::from_le_bytes([pre[8], pre[9], more[0], more[1]]) as usize, 12)
        }
        v => return Err(format!("unsupported .npy version {v}")),
    };
    if hlen > MAX_HEADER_BYTES {
        return Err(format!("header of {hlen} bytes is larger than the limit {MAX_HEADER_BYTES}"));
    }
    let mut text = vec![0u8; hlen];
    r.read_exact(&mut text).map_err(|_| "truncated .npy header".to_string())?;
    Ok((parse_header(&text)?, (off + hlen) as u64))
}

/// Reads a 2-D C-order float16/float32 array whose data starts after the header just read from `r`;
/// `len` is the total stream length, checked against the shape before any data is read.
fn read_2d_body(r: &mut impl Read, len: u64) -> std::result::Result<((usize, usize), Vec<f32>), String> {
    let (h, off) = read_header(r)?;
    if h.fortran_order {
        return Err("Fortran-order arrays are not supported".into());
    }
    let [rows, cols] = h.shape[..] else { return Err(format!("expected a 2-D array, got shape {:?}", h.shape)) };
    let n = h.elements()?;
    if n == 0 {
        return Err(format!("empty array of shape ({rows}, {cols})"));
    }
    let need = h.data_bytes()?;
    let have = len.saturating_sub(off);
    if have != need as u64 {
        return Err(format!("data is {have} bytes, shape ({rows}, {cols}) needs {need}"));
    }
    let mut data = vec![0u8; need];
    r.read_exact(&mut data).map_err(|e| format!("cannot read the data: {e}"))?;
    let values = match h.dtype {
        NpyDtype::F16 => data.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        NpyDtype::F32 => data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
    };
    Ok(((rows, cols), values))
}

/// Decodes a 2-D float16 or float32 `.npy` file held in memory (C order), validating its header.
pub fn decode_npy_2d(bytes: &[u8]) -> std::result::Result<((usize, usize), Vec<f32>), String> {
    read_2d_body(&mut std::io::Cursor::new(bytes), bytes.len() as u64)
}

/// Reads a 2-D float16 or float32 `.npy` file (C order) as `(shape, values)`: the header is parsed
/// and the data size checked against the file length before the data is read.
pub fn read_npy_2d(path: &Path) -> Result<((usize, usize), Vec<f32>)> {
    let f = crate::fsutil::open_input(path)?;
    let len = f.metadata().map_err(|e| Error::io(path, e))?.len();
    read_2d_body(&mut std::io::BufReader::new(f), len).map_err(|m| Error::bad_file(path, m))
}
