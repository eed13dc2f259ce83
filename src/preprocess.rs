//! Image → `pixel_values` preprocessing recipes of the reference image processors.
use candle_core::{Device, Tensor};
use image::RgbImage;

use crate::error::Result;
use crate::imageio::resample::{resize, Filter};

/// ImageNet mean (RGB).
pub const IMAGENET_MEAN: [f32; 3] = [0.485, 0.456, 0.406];
/// ImageNet standard deviation (RGB).
pub const IMAGENET_STD: [f32; 3] = [0.229, 0.224, 0.225];

/// Python's `round` (half to even).
fn round_half_even(x: f64) -> f64 {
    let r = x.round();
    if (x - x.trunc()).abs() == 0.5 {
        2.0 * (x / 2.0).round()
    } else {
        r
    }
}

/// The DPT processor's output size: keep aspect with the scale closer to 1, each side rounded to a
/// multiple of `multiple` (`get_resize_output_image_size` in transformers). Degenerate arguments
/// (zero sizes) give saturated sizes that the pixel-value step then refuses, never a panic.
pub fn dpt_output_size(h: usize, w: usize, target_h: usize, target_w: usize, multiple: usize, keep_aspect: bool) -> (usize, usize) {
    let multiple = multiple.max(1);
    let mut sh = target_h as f64 / h.max(1) as f64;
    let mut sw = target_w as f64 / w.max(1) as f64;
    if keep_aspect {
        if (1.0 - sw).abs() < (1.0 - sh).abs() {
            sh = sw;
        } else {
            sw = sh;
        }
    }
    let fit = |v: f64| (round_half_even(v / multiple as f64) as usize).saturating_mul(multiple).max(multiple);
    (fit(sh * h as f64), fit(sw * w as f64))
}

/// Resizes with `filter` to `(h, w)` and normalises to a `[3, h, w]` f32 tensor.
pub fn to_pixel_values(img: &RgbImage, h: usize, w: usize, filter: Filter, mean: [f32; 3], std: [f32; 3], device: &Device) -> Result<Tensor> {
    crate::config_check::input_elements(h, w, 3)?;
    let resized = resize(img, w as u32, h as u32, filter);
    normalize(&resized, mean, std, device)
}

/// `(x / 255 − mean) / std` per channel, as `[3, H, W]` f32.
pub fn normalize(img: &RgbImage, mean: [f32; 3], std: [f32; 3], device: &Device) -> Result<Tensor> {
    let (w, h) = img.dimensions();
    let (w, h) = (w as usize, h as usize);
    let mut data = vec![0f32; 3 * h * w];
    for (i, px) in img.as_raw().chunks_exact(3).enumerate() {
        for c in 0..3 {
            data[c * h * w + i] = (px[c] as f32 / 255.0 - mean[c]) / std[c];
        }
    }
    Ok(Tensor::from_vec(data, (3, h, w), device)?)
}
