//! Direct stride-1 convolution for f32 on x86-64 CPUs with AVX-512 or AVX2 + FMA: no
//! image-to-columns matrix. A register tile is a few output channels × a few vectors of output
//! pixels of one row; for every input channel and kernel tap it loads the input pixels once (masked
//! at the borders, so the input is never padded or copied) and multiplies them by each channel's
//! weight, broadcast. The DPT heads' 3×3 convs ran at 110–150 GFLOP/s through the image-to-columns
//! GEMM (ONNX Runtime's direct NCHWc kernels reach ~330 on AVX-512); the tile keeps both FMA ports
//! busy from L1 instead.
#[cfg(target_arch = "x86_64")]
use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

/// Largest kernel side this kernel takes (the border masks are precomputed per kernel column).
pub(crate) const MAX_KERNEL: usize = 7;

/// The register tiles, by instruction set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
enum Isa {
    /// 8 channels × 48 pixels in 512-bit registers.
    Avx512,
    /// 6 channels × 16 pixels in 256-bit registers.
    Avx2,
}

/// Bytes of one tile's weights (all input channels and taps) above which the AVX2 tile loses to the
/// stripe GEMM: each 16-pixel chunk streams them all, and past L1 they come from L2 (CHMv2's 256-channel
/// 3×3 convs, 55 KiB per tile, made its forward ~8 % slower).
const AVX2_TILE_WEIGHT_BYTES: usize = 16 << 10;
/// Output channels per AVX2 register tile.
const AVX2_CHANNELS: usize = 6;

impl Isa {
    /// Whether a tile's weights for `s` stay in cache while a chunk runs (always for AVX-512, whose
    /// chunks are three times wider).
    fn tile_weights_fit(self, s: &Shape) -> bool {
        match self {
            Isa::Avx512 => true,
            Isa::Avx2 => s.c.saturating_mul(s.kh * s.kw).saturating_mul(AVX2_CHANNELS * 4) <= AVX2_TILE_WEIGHT_BYTES,
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl Isa {
    /// Output channels per register tile (and per packed weight tile).
    fn channels(self) -> usize {
        match self {
            Isa::Avx512 => avx512::CO,
            Isa::Avx2 => avx2::CO,
        }
    }
}

/// The widest tile this CPU runs, if any.
fn isa() -> Option<Isa> {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return Some(Isa::Avx512);
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            return Some(Isa::Avx2);
        }
    }
    None
}

/// Whether the CPU runs [`conv2d`].
pub fn available() -> bool {
    isa().is_some()
}

/// The shape of one convolution: input `[b, c, h, w]`, weight `[o, c, kh, kw]`, zero padding `pad`,
/// stride 1.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    /// Images.
    pub b: usize,
    /// Input channels.
    pub c: usize,
    /// Input rows.
    pub h: usize,
    /// Input columns.
    pub w: usize,
    /// Output channels.
    pub o: usize,
    /// Kernel rows.
    pub kh: usize,
    /// Kernel columns.
    pub kw: usize,
    /// Zero padding on every side.
    pub pad: usize,
}

impl Shape {
    /// Output rows and columns, or `None` when the kernel does not fit the padded input.
    pub fn output(&self) -> Option<(usize, usize)> {
        let padded = |n: usize| self.pad.checked_mul(2)?.checked_add(n);
        let oh = padded(self.h)?.checked_sub(self.kh)? + 1;
        let ow = padded(self.w)?.checked_sub(self.kw)? + 1;
        Some((oh, ow))
    }
}

/// The weight `[o, c, kh, kw]` regrouped as `[o / tile][c][kh][kw][tile]` (missing channels zero)
/// and the bias as `[o / tile][tile]`, for register tiles of `tile` channels.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn pack(s: &Shape, weight: &[f32], bias: Option<&[f32]>, tile: usize) -> (Vec<f32>, Vec<f32>) {
    let taps = s.c * s.kh * s.kw;
    let tiles = s.o.div_ceil(tile);
    let mut wp = vec![0f32; tiles * taps * tile];
    let mut bp = vec![0f32; tiles * tile];
    for co in 0..s.o {
        let (t0, j) = (co / tile, co % tile);
        for t in 0..taps {
            wp[(t0 * taps + t) * tile + j] = weight[co * taps + t];
        }
        bp[t0 * tile + j] = bias.map_or(0.0, |b| b[co]);
    }
    (wp, bp)
}

