//! Log-softmax over the channels of `[B, C, H, W]` class scores (f32, CPU), and its backward from the
//! output alone: a segmentation loss's largest tensors (150 classes at 512² is 315 MB per image pair)
//! go through one pass each way instead of Candle's seven-op formula with a strided reduction per
//! channel sum and a kept intermediate per op.
use rayon::prelude::*;

use super::fast_math::{add_exp_shifted, log_softmax_grad_row, softmax_mix_row};

/// Pixels per parallel task (contiguous within each channel plane).
const PIXELS_PER_TASK: usize = 512;

/// `x − logsumexp_c(x)` of `x` `[planes, c, pixels]`; `None` when the length disagrees.
pub(crate) fn forward(x: &[f32], c: usize, pixels: usize) -> Option<Vec<f32>> {
    if c == 0 || pixels == 0 || !x.len().is_multiple_of(c * pixels) {
        return None;
    }
    let mut out = vec![0f32; x.len()];
    let (out_ptr, tasks) = (crate::kernels::cpu_slice::SharedOut(out.as_mut_ptr()), tasks(x.len(), c, pixels));
    tasks.into_par_iter().for_each(|(base, p0, n)| {
        let (mut max, mut sum) = (vec![f32::NEG_INFINITY; n], vec![0f32; n]);
        for ch in 0..c {
            let row = &x[base + ch * pixels + p0..][..n];
            max.iter_mut().zip(row).for_each(|(m, &v)| *m = m.max(v));
        }
        for ch in 0..c {
            let row = &x[base + ch * pixels + p0..][..n];
            add_exp_shifted(row, &max, &mut sum);
        }
        let shift: Vec<f32> = max.iter().zip(&sum).map(|(&m, &s)| m + s.ln()).collect();
        for ch in 0..c {
            let at = base + ch * pixels + p0;
            // SAFETY: each task writes pixels p0..p0 + n of every channel of its plane only.
            let dst = unsafe { std::slice::from_raw_parts_mut(out_ptr.at(at), n) };
            dst.iter_mut().zip(&x[at..at + n]).zip(&shift).for_each(|((d, &v), &s)| *d = v - s);
        }
    });
    Some(out)
}

/// The input gradient `g − softmax · Σ_c g` of [`forward`] from its output `logp` and the output's
/// gradient `g`; `None` when a length disagrees.
pub(crate) fn backward(logp: &[f32], g: &[f32], c: usize, pixels: usize) -> Option<Vec<f32>> {
    if c == 0 || pixels == 0 || !logp.len().is_multiple_of(c * pixels) || g.len() != logp.len() {
        return None;
    }
    let mut dx = vec![0f32; g.len()];
    let (dx_ptr, tasks) = (crate::kernels::cpu_slice::SharedOut(dx.as_mut_ptr()), tasks(g.len(), c, pixels));
    tasks.into_par_iter().for_each(|(base, p0, n)| {
        let mut total = vec![0f32; n];
        for ch in 0..c {
            total.iter_mut().zip(&g[base + ch * pixels + p0..][..n]).for_each(|(t, &v)| *t += v);
        }
        for ch in 0..c {
            let at = base + ch * pixels + p0;
            // SAFETY: as in `forward`: this task's pixels of its plane only.
            let dst = unsafe { std::slice::from_raw_parts_mut(dx_ptr.at(at), n) };
            log_softmax_grad_row(&g[at..at + n], &logp[at..at + n], &total, dst);
        }
    });
    Some(dx)
}

