//! SegFormer semantic segmentation (`SegformerForSemanticSegmentation`, transformers 5.24.0), B0–B5.
//!
//! Module paths mirror the hub (legacy) tensor names that `save_pretrained` writes:
//! `segformer.encoder.patch_embeddings.{s}`, `segformer.encoder.block.{s}.{j}.attention.self.query`, …,
//! `decode_head.linear_c.{s}.proj`, `decode_head.linear_fuse`, `decode_head.batch_norm`,
//! `decode_head.classifier`.
//!
//! Forward (per stage s): overlapping patch embedding (conv k_s, stride_s, padding k_s/2) → LayerNorm;
//! `depths[s]` blocks of `x += Attn(LN(x))` (efficient self-attention: keys/values from a strided
//! `sr_ratio` conv + LayerNorm when `sr_ratio > 1`), `x += MixFFN(LN(x))` (fc1 → 3×3 depthwise conv →
//! activation → fc2); stage LayerNorm. Every LayerNorm uses eps 1e-5 whatever `layer_norm_eps` says
//! (the reference builds them as `nn.LayerNorm(C)`). Decode head: per-stage Linear to
//! `decoder_hidden_size`, bilinear (align_corners=False) to the stage-0 size, concatenation in reverse
//! stage order, 1×1 conv without bias + BatchNorm (running statistics, eps 1e-5; folded into the conv
//! at load time) + ReLU, 1×1 classifier → logits `[B, num_labels, H/4, W/4]`.
use std::collections::BTreeMap;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Conv2dConfig, LayerNorm};
use crate::nn::conv::Conv2d;
use serde::Deserialize;

use crate::config_check::{Section, MAX_CLASSES, MAX_INPUT_CHANNELS, MAX_LAYERS, MAX_LEVELS, MAX_MLP_WIDTH, MAX_PATCH, MAX_WIDTH};
use crate::error::{Error, Result};
use crate::profile::Span;
use crate::models::{Model, NamedTensors};
use crate::kernels::depthwise::{depthwise_conv2d_nhwc, depthwise_nhwc_q8, DepthwiseConfig, DepthwiseConv2d, DepthwiseImpl, DwActivation};
use crate::nn::layers::{conv2d, layer_norm};
use crate::nn::Linear;
use crate::weights::{StoredDType, Vb};

mod family;
mod training;

pub use family::SegformerFamily;
/// SegFormer's image processor: the fixed-size one with its defaults.
pub use crate::models::fixed_size::FixedSizeProcessor as SegformerProcessor;

use crate::kernels::folded_decode::{ClassifierWeight, FoldedDecode};

/// The decode head with `linear_fuse` and the BatchNorm multiplied into the stage projections.
struct FoldedHead {
    /// Per stage: `linear_fuse[:, block(s)] · proj_s` as `[D, C_s]`, no bias.
    stage: Vec<Linear>,
    /// The rest, in bands of rows.
    decode: FoldedDecode,
}


/// LayerNorm eps of every SegFormer LayerNorm (the config's `layer_norm_eps` is not used by the reference).
pub(crate) const LAYER_NORM_EPS: f64 = 1e-5;
/// Decode-head BatchNorm eps (`nn.BatchNorm2d` default).
pub(crate) const BATCH_NORM_EPS: f64 = 1e-5;

fn d_channels() -> usize {
    3
}
fn d_blocks() -> usize {
    4
}
fn d_depths() -> Vec<usize> {
    vec![2, 2, 2, 2]
}
fn d_sr() -> Vec<usize> {
    vec![8, 4, 2, 1]
}
fn d_hidden() -> Vec<usize> {
    vec![32, 64, 160, 256]
}
fn d_patch() -> Vec<usize> {
    vec![7, 3, 3, 3]
}
fn d_strides() -> Vec<usize> {
    vec![4, 2, 2, 2]
}
fn d_heads() -> Vec<usize> {
    vec![1, 2, 5, 8]
}
fn d_mlp() -> Vec<f64> {
    vec![4.0; 4]
}
fn d_act() -> String {
    "gelu".into()
}
fn d_decoder() -> usize {
    256
}
fn d_true() -> bool {
    true
}
fn d_ln_eps() -> f64 {
    1e-6
}
fn d_ignore() -> i64 {
    255
}

