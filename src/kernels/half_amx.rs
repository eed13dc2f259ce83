//! `x · w` for f32 activations and an f16 weight on Intel AMX-BF16, to about f32's precision.
//!
//! An f16 weight is exactly the sum of two bf16 values: `hi`, the weight rounded to bf16 (8
//! significant bits of its 11), and the remainder `lo`. An f32 activation is split the same way
//! (16 of its 24 bits). The tiles sum `a_hi·w_hi + a_lo·w_hi + a_hi·w_lo` in f32: what is left out
//! (`a_lo·w_lo` and the activation's bits below `lo`) is under 2⁻¹⁶ of each product, where the f16
//! weight itself is 2⁻¹¹ from the f32 it was rounded from. Three tile products per step still run
//! at several times the rate of the f32 FMA GEMM.

/// Rows of `x` from which the tiles run (fewer: the widened f32 GEMM).
pub(crate) const MIN_ROWS: usize = 32;
/// Input features from which the tiles run: each 32 × 32 block of sums leaves the tiles once per
/// product, which a shallow product does not repay.
const MIN_DEPTH: usize = 128;
/// Output features from which the tiles run: splitting each activation costs about what 130
/// products gain.
const MIN_COLUMNS: usize = 256;

/// Whether [`xw_into`] runs here for `x [rows, k] · w [k, n]`: x86-64 Linux with AMX-BF16
/// ([`super::amx::bf16_available`]; `EDGERUN_NO_AMX=1` turns it off), at least [`MIN_ROWS`] rows,
/// [`MIN_DEPTH`] input and [`MIN_COLUMNS`] output features.
pub(crate) fn runs_for(rows: usize, k: usize, n: usize) -> bool {
    cfg!(all(target_arch = "x86_64", target_os = "linux")) && rows >= MIN_ROWS && k >= MIN_DEPTH && n >= MIN_COLUMNS && super::amx::bf16_available()
}

