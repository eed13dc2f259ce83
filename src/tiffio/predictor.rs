//! TIFF predictor 2 (horizontal differencing): each sample after a row's first pixel is stored as
//! its difference from the same sample of the pixel to its left, modulo 2^bits.

/// Undoes horizontal differencing in place on rows of `stride` samples, `spp` samples per pixel.
pub(crate) fn undo_horizontal(samples: &mut [u16], stride: usize, spp: usize, bits: u8) {
    let mask = if bits == 16 { u16::MAX } else { (1u16 << bits) - 1 };
    for row in samples.chunks_exact_mut(stride) {
        for i in spp..row.len() {
            row[i] = row[i].wrapping_add(row[i - spp]) & mask;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_differences_per_sample_with_wraparound() {
        // Two RGB pixels per row, 8-bit: 250 + 10 wraps to 4.
        let mut s = vec![250, 1, 2, 10, 1, 1, 0, 0, 0, 5, 5, 5];
        undo_horizontal(&mut s, 6, 3, 8);
        assert_eq!(s, vec![250, 1, 2, 4, 2, 3, 0, 0, 0, 5, 5, 5]);
        let mut w = vec![65535, 2];
        undo_horizontal(&mut w, 2, 1, 16);
        assert_eq!(w, vec![65535, 1]);
    }
}
