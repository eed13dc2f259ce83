//! Open-vocabulary semantic segmentation: SegEarth-OV-3 ("Exploring SAM 3 for Open-Vocabulary
//! Semantic Segmentation in Remote Sensing Images"; `earth-insights/SegEarth-OV-3`) on SAM 3. Each
//! view is resized to the model's input (aspect not kept), its image side run once; the prompts'
//! features are computed once per run and grounded in a batch; each prompt's score map, the sliding
//! window, the classes' maxima over their synonyms and the thresholded argmax follow the official
//! segmentor ([`scores`]).
pub mod classes;
pub mod presets;
pub mod scores;
pub mod spec;

use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device};
use image::RgbImage;

use crate::error::{Error, Result};
use crate::models::footprint::Footprint;
use crate::models::processor::ImageProcessor;
use crate::models::sam3::{PromptFeatures, Sam3};
use crate::models::Checkpoint;
use crate::weights::Vb;
pub use classes::ClassList;
pub use scores::ClassScores;
pub use spec::{parse_slide, OpenVocabSpec};

/// The official defaults: `confidence_threshold`, `prob_thd`, `bg_idx`.
pub const DEFAULT_CONF: f32 = 0.5;
/// See [`DEFAULT_CONF`].
pub const DEFAULT_PROB_THD: f32 = 0.0;

/// The sliding window: square crops of `crop` pixels every `stride` pixels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slide {
    /// Crop side.
    pub crop: usize,
    /// Step between crops.
    pub stride: usize,
}

/// How scores become classes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Params {
    /// A query counts when its score σ(logit)·presence exceeds this (strictly).
    pub conf: f32,
    /// Pixels whose best class score is below this take `bg_idx`.
    pub prob_thd: f32,
    /// The class id of pixels below `prob_thd`.
    pub bg_idx: u8,
    /// Sliding-window inference (used only on images larger than the crop).
    pub slide: Option<Slide>,
}

impl Default for Params {
    fn default() -> Self {
        Params { conf: DEFAULT_CONF, prob_thd: DEFAULT_PROB_THD, bg_idx: 0, slide: None }
    }
}

impl Params {
    /// Checks the numbers against `classes` classes.
    pub fn validate(&self, classes: usize) -> std::result::Result<(), String> {
        if !(self.conf.is_finite() && (0.0..=1.0).contains(&self.conf)) {
            return Err(format!("conf {} is not in 0..1", self.conf));
        }
        if !self.prob_thd.is_finite() {
            return Err(format!("prob_thd {} is not a number", self.prob_thd));
        }
        if self.bg_idx as usize >= classes && self.bg_idx != NO_DATA_CLASS {
            return Err(format!("bg_idx {} is not a class id (0 to {}) or 255 (no data)", self.bg_idx, classes - 1));
        }
        if let Some(s) = self.slide {
            if s.crop == 0 || s.stride == 0 || s.stride > s.crop || s.crop > MAX_SLIDE {
                return Err(format!("slide {}:{}: the crop must be 1 to {MAX_SLIDE} and the stride 1 to the crop", s.crop, s.stride));
            }
        }
        Ok(())
    }
}

/// The class id of no-data pixels (`bg_idx` may take it).
pub const NO_DATA_CLASS: u8 = 255;

/// The largest sliding-window crop.
pub const MAX_SLIDE: usize = 16384;

/// SAM 3 as an open-vocabulary segmenter of a fixed class list.
pub struct OpenVocabSegmenter {
    model: Sam3,
    processor: Arc<dyn ImageProcessor>,
    prompts: PromptFeatures,
    classes: ClassList,
    params: Params,
    footprint: Option<Footprint>,
    device: Device,
}

impl OpenVocabSegmenter {
    /// Loads the SAM 3 checkpoint `ckpt` on `device` in `dtype` and computes the prompts' features
    /// (stored ones read from the file).
    pub fn load(ckpt: &Checkpoint, device: &Device, dtype: DType, classes: ClassList, params: Params) -> Result<Self> {
        let config = ckpt.config::<crate::models::sam3::Config>().ok_or_else(|| {
            Error::Config(format!("{}: a `{}` model, not SAM 3: open-vocabulary classes need a SAM 3 model", ckpt.path().display(), ckpt.architecture()))
        })?;
        params.validate(classes.len()).map_err(Error::Config)?;
        let vb = Vb::new(ckpt.store().clone(), dtype, device.clone());
        let model = ckpt.built(|| Sam3::load(&vb, config))?;
        let processor = ckpt.processor()?.ok_or_else(|| Error::Config("SAM 3 without an image processor (a bug)".into()))?;
        let prompts = model.prompt_features(&classes.prompts)?;
        Ok(OpenVocabSegmenter { model, processor, prompts, classes, params, footprint: ckpt.footprint(dtype), device: device.clone() })
    }

    /// Is `model` a SAM 3 checkpoint (an open-vocabulary segmenter)?
    pub fn is_sam3(ckpt: &Checkpoint) -> bool {
        ckpt.config::<crate::models::sam3::Config>().is_some()
    }

    /// The classes.
    pub fn classes(&self) -> &ClassList {
        &self.classes
    }

