//! Log-softmax over the channels of `[B, C, H, W]` class scores (f32, CPU), and its backward from the
//! output alone: a segmentation loss's largest tensors (150 classes at 512² is 315 MB per image pair)
//! go through one pass each way instead of Candle's seven-op formula with a strided reduction per
//! channel sum and a kept intermediate per op.
use rayon::prelude::*;

use super::fast_math::{add_exp_shifted, log_softmax_grad_row};

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
                    let m = (0..c).map(|ch| x[at(ch)]).fold(f64::MIN, f64::max);
                    let lse = m + (0..c).map(|ch| (x[at(ch)] - m).exp()).sum::<f64>().ln();
                    total += (0..c).map(|ch| (x[at(ch)] - lse) * g[at(ch)] as f64).sum::<f64>();
                }
            }
            total
        };
        let wide: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        let y = forward(&x, c, pixels).unwrap();
        let got: f64 = y.iter().zip(&g).map(|(&a, &b)| a as f64 * b as f64).sum();
        assert!((got - loss(&wide)).abs() <= 1e-4 * got.abs().max(1.0));
        let dx = backward(&y, &g, c, pixels).unwrap();
        for j in (0..x.len()).step_by(37) {
            let (mut up, mut down) = (wide.clone(), wide.clone());
            up[j] += 1e-6;
            down[j] -= 1e-6;
            let want = (loss(&up) - loss(&down)) / 2e-6;
            assert!((dx[j] as f64 - want).abs() <= 1e-4 * want.abs().max(1.0), "element {j}: {} vs {want}", dx[j]);
        }
    }
}
