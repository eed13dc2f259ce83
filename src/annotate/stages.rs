//! The model stages behind one trait, and the ordered fallback chain that runs them.
//!
//! A stage turns a batch of RGB images into one [`Prediction`] per image. A [`ModelChain`] holds a
//! stage's primary model and its fallbacks: the first model that loads is used, in batches planned
//! from the memory budget that halve when a pass runs out of memory; when a batch fails otherwise,
//! its images are retried one by one, and an image that still fails moves on to the next model.
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use candle_core::{DType, Device};
use image::RgbImage;

use super::config::{Config, ModelSpec, StageKind};
use crate::error::{Error, Result};
use crate::runner::{BatchSetting, ItemRunner, MemoryBudget, MemoryFailure, PassLog};
use crate::tasks::segment::{ClassMap, Segmenter};
use crate::models::chmv2::Precision;
use crate::tasks::chm::ChmEstimator;
use crate::tasks::depth::DepthEstimator;
use crate::tasks::open_vocab::{open_sam3, OpenVocabSegmenter};
use crate::tasks::tiles::{depth_default, open_vocab_default, seg_default, ChmTiles, DepthTiles, OpenVocabTiles, SegTiles, CHM_DEFAULT};
use crate::tiling::{Output, TileModel};

/// The class names, palette and PNG metadata of a segmentation model's output.
#[derive(Debug)]
pub struct ClassInfo {
    /// Output classes and palette.
    pub map: ClassMap,
    /// The `edgerun:classes` metadata JSON.
    pub metadata: String,
}

/// One image's result.
#[derive(Debug)]
pub enum Prediction {
    /// A float map at the image's size (depth, CHM).
    Float {
        /// Rows.
        height: usize,
        /// Columns.
        width: usize,
        /// Row-major values.
        values: Vec<f32>,
    },
    /// uint8 class ids at the image's size.
    Classes {
        /// Rows.
        height: usize,
        /// Columns.
        width: usize,
        /// Row-major class ids.
        ids: Vec<u8>,
        /// What the ids mean.
        classes: Arc<ClassInfo>,
    },
}

impl Prediction {
    /// `(height, width)`.
    pub fn size(&self) -> (usize, usize) {
        match self {
            Prediction::Float { height, width, .. } | Prediction::Classes { height, width, .. } => (*height, *width),
        }
    }
}

/// A stage's model as tiled inference runs it.
pub(crate) struct Tiling<'a> {
    /// The model on tiles.
    pub model: Box<dyn TileModel + 'a>,
    /// What the tiled GeoTIFF holds.
    pub output: Output,
    /// The model's default `(tile, overlap)`.
    pub default: (usize, usize),
}

/// A loaded model stage.
pub(crate) trait Stage {
    /// The model on tiles.
    fn tiling(&self) -> Tiling<'_>;
    /// One prediction per image, in order.
    fn predict(&self, images: &[&RgbImage]) -> Result<Vec<Prediction>>;
    /// Estimated activation bytes of one image in a forward pass (for `batch = "auto"`).
    fn activation_bytes(&self, image: &RgbImage) -> Option<u64>;
    /// The device the model runs on.
    fn device(&self) -> &Device;
}

struct DepthStage(DepthEstimator);

impl Stage for DepthStage {
    fn tiling(&self) -> Tiling<'_> {
        Tiling { model: Box::new(DepthTiles { est: &self.0 }), output: Output::Float { nodata: Some(f32::NAN) }, default: depth_default(&self.0) }
    }
    fn predict(&self, images: &[&RgbImage]) -> Result<Vec<Prediction>> {
        Ok(self
            .0
            .predict(images, images.len().max(1))?
            .into_iter()
            .map(|d| Prediction::Float { height: d.height, width: d.width, values: d.values })
            .collect())
    }
    fn activation_bytes(&self, image: &RgbImage) -> Option<u64> {
        self.0.activation_bytes(image)
    }
    fn device(&self) -> &Device {
        self.0.device()
    }
}

struct ChmStage(ChmEstimator);

