//! The DINOv2 ViT backbone (transformers `Dinov2Backbone`, hub key layout), batched, any input size.
use candle_core::{Module, Tensor, D};
use candle_nn::{Conv2d, Conv2dConfig, LayerNorm};
use serde::Deserialize;

use super::activation::Activation;
use super::attention::{merge_heads, sdpa, split_heads};
use super::interpolate::{bicubic, Resize};
use super::layers::{conv2d, layer_norm};
use super::linear::Linear;
use crate::error::{Error, Result};
use crate::weights::Vb;

/// `Dinov2Config` as transformers 5.24 writes it (defaults are that class's).
#[derive(Debug, Clone, Deserialize)]
pub struct Dinov2Config {
    /// Token width.
    #[serde(default = "d768")]
    pub hidden_size: usize,
    /// Number of transformer blocks.
    #[serde(default = "d12")]
    pub num_hidden_layers: usize,
    /// Attention heads.
    #[serde(default = "d12")]
    pub num_attention_heads: usize,
    /// MLP width as a multiple of `hidden_size`.
    #[serde(default = "d4f")]
    pub mlp_ratio: f64,
    /// MLP activation.
    #[serde(default = "gelu")]
    pub hidden_act: String,
    /// LayerNorm epsilon.
    #[serde(default = "eps6")]
    pub layer_norm_eps: f64,
    /// Training image size (sets the position-embedding grid).
    #[serde(default = "d224")]
    pub image_size: usize,
    /// Patch size.
    #[serde(default = "d14")]
    pub patch_size: usize,
    /// Input channels.
    #[serde(default = "d3")]
    pub num_channels: usize,
    /// Whether q/k/v have biases.
    #[serde(default = "yes")]
    pub qkv_bias: bool,
    /// SwiGLU feed-forward instead of the GELU MLP (ViT-g).
    #[serde(default)]
    pub use_swiglu_ffn: bool,
    /// Indices into the hidden states (0 = embeddings) returned as feature maps.
    #[serde(default)]
    pub out_indices: Option<Vec<i64>>,
    /// Stage names returned as feature maps (`stageK`), used when `out_indices` is absent.
    #[serde(default)]
    pub out_features: Option<Vec<String>>,
    /// Apply the final LayerNorm to each returned map.
    #[serde(default = "yes")]
    pub apply_layernorm: bool,
}

fn d768() -> usize { 768 }
fn d12() -> usize { 12 }
fn d4f() -> f64 { 4.0 }
fn gelu() -> String { "gelu".into() }
fn eps6() -> f64 { 1e-6 }
fn d224() -> usize { 224 }
fn d14() -> usize { 14 }
fn d3() -> usize { 3 }
fn yes() -> bool { true }

impl Dinov2Config {
    /// The hidden-state indices (0 = embeddings, k = after block k) to return, validated.
    pub fn feature_indices(&self) -> Result<Vec<usize>> {
        let n = self.num_hidden_layers as i64;
        let raw: Vec<i64> = match (&self.out_indices, &self.out_features) {
            (Some(ix), _) => ix.clone(),
            (None, Some(names)) => names
                .iter()
                .map(|s| match s.as_str() {
                    "stem" => Ok(0),
                    s => s
                        .strip_prefix("stage")
                        .and_then(|k| k.parse::<i64>().ok())
                        .ok_or_else(|| Error::Config(format!("bad out_features entry `{s}`"))),
                })
                .collect::<Result<_>>()?,
            (None, None) => vec![n],
        };
        raw.iter()
            .map(|&i| {
                let j = if i < 0 { i + n + 1 } else { i };
                if (0..=n).contains(&j) {
                    Ok(j as usize)
                } else {
                    Err(Error::Config(format!("out index {i} outside 0..={n}")))
                }
            })
            .collect()
    }

    fn validate(&self) -> Result<()> {
        if self.hidden_size == 0 || self.num_attention_heads == 0 || self.hidden_size % self.num_attention_heads != 0 {
            return Err(Error::Config(format!(
                "hidden_size {} is not a positive multiple of num_attention_heads {}",
                self.hidden_size, self.num_attention_heads
            )));
        }
        if self.patch_size == 0 || self.image_size < self.patch_size {
            return Err(Error::Config(format!("bad patch_size {} / image_size {}", self.patch_size, self.image_size)));
        }
        Ok(())
    }
}

/// How the position-embedding grid is resized to the input's patch grid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PosEmbedResize {
    /// transformers 5.x: bicubic by output size; the stored table is used as is for its own square size.
    HfSize,
    /// Original DINOv2 / Depth Anything: bicubic by scale factor `(n + 0.1) / grid`.
    OriginalOffset,
}

enum Ffn {
    Mlp { fc1: Linear, act: Activation, fc2: Linear },
    SwiGlu { gate_up: Linear, hidden: usize, down: Linear },
}

