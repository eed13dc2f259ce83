//! 3×3 "same" convolution (stride 1, padding 1) for f32 by Winograd's F(2×2, 3×3) on x86-64 CPUs
//! with AVX-512: each 2×2 block of output pixels takes 16 multiplies per input and output channel
//! instead of the direct conv's 36. Per task (one image, one row of 2×2 tiles, up to 48 tiles
//! along it) every input channel's 4×4 patches are transformed (`Bᵀ d B`, adds only) into 16
//! planes of 48 lanes, one lane per tile; the 16 products with the transformed weights
//! (`G g Gᵀ`, made once per call in f64) run as broadcast-weight × tile-vector FMAs in an
//! 8-channel × 48-tile register tile like the direct conv's; the output transform (`Aᵀ m A`,
//! adds only) gives the 2×2 pixels, plus the bias. The transforms' coefficients are 0, ±1 and ½,
//! so the rounding stays that of a direct sum (DPT heads: max error against the direct conv
//! ~1e-6 relative).
use rayon::prelude::*;

/// Output channels per register tile.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const CO: usize = 8;
/// Tiles per task along a row (three 16-lane vectors).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const TILES: usize = 48;

/// Whether the CPU runs [`conv3x3`] (AVX-512F).
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The transformed weights `U = G g Gᵀ` (16 values per output and input channel) as
/// `[o / 8][16][c][8]` (missing channels zero), and the bias padded to whole tiles; the tiles of
/// eight output channels in parallel (made on every call: serial, they left one core idle for
/// ~40 ms of each CHMv2 forward).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn transform_weights(o: usize, c: usize, weight: &[f32], bias: Option<&[f32]>) -> (Vec<f32>, Vec<f32>) {
    const G: [[f64; 3]; 4] = [[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]];
    let tiles = o.div_ceil(CO);
    let mut u = vec![0f32; tiles * 16 * c * CO];
    let transform_tile = |(t, ut): (usize, &mut [f32])| {
        for co in t * CO..(t * CO + CO).min(o) {
            let j = co % CO;
            for ci in 0..c {
                let g = &weight[(co * c + ci) * 9..][..9];
                // G g: 4 × 3, then (G g) Gᵀ: 4 × 4.
                let mut gg = [[0f64; 3]; 4];
                for (r, row) in gg.iter_mut().enumerate() {
                    for (k, v) in row.iter_mut().enumerate() {
                        *v = (0..3).map(|m| G[r][m] * g[m * 3 + k] as f64).sum();
                    }
                }
                for r in 0..4 {
                    for s in 0..4 {
                        let v: f64 = (0..3).map(|k| gg[r][k] * G[s][k]).sum();
                        ut[((r * 4 + s) * c + ci) * CO + j] = v as f32;
                    }
                }
            }
        }
    };
    u.par_chunks_mut(16 * c * CO).enumerate().for_each(transform_tile);
    let mut b = vec![0f32; tiles * CO];
    if let Some(bias) = bias {
        b[..o].copy_from_slice(&bias[..o]);
    }
    (u, b)
}

/// What [`conv3x3`] folds into its passes: a ReLU of the input as it is read, and a residual
/// added to the output as it is written (DPT's pre-activation units: `x + conv(relu(conv(relu(x))))`
/// without three more passes over the feature map).
#[derive(Debug, Clone, Copy, Default)]
// Off x86-64 the kernel does not run and nothing reads the settings.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) struct Fused<'a> {
    /// Convolve `relu(x)` instead of `x`.
    pub relu_input: bool,
    /// `[b, o, h, w]` added to the output (after the bias, as a separate add would).
    pub residual: Option<&'a [f32]>,
    /// A ReLU of the output as it is written (after the bias and the residual): the heads'
    /// `relu(conv(x))` without a pass over the map of its own.
    pub relu_output: bool,
}

/// `x` `[b, c, h, w]` (row-major) convolved with `weight` `[o, c, 3, 3]` plus `bias` `[o]`, zero
/// padding 1, stride 1, with `fused`'s input ReLU and residual: the `[b, o, h, w]` output. `None`
/// without AVX-512F or when a length disagrees with the shape.
#[allow(clippy::too_many_arguments)]
pub(crate) fn conv3x3(b: usize, c: usize, h: usize, w: usize, o: usize, x: &[f32], weight: &[f32], bias: Option<&[f32]>, fused: Fused) -> Option<Vec<f32>> {
    if x.len() != b.checked_mul(c)?.checked_mul(h)?.checked_mul(w)? {
        return None;
    }
    convolve(b, c, h, w, o, Input::Map(x), weight, bias, fused)
}

