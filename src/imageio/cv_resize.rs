//! OpenCV-compatible `cv2.resize` of 8-bit RGB images for `INTER_CUBIC` and `INTER_AREA`, the
//! resampling the Depth Anything 3 input processor uses (cubic when enlarging, area when shrinking).
//!
//! * Area (shrinking only) follows OpenCV's `resizeArea` exactly: integer factors average whole cells
//!   (2×2 as `(sum + 2) >> 2`, others `round(sum / area)`); other factors accumulate fractional cell
//!   weights in f32 row by row and round half to even. This matches `cv2` 5.0 bit for bit.
//! * Cubic is separable Keys cubic (a = −0.75), `src = (dst + 0.5)·scale − 0.5`, borders replicated,
//!   no antialiasing, with the horizontal pass kept unrounded (f64) and one final rounding. It agrees
//!   with `cv2` 5.0 except for values within ~1e-5 of a rounding tie (about 1 in 10⁵ values, ±1 level).
use image::RgbImage;

use crate::error::{Error, Result};

/// The interpolation, as OpenCV names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CvInterp {
    /// `cv2.INTER_CUBIC`.
    Cubic,
    /// `cv2.INTER_AREA` (only for shrinking, in both directions).
    Area,
}

/// `cv2.resize(img, (out_w, out_h), interpolation)`.
pub(crate) fn cv_resize(img: &RgbImage, out_w: u32, out_h: u32, interp: CvInterp) -> Result<RgbImage> {
    let (w, h) = img.dimensions();
    if out_w == 0 || out_h == 0 || w == 0 || h == 0 {
        return Err(Error::Input(format!("cannot resize {w}×{h} to {out_w}×{out_h}")));
    }
    if (w, h) == (out_w, out_h) {
        return Ok(img.clone());
    }
    match interp {
        CvInterp::Cubic => Ok(cubic(img, out_w as usize, out_h as usize)),
        CvInterp::Area if out_w <= w && out_h <= h => Ok(area(img, out_w as usize, out_h as usize)),
        CvInterp::Area => Err(Error::Input(format!("area resize only shrinks ({w}×{h} → {out_w}×{out_h})"))),
    }
}

fn cubic_weights(t: f64) -> [f64; 4] {
    const A: f64 = -0.75;
    let c0 = ((A * (t + 1.0) - 5.0 * A) * (t + 1.0) + 8.0 * A) * (t + 1.0) - 4.0 * A;
    let c1 = ((A + 2.0) * t - (A + 3.0)) * t * t + 1.0;
    let c2 = ((A + 2.0) * (1.0 - t) - (A + 3.0)) * (1.0 - t) * (1.0 - t) + 1.0;
    [c0, c1, c2, 1.0 - c0 - c1 - c2]
}

/// Source taps (clamped) and weights per output index.
fn cubic_taps(n_in: usize, n_out: usize) -> Vec<([usize; 4], [f64; 4])> {
    let scale = 1.0 / (n_out as f64 / n_in as f64);
    (0..n_out)
        .map(|d| {
            let f = (d as f64 + 0.5) * scale - 0.5;
            let s = f.floor();
            let idx = [0i64, 1, 2, 3].map(|k| (s as i64 - 1 + k).clamp(0, n_in as i64 - 1) as usize);
            (idx, cubic_weights(f - s))
        })
        .collect()
}

fn cubic(img: &RgbImage, ow: usize, oh: usize) -> RgbImage {
    let (w, h) = (img.width() as usize, img.height() as usize);
    let src = img.as_raw();
    let tx = cubic_taps(w, ow);
    let ty = cubic_taps(h, oh);
    let mut rows = vec![0f64; h * ow * 3];
    for y in 0..h {
        let row = &src[y * w * 3..(y + 1) * w * 3];
        for (x, (idx, wt)) in tx.iter().enumerate() {
            for c in 0..3 {
                rows[(y * ow + x) * 3 + c] = (0..4).map(|k| row[idx[k] * 3 + c] as f64 * wt[k]).sum();
            }
        }
    }
    let mut out = vec![0u8; oh * ow * 3];
    let stride = ow * 3;
    for (y, (idx, wt)) in ty.iter().enumerate() {
        for i in 0..stride {
            let v: f64 = (0..4).map(|k| rows[idx[k] * stride + i] * wt[k]).sum();
            out[y * stride + i] = round_u8(v);
        }
    }
    RgbImage::from_raw(ow as u32, oh as u32, out).unwrap_or_default()
}

