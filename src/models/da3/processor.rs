//! Depth Anything 3's input processing (the `depth-anything-3` package's `InputProcessor`).
use candle_core::{Device, Tensor};
use image::RgbImage;

use crate::config_check;
use crate::error::{Error, Result};
use crate::imageio::cv_resize::{cv_resize, CvInterp};
use crate::imageio::resample::Filter;
use crate::models::processor::{normalize, ImageProcessor, Normalization, IMAGENET_MEAN, IMAGENET_STD};

/// Depth Anything 3's input processing (`InputProcessor`, method `upper_bound_resize`): the longest
/// side to `process_res` (sizes `round(x·s)`, cv2 cubic when enlarging, area otherwise), then each
/// side to the nearest multiple of the patch size (ties up; cubic if a side grows, else area; at
/// least one patch, where the package would produce an unusable 1-pixel side), ImageNet mean/std.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Da3Processor {
    /// Longest side after the first resize (504 in the package).
    pub process_res: usize,
    /// Each side becomes a multiple of this.
    pub patch: usize,
    /// Per-channel mean.
    pub mean: [f32; 3],
    /// Per-channel std.
    pub std: [f32; 3],
}

impl Default for Da3Processor {
    fn default() -> Self {
        Da3Processor { process_res: 504, patch: 14, mean: IMAGENET_MEAN, std: IMAGENET_STD }
    }
}

impl Da3Processor {
    /// The size after the longest-side resize and the final network input size, as (h, w) pairs.
    pub fn sizes(&self, h: usize, w: usize) -> ((usize, usize), (usize, usize)) {
        let longest = h.max(w);
        let first = if longest == self.process_res || longest == 0 {
            (h, w)
        } else {
            let s = self.process_res as f64 / longest as f64;
            let r = |x: usize| ((x as f64 * s).round_ties_even() as usize).max(1);
            (r(h), r(w))
        };
        let p = self.patch.max(1);
        let nearest = |x: usize| {
            let down = x / p * p;
            let up = down + p;
            (if up - x <= x - down { up } else { down }).max(p)
        };
        (first, (nearest(first.0), nearest(first.1)))
    }

    /// The network input size for an `h`×`w` image.
    pub fn input_size(&self, h: usize, w: usize) -> (usize, usize) {
        self.sizes(h, w).1
    }

    /// The resized 8-bit image the network sees.
    pub fn resize(&self, img: &RgbImage) -> Result<RgbImage> {
        let (h, w) = (img.height() as usize, img.width() as usize);
        let ((h1, w1), (h2, w2)) = self.sizes(h, w);
        config_check::input_elements(h1, w1, 3)?;
        config_check::input_elements(h2, w2, 3)?;
        let step = |im: &RgbImage, nh: usize, nw: usize, grow: bool| -> Result<RgbImage> {
            if (nh, nw) == (im.height() as usize, im.width() as usize) {
                return Ok(im.clone());
            }
            let (nh, nw) = (u32::try_from(nh).map_err(|_| Error::Input("image too large".into()))?, u32::try_from(nw).map_err(|_| Error::Input("image too large".into()))?);
            cv_resize(im, nw, nh, if grow { CvInterp::Cubic } else { CvInterp::Area })
        };
        let grow1 = self.process_res > h.max(w);
        let first = step(img, h1, w1, grow1)?;
        step(&first, h2, w2, h2 > h1 || w2 > w1)
    }

    /// `[3, H, W]` f32 pixel values for one image.
    pub fn pixel_values(&self, img: &RgbImage, device: &Device) -> Result<Tensor> {
        normalize(&self.resize(img)?, self.mean, self.std, device)
    }
}

impl ImageProcessor for Da3Processor {
    fn input_size(&self, h: usize, w: usize) -> (usize, usize) {
        Da3Processor::input_size(self, h, w)
    }

    fn pixel_values(&self, img: &RgbImage, device: &Device) -> Result<Tensor> {
        Da3Processor::pixel_values(self, img, device)
    }

    fn working_size(&self) -> usize {
        self.process_res
    }

    fn normalization(&self) -> Result<Normalization> {
        Ok(Normalization { mean: self.mean, std: self.std, filter: Filter::Bicubic })
    }
}
