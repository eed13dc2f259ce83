//! Scaled dot-product attention with int8 products on AMX, for the ViT blocks of Q8_0 models (whose
//! projections already round their activations to 8 bits). Per head, keys are rounded to int8 with
//! one scale per key and values with one scale per channel, packed once into AMX tiles; per block of
//! 32 query rows, queries are rounded with one scale per row, `q kᵀ` is summed in int32 by
//! `tdpbssd`, scaled into f32, and the softmax's numerators `exp(s − max)` (≤ 1) are rounded to
//! bytes `round(255 e)` that `tdpbusd` multiplies by the values, normalised by their integer sum.
//! The score block stays in L2 as in [`super::fused_attention`], whose layout checks it shares.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code, unused_imports))]
use candle_core::Tensor;
use rayon::prelude::*;

use super::fused_attention::{dims, view, HeadsView};
use crate::error::{Error, Result};

/// Query rows per task: two 16-row tiles.
const ROWS: usize = 32;
/// Keys per tile of `q kᵀ`, values per tile row group (and the depth of a tile step, in bytes).
const KEYS: usize = 16;
const DEPTH: usize = 64;
/// Head widths are a multiple of this; a width that is not a multiple of [`DEPTH`] is padded with
/// zeros to one in the packed queries, keys and values (SegFormer's 32-wide heads).
const WIDTH_STEP: usize = 32;

/// The most terms an int32 sum here holds without overflow: `Σ p v` over the keys adds bytes ≤ 255
/// times values ≤ 128 in magnitude (`q kᵀ` over the head width adds smaller products).
const MAX_KEYS: usize = (i32::MAX as usize) / (255 * 128);

/// Whether [`attention`] runs `q`, `k`, `v` here: f32 CPU tensors as [`super::fused_attention`]
/// takes, a head width that is a multiple of 32, at most [`MAX_KEYS`] keys and channels, and AMX.
pub fn applies(q: &Tensor, k: &Tensor, v: &Tensor) -> bool {
    super::fused_attention::applies(q, k, v)
        && q.dim(3).is_ok_and(|d| d > 0 && d % WIDTH_STEP == 0 && d <= MAX_KEYS)
        && k.dim(2).is_ok_and(|n| n <= MAX_KEYS)
        && super::amx::available()
}

/// `softmax(q kᵀ · scale) v` with int8 products, for `q` `[B, H, Nq, D]`, `k`, `v` `[B, H, Nk, D]`
/// (any strides with the last dimension contiguous), returned contiguous `[B, H, Nq, D]`. An error
/// where [`applies`] does not hold.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32) -> Result<Tensor> {
    if !applies(q, k, v) {
        return Err(Error::Input("int8 attention: needs f32 CPU tensors, a head width that is a multiple of 32 and AMX".into()));
    }
    let (b, h, nq, nk, d) = dims(q, k, v)?;
    let (qs, ql) = q.storage_and_layout();
    let (ks, kl) = k.storage_and_layout();
    let (vs, vl) = v.storage_and_layout();
    let (qv, kv, vv) = (view(&qs, ql)?, view(&ks, kl)?, view(&vs, vl)?);
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
    let mut out = vec![0f32; b * h * nq * d];
    #[cfg(target_arch = "x86_64")]
    if nq > 0 {
        out.par_chunks_mut(nq * d).enumerate().for_each(|(bh, head_out)| {
            let (bi, hi) = (bh / h, bh % h);
            // SAFETY: `applies` checked AMX, which comes with AVX-512F and BW.
            let (keys, values) = unsafe { (Keys::pack(&kv, (bi, hi), nk, d), Values::pack(&vv, (bi, hi), nk, d)) };
            head_out.par_chunks_mut(ROWS * d).enumerate().for_each(|(block, o)| {
                let q_rows = |r: usize| &qv.rows_from(bi, hi, block * ROWS + r)[..d];
                // SAFETY: as above.
                unsafe { attend_block(q_rows, o.len() / d, d, &keys, &values, scale, o) };
            });
        });
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (qv, kv, vv, nk, scale);
    drop((qs, ks, vs));
    Ok(Tensor::from_vec(out, (b, h, nq, d), q.device())?)
}

/// One head's keys rounded per key and packed as `q kᵀ`'s right-hand tiles.
struct Keys {
    /// `[key tile][depth step][16 rows of 4 bytes × 16 keys]`, keys padded with zeros to 32.
    tiles: Vec<i8>,
    /// Each key's scale (padding keys: 0).
    scale: Vec<f32>,
    /// Keys in all (unpadded).
    n: usize,
}