impl Ffn {
    fn load(vb: &Vb, cfg: &Dinov2Config) -> Result<Self> {
        let d = cfg.hidden_size;
        if cfg.use_swiglu_ffn {
            let base = (d as f64 * cfg.mlp_ratio) as usize;
            let hidden = ((base as f64 * 2.0 / 3.0) as usize + 7) / 8 * 8;
            let gate_up = if vb.contains("weights_in.weight") {
                Linear::load(&vb.pp("weights_in"), d, 2 * hidden, true)?
            } else {
                let g = Linear::load(&vb.pp("gate_proj"), d, hidden, true)?;
                let u = Linear::load(&vb.pp("up_proj"), d, hidden, true)?;
                Linear::concat(&[g, u])?.ok_or_else(|| Error::Config("quantized SwiGLU halves are not supported".into()))?
            };
            let down = if vb.contains("weights_out.weight") {
                Linear::load(&vb.pp("weights_out"), hidden, d, true)?
            } else {
                Linear::load(&vb.pp("down_proj"), hidden, d, true)?
            };
            return Ok(Ffn::SwiGlu { gate_up, hidden, down });
        }
        let hidden = (d as f64 * cfg.mlp_ratio) as usize;
        Ok(Ffn::Mlp {
            fc1: Linear::load(&vb.pp("fc1"), d, hidden, true)?,
            act: Activation::from_name(&cfg.hidden_act)?,
            fc2: Linear::load(&vb.pp("fc2"), hidden, d, true)?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Ffn::Mlp { fc1, act, fc2 } => fc2.forward(&act.forward(&fc1.forward(x)?)?)?,
            Ffn::SwiGlu { gate_up, hidden, down } => {
                let gu = gate_up.forward(x)?;
                let g = gu.narrow(D::Minus1, 0, *hidden)?;
                let u = gu.narrow(D::Minus1, *hidden, *hidden)?;
                down.forward(&(g.silu()? * u)?)?
            }
        })
    }
}

/// Self-attention with fused q/k/v projections where the weights allow.
pub struct SelfAttention {
    qkv: Option<Linear>,
    q: Linear,
    k: Linear,
    v: Linear,
    out: Linear,
    heads: usize,
    dim: usize,
}

impl SelfAttention {
    /// Loads `attention.attention.{query,key,value}` and `attention.output.dense` under `vb`.
    pub fn load(vb: &Vb, dim: usize, heads: usize, bias: bool) -> Result<Self> {
        let a = vb.pp("attention");
        let q = Linear::load(&a.pp("query"), dim, dim, bias)?;
        let k = Linear::load(&a.pp("key"), dim, dim, bias)?;
        let v = Linear::load(&a.pp("value"), dim, dim, bias)?;
        let qkv = Linear::concat(&[q.clone(), k.clone(), v.clone()])?;
        let out = Linear::load(&vb.pp("output").pp("dense"), dim, dim, true)?;
        Ok(SelfAttention { qkv, q, k, v, out, heads, dim })
    }

    /// Attention over tokens `[B, N, D]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (q, k, v) = match &self.qkv {
            Some(qkv) => {
                let t = qkv.forward(x)?;
                (t.narrow(D::Minus1, 0, self.dim)?, t.narrow(D::Minus1, self.dim, self.dim)?, t.narrow(D::Minus1, 2 * self.dim, self.dim)?)
            }
            None => (self.q.forward(x)?, self.k.forward(x)?, self.v.forward(x)?),
        };
        let (q, k, v) = (split_heads(&q, self.heads)?, split_heads(&k, self.heads)?, split_heads(&v, self.heads)?);
        let scale = 1.0 / ((self.dim / self.heads) as f64).sqrt();
        let o = sdpa(&q, &k, &v, scale, None)?;
        Ok(self.out.forward(&merge_heads(&o)?)?)
    }
}

/// One pre-norm ViT block with LayerScale.
pub struct Block {
    norm1: LayerNorm,
    attn: SelfAttention,
    ls1: Tensor,
    norm2: LayerNorm,
    ffn: Ffn,
    ls2: Tensor,
}

impl Block {
    fn load(vb: &Vb, cfg: &Dinov2Config) -> Result<Self> {
        let d = cfg.hidden_size;
        Ok(Block {
            norm1: layer_norm(&vb.pp("norm1"), d, cfg.layer_norm_eps)?,
            attn: SelfAttention::load(&vb.pp("attention"), d, cfg.num_attention_heads, cfg.qkv_bias)?,
            ls1: vb.get(d, "layer_scale1.lambda1")?,
            norm2: layer_norm(&vb.pp("norm2"), d, cfg.layer_norm_eps)?,
            ffn: Ffn::load(&vb.pp("mlp"), cfg)?,
            ls2: vb.get(d, "layer_scale2.lambda1")?,
        })
    }

    /// `x + ls1·attn(norm1 x)`, then `x + ls2·ffn(norm2 x)`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.attn.forward(&self.norm1.forward(x)?)?;
        let x = (x + h.broadcast_mul(&self.ls1)?)?;
        let h = self.ffn.forward(&self.norm2.forward(&x)?)?;
        Ok((x + h.broadcast_mul(&self.ls2)?)?)
    }
}

/// The DINOv2 backbone.
pub struct Dinov2 {
    patch: Conv2d,
    cls: Tensor,
    pos: Tensor,
    grid: usize,
    blocks: Vec<Block>,
    norm: LayerNorm,
    cfg: Dinov2Config,
    pos_resize: PosEmbedResize,
}

