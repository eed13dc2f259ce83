//! `finetune.toml`: what to train, on which data, and how; every number bounded before use.
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::mix::MixConfig;
use super::objective::{loss_names, trainable_task_names, trainable_tasks};
use super::select::TrainSpec;
use crate::error::{Error, Result};
use crate::tasks::Task;

/// Largest side of a training input.
pub(crate) const MAX_TRAIN_SIDE: usize = 4096;
/// Most epochs.
pub(crate) const MAX_EPOCHS: usize = 100_000;
/// Largest micro-batch and accumulation count.
pub(crate) const MAX_BATCH: usize = 1024;

/// The fine-tuning configuration (TOML; each key may be overridden on the command line).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FinetuneConfig {
    /// Model directory (config.json + model.safetensors) or GGUF file.
    pub model: PathBuf,
    /// `depth` (Depth Anything V1/V2), `segmentation` (SegFormer) or `chm` (CHMv2).
    pub task: Task,
    /// Data directory: `images/<name>.{png,jpg,jpeg,tif,tiff}` and `targets/<name>.npy` (depth,
    /// chm) or `targets/<name>.png` (segmentation: 8-bit class ids).
    pub data: PathBuf,
    /// Output directory: `last/`, `best/`, `log.jsonl`, `state/`.
    pub out: PathBuf,
    /// Training resolution `[H, W]`, multiples of the patch size.
    #[serde(default = "default_input_size")]
    pub input_size: [usize; 2],
    /// Passes over the training split.
    #[serde(default = "one")]
    pub epochs: usize,
    /// Images per micro-batch.
    #[serde(default = "two")]
    pub batch: usize,
    /// Micro-batches per optimiser step.
    #[serde(default = "one")]
    pub accumulate: usize,
    /// `head`, `last:N` or `all`.
    #[serde(default = "head")]
    pub train: TrainSpec,
    /// Loss: `ssi` (default for relative depth), `silog` (default for metric depth and chm), `l1`;
    /// `cross_entropy` (default for segmentation), `focal`.
    #[serde(default)]
    pub loss: Option<String>,
    /// Class id not counted by the segmentation losses (default: the checkpoint's
    /// `semantic_loss_ignore_index`, else 255).
    #[serde(default)]
    pub ignore_index: Option<u32>,
    /// Focal-loss exponent γ.
    #[serde(default = "focal_gamma")]
    pub focal_gamma: f64,
    /// Label smoothing ε of the cross-entropy (segmentation; PyTorch's `label_smoothing`), 0 ≤ ε < 1.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub label_smoothing: f64,
    /// MixUp's Beta(α, α) parameter (timm `Mixup`, batch mode; 0 = off).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub mixup_alpha: f64,
    /// CutMix's Beta(α, α) parameter (timm `Mixup`, batch mode; 0 = off).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cutmix_alpha: f64,
    /// Probability that a micro-batch is mixed (timm `prob`).
    #[serde(default = "one_f", skip_serializing_if = "is_one")]
    pub mix_prob: f64,
    /// With MixUp and CutMix both on, the probability of CutMix (timm `switch_prob`).
    #[serde(default = "half", skip_serializing_if = "is_half")]
    pub switch_prob: f64,
    /// Hard-example sampling: 0 = off (each epoch a permutation); f in (0, 1): each epoch's samples are
    /// drawn with replacement, with probability `(1 − f)/n + f · loss_i / Σ loss` from the per-sample
    /// training losses seen so far.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub hard_examples: f64,
    /// One-cycle peak learning rate.
    #[serde(default = "max_lr")]
    pub max_lr: f64,
    /// One-cycle warm-up fraction.
    #[serde(default = "pct_start")]
    pub pct_start: f64,
    /// Initial lr = max_lr / div_factor.
    #[serde(default = "div_factor")]
    pub div_factor: f64,
    /// Final lr = initial lr / final_div_factor.
    #[serde(default = "final_div_factor")]
    pub final_div_factor: f64,
    /// Cycle AdamW's β1 between 0.95 and 0.85 inversely to the rate (PyTorch's default; off here).
    #[serde(default)]
    pub cycle_momentum: bool,
    /// AdamW decoupled weight decay.
    #[serde(default = "weight_decay")]
    pub weight_decay: f64,
    /// Gradient-norm clipping (0 = off).
    #[serde(default = "clip")]
    pub clip_grad_norm: f64,
    /// EMA decay (0 = no EMA; validation and outputs then use the live weights).
    #[serde(default = "ema_decay")]
    pub ema_decay: f64,
    /// EMA warm-up (timm `ModelEmaV3` use_warmup).
    #[serde(default = "yes")]
    pub ema_warmup: bool,
    /// Fraction of the data held out for validation (deterministic by file name).
    #[serde(default = "val_fraction")]
    pub val_fraction: f64,
    /// Validate every N optimiser steps (and at the end).
    #[serde(default = "every")]
    pub val_every: usize,
    /// Also validate at the end of every epoch.
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub val_every_epoch: bool,
    /// Save `state/` and `last/` every N optimiser steps (and at the end).
    #[serde(default = "every")]
    pub save_every: usize,
    /// Seed of the data order and augmentation.
    #[serde(default)]
    pub seed: u64,
    /// Photometric augmentation and horizontal flips (turns off the frozen-feature cache).
    #[serde(default)]
    pub augment: bool,
    /// Keep only each trained block's input in the forward pass and recompute the blocks in backward.
    #[serde(default)]
    pub checkpoint_activations: bool,
    /// Move the kept block inputs off the compute device (host memory from a GPU, a spill file in
    /// `<out>/state/` on a CPU); implies `checkpoint_activations`.
    #[serde(default)]
    pub offload: bool,
    /// MiB of frozen-backbone features to cache (features beyond it are recomputed).
    #[serde(default = "cache_mib")]
    pub feature_cache_mib: usize,
}

