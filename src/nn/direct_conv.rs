//! Direct stride-1 convolution for f32 on CPUs with AVX-512: no image-to-columns matrix. A register
//! tile is [`CO`] output channels × up to 48 output pixels of one row (24 accumulators); for every
//! input channel and kernel tap it loads the input pixels once (masked at the borders, so the input
//! is never padded or copied) and multiplies them by each channel's weight, broadcast. The DPT heads'
//! 3×3 convs ran at 110–150 GFLOP/s through the image-to-columns GEMM (ONNX Runtime's direct NCHWc
//! kernels reach ~330 here); the tile keeps both FMA ports busy from L1 instead.
#[cfg(target_arch = "x86_64")]
use rayon::prelude::*;

/// Output channels per register tile.
const CO: usize = 8;
/// Largest kernel side this kernel takes (the border masks are precomputed per kernel column).
pub const MAX_KERNEL: usize = 7;

/// Whether the CPU runs [`conv2d`].
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
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

/// The weight `[o, c, kh, kw]` regrouped as `[o / CO][c][kh][kw][CO]` (missing channels zero) and
/// the bias as `[o / CO][CO]`.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn pack(s: &Shape, weight: &[f32], bias: Option<&[f32]>) -> (Vec<f32>, Vec<f32>) {
    let taps = s.c * s.kh * s.kw;
    let tiles = s.o.div_ceil(CO);
    let mut wp = vec![0f32; tiles * taps * CO];
    let mut bp = vec![0f32; tiles * CO];
    for co in 0..s.o {
        let (tile, j) = (co / CO, co % CO);
        for t in 0..taps {
            wp[(tile * taps + t) * CO + j] = weight[co * taps + t];
        }
        bp[tile * CO + j] = bias.map_or(0.0, |b| b[co]);
    }
    (wp, bp)
}

