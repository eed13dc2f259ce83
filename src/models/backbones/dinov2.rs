//! The DINOv2 ViT backbone (transformers `Dinov2Backbone`, hub key layout), batched, any input size.
//!
//! The same blocks also load the original DINOv2 key layout (`blocks.N.attn.qkv`, `ls1.gamma`, …) and
//! carry the Depth Anything 3 extras as options ([`Dinov2Options`]): per-head q/k LayerNorm, 2-D RoPE,
//! a camera token and alternating per-view / cross-view attention ([`Dinov2::forward_views`]).
use candle_core::{Module, Tensor, D};
use candle_nn::{Conv2dConfig, LayerNorm};
use crate::nn::conv::Conv2d;
use serde::Deserialize;

use crate::nn::activation::Activation;
use crate::nn::attention::{merge_heads, sdpa, split_fused_qkv, split_heads};
use crate::kernels::int8_attention;
use crate::nn::interpolate::{bicubic, Resize};
use crate::nn::grad::layer_norm as layer_norm_grad;
use crate::nn::layers::{conv2d, layer_norm};
use crate::nn::linear::Linear;
use crate::kernels::residual::add_scaled;
use crate::nn::rope2d::Rope2d;
use crate::config_check::{Section, MAX_INPUT_CHANNELS, MAX_IMAGE_SIZE, MAX_LAYERS, MAX_MLP_WIDTH, MAX_PATCH, MAX_WIDTH};
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
    pub(crate) fn feature_indices(&self) -> Result<Vec<usize>> {
        resolve_out_indices(self.out_indices.as_deref(), self.out_features.as_deref(), self.num_hidden_layers)
    }

    fn validate(&self) -> Result<()> {
        self.validate_in(Section::root())
    }

    /// Checks every number against the shared config limits, naming keys under `s`.
    pub(crate) fn validate_in(&self, s: Section) -> Result<()> {
        let d = s.count("hidden_size", self.hidden_size, MAX_WIDTH)?;
        s.heads("num_attention_heads", self.num_attention_heads, "hidden_size", d)?;
        s.count("num_hidden_layers", self.num_hidden_layers, MAX_LAYERS)?;
        s.scaled("mlp_ratio", d, self.mlp_ratio, MAX_MLP_WIDTH)?;
        s.positive("layer_norm_eps", self.layer_norm_eps, 1.0)?;
        let p = s.count("patch_size", self.patch_size, MAX_PATCH)?;
        s.range("image_size", self.image_size, p, MAX_IMAGE_SIZE)?;
        s.count("num_channels", self.num_channels, MAX_INPUT_CHANNELS)?;
        Ok(())
    }
}

/// The hidden-state indices (0 = embeddings, k = after block k of `layers`) that a transformers
/// backbone config selects with `out_indices` (negative from the end) or `out_features` (`stemN`/`stageK`);
/// the last stage when neither is given.
pub(crate) fn resolve_out_indices(out_indices: Option<&[i64]>, out_features: Option<&[String]>, layers: usize) -> Result<Vec<usize>> {
    let n = layers as i64;
    let raw: Vec<i64> = match (out_indices, out_features) {
        (Some(ix), _) => ix.to_vec(),
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

/// How the position-embedding grid is resized to the input's patch grid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PosEmbedResize {
    /// transformers 5.x: bicubic by output size; the stored table is used as is for its own square size.
    HfSize,
    /// Original DINOv2 / Depth Anything: bicubic by scale factor `(n + 0.1) / grid`.
    OriginalOffset,
}

/// Which tensor names the backbone is stored under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyLayout {
    /// transformers: `embeddings.*`, `encoder.layer.N.attention.attention.{query,key,value}`, `layer_scale1.lambda1`, `layernorm`.
    Hf,
    /// Original DINOv2 (Depth Anything `pretrained.*`): `patch_embed.proj`, `cls_token`, `pos_embed`,
    /// `blocks.N.{norm1, attn.qkv, attn.proj, ls1.gamma, norm2, mlp.*, ls2.gamma}`, `norm`.
    Original,
}

/// 2-D RoPE in the blocks from `start` on (Depth Anything 3).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeOptions {
    /// First block (0-based) that rotates q and k.
    pub start: usize,
    /// Frequency base (100 in DA3).
    pub base: f32,
}

