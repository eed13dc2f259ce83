//! A single-threaded f32 GEMM on x86-64 with AVX2 + FMA (and no AVX-512) whose right-hand operand
//! is packed once and reused: `C (+)= A · B` for a row-major `A` read in place and `B` held as
//! 16-column panels (`[n / 16][k][16]`, zero-padded). A 6 × 16 register tile (12 of the 16 ymm
//! registers accumulate) multiplies a 6-row strip of `A` by one panel, `K` in passes of at most
//! [`KC`] so that the panel's slice stays in L1 while the strips pass it. The fused attention packs
//! each head's keys and values once for all its query blocks here; through the `gemm` crate they
//! were packed again for every block (its 64-deep `q kᵀ` and 64-wide `s v` ran at ~154 GFLOP/s on
//! two Zen 2 cores against its ~186 on the ViT linears).

/// Columns of one packed panel (two ymm registers).
pub const NR: usize = 16;
/// Rows of the register tile.
#[cfg(target_arch = "x86_64")]
const MR: usize = 6;
/// Depth of one pass over a panel: its `KC × 16` slice (16 KiB) stays in L1.
#[cfg(target_arch = "x86_64")]
const KC: usize = 256;

/// Whether this CPU runs [`multiply`]: AVX2 and FMA, without AVX-512 (where the `gemm` crate's
/// 512-bit kernels are wider than this tile).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && !is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Right-hand operand `B [k, n]` packed as `ceil(n / 16)` panels of `k × 16` floats.
pub struct Panels {
    data: Vec<f32>,
    k: usize,
    n: usize,
}

impl Panels {
    /// Packs `B = Xᵀ` for `X [n, k]` whose row `j` starts at `rows(j)` (`k` contiguous floats):
    /// the keys of `q kᵀ`, a linear layer's weight.
    pub fn from_rows<'a>(n: usize, k: usize, rows: impl Fn(usize) -> &'a [f32]) -> Self {
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
    pub fn from_columns<'a>(k: usize, n: usize, rows: impl Fn(usize) -> &'a [f32]) -> Self {
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
pub fn multiply(a: &[f32], lda: usize, m: usize, b: &Panels, c: &mut [f32], ldc: usize, accumulate: bool) {
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
    // SAFETY: the features were checked and every access stays inside the sizes asserted above.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        passes(a, lda, m, b, c, ldc, accumulate)
    };
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
            eprintln!("panel_gemm: this CPU has no AVX2 + FMA without AVX-512; nothing to test");
            return;
        }
        // Rows and columns off the tile, depths across the KC split, strides longer than rows.
        for &(m, k, n) in &[(1, 1, 1), (7, 3, 17), (13, 257, 33), (100, 600, 130), (6, 512, 16), (97, 40, 5)] {
            let (lda, ldc) = (k + 3, n + 5);
            let a = values(m * lda, 1);
            let bt = values(n * k, 2); // B transposed: [n, k]
            let b: Vec<f32> = (0..k * n).map(|i| bt[(i % n) * k + i / n]).collect(); // [k, n]
            let want = |i: usize, j: usize| (0..k).map(|p| a[i * lda + p] as f64 * bt[j * k + p] as f64).sum::<f64>();
            for packed in [Panels::from_rows(n, k, |j| &bt[j * k..]), Panels::from_columns(k, n, |p| &b[p * n..])] {
                for accumulate in [false, true] {
                    let start = values(m * ldc, 3);
                    let mut got = start.clone();
                    multiply(&a, lda, m, &packed, &mut got, ldc, accumulate);
                    for i in 0..m {
                        for j in 0..ldc {
                            let expect = if j >= n { start[i * ldc + j] as f64 } else { want(i, j) + if accumulate { start[i * ldc + j] as f64 } else { 0.0 } };
                            let err = (got[i * ldc + j] as f64 - expect).abs();
                            assert!(err <= 1e-4 * (k as f64).sqrt(), "m {m} k {k} n {n} accumulate {accumulate} at ({i}, {j}): error {err}");
                        }
                    }
                }
            }
        }
    }
}
