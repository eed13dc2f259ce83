//! A model's output for one tile, sampled row by row at the tile's resolution.
use crate::error::{Error, Result};
use crate::kernels::bilinear_cpu::{axis_tap, axis_taps};

/// Per-tile model output.
#[derive(Debug, Clone)]
pub enum TileMap {
    /// `channels` planes already at the tile's size (canopy height, depth), channel-major.
    Dense {
        /// Planes.
        channels: usize,
        /// Tile rows.
        height: usize,
        /// Tile columns.
        width: usize,
        /// `channels · height · width` values.
        values: Vec<f32>,
    },
    /// Low-resolution logits `[channels, lh, lw]`, resized to the tile's size on demand with bilinear
    /// `align_corners=False` (as SegFormer's post-processing), so that a tile's full-resolution
    /// logits are never materialised.
    Logits {
        /// Classes.
        channels: usize,
        /// Logit rows.
        lh: usize,
        /// Logit columns.
        lw: usize,
        /// `channels · lh · lw` values.
        values: Vec<f32>,
        /// Tile rows.
        height: usize,
        /// Tile columns.
        width: usize,
    },
}

impl TileMap {
    /// A one-plane map at the tile's size.
    pub fn dense(height: usize, width: usize, values: Vec<f32>) -> Result<Self> {
        if values.len() != height * width {
            return Err(Error::Input(format!("{} values for a {height}×{width} tile", values.len())));
        }
        Ok(TileMap::Dense { channels: 1, height, width, values })
    }

    /// Planes (classes for logits).
    pub fn channels(&self) -> usize {
        match self {
            TileMap::Dense { channels, .. } | TileMap::Logits { channels, .. } => *channels,
        }
    }

    /// `(height, width)` at the tile's resolution.
    pub fn size(&self) -> (usize, usize) {
        match self {
            TileMap::Dense { height, width, .. } | TileMap::Logits { height, width, .. } => (*height, *width),
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        match self {
            TileMap::Dense { values, .. } | TileMap::Logits { values, .. } => values.len() * 4,
        }
    }

    /// The one-plane values of a dense map (for depth alignment).
    pub(crate) fn plane_mut(&mut self) -> Option<&mut [f32]> {
        match self {
            TileMap::Dense { channels: 1, values, .. } => Some(values),
            _ => None,
        }
    }

    /// The one-plane values of a dense map.
    pub fn plane(&self) -> Option<&[f32]> {
        match self {
            TileMap::Dense { channels: 1, values, .. } => Some(values),
            _ => None,
        }
    }

    /// Writes the values of tile row `y`, columns `u0..u1`, into `out` (channel-major: channel `c`
    /// at `out[c · (u1 − u0) ..]`). `cols` caches the column taps of a logits map between calls.
    pub(crate) fn sample_row(&self, y: usize, u0: usize, u1: usize, cols: &mut Vec<(usize, usize, f32)>, out: &mut [f32]) {
        let n = u1 - u0;
        match self {
            TileMap::Dense { channels, height, width, values } => {
                for c in 0..*channels {
                    let src = &values[c * height * width + y * width..][u0..u1];
                    out[c * n..(c + 1) * n].copy_from_slice(src);
                }
            }
            TileMap::Logits { channels, lh, lw, values, height, width } => {
                if cols.len() != *width {
                    *cols = axis_taps(*lw, *width);
                }
                // The same taps and arithmetic order as `resize_argmax`, so one tile reproduces it exactly.
                let (y0, y1, ly1) = axis_tap(*lh, *height, y);
                let ly0 = 1.0 - ly1;
                let plane = lh * lw;
                for c in 0..*channels {
                    let p = &values[c * plane..][..plane];
                    for (k, u) in (u0..u1).enumerate() {
                        let (x0, x1, lx1) = cols[u];
                        let lx0 = 1.0 - lx1;
                        out[c * n + k] = ly0 * (lx0 * p[y0 * lw + x0] + lx1 * p[y0 * lw + x1]) + ly1 * (lx0 * p[y1 * lw + x0] + lx1 * p[y1 * lw + x1]);
                    }
                }
            }
        }
    }
}
