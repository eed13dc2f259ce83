//! transformers' `DPTImageProcessor` as Depth Anything V1/V2 checkpoints configure it: keep the
//! aspect ratio (the scale closer to 1 wins), each side a multiple of the patch size, bicubic, mean
//! and std from `preprocessor_config.json`.
use std::path::Path;

use candle_core::{Device, Tensor};
use image::RgbImage;
use serde::Deserialize;

use crate::config_check::{Section, MAX_MULTIPLE};
use crate::error::Result;
use crate::imageio::resample::Filter;
use crate::models::processor::{dpt_output_size, Size, processor_file, read_processor, to_pixel_values, ImageProcessor, Normalization, IMAGENET_MEAN, IMAGENET_STD};

/// The DPT image processor's settings (`preprocessor_config.json`), defaults as the DA-V2 hub files.
#[derive(Debug, Clone, Deserialize)]
pub struct DptProcessor {
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

fn size518() -> Size { Size { height: 518, width: 518 } }
fn m14() -> usize { 14 }
fn yes() -> bool { true }
fn mean() -> [f32; 3] { IMAGENET_MEAN }
fn std() -> [f32; 3] { IMAGENET_STD }

impl Default for DptProcessor {
    fn default() -> Self {
        DptProcessor { size: size518(), ensure_multiple_of: 14, keep_aspect_ratio: true, image_mean: mean(), image_std: std() }
    }
}

impl DptProcessor {
    /// Reads `preprocessor_config.json` beside a model, or the defaults when there is none.
    pub fn for_model(model_path: &Path) -> Result<Self> {
        match processor_file(model_path) {
            Some(p) => read_processor(&p, Self::validate),
            None => Ok(Self::default()),
        }
    }

    /// Checks every number against the shared config limits ([`crate::config_check`]).
    pub fn validate(&self) -> Result<()> {
        let s = Section::root();
        s.image_size("size", self.size.height, self.size.width)?;
        s.count("ensure_multiple_of", self.ensure_multiple_of, MAX_MULTIPLE)?;
        s.mean_std(&self.image_mean, &self.image_std)
    }

    /// The network input size for an `h`×`w` image.
    pub fn input_size(&self, h: usize, w: usize) -> (usize, usize) {
        dpt_output_size(h, w, self.size.height, self.size.width, self.ensure_multiple_of, self.keep_aspect_ratio)
    }
}

impl ImageProcessor for DptProcessor {
    fn input_size(&self, h: usize, w: usize) -> (usize, usize) {
        DptProcessor::input_size(self, h, w)
    }

    fn pixel_values(&self, img: &RgbImage, device: &Device) -> Result<Tensor> {
        let (h, w) = self.input_size(img.height() as usize, img.width() as usize);
        to_pixel_values(img, h, w, Filter::Bicubic, self.image_mean, self.image_std, device)
    }

    fn working_size(&self) -> usize {
        self.size.height.max(self.size.width)
    }

    fn normalization(&self) -> Result<Normalization> {
        Ok(Normalization { mean: self.image_mean, std: self.image_std, filter: Filter::Bicubic })
    }
}
