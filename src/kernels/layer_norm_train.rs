//! LayerNorm over the last dimension for training on the CPU (f32), forward and backward each one
//! pass over the rows (Candle's differentiable form is nine ops, each a tensor of the input's size
//! kept for the backward). The backward recomputes each row's mean and deviation from the input.
use rayon::prelude::*;

/// Rows per parallel task.
const ROWS_PER_TASK: usize = 64;

/// Mean and 1/σ of one row (two passes; the variance is the biased one, as PyTorch's).
fn stats(row: &[f32], eps: f32) -> (f32, f32) {
    let n = row.len().max(1) as f32;
    let mean = row.iter().sum::<f32>() / n;
    let var = row.iter().map(|&x| (x - mean) * (x - mean)).sum::<f32>() / n;
    (mean, 1.0 / (var + eps).sqrt())
}

/// `(x − mean) / sqrt(var + eps) · gamma + beta` per row of `dim` values; `None` when a length
/// disagrees.
pub(crate) fn forward(x: &[f32], dim: usize, gamma: &[f32], beta: Option<&[f32]>, eps: f32) -> Option<Vec<f32>> {
    if dim == 0 || !x.len().is_multiple_of(dim) || gamma.len() != dim || beta.is_some_and(|b| b.len() != dim) {
        return None;
    }
    let mut y = vec![0f32; x.len()];
    y.par_chunks_mut(dim * ROWS_PER_TASK).zip(x.par_chunks(dim * ROWS_PER_TASK)).for_each(|(ys, xs)| {
        for (yr, xr) in ys.chunks_exact_mut(dim).zip(xs.chunks_exact(dim)) {
            let (mean, rstd) = stats(xr, eps);
            for (j, (o, &v)) in yr.iter_mut().zip(xr).enumerate() {
                *o = (v - mean) * rstd * gamma[j] + beta.map_or(0.0, |b| b[j]);
            }
        }
    });
    Some(y)
}

/// The gradients `(dx, dgamma, dbeta)` of [`forward`] from its input `x` and the output's gradient
/// `gy`; `None` when a length disagrees.
pub(crate) fn backward(x: &[f32], dim: usize, gamma: &[f32], gy: &[f32], eps: f32) -> Option<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    if dim == 0 || !x.len().is_multiple_of(dim) || gamma.len() != dim || gy.len() != x.len() {
        return None;
    }
    let mut dx = vec![0f32; x.len()];
    let block = dim * ROWS_PER_TASK;
    let (dgamma, dbeta) = dx
        .par_chunks_mut(block)
        .zip(x.par_chunks(block).zip(gy.par_chunks(block)))
        .map(|(dxs, (xs, gys))| {
            let (mut dg, mut db) = (vec![0f32; dim], vec![0f32; dim]);
            for ((dxr, xr), gr) in dxs.chunks_exact_mut(dim).zip(xs.chunks_exact(dim)).zip(gys.chunks_exact(dim)) {
                let (mean, rstd) = stats(xr, eps);
                let (mut mean_g, mut mean_gx) = (0f32, 0f32);
                for j in 0..dim {
                    let xhat = (xr[j] - mean) * rstd;
                    let g = gr[j] * gamma[j];
                    mean_g += g;
                    mean_gx += g * xhat;
                    dg[j] += gr[j] * xhat;
                    db[j] += gr[j];
                }
                let (mean_g, mean_gx) = (mean_g / dim as f32, mean_gx / dim as f32);
                for j in 0..dim {
                    let xhat = (xr[j] - mean) * rstd;
                    dxr[j] = rstd * (gr[j] * gamma[j] - mean_g - xhat * mean_gx);
                }
            }
            (dg, db)
        })
        .reduce(
            || (vec![0f32; dim], vec![0f32; dim]),
            |(mut ga, mut ba), (gb, bb)| {
                ga.iter_mut().zip(&gb).for_each(|(a, b)| *a += b);
                ba.iter_mut().zip(&bb).for_each(|(a, b)| *a += b);
                (ga, ba)
            },
        );
    Some((dx, dgamma, dbeta))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        crate::kernels::test_values::spread(n, seed, &candle_core::Device::Cpu).to_vec1().unwrap()
    }

    /// Σ gy ∘ layer_norm(x) in f64, from the definition.
    fn loss(x: &[f64], dim: usize, gamma: &[f64], beta: &[f64], gy: &[f32], eps: f64) -> f64 {
        let mut total = 0.0;
        for (r, row) in x.chunks_exact(dim).enumerate() {
            let mean = row.iter().sum::<f64>() / dim as f64;
            let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / dim as f64;
            for j in 0..dim {
                total += ((row[j] - mean) / (var + eps).sqrt() * gamma[j] + beta[j]) * gy[r * dim + j] as f64;
            }
        }
        total
    }

    #[test]
    fn gradients_match_finite_differences_in_f64() {
        // 150 rows: three parallel tasks, the last one short.
        let (rows, dim, eps) = (150, 7, 1e-5);
        let x = values(rows * dim, 1);
        let gamma = values(dim, 2);
        let beta = values(dim, 3);
        let gy = values(rows * dim, 4);
        let wide = |v: &[f32]| v.iter().map(|&a| a as f64).collect::<Vec<f64>>();
        let (x64, g64, b64) = (wide(&x), wide(&gamma), wide(&beta));
        let y = forward(&x, dim, &gamma, Some(&beta), eps as f32).unwrap();
        let got: f64 = y.iter().zip(&gy).map(|(&a, &b)| a as f64 * b as f64).sum();
        let want = loss(&x64, dim, &g64, &b64, &gy, eps);
        assert!((got - want).abs() <= 1e-4 * want.abs().max(1.0));
        let (dx, dg, db) = backward(&x, dim, &gamma, &gy, eps as f32).unwrap();
        let h = 1e-6;
        let fd = |which: usize, j: usize| {
            let mut ins = [x64.clone(), g64.clone(), b64.clone()];
            ins[which][j] += h;
            let up = loss(&ins[0], dim, &ins[1], &ins[2], &gy, eps);
            ins[which][j] -= 2.0 * h;
            let down = loss(&ins[0], dim, &ins[1], &ins[2], &gy, eps);
            (up - down) / (2.0 * h)
        };
        for (which, grad) in [(0, &dx), (1, &dg), (2, &db)] {
            for (j, &g) in grad.iter().enumerate() {
                let want = fd(which, j);
                assert!((g as f64 - want).abs() <= 1e-4 * want.abs().max(1.0), "operand {which} element {j}: {g} vs {want}");
            }
        }
    }
}