/// Stride-1 convolution of `x` `[b, c, h, w]` (row-major) by `weight` `[o, c, kh, kw]` plus
/// `bias` `[o]`, zero padding `s.pad`: the `[b, o, oh, ow]` output. `None` when the CPU lacks
/// AVX-512, a kernel side exceeds [`MAX_KERNEL`], the kernel does not fit, or a length disagrees
/// with the shape.
pub fn conv2d(s: &Shape, x: &[f32], weight: &[f32], bias: Option<&[f32]>) -> Option<Vec<f32>> {
    let (oh, ow) = s.output()?;
    let ok = available()
        && s.kh <= MAX_KERNEL
        && s.kw <= MAX_KERNEL
        && x.len() == s.b.checked_mul(s.c)?.checked_mul(s.h)?.checked_mul(s.w)?
        && weight.len() == s.o.checked_mul(s.c)?.checked_mul(s.kh)?.checked_mul(s.kw)?
        && bias.is_none_or(|b| b.len() == s.o);
    if !ok {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let n = s.b.checked_mul(s.o)?.checked_mul(oh)?.checked_mul(ow)?;
        let (wp, bp) = pack(s, weight, bias);
        let mut out: Vec<f32> = Vec::with_capacity(n);
        {
            let dst = super::cpu_slice::SharedOut(out.as_mut_ptr());
            let tiles = s.o.div_ceil(CO);
            let taps = s.c * s.kh * s.kw;
            // One task per output row, every channel tile in turn: the input rows it reads (all
            // channels) stay in L2 across the tiles instead of coming from memory once per tile.
            (0..s.b * oh).into_par_iter().for_each(|task| {
                let (img, y) = (task / oh, task % oh);
                let xs = &x[img * s.c * s.h * s.w..][..s.c * s.h * s.w];
                for tile in 0..tiles {
                    let row = Row {
                        s,
                        x: xs,
                        w: &wp[tile * taps * CO..][..taps * CO],
                        bias: &bp[tile * CO..][..CO],
                        y,
                        channels: CO.min(s.o - tile * CO),
                        // Channel `tile·CO + j`, row y of image `img`: plane stride oh·ow.
                        out: dst.at(((img * s.o + tile * CO) * oh + y) * ow),
                        plane: oh * ow,
                        ow,
                    };
                    // SAFETY: AVX-512F was detected above; the row writes only its own output
                    // elements (its channels' row `y` of its image), inside `out`'s capacity of `n`.
                    unsafe { row.run() };
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
        let _ = (oh, ow, weight, bias);
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
    /// Computes the row in chunks of 48 pixels, the last one narrower.
    ///
    /// # Safety
    /// The CPU has AVX-512F; `out` addresses `channels` planes (stride `plane`) of at least `ow`
    /// writable floats each.
    #[target_feature(enable = "avx512f")]
    unsafe fn run(&self) {
        let mut x0 = 0;
        while x0 < self.ow {
            match (self.ow - x0).div_ceil(16) {
                1 => self.chunk::<1>(x0),
                2 => self.chunk::<2>(x0),
                _ => self.chunk::<3>(x0),
            }
            x0 += 48;
        }
    }

    /// Output pixels `x0 .. x0 + 16·NV` (clipped to the row) of the tile's channels.
    #[target_feature(enable = "avx512f")]
    unsafe fn chunk<const NV: usize>(&self, x0: usize) {
        use std::arch::x86_64::*;
        let s = self.s;
        let (h, w, pad) = (s.h as isize, s.w as isize, s.pad as isize);
        // Lanes whose input column (pixel + kx − pad) lies inside the row, per kernel column.
        let mut masks = [[0u16; NV]; MAX_KERNEL];
        for (kx, m) in masks.iter_mut().enumerate().take(s.kw) {
            for (v, mv) in m.iter_mut().enumerate() {
                let start = (x0 + 16 * v + kx) as isize - pad;
                let lo = (-start).clamp(0, 16);
                let hi = (w - start).clamp(0, 16);
                *mv = if hi > lo { (((1u32 << hi) - 1) & !((1u32 << lo) - 1)) as u16 } else { 0 };
            }
        }
        let mut acc = [[_mm512_setzero_ps(); NV]; CO];
        for (j, a) in acc.iter_mut().enumerate() {
            *a = [_mm512_set1_ps(self.bias[j]); NV];
        }
        let y = self.y as isize;
        let ky_lo = (pad - y).clamp(0, s.kh as isize) as usize;
        let ky_hi = (h + pad - y).clamp(0, s.kh as isize) as usize;
        let xp = self.x.as_ptr();
        let wp = self.w.as_ptr();
        for ci in 0..s.c {
            for ky in ky_lo..ky_hi {
                let iy = (y + ky as isize - pad) as usize;
                let line = xp.add((ci * s.h + iy) * s.w);
                for (kx, m) in masks.iter().enumerate().take(s.kw) {
                    let mut inp = [_mm512_setzero_ps(); NV];
                    for v in 0..NV {
                        // A masked-off lane is not read, so an address before or past the row
                        // (the padding) is never touched.
                        let at = line.wrapping_offset((x0 + 16 * v + kx) as isize - pad);
                        inp[v] = _mm512_maskz_loadu_ps(m[v], at);
                    }
                    let wt = wp.add(((ci * s.kh + ky) * s.kw + kx) * CO);
                    for (j, a) in acc.iter_mut().enumerate() {
                        let wj = _mm512_set1_ps(*wt.add(j));
                        for v in 0..NV {
                            a[v] = _mm512_fmadd_ps(inp[v], wj, a[v]);
                        }
                    }
                }
            }
        }
        for (j, a) in acc.iter().enumerate().take(self.channels) {
            let dst = self.out.add(j * self.plane + x0);
            for (v, av) in a.iter().enumerate() {
                let left = self.ow as isize - (x0 + 16 * v) as isize;
                let keep = if left >= 16 { 0xFFFF } else if left > 0 { ((1u32 << left) - 1) as u16 } else { 0 };
                _mm512_mask_storeu_ps(dst.add(16 * v), keep, *av);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    /// Every kernel size, padding and width tail against Candle's conv2d.
    #[test]
    fn matches_candles_conv_at_odd_shapes() {
        if !available() {
            return;
        }
        let dev = Device::Cpu;
        for &(b, c, h, w, o, k, pad) in &[
            (1, 3, 9, 37, 5, 3, 1),
            (2, 16, 13, 50, 17, 3, 1),
            (1, 4, 7, 16, 8, 3, 0),
            (1, 5, 6, 33, 9, 5, 2),
            (1, 2, 5, 48, 3, 7, 3),
            (1, 3, 4, 20, 2, 2, 0),
            (1, 3, 3, 3, 4, 3, 4),
        ] {
            let x = Tensor::randn(0f32, 1.0, (b, c, h, w), &dev).unwrap();
            let wt = Tensor::randn(0f32, 1.0, (o, c, k, k), &dev).unwrap();
            let bias = Tensor::randn(0f32, 1.0, o, &dev).unwrap();
            let want = x.conv2d(&wt, pad, 1, 1, 1).unwrap().broadcast_add(&bias.reshape((1, o, 1, 1)).unwrap()).unwrap();
            let s = Shape { b, c, h, w, o, kh: k, kw: k, pad };
            let got = conv2d(
                &s,
                &x.flatten_all().unwrap().to_vec1().unwrap(),
                &wt.flatten_all().unwrap().to_vec1().unwrap(),
                Some(&bias.to_vec1().unwrap()),
            )
            .unwrap();
            let want = want.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(got.len(), want.len(), "{s:?}");
            let err = got.iter().zip(&want).map(|(g, w)| (g - w).abs()).fold(0f32, f32::max);
            assert!(err < 1e-4, "{s:?}: max abs error {err}");
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
    }
}
