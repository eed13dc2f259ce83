//! The fine-tuning tasks over the inference model structs: `depth` (Depth Anything V1/V2),
//! `segmentation` (SegFormer) and `chm` (CHMv2 canopy height) — what each loads, what its frozen
//! backbone hands the head, its preprocessing, and how its prediction is scored.
use std::path::Path;

use candle_core::Tensor;

use super::checkpointing::BlockWalk;
use super::data::{SampleSpec, TargetKind};
use super::losses;
use super::select::{BackboneLayout, CHMV2, DEPTH_ANYTHING, SEGFORMER};
use crate::error::{Error, Result};
use crate::imageio::resample::Filter;
use crate::models::chmv2::Chmv2;
use crate::models::depth_anything::{BackboneFeatures, DepthAnything, DepthKind};
use crate::models::segformer::pipeline::Preprocess as SegformerPreprocess;
use crate::models::segformer::SegformerForSemanticSegmentation;
use crate::models::backbones::dinov3::Dinov3Features;
use crate::preprocess::{IMAGENET_MEAN, IMAGENET_STD};
use crate::tasks::chm::ChmPreprocess;
use crate::weights::Vb;

/// The `task` setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TaskKind {
    /// Depth Anything V1/V2, `.npy` depth targets.
    Depth,
    /// SegFormer, `.png` class-id targets.
    Segmentation,
    /// CHMv2, `.npy` canopy-height targets (metres).
    Chm,
}

/// The task names `task` accepts.
pub const TASKS: &str = "depth, segmentation, chm";

impl TaskKind {
    /// Parses `depth`, `segmentation` or `chm`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "depth" => Ok(TaskKind::Depth),
            "segmentation" => Ok(TaskKind::Segmentation),
            "chm" => Ok(TaskKind::Chm),
            o => Err(Error::Config(format!("task: `{o}` is not a task (expected {TASKS})"))),
        }
    }

    /// The task's name in `finetune.toml`.
    pub fn name(self) -> &'static str {
        match self {
            TaskKind::Depth => "depth",
            TaskKind::Segmentation => "segmentation",
            TaskKind::Chm => "chm",
        }
    }

    /// The `model_type` this task fine-tunes and how it is described in errors.
    fn architecture(self) -> (&'static str, &'static str) {
        match self {
            TaskKind::Depth => ("depth_anything", "Depth Anything V1/V2 checkpoints (model_type `depth_anything`)"),
            TaskKind::Segmentation => ("segformer", "SegFormer checkpoints (model_type `segformer`)"),
            TaskKind::Chm => ("chmv2", "CHMv2 checkpoints (model_type `chmv2`)"),
        }
    }

    /// How the family names its backbone.
    pub fn layout(self) -> &'static BackboneLayout {
        match self {
            TaskKind::Depth => &DEPTH_ANYTHING,
            TaskKind::Segmentation => &SEGFORMER,
            TaskKind::Chm => &CHMV2,
        }
    }

    /// What the task's target files hold.
    pub fn target_kind(self) -> TargetKind {
        match self {
            TaskKind::Segmentation => TargetKind::Classes,
            TaskKind::Depth | TaskKind::Chm => TargetKind::Values,
        }
    }

    /// The loss names the task accepts.
    pub fn losses(self) -> &'static [&'static str] {
        match self {
            TaskKind::Segmentation => &["cross_entropy", "focal"],
            TaskKind::Depth | TaskKind::Chm => &["ssi", "silog", "l1"],
        }
    }
}

/// A loss and its settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Loss {
    /// Scale-and-shift-invariant (relative depth).
    Ssi,
    /// Scale-invariant log (metric depth, canopy height); targets ≤ 0 are not counted.
    Silog,
    /// Masked L1.
    L1,
    /// Cross-entropy over classes, pixels at `ignore` not counted.
    CrossEntropy {
        /// The ignore index.
        ignore: u32,
    },
    /// Focal loss.
    Focal {
        /// Focusing exponent γ.
        gamma: f64,
        /// The ignore index.
        ignore: u32,
    },
}

impl Loss {
    /// The ignore index of a segmentation loss.
    pub fn ignore_index(self) -> Option<u32> {
        match self {
            Loss::CrossEntropy { ignore } | Loss::Focal { ignore, .. } => Some(ignore),
            _ => None,
        }
    }

