//! Attention for training on the CPU (f32): `softmax(q kᵀ · scale) v` per head, and its backward
//! recomputing the probabilities from q and k instead of keeping the `[B, H, N, N]` score matrix
//! (and Candle's half-dozen intermediates of that size) alive from the forward to the backward.
//! Each head's scores live in one per-task `[Nq, Nk]` buffer; heads run in parallel.
use rayon::prelude::*;

use super::fast_math::softmax_numerator;
use super::gemm::product;

/// The sizes of one attention: `heads` (batch × heads) independent heads of `nq` queries and `nk`
/// keys of width `d`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Heads {
    pub(crate) heads: usize,
    pub(crate) nq: usize,
    pub(crate) nk: usize,
    pub(crate) d: usize,
}

impl Heads {
    fn lengths_match(&self, q: &[f32], k: &[f32], v: &[f32]) -> bool {
        q.len() == self.heads * self.nq * self.d && k.len() == self.heads * self.nk * self.d && v.len() == k.len()
    }

    fn inner_parallelism(&self) -> gemm::Parallelism {
        let threads = rayon::current_num_threads();
        if self.heads < threads { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None }
    }
}

/// One head's probabilities `softmax(q kᵀ · scale)` into `p` (`nq × nk`).
fn probabilities(s: &Heads, q: &[f32], k: &[f32], scale: f32, p: &mut Vec<f32>, par: gemm::Parallelism) {
    p.clear();
    p.resize(s.nq * s.nk, 0.0);
    product(p, (s.nq, s.nk, s.d), q, false, k, true, 1.0, false, par);
    for row in p.chunks_exact_mut(s.nk) {
        let sum = softmax_numerator(row, scale);
        let inv = 1.0 / sum;
        row.iter_mut().for_each(|x| *x *= inv);
    }
}

/// `softmax(q kᵀ · scale) v` for `q` `[heads, nq, d]`, `k`, `v` `[heads, nk, d]` (contiguous):
/// `[heads, nq, d]`; `None` when a length disagrees with `s`.
pub(crate) fn forward(s: &Heads, q: &[f32], k: &[f32], v: &[f32], scale: f32) -> Option<Vec<f32>> {
    if !s.lengths_match(q, k, v) {
        return None;
    }
    let (qd, kd) = (s.nq * s.d, s.nk * s.d);
    let par = s.inner_parallelism();
    let mut out = vec![0f32; s.heads * qd];
    out.par_chunks_exact_mut(qd.max(1)).enumerate().for_each_init(Vec::new, |p, (h, o)| {
        let (q, k, v) = (&q[h * qd..][..qd], &k[h * kd..][..kd], &v[h * kd..][..kd]);
        probabilities(s, q, k, scale, p, par);
        product(o, (s.nq, s.d, s.nk), p, false, v, false, 1.0, false, par);
    });
    Some(out)
}

