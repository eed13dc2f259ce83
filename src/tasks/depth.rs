//! Monocular depth on images: the model's preprocessing (DPT processor for Depth Anything V1/V2,
//! the `depth-anything-3` input processor for DA3), batched forward, resize back to the source.
use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use image::RgbImage;
use serde::Deserialize;

use super::batch::group_by_key;
use crate::memory::backoff::check_injected_oom;
use crate::models::footprint::Footprint;
use crate::config_check::{self, Section, MAX_MULTIPLE};
use crate::error::{Error, Result};
use crate::imageio::cv_resize::{cv_resize, CvInterp};
use crate::imageio::resample::Filter;
use crate::models::da3::{replace_sky_depth, scale_to_metric, Da3Kind, ARCH_ANY_VIEW, ARCH_METRIC, ARCH_MONO};
use crate::models::{Model, NamedTensors};
use crate::nn::interpolate::bicubic_map;
use crate::preprocess::{dpt_output_size, normalize, to_pixel_values, IMAGENET_MEAN, IMAGENET_STD};
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
        let text = crate::fsutil::read_input(&p, crate::fsutil::MAX_TEXT_INPUT)?;
        let cfg: DepthPreprocess = serde_json::from_slice(&text).map_err(|e| Error::bad_file(&p, e.to_string()))?;
        cfg.validate().map_err(|e| config_check::in_file(&p.display().to_string(), e))?;
        Ok(cfg)
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

/// Depth Anything 3's input processing (`InputProcessor`, method `upper_bound_resize`): the longest
/// side to `process_res` (sizes `round(x·s)`, cv2 cubic when enlarging, area otherwise), then each
/// side to the nearest multiple of the patch size (ties up; cubic if a side grows, else area; at
/// least one patch, where the package would produce an unusable 1-pixel side), ImageNet mean/std.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Da3Preprocess {
    /// Longest side after the first resize (504 in the package).
    pub process_res: usize,
    /// Each side becomes a multiple of this.
    pub patch: usize,
    /// Per-channel mean.
    pub mean: [f32; 3],
    /// Per-channel std.
    pub std: [f32; 3],
}

impl Default for Da3Preprocess {
    fn default() -> Self {
        Da3Preprocess { process_res: 504, patch: 14, mean: IMAGENET_MEAN, std: IMAGENET_STD }
    }
}

impl Da3Preprocess {
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

/// A model's image → tensor recipe.
#[derive(Debug, Clone)]
pub enum Preprocess {
    /// transformers `DPTImageProcessor` (Depth Anything V1/V2).
    Dpt(DepthPreprocess),
    /// `depth-anything-3` `InputProcessor`.
    Da3(Da3Preprocess),
}

impl Preprocess {
    /// The network input size for an `h`×`w` image.
    pub fn input_size(&self, h: usize, w: usize) -> (usize, usize) {
        match self {
            Preprocess::Dpt(p) => p.input_size(h, w),
            Preprocess::Da3(p) => p.input_size(h, w),
        }
    }

