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

/// The geometry of a dense conv (one group, no dilation): input `[b, c, h, w]`, weight
/// `[o, c, kh, kw]`, zero padding `pad` on every side, `stride` on both axes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Dense {
    pub(crate) b: usize,
    pub(crate) c: usize,
    pub(crate) h: usize,
    pub(crate) w: usize,
    pub(crate) o: usize,
    pub(crate) kh: usize,
    pub(crate) kw: usize,
    pub(crate) pad: usize,
    pub(crate) stride: usize,
}

impl Dense {
    /// Output rows and columns; `None` when the kernel does not fit the padded input or the stride is 0.
    pub(crate) fn output(&self) -> Option<(usize, usize)> {
        let side = |n: usize, k: usize| Some(self.pad.checked_mul(2)?.checked_add(n)?.checked_sub(k)?.checked_div(self.stride)? + 1);
        Some((side(self.h, self.kh)?, side(self.w, self.kw)?))
    }

    /// Rows of the image-to-columns matrix (`c·kh·kw`).
    pub(crate) fn taps(&self) -> usize {
        self.c * self.kh * self.kw
    }

    /// Whether the columns are the input planes themselves (a 1×1, stride-1, unpadded conv).
    pub(crate) fn pointwise(&self) -> bool {
        (self.kh, self.kw, self.stride, self.pad) == (1, 1, 1, 0)
    }

    /// Output rows per stripe: its columns and output stay in cache, and the stripe is wide
    /// enough that packing the weight once per stripe pays.
    pub(crate) fn stripe_rows(&self, (oh, ow): (usize, usize)) -> usize {
        (STRIPE_WORKING_SET / ((self.taps() + self.o) * ow).max(1)).max(MIN_STRIPE_PIXELS.div_ceil(ow.max(1))).clamp(1, oh.max(1))
    }

    /// Column row `r` (channel, kernel row, kernel column) of the output rows `y0..` of one image
    /// `img` `[c, h, w]`, one output row of `ow` values per chunk of `col` (what the padding reads
    /// stays as `col` holds it: zero).
    pub(crate) fn fill_column_row(&self, img: &[f32], ow: usize, y0: usize, r: usize, col: &mut [f32]) {
        let (kh, kw, stride, pad, h, wd) = (self.kh, self.kw, self.stride, self.pad, self.h, self.w);
        let (ci, ky, kx) = (r / (kh * kw), (r / kw) % kh, r % kw);
        let plane = &img[ci * h * wd..][..h * wd];
        for (dy, line) in col.chunks_exact_mut(ow).enumerate() {
            let iy = ((y0 + dy) * stride + ky) as isize - pad as isize;
            if iy < 0 || iy >= h as isize {
                continue;
            }
            let src = &plane[iy as usize * wd..][..wd];
            // Output x reads input x·stride + kx − pad; columns outside the input stay zero.
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
    }
}

/// The conv of f32 slices by the fastest kernel this CPU has for it: Winograd for 3×3 "same"
/// convs on AVX-512, the direct kernel for other stride-1 convs wider than 1×1, the stripe GEMM
/// otherwise. `None` when a length disagrees with `g` or the kernel does not fit.
pub(crate) fn conv_f32(g: &Dense, xs: &[f32], ws: &[f32], bias: Option<&[f32]>) -> Option<Vec<f32>> {
    g.output()?;
    if xs.len() != g.b * g.c * g.h * g.w || ws.len() != g.o * g.taps() || bias.is_some_and(|b| b.len() != g.o) {
        return None;
    }
    let Dense { b, c, h, w, o, kh, kw, pad, stride } = *g;
    if (kh, kw, pad, stride) == (3, 3, 1, 1) && crate::kernels::winograd::available() {
        if let Some(y) = crate::kernels::winograd::conv3x3(b, c, h, w, o, xs, ws, bias, Default::default()) {
            return Some(y);
        }
    }
    if stride == 1 && kh * kw > 1 && kh == kw {
        let s = crate::kernels::direct_conv::Shape { b, c, h, w, o, kh, kw, pad };
        if let Some(y) = crate::kernels::direct_conv::conv2d(&s, xs, ws, bias) {
            return Some(y);
        }
    }
    Some(stripe_conv(g, xs, ws, bias))
}

/// Conv of `x` `[B, C, H, W]` with `w` `[O, C, kh, kw]`, zero padding `pad` and `stride`, by
/// [`stripe_conv`].
pub(crate) fn stripe_gemm_conv(x: &Tensor, w: &Tensor, bias: Option<&Tensor>, pad: usize, stride: usize) -> Result<Tensor> {
    let (b, c, h, wd) = x.dims4()?;
    let (o, wc, kh, kw) = w.dims4()?;
    if wc != c {
        candle_core::bail!("conv2d: input has {c} channels, the weight expects {wc}");
    }
    let g = Dense { b, c, h, w: wd, o, kh, kw, pad, stride: stride.max(1) };
    let Some((oh, ow)) = g.output() else {
        candle_core::bail!("conv2d: a {kh}×{kw} kernel does not fit a {h}×{wd} input padded by {pad}");
    };
    let bias = bias.map(|b| b.to_vec1::<f32>()).transpose()?;
    let out = crate::kernels::cpu_slice::with_contiguous(w, |ws: &[f32]| crate::kernels::cpu_slice::with_contiguous(x, |xs: &[f32]| stripe_conv(&g, xs, ws, bias.as_deref())))?.transpose()?.flatten();
    match out {
        Some(out) => Tensor::from_vec(out, (b, o, oh, ow), x.device()),
        None => candle_core::bail!("conv2d: the fast path needs an f32 CPU input and weight"),
    }
}

/// The conv `g` of `xs` by `ws` (+ `bias`), by stripes of output rows sized to stay in cache: each
/// parallel task builds its stripe's columns `[C·kh·kw, rows·OW]` (image-to-columns, zero padding
/// by bounds) in a per-thread buffer and multiplies the weight by them straight into its rows of
/// the output (which start as the bias). The lengths must agree with `g`.
pub(crate) fn stripe_conv(g: &Dense, xs: &[f32], weight: &[f32], bias: Option<&[f32]>) -> Vec<f32> {
    let Dense { b, c, h, w: wd, o, .. } = *g;
    let Some((oh, ow)) = g.output() else { return Vec::new() };
    let k = g.taps();
    let rows = g.stripe_rows((oh, ow));
    let stripes = oh.div_ceil(rows);
    let threads = rayon::current_num_threads();
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
                    if let Some(bias) = bias {
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
            if g.pointwise() {
                // The columns are the input planes themselves: pixels y0·ow .. + n of each of
                // the c planes (stride h·w).
                multiply(img[y0 * ow..].as_ptr(), (h * wd) as isize);
                return;
            }
            crate::kernels::cpu_slice::with_scratch(&COLUMNS, |cols| {
                cols.clear();
                cols.resize(k * n, 0.0);
                let fill = |(r, col): (usize, &mut [f32])| g.fill_column_row(img, ow, y0, r, col);
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
            (0..stripes).for_each(|si| run(si, super::gemm::pool_parallelism()));
        }
    }
    out
}

thread_local! {
    /// Each worker's image-to-columns buffer (the stripe conv's and [`crate::kernels::conv_nhwc`]'s),
    /// reused across stripes and calls.
    pub(crate) static COLUMNS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}