/// The gradients `(dq, dk, dv)` of [`forward`] from its inputs, its output `o` and the output's
/// gradient `go` (all contiguous, `[heads, n, d]`); `None` when a length disagrees with `s`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(s: &Heads, q: &[f32], k: &[f32], v: &[f32], o: &[f32], go: &[f32], scale: f32) -> Option<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    if !s.lengths_match(q, k, v) || o.len() != q.len() || go.len() != q.len() {
        return None;
    }
    let (qd, kd) = (s.nq * s.d, s.nk * s.d);
    let par = s.inner_parallelism();
    let (mut dq, mut dk, mut dv) = (vec![0f32; q.len()], vec![0f32; k.len()], vec![0f32; v.len()]);
    let chunks = dq.par_chunks_exact_mut(qd.max(1)).zip(dk.par_chunks_exact_mut(kd.max(1))).zip(dv.par_chunks_exact_mut(kd.max(1)));
    chunks.enumerate().for_each_init(
        || (Vec::new(), Vec::new()),
        |(p, dp), (h, ((dq, dk), dv))| {
            let (q, k, v) = (&q[h * qd..][..qd], &k[h * kd..][..kd], &v[h * kd..][..kd]);
            let (o, go) = (&o[h * qd..][..qd], &go[h * qd..][..qd]);
            probabilities(s, q, k, scale, p, par);
            // dv = pᵀ · go; dp = go · vᵀ.
            product(dv, (s.nk, s.d, s.nq), p, true, go, false, 1.0, false, par);
            dp.clear();
            dp.resize(s.nq * s.nk, 0.0);
            product(dp, (s.nq, s.nk, s.d), go, false, v, true, 1.0, false, par);
            // ds = p ∘ (dp − rowsum(go ∘ o)), in place of dp.
            for (i, (ds, p)) in dp.chunks_exact_mut(s.nk).zip(p.chunks_exact(s.nk)).enumerate() {
                let dot: f32 = go[i * s.d..][..s.d].iter().zip(&o[i * s.d..][..s.d]).map(|(a, b)| a * b).sum();
                ds.iter_mut().zip(p).for_each(|(g, &p)| *g = p * (*g - dot));
            }
            // dq = scale · ds · k; dk = scale · dsᵀ · q.
            product(dq, (s.nq, s.d, s.nk), dp, false, k, false, scale, false, par);
            product(dk, (s.nk, s.d, s.nq), dp, true, q, false, scale, false, par);
        },
    );
    Some((dq, dk, dv))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        crate::kernels::test_values::spread(n, seed, &candle_core::Device::Cpu).to_vec1().unwrap()
    }

    /// Σ go ∘ attention(q, k, v) in f64, straight from the definition.
    fn loss(s: &Heads, q: &[f64], k: &[f64], v: &[f64], go: &[f32], scale: f64) -> f64 {
        let mut total = 0.0;
        for h in 0..s.heads {
            for i in 0..s.nq {
                let scores: Vec<f64> = (0..s.nk).map(|j| (0..s.d).map(|t| q[(h * s.nq + i) * s.d + t] * k[(h * s.nk + j) * s.d + t]).sum::<f64>() * scale).collect();
                let max = scores.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
                let z: f64 = e.iter().sum();
                for t in 0..s.d {
                    let o: f64 = (0..s.nk).map(|j| e[j] / z * v[(h * s.nk + j) * s.d + t]).sum();
                    total += o * go[(h * s.nq + i) * s.d + t] as f64;
                }
            }
        }
        total
    }

    #[test]
    fn gradients_match_finite_differences_in_f64() {
        for (i, s) in [Heads { heads: 3, nq: 5, nk: 5, d: 4 }, Heads { heads: 1, nq: 3, nk: 7, d: 2 }, Heads { heads: 2, nq: 17, nk: 17, d: 8 }].iter().enumerate() {
            let seed = 10 * i as u64;
            let (q, k, v) = (values(s.heads * s.nq * s.d, seed + 1), values(s.heads * s.nk * s.d, seed + 2), values(s.heads * s.nk * s.d, seed + 3));
            let go = values(q.len(), seed + 4);
            let scale = 1.0 / (s.d as f32).sqrt();
            let o = forward(s, &q, &k, &v, scale).unwrap();
            let (dq, dk, dv) = backward(s, &q, &k, &v, &o, &go, scale).unwrap();
            let wide = |x: &[f32]| x.iter().map(|&v| v as f64).collect::<Vec<f64>>();
            let (q64, k64, v64) = (wide(&q), wide(&k), wide(&v));
            // The forward against the definition.
            let direct = loss(s, &q64, &k64, &v64, &go, scale as f64);
            let got: f64 = o.iter().zip(&go).map(|(&a, &b)| a as f64 * b as f64).sum();
            assert!((got - direct).abs() <= 1e-4 * direct.abs().max(1.0), "{s:?}: forward {got} vs {direct}");
            let eps = 1e-6;
            for (which, grad) in [(0, &dq), (1, &dk), (2, &dv)] {
                for (j, &g) in grad.iter().enumerate() {
                    let mut ins = [q64.clone(), k64.clone(), v64.clone()];
                    ins[which][j] += eps;
                    let up = loss(s, &ins[0], &ins[1], &ins[2], &go, scale as f64);
                    ins[which][j] -= 2.0 * eps;
                    let down = loss(s, &ins[0], &ins[1], &ins[2], &go, scale as f64);
                    let want = (up - down) / (2.0 * eps);
                    assert!((g as f64 - want).abs() <= 1e-4 * want.abs().max(1.0), "{s:?} operand {which} element {j}: {g} vs {want}");
                }
            }
        }
    }
}
