//! The DINOv3 ViT backbone (transformers `DINOv3ViTBackbone`, hub key layout), batched, any input size.
//!
//! Tokens are `[cls, registers×R, patches]` with no absolute position embedding; the patch tokens'
//! queries and keys are rotated by the 2-D RoPE of [`crate::nn::rope`]. Blocks are the DINOv2 pre-norm
//! blocks with LayerScale ([`super::dinov2::Block`]), with DINOv3's projection names
//! (`attention.{q,k,v,o}_proj`, `mlp.{up,down}_proj`, `mlp.gate_proj` for the gated variant).
use candle_core::{Module, Tensor};
use candle_nn::{Conv2dConfig, LayerNorm};
use crate::nn::conv::Conv2d;
use serde::Deserialize;

use crate::nn::activation::Activation;
use super::dinov2::{resolve_out_indices, Block, Ffn, SelfAttention};
use crate::nn::layers::{conv2d, layer_norm};
use crate::nn::linear::Linear;
use crate::nn::rope::Rope2d;
use crate::config_check::{Section, MAX_INPUT_CHANNELS, MAX_LAYERS, MAX_MLP_WIDTH, MAX_PATCH, MAX_WIDTH};
use crate::error::{Error, Result};
use crate::weights::Vb;

/// An int or a `[h, w]` pair, as transformers allows for `patch_size` / `image_size`.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum SizeSpec {
    /// Square.
    One(usize),
    /// `[h, w]`.
    Two(Vec<usize>),
}

impl SizeSpec {
    fn square(&self, what: &str) -> Result<usize> {
        match self {
            SizeSpec::One(n) => Ok(*n),
            SizeSpec::Two(v) if v.len() == 2 && v[0] == v[1] => Ok(v[0]),
            SizeSpec::Two(v) => Err(Error::Config(format!("non-square {what} {v:?} is not supported"))),
        }
    }
}

/// `DINOv3ViTConfig` as transformers 5.24 writes it (defaults are that class's).
#[derive(Debug, Clone, Deserialize)]
pub struct Dinov3Config {
    /// Patch size (square).
    #[serde(default = "p16")]
    pub patch_size: SizeSpec,
    /// Token width.
    #[serde(default = "d384")]
    pub hidden_size: usize,
    /// MLP width.
    #[serde(default = "d1536")]
    pub intermediate_size: usize,
    /// Number of blocks.
    #[serde(default = "d12")]
    pub num_hidden_layers: usize,
    /// Attention heads.
    #[serde(default = "d6")]
    pub num_attention_heads: usize,
    /// MLP activation (also the gate's activation in the gated MLP).
    #[serde(default = "gelu")]
    pub hidden_act: String,
    /// LayerNorm epsilon (every norm of the backbone).
    #[serde(default = "eps5")]
    pub layer_norm_eps: f64,
    /// RoPE base period θ.
    #[serde(default = "theta")]
    pub rope_theta: f64,
    /// Input channels.
    #[serde(default = "d3")]
    pub num_channels: usize,
    /// Query bias.
    #[serde(default = "yes")]
    pub query_bias: bool,
    /// Key bias (loaded when present in the weights, zeros otherwise).
    #[serde(default)]
    pub key_bias: bool,
    /// Value bias.
    #[serde(default = "yes")]
    pub value_bias: bool,
    /// Attention output bias.
    #[serde(default = "yes")]
    pub proj_bias: bool,
    /// MLP biases.
    #[serde(default = "yes")]
    pub mlp_bias: bool,
    /// SwiGLU-style gated MLP.
    #[serde(default)]
    pub use_gated_mlp: bool,
    /// Register (storage) tokens after the class token.
    #[serde(default)]
    pub num_register_tokens: usize,
    /// Hidden-state indices returned (0 = embeddings).
    #[serde(default)]
    pub out_indices: Option<Vec<i64>>,
    /// Stage names returned, used when `out_indices` is absent.
    #[serde(default)]
    pub out_features: Option<Vec<String>>,
    /// Apply the final norm to every returned map (the last stage is always normed).
    #[serde(default = "yes")]
    pub apply_layernorm: bool,
    /// Return patch tokens as `[B, D, h, w]` maps.
    #[serde(default = "yes")]
    pub reshape_hidden_states: bool,
    /// Also return each stage's class token.
    #[serde(default)]
    pub return_class_token: bool,
}

