//! SegFormer under fine-tuning: its four stage outputs as the cacheable features. Its BatchNorm
//! trains scale and shift and keeps its running statistics (eval mode).
use candle_core::Tensor;

use super::SegformerForSemanticSegmentation;
use crate::error::Result;
use crate::models::training::{BlockWalk, Features, Prediction, Trainee};

impl Trainee for SegformerForSemanticSegmentation {
    fn input_multiple(&self) -> usize {
        1
    }

    fn prediction(&self) -> Prediction {
        // An ignore index that is no 8-bit class id (PyTorch's −100) ignores no pixel by default.
        let ignore = u32::try_from(self.config().semantic_loss_ignore_index).unwrap_or(u32::MAX);
        Prediction::Classes { classes: self.config().num_labels(), ignore }
    }

    fn features(&self, pixels: &Tensor) -> Result<Features> {
        let stages = self.encode(pixels)?;
        let grids = stages.iter().map(|(_, h, w)| (*h, *w)).collect();
        Ok(Features { tensors: stages.into_iter().map(|(t, _, _)| t).collect(), grids })
    }

    fn decode(&self, features: &Features) -> Result<Tensor> {
        let stages: Vec<(Tensor, usize, usize)> = features.tensors.iter().cloned().zip(&features.grids).map(|(t, &(h, w))| (t, h, w)).collect();
        SegformerForSemanticSegmentation::decode(self, &stages)
    }

    fn block_walk(&self) -> Option<&dyn BlockWalk> {
        None
    }
}
