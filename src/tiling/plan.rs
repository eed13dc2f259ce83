//! The tile grid: overlapping square tiles covering a raster, evenly spaced so that the first tile
//! starts at 0 and the last ends flush with the edge, and the column stripes the raster is processed
//! in (see `docs/tiling.md`).
use crate::error::{Error, Result};

/// Smallest tile side accepted.
pub(crate) const MIN_TILE: usize = 32;
/// Largest tile side accepted.
pub(crate) const MAX_TILE: usize = 8192;

/// Tile starts along one axis of `len` pixels for tiles of `tile` pixels overlapping by at least
/// `overlap`: one tile (of extent `len`) when `len <= tile`, else `n = ceil((len − tile) / (tile −
/// overlap)) + 1` starts spread evenly from 0 to `len − tile` (so every overlap is at least
/// `overlap` and they differ by at most one pixel).
pub(crate) fn axis_starts(len: usize, tile: usize, overlap: usize) -> Vec<usize> {
    if len <= tile || tile == 0 {
        return vec![0];
    }
    let stride = tile.saturating_sub(overlap).max(1);
    let span = len - tile;
    let gaps = span.div_ceil(stride);
    // Rounded even spacing: start_i = round(i · span / gaps); strictly increasing since span ≥ gaps.
    (0..=gaps).map(|i| (i * span * 2 + gaps) / (2 * gaps)).collect()
}

/// The tile layout of a raster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TilePlan {
    /// Raster width.
    pub width: usize,
    /// Raster height.
    pub height: usize,
    /// Tile width (`min(tile, width)`).
    pub tile_w: usize,
    /// Tile height (`min(tile, height)`).
    pub tile_h: usize,
    /// Requested minimum overlap.
    pub overlap: usize,
    /// Column starts of the tiles.
    pub xs: Vec<usize>,
    /// Row starts of the tiles.
    pub ys: Vec<usize>,
}

impl TilePlan {
    /// Plans `tile`-pixel tiles with at least `overlap` pixels of overlap over a `width`×`height` raster.
    pub fn new(width: usize, height: usize, tile: usize, overlap: usize) -> Result<Self> {
        check_tile(tile, overlap)?;
        if width == 0 || height == 0 {
            return Err(Error::Input(format!("cannot tile an empty {width}×{height} raster")));
        }
        Ok(TilePlan {
            width,
            height,
            tile_w: tile.min(width),
            tile_h: tile.min(height),
            overlap,
            xs: axis_starts(width, tile, overlap),
            ys: axis_starts(height, tile, overlap),
        })
    }

    /// Number of tiles.
    pub fn len(&self) -> usize {
        self.xs.len() * self.ys.len()
    }

    /// Whether the plan has no tiles (never: a plan covers a non-empty raster).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tile columns whose extent intersects the pixel columns `x0..x1`.
    pub(crate) fn columns_touching(&self, x0: usize, x1: usize) -> std::ops::Range<usize> {
        let first = self.xs.iter().position(|&s| s + self.tile_w > x0).unwrap_or(self.xs.len());
        let end = self.xs.iter().position(|&s| s >= x1).unwrap_or(self.xs.len());
        first..end.max(first)
    }

    /// The first row not covered by tile row `r + 1` or later (the raster height after the last).
    pub(crate) fn rows_final_after(&self, r: usize) -> usize {
        self.ys.get(r + 1).copied().unwrap_or(self.height)
    }
}

/// Checks a tile size and overlap: `MIN_TILE..=MAX_TILE`, overlap at most half the tile.
pub(crate) fn check_tile(tile: usize, overlap: usize) -> Result<()> {
    if !(MIN_TILE..=MAX_TILE).contains(&tile) {
        return Err(Error::Input(format!("tile size {tile} px: expected {MIN_TILE} to {MAX_TILE}")));
    }
    if overlap > tile / 2 {
        return Err(Error::Input(format!("overlap {overlap} px is more than half the tile ({tile} px)")));
    }
    Ok(())
}

/// Column stripes `[x0, x1)` the raster is processed in: `ceil(width / max_stripe)` stripes of equal
/// width rounded up to a multiple of `block` (the output tile), the last one cut at the raster edge.
pub fn stripes(width: usize, max_stripe: usize, block: usize) -> Vec<(usize, usize)> {
    let block = block.max(1);
    let max_stripe = max_stripe.max(block);
    let n = width.div_ceil(max_stripe).max(1);
    let w = width.div_ceil(n).div_ceil(block) * block;
    let mut out = Vec::with_capacity(n);
    let mut x = 0;
    while x < width {
        out.push((x, (x + w).min(width)));
        x += w;
    }
    out
}

/// The blending weight of each pixel of a tile along one axis: a raised-cosine ramp from ~0 to 1
/// over the overlap with the previous tile and back over the overlap with the next; 1 elsewhere and
/// at the raster edges. With two tiles overlapping, the ramps of both sum to 1 at every pixel.
pub(crate) fn axis_weights(starts: &[usize], extent: usize, i: usize) -> Vec<f32> {
    let s = starts[i];
    let before = if i > 0 { starts[i - 1] + extent - s } else { 0 };
    let after = match starts.get(i + 1) {
        Some(&n) => s + extent - n,
        None => 0,
    };
    let ramp = |t: f64| (0.5 - 0.5 * (std::f64::consts::PI * t).cos()) as f32;
    (0..extent)
        .map(|u| {
            let mut w = 1.0f32;
            if u < before {
                w *= ramp((u as f64 + 0.5) / before as f64);
            }
            if u + after >= extent && after > 0 {
                w *= ramp((extent as f64 - u as f64 - 0.5) / after as f64);
            }
            w
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_cover_and_end_flush() {
        for len in [1usize, 31, 416, 417, 1000, 4096, 4097] {
            for (tile, ov) in [(416usize, 64usize), (64, 0), (64, 32), (100, 10)] {
                let s = axis_starts(len, tile, ov);
                let ext = tile.min(len);
                assert_eq!(s[0], 0);
                assert_eq!(s.last().copied().unwrap() + ext, len.max(ext), "len {len} tile {tile}");
                for w in s.windows(2) {
                    assert!(w[1] > w[0] && w[0] + ext >= w[1] + ov, "len {len} tile {tile} ov {ov}: {s:?}");
                }
            }
        }
    }

    #[test]
    fn weights_sum_to_one_over_two_tile_overlaps() {
        let s = axis_starts(1000, 200, 50);
        let mut sum = vec![0f32; 1000];
        for i in 0..s.len() {
            for (u, w) in axis_weights(&s, 200, i).iter().enumerate() {
                assert!(*w > 0.0 && *w <= 1.0);
                sum[s[i] + u] += w;
            }
        }
        assert!(sum.iter().all(|v| (v - 1.0).abs() < 1e-5), "{sum:?}");
    }

    #[test]
    fn stripes_are_block_aligned() {
        assert_eq!(stripes(4096, 4096, 256), vec![(0, 4096)]);
        assert_eq!(stripes(16384, 4096, 256), vec![(0, 4096), (4096, 8192), (8192, 12288), (12288, 16384)]);
        assert_eq!(stripes(5000, 4096, 256), vec![(0, 2560), (2560, 5000)]);
        assert_eq!(stripes(100, 4096, 256), vec![(0, 100)]);
    }
}