fn p16() -> SizeSpec { SizeSpec::One(16) }
fn d384() -> usize { 384 }
fn d1536() -> usize { 1536 }
fn d12() -> usize { 12 }
fn d6() -> usize { 6 }
fn d3() -> usize { 3 }
fn gelu() -> String { "gelu".into() }
fn eps5() -> f64 { 1e-5 }
fn theta() -> f64 { 100.0 }
fn yes() -> bool { true }

impl Dinov3Config {
    /// The square patch size.
    pub fn patch(&self) -> Result<usize> {
        self.patch_size.square("patch_size")
    }

    /// Per-head width.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads.max(1)
    }

    /// The hidden-state indices to return, validated and strictly increasing (as transformers requires).
    pub(crate) fn feature_indices(&self) -> Result<Vec<usize>> {
        let ix = resolve_out_indices(self.out_indices.as_deref(), self.out_features.as_deref(), self.num_hidden_layers)?;
        if ix.windows(2).any(|w| w[0] >= w[1]) {
            return Err(Error::Config(format!("out_indices {ix:?} must be strictly increasing")));
        }
        Ok(ix)
    }

    fn validate(&self) -> Result<()> {
        self.validate_in(Section::root())
    }

    /// Checks every number against the shared config limits, naming keys under `s`.
    pub(crate) fn validate_in(&self, s: Section) -> Result<()> {
        let d = s.count("hidden_size", self.hidden_size, MAX_WIDTH)?;
        s.heads("num_attention_heads", self.num_attention_heads, "hidden_size", d)?;
        if !self.head_dim().is_multiple_of(4) {
            return Err(s.bad("num_attention_heads", format!("gives a head width of {}; DINOv3 RoPE needs a multiple of 4", self.head_dim())));
        }
        s.count("patch_size", self.patch()?, MAX_PATCH)?;
        s.count("intermediate_size", self.intermediate_size, MAX_MLP_WIDTH)?;
        s.count("num_hidden_layers", self.num_hidden_layers, MAX_LAYERS)?;
        s.count("num_channels", self.num_channels, MAX_INPUT_CHANNELS)?;
        s.range("num_register_tokens", self.num_register_tokens, 0, MAX_REGISTERS)?;
        s.positive("layer_norm_eps", self.layer_norm_eps, 1.0)?;
        s.positive("rope_theta", self.rope_theta, 1e9)?;
        Ok(())
    }
}

/// Largest number of DINOv3 register tokens.
const MAX_REGISTERS: usize = 256;

/// Backbone outputs for the selected stages.
#[derive(Clone)]
pub struct Dinov3Features {
    /// Patch tokens per stage: `[B, D, ph, pw]` (or `[B, ph·pw, D]` without `reshape_hidden_states`).
    pub maps: Vec<Tensor>,
    /// Class token per stage `[B, D]` (empty unless `return_class_token`).
    pub cls: Vec<Tensor>,
    /// Patch grid rows.
    pub ph: usize,
    /// Patch grid columns.
    pub pw: usize,
}

/// The DINOv3 ViT backbone.
pub struct Dinov3 {
    patch: Conv2d,
    cls: Tensor,
    registers: Option<Tensor>,
    blocks: Vec<Block>,
    norm: LayerNorm,
    cfg: Dinov3Config,
    indices: Vec<usize>,
    p: usize,
}

