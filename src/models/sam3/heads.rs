//! SAM 3's heads on the decoded queries: the dot-product scoring against the pooled prompt
//! (`Sam3DotProductScoring`) and the mask decoder (`Sam3MaskDecoder`: the encoded image attends to
//! the prompt, a pixel decoder climbs the FPN to the ×4 level, and the queries' embeddings dotted
//! with its projection give the instance masks; a 1×1 conv gives the semantic map).
use candle_core::{Module, Tensor, D};
use candle_nn::{Conv2dConfig, LayerNorm};

use super::attention::{Attention, ReluMlp};
use super::config::Config;
use super::geometry::EPS;
use crate::error::Result;
use crate::nn::conv::Conv2d;
use crate::nn::grad::layer_norm as norm;
use crate::nn::group_norm::GroupNorm;
use crate::nn::layers::{conv2d, layer_norm};
use crate::nn::Linear;
use crate::weights::Vb;

/// Scores are clamped to ±this.
const SCORE_CLAMP: f64 = 12.0;
/// The pixel decoder's GroupNorm groups.
const GROUPS: usize = 8;
/// `nn.GroupNorm`'s default epsilon.
const GROUP_NORM_EPS: f64 = 1e-5;

/// The dot-product scoring (`dot_product_scoring`).
pub(crate) struct Scoring {
    text_mlp: ReluMlp,
    text_norm: LayerNorm,
    text_proj: Linear,
    query_proj: Linear,
    scale: f64,
}

impl Scoring {
    /// Loads `dot_product_scoring.*` under `vb`.
    pub(crate) fn load(vb: &Vb, c: &Config) -> Result<Self> {
        let d = c.width();
        Ok(Scoring {
            text_mlp: ReluMlp::load(&vb.pp("text_mlp"), &["layer1", "layer2"], &[d, c.detr_decoder_config.intermediate_size, d])?,
            text_norm: layer_norm(&vb.pp("text_mlp_out_norm"), d, EPS)?,
            text_proj: Linear::load(&vb.pp("text_proj"), d, d, true)?,
            query_proj: Linear::load(&vb.pp("query_proj"), d, d, true)?,
            scale: 1.0 / (d as f64).sqrt(),
        })
    }

    /// The projected mean of the prompt's tokens `[P, L, D]` under `mask` `[P, L]`, `[P, D]`.
    pub(crate) fn prompt_vector(&self, prompt: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let t = norm(&self.text_norm, &(self.text_mlp.forward(prompt)? + prompt)?)?;
        let m = mask.to_dtype(t.dtype())?.unsqueeze(D::Minus1)?;
        let count = m.sum(1)?.clamp(1f32, f32::MAX)?;
        let pooled = t.broadcast_mul(&m)?.sum(1)?.broadcast_div(&count)?;
        Ok(self.text_proj.forward(&pooled)?)
    }

    /// The logits `[P, Q]` of queries `[P, Q, D]` against prompt vectors `[P, D]`.
    pub(crate) fn logits(&self, queries: &Tensor, prompt: &Tensor) -> Result<Tensor> {
        let q = self.query_proj.forward(queries)?;
        let s = q.matmul(&prompt.unsqueeze(D::Minus1)?)?.squeeze(D::Minus1)?;
        Ok(s.affine(self.scale, 0.0)?.clamp(-SCORE_CLAMP, SCORE_CLAMP)?)
    }
}

/// The mask decoder (`mask_decoder`).
pub(crate) struct MaskDecoder {
    cross_attn: Attention,
    cross_norm: LayerNorm,
    convs: Vec<Conv2d>,
    norms: Vec<GroupNorm>,
    mask_embed: ReluMlp,
    /// The 1×1 instance projection's weight `[D, D]` (out × in) and bias `[D, 1]`.
    instance: (Tensor, Tensor),
    semantic: Conv2d,
}

/// Masks and semantic map of some prompts.
pub(crate) struct Masks {
    /// `[P, Q, H, W]` at the ×4 level (`[P, K, H, W]` for `K` chosen queries; `None` for none).
    pub(crate) instances: Option<Tensor>,
    /// `[P, 1, H, W]`.
    pub(crate) semantic: Tensor,
}