/// `saturate_cast<uchar>`: round half to even, clamp.
fn round_u8(v: f64) -> u8 {
    v.round_ties_even().clamp(0.0, 255.0) as u8
}

/// One entry of OpenCV's `computeResizeAreaTab`: destination index, source index, weight.
fn area_tab(n_in: usize, n_out: usize, scale: f64) -> Vec<(usize, usize, f32)> {
    let mut tab = Vec::with_capacity(n_in * 2);
    for d in 0..n_out {
        let f1 = d as f64 * scale;
        let f2 = f1 + scale;
        let cell = scale.min(n_in as f64 - f1);
        let s2 = (f2.floor() as i64).min(n_in as i64 - 1);
        let s1 = (f1.ceil() as i64).min(s2);
        if s1 as f64 - f1 > 1e-3 {
            tab.push((d, (s1 - 1) as usize, ((s1 as f64 - f1) / cell) as f32));
        }
        for s in s1..s2 {
            tab.push((d, s as usize, (1.0 / cell) as f32));
        }
        if f2 - s2 as f64 > 1e-3 {
            tab.push((d, s2 as usize, ((f2 - s2 as f64).min(1.0).min(cell) / cell) as f32));
        }
    }
    tab
}

fn area(img: &RgbImage, ow: usize, oh: usize) -> RgbImage {
    let (w, h) = (img.width() as usize, img.height() as usize);
    let src = img.as_raw();
    let (sx, sy) = (1.0 / (ow as f64 / w as f64), 1.0 / (oh as f64 / h as f64));
    let (ix, iy) = (sx.round_ties_even(), sy.round_ties_even());
    let mut out = vec![0u8; oh * ow * 3];
    if (sx - ix).abs() < f64::EPSILON && (sy - iy).abs() < f64::EPSILON {
        let (ix, iy) = (ix as usize, iy as usize);
        let inv = 1.0f32 / (ix * iy) as f32;
        for y in 0..oh {
            for x in 0..ow {
                for c in 0..3 {
                    let mut sum = 0u32;
                    for dy in 0..iy {
                        for dx in 0..ix {
                            sum += src[((y * iy + dy) * w + x * ix + dx) * 3 + c] as u32;
                        }
                    }
                    out[(y * ow + x) * 3 + c] =
                        if ix == 2 && iy == 2 { ((sum + 2) >> 2) as u8 } else { (sum as f32 * inv).round_ties_even().clamp(0.0, 255.0) as u8 };
                }
            }
        }
        return RgbImage::from_raw(ow as u32, oh as u32, out).unwrap_or_default();
    }
    let xt = area_tab(w, ow, sx);
    let yt = area_tab(h, oh, sy);
    let stride = ow * 3;
    let mut sum = vec![0f32; stride];
    let mut buf = vec![0f32; stride];
    let mut prev = yt.first().map(|t| t.0).unwrap_or(0);
    let flush = |sum: &[f32], out: &mut [u8], dy: usize| {
        for (o, &v) in out[dy * stride..(dy + 1) * stride].iter_mut().zip(sum) {
            *o = v.round_ties_even().clamp(0.0, 255.0) as u8;
        }
    };
    for &(dy, sy_, beta) in &yt {
        buf.iter_mut().for_each(|v| *v = 0.0);
        let row = &src[sy_ * w * 3..(sy_ + 1) * w * 3];
        for &(dx, sx_, alpha) in &xt {
            for c in 0..3 {
                buf[dx * 3 + c] += row[sx_ * 3 + c] as f32 * alpha;
            }
        }
        if dy != prev {
            flush(&sum, &mut out, prev);
            for (s, b) in sum.iter_mut().zip(&buf) {
                *s = beta * b;
            }
            prev = dy;
        } else {
            for (s, b) in sum.iter_mut().zip(&buf) {
                *s += beta * b;
            }
        }
    }
    flush(&sum, &mut out, prev);
    RgbImage::from_raw(ow as u32, oh as u32, out).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn area_by_two_rounds_half_up_and_identity_is_a_copy() {
        let img = RgbImage::from_raw(2, 2, vec![0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1]).unwrap();
        let out = cv_resize(&img, 1, 1, CvInterp::Area).unwrap();
        assert_eq!(out.as_raw(), &vec![1, 1, 1]);
        assert_eq!(cv_resize(&img, 2, 2, CvInterp::Cubic).unwrap(), img);
        assert!(cv_resize(&img, 3, 3, CvInterp::Area).is_err());
    }
}
