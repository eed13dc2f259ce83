//! What fine-tuning optimises for each task: the tasks that train and what their targets hold, the
//! losses a task accepts and the one chosen by default, and the mean IoU of segmentation.
use candle_core::{DType, Tensor};

use super::data::TargetKind;
use super::losses;
use super::mix::{TargetRule, Targets};
use crate::error::Result;
use crate::models::training::Prediction;
use crate::models::FAMILIES;
use crate::tasks::Task;

/// The tasks that fine-tune: those some family can train.
pub(crate) fn trainable_tasks() -> Vec<Task> {
    Task::ALL.into_iter().filter(|t| FAMILIES.iter().any(|f| f.training().is_some() && f.tasks().contains(t))).collect()
}

/// The names `task` accepts, for messages (`depth, segmentation, chm`).
pub(crate) fn trainable_task_names() -> String {
    trainable_tasks().iter().map(|t| t.name()).collect::<Vec<_>>().join(", ")
}

/// What the checkpoints that fine-tune for `task` are, for messages.
pub(crate) fn trained_checkpoints(task: Task) -> String {
    let families: Vec<String> = FAMILIES
        .iter()
        .filter(|f| f.training().is_some() && f.tasks().contains(&task))
        .map(|f| format!("{} checkpoints (model_type {})", f.name(), f.architectures().iter().map(|a| format!("`{a}`")).collect::<Vec<_>>().join(" or ")))
        .collect();
    families.join(", ")
}

/// What the target files of `task` hold.
pub(crate) fn target_kind(task: Task) -> TargetKind {
    match task {
        Task::Segmentation => TargetKind::Classes,
        _ => TargetKind::Values,
    }
}

/// The loss names `task` accepts.
pub(crate) fn loss_names(task: Task) -> &'static [&'static str] {
    match task {
        Task::Segmentation => &["cross_entropy", "focal"],
        _ => &["ssi", "silog", "l1"],
    }
}