impl Stage for ChmStage {
    fn tiling(&self) -> Tiling<'_> {
        // Heights where the source is no-data get its GDAL_NODATA value, as `edgerun chm` writes them.
        Tiling { model: Box::new(ChmTiles { est: &self.0 }), output: Output::Float { nodata: None }, default: CHM_DEFAULT }
    }
    fn predict(&self, images: &[&RgbImage]) -> Result<Vec<Prediction>> {
        let labels: Vec<String> = (0..images.len()).map(|i| format!("image {i} of the batch")).collect();
        Ok(self
            .0
            .predict(images, &labels, images.len().max(1))?
            .into_iter()
            .map(|d| Prediction::Float { height: d.height, width: d.width, values: d.values })
            .collect())
    }
    fn activation_bytes(&self, image: &RgbImage) -> Option<u64> {
        self.0.activation_bytes(image)
    }
    fn device(&self) -> &Device {
        self.0.device()
    }
}

struct SegStage {
    seg: Segmenter,
    classes: Arc<ClassInfo>,
}

impl Stage for SegStage {
    fn tiling(&self) -> Tiling<'_> {
        let output = Output::Classes { lut: self.classes.map.lut.clone(), description: Some(self.classes.metadata.clone()), floor: None };
        Tiling { model: Box::new(SegTiles { seg: &self.seg }), output, default: seg_default(&self.seg) }
    }
    fn predict(&self, images: &[&RgbImage]) -> Result<Vec<Prediction>> {
        let masks = self.seg.segment(images)?;
        images
            .iter()
            .zip(masks)
            .map(|(im, ids)| {
                Ok(Prediction::Classes {
                    height: im.height() as usize,
                    width: im.width() as usize,
                    ids: self.classes.map.apply(&ids)?,
                    classes: self.classes.clone(),
                })
            })
            .collect()
    }
    fn activation_bytes(&self, image: &RgbImage) -> Option<u64> {
        self.seg.activation_bytes(image)
    }
    fn device(&self) -> &Device {
        self.seg.device()
    }
}

/// SAM 3 as an open-vocabulary segmenter (SegEarth-OV-3) of the configured classes.
struct OpenVocabStage {
    seg: OpenVocabSegmenter,
    classes: Arc<ClassInfo>,
}

impl Stage for OpenVocabStage {
    fn tiling(&self) -> Tiling<'_> {
        let p = self.seg.params();
        let output = Output::Classes { lut: self.classes.map.lut.clone(), description: Some(self.classes.metadata.clone()), floor: Some((p.prob_thd, p.bg_idx)) };
        Tiling { model: Box::new(OpenVocabTiles { seg: &self.seg }), output, default: open_vocab_default(&self.seg) }
    }
    fn predict(&self, images: &[&RgbImage]) -> Result<Vec<Prediction>> {
        images
            .iter()
            .map(|im| {
                let (ids, _) = self.seg.segment(im)?;
                Ok(Prediction::Classes { height: im.height() as usize, width: im.width() as usize, ids, classes: self.classes.clone() })
            })
            .collect()
    }
    fn activation_bytes(&self, image: &RgbImage) -> Option<u64> {
        self.seg.activation_bytes(image)
    }
    fn device(&self) -> &Device {
        self.seg.device()
    }
}

/// Devices opened so far, shared by stages that name the same one.
#[derive(Default)]
pub struct Devices(HashMap<String, Device>);

impl Devices {
    /// The device for a `--device` spec.
    pub fn get(&mut self, spec: &str) -> Result<Device> {
        if let Some(d) = self.0.get(spec) {
            return Ok(d.clone());
        }
        let d = crate::device::parse_device(spec)?;
        self.0.insert(spec.to_string(), d.clone());
        Ok(d)
    }
}

