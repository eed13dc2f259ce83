//! The geometry encoder on an empty prompt, as the original SAM 3 always runs it: one learned token
//! (`cls_embed` → `final_proj` → LayerNorm) through the encoder's layers (self-attention, then
//! cross-attention to the ×1 FPN level with its sine positions added to the keys, then a ReLU MLP,
//! each pre-norm and residual) and the output LayerNorm. It depends only on the image; the prompt is
//! the text's tokens followed by it. (transformers' `Sam3Model` skips it when no box is given.) Box
//! prompts are not built.
use candle_core::{Module, Tensor};
use candle_nn::LayerNorm;

use super::config::StackConfig;
use super::detr_encoder::{load_layers, Layer};
use crate::error::Result;
use crate::nn::grad::layer_norm as norm;
use crate::nn::layers::layer_norm;
use crate::nn::Linear;
use crate::weights::Vb;

/// `nn.LayerNorm`'s default epsilon, which every prompt-side LayerNorm of SAM 3 keeps.
pub(crate) const EPS: f64 = 1e-5;

/// The geometry encoder as far as an empty prompt uses it.
pub(crate) struct EmptyGeometry {
    cls: Tensor,
    final_proj: Linear,
    prompt_norm: LayerNorm,
    layers: Vec<Layer>,
    output_norm: LayerNorm,
}

impl EmptyGeometry {
    /// Loads `geometry_encoder.*` (what an empty prompt reads) under `vb`.
    pub(crate) fn load(vb: &Vb, c: &StackConfig) -> Result<Self> {
        let d = c.hidden_size;
        let layers = load_layers(vb, c)?;
        Ok(EmptyGeometry {
            cls: vb.get((1, d), "cls_embed.weight")?,
            final_proj: Linear::load(&vb.pp("final_proj"), d, d, true)?,
            prompt_norm: layer_norm(&vb.pp("prompt_layer_norm"), d, EPS)?,
            layers,
            output_norm: layer_norm(&vb.pp("output_layer_norm"), d, EPS)?,
        })
    }

    /// The prompt token `[B, 1, D]` for image tokens `[B, N, D]` with sine positions `[1, N, D]`.
    pub(crate) fn forward(&self, vision: &Tensor, pos: &Tensor) -> Result<Tensor> {
        let b = vision.dim(0)?;
        let keys = vision.broadcast_add(pos)?;
        let x = self.cls.unsqueeze(0)?.repeat((b, 1, 1))?;
        let mut x = norm(&self.prompt_norm, &self.final_proj.forward(&x)?)?;
        for l in &self.layers {
            let h = norm(&l.norm1, &x)?;
            x = (&x + l.self_attn.forward(&h, &h, &h, None)?)?;
            let h = norm(&l.norm2, &x)?;
            x = (&x + l.cross_attn.forward(&h, &keys, vision, None)?)?;
            let h = norm(&l.norm3, &x)?;
            x = (&x + l.mlp.forward(&h)?)?;
        }
        Ok(norm(&self.output_norm, &x)?)
    }
}