/// `SegformerConfig` as `config.json` writes it (defaults: transformers 5.24.0, i.e. B0).
/// Dropout, drop-path and initializer fields are accepted and ignored (inference only).
#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    /// Input channels.
    #[serde(default = "d_channels")]
    pub num_channels: usize,
    /// Number of encoder stages.
    #[serde(default = "d_blocks")]
    pub num_encoder_blocks: usize,
    /// Blocks per stage.
    #[serde(default = "d_depths")]
    pub depths: Vec<usize>,
    /// Key/value spatial reduction per stage (1: none).
    #[serde(default = "d_sr")]
    pub sr_ratios: Vec<usize>,
    /// Channels per stage.
    #[serde(default = "d_hidden")]
    pub hidden_sizes: Vec<usize>,
    /// Patch-embedding kernel per stage.
    #[serde(default = "d_patch")]
    pub patch_sizes: Vec<usize>,
    /// Patch-embedding stride per stage.
    #[serde(default = "d_strides")]
    pub strides: Vec<usize>,
    /// Attention heads per stage.
    #[serde(default = "d_heads")]
    pub num_attention_heads: Vec<usize>,
    /// Mix-FFN expansion per stage (hidden = `int(C · ratio)`).
    #[serde(default = "d_mlp")]
    pub mlp_ratios: Vec<f64>,
    /// Activation of the Mix-FFN (`gelu` = exact erf GELU).
    #[serde(default = "d_act")]
    pub hidden_act: String,
    /// Decode-head width.
    #[serde(default = "d_decoder")]
    pub decoder_hidden_size: usize,
    /// Whether the last stage is reshaped to NCHW (must be true for segmentation).
    #[serde(default = "d_true")]
    pub reshape_last_stage: bool,
    /// Stored in the config but not used by the reference's LayerNorms (they use 1e-5).
    #[serde(default = "d_ln_eps")]
    pub layer_norm_eps: f64,
    /// Training-only ignore index (kept for the manifest).
    #[serde(default = "d_ignore")]
    pub semantic_loss_ignore_index: i64,
    /// Class names by id (`"0": "wall"`, …).
    #[serde(default)]
    pub id2label: Option<BTreeMap<String, String>>,
    /// Class count when `id2label` is absent.
    #[serde(default)]
    pub num_labels: Option<usize>,
}

/// How the Mix-FFN activation is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Act {
    GeluErf,
    GeluTanh,
    Relu,
    Silu,
}

impl Config {
    /// Parses and validates a `config.json` value.
    pub fn from_json(v: &serde_json::Value) -> Result<Self> {
        let c: Config = serde_json::from_value(v.clone()).map_err(|e| Error::Config(format!("segformer: {e}")))?;
        c.validate()?;
        Ok(c)
    }

    /// The number of classes: `len(id2label)` when present, else `num_labels`, else 2 (the transformers default).
    pub fn num_labels(&self) -> usize {
        match &self.id2label {
            Some(m) if !m.is_empty() => m.len(),
            _ => self.num_labels.unwrap_or(2),
        }
    }

    /// Class names by id (`label_<i>` where `id2label` has no entry).
    pub fn labels(&self) -> Vec<String> {
        (0..self.num_labels())
            .map(|i| {
                self.id2label.as_ref().and_then(|m| m.get(&i.to_string()).cloned()).unwrap_or_else(|| format!("LABEL_{i}"))
            })
            .collect()
    }

    fn act(&self) -> Result<Act> {
        match self.hidden_act.as_str() {
            "gelu" => Ok(Act::GeluErf),
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Ok(Act::GeluTanh),
            "relu" => Ok(Act::Relu),
            "silu" | "swish" => Ok(Act::Silu),
            other => Err(Error::Config(format!("segformer: unsupported hidden_act `{other}`"))),
        }
    }

    fn mlp_hidden(&self, s: usize) -> usize {
        // Python: int(hidden_size * mlp_ratio), truncation toward zero.
        (self.hidden_sizes[s] as f64 * self.mlp_ratios[s]) as usize
    }

