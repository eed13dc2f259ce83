//! YCbCr → RGB exactly as libjpeg's `ycc_rgb_convert` (jdcolor.c) computes it: 16-bit fixed-point
//! coefficients, the red and blue terms rounded, the green term's two products summed before one
//! rounding shift, and the result clamped to 0..=255.

/// `FIX(x)` of libjpeg: `x · 2^16`, rounded.
const R_CR: i32 = 91_881; // FIX(1.40200)
const B_CB: i32 = 116_130; // FIX(1.77200)
const G_CR: i32 = 46_802; // FIX(0.71414)
const G_CB: i32 = 22_554; // FIX(0.34414)
const HALF: i32 = 1 << 15;

/// One pixel.
fn pixel(y: u8, cb: u8, cr: u8) -> [u8; 3] {
    let (y, cb, cr) = (y as i32, cb as i32 - 128, cr as i32 - 128);
    let r = y + ((R_CR * cr + HALF) >> 16);
    let g = y + ((-G_CB * cb + HALF - G_CR * cr) >> 16);
    let b = y + ((B_CB * cb + HALF) >> 16);
    [r.clamp(0, 255) as u8, g.clamp(0, 255) as u8, b.clamp(0, 255) as u8]
}

/// Converts interleaved `Y Cb Cr` triples to `R G B` in place.
pub(crate) fn to_rgb(buf: &mut [u8]) {
    for p in buf.chunks_exact_mut(3) {
        p.copy_from_slice(&pixel(p[0], p[1], p[2]));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_libjpeg_on_known_values() {
        // Values computed with libjpeg-turbo's tables (jdcolor.c, SCALEBITS 16).
        assert_eq!(pixel(128, 128, 128), [128, 128, 128]);
        assert_eq!(pixel(76, 85, 255), [254, 0, 0]);
        assert_eq!(pixel(0, 0, 0), [0, 135, 0]);
        assert_eq!(pixel(255, 255, 255), [255, 121, 255]);
    }
}
