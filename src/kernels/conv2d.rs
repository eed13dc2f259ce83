//! The f32 CPU paths of a 2-D convolution: Winograd F(2×2, 3×3) for 3×3 "same" convs on AVX-512
//! ([`crate::kernels::winograd`]), the direct kernel ([`crate::kernels::direct_conv`]) for other
//! stride-1 convs wider than 1×1, and an image-to-columns GEMM in row stripes small enough that each
//! stripe's columns stay in cache (the GEMM writes the stripe's NCHW output rows in place).
use candle_core::{DType, Result, Tensor};
use rayon::prelude::*;

/// Floats of one stripe's columns and output (512 KiB, in L2; 2 MiB and 192 KiB were slower).
const STRIPE_WORKING_SET: usize = 128 << 10;
/// The fewest output pixels per stripe: the GEMM packs the whole weight for each stripe, so a wide
/// conv on a small map (DPT's 3×3 / 2 over 384 channels, 19 pixels a row) must not take one row
/// at a time.
const MIN_STRIPE_PIXELS: usize = 256;

/// A 3×3, stride-1, padding-1 conv of `x` by [`crate::kernels::winograd`] (AVX-512), of `relu(x)` with
/// `relu_input`, plus `residual`, its output through a ReLU with `relu_output`; `None` where the
/// kernel does not run or the residual is not an f32 CPU tensor of the output's shape.
pub(crate) fn winograd(x: &Tensor, w: &Tensor, bias: Option<&[f32]>, (relu_input, relu_output): (bool, bool), residual: Option<&Tensor>) -> Result<Option<Tensor>> {
    use crate::kernels::cpu_slice::with_contiguous;
    let ((b, c, h, wd), o) = (x.dims4()?, w.dim(0)?);
    if residual.is_some_and(|r| r.dtype() != DType::F32 || !r.device().is_cpu() || r.dims() != [b, o, h, wd]) {
        return Ok(None);
    }
    let out = with_contiguous(x, |xs: &[f32]| -> Result<Option<Vec<f32>>> {
        let run = |residual: Option<&[f32]>| -> Result<Option<Vec<f32>>> {
            let fused = crate::kernels::winograd::Fused { relu_input, residual, relu_output };
            Ok(with_contiguous(w, |ws: &[f32]| crate::kernels::winograd::conv3x3(b, c, h, wd, o, xs, ws, bias, fused))?.flatten())
        };
        match residual {
            Some(r) => Ok(with_contiguous(r, |rs: &[f32]| run(Some(rs)))?.transpose()?.flatten()),
            None => run(None),
        }
    })?
    .transpose()?
    .flatten();
    out.map(|v| Tensor::from_vec(v, (b, o, h, wd), x.device())).transpose()
}

/// A stride-1 conv with a kernel wider than 1×1 by [`crate::kernels::direct_conv`] (x86-64 CPUs with AVX-512 or AVX2);
/// `None` where that kernel does not run (1×1 convs are plain GEMMs, strided ones gathers: the
/// stripe path).
pub fn direct(x: &Tensor, w: &Tensor, bias: Option<&Tensor>, pad: usize, stride: usize) -> Result<Option<Tensor>> {
    use crate::kernels::cpu_slice::with_contiguous;
    use crate::kernels::direct_conv::{self, Shape};
    let ((b, c, h, wd), (o, wc, kh, kw)) = (x.dims4()?, w.dims4()?);
    if stride != 1 || kh * kw == 1 || wc != c || !direct_conv::available() {
        return Ok(None);
    }
    let s = Shape { b, c, h, w: wd, o, kh, kw, pad };
    let Some((oh, ow)) = s.output() else { return Ok(None) };
    let bias = match bias {
        Some(b) => Some(b.to_vec1::<f32>()?),
        None => None,
    };
    // 3×3 "same" convs by Winograd F(2×2, 3×3) where the CPU has AVX-512 (DPT convs 1.4–1.7× the
    // direct kernel), the others by the direct kernel.
    if (kh, kw, pad) == (3, 3, 1) && crate::kernels::winograd::available() {
        return winograd(x, w, bias.as_deref(), (false, false), None);
    }
    let out = with_contiguous(w, |weight: &[f32]| with_contiguous(x, |xs: &[f32]| direct_conv::conv2d(&s, xs, weight, bias.as_deref())))?
    .transpose()?
    .flatten()
    .flatten();
    out.map(|out| Tensor::from_vec(out, (b, o, oh, ow), x.device())).transpose()
}

