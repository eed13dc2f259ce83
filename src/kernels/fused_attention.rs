//! Fused scaled dot-product attention for f32 inference on the CPU. Each task takes one head and a
//! block of query rows: the score block `q kᵀ` (≤ 128 rows × Nk, ≤ 768 KiB) is computed, turned into
//! probabilities and multiplied by `v` while it is still in cache, so the `[B, H, Nq, Nk]` score
//! matrix that the unfused path writes and reads three times (45 MB per ViT-S layer at 518²) never
//! exists. The products run single-threaded per task, the tasks in parallel on rayon: on x86-64
//! with AVX2 on [`panel_gemm`] with each head's keys and values packed once (ViT-S at 1370 tokens
//! on Zen 4: 16.4 → 15.5 ms against the `gemm` crate, which packed them again for every block),
//! elsewhere on the `gemm` crate (Candle's own GEMM).
use std::cell::RefCell;

use candle_core::{CpuStorage, Layout, Storage, Tensor};
use gemm::{gemm, Parallelism};
use rayon::prelude::*;

use super::fast_math::softmax_numerator;
use super::panel_gemm::{self, Panels};
use crate::error::{Error, Result};

/// The most query rows per task (ViT-S at 1370 tokens: 128 rows 8 % faster than 64 with AVX-512).
const MAX_ROWS: usize = 128;
/// The score block's size bound in floats (768 KiB, in L2): longer key sets take fewer rows.
const SCORE_BLOCK_FLOATS: usize = 192 << 10;
/// The bound where [`panel_gemm`] runs (x86-64 with AVX2: on Zen 2, whose L2 is 512 KiB, 256 KiB
/// blocks ran ViT-S attention 2.6 % faster than 768 KiB, 128 KiB 1 % slower; on Zen 4 with
/// AVX-512, 128 KiB to 768 KiB all ran within 2 %).
const SCORE_BLOCK_FLOATS_PANELS: usize = 64 << 10;

/// A rank-4 `[B, H, N, D]` f32 view whose last dimension is contiguous.
pub(crate) struct HeadsView<'a> {
    data: &'a [f32],
    offset: usize,
    stride_b: usize,
    stride_h: usize,
    stride_n: usize,
}

impl HeadsView<'_> {
    /// Pointer to row `n` of head `h` of batch item `b`.
    fn row(&self, b: usize, h: usize, n: usize) -> *const f32 {
        self.rows_from(b, h, n).as_ptr()
    }

    /// The data from row `n` of head `h` of batch item `b` to the end.
    pub(crate) fn rows_from(&self, b: usize, h: usize, n: usize) -> &[f32] {
        &self.data[self.offset + b * self.stride_b + h * self.stride_h + n * self.stride_n..]
    }
}

/// Whether [`attention`] can run `q`, `k`, `v` (f32 on the CPU, nothing recording for autograd).
pub(crate) fn applies(q: &Tensor, k: &Tensor, v: &Tensor) -> bool {
    [q, k, v].iter().all(|t| t.device().is_cpu() && t.dtype() == candle_core::DType::F32 && t.rank() == 4 && !t.track_op())
}

/// `softmax(q kᵀ · scale) v` for `q` `[B, H, Nq, D]`, `k`, `v` `[B, H, Nk, D]` (any strides with
/// the last dimension contiguous), returned contiguous `[B, H, Nq, D]`. Callers check [`applies`].
pub(crate) fn attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32) -> Result<Tensor> {
    let (b, h, nq, nk, d) = dims(q, k, v)?;
    let (qs, ql) = q.storage_and_layout();
    let (ks, kl) = k.storage_and_layout();
    let (vs, vl) = v.storage_and_layout();
    let (qv, kv, vv) = (view(&qs, ql)?, view(&ks, kl)?, view(&vs, vl)?);
    let own_gemm = panel_gemm::available();
    let block_floats = if own_gemm { SCORE_BLOCK_FLOATS_PANELS } else { SCORE_BLOCK_FLOATS };
    let rows = (block_floats / nk).clamp(16, MAX_ROWS);
    let mut out = vec![0f32; b * h * nq * d];
    if nq > 0 && d > 0 {
        out.par_chunks_mut(nq * d).enumerate().for_each(|(bh, head_out)| {
            let (bi, hi) = (bh / h, bh % h);
            // The head's keys and values packed once for all its query blocks.
            let packed = own_gemm.then(|| (Panels::from_rows(nk, d, |j| kv.rows_from(bi, hi, j)), Panels::from_columns(nk, d, |j| vv.rows_from(bi, hi, j))));
            head_out.par_chunks_mut(rows * d).enumerate().for_each(|(block, o)| {
                let first = block * rows;
                let rows = o.len() / d;
                super::cpu_slice::with_scratch(&SCORES, |s| {
                    s.resize(rows * nk, 0.0);
                    attend_block(&qv, &kv, &vv, packed.as_ref(), (bi, hi), first, rows, nk, d, scale, s, o);
                });
            });
        });
    }
    drop((qs, ks, vs));
    Ok(Tensor::from_vec(out, (b, h, nq, d), q.device())?)
}

