//! Canopy height on images: CHMv2 preprocessing (normalise, centre zero-pad to a multiple of 16),
//! batched forward, and the map resized back to the source (bilinear, align_corners=True).
use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use image::RgbImage;
use serde::Deserialize;

use super::batch::group_by_key;
use super::depth::{DepthMap, Size};
use crate::memory::backoff::check_injected_oom;
use crate::models::footprint::Footprint;
use crate::config_check::{self, Section, MAX_MULTIPLE};
use crate::error::{Error, Result};
use crate::imageio::resample::{resize, Filter};
use crate::models::chmv2::{Chmv2, Precision};
use crate::preprocess::dpt_output_size;
use crate::weights::{Vb, WeightStore};

/// A canopy-height map (metres) at the source image's resolution.
pub type HeightMap = DepthMap;

/// CHMv2 mean (RGB).
pub const CHMV2_MEAN: [f32; 3] = [0.420, 0.411, 0.296];
/// CHMv2 standard deviation (RGB).
pub const CHMV2_STD: [f32; 3] = [0.213, 0.156, 0.143];

/// `CHMv2ImageProcessor` settings (`preprocessor_config.json`), defaults as that class's.
#[derive(Debug, Clone, Deserialize)]
pub struct ChmPreprocess {
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

impl Default for ChmPreprocess {
    fn default() -> Self {
        ChmPreprocess {
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

impl ChmPreprocess {
    /// Reads `preprocessor_config.json` beside a model (directory or file), or the defaults.
    pub fn for_model(model_path: &Path) -> Result<Self> {
        let dir = if model_path.is_dir() { model_path.to_path_buf() } else { model_path.parent().unwrap_or(Path::new(".")).to_path_buf() };
        let p = dir.join("preprocessor_config.json");
        if !p.exists() {
            return Ok(Self::default());
        }
        Self::from_file(&p)
    }

    /// Reads and validates a `preprocessor_config.json`.
    pub fn from_file(p: &Path) -> Result<Self> {
        let text = crate::fsutil::read_input(p, crate::fsutil::MAX_TEXT_INPUT)?;
        let cfg: ChmPreprocess = serde_json::from_slice(&text).map_err(|e| Error::bad_file(p, e.to_string()))?;
        cfg.validate().map_err(|e| config_check::in_file(&p.display().to_string(), e))?;
        Ok(cfg)
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
    pub fn resized_size(&self, h: usize, w: usize) -> (usize, usize) {
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

/// A loaded CHMv2 model with its preprocessing.
pub struct ChmEstimator {
    model: Chmv2,
    pre: ChmPreprocess,
    device: Device,
    precision: Precision,
    footprint: Footprint,
}

impl ChmEstimator {
    /// Loads the CHMv2 model at `path` (directory or `.gguf`) with per-part compute dtypes.
    pub fn load(path: &Path, device: &Device, precision: Precision) -> Result<Self> {
        crate::device::check_dtype(device, precision.backbone)?;
        crate::device::check_dtype(device, precision.head)?;
        let store = Arc::new(WeightStore::open(path)?);
        let arch = crate::models::architecture(&store).unwrap_or_default();
        if arch != "chmv2" {
            return Err(Error::Config(format!("{}: `{arch}` is not a CHMv2 canopy-height model", path.display())));
        }
        let cfg = store.config().clone();
        let footprint = Footprint::new(&arch, &cfg, precision.head);
        let vb = Vb::new(store, precision.backbone, device.clone());
        let origin = vb.store().config_origin().to_string();
        let model = Chmv2::load_with(&vb, &cfg, precision).map_err(|e| crate::config_check::in_file(&origin, e))?;
        Ok(ChmEstimator { model, pre: ChmPreprocess::for_model(path)?, device: device.clone(), precision, footprint })
    }

    /// Replaces the preprocessing settings.
    pub fn with_preprocess(mut self, pre: ChmPreprocess) -> Self {
        self.pre = pre;
        self
    }

    /// The preprocessing settings.
    pub fn preprocess(&self) -> &ChmPreprocess {
        &self.pre
    }

    /// Estimated activation bytes of one forward-pass item for `image` (for batch planning).
    pub fn activation_bytes(&self, image: &RgbImage) -> Option<u64> {
        let (h, w) = (image.height() as usize, image.width() as usize);
        self.footprint.per_item(self.pre.input_size(h, w), (h, w))
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
        let sizes: Vec<(usize, usize)> = images.iter().map(|im| self.pre.input_size(im.height() as usize, im.width() as usize)).collect();
        let mut out = Vec::with_capacity(images.len());
        for range in group_by_key(&sizes, max_batch) {
            let batch = images[range.clone()].iter().map(|im| self.pre.pixel_values(im, &self.device)).collect::<Result<Vec<_>>>()?;
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
