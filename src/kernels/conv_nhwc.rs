//! Convolution of a channels-last map (tokens `[B, H·W, C]`) into tokens `[B, OH·OW, O]`, for f32
//! inference on the CPU: image-to-columns and one GEMM per block of output pixels. A pixel's patch is
//! `kh` runs of `kw·C` contiguous floats (one copy each), so SegFormer's patch embeddings and
//! sequence-reduction convs run on its tokens without the two transposes to NCHW and back (those
//! took longer than the convs themselves: 5 of 9.5 ms in B0's sequence reductions at 512²).
use candle_core::{DType, Result, Tensor};
use rayon::prelude::*;

use super::cpu_slice::{with_contiguous, with_scratch, SharedOut};
use super::int8_gemm::PackedQ8;

/// One task's columns, in floats (256 KiB: in L2 with the weight).
const COLUMN_FLOATS: usize = 64 << 10;
/// The fewest output pixels per task.
const MIN_PIXELS: usize = 16;

/// A conv's kernel, stride and zero padding (square kernels and strides as SegFormer's, or not).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Window {
    /// Kernel height and width.
    pub kernel: (usize, usize),
    /// Step between output pixels, in input pixels.
    pub stride: usize,
    /// Zeros on every side.
    pub pad: usize,
}

impl Window {
    /// The output size for an `h × w` input, `None` where the kernel does not fit.
    pub(crate) fn output(&self, h: usize, w: usize) -> Option<(usize, usize)> {
        let s = self.stride.max(1);
        let oh = (h + 2 * self.pad).checked_sub(self.kernel.0)? / s + 1;
        let ow = (w + 2 * self.pad).checked_sub(self.kernel.1)? / s + 1;
        Some((oh, ow))
    }
}

/// `x` tokens `[B, h·w, C]` of an `h × w` map convolved with `weight` `[O, C, kh, kw]` (PyTorch's
/// layout) plus `bias` `[O]`: tokens `[B, OH·OW, O]` and `(OH, OW)`. `Ok(None)` where this path does
/// not run (not f32, not on the CPU, or recording for autograd): the caller takes the NCHW conv.
pub(crate) fn conv2d(x: &Tensor, (h, w): (usize, usize), weight: &Tensor, bias: Option<&Tensor>, window: Window) -> Result<Option<(Tensor, (usize, usize))>> {
    let tensors = [Some(x), Some(weight), bias];
    if tensors.iter().flatten().any(|t| !t.device().is_cpu() || t.dtype() != DType::F32 || t.track_op()) {
        return Ok(None);
    }
    let (o, c, kh, kw) = weight.dims4()?;
    let (b, shape) = Shape::checked(x, (h, w), (o, c, (kh, kw)), window)?;
    let (oh, ow) = (shape.oh, shape.ow);
    // [O, kh, kw, C]: row k of the weight matches the columns' order (ky, kx, channel).
    let weight = weight.permute((0, 2, 3, 1))?;
    let bias = bias.map(|b| b.to_vec1::<f32>()).transpose()?;
    let out = with_contiguous(&weight, |ws: &[f32]| with_contiguous(x, |xs: &[f32]| shape.run(b, xs, ws, bias.as_deref())))?.transpose()?.flatten();
    let Some(out) = out else { return Ok(None) };
    Ok(Some((Tensor::from_vec(out, (b, oh * ow, o), x.device())?, (oh, ow))))
}

/// A conv weight rounded to Q8_0 for the int8 GEMM ([`conv2d_int8`]): `[O, kh·kw·C]` in the
/// columns' order (ky, kx, channel).
#[derive(Debug)]
pub(crate) struct Int8Weight {
    packed: PackedQ8,
    kernel: (usize, usize),
    channels: usize,
}

impl Int8Weight {
    /// `weight` `[O, C, kh, kw]` (PyTorch's layout) rounded to Q8_0; `None` where this CPU has no
    /// int8 kernel or a patch's `kh·kw·C` values are not whole Q8_0 blocks.
    pub(crate) fn new(weight: &Tensor) -> Result<Option<Self>> {
        if !weight.device().is_cpu() || !super::int8_gemm::available() {
            return Ok(None);
        }
        let (o, c, kh, kw) = weight.dims4()?;
        let rows = weight.to_dtype(DType::F32)?.permute((0, 2, 3, 1))?.contiguous()?.reshape((o, kh * kw * c))?;
        Ok(PackedQ8::from_f32(&rows)?.map(|packed| Int8Weight { packed, kernel: (kh, kw), channels: c }))
    }
}

/// Output pixels per product of [`conv2d_int8`]: their columns (≤ 4 MiB) are the GEMM's input.
const INT8_COLUMN_FLOATS: usize = 1 << 20;

