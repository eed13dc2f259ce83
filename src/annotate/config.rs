//! The `annotate` configuration: a TOML file (see [`DEFAULT_CONFIG`]) plus command-line overrides.
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::runner::BatchSetting;
use crate::config_check::Section;
use crate::error::{Error, Result};
use crate::tasks::Task;
use crate::imageio::ImageLimits;

/// Largest `prefetch` (decoded batches queued ahead of the model).
pub(crate) const MAX_PREFETCH: usize = 1024;
/// Largest `decode_threads` / `write_threads`.
pub const MAX_THREADS: usize = 1024;
/// Largest `memory_mb` / `[limits] max_alloc_mb` (1 TiB).
pub(crate) const MAX_MEMORY_MB: usize = 1 << 20;
/// Largest `[journal] sync_every`.
pub(crate) const MAX_SYNC_EVERY: usize = 1 << 20;
/// Largest `sync_interval_s` / `[progress] interval_s` (one day).
pub(crate) const MAX_INTERVAL_S: f64 = 86_400.0;
/// Largest `every` of a stage.
pub(crate) const MAX_EVERY: usize = 1_000_000;
/// Largest `[watch] max_backlog`.
pub(crate) const MAX_BACKLOG: usize = 10_000_000;
/// Largest `[watch] settle_s` / `poll_interval_s` / `status_interval_s` (one hour).
pub(crate) const MAX_WATCH_S: f64 = 3600.0;
/// Largest `[watch] idle_exit_s` (thirty days).
pub(crate) const MAX_IDLE_EXIT_S: f64 = 30.0 * 86_400.0;
/// Largest `[limits] max_side` (pixels per side).
pub(crate) const MAX_IMAGE_SIDE: usize = 1 << 20;
/// Largest `[limits] max_pixels` (16 GiB of RGB8).
pub(crate) const MAX_IMAGE_PIXELS: usize = 1 << 34;

/// A pipeline stage. The pipeline always runs them in this order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StageKind {
    /// Monocular depth (float `.npy`).
    Depth,
    /// Sobel edges of the depth (float `.npy`).
    Edges,
    /// Semantic segmentation (uint8 class-id PNG).
    Segmentation,
    /// Canopy height model (float `.npy`, GeoTIFF when the input is georeferenced).
    Chm,
}

/// The name of the one stage that runs no model.
const EDGES: &str = "edges";

impl StageKind {
    /// All stages, in pipeline order.
    pub const ALL: [StageKind; 4] = [StageKind::Depth, StageKind::Edges, StageKind::Segmentation, StageKind::Chm];

    /// The task a model stage runs (`None` for edges).
    pub fn task(self) -> Option<Task> {
        match self {
            StageKind::Depth => Some(Task::Depth),
            StageKind::Edges => None,
            StageKind::Segmentation => Some(Task::Segmentation),
            StageKind::Chm => Some(Task::CanopyHeight),
        }
    }

    /// The stage's name, which is also its output directory and journal name: its task's name.
    pub fn name(self) -> &'static str {
        self.task().map_or(EDGES, Task::name)
    }

    /// Parses a stage name: `edges`, or a task name or alias (`seg` for `segmentation`).
    pub fn parse(s: &str) -> Result<Self> {
        let s = s.trim().to_ascii_lowercase();
        if s == EDGES {
            return Ok(StageKind::Edges);
        }
        Task::parse(&s)
            .and_then(|t| StageKind::ALL.into_iter().find(|k| k.task() == Some(t)))
            .ok_or_else(|| Error::Config(format!("unknown stage `{s}` (expected depth, edges, segmentation or chm)")))
    }

    /// Whether the stage runs a model.
    pub(crate) fn has_model(self) -> bool {
        self.task().is_some()
    }
}

/// How an input's identity is recorded, to tell on resume whether it is still the same file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Fingerprint {
    /// Size and modification time (cheap: one `stat` at listing time).
    Mtime,
    /// Size and an xxh64 hash of the bytes (survives copies that change mtimes; reads every input once).
    Content,
}

/// The element type of float `.npy` outputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FloatFormat {
    /// IEEE half precision (`<f2`).
    F16,
    /// IEEE single precision (`<f4`).
    F32,
}

/// One model of a stage: a path, optionally with its own device and dtype.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ModelRef {
    /// A model directory or `.gguf` file.
    Path(String),
    /// A model with its own device / dtype.
    Full {
        /// A model directory or `.gguf` file.
        model: String,
        /// Overrides the stage's device.
        #[serde(default)]
        device: Option<String>,
        /// Overrides the stage's dtype.
        #[serde(default)]
        dtype: Option<String>,
    },
}