/// Loads one model of a stage.
pub(crate) fn load_stage(kind: StageKind, spec: &ModelSpec, cfg: &Config, devices: &mut Devices) -> Result<Box<dyn Stage>> {
    let device = devices.get(&spec.device)?;
    let dtype: DType = crate::device::parse_dtype(&spec.dtype)?;
    if !spec.path.exists() {
        return Err(Error::Config(format!("model {} does not exist", spec.path.display())));
    }
    match kind {
        StageKind::Depth => Ok(Box::new(DepthStage(DepthEstimator::load(&spec.path, &device, dtype)?))),
        StageKind::Segmentation => {
            let open_vocab = cfg.segmentation_classes();
            if let Some(ckpt) = open_sam3(&spec.path)? {
                let (classes, params) = open_vocab.resolve(Some(ckpt.store()))?;
                let seg = OpenVocabSegmenter::load(&ckpt, &device, dtype, classes, params)?;
                let (map, metadata) = (ClassMap::identity(&seg.classes().names())?, seg.metadata_json());
                return Ok(Box::new(OpenVocabStage { seg, classes: Arc::new(ClassInfo { map, metadata }) }));
            }
            let mut seg = Segmenter::load(&spec.path, &device, dtype)?;
            if let [h, w] = cfg.segmentation.input_size[..] {
                seg.set_input_size(Some((h, w)));
            }
            let map = if open_vocab.names_classes() {
                let (classes, params) = open_vocab.resolve(None)?;
                ClassMap::by_synonyms(seg.labels(), &classes.classes, params.bg_idx)?
            } else if cfg.segmentation.classes.trim().is_empty() {
                ClassMap::identity(seg.labels())?
            } else {
                ClassMap::load(&cfg.resolve(&cfg.segmentation.classes), seg.labels())?
            };
            let metadata = map.metadata_json();
            Ok(Box::new(SegStage { seg, classes: Arc::new(ClassInfo { map, metadata }) }))
        }
        StageKind::Chm => {
            let head = match &cfg.chm.head_dtype {
                Some(h) => crate::device::parse_dtype(h)?,
                None => dtype,
            };
            Ok(Box::new(ChmStage(ChmEstimator::load(&spec.path, &device, Precision { backbone: dtype, head })?)))
        }
        StageKind::Edges => Err(Error::Config("edges has no model".into())),
    }
}

enum Slot {
    Unloaded,
    Ready(Box<dyn Stage>),
    Broken(String),
}

/// A stage's models in fallback order.
pub struct ModelChain {
    kind: StageKind,
    specs: Vec<ModelSpec>,
    slots: Vec<Slot>,
    /// The first working model's runner (per chain, across chunks): its index and the runner.
    runner: Option<(usize, ItemRunner)>,
    /// The stage's pass log ([`PassLog`]) and the ceiling its recovery set.
    passes: Option<PassLog>,
    ceiling: Option<usize>,
}

/// A runner for model `stage` of a stage: the budget is measured once per model, after it has
/// loaded; under `auto`, where it came from goes to `log`.
pub(crate) fn stage_runner(cfg: &Config, stage: &dyn Stage, log: &mut dyn FnMut(String)) -> ItemRunner {
    let (budget, why) = MemoryBudget::explain(cfg.mem_budget_mb, stage.device()).unwrap_or((MemoryBudget::FALLBACK, "1024 MiB (fallback)".into()));
    if cfg.batch == BatchSetting::Auto {
        log(format!("memory budget {why}"));
    }
    ItemRunner::new(cfg.batch, budget)
}

/// Runs one pass of `units` over `keys` between its `begin` and `end` in `passes` (when kept); a
/// failure to record either is kept in `fatal` (it ends the run) and fails the pass.
fn recorded<T>(
    passes: &mut Option<PassLog>,
    fatal: &mut Option<Error>,
    keys: &[&str],
    f: impl FnOnce() -> std::result::Result<T, StageFailure>,
) -> std::result::Result<T, StageFailure> {
    if let Some(p) = passes.as_mut() {
        if let Err(e) = p.begin(keys.len(), keys) {
            let msg = e.to_string();
            fatal.get_or_insert(e);
            return Err(StageFailure::Misfit(format!("the pass could not be recorded: {msg}")));
        }
    }
    let r = f();
    if let Some(Err(e)) = passes.as_mut().map(PassLog::end) {
        fatal.get_or_insert(e);
    }
    r
}

/// Why a stage's model failed on a batch.
#[derive(Debug)]
enum StageFailure {
    /// It returned an error.
    Failed(Error),
    /// It panicked (the message).
    Panicked(String),
    /// It returned results that do not fit the images.
    Misfit(String),
}

impl std::fmt::Display for StageFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StageFailure::Failed(e) => write!(f, "{e}"),
            StageFailure::Panicked(m) => write!(f, "panicked: {m}"),
            StageFailure::Misfit(m) => f.write_str(m),
        }
    }
}