/// Variations of the backbone; [`Dinov2Options::hf`] is plain transformers DINOv2.
#[derive(Debug, Clone, PartialEq)]
pub struct Dinov2Options {
    /// Key names.
    pub layout: KeyLayout,
    /// Position-embedding resize rule.
    pub pos_resize: PosEmbedResize,
    /// Epsilon of the final LayerNorm (None: `layer_norm_eps`; the original code uses 1e-5).
    pub final_norm_eps: Option<f64>,
    /// Per-head LayerNorm on q and k (`attn.q_norm`, `attn.k_norm`, eps 1e-5) from this block on.
    pub qk_norm_start: Option<usize>,
    /// 2-D RoPE.
    pub rope: Option<RopeOptions>,
    /// Camera token (`camera_token` `[1, 2, D]`) inserted at this block, which also starts the
    /// alternation: odd blocks from here attend across all views, the others within each view.
    pub alt_start: Option<usize>,
    /// Outputs are `[last per-view tokens ‖ normed tokens]` (`2D` wide) instead of normed tokens.
    pub cat_token: bool,
}

impl Dinov2Options {
    /// transformers DINOv2 with the given position-embedding rule.
    pub(crate) fn hf(pos_resize: PosEmbedResize) -> Self {
        Dinov2Options { layout: KeyLayout::Hf, pos_resize, final_norm_eps: None, qk_norm_start: None, rope: None, alt_start: None, cat_token: false }
    }
}

/// Epsilon of the per-head q/k LayerNorms (`nn.LayerNorm` default).
const QK_NORM_EPS: f64 = 1e-5;

/// The feed-forward part of a ViT block.
pub(crate) enum Ffn {
    /// `fc2(act(fc1 x))`.
    Mlp {
        /// Up projection.
        fc1: Linear,
        /// Activation.
        act: Activation,
        /// Down projection.
        fc2: Linear,
    },
    /// DINOv2 SwiGLU: `down(silu(g) · u)` with `[g, u]` from one fused projection.
    SwiGlu {
        /// Fused gate and up projections (`2·hidden` outputs).
        gate_up: Linear,
        /// Width of each half.
        hidden: usize,
        /// Down projection.
        down: Linear,
    },
    /// Gated MLP with any activation: `down(act(gate x) · up x)` (DINOv3 `use_gated_mlp`).
    Gated {
        /// Gate projection.
        gate: Linear,
        /// Up projection.
        up: Linear,
        /// Activation applied to the gate.
        act: Activation,
        /// Down projection.
        down: Linear,
    },
}

impl Ffn {
    fn load(vb: &Vb, cfg: &Dinov2Config) -> Result<Self> {
        let d = cfg.hidden_size;
        if cfg.use_swiglu_ffn {
            let base = (d as f64 * cfg.mlp_ratio) as usize;
            let hidden = ((base as f64 * 2.0 / 3.0) as usize).div_ceil(8) * 8;
            let gate_up = if vb.contains("w12.weight") {
                Linear::load(&vb.pp("w12"), d, 2 * hidden, true)?
            } else if vb.contains("weights_in.weight") {
                Linear::load(&vb.pp("weights_in"), d, 2 * hidden, true)?
            } else {
                let g = Linear::load(&vb.pp("gate_proj"), d, hidden, true)?;
                let u = Linear::load(&vb.pp("up_proj"), d, hidden, true)?;
                Linear::concat(&[g, u])?.ok_or_else(|| Error::Config("quantized SwiGLU halves are not supported".into()))?
            };
            let down = if vb.contains("w3.weight") {
                Linear::load(&vb.pp("w3"), hidden, d, true)?
            } else if vb.contains("weights_out.weight") {
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

    /// Applies the feed-forward network.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(match self {
            // Exact GELU in the same pass as fc1's bias.
            Ffn::Mlp { fc1, act: Activation::Gelu, fc2 } => fc2.forward(&fc1.forward_gelu(x)?)?,
            Ffn::Mlp { fc1, act, fc2 } => fc2.forward(&act.forward(&fc1.forward(x)?)?)?,
            Ffn::Gated { gate, up, act, down } => down.forward(&(act.forward(&gate.forward(x)?)? * up.forward(x)?)?)?,
            Ffn::SwiGlu { gate_up, hidden, down } => {
                let gu = gate_up.forward(x)?;
                let g = gu.narrow(D::Minus1, 0, *hidden)?;
                let u = gu.narrow(D::Minus1, *hidden, *hidden)?;
                down.forward(&(g.silu()? * u)?)?
            }
        })
    }
}

