//! Resizing feature maps with PyTorch's `F.interpolate` semantics.
//!
//! Candle has nearest and bilinear but no bicubic; bicubic here is built as two small interpolation
//! matrices (rows and columns), so it runs on every backend and is differentiable.
use candle_core::{DType, Tensor};

use crate::error::{Error, Result};

/// How the output size and the source-coordinate scale of a resize are given.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Resize {
    /// By output size; PyTorch then uses `scale = in / out` (transformers 5.x position embeddings).
    Size(usize, usize),
    /// By scale factor (`out = floor(in · s)`), PyTorch then maps with `1 / s` (the original
    /// DINOv2 / Depth Anything `+0.1` rule passes `(new + 0.1) / old` here).
    ScaleFactor(f64, f64),
}

const CUBIC_A: f64 = -0.75;

fn cubic1(x: f64) -> f64 {
    ((CUBIC_A + 2.0) * x - (CUBIC_A + 3.0)) * x * x + 1.0
}

fn cubic2(x: f64) -> f64 {
    ((CUBIC_A * x - 5.0 * CUBIC_A) * x + 8.0 * CUBIC_A) * x - 4.0 * CUBIC_A
}

/// Largest side of a resize output (feature maps never exceed the network input).
pub(crate) const MAX_RESIZE_SIDE: usize = crate::config_check::MAX_INPUT_SIDE;

/// Checks a resize of `n_in` to `n_out` samples along one axis (both in `1..=MAX_RESIZE_SIDE`).
fn check_axis(n_in: usize, n_out: usize) -> Result<()> {
    if n_in == 0 || n_out == 0 || n_in > MAX_RESIZE_SIDE || n_out > MAX_RESIZE_SIDE {
        return Err(Error::Input(format!("cannot resize {n_in} to {n_out} samples: sizes must be in 1..={MAX_RESIZE_SIDE}")));
    }
    Ok(())
}

/// The `[out, in]` matrix of 1-D bicubic interpolation (align_corners=False, borders clamped),
/// where `scale` maps output to input coordinates.
pub(crate) fn bicubic_matrix(n_in: usize, n_out: usize, scale: f64) -> Result<Vec<f32>> {
    check_axis(n_in, n_out)?;
    let mut m = vec![0f32; n_out * n_in];
    for o in 0..n_out {
        let real = scale * (o as f64 + 0.5) - 0.5;
        let base = real.floor();
        let t = real - base;
        let w = [cubic2(t + 1.0), cubic1(t), cubic1(1.0 - t), cubic2(2.0 - t)];
        for (k, wk) in w.iter().enumerate() {
            let idx = (base as i64 - 1 + k as i64).clamp(0, n_in as i64 - 1) as usize;
            m[o * n_in + idx] += *wk as f32;
        }
    }
    Ok(m)
}

/// Output size and input-coordinate scales of a resize of an `h`×`w` map.
pub fn resolve(h: usize, w: usize, r: Resize) -> Result<(usize, usize, f64, f64)> {
    let (oh, ow, sh, sw) = match r {
        Resize::Size(oh, ow) => (oh, ow, h as f64 / oh.max(1) as f64, w as f64 / ow.max(1) as f64),
        Resize::ScaleFactor(fh, fw) => {
            if !(fh > 0.0 && fw > 0.0 && fh.is_finite() && fw.is_finite()) {
                return Err(Error::Input(format!("bad resize scale factors {fh}, {fw}")));
            }
            let (oh, ow) = ((h as f64 * fh).floor(), (w as f64 * fw).floor());
            if oh > MAX_RESIZE_SIDE as f64 || ow > MAX_RESIZE_SIDE as f64 {
                return Err(Error::Input(format!("resize of {h}×{w} by {fh}, {fw} exceeds {MAX_RESIZE_SIDE} per side")));
            }
            (oh as usize, ow as usize, 1.0 / fh, 1.0 / fw)
        }
    };
    if oh == 0 || ow == 0 {
        return Err(Error::Input(format!("resize of {h}×{w} gives an empty output {oh}×{ow}")));
    }
    check_axis(h, oh)?;
    check_axis(w, ow)?;
    Ok((oh, ow, sh, sw))
}

