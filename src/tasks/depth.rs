//! Monocular depth on images: the family's image processor (the DPT processor for Depth Anything
//! V1/V2, the `depth-anything-3` input processor for DA3), batched forward, the map resized back to
//! the source (bicubic).
use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use image::RgbImage;

use super::batch::group_by_key;
use super::Task;
use crate::error::{Error, Result};
use crate::runner::check_injected_oom;
use crate::models::da3::{replace_sky_depth, scale_to_metric};
use crate::models::footprint::Footprint;
use crate::models::processor::ImageProcessor;
use crate::models::{Checkpoint, DepthOutputs, Model, NamedTensors};
use crate::nn::interpolate::bicubic_map;

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


/// Everything a depth model predicts for one image, at the image's resolution.
#[derive(Debug, Clone)]
pub struct DepthPrediction {
    /// Depth (DA-V2: relative disparity or metres; DA3: depth up to scale, or metres for DA3Metric;
    /// DA3Mono/Metric sky pixels replaced as [`replace_sky_depth`] describes).
    pub depth: DepthMap,
    /// DA3 any-view confidence (`exp(x) + 1`, ≥ 1).
    pub confidence: Option<DepthMap>,
    /// DA3Mono/Metric sky score (ReLU output; sky where ≥ 0.3).
    pub sky: Option<DepthMap>,
}

/// A loaded depth model with its image processor.
pub struct DepthEstimator {
    model: Box<dyn Model>,
    outputs: DepthOutputs,
    processor: Arc<dyn ImageProcessor>,
    focal: Option<f32>,
    device: Device,
    dtype: DType,
    footprint: Option<Footprint>,
}

impl DepthEstimator {
    /// Loads the depth model at `path` (directory or `.gguf`): any family that serves the depth task
    /// (Depth Anything V1/V2; Depth Anything 3, whose hub configs name it by `model_name`).
    pub fn load(path: &Path, device: &Device, dtype: DType) -> Result<Self> {
        let ckpt = Checkpoint::open(path)?;
        let not_depth = || Error::Config(format!("{}: `{}` is not a depth model", path.display(), ckpt.architecture()));
        let outputs = ckpt.depth_outputs().filter(|_| ckpt.serves(Task::Depth)).ok_or_else(not_depth)?;
        let processor = ckpt.processor()?.ok_or_else(not_depth)?;
        let footprint = ckpt.footprint(dtype);
        let model = ckpt.load(device, dtype)?;
        Ok(DepthEstimator { model, outputs, processor, focal: None, device: device.clone(), dtype, footprint })
    }

    /// Sets the focal length in pixels of the source images (DA3Metric: metric depth =
    /// focal′ · output / 300 with focal′ the focal at the network input size, `(fx·w′/w + fy·h′/h)/2`
    /// as the package rescales intrinsics). Other models ignore it.
    pub fn with_focal(mut self, focal_px: Option<f32>) -> Result<Self> {
        if let Some(f) = focal_px {
            if !(f.is_finite() && f > 0.0) {
                return Err(Error::Input(format!("focal length must be a positive number of pixels, got {f}")));
            }
        }
        self.focal = focal_px;
        Ok(self)
    }

    /// Estimated activation bytes of one forward-pass item for `image` (for batch planning).
    pub fn activation_bytes(&self, image: &RgbImage) -> Option<u64> {
        let (h, w) = (image.height() as usize, image.width() as usize);
        Some(self.footprint.as_ref()?.per_item(self.processor.input_size(h, w), (h, w)))
    }

    /// The device the model runs on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Whether metric depth needs the images' focal length (DA3Metric).
    pub fn needs_focal(&self) -> bool {
        self.outputs.needs_focal
    }

    /// Whether the model predicts metric depth (DA-V2 metric, DA3Metric) rather than relative depth.
    pub(crate) fn is_metric(&self) -> bool {
        self.outputs.metric
    }

    /// Replaces the image processor (e.g. a DA3 `process_res` other than 504).
    pub fn with_processor(mut self, processor: Arc<dyn ImageProcessor>) -> Self {
        self.processor = processor;
        self
    }

    /// The image processor.
    pub fn processor(&self) -> &dyn ImageProcessor {
        self.processor.as_ref()
    }

    /// Predicts one depth map per image; equal-size images share forward passes of up to `max_batch`.
    pub fn predict(&self, images: &[&RgbImage], max_batch: usize) -> Result<Vec<DepthMap>> {
        Ok(self.predict_all(images, max_batch)?.into_iter().map(|p| p.depth).collect())
    }

    /// Predicts depth and, where the model has them, confidence and sky per image, each resized
    /// (bicubic) to the image's resolution. DA3 images are single views (S = 1).
    pub fn predict_all(&self, images: &[&RgbImage], max_batch: usize) -> Result<Vec<DepthPrediction>> {
        if self.outputs.needs_focal && self.focal.is_none() {
            return Err(Error::Input("DA3Metric gives metric depth only with a focal length: pass --focal (pixels)".into()));
        }
        let sizes: Vec<(usize, usize)> = images.iter().map(|im| self.processor.input_size(im.height() as usize, im.width() as usize)).collect();
        let mut out = Vec::with_capacity(images.len());
        for range in group_by_key(&sizes, max_batch) {
            let batch = images[range.clone()].iter().map(|im| self.processor.pixel_values(im, &self.device)).collect::<Result<Vec<_>>>()?;
            check_injected_oom(batch.len())?;
            let x = Tensor::stack(&batch, 0)?.to_dtype(self.dtype)?;
            let mut inputs = NamedTensors::new();
            inputs.insert("pixel_values".into(), x);
            let y = crate::device::on_pool_worker(&self.device, || self.model.forward_named(&inputs))?;
            let fetch = |name: &str| -> Result<Tensor> {
                let t = y.get(name).ok_or_else(|| Error::Input(format!("model produced no `{name}`")))?;
                Ok(t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?)
            };
            let depth = fetch(self.outputs.depth)?;
            let conf = self.outputs.confidence.map(fetch).transpose()?;
            let sky = self.outputs.sky.map(fetch).transpose()?;
            let (_, oh, ow) = depth.dims3()?;
            for (k, im) in images[range].iter().enumerate() {
                let (sh, sw) = (im.height() as usize, im.width() as usize);
                let row = |t: &Tensor| -> Result<Vec<f32>> {
                    let v = t.get(k)?.flatten_all()?.to_vec1::<f32>()?;
                    if v.iter().any(|x| !x.is_finite()) {
                        return Err(Error::Input(format!("non-finite model outputs in {:?} compute (try --dtype f32)", self.dtype)));
                    }
                    Ok(v)
                };
                let back = |v: &[f32]| -> Result<DepthMap> { Ok(DepthMap { height: sh, width: sw, values: bicubic_map(v, oh, ow, sh, sw)? }) };
                let mut d = row(&depth)?;
                let sky_v = sky.as_ref().map(row).transpose()?;
                if let Some(s) = &sky_v {
                    replace_sky_depth(&mut d, s);
                }
                if let (true, Some(f)) = (self.outputs.needs_focal, self.focal) {
                    scale_to_metric(&mut d, f * (ow as f32 / sw as f32 + oh as f32 / sh as f32) / 2.0);
                }
                out.push(DepthPrediction {
                    depth: back(&d)?,
                    confidence: conf.as_ref().map(|c| row(c).and_then(|v| back(&v))).transpose()?,
                    sky: sky_v.map(|v| back(&v)).transpose()?,
                });
            }
        }
        Ok(out)
    }
}
