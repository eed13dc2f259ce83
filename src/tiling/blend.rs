//! Blending overlapping tiles into output rows: every output pixel is the weighted mean of the
//! tiles covering it, with separable raised-cosine weights ([`super::plan::axis_weights`]), so values
//! change smoothly across tile borders. Rows are produced one at a time for one column stripe and
//! gathered into a band that is flushed as whole output blocks.
use std::ops::Range;

use super::map::TileMap;
use super::writer::{SampleKind, TiledTiffWriter};
use crate::error::{Error, Result};

/// What an output pixel becomes.
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    /// One float plane (canopy height, depth): the blended value; `nodata` where the source is no-data.
    Float {
        /// Value written at no-data pixels; `None`: the source's GDAL_NODATA value (NaN without one).
        nodata: Option<f32>,
    },
    /// Class ids: argmax of the blended logits mapped through `lut` (checkpoint id → output id);
    /// [`CLASS_NODATA`] where the source is no-data.
    Classes {
        /// Output id per checkpoint class.
        lut: Vec<u8>,
        /// Text for the TIFF ImageDescription (e.g. the class table as JSON).
        description: Option<String>,
        /// `(threshold, id)`: a pixel whose best blended score is below the threshold takes this
        /// output id (open-vocabulary segmentation's `prob_thd` and `bg_idx`).
        floor: Option<(f32, u8)>,
    },
}

/// The class id written at no-data pixels (the ignore index).
pub(crate) const CLASS_NODATA: u8 = 255;

impl Output {
    /// The output sample type.
    pub fn kind(&self) -> SampleKind {
        match self {
            Output::Float { .. } => SampleKind::F32,
            Output::Classes { .. } => SampleKind::U8,
        }
    }

    /// This output with a `None` no-data value replaced by `source` (NaN without one).
    pub fn resolved(&self, source: Option<f64>) -> Output {
        match self {
            Output::Float { nodata: None } => Output::Float { nodata: Some(source.map(|v| v as f32).unwrap_or(f32::NAN)) },
            other => other.clone(),
        }
    }

    /// The GDAL_NODATA text for this output.
    pub fn nodata_text(&self) -> String {
        match self {
            Output::Float { nodata: Some(v) } if !v.is_nan() => format!("{v}"),
            Output::Float { .. } => "nan".into(),
            Output::Classes { .. } => CLASS_NODATA.to_string(),
        }
    }
}

/// A tile taking part in blending: its map, where it lies and its weights.
#[derive(Debug)]
pub(crate) struct Placed {
    /// The model output.
    pub map: TileMap,
    /// Raster rows covered.
    pub rows: Range<usize>,
    /// Raster columns covered.
    pub cols: Range<usize>,
    /// Weight per tile column.
    pub wx: std::rc::Rc<[f32]>,
    /// Weight per tile row.
    pub wy: std::rc::Rc<[f32]>,
    /// Column taps cached by [`TileMap::sample_row`].
    pub taps: Vec<(usize, usize, f32)>,
}

/// Blends the tiles covering one row of a column stripe `[x0, x1)`.
pub(crate) struct RowBlender {
    x0: usize,
    width: usize,
    channels: usize,
    acc: Vec<f32>,
    wsum: Vec<f32>,
    buf: Vec<f32>,
}

impl RowBlender {
    /// A blender for the stripe `x0..x1` and `channels` planes.
    pub(crate) fn new(x0: usize, x1: usize, channels: usize) -> Self {
        let width = x1 - x0;
        RowBlender { x0, width, channels, acc: vec![0.0; channels * width], wsum: vec![0.0; width], buf: Vec::new() }
    }

