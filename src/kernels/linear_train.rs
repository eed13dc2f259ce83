//! A linear layer for training on the CPU (f32): `y = x · Wᵀ + b` over all rows at once, and its
//! backward as two GEMMs and a column sum. Candle's form runs the batch item by item, adds the bias
//! by a broadcast whose backward is a strided reduction, and keeps the product and the sum apart.
use rayon::prelude::*;

use super::gemm::{pool_parallelism, product};

/// Rows per parallel task of the bias gradient's column sums.
const ROWS_PER_TASK: usize = 256;

/// The sizes of one linear: `rows` inputs of `k` features to `n` outputs; the weight is `[n, k]`,
/// or `[k, n]` when `transposed` (a frozen weight held for the inference GEMM).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Sizes {
    pub(crate) rows: usize,
    pub(crate) k: usize,
    pub(crate) n: usize,
    pub(crate) transposed: bool,
}


impl Sizes {
    fn fits(&self, x: &[f32], w: &[f32]) -> bool {
        x.len() == self.rows * self.k && w.len() == self.k * self.n
    }
}

/// `x · Wᵀ + bias` `[rows, n]`; `None` when a length disagrees with `s`.
pub(crate) fn forward(s: &Sizes, x: &[f32], w: &[f32], bias: Option<&[f32]>) -> Option<Vec<f32>> {
    if !s.fits(x, w) || bias.is_some_and(|b| b.len() != s.n) {
        return None;
    }
    let mut y = vec![0f32; s.rows * s.n];
    if let Some(b) = bias {
        y.par_chunks_mut(s.n.max(1) * ROWS_PER_TASK).for_each(|rows| rows.chunks_exact_mut(s.n.max(1)).for_each(|r| r.copy_from_slice(b)));
    }
    product(&mut y, (s.rows, s.n, s.k), x, false, w, !s.transposed, 1.0, bias.is_some(), pool_parallelism());
    Some(y)
}

/// `∂L/∂x = g · W` `[rows, k]` from the output gradient `g` `[rows, n]`.
pub(crate) fn input_grad(s: &Sizes, w: &[f32], g: &[f32]) -> Option<Vec<f32>> {
    if w.len() != s.k * s.n || g.len() != s.rows * s.n {
        return None;
    }
    let mut dx = vec![0f32; s.rows * s.k];
    product(&mut dx, (s.rows, s.k, s.n), g, false, w, s.transposed, 1.0, false, pool_parallelism());
    Some(dx)
}

/// `∂L/∂W` in the weight's layout: `gᵀ · x` `[n, k]`, or `xᵀ · g` `[k, n]` when transposed.
pub(crate) fn weight_grad(s: &Sizes, x: &[f32], g: &[f32]) -> Option<Vec<f32>> {
    if x.len() != s.rows * s.k || g.len() != s.rows * s.n {
        return None;
    }
    let mut dw = vec![0f32; s.k * s.n];
    if s.transposed {
        product(&mut dw, (s.k, s.n, s.rows), x, true, g, false, 1.0, false, pool_parallelism());
    } else {
        product(&mut dw, (s.n, s.k, s.rows), g, true, x, false, 1.0, false, pool_parallelism());
    }
    Some(dw)
}

/// `∂L/∂b`: the column sums of `g` `[rows, n]` (per-task partial sums, then their total).
pub(crate) fn bias_grad(n: usize, g: &[f32]) -> Vec<f32> {
    let n = n.max(1);
    g.par_chunks(n * ROWS_PER_TASK)
        .map(|rows| {
            let mut acc = vec![0f32; n];
            for r in rows.chunks_exact(n) {
                acc.iter_mut().zip(r).for_each(|(a, &v)| *a += v);
            }
            acc
        })
        .reduce(|| vec![0f32; n], |mut a, b| {
            a.iter_mut().zip(&b).for_each(|(x, y)| *x += y);
            a
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gradients_match_finite_differences_in_f64() {
        let values = |n: usize, seed: u64| -> Vec<f32> { crate::kernels::test_values::spread(n, seed, &candle_core::Device::Cpu).to_vec1().unwrap() };
        for transposed in [false, true] {
            // 600 rows: three bias-sum tasks, the last one short.
            let s = Sizes { rows: 600, k: 5, n: 3, transposed };
            let (x, w, b, g) = (values(s.rows * s.k, 1), values(s.k * s.n, 2), values(s.n, 3), values(s.rows * s.n, 4));
            let at = |w: &[f64], o: usize, i: usize| if transposed { w[i * s.n + o] } else { w[o * s.k + i] };
            let loss = |x: &[f64], w: &[f64], b: &[f64]| -> f64 {
                (0..s.rows).map(|r| (0..s.n).map(|o| (b[o] + (0..s.k).map(|i| x[r * s.k + i] * at(w, o, i)).sum::<f64>()) * g[r * s.n + o] as f64).sum::<f64>()).sum()
            };
            let wide = |v: &[f32]| v.iter().map(|&a| a as f64).collect::<Vec<f64>>();
            let (x64, w64, b64) = (wide(&x), wide(&w), wide(&b));
            let y = forward(&s, &x, &w, Some(&b)).unwrap();
            let got: f64 = y.iter().zip(&g).map(|(&a, &b)| a as f64 * b as f64).sum();
            let want = loss(&x64, &w64, &b64);
            assert!((got - want).abs() <= 1e-4 * want.abs().max(1.0));
            let grads = [input_grad(&s, &w, &g).unwrap(), weight_grad(&s, &x, &g).unwrap(), bias_grad(s.n, &g)];
            for (which, grad) in grads.iter().enumerate() {
                for j in (0..grad.len()).step_by(7) {
                    let mut ins = [x64.clone(), w64.clone(), b64.clone()];
                    ins[which][j] += 1e-6;
                    let up = loss(&ins[0], &ins[1], &ins[2]);
                    ins[which][j] -= 2e-6;
                    let down = loss(&ins[0], &ins[1], &ins[2]);
                    let want = (up - down) / 2e-6;
                    assert!((grad[j] as f64 - want).abs() <= 1e-4 * want.abs().max(1.0), "transposed {transposed} operand {which} element {j}: {} vs {want}", grad[j]);
                }
            }
        }
    }
}
