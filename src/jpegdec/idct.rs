//! The inverse DCT of libjpeg's `jpeg_idct_islow` (jidctint.c: the accurate integer method, 13-bit
//! constants, two passes), so that pixels equal libjpeg's, GDAL's and imagecodecs'. Results are
//! clamped to 0..=255 as libjpeg-turbo's SIMD versions do.
const CONST_BITS: u32 = 13;
const PASS1_BITS: u32 = 2;
const F_0_298: i64 = 2446;
const F_0_390: i64 = 3196;
const F_0_541: i64 = 4433;
const F_0_765: i64 = 6270;
const F_0_899: i64 = 7373;
const F_1_175: i64 = 9633;
const F_1_501: i64 = 12299;
const F_1_847: i64 = 15137;
const F_1_961: i64 = 16069;
const F_2_053: i64 = 16819;
const F_2_562: i64 = 20995;
const F_3_072: i64 = 25172;

/// `(x + 2^(n−1)) >> n`.
fn descale(x: i64, n: u32) -> i64 {
    (x + (1 << (n - 1))) >> n
}

/// One 8-point pass over `v` (stride `s` from `base`), the even and odd parts of jidctint.c;
/// returns the eight outputs before descaling.
fn pass(v: [i64; 8], shift_dc: u32) -> [i64; 8] {
    let (z2, z3) = (v[2], v[6]);
    let z1 = (z2 + z3) * F_0_541;
    let tmp2 = z1 - z3 * F_1_847;
    let tmp3 = z1 + z2 * F_0_765;
    let tmp0 = (v[0] + v[4]) << shift_dc;
    let tmp1 = (v[0] - v[4]) << shift_dc;
    let (t10, t13, t11, t12) = (tmp0 + tmp3, tmp0 - tmp3, tmp1 + tmp2, tmp1 - tmp2);
    let (mut o0, mut o1, mut o2, mut o3) = (v[7], v[5], v[3], v[1]);
    let (z1, z2, z3, z4) = (o0 + o3, o1 + o2, o0 + o2, o1 + o3);
    let z5 = (z3 + z4) * F_1_175;
    o0 *= F_0_298;
    o1 *= F_2_053;
    o2 *= F_3_072;
    o3 *= F_1_501;
    let (z1, z2) = (-z1 * F_0_899, -z2 * F_2_562);
    let (z3, z4) = (-z3 * F_1_961 + z5, -z4 * F_0_390 + z5);
    o0 += z1 + z3;
    o1 += z2 + z4;
    o2 += z2 + z3;
    o3 += z1 + z4;
    [t10 + o3, t11 + o2, t12 + o1, t13 + o0, t13 - o0, t12 - o1, t11 - o2, t10 - o3]
}

/// The 8×8 samples of dequantised coefficients `c` (natural order) into `out` (row stride
/// `stride`).
pub(crate) fn idct(c: &[i64; 64], out: &mut [u8], stride: usize) {
    let mut ws = [0i64; 64];
    for x in 0..8 {
        let col = std::array::from_fn(|k| c[k * 8 + x]);
        for (y, v) in pass(col, CONST_BITS).into_iter().enumerate() {
            ws[y * 8 + x] = descale(v, CONST_BITS - PASS1_BITS);
        }
    }
    for y in 0..8 {
        let row: [i64; 8] = std::array::from_fn(|k| ws[y * 8 + k]);
        for (x, v) in pass(row, CONST_BITS).into_iter().enumerate() {
            out[y * stride + x] = (descale(v, CONST_BITS + PASS1_BITS + 3) + 128).clamp(0, 255) as u8;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dc_only_block_is_flat() {
        // DC 80 (dequantised): 80 / 8 = 10 above mid-grey.
        let mut c = [0i64; 64];
        c[0] = 80;
        let mut out = [0u8; 64];
        idct(&c, &mut out, 8);
        assert!(out.iter().all(|&v| v == 138), "{out:?}");
    }
}
