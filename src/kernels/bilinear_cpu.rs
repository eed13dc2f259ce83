//! Bilinear resize of f32 CPU feature maps, in parallel. Candle's `upsample_bilinear2d` runs one
//! thread in f64 per element (DA-V2-Small's fusion and head upsampling: ~60 ms of a 780 ms forward
//! on 2 cores); this computes the same interpolation (same source indices and weights, rows then
//! columns, as PyTorch's `F.interpolate` in f32) over blocks of output rows in parallel, each source
//! row interpolated along the width once per block and reused.
use candle_core::{Result, Tensor};
use rayon::prelude::*;

use super::cpu_slice::with_contiguous;

/// Output rows per parallel task (a plane's rows are split into blocks of this many).
const ROWS_PER_TASK: usize = 32;

/// One output coordinate's two source samples and the weight of the second.
#[derive(Clone, Copy)]
pub(crate) struct Tap {
    /// The first source sample.
    pub lo: usize,
    /// The second (`lo + 1`, or `lo` at the last sample).
    pub hi: usize,
    /// The weight of `hi` (`lo` gets `1 − t`).
    pub t: f32,
}

/// The taps along one axis, `n_in ≥ 1` (PyTorch's `area_pixel_compute_source_index`, scale
/// `in / out`, or `(in − 1) / (out − 1)` with `align_corners`); also the rows of
/// `nn::grad::linear_matrix`.
pub(crate) fn taps(n_in: usize, n_out: usize, align_corners: bool) -> Vec<Tap> {
    let scale = if align_corners {
        if n_out > 1 { (n_in - 1) as f64 / (n_out - 1) as f64 } else { 0.0 }
    } else {
        n_in as f64 / n_out as f64
    };
    (0..n_out)
        .map(|o| {
            let src = if align_corners { scale * o as f64 } else { scale * (o as f64 + 0.5) - 0.5 }.max(0.0);
            let lo = (src.floor() as usize).min(n_in - 1);
            let hi = (lo + 1).min(n_in - 1);
            Tap { lo, hi, t: (src - lo as f64).clamp(0.0, 1.0) as f32 }
        })
        .collect()
}

/// `upsample_bilinear2d` of an f32 CPU tensor `[B, C, H, W]` to `oh × ow` (sizes already checked
/// by the caller); `None` for other dtypes or devices and for empty maps (Candle's op then).
pub(crate) fn bilinear(x: &Tensor, oh: usize, ow: usize, align_corners: bool) -> Result<Option<Tensor>> {
    let (b, c, h, w) = x.dims4()?;
    if !x.device().is_cpu() || x.dtype() != candle_core::DType::F32 || h == 0 || w == 0 || oh == 0 || ow == 0 {
        return Ok(None);
    }
    let out = with_contiguous(x, |src: &[f32]| resize(src, (h, w), (oh, ow), align_corners))?;
    Ok(match out {
        Some(out) => Some(Tensor::from_vec(out, (b, c, oh, ow), x.device())?),
        None => None,
    })
}

/// The planes `src` (each `h × w`, none empty) resized to `oh × ow`.
pub(crate) fn resize(src: &[f32], (h, w): (usize, usize), (oh, ow): (usize, usize), align_corners: bool) -> Vec<f32> {
    let (ty, tx) = (taps(h, oh, align_corners), taps(w, ow, align_corners));
    let mut out = vec![0f32; src.len() / (h * w).max(1) * oh * ow];
    let block_rows = ROWS_PER_TASK.min(oh).max(1);
    out.par_chunks_mut(oh * ow).zip(src.par_chunks(h * w)).for_each(|(plane_out, plane)| {
        plane_out.par_chunks_mut(block_rows * ow).enumerate().for_each(|(block, rows)| {
            resize_rows(plane, w, &ty[block * block_rows..], &tx, rows);
        });
    });
    out
}