/// A model resolved for loading.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ModelSpec {
    /// The name recorded in journals: the path as written in the config.
    pub name: String,
    /// The path to load (relative paths resolved against the config file's directory).
    pub path: PathBuf,
    /// Device (`cpu`, `cuda:N`, `metal`, `auto`).
    pub device: String,
    /// Compute dtype (`f32`, `f16`, `bf16`).
    pub dtype: String,
}

/// Settings of a model stage (depth, segmentation, CHM).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelStage {
    /// The primary model.
    #[serde(default)]
    pub model: String,
    /// Models tried in order when the primary cannot load or fails on an image.
    #[serde(default)]
    pub fallback: Vec<ModelRef>,
    /// Overrides the top-level device.
    #[serde(default)]
    pub device: Option<String>,
    /// Overrides the top-level dtype.
    #[serde(default)]
    pub dtype: Option<String>,
    /// Element type of `.npy` outputs (depth, CHM).
    #[serde(default = "f16")]
    pub format: FloatFormat,
    /// Also write a PNG visualisation `<name>.viz.png`.
    #[serde(default)]
    pub visualize: bool,
    /// Segmentation: a class-map TOML (`.toml`: checkpoint labels → project classes), or a class
    /// list (any other file: one class per line, synonyms comma-separated) for a SAM 3 model (and a
    /// SegFormer fallback maps its labels onto it by name); empty = the checkpoint's.
    #[serde(default)]
    pub classes: String,
    /// Segmentation, SAM 3: the classes inline (`;` between classes, `,` between synonyms).
    #[serde(default)]
    pub prompts: String,
    /// Segmentation, SAM 3: a SegEarth-OV-3 dataset setting (`edgerun segment --preset`).
    #[serde(default)]
    pub preset: String,
    /// Segmentation, SAM 3: query score threshold (`--conf`).
    #[serde(default)]
    pub conf: Option<f32>,
    /// Segmentation, SAM 3: class score threshold (`--prob-thd`).
    #[serde(default)]
    pub prob_thd: Option<f32>,
    /// Segmentation, SAM 3: class of pixels below `prob_thd` (`--bg-idx`).
    #[serde(default)]
    pub bg_idx: Option<u8>,
    /// Segmentation, SAM 3: sliding window `[crop, stride]` (`--slide`; a crop of 0 turns it off).
    #[serde(default)]
    pub slide: Option<[usize; 2]>,
    /// Segmentation: network input size `[height, width]`; empty = the model's preprocessor config.
    #[serde(default)]
    pub input_size: Vec<usize>,
    /// CHM: also write a GeoTIFF `<name>.tif` when the input is georeferenced.
    #[serde(default = "yes")]
    pub geotiff: bool,
    /// CHM: compute dtype of the DPT head when it should differ from `dtype` (e.g. f16 backbone, f32 head).
    #[serde(default)]
    pub head_dtype: Option<String>,
    /// Tiled inference tile side in pixels (0 = off, unset = automatic for large GeoTIFFs), as
    /// `--tile` of the direct commands.
    #[serde(default)]
    pub tile: Option<usize>,
    /// Overlap between tiles in pixels, as `--overlap` (unset: the model's default).
    #[serde(default)]
    pub overlap: Option<usize>,
    /// Cadence: the stage runs on the first frame and every K-th after it, in processing order
    /// (the others are recorded as passed over; edges follow depth).
    #[serde(default = "one")]
    pub every: usize,
}

/// Settings of the edges stage.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EdgesStage {
    /// Element type of `.npy` outputs.
    #[serde(default = "f16")]
    pub format: FloatFormat,
    /// Also write a PNG visualisation `<name>.viz.png`.
    #[serde(default)]
    pub visualize: bool,
}

/// Journal durability settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JournalConfig {
    /// fsync the journal after this many records…
    #[serde(default = "sync_every")]
    pub sync_every: usize,
    /// …or this many seconds, whichever comes first.
    #[serde(default = "sync_interval")]
    pub sync_interval_s: f64,
}

/// Input size limits (checked from the header, before decoding).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsConfig {
    /// Largest accepted width or height.
    #[serde(default = "max_side")]
    pub max_side: u32,
    /// Largest accepted pixel count.
    #[serde(default = "max_pixels")]
    pub max_pixels: u64,
    /// Largest decoder allocation in MiB.
    #[serde(default = "max_alloc_mb")]
    pub max_alloc_mb: u64,
}