/// Stride-1 convolution of `x` `[b, c, h, w]` (row-major) by `weight` `[o, c, kh, kw]` plus
/// `bias` `[o]`, zero padding `s.pad`: the `[b, o, oh, ow]` output. `None` when the CPU has
/// neither AVX-512 nor AVX2 + FMA, a kernel side exceeds [`MAX_KERNEL`], the kernel does not fit,
/// or a length disagrees with the shape.
pub fn conv2d(s: &Shape, x: &[f32], weight: &[f32], bias: Option<&[f32]>) -> Option<Vec<f32>> {
    conv2d_on(isa()?, s, x, weight, bias)
}

/// [`conv2d`] with the tile of `isa`, which the caller has detected on this CPU.
fn conv2d_on(isa: Isa, s: &Shape, x: &[f32], weight: &[f32], bias: Option<&[f32]>) -> Option<Vec<f32>> {
    let (oh, ow) = s.output()?;
    let ok = s.kh <= MAX_KERNEL
        && s.kw <= MAX_KERNEL
        && isa.tile_weights_fit(s)
        && x.len() == s.b.checked_mul(s.c)?.checked_mul(s.h)?.checked_mul(s.w)?
        && weight.len() == s.o.checked_mul(s.c)?.checked_mul(s.kh)?.checked_mul(s.kw)?
        && bias.is_none_or(|b| b.len() == s.o);
    if !ok {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let n = s.b.checked_mul(s.o)?.checked_mul(oh)?.checked_mul(ow)?;
        let co = isa.channels();
        let (wp, bp) = pack(s, weight, bias, co);
        let mut out: Vec<f32> = Vec::with_capacity(n);
        {
            let dst = super::cpu_slice::SharedOut(out.as_mut_ptr());
            let tiles = s.o.div_ceil(co);
            let taps = s.c * s.kh * s.kw;
            // One task per output row, every channel tile in turn: the input rows it reads (all
            // channels) stay in L2 across the tiles instead of coming from memory once per tile.
            // (Blocking the input channels by 16 or 32 as well, partial sums kept in the output,
            // made no measurable difference on Zen 4.)
            (0..s.b * oh).into_par_iter().for_each(|task| {
                let (img, y) = (task / oh, task % oh);
                let xs = &x[img * s.c * s.h * s.w..][..s.c * s.h * s.w];
                let rows: Vec<Row> = (0..tiles)
                    .map(|tile| Row {
                        s,
                        x: xs,
                        w: &wp[tile * taps * co..][..taps * co],
                        bias: &bp[tile * co..][..co],
                        y,
                        channels: co.min(s.o - tile * co),
                        // Channel `tile·co + j`, row y of image `img`: plane stride oh·ow.
                        out: dst.at(((img * s.o + tile * co) * oh + y) * ow),
                        plane: oh * ow,
                        ow,
                    })
                    .collect();
                // SAFETY: `isa` was detected on this CPU; each row writes only its own output
                // elements (its channels' row `y` of its image), inside `out`'s capacity of `n`.
                unsafe {
                    match isa {
                        // Every channel tile on one chunk of pixels in turn, so the chunk's input
                        // stays in L1/L2 across the tiles (DA-V2-Small's head convs 2–4 % faster
                        // than each tile along the whole row).
                        Isa::Avx512 => {
                            let mut x0 = 0;
                            while x0 < ow {
                                for row in &rows {
                                    row.chunk_avx512(x0);
                                }
                                x0 += avx512::PX;
                            }
                        }
                        Isa::Avx2 => rows.iter().for_each(|r| r.run_avx2()),
                    }
                }
            });
        }
        // SAFETY: the tasks above wrote every one of the `n` elements (each image, channel and row
        // once, every column of the row); nothing else reads `out` until they are done.
        unsafe { out.set_len(n) };
        Some(out)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (oh, ow, weight, bias, isa);
        None
    }
}

/// One output row of one channel tile.
#[cfg(target_arch = "x86_64")]
struct Row<'a> {
    s: &'a Shape,
    x: &'a [f32],
    w: &'a [f32],
    bias: &'a [f32],
    y: usize,
    channels: usize,
    out: *mut f32,
    plane: usize,
    ow: usize,
}