    fn validate(&self) -> Result<()> {
        let n = self.num_encoder_blocks;
        let bad = |m: String| Err(Error::Config(format!("segformer: {m}")));
        if n == 0 {
            return bad("num_encoder_blocks must be at least 1".into());
        }
        for (name, len) in [
            ("depths", self.depths.len()),
            ("sr_ratios", self.sr_ratios.len()),
            ("hidden_sizes", self.hidden_sizes.len()),
            ("patch_sizes", self.patch_sizes.len()),
            ("strides", self.strides.len()),
            ("num_attention_heads", self.num_attention_heads.len()),
            ("mlp_ratios", self.mlp_ratios.len()),
        ] {
            if len < n {
                return bad(format!("{name} has {len} entries, num_encoder_blocks is {n}"));
            }
        }
        let sec = Section::root();
        sec.count("num_encoder_blocks", n, MAX_LEVELS)?;
        for s in 0..n {
            let c = sec.count(&format!("hidden_sizes[{s}]"), self.hidden_sizes[s], MAX_WIDTH)?;
            sec.heads(&format!("num_attention_heads[{s}]"), self.num_attention_heads[s], &format!("hidden_sizes[{s}]"), c)?;
            sec.count(&format!("depths[{s}]"), self.depths[s], MAX_LAYERS)?;
            sec.count(&format!("patch_sizes[{s}]"), self.patch_sizes[s], MAX_PATCH)?;
            sec.count(&format!("strides[{s}]"), self.strides[s], MAX_PATCH)?;
            sec.count(&format!("sr_ratios[{s}]"), self.sr_ratios[s], MAX_PATCH)?;
            sec.scaled(&format!("mlp_ratios[{s}]"), c, self.mlp_ratios[s], MAX_MLP_WIDTH)?;
        }
        sec.count("num_channels", self.num_channels, MAX_INPUT_CHANNELS)?;
        sec.count("decoder_hidden_size", self.decoder_hidden_size, MAX_WIDTH)?;
        sec.count("num_labels", self.num_labels(), MAX_CLASSES)?;
        if !self.reshape_last_stage {
            return bad("reshape_last_stage = false is only meaningful for image classification; SegformerForSemanticSegmentation needs true".into());
        }
        self.act()?;
        Ok(())
    }

    /// The stage feature sizes `(h_s, w_s)` for an `h × w` input, or an input error when the input is
    /// too small for a stage's sequence-reduction conv.
    pub fn stage_sizes(&self, h: usize, w: usize) -> Result<Vec<(usize, usize)>> {
        let (mut h, mut w) = (h, w);
        let mut out = Vec::with_capacity(self.num_encoder_blocks);
        for s in 0..self.num_encoder_blocks {
            let (k, st) = (self.patch_sizes[s], self.strides[s]);
            let pad = 2 * (k / 2);
            if h + pad < k || w + pad < k || h == 0 || w == 0 {
                return Err(Error::Input(format!("segformer: a {h}x{w} map is too small for stage {s}'s {k}x{k} patch embedding")));
            }
            h = (h + pad - k) / st + 1;
            w = (w + pad - k) / st + 1;
            let r = self.sr_ratios[s];
            if r > 1 && (h < r || w < r) {
                return Err(Error::Input(format!(
                    "segformer: stage {s} is {h}x{w}, smaller than its sequence-reduction ratio {r}; the input is too small"
                )));
            }
            out.push((h, w));
        }
        Ok(out)
    }
}

fn ln(vb: &Vb, dim: usize) -> Result<LayerNorm> {
    layer_norm(vb, dim, LAYER_NORM_EPS)
}

/// `[B, N, C]` tokens of an `h × w` map → `[B, C, h, w]` (contiguous).
fn tokens_to_nchw(x: &Tensor, h: usize, w: usize) -> candle_core::Result<Tensor> {
    let (b, _, c) = x.dims3()?;
    crate::kernels::cpu_slice::transpose_last_two(x)?.reshape((b, c, h, w))
}

/// `[B, C, h, w]` → `[B, h·w, C]` (contiguous).
fn nchw_to_tokens(x: &Tensor) -> candle_core::Result<Tensor> {
    crate::kernels::cpu_slice::transpose_last_two(&x.flatten_from(2)?)
}

struct PatchEmbed {
    proj: Conv2d,
    norm: LayerNorm,
}

impl PatchEmbed {
    fn load(vb: &Vb, in_c: usize, out_c: usize, k: usize, stride: usize) -> Result<Self> {
        let cfg = Conv2dConfig { padding: k / 2, stride, ..Default::default() };
        Ok(PatchEmbed { proj: conv2d(&vb.pp("proj"), in_c, out_c, k, cfg, true)?, norm: ln(&vb.pp("layer_norm"), out_c)? })
    }

    /// Tokens `[B, h·w, C]` of an `h × w` map → (tokens `[B, h'·w', C']`, h', w').
    fn forward(&self, x: &Tensor, hw: (usize, usize)) -> candle_core::Result<(Tensor, usize, usize)> {
        let (y, (h, w)) = self.proj.forward_tokens(x, hw)?;
        Ok((crate::nn::grad::layer_norm(&self.norm, &y)?, h, w))
    }
}

struct Attention {
    query: Linear,
    key: Linear,
    value: Linear,
    sr: Option<(Conv2d, LayerNorm)>,
    out: Linear,
    heads: usize,
    head_dim: usize,
}