/// `--watch` settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WatchConfig {
    /// How new files are noticed: `auto` (inotify on Linux, except on network filesystems),
    /// `inotify` or `poll`.
    #[serde(default = "auto")]
    pub backend: String,
    /// A file whose writer was not seen closing it counts as complete once its size and mtime
    /// have not changed for this many seconds.
    #[serde(default = "settle")]
    pub settle_s: f64,
    /// Seconds between re-listings of the tree (polling) and checks of settling files.
    #[serde(default = "poll_interval")]
    pub poll_interval_s: f64,
    /// inotify: a file closed after writing is complete at once (set false when writers close and
    /// reopen a file while writing it).
    #[serde(default = "yes")]
    pub close_is_complete: bool,
    /// `newest` (latest arrival first) or `oldest`.
    #[serde(default = "newest")]
    pub order: String,
    /// Frames waiting beyond this many are recorded as skipped, oldest first (0 = no bound).
    #[serde(default)]
    pub max_backlog: usize,
    /// End the run after this many seconds without a new frame (0 = never).
    #[serde(default)]
    pub idle_exit_s: f64,
    /// Seconds between rewrites of `<output_dir>/status.json`.
    #[serde(default = "status_interval")]
    pub status_interval_s: f64,
}

/// Feedback settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProgressConfig {
    /// `auto` (bar on a terminal, lines otherwise), `bar`, `lines` or `none`.
    #[serde(default = "auto")]
    pub mode: String,
    /// Seconds between plain progress lines.
    #[serde(default = "interval")]
    pub interval_s: f64,
}

/// The whole configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Stages to run (always executed in pipeline order).
    #[serde(default = "default_stages")]
    pub stages: Vec<StageKind>,
    /// Default device.
    #[serde(default = "auto")]
    pub device: String,
    /// Default compute dtype.
    #[serde(default = "f32s")]
    pub dtype: String,
    /// Images per forward pass: `"auto"` (planned from `mem_budget_mb` and the model) or at most N.
    /// Chunks of the sorted input list (N, or [`AUTO_CHUNK`] under `auto`) are the unit of decoding
    /// and sharding; forward passes split a chunk when memory requires.
    #[serde(default = "batch")]
    pub batch: BatchSetting,
    /// Memory for activations in MiB (default: what each stage's device can spare after loading its
    /// model, less 10 %).
    #[serde(default)]
    pub mem_budget_mb: Option<u64>,
    /// Bound in MiB on decoded images and results in flight.
    #[serde(default = "memory_mb")]
    pub memory_mb: u64,
    /// Decode threads (0 = automatic).
    #[serde(default)]
    pub decode_threads: usize,
    /// Decoded batches queued ahead of the model.
    #[serde(default = "prefetch")]
    pub prefetch: usize,
    /// Writer threads.
    #[serde(default = "write_threads")]
    pub write_threads: usize,
    /// Input identity used on resume.
    #[serde(default = "mtime")]
    pub fingerprint: Fingerprint,
    /// Input extensions (case-insensitive).
    #[serde(default = "extensions")]
    pub extensions: Vec<String>,
    /// Journal durability.
    #[serde(default)]
    pub journal: JournalConfig,
    /// Input limits.
    #[serde(default)]
    pub limits: LimitsConfig,
    /// Feedback.
    #[serde(default)]
    pub progress: ProgressConfig,
    /// `--watch`.
    #[serde(default)]
    pub watch: WatchConfig,
    /// Depth stage.
    #[serde(default = "depth_stage")]
    pub depth: ModelStage,
    /// Edges stage.
    #[serde(default)]
    pub edges: EdgesStage,
    /// Segmentation stage.
    #[serde(default = "seg_stage")]
    pub segmentation: ModelStage,
    /// Canopy-height stage.
    #[serde(default = "chm_stage")]
    pub chm: ModelStage,
    /// Directory relative model / class-map paths are resolved against (the config file's).
    #[serde(skip)]
    pub base_dir: PathBuf,
    /// The file the configuration was read from (named in validation errors), if any.
    #[serde(skip)]
    pub source: Option<PathBuf>,
}

fn f16() -> FloatFormat { FloatFormat::F16 }
fn yes() -> bool { true }
fn one() -> usize { 1 }
fn settle() -> f64 { 2.0 }
fn poll_interval() -> f64 { 1.0 }
fn status_interval() -> f64 { 2.0 }
fn newest() -> String { "newest".into() }
fn sync_every() -> usize { 64 }
fn sync_interval() -> f64 { 2.0 }
fn max_side() -> u32 { ImageLimits::default().max_side }
fn max_pixels() -> u64 { ImageLimits::default().max_pixels }
fn max_alloc_mb() -> u64 { ImageLimits::default().max_alloc >> 20 }
fn auto() -> String { "auto".into() }
fn f32s() -> String { "f32".into() }
fn interval() -> f64 { 10.0 }
fn default_stages() -> Vec<StageKind> { vec![StageKind::Depth, StageKind::Edges, StageKind::Segmentation] }
fn batch() -> BatchSetting { BatchSetting::Auto }

