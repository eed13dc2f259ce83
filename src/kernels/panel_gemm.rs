//! A single-threaded f32 GEMM on x86-64 with AVX2 + FMA whose right-hand operand is packed once and
//! reused: `C (+)= A · B` for a row-major `A` read in place and `B` held as 16-column panels
//! (`[n / 16][k][16]`, zero-padded). With AVX-512 a 12 × 32 register tile (24 of the 32 zmm
//! registers accumulate) multiplies a 12-row strip of `A` by two adjacent panels; with AVX2 only, a
//! 6 × 16 tile (12 of the 16 ymm registers) by one panel. `K` runs in passes of at most [`KC`] so
//! that the panels' slices stay in L1 while the strips pass them. The fused attention packs
//! each head's keys and values once for all its query blocks here; through the `gemm` crate they
//! were packed again for every block (its 64-deep `q kᵀ` and 64-wide `s v` ran at ~154 GFLOP/s on
//! two Zen 2 cores against its ~186 on the ViT linears).

/// Columns of one packed panel (two ymm registers).
pub(crate) const NR: usize = 16;
/// Rows of the AVX2 register tile.
#[cfg(target_arch = "x86_64")]
const MR: usize = 6;
/// Rows of the AVX-512 register tile (two panels wide).
#[cfg(target_arch = "x86_64")]
const MR_512: usize = 12;
/// Depth of one pass over a panel: its `KC × 16` slice (16 KiB) stays in L1.
#[cfg(target_arch = "x86_64")]
const KC: usize = 256;

/// Whether this CPU runs [`multiply`]: AVX2 and FMA.
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Right-hand operand `B [k, n]` packed as `ceil(n / 16)` panels of `k × 16` floats.
pub(crate) struct Panels {
    data: Vec<f32>,
    k: usize,
    n: usize,
}

impl Panels {
    /// Packs `B = Xᵀ` for `X [n, k]` whose row `j` starts at `rows(j)` (`k` contiguous floats):
    /// the keys of `q kᵀ`, a linear layer's weight.
    pub(crate) fn from_rows<'a>(n: usize, k: usize, rows: impl Fn(usize) -> &'a [f32]) -> Self {
        let mut p = Panels::zeroed(k, n);
        for (pi, panel) in p.data.chunks_exact_mut((k * NR).max(1)).enumerate() {
            for c in 0..NR.min(n - pi * NR) {
                for (kk, &v) in rows(pi * NR + c)[..k].iter().enumerate() {
                    panel[kk * NR + c] = v;
                }
            }
        }
        p
    }

    /// Packs `B [k, n]` whose row `kk` starts at `rows(kk)` (`n` contiguous floats): the values of
    /// `s v`.
    pub(crate) fn from_columns<'a>(k: usize, n: usize, rows: impl Fn(usize) -> &'a [f32]) -> Self {
        let mut p = Panels::zeroed(k, n);
        for kk in 0..k {
            let row = &rows(kk)[..n];
            for (pi, cols) in row.chunks(NR).enumerate() {
                p.data[(pi * k + kk) * NR..][..cols.len()].copy_from_slice(cols);
            }
        }
        p
    }

    fn zeroed(k: usize, n: usize) -> Self {
        Panels { data: vec![0f32; n.div_ceil(NR) * k * NR], k, n }
    }
}

/// `c [m, n] (+)= a [m, k] · b` on this thread, for `a` and `c` row-major with row strides `lda`
/// and `ldc`; `accumulate` adds to what `c` holds, otherwise it is overwritten.
///
/// # Panics
/// When [`available`] is false, or `a` / `c` are too short for `m` rows at their strides.
pub(crate) fn multiply(a: &[f32], lda: usize, m: usize, b: &Panels, c: &mut [f32], ldc: usize, accumulate: bool) {
    multiply_on(wide_available(), a, lda, m, b, c, ldc, accumulate)
}

