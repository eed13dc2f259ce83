//! The AVX-512 register tile of the direct conv: 8 output channels × 48 pixels of one row (24
//! accumulators); border lanes are masked, so the input is never padded or copied.
use std::arch::x86_64::*;

use super::{Row, MAX_KERNEL};

/// Output channels per register tile.
pub(super) const CO: usize = 8;
/// Output pixels per chunk.
pub(super) const PX: usize = 48;

impl Row<'_> {
    /// Output pixels `x0 .. x0 + 48` (clipped to the row; `x0 < ow`).
    ///
    /// # Safety
    /// The CPU has AVX-512F; `out` addresses `channels` planes (stride `plane`) of at least `ow`
    /// writable floats each.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn chunk_avx512(&self, x0: usize) {
        match (self.ow - x0).div_ceil(16) {
            1 => self.chunk::<1>(x0),
            2 => self.chunk::<2>(x0),
            _ => self.chunk::<3>(x0),
        }
    }

    /// Output pixels `x0 .. x0 + 16·NV` (clipped to the row) of the tile's channels.
    ///
    /// # Safety
    /// The CPU has AVX-512F, and `x0` is a pixel of the output row.
    #[target_feature(enable = "avx512f")]
    unsafe fn chunk<const NV: usize>(&self, x0: usize) {
        let s = self.s;
        let (w, pad) = (s.w as isize, s.pad as isize);
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
        let keep = |v: usize| -> u16 {
            let left = self.ow as isize - (x0 + 16 * v) as isize;
            if left >= 16 { 0xFFFF } else if left > 0 { ((1u32 << left) - 1) as u16 } else { 0 }
        };
        let mut acc = [[_mm512_setzero_ps(); NV]; CO];
        for (j, a) in acc.iter_mut().enumerate() {
            *a = [_mm512_set1_ps(self.bias[j]); NV];
        }
        let rows = self.kernel_rows();
        let wp = self.w.as_ptr();
        for ci in 0..s.c {
            for ky in rows.clone() {
                let line = self.line(ci, ky).as_ptr();
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
                _mm512_mask_storeu_ps(dst.add(16 * v), keep(v), *av);
            }
        }
    }
}