/// [`conv2d`] with an [`Int8Weight`]: each block of output pixels' columns are rounded per row to
/// 8 bits and multiplied by the int8 GEMM (a Q8_0 model's convolutions). `Ok(None)` where [`conv2d`]
/// would not run (not f32, not on the CPU, or recording for autograd).
pub(crate) fn conv2d_int8(x: &Tensor, (h, w): (usize, usize), weight: &Int8Weight, bias: Option<&Tensor>, window: Window) -> Result<Option<(Tensor, (usize, usize))>> {
    if [Some(x), bias].iter().flatten().any(|t| !t.device().is_cpu() || t.dtype() != DType::F32 || t.track_op()) {
        return Ok(None);
    }
    let (o, k) = (weight.packed.n(), weight.packed.k());
    let (b, shape) = Shape::checked(x, (h, w), (o, weight.channels, weight.kernel), window)?;
    let (c, oh, ow) = (shape.c, shape.oh, shape.ow);
    let pixels = oh * ow;
    let bias = bias.map(|b| b.to_vec1::<f32>()).transpose()?;
    let per_product = (INT8_COLUMN_FLOATS / k.max(1)).max(1);
    let mut out: Vec<f32> = Vec::with_capacity(b * pixels * o);
    let wrote = with_contiguous(x, |xs: &[f32]| {
        with_scratch(&crate::kernels::conv2d::COLUMNS, |columns| -> Result<()> {
            // Grown once per thread, never zeroed again: `patch` writes every value.
            if columns.len() < per_product.min(b * pixels) * k {
                columns.resize(per_product.min(b * pixels) * k, 0.0);
            }
            let spare = &mut out.spare_capacity_mut()[..b * pixels * o];
            // The output tokens of all images in turn: pixel g is pixel g % pixels of image g / pixels.
            for (block, dst) in spare.chunks_mut(per_product * o).enumerate() {
                let (first, count) = (block * per_product, dst.len() / o);
                let cols = &mut columns[..count * k];
                cols.par_chunks_exact_mut(k).enumerate().for_each(|(i, row)| {
                    let g = first + i;
                    shape.patch(&xs[(g / pixels) * h * w * c..][..h * w * c], g % pixels, row);
                });
                weight.packed.matmul_into(cols, count, bias.as_deref(), dst)?;
            }
            Ok(())
        })
    })?
    .transpose()?;
    if wrote.is_none() {
        return Ok(None);
    }
    // SAFETY: the blocks' products wrote every output token's `o` values.
    unsafe { out.set_len(b * pixels * o) };
    Ok(Some((Tensor::from_vec(out, (b, pixels, o), x.device())?, (oh, ow))))
}

/// The sizes of one call.
#[derive(Clone, Copy)]
struct Shape {
    h: usize,
    w: usize,
    c: usize,
    o: usize,
    oh: usize,
    ow: usize,
    window: Window,
}

impl Shape {
    /// The sizes of `x` (tokens `[B, h·w, C]`) convolved by an `[O, C, kh, kw]` weight through
    /// `window`, and `B`: an error where they disagree, the kernel does not fit, or the output or
    /// the columns would overflow.
    fn checked(x: &Tensor, (h, w): (usize, usize), (o, wc, kernel): (usize, usize, (usize, usize)), window: Window) -> Result<(usize, Shape)> {
        let (b, n, c) = x.dims3()?;
        if h.checked_mul(w) != Some(n) || wc != c || kernel != window.kernel {
            candle_core::bail!("conv2d: tokens {:?} of a {h}×{w} map, a {kernel:?} kernel over {wc} channels, window {:?}", x.dims(), window.kernel);
        }
        let Some((oh, ow)) = window.output(h, w) else {
            candle_core::bail!("conv2d: a {kernel:?} kernel does not fit a {h}×{w} input padded by {}", window.pad);
        };
        let sizes = [oh, ow, o, kernel.0, kernel.1, c];
        if sizes.iter().try_fold(b, |acc, &v| acc.checked_mul(v)).is_none() {
            candle_core::bail!("conv2d: a {oh}×{ow}×{o} output of {kernel:?}×{c} patches for {b} images overflows");
        }
        Ok((b, Shape { h, w, c, o, oh, ow, window }))
    }

    /// Floats in one pixel's patch (one row of the columns).
    fn taps(&self) -> usize {
        self.window.kernel.0 * self.window.kernel.1 * self.c
    }