/// Whether this CPU runs the AVX-512 tile.
fn wide_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        available() && is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// [`multiply`] with the AVX-512 tile when `wide` (which the caller has detected), else the AVX2 one.
#[allow(clippy::too_many_arguments)]
fn multiply_on(wide: bool, a: &[f32], lda: usize, m: usize, b: &Panels, c: &mut [f32], ldc: usize, accumulate: bool) {
    let (k, n) = (b.k, b.n);
    assert!(available(), "panel_gemm: needs AVX2 + FMA");
    assert!(lda >= k && ldc >= n, "panel_gemm: strides shorter than rows");
    if m == 0 || n == 0 {
        return;
    }
    assert!(a.len() >= (m - 1) * lda + k && c.len() >= (m - 1) * ldc + n, "panel_gemm: operand sizes");
    if k == 0 {
        if !accumulate {
            c.chunks_mut(ldc).take(m).for_each(|row| row[..n].fill(0.0));
        }
        return;
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = wide;
    // SAFETY: the features were checked and every access stays inside the sizes asserted above.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        assert!(!wide || is_x86_feature_detected!("avx512f"), "panel_gemm: needs AVX-512F");
        if wide {
            passes_512(a, lda, m, b, c, ldc, accumulate)
        } else {
            passes(a, lda, m, b, c, ldc, accumulate)
        }
    };
}

/// Calls `$tile::<R>($args..)` with `R = $rows` (1 ..= 12).
#[cfg(target_arch = "x86_64")]
macro_rules! rows_512 {
    ($rows:expr, $tile:ident($($arg:expr),*)) => {
        match $rows {
            12 => $tile::<12>($($arg),*),
            11 => $tile::<11>($($arg),*),
            10 => $tile::<10>($($arg),*),
            9 => $tile::<9>($($arg),*),
            8 => $tile::<8>($($arg),*),
            7 => $tile::<7>($($arg),*),
            6 => $tile::<6>($($arg),*),
            5 => $tile::<5>($($arg),*),
            4 => $tile::<4>($($arg),*),
            3 => $tile::<3>($($arg),*),
            2 => $tile::<2>($($arg),*),
            _ => $tile::<1>($($arg),*),
        }
    };
}

/// [`multiply`] after its checks, with AVX-512: pairs of full panels through the 12 × 32 tile, a
/// last odd or partial panel through [`panel_512`].
///
/// # Safety
/// AVX-512F, AVX2 + FMA present; `a`, `c` and `b` hold `m` rows at their strides.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn passes_512(a: &[f32], lda: usize, m: usize, b: &Panels, c: &mut [f32], ldc: usize, accumulate: bool) {
    let (k, n) = (b.k, b.n);
    let count = k.div_ceil(KC);
    let depth = k.div_ceil(count);
    let (full, panels) = (n / NR, n.div_ceil(NR));
    for pass in 0..count {
        let k0 = pass * depth;
        let kc = depth.min(k - k0);
        let add = accumulate || pass > 0;
        let mut p = 0;
        while p < panels {
            let panel = b.data.as_ptr().add((p * k + k0) * NR);
            let pair = p + 1 < full;
            let mut i = 0;
            while i < m {
                let rows = MR_512.min(m - i);
                let strip = a.as_ptr().add(i * lda + k0);
                let out = c.as_mut_ptr().add(i * ldc + p * NR);
                if pair {
                    rows_512!(rows, pair_512(kc, strip, lda, panel, k * NR, out, ldc, add));
                } else {
                    rows_512!(rows, panel_512(kc, strip, lda, panel, out, ldc, NR.min(n - p * NR), add));
                }
                i += rows;
            }
            p += if pair { 2 } else { 1 };
        }
    }
}

