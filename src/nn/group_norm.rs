//! GroupNorm as `nn.GroupNorm` computes it, optionally fused with the ReLU that follows it.
use candle_core::Tensor;

use crate::error::Result;
use crate::kernels::group_norm::group_norm;
use crate::weights::Vb;

/// A GroupNorm layer: `groups` groups over the channels, per-channel weight and bias.
#[derive(Debug, Clone)]
pub struct GroupNorm {
    weight: Tensor,
    bias: Tensor,
    groups: usize,
    eps: f64,
}

impl GroupNorm {
    /// Loads `weight` and `bias` `[channels]` under `vb`.
    pub fn load(vb: &Vb, channels: usize, groups: usize, eps: f64) -> Result<Self> {
        Ok(GroupNorm { weight: vb.get(channels, "weight")?, bias: vb.get(channels, "bias")?, groups, eps })
    }

    /// `x` `[B, C, …]` normalised, then ReLU where `relu` (one pass on the CPU in f32 inference).
    pub fn forward(&self, x: &Tensor, relu: bool) -> Result<Tensor> {
        Ok(group_norm(x, &self.weight, &self.bias, self.groups, self.eps, relu)?)
    }
}