impl MemoryFailure for StageFailure {
    fn is_out_of_memory(&self) -> bool {
        matches!(self, StageFailure::Failed(e) if e.is_out_of_memory())
    }
}

fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".into()
    }
}

/// Runs a stage, turning errors, panics and wrong result counts or sizes into a [`StageFailure`].
fn guarded(stage: &dyn Stage, images: &[&RgbImage]) -> std::result::Result<Vec<Prediction>, StageFailure> {
    let r = catch_unwind(AssertUnwindSafe(|| stage.predict(images))).map_err(|p| StageFailure::Panicked(panic_message(p)))?;
    let preds = r.map_err(StageFailure::Failed)?;
    if preds.len() != images.len() {
        return Err(StageFailure::Misfit(format!("returned {} results for {} images", preds.len(), images.len())));
    }
    for (p, im) in preds.iter().zip(images) {
        if p.size() != (im.height() as usize, im.width() as usize) {
            return Err(StageFailure::Misfit(format!("returned a {:?} map for a {}×{} image", p.size(), im.width(), im.height())));
        }
    }
    Ok(preds)
}

impl ModelChain {
    /// The chain of a model stage as configured (nothing loaded yet).
    pub fn new(kind: StageKind, cfg: &Config) -> Result<Self> {
        let specs = cfg.model_chain(kind)?;
        let slots = specs.iter().map(|_| Slot::Unloaded).collect();
        Ok(ModelChain { kind, specs, slots, runner: None, passes: None, ceiling: None })
    }

    /// Records every pass in `passes`; at most `ceiling` images per pass (a run killed for memory).
    pub fn set_passes(&mut self, passes: PassLog, ceiling: Option<usize>) {
        self.passes = Some(passes);
        self.ceiling = ceiling;
    }

    /// The stage.
    pub fn kind(&self) -> StageKind {
        self.kind
    }

    /// The journal name of model `i`.
    pub fn model_name(&self, i: usize) -> &str {
        &self.specs[i].name
    }

    /// The model batches go to first (the first that loaded) and the device it runs on.
    pub(crate) fn in_use(&self) -> Option<(&str, String)> {
        self.slots.iter().zip(&self.specs).find_map(|(slot, spec)| match slot {
            Slot::Ready(stage) => Some((
                spec.name.as_str(),
                match stage.device().location() {
                    candle_core::DeviceLocation::Cpu => "cpu".to_string(),
                    candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
                    candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
                },
            )),
            _ => None,
        })
    }

    fn load(&mut self, i: usize, cfg: &Config, devices: &mut Devices, warn: &mut dyn FnMut(String)) -> bool {
        if let Slot::Unloaded = self.slots[i] {
            self.slots[i] = match load_stage(self.kind, &self.specs[i], cfg, devices) {
                Ok(s) => Slot::Ready(s),
                Err(e) => {
                    let m = e.to_string();
                    warn(format!("{}: cannot load model {}: {m}", self.kind.name(), self.specs[i].name));
                    Slot::Broken(m)
                }
            };
        }
        matches!(self.slots[i], Slot::Ready(_))
    }

    /// Loads models in order until one loads (the one batches go to first); errors when none does.
    pub(crate) fn load_primary(&mut self, cfg: &Config, devices: &mut Devices, warn: &mut dyn FnMut(String)) -> Result<usize> {
        for i in 0..self.specs.len() {
            if self.load(i, cfg, devices, warn) {
                return Ok(i);
            }
        }
        let why: Vec<String> = self
            .specs
            .iter()
            .zip(&self.slots)
            .map(|(s, slot)| format!("{}: {}", s.name, if let Slot::Broken(m) = slot { m.as_str() } else { "not loaded" }))
            .collect();
        Err(Error::Config(format!("no {} model could be loaded ({})", self.kind.name(), why.join("; "))))
    }

