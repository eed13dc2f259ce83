//! `LGATrBlock`: pre-norm attention and MLP with residual connections.
use candle_core::Tensor;
use candle_nn::VarBuilder;

use super::attention::GaSelfAttention;
use super::config::LgatrConfig;
use super::mlp::GeoMlp;
use super::norm::EquiNorm;
use crate::error::Result;

/// One `LGATrBlock` on fused rows `(B·N, 16C + S)`.
#[derive(Debug, Clone)]
pub(crate) struct LgatrBlock {
    norm1: EquiNorm,
    attention: GaSelfAttention,
    norm2: EquiNorm,
    mlp: GeoMlp,
}

impl LgatrBlock {
    /// Loads `norm1`, `attention`, `norm2`, `mlp` under `vb` (= `blocks.{i}`).
    pub(crate) fn load(vb: &VarBuilder, cfg: &LgatrConfig) -> Result<Self> {
        let (c, s, affine) = (cfg.hidden_mv_channels, cfg.hidden_s_channels, cfg.norm_elementwise_affine);
        Ok(Self {
            norm1: EquiNorm::load(&vb.pp("norm1"), c, s, affine)?,
            attention: GaSelfAttention::load(&vb.pp("attention"), cfg)?,
            norm2: EquiNorm::load(&vb.pp("norm2"), c, s, affine)?,
            mlp: GeoMlp::load(&vb.pp("mlp"), cfg)?,
        })
    }

    /// `x + attn(norm1(x))`, then `+ mlp(norm2(·))`.
    pub(crate) fn forward(
        &self,
        x: &Tensor,
        add: Option<&Tensor>,
        b: usize,
        n: usize,
        bias: Option<&Tensor>,
    ) -> Result<Tensor> {
        let h = self.attention.forward(&self.norm1.forward(x)?, add, b, n, bias)?;
        let x = (x + h)?;
        let h = self.mlp.forward(&self.norm2.forward(&x)?)?;
        Ok((x + h)?)
    }
}
