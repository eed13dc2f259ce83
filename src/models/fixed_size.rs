//! The image processor that resizes to a fixed size (no aspect keep; Pillow-exact antialiased
//! BILINEAR or BICUBIC on the 8-bit image, [`crate::imageio::resample`]), rescales and normalises:
//! transformers' `SegformerImageProcessor` (5.24.0, the [`Default`]) and SAM 3's, each family giving
//! the defaults its processor has when a checkpoint has no `preprocessor_config.json`.
use std::path::Path;

use candle_core::{Device, Tensor};
use image::RgbImage;

use crate::error::{Error, Result};
use crate::imageio::resample::{resize_with, Filter, Rounding};
use crate::models::processor::{processor_file, ImageProcessor, Normalization, IMAGENET_MEAN, IMAGENET_STD};

/// SegFormer's input side without a `preprocessor_config.json`.
const DEFAULT_SIDE: usize = 512;

/// Fixed-size image preprocessing (`SegformerImageProcessor` settings by default).
#[derive(Debug, Clone)]
pub struct FixedSizeProcessor {
    /// Target `(height, width)`; `None`: keep the image size (`do_resize = false`).
    pub size: Option<(usize, usize)>,
    /// Resampling filter (`resample`: 2 = PIL BILINEAR, 3 = PIL BICUBIC), Pillow-exact.
    pub filter: Filter,
    /// Whose fixed-point resize it reproduces (Pillow's for the HF processors, torchvision's for
    /// the original SAM 3 package).
    pub rounding: Rounding,
    /// Rescale factor (`1/255`), `None` when `do_rescale = false`.
    pub rescale: Option<f32>,
    /// Per-channel mean and std, `None` when `do_normalize = false`.
    pub normalize: Option<([f32; 3], [f32; 3])>,
}

impl Default for FixedSizeProcessor {
    fn default() -> Self {
        FixedSizeProcessor {
            size: Some((DEFAULT_SIDE, DEFAULT_SIDE)),
            filter: Filter::Bilinear,
            rounding: Rounding::Pillow,
            rescale: Some(1.0 / 255.0),
            normalize: Some((IMAGENET_MEAN, IMAGENET_STD)),
        }
    }
}

impl FixedSizeProcessor {
    /// Reads `preprocessor_config.json` next to the model (inside a model directory, or beside a
    /// single weight file); SegFormer's defaults (512×512, bilinear, ImageNet) when there is none.
    pub fn from_model_path(model: &Path) -> Result<Self> {
        Self::from_model_path_or(model, Self::default())
    }

