//! libjpeg's "fancy" chroma upsampling (jdsample.c, libjpeg-turbo's default): triangular filters
//! with its exact rounding biases, for 2×1 (`h2v1_fancy_upsample`) and 2×2
//! (`h2v2_fancy_upsample`) subsampling; full-resolution components are copied.

/// One output row of a 2×1-subsampled row `row` (`dw` real samples) into `out` (2·dw samples).
pub(crate) fn h2v1(row: &[u8], out: &mut [u8]) {
    let dw = row.len();
    if dw == 1 {
        out[..2].fill(row[0]);
        return;
    }
    let s = |i: usize| row[i] as u32;
    out[0] = row[0];
    out[1] = ((s(0) * 3 + s(1) + 2) >> 2) as u8;
    for i in 1..dw - 1 {
        let v = s(i) * 3;
        out[2 * i] = ((v + s(i - 1) + 1) >> 2) as u8;
        out[2 * i + 1] = ((v + s(i + 1) + 2) >> 2) as u8;
    }
    let last = dw - 1;
    out[2 * last] = ((s(last) * 3 + s(last - 1) + 1) >> 2) as u8;
    out[2 * last + 1] = row[last];
}

/// One output row of a 2×2-subsampled component: `near` is the chroma row it lies in, `far` the
/// next nearest (above for the upper output row, below for the lower); `dw` real samples each.
pub(crate) fn h2v2(near: &[u8], far: &[u8], out: &mut [u8]) {
    let dw = near.len();
    let col = |i: usize| near[i] as u32 * 3 + far[i] as u32;
    if dw == 1 {
        out[..2].fill(((col(0) * 4 + 8) >> 4) as u8);
        return;
    }
    let (mut last, mut this) = (col(0), col(0));
    for i in 0..dw {
        let next = if i + 1 < dw { col(i + 1) } else { this };
        out[2 * i] = if i == 0 { ((this * 4 + 8) >> 4) as u8 } else { ((this * 3 + last + 8) >> 4) as u8 };
        out[2 * i + 1] = if i + 1 == dw { ((this * 4 + 7) >> 4) as u8 } else { ((this * 3 + next + 7) >> 4) as u8 };
        last = this;
        this = next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flat_rows_stay_flat_and_edges_follow_libjpeg() {
        let mut out = [0u8; 6];
        h2v2(&[100, 100, 100], &[100, 100, 100], &mut out);
        assert_eq!(out, [100; 6]);
        h2v1(&[0, 40, 80], &mut out);
        // first copied; 3/4·near + 1/4·far with biases 1 and 2; last copied.
        assert_eq!(out, [0, 10, 30, 50, 70, 80]);
        h2v2(&[0, 16], &[0, 16], &mut out[..4]);
        // colsums 0 and 64: (0·4+8)>>4, (0·3+64+7)>>4, (64·3+0+8)>>4, (64·4+7)>>4.
        assert_eq!(&out[..4], &[0, 4, 12, 16]);
    }
}
