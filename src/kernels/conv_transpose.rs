//! The CPU path of a transposed convolution whose kernel equals its stride (DPT's reassemble
//! upsampling): the output blocks do not overlap, so it is one GEMM, `[out·k·k, in] × [in, H·W]`,
//! whose rows are then spread into the `k × k` blocks.
use candle_core::{Result, Tensor};
use rayon::prelude::*;

/// `x [B, C, H, W]` → `[B, O, H·k, W·k]` for a weight `[C, O, k, k]` (kernel = stride): output
/// pixel `(y·k + i, x·k + j)` of channel `o` is `bias[o] + Σ_c x[c, y, x] · w[c, o, i, j]`.
pub(crate) fn blocks_by_gemm(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Option<Tensor>> {
    let ((b, c, h, wd), (wc, o, k, _)) = (x.dims4()?, w.dims4()?);
    if wc != c {
        candle_core::bail!("conv_transpose2d: input has {c} channels, the weight expects {wc}");
    }
    if [b, c, h, wd, o, k].contains(&0) {
        return Ok(None); // an empty map: Candle's op
    }
    let (oh, ow, hw, rows) = (h * k, wd * k, h * wd, o * k * k);
    let weight = w.flatten_all()?.to_vec1::<f32>()?;
    let bias = match bias {
        Some(b) => b.to_vec1::<f32>()?,
        None => vec![0.0; o],
    };
    let threads = rayon::current_num_threads();
    let par = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    let out = crate::kernels::cpu_slice::with_contiguous(x, |xs: &[f32]| {
        let mut out = vec![0f32; b * o * oh * ow];
        let mut blocks = vec![0f32; rows * hw];
        for (img, dst) in xs.chunks_exact(c * hw).zip(out.chunks_exact_mut(o * oh * ow)) {
            // SAFETY: lhs is the weight read as `[rows, c]` (element (r, ci) at ci·rows + r, inside
            // its c·rows elements), rhs the image `[c, hw]` row-major, dst `blocks` `[rows, hw]`.
            unsafe {
                gemm::gemm(
                    rows, hw, c,
                    blocks.as_mut_ptr(), 1, hw as isize, false,
                    weight.as_ptr(), rows as isize, 1,
                    img.as_ptr(), 1, hw as isize,
                    0.0, 1.0, false, false, false, par,
                );
            }
            // Output row y·k + i of channel `oc` takes, for each j, block row (oc, i, j)'s row y.
            dst.par_chunks_mut(ow).enumerate().for_each(|(r, line)| {
                let (oc, oy) = (r / oh, r % oh);
                let (y, i) = (oy / k, oy % k);
                for j in 0..k {
                    let src = &blocks[((oc * k + i) * k + j) * hw + y * wd..][..wd];
                    for (xi, &v) in src.iter().enumerate() {
                        line[xi * k + j] = v + bias[oc];
                    }
                }
            });
        }
        out
    })?;
    out.map(|out| Tensor::from_vec(out, (b, o, oh, ow), x.device())).transpose()
}