#[cfg(target_arch = "x86_64")]
impl Keys {
    /// Rounds and packs keys `0 .. n` (width `d`, a multiple of 32, padded with zeros to a
    /// multiple of 64) of head `h` of item `b`.
    ///
    /// # Safety
    /// AVX-512F runs here.
    unsafe fn pack(k: &HeadsView, (b, h): (usize, usize), n: usize, d: usize) -> Keys {
        let padded = n.next_multiple_of(2 * KEYS);
        let width = d.next_multiple_of(DEPTH);
        let steps = width / DEPTH;
        let mut tiles = vec![0i8; padded * width];
        let mut scale = vec![0f32; padded];
        let mut row = vec![0i8; width];
        for (j, s) in scale.iter_mut().enumerate().take(n) {
            // SAFETY: AVX-512F runs here (this function's contract); both slices are `d` long, a multiple of 16.
            *s = unsafe { simd::round_row(&k.rows_from(b, h, j)[..d], &mut row[..d]) };
            // Each 4 bytes of the key go whole to their tile row (64 bytes apart).
            let (tile, col) = (j / KEYS, j % KEYS);
            for (quad, x) in row.chunks_exact(4).enumerate() {
                let (step, r) = (quad / (DEPTH / 4), quad % (DEPTH / 4));
                tiles[(tile * steps + step) * 1024 + r * 64 + col * 4..][..4].copy_from_slice(x);
            }
        }
        Keys { tiles, scale, n }
    }
}

/// One head's values rounded per channel and packed as `p v`'s right-hand tiles.
struct Values {
    /// `[64-key step][16-channel group][16 rows of 4 keys × 16 channels]`, keys and channels
    /// padded with zeros (channels to a multiple of 64).
    tiles: Vec<i8>,
    /// Each channel's scale (padding channels: 0).
    scale: Vec<f32>,
}