    /// The loss of `pred` against `target` `[B, H, W]`. A prediction of another size (a head whose
    /// output grid is not the input's, SegFormer's quarter-resolution logits) is first resized to the
    /// target bilinearly (`align_corners=False`), as transformers does before its loss.
    pub fn apply(self, pred: &Tensor, target: &Tensor) -> Result<Tensor> {
        let (th, tw) = (target.dim(1)?, target.dim(2)?);
        match self {
            Loss::CrossEntropy { ignore } => losses::cross_entropy(&to_size(pred, th, tw)?, target, ignore),
            Loss::Focal { gamma, ignore } => losses::focal(&to_size(pred, th, tw)?, target, gamma, ignore),
            regression => {
                let pred = if pred.dims()[1..] == [th, tw] { pred.clone() } else { to_size(&pred.unsqueeze(1)?, th, tw)?.squeeze(1)? };
                match regression {
                    Loss::Ssi => losses::ssi(&pred, target),
                    Loss::Silog => losses::silog(&pred, target, 0.5),
                    _ => losses::l1(&pred, target),
                }
            }
        }
    }
}

/// Per-class pixel counts of intersection and union between the argmax of `logits` `[B, L, h, w]`
/// (resized to the target) and class ids `target` `[B, H, W]`; pixels at `ignore` are not counted.
#[derive(Debug, Clone, Default)]
pub struct ClassOverlap {
    inter: Vec<u64>,
    union: Vec<u64>,
}

impl ClassOverlap {
    /// Adds a batch.
    pub fn add(&mut self, logits: &Tensor, target: &Tensor, ignore: u32) -> Result<()> {
        let (th, tw) = (target.dim(1)?, target.dim(2)?);
        let classes = logits.dim(1)?;
        let pred = to_size(logits, th, tw)?.argmax(1)?.flatten_all()?.to_vec1::<u32>()?;
        let truth = target.flatten_all()?.to_vec1::<f32>()?;
        if self.inter.len() < classes {
            self.inter.resize(classes, 0);
            self.union.resize(classes, 0);
        }
        for (&p, &t) in pred.iter().zip(&truth) {
            let t = t as u32;
            if t == ignore || t as usize >= classes {
                continue;
            }
            if p == t {
                self.inter[t as usize] += 1;
                self.union[t as usize] += 1;
            } else {
                self.union[t as usize] += 1;
                self.union[p as usize] += 1;
            }
        }
        Ok(())
    }

    /// Mean intersection over union of the classes present in prediction or target (None: none).
    pub fn mean_iou(&self) -> Option<f64> {
        let ious: Vec<f64> = self.inter.iter().zip(&self.union).filter(|(_, &u)| u > 0).map(|(&i, &u)| i as f64 / u as f64).collect();
        (!ious.is_empty()).then(|| ious.iter().sum::<f64>() / ious.len() as f64)
    }
}

fn to_size(x: &Tensor, h: usize, w: usize) -> Result<Tensor> {
    crate::nn::interpolate::bilinear(x, h, w, false)
}

/// A loaded model of one of the tasks.
pub enum TaskModel {
    /// Depth Anything V1/V2.
    Depth(DepthAnything),
    /// SegFormer.
    Segmentation(Box<SegformerForSemanticSegmentation>),
    /// CHMv2.
    Chm(Box<Chmv2>),
}

/// What a frozen backbone hands the trainable head, per task (cacheable: it never changes while only
/// the head trains on unaugmented images).
#[derive(Clone)]
pub enum Features {
    /// Depth Anything token maps.
    Depth(BackboneFeatures),
    /// SegFormer stage outputs (tokens `[B, h·w, C]`, h, w).
    Segmentation(Vec<(Tensor, usize, usize)>),
    /// DINOv3 stage maps and class tokens.
    Chm(Dinov3Features),
}

fn cat0(ts: Vec<Tensor>) -> Result<Tensor> {
    Ok(Tensor::cat(&ts, 0)?)
}