    /// As [`FixedSizeProcessor::from_model_path`], with `defaults` for what the file does not say.
    pub fn from_model_path_or(model: &Path, defaults: Self) -> Result<Self> {
        let Some(p) = processor_file(model) else { return Ok(defaults) };
        let text = crate::fsutil::read_input_text(&p, crate::fsutil::MAX_TEXT_INPUT)?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::bad_file(&p, format!("invalid JSON: {e}")))?;
        Self::from_json_or(&v, defaults).map_err(|e| Error::bad_file(&p, e.to_string()))
    }

    /// From a parsed `preprocessor_config.json` (missing fields take the processor defaults).
    pub fn from_json(v: &serde_json::Value) -> Result<Self> {
        Self::from_json_or(v, Self::default())
    }

    /// From a parsed `preprocessor_config.json`, `d` giving what it does not say.
    pub fn from_json_or(v: &serde_json::Value, d: Self) -> Result<Self> {
        let bad = |m: String| Error::Config(format!("preprocessor_config: {m}"));
        let flag = |k: &str| v.get(k).and_then(|x| x.as_bool()).unwrap_or(true);
        let size = if !flag("do_resize") {
            None
        } else {
            match v.get("size") {
                None | Some(serde_json::Value::Null) => d.size,
                Some(serde_json::Value::Number(n)) => {
                    let n = n.as_u64().filter(|&n| n > 0).ok_or_else(|| bad(format!("bad size {n}")))? as usize;
                    Some((n, n))
                }
                Some(obj) => {
                    let get = |k: &str| obj.get(k).and_then(|x| x.as_u64()).filter(|&n| n > 0).map(|n| n as usize);
                    match (get("height"), get("width")) {
                        (Some(h), Some(w)) => Some((h, w)),
                        _ => return Err(bad(format!("size {obj} is not {{height, width}}; only a fixed resize is supported"))),
                    }
                }
            }
        };
        let filter = match v.get("resample").and_then(|x| x.as_u64()) {
            None => d.filter,
            Some(2) => Filter::Bilinear,
            Some(3) => Filter::Bicubic,
            Some(r) => return Err(bad(format!("unsupported resample {r} (2 = bilinear and 3 = bicubic are supported)"))),
        };
        let rescale = if flag("do_rescale") {
            Some(v.get("rescale_factor").and_then(|x| x.as_f64()).map(|r| r as f32).or(d.rescale).unwrap_or(1.0 / 255.0))
        } else {
            None
        };
        let triple = |k: &str, dflt: [f32; 3]| -> Result<[f32; 3]> {
            match v.get(k) {
                None | Some(serde_json::Value::Null) => Ok(dflt),
                Some(serde_json::Value::Number(n)) => Ok([n.as_f64().unwrap_or(0.0) as f32; 3]),
                Some(serde_json::Value::Array(a)) if a.len() == 3 => {
                    let mut o = [0f32; 3];
                    for (i, x) in a.iter().enumerate() {
                        o[i] = x.as_f64().ok_or_else(|| bad(format!("{k} must be numbers")))? as f32;
                    }
                    Ok(o)
                }
                Some(x) => Err(bad(format!("{k} must be 3 numbers, got {x}"))),
            }
        };
        let normalize = if flag("do_normalize") {
            let (mean, std) = d.normalize.unwrap_or((IMAGENET_MEAN, IMAGENET_STD));
            let std = triple("image_std", std)?;
            if std.iter().any(|&s| !(s.is_finite() && s > 0.0)) {
                return Err(bad(format!("image_std {std:?} must be positive")));
            }
            Some((triple("image_mean", mean)?, std))
        } else {
            None
        };
        let pre = FixedSizeProcessor { size, filter, rounding: d.rounding, rescale, normalize };
        pre.validate()?;
        Ok(pre)
    }

    /// Checks every number against the shared config limits ([`crate::config_check`]).
    pub fn validate(&self) -> Result<()> {
        let s = crate::config_check::Section::root();
        if let Some((h, w)) = self.size {
            s.image_size("size", h, w)?;
        }
        if let Some(r) = self.rescale {
            s.positive("rescale_factor", r as f64, 1.0)?;
        }
        if let Some((mean, std)) = &self.normalize {
            s.mean_std(mean, std)?;
        }
        Ok(())
    }

    /// The network input size for an image of `w × h`.
    pub fn input_size(&self, w: u32, h: u32) -> (usize, usize) {
        self.size.unwrap_or((h as usize, w as usize))
    }

    /// `pixel_values [3, H, W]` (f32) for one RGB image.
    pub fn apply(&self, img: &RgbImage, device: &Device) -> Result<Tensor> {
        let (h, w) = self.input_size(img.width(), img.height());
        let n = crate::config_check::input_elements(h, w, 3)?;
        let resized;
        let img = if (h, w) != (img.height() as usize, img.width() as usize) {
            resized = resize_with(img, w as u32, h as u32, self.filter, self.rounding);
            &resized
        } else {
            img
        };
        let scale = self.rescale.unwrap_or(1.0);
        let (mean, std) = self.normalize.unwrap_or(([0.0; 3], [1.0; 3]));
        let raw = img.as_raw();
        let plane = h * w;
        let mut out = vec![0f32; n];
        for (c, dst) in out.chunks_mut(plane).enumerate() {
            for (i, d) in dst.iter_mut().enumerate() {
                *d = (raw[3 * i + c] as f32 * scale - mean[c]) / std[c];
            }
        }
        Ok(Tensor::from_vec(out, (3, h, w), device)?)
    }
}


impl ImageProcessor for FixedSizeProcessor {
    fn input_size(&self, h: usize, w: usize) -> (usize, usize) {
        FixedSizeProcessor::input_size(self, w as u32, h as u32)
    }

    fn pixel_values(&self, img: &RgbImage, device: &Device) -> Result<Tensor> {
        self.apply(img, device)
    }

    fn working_size(&self) -> usize {
        self.size.map(|(h, w)| h.max(w)).unwrap_or(DEFAULT_SIDE)
    }

    fn normalization(&self) -> Result<Normalization> {
        let (mean, std) = self.normalize.unwrap_or(([0.0; 3], [1.0; 3]));
        Ok(Normalization { mean, std, filter: self.filter })
    }
}