/// Per pixel of `x` `[planes, c, pixels]`, the log-probability of class `target[pixel]` and the mean
/// log-probability over the classes: `[planes, 2, pixels]` (the cross-entropy's two terms, without
/// the `[planes, c, pixels]` log-probabilities). `None` when a length disagrees or a target is `≥ c`.
pub(crate) fn target_and_mean(x: &[f32], target: &[u32], c: usize, pixels: usize) -> Option<Vec<f32>> {
    if c == 0 || pixels == 0 || !x.len().is_multiple_of(c * pixels) || target.len() * c != x.len() || target.iter().any(|&t| t as usize >= c) {
        return None;
    }
    let planes = x.len() / (c * pixels);
    let mut out = vec![0f32; planes * 2 * pixels];
    let out_ptr = crate::kernels::cpu_slice::SharedOut(out.as_mut_ptr());
    tasks(x.len(), c, pixels).into_par_iter().for_each(|(base, p0, n)| {
        let plane = base / (c * pixels);
        let lse = log_sum_exp(x, base, p0, n, c, pixels);
        let mut mean = vec![0f32; n];
        for ch in 0..c {
            mean.iter_mut().zip(&x[base + ch * pixels + p0..][..n]).for_each(|(m, &v)| *m += v);
        }
        // SAFETY: each task writes pixels p0..p0 + n of its plane's two rows only.
        let (picked, avg) = unsafe {
            (std::slice::from_raw_parts_mut(out_ptr.at(plane * 2 * pixels + p0), n), std::slice::from_raw_parts_mut(out_ptr.at((plane * 2 + 1) * pixels + p0), n))
        };
        for j in 0..n {
            let t = target[plane * pixels + p0 + j] as usize;
            picked[j] = x[base + t * pixels + p0 + j] - lse[j];
            avg[j] = mean[j] / c as f32 - lse[j];
        }
    });
    Some(out)
}

/// The input gradient of [`target_and_mean`] from its output's gradient `g` `[planes, 2, pixels]`:
/// `∂/∂x_k = g₀ · ([k = t] − p_k) + g₁ · (1/c − p_k)`, the probabilities recomputed from `x`.
pub(crate) fn target_and_mean_backward(x: &[f32], target: &[u32], g: &[f32], c: usize, pixels: usize) -> Option<Vec<f32>> {
    if c == 0 || pixels == 0 || !x.len().is_multiple_of(c * pixels) || target.len() * c != x.len() || g.len() * c != 2 * x.len() || target.iter().any(|&t| t as usize >= c) {
        return None;
    }
    let mut dx = vec![0f32; x.len()];
    let dx_ptr = crate::kernels::cpu_slice::SharedOut(dx.as_mut_ptr());
    tasks(x.len(), c, pixels).into_par_iter().for_each(|(base, p0, n)| {
        let plane = base / (c * pixels);
        let lse = log_sum_exp(x, base, p0, n, c, pixels);
        let (g0, g1) = (&g[plane * 2 * pixels + p0..][..n], &g[(plane * 2 + 1) * pixels + p0..][..n]);
        let both: Vec<f32> = g0.iter().zip(g1).map(|(a, b)| a + b).collect();
        for ch in 0..c {
            let at = base + ch * pixels + p0;
            // SAFETY: this task's pixels of its plane only.
            let dst = unsafe { std::slice::from_raw_parts_mut(dx_ptr.at(at), n) };
            softmax_mix_row(&x[at..at + n], &lse, &both, g1, 1.0 / c as f32, dst);
        }
        for j in 0..n {
            let t = target[plane * pixels + p0 + j] as usize;
            // SAFETY: as above.
            unsafe { *dx_ptr.at(base + t * pixels + p0 + j) += g0[j] };
        }
    });
    Some(dx)
}

/// `log Σ_c exp(x_c)` of pixels `p0..p0 + n` of the plane at `base`.
fn log_sum_exp(x: &[f32], base: usize, p0: usize, n: usize, c: usize, pixels: usize) -> Vec<f32> {
    let (mut max, mut sum) = (vec![f32::NEG_INFINITY; n], vec![0f32; n]);
    for ch in 0..c {
        max.iter_mut().zip(&x[base + ch * pixels + p0..][..n]).for_each(|(m, &v)| *m = m.max(v));
    }
    for ch in 0..c {
        add_exp_shifted(&x[base + ch * pixels + p0..][..n], &max, &mut sum);
    }
    max.iter().zip(&sum).map(|(&m, &s)| m + s.ln()).collect()
}

