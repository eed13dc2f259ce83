//! SegFormer's decode head, folded (`DecodeHeadImpl::Folded`), on f32 CPU tensors. The
//! output is computed in bands of rows: each band's fused features (bias plus the upsampled stage
//! maps, then ReLU) are classified while they are still in cache, straight into the NCHW logits, so
//! the `[B, H·W, D]` feature map (16 MB for B0 at 512²) is never written out and read back.
use rayon::prelude::*;

use crate::kernels::bilinear_cpu::axis_taps;
use crate::kernels::cpu_slice::{with_scratch, SharedOut};
use crate::kernels::int8_gemm::PackedQ8;

/// Output pixels per band (4 rows of B0's 128-wide map at 512²): the band's features (512 KiB at
/// 256 channels) and logits stay in L2 between the two steps.
const BAND_PIXELS: usize = 512;

/// The classifier's `[L, D]` weight as the band products read it.
pub(crate) enum ClassifierWeight {
    /// f32, row-major.
    F32(Vec<f32>),
    /// Rounded to Q8_0 for the int8 GEMM (the head of a Q8_0 file), its features rounded per row.
    Int8(PackedQ8),
}

/// The part of a folded decode head after its stage projections (`linear_fuse` and the BatchNorm
/// multiplied into them): the bias, the ReLU and the classifier.
pub(crate) struct FoldedDecode {
    /// `BN bias + Σ_s linear_fuse[:, block(s)] · proj_s.bias` `[D]`.
    pub bias: Vec<f32>,
    /// The classifier `[L, D]` and its bias `[L]`.
    pub classifier: ClassifierWeight,
    pub classifier_bias: Vec<f32>,
}

/// A stage map's bilinear taps along its rows and its columns.
type MapTaps = (Vec<(usize, usize, f32)>, Vec<(usize, usize, f32)>);

/// One stage's map after its folded linear: channels-last `[B, h·w, D]` values, `h`, `w`.
pub(crate) type StageMap<'a> = (&'a [f32], usize, usize);