impl Dinov2 {
    /// Loads `embeddings.*`, `encoder.layer.*` and `layernorm` under `vb` (e.g. `backbone`).
    pub fn load(vb: &Vb, cfg: &Dinov2Config, pos_resize: PosEmbedResize) -> Result<Self> {
        cfg.validate()?;
        let d = cfg.hidden_size;
        let e = vb.pp("embeddings");
        let p = cfg.patch_size;
        let patch = conv2d(&e.pp("patch_embeddings").pp("projection"), cfg.num_channels, d, p, Conv2dConfig { stride: p, ..Default::default() }, true)?;
        let grid = cfg.image_size / p;
        let cls = e.get((1, 1, d), "cls_token")?;
        let pos = e.get((1, grid * grid + 1, d), "position_embeddings")?;
        let blocks = (0..cfg.num_hidden_layers)
            .map(|i| Block::load(&vb.pp("encoder").pp("layer").pp(i), cfg))
            .collect::<Result<_>>()?;
        let norm = layer_norm(&vb.pp("layernorm"), d, cfg.layer_norm_eps)?;
        Ok(Dinov2 { patch, cls, pos, grid, blocks, norm, cfg: cfg.clone(), pos_resize })
    }

    /// The configuration.
    pub fn config(&self) -> &Dinov2Config {
        &self.cfg
    }

    /// Position embeddings for a `ph`×`pw` patch grid, `[1, 1 + ph·pw, D]`.
    pub fn position_embeddings(&self, ph: usize, pw: usize, square_input: bool) -> Result<Tensor> {
        let g = self.grid;
        if ph * pw == g * g && square_input && self.pos_resize == PosEmbedResize::HfSize {
            return Ok(self.pos.clone());
        }
        if self.pos_resize == PosEmbedResize::OriginalOffset && ph == g && pw == g {
            return Ok(self.pos.clone());
        }
        let d = self.cfg.hidden_size;
        let cls = self.pos.narrow(1, 0, 1)?;
        let grid = self.pos.narrow(1, 1, g * g)?.reshape((1, g, g, d))?.permute((0, 3, 1, 2))?;
        let r = match self.pos_resize {
            PosEmbedResize::HfSize => Resize::Size(ph, pw),
            PosEmbedResize::OriginalOffset => Resize::ScaleFactor((ph as f64 + 0.1) / g as f64, (pw as f64 + 0.1) / g as f64),
        };
        let resized = bicubic(&grid, r)?;
        if resized.dims()[2..] != [ph, pw] {
            return Err(Error::Input(format!("position grid resized to {:?}, expected {ph}×{pw}", &resized.dims()[2..])));
        }
        let patches = resized.permute((0, 2, 3, 1))?.reshape((1, ph * pw, d))?;
        Ok(Tensor::cat(&[cls, patches], 1)?)
    }

    /// Patch + class-token embedding with position embeddings: `[B, 1 + N, D]`, and the patch grid.
    pub fn embed(&self, pixel_values: &Tensor) -> Result<(Tensor, usize, usize)> {
        let (b, c, h, w) = pixel_values.dims4()?;
        let p = self.cfg.patch_size;
        if c != self.cfg.num_channels || h < p || w < p {
            return Err(Error::Input(format!(
                "pixel_values {:?}: expected [B, {}, H ≥ {p}, W ≥ {p}]",
                pixel_values.dims(),
                self.cfg.num_channels
            )));
        }
        let x = self.patch.forward(pixel_values)?;
        let (_, d, ph, pw) = x.dims4()?;
        let x = x.flatten_from(2)?.transpose(1, 2)?;
        let cls = self.cls.expand((b, 1, d))?;
        let x = Tensor::cat(&[cls, x], 1)?;
        let pos = self.position_embeddings(ph, pw, h == w)?;
        Ok((x.broadcast_add(&pos)?, ph, pw))
    }

    /// Runs the blocks and returns the hidden states at `indices` (0 = embeddings), each normed when
    /// `apply_layernorm`; tokens `[B, 1 + N, D]`.
    pub fn forward_features(&self, pixel_values: &Tensor, indices: &[usize]) -> Result<(Vec<Tensor>, usize, usize)> {
        let (mut x, ph, pw) = self.embed(pixel_values)?;
        let last = indices.iter().copied().max().unwrap_or(0);
        let mut states = vec![None; last + 1];
        if indices.contains(&0) {
            states[0] = Some(x.clone());
        }
        for (i, blk) in self.blocks.iter().enumerate().take(last) {
            x = blk.forward(&x)?;
            if indices.contains(&(i + 1)) {
                states[i + 1] = Some(x.clone());
            }
        }
        let out = indices
            .iter()
            .map(|&i| {
                let s = states[i].clone().ok_or_else(|| Error::Config(format!("hidden state {i} not computed")))?;
                Ok(if self.cfg.apply_layernorm { self.norm.forward(&s)? } else { s })
            })
            .collect::<Result<_>>()?;
        Ok((out, ph, pw))
    }
}