/// The gradient of [`resize`] with respect to its input: each output gradient added back onto the
/// (up to four) source samples it was interpolated from, with the same weights; planes in parallel.
pub(crate) fn resize_backward(gy: &[f32], (h, w): (usize, usize), (oh, ow): (usize, usize), align_corners: bool) -> Vec<f32> {
    let (ty, tx) = (taps(h, oh, align_corners), taps(w, ow, align_corners));
    let mut gx = vec![0f32; gy.len() / (oh * ow).max(1) * h * w];
    gx.par_chunks_mut(h * w).zip(gy.par_chunks(oh * ow)).for_each_init(
        || vec![0f32; h * ow],
        |rows, (gx, gy)| {
            // Along the height: output rows onto source rows (still at the output width).
            rows.fill(0.0);
            for (g, tap) in gy.chunks_exact(ow).zip(&ty) {
                let (lo, hi) = (tap.lo * ow, tap.hi * ow);
                for (j, &v) in g.iter().enumerate() {
                    rows[lo + j] += v * (1.0 - tap.t);
                    rows[hi + j] += v * tap.t;
                }
            }
            // Along the width: output columns onto source columns.
            for (dst, row) in gx.chunks_exact_mut(w).zip(rows.chunks_exact(ow)) {
                for (&v, tap) in row.iter().zip(&tx) {
                    dst[tap.lo] += v * (1.0 - tap.t);
                    dst[tap.hi] += v * tap.t;
                }
            }
        },
    );
    gx
}

/// Output rows `rows` (`ty.len() ≥ rows / ow` taps from the block's first row) of one plane.
fn resize_rows(plane: &[f32], w: usize, ty: &[Tap], tx: &[Tap], rows: &mut [f32]) {
    let ow = tx.len();
    // The width-interpolated source rows `lo` and `hi` of the current output row, cached by index.
    let (mut lo_row, mut hi_row) = (vec![0f32; ow], vec![0f32; ow]);
    let (mut lo_at, mut hi_at) = (usize::MAX, usize::MAX);
    for (out_row, tap) in rows.chunks_exact_mut(ow).zip(ty) {
        if lo_at != tap.lo {
            if hi_at == tap.lo {
                std::mem::swap(&mut lo_row, &mut hi_row);
                hi_at = usize::MAX;
            } else {
                along_width(&plane[tap.lo * w..(tap.lo + 1) * w], tx, &mut lo_row);
            }
            lo_at = tap.lo;
        }
        if hi_at != tap.hi {
            along_width(&plane[tap.hi * w..(tap.hi + 1) * w], tx, &mut hi_row);
            hi_at = tap.hi;
        }
        let t = tap.t;
        for ((o, &a), &b) in out_row.iter_mut().zip(&lo_row).zip(&hi_row) {
            *o = a * (1.0 - t) + b * t;
        }
    }
}

/// One source row interpolated to the output width.
fn along_width(src: &[f32], tx: &[Tap], dst: &mut [f32]) {
    for (d, tap) in dst.iter_mut().zip(tx) {
        *d = src[tap.lo] * (1.0 - tap.t) + src[tap.hi] * tap.t;
    }
}

/// An upsampling's column taps in groups of 16 output columns, each group reading a 32-sample
/// window of the source row, for [`RowPlan::group`] (two permutes per 16 outputs instead of 32
/// scalar gathers).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) struct RowPlan {
    groups: Vec<Group>,
    n_in: usize,
}

/// One group: the window's first sample, each column's two samples in it and weights.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
struct Group {
    base: usize,
    lo: [i32; 16],
    hi: [i32; 16],
    t: [f32; 16],
    one_minus_t: [f32; 16],
}

impl RowPlan {
    /// The plan for `taps` over `n_in` samples; `None` where a group's samples span more than the
    /// window (resizes that shrink by about 2 or more).
    pub(crate) fn new(taps: &[Tap], n_in: usize) -> Option<Self> {
        let mut groups = Vec::with_capacity(taps.len().div_ceil(16));
        for chunk in taps.chunks(16) {
            let base = chunk[0].lo;
            let mut g = Group { base, lo: [0; 16], hi: [0; 16], t: [0.0; 16], one_minus_t: [1.0; 16] };
            for (i, tap) in chunk.iter().enumerate() {
                let (lo, hi) = (tap.lo.checked_sub(base)?, tap.hi.checked_sub(base)?);
                if lo >= 32 || hi >= 32 {
                    return None;
                }
                (g.lo[i], g.hi[i], g.t[i], g.one_minus_t[i]) = (lo as i32, hi as i32, tap.t, 1.0 - tap.t);
            }
            groups.push(g);
        }
        Some(RowPlan { groups, n_in })
    }