/// A rotation applied to per-head queries and keys `[B, heads, N, D/heads]` (rotary embeddings).
pub(crate) type QkRotate<'a> = dyn Fn(&Tensor) -> Result<Tensor> + 'a;

/// Self-attention with fused q/k/v projections where the weights allow.
pub(crate) struct SelfAttention {
    qkv: Qkv,
    qk_norm: Option<(LayerNorm, LayerNorm)>,
    out: Linear,
    heads: usize,
    dim: usize,
}

/// The q/k/v projections: one fused `[q; k; v]` matrix where the weights allow, else three.
enum Qkv {
    Fused(Linear),
    Split(Linear, Linear, Linear),
}

impl Qkv {
    /// Whether the projections run through the int8 GEMM.
    fn runs_int8(&self) -> bool {
        match self {
            Qkv::Fused(qkv) => qkv.runs_int8(),
            Qkv::Split(q, k, v) => q.runs_int8() && k.runs_int8() && v.runs_int8(),
        }
    }

    fn new(q: Linear, k: Linear, v: Linear) -> Result<Self> {
        Ok(match Linear::concat(&[q.clone(), k.clone(), v.clone()])? {
            Some(f) => Qkv::Fused(f),
            None => Qkv::Split(q, k, v),
        })
    }
}

impl SelfAttention {
    /// Loads `attention.attention.{query,key,value}` and `attention.output.dense` under `vb`.
    pub(crate) fn load(vb: &Vb, dim: usize, heads: usize, bias: bool) -> Result<Self> {
        let a = vb.pp("attention");
        let q = Linear::load(&a.pp("query"), dim, dim, bias)?;
        let k = Linear::load(&a.pp("key"), dim, dim, bias)?;
        let v = Linear::load(&a.pp("value"), dim, dim, bias)?;
        let qkv = Qkv::new(q, k, v)?;
        let out = Linear::load(&vb.pp("output").pp("dense"), dim, dim, true)?;
        Ok(SelfAttention { qkv, qk_norm: None, out, heads, dim })
    }

    /// Loads the original layout under `vb` (`attn`): fused `qkv` `[3D, D]` (rows q, k, v), `proj`,
    /// and with `qk_norm` the per-head `q_norm` / `k_norm` LayerNorms (width D / heads).
    pub(crate) fn load_original(vb: &Vb, dim: usize, heads: usize, bias: bool, qk_norm: bool) -> Result<Self> {
        if heads == 0 || !dim.is_multiple_of(heads) {
            return Err(Error::Config(format!("width {dim} is not a positive multiple of {heads} heads")));
        }
        let qkv = Qkv::Fused(Linear::load(&vb.pp("qkv"), dim, 3 * dim, bias)?);
        let hd = dim / heads;
        let qk_norm = if qk_norm {
            Some((layer_norm(&vb.pp("q_norm"), hd, QK_NORM_EPS)?, layer_norm(&vb.pp("k_norm"), hd, QK_NORM_EPS)?))
        } else {
            None
        };
        let out = Linear::load(&vb.pp("proj"), dim, dim, true)?;
        Ok(SelfAttention { qkv, qk_norm, out, heads, dim })
    }

    /// Builds from already loaded projections (fused into one q/k/v matmul when all are dense).
    pub(crate) fn from_linears(q: Linear, k: Linear, v: Linear, out: Linear, dim: usize, heads: usize) -> Result<Self> {
        if heads == 0 || !dim.is_multiple_of(heads) {
            return Err(Error::Config(format!("width {dim} is not a positive multiple of {heads} heads")));
        }
        let qkv = Qkv::new(q, k, v)?;
        Ok(SelfAttention { qkv, qk_norm: None, out, heads, dim })
    }

