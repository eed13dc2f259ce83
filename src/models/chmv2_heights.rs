//! CHMv2's `chmv2_mixlog` normalisation (bin logits → heights) for f32 on the CPU in one fused
//! pass: Candle's ops made ~10 passes over the `[B, 256, H, W]` logits (177 MB at 416²) and
//! reduced over the strided bin dimension, ~5–7 % of a CHMv2 forward.
use candle_core::{DType, Tensor};
use rayon::prelude::*;

use crate::error::Result;

/// Pixels per task: its bins × pixels block (256 KiB at 256 bins) stays in L2 across the three
/// sweeps over the bins.
const PIXELS: usize = 256;

/// The constants of transformers' `chmv2_mixlog` normalisation.
pub(super) struct MixLog {
    /// Upper clamp of the shift that makes the smallest bin weight non-negative.
    pub max_clamp: f32,
    /// Added to that shift.
    pub eps_shift: f32,
    /// Lower clamp of the denominator, the bins and the result.
    pub eps: f32,
    /// The result's factor.
    pub scale: f32,
}

/// Heights `[B, H, W]` from f32 CPU logits `[B, n, H, W]` and the `n` bin values, or `None` when
/// the logits are not f32 on the CPU or record a gradient (then Candle's ops run). Per pixel, as
/// transformers: `y = relu(x)`, `y += clamp(-min y, 0, max_clamp) + eps_shift`, `d = Σ y` (1 when
/// not finite, at least eps), `out = max(Σ (y / d) · max(bin, eps), eps) · scale`.
pub(super) fn mixlog_heights(x: &Tensor, bins: &[f32], c: &MixLog) -> Result<Option<Tensor>> {
    if x.dtype() != DType::F32 || !x.device().is_cpu() || x.track_op() {
        return Ok(None);
    }
    let (b, n, h, w) = x.dims4()?;
    if n != bins.len() {
        return Ok(None);
    }
    let hw = h * w;
    let bins: Vec<f32> = bins.iter().map(|v| v.max(c.eps)).collect();
    let out = crate::nn::cpu_slice::with_contiguous(x, |xs: &[f32]| {
        let mut out = vec![0f32; b * hw];
        if hw > 0 && n > 0 {
            out.par_chunks_mut(hw).zip(xs.par_chunks(n * hw)).for_each(|(item_out, item)| {
                item_out.par_chunks_mut(PIXELS).enumerate().for_each(|(block, o)| pixels(item, hw, block * PIXELS, o, &bins, c));
            });
        }
        out
    })?;
    Ok(match out {
        Some(out) => Some(Tensor::from_vec(out, (b, h, w), x.device())?),
        None => None,
    })
}

/// The heights of pixels `p0 .. p0 + out.len()` of one item (`x`: `n` planes of `hw` pixels).
fn pixels(x: &[f32], hw: usize, p0: usize, out: &mut [f32], bins: &[f32], c: &MixLog) {
    let len = out.len();
    let plane = |bin: usize| &x[bin * hw + p0..][..len];
    let mut shift = [f32::INFINITY; PIXELS];
    let shift = &mut shift[..len];
    for bin in 0..bins.len() {
        for (m, &v) in shift.iter_mut().zip(plane(bin)) {
            *m = m.min(v.max(0.0));
        }
    }
    for m in shift.iter_mut() {
        *m = (-*m).clamp(0.0, c.max_clamp) + c.eps_shift;
    }
    let mut denom = [0f32; PIXELS];
    let denom = &mut denom[..len];
    for bin in 0..bins.len() {
        for ((d, &s), &v) in denom.iter_mut().zip(&*shift).zip(plane(bin)) {
            *d += v.max(0.0) + s;
        }
    }
    for d in denom.iter_mut() {
        *d = if d.abs() < f32::INFINITY { d.max(c.eps) } else { 1.0 };
    }
    out.fill(0.0);
    for (bin, &value) in bins.iter().enumerate() {
        for (((o, &s), &d), &v) in out.iter_mut().zip(&*shift).zip(&*denom).zip(plane(bin)) {
            *o += (v.max(0.0) + s) / d * value;
        }
    }
    for o in out.iter_mut() {
        *o = o.max(c.eps) * c.scale;
    }
}