fn load_ffn(vb: &Vb, cfg: &Dinov3Config) -> Result<Ffn> {
    let (d, h, bias) = (cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias);
    let act = Activation::from_name(&cfg.hidden_act)?;
    let up = Linear::load(&vb.pp("up_proj"), d, h, bias)?;
    let down = Linear::load(&vb.pp("down_proj"), h, d, bias)?;
    Ok(if cfg.use_gated_mlp {
        Ffn::Gated { gate: Linear::load(&vb.pp("gate_proj"), d, h, bias)?, up, act, down }
    } else {
        Ffn::Mlp { fc1: up, act, fc2: down }
    })
}

fn load_attention(vb: &Vb, cfg: &Dinov3Config) -> Result<SelfAttention> {
    let d = cfg.hidden_size;
    let q = Linear::load(&vb.pp("q_proj"), d, d, cfg.query_bias)?;
    // The original model masks the key bias; the hub conversion may drop it: zeros when absent.
    let k = Linear::load(&vb.pp("k_proj"), d, d, cfg.key_bias && vb.contains("k_proj.bias"))?;
    let v = Linear::load(&vb.pp("v_proj"), d, d, cfg.value_bias)?;
    let o = Linear::load(&vb.pp("o_proj"), d, d, cfg.proj_bias)?;
    SelfAttention::from_linears(q, k, v, o, d, cfg.num_attention_heads)
}

impl Dinov3 {
    /// Loads `embeddings.*`, `layer.*` (or the runtime name `model.layer.*`) and `norm` under `vb`.
    pub fn load(vb: &Vb, cfg: &Dinov3Config) -> Result<Self> {
        cfg.validate()?;
        let indices = cfg.feature_indices()?;
        let d = cfg.hidden_size;
        let p = cfg.patch()?;
        let e = vb.pp("embeddings");
        let patch = conv2d(&e.pp("patch_embeddings"), cfg.num_channels, d, p, Conv2dConfig { stride: p, ..Default::default() }, true)?;
        let cls = e.get((1, 1, d), "cls_token")?;
        let registers = match cfg.num_register_tokens {
            0 => None,
            r => Some(e.get((1, r, d), "register_tokens")?),
        };
        let layers = if !vb.contains("layer.0.norm1.weight") && vb.contains("model.layer.0.norm1.weight") {
            vb.pp("model").pp("layer")
        } else {
            vb.pp("layer")
        };
        let blocks = (0..cfg.num_hidden_layers)
            .map(|i| {
                let l = layers.pp(i);
                Ok(Block::from_parts(
                    layer_norm(&l.pp("norm1"), d, cfg.layer_norm_eps)?,
                    load_attention(&l.pp("attention"), cfg)?,
                    l.get(d, "layer_scale1.lambda1")?,
                    layer_norm(&l.pp("norm2"), d, cfg.layer_norm_eps)?,
                    load_ffn(&l.pp("mlp"), cfg)?,
                    l.get(d, "layer_scale2.lambda1")?,
                ))
            })
            .collect::<Result<_>>()?;
        let norm = layer_norm(&vb.pp("norm"), d, cfg.layer_norm_eps)?;
        Ok(Dinov3 { patch, cls, registers, blocks, norm, cfg: cfg.clone(), indices, p })
    }

    /// The configuration.
    pub fn config(&self) -> &Dinov3Config {
        &self.cfg
    }

    /// The selected hidden-state indices.
    pub fn indices(&self) -> &[usize] {
        &self.indices
    }

    /// Class + register tokens before the patches.
    pub(crate) fn prefix_len(&self) -> usize {
        1 + self.cfg.num_register_tokens
    }

