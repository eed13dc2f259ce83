//! transformers' `CHMv2ImageProcessor`: optional keep-aspect resize (off for CHMv2), rescale and
//! normalise in one step, then centre zero-padding to a multiple of 16.
use std::path::Path;

use candle_core::{Device, Tensor};
use image::RgbImage;
use serde::Deserialize;

use crate::config_check::{self, Section, MAX_MULTIPLE};
use crate::error::{Error, Result};
use crate::imageio::resample::{resize, Filter};
use crate::models::processor::{dpt_output_size, processor_file, read_processor, ImageProcessor, Normalization, Size};

/// The side CHMv2 was trained at (416 px tiles of 0.6 m imagery): the default tile of a large raster.
pub(crate) const WORKING_SIZE: usize = 416;

/// CHMv2 mean (RGB).
pub(crate) const CHMV2_MEAN: [f32; 3] = [0.420, 0.411, 0.296];
/// CHMv2 standard deviation (RGB).
pub(crate) const CHMV2_STD: [f32; 3] = [0.213, 0.156, 0.143];

/// `CHMv2ImageProcessor` settings (`preprocessor_config.json`), defaults as that class's.
#[derive(Debug, Clone, Deserialize)]
pub struct Chmv2Processor {
    /// Resize before normalising (off for CHMv2).
    #[serde(default)]
    pub do_resize: bool,
    /// Target size of the keep-aspect resize.
    #[serde(default = "size384")]
    pub size: Size,
    /// Resize output sides are multiples of this.
    #[serde(default = "m16")]
    pub ensure_multiple_of: usize,
    /// Keep the aspect ratio when resizing (the scale closer to 1 wins).
    #[serde(default = "yes")]
    pub keep_aspect_ratio: bool,
    /// PIL resampling filter id (2 bilinear, 3 bicubic).
    #[serde(default = "bicubic")]
    pub resample: u32,
    /// Multiply 8-bit values by `rescale_factor`.
    #[serde(default = "yes")]
    pub do_rescale: bool,
    /// Usually 1/255.
    #[serde(default = "r255")]
    pub rescale_factor: f64,
    /// Subtract the mean and divide by the std.
    #[serde(default = "yes")]
    pub do_normalize: bool,
    /// Per-channel mean.
    #[serde(default = "mean")]
    pub image_mean: [f32; 3],
    /// Per-channel std.
    #[serde(default = "std")]
    pub image_std: [f32; 3],
    /// Centre zero-pad (after normalisation) to a multiple of `size_divisor`.
    #[serde(default = "yes")]
    pub do_pad: bool,
    /// Padding multiple.
    #[serde(default = "m16")]
    pub size_divisor: usize,
}

fn size384() -> Size { Size { height: 384, width: 384 } }
fn m16() -> usize { 16 }
fn yes() -> bool { true }
fn bicubic() -> u32 { 3 }
fn r255() -> f64 { 1.0 / 255.0 }
fn mean() -> [f32; 3] { CHMV2_MEAN }
fn std() -> [f32; 3] { CHMV2_STD }

impl Default for Chmv2Processor {
    fn default() -> Self {
        Chmv2Processor {
            do_resize: false,
            size: size384(),
            ensure_multiple_of: 16,
            keep_aspect_ratio: true,
            resample: 3,
            do_rescale: true,
            rescale_factor: r255(),
            do_normalize: true,
            image_mean: CHMV2_MEAN,
            image_std: CHMV2_STD,
            do_pad: true,
            size_divisor: 16,
        }
    }
}

/// Padding before and after along one axis to reach a multiple of `m` (before = total / 2).
pub fn centre_pad(n: usize, m: usize) -> (usize, usize) {
    let m = m.max(1);
    let total = n.div_ceil(m).saturating_mul(m).saturating_sub(n);
    (total / 2, total - total / 2)
}

impl Chmv2Processor {
    /// Reads `preprocessor_config.json` beside a model (directory or file), or the defaults.
    pub fn for_model(model_path: &Path) -> Result<Self> {
        match processor_file(model_path) {
            Some(p) => Self::from_file(&p),
            None => Ok(Self::default()),
        }
    }

    /// Reads and validates a `preprocessor_config.json`.
    pub fn from_file(p: &Path) -> Result<Self> {
        read_processor(p, Self::validate)
    }