impl MaskDecoder {
    /// Loads `mask_decoder.*` under `vb`, the stages that `levels` FPN levels use.
    pub(crate) fn load(vb: &Vb, c: &Config, levels: usize) -> Result<Self> {
        let d = c.width();
        let pd = vb.pp("pixel_decoder");
        let same = Conv2dConfig { padding: 1, ..Default::default() };
        let stages = levels - 1;
        let convs = (0..stages).map(|i| conv2d(&pd.pp("conv_layers").pp(i), d, d, 3, same, true)).collect::<Result<_>>()?;
        let norms = (0..stages)
            .map(|i| GroupNorm::load(&pd.pp("norms").pp(i), d, GROUPS, GROUP_NORM_EPS))
            .collect::<Result<_>>()?;
        let layers = vb.pp("mask_embedder").pp("layers");
        Ok(MaskDecoder {
            cross_attn: Attention::load(&vb.pp("prompt_cross_attn"), d, c.mask_decoder_config.num_attention_heads)?,
            cross_norm: layer_norm(&vb.pp("prompt_cross_attn_norm"), d, EPS)?,
            convs,
            norms,
            mask_embed: ReluMlp::load(&layers, &["0", "1", "2"], &[d, d, d, d])?,
            instance: {
                let ip = vb.pp("instance_projection");
                (ip.get((d, d, 1, 1), "weight")?.reshape((d, d))?, ip.get(d, "bias")?.reshape((d, 1))?)
            },
            semantic: conv2d(&vb.pp("semantic_projection"), d, 1, 1, Conv2dConfig::default(), true)?,
        })
    }

    /// The masks of queries `[P, Q, D]` from the encoded image `[P, N, D]` (an `h × w` grid), the
    /// finer FPN levels `[1, D, ·, ·]` (finest first) and the prompts `[P, L, D]` with their padding
    /// bias; instance masks for the queries `keep` (u32 indices) lists, or all of them.
    pub(crate) fn forward(&self, queries: &Tensor, memory: &Tensor, (h, w): (usize, usize), finer: &[Tensor], (prompt, prompt_bias): (&Tensor, &Tensor), keep: Option<&Tensor>) -> Result<Masks> {
        let (p, _, d) = memory.dims3()?;
        let attended = (memory + self.cross_attn.forward(&norm(&self.cross_norm, memory)?, prompt, prompt, Some(prompt_bias))?)?;
        let mut x = attended.transpose(1, 2)?.reshape((p, d, h, w))?;
        for (i, skip) in finer.iter().rev().enumerate() {
            let (_, _, sh, sw) = skip.dims4()?;
            let summed = x.upsample_nearest2d(sh, sw)?.broadcast_add(skip)?;
            // Each map dropped as soon as the next is made: at 288² every one is 81 MiB.
            let conv = self.convs[i].forward(&summed)?;
            drop(summed);
            x = self.norms[i].forward(&conv, true)?;
        }
        let (_, _, oh, ow) = x.dims4()?;
        let queries = match keep {
            Some(k) if k.dim(0)? == 0 => None,
            Some(k) => Some(queries.index_select(k, 1)?),
            None => Some(queries.clone()),
        };
        // masks = E (W x + b) taken as (E W) x + E b: the same sum in another order, without the
        // projected map (81 MiB at 288²) and with a fifth of the products.
        let instances = match queries {
            Some(queries) => {
                let embed = self.mask_embed.forward(&queries)?;
                let (w, b) = &self.instance;
                let (ew, eb) = (embed.broadcast_matmul(w)?, embed.broadcast_matmul(b)?);
                Some(ew.matmul(&x.reshape((p, d, oh * ow))?)?.broadcast_add(&eb)?.reshape((p, embed.dim(1)?, oh, ow))?)
            }
            None => None,
        };
        let semantic = self.semantic.forward(&x)?;
        Ok(Masks { instances, semantic })
    }
}

/// `(cx, cy, w, h)` → `(x0, y0, x1, y1)` over the last dimension.
pub(crate) fn cxcywh_to_xyxy(b: &Tensor) -> Result<Tensor> {
    let c = b.narrow(D::Minus1, 0, 2)?;
    let half = b.narrow(D::Minus1, 2, 2)?.affine(0.5, 0.0)?;
    Ok(Tensor::cat(&[(&c - &half)?, (&c + &half)?], D::Minus1)?)
}