    /// `[cls, registers, patches]` `[B, 1 + R + N, D]` and the patch grid.
    pub fn embed(&self, pixel_values: &Tensor) -> Result<(Tensor, usize, usize)> {
        let (b, c, h, w) = pixel_values.dims4()?;
        let p = self.p;
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
        let mut parts = vec![self.cls.expand((b, 1, d))?];
        if let Some(r) = &self.registers {
            parts.push(r.expand((b, self.cfg.num_register_tokens, d))?);
        }
        parts.push(x);
        // Contiguous, so LayerNorm takes its fused per-row path: the strided fallback sums in an
        // order that depends on the batch size.
        Ok((Tensor::cat(&parts, 1)?.contiguous()?, ph, pw))
    }

    /// The RoPE table for a `ph`×`pw` grid in the compute dtype of `like`.
    pub fn rope(&self, ph: usize, pw: usize, like: &Tensor) -> Result<Rope2d> {
        Rope2d::new(self.prefix_len(), ph, pw, self.cfg.head_dim(), self.cfg.rope_theta, like.dtype(), like.device())
    }

    /// Number of transformer blocks.
    pub fn block_count(&self) -> usize {
        self.blocks.len()
    }

    /// Block `i` alone on tokens `[B, 1 + R + N, D]` of a `ph`×`pw` grid, with `rope` from
    /// [`Dinov3::rope`] (activation checkpointing recomputes blocks one by one).
    pub(crate) fn block_forward(&self, i: usize, x: &Tensor, rope: &Rope2d) -> Result<Tensor> {
        let blk = self.blocks.get(i).ok_or_else(|| Error::Input(format!("block {i} of {}", self.blocks.len())))?;
        blk.forward_rotated(x, &|t: &Tensor| rope.apply(t))
    }

    /// Hidden state `k` (0 = embeddings) as the head reads it: normed as transformers does, split
    /// into the patch map (`[B, D, ph, pw]`, or tokens without `reshape_hidden_states`) and the class
    /// token when `return_class_token`.
    pub(crate) fn stage_output(&self, k: usize, x: &Tensor, ph: usize, pw: usize) -> Result<(Tensor, Option<Tensor>)> {
        let s = if self.cfg.apply_layernorm || k == self.cfg.num_hidden_layers { crate::nn::grad::layer_norm(&self.norm, x)? } else { x.clone() };
        let cls = if self.cfg.return_class_token { Some(s.narrow(1, 0, 1)?.squeeze(1)?) } else { None };
        let (b, _, d) = s.dims3()?;
        let patches = s.narrow(1, self.prefix_len(), ph * pw)?;
        let map = if self.cfg.reshape_hidden_states { crate::kernels::cpu_slice::transpose_last_two(&patches)?.reshape((b, d, ph, pw))? } else { patches.contiguous()? };
        Ok((map, cls))
    }

    /// Assembles the selected stages' outputs (`(map, class token)` in index order).
    pub(crate) fn features_from(stages: Vec<(Tensor, Option<Tensor>)>, ph: usize, pw: usize) -> Dinov3Features {
        let mut maps = Vec::with_capacity(stages.len());
        let mut cls = Vec::with_capacity(stages.len());
        for (m, c) in stages {
            maps.push(m);
            cls.extend(c);
        }
        Dinov3Features { maps, cls, ph, pw }
    }

    /// Runs the blocks and returns the selected stages (normed as transformers does), their class
    /// tokens when `return_class_token`, and the patch grid.
    pub fn forward_features(&self, pixel_values: &Tensor) -> Result<Dinov3Features> {
        let (mut x, ph, pw) = self.embed(pixel_values)?;
        let rope = self.rope(ph, pw, &x)?;
        let mut stages = Vec::with_capacity(self.indices.len());
        if self.indices.contains(&0) {
            stages.push(self.stage_output(0, &x, ph, pw)?);
        }
        let last = self.indices.iter().copied().max().unwrap_or(0);
        for i in 0..last.min(self.blocks.len()) {
            x = self.block_forward(i, &x, &rope)?;
            if self.indices.contains(&(i + 1)) {
                stages.push(self.stage_output(i + 1, &x, ph, pw)?);
            }
        }
        Ok(Self::features_from(stages, ph, pw))
    }
}
