//! Canopy height on images: the CHMv2 image processor (normalise, centre zero-pad to a multiple of
//! 16), batched forward, and the map resized back to the source (bilinear, align_corners=True).
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use image::RgbImage;

use super::batch::group_by_key;
use super::depth::DepthMap;
use super::Task;
use crate::error::{Error, Result};
use crate::runner::check_injected_oom;
use crate::models::chmv2::{Chmv2, Chmv2Processor, Config, Precision};
use crate::models::footprint::Footprint;
use crate::models::Checkpoint;
use crate::weights::Vb;

/// A canopy-height map (metres) at the source image's resolution.
pub type HeightMap = DepthMap;


/// Resizes a `[h, w]` map to `(oh, ow)` with bilinear interpolation, align_corners=True (as
/// `CHMv2ImageProcessor.post_process_depth_estimation`).
pub fn resize_back(values: &[f32], h: usize, w: usize, oh: usize, ow: usize) -> Result<Vec<f32>> {
    if h.checked_mul(w) != Some(values.len()) || oh == 0 || ow == 0 || oh.checked_mul(ow).is_none() {
        return Err(Error::Input(format!("cannot resize a map of {} values as {h}×{w} to {oh}×{ow}", values.len())));
    }
    if (h, w) == (oh, ow) {
        return Ok(values.to_vec());
    }
    let t = Tensor::from_slice(values, (1, 1, h, w), &Device::Cpu)?;
    Ok(t.upsample_bilinear2d(oh, ow, true)?.flatten_all()?.to_vec1::<f32>()?)
}

/// A loaded CHMv2 model with its image processor.
pub struct ChmEstimator {
    model: Chmv2,
    processor: Chmv2Processor,
    device: Device,
    precision: Precision,
    footprint: Option<Footprint>,
}

impl ChmEstimator {
    /// Loads the CHMv2 model at `path` (directory or `.gguf`) with per-part compute dtypes.
    pub fn load(path: &Path, device: &Device, precision: Precision) -> Result<Self> {
        crate::device::check_dtype(device, precision.backbone)?;
        crate::device::check_dtype(device, precision.head)?;
        let ckpt = Checkpoint::open(path)?;
        let config = ckpt.config::<Config>().filter(|_| ckpt.serves(Task::CanopyHeight));
        let Some(config) = config else {
            return Err(Error::Config(format!("{}: `{}` is not a CHMv2 canopy-height model", path.display(), ckpt.architecture())));
        };
        let footprint = ckpt.footprint(precision.head);
        let vb = Vb::new(ckpt.store().clone(), precision.backbone, device.clone());
        let model = ckpt.built(|| Chmv2::load_with(&vb, config, precision))?;
        Ok(ChmEstimator { model, processor: Chmv2Processor::for_model(path)?, device: device.clone(), precision, footprint })
    }

    /// Replaces the image processor.
    pub fn with_processor(mut self, processor: Chmv2Processor) -> Self {
        self.processor = processor;
        self
    }

    /// The image processor.
    pub fn processor(&self) -> &Chmv2Processor {
        &self.processor
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

    /// The model.
    pub fn model(&self) -> &Chmv2 {
        &self.model
    }

    /// Heights in metres for each image (at its own size). Images with the same network input size
    /// share forward passes of up to `max_batch`. `labels` name the images in errors (e.g. paths).
    pub fn predict(&self, images: &[&RgbImage], labels: &[String], max_batch: usize) -> Result<Vec<HeightMap>> {
        if labels.len() != images.len() {
            return Err(Error::Input(format!("{} labels for {} images", labels.len(), images.len())));
        }
        let sizes: Vec<(usize, usize)> = images.iter().map(|im| self.processor.input_size(im.height() as usize, im.width() as usize)).collect();
        let mut out = Vec::with_capacity(images.len());
        for range in group_by_key(&sizes, max_batch) {
            let batch = images[range.clone()].iter().map(|im| self.processor.pixel_values(im, &self.device)).collect::<Result<Vec<_>>>()?;
            check_injected_oom(batch.len())?;
            let x = Tensor::stack(&batch, 0)?;
            let (y, bad) = crate::device::on_pool_worker(&self.device, || self.model.forward_checked(&x))?;
            let y = y.to_dtype(DType::F32)?.to_device(&Device::Cpu)?;
            let (_, oh, ow) = y.dims3()?;
            for (k, im) in images[range.clone()].iter().enumerate() {
                let v = y.get(k)?.flatten_all()?.to_vec1::<f32>()?;
                let n_bad = v.iter().filter(|x| !x.is_finite()).count();
                if let Some(stage) = bad[k].or((n_bad > 0).then_some("bins")) {
                    return Err(Error::Input(format!(
                        "{}: non-finite values in the {stage} output with {} compute; canopy height not written (rerun with --dtype f32)",
                        labels[range.start + k],
                        precision_name(self.precision),
                    )));
                }
                let (sh, sw) = (im.height() as usize, im.width() as usize);
                out.push(HeightMap { height: sh, width: sw, values: resize_back(&v, oh, ow, sh, sw)? });
            }
        }
        Ok(out)
    }
}

/// A short name for a precision setting.
pub fn precision_name(p: Precision) -> String {
    let n = |d: DType| format!("{d:?}").to_lowercase();
    if p.backbone == p.head {
        n(p.backbone)
    } else {
        format!("{} backbone + {} head", n(p.backbone), n(p.head))
    }
}
