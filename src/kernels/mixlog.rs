//! CHMv2's `chmv2_mixlog` normalisation (bin logits → heights) for f32 on the CPU in one fused
//! pass: Candle's ops made ~10 passes over the `[B, 256, H, W]` logits (177 MB at 416²) and
//! reduced over the strided bin dimension, ~5–7 % of a CHMv2 forward. [`mixlog_heights_from_hidden`]
//! also folds in the head's last 1×1 conv, so the logits are never stored at all.
use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::{DType, Tensor};
use rayon::prelude::*;

use crate::error::Result;

/// Pixels per task: its bins × pixels block (256 KiB at 256 bins) stays in L2 across the three
/// sweeps over the bins.
const PIXELS: usize = 256;

/// The constants of transformers' `chmv2_mixlog` normalisation.
pub(crate) struct MixLog {
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
pub(crate) fn mixlog_heights(x: &Tensor, bins: &[f32], c: &MixLog) -> Result<Option<Tensor>> {
    if !plain_f32_cpu(x) {
        return Ok(None);
    }
    let (b, n, h, w) = x.dims4()?;
    if n != bins.len() {
        return Ok(None);
    }
    let out = crate::kernels::cpu_slice::with_contiguous(x, |xs: &[f32]| mixlog_forward(xs, (b, n, h * w), bins, c))?.flatten();
    Ok(match out {
        Some(out) => Some(Tensor::from_vec(out, (b, h, w), x.device())?),
        None => None,
    })
}

/// [`mixlog_heights`] of f32 logits `xs` (`b` items of `n` planes of `hw` pixels): `b · hw` heights;
/// `None` when a length disagrees.
pub(crate) fn mixlog_forward(xs: &[f32], (b, n, hw): (usize, usize, usize), bins: &[f32], c: &MixLog) -> Option<Vec<f32>> {
    if xs.len() != b * n * hw || bins.len() != n {
        return None;
    }
    if n == 0 {
        return Some(vec![0f32; b * hw]);
    }
    let bins: Vec<f32> = bins.iter().map(|v| v.max(c.eps)).collect();
    Some(by_bands(b, hw, |item, p0, o| pixels(&xs[item * n * hw..][..n * hw], hw, p0, o, &bins, c)))
}

/// Whether `t` is an f32 CPU tensor that records no gradient: what the fused passes take.
fn plain_f32_cpu(t: &Tensor) -> bool {
    t.dtype() == DType::F32 && t.device().is_cpu() && !t.track_op()
}

/// `b` images of `hw` output pixels, computed in parallel bands of [`PIXELS`]: `band(item, p0,
/// out)` writes pixels `p0 .. p0 + out.len()` of image `item`.
fn by_bands(b: usize, hw: usize, band: impl Fn(usize, usize, &mut [f32]) + Sync) -> Vec<f32> {
    let mut out = vec![0f32; b * hw];
    if hw > 0 {
        out.par_chunks_mut(hw).enumerate().for_each(|(item, item_out)| {
            item_out.par_chunks_mut(PIXELS).enumerate().for_each(|(block, o)| band(item, block * PIXELS, o));
        });
    }
    out
}

/// Heights `[B, H, W]` from the head's last hidden map `hidden` `[B, k, H, W]` through its final
/// 1×1 conv (`weight` `[n, k, 1, 1]`, `bias` `[n]`) and the normalisation, and per item whether
/// a logit was not finite. Band by band: a band's `[n, PIXELS]` logits are made in L2 by a GEMM
/// and reduced there, so the `[B, n, H, W]` logits (177 MB at 416²) are never written, checked
/// and read back. `None` where [`mixlog_heights`] would decline, or the conv is not a 1×1 from
/// `k` to `n = bins.len()` channels in f32.
pub(crate) fn mixlog_heights_from_hidden(hidden: &Tensor, weight: &Tensor, bias: Option<&Tensor>, bins: &[f32], c: &MixLog) -> Result<Option<(Tensor, Vec<bool>)>> {
    if !plain_f32_cpu(hidden) || !plain_f32_cpu(weight) || bias.is_some_and(|b| !plain_f32_cpu(b)) {
        return Ok(None);
    }
    let (b, k, h, w) = hidden.dims4()?;
    let (n, wk, kh, kw) = weight.dims4()?;
    if wk != k || (kh, kw) != (1, 1) || n != bins.len() || n == 0 || k == 0 {
        return Ok(None);
    }
    let bias = match bias {
        Some(t) if t.dims() == [n] => t.to_vec1::<f32>()?,
        Some(_) => return Ok(None),
        None => vec![0.0; n],
    };
    let hw = h * w;
    let bins: Vec<f32> = bins.iter().map(|v| v.max(c.eps)).collect();
    let bad: Vec<AtomicBool> = (0..b).map(|_| AtomicBool::new(false)).collect();
    let band = |item: usize, x: &[f32], ws: &[f32], p0: usize, out: &mut [f32]| {
        let len = out.len();
        crate::kernels::cpu_slice::with_scratch(&LOGITS, |logits| {
            logits.resize(n * PIXELS, 0.0);
            for (row, &v) in logits.chunks_exact_mut(PIXELS).zip(&bias) {
                row[..len].fill(v);
            }
            // SAFETY: `logits` holds n rows of PIXELS ≥ len; `ws` is `[n, k]`; `x` is the item's
            // `[k, hw]` and its columns p0 .. p0 + len lie inside each row.
            unsafe {
                gemm::gemm(
                    n, len, k,
                    logits.as_mut_ptr(), 1, PIXELS as isize, true,
                    ws.as_ptr(), 1, k as isize,
                    x.as_ptr().add(p0), 1, hw as isize,
                    1.0, 1.0, false, false, false, gemm::Parallelism::None,
                );
            }
            let non_finite = logits.chunks_exact(PIXELS).fold(false, |any, row| row[..len].iter().fold(any, |any, v| any | !v.is_finite()));
            if non_finite {
                bad[item].store(true, Ordering::Relaxed);
            }
            pixels(logits, PIXELS, 0, out, &bins, c);
        });
    };
    let out = crate::kernels::cpu_slice::with_contiguous(weight, |ws: &[f32]| {
        crate::kernels::cpu_slice::with_contiguous(hidden, |xs: &[f32]| by_bands(b, hw, |item, p0, o| band(item, &xs[item * k * hw..][..k * hw], ws, p0, o)))
    })?
    .transpose()?
    .flatten();
    Ok(match out {
        Some(out) => Some((Tensor::from_vec(out, (b, h, w), hidden.device())?, bad.iter().map(|f| f.load(Ordering::Relaxed)).collect())),
        None => None,
    })
}

thread_local! {
    /// Each worker's `[n, PIXELS]` band of logits, reused across bands.
    static LOGITS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
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

/// The input gradient `[B, n, H, W]` of [`mixlog_heights`] at f32 logits `xs` (`b` items of `n`
/// planes of `hw` pixels) from the heights' gradient `gy` `[B, H, W]`. Per pixel, with
/// `y'ᵢ = relu(xᵢ) + shift` (the shift is `eps_shift`: `relu` makes the minimum ≥ 0), `d = Σ y'`
/// and `s = Σ (y'ᵢ / d) · binᵢ`: `∂out/∂xⱼ = scale · [s > eps] · [xⱼ > 0] · (binⱼ − s·[d free]) / d`,
/// where `d` is free unless clamped to `eps` or replaced by 1 (not finite). `None` when a length
/// disagrees.
pub(crate) fn mixlog_backward(xs: &[f32], gy: &[f32], (b, n, hw): (usize, usize, usize), bins: &[f32], c: &MixLog) -> Option<Vec<f32>> {
    if xs.len() != b * n * hw || gy.len() != b * hw || bins.len() != n || n == 0 {
        return None;
    }
    let bins: Vec<f32> = bins.iter().map(|v| v.max(c.eps)).collect();
    let mut dx = vec![0f32; xs.len()];
    let out = crate::kernels::cpu_slice::SharedOut(dx.as_mut_ptr());
    let tasks: Vec<(usize, usize)> = (0..b).flat_map(|item| (0..hw).step_by(PIXELS).map(move |p0| (item, p0))).collect();
    tasks.into_par_iter().for_each(|(item, p0)| {
        let len = PIXELS.min(hw - p0);
        let x = &xs[item * n * hw..][..n * hw];
        let plane = |bin: usize| &x[bin * hw + p0..][..len];
        let shift = c.eps_shift;
        let (mut denom, mut inner) = ([0f32; PIXELS], [0f32; PIXELS]);
        for bin in 0..n {
            for (d, &v) in denom[..len].iter_mut().zip(plane(bin)) {
                *d += v.max(0.0) + shift;
            }
        }
        let mut free = [true; PIXELS];
        for (d, f) in denom[..len].iter_mut().zip(free.iter_mut()) {
            (*d, *f) = if d.abs() < f32::INFINITY { if *d < c.eps { (c.eps, false) } else { (*d, true) } } else { (1.0, false) };
        }
        for (bin, &value) in bins.iter().enumerate() {
            for ((s, &d), &v) in inner[..len].iter_mut().zip(&denom[..len]).zip(plane(bin)) {
                *s += (v.max(0.0) + shift) / d * value;
            }
        }
        for (bin, &value) in bins.iter().enumerate() {
            // SAFETY: this task alone writes pixels p0 .. p0 + len of every plane of its item.
            let dst = unsafe { std::slice::from_raw_parts_mut(out.at((item * n + bin) * hw + p0), len) };
            for (j, (d, &v)) in dst.iter_mut().zip(plane(bin)).enumerate() {
                let g = gy[item * hw + p0 + j] * c.scale;
                let open = inner[j] > c.eps && v > 0.0;
                let centre = if free[j] { inner[j] } else { 0.0 };
                *d = if open { g * (value - centre) / denom[j] } else { 0.0 };
            }
        }
    });
    Some(dx)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn values(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1().unwrap()
    }

    /// The band-by-band pass equals Candle's 1×1 conv then [`mixlog_heights`] over two items of
    /// three bands each (the last one short); a NaN in one item's hidden map flags that item only
    /// and leaves the other's heights as they were; other shapes and dtypes are declined.
    #[test]
    fn the_fused_conv_and_heights_match_logits_then_heights() {
        let dev = Device::Cpu;
        let (b, k, n, h, w) = (2, 5, 7, 19, 31);
        let hidden = Tensor::randn(0f32, 1.0, (b, k, h, w), &dev).unwrap().relu().unwrap();
        let weight = Tensor::randn(0f32, 1.0, (n, k, 1, 1), &dev).unwrap();
        let bias = Tensor::randn(0f32, 1.0, n, &dev).unwrap();
        let bins: Vec<f32> = (0..n).map(|i| 0.5 + 3.0 * i as f32).collect();
        let c = MixLog { max_clamp: 1e4, eps_shift: 1e-8, eps: 1e-12, scale: 8.0 };
        let logits = hidden.conv2d(&weight, 0, 1, 1, 1).unwrap().broadcast_add(&bias.reshape((1, n, 1, 1)).unwrap()).unwrap();
        let want = values(&mixlog_heights(&logits, &bins, &c).unwrap().unwrap());
        let (got, bad) = mixlog_heights_from_hidden(&hidden, &weight, Some(&bias), &bins, &c).unwrap().unwrap();
        assert_eq!(got.dims(), [b, h, w]);
        assert_eq!(bad, [false, false]);
        let got = values(&got);
        let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
        let err = got.iter().zip(&want).fold(0f32, |m, (g, w)| m.max((g - w).abs()));
        assert!(err <= 1e-5 * scale, "max abs error {err} (max |ref| {scale})");
        assert!(want.iter().any(|&v| (v - want[0]).abs() > 1e-3), "the heights must vary");

        let mut poisoned = values(&hidden);
        poisoned[k * h * w + 300] = f32::NAN;
        let poisoned = Tensor::from_vec(poisoned, (b, k, h, w), &dev).unwrap();
        let (again, bad) = mixlog_heights_from_hidden(&poisoned, &weight, Some(&bias), &bins, &c).unwrap().unwrap();
        assert_eq!(bad, [false, true]);
        assert_eq!(values(&again)[..h * w], got[..h * w]);

        let declined = |hidden: &Tensor, weight: &Tensor, bins: &[f32]| mixlog_heights_from_hidden(hidden, weight, None, bins, &c).unwrap().is_none();
        assert!(declined(&hidden, &weight, &bins[1..]));
        assert!(declined(&hidden, &Tensor::zeros((n, k, 3, 3), DType::F32, &dev).unwrap(), &bins));
        assert!(declined(&hidden, &Tensor::zeros((n, k + 1, 1, 1), DType::F32, &dev).unwrap(), &bins));
        assert!(declined(&hidden.to_dtype(DType::F64).unwrap(), &weight, &bins));
    }

    /// The backward against central differences of the f64 formula (the reference's, per pixel),
    /// over two items of a band and a half each.
    #[test]
    fn the_backward_matches_finite_differences_in_f64() {
        let (b, n, hw) = (2, 5, PIXELS + 37);
        let xs: Vec<f32> = crate::kernels::test_values::spread(b * n * hw, 1, &Device::Cpu).to_vec1().unwrap();
        let gy: Vec<f32> = crate::kernels::test_values::spread(b * hw, 2, &Device::Cpu).to_vec1().unwrap();
        let bins: Vec<f32> = (0..n).map(|i| 0.5 + 3.0 * i as f32).collect();
        let c = MixLog { max_clamp: 1e-4, eps_shift: 1e-8, eps: 1e-12, scale: 8.0 };
        let height = |x: &[f64]| -> f64 {
            let y: Vec<f64> = x.iter().map(|v| v.max(0.0) + c.eps_shift as f64).collect();
            let d = y.iter().sum::<f64>().max(c.eps as f64);
            (y.iter().zip(&bins).map(|(y, &bin)| y / d * bin as f64).sum::<f64>()).max(c.eps as f64) * c.scale as f64
        };
        let dx = mixlog_backward(&xs, &gy, (b, n, hw), &bins, &c).unwrap();
        for item in 0..b {
            for p in (0..hw).step_by(29) {
                let x: Vec<f64> = (0..n).map(|i| xs[(item * n + i) * hw + p] as f64).collect();
                for i in 0..n {
                    let (mut up, mut down) = (x.clone(), x.clone());
                    up[i] += 1e-6;
                    down[i] -= 1e-6;
                    let want = (height(&up) - height(&down)) / 2e-6 * gy[item * hw + p] as f64;
                    let got = dx[(item * n + i) * hw + p] as f64;
                    assert!((got - want).abs() <= 1e-4 * want.abs().max(1.0), "item {item} pixel {p} bin {i}: {got} vs {want}");
                }
            }
        }
    }
}
