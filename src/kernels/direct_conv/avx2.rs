//! The AVX2 + FMA register tile of the direct conv: 6 output channels × 16 pixels of one row (12
//! of the 16 vector registers accumulate, 2 hold the input pixels, 1 the broadcast weight; 4
//! channels × 24 pixels also needs 16 and LLVM spilled an accumulator, at half the FMA peak).
//! Chunks clear of the row's borders load plainly; the first and last load through lane masks, so
//! the input is never padded or copied.
use std::arch::x86_64::*;

use super::{Row, MAX_KERNEL};

/// Output channels per register tile.
pub(super) const CO: usize = super::AVX2_CHANNELS;
/// Vectors of 8 pixels per register tile.
const NV: usize = 2;
/// Output pixels per register tile.
const PX: usize = 8 * NV;
impl Row<'_> {
    /// Computes the row in chunks of [`PX`] pixels, the last one narrower.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; `out` addresses `channels` planes (stride `plane`) of at least
    /// `ow` writable floats each.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn run_avx2(&self) {
        let s = self.s;
        let mut x0 = 0;
        while x0 < self.ow {
            // Input columns x0 − pad ..= x0 + PX − 1 + kw − 1 − pad all inside the row?
            let inside = x0 >= s.pad && x0 + PX + s.kw - 1 <= s.w + s.pad;
            if inside {
                self.chunk_avx2::<false>(x0);
            } else {
                self.chunk_avx2::<true>(x0);
            }
            x0 += PX;
        }
    }

    /// Output pixels `x0 .. x0 + PX` (clipped to the row) of the tile's channels; `MASKED` loads
    /// only the lanes whose input column lies inside the row.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA, and `x0` is a pixel of the output row.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn chunk_avx2<const MASKED: bool>(&self, x0: usize) {
        let s = self.s;
        let (w, pad) = (s.w as isize, s.pad as isize);
        let mut masks = [[_mm256_setzero_si256(); NV]; MAX_KERNEL];
        if MASKED {
            let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            for (kx, m) in masks.iter_mut().enumerate().take(s.kw) {
                for (v, mv) in m.iter_mut().enumerate() {
                    // Input column of lane i: start + i; inside when 0 ≤ start + i < w.
                    let start = (x0 + 8 * v + kx) as isize - pad;
                    let col = _mm256_add_epi32(lane, _mm256_set1_epi32(start as i32));
                    let ge0 = _mm256_cmpgt_epi32(col, _mm256_set1_epi32(-1));
                    let ltw = _mm256_cmpgt_epi32(_mm256_set1_epi32(w as i32), col);
                    *mv = _mm256_and_si256(ge0, ltw);
                }
            }
        }
        let width = (self.ow - x0).min(PX);
        let mut acc = [[_mm256_setzero_ps(); NV]; CO];
        for (j, a) in acc.iter_mut().enumerate() {
            *a = [_mm256_set1_ps(self.bias[j]); NV];
        }
        let rows = self.kernel_rows();
        let wp = self.w.as_ptr();
        for ci in 0..s.c {
            for ky in rows.clone() {
                let line = self.line(ci, ky).as_ptr();
                for (kx, m) in masks.iter().enumerate().take(s.kw) {
                    let mut inp = [_mm256_setzero_ps(); NV];
                    for v in 0..NV {
                        let at = line.wrapping_offset((x0 + 8 * v + kx) as isize - pad);
                        // A masked-off lane is not read, so an address before or past the row (the
                        // padding) is never touched; unmasked chunks lie inside the row.
                        inp[v] = if MASKED { _mm256_maskload_ps(at, m[v]) } else { _mm256_loadu_ps(at) };
                    }
                    let wt = wp.add(((ci * s.kh + ky) * s.kw + kx) * CO);
                    for (j, a) in acc.iter_mut().enumerate() {
                        let wj = _mm256_broadcast_ss(&*wt.add(j));
                        for v in 0..NV {
                            a[v] = _mm256_fmadd_ps(inp[v], wj, a[v]);
                        }
                    }
                }
            }
        }
        for (j, a) in acc.iter().enumerate().take(self.channels) {
            let dst = self.out.add(j * self.plane + x0);
            if width == PX {
                for (v, av) in a.iter().enumerate() {
                    _mm256_storeu_ps(dst.add(8 * v), *av);
                }
            } else {
                let mut tail = [0f32; PX];
                for (v, av) in a.iter().enumerate() {
                    _mm256_storeu_ps(tail.as_mut_ptr().add(8 * v), *av);
                }
                std::ptr::copy_nonoverlapping(tail.as_ptr(), dst, width);
            }
        }
    }
}