    /// Attention over tokens `[B, N, D]`.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.attend(x, None)
    }

    /// Attention with `rotate` applied to the per-head queries and keys `[B, heads, N, D/heads]`
    /// before the scores (rotary position embeddings).
    pub(crate) fn forward_rotated(&self, x: &Tensor, rotate: &dyn Fn(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
        self.attend(x, Some(rotate))
    }

    fn attend(&self, x: &Tensor, rotate: Option<&QkRotate<'_>>) -> Result<Tensor> {
        let (q, k, v) = match &self.qkv {
            Qkv::Fused(qkv) => split_fused_qkv(&qkv.forward(x)?, self.heads)?,
            Qkv::Split(q, k, v) => (split_heads(&q.forward(x)?, self.heads)?, split_heads(&k.forward(x)?, self.heads)?, split_heads(&v.forward(x)?, self.heads)?),
        };
        let (q, k) = match &self.qk_norm {
            Some((qn, kn)) => (qn.forward(&q.contiguous()?)?, kn.forward(&k.contiguous()?)?),
            None => (q, k),
        };
        let (q, k) = match rotate {
            Some(r) => (r(&q.contiguous()?)?, r(&k.contiguous()?)?),
            None => (q, k),
        };
        let scale = 1.0 / ((self.dim / self.heads) as f64).sqrt();
        // A block whose projections round their activations to 8 bits takes int8 products here too.
        let o = if self.qkv.runs_int8() && int8_attention::applies(&q, &k, &v) {
            int8_attention::attention(&q, &k, &v, scale as f32)?
        } else {
            sdpa(&q, &k, &v, scale, None)?
        };
        Ok(self.out.forward(&merge_heads(&o)?)?)
    }
}

/// One pre-norm ViT block with LayerScale.
pub(crate) struct Block {
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

    /// Loads block `index` of the original layout under `vb` (`blocks.N`): `norm1`, `attn.qkv`,
    /// `attn.proj`, (`attn.q_norm`, `attn.k_norm` from `opts.qk_norm_start`), `ls1.gamma`, `norm2`, `mlp`, `ls2.gamma`.
    pub(crate) fn load_original(vb: &Vb, cfg: &Dinov2Config, opts: &Dinov2Options, index: usize) -> Result<Self> {
        let d = cfg.hidden_size;
        let qk_norm = opts.qk_norm_start.is_some_and(|s| index >= s);
        Ok(Block {
            norm1: layer_norm(&vb.pp("norm1"), d, cfg.layer_norm_eps)?,
            attn: SelfAttention::load_original(&vb.pp("attn"), d, cfg.num_attention_heads, cfg.qkv_bias, qk_norm)?,
            ls1: vb.get(d, "ls1.gamma")?,
            norm2: layer_norm(&vb.pp("norm2"), d, cfg.layer_norm_eps)?,
            ffn: Ffn::load(&vb.pp("mlp"), cfg)?,
            ls2: vb.get(d, "ls2.gamma")?,
        })
    }

    /// Builds a block from loaded parts (layer scales `[D]`).
    pub(crate) fn from_parts(norm1: LayerNorm, attn: SelfAttention, ls1: Tensor, norm2: LayerNorm, ffn: Ffn, ls2: Tensor) -> Self {
        Block { norm1, attn, ls1, norm2, ffn, ls2 }
    }