impl Attention {
    fn load(vb: &Vb, c: usize, heads: usize, sr: usize) -> Result<Self> {
        let head_dim = c / heads;
        let inner = heads * head_dim;
        let s = vb.pp("self");
        let query = Linear::load(&s.pp("query"), c, inner, true)?;
        let sr = if sr > 1 {
            let cfg = Conv2dConfig { stride: sr, ..Default::default() };
            let mut conv = conv2d(&s.pp("sr"), c, c, sr, cfg, true)?;
            // Projections that run the int8 GEMM (a Q8_0 file's): the reduction runs it too.
            if query.runs_int8() {
                conv.hold_int8_for_tokens()?;
            }
            Some((conv, ln(&s.pp("layer_norm"), c)?))
        } else {
            None
        };
        Ok(Attention {
            query,
            key: Linear::load(&s.pp("key"), c, inner, true)?,
            value: Linear::load(&s.pp("value"), c, inner, true)?,
            sr,
            out: Linear::load(&vb.pp("output").pp("dense"), inner, c, true)?,
            heads,
            head_dim,
        })
    }

    /// `[B, N, heads·D]` → a `[B, heads, N, D]` view.
    fn heads(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (b, n, _) = x.dims3()?;
        x.reshape((b, n, self.heads, self.head_dim))?.transpose(1, 2)
    }

    fn forward(&self, x: &Tensor, h: usize, w: usize) -> candle_core::Result<Tensor> {
        let (b, n, _) = x.dims3()?;
        let q = self.heads(&self.query.forward(x)?)?;
        let kv = match &self.sr {
            Some((conv, norm)) => {
                let (a, _) = conv.forward_tokens(x, (h, w))?;
                crate::nn::grad::layer_norm(norm, &a)?
            }
            None => x.clone(),
        };
        let k = self.heads(&self.key.forward(&kv)?)?;
        let v = self.heads(&self.value.forward(&kv)?)?;
        let scale = (self.head_dim as f64).powf(-0.5);
        // Projections that round their activations to 8 bits (a Q8_0 file's) take int8 products here too.
        let fused = if self.query.runs_int8() && crate::kernels::int8_attention::applies(&q, &k, &v) {
            Some(crate::kernels::int8_attention::attention(&q, &k, &v, scale as f32))
        } else if crate::kernels::fused_attention::applies(&q, &k, &v) {
            Some(crate::kernels::fused_attention::attention(&q, &k, &v, scale as f32))
        } else if crate::nn::attention::trains_on_cpu(&q, &k, &v) {
            Some(crate::nn::attention::train_attention(&q, &k, &v, scale))
        } else {
            None
        };
        if let Some(o) = fused {
            let o = o.map_err(candle_core::Error::wrap)?;
            return self.out.forward(&o.transpose(1, 2)?.reshape((b, n, self.heads * self.head_dim))?);
        }
        let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
        let scores = (q.matmul(&k.t()?)? * scale)?;
        // Softmax in f32, as the reference (`softmax(..., dtype=torch.float32)`).
        let dt = scores.dtype();
        let probs = if dt == DType::F32 || dt == DType::F64 {
            crate::nn::grad::softmax_last_dim(&scores)?
        } else {
            candle_nn::ops::softmax_last_dim(&scores.to_dtype(DType::F32)?)?.to_dtype(dt)?
        };
        let o = probs.matmul(&v)?.transpose(1, 2)?.reshape((b, n, self.heads * self.head_dim))?;
        self.out.forward(&o)
    }
}

struct MixFfn {
    fc1: Linear,
    dwconv: DepthwiseConv2d,
    act: Act,
    fc2: Linear,
    imp: DepthwiseImpl,
}

impl MixFfn {
    fn load(vb: &Vb, c: usize, hidden: usize, act: Act) -> Result<Self> {
        let dw_cfg = DepthwiseConfig { stride: 1, padding: 1, dilation: 1 };
        Ok(MixFfn {
            fc1: Linear::load(&vb.pp("dense1"), c, hidden, true)?,
            dwconv: DepthwiseConv2d::load(&vb.pp("dwconv").pp("dwconv"), hidden, 3, dw_cfg, true)?,
            act,
            fc2: Linear::load(&vb.pp("dense2"), hidden, c, true)?,
            imp: DepthwiseImpl::Auto,
        })
    }

    fn activate(&self, y: Tensor) -> candle_core::Result<Tensor> {
        match self.act {
            Act::GeluErf => y.gelu_erf(),
            Act::GeluTanh => y.gelu(),
            Act::Relu => y.relu(),
            Act::Silu => y.silu(),
        }
    }