    /// Groups of 16 output columns.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) fn groups(&self) -> usize {
        self.groups.len()
    }

    /// Output columns `16 g .. 16 g + 16` of the source row `row` (`n_in` samples) interpolated, as
    /// [`along_width`] computes them (`src[lo] (1 − t) + src[hi] t`, the same roundings); lanes past
    /// the output's width hold what their padding taps give.
    ///
    /// # Safety
    /// AVX-512F present; `row` holds at least `n_in` floats; `g < self.groups()`.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn group(&self, g: usize, row: *const f32) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        let p = self.groups.get_unchecked(g);
        let valid = |start: usize| -> __mmask16 {
            let n = self.n_in.saturating_sub(start).min(16);
            ((1u32 << n) - 1) as u16
        };
        // Masked-off lanes are not read: nothing past the row is touched.
        let w0 = _mm512_maskz_loadu_ps(valid(p.base), row.add(p.base));
        let w1 = _mm512_maskz_loadu_ps(valid(p.base + 16), row.wrapping_add(p.base + 16));
        let a = _mm512_permutex2var_ps(w0, _mm512_loadu_si512(p.lo.as_ptr().cast()), w1);
        let b = _mm512_permutex2var_ps(w0, _mm512_loadu_si512(p.hi.as_ptr().cast()), w1);
        _mm512_add_ps(_mm512_mul_ps(a, _mm512_loadu_ps(p.one_minus_t.as_ptr())), _mm512_mul_ps(b, _mm512_loadu_ps(p.t.as_ptr())))
    }
}

/// PyTorch's align_corners=False source taps along one axis: `(i0, i1, λ1)` per output index.
pub(crate) fn axis_taps(n_in: usize, n_out: usize) -> Vec<(usize, usize, f32)> {
    (0..n_out).map(|o| axis_tap(n_in, n_out, o)).collect()
}

/// The align_corners=False source taps `(i0, i1, λ1)` of output index `o` of `n_out` over `n_in` inputs.
pub(crate) fn axis_tap(n_in: usize, n_out: usize, o: usize) -> (usize, usize, f32) {
    let scale = n_in as f32 / n_out as f32;
    let src = (scale * (o as f32 + 0.5) - 0.5).max(0.0);
    let i0 = (src as usize).min(n_in - 1);
    let i1 = if i0 < n_in - 1 { i0 + 1 } else { i0 };
    (i0, i1, src - i0 as f32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn matches_candles_upsample_for_both_corner_modes_and_shrinking() {
        let x = Tensor::randn(0f32, 1.0, (2, 3, 37, 29), &Device::Cpu).unwrap();
        for &(oh, ow) in &[(74, 58), (518, 301), (20, 11), (1, 5), (37, 29 * 3)] {
            for align in [false, true] {
                let want = x.upsample_bilinear2d(oh, ow, align).unwrap();
                let got = bilinear(&x, oh, ow, align).unwrap().unwrap();
                let err = (got - &want).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
                assert!(err < 1e-5, "{oh}x{ow} align {align}: max abs error {err}");
            }
        }
    }

    /// The vectorised groups give `along_width`'s values bit for bit, for both corner modes and
    /// widths off the group size; a 5× shrink has no plan.
    #[test]
    fn row_plan_groups_are_along_width() {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            let src: Vec<f32> = (0..296).map(|i| ((i * 7919) % 1000) as f32 * 0.013 - 6.0).collect();
            for (n_in, n_out) in [(296, 518), (37, 74), (5, 37), (1, 20), (296, 296)] {
                for align in [false, true] {
                    let tx = taps(n_in, n_out, align);
                    let plan = RowPlan::new(&tx, n_in).unwrap();
                    let mut want = vec![0f32; n_out];
                    along_width(&src[..n_in], &tx, &mut want);
                    let mut got = vec![0f32; plan.groups() * 16];
                    for g in 0..plan.groups() {
                        // SAFETY: AVX-512F detected; the row holds n_in floats.
                        unsafe { std::arch::x86_64::_mm512_storeu_ps(got.as_mut_ptr().add(16 * g), plan.group(g, src.as_ptr())) };
                    }
                    assert_eq!(&got[..n_out], &want[..], "{n_in} -> {n_out} align {align}");
                }
            }
        }
        assert!(RowPlan::new(&taps(100, 20, false), 100).is_none());
    }

    #[test]
    fn reads_strided_views_and_declines_other_dtypes() {
        let x = Tensor::randn(0f32, 1.0, (1, 4, 16, 12), &Device::Cpu).unwrap();
        let view = x.transpose(2, 3).unwrap();
        let want = view.contiguous().unwrap().upsample_bilinear2d(24, 32, true).unwrap();
        let got = bilinear(&view, 24, 32, true).unwrap().unwrap();
        let err = (got - &want).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
        assert!(err < 1e-5, "max abs error {err}");
        assert!(bilinear(&x.to_dtype(candle_core::DType::F64).unwrap(), 8, 8, false).unwrap().is_none());
        assert!(bilinear(&x, 0, 8, false).unwrap().is_none(), "an empty output is Candle's to handle");
    }
}