/// Chunk length under `batch = "auto"`.
pub(crate) const AUTO_CHUNK: usize = 16;
fn memory_mb() -> u64 { 2048 }
fn prefetch() -> usize { 2 }
fn write_threads() -> usize { 2 }
fn mtime() -> Fingerprint { Fingerprint::Mtime }
fn extensions() -> Vec<String> { crate::imageio::IMAGE_EXTENSIONS.iter().map(|s| s.to_string()).collect() }

fn model_stage(model: &str) -> ModelStage {
    ModelStage {
        model: model.into(),
        fallback: vec![],
        device: None,
        dtype: None,
        format: FloatFormat::F16,
        visualize: false,
        classes: String::new(),
        prompts: String::new(),
        preset: String::new(),
        conf: None,
        prob_thd: None,
        bg_idx: None,
        slide: None,
        input_size: vec![],
        geotiff: true,
        head_dtype: None,
        tile: None,
        overlap: None,
        every: 1,
    }
}
fn depth_stage() -> ModelStage { model_stage("models/depth-anything-v2-small") }
fn seg_stage() -> ModelStage { model_stage("models/segformer-b0") }
fn chm_stage() -> ModelStage { model_stage("models/chm") }

impl Default for JournalConfig {
    fn default() -> Self { JournalConfig { sync_every: sync_every(), sync_interval_s: sync_interval() } }
}
impl Default for LimitsConfig {
    fn default() -> Self { LimitsConfig { max_side: max_side(), max_pixels: max_pixels(), max_alloc_mb: max_alloc_mb() } }
}
impl Default for ProgressConfig {
    fn default() -> Self { ProgressConfig { mode: auto(), interval_s: interval() } }
}
impl Default for WatchConfig {
    fn default() -> Self {
        WatchConfig {
            backend: auto(),
            settle_s: settle(),
            poll_interval_s: poll_interval(),
            close_is_complete: true,
            order: newest(),
            max_backlog: 0,
            idle_exit_s: 0.0,
            status_interval_s: status_interval(),
        }
    }
}
impl Default for EdgesStage {
    fn default() -> Self { EdgesStage { format: FloatFormat::F16, visualize: false } }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            stages: default_stages(),
            device: auto(),
            dtype: f32s(),
            batch: batch(),
            mem_budget_mb: None,
            memory_mb: memory_mb(),
            decode_threads: 0,
            prefetch: prefetch(),
            write_threads: write_threads(),
            fingerprint: mtime(),
            extensions: extensions(),
            journal: JournalConfig::default(),
            limits: LimitsConfig::default(),
            progress: ProgressConfig::default(),
            watch: WatchConfig::default(),
            depth: depth_stage(),
            edges: EdgesStage::default(),
            segmentation: seg_stage(),
            chm: chm_stage(),
            base_dir: PathBuf::from("."),
            source: None,
        }
    }
}

/// The commented default configuration printed by `edgerun annotate --print-config`.
pub const DEFAULT_CONFIG: &str = r#"# edgerun annotate configuration (every key is optional; these are the defaults).
#
#   edgerun annotate --config annotate.toml <input_dir> <output_dir>
#
# Outputs go to <output_dir>/<stage>/, mirroring the input tree with the extension replaced:
# depth, edges, chm: <name>.npy (float16 or float32); segmentation: <name>.png (uint8 class ids);
# visualisations: <name>.viz.png; chm on georeferenced input: <name>.tif.
# Completion journals (JSON lines) are in <output_dir>/manifests/; a killed run resumes where it stopped.

# Stages to run. They always execute in pipeline order: depth, edges, segmentation, chm.
# edges is computed from the depth produced in the same run; run alone it reads <output_dir>/depth/*.npy.
stages = ["depth", "edges", "segmentation"]

# Compute device (cpu, cuda, cuda:N, metal, auto) and dtype (f32, f16, bf16); a stage may override both.
device = "auto"
dtype = "f32"

# Images per forward pass: "auto" plans it from the memory budget and each model's per-image estimate
# (and halves it when a pass runs out of memory, growing back after successes), or a number caps it.
# The sorted input list is cut into chunks (the number, or 16 under "auto") that shards take whole.
batch = "auto"
# Memory for activations in MiB (default: what the device can spare after loading the model, less 10 %).
# mem_budget_mb = 4096
# Bound (MiB) on decoded images and results in flight; decoding pauses when it is reached.
# Model weights and activations are not counted.
memory_mb = 2048
# Threads decoding inputs (0 = automatic: half the cores, at most 8) and decoded batches queued ahead
# of the model.
decode_threads = 0
prefetch = 2
# Threads writing outputs (each write: temp file, fsync, rename, fsync of the directory).
write_threads = 2

# How an input is recognised on resume: "mtime" (size + modification time) or "content"
# (size + xxh64 of the bytes; survives copies that reset mtimes, but reads every new input once).
fingerprint = "mtime"
# Input file extensions (case-insensitive). Other files, and hidden files and directories (names
# starting with "."), are ignored; so is the output directory when it lies inside the input.
extensions = ["png", "jpg", "jpeg", "tif", "tiff"]

