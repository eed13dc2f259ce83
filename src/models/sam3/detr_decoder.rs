//! SAM 3's DETR decoder (`Sam3DetrDecoder`): a presence token and `num_queries` learned queries with
//! learned reference boxes, through post-norm layers of self-attention, cross-attention to the
//! prompt and cross-attention to the encoded image under the log-scale box relative-position bias;
//! queries are conditioned on the sine encoding of their boxes, which each layer refines. Returns
//! the last layer's normed queries, boxes and presence logit.
use candle_core::{DType, Tensor, D};
use candle_nn::LayerNorm;

use super::attention::{Attention, Mlp, ReluMlp};
use super::config::StackConfig;
use super::geometry::EPS;
use super::neck::box_sine;
use crate::error::Result;
use crate::nn::grad::layer_norm as norm;
use crate::nn::layers::layer_norm;
use crate::weights::Vb;

/// The presence logit is clamped to ±this.
const PRESENCE_CLAMP: f64 = 10.0;

struct Layer {
    self_attn: Attention,
    self_norm: LayerNorm,
    text_attn: Attention,
    text_norm: LayerNorm,
    vision_attn: Attention,
    vision_norm: LayerNorm,
    mlp: Mlp,
    mlp_norm: LayerNorm,
}

/// What the decoder gives the heads.
pub(crate) struct Decoded {
    /// The last layer's queries after `output_layer_norm`, `[P, Q, D]`.
    pub(crate) queries: Tensor,
    /// Their boxes, (cx, cy, w, h) in 0..1, `[P, Q, 4]`.
    pub(crate) boxes: Tensor,
    /// The presence logit, `[P, 1]`.
    pub(crate) presence: Tensor,
}

/// The decoder (`detr_decoder`).
pub(crate) struct DetrDecoder {
    layers: Vec<Layer>,
    output_norm: LayerNorm,
    box_head: ReluMlp,
    queries: Tensor,
    reference: Tensor,
    presence_token: Tensor,
    presence_head: ReluMlp,
    presence_norm: LayerNorm,
    ref_point_head: ReluMlp,
    rpb_x: ReluMlp,
    rpb_y: ReluMlp,
    heads: usize,
}

impl DetrDecoder {
    /// Loads `detr_decoder.*` under `vb`.
    pub(crate) fn load(vb: &Vb, c: &StackConfig) -> Result<Self> {
        let (d, h) = (c.hidden_size, c.num_attention_heads);
        let three = ["layer1", "layer2", "layer3"];
        let layers = (0..c.num_layers)
            .map(|i| {
                let l = vb.pp("layers").pp(i);
                Ok(Layer {
                    self_attn: Attention::load(&l.pp("self_attn"), d, h)?,
                    self_norm: layer_norm(&l.pp("self_attn_layer_norm"), d, EPS)?,
                    text_attn: Attention::load(&l.pp("text_cross_attn"), d, h)?,
                    text_norm: layer_norm(&l.pp("text_cross_attn_layer_norm"), d, EPS)?,
                    vision_attn: Attention::load(&l.pp("vision_cross_attn"), d, h)?,
                    vision_norm: layer_norm(&l.pp("vision_cross_attn_layer_norm"), d, EPS)?,
                    mlp: Mlp::load(&l.pp("mlp"), d, c.intermediate_size, &c.hidden_act)?,
                    mlp_norm: layer_norm(&l.pp("mlp_layer_norm"), d, EPS)?,
                })
            })
            .collect::<Result<_>>()?;
        Ok(DetrDecoder {
            layers,
            output_norm: layer_norm(&vb.pp("output_layer_norm"), d, EPS)?,
            box_head: ReluMlp::load(&vb.pp("box_head"), &three, &[d, d, d, 4])?,
            queries: vb.get((c.num_queries, d), "query_embed.weight")?,
            reference: vb.get((c.num_queries, 4), "reference_points.weight")?,
            presence_token: vb.get((1, d), "presence_token.weight")?,
            presence_head: ReluMlp::load(&vb.pp("presence_head"), &three, &[d, d, d, 1])?,
            presence_norm: layer_norm(&vb.pp("presence_layer_norm"), d, EPS)?,
            ref_point_head: ReluMlp::load(&vb.pp("ref_point_head"), &three[..2], &[2 * d, d, d])?,
            rpb_x: ReluMlp::load(&vb.pp("box_rpb_embed_x"), &three[..2], &[2, d, h])?,
            rpb_y: ReluMlp::load(&vb.pp("box_rpb_embed_y"), &three[..2], &[2, d, h])?,
            heads: h,
        })
    }