thread_local! {
    /// Each worker's band of fused features.
    static FEATURES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl FoldedDecode {
    /// The logits `[B, L, h0·w0]` (NCHW) from the stage maps, the first of which is `h0 × w0`:
    /// `classifier · relu(bias + Σ_s bilinear(map_s → h0 × w0)) + classifier bias`.
    pub(crate) fn logits(&self, maps: &[StageMap], b: usize, (h0, w0): (usize, usize)) -> candle_core::Result<Vec<f32>> {
        let (d, labels) = (self.bias.len(), self.classifier_bias.len());
        let pixels = h0 * w0;
        let total = b.checked_mul(labels).and_then(|n| n.checked_mul(pixels));
        let Some(total) = total else { candle_core::bail!("segformer: {b} × {labels} × {pixels} logits overflow") };
        if total == 0 {
            return Ok(Vec::new());
        }
        for (values, h, w) in maps {
            if values.len() != b * h * w * d {
                candle_core::bail!("segformer: a {h} × {w} stage map of {} values for {b} images of {d} channels", values.len());
            }
        }
        let taps: Vec<_> = maps.iter().map(|(_, h, w)| (axis_taps(*h, h0), axis_taps(*w, w0))).collect();
        let band_rows = (BAND_PIXELS / w0).max(1);
        let bands = h0.div_ceil(band_rows);
        let mut out: Vec<f32> = Vec::with_capacity(total);
        let dst = SharedOut(out.spare_capacity_mut().as_mut_ptr().cast());
        (0..b * bands).into_par_iter().try_for_each(|unit| {
            let (image, band) = (unit / bands, unit % bands);
            let rows = band * band_rows..((band + 1) * band_rows).min(h0);
            let np = rows.len() * w0;
            with_scratch(&FEATURES, |features| {
                // Grown once per thread, never zeroed again: `fuse_row` writes every value.
                if features.len() < np * d {
                    features.resize(np * d, 0.0);
                }
                for (row, oy) in features[..np * d].chunks_exact_mut(w0 * d).zip(rows.clone()) {
                    fuse_row(row, image, (oy, h0), maps, &taps, &self.bias);
                }
                // SAFETY: this unit alone writes pixels `rows` of image `image`'s L planes, which
                // lie inside the `total` elements reserved.
                unsafe { self.classify_band(&features[..np * d], np, dst.at(image * labels * pixels + rows.start * w0), pixels) }
            })
        })?;
        // SAFETY: the units cover every image's bands, and each wrote all L planes' pixels of its band.
        unsafe { out.set_len(total) };
        Ok(out)
    }

    /// Logits of a band's `np` pixels (`features [np, D]`) into the L planes at `planes`, `stride`
    /// floats apart.
    ///
    /// # Safety
    /// `planes + l · stride + p` for `l < L`, `p < np` is memory this call alone writes.
    unsafe fn classify_band(&self, features: &[f32], np: usize, planes: *mut f32, stride: usize) -> candle_core::Result<()> {
        let (d, labels) = (self.bias.len(), self.classifier_bias.len());
        match &self.classifier {
            ClassifierWeight::F32(weight) => {
                for (l, &v) in self.classifier_bias.iter().enumerate() {
                    for p in 0..np {
                        planes.add(l * stride + p).write(v);
                    }
                }
                // SAFETY: dst is the L × np planes (row stride `stride`), lhs the L × D weight, rhs
                // `featuresᵀ` (D × np, element (c, p) at p·D + c).
                gemm::gemm(
                    labels, np, d,
                    planes, 1, stride as isize, true,
                    weight.as_ptr(), 1, d as isize,
                    features.as_ptr(), d as isize, 1,
                    1.0, 1.0, false, false, false, gemm::Parallelism::None,
                );
            }
            ClassifierWeight::Int8(weight) => {
                let rows = weight.matmul(features, np, Some(&self.classifier_bias))?;
                for l in 0..labels {
                    for (p, v) in rows[l..].iter().step_by(labels).take(np).enumerate() {
                        planes.add(l * stride + p).write(*v);
                    }
                }
            }
        }
        Ok(())
    }
}

/// Output row `oy` (of `h0`) of image `image`'s fused features, `[w0, D]`: `relu(bias + Σ_s
/// bilinear_{align_corners=False}(map_s))`; a map already at the output size is added as it is.
fn fuse_row(row: &mut [f32], image: usize, (oy, h0): (usize, usize), maps: &[StageMap], taps: &[MapTaps], bias: &[f32]) {
    let d = bias.len();
    let w0 = row.len() / d;
    for px in row.chunks_exact_mut(d) {
        px.copy_from_slice(bias);
    }
    for ((values, h, w), (row_taps, col_taps)) in maps.iter().zip(taps) {
        let (h, w) = (*h, *w);
        let plane = &values[image * h * w * d..][..h * w * d];
        if (h, w) == (h0, w0) {
            row.iter_mut().zip(&plane[oy * w0 * d..][..w0 * d]).for_each(|(o, v)| *o += v);
            continue;
        }
        let (y0, y1, ly1) = row_taps[oy];
        let ly0 = 1.0 - ly1;
        for (ox, o) in row.chunks_exact_mut(d).enumerate() {
            let (x0, x1, lx1) = col_taps[ox];
            let lx0 = 1.0 - lx1;
            let p = |yy: usize, xx: usize| &plane[(yy * w + xx) * d..][..d];
            let (p00, p01, p10, p11) = (p(y0, x0), p(y0, x1), p(y1, x0), p(y1, x1));
            let (w00, w01, w10, w11) = (ly0 * lx0, ly0 * lx1, ly1 * lx0, ly1 * lx1);
            for c in 0..d {
                o[c] += w00 * p00[c] + w01 * p01[c] + w10 * p10[c] + w11 * p11[c];
            }
        }
    }
    for v in row.iter_mut() {
        *v = v.max(0.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_values::spread;
    use candle_core::Device;

    /// The logits by the formula, element by element in f64: the bilinear taps, the ReLU, the
    /// classifier, NCHW.
    fn reference(maps: &[(Vec<f32>, usize, usize)], b: usize, (h0, w0): (usize, usize), bias: &[f32], weight: &[f32], cls_bias: &[f32]) -> Vec<f32> {
        let (d, labels) = (bias.len(), cls_bias.len());
        let mut out = vec![0f32; b * labels * h0 * w0];
        for image in 0..b {
            for oy in 0..h0 {
                for ox in 0..w0 {
                    let mut f: Vec<f64> = bias.iter().map(|&v| v as f64).collect();
                    for (values, h, w) in maps {
                        let (y0, y1, ly) = axis_tap(*h, h0, oy);
                        let (x0, x1, lx) = axis_tap(*w, w0, ox);
                        let at = |y: usize, x: usize, c: usize| values[((image * h + y) * w + x) * d + c] as f64;
                        let (ly, lx) = (ly as f64, lx as f64);
                        for (c, v) in f.iter_mut().enumerate() {
                            *v += (1.0 - ly) * ((1.0 - lx) * at(y0, x0, c) + lx * at(y0, x1, c)) + ly * ((1.0 - lx) * at(y1, x0, c) + lx * at(y1, x1, c));
                        }
                    }
                    for l in 0..labels {
                        let z: f64 = f.iter().enumerate().map(|(c, v)| v.max(0.0) * weight[l * d + c] as f64).sum();
                        out[((image * labels + l) * h0 + oy) * w0 + ox] = (z + cls_bias[l] as f64) as f32;
                    }
                }
            }
        }
        out
    }

    use crate::kernels::bilinear_cpu::axis_tap;

    /// Several bands per image (a partial last one), two images, a map at the output size and
    /// three smaller ones; the f32 classifier to f32 rounding, the int8 one to 8-bit rounding.
    #[test]
    fn bands_match_the_formula() {
        let dev = Device::Cpu;
        let (b, d, labels, h0, w0) = (2, 64, 40, 23, 48);
        let sizes = [(h0, w0), (12, 24), (6, 12), (3, 5)];
        let maps: Vec<(Vec<f32>, usize, usize)> =
            sizes.iter().enumerate().map(|(s, &(h, w))| (spread(b * h * w * d, s as u64 + 1, &dev).to_vec1::<f32>().unwrap(), h, w)).collect();
        let bias = spread(d, 7, &dev).to_vec1::<f32>().unwrap();
        let weight = spread((labels, d), 8, &dev);
        let cls_bias = spread(labels, 9, &dev).to_vec1::<f32>().unwrap();
        let w32 = weight.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let want = reference(&maps, b, (h0, w0), &bias, &w32, &cls_bias);
        let max = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let planes: Vec<StageMap> = maps.iter().map(|(v, h, w)| (v.as_slice(), *h, *w)).collect();
        let head = |classifier| FoldedDecode { bias: bias.clone(), classifier, classifier_bias: cls_bias.clone() };
        assert!(BAND_PIXELS / w0 < h0, "the test must cover several bands");
        let got = head(ClassifierWeight::F32(w32.clone())).logits(&planes, b, (h0, w0)).unwrap();
        let err = got.iter().zip(&want).fold(0f32, |m, (g, w)| m.max((g - w).abs()));
        assert!(err <= 1e-4 * max.max(1.0), "f32: max error {err} (max |ref| {max})");
        if let Some(packed) = PackedQ8::from_f32(&weight).unwrap().filter(|_| crate::kernels::int8_gemm::available()) {
            let got = head(ClassifierWeight::Int8(packed)).logits(&planes, b, (h0, w0)).unwrap();
            let err = got.iter().zip(&want).fold(0f32, |m, (g, w)| m.max((g - w).abs()));
            assert!(err > 0.0 && err < 0.03 * max, "int8: max error {err} (max |ref| {max})");
        }
        // A map of the wrong size is an error, not a read out of bounds.
        let short = [(&maps[0].0[..10], h0, w0)];
        assert!(head(ClassifierWeight::F32(w32)).logits(&short, b, (h0, w0)).is_err());
    }
}