[journal]
# The journal is fsynced after this many records or this many seconds, whichever comes first
# (a record is only written once the item's outputs are durable).
sync_every = 64
sync_interval_s = 2.0

[limits]
# Inputs larger than this (from the header, before decoding) are recorded as failed.
max_side = 20000
max_pixels = 120000000
max_alloc_mb = 1024

[progress]
# "auto" (a bar on a terminal, plain lines otherwise), "bar", "lines" or "none"; all on stderr.
mode = "auto"
# Seconds between plain progress lines.
interval_s = 10.0

[watch]
# `edgerun annotate --watch`: keep running and process frames as they land in the input tree
# (docs/watch.md). A file joins the queue once complete: closed after writing (inotify), renamed
# into place from a temporary name (a hidden name such as ".f.jpg.part" or a name without an image
# extension such as "f.jpg.tmp"), or with size and mtime unchanged for settle_s seconds.
# How new files are noticed: "auto" (inotify on Linux, polling on network filesystems and other
# systems), "inotify" or "poll".
backend = "auto"
settle_s = 2.0
# Seconds between re-listings of the tree (polling) and checks of settling files.
poll_interval_s = 1.0
# inotify: a file closed after writing is complete at once; false when writers close and reopen a
# file while writing it (settle_s then decides).
close_is_complete = true
# Which waiting frame goes first: "newest" (latest arrival; frames from one listing by mtime) or
# "oldest" (--order).
order = "newest"
# Frames waiting beyond this many are recorded as skipped, oldest first, with the reason; a later
# run processes them (--max-backlog; 0 = no bound).
max_backlog = 0
# End the run after this many seconds without a new frame (--idle-exit; 0 = never).
idle_exit_s = 0.0
# Seconds between rewrites of <output_dir>/status.json (queue depth, counts, latency, throughput).
status_interval_s = 2.0

[depth]
# Model directory (config.json + model.safetensors) or .gguf; relative paths are relative to this file.
model = "models/depth-anything-v2-small"
# Tried in order when the primary cannot load or fails on an image; the journal records which model
# produced each output. Each entry is a path or { model = "...", device = "cpu", dtype = "f32" }.
fallback = []
# device = "cuda:0"   # overrides the top-level device for this stage
# dtype = "f16"       # overrides the top-level dtype for this stage
format = "f16"        # .npy element type: "f16" or "f32"
visualize = false     # also write a colour-mapped <name>.viz.png
# tile = 518          # tiled inference (as `edgerun depth --tile`): tile side in px; 0 = never; unset =
#                     # GeoTIFFs over 4096 px and TIFFs over the image limits only. A tiled input's
#                     # output is one tiled GeoTIFF <name>.tif (no .npy, no visualisation; edges are not
#                     # computed from a tiled depth map). See docs/tiling.md.
# overlap = 96        # overlap in px (default: the model's). Also in [segmentation] and [chm].
# Cadence: run on the first frame and then every K-th, in processing order (newest first under
# --watch). A frame passed over is journalled as failed with the reason "not run on this frame:
# every = K"; runs with the same cadence leave it, a run with every = 1 processes it. Edges follow
# depth's cadence. Also in [segmentation] and [chm] (e.g. every = 10 for canopy height).
every = 1

[edges]
format = "f16"
visualize = false

[segmentation]
model = "models/segformer-b0"
fallback = []
# Class map (TOML) from checkpoint labels onto project classes; "" keeps the checkpoint's classes.
# With a SAM 3 model (open-vocabulary, SegEarth-OV-3), a class list instead: a file of one class per
# line with comma-separated synonyms, or inline prompts, or a preset; a SegFormer fallback then maps
# its labels onto those classes by name (others: bg_idx), so every output shares one class table.
classes = ""
# prompts = "background;building,roof,house;tree,forest;water,river;road"
# preset = "openearthmap"   # openearthmap, loveda, isaid, potsdam, vaihingen, uavid, udd5, vdd
# conf = 0.5          # a query counts when its score exceeds this
# prob_thd = 0.0      # pixels whose best class score is below this take bg_idx
# bg_idx = 0
# slide = [512, 512]  # sliding window [crop, stride] on images larger than the crop
# Network input size [height, width]; [] uses the model's preprocessor_config.json.
input_size = []
visualize = false     # also write a palette <name>.viz.png
every = 1

[chm]
model = "models/chm"
fallback = []
format = "f16"
visualize = false
geotiff = true        # also write <name>.tif (float32, the input's georeferencing) for GeoTIFF inputs
# head_dtype = "f32"  # DPT-head dtype when it should differ from dtype (e.g. dtype = "f16" on a GPU)
every = 1
"#;