thread_local! {
    /// Each worker's score block, reused across tasks.
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `(B, H, Nq, Nk, D)` of `q` `[B, H, Nq, D]` and `k`, `v` `[B, H, Nk, D]`; an error where they
/// disagree or there are no keys.
pub(crate) fn dims(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(usize, usize, usize, usize, usize)> {
    let (b, h, nq, d) = q.dims4()?;
    let (kb, kh, nk, kd) = k.dims4()?;
    if (kb, kh, kd) != (b, h, d) || v.dims4()? != (b, h, nk, d) || nk == 0 {
        return Err(Error::Input(format!("attention: incompatible q {:?}, k {:?}, v {:?}", q.dims(), k.dims(), v.dims())));
    }
    Ok((b, h, nq, nk, d))
}

/// The f32 CPU data of a tensor as a [`HeadsView`], or an error for other storage.
pub(crate) fn view<'a>(storage: &'a Storage, layout: &Layout) -> Result<HeadsView<'a>> {
    let data = match storage {
        Storage::Cpu(CpuStorage::F32(data)) => data.as_slice(),
        _ => return Err(Error::Input("attention: fused path needs f32 CPU tensors".into())),
    };
    let st = layout.stride();
    if st.len() != 4 || (st[3] != 1 && layout.dims()[3] > 1) {
        return Err(Error::Input(format!("attention: last dimension not contiguous (strides {st:?})")));
    }
    Ok(HeadsView { data, offset: layout.start_offset(), stride_b: st[0], stride_h: st[1], stride_n: st[2] })
}

/// One head's query rows `first..first + rows`: scores, softmax, times `v`, into `out` (`rows × d`).
#[allow(clippy::too_many_arguments)]
fn attend_block(
    q: &HeadsView,
    k: &HeadsView,
    v: &HeadsView,
    packed: Option<&(Panels, Panels)>,
    (b, h): (usize, usize),
    first: usize,
    rows: usize,
    nk: usize,
    d: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let q_rows = q.rows_from(b, h, first);
    match packed {
        Some((keys, _)) => panel_gemm::multiply(q_rows, q.stride_n, rows, keys, scores, nk, false),
        // SAFETY: every pointer addresses `rows × d` (q), `nk × d` (k, v), `rows × nk` (scores)
        // and `rows × d` (out) elements inside their buffers with the strides given: the views
        // were checked against their tensors' layouts and the buffers sized from the same dims.
        None => unsafe {
            gemm(
                rows, nk, d,
                scores.as_mut_ptr(), 1, nk as isize, false,
                q_rows.as_ptr(), 1, q.stride_n as isize,
                k.row(b, h, 0), k.stride_n as isize, 1,
                0.0, 1.0, false, false, false, Parallelism::None,
            );
        },
    }
    let mut sums = [0f32; MAX_ROWS];
    for (r, row) in scores.chunks_exact_mut(nk).enumerate() {
        sums[r] = softmax_numerator(row, scale);
    }
    match packed {
        Some((_, values)) => panel_gemm::multiply(scores, nk, rows, values, out, d, false),
        // SAFETY: as above.
        None => unsafe {
            gemm(
                rows, d, nk,
                out.as_mut_ptr(), 1, d as isize, false,
                scores.as_ptr(), 1, nk as isize,
                v.row(b, h, 0), 1, v.stride_n as isize,
                0.0, 1.0, false, false, false, Parallelism::None,
            );
        },
    }
    for (row, sum) in out.chunks_exact_mut(d).zip(sums) {
        let inv = 1.0 / sum;
        row.iter_mut().for_each(|x| *x *= inv);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, D};

    fn reference(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Tensor {
        let s = (q.matmul(&k.t().unwrap()).unwrap() * scale).unwrap();
        candle_nn::ops::softmax(&s, D::Minus1).unwrap().matmul(v).unwrap()
    }

    #[test]
    fn matches_the_unfused_formula_for_contiguous_and_strided_inputs() {
        let dev = Device::Cpu;
        // 150 queries: two full blocks and a partial one; 70 keys: not a multiple of 8.
        let (b, h, nq, nk, d) = (2, 3, 150, 70, 16);
        let q = (Tensor::randn(0f32, 1.0, (b, h, nq, d), &dev).unwrap() * 3.0).unwrap();
        let k = Tensor::randn(0f32, 1.0, (b, h, nk, d), &dev).unwrap();
        let v = Tensor::randn(0f32, 1.0, (b, h, nk, d), &dev).unwrap();
        let scale = 0.25;
        let want = reference(&q, &k, &v, scale);
        let got = attention(&q, &k, &v, scale as f32).unwrap();
        let err = (got - &want).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
        assert!(err < 1e-5, "max abs error {err}");
        // k and v as strided views of one [B, Nk, 2, H, D] projection, as a fused qkv linear gives.
        let kv = Tensor::randn(0f32, 1.0, (b, nk, 2 * h * d), &dev).unwrap();
        let split = |i: usize| kv.narrow(2, i * h * d, h * d).unwrap().reshape((b, nk, h, d)).unwrap().transpose(1, 2).unwrap();
        let (ks, vs) = (split(0), split(1));
        assert!(!ks.is_contiguous());
        let want = reference(&q, &ks.contiguous().unwrap(), &vs.contiguous().unwrap(), scale);
        let got = attention(&q, &ks, &vs, scale as f32).unwrap();
        let err = (got - &want).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
        assert!(err < 1e-5, "strided: max abs error {err}");
    }

    #[test]
    fn mismatched_shapes_are_an_error() {
        let dev = Device::Cpu;
        let q = Tensor::zeros((1, 2, 4, 8), candle_core::DType::F32, &dev).unwrap();
        let k = Tensor::zeros((1, 2, 5, 4), candle_core::DType::F32, &dev).unwrap();
        assert!(attention(&q, &k, &k, 1.0).is_err());
    }
}
