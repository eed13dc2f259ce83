//! CHMv2 under fine-tuning: its DINOv3 stage maps and class tokens as the cacheable features, and
//! the walk over its ViT blocks for activation checkpointing.
use candle_core::Tensor;

use super::Chmv2;
use crate::error::Result;
use crate::models::backbones::dinov3::{Dinov3, Dinov3Features};
use crate::models::training::{BlockWalk, Features, Prediction, Trainee};

/// The stage maps, then the class tokens; one grid per map.
fn to_features(f: Dinov3Features) -> Features {
    let grids = vec![(f.ph, f.pw); f.maps.len()];
    Features { tensors: f.maps.into_iter().chain(f.cls).collect(), grids }
}

fn from_features(f: &Features) -> Dinov3Features {
    let maps = f.grids.len().min(f.tensors.len());
    let (ph, pw) = f.grids.first().copied().unwrap_or((0, 0));
    Dinov3Features { maps: f.tensors[..maps].to_vec(), cls: f.tensors[maps..].to_vec(), ph, pw }
}

impl Trainee for Chmv2 {
    fn input_multiple(&self) -> usize {
        self.patch_size()
    }

    fn prediction(&self) -> Prediction {
        Prediction::Metric
    }

    fn features(&self, pixels: &Tensor) -> Result<Features> {
        Ok(to_features(self.backbone_features(pixels)?))
    }

    fn decode(&self, features: &Features) -> Result<Tensor> {
        self.features_to_depth().forward(&self.decode_logits(&from_features(features))?)
    }

    fn block_walk(&self) -> Option<&dyn BlockWalk> {
        Some(self)
    }
}

impl BlockWalk for Chmv2 {
    fn embed(&self, pixels: &Tensor) -> Result<(Tensor, usize, usize)> {
        self.backbone().embed(&pixels.to_dtype(self.precision().backbone)?)
    }

    fn block_count(&self) -> usize {
        self.backbone().block_count()
    }

    fn block(&self, i: usize, x: &Tensor, (ph, pw): (usize, usize)) -> Result<Tensor> {
        let bb: &Dinov3 = self.backbone();
        bb.block_forward(i, x, &bb.rope(ph, pw, x)?)
    }

    fn taps(&self) -> Vec<usize> {
        self.backbone().indices().to_vec()
    }

    fn head(&self, taps: &[Tensor], (ph, pw): (usize, usize)) -> Result<Tensor> {
        let bb = self.backbone();
        let stages = bb.indices().iter().zip(taps).map(|(&k, t)| bb.stage_output(k, t, ph, pw)).collect::<Result<Vec<_>>>()?;
        self.features_to_depth().forward(&self.decode_logits(&Dinov3::features_from(stages, ph, pw))?)
    }
}