    /// All `b` images: blocks of output pixels as parallel tasks, or one after another with a
    /// threaded GEMM when there are too few blocks to share.
    fn run(&self, b: usize, xs: &[f32], weight: &[f32], bias: Option<&[f32]>) -> Vec<f32> {
        let pixels = self.oh * self.ow;
        let per_task = (COLUMN_FLOATS / self.taps().max(1)).max(MIN_PIXELS).min(pixels.max(1));
        let blocks = pixels.div_ceil(per_task);
        let mut out: Vec<f32> = Vec::with_capacity(b * pixels * self.o);
        let dst = SharedOut(out.as_mut_ptr());
        let threads = rayon::current_num_threads();
        let task = |t: usize, par: gemm::Parallelism| {
            let (img, first) = (t / blocks, (t % blocks) * per_task);
            let count = per_task.min(pixels - first);
            let image = &xs[img * self.h * self.w * self.c..][..self.h * self.w * self.c];
            // SAFETY: the task writes output pixels `first .. first + count` of image `img`, which
            // no other task writes, inside `out`'s capacity.
            unsafe { self.block(image, first, count, weight, bias, dst.at((img * pixels + first) * self.o), par) };
        };
        if b * blocks >= 2 * threads {
            (0..b * blocks).into_par_iter().for_each(|t| task(t, gemm::Parallelism::None));
        } else {
            let par = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
            (0..b * blocks).for_each(|t| task(t, par));
        }
        // SAFETY: the tasks wrote every output pixel of every image, all `o` channels of each.
        unsafe { out.set_len(b * pixels * self.o) };
        out
    }

    /// Output pixels `first .. first + count` of one image: their columns, then `dst` (`count × o`)
    /// = bias + columns · weightᵀ.
    ///
    /// # Safety
    /// `dst` addresses `count × o` writable floats that nothing else accesses meanwhile.
    #[allow(clippy::too_many_arguments)]
    unsafe fn block(&self, image: &[f32], first: usize, count: usize, weight: &[f32], bias: Option<&[f32]>, dst: *mut f32, par: gemm::Parallelism) {
        let k = self.taps();
        with_scratch(&crate::kernels::conv2d::COLUMNS, |cols| {
            cols.resize(count * k, 0.0);
            let fill = |(i, row): (usize, &mut [f32])| self.patch(image, first + i, row);
            if matches!(par, gemm::Parallelism::None) {
                cols.chunks_exact_mut(k).enumerate().for_each(fill);
            } else {
                cols.par_chunks_exact_mut(k).enumerate().for_each(fill);
            }
            let out = std::slice::from_raw_parts_mut(dst, count * self.o);
            if let Some(bias) = bias {
                out.chunks_exact_mut(self.o).for_each(|px| px.copy_from_slice(bias));
            }
            // dst `count × o` (row stride o) = columns `count × k` · weightᵀ, the weight `o × k`
            // row-major (element (kk, j) of its transpose at j·k + kk).
            gemm::gemm(
                count, self.o, k,
                dst, 1, self.o as isize, bias.is_some(),
                cols.as_ptr(), 1, k as isize,
                weight.as_ptr(), k as isize, 1,
                1.0, 1.0, false, false, false, par,
            );
        });
    }