/// The AVX-512 register tile: `c[R × 32] (+)= a[R × kc] · [b | b + next][kc × 32]`, two panels'
/// slices `next` floats apart, `a` rows `lda` apart, `c` rows `ldc` apart.
///
/// # Safety
/// The CPU has AVX-512F; `a` addresses `R` rows of `kc` floats `lda` apart, `b` and `b + next` each
/// `kc` rows of 16 floats (packed panels), `c` `R` rows of 32 writable floats `ldc` apart.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn pair_512<const R: usize>(kc: usize, a: *const f32, lda: usize, b: *const f32, next: usize, c: *mut f32, ldc: usize, add: bool) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    let b1 = b.add(next);
    for kk in 0..kc {
        let lo = _mm512_loadu_ps(b.add(kk * NR));
        let hi = _mm512_loadu_ps(b1.add(kk * NR));
        for (r, acc) in acc.iter_mut().enumerate() {
            let ar = _mm512_set1_ps(*a.add(r * lda + kk));
            acc[0] = _mm512_fmadd_ps(ar, lo, acc[0]);
            acc[1] = _mm512_fmadd_ps(ar, hi, acc[1]);
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        let row = c.add(r * ldc);
        let (mut lo, mut hi) = (acc[0], acc[1]);
        if add {
            lo = _mm512_add_ps(lo, _mm512_loadu_ps(row));
            hi = _mm512_add_ps(hi, _mm512_loadu_ps(row.add(NR)));
        }
        _mm512_storeu_ps(row, lo);
        _mm512_storeu_ps(row.add(NR), hi);
    }
}

/// One panel (the last, odd or partial one: `cols` ≤ 16 of its columns are stored) by `R` rows
/// with AVX-512, a masked store for a partial panel.
///
/// # Safety
/// The CPU has AVX-512F; `a` addresses `R` rows of `kc` floats `lda` apart, `b` `kc` rows of 16
/// floats (a packed panel), `c` `R` rows of `cols` ≤ 16 writable floats `ldc` apart.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn panel_512<const R: usize>(kc: usize, a: *const f32, lda: usize, b: *const f32, c: *mut f32, ldc: usize, cols: usize, add: bool) {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_setzero_ps(); R];
    for kk in 0..kc {
        let bv = _mm512_loadu_ps(b.add(kk * NR));
        for (r, acc) in acc.iter_mut().enumerate() {
            *acc = _mm512_fmadd_ps(_mm512_set1_ps(*a.add(r * lda + kk)), bv, *acc);
        }
    }
    let keep: __mmask16 = if cols >= NR { 0xFFFF } else { ((1u32 << cols) - 1) as u16 };
    for (r, acc) in acc.iter().enumerate() {
        let row = c.add(r * ldc);
        let mut v = *acc;
        if add {
            v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(keep, row));
        }
        _mm512_mask_storeu_ps(row, keep, v);
    }
}

/// [`multiply`] after its checks.
///
/// # Safety
/// AVX2 + FMA present; `a`, `c` and `b` hold `m` rows at their strides.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn passes(a: &[f32], lda: usize, m: usize, b: &Panels, c: &mut [f32], ldc: usize, accumulate: bool) {
    let (k, n) = (b.k, b.n);
    let count = k.div_ceil(KC);
    let depth = k.div_ceil(count);
    for pass in 0..count {
        let k0 = pass * depth;
        let kc = depth.min(k - k0);
        let add = accumulate || pass > 0;
        for p in 0..n.div_ceil(NR) {
            let panel = b.data.as_ptr().add((p * k + k0) * NR);
            let cols = NR.min(n - p * NR);
            let mut i = 0;
            while i < m {
                let rows = MR.min(m - i);
                let strip = a.as_ptr().add(i * lda + k0);
                let out = c.as_mut_ptr().add(i * ldc + p * NR);
                if cols == NR {
                    tile_rows(rows, kc, strip, lda, panel, out, ldc, add);
                } else {
                    // A partial last panel: through a full-width scratch tile.
                    let mut scratch = [0f32; MR * NR];
                    if add {
                        for r in 0..rows {
                            std::ptr::copy_nonoverlapping(out.add(r * ldc), scratch.as_mut_ptr().add(r * NR), cols);
                        }
                    }
                    tile_rows(rows, kc, strip, lda, panel, scratch.as_mut_ptr(), NR, add);
                    for r in 0..rows {
                        std::ptr::copy_nonoverlapping(scratch.as_ptr().add(r * NR), out.add(r * ldc), cols);
                    }
                }
                i += rows;
            }
        }
    }
}