    /// `x + ls1·attn(norm1 x)`, then `x + ls2·ffn(norm2 x)`.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.attn.forward(&layer_norm_grad(&self.norm1, x)?)?;
        self.finish(x, &h)
    }

    /// As `forward`, with `rotate` applied to the attention's per-head queries and keys.
    pub(crate) fn forward_rotated(&self, x: &Tensor, rotate: &dyn Fn(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
        let h = self.attn.forward_rotated(&layer_norm_grad(&self.norm1, x)?, rotate)?;
        self.finish(x, &h)
    }

    fn finish(&self, x: &Tensor, h: &Tensor) -> Result<Tensor> {
        let x = add_scaled(x, h, &self.ls1)?;
        let h = self.ffn.forward(&layer_norm_grad(&self.norm2, &x)?)?;
        Ok(add_scaled(&x, &h, &self.ls2)?)
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
    camera: Option<Tensor>,
    opts: Dinov2Options,
}

impl Dinov2 {
    /// Loads the original layout with `opts` (`patch_embed.proj`, `cls_token`, `pos_embed`,
    /// `camera_token` when `alt_start` is set, `blocks.*`, `norm` under `vb`), or, for
    /// [`KeyLayout::Hf`] without extras, as [`Dinov2::load`].
    pub fn load_with(vb: &Vb, cfg: &Dinov2Config, opts: &Dinov2Options) -> Result<Self> {
        if opts.layout == KeyLayout::Hf {
            if opts.qk_norm_start.is_some() || opts.rope.is_some() || opts.alt_start.is_some() || opts.cat_token || opts.final_norm_eps.is_some() {
                return Err(Error::Config("the DA3 backbone options need the original key layout".into()));
            }
            return Self::load(vb, cfg, opts.pos_resize);
        }
        cfg.validate()?;
        let d = cfg.hidden_size;
        if opts.rope.is_some() && !(d / cfg.num_attention_heads).is_multiple_of(4) {
            return Err(Error::Config(format!("2-D RoPE needs a head dimension divisible by 4, got {}", d / cfg.num_attention_heads)));
        }
        let p = cfg.patch_size;
        let patch = conv2d(&vb.pp("patch_embed").pp("proj"), cfg.num_channels, d, p, Conv2dConfig { stride: p, ..Default::default() }, true)?;
        let grid = cfg.image_size / p;
        let cls = vb.get((1, 1, d), "cls_token")?;
        let pos = vb.get((1, grid * grid + 1, d), "pos_embed")?;
        let camera = match opts.alt_start {
            Some(_) => Some(vb.get((1, 2, d), "camera_token")?),
            None => None,
        };
        let blocks = (0..cfg.num_hidden_layers)
            .map(|i| Block::load_original(&vb.pp("blocks").pp(i), cfg, opts, i))
            .collect::<Result<_>>()?;
        let norm = layer_norm(&vb.pp("norm"), d, opts.final_norm_eps.unwrap_or(cfg.layer_norm_eps))?;
        Ok(Dinov2 { patch, cls, pos, grid, blocks, norm, cfg: cfg.clone(), pos_resize: opts.pos_resize, camera, opts: opts.clone() })
    }

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
        Ok(Dinov2 { patch, cls, pos, grid, blocks, norm, cfg: cfg.clone(), pos_resize, camera: None, opts: Dinov2Options::hf(pos_resize) })
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

    /// Number of transformer blocks.
    pub fn block_count(&self) -> usize {
        self.blocks.len()
    }

    /// Block `i` alone on tokens `[B, 1 + N, D]` (activation checkpointing recomputes blocks one by one).
    pub(crate) fn block_forward(&self, i: usize, x: &Tensor) -> Result<Tensor> {
        let blk = self.blocks.get(i).ok_or_else(|| Error::Input(format!("block {i} of {}", self.blocks.len())))?;
        blk.forward(x)
    }

    /// The final LayerNorm when the config applies it to returned hidden states, else `x` itself.
    pub(crate) fn output_norm(&self, x: &Tensor) -> Result<Tensor> {
        Ok(if self.cfg.apply_layernorm { layer_norm_grad(&self.norm, x)? } else { x.clone() })
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
                self.output_norm(&s)
            })
            .collect::<Result<_>>()?;
        Ok((out, ph, pw))
    }

    /// The Depth Anything 3 forward over views: `pixel_values` `[B, S, C, H, W]` (H, W multiples of
    /// the patch size) → for each 0-based block index in `out_blocks`, the tokens after that block
    /// `[B·S, 1 + N, D]` normed (or `[B·S, 1 + N, 2D]` = `[last per-view tokens ‖ normed]` with
    /// `cat_token`), views in input order, plus the patch grid.
    ///
    /// With `alt_start = a`: token 0 of every view becomes the camera token at block `a` (`camera_token[0]`
    /// for view 0, `[1]` for the others) and odd blocks `≥ a` attend across all views of a sample.
    /// With `S ≥ 3`, before block `a − 1` the views are reordered to put the reference view first
    /// (the reference's default `saddle_balanced` choice) and outputs are put back in input order.
    pub(crate) fn forward_views(&self, pixel_values: &Tensor, out_blocks: &[usize]) -> Result<(Vec<Tensor>, usize, usize)> {
        let (b, s, c, h, w) = pixel_values.dims5()?;
        let p = self.cfg.patch_size;
        if b == 0 || s == 0 || h % p != 0 || w % p != 0 {
            return Err(Error::Input(format!("pixel_values {:?}: expected [B ≥ 1, S ≥ 1, C, H, W] with H, W multiples of {p}", pixel_values.dims())));
        }
        let last = match out_blocks.iter().copied().max() {
            Some(l) if l < self.blocks.len() => l,
            _ => return Err(Error::Config(format!("output blocks {out_blocks:?} not within 0..{}", self.blocks.len()))),
        };
        let (mut x, ph, pw) = self.embed(&pixel_values.reshape((b * s, c, h, w))?)?;
        let (n, d) = (x.dim(1)?, self.cfg.hidden_size);
        let hd = d / self.cfg.num_attention_heads;
        let ropes = match self.opts.rope {
            Some(r) => {
                let (dt, dev) = (x.dtype(), x.device());
                let local = Rope2d::new(&Rope2d::grid_positions(ph, pw, 1, 1, false), hd, r.base, dt, dev)?;
                let global = Rope2d::new(&Rope2d::grid_positions(ph, pw, 1, s, true), hd, r.base, dt, dev)?;
                Some((local, global))
            }
            None => None,
        };
        let mut local = x.clone();
        let mut restore: Option<Tensor> = None;
        let mut outs: Vec<(usize, Tensor)> = Vec::with_capacity(out_blocks.len());
        for (i, blk) in self.blocks.iter().enumerate().take(last + 1) {
            if let Some(a) = self.opts.alt_start {
                if s >= 3 && i + 1 == a {
                    let (fwd, inv) = reference_first_order(&x, b, s)?;
                    x = x.index_select(&fwd, 0)?;
                    local = local.index_select(&fwd, 0)?;
                    restore = Some(inv);
                }
                if i == a {
                    x = self.insert_camera_token(&x, b, s)?;
                }
            }
            let global = self.opts.alt_start.is_some_and(|a| i >= a && i % 2 == 1);
            let rope = match (&ropes, self.opts.rope) {
                (Some((l, g)), Some(r)) if i >= r.start => Some(if global { g } else { l }),
                _ => None,
            };
            let run = |t: &Tensor| -> Result<Tensor> {
                match rope {
                    Some(r) => blk.forward_rotated(t, &|q: &Tensor| r.apply(q)),
                    None => blk.forward(t),
                }
            };
            if global {
                x = run(&x.reshape((b, s * n, d))?)?.reshape((b * s, n, d))?;
            } else {
                x = run(&x)?;
                local = x.clone();
            }
            if out_blocks.contains(&i) {
                let normed = layer_norm_grad(&self.norm, &x)?;
                let mut o = if self.opts.cat_token { Tensor::cat(&[&local, &normed], 2)? } else { normed };
                if let Some(inv) = &restore {
                    o = o.index_select(inv, 0)?;
                }
                outs.push((i, o));
            }
        }
        let out = out_blocks
            .iter()
            .map(|i| outs.iter().find(|(j, _)| j == i).map(|(_, t)| t.clone()).ok_or_else(|| Error::Config(format!("block {i} not computed"))))
            .collect::<Result<_>>()?;
        Ok((out, ph, pw))
    }

    /// Replaces token 0 of each view of `x` `[B·S, N, D]` by the camera token (reference view: `[0]`).
    fn insert_camera_token(&self, x: &Tensor, b: usize, s: usize) -> Result<Tensor> {
        let cam = self.camera.as_ref().ok_or_else(|| Error::Config("alt_start is set but no camera_token was loaded".into()))?;
        let cam = cam.to_dtype(x.dtype())?;
        let mut per_view = vec![cam.narrow(1, 0, 1)?];
        per_view.extend(std::iter::repeat_n(cam.narrow(1, 1, 1)?, s - 1));
        let one = Tensor::cat(&per_view, 0)?;
        let all = Tensor::cat(&vec![one; b], 0)?;
        let n = x.dim(1)?;
        Ok(Tensor::cat(&[all, x.narrow(1, 1, n - 1)?], 1)?)
    }
}

