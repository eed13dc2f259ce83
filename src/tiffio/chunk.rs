//! One strip or tile, from its stored bytes to samples: decompressed into at most the bytes its
//! pixels take (or decoded by the JPEG / WebP codec at the chunk's size), the predictor undone,
//! and samples widened to `u16` (8-bit values stay 0..=255; 1-bit mask samples become 0 or 1).
use super::codec::{decompress, Compression};
use super::jpeg::{self, Expect};
use super::layout::{Colour, Layout};
use super::predictor::undo_horizontal;
use super::webp;

/// A decoded chunk: row-major samples, `stride` per row.
pub(crate) struct Chunk {
    /// The samples.
    pub(crate) samples: Vec<u16>,
    /// Samples per row.
    pub(crate) stride: usize,
}

/// Decodes chunk `index` of `layout` from its stored bytes `raw`.
pub(crate) fn decode(layout: &Layout, index: usize, raw: &[u8]) -> Result<Chunk, String> {
    let rows = layout.rows_in(index);
    let spp = layout.chunk_samples();
    let row_bytes = layout.row_bytes();
    let need = row_bytes * rows;
    let bytes = match layout.compression {
        Compression::Jpeg => {
            let want = Expect { width: layout.chunk_w, rows_min: rows, rows_max: layout.chunk_h, components: spp, ycbcr: layout.colour == Colour::YCbCr };
            jpeg::decode(layout.jpeg_tables.as_deref(), raw, &want)?
        }
        Compression::WebP => webp::decode(raw, layout.chunk_w, rows, layout.chunk_h, spp)?,
        method => decompress(method, raw, row_bytes * layout.chunk_h)?,
    };
    if bytes.len() < need {
        return Err(format!(
            "{} data holds {} bytes once decoded, {need} needed for its pixels: the file is truncated or corrupt",
            layout.compression.name(),
            bytes.len()
        ));
    }
    let bytes = &bytes[..need];
    let stride = layout.chunk_w * spp;
    let mut samples: Vec<u16> = match layout.bits {
        8 => bytes.iter().map(|&b| u16::from(b)).collect(),
        16 if layout.little_endian => bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect(),
        16 => bytes.chunks_exact(2).map(|c| u16::from_be_bytes([c[0], c[1]])).collect(),
        _ => bytes.chunks_exact(row_bytes).flat_map(|row| (0..stride).map(move |i| u16::from(row[i / 8] >> (7 - i % 8) & 1))).collect(),
    };
    if layout.horizontal_predictor {
        undo_horizontal(&mut samples, stride, spp, layout.bits);
    }
    Ok(Chunk { samples, stride })
}