/// Checks a stage's `tile` / `overlap`: a tile of 0 (off) or within the tiling limits, an overlap
/// at most half the tile.
fn check_tiling(tile: Option<usize>, overlap: Option<usize>) -> std::result::Result<(), String> {
    let msg = |e: Error| e.to_string().trim_start_matches("input: ").to_string();
    match (tile, overlap) {
        (Some(0), _) | (None, None) => Ok(()),
        (Some(t), o) => crate::tiling::plan::check_tile(t, o.unwrap_or(0)).map_err(msg),
        (None, Some(o)) => crate::tiling::plan::check_tile(crate::tiling::plan::MAX_TILE, o).map_err(msg),
    }
}

impl Config {
    /// A model stage's `tile` / `overlap` as a tiling request (edges: never tiled).
    pub(crate) fn tile_request(&self, k: StageKind) -> crate::tiling::TileRequest {
        match self.model_stage(k) {
            Some(s) => crate::tiling::TileRequest { tile: s.tile, overlap: s.overlap },
            None => crate::tiling::TileRequest { tile: Some(0), overlap: None },
        }
    }

    /// Parses TOML text; relative paths will resolve against `base_dir`.
    pub fn from_toml(text: &str, base_dir: &Path) -> Result<Self> {
        let mut c: Config = toml::from_str(text).map_err(|e| Error::Config(e.to_string()))?;
        c.base_dir = base_dir.to_path_buf();
        Ok(c)
    }

    /// Reads a config file.
    pub fn load(path: &Path) -> Result<Self> {
        let text = crate::fsutil::read_input_text(path, crate::fsutil::MAX_TEXT_INPUT)?;
        let base = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let mut c = Self::from_toml(&text, base).map_err(|e| match e {
            Error::Config(m) => Error::bad_file(path, m),
            other => other,
        })?;
        c.source = Some(path.to_path_buf());
        Ok(c)
    }

    /// The stages to run, deduplicated, in pipeline order.
    pub(crate) fn stage_list(&self) -> Vec<StageKind> {
        let mut s = self.stages.clone();
        s.sort();
        s.dedup();
        s
    }

    /// The settings of a model stage.
    pub(crate) fn model_stage(&self, k: StageKind) -> Option<&ModelStage> {
        match k {
            StageKind::Depth => Some(&self.depth),
            StageKind::Segmentation => Some(&self.segmentation),
            StageKind::Chm => Some(&self.chm),
            StageKind::Edges => None,
        }
    }

    /// Mutable settings of a model stage.
    pub fn model_stage_mut(&mut self, k: StageKind) -> Option<&mut ModelStage> {
        match k {
            StageKind::Depth => Some(&mut self.depth),
            StageKind::Segmentation => Some(&mut self.segmentation),
            StageKind::Chm => Some(&mut self.chm),
            StageKind::Edges => None,
        }
    }

    /// Whether a stage writes a visualisation.
    pub fn visualize(&self, k: StageKind) -> bool {
        match k {
            StageKind::Edges => self.edges.visualize,
            _ => self.model_stage(k).is_some_and(|s| s.visualize),
        }
    }

    /// A stage's cadence `every` (edges follow depth's).
    pub(crate) fn every(&self, k: StageKind) -> usize {
        let k = if k == StageKind::Edges { StageKind::Depth } else { k };
        self.model_stage(k).map_or(1, |s| s.every.max(1))
    }

    /// The `.npy` element type of a float stage.
    pub(crate) fn float_format(&self, k: StageKind) -> FloatFormat {
        match k {
            StageKind::Edges => self.edges.format,
            _ => self.model_stage(k).map(|s| s.format).unwrap_or(FloatFormat::F16),
        }
    }

    /// Resolves a path from the config against its directory.
    pub fn resolve(&self, p: &str) -> PathBuf {
        let p = Path::new(p);
        if p.is_absolute() {
            p.to_path_buf()
        } else {
            self.base_dir.join(p)
        }
    }

    /// The open-vocabulary classes and thresholds of `[segmentation]` (a `.toml` `classes` is a
    /// SegFormer class map, not a class list).
    pub(crate) fn segmentation_classes(&self) -> crate::tasks::open_vocab::OpenVocabSpec {
        let s = &self.segmentation;
        let nonempty = |v: &str| (!v.trim().is_empty()).then(|| v.to_string());
        let list = nonempty(&s.classes).filter(|c| !c.trim().to_ascii_lowercase().ends_with(".toml"));
        crate::tasks::open_vocab::OpenVocabSpec {
            classes: list.map(|c| self.resolve(&c)),
            prompts: nonempty(&s.prompts),
            preset: nonempty(&s.preset),
            conf: s.conf,
            prob_thd: s.prob_thd,
            bg_idx: s.bg_idx,
            slide: s.slide.map(|[crop, stride]| (crop > 0).then_some(crate::tasks::open_vocab::Slide { crop, stride })),
        }
    }