/// Writes `x [rows, k] · w` into `out` (`[rows, n]` row-major) for row-major f32 `x` and f16
/// `w [k, n]`.
///
/// # Safety
/// [`runs_for`]`(rows, k, n)` is true, `out` addresses `rows × n` writable floats that nothing else
/// touches meanwhile, `xs` holds `rows × k` values and `ws` `k × n`.
#[allow(unused_variables)]
pub(crate) unsafe fn xw_into(out: *mut f32, xs: &[f32], rows: usize, k: usize, ws: &[half::f16], n: usize) {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    // SAFETY: as this function's contract.
    unsafe {
        tiles::xw_into(out, xs, rows, k, ws, n)
    }
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
mod tiles {
    use std::arch::x86_64::*;

    use super::super::amx;
    use super::super::cpu_slice::{with_scratch, SharedOut};

    /// Depth (and rows, and columns) of one tile step.
    const STEP: usize = 32;
    /// Values of one 16 × 32 tile (1 KiB).
    const TILE_LEN: usize = 16 * STEP;
    /// Values of one depth step of a strip or a column block: four tiles.
    const STEP_LEN: usize = 4 * TILE_LEN;
    /// Bytes of one column block's packed weight (both parts): it stays in L2 while every strip of
    /// rows passes over it.
    const BLOCK_BYTES: usize = 1 << 20;

    /// See [`super::xw_into`].
    ///
    /// # Safety
    /// As [`super::xw_into`]'s.
    pub(super) unsafe fn xw_into(out: *mut f32, xs: &[f32], rows: usize, k: usize, ws: &[half::f16], n: usize) {
        use rayon::prelude::*;
        thread_local! {
            static PACKED: std::cell::RefCell<Vec<u16>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        let kp = k.div_ceil(STEP) * STEP;
        let split = split_rows(xs, rows, k, kp);
        let dst = SharedOut(out);
        // Column blocks of whole 32-column steps: at most BLOCK_BYTES of packed weight each, and at
        // least four blocks per thread where the columns allow (balance).
        let units = n.div_ceil(STEP);
        let max_units = (BLOCK_BYTES / (STEP * kp * 4)).max(1);
        let per_block = units.div_ceil(4 * rayon::current_num_threads()).clamp(1, max_units);
        (0..units.div_ceil(per_block)).into_par_iter().for_each(|block| {
            let j0 = block * per_block * STEP;
            let cols = (per_block * STEP).min(n - j0);
            with_scratch(&PACKED, |packed| {
                let len = cols.div_ceil(STEP) * (kp / STEP) * STEP_LEN;
                // Grown once per thread, never zeroed: the packing writes every value.
                if packed.len() < len {
                    packed.resize(len, 0);
                }
                // SAFETY: AVX-512F/BW/VL run where AMX-BF16 was found; `packed` holds the block.
                unsafe { pack_weight(&mut packed[..len], ws, k, kp, n, j0, cols) };
                // SAFETY: `runs_for` found AMX; this task alone writes columns j0 .. j0 + cols.
                unsafe { multiply_block(dst, &split, rows, kp, n, &packed[..len], j0, cols) };
            });
        });
    }

    /// `x` split into bf16 parts, in tiles: for each strip of 32 rows (the last padded with zeros)
    /// and each depth step of 32, four 16 × 32 tiles: `hi` of rows 0–15, `hi` of rows 16–31, then
    /// `lo` (zeros past `k`).
    fn split_rows(xs: &[f32], rows: usize, k: usize, kp: usize) -> Vec<u16> {
        use rayon::prelude::*;
        let strips = rows.div_ceil(STEP);
        let strip_len = kp / STEP * STEP_LEN;
        let mut split: Vec<u16> = Vec::with_capacity(strips * strip_len);
        let dst = SharedOut(split.spare_capacity_mut().as_mut_ptr().cast());
        (0..strips).into_par_iter().for_each(|strip| {
            let base = dst.at(0).cast::<u16>().wrapping_add(strip * strip_len);
            // SAFETY: each task writes its own strip's values inside the capacity.
            let tiles = unsafe { std::slice::from_raw_parts_mut(base, strip_len) };
            for i in 0..STEP {
                let r = strip * STEP + i;
                let x = if r < rows { &xs[r * k..][..k] } else { &[][..] };
                // SAFETY: AVX-512F/BW/VL run where AMX-BF16 was found.
                unsafe { split_row(x, tiles, (i / 16) * TILE_LEN + (i % 16) * STEP) };
            }
        });
        // SAFETY: every strip's values were written above.
        unsafe { split.set_len(strips * strip_len) };
        split
    }

    /// The bf16 bits (in each lane's low half) of 16 floats' bits, rounded to nearest, ties to even.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn round_to_bf16(bits: __m512i) -> __m512i {
        let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
        _mm512_srli_epi32::<16>(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))))
    }

    /// 16 floats as `(hi, lo)` bf16 bits (each lane's low half): `hi` the float rounded, `lo` the
    /// remainder rounded.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn split16(v: __m512) -> (__m512i, __m512i) {
        let hi = round_to_bf16(_mm512_castps_si512(v));
        let rest = _mm512_sub_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32::<16>(hi)));
        (hi, round_to_bf16(_mm512_castps_si512(rest)))
    }

    /// The mask of the first `len` (≤ 16) lanes.
    fn lanes(len: usize) -> u16 {
        ((1u32 << len) - 1) as u16
    }

    /// Writes `x`'s `hi` and `lo` parts (zeros past `x.len()`) into a strip's tiles, this row's
    /// 32 values of each step at `at` (`hi`) and `at + 2` tiles (`lo`) from the step's start.
    ///
    /// # Safety
    /// The CPU has AVX-512F, BW, VL and BF16.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    unsafe fn split_row(x: &[f32], tiles: &mut [u16], at: usize) {
        for (step, tile) in tiles.chunks_exact_mut(STEP_LEN).enumerate() {
            for half in 0..2 {
                let p = step * STEP + 16 * half;
                let mask = lanes(x.len().saturating_sub(p).min(16));
                // SAFETY: the mask covers only elements of `x`; `at + 2 tiles + 32` is inside the step.
                unsafe {
                    let v = _mm512_maskz_loadu_ps(mask, x.as_ptr().wrapping_add(p));
                    let hi = _mm512_cvtneps_pbh(v);
                    let lo = _mm512_cvtneps_pbh(_mm512_sub_ps(v, _mm512_cvtpbh_ps(hi)));
                    _mm256_storeu_si256(tile.as_mut_ptr().add(at + 16 * half).cast(), std::mem::transmute::<__m256bh, __m256i>(hi));
                    _mm256_storeu_si256(tile.as_mut_ptr().add(at + 2 * TILE_LEN + 16 * half).cast(), std::mem::transmute::<__m256bh, __m256i>(lo));
                }
            }
        }
    }

    /// Packs columns `j0 .. j0 + cols` of `w [k, n]` for the tiles: for each 32 columns and each
    /// depth step, four 16 × 16-pair tiles (`hi` of columns 0–15, `hi` of 16–31, then `lo`), each
    /// row the column pairs `(w[2r][j], w[2r+1][j])` (zeros past `k` and `n`).
    ///
    /// # Safety
    /// The CPU has AVX-512F, BW, VL and F16C.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
    unsafe fn pack_weight(packed: &mut [u16], ws: &[half::f16], k: usize, kp: usize, n: usize, j0: usize, cols: usize) {
        let block_len = kp / STEP * STEP_LEN;
        for (q, block) in packed.chunks_exact_mut(block_len).enumerate() {
            for t in 0..2 {
                let c0 = 32 * q + 16 * t;
                let mask = lanes(cols.saturating_sub(c0).min(16));
                let row = |p: usize| -> __m512 {
                    if p < k {
                        // SAFETY: the mask covers only columns of row p < k that are < n.
                        unsafe { _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, ws.as_ptr().wrapping_add(p * n + j0 + c0).cast())) }
                    } else {
                        _mm512_setzero_ps()
                    }
                };
                for r in 0..kp / 2 {
                    let (h0, l0) = split16(row(2 * r));
                    let (h1, l1) = split16(row(2 * r + 1));
                    let at = (r / 16) * STEP_LEN + t * TILE_LEN + (r % 16) * STEP;
                    // SAFETY: `at + 2 tiles + 32` is inside the block's step r / 16.
                    unsafe {
                        _mm512_storeu_si512(block.as_mut_ptr().add(at).cast(), _mm512_or_si512(h0, _mm512_slli_epi32::<16>(h1)));
                        _mm512_storeu_si512(block.as_mut_ptr().add(at + 2 * TILE_LEN).cast(), _mm512_or_si512(l0, _mm512_slli_epi32::<16>(l1)));
                    }
                }
            }
        }
    }

    /// Every strip of 32 rows times the packed column block at `j0` (`cols` wide), stored into `out`.
    ///
    /// # Safety
    /// AMX-BF16 runs here; `a` is [`split_rows`]'s buffer for `rows` rows of depth `kp`, `packed`
    /// the block's [`pack_weight`], and no other task writes columns `j0 .. j0 + cols` of `out`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn multiply_block(out: SharedOut, a: &[u16], rows: usize, kp: usize, n: usize, packed: &[u16], j0: usize, cols: usize) {
        let steps = kp / STEP;
        let strip_len = steps * STEP_LEN;
        let mut edge = Edge([0.0; STEP * STEP]);
        // SAFETY: AMX runs here.
        let _tiles = unsafe { amx::Tiles::configure() };
        for m0 in (0..rows).step_by(STEP) {
            let strip = a[m0 / STEP * strip_len..].as_ptr();
            for c0 in (0..cols).step_by(STEP) {
                let block = packed[c0 / STEP * strip_len..].as_ptr();
                let (m, c) = ((rows - m0).min(STEP), (cols - c0).min(STEP));
                // SAFETY: the strip and the block each hold `steps` steps; the store goes to this
                // task's columns of rows m0 .. m0 + 32 of `out`, or to `edge`.
                unsafe {
                    amx::zero_sums();
                    amx::add_split_bf16_32x32(strip, block, steps);
                    let at = out.at(m0 * n + j0 + c0);
                    if m == STEP && c == STEP {
                        amx::store_f32_32x32(at, n * 4);
                    } else {
                        amx::store_f32_32x32(edge.0.as_mut_ptr(), STEP * 4);
                        for i in 0..m {
                            std::ptr::copy_nonoverlapping(edge.0.as_ptr().add(i * STEP), at.add(i * n), c);
                        }
                    }
                }
            }
        }
    }

    /// A 32 × 32 block of sums for a strip or block cut short by the matrix's edge.
    #[repr(align(64))]
    struct Edge([f32; STEP * STEP]);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `x · w` on the tiles agrees with the f64 product of the same f16 weights to within 2⁻¹⁵ of
    /// `Σ |x||w|` for ragged shapes (rows, depth and columns not whole steps) and for column blocks
    /// over several tasks; every output element is written.
    #[test]
    fn the_tile_product_matches_f64_on_ragged_shapes() {
        if !runs_for(MIN_ROWS, MIN_DEPTH, MIN_COLUMNS) {
            return;
        }
        for &(rows, k, n) in &[(32, 32, 32), (45, 70, 50), (33, 384, 200), (100, 1030, 700)] {
            let xs: Vec<f32> = (0..rows * k).map(|i| ((i * 37 % 101) as f32 / 50.0 - 1.0) * if i % 7 == 0 { 300.0 } else { 1.0 }).collect();
            let ws: Vec<half::f16> = (0..k * n).map(|i| half::f16::from_f32((i * 53 % 97) as f32 / 48.3 - 1.0)).collect();
            let mut out = vec![f32::NAN; rows * n];
            // SAFETY: runs_for is true; out is rows × n, xs rows × k, ws k × n.
            unsafe { xw_into(out.as_mut_ptr(), &xs, rows, k, &ws, n) };
            for r in 0..rows {
                for j in 0..n {
                    let (mut exact, mut scale) = (0f64, 0f64);
                    for p in 0..k {
                        let term = xs[r * k + p] as f64 * ws[p * n + j].to_f64();
                        exact += term;
                        scale += term.abs();
                    }
                    let got = out[r * n + j] as f64;
                    assert!((got - exact).abs() <= scale * 2f64.powi(-15), "{rows}×{k}×{n} at ({r}, {j}): {got} against {exact} (scale {scale})");
                }
            }
        }
    }
}