fn default_input_size() -> [usize; 2] { [518, 518] }
fn one() -> usize { 1 }
fn two() -> usize { 2 }
fn head() -> TrainSpec { TrainSpec::Head }
fn max_lr() -> f64 { 1e-4 }
fn focal_gamma() -> f64 { 2.0 }
fn pct_start() -> f64 { 0.3 }
fn div_factor() -> f64 { 25.0 }
fn final_div_factor() -> f64 { 1e4 }
fn weight_decay() -> f64 { 1e-2 }
fn clip() -> f64 { 1.0 }
fn ema_decay() -> f64 { 0.999 }
fn yes() -> bool { true }
fn val_fraction() -> f64 { 0.1 }
fn every() -> usize { 50 }
fn cache_mib() -> usize { 1024 }
fn one_f() -> f64 { 1.0 }
fn half() -> f64 { 0.5 }
fn is_zero(v: &f64) -> bool { *v == 0.0 }
fn is_one(v: &f64) -> bool { *v == 1.0 }
fn is_half(v: &f64) -> bool { *v == 0.5 }
fn is_true(v: &bool) -> bool { *v }

/// Largest MixUp / CutMix α.
pub(crate) const MAX_MIX_ALPHA: f64 = 100.0;

/// The commented default `finetune.toml` (`edgerun finetune --print-config`).
pub const DEFAULT_TOML: &str = include_str!("default_finetune.toml");

impl FinetuneConfig {
    /// Parses TOML; relative paths are taken from `base_dir` (the file's directory).
    pub fn from_toml(text: &str, base_dir: &Path) -> Result<Self> {
        let mut c: FinetuneConfig = toml::from_str(text).map_err(|e| Error::Config(e.to_string()))?;
        for p in [&mut c.model, &mut c.data, &mut c.out] {
            if p.is_relative() && !p.as_os_str().is_empty() {
                *p = base_dir.join(&*p);
            }
        }
        Ok(c)
    }

    /// Reads and parses a config file (size-limited).
    pub fn load(path: &Path) -> Result<Self> {
        let text = crate::fsutil::read_input_text(path, crate::fsutil::MAX_TEXT_INPUT)?;
        let base = path.parent().unwrap_or(Path::new("."));
        Self::from_toml(&text, base).map_err(|e| match e {
            Error::Config(m) => Error::bad_file(path, m),
            o => o,
        })
    }

    /// Checks every setting; names the first that is out of range.
    pub fn validate(&self) -> Result<()> {
        let bad = |k: &str, msg: String| Err(Error::Config(format!("{k}: {msg}")));
        if !trainable_tasks().contains(&self.task) {
            return bad("task", format!("`{}` does not fine-tune (expected {})", self.task.name(), trainable_task_names()));
        }
        for (k, p) in [("model", &self.model), ("data", &self.data), ("out", &self.out)] {
            if p.as_os_str().is_empty() {
                return bad(k, "is required".into());
            }
        }
        let [h, w] = self.input_size;
        if !(1..=MAX_TRAIN_SIDE).contains(&h) || !(1..=MAX_TRAIN_SIDE).contains(&w) {
            return bad("input_size", format!("[{h}, {w}]: each side must be in 1..={MAX_TRAIN_SIDE}"));
        }
        for (k, v, max) in [("epochs", self.epochs, MAX_EPOCHS), ("batch", self.batch, MAX_BATCH), ("accumulate", self.accumulate, MAX_BATCH), ("val_every", self.val_every, usize::MAX), ("save_every", self.save_every, usize::MAX)] {
            if v == 0 || v > max {
                return bad(k, format!("{v} is outside 1..={max}"));
            }
        }
        if let Some(l) = &self.loss {
            let names = loss_names(self.task);
            if !names.contains(&l.as_str()) {
                return bad("loss", format!("`{l}` does not fit task `{}` (expected {})", self.task.name(), names.join(", ")));
            }
        }
        let finite_in = |k: &str, v: f64, lo: f64, hi: f64, lo_open: bool| -> Result<()> {
            let ok = v.is_finite() && v <= hi && if lo_open { v > lo } else { v >= lo };
            if ok { Ok(()) } else { bad(k, format!("{v} is outside {}{lo}, {hi}]", if lo_open { "(" } else { "[" })) }
        };
        finite_in("max_lr", self.max_lr, 0.0, 10.0, true)?;
        finite_in("focal_gamma", self.focal_gamma, 0.0, 100.0, false)?;
        finite_in("pct_start", self.pct_start, 0.0, 1.0, true)?;
        finite_in("div_factor", self.div_factor, 0.0, 1e12, true)?;
        finite_in("final_div_factor", self.final_div_factor, 0.0, 1e12, true)?;
        finite_in("weight_decay", self.weight_decay, 0.0, 10.0, false)?;
        finite_in("clip_grad_norm", self.clip_grad_norm, 0.0, 1e12, false)?;
        finite_in("ema_decay", self.ema_decay, 0.0, 1.0, false)?;
        finite_in("val_fraction", self.val_fraction, 0.0, 0.9, false)?;
        self.validate_techniques()?;
        if self.feature_cache_mib > 1 << 30 {
            return bad("feature_cache_mib", format!("{} is too large", self.feature_cache_mib));
        }
        Ok(())
    }