/// [`tile`] for `rows` (1 ..= 6) rows.
///
/// # Safety
/// As [`tile`]'s with `R = rows`, and `rows` is 1 to 6.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn tile_rows(rows: usize, kc: usize, a: *const f32, lda: usize, b: *const f32, c: *mut f32, ldc: usize, add: bool) {
    match rows {
        6 => tile::<6>(kc, a, lda, b, c, ldc, add),
        5 => tile::<5>(kc, a, lda, b, c, ldc, add),
        4 => tile::<4>(kc, a, lda, b, c, ldc, add),
        3 => tile::<3>(kc, a, lda, b, c, ldc, add),
        2 => tile::<2>(kc, a, lda, b, c, ldc, add),
        _ => tile::<1>(kc, a, lda, b, c, ldc, add),
    }
}

/// The register tile: `c[R × 16] (+)= a[R × kc] · b[kc × 16]`, `a` rows `lda` apart, `b` a packed
/// panel's slice, `c` rows `ldc` apart.
///
/// # Safety
/// The CPU has AVX2 and FMA; `a` addresses `R` rows of `kc` floats `lda` apart, `b` `kc` rows of
/// 16 floats (a packed panel), `c` `R` rows of 16 writable floats `ldc` apart.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile<const R: usize>(kc: usize, a: *const f32, lda: usize, b: *const f32, c: *mut f32, ldc: usize, add: bool) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    for kk in 0..kc {
        let b0 = _mm256_loadu_ps(b.add(kk * NR));
        let b1 = _mm256_loadu_ps(b.add(kk * NR + 8));
        for (r, acc) in acc.iter_mut().enumerate() {
            let ar = _mm256_broadcast_ss(&*a.add(r * lda + kk));
            acc[0] = _mm256_fmadd_ps(ar, b0, acc[0]);
            acc[1] = _mm256_fmadd_ps(ar, b1, acc[1]);
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        let row = c.add(r * ldc);
        let (mut lo, mut hi) = (acc[0], acc[1]);
        if add {
            lo = _mm256_add_ps(lo, _mm256_loadu_ps(row));
            hi = _mm256_add_ps(hi, _mm256_loadu_ps(row.add(8)));
        }
        _mm256_storeu_ps(row, lo);
        _mm256_storeu_ps(row.add(8), hi);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(len: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2_654_435_761).max(1);
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn both_packings_multiply_as_a_naive_product_at_edge_shapes() {
        if !available() {
            eprintln!("panel_gemm: this CPU has no AVX2 + FMA; nothing to test");
            return;
        }
        // Rows and columns off the tile, depths across the KC split, strides longer than rows.
        for &(m, k, n) in &[(1, 1, 1), (7, 3, 17), (13, 257, 33), (100, 600, 130), (6, 512, 16), (97, 40, 5), (25, 64, 80), (12, 9, 48)] {
            let (lda, ldc) = (k + 3, n + 5);
            let a = values(m * lda, 1);
            let bt = values(n * k, 2); // B transposed: [n, k]
            let b: Vec<f32> = (0..k * n).map(|i| bt[(i % n) * k + i / n]).collect(); // [k, n]
            let want = |i: usize, j: usize| (0..k).map(|p| a[i * lda + p] as f64 * bt[j * k + p] as f64).sum::<f64>();
            let tiles = if wide_available() { vec![false, true] } else { vec![false] };
            for (packed, wide) in [Panels::from_rows(n, k, |j| &bt[j * k..]), Panels::from_columns(k, n, |p| &b[p * n..])]
                .iter()
                .flat_map(|p| tiles.iter().map(move |&w| (p, w)))
            {
                for accumulate in [false, true] {
                    let start = values(m * ldc, 3);
                    let mut got = start.clone();
                    multiply_on(wide, &a, lda, m, packed, &mut got, ldc, accumulate);
                    for i in 0..m {
                        for j in 0..ldc {
                            let expect = if j >= n { start[i * ldc + j] as f64 } else { want(i, j) + if accumulate { start[i * ldc + j] as f64 } else { 0.0 } };
                            let err = (got[i * ldc + j] as f64 - expect).abs();
                            assert!(err <= 1e-4 * (k as f64).sqrt(), "m {m} k {k} n {n} wide {wide} accumulate {accumulate} at ({i}, {j}): error {err}");
                        }
                    }
                }
            }
        }
    }
}