/// (plane offset, first pixel, pixel count) of each task.
fn tasks(len: usize, c: usize, pixels: usize) -> Vec<(usize, usize, usize)> {
    let planes = len / (c * pixels);
    (0..planes)
        .flat_map(|b| (0..pixels).step_by(PIXELS_PER_TASK).map(move |p0| (b * c * pixels, p0, PIXELS_PER_TASK.min(pixels - p0))))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `log Σ_c exp(x)` of pixel `p` of plane `b` in f64 (the reference's).
    fn lse64(x: &[f64], (b, p): (usize, usize), c: usize, pixels: usize) -> f64 {
        let at = |ch: usize| b * c * pixels + ch * pixels + p;
        let m = (0..c).map(|ch| x[at(ch)]).fold(f64::MIN, f64::max);
        m + (0..c).map(|ch| (x[at(ch)] - m).exp()).sum::<f64>().ln()
    }

    /// `got` (the gradient of `loss` at `x`) against central differences, every `step`-th element.
    fn check_gradient(x: &[f32], got: &[f32], loss: &dyn Fn(&[f64]) -> f64, step: usize) {
        let wide: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        for j in (0..x.len()).step_by(step) {
            let (mut up, mut down) = (wide.clone(), wide.clone());
            up[j] += 1e-6;
            down[j] -= 1e-6;
            let want = (loss(&up) - loss(&down)) / 2e-6;
            assert!((got[j] as f64 - want).abs() <= 1e-4 * want.abs().max(1.0), "element {j}: {} vs {want}", got[j]);
        }
    }

    #[test]
    fn gradient_matches_finite_differences_in_f64() {
        // 2 planes, 5 classes, 600 pixels: two tasks per plane, the second short.
        let (planes, c, pixels) = (2, 5, 600);
        let x: Vec<f32> = crate::kernels::test_values::spread(planes * c * pixels, 1, &candle_core::Device::Cpu).to_vec1().unwrap();
        let g: Vec<f32> = crate::kernels::test_values::spread(x.len(), 2, &candle_core::Device::Cpu).to_vec1().unwrap();
        let loss = |x: &[f64]| -> f64 {
            let mut total = 0.0;
            for b in 0..planes {
                for p in 0..pixels {
                    let at = |ch: usize| b * c * pixels + ch * pixels + p;
                    let lse = lse64(x, (b, p), c, pixels);
                    total += (0..c).map(|ch| (x[at(ch)] - lse) * g[at(ch)] as f64).sum::<f64>();
                }
            }
            total
        };
        let wide: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        let y = forward(&x, c, pixels).unwrap();
        let got: f64 = y.iter().zip(&g).map(|(&a, &b)| a as f64 * b as f64).sum();
        assert!((got - loss(&wide)).abs() <= 1e-4 * got.abs().max(1.0));
        check_gradient(&x, &backward(&y, &g, c, pixels).unwrap(), &loss, 37);
    }

    #[test]
    fn target_and_mean_gradients_match_finite_differences_in_f64() {
        let (planes, c, pixels) = (2, 4, 530);
        let x: Vec<f32> = crate::kernels::test_values::spread(planes * c * pixels, 3, &candle_core::Device::Cpu).to_vec1().unwrap();
        let g: Vec<f32> = crate::kernels::test_values::spread(planes * 2 * pixels, 4, &candle_core::Device::Cpu).to_vec1().unwrap();
        let target: Vec<u32> = (0..planes * pixels).map(|i| (i * 7 % c) as u32).collect();
        let loss = |x: &[f64]| -> f64 {
            let mut total = 0.0;
            for b in 0..planes {
                for p in 0..pixels {
                    let at = |ch: usize| b * c * pixels + ch * pixels + p;
                    let lse = lse64(x, (b, p), c, pixels);
                    let picked = x[at(target[b * pixels + p] as usize)] - lse;
                    let mean = (0..c).map(|ch| x[at(ch)]).sum::<f64>() / c as f64 - lse;
                    total += picked * g[b * 2 * pixels + p] as f64 + mean * g[(b * 2 + 1) * pixels + p] as f64;
                }
            }
            total
        };
        let wide: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        let y = target_and_mean(&x, &target, c, pixels).unwrap();
        let got: f64 = y.iter().zip(&g).map(|(&a, &b)| a as f64 * b as f64).sum();
        assert!((got - loss(&wide)).abs() <= 1e-4 * got.abs().max(1.0));
        check_gradient(&x, &target_and_mean_backward(&x, &target, &g, c, pixels).unwrap(), &loss, 13);
        assert!(target_and_mean(&x, &vec![c as u32; planes * pixels], c, pixels).is_none());
    }
}