/// [`conv3x3`] of the bilinear upsampling of `src` `[b, c, sh, sw]` to `h × w` (PyTorch's
/// `align_corners` semantics), interpolated as the conv reads its rows: the upsampled map is never
/// stored (DA-V2-Small's head: 34 MB written and read back). The values are those of
/// [`super::bilinear_cpu::bilinear`] then [`conv3x3`], bit for bit. `None` where [`conv3x3`] would
/// be, for a resize that shrinks past [`super::bilinear_cpu::RowPlan`]'s window, or when `src`'s
/// length disagrees with the shape.
#[allow(clippy::too_many_arguments)]
pub(crate) fn conv3x3_upsampled(b: usize, c: usize, (sh, sw): (usize, usize), (h, w): (usize, usize), align_corners: bool, o: usize, src: &[f32], weight: &[f32], bias: Option<&[f32]>, fused: Fused) -> Option<Vec<f32>> {
    use super::bilinear_cpu::{taps, RowPlan};
    if sh == 0 || sw == 0 || h == 0 || w == 0 || src.len() != b.checked_mul(c)?.checked_mul(sh)?.checked_mul(sw)? {
        return None;
    }
    let cols = RowPlan::new(&taps(sw, w, align_corners), sw)?;
    let rows = taps(sh, h, align_corners);
    convolve(b, c, h, w, o, Input::Upsampled { src, sh, sw, rows: &rows, cols: &cols }, weight, bias, fused)
}

/// Where the conv's input rows come from.
#[derive(Clone, Copy)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
enum Input<'a> {
    /// The map itself, `[b, c, h, w]`.
    Map(&'a [f32]),
    /// The upsampling of `src` `[b, c, sh, sw]` by the row taps and column plan.
    Upsampled { src: &'a [f32], sh: usize, sw: usize, rows: &'a [super::bilinear_cpu::Tap], cols: &'a super::bilinear_cpu::RowPlan },
}

impl<'a> Input<'a> {
    /// Image `img`'s part (`c` channels).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    fn image(self, img: usize, c: usize, (h, w): (usize, usize)) -> Input<'a> {
        match self {
            Input::Map(x) => Input::Map(&x[img * c * h * w..][..c * h * w]),
            Input::Upsampled { src, sh, sw, rows, cols } => Input::Upsampled { src: &src[img * c * sh * sw..][..c * sh * sw], sh, sw, rows, cols },
        }
    }
}

/// [`conv3x3`] from `input`, whose length the caller checked.
#[allow(clippy::too_many_arguments)]
fn convolve(b: usize, c: usize, h: usize, w: usize, o: usize, input: Input, weight: &[f32], bias: Option<&[f32]>, fused: Fused) -> Option<Vec<f32>> {
    let pixels = b.checked_mul(o)?.checked_mul(h)?.checked_mul(w)?;
    let ok = available()
        && h > 0
        && w > 0
        && c > 0
        && weight.len() == o.checked_mul(c)?.checked_mul(9)?
        && bias.is_none_or(|v| v.len() == o)
        && fused.residual.is_none_or(|r| r.len() == pixels);
    if !ok {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let n = pixels;
        let (u, bias) = transform_weights(o, c, weight, bias);
        let (th, tw) = (h.div_ceil(2), w.div_ceil(2));
        let blocks = tw.div_ceil(TILES);
        let mut out: Vec<f32> = Vec::with_capacity(n);
        {
            let dst = super::cpu_slice::SharedOut(out.as_mut_ptr());
            (0..b * th * blocks).into_par_iter().for_each(|task| {
                let (img, rest) = (task / (th * blocks), task % (th * blocks));
                let (ty, block) = (rest / blocks, rest % blocks);
                let task = Task {
                    input: input.image(img, c, (h, w)),
                    c,
                    h,
                    w,
                    o,
                    u: &u,
                    bias: &bias,
                    ty,
                    t0: block * TILES,
                    out: dst.at(img * o * h * w),
                    relu_input: fused.relu_input,
                    relu_output: fused.relu_output,
                    residual: fused.residual.map(|r| &r[img * o * h * w..][..o * h * w]),
                };
                let vectors = (tw - task.t0).min(TILES).div_ceil(16);
                super::cpu_slice::with_scratch(&BUFFER, |buf| {
                    buf.resize(16 * c * TILES + w.div_ceil(16) * 16, 0.0);
                    // SAFETY: AVX-512F was checked above; the task writes only its own tile row's
                    // pixels of its image (rows 2ty, 2ty + 1, its tiles' columns), inside `out`'s
                    // capacity of `n`.
                    unsafe {
                        match vectors {
                            1 => task.run::<1>(buf),
                            2 => task.run::<2>(buf),
                            _ => task.run::<3>(buf),
                        }
                    }
                });
            });
        }
        // SAFETY: the tasks wrote every element: each image, tile row (both pixel rows when they
        // exist) and block of tiles once, every output channel and valid column of it.
        unsafe { out.set_len(n) };
        Some(out)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (input, weight, bias, pixels);
        None
    }
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// Each worker's transformed input `[16][c][48]` and an upsampled input row, reused across tasks.
    static BUFFER: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// One tile row of one image, tiles `t0 .. t0 + 16·NV`.
#[cfg(target_arch = "x86_64")]
struct Task<'a> {
    /// The image's input.
    input: Input<'a>,
    c: usize,
    h: usize,
    w: usize,
    o: usize,
    u: &'a [f32],
    bias: &'a [f32],
    ty: usize,
    t0: usize,
    /// The image's output `[o, h, w]`.
    out: *mut f32,
    relu_input: bool,
    relu_output: bool,
    /// The image's residual `[o, h, w]`.
    residual: Option<&'a [f32]>,
}

