//! SAM 3's DETR encoder (`Sam3DetrEncoder`): the ×1 FPN level's tokens through pre-norm layers of
//! self-attention (sine positions added to queries and keys), cross-attention to the prompt under
//! its padding mask, and a ReLU MLP, once per prompt.
use candle_core::Tensor;
use candle_nn::LayerNorm;

use super::attention::{Attention, Mlp};
use super::config::StackConfig;
use super::geometry::EPS;
use crate::error::Result;
use crate::nn::grad::layer_norm as norm;
use crate::nn::layers::layer_norm;
use crate::weights::Vb;

/// A pre-norm layer of self-attention, cross-attention and MLP (the DETR and geometry encoders').
pub(super) struct Layer {
    pub(super) norm1: LayerNorm,
    pub(super) self_attn: Attention,
    pub(super) norm2: LayerNorm,
    pub(super) cross_attn: Attention,
    pub(super) norm3: LayerNorm,
    pub(super) mlp: Mlp,
}

/// Loads the `layers.*` under `vb` of a stack configured by `c`.
pub(super) fn load_layers(vb: &Vb, c: &StackConfig) -> Result<Vec<Layer>> {
    let d = c.hidden_size;
    (0..c.num_layers)
        .map(|i| {
            let l = vb.pp("layers").pp(i);
            Ok(Layer {
                norm1: layer_norm(&l.pp("layer_norm1"), d, EPS)?,
                self_attn: Attention::load(&l.pp("self_attn"), d, c.num_attention_heads)?,
                norm2: layer_norm(&l.pp("layer_norm2"), d, EPS)?,
                cross_attn: Attention::load(&l.pp("cross_attn"), d, c.num_attention_heads)?,
                norm3: layer_norm(&l.pp("layer_norm3"), d, EPS)?,
                mlp: Mlp::load(&l.pp("mlp"), d, c.intermediate_size, &c.hidden_act)?,
            })
        })
        .collect()
}

/// The encoder (`detr_encoder`).
pub(crate) struct DetrEncoder {
    layers: Vec<Layer>,
}

impl DetrEncoder {
    /// Loads `layers.*` under `vb`.
    pub(crate) fn load(vb: &Vb, c: &StackConfig) -> Result<Self> {
        let layers = load_layers(vb, c)?;
        Ok(DetrEncoder { layers })
    }

    /// The encoded image tokens `[P, N, D]` for image tokens `[1, N, D]` (shared by the prompts) with
    /// positions `[1, N, D]`, prompts `[P, L, D]` and their padding bias `[P, 1, 1, L]`. The first
    /// layer's self-attention does not depend on the prompt: it runs once.
    pub(crate) fn forward(&self, vision: &Tensor, pos: &Tensor, prompt: &Tensor, prompt_bias: &Tensor) -> Result<Tensor> {
        let (p, n, d) = (prompt.dim(0)?, vision.dim(1)?, vision.dim(2)?);
        let mut x = vision.clone();
        for l in &self.layers {
            let h = norm(&l.norm1, &x)?;
            let hp = h.broadcast_add(pos)?;
            x = (&x + l.self_attn.forward(&hp, &hp, &h, None)?)?;
            if x.dim(0)? != p {
                x = x.broadcast_as((p, n, d))?.contiguous()?;
            }
            let h = norm(&l.norm2, &x)?;
            x = (&x + l.cross_attn.forward(&h, prompt, prompt, Some(prompt_bias))?)?;
            let h = norm(&l.norm3, &x)?;
            x = (&x + l.mlp.forward(&h)?)?;
        }
        Ok(x)
    }
}