    /// The label smoothing, mixing and hard-example settings.
    fn validate_techniques(&self) -> Result<()> {
        let bad = |k: &str, msg: String| Err(Error::Config(format!("{k}: {msg}")));
        let half_open = |k: &str, v: f64| if v.is_finite() && (0.0..1.0).contains(&v) { Ok(()) } else { bad(k, format!("{v} is outside [0, 1)")) };
        half_open("label_smoothing", self.label_smoothing)?;
        half_open("hard_examples", self.hard_examples)?;
        for (k, v) in [("mixup_alpha", self.mixup_alpha), ("cutmix_alpha", self.cutmix_alpha)] {
            if !(v.is_finite() && (0.0..=MAX_MIX_ALPHA).contains(&v)) {
                return bad(k, format!("{v} is outside [0, {MAX_MIX_ALPHA}]"));
            }
        }
        for (k, v) in [("mix_prob", self.mix_prob), ("switch_prob", self.switch_prob)] {
            if !(v.is_finite() && (0.0..=1.0).contains(&v)) {
                return bad(k, format!("{v} is outside [0, 1]"));
            }
        }
        if self.label_smoothing > 0.0 {
            if self.task != Task::Segmentation {
                return bad("label_smoothing", format!("smooths the segmentation cross-entropy; task `{}` has no class labels", self.task.name()));
            }
            if self.loss.as_deref() == Some("focal") {
                return bad("label_smoothing", "is defined for loss `cross_entropy` only (neither torchvision nor timm defines a label-smoothed focal loss); use loss = \"cross_entropy\" or label_smoothing = 0".into());
            }
        }
        if self.mix().enabled() && self.batch < 2 {
            return bad("mixup_alpha / cutmix_alpha", format!("mixing pairs the samples of a micro-batch (sample i with sample B−1−i, timm's batch mode): batch must be at least 2, not {}", self.batch));
        }
        Ok(())
    }

    /// The MixUp / CutMix settings.
    pub fn mix(&self) -> MixConfig {
        MixConfig { mixup_alpha: self.mixup_alpha, cutmix_alpha: self.cutmix_alpha, mix_prob: self.mix_prob, switch_prob: self.switch_prob }
    }

    /// What must match for a saved state to be resumed (everything that changes the result).
    pub fn fingerprint(&self) -> String {
        let mut c = self.clone();
        c.out = PathBuf::new();
        c.save_every = 0;
        c.val_every = 0;
        c.val_every_epoch = true;
        c.feature_cache_mib = 0;
        c.checkpoint_activations = false;
        c.offload = false;
        serde_json::to_string(&c).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// New settings at their defaults leave the fingerprint as it was, so states saved before they
    /// existed still resume.
    #[test]
    fn default_new_settings_keep_old_fingerprints() {
        let c = FinetuneConfig::from_toml("model = \"m\"\ntask = \"depth\"\ndata = \"d\"\nout = \"o\"\n", Path::new("/")).unwrap();
        let fp = c.fingerprint();
        for k in ["label_smoothing", "mixup_alpha", "cutmix_alpha", "mix_prob", "switch_prob", "hard_examples", "val_every_epoch"] {
            assert!(!fp.contains(k), "{k} in {fp}");
        }
        let mut d = c.clone();
        d.val_every_epoch = false;
        assert_eq!(d.fingerprint(), fp, "validation settings do not change the result");
        d.mixup_alpha = 0.2;
        assert_ne!(d.fingerprint(), fp);
    }
}