    /// Decodes the encoded image `[P, N, D]` (an `h × w` grid, positions `[1, N, D]`) against the
    /// prompts `[P, L, D]` with their padding bias `[P, 1, 1, L]`.
    pub(crate) fn forward(&self, memory: &Tensor, pos: &Tensor, (h, w): (usize, usize), prompt: &Tensor, prompt_bias: &Tensor) -> Result<Decoded> {
        let p = memory.dim(0)?;
        let (q, d) = self.queries.dims2()?;
        let dtype = memory.dtype();
        let mut x = Tensor::cat(&[&self.presence_token, &self.queries], 0)?.unsqueeze(0)?.repeat((p, 1, 1))?;
        let mut boxes = candle_nn::ops::sigmoid(&self.reference.to_dtype(DType::F32)?)?.unsqueeze(0)?.repeat((p, 1, 1))?;
        let keys = memory.broadcast_add(pos)?;
        let zero_row = Tensor::zeros((p, 1, d), dtype, memory.device())?;
        let mut presence = None;
        for (i, l) in self.layers.iter().enumerate() {
            let sine = Tensor::from_vec(box_sine(&boxes.flatten_all()?.to_vec1::<f32>()?, d / 2), (p, q, 2 * d), memory.device())?.to_dtype(dtype)?;
            let qpos = Tensor::cat(&[&zero_row, &self.ref_point_head.forward(&sine)?], 1)?;
            let rpb = self.relative_position_bias(&boxes, h, w, dtype)?;
            let xq = (&x + &qpos)?;
            x = norm(&l.self_norm, &(&x + l.self_attn.forward(&xq, &xq, &x, None)?)?)?;
            let xq = (&x + &qpos)?;
            x = norm(&l.text_norm, &(&x + l.text_attn.forward(&xq, prompt, prompt, Some(prompt_bias))?)?)?;
            let xq = (&x + &qpos)?;
            x = norm(&l.vision_norm, &(&x + l.vision_attn.forward(&xq, &keys, memory, Some(&rpb))?)?)?;
            x = norm(&l.mlp_norm, &(&x + l.mlp.forward(&x)?)?)?;
            let queries = norm(&self.output_norm, &x.narrow(1, 1, q)?)?;
            let delta = self.box_head.forward(&queries)?.to_dtype(DType::F32)?;
            boxes = candle_nn::ops::sigmoid(&(delta + inverse_sigmoid(&boxes)?)?)?;
            if i + 1 == self.layers.len() {
                let logit = self.presence_head.forward(&norm(&self.presence_norm, &x.narrow(1, 0, 1)?)?)?.squeeze(D::Minus1)?;
                presence = Some((queries, logit.clamp(-PRESENCE_CLAMP, PRESENCE_CLAMP)?));
            }
        }
        let (queries, presence) = presence.ok_or_else(|| crate::error::Error::Config("the DETR decoder has no layers".into()))?;
        Ok(Decoded { queries, boxes: boxes.to_dtype(dtype)?, presence })
    }

    /// The bias `[P, heads, 1 + Q, h·w]` that each query's box puts on the image tokens (zero for the
    /// presence token): MLPs of the log-scaled offsets of each column from the box's left and right
    /// edges and of each row from its top and bottom, summed.
    fn relative_position_bias(&self, boxes: &Tensor, h: usize, w: usize, dtype: DType) -> Result<Tensor> {
        let (p, q, _) = boxes.dims3()?;
        let b = boxes.flatten_all()?.to_vec1::<f32>()?;
        let log = |v: f32| {
            let v = v * 8.0;
            v.signum() * (v.abs() + 1.0).log2() / 3.0
        };
        let deltas = |n: usize, lo: usize| -> Vec<f32> {
            let mut out = Vec::with_capacity(p * q * n * 2);
            for bx in b.chunks_exact(4) {
                let (c, s) = (bx[lo], bx[lo + 2]);
                let (a, z) = (c - 0.5 * s, c + 0.5 * s);
                for j in 0..n {
                    let coord = j as f32 / n as f32;
                    out.push(log(coord - a));
                    out.push(log(coord - z));
                }
            }
            out
        };
        let dev = boxes.device();
        let dx = Tensor::from_vec(deltas(w, 0), (p, q, w, 2), dev)?.to_dtype(dtype)?;
        let dy = Tensor::from_vec(deltas(h, 1), (p, q, h, 2), dev)?.to_dtype(dtype)?;
        let bx = self.rpb_x.forward(&dx)?.permute((0, 3, 1, 2))?.unsqueeze(3)?; // [P, H, Q, 1, w]
        let by = self.rpb_y.forward(&dy)?.permute((0, 3, 1, 2))?.unsqueeze(4)?; // [P, H, Q, h, 1]
        let bias = by.broadcast_add(&bx)?.reshape((p, self.heads, q, h * w))?;
        let zero = Tensor::zeros((p, self.heads, 1, h * w), dtype, dev)?;
        Ok(Tensor::cat(&[&zero, &bias], 2)?)
    }
}

/// `log(x / (1 − x))` with both clamped to at least 1e-3 (and `x` to 0..1), as the reference.
fn inverse_sigmoid(x: &Tensor) -> Result<Tensor> {
    let x = x.clamp(0f32, 1f32)?;
    let x1 = x.clamp(1e-3f32, f32::MAX)?;
    let x2 = x.affine(-1.0, 1.0)?.clamp(1e-3f32, f32::MAX)?;
    Ok((x1 / x2)?.log()?)
}
