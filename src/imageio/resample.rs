//! Pillow-exact separable resampling of 8-bit RGB images (antialiased when downscaling), the
//! resize that the HF image processors' PIL path performs and their torchvision path matches to
//! within one level.
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

const PRECISION_BITS: u32 = 32 - 8 - 2;

/// Per-output-pixel source window start and fixed-point weights.
struct Coeffs {
    start: Vec<usize>,
    weights: Vec<Vec<i32>>,
}

fn coeffs(in_size: usize, out_size: usize, filter: Filter) -> Coeffs {
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
        let fixed = w
            .iter()
            .map(|&v| {
                let s = v * (1u64 << PRECISION_BITS) as f64;
                (if v >= 0.0 { s + 0.5 } else { s - 0.5 }) as i32
            })
            .collect();
        start.push(xmin);
        weights.push(fixed);
    }
    Coeffs { start, weights }
}

fn clip8(v: i64) -> u8 {
    (v >> PRECISION_BITS).clamp(0, 255) as u8
}

fn horizontal(src: &RgbImage, out_w: u32, filter: Filter) -> RgbImage {
    let (w, h) = src.dimensions();
    let c = coeffs(w as usize, out_w as usize, filter);
    let mut out = RgbImage::new(out_w, h);
    let s = src.as_raw();
    let o: &mut [u8] = &mut out;
    for y in 0..h as usize {
        let row = &s[y * w as usize * 3..(y + 1) * w as usize * 3];
        for (xx, (st, ws)) in c.start.iter().zip(&c.weights).enumerate() {
            let mut acc = [1i64 << (PRECISION_BITS - 1); 3];
            for (k, &wk) in ws.iter().enumerate() {
                let p = &row[(st + k) * 3..(st + k) * 3 + 3];
                for ch in 0..3 {
                    acc[ch] += p[ch] as i64 * wk as i64;
                }
            }
            let base = (y * out_w as usize + xx) * 3;
            for ch in 0..3 {
                o[base + ch] = clip8(acc[ch]);
            }
        }
    }
    out
}

fn vertical(src: &RgbImage, out_h: u32, filter: Filter) -> RgbImage {
    let (w, h) = src.dimensions();
    let c = coeffs(h as usize, out_h as usize, filter);
    let mut out = RgbImage::new(w, out_h);
    let s = src.as_raw();
    let stride = w as usize * 3;
    let o: &mut [u8] = &mut out;
    for (yy, (st, ws)) in c.start.iter().zip(&c.weights).enumerate() {
        for i in 0..stride {
            let mut acc = 1i64 << (PRECISION_BITS - 1);
            for (k, &wk) in ws.iter().enumerate() {
                acc += s[(st + k) * stride + i] as i64 * wk as i64;
            }
            o[yy * stride + i] = clip8(acc);
        }
    }
    out
}

/// Resizes `img` to `out_w`×`out_h` like Pillow's `Image.resize(size, filter)`: horizontal pass
/// first, each pass rounded to 8 bits.
pub fn resize(img: &RgbImage, out_w: u32, out_h: u32, filter: Filter) -> RgbImage {
    let (w, h) = img.dimensions();
    let tmp = if w != out_w { horizontal(img, out_w, filter) } else { img.clone() };
    if h != out_h {
        vertical(&tmp, out_h, filter)
    } else {
        tmp
    }
}