    /// Accumulates raster row `y` from `tiles` (those not covering it are skipped).
    pub(crate) fn blend<'a>(&mut self, y: usize, tiles: impl Iterator<Item = &'a mut Placed>) {
        self.acc.fill(0.0);
        self.wsum.fill(0.0);
        let (x0, x1) = (self.x0, self.x0 + self.width);
        for t in tiles {
            if !t.rows.contains(&y) || t.cols.end <= x0 || t.cols.start >= x1 {
                continue;
            }
            let ty = y - t.rows.start;
            let (u0, u1) = (x0.max(t.cols.start) - t.cols.start, x1.min(t.cols.end) - t.cols.start);
            let n = u1 - u0;
            self.buf.resize(self.channels * n, 0.0);
            t.map.sample_row(ty, u0, u1, &mut t.taps, &mut self.buf);
            let wy = t.wy[ty];
            let base = t.cols.start + u0 - x0;
            for k in 0..n {
                let w = wy * t.wx[u0 + k];
                self.wsum[base + k] += w;
                for c in 0..self.channels {
                    self.acc[c * self.width + base + k] += w * self.buf[c * n + k];
                }
            }
        }
    }

    /// Writes the blended row as output samples (little-endian bytes) into `out`; `nodata[x]` marks
    /// source no-data pixels of the stripe.
    pub(crate) fn finish_row(&self, output: &Output, nodata: Option<&[bool]>, out: &mut Vec<u8>) -> Result<()> {
        out.clear();
        let masked = |x: usize| nodata.is_some_and(|m| m[x]);
        match output {
            Output::Float { nodata: nd } => {
                for x in 0..self.width {
                    let v = if masked(x) { nd.unwrap_or(f32::NAN) } else { self.acc[x] / self.wsum[x] };
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
            Output::Classes { lut, floor, .. } => {
                for x in 0..self.width {
                    if masked(x) {
                        out.push(CLASS_NODATA);
                        continue;
                    }
                    // Ties go to the lowest class and NaN wins, as `resize_argmax` (the weight sum is
                    // positive, so the argmax of the sums is that of the means).
                    let (mut best, mut arg) = (f32::NEG_INFINITY, 0usize);
                    for k in 0..self.channels {
                        let v = self.acc[k * self.width + x];
                        if best.is_nan() {
                            break;
                        }
                        if k == 0 || v > best || v.is_nan() {
                            best = v;
                            arg = k;
                        }
                    }
                    let id = lut.get(arg).copied().ok_or_else(|| Error::Input(format!("class {arg} is outside the class map")))?;
                    out.push(match floor {
                        Some((threshold, below)) if best / self.wsum[x] < *threshold => *below,
                        _ => id,
                    });
                }
            }
        }
        Ok(())
    }
}

/// Finished output rows of one stripe, written out as whole blocks.
pub(crate) struct OutBand {
    x0: usize,
    width: usize,
    row_bytes: usize,
    block: usize,
    sample: usize,
    /// First raster row held (a multiple of `block`).
    y0: usize,
    rows: Vec<u8>,
}

impl OutBand {
    /// A band for stripe columns `x0..x1` (`x0` a multiple of the writer's block).
    pub(crate) fn new(x0: usize, x1: usize, kind: SampleKind, block: usize) -> Self {
        let width = x1 - x0;
        OutBand { x0, width, row_bytes: width * kind.bytes(), block, sample: kind.bytes(), y0: 0, rows: Vec::new() }
    }

    /// Appends the next row.
    pub(crate) fn push(&mut self, row: &[u8]) {
        self.rows.extend_from_slice(&row[..self.row_bytes]);
    }

    /// Writes every complete block row; with `last`, the remainder too (padded with zeros).
    pub(crate) fn flush(&mut self, w: &mut TiledTiffWriter, last: bool) -> Result<()> {
        let b = self.block;
        loop {
            let held = self.rows.len() / self.row_bytes;
            if held == 0 || (held < b && !last) {
                return Ok(());
            }
            let n = held.min(b);
            let bx0 = self.x0 / b;
            let mut data = vec![0u8; b * b * self.sample];
            for bx in bx0..(self.x0 + self.width).div_ceil(b) {
                data.fill(0);
                let c0 = bx * b - self.x0;
                let c1 = ((bx + 1) * b - self.x0).min(self.width);
                for r in 0..n {
                    let src = &self.rows[r * self.row_bytes + c0 * self.sample..r * self.row_bytes + c1 * self.sample];
                    data[r * b * self.sample..r * b * self.sample + src.len()].copy_from_slice(src);
                }
                w.write_block(bx, self.y0 / b, &data)?;
            }
            self.rows.drain(..n * self.row_bytes);
            self.y0 += b;
        }
    }
}