/// A loss and its settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Loss {
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
        /// Label smoothing ε (0 = none).
        smoothing: f64,
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
    /// The loss `name` names (None: the default for what the model predicts) with its settings;
    /// `ignore_index` overrides the checkpoint's ignore index; `smoothing` is cross-entropy's label
    /// smoothing (the configuration refuses it with any other loss).
    pub(crate) fn choose(name: Option<&str>, prediction: Prediction, ignore_index: Option<u32>, focal_gamma: f64, smoothing: f64) -> Loss {
        let ignore = ignore_index.unwrap_or(match prediction {
            Prediction::Classes { ignore, .. } => ignore,
            _ => 255,
        });
        match (prediction, name) {
            (_, Some("l1")) => Loss::L1,
            (_, Some("ssi")) => Loss::Ssi,
            (_, Some("silog")) => Loss::Silog,
            (_, Some("focal")) => Loss::Focal { gamma: focal_gamma, ignore },
            (Prediction::Classes { .. }, _) => Loss::CrossEntropy { ignore, smoothing },
            (Prediction::Relative, None) => Loss::Ssi,
            _ => Loss::Silog,
        }
    }

    /// The ignore index of a segmentation loss.
    pub(crate) fn ignore_index(self) -> Option<u32> {
        match self {
            Loss::CrossEntropy { ignore, .. } | Loss::Focal { ignore, .. } => Some(ignore),
            _ => None,
        }
    }

    /// Whether `target` has a pixel this loss counts (the rule the losses apply: a class other than
    /// the ignore index; a finite value, and for `silog` a positive one).
    pub(crate) fn counts_any(self, target: &Tensor) -> Result<bool> {
        let t = target.to_dtype(DType::F64)?;
        let keep = match self {
            Loss::CrossEntropy { ignore, .. } | Loss::Focal { ignore, .. } => t.ne(ignore as f64)?,
            Loss::Silog => t.abs()?.le(f64::MAX)?.mul(&t.gt(0.0)?)?,
            _ => t.abs()?.le(f64::MAX)?,
        };
        Ok(keep.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()? > 0.0)
    }

    /// The loss of `pred` against `target` `[B, H, W]`. A prediction of another size (a head whose
    /// output grid is not the input's, SegFormer's quarter-resolution logits) is first resized to the
    /// target bilinearly (`align_corners=False`), as transformers does before its loss.
    pub(crate) fn apply(self, pred: &Tensor, target: &Tensor) -> Result<Tensor> {
        let (th, tw) = (target.dim(1)?, target.dim(2)?);
        match self {
            Loss::CrossEntropy { ignore, smoothing } => losses::cross_entropy_smoothed(&to_size(pred, th, tw)?, target, ignore, smoothing),
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

impl Loss {
    /// Which target pixels count, for mixing targets.
    pub(crate) fn target_rule(self) -> TargetRule {
        match self {
            Loss::CrossEntropy { .. } | Loss::Focal { .. } => TargetRule::Classes,
            Loss::Silog => TargetRule::Values { positive: true },
            _ => TargetRule::Values { positive: false },
        }
    }

    /// The loss of `pred` against mixed or plain targets: MixUp on class maps mixes the two losses,
    /// `λ · loss(pred, a) + (1 − λ) · loss(pred, b)`.
    pub(crate) fn apply_targets(self, pred: &Tensor, targets: &Targets) -> Result<Tensor> {
        match (self, targets) {
            (_, Targets::One(t)) => self.apply(pred, t),
            (Loss::CrossEntropy { ignore, smoothing }, Targets::Two { a, b, lam }) => {
                let (th, tw) = (a.dim(1)?, a.dim(2)?);
                losses::cross_entropy_pair(&to_size(pred, th, tw)?, a, b, *lam, ignore, smoothing)
            }
            (_, Targets::Two { a, b, lam }) => Ok((self.apply(pred, a)?.affine(*lam, 0.0)? + self.apply(pred, b)?.affine(1.0 - lam, 0.0)?)?),
        }
    }

    /// Each sample's loss (for hard-example sampling), from a detached prediction; None for a sample
    /// with no counted pixel.
    pub(crate) fn per_sample(self, pred: &Tensor, targets: &Targets) -> Result<Vec<Option<f64>>> {
        let pred = pred.detach();
        let mut out = Vec::with_capacity(pred.dim(0)?);
        for i in 0..pred.dim(0)? {
            let t = targets.sample(i)?;
            let counted = match &t {
                Targets::One(t) => self.counts_any(t)?,
                Targets::Two { a, b, .. } => self.counts_any(a)? && self.counts_any(b)?,
            };
            let v = if counted { Some(self.apply_targets(&pred.narrow(0, i, 1)?, &t)?.to_dtype(DType::F64)?.to_scalar::<f64>()?) } else { None };
            out.push(v.filter(|v| v.is_finite()));
        }
        Ok(out)
    }
}

/// Per-class pixel counts of intersection and union between the argmax of `logits` `[B, L, h, w]`
/// (resized to the target) and class ids `target` `[B, H, W]`; pixels at `ignore` are not counted.
#[derive(Debug, Clone, Default)]
pub(crate) struct ClassOverlap {
    inter: Vec<u64>,
    union: Vec<u64>,
}

impl ClassOverlap {
    /// Adds a batch.
    pub(crate) fn add(&mut self, logits: &Tensor, target: &Tensor, ignore: u32) -> Result<()> {
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
    pub(crate) fn mean_iou(&self) -> Option<f64> {
        let ious: Vec<f64> = self.inter.iter().zip(&self.union).filter(|(_, &u)| u > 0).map(|(&i, &u)| i as f64 / u as f64).collect();
        (!ious.is_empty()).then(|| ious.iter().sum::<f64>() / ious.len() as f64)
    }
}


fn to_size(x: &Tensor, h: usize, w: usize) -> Result<Tensor> {
    crate::nn::interpolate::bilinear(x, h, w, false)
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