/// Bicubic resize of `x` `[B, C, H, W]` (computed in f32, returned in the input dtype).
pub fn bicubic(x: &Tensor, r: Resize) -> Result<Tensor> {
    let (b, c, h, w) = x.dims4()?;
    let (oh, ow, sh, sw) = resolve(h, w, r)?;
    let dev = x.device();
    let my = Tensor::from_vec(bicubic_matrix(h, oh, sh)?, (oh, h), dev)?;
    let mx = Tensor::from_vec(bicubic_matrix(w, ow, sw)?, (ow, w), dev)?;
    let xf = x.to_dtype(DType::F32)?.reshape((b * c, h, w))?;
    // rows: [oh, h] x [bc, h, w] -> [bc, oh, w]; then columns: [bc, oh, w] x [w, ow].
    let y = my.broadcast_left(b * c)?.matmul(&xf)?;
    let y = y.broadcast_matmul(&mx.t()?)?;
    Ok(y.reshape((b, c, oh, ow))?.to_dtype(x.dtype())?)
}

/// Bilinear resize to `(oh, ow)` with PyTorch's `align_corners` semantics.
pub fn bilinear(x: &Tensor, oh: usize, ow: usize, align_corners: bool) -> Result<Tensor> {
    let (_, _, h, w) = x.dims4()?;
    if (h, w) == (oh, ow) {
        return Ok(x.clone());
    }
    check_bilinear(x, oh, ow)?;
    Ok(super::grad::bilinear(x, oh, ow, align_corners)?)
}

/// The checks of [`bilinear`]: both sizes in range, the output's element count representable.
pub(crate) fn check_bilinear(x: &Tensor, oh: usize, ow: usize) -> Result<()> {
    let (b, c, h, w) = x.dims4()?;
    check_axis(h, oh)?;
    check_axis(w, ow)?;
    (b * c).checked_mul(oh).and_then(|v| v.checked_mul(ow)).ok_or_else(|| Error::Input(format!("bilinear resize of {:?} to {oh}×{ow} overflows", x.dims())))?;
    Ok(())
}

/// Bicubic resize (PyTorch semantics, align_corners=False, by size) of one row-major `h`×`w` map on
/// the CPU, four taps per axis; used to bring predictions back to the source resolution.
pub fn bicubic_map(values: &[f32], h: usize, w: usize, oh: usize, ow: usize) -> Result<Vec<f32>> {
    if h == 0 || w == 0 || oh == 0 || ow == 0 || h.checked_mul(w) != Some(values.len()) || oh.checked_mul(ow).is_none() {
        return Err(Error::Input(format!("cannot resize a map of {} values as {h}×{w} to {oh}×{ow}", values.len())));
    }
    let taps = |n_in: usize, n_out: usize| -> Vec<([usize; 4], [f32; 4])> {
        let scale = n_in as f64 / n_out as f64;
        (0..n_out)
            .map(|o| {
                let real = scale * (o as f64 + 0.5) - 0.5;
                let base = real.floor();
                let t = real - base;
                let wts = [cubic2(t + 1.0), cubic1(t), cubic1(1.0 - t), cubic2(2.0 - t)].map(|v| v as f32);
                let idx = [0, 1, 2, 3].map(|k| (base as i64 - 1 + k).clamp(0, n_in as i64 - 1) as usize);
                (idx, wts)
            })
            .collect()
    };
    let tx = taps(w, ow);
    let ty = taps(h, oh);
    let mut rows = vec![0f32; h * ow];
    for y in 0..h {
        let src = &values[y * w..(y + 1) * w];
        for (x, (idx, wts)) in tx.iter().enumerate() {
            rows[y * ow + x] = (0..4).map(|k| src[idx[k]] * wts[k]).sum();
        }
    }
    let mut out = vec![0f32; oh * ow];
    for (y, (idx, wts)) in ty.iter().enumerate() {
        for x in 0..ow {
            out[y * ow + x] = (0..4).map(|k| rows[idx[k] * ow + x] * wts[k]).sum();
        }
    }
    Ok(out)
}
