//! What fine-tuning needs from a family: where each backbone tensor sits in the forward order
//! ([`TrainingLayout`], for `train = "last:N"`), the model as the loop drives it ([`Trainee`]) and,
//! for ViT backbones, a walk over the blocks for activation checkpointing ([`BlockWalk`]).
use candle_core::Tensor;

use crate::error::{Error, Result};

/// Where a backbone tensor sits in the forward order of its stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Slot {
    /// The stage's embedding (patch embedding, position embedding, tokens).
    Embed,
    /// Block `j` of the stage.
    Block(usize),
    /// The stage's final norm.
    Norm,
}

/// A backbone tensor's place: (stage, slot), ordered as the forward pass runs.
pub(crate) type Position = (usize, Slot);

/// How a family names its backbone: the prefix of every backbone tensor and where each one sits.
#[derive(Debug, Clone, Copy)]
pub struct TrainingLayout {
    /// Prefix of every backbone tensor (`backbone.`).
    pub prefix: &'static str,
    /// The position of a backbone tensor (None: not part of the forward order, e.g. unused tokens).
    pub position: fn(&str) -> Option<Position>,
}

/// The number after `prefix` in `name` (`backbone.layer.` + `3.mlp…` → 3).
pub(crate) fn number_after(name: &str, prefix: &str) -> Option<usize> {
    name.strip_prefix(prefix)?.split('.').next()?.parse().ok()
}

/// Two numbers after `prefix` (`block.` + `2.1.attn…` → (2, 1)).
pub(crate) fn two_numbers_after(name: &str, prefix: &str) -> Option<(usize, usize)> {
    let mut it = name.strip_prefix(prefix)?.split('.');
    Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
}

/// A single-stage ViT: embeddings, numbered blocks, a final norm.
pub(crate) fn vit_position(name: &str, embed: &str, blocks: &str, norm: &str) -> Option<Position> {
    if name.starts_with(embed) {
        Some((0, Slot::Embed))
    } else if let Some(i) = number_after(name, blocks) {
        Some((0, Slot::Block(i)))
    } else if name.starts_with(norm) {
        Some((0, Slot::Norm))
    } else {
        None
    }
}

/// What a frozen backbone hands the trained head: batch-first tensors and the grids (rows,
/// columns) its family needs to read them back. Cacheable: it never changes while only the head
/// trains on unaugmented images.
#[derive(Debug, Clone)]
pub struct Features {
    /// Batch-first tensors.
    pub tensors: Vec<Tensor>,
    /// Grid sizes, as the family records them.
    pub grids: Vec<(usize, usize)>,
}

impl Features {
    /// Stacks single-image features of one family (same grids) into one batch.
    pub fn stack(items: &[&Features]) -> Result<Features> {
        let first = items.first().ok_or_else(|| Error::Input("no features to stack".into()))?;
        if items.iter().any(|f| f.tensors.len() != first.tensors.len() || f.grids != first.grids) {
            return Err(Error::Input("features of different shapes cannot be stacked".into()));
        }
        let tensors = (0..first.tensors.len())
            .map(|i| Ok(Tensor::cat(&items.iter().map(|f| f.tensors[i].clone()).collect::<Vec<_>>(), 0)?))
            .collect::<Result<_>>()?;
        Ok(Features { tensors, grids: first.grids.clone() })
    }

    /// Bytes the tensors hold.
    pub fn bytes(&self) -> usize {
        self.tensors.iter().map(|t| t.elem_count() * t.dtype().size_in_bytes()).sum()
    }
}

/// What a trained model predicts, which picks the loss when none is named.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prediction {
    /// Affine-invariant (relative) depth: scale-and-shift-invariant loss.
    Relative,
    /// Metric values (depth, heights): scale-invariant log loss.
    Metric,
    /// Class logits: cross-entropy; `ignore` is the checkpoint's ignore index.
    Classes {
        /// Number of classes.
        classes: usize,
        /// Target value that is not counted.
        ignore: u32,
    },
}

/// A model as the fine-tuning loop drives it, built on the inference struct (its trainable weights
/// are `Var`s inside it).
pub trait Trainee: Send + Sync {
    /// Each side of a training input must be a multiple of this (the ViT patch size).
    fn input_multiple(&self) -> usize;
    /// What the model predicts.
    fn prediction(&self) -> Prediction;
    /// The frozen backbone's output for `pixels` `[B, 3, H, W]`.
    fn features(&self, pixels: &Tensor) -> Result<Features>;
    /// The head on backbone features → the prediction the loss scores (depth `[B, H, W]`, class
    /// logits `[B, L, h, w]`, heights `[B, H', W']`).
    fn decode(&self, features: &Features) -> Result<Tensor>;
    /// The whole model on pixels → the prediction.
    fn forward(&self, pixels: &Tensor) -> Result<Tensor> {
        self.decode(&self.features(pixels)?)
    }
    /// The model as a walk over its ViT blocks (activation checkpointing), when it has one.
    fn block_walk(&self) -> Option<&dyn BlockWalk>;
}

/// A model whose ViT backbone can be walked one block at a time (what checkpointing needs).
pub trait BlockWalk {
    /// Embedding tokens `[B, N, D]` of `pixels` and the patch grid.
    fn embed(&self, pixels: &Tensor) -> Result<(Tensor, usize, usize)>;
    /// Number of backbone blocks.
    fn block_count(&self) -> usize;
    /// Block `i` on tokens of a `grid`.
    fn block(&self, i: usize, x: &Tensor, grid: (usize, usize)) -> Result<Tensor>;
    /// The hidden states the head reads (0 = embeddings), increasing.
    fn taps(&self) -> Vec<usize>;
    /// The prediction from those hidden states (in `taps` order).
    fn head(&self, taps: &[Tensor], grid: (usize, usize)) -> Result<Tensor>;
}