    /// What of the open-vocabulary keys can be checked before a model and class file are read.
    fn check_open_vocab(&self) -> std::result::Result<(), String> {
        use crate::tasks::open_vocab::{presets, Params, DEFAULT_CONF, DEFAULT_PROB_THD};
        let ov = self.segmentation_classes();
        if ov.classes.is_some() && ov.prompts.is_some() {
            return Err("give `classes` (a class list) or `prompts`, not both".into());
        }
        if let Some(p) = ov.preset.as_deref().filter(|p| presets::preset(p).is_none()) {
            return Err(format!("preset `{p}` is not one of {}", presets::preset_names()));
        }
        let params = Params { conf: ov.conf.unwrap_or(DEFAULT_CONF), prob_thd: ov.prob_thd.unwrap_or(DEFAULT_PROB_THD), bg_idx: 0, slide: ov.slide.flatten() };
        params.validate(crate::tasks::segment::MAX_UINT8_CLASSES)
    }

    /// The primary model and fallbacks of a model stage, in the order they are tried.
    pub(crate) fn model_chain(&self, k: StageKind) -> Result<Vec<ModelSpec>> {
        let s = self.model_stage(k).ok_or_else(|| Error::Config(format!("{} has no model", k.name())))?;
        if s.model.trim().is_empty() {
            return Err(Error::Config(format!("[{}] model is not set", k.name())));
        }
        let dev = s.device.clone().unwrap_or_else(|| self.device.clone());
        let dt = s.dtype.clone().unwrap_or_else(|| self.dtype.clone());
        let mut out = vec![ModelSpec { name: s.model.clone(), path: self.resolve(&s.model), device: dev.clone(), dtype: dt.clone() }];
        for f in &s.fallback {
            out.push(match f {
                ModelRef::Path(p) => ModelSpec { name: p.clone(), path: self.resolve(p), device: dev.clone(), dtype: dt.clone() },
                ModelRef::Full { model, device, dtype } => ModelSpec {
                    name: model.clone(),
                    path: self.resolve(model),
                    device: device.clone().unwrap_or_else(|| dev.clone()),
                    dtype: dtype.clone().unwrap_or_else(|| dt.clone()),
                },
            });
        }
        Ok(out)
    }

    /// The image limits.
    pub(crate) fn image_limits(&self) -> ImageLimits {
        ImageLimits {
            max_side: self.limits.max_side,
            max_pixels: self.limits.max_pixels,
            max_alloc: self.limits.max_alloc_mb.saturating_mul(1 << 20),
        }
    }

    /// Items per chunk of the sorted input list (the unit of decoding and sharding).
    pub(crate) fn chunk_len(&self) -> usize {
        match self.batch {
            BatchSetting::Fixed(n) => n,
            BatchSetting::Auto => AUTO_CHUNK,
        }
    }

    /// Checks values that serde cannot.
    pub fn validate(&self) -> Result<()> {
        self.check().map_err(|e| match &self.source {
            Some(p) => crate::config_check::in_file(&p.display().to_string(), e),
            None => e,
        })
    }

