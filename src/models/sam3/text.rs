//! SAM 3's text side: CLIP's causal text transformer (`text_encoder.text_model`: token and position
//! embeddings, pre-norm blocks under a causal and key-padding mask, a final LayerNorm) and the
//! per-token `text_projection` to the prompt width. CLIP's own pooled projection is not used.
use candle_core::{DType, Module, Tensor};
use candle_nn::{Embedding, LayerNorm};

use super::attention::{Attention, Mlp};
use super::config::TextConfig;
use crate::error::{Error, Result};
use crate::nn::grad::layer_norm as norm;
use crate::nn::layers::layer_norm;
use crate::nn::Linear;
use crate::weights::Vb;

struct Layer {
    norm1: LayerNorm,
    attn: Attention,
    norm2: LayerNorm,
    mlp: Mlp,
}

/// The text encoder and its projection.
pub(crate) struct TextEncoder {
    tokens: Embedding,
    positions: Tensor,
    layers: Vec<Layer>,
    final_norm: LayerNorm,
    projection: Linear,
    config: TextConfig,
}

impl TextEncoder {
    /// Loads `text_encoder.text_model.*` and `text_projection` under `vb` (the model root), projecting
    /// to width `out`.
    pub(crate) fn load(vb: &Vb, c: &TextConfig, out: usize) -> Result<Self> {
        let t = vb.pp("text_encoder").pp("text_model");
        let d = c.hidden_size;
        let e = t.pp("embeddings");
        let tokens = Embedding::new(e.get((c.vocab_size, d), "token_embedding.weight")?, d);
        let positions = e.get((c.max_position_embeddings, d), "position_embedding.weight")?;
        let layers = (0..c.num_hidden_layers)
            .map(|i| {
                let l = t.pp("encoder").pp("layers").pp(i);
                Ok(Layer {
                    norm1: layer_norm(&l.pp("layer_norm1"), d, c.layer_norm_eps)?,
                    attn: Attention::load_named(&l.pp("self_attn"), d, c.num_attention_heads, "out_proj")?,
                    norm2: layer_norm(&l.pp("layer_norm2"), d, c.layer_norm_eps)?,
                    mlp: Mlp::load(&l.pp("mlp"), d, c.intermediate_size, &c.hidden_act)?,
                })
            })
            .collect::<Result<_>>()?;
        Ok(TextEncoder {
            tokens,
            positions,
            layers,
            final_norm: layer_norm(&t.pp("final_layer_norm"), d, c.layer_norm_eps)?,
            projection: Linear::load(&vb.pp("text_projection"), d, out, true)?,
            config: c.clone(),
        })
    }

    /// The projected features `[P, L, out]` of token ids `[P, L]` (u32) under `mask` `[P, L]` (1 = token,
    /// 0 = padding).
    pub(crate) fn forward(&self, ids: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let (p, l) = ids.dims2()?;
        if l > self.config.max_position_embeddings {
            return Err(Error::Input(format!("{l} tokens per prompt; the text encoder's context is {}", self.config.max_position_embeddings)));
        }
        let max = ids.max_all()?.to_dtype(DType::U32)?.to_scalar::<u32>()?;
        if max as usize >= self.config.vocab_size {
            return Err(Error::Input(format!("token id {max} is outside the vocabulary of {}", self.config.vocab_size)));
        }
        let dtype = self.positions.dtype();
        let x = self.tokens.forward(ids)?.broadcast_add(&self.positions.narrow(0, 0, l)?.unsqueeze(0)?)?;
        let bias = causal_padding_bias(mask, p, l, dtype)?;
        let mut x = x;
        for layer in &self.layers {
            let h = norm(&layer.norm1, &x)?;
            x = (&x + layer.attn.forward(&h, &h, &h, Some(&bias))?)?;
            let h = norm(&layer.norm2, &x)?;
            x = (&x + layer.mlp.forward(&h)?)?;
        }
        Ok(self.projection.forward(&norm(&self.final_norm, &x)?)?)
    }
}

/// `[P, 1, L, L]`: 0 where key `j ≤` query `i` and key `j` is a token, −∞ elsewhere.
fn causal_padding_bias(mask: &Tensor, p: usize, l: usize, dtype: DType) -> Result<Tensor> {
    let m = mask.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let mut out = vec![0f32; p * l * l];
    for (b, row) in m.iter().enumerate() {
        if row.first().is_none_or(|&v| v < 0.5) {
            return Err(Error::Input(format!("prompt {b}: its attention mask does not start with a token")));
        }
        for i in 0..l {
            for (j, &valid) in row.iter().enumerate() {
                if j > i || valid < 0.5 {
                    out[(b * l + i) * l + j] = f32::NEG_INFINITY;
                }
            }
        }
    }
    Ok(Tensor::from_vec(out, (p, 1, l, l), mask.device())?.to_dtype(dtype)?)
}
