//! What the families' image processors share: the [`ImageProcessor`] trait each family implements
//! in its folder (the one reader of its `preprocessor_config.json`, for inference and training
//! alike), where that file lies, and the reference processors' common steps.
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use image::RgbImage;
use serde::Deserialize;

use crate::error::Result;
use crate::imageio::resample::{resize, Filter};

/// How training samples, resized to a fixed size, are made network inputs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Normalization {
    /// Per-channel mean (of values scaled to 0..1).
    pub mean: [f32; 3],
    /// Per-channel standard deviation.
    pub std: [f32; 3],
    /// The resampling filter.
    pub filter: Filter,
}

/// A family's image preprocessing, as its reference image processor does it.
pub trait ImageProcessor: Send + Sync + std::fmt::Debug {
    /// The network input size `(H, W)` for an `h × w` image.
    fn input_size(&self, h: usize, w: usize) -> (usize, usize);
    /// `pixel_values [3, H, W]` (f32) for one image, at [`ImageProcessor::input_size`].
    fn pixel_values(&self, img: &RgbImage, device: &Device) -> Result<Tensor>;
    /// The side of a tile that the network takes without resizing (the default tile of a large raster).
    fn working_size(&self) -> usize;
    /// How training samples at a fixed size are normalised.
    fn normalization(&self) -> Result<Normalization>;
}

/// A height/width pair as the processors write it.
#[derive(Debug, Clone, Copy, Deserialize)]
pub struct Size {
    /// Height in pixels.
    pub height: usize,
    /// Width in pixels.
    pub width: usize,
}

/// Reads a `preprocessor_config.json` at `path` (size-limited), parses it and checks it with
/// `validate`; errors name the file.
pub fn read_processor<T: serde::de::DeserializeOwned>(path: &Path, validate: impl FnOnce(&T) -> Result<()>) -> Result<T> {
    let text = crate::fsutil::read_input(path, crate::fsutil::MAX_TEXT_INPUT)?;
    let cfg: T = serde_json::from_slice(&text).map_err(|e| crate::error::Error::bad_file(path, e.to_string()))?;
    validate(&cfg).map_err(|e| crate::config_check::in_file(&path.display().to_string(), e))?;
    Ok(cfg)
}

/// The `preprocessor_config.json` beside a model (inside a model directory, or beside a single
/// weight file), when there is one.
pub(crate) fn processor_file(model: &Path) -> Option<PathBuf> {
    let p = if model.is_dir() { model.join("preprocessor_config.json") } else { model.with_file_name("preprocessor_config.json") };
    p.exists().then_some(p)
}

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
pub(crate) fn normalize(img: &RgbImage, mean: [f32; 3], std: [f32; 3], device: &Device) -> Result<Tensor> {
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
