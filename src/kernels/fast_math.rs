//! Branch-free f32 `exp` and exact-GELU kernels that the compiler vectorises (AVX-512 or AVX2 + FMA
//! chosen at run time on x86-64), for the CPU inference paths: the fused attention's softmax and GELU.
//! Candle's `gelu_erf` calls libm's scalar `erf` per element on one thread (6.2 ms for one ViT-S
//! MLP at 1370 tokens); these run in parallel chunks at a fraction of that.
use rayon::prelude::*;

/// Defines a function whose body is compiled three times (AVX-512; AVX2 + FMA; the baseline) and
/// runs the widest form the CPU has, chosen at run time. The body is an `inline(always)` function
/// called from `target_feature` wrappers, so it is always compiled with their vector width (a
/// closure passed to such a wrapper may stay a separate baseline-SSE function: the softmax ran
/// 4-wide that way, 10 % of a DA-V2-Small forward). The body sees the const `$fused`: true where
/// the CPU has FMA, for [`madd`] (the baseline x86-64 form would call a software `fmaf`).
macro_rules! simd_fn {
    ($(#[$meta:meta])* $vis:vis fn $name:ident<$fused:ident>($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) -> $ret {
            #[inline(always)]
            fn body<const $fused: bool>($($arg: $ty),*) -> $ret $body
            #[cfg(target_arch = "x86_64")]
            {
                if std::arch::is_x86_feature_detected!("avx512f") {
                    /// # Safety
                    /// The CPU has the target features enabled for it.
                    #[target_feature(enable = "avx512f,avx2,fma")]
                    unsafe fn wide($($arg: $ty),*) -> $ret {
                        body::<true>($($arg),*)
                    }
                    // SAFETY: the feature was just detected (AVX-512F implies AVX2 and FMA).
                    return unsafe { wide($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                    /// # Safety
                    /// The CPU has the target features enabled for it.
                    #[target_feature(enable = "avx2,fma")]
                    unsafe fn wide($($arg: $ty),*) -> $ret {
                        body::<true>($($arg),*)
                    }
                    // SAFETY: the features were just detected.
                    return unsafe { wide($($arg),*) };
                }
            }
            // AArch64 always has FMA; other baselines may not.
            body::<{ cfg!(target_arch = "aarch64") }>($($arg),*)
        }
    };
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty $body:block) => {
        $crate::kernels::fast_math::simd_fn! { $(#[$meta])* $vis fn $name<_FUSED>($($arg: $ty),*) -> $ret $body }
    };
}
pub(crate) use simd_fn;

/// Elements per parallel chunk of an elementwise pass.
const CHUNK: usize = 1 << 14;

/// `a · b + c`, fused into one instruction when `FUSED` (inside a [`simd_fn`] body on a CPU with
/// FMA: Rust never contracts a multiply and an add by itself), else a multiply and an add.
#[inline(always)]
pub(crate) fn madd<const FUSED: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FUSED { a.mul_add(b, c) } else { a * b + c }
}

/// `eˣ` for `x ≤ 0` (Cephes' polynomial, relative error ~1e-7; results below 2⁻¹²⁶ flush to 0);
/// `FUSED` as for [`madd`].
#[inline(always)]
pub(crate) fn exp_nonpositive<const FUSED: bool>(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0; // 1.5 · 2²³: adding and subtracting it rounds to an integer
    let x = if x < -87.0 { -87.0 } else { x };
    let rounded = madd::<FUSED>(x, LOG2E, ROUND);
    // The integer n sits in the low mantissa bits of `rounded`: read it with integer ops (a float
    // to int cast saturates in Rust and keeps the loop from vectorising).
    let n_int = (rounded.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let n = rounded - ROUND;
    let r = madd::<FUSED>(-n, LN2_LO, madd::<FUSED>(-n, LN2_HI, x));
    // The degree-5 polynomial in Estrin's form (pairs of terms, then powers of r²): three
    // dependent steps after r² instead of Horner's five, so that more rows overlap in flight.
    let r2 = r * r;
    let lo = madd::<FUSED>(1.666_666_5e-1, r, 5e-1);
    let mid = madd::<FUSED>(8.333_452e-3, r, 4.166_579_6e-2);
    let hi = madd::<FUSED>(1.987_569_1e-4, r, 1.398_199_9e-3);
    let p = madd::<FUSED>(r2, madd::<FUSED>(r2, hi, mid), lo);
    let e = madd::<FUSED>(p, r2, r + 1.0);
    let pow2 = f32::from_bits(((n_int + 127) as u32) << 23);
    e * pow2
}

/// The logistic `1 / (1 + e⁻ᶻ)` for any `z`, from [`exp_nonpositive`] of `−|z|` (so nothing
/// overflows); `FUSED` as for [`madd`].
#[inline(always)]
pub fn sigmoid<const FUSED: bool>(z: f32) -> f32 {
    let e = exp_nonpositive::<FUSED>(-z.abs());
    let r = 1.0 / (1.0 + e);
    if z >= 0.0 { r } else { e * r }
}

/// `erf(x)` by Abramowitz & Stegun 7.1.26 (absolute error ≤ 1.5e-7), the formula PyTorch's own
/// vectorised CPU `erf` uses; `FUSED` as for [`madd`].
#[inline(always)]
pub fn erf<const FUSED: bool>(x: f32) -> f32 {
    const P: f32 = 0.327_591_1;
    const A1: f32 = 0.254_829_6;
    const A2: f32 = -0.284_496_74;
    const A3: f32 = 1.421_413_8;
    const A4: f32 = -1.453_152_1;
    const A5: f32 = 1.061_405_4;
    let a = x.abs();
    let t = 1.0 / madd::<FUSED>(P, a, 1.0);
    let poly = madd::<FUSED>(madd::<FUSED>(madd::<FUSED>(madd::<FUSED>(A5, t, A4), t, A3), t, A2), t, A1) * t;
    let y = madd::<FUSED>(-poly, exp_nonpositive::<FUSED>(-a * a), 1.0);
    if x < 0.0 { -y } else { y }
}

/// Exact GELU `x · Φ(x) = x · (1 + erf(x/√2)) / 2`; `FUSED` as for [`madd`].
#[inline(always)]
pub fn gelu_erf<const FUSED: bool>(x: f32) -> f32 {
    0.5 * x * (1.0 + erf::<FUSED>(x * std::f32::consts::FRAC_1_SQRT_2))
}

/// The derivative of [`gelu_erf`], `Φ(x) + x·φ(x)`, times `dy`: `dx[i] = dy[i] · gelu'(x[i])`, in
/// parallel chunks (the three of one length).
pub(crate) fn gelu_erf_grad_map(x: &[f32], dy: &[f32], dx: &mut [f32]) {
    dx.par_chunks_mut(CHUNK).zip(x.par_chunks(CHUNK).zip(dy.par_chunks(CHUNK))).for_each(|(d, (x, g))| gelu_erf_grad_into(x, g, d));
}

simd_fn! {
    /// [`gelu_erf_grad_map`] on this thread.
    fn gelu_erf_grad_into<FUSED>(x: &[f32], dy: &[f32], dx: &mut [f32]) -> () {
        const INV_SQRT_2PI: f32 = 0.398_942_3;
        for ((d, &x), &g) in dx.iter_mut().zip(x).zip(dy) {
            let cdf = 0.5 * (1.0 + erf::<FUSED>(x * std::f32::consts::FRAC_1_SQRT_2));
            let pdf = INV_SQRT_2PI * exp_nonpositive::<FUSED>(-0.5 * x * x);
            *d = g * madd::<FUSED>(x, pdf, cdf);
        }
    }
}

simd_fn! {
    /// `sum[j] += exp(row[j] − max[j])` for `row[j] ≤ max[j]`, on this thread.
    pub(crate) fn add_exp_shifted<FUSED>(row: &[f32], max: &[f32], sum: &mut [f32]) -> () {
        for ((s, &v), &m) in sum.iter_mut().zip(row).zip(max) {
            *s += exp_nonpositive::<FUSED>(v - m);
        }
    }
}

simd_fn! {
    /// `dst[j] = k · g1[j] − exp(x[j] − lse[j]) · both[j]` (the softmax part of the cross-entropy
    /// terms' input gradient; `x ≤ lse`), on this thread.
    pub(crate) fn softmax_mix_row<FUSED>(x: &[f32], lse: &[f32], both: &[f32], g1: &[f32], k: f32, dst: &mut [f32]) -> () {
        for ((((d, &v), &l), &b), &g) in dst.iter_mut().zip(x).zip(lse).zip(both).zip(g1) {
            *d = madd::<FUSED>(-exp_nonpositive::<FUSED>(v - l), b, k * g);
        }
    }
}

simd_fn! {
    /// `dst[j] = g[j] − exp(logp[j]) · total[j]` (a log-softmax's input gradient) for `logp[j] ≤ 0`,
    /// on this thread.
    pub(crate) fn log_softmax_grad_row<FUSED>(g: &[f32], logp: &[f32], total: &[f32], dst: &mut [f32]) -> () {
        for (((d, &gv), &lp), &t) in dst.iter_mut().zip(g).zip(logp).zip(total) {
            *d = madd::<FUSED>(-exp_nonpositive::<FUSED>(lp), t, gv);
        }
    }
}

/// `dst[i] = gelu_erf(src[i])`, in parallel chunks (`src` and `dst` of one length).
pub(crate) fn gelu_erf_map(src: &[f32], dst: &mut [f32]) {
    dst.par_chunks_mut(CHUNK).zip(src.par_chunks(CHUNK)).for_each(|(d, s)| gelu_erf_into(s, d));
}

simd_fn! {
    /// `dst[i] = gelu_erf(src[i])` on this thread.
    fn gelu_erf_into<FUSED>(src: &[f32], dst: &mut [f32]) -> () {
        dst.iter_mut().zip(src).for_each(|(d, &x)| *d = gelu_erf::<FUSED>(x))
    }
}

simd_fn! {
    /// Applies [`gelu_erf`] to every element of `data`, on this thread.
    pub(crate) fn gelu_erf_in_place<FUSED>(data: &mut [f32]) -> () {
        data.iter_mut().for_each(|x| *x = gelu_erf::<FUSED>(*x))
    }
}

simd_fn! {
    /// Replaces `row` by `exp((row − max) · scale)` and returns the sum (the softmax's numerator).
    pub fn softmax_numerator<FUSED>(row: &mut [f32], scale: f32) -> f32 {
        let shift = row_max(row) * scale;
        let mut acc = [0f32; 16];
        let mut chunks = row.chunks_exact_mut(16);
        for c in &mut chunks {
            for (x, a) in c.iter_mut().zip(acc.iter_mut()) {
                *x = exp_nonpositive::<FUSED>(madd::<FUSED>(*x, scale, -shift));
                *a += *x;
            }
        }
        let mut sum: f32 = acc.iter().sum();
        for x in chunks.into_remainder() {
            *x = exp_nonpositive::<FUSED>(madd::<FUSED>(*x, scale, -shift));
            sum += *x;
        }
        sum
    }
}

#[inline(always)]
fn row_max(row: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 16];
    let mut chunks = row.chunks_exact(16);
    for c in &mut chunks {
        for (x, a) in c.iter().zip(acc.iter_mut()) {
            *a = if *x > *a { *x } else { *a };
        }
    }
    let tail = chunks.remainder().iter().fold(f32::NEG_INFINITY, |a, &x| if x > a { x } else { a });
    acc.iter().fold(tail, |a, &x| if x > a { x } else { a })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_std_over_the_softmax_range() {
        let mut worst = 0f32;
        for i in 0..100_000 {
            let x = -87.0 * i as f32 / 100_000.0;
            for e in [exp_nonpositive::<false>(x), exp_nonpositive::<true>(x)] {
                worst = worst.max(((e - x.exp()) / x.exp()).abs());
            }
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(exp_nonpositive::<false>(0.0), 1.0);
        assert_eq!(exp_nonpositive::<true>(0.0), 1.0);
    }

    #[test]
    fn sigmoid_matches_the_f64_logistic_everywhere() {
        let mut worst = 0f64;
        for i in 0..200_001 {
            let z = (i as f32 - 100_000.0) * 1e-3;
            let want = 1.0 / (1.0 + (-(z as f64)).exp());
            for got in [sigmoid::<false>(z), sigmoid::<true>(z)] {
                // relative in f32's normal range; below it (z < −87) the exp's clamp gives ~1.6e-38
                worst = worst.max(((got as f64 - want).abs() - 2e-38).max(0.0) / want);
            }
        }
        assert!(worst < 1e-6, "worst relative error {worst}");
        assert_eq!(sigmoid::<false>(1e4), 1.0);
        assert!(sigmoid::<false>(-1e4) < 1e-37);
        assert!(sigmoid::<false>(f32::NAN).is_nan());
    }

    #[test]
    fn gelu_matches_the_libm_erf_formula() {
        let src: Vec<f32> = (0..200_001).map(|i| (i as f32 - 100_000.0) * 1e-4).collect();
        let want: Vec<f64> = src.iter().map(|&x| 0.5 * x as f64 * (1.0 + candle_core::cpu::erf::erf_f64(x as f64 / std::f64::consts::SQRT_2))).collect();
        let mut data = vec![0f32; src.len()];
        gelu_erf_map(&src, &mut data);
        let worst = data.iter().zip(&want).map(|(&g, &w)| (g as f64 - w).abs() / w.abs().max(1.0)).fold(0.0, f64::max);
        assert!(worst < 1e-6, "worst error {worst}");
        let mut big = [-30.0f32, 30.0, 0.0];
        gelu_erf_in_place(&mut big);
        assert_eq!(big, [0.0, 30.0, 0.0]);
    }

    #[test]
    fn softmax_numerator_is_exp_of_the_shifted_row() {
        let mut row: Vec<f32> = (0..37).map(|i| ((i * 7919) % 23) as f32 - 11.0).collect();
        let orig = row.clone();
        let sum = softmax_numerator(&mut row, 0.5);
        let max = orig.iter().cloned().fold(f32::MIN, f32::max);
        for (r, o) in row.iter().zip(&orig) {
            assert!((r - ((o - max) * 0.5).exp()).abs() < 1e-6);
        }
        assert!((sum - row.iter().sum::<f32>()).abs() < 1e-5);
    }
}