/// The view order that puts each sample's reference view first (`[r, 0, 1, …]` without r), as
/// flat `[B·S]` gather indices, and the inverse gather. The reference view is the one whose class
/// token is most "balanced" (reference `saddle_balanced`): mean cosine similarity to the other views,
/// token norm and variance of the unit token, each min-max normalised, closest to 0.5 in total.
fn reference_first_order(x: &Tensor, b: usize, s: usize) -> Result<(Tensor, Tensor)> {
    let d = x.dim(2)?;
    let cls = x.narrow(1, 0, 1)?.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let mut fwd = Vec::with_capacity(b * s);
    for bi in 0..b {
        let toks: Vec<&[f32]> = (0..s).map(|j| &cls[(bi * s + j) * d..(bi * s + j + 1) * d]).collect();
        let norms: Vec<f64> = toks.iter().map(|t| t.iter().map(|&v| (v as f64).powi(2)).sum::<f64>().sqrt()).collect();
        let unit: Vec<Vec<f64>> = toks.iter().zip(&norms).map(|(t, &nm)| t.iter().map(|&v| v as f64 / nm).collect()).collect();
        let sim: Vec<f64> = (0..s)
            .map(|i| (0..s).filter(|&j| j != i).map(|j| unit[i].iter().zip(&unit[j]).map(|(a, c)| a * c).sum::<f64>()).sum::<f64>() / (s - 1) as f64)
            .collect();
        let var: Vec<f64> = unit
            .iter()
            .map(|u| {
                let m = u.iter().sum::<f64>() / d as f64;
                u.iter().map(|v| (v - m).powi(2)).sum::<f64>() / (d.max(2) - 1) as f64
            })
            .collect();
        let scaled = |m: &[f64]| -> Vec<f64> {
            let lo = m.iter().cloned().fold(f64::INFINITY, f64::min);
            let hi = m.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            m.iter().map(|v| (v - lo) / (hi - lo + 1e-8)).collect()
        };
        let (a, n, v) = (scaled(&sim), scaled(&norms), scaled(&var));
        let score: Vec<f64> = (0..s).map(|j| (a[j] - 0.5).abs() + (n[j] - 0.5).abs() + (v[j] - 0.5).abs()).collect();
        let r = (0..s).fold(0, |best, j| if score[j] < score[best] { j } else { best });
        fwd.push((bi * s + r) as u32);
        fwd.extend((0..s).filter(|&j| j != r).map(|j| (bi * s + j) as u32));
    }
    let mut inv = vec![0u32; b * s];
    for (pos, &src) in fwd.iter().enumerate() {
        inv[src as usize] = pos as u32;
    }
    let dev = x.device();
    Ok((Tensor::from_vec(fwd, b * s, dev)?, Tensor::from_vec(inv, b * s, dev)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Projections held in int8 take the int8 attention where AMX runs (an output within 8-bit
    /// rounding of the f32 attention's, and not equal to it), the f32 attention elsewhere.
    #[test]
    fn int8_projections_take_the_int8_attention_where_amx_runs() {
        let dev = Device::Cpu;
        let (dim, heads, n) = (128, 2, 40);
        // Fixed inputs: the error depends on the draw (0.9 % to 2.1 % of max |f32| over random ones).
        let w = |seed| (crate::kernels::test_values::spread((dim, dim), seed, &dev) * 0.1).unwrap();
        let (wq, wk, wv, wo) = (w(1), w(2), w(3), w(4));
        let int8 = |w: &Tensor| Linear::int8_from_f32(w, None).unwrap();
        if int8(&wq).is_none() {
            return; // no int8 GEMM on this CPU
        }
        let attn = SelfAttention::from_linears(int8(&wq).unwrap(), int8(&wk).unwrap(), int8(&wv).unwrap(), Linear::from_tensors(wo.clone(), None).unwrap(), dim, heads).unwrap();
        let x = crate::kernels::test_values::spread((1, n, dim), 5, &dev);
        let got = attn.forward(&x).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        // The same int8 projections around the f32 attention.
        let project = |w: &Tensor| split_heads(&int8(w).unwrap().forward(&x).unwrap(), heads).unwrap();
        let o = sdpa(&project(&wq), &project(&wk), &project(&wv), 1.0 / ((dim / heads) as f64).sqrt(), None).unwrap();
        let want = Linear::from_tensors(wo, None).unwrap().forward(&merge_heads(&o).unwrap()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        if crate::kernels::amx::available() {
            let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            let max = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            eprintln!("int8 attention: max abs error {err} (max |f32| {max})");
            assert!(err > 0.0 && err < 0.03 * max, "int8 attention: max abs error {err} (max |f32| {max})");
        } else {
            assert_eq!(got, want);
        }
    }
}