#[cfg(target_arch = "x86_64")]
impl Task<'_> {
    /// Transforms the input, multiplies and writes the output pixels.
    ///
    /// # Safety
    /// AVX-512F present; `out` addresses the image's `o × h × w` writable floats.
    #[target_feature(enable = "avx512f")]
    unsafe fn run<const NV: usize>(&self, buffer: &mut [f32]) {
        use std::arch::x86_64::*;
        let (v, line) = buffer.split_at_mut(16 * self.c * TILES);
        for ci in 0..self.c {
            self.transform_input::<NV>(ci, v, line);
        }
        // Every product is written below before the output transform reads it (zeroing these
        // 24 KiB per task took ~5 % of the conv).
        let mut m = std::mem::MaybeUninit::<[[[__m512; NV]; CO]; 16]>::uninit();
        for tile in 0..self.o.div_ceil(CO) {
            let u = self.u.as_ptr().add(tile * 16 * self.c * CO);
            for xi in 0..16 {
                let mut acc = [[_mm512_setzero_ps(); NV]; CO];
                let vx = v.as_ptr().add(xi * self.c * TILES);
                let ux = u.add(xi * self.c * CO);
                for ci in 0..self.c {
                    let mut inp = [_mm512_setzero_ps(); NV];
                    for (k, iv) in inp.iter_mut().enumerate() {
                        *iv = _mm512_loadu_ps(vx.add(ci * TILES + 16 * k));
                    }
                    let wt = ux.add(ci * CO);
                    for (j, a) in acc.iter_mut().enumerate() {
                        let wj = _mm512_set1_ps(*wt.add(j));
                        for k in 0..NV {
                            a[k] = _mm512_fmadd_ps(inp[k], wj, a[k]);
                        }
                    }
                }
                m.as_mut_ptr().cast::<[[__m512; NV]; CO]>().add(xi).write(acc);
            }
            // SAFETY: all 16 products were written just above.
            self.transform_output::<NV>(tile, m.assume_init_ref());
        }
    }

    /// Channel `ci`'s input patches → its 16 transformed planes in `v` (`[16][c][48]`); an
    /// upsampled input's rows are interpolated into `line` (the output width, rounded up to 16).
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    // The lane loops index several arrays by the same vector index.
    #[allow(clippy::needless_range_loop)]
    unsafe fn transform_input<const NV: usize>(&self, ci: usize, v: &mut [f32], line_buffer: &mut [f32]) {
        use std::arch::x86_64::*;
        let (h, w) = (self.h as isize, self.w as isize);
        // Tile t covers input columns 2t − 1 .. 2t + 2; lane l of vector k is tile t0 + 16k + l.
        let col0 = 2 * self.t0 as isize - 1;
        let even_idx = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
        let odd_idx = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
        // d[r][j][k]: input row 2ty − 1 + r, column 2t − 1 + j, for the tiles of vector k.
        let mut d = [[[_mm512_setzero_ps(); NV]; 4]; 4];
        for (r, dr) in d.iter_mut().enumerate() {
            let iy = (2 * self.ty + r) as isize - 1;
            if iy < 0 || iy >= h {
                continue;
            }
            let line = match self.input {
                Input::Map(x) => x.as_ptr().add((ci * self.h + iy as usize) * self.w),
                Input::Upsampled { src, sh, sw, rows, cols } => {
                    // The columns the loads below read: col0 .. col0 + 32 (NV + 1), inside the row.
                    let first = col0.max(0) as usize / 16;
                    let last = ((col0 + 32 * (NV as isize + 1)).min(w) as usize).div_ceil(16).min(cols.groups());
                    let tap = rows[iy as usize];
                    let plane = src.as_ptr().add(ci * sh * sw);
                    let (lo, hi) = (plane.add(tap.lo * sw), plane.add(tap.hi * sw));
                    let (w_lo, w_hi) = (_mm512_set1_ps(1.0 - tap.t), _mm512_set1_ps(tap.t));
                    for g in first..last {
                        // Each source row along the width, then the two blended: the order and
                        // roundings of `bilinear_cpu`.
                        let (a, b) = (cols.group(g, lo), cols.group(g, hi));
                        _mm512_storeu_ps(line_buffer.as_mut_ptr().add(16 * g), _mm512_add_ps(_mm512_mul_ps(a, w_lo), _mm512_mul_ps(b, w_hi)));
                    }
                    line_buffer.as_ptr()
                }
            };
            let load = |start: isize| -> __m512 {
                let lo = (-start).clamp(0, 16);
                let hi = (w - start).clamp(0, 16);
                let mask = if hi > lo { (((1u32 << hi) - 1) & !((1u32 << lo) - 1)) as u16 } else { 0 };
                // Masked-off lanes are not read: addresses outside the row are never touched.
                let v = _mm512_maskz_loadu_ps(mask, line.wrapping_offset(start));
                // max(v, 0) is `v > 0 ? v : 0`, as Candle's ReLU.
                if self.relu_input { _mm512_max_ps(v, _mm512_setzero_ps()) } else { v }
            };
            // Evens and odds of columns col0 + 32k .. + 32, for k = 0 ..= NV (one vector more for
            // the shifted columns 2 and 3).
            let mut even = [_mm512_setzero_ps(); 4];
            let mut odd = [_mm512_setzero_ps(); 4];
            for k in 0..=NV {
                let start = col0 + 32 * k as isize;
                let (a, b) = (load(start), load(start + 16));
                even[k] = _mm512_permutex2var_ps(a, even_idx, b);
                odd[k] = _mm512_permutex2var_ps(a, odd_idx, b);
            }
            for k in 0..NV {
                dr[0][k] = even[k];
                dr[1][k] = odd[k];
                dr[2][k] = _mm512_castsi512_ps(_mm512_alignr_epi32(_mm512_castps_si512(even[k + 1]), _mm512_castps_si512(even[k]), 1));
                dr[3][k] = _mm512_castsi512_ps(_mm512_alignr_epi32(_mm512_castps_si512(odd[k + 1]), _mm512_castps_si512(odd[k]), 1));
            }
        }
        let (add, sub) = (|a, b| _mm512_add_ps(a, b), |a, b| _mm512_sub_ps(a, b));
        for k in 0..NV {
            // Bᵀ d: rows (d0 − d2, d1 + d2, d2 − d1, d1 − d3), then the same on the columns.
            let col = |j: usize| [sub(d[0][j][k], d[2][j][k]), add(d[1][j][k], d[2][j][k]), sub(d[2][j][k], d[1][j][k]), sub(d[1][j][k], d[3][j][k])];
            let t = [col(0), col(1), col(2), col(3)]; // t[j][i]
            for i in 0..4 {
                let row = [sub(t[0][i], t[2][i]), add(t[1][i], t[2][i]), sub(t[2][i], t[1][i]), sub(t[1][i], t[3][i])];
                for (s, val) in row.iter().enumerate() {
                    _mm512_storeu_ps(v.as_mut_ptr().add(((i * 4 + s) * self.c + ci) * TILES + 16 * k), *val);
                }
            }
        }
    }

    /// The 16 products of one channel tile → 2×2 output pixels per tile, plus the bias.
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::needless_range_loop)]
    unsafe fn transform_output<const NV: usize>(&self, tile: usize, m: &[[[std::arch::x86_64::__m512; NV]; CO]; 16]) {
        use std::arch::x86_64::*;
        let lo_idx = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
        let hi_idx = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
        let (add, sub) = (|a, b| _mm512_add_ps(a, b), |a, b| _mm512_sub_ps(a, b));
        for j in 0..CO.min(self.o - tile * CO) {
            let co = tile * CO + j;
            let bias = _mm512_set1_ps(self.bias[co]);
            for k in 0..NV {
                let mm = |i: usize, s: usize| m[i * 4 + s][j][k];
                // Aᵀ m: rows (m0 + m1 + m2, m1 − m2 − m3), then the same on the columns.
                let s0 = |s: usize| add(add(mm(0, s), mm(1, s)), mm(2, s));
                let s1 = |s: usize| sub(sub(mm(1, s), mm(2, s)), mm(3, s));
                for (dy, sr) in [[s0(0), s0(1), s0(2), s0(3)], [s1(0), s1(1), s1(2), s1(3)]].iter().enumerate() {
                    let y = 2 * self.ty + dy;
                    if y >= self.h {
                        continue;
                    }
                    let left = add(add(add(sr[0], sr[1]), sr[2]), bias);
                    let right = add(sub(sub(sr[1], sr[2]), sr[3]), bias);
                    let x0 = 2 * (self.t0 + 16 * k);
                    let row = self.out.wrapping_add((co * self.h + y) * self.w + x0);
                    for (half, idx) in [lo_idx, hi_idx].into_iter().enumerate() {
                        let px = x0 + 16 * half;
                        if px >= self.w {
                            break;
                        }
                        let n = (self.w - px).min(16);
                        let keep = if n == 16 { 0xFFFF } else { ((1u32 << n) - 1) as u16 };
                        let mut pixels = _mm512_permutex2var_ps(left, idx, right);
                        if let Some(r) = self.residual {
                            let at = (co * self.h + y) * self.w + px;
                            pixels = _mm512_add_ps(pixels, _mm512_maskz_loadu_ps(keep, r.as_ptr().add(at)));
                        }
                        if self.relu_output {
                            pixels = _mm512_max_ps(pixels, _mm512_setzero_ps());
                        }
                        _mm512_mask_storeu_ps(row.add(16 * half), keep, pixels);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    /// Odd and even sizes, widths across the 16- and 48-tile vectors, channel counts off the tile,
    /// two images, against Candle's conv2d.
    #[test]
    fn matches_candles_conv_at_odd_shapes() {
        if !available() {
            eprintln!("winograd: this CPU has no AVX-512F; nothing to test");
            return;
        }
        let dev = Device::Cpu;
        for &(b, c, h, w, o) in &[(1, 1, 1, 1, 1), (2, 3, 5, 7, 9), (1, 16, 4, 33, 8), (1, 5, 9, 97, 17), (2, 8, 6, 200, 3), (1, 2, 2, 2, 2), (1, 4, 3, 64, 12)] {
            let x = Tensor::randn(0f32, 1.0, (b, c, h, w), &dev).unwrap();
            let wt = Tensor::randn(0f32, 1.0, (o, c, 3, 3), &dev).unwrap();
            let bias = Tensor::randn(0f32, 1.0, o, &dev).unwrap();
            let want = x.conv2d(&wt, 1, 1, 1, 1).unwrap().broadcast_add(&bias.reshape((1, o, 1, 1)).unwrap()).unwrap();
            let got = conv3x3(
                b,
                c,
                h,
                w,
                o,
                &x.flatten_all().unwrap().to_vec1().unwrap(),
                &wt.flatten_all().unwrap().to_vec1().unwrap(),
                Some(&bias.to_vec1().unwrap()),
                Fused::default(),
            )
            .unwrap();
            let want = want.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(got.len(), want.len(), "{:?}", (b, c, h, w, o));
            let err = got.iter().zip(&want).map(|(g, w)| (g - w).abs()).fold(0f32, f32::max);
            assert!(err < 1e-4 * (c as f32 * 9.0).sqrt(), "{:?}: max abs error {err}", (b, c, h, w, o));
        }
    }

    #[test]
    fn the_fused_relu_and_residual_are_the_separate_ops() {
        if !available() {
            return;
        }
        let dev = Device::Cpu;
        let (b, c, h, w) = (2, 5, 7, 37);
        let x = Tensor::randn(0f32, 1.0, (b, c, h, w), &dev).unwrap();
        let wt = Tensor::randn(0f32, 1.0, (c, c, 3, 3), &dev).unwrap();
        let bias: Vec<f32> = (0..c).map(|i| i as f32 * 0.25 - 0.5).collect();
        let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let (xs, ws) = (flat(&x), flat(&wt));
        let plain = |input: &[f32]| conv3x3(b, c, h, w, c, input, &ws, Some(&bias), Fused::default()).unwrap();
        let relu_x = flat(&x.relu().unwrap());
        let fused = conv3x3(b, c, h, w, c, &xs, &ws, Some(&bias), Fused { relu_input: true, residual: Some(&xs), relu_output: false }).unwrap();
        let separate: Vec<f32> = plain(&relu_x).iter().zip(&xs).map(|(y, r)| y + r).collect();
        assert_eq!(fused, separate);
        // The output ReLU after the residual: max(y + r, 0), element for element.
        let all = conv3x3(b, c, h, w, c, &xs, &ws, Some(&bias), Fused { relu_input: true, residual: Some(&xs), relu_output: true }).unwrap();
        let want: Vec<f32> = separate.iter().map(|&v| if v > 0.0 { v } else { 0.0 }).collect();
        assert_eq!(all, want);
        assert!(want.contains(&0.0) && want.iter().any(|&v| v > 0.0), "the test needs both signs");
    }

    /// The conv of an upsampled map interpolated as it is read equals the conv of the stored
    /// upsampling, bit for bit: both corner modes, widths across the 48-tile blocks and odd sizes,
    /// two images, with the output ReLU; a resize that shrinks past the row window is declined.
    #[test]
    fn the_conv_of_an_upsampling_is_the_conv_of_the_upsampled_map() {
        if !available() {
            return;
        }
        let dev = Device::Cpu;
        for ((sh, sw), (h, w), align) in [((37, 37), (74, 74), true), ((23, 60), (45, 141), false), ((5, 9), (7, 9), true), ((1, 1), (3, 5), false)] {
            let (b, c, o) = (2, 5, 11);
            let src = Tensor::randn(0f32, 1.0, (b, c, sh, sw), &dev).unwrap();
            let ws = Tensor::randn(0f32, 1.0, (o, c, 3, 3), &dev).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let bias: Vec<f32> = (0..o).map(|i| i as f32 * 0.1 - 0.5).collect();
            let up = crate::kernels::bilinear_cpu::bilinear(&src, h, w, align).unwrap().unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let src = src.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            for relu_output in [false, true] {
                let fused = Fused { relu_output, ..Fused::default() };
                let want = conv3x3(b, c, h, w, o, &up, &ws, Some(&bias), fused).unwrap();
                let got = conv3x3_upsampled(b, c, (sh, sw), (h, w), align, o, &src, &ws, Some(&bias), fused).unwrap();
                assert_eq!(got, want, "{sh}×{sw} → {h}×{w} align {align} relu {relu_output}");
            }
        }
        assert!(conv3x3_upsampled(1, 1, (100, 100), (20, 20), false, 1, &[0.0; 10000], &[0.0; 9], None, Fused::default()).is_none());
        assert!(conv3x3_upsampled(1, 1, (4, 4), (8, 8), false, 1, &[0.0; 15], &[0.0; 9], None, Fused::default()).is_none());
    }

    #[test]
    fn refuses_lengths_that_disagree_with_the_shape() {
        let none = Fused::default();
        assert!(conv3x3(1, 1, 2, 2, 1, &[0.0; 3], &[0.0; 9], None, none).is_none());
        assert!(conv3x3(1, 1, 2, 2, 1, &[0.0; 4], &[0.0; 8], None, none).is_none());
        assert!(conv3x3(1, 1, 2, 2, 1, &[0.0; 4], &[0.0; 9], Some(&[0.0; 2]), none).is_none());
        assert!(conv3x3(1, 1, 2, 2, 1, &[0.0; 4], &[0.0; 9], None, Fused { relu_input: false, residual: Some(&[0.0; 3]), relu_output: false }).is_none());
    }
}