    fn forward(&self, x: &Tensor, h: usize, w: usize) -> candle_core::Result<Tensor> {
        let y = self.fc1.forward(x)?;
        match self.imp {
            DepthwiseImpl::Auto => {
                // Channels-last: the tokens [B, h·w, C] are already NHWC; bias (+ exact GELU) fused.
                let (b, n, c) = y.dims3()?;
                let (dw_act, fused) = if self.act == Act::GeluErf { (DwActivation::GeluErf, true) } else { (DwActivation::None, false) };
                let cfg = DepthwiseConfig { stride: 1, padding: 1, dilation: 1 };
                // An int8 `dense2` (a Q8_0 file's) takes the conv's pixels rounded to 8 bits as
                // they are computed: the f32 map is never written out and read back.
                if let Some(bias) = self.dwconv.bias().filter(|_| fused && self.fc2.runs_int8()) {
                    if let Some((q, d)) = depthwise_nhwc_q8(&y.reshape((b, h, w, c))?, self.dwconv.weight(), bias, dw_act, cfg)? {
                        if let Some(z) = self.fc2.forward_quantized(&q, &d, b * n)? {
                            return z.reshape((b, n, ()));
                        }
                    }
                }
                let z = depthwise_conv2d_nhwc(&y.reshape((b, h, w, c))?, self.dwconv.weight(), self.dwconv.bias(), dw_act, cfg)?
                    .reshape((b, n, c))?;
                let z = if fused { z } else { self.activate(z)? };
                self.fc2.forward(&z)
            }
            DepthwiseImpl::Grouped => {
                // The reference layout: NCHW, Candle's grouped conv, then the activation.
                let mut dw = self.dwconv.clone();
                dw.set_impl(DepthwiseImpl::Grouped);
                let z = self.activate(dw.forward(&tokens_to_nchw(&y, h, w)?)?)?;
                self.fc2.forward(&nchw_to_tokens(&z)?)
            }
        }
    }
}

struct Block {
    norm1: LayerNorm,
    attn: Attention,
    norm2: LayerNorm,
    mlp: MixFfn,
}

impl Block {
    fn forward(&self, x: &Tensor, h: usize, w: usize) -> candle_core::Result<Tensor> {
        let span = Span::new("segformer.attention");
        let x = (x + self.attn.forward(&crate::nn::grad::layer_norm(&self.norm1, x)?, h, w)?)?;
        drop(span);
        let _span = Span::new("segformer.mix_ffn");
        &x + self.mlp.forward(&crate::nn::grad::layer_norm(&self.norm2, &x)?, h, w)?
    }
}

struct Stage {
    embed: PatchEmbed,
    blocks: Vec<Block>,
    norm: LayerNorm,
}

/// How the decode head is evaluated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DecodeHeadImpl {
    /// Exploits linearity: per stage, `linear_fuse`'s column block (BatchNorm folded) is multiplied
    /// into the stage projection at load time, applied at the stage's own resolution, and the results
    /// are bilinearly upsampled and summed in one fused pass (with bias and ReLU). Mathematically the
    /// reference head (bilinear interpolation and 1×1 convs commute); about half of B0's FLOPs are
    /// saved. CPU f32 only; other dtypes/devices use `Literal`.
    #[default]
    Folded,
    /// The reference order: project, upsample, concatenate, 1×1 conv, BatchNorm, ReLU.
    Literal,
}

/// `linear_fuse` and an eval-mode BatchNorm kept apart, for training: the conv weight and the
/// BatchNorm's affine parameters may be trainable; the running statistics stay fixed.
struct TrainableFuse {
    /// The bias-free 1×1 `linear_fuse` (its weight may be a Var).
    conv: Conv2d,
    gamma: Tensor,
    beta: Tensor,
    mean: Tensor,
    /// `1 / sqrt(running_var + ε)`.
    inv_std: Tensor,
}

impl TrainableFuse {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let d = self.gamma.dim(0)?;
        let per_channel = |t: &Tensor| t.reshape((1, d, 1, 1));
        let y = self.conv.forward(x)?;
        let scale = (&self.gamma * &self.inv_std)?;
        y.broadcast_sub(&per_channel(&self.mean)?)?.broadcast_mul(&per_channel(&scale)?)?.broadcast_add(&per_channel(&self.beta)?)
    }
}

/// `linear_fuse` + BatchNorm: folded into one conv for inference, kept apart when the head trains.
enum Fuse {
    Folded(Conv2d),
    Trainable(TrainableFuse),
}

struct DecodeHead {
    proj: Vec<Linear>,
    fuse: Fuse,
    classifier: Conv2d,
    folded: Option<FoldedHead>,
    imp: DecodeHeadImpl,
}

