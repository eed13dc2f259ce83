//! Separable resampling of 8-bit RGB images (antialiased when downscaling), exact to Pillow's
//! `Image.resize` (the HF image processors' PIL path) or to torchvision's resize of a uint8 tensor
//! (`v2.Resize`, antialiased: the same weights in fixed point of another precision), per [`Rounding`].
use image::RgbImage;

/// The resampling filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Filter {
    /// Pillow `BICUBIC` (a = −0.5, support 2).
    Bicubic,
    /// Pillow `BILINEAR` (triangle, support 1).
    Bilinear,
}

impl Filter {
    fn support(self) -> f64 {
        match self {
            Filter::Bicubic => 2.0,
            Filter::Bilinear => 1.0,
        }
    }

    fn eval(self, x: f64) -> f64 {
        let x = x.abs();
        match self {
            Filter::Bicubic => {
                const A: f64 = -0.5;
                if x < 1.0 {
                    ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
                } else if x < 2.0 {
                    (((x - 5.0) * x + 8.0) * x - 4.0) * A
                } else {
                    0.0
                }
            }
            Filter::Bilinear => (1.0 - x).max(0.0),
        }
    }
}

/// Which library's fixed-point weights a resize reproduces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Rounding {
    /// Pillow: 22 fractional bits.
    #[default]
    Pillow,
    /// PyTorch's uint8 antialiased interpolation (what torchvision resizes a uint8 image with): the
    /// most fractional bits (below 22) that keep the largest weight of the axis within an int16.
    Torch,
}

const PRECISION_BITS: u32 = 32 - 8 - 2;

/// Per-output-pixel source window start and fixed-point weights.
struct Coeffs {
    start: Vec<usize>,
    weights: Vec<Vec<i32>>,
    /// Fractional bits of the weights.
    precision: u32,
}

/// PyTorch's `_compute_index_ranges_int16_weights` precision for the largest weight `wt_max`.
fn torch_precision(wt_max: f64) -> u32 {
    let mut p = 0;
    while p < PRECISION_BITS {
        if (0.5 + wt_max * (1u64 << (p + 1)) as f64) as i64 >= 1 << 15 {
            break;
        }
        p += 1;
    }
    p
}

fn coeffs(in_size: usize, out_size: usize, filter: Filter, rounding: Rounding) -> Coeffs {
    let scale = in_size as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = filter.support() * filterscale;
    let ss = 1.0 / filterscale;
    let mut start = Vec::with_capacity(out_size);
    let mut weights = Vec::with_capacity(out_size);
    for xx in 0..out_size {
        let center = (xx as f64 + 0.5) * scale;
        let xmin = ((center - support + 0.5) as i64).max(0) as usize;
        let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
        let mut w: Vec<f64> = (xmin..xmax).map(|x| filter.eval((x as f64 - center + 0.5) * ss)).collect();
        let total: f64 = w.iter().sum();
        if total != 0.0 {
            w.iter_mut().for_each(|v| *v /= total);
        }
        start.push(xmin);
        weights.push(w);
    }
    let precision = match rounding {
        Rounding::Pillow => PRECISION_BITS,
        Rounding::Torch => torch_precision(weights.iter().flatten().fold(0.0, |m: f64, &v| m.max(v))),
    };
    let weights = weights
        .iter()
        .map(|w| {
            w.iter()
                .map(|&v| {
                    let s = v * (1u64 << precision) as f64;
                    (if v >= 0.0 { s + 0.5 } else { s - 0.5 }) as i32
                })
                .collect()
        })
        .collect();
    Coeffs { start, weights, precision }
}

fn clip8(v: i64, precision: u32) -> u8 {
    (v >> precision).clamp(0, 255) as u8
}

fn horizontal(src: &RgbImage, out_w: u32, filter: Filter, rounding: Rounding) -> RgbImage {
    let (w, h) = src.dimensions();
    let c = coeffs(w as usize, out_w as usize, filter, rounding);
    let mut out = RgbImage::new(out_w, h);
    let s = src.as_raw();
    let o: &mut [u8] = &mut out;
    for y in 0..h as usize {
        let row = &s[y * w as usize * 3..(y + 1) * w as usize * 3];
        for (xx, (st, ws)) in c.start.iter().zip(&c.weights).enumerate() {
            let mut acc = [1i64 << (c.precision - 1); 3];
            for (k, &wk) in ws.iter().enumerate() {
                let p = &row[(st + k) * 3..(st + k) * 3 + 3];
                for ch in 0..3 {
                    acc[ch] += p[ch] as i64 * wk as i64;
                }
            }
            let base = (y * out_w as usize + xx) * 3;
            for ch in 0..3 {
                o[base + ch] = clip8(acc[ch], c.precision);
            }
        }
    }
    out
}

fn vertical(src: &RgbImage, out_h: u32, filter: Filter, rounding: Rounding) -> RgbImage {
    let (w, h) = src.dimensions();
    let c = coeffs(h as usize, out_h as usize, filter, rounding);
    let mut out = RgbImage::new(w, out_h);
    let s = src.as_raw();
    let stride = w as usize * 3;
    let o: &mut [u8] = &mut out;
    for (yy, (st, ws)) in c.start.iter().zip(&c.weights).enumerate() {
        for i in 0..stride {
            let mut acc = 1i64 << (c.precision - 1);
            for (k, &wk) in ws.iter().enumerate() {
                acc += s[(st + k) * stride + i] as i64 * wk as i64;
            }
            o[yy * stride + i] = clip8(acc, c.precision);
        }
    }
    out
}

/// Resizes `img` to `out_w`×`out_h` like Pillow's `Image.resize(size, filter)`: horizontal pass
/// first, each pass rounded to 8 bits.
pub fn resize(img: &RgbImage, out_w: u32, out_h: u32, filter: Filter) -> RgbImage {
    resize_with(img, out_w, out_h, filter, Rounding::Pillow)
}

/// [`resize`] with the fixed-point weights of `rounding`'s library.
pub fn resize_with(img: &RgbImage, out_w: u32, out_h: u32, filter: Filter, rounding: Rounding) -> RgbImage {
    let (w, h) = img.dimensions();
    let tmp = if w != out_w { horizontal(img, out_w, filter, rounding) } else { img.clone() };
    if h != out_h {
        vertical(&tmp, out_h, filter, rounding)
    } else {
        tmp
    }
}