    /// The parameters.
    pub fn params(&self) -> &Params {
        &self.params
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The model's input side (each view is resized to it).
    pub fn input_side(&self) -> usize {
        self.processor.working_size()
    }

    /// Activation bytes of one view, beside the score planes of `image`.
    pub fn activation_bytes(&self, image: &RgbImage) -> Option<u64> {
        let side = self.input_side();
        let view = self.footprint.as_ref()?.per_item((side, side), (side, side));
        let planes = (self.classes.len() + self.score_planes(image)) as u64;
        Some(view + planes * image.width() as u64 * image.height() as u64 * 4)
    }

    /// The per-prompt planes a sliding window sums in (none without one).
    fn score_planes(&self, image: &RgbImage) -> usize {
        if self.slides(image.width() as usize, image.height() as usize).is_some() {
            self.classes.prompts.len() + 1
        } else {
            1
        }
    }

    fn slides(&self, w: usize, h: usize) -> Option<Slide> {
        self.params.slide.filter(|s| s.crop < w || s.crop < h)
    }

    /// The per-class scores of `image` (SegEarth-OV-3's `predict` before its argmax).
    pub fn scores(&self, image: &RgbImage) -> Result<ClassScores> {
        let (w, h) = (image.width() as usize, image.height() as usize);
        if w == 0 || h == 0 {
            return Err(Error::Input("an empty image".into()));
        }
        let plane = w * h;
        let c = self.classes.len();
        let mut class_scores = ClassScores { classes: c, height: h, width: w, values: vec![0f32; c * plane] };
        let Some(slide) = self.slides(w, h) else {
            self.view(image, &mut |q, map| {
                for (class, members) in self.classes.members.iter().enumerate() {
                    if members.contains(&q) {
                        scores::max_into(&mut class_scores.values[class * plane..][..plane], map);
                    }
                }
                Ok(())
            })?;
            return Ok(class_scores);
        };
        let p = self.classes.prompts.len();
        let mut sums = vec![0f32; p * plane];
        let mut count = vec![0f32; plane];
        for (x0, y0, x1, y1) in scores::windows(w, h, slide.crop, slide.stride) {
            let crop = image::imageops::crop_imm(image, x0 as u32, y0 as u32, (x1 - x0) as u32, (y1 - y0) as u32).to_image();
            let cw = x1 - x0;
            self.view(&crop, &mut |q, map| {
                let dst = &mut sums[q * plane..][..plane];
                for (r, src) in map.chunks(cw).enumerate() {
                    dst[(y0 + r) * w + x0..][..cw].iter_mut().zip(src).for_each(|(d, s)| *d += s);
                }
                Ok(())
            })?;
            for y in y0..y1 {
                count[y * w + x0..y * w + x1].iter_mut().for_each(|n| *n += 1.0);
            }
        }
        for q in 0..p {
            sums[q * plane..][..plane].iter_mut().zip(&count).for_each(|(s, n)| *s /= n);
        }
        for (class, members) in self.classes.members.iter().enumerate() {
            for &q in members {
                scores::max_into(&mut class_scores.values[class * plane..][..plane], &sums[q * plane..][..plane]);
            }
        }
        Ok(class_scores)
    }

    /// The class table written beside a class map: names, each class's prompts, the parameters.
    pub fn metadata_json(&self) -> String {
        serde_json::json!({
            "classes": self.classes.names(),
            "ignore_index": NO_DATA_CLASS,
            "method": "SegEarth-OV-3 (SAM 3)",
            "prompts": self.classes.classes,
            "conf": self.params.conf,
            "prob_thd": self.params.prob_thd,
            "bg_idx": self.params.bg_idx,
            "slide": self.params.slide.map(|s| [s.crop, s.stride]),
        })
        .to_string()
    }

    /// The class map of `image` and its per-class scores.
    pub fn segment(&self, image: &RgbImage) -> Result<(Vec<u8>, ClassScores)> {
        let s = self.scores(image)?;
        Ok((scores::classify(&s, self.params.prob_thd, self.params.bg_idx), s))
    }

    /// Runs one view: the image side once, every prompt grounded, each prompt's score map at the
    /// view's size handed to `each(prompt, map)`.
    fn view(&self, view: &RgbImage, each: &mut dyn FnMut(usize, &[f32]) -> Result<()>) -> Result<()> {
        let (w, h) = (view.width() as usize, view.height() as usize);
        let pixel_values = self.processor.pixel_values(view, &self.device)?.unsqueeze(0)?;
        let features = self.model.image_features(&pixel_values)?;
        let mut map = vec![0f32; w * h];
        self.model.ground_maps(&features, &self.prompts, self.params.conf, &mut |q, maps| {
            scores::prompt_scores(&maps, h, w, &mut map);
            each(q, &map)
        })
    }
}

/// Opens `model` and tells whether it is a SAM 3 checkpoint.
pub fn open_sam3(model: &Path) -> Result<Option<Checkpoint>> {
    let ckpt = Checkpoint::open(model)?;
    Ok(OpenVocabSegmenter::is_sam3(&ckpt).then_some(ckpt))
}