    fn check(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(m));
        if self.stages.is_empty() {
            return bad("`stages` is empty".into());
        }
        let s = Section::root();
        if let BatchSetting::Fixed(n) = self.batch {
            s.count("batch", n, crate::runner::plan::MAX_BATCH)?;
        }
        if let Some(m) = self.mem_budget_mb {
            s.count("mem_budget_mb", m.try_into().unwrap_or(usize::MAX), crate::runner::plan::MAX_BUDGET_MIB as usize)?;
        }
        s.count("prefetch", self.prefetch, MAX_PREFETCH)?;
        s.count("write_threads", self.write_threads, MAX_THREADS)?;
        s.range("decode_threads", self.decode_threads, 0, MAX_THREADS)?;
        s.count("memory_mb", self.memory_mb.try_into().unwrap_or(usize::MAX), MAX_MEMORY_MB)?;
        let j = Section::at("journal");
        j.count("sync_every", self.journal.sync_every, MAX_SYNC_EVERY)?;
        j.real("sync_interval_s", self.journal.sync_interval_s, 0.0, MAX_INTERVAL_S)?;
        Section::at("progress").real("interval_s", self.progress.interval_s, 0.0, MAX_INTERVAL_S)?;
        let w = Section::at("watch");
        w.real("settle_s", self.watch.settle_s, 0.0, MAX_WATCH_S)?;
        w.real("poll_interval_s", self.watch.poll_interval_s, 0.01, MAX_WATCH_S)?;
        w.real("status_interval_s", self.watch.status_interval_s, 0.1, MAX_WATCH_S)?;
        w.real("idle_exit_s", self.watch.idle_exit_s, 0.0, MAX_IDLE_EXIT_S)?;
        w.range("max_backlog", self.watch.max_backlog, 0, MAX_BACKLOG)?;
        if !matches!(self.watch.backend.as_str(), "auto" | "inotify" | "poll") {
            return bad(format!("[watch] backend `{}` is not auto, inotify or poll", self.watch.backend));
        }
        if !matches!(self.watch.order.as_str(), "newest" | "oldest") {
            return bad(format!("[watch] order `{}` is not newest or oldest", self.watch.order));
        }
        let l = Section::at("limits");
        l.count("max_side", self.limits.max_side as usize, MAX_IMAGE_SIDE)?;
        l.count("max_pixels", self.limits.max_pixels.try_into().unwrap_or(usize::MAX), MAX_IMAGE_PIXELS)?;
        l.count("max_alloc_mb", self.limits.max_alloc_mb.try_into().unwrap_or(usize::MAX), MAX_MEMORY_MB)?;
        if self.extensions.is_empty() {
            return bad("`extensions` is empty".into());
        }
        if !matches!(self.progress.mode.as_str(), "auto" | "bar" | "lines" | "none") {
            return bad(format!("[progress] mode `{}` is not auto, bar, lines or none", self.progress.mode));
        }
        match self.segmentation.input_size[..] {
            [] => {}
            [h, w] => {
                Section::at("segmentation").image_size("input_size", h, w)?;
            }
            _ => return bad("[segmentation] input_size must be [] or [height, width]".into()),
        }
        self.check_open_vocab().map_err(|m| Error::Config(format!("[segmentation] {m}")))?;
        crate::device::parse_dtype(&self.dtype).map_err(|e| Error::Config(e.to_string()))?;
        for k in [StageKind::Depth, StageKind::Segmentation, StageKind::Chm] {
            if let Some(s) = self.model_stage(k) {
                check_tiling(s.tile, s.overlap).map_err(|m| Error::Config(format!("[{}] {m}", k.name())))?;
                Section::at(k.name()).count("every", s.every, MAX_EVERY)?;
            }
        }
        for k in self.stage_list() {
            if k.has_model() {
                for m in self.model_chain(k)? {
                    crate::device::parse_dtype(&m.dtype).map_err(|e| Error::Config(format!("[{}] {}: {e}", k.name(), m.name)))?;
                }
                if let Some(h) = self.model_stage(k).and_then(|s| s.head_dtype.as_deref()) {
                    crate::device::parse_dtype(h).map_err(|e| Error::Config(format!("[{}] head_dtype: {e}", k.name())))?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn printed_default_parses_to_the_defaults() {
        let c = Config::from_toml(DEFAULT_CONFIG, Path::new(".")).unwrap();
        assert_eq!(c, Config::default());
        c.validate().unwrap();
    }

    #[test]
    fn fallbacks_take_paths_or_tables_and_unknown_keys_are_rejected() {
        let c = Config::from_toml(
            "[depth]\nmodel = \"a\"\nfallback = [\"b\", { model = \"/c\", device = \"cpu\" }]\n",
            Path::new("/cfg"),
        )
        .unwrap();
        let chain = c.model_chain(StageKind::Depth).unwrap();
        assert_eq!(chain.iter().map(|m| m.path.clone()).collect::<Vec<_>>(), vec![PathBuf::from("/cfg/a"), PathBuf::from("/cfg/b"), PathBuf::from("/c")]);
        assert_eq!(chain[2].device, "cpu");
        assert!(Config::from_toml("batchsize = 3", Path::new(".")).is_err());
    }

    #[test]
    fn tile_and_overlap_are_parsed_and_checked() {
        let c = Config::from_toml("stages = [\"chm\"]\n[chm]\nmodel = \"m\"\ntile = 416\noverlap = 64\n", Path::new(".")).unwrap();
        assert_eq!((c.chm.tile, c.chm.overlap), (Some(416), Some(64)));
        c.validate().unwrap();
        assert_eq!(c.tile_request(StageKind::Chm), crate::tiling::TileRequest { tile: Some(416), overlap: Some(64) });
        assert_eq!(c.tile_request(StageKind::Depth), crate::tiling::TileRequest::default());
        assert_eq!(c.tile_request(StageKind::Edges).tile, Some(0));
        for (text, want) in [("[chm]\ntile = 8", "tile size 8"), ("[depth]\ntile = 100\noverlap = 60", "more than half"), ("[segmentation]\noverlap = 9000", "overlap 9000")] {
            let e = Config::from_toml(text, Path::new(".")).unwrap().validate().unwrap_err().to_string();
            assert!(e.contains(want), "{text}: {e}");
        }
        assert!(Config::from_toml("[chm]\ntile = 0", Path::new(".")).unwrap().validate().is_ok());
    }
}
