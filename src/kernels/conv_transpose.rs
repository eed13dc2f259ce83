//! The CPU path of a transposed convolution whose kernel equals its stride (DPT's reassemble
//! upsampling): the output blocks do not overlap, so it is one GEMM, `[out·k·k, in] × [in, H·W]`,
//! whose rows are then spread into the `k × k` blocks.
use candle_core::{Result, Tensor};
use rayon::prelude::*;

use super::gemm::pool_parallelism;

/// The sizes of a transposed conv whose kernel equals its stride: input `[b, c, h, w]`, weight
/// `[c, o, k, k]`, output `[b, o, h·k, w·k]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Blocks {
    pub(crate) b: usize,
    pub(crate) c: usize,
    pub(crate) h: usize,
    pub(crate) w: usize,
    pub(crate) o: usize,
    pub(crate) k: usize,
}

impl Blocks {
    /// Rows of the block matrix (`o·k·k`) and pixels of an input plane.
    fn rows_pixels(&self) -> (usize, usize) {
        (self.o * self.k * self.k, self.h * self.w)
    }

    fn output_len(&self) -> usize {
        self.b * self.o * self.h * self.k * self.w * self.k
    }
}


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
    let g = Blocks { b, c, h, w: wd, o, k };
    let weight = w.flatten_all()?.to_vec1::<f32>()?;
    let bias = bias.map(|b| b.to_vec1::<f32>()).transpose()?;
    let out = crate::kernels::cpu_slice::with_contiguous(x, |xs: &[f32]| blocks_forward(&g, xs, &weight, bias.as_deref()))?.flatten();
    out.map(|out| Tensor::from_vec(out, (b, o, h * k, wd * k), x.device())).transpose()
}

/// [`blocks_by_gemm`] on slices; `None` when a length disagrees with `g`.
pub(crate) fn blocks_forward(g: &Blocks, xs: &[f32], weight: &[f32], bias: Option<&[f32]>) -> Option<Vec<f32>> {
    let Blocks { b, c, h, w: wd, o, k } = *g;
    let (rows, hw) = g.rows_pixels();
    if xs.len() != b * c * hw || weight.len() != c * rows || bias.is_some_and(|v| v.len() != o) {
        return None;
    }
    let (oh, ow) = (h * k, wd * k);
    let mut out = vec![0f32; g.output_len()];
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
                0.0, 1.0, false, false, false, pool_parallelism(),
            );
        }
        // Output row y·k + i of channel `oc` takes, for each j, block row (oc, i, j)'s row y.
        dst.par_chunks_mut(ow).enumerate().for_each(|(r, line)| {
            let (oc, oy) = (r / oh, r % oh);
            let (y, i) = (oy / k, oy % k);
            let add = bias.map_or(0.0, |b| b[oc]);
            for j in 0..k {
                let src = &blocks[((oc * k + i) * k + j) * hw + y * wd..][..wd];
                for (xi, &v) in src.iter().enumerate() {
                    line[xi * k + j] = v + add;
                }
            }
        });
    }
    Some(out)
}

/// One image's output gradient `[o, h·k, w·k]` regrouped as the block matrix `[o·k·k, h·w]`.
fn gather_blocks(g: &Blocks, gy: &[f32], blocks: &mut [f32]) {
    let Blocks { h, w: wd, k, .. } = *g;
    let (ow, hw) = (wd * k, h * wd);
    blocks.par_chunks_mut(hw).enumerate().for_each(|(r, row)| {
        let (oc, i, j) = (r / (k * k), (r / k) % k, r % k);
        for y in 0..h {
            let src = &gy[(oc * h * k + y * k + i) * ow..][..ow];
            for (xi, d) in row[y * wd..(y + 1) * wd].iter_mut().enumerate() {
                *d = src[xi * k + j];
            }
        }
    });
}

/// The gradients `(dx, dw)` of [`blocks_forward`] from its input, weight and the output gradient
/// `gy`, each only when asked for; `None` when a length disagrees with `g`.
pub(crate) fn blocks_backward(g: &Blocks, xs: &[f32], weight: &[f32], gy: &[f32], want: (bool, bool)) -> Option<(Vec<f32>, Vec<f32>)> {
    let Blocks { b, c, o, k, .. } = *g;
    let (rows, hw) = g.rows_pixels();
    if xs.len() != b * c * hw || weight.len() != c * rows || gy.len() != g.output_len() {
        return None;
    }
    let (mut dx, mut dw) = (vec![0f32; if want.0 { xs.len() } else { 0 }], vec![0f32; if want.1 { weight.len() } else { 0 }]);
    let mut blocks = vec![0f32; rows * hw];
    for (i, dy) in gy.chunks_exact(o * hw * k * k).enumerate() {
        gather_blocks(g, dy, &mut blocks);
        if want.0 {
            // dx[c, hw] = w[c, rows] · blocks[rows, hw].
            crate::kernels::gemm::product(&mut dx[i * c * hw..][..c * hw], (c, hw, rows), weight, false, &blocks, false, 1.0, false, pool_parallelism());
        }
        if want.1 {
            // dw[c, rows] += x[c, hw] · blocks[rows, hw]ᵀ.
            crate::kernels::gemm::product(&mut dw, (c, rows, hw), &xs[i * c * hw..][..c * hw], false, &blocks, true, 1.0, true, pool_parallelism());
        }
    }
    Some((dx, dw))
}