#[cfg(target_arch = "x86_64")]
impl Row<'_> {
    /// The kernel rows whose input row lies inside the image (the others read the zero padding).
    fn kernel_rows(&self) -> std::ops::Range<usize> {
        let (y, pad, kh) = (self.y as isize, self.s.pad as isize, self.s.kh as isize);
        let lo = (pad - y).clamp(0, kh) as usize;
        let hi = (self.s.h as isize + pad - y).clamp(0, kh) as usize;
        lo..hi
    }

    /// The input row that kernel row `ky` of input channel `ci` reads (one of [`Self::kernel_rows`]).
    fn line(&self, ci: usize, ky: usize) -> &[f32] {
        let iy = self.y + ky - self.s.pad;
        &self.x[(ci * self.s.h + iy) * self.s.w..][..self.s.w]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    /// The tiles this CPU runs (the widest and every narrower one).
    fn isas_here() -> Vec<Isa> {
        match isa() {
            Some(Isa::Avx512) => vec![Isa::Avx512, Isa::Avx2],
            Some(Isa::Avx2) => vec![Isa::Avx2],
            None => vec![],
        }
    }

    /// Every tile, kernel size, padding, channel remainder and width tail against Candle's conv2d.
    #[test]
    fn matches_candles_conv_at_odd_shapes() {
        for isa in isas_here() {
            matches_candles_conv_with(isa);
        }
    }

    fn matches_candles_conv_with(isa: Isa) {
        let dev = Device::Cpu;
        for &(b, c, h, w, o, k, pad) in &[
            (1, 3, 9, 37, 5, 3, 1),
            (2, 16, 13, 50, 17, 3, 1),
            (1, 4, 7, 16, 8, 3, 0),
            (1, 5, 6, 33, 9, 5, 2),
            (1, 2, 5, 48, 3, 7, 3),
            (1, 3, 4, 20, 2, 2, 0),
            (1, 3, 3, 3, 4, 3, 4),
            (1, 6, 5, 80, 12, 3, 1),
            (1, 3, 4, 30, 6, 1, 0),
            (1, 2, 5, 75, 3, 5, 0),
        ] {
            let x = Tensor::randn(0f32, 1.0, (b, c, h, w), &dev).unwrap();
            let wt = Tensor::randn(0f32, 1.0, (o, c, k, k), &dev).unwrap();
            let bias = Tensor::randn(0f32, 1.0, o, &dev).unwrap();
            let want = x.conv2d(&wt, pad, 1, 1, 1).unwrap().broadcast_add(&bias.reshape((1, o, 1, 1)).unwrap()).unwrap();
            let s = Shape { b, c, h, w, o, kh: k, kw: k, pad };
            let got = conv2d_on(
                isa,
                &s,
                &x.flatten_all().unwrap().to_vec1().unwrap(),
                &wt.flatten_all().unwrap().to_vec1().unwrap(),
                Some(&bias.to_vec1().unwrap()),
            )
            .unwrap();
            let want = want.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(got.len(), want.len(), "{isa:?} {s:?}");
            let err = got.iter().zip(&want).map(|(g, w)| (g - w).abs()).fold(0f32, f32::max);
            assert!(err < 1e-4, "{isa:?} {s:?}: max abs error {err}");
        }
    }

    #[test]
    fn refuses_what_it_cannot_compute() {
        let s = Shape { b: 1, c: 1, h: 2, w: 2, o: 1, kh: 3, kw: 3, pad: 0 };
        assert!(conv2d(&s, &[0.0; 4], &[0.0; 9], None).is_none(), "kernel larger than the input");
        let s = Shape { pad: 1, ..s };
        assert!(conv2d(&s, &[0.0; 3], &[0.0; 9], None).is_none(), "input length");
        let s = Shape { kh: 9, kw: 9, pad: 4, ..s };
        assert!(conv2d(&s, &[0.0; 4], &[0.0; 81], None).is_none(), "kernel side");
        let wide = Shape { b: 1, c: 256, h: 8, w: 8, o: 8, kh: 3, kw: 3, pad: 1 };
        assert!(!Isa::Avx2.tile_weights_fit(&wide) && Isa::Avx512.tile_weights_fit(&wide));
        assert!(Isa::Avx2.tile_weights_fit(&Shape { c: 64, ..wide }), "DA-V2-Small's 64-channel convs");
    }
}