impl Features {
    /// Stacks single-image features (same grid) into one batch.
    pub fn stack(items: &[&Features]) -> Result<Features> {
        let mismatch = || Error::Input("features of different tasks cannot be stacked".into());
        match items.first().ok_or_else(|| Error::Input("no features to stack".into()))? {
            Features::Depth(_) => {
                let f = items.iter().map(|f| if let Features::Depth(d) = f { Ok(d) } else { Err(mismatch()) }).collect::<Result<Vec<_>>>()?;
                Ok(Features::Depth(BackboneFeatures::stack(&f)?))
            }
            Features::Segmentation(first) => {
                let f = items.iter().map(|f| if let Features::Segmentation(s) = f { Ok(s) } else { Err(mismatch()) }).collect::<Result<Vec<_>>>()?;
                let stages = (0..first.len())
                    .map(|s| Ok((cat0(f.iter().map(|x| x[s].0.clone()).collect())?, first[s].1, first[s].2)))
                    .collect::<Result<_>>()?;
                Ok(Features::Segmentation(stages))
            }
            Features::Chm(first) => {
                let f = items.iter().map(|f| if let Features::Chm(c) = f { Ok(c) } else { Err(mismatch()) }).collect::<Result<Vec<_>>>()?;
                let maps = (0..first.maps.len()).map(|l| cat0(f.iter().map(|x| x.maps[l].clone()).collect())).collect::<Result<_>>()?;
                let cls = (0..first.cls.len()).map(|l| cat0(f.iter().map(|x| x.cls[l].clone()).collect())).collect::<Result<_>>()?;
                Ok(Features::Chm(Dinov3Features { maps, cls, ph: first.ph, pw: first.pw }))
            }
        }
    }

    /// Bytes the tensors hold.
    pub fn bytes(&self) -> usize {
        let size = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        match self {
            Features::Depth(d) => d.bytes(),
            Features::Segmentation(s) => s.iter().map(|(t, _, _)| size(t)).sum(),
            Features::Chm(c) => c.maps.iter().chain(&c.cls).map(size).sum(),
        }
    }
}

impl TaskModel {
    /// Loads the model `task` fine-tunes from `vb` (trainable tensors already chosen); another
    /// family is an error naming the checkpoint.
    pub fn load(task: TaskKind, vb: &Vb, model_path: &Path) -> Result<Self> {
        let store = vb.store();
        let arch = crate::models::architecture(store).unwrap_or_default();
        let (want, what) = task.architecture();
        if arch != want {
            return Err(Error::bad_file(model_path, format!("task `{}` fine-tunes {what}; this is `{arch}`", task.name())));
        }
        let in_file = |e| crate::config_check::in_file(store.config_origin(), e);
        Ok(match task {
            TaskKind::Depth => TaskModel::Depth(DepthAnything::load(vb, store.config()).map_err(in_file)?),
            TaskKind::Segmentation => TaskModel::Segmentation(Box::new(SegformerForSemanticSegmentation::load(vb, store.config()).map_err(in_file)?)),
            TaskKind::Chm => TaskModel::Chm(Box::new(Chmv2::load(vb, store.config()).map_err(in_file)?)),
        })
    }

    /// Each side of a training input must be a multiple of this (the ViT patch size).
    pub fn input_multiple(&self) -> usize {
        match self {
            TaskModel::Depth(m) => m.patch_size(),
            TaskModel::Segmentation(_) => 1,
            TaskModel::Chm(m) => m.patch_size(),
        }
    }

    /// The frozen backbone's output for `pixels` `[B, 3, H, W]`.
    pub fn features(&self, pixels: &Tensor) -> Result<Features> {
        Ok(match self {
            TaskModel::Depth(m) => Features::Depth(m.backbone_features(pixels)?),
            TaskModel::Segmentation(m) => Features::Segmentation(m.encode(pixels)?),
            TaskModel::Chm(m) => Features::Chm(m.backbone_features(pixels)?),
        })
    }

    /// The head on backbone features → the prediction the loss scores (depth `[B, H, W]`, class
    /// logits `[B, L, h, w]`, heights `[B, H', W']`).
    pub fn decode(&self, features: &Features) -> Result<Tensor> {
        match (self, features) {
            (TaskModel::Depth(m), Features::Depth(f)) => m.decode(f),
            (TaskModel::Segmentation(m), Features::Segmentation(f)) => m.decode(f),
            (TaskModel::Chm(m), Features::Chm(f)) => m.features_to_depth().forward(&m.decode_logits(f)?),
            _ => Err(Error::Input("features of another task".into())),
        }
    }

