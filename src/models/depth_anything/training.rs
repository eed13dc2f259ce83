//! Depth Anything V1/V2 under fine-tuning: its DINOv2 token maps as the cacheable features, and
//! the walk over its ViT blocks for activation checkpointing.
use candle_core::Tensor;

use super::{BackboneFeatures, DepthAnything, DepthKind};
use crate::error::Result;
use crate::models::training::{BlockWalk, Features, Prediction, Trainee};

impl From<BackboneFeatures> for Features {
    fn from(f: BackboneFeatures) -> Self {
        Features { tensors: f.tokens, grids: vec![(f.ph, f.pw)] }
    }
}

fn backbone_features(f: &Features) -> BackboneFeatures {
    let (ph, pw) = f.grids.first().copied().unwrap_or((0, 0));
    BackboneFeatures { tokens: f.tensors.clone(), ph, pw }
}

impl Trainee for DepthAnything {
    fn input_multiple(&self) -> usize {
        self.patch_size()
    }

    fn prediction(&self) -> Prediction {
        match self.kind() {
            DepthKind::Relative => Prediction::Relative,
            DepthKind::Metric => Prediction::Metric,
        }
    }

    fn features(&self, pixels: &Tensor) -> Result<Features> {
        Ok(self.backbone_features(pixels)?.into())
    }

    fn decode(&self, features: &Features) -> Result<Tensor> {
        DepthAnything::decode(self, &backbone_features(features))
    }

    fn forward(&self, pixels: &Tensor) -> Result<Tensor> {
        DepthAnything::forward(self, pixels)
    }

    fn block_walk(&self) -> Option<&dyn BlockWalk> {
        Some(self)
    }
}

impl BlockWalk for DepthAnything {
    fn embed(&self, pixels: &Tensor) -> Result<(Tensor, usize, usize)> {
        self.backbone().embed(pixels)
    }

    fn block_count(&self) -> usize {
        self.backbone().block_count()
    }

    fn block(&self, i: usize, x: &Tensor, _: (usize, usize)) -> Result<Tensor> {
        self.backbone().block_forward(i, x)
    }

    fn taps(&self) -> Vec<usize> {
        self.feature_indices().to_vec()
    }

    fn head(&self, taps: &[Tensor], (ph, pw): (usize, usize)) -> Result<Tensor> {
        let tokens = taps.iter().map(|t| self.backbone().output_norm(t)).collect::<Result<Vec<_>>>()?;
        self.decode(&BackboneFeatures { tokens, ph, pw })
    }
}
