//! Monocular depth on images: DPT-style preprocessing, batched forward, resize back to the source.
use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use image::RgbImage;
use serde::Deserialize;

use super::batch::group_by_key;
use crate::error::{Error, Result};
use crate::imageio::resample::Filter;
use crate::models::{Model, NamedTensors};
use crate::nn::interpolate::bicubic_map;
use crate::preprocess::{dpt_output_size, to_pixel_values, IMAGENET_MEAN, IMAGENET_STD};
use crate::weights::WeightStore;

/// The DPT image processor's settings (`preprocessor_config.json`), defaults as the DA-V2 hub files.
#[derive(Debug, Clone, Deserialize)]
pub struct DepthPreprocess {
    /// Target size before the keep-aspect rule.
    #[serde(default = "size518")]
    pub size: Size,
    /// Each side is rounded to a multiple of this.
    #[serde(default = "m14")]
    pub ensure_multiple_of: usize,
    /// Keep the aspect ratio (the scale closer to 1 wins).
    #[serde(default = "yes")]
    pub keep_aspect_ratio: bool,
    /// Per-channel mean.
    #[serde(default = "mean")]
    pub image_mean: [f32; 3],
    /// Per-channel std.
    #[serde(default = "std")]
    pub image_std: [f32; 3],
}

/// A height/width pair as the processors write it.
#[derive(Debug, Clone, Copy, Deserialize)]
pub struct Size {
    /// Height in pixels.
    pub height: usize,
    /// Width in pixels.
    pub width: usize,
}

fn size518() -> Size { Size { height: 518, width: 518 } }
fn m14() -> usize { 14 }
fn yes() -> bool { true }
fn mean() -> [f32; 3] { IMAGENET_MEAN }
fn std() -> [f32; 3] { IMAGENET_STD }

impl Default for DepthPreprocess {
    fn default() -> Self {
        DepthPreprocess { size: size518(), ensure_multiple_of: 14, keep_aspect_ratio: true, image_mean: mean(), image_std: std() }
    }
}

impl DepthPreprocess {
    /// Reads `preprocessor_config.json` beside a model, or the defaults when there is none.
    pub fn for_model(model_path: &Path) -> Result<Self> {
        let dir = if model_path.is_dir() { model_path.to_path_buf() } else { model_path.parent().unwrap_or(Path::new(".")).to_path_buf() };
        let p = dir.join("preprocessor_config.json");
        if !p.exists() {
            return Ok(Self::default());
        }
        let text = std::fs::read(&p).map_err(|e| Error::io(&p, e))?;
        let cfg: DepthPreprocess = serde_json::from_slice(&text).map_err(|e| Error::bad_file(&p, e.to_string()))?;
        if cfg.ensure_multiple_of == 0 || cfg.size.height == 0 || cfg.size.width == 0 || cfg.image_std.iter().any(|s| *s <= 0.0) {
            return Err(Error::bad_file(&p, "size, ensure_multiple_of and image_std must be positive"));
        }
        Ok(cfg)
    }

    /// The network input size for an `h`×`w` image.
    pub fn input_size(&self, h: usize, w: usize) -> (usize, usize) {
        dpt_output_size(h, w, self.size.height, self.size.width, self.ensure_multiple_of, self.keep_aspect_ratio)
    }
}

/// A depth map at the source image's resolution.
#[derive(Debug, Clone)]
pub struct DepthMap {
    /// Rows.
    pub height: usize,
    /// Columns.
    pub width: usize,
    /// Row-major values (relative disparity or metres, as the model defines).
    pub values: Vec<f32>,
}

/// A loaded depth model with its preprocessing.
pub struct DepthEstimator {
    model: Box<dyn Model>,
    output: &'static str,
    pre: DepthPreprocess,
    device: Device,
    dtype: DType,
}

impl DepthEstimator {
    /// Loads the depth model at `path` (directory or `.gguf`).
    pub fn load(path: &Path, device: &Device, dtype: DType) -> Result<Self> {
        let store = Arc::new(WeightStore::open(path)?);
        let arch = store.architecture().unwrap_or_default();
        let output = match arch.as_str() {
            "depth_anything" => "predicted_depth",
            other => return Err(Error::Config(format!("{}: `{other}` is not a depth model", path.display()))),
        };
        let model = crate::models::load(store, device, dtype)?;
        Ok(DepthEstimator { model, output, pre: DepthPreprocess::for_model(path)?, device: device.clone(), dtype })
    }

    /// The preprocessing settings.
    pub fn preprocess(&self) -> &DepthPreprocess {
        &self.pre
    }

    /// Predicts one depth map per image; equal-size images share forward passes of up to `max_batch`.
    pub fn predict(&self, images: &[&RgbImage], max_batch: usize) -> Result<Vec<DepthMap>> {
        let sizes: Vec<(usize, usize)> = images.iter().map(|im| self.pre.input_size(im.height() as usize, im.width() as usize)).collect();
        let mut out = Vec::with_capacity(images.len());
        for range in group_by_key(&sizes, max_batch) {
            let (h, w) = sizes[range.start];
            let batch = images[range.clone()]
                .iter()
                .map(|im| to_pixel_values(im, h, w, Filter::Bicubic, self.pre.image_mean, self.pre.image_std, &self.device))
                .collect::<Result<Vec<_>>>()?;
            let x = Tensor::stack(&batch, 0)?.to_dtype(self.dtype)?;
            let mut inputs = NamedTensors::new();
            inputs.insert("pixel_values".into(), x);
            let y = self.model.forward_named(&inputs)?;
            let y = y.get(self.output).ok_or_else(|| Error::Input(format!("model produced no `{}`", self.output)))?;
            let y = y.to_dtype(DType::F32)?.to_device(&Device::Cpu)?;
            let (_, oh, ow) = y.dims3()?;
            for (k, im) in images[range].iter().enumerate() {
                let v = y.get(k)?.flatten_all()?.to_vec1::<f32>()?;
                if v.iter().any(|x| !x.is_finite()) {
                    return Err(Error::Input(format!("non-finite depth values in {:?} compute (try --dtype f32)", self.dtype)));
                }
                let (sh, sw) = (im.height() as usize, im.width() as usize);
                out.push(DepthMap { height: sh, width: sw, values: bicubic_map(&v, oh, ow, sh, sw) });
            }
        }
        Ok(out)
    }
}