    /// `[3, H, W]` pixel values at the network input size `(h, w)` (from [`Preprocess::input_size`]).
    pub fn pixel_values(&self, img: &RgbImage, h: usize, w: usize, device: &Device) -> Result<Tensor> {
        match self {
            Preprocess::Dpt(p) => to_pixel_values(img, h, w, Filter::Bicubic, p.image_mean, p.image_std, device),
            Preprocess::Da3(p) => p.pixel_values(img, device),
        }
    }
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

/// Names of the outputs a depth model writes.
#[derive(Debug, Clone, Copy)]
struct Outputs {
    depth: &'static str,
    confidence: Option<&'static str>,
    sky: Option<&'static str>,
}

/// A loaded depth model with its preprocessing.
pub struct DepthEstimator {
    model: Box<dyn Model>,
    outputs: Outputs,
    pre: Preprocess,
    da3: Option<Da3Kind>,
    metric: bool,
    focal: Option<f32>,
    device: Device,
    dtype: DType,
    footprint: Footprint,
}

impl DepthEstimator {
    /// Loads the depth model at `path` (directory or `.gguf`): Depth Anything V1/V2 (`depth_anything`)
    /// or Depth Anything 3 (`da3`, `da3_mono`, `da3_metric`; hub configs name it by `model_name`).
    pub fn load(path: &Path, device: &Device, dtype: DType) -> Result<Self> {
        let store = Arc::new(WeightStore::open(path)?);
        let arch = crate::models::architecture(&store).unwrap_or_default();
        let (outputs, pre, da3) = match arch.as_str() {
            "depth_anything" => (Outputs { depth: "predicted_depth", confidence: None, sky: None }, Preprocess::Dpt(DepthPreprocess::for_model(path)?), None),
            ARCH_ANY_VIEW => (Outputs { depth: "depth", confidence: Some("depth_conf"), sky: None }, Preprocess::Da3(Da3Preprocess::default()), Some(Da3Kind::AnyView)),
            ARCH_MONO | ARCH_METRIC => (
                Outputs { depth: "depth", confidence: None, sky: Some("sky") },
                Preprocess::Da3(Da3Preprocess::default()),
                Some(if arch == ARCH_MONO { Da3Kind::Mono } else { Da3Kind::Metric }),
            ),
            other => return Err(Error::Config(format!("{}: `{other}` is not a depth model", path.display()))),
        };
        let metric = match da3 {
            Some(k) => k == Da3Kind::Metric,
            None => store.config().get("depth_estimation_type").and_then(|v| v.as_str()) == Some("metric"),
        };
        let footprint = Footprint::new(&arch, store.config(), dtype);
        let model = crate::models::load(store, device, dtype)?;
        Ok(DepthEstimator { model, outputs, pre, da3, metric, focal: None, device: device.clone(), dtype, footprint })
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
        self.footprint.per_item(self.pre.input_size(h, w), (h, w))
    }

    /// The device the model runs on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The DA3 family, when the model is a Depth Anything 3 one.
    pub fn da3_kind(&self) -> Option<Da3Kind> {
        self.da3
    }

    /// Whether the model predicts metric depth (DA-V2 metric, DA3Metric) rather than relative depth.
    pub fn is_metric(&self) -> bool {
        self.metric
    }

    /// Replaces the preprocessing (e.g. a DA3 `process_res` other than 504).
    pub fn with_preprocess(mut self, pre: Preprocess) -> Self {
        self.pre = pre;
        self
    }

    /// The preprocessing settings.
    pub fn preprocess(&self) -> &Preprocess {
        &self.pre
    }

    /// Predicts one depth map per image; equal-size images share forward passes of up to `max_batch`.
    pub fn predict(&self, images: &[&RgbImage], max_batch: usize) -> Result<Vec<DepthMap>> {
        Ok(self.predict_all(images, max_batch)?.into_iter().map(|p| p.depth).collect())
    }

    /// Predicts depth and, where the model has them, confidence and sky per image, each resized
    /// (bicubic) to the image's resolution. DA3 images are single views (S = 1).
    pub fn predict_all(&self, images: &[&RgbImage], max_batch: usize) -> Result<Vec<DepthPrediction>> {
        if self.da3 == Some(Da3Kind::Metric) && self.focal.is_none() {
            return Err(Error::Input("DA3Metric gives metric depth only with a focal length: pass --focal (pixels)".into()));
        }
        let sizes: Vec<(usize, usize)> = images.iter().map(|im| self.pre.input_size(im.height() as usize, im.width() as usize)).collect();
        let mut out = Vec::with_capacity(images.len());
        for range in group_by_key(&sizes, max_batch) {
            let (h, w) = sizes[range.start];
            let batch = images[range.clone()].iter().map(|im| self.pre.pixel_values(im, h, w, &self.device)).collect::<Result<Vec<_>>>()?;
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
                if let (Some(Da3Kind::Metric), Some(f)) = (self.da3, self.focal) {
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