    /// Runs `f` (one tiled input) on the stage's models in fallback order until one succeeds:
    /// `(result, model index)`, or every model's reason (errors and panics alike).
    pub(crate) fn first_success<T>(
        &mut self,
        cfg: &Config,
        devices: &mut Devices,
        warn: &mut dyn FnMut(String),
        mut f: impl FnMut(&dyn Stage) -> Result<T>,
    ) -> std::result::Result<(T, usize), String> {
        let mut reasons = Vec::new();
        for m in 0..self.specs.len() {
            if !self.load(m, cfg, devices, warn) {
                continue;
            }
            let Slot::Ready(stage) = &self.slots[m] else { continue };
            match catch_unwind(AssertUnwindSafe(|| f(stage.as_ref()))) {
                Ok(Ok(t)) => return Ok((t, m)),
                Ok(Err(e)) => reasons.push(format!("{}: {e}", self.specs[m].name)),
                Err(p) => reasons.push(format!("{}: panicked: {}", self.specs[m].name, panic_message(p))),
            }
        }
        Err(if reasons.is_empty() { "no model of this stage could be loaded".into() } else { reasons.join("; ") })
    }

    /// Predicts for every image (`keys[i]` names `images[i]` in the pass log): `(prediction, model
    /// index)` or the reasons every model failed; an error when a pass could not be recorded.
    pub fn predict(
        &mut self,
        images: &[&RgbImage],
        keys: &[&str],
        cfg: &Config,
        devices: &mut Devices,
        warn: &mut dyn FnMut(String),
    ) -> Result<Vec<std::result::Result<(Prediction, usize), String>>> {
        let n = images.len();
        if keys.len() != n {
            return Err(Error::Config(format!("{} keys for {n} images (a bug)", keys.len())));
        }
        let mut fatal: Option<Error> = None;
        let mut out: Vec<Option<(Prediction, usize)>> = (0..n).map(|_| None).collect();
        let mut reasons: Vec<Vec<String>> = vec![Vec::new(); n];
        let mut first = true;
        for m in 0..self.specs.len() {
            let todo: Vec<usize> = (0..n).filter(|&i| out[i].is_none()).collect();
            if todo.is_empty() {
                break;
            }
            if !self.load(m, cfg, devices, warn) {
                continue;
            }
            let Slot::Ready(stage) = &self.slots[m] else { continue };
            let name = &self.specs[m].name;
            // The first working model gets the images in planned batches (halved when memory runs
            // out, retried one by one after another failure); later models take them one at a time.
            if first {
                first = false;
                let stage_name = self.kind.name();
                if self.runner.as_ref().is_none_or(|(model, _)| *model != m) {
                    let mut r = stage_runner(cfg, stage.as_ref(), &mut |msg| warn(format!("{stage_name}: {msg}")));
                    if let Some(c) = self.ceiling {
                        r.limit_to(c);
                    }
                    self.runner = Some((m, r));
                }
                let Some((_, runner)) = self.runner.as_mut() else { continue };
                let worst = images.iter().filter_map(|im| stage.activation_bytes(im).map(|b| b + im.as_raw().len() as u64)).max();
                runner.plan(worst, cfg.chunk_len(), &mut |msg| warn(format!("{stage_name}: {msg}")));
                let results = runner.batch().run(
                    &todo,
                    Some(stage.device()),
                    |got, want| StageFailure::Misfit(format!("returned {got} results for {want} images")),
                    &mut |msg| warn(format!("{stage_name}: {msg}")),
                    |idx| {
                        let names: Vec<&str> = idx.iter().map(|&i| keys[i]).collect();
                        recorded(&mut self.passes, &mut fatal, &names, || guarded(stage.as_ref(), &idx.iter().map(|&i| images[i]).collect::<Vec<_>>()))
                    },
                );
                for (&i, r) in todo.iter().zip(results) {
                    match r {
                        Ok(p) => out[i] = Some((p, m)),
                        Err(e) => reasons[i].push(format!("{name}: {e}")),
                    }
                }
                continue;
            }
            for i in todo {
                match recorded(&mut self.passes, &mut fatal, &keys[i..i + 1], || guarded(stage.as_ref(), &images[i..i + 1])) {
                    Ok(mut p) => out[i] = p.pop().map(|p| (p, m)),
                    Err(e) => reasons[i].push(format!("{name}: {e}")),
                }
            }
        }
        if let Some(e) = fatal {
            return Err(e);
        }
        Ok(out
            .into_iter()
            .zip(reasons)
            .map(|(o, r)| match o {
                Some(x) => Ok(x),
                None if r.is_empty() => Err("no model of this stage could be loaded".into()),
                None => Err(r.join("; ")),
            })
            .collect())
    }
}