impl DecodeHead {
    fn load(vb: &Vb, cfg: &Config) -> Result<Self> {
        let d = cfg.decoder_hidden_size;
        let n = cfg.num_encoder_blocks;
        let labels = cfg.num_labels();
        let proj = (0..n)
            .map(|s| Linear::load(&vb.pp("linear_c").pp(s).pp("proj"), cfg.hidden_sizes[s], d, true))
            .collect::<Result<Vec<_>>>()?;
        let classifier = conv2d(&vb.pp("classifier"), d, labels, 1, Conv2dConfig::default(), true)?;
        let trains = ["linear_fuse.weight", "batch_norm.weight", "batch_norm.bias", "classifier.weight", "classifier.bias"]
            .iter()
            .any(|n| vb.is_trainable(n))
            || (0..n).any(|s| vb.pp("linear_c").pp(s).pp("proj").is_trainable("weight"));
        if trains {
            // Unfolded, in the model's dtype (f64 for gradient checks), reading the Vars themselves.
            let bn = vb.pp("batch_norm");
            let inv_std = (bn.get(d, "running_var")? + BATCH_NORM_EPS)?.sqrt()?.recip()?;
            let fuse = TrainableFuse {
                conv: Conv2d::new(vb.get((d, n * d, 1, 1), "linear_fuse.weight")?, None, Conv2dConfig::default()),
                gamma: bn.get(d, "weight")?,
                beta: bn.get(d, "bias")?,
                mean: bn.get(d, "running_mean")?,
                inv_std,
            };
            return Ok(DecodeHead { proj, fuse: Fuse::Trainable(fuse), classifier, folded: None, imp: DecodeHeadImpl::Literal });
        }
        // Fold eval-mode BatchNorm into the bias-free 1x1 conv, in f32:
        // y = γ (W x − μ) / sqrt(σ² + ε) + β  =  (γ/σ̂ · W) x + (β − γ μ / σ̂).
        let f32v = vb.with_dtype(DType::F32);
        let w = f32v.get((d, n * d, 1, 1), "linear_fuse.weight")?;
        let bn = f32v.pp("batch_norm");
        let gamma = bn.get(d, "weight")?;
        let beta = bn.get(d, "bias")?;
        let mean = bn.get(d, "running_mean")?;
        let var = bn.get(d, "running_var")?;
        let inv = (gamma / (&var + BATCH_NORM_EPS)?.sqrt()?)?;
        let w32 = w.broadcast_mul(&inv.reshape((d, 1, 1, 1))?)?;
        let b32 = (beta - (&mean * &inv)?)?;
        let fuse = Fuse::Folded(Conv2d::new(w32.to_dtype(vb.dtype())?, Some(b32.to_dtype(vb.dtype())?), Conv2dConfig::default()));
        // The folded form, computed in f64 from the f32 weights (on the CPU, then moved). A head
        // whose projections a Q8_0 or Q4_K file holds quantized is held for the int8 GEMM, as the
        // encoder's linears of such a file are.
        let int8 = matches!(vb.store().stored_dtype(&vb.pp("linear_c").pp(0).pp("proj").path("weight")),
            Some(StoredDType::Ggml(t)) if crate::nn::linear::runs_int8_when_stored_as(t));
        let folded = if vb.dtype() == DType::F32 && vb.device().is_cpu() {
            let wf = w32.reshape((d, n * d))?.to_dtype(DType::F64)?;
            let mut bias = b32.to_dtype(DType::F64)?;
            let mut stage = Vec::with_capacity(n);
            for s in 0..n {
                let k = n - 1 - s; // concatenation is in reverse stage order
                let ws = wf.narrow(1, k * d, d)?;
                let p = f32v.pp("linear_c").pp(s).pp("proj");
                let pw = p.get((d, cfg.hidden_sizes[s]), "weight")?.to_dtype(DType::F64)?;
                let pb = p.get(d, "bias")?.to_dtype(DType::F64)?;
                let map = ws.matmul(&pw)?.to_dtype(DType::F32)?;
                let held = if int8 { Linear::int8_from_f32(&map, None)? } else { None };
                stage.push(match held {
                    Some(linear) => linear,
                    None => Linear::from_tensors(map, None)?,
                });
                bias = (bias + ws.matmul(&pb.reshape((d, 1))?)?.reshape(d)?)?;
            }
            let cls = f32v.pp("classifier");
            let cls_w = cls.get((labels, d, 1, 1), "weight")?.reshape((labels, d))?;
            let packed = if int8 { crate::kernels::int8_gemm::PackedQ8::from_f32(&cls_w)? } else { None };
            let classifier = match packed {
                Some(p) => ClassifierWeight::Int8(p),
                None => ClassifierWeight::F32(cls_w.flatten_all()?.to_vec1::<f32>()?),
            };
            Some(FoldedHead {
                stage,
                decode: FoldedDecode {
                    bias: bias.to_dtype(DType::F32)?.to_vec1::<f32>()?,
                    classifier,
                    classifier_bias: cls.get(labels, "bias")?.to_vec1::<f32>()?,
                },
            })
        } else {
            None
        };
        Ok(DecodeHead { proj, fuse, classifier, folded, imp: DecodeHeadImpl::Folded })
    }