/// Conv of `x` `[B, C, H, W]` with `w` `[O, C, kh, kw]`, zero padding `pad` and `stride`, by
/// stripes of output rows sized to stay in cache: each parallel task builds its stripe's columns
/// `[C·kh·kw + 1, rows·OW]` (image-to-columns, zero padding by bounds, a row of ones for the bias)
/// in a per-thread buffer and multiplies the weight by them straight into its rows of the output.
pub(crate) fn stripe_gemm_conv(x: &Tensor, w: &Tensor, bias: Option<&Tensor>, pad: usize, stride: usize) -> Result<Tensor> {
    let (b, c, h, wd) = x.dims4()?;
    let (o, wc, kh, kw) = w.dims4()?;
    if wc != c {
        candle_core::bail!("conv2d: input has {c} channels, the weight expects {wc}");
    }
    let stride = stride.max(1);
    let (Some(oh), Some(ow)) = ((h + 2 * pad).checked_sub(kh).map(|v| v / stride + 1), (wd + 2 * pad).checked_sub(kw).map(|v| v / stride + 1)) else {
        candle_core::bail!("conv2d: a {kh}×{kw} kernel does not fit a {h}×{wd} input padded by {pad}");
    };
    let k = c * kh * kw;
    let pointwise = (kh, kw, stride, pad) == (1, 1, 1, 0);
    let bias = bias.map(|b| b.to_vec1::<f32>()).transpose()?;
    let rows = (STRIPE_WORKING_SET / ((k + o) * ow).max(1)).max(MIN_STRIPE_PIXELS.div_ceil(ow.max(1))).clamp(1, oh.max(1));
    let stripes = oh.div_ceil(rows);
    let threads = rayon::current_num_threads();
    let convolve = |weight: &[f32], xs: &[f32]| -> Vec<f32> {
        let mut out = vec![0f32; b * o * oh * ow];
        for (img, dst) in xs.chunks_exact(c * h * wd).zip(out.chunks_exact_mut(o * oh * ow)) {
            let dst = crate::kernels::cpu_slice::SharedOut(dst.as_mut_ptr());
            let run = |si: usize, par: gemm::Parallelism| {
                let (y0, n) = (si * rows, rows.min(oh - si * rows) * ow);
                // The weight times the `k × n` columns at `rhs` (row stride `rhs_rs`), into the stripe.
                let multiply = |rhs: *const f32, rhs_rs: isize| {
                    // SAFETY: lhs is the `o × k` weight, rhs the caller's `k × n` columns; dst
                    // addresses output rows y0.. of each of the o channel planes (row stride
                    // oh·ow, n = rows·ow elements each), which no other stripe writes. With a
                    // bias, those rows start as the bias and the GEMM adds to them.
                    unsafe {
                        if let Some(bias) = &bias {
                            for (co, &v) in bias.iter().enumerate() {
                                std::slice::from_raw_parts_mut(dst.at(co * oh * ow + y0 * ow), n).fill(v);
                            }
                        }
                        gemm::gemm(
                            o, n, k,
                            dst.at(y0 * ow), 1, (oh * ow) as isize, bias.is_some(),
                            weight.as_ptr(), 1, k as isize,
                            rhs, 1, rhs_rs,
                            1.0, 1.0, false, false, false, par,
                        );
                    }
                };
                if pointwise {
                    // A 1×1, stride-1, unpadded conv's columns are the input planes themselves:
                    // pixels y0·ow .. + n of each of the c planes (stride h·w).
                    multiply(img[y0 * ow..].as_ptr(), (h * wd) as isize);
                    return;
                }
                crate::kernels::cpu_slice::with_scratch(&COLUMNS, |cols| {
                    cols.clear();
                    cols.resize(k * n, 0.0);
                    let fill = |(r, col): (usize, &mut [f32])| {
                        let (ci, ky, kx) = (r / (kh * kw), (r / kw) % kh, r % kw);
                        let plane = &img[ci * h * wd..][..h * wd];
                        for (dy, line) in col.chunks_exact_mut(ow).enumerate() {
                            let iy = ((y0 + dy) * stride + ky) as isize - pad as isize;
                            if iy < 0 || iy >= h as isize {
                                continue; // stays zero
                            }
                            let src = &plane[iy as usize * wd..][..wd];
                            // Output x reads input x·stride + kx − pad; columns outside the input
                            // stay zero.
                            let lo = pad.saturating_sub(kx).div_ceil(stride).min(ow);
                            let hi = (wd + pad).saturating_sub(kx).div_ceil(stride).min(ow);
                            if lo < hi {
                                let s0 = lo * stride + kx - pad;
                                if stride == 1 {
                                    line[lo..hi].copy_from_slice(&src[s0..s0 + (hi - lo)]);
                                } else {
                                    for (d, &v) in line[lo..hi].iter_mut().zip(src[s0..].iter().step_by(stride)) {
                                        *d = v;
                                    }
                                }
                            }
                        }
                    };
                    // The stripes in turn (a threaded GEMM each): their columns in parallel too.
                    if matches!(par, gemm::Parallelism::None) {
                        cols.chunks_exact_mut(n).enumerate().for_each(fill);
                    } else {
                        cols.par_chunks_exact_mut(n).enumerate().for_each(fill);
                    }
                    multiply(cols.as_ptr(), n as isize);
                });
            };
            if stripes >= 2 * threads {
                (0..stripes).into_par_iter().for_each(|si| run(si, gemm::Parallelism::None));
            } else {
                let par = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
                (0..stripes).for_each(|si| run(si, par));
            }
        }
        out
    };
    let out = crate::kernels::cpu_slice::with_contiguous(w, |ws: &[f32]| crate::kernels::cpu_slice::with_contiguous(x, |xs: &[f32]| convolve(ws, xs)))?.transpose()?.flatten();
    match out {
        Some(out) => Tensor::from_vec(out, (b, o, oh, ow), x.device()),
        None => candle_core::bail!("conv2d: the fast path needs an f32 CPU input and weight"),
    }
}

thread_local! {
    /// Each worker's image-to-columns buffer (the stripe conv's and [`crate::kernels::conv_nhwc`]'s),
    /// reused across stripes and calls.
    pub(crate) static COLUMNS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}