    /// The whole model on pixels → the prediction.
    pub fn forward(&self, pixels: &Tensor) -> Result<Tensor> {
        match self {
            TaskModel::Depth(m) => m.forward(pixels),
            _ => self.decode(&self.features(pixels)?),
        }
    }

    /// The loss `name` names (None: the task's default) with its settings.
    pub fn loss(&self, name: Option<&str>, ignore_index: Option<u32>, focal_gamma: f64) -> Loss {
        let ignore = ignore_index.unwrap_or_else(|| self.ignore_index());
        match (self, name) {
            (_, Some("l1")) => Loss::L1,
            (_, Some("ssi")) => Loss::Ssi,
            (_, Some("silog")) => Loss::Silog,
            (_, Some("focal")) => Loss::Focal { gamma: focal_gamma, ignore },
            (TaskModel::Segmentation(_), _) => Loss::CrossEntropy { ignore },
            (TaskModel::Depth(m), None) if m.kind() == DepthKind::Relative => Loss::Ssi,
            _ => Loss::Silog,
        }
    }

    /// The checkpoint's ignore index (SegFormer `semantic_loss_ignore_index`; 255 otherwise or when
    /// it is no 8-bit class id, e.g. PyTorch's −100, in which case no pixel is ignored by default).
    fn ignore_index(&self) -> u32 {
        match self {
            TaskModel::Segmentation(m) => u32::try_from(m.config().semantic_loss_ignore_index).unwrap_or(u32::MAX),
            _ => 255,
        }
    }

    /// The number of classes (segmentation) for target checks.
    pub fn classes(&self) -> Option<usize> {
        match self {
            TaskModel::Segmentation(m) => Some(m.config().num_labels()),
            _ => None,
        }
    }

    /// The model as a walk over its ViT blocks (activation checkpointing), when it has one.
    pub fn block_walk(&self) -> Option<&dyn BlockWalk> {
        match self {
            TaskModel::Depth(m) => Some(m),
            TaskModel::Chm(m) => Some(m.as_ref()),
            TaskModel::Segmentation(_) => None,
        }
    }
}

/// The model's own preprocessing for training samples at `size`: its normalisation and resampling
/// filter (`preprocessor_config.json` beside the model when there is one).
pub fn sample_spec(task: TaskKind, model_path: &Path, size: (usize, usize)) -> Result<SampleSpec> {
    let target = task.target_kind();
    Ok(match task {
        TaskKind::Depth => SampleSpec { size, mean: IMAGENET_MEAN, std: IMAGENET_STD, filter: Filter::Bicubic, target },
        TaskKind::Segmentation => {
            let pre = SegformerPreprocess::from_model_path(model_path)?;
            let (mean, std) = pre.normalize.unwrap_or(([0.0; 3], [1.0; 3]));
            SampleSpec { size, mean, std, filter: pre.filter, target }
        }
        TaskKind::Chm => {
            let pre = ChmPreprocess::for_model(model_path)?;
            let filter = pre.filter().map_err(Error::Config)?;
            SampleSpec { size, mean: pre.image_mean, std: pre.image_std, filter, target }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn mean_iou_counts_by_hand() {
        // Predictions (argmax over 3 classes): [0, 1, 1, 2]; targets [0, 1, 0, 255 (ignored)].
        let one_hot = |c: usize| (0..3).map(|k| if k == c { 1f32 } else { 0.0 }).collect::<Vec<_>>();
        let mut v = Vec::new();
        for k in 0..3 {
            for c in [0, 1, 1, 2] {
                v.push(one_hot(c)[k]);
            }
        }
        let logits = Tensor::from_vec(v, (1, 3, 1, 4), &Device::Cpu).unwrap();
        let target = Tensor::from_vec(vec![0f32, 1.0, 0.0, 255.0], (1, 1, 4), &Device::Cpu).unwrap();
        let mut o = ClassOverlap::default();
        o.add(&logits, &target, 255).unwrap();
        // class 0: I 1, U 2 (pixels 0, 2); class 1: I 1, U 2 (pixels 1, 2); class 2 absent.
        assert_eq!(o.mean_iou(), Some(0.5));
        assert_eq!(ClassOverlap::default().mean_iou(), None);
    }
}