    /// `feats[s]` = (stage tokens `[B, h_s·w_s, C_s]`, h_s, w_s).
    fn forward(&self, feats: &[(Tensor, usize, usize)]) -> candle_core::Result<Tensor> {
        if let (DecodeHeadImpl::Folded, Some(f)) = (self.imp, &self.folded) {
            if feats[0].0.dtype() == DType::F32 && feats[0].0.device().is_cpu() {
                return self.forward_folded(f, feats);
            }
        }
        let (_, h0, w0) = feats[0];
        let mut ups = Vec::with_capacity(feats.len());
        for ((t, h, w), proj) in feats.iter().zip(&self.proj).rev() {
            let y = tokens_to_nchw(&proj.forward(t)?, *h, *w)?;
            ups.push(if (*h, *w) == (h0, w0) { y } else { crate::nn::grad::bilinear(&y, h0, w0, false)? });
        }
        let x = Tensor::cat(&ups, 1)?;
        let x = match &self.fuse {
            Fuse::Trainable(t) => t.forward(&x)?.relu()?,
            Fuse::Folded(c) => c.forward(&x)?.relu()?,
        };
        self.classifier.forward(&x)
    }

    fn forward_folded(&self, f: &FoldedHead, feats: &[(Tensor, usize, usize)]) -> candle_core::Result<Tensor> {
        let (b, _, _) = feats[0].0.dims3()?;
        let (_, h0, w0) = feats[0];
        let d = f.decode.bias.len();
        let labels = f.decode.classifier_bias.len();
        let maps = feats
            .iter()
            .zip(&f.stage)
            .map(|((t, h, w), lin)| Ok((lin.forward(t)?.contiguous()?, *h, *w)))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let held: Vec<_> = maps.iter().map(|(t, _, _)| t.storage_and_layout()).collect();
        let mut planes = Vec::with_capacity(maps.len());
        for ((storage, layout), (_, h, w)) in held.iter().zip(&maps) {
            let candle_core::Storage::Cpu(candle_core::CpuStorage::F32(data)) = &**storage else {
                candle_core::bail!("segformer: the folded decode head runs on f32 CPU tensors");
            };
            planes.push((&data[layout.start_offset()..][..b * h * w * d], *h, *w));
        }
        let logits = f.decode.logits(&planes, b, (h0, w0))?;
        drop(held);
        Tensor::from_vec(logits, (b, labels, h0, w0), feats[0].0.device())
    }
}

/// `SegformerForSemanticSegmentation`: `pixel_values [B, C, H, W]` → `logits [B, num_labels, H/4, W/4]`.
pub struct SegformerForSemanticSegmentation {
    config: Config,
    stages: Vec<Stage>,
    head: DecodeHead,
    dtype: DType,
    device: Device,
}

impl SegformerForSemanticSegmentation {
    /// Loads from the root of a checkpoint (`segformer.*`, `decode_head.*`) with its `config.json` value.
    pub fn load(vb: &Vb, config: &Config) -> Result<Self> {
        Self::load_with_config(vb, config.clone())
    }

