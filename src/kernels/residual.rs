//! The residual update of a block with LayerScale, `x + h · γ` (`γ` over the last dimension), in
//! one pass on the CPU for f32 inference; Candle's `broadcast_mul` and add (two passes and an
//! intermediate tensor) elsewhere and whenever autograd records.
use candle_core::{DType, Tensor};
use rayon::prelude::*;

use super::cpu_slice::with_contiguous;

/// Rows per parallel task of the one-pass form.
const ROWS_PER_TASK: usize = 64;

/// `x + h · gamma` for `x`, `h` of one shape and `gamma` of their last dimension's length.
pub(crate) fn add_scaled(x: &Tensor, h: &Tensor, gamma: &Tensor) -> candle_core::Result<Tensor> {
    let one_pass = [x, h, gamma].iter().all(|t| t.dtype() == DType::F32 && t.device().is_cpu() && !t.track_op())
        && x.dims() == h.dims()
        && gamma.dims() == [x.dims().last().copied().unwrap_or(0)]
        && x.elem_count() > 0;
    if one_pass {
        let dim = gamma.elem_count();
        let sum = with_contiguous(x, |xs: &[f32]| {
            with_contiguous(h, |hs: &[f32]| {
                with_contiguous(gamma, |g: &[f32]| {
                    // Written straight into fresh storage: no zeroing pass first.
                    let mut out = Vec::with_capacity(xs.len());
                    out.spare_capacity_mut().par_chunks_mut(dim * ROWS_PER_TASK).zip(xs.par_chunks(dim * ROWS_PER_TASK)).zip(hs.par_chunks(dim * ROWS_PER_TASK)).for_each(|((o, xr), hr)| {
                        for ((o, xr), hr) in o.chunks_exact_mut(dim).zip(xr.chunks_exact(dim)).zip(hr.chunks_exact(dim)) {
                            for (((o, &xv), &hv), &gv) in o.iter_mut().zip(xr).zip(hr).zip(g) {
                                // Rounded as the two-op form: the product, then the sum (Rust never fuses them).
                                o.write(xv + hv * gv);
                            }
                        }
                    });
                    // SAFETY: `xs.len()` is a multiple of `dim` (x's last dimension), so the chunks
                    // above cover the storage and every element was written.
                    unsafe { out.set_len(xs.len()) };
                    out
                })
            })
        })?;
        if let Some(Ok(Some(Ok(Some(out))))) = sum {
            return Tensor::from_vec(out, x.dims(), x.device());
        }
    }
    x + h.broadcast_mul(gamma)?
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn one_pass_equals_the_two_op_form_bit_for_bit_and_autograd_still_records() {
        let dev = Device::Cpu;
        // 130 rows: two full tasks and a partial one.
        let x = Tensor::randn(0f32, 1.0, (2, 65, 24), &dev).unwrap();
        let h = Tensor::randn(0f32, 3.0, (2, 65, 24), &dev).unwrap();
        let g = Tensor::randn(0f32, 0.1, 24, &dev).unwrap();
        let want = (&x + h.broadcast_mul(&g).unwrap()).unwrap();
        let got = add_scaled(&x, &h, &g).unwrap();
        assert_eq!(got.flatten_all().unwrap().to_vec1::<f32>().unwrap(), want.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        // A trainable gamma takes Candle's ops, so its gradient exists.
        let gv = Var::from_tensor(&g).unwrap();
        let y = add_scaled(&x, &h, gv.as_tensor()).unwrap();
        let grads = y.sum_all().unwrap().backward().unwrap();
        let dg = grads.get(gv.as_tensor()).expect("gamma's gradient");
        let want_dg = h.sum((0, 1)).unwrap();
        let err = (dg - want_dg).unwrap().abs().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
        assert!(err < 1e-4, "gamma gradient error {err}");
    }
}