    /// Output pixel `p`'s patch into `row` (`kh · kw · C`, zeros where it overlaps the padding).
    fn patch(&self, image: &[f32], p: usize, row: &mut [f32]) {
        let Window { kernel: (_, kw), stride, pad } = self.window;
        let (oy, ox) = (p / self.ow, p % self.ow);
        let c = self.c;
        // Kernel columns kx read input column ox·stride + kx − pad: those inside the input.
        let x0 = ox * stride;
        let kx_lo = pad.saturating_sub(x0).min(kw);
        let kx_hi = (self.w + pad).saturating_sub(x0).min(kw).max(kx_lo);
        for (ky, run) in row.chunks_exact_mut(kw * c).enumerate() {
            let iy = (oy * stride + ky) as isize - pad as isize;
            if iy < 0 || iy >= self.h as isize {
                run.fill(0.0);
                continue;
            }
            run[..kx_lo * c].fill(0.0);
            run[kx_hi * c..].fill(0.0);
            if kx_hi > kx_lo {
                let from = (iy as usize * self.w + x0 + kx_lo - pad) * c;
                run[kx_lo * c..kx_hi * c].copy_from_slice(&image[from..][..(kx_hi - kx_lo) * c]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    /// The int8 conv against the f32 one within 8-bit rounding: several images, padding, a
    /// depth of several Q8_0 blocks, several products (more columns than one product takes).
    #[test]
    fn int8_tracks_the_f32_conv() {
        let dev = Device::Cpu;
        let (b, c, h, w, o) = (2, 64, 47, 45, 40);
        let x = crate::kernels::test_values::spread((b, h * w, c), 1, &dev);
        let wt = crate::kernels::test_values::spread((o, c, 3, 3), 2, &dev);
        let bias = crate::kernels::test_values::spread(o, 3, &dev);
        let window = Window { kernel: (3, 3), stride: 1, pad: 1 };
        assert!(b * h * w * 9 * c > INT8_COLUMN_FLOATS, "the test must cover several products");
        let Some(held) = Int8Weight::new(&wt).unwrap() else {
            eprintln!("no int8 kernel here: the int8 conv does not run");
            return;
        };
        let (want, size) = conv2d(&x, (h, w), &wt, Some(&bias), window).unwrap().unwrap();
        let (got, got_size) = conv2d_int8(&x, (h, w), &held, Some(&bias), window).unwrap().unwrap();
        assert_eq!(got_size, size);
        let err = (&got - &want).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
        let max = want.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
        assert!(err > 0.0 && err < 0.02 * max, "max error {err} (max |f32| {max})");
        // A patch of 3·3·3 values is not whole Q8_0 blocks: no int8 weight; a mismatched input is an error.
        assert!(Int8Weight::new(&crate::kernels::test_values::spread((o, 3, 3, 3), 4, &dev)).unwrap().is_none());
        assert!(conv2d_int8(&x, (h + 1, w), &held, Some(&bias), window).is_err());
    }

    /// Against Candle's NCHW conv: overlapping and patchifying kernels, padding wider than a stride,
    /// odd sizes, several images, with and without a bias, one and many blocks per image.
    #[test]
    fn equals_candles_conv_on_the_transposed_map() {
        let dev = Device::Cpu;
        for (b, c, h, w, o, k, stride, pad, bias) in [
            (2, 3, 23, 17, 8, 7, 4, 3, true),
            (1, 5, 9, 12, 6, 3, 2, 1, false),
            (1, 4, 16, 16, 5, 4, 4, 0, true),
            (3, 2, 5, 7, 3, 3, 1, 2, true),
            (1, 9, 70, 66, 4, 3, 1, 1, true),
        ] {
            let x = Tensor::randn(0f32, 1.0, (b, c, h, w), &dev).unwrap();
            let wt = Tensor::randn(0f32, 1.0, (o, c, k, k), &dev).unwrap();
            let bs = Tensor::randn(0f32, 1.0, o, &dev).unwrap();
            let bias = bias.then_some(&bs);
            let mut want = x.conv2d(&wt, pad, stride, 1, 1).unwrap();
            if let Some(bs) = bias {
                want = want.broadcast_add(&bs.reshape((1, o, 1, 1)).unwrap()).unwrap();
            }
            let tokens = x.flatten_from(2).unwrap().transpose(1, 2).unwrap().contiguous().unwrap();
            let window = Window { kernel: (k, k), stride, pad };
            let (got, (oh, ow)) = conv2d(&tokens, (h, w), &wt, bias, window).unwrap().unwrap();
            assert_eq!((oh, ow), (want.dim(2).unwrap(), want.dim(3).unwrap()));
            let want = want.flatten_from(2).unwrap().transpose(1, 2).unwrap();
            let err = (got - want).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
            assert!(err < 1e-4, "{b}×{c}×{h}×{w}, {o} out, {k}×{k}/{stride} pad {pad}: max error {err}");
        }
    }

    /// Shapes that disagree and kernels larger than the padded input are errors; other dtypes and
    /// recorded tensors are left to the caller.
    #[test]
    fn refuses_what_it_cannot_run() {
        let dev = Device::Cpu;
        let x = Tensor::zeros((1, 12, 4), DType::F32, &dev).unwrap();
        let wt = Tensor::zeros((2, 4, 3, 3), DType::F32, &dev).unwrap();
        let window = Window { kernel: (3, 3), stride: 1, pad: 1 };
        assert!(conv2d(&x, (3, 5), &wt, None, window).is_err(), "12 tokens are not 3 × 5");
        assert!(conv2d(&x, (3, 4), &Tensor::zeros((2, 5, 3, 3), DType::F32, &dev).unwrap(), None, window).is_err());
        assert!(conv2d(&x, (3, 4), &wt, None, Window { kernel: (5, 5), stride: 1, pad: 0 }).is_err());
        assert!(conv2d(&x.to_dtype(DType::F64).unwrap(), (3, 4), &wt.to_dtype(DType::F64).unwrap(), None, window).unwrap().is_none());
        let var = candle_core::Var::from_tensor(&wt).unwrap();
        assert!(conv2d(&x, (3, 4), var.as_tensor(), None, window).unwrap().is_none());
    }
}