    /// Loads with an already parsed config.
    pub(crate) fn load_with_config(vb: &Vb, cfg: Config) -> Result<Self> {
        let act = cfg.act()?;
        let enc = vb.pp("segformer").pp("encoder");
        let mut stages = Vec::with_capacity(cfg.num_encoder_blocks);
        for s in 0..cfg.num_encoder_blocks {
            let c = cfg.hidden_sizes[s];
            let in_c = if s == 0 { cfg.num_channels } else { cfg.hidden_sizes[s - 1] };
            let mut embed = PatchEmbed::load(&enc.pp("patch_embeddings").pp(s), in_c, c, cfg.patch_sizes[s], cfg.strides[s])?;
            let blocks = (0..cfg.depths[s])
                .map(|j| {
                    let b = enc.pp("block").pp(s).pp(j);
                    Ok(Block {
                        norm1: ln(&b.pp("layer_norm_1"), c)?,
                        attn: Attention::load(&b.pp("attention"), c, cfg.num_attention_heads[s], cfg.sr_ratios[s])?,
                        norm2: ln(&b.pp("layer_norm_2"), c)?,
                        mlp: MixFfn::load(&b.pp("mlp"), c, cfg.mlp_hidden(s), act)?,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            // A stage whose linears run the int8 GEMM (a Q8_0 file's) convolves in int8 too.
            if blocks.first().is_some_and(|b| b.attn.query.runs_int8()) {
                embed.proj.hold_int8_for_tokens()?;
            }
            let norm = ln(&enc.pp("layer_norm").pp(s), c)?;
            stages.push(Stage { embed, blocks, norm });
        }
        let head = DecodeHead::load(&vb.pp("decode_head"), &cfg)?;
        Ok(SegformerForSemanticSegmentation { config: cfg, stages, head, dtype: vb.dtype(), device: vb.device().clone() })
    }

    /// The parsed config.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The compute dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Chooses how the decode head is evaluated (folded by default; `Literal` is the reference order).
    pub fn set_decode_head_impl(&mut self, imp: DecodeHeadImpl) {
        self.head.imp = imp;
    }

    /// Chooses the Mix-FFN depthwise-conv implementation: `Auto` (default) runs the channels-last
    /// kernel on the tokens with bias and GELU fused; `Grouped` is the reference layout (NCHW
    /// transposes, Candle's per-group conv, separate activation), kept for benchmarks and cross-checks.
    pub fn set_depthwise_impl(&mut self, imp: DepthwiseImpl) {
        for st in &mut self.stages {
            for b in &mut st.blocks {
                b.mlp.imp = imp;
            }
        }
    }

    fn check_input(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims();
        let &[_, c, h, w] = dims else {
            return Err(Error::Input(format!("segformer: pixel_values must be [B, C, H, W], got {dims:?}")));
        };
        if dims[0] == 0 {
            return Err(Error::Input("segformer: pixel_values has batch size 0".into()));
        }
        if c != self.config.num_channels {
            return Err(Error::Input(format!(
                "segformer: pixel_values has {c} channels, the model expects {}",
                self.config.num_channels
            )));
        }
        self.config.stage_sizes(h, w)?;
        let x = if x.device().same_device(&self.device) { x.clone() } else { x.to_device(&self.device)? };
        Ok(if x.dtype() == self.dtype { x } else { x.to_dtype(self.dtype)? })
    }

    /// Logits `[B, num_labels, h_0, w_0]` (h_0 = stage-0 height, H/4 for the standard configs).
    pub fn forward(&self, pixel_values: &Tensor) -> Result<Tensor> {
        self.decode(&self.encode(pixel_values)?)
    }

    /// Logits and the encoder stage outputs (after each stage LayerNorm, NCHW), as the reference's
    /// `hidden_states`.
    pub fn forward_with_hidden(&self, pixel_values: &Tensor) -> Result<(Tensor, Vec<Tensor>)> {
        let feats = self.encode(pixel_values)?;
        let logits = self.decode(&feats)?;
        let hidden = feats.iter().map(|(t, h, w)| tokens_to_nchw(t, *h, *w)).collect::<candle_core::Result<Vec<_>>>()?;
        Ok((logits, hidden))
    }

    /// The decode head on encoder features ([`Self::encode`]) → logits `[B, num_labels, h_0, w_0]`.
    pub fn decode(&self, feats: &[(Tensor, usize, usize)]) -> Result<Tensor> {
        let _span = Span::new("segformer.decode_head");
        Ok(self.head.forward(feats)?)
    }

    /// Per stage: (tokens `[B, h·w, C]` after the stage LayerNorm, h, w).
    pub fn encode(&self, pixel_values: &Tensor) -> Result<Vec<(Tensor, usize, usize)>> {
        let x = self.check_input(pixel_values)?;
        let (_, _, h, w) = x.dims4()?;
        let mut x = (nchw_to_tokens(&x)?, h, w);
        let mut feats = Vec::with_capacity(self.stages.len());
        for st in &self.stages {
            let span = Span::new("segformer.patch_embed");
            let (mut t, h, w) = st.embed.forward(&x.0, (x.1, x.2))?;
            drop(span);
            for b in &st.blocks {
                t = b.forward(&t, h, w)?;
            }
            x = (crate::nn::grad::layer_norm(&st.norm, &t)?, h, w);
            feats.push(x.clone());
        }
        Ok(feats)
    }
}

impl Model for SegformerForSemanticSegmentation {
    fn architecture(&self) -> &str {
        "segformer"
    }

    fn input_names(&self) -> Vec<&'static str> {
        vec!["pixel_values"]
    }

    fn forward_named(&self, inputs: &NamedTensors) -> Result<NamedTensors> {
        let x = inputs
            .get("pixel_values")
            .ok_or_else(|| Error::Input("segformer: missing input `pixel_values` [B, 3, H, W]".into()))?;
        let mut out = NamedTensors::new();
        out.insert("logits".to_string(), self.forward(x)?);
        Ok(out)
    }
}