#[cfg(target_arch = "x86_64")]
impl Values {
    /// Rounds and packs values `0 .. n` (width `d`, a multiple of 32, padded with zeros to a
    /// multiple of 64) of head `h` of item `b`.
    ///
    /// # Safety
    /// AVX-512F runs here.
    unsafe fn pack(v: &HeadsView, (b, h): (usize, usize), n: usize, d: usize) -> Values {
        let padded = n.next_multiple_of(DEPTH);
        let width = d.next_multiple_of(DEPTH);
        let groups = width / 16;
        let mut max = vec![0f32; width];
        for j in 0..n {
            for (m, x) in max.iter_mut().zip(&v.rows_from(b, h, j)[..d]) {
                if x.abs() > *m || x.is_nan() {
                    *m = x.abs();
                }
            }
        }
        let inv: Vec<f32> = max.iter().map(|&m| if m > 0.0 { 127.0 / m } else { 0.0 }).collect();
        let mut tiles = vec![0i8; padded * width];
        // Four keys at a time: their bytes interleave into each 16-channel group's tile row.
        let mut quad = vec![0i8; 4 * width];
        for j0 in (0..n).step_by(4) {
            quad.fill(0);
            for (t, dst) in quad.chunks_exact_mut(width).enumerate().take(n - j0) {
                // SAFETY: AVX-512F runs here (this function's contract); the three slices are `d` long, a multiple of 16.
                unsafe { simd::round_by(&v.rows_from(b, h, j0 + t)[..d], &inv[..d], &mut dst[..d]) };
            }
            let (step, r) = (j0 / DEPTH, (j0 % DEPTH) / 4);
            for g in 0..groups {
                let dst = &mut tiles[(step * groups + g) * 1024 + r * 64..][..64];
                for (c, lane) in dst.chunks_exact_mut(4).enumerate() {
                    for (t, x) in lane.iter_mut().enumerate() {
                        *x = quad[t * width + g * 16 + c];
                    }
                }
            }
        }
        let scale = max.iter().map(|&m| if m.is_finite() { m / 127.0 } else { f32::NAN }).collect();
        Values { tiles, scale }
    }
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// Each worker's score block (int32 sums, then f32 scores in place).
    static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// Each worker's rounded probabilities.
    static PROBS: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Query rows `q_rows(0 .. rows)` (`rows` ≤ 32, `d` wide) of one head against its packed keys
/// and values, into `out` (`rows × d`).
///
/// # Safety
/// AMX and AVX-512BW run here ([`super::amx::available`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn attend_block<'a>(q_rows: impl Fn(usize) -> &'a [f32], rows: usize, d: usize, keys: &Keys, values: &Values, scale: f32, out: &mut [f32]) {
    use super::amx;
    use super::cpu_slice::with_scratch;
    // The packed width: `d` padded with zeros to whole depth steps.
    let width = values.scale.len();
    let (nk, padded_keys) = (keys.n, keys.scale.len());
    let padded_probs = nk.next_multiple_of(DEPTH);
    let mut q8 = vec![0i8; ROWS * width];
    let mut q_scale = [0f32; ROWS];
    for r in 0..rows {
        q_scale[r] = simd::round_row(&q_rows(r)[..d], &mut q8[r * width..][..d]) * scale;
    }
    with_scratch(&SCORES, |scores| {
        with_scratch(&PROBS, |probs| {
            scores.resize(ROWS * padded_keys, 0.0);
            probs.resize(ROWS * padded_probs, 0);
            let sums = scores.as_mut_ptr().cast::<i32>();
            // SAFETY: the tiles are configured for this block only; `q8` holds 32 rows of `width`
            // bytes, the key tiles `padded_keys / 16` tiles of width/64 steps, the score block 32
            // rows of `padded_keys` int32 sums, each call two tiles (32 columns) of them.
            {
                // SAFETY: as above; the guard releases the tiles at the end of the block.
                let _tiles = unsafe { amx::Tiles::configure() };
                let steps = width / DEPTH;
                for pair in 0..padded_keys / (2 * KEYS) {
                    let b0 = keys.tiles.as_ptr().add(2 * pair * steps * 1024);
                    // SAFETY: as above: `b0` starts a pair of key tiles, the sums their 32 columns.
                    unsafe { amx::dot_s8_32x32(q8.as_ptr(), width, b0, b0.add(steps * 1024), steps, sums.add(pair * 2 * KEYS), padded_keys * 4) };
                }
                let mut prob_sums = [0u32; ROWS];
                for r in 0..rows {
                    // The row's int32 sums become its f32 scores in place.
                    let row = sums.add(r * padded_keys);
                    let max = simd::scale_sums(row, &keys.scale[..nk], q_scale[r]);
                    let row = std::slice::from_raw_parts(row.cast::<f32>().cast_const(), nk);
                    let p = &mut probs[r * padded_probs..][..padded_probs];
                    let sum = simd::round_numerators(row, max, &mut p[..nk]);
                    p[nk..].fill(0);
                    prob_sums[r] = if max.is_finite() { sum } else { 0 };
                }
                let mut acc = [0i32; 16 * 64];
                let (steps, groups) = (padded_probs / DEPTH, width / 16);
                for half in 0..rows.div_ceil(16) {
                    for quad in 0..groups / 4 {
                        // SAFETY: 16 rows of `padded_probs` bytes from row 16·half (the block has 32
                        // rows); the value tiles of `steps` steps of `groups` 1 KiB tiles each.
                        unsafe {
                            amx::dot_u8s8_16x64(probs.as_ptr().add(half * 16 * padded_probs), padded_probs, values.tiles.as_ptr().add(quad * 4 * 1024), groups * 1024, steps, acc.as_mut_ptr());
                        }
                        for i in 0..16.min(rows - half * 16) {
                            let r = half * 16 + i;
                            let inv = if prob_sums[r] > 0 { 1.0 / prob_sums[r] as f32 } else { f32::NAN };
                            // The packed width's padding channels (zeros) are not stored.
                            let dst = &mut out[r * d + quad * 64..][..64.min(d - quad * 64)];
                            for ((o, a), s) in dst.iter_mut().zip(&acc[i * 64..][..64]).zip(&values.scale[quad * 64..]) {
                                *o = *a as f32 * s * inv;
                            }
                        }
                    }
                }
            }
        })
    });
}