    /// Checks every number against the shared config limits ([`crate::config_check`]).
    pub fn validate(&self) -> Result<()> {
        let s = Section::root();
        s.image_size("size", self.size.height, self.size.width)?;
        s.count("ensure_multiple_of", self.ensure_multiple_of, MAX_MULTIPLE)?;
        s.count("size_divisor", self.size_divisor, MAX_MULTIPLE)?;
        s.mean_std(&self.image_mean, &self.image_std)?;
        s.positive("rescale_factor", self.rescale_factor, 1.0)?;
        self.filter().map_err(|m| s.bad("resample", m))?;
        Ok(())
    }

    /// The resampling filter `resample` names.
    pub fn filter(&self) -> std::result::Result<Filter, String> {
        match self.resample {
            2 => Ok(Filter::Bilinear),
            3 => Ok(Filter::Bicubic),
            r => Err(format!("resample {r} is not supported (2 bilinear, 3 bicubic)")),
        }
    }

    /// The size after the optional resize.
    pub(crate) fn resized_size(&self, h: usize, w: usize) -> (usize, usize) {
        if self.do_resize {
            dpt_output_size(h, w, self.size.height, self.size.width, self.ensure_multiple_of, self.keep_aspect_ratio)
        } else {
            (h, w)
        }
    }

    /// The network input size for an `h`×`w` image (after resize and padding).
    pub fn input_size(&self, h: usize, w: usize) -> (usize, usize) {
        let (h, w) = self.resized_size(h, w);
        if self.do_pad {
            let m = self.size_divisor.max(1);
            (h.div_ceil(m).saturating_mul(m), w.div_ceil(m).saturating_mul(m))
        } else {
            (h, w)
        }
    }

    /// `pixel_values` `[3, H, W]` (f32) for one image, as `CHMv2ImageProcessor` makes them.
    pub fn pixel_values(&self, img: &RgbImage, device: &Device) -> Result<Tensor> {
        let (h0, w0) = (img.height() as usize, img.width() as usize);
        let (ph, pw) = self.input_size(h0, w0);
        let n = config_check::input_elements(ph, pw, 3)?;
        let (h, w) = self.resized_size(h0, w0);
        let resized;
        let img = if (h, w) != (h0, w0) {
            let f = self.filter().map_err(Error::Config)?;
            resized = resize(img, w as u32, h as u32, f);
            &resized
        } else {
            img
        };
        let (top, _) = centre_pad(h, if self.do_pad { self.size_divisor } else { 1 });
        let (left, _) = centre_pad(w, if self.do_pad { self.size_divisor } else { 1 });
        // transformers fuses rescale and normalise: (x − mean/r) / (std/r) in float32.
        let r = self.rescale_factor as f32;
        let (mut m, mut s) = ([0f32; 3], [1f32; 3]);
        for c in 0..3 {
            match (self.do_rescale, self.do_normalize) {
                (true, true) => {
                    m[c] = self.image_mean[c] / r;
                    s[c] = self.image_std[c] / r;
                }
                (false, true) => {
                    m[c] = self.image_mean[c];
                    s[c] = self.image_std[c];
                }
                (true, false) => s[c] = 1.0 / r,
                (false, false) => {}
            }
        }
        let mut data = vec![0f32; n];
        for (i, px) in img.as_raw().chunks_exact(3).enumerate() {
            let (y, x) = (i / w + top, i % w + left);
            for c in 0..3 {
                data[c * ph * pw + y * pw + x] = (px[c] as f32 - m[c]) / s[c];
            }
        }
        Ok(Tensor::from_vec(data, (3, ph, pw), device)?)
    }
}

impl ImageProcessor for Chmv2Processor {
    fn input_size(&self, h: usize, w: usize) -> (usize, usize) {
        Chmv2Processor::input_size(self, h, w)
    }

    fn pixel_values(&self, img: &RgbImage, device: &Device) -> Result<Tensor> {
        Chmv2Processor::pixel_values(self, img, device)
    }

    fn working_size(&self) -> usize {
        WORKING_SIZE
    }

    fn normalization(&self) -> Result<Normalization> {
        Ok(Normalization { mean: self.image_mean, std: self.image_std, filter: self.filter().map_err(Error::Config)? })
    }
}