/// The element-wise passes of [`attend_block`] in AVX-512 (LLVM left their rounding and
/// saturating casts scalar).
#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    /// The mask of the first `n` (< 16) lanes.
    fn first(n: usize) -> __mmask16 {
        ((1u32 << n) - 1) as __mmask16
    }

    /// Rounds `x` (a multiple of 16 values) to bytes `round(x / s)` with `s = max|x| / 127` and
    /// returns `s` (NaN where `x` holds a non-finite value, 0 for a zero row).
    ///
    /// # Safety
    /// AVX-512F runs here; `dst` is as long as `x`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn round_row(x: &[f32], dst: &mut [i8]) -> f32 {
        let (mut max, mut bad) = (_mm512_setzero_ps(), 0 as __mmask16);
        for c in x.chunks_exact(16) {
            let v = _mm512_loadu_ps(c.as_ptr());
            bad |= _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
            max = _mm512_max_ps(max, _mm512_abs_ps(v));
        }
        let max = _mm512_reduce_max_ps(max);
        let inv = _mm512_set1_ps(if max > 0.0 { 127.0 / max } else { 0.0 });
        for (c, d) in x.chunks_exact(16).zip(dst.chunks_exact_mut(16)) {
            let q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(c.as_ptr()), inv));
            _mm_storeu_si128(d.as_mut_ptr().cast(), _mm512_cvtsepi32_epi8(q));
        }
        if bad != 0 || !max.is_finite() { f32::NAN } else { max / 127.0 }
    }

    /// Rounds `x · inv` (a multiple of 16 values) to bytes, value by value.
    ///
    /// # Safety
    /// AVX-512F runs here; `inv` and `dst` are as long as `x`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn round_by(x: &[f32], inv: &[f32], dst: &mut [i8]) {
        for ((c, s), d) in x.chunks_exact(16).zip(inv.chunks_exact(16)).zip(dst.chunks_exact_mut(16)) {
            let q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(c.as_ptr()), _mm512_loadu_ps(s.as_ptr())));
            _mm_storeu_si128(d.as_mut_ptr().cast(), _mm512_cvtsepi32_epi8(q));
        }
    }

    /// Turns a row's int32 sums at `row` into f32 scores in place, `sum_j · key_scale_j · q_scale`,
    /// and returns their maximum (NaN where a score is not a number).
    ///
    /// # Safety
    /// AVX-512F runs here; `row` holds `key_scale.len()` int32 values.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn scale_sums(row: *mut i32, key_scale: &[f32], q_scale: f32) -> f32 {
        let qs = _mm512_set1_ps(q_scale);
        let (mut max, mut bad) = (_mm512_set1_ps(f32::NEG_INFINITY), 0 as __mmask16);
        let n = key_scale.len();
        for j in (0..n).step_by(16) {
            let m = if n - j >= 16 { !0 } else { first(n - j) };
            let sums = _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(m, row.add(j)));
            let s = _mm512_mul_ps(sums, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, key_scale.as_ptr().add(j)), qs));
            _mm512_mask_storeu_ps(row.add(j).cast(), m, s);
            bad |= _mm512_mask_cmp_ps_mask::<_CMP_UNORD_Q>(m, s, s);
            max = _mm512_mask_max_ps(max, m, max, s);
        }
        if bad != 0 { f32::NAN } else { _mm512_reduce_max_ps(max) }
    }

    /// Rounds the softmax's numerators `exp(s − max)` (in `[0, 1]`) of scores `s` to bytes
    /// `round(255 e)` and returns their sum.
    ///
    /// # Safety
    /// AVX-512F runs here; `dst` is as long as `s`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn round_numerators(s: &[f32], max: f32, dst: &mut [u8]) -> u32 {
        let (shift, scale) = (_mm512_set1_ps(max), _mm512_set1_ps(255.0));
        let mut sum = _mm512_setzero_si512();
        let n = s.len();
        for j in (0..n).step_by(16) {
            let m = if n - j >= 16 { !0 } else { first(n - j) };
            let e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s.as_ptr().add(j)), shift));
            let q = _mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(e, scale)), _mm512_setzero_si512());
            let q = _mm512_maskz_mov_epi32(m, q);
            sum = _mm512_add_epi32(sum, q);
            _mm512_mask_cvtusepi32_storeu_epi8(dst.as_mut_ptr().add(j).cast(), m, q);
        }
        _mm512_reduce_add_epi32(sum) as u32
    }

    /// `eˣ` for `x ≤ 0`, lane by lane: [`crate::kernels::fast_math::exp_nonpositive`]'s reduction and
    /// polynomial, the power of two applied by `vscalefps`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn exp_nonpositive(x: __m512) -> __m512 {
        let x = _mm512_max_ps(x, _mm512_set1_ps(-87.0));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)));
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
        let r2 = _mm512_mul_ps(r, r);
        let lo = _mm512_fmadd_ps(_mm512_set1_ps(1.666_666_5e-1), r, _mm512_set1_ps(5e-1));
        let mid = _mm512_fmadd_ps(_mm512_set1_ps(8.333_452e-3), r, _mm512_set1_ps(4.166_579_6e-2));
        let hi = _mm512_fmadd_ps(_mm512_set1_ps(1.987_569_1e-4), r, _mm512_set1_ps(1.398_199_9e-3));
        let p = _mm512_fmadd_ps(r2, _mm512_fmadd_ps(r2, hi, mid), lo);
        let e = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0)));
        _mm512_scalef_ps(e, n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn tracks_the_f32_attention_within_8_bit_rounding() {
        if !crate::kernels::amx::available() {
            eprintln!("no AMX here: the int8 attention does not run");
            return;
        }
        let dev = Device::Cpu;
        // 75 queries: two full blocks and a partial one; 70 keys: not a multiple of 16 or 64;
        // width 128: two depth steps; widths 32 and 96: padded to whole depth steps.
        for (b, h, nq, nk, d) in [(2, 3, 75, 70, 64), (1, 2, 40, 130, 128), (1, 3, 70, 90, 32), (2, 1, 33, 45, 96)] {
            // Fixed inputs: the error depends on the draw (1.1 % to 2.7 % of max |f32| over random
            // draws), and a test must not pass or fail by chance.
            let q = crate::kernels::test_values::spread((b, h, nq, d), 1, &dev);
            let k = crate::kernels::test_values::spread((b, h, nk, d), 2, &dev);
            let v = crate::kernels::test_values::spread((b, h, nk, d), 3, &dev);
            let scale = 1.0 / (d as f32).sqrt();
            let want = crate::kernels::fused_attention::attention(&q, &k, &v, scale).unwrap();
            let got = attention(&q, &k, &v, scale).unwrap();
            let err = (&got - &want).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
            let max = want.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
            eprintln!("{b}×{h}×{nq}×{nk}×{d}: max abs error {err} (max |f32| {max})");
            assert!(err < 0.03 * max && err > 0.0, "{b}×{h}×{nq}×{nk}×{d}: max abs error {err} (max |f32| {max})");
        }
    }

    #[test]
    fn strided_heads_and_bad_shapes() {
        if !crate::kernels::amx::available() {
            return;
        }
        let dev = Device::Cpu;
        let (b, h, n, d) = (1, 2, 50, 64);
        let qkv = Tensor::randn(0f32, 1.0, (b, n, 3 * h * d), &dev).unwrap();
        let split = |i: usize| qkv.narrow(2, i * h * d, h * d).unwrap().reshape((b, n, h, d)).unwrap().transpose(1, 2).unwrap();
        let (q, k, v) = (split(0), split(1), split(2));
        let want = attention(&q.contiguous().unwrap(), &k.contiguous().unwrap(), &v.contiguous().unwrap(), 0.125).unwrap();
        let got = attention(&q, &k, &v, 0.125).unwrap();
        assert_eq!(got.flatten_all().unwrap().to_vec1::<f32>().unwrap(), want.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        // A non-finite query stays non-finite in its own output row only.
        let mut qs = q.contiguous().unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        qs[5 * d] = f32::NAN;
        let bad = attention(&Tensor::from_vec(qs, (b, h, n, d), &dev).unwrap(), &k, &v, 0.125).unwrap();
        let rows = bad.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(rows.chunks(d).enumerate().all(|(r, row)| row.iter().all(|x| x.is_nan()) == (r == 5) && (r == 5 || row.iter().all(|x| x.is_finite()))));
        let narrow = Tensor::zeros((1, 2, 4, 48), candle_core::DType::F32, &dev).unwrap();
        assert!(attention(&narrow, &narrow, &narrow, 1.0).is_err());
        let other = Tensor::zeros((1, 2, 5, 128), candle_core::DType::F32, &dev).unwrap();
        assert!(attention(&q, &other, &other, 1.0).is_err());
        // More keys than int32 sums hold: the f32 attention's (a broadcast view, no memory).
        let many = Tensor::zeros((1, 1, 1, 64), candle_core::DType::F32, &dev).unwrap().broadcast_as((1, 1, MAX_KEYS + 1, 64)).unwrap();
        assert!(!applies(&Tensor::zeros((1, 1, 1, 64), candle_core::DType::F32, &dev).unwrap(), &many, &many));
    }
}
