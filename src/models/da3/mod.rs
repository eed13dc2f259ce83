//! Depth Anything 3 (package `depth-anything-3` 0.1.1, `DepthAnything3Net`): the depth path of the
//! any-view models (DA3-Small/Base/Large/Giant: DINOv2 with q/k norm, 2-D RoPE, camera token and
//! alternating view attention + DualDPT head) and of the monocular DA3Mono/DA3Metric-Large
//! (plain DINOv2-L + DPT head with a sky head).
//!
//! The hub checkpoints are `config.json` `{"model_name": "da3-small"}` (written by the package's
//! `PyTorchModelHubMixin`) and `model.safetensors` with keys `model.backbone.pretrained.*` and
//! `model.head.*`. The model name picks a preset mirroring the package's `configs/<name>.yaml`;
//! explicit `net` / `head` sections (same fields as the yaml, see [`NetConfig`] / [`HeadConfig`])
//! replace the preset. The camera encoder/decoder and the DualDPT ray branch (`model.cam_enc.*`,
//! `model.cam_dec.*`, `head.scratch.*_aux*`) are never read.
mod family;
pub mod processor;

pub(crate) use family::Da3Family;
pub use processor::Da3Processor;

use candle_core::{Module, Tensor};
use candle_nn::LayerNorm;
use crate::nn::conv::Conv2d;
use serde::Deserialize;

use super::{Model, NamedTensors};
use crate::config_check::{Section, MAX_IMAGE_SIZE, MAX_LAYERS, MAX_MLP_WIDTH, MAX_PATCH, MAX_WIDTH};
use crate::error::{Error, Result};
use crate::models::backbones::dinov2::{Dinov2, Dinov2Config, Dinov2Options, KeyLayout, PosEmbedResize, RopeOptions};
use crate::models::backbones::dpt::{same3x3, tokens_to_grid, FusionStage, ReassembleLayer};
use crate::nn::interpolate::bilinear;
use crate::nn::layers::{conv2d, layer_norm};
use crate::weights::Vb;

/// Architecture of the any-view (depth + confidence) models.
pub(crate) const ARCH_ANY_VIEW: &str = "da3";
/// Architecture of DA3Mono (relative depth + sky).
pub(crate) const ARCH_MONO: &str = "da3_mono";
/// Architecture of DA3Metric (depth to be scaled by focal/300, + sky).
pub(crate) const ARCH_METRIC: &str = "da3_metric";
/// The nested giant + metric model (not supported).
pub(crate) const ARCH_NESTED: &str = "da3_nested";

/// The architecture of a package model name (`config.json` `model_name`), e.g. `da3-small` → `da3`.
pub(crate) fn architecture_for_model_name(name: &str) -> Option<&'static str> {
    let base = name.strip_suffix("-1.1").unwrap_or(name).to_ascii_lowercase();
    match base.as_str() {
        "da3-small" | "da3-base" | "da3-large" | "da3-giant" => Some(ARCH_ANY_VIEW),
        "da3mono-large" => Some(ARCH_MONO),
        "da3metric-large" => Some(ARCH_METRIC),
        "da3nested-giant-large" => Some(ARCH_NESTED),
        _ => None,
    }
}

/// The backbone section (`net` in the package yaml).
#[derive(Debug, Clone, Deserialize)]
pub struct NetConfig {
    /// `vits`, `vitb`, `vitl` or `vitg` (sets width, depth and heads).
    pub name: String,
    /// 0-based blocks whose outputs feed the head (4).
    pub out_layers: Vec<usize>,
    /// Camera token and alternating attention from this block (−1: off).
    #[serde(default = "minus1")]
    pub alt_start: i64,
    /// Per-head q/k LayerNorm from this block (−1: off).
    #[serde(default = "minus1")]
    pub qknorm_start: i64,
    /// 2-D RoPE from this block (−1: off).
    #[serde(default = "minus1")]
    pub rope_start: i64,
    /// Head input = `[last per-view tokens ‖ normed tokens]`.
    #[serde(default = "yes")]
    pub cat_token: bool,
    /// edgerun extension (small test models): width instead of the `name` preset's.
    #[serde(default)]
    pub embed_dim: Option<usize>,
    /// edgerun extension: number of blocks.
    #[serde(default)]
    pub depth: Option<usize>,
    /// edgerun extension: attention heads.
    #[serde(default)]
    pub num_heads: Option<usize>,
    /// edgerun extension: MLP ratio (default 4).
    #[serde(default)]
    pub mlp_ratio: Option<f64>,
    /// edgerun extension: training image size (position table 37×37 for 518).
    #[serde(default = "d518")]
    pub img_size: usize,
    /// Patch size.
    #[serde(default = "d14")]
    pub patch_size: usize,
    /// RoPE frequency base.
    #[serde(default = "d100")]
    pub rope_freq: f32,
}

/// The head section (`head` in the package yaml); `class` is the yaml's `__object__.name`.
#[derive(Debug, Clone, Deserialize)]
pub struct HeadConfig {
    /// `DualDPT` (any-view) or `DPT` (mono / metric).
    pub class: String,
    /// Token width entering the head.
    pub dim_in: usize,
    /// Output channels of the main head (depth [+ confidence]).
    pub output_dim: usize,
    /// Fusion width.
    pub features: usize,
    /// Channels per pyramid level.
    pub out_channels: Vec<usize>,
    /// Patch size.
    #[serde(default = "d14")]
    pub patch_size: usize,
    /// Depth activation.
    #[serde(default = "exp")]
    pub activation: String,
    /// Confidence activation.
    #[serde(default = "expp1")]
    pub conf_activation: String,
    /// UV sinusoidal position embedding (DualDPT default true, DPT false).
    #[serde(default)]
    pub pos_embed: Option<bool>,
    /// Output resolution divisor.
    #[serde(default = "d1")]
    pub down_ratio: usize,
    /// DPT sky head (default true).
    #[serde(default)]
    pub use_sky_head: Option<bool>,
    /// Sky activation.
    #[serde(default = "relu")]
    pub sky_activation: String,
    /// DPT token norm: `idt` (none) or `layer` (DualDPT always has one).
    #[serde(default)]
    pub norm_type: Option<String>,
    /// DPT LayerNorm inside the output convs (not supported).
    #[serde(default)]
    pub use_ln_for_heads: bool,
}

fn minus1() -> i64 { -1 }
fn yes() -> bool { true }
fn d518() -> usize { 518 }
fn d14() -> usize { 14 }
fn d1() -> usize { 1 }
fn d100() -> f32 { 100.0 }
fn exp() -> String { "exp".into() }
fn expp1() -> String { "expp1".into() }
fn relu() -> String { "relu".into() }

/// `config.json` of a DA3 checkpoint.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct Da3Config {
    /// `da3`, `da3_mono` or `da3_metric` (else derived from `model_name`).
    #[serde(default)]
    pub model_type: Option<String>,
    /// The package preset name (`da3-small`, `da3mono-large`, …).
    #[serde(default)]
    pub model_name: Option<String>,
    /// Backbone (replaces the preset's).
    #[serde(default)]
    pub net: Option<NetConfig>,
    /// Head (replaces the preset's).
    #[serde(default)]
    pub head: Option<HeadConfig>,
}

fn net_preset(name: &str, out_layers: [usize; 4], start: i64, cat_token: bool) -> NetConfig {
    NetConfig {
        name: name.into(),
        out_layers: out_layers.to_vec(),
        alt_start: start,
        qknorm_start: start,
        rope_start: start,
        cat_token,
        embed_dim: None,
        depth: None,
        num_heads: None,
        mlp_ratio: None,
        img_size: 518,
        patch_size: 14,
        rope_freq: 100.0,
    }
}

fn head_preset(class: &str, dim_in: usize, output_dim: usize, features: usize, out_channels: [usize; 4]) -> HeadConfig {
    HeadConfig {
        class: class.into(),
        dim_in,
        output_dim,
        features,
        out_channels: out_channels.to_vec(),
        patch_size: 14,
        activation: exp(),
        conf_activation: expp1(),
        pos_embed: None,
        down_ratio: 1,
        use_sky_head: None,
        sky_activation: relu(),
        norm_type: None,
        use_ln_for_heads: false,
    }
}

/// The package's `configs/<name>.yaml` (network and head parts) for a model name.
pub fn preset(model_name: &str) -> Option<(NetConfig, HeadConfig)> {
    let base = model_name.strip_suffix("-1.1").unwrap_or(model_name).to_ascii_lowercase();
    let big = [256, 512, 1024, 1024];
    Some(match base.as_str() {
        "da3-small" => (net_preset("vits", [5, 7, 9, 11], 4, true), head_preset("DualDPT", 768, 2, 64, [48, 96, 192, 384])),
        "da3-base" => (net_preset("vitb", [5, 7, 9, 11], 4, true), head_preset("DualDPT", 1536, 2, 128, [96, 192, 384, 768])),
        "da3-large" => (net_preset("vitl", [11, 15, 19, 23], 8, true), head_preset("DualDPT", 2048, 2, 256, big)),
        "da3-giant" => (net_preset("vitg", [19, 27, 33, 39], 13, true), head_preset("DualDPT", 3072, 2, 256, big)),
        "da3mono-large" | "da3metric-large" => (net_preset("vitl", [4, 11, 17, 23], -1, false), head_preset("DPT", 1024, 1, 256, big)),
        _ => return None,
    })
}

impl Da3Config {
    /// Parses `config.json`, filling `net` / `head` from the `model_name` preset where absent.
    pub(crate) fn from_json(config: &serde_json::Value) -> Result<(String, NetConfig, HeadConfig)> {
        let cfg: Da3Config = serde_json::from_value(config.clone()).map_err(|e| Error::Config(format!("DA3 config: {e}")))?;
        let preset = cfg.model_name.as_deref().and_then(preset);
        let arch = match (&cfg.model_type, cfg.model_name.as_deref().and_then(architecture_for_model_name)) {
            (Some(t), _) => t.clone(),
            (None, Some(a)) => a.to_string(),
            (None, None) => return Err(Error::Config("DA3 config has neither `model_type` nor a known `model_name`".into())),
        };
        if arch == ARCH_NESTED {
            return Err(Error::Config("DA3 nested (giant any-view + metric) checkpoints are not supported; use the any-view or metric model".into()));
        }
        let (pn, ph) = match preset {
            Some((n, h)) => (Some(n), Some(h)),
            None => (None, None),
        };
        let net = cfg.net.or(pn).ok_or_else(|| Error::Config("DA3 config: no `net` section and no known `model_name`".into()))?;
        let head = cfg.head.or(ph).ok_or_else(|| Error::Config("DA3 config: no `head` section and no known `model_name`".into()))?;
        net.validate()?;
        head.validate()?;
        Ok((arch, net, head))
    }
}

/// A parsed DA3 config: which model it is, its backbone and its head.
#[derive(Debug, Clone)]
pub struct Config {
    /// The model family.
    pub kind: Da3Kind,
    /// The backbone.
    pub net: NetConfig,
    /// The head.
    pub head: HeadConfig,
}

impl Config {
    /// Parses and checks `config.json` ([`Da3Config::from_json`]).
    pub fn from_json(config: &serde_json::Value) -> Result<Self> {
        let (arch, net, head) = Da3Config::from_json(config)?;
        let kind = match arch.as_str() {
            ARCH_ANY_VIEW => Da3Kind::AnyView,
            ARCH_MONO => Da3Kind::Mono,
            ARCH_METRIC => Da3Kind::Metric,
            o => return Err(Error::Config(format!("`{o}` is not a DA3 architecture"))),
        };
        if net.out_layers.len() != 4 {
            return Err(Error::Config(format!("DA3 needs 4 out_layers, got {:?}", net.out_layers)));
        }
        Ok(Config { kind, net, head })
    }

    /// The architecture name.
    pub fn architecture(&self) -> &'static str {
        match self.kind {
            Da3Kind::AnyView => ARCH_ANY_VIEW,
            Da3Kind::Mono => ARCH_MONO,
            Da3Kind::Metric => ARCH_METRIC,
        }
    }
}

impl NetConfig {
    /// Checks every number against the shared config limits ([`crate::config_check`]).
    pub fn validate(&self) -> Result<()> {
        let s = Section::at("net");
        let d = s.count("embed_dim", self.embed_dim.unwrap_or(1), MAX_WIDTH)?;
        s.count("depth", self.depth.unwrap_or(1), MAX_LAYERS)?;
        if let Some(h) = self.num_heads {
            s.heads("num_heads", h, "embed_dim", d)?;
        }
        if let Some(r) = self.mlp_ratio {
            s.scaled("mlp_ratio", d, r, MAX_MLP_WIDTH)?;
        }
        let p = s.count("patch_size", self.patch_size, MAX_PATCH)?;
        s.range("img_size", self.img_size, p, MAX_IMAGE_SIZE)?;
        s.positive("rope_freq", self.rope_freq as f64, 1e6)?;
        s.each("out_layers", &self.out_layers, 0, MAX_LAYERS - 1)?;
        for (key, v) in [("alt_start", self.alt_start), ("qknorm_start", self.qknorm_start), ("rope_start", self.rope_start)] {
            if !(-1..=MAX_LAYERS as i64).contains(&v) {
                return Err(s.bad(key, format!("= {v} is outside -1..={MAX_LAYERS}")));
            }
        }
        Ok(())
    }

    fn backbone_config(&self) -> Result<Dinov2Config> {
        let (d, depth, heads) = match self.name.as_str() {
            "vits" => (384, 12, 6),
            "vitb" => (768, 12, 12),
            "vitl" => (1024, 24, 16),
            "vitg" => (1536, 40, 24),
            o => return Err(Error::Config(format!("unknown DA3 backbone `{o}` (vits, vitb, vitl, vitg)"))),
        };
        let cfg = Dinov2Config {
            hidden_size: self.embed_dim.unwrap_or(d),
            num_hidden_layers: self.depth.unwrap_or(depth),
            num_attention_heads: self.num_heads.unwrap_or(heads),
            mlp_ratio: self.mlp_ratio.unwrap_or(4.0),
            hidden_act: "gelu".into(),
            layer_norm_eps: 1e-6,
            image_size: self.img_size,
            patch_size: self.patch_size,
            num_channels: 3,
            qkv_bias: true,
            use_swiglu_ffn: self.name == "vitg",
            out_indices: None,
            out_features: None,
            apply_layernorm: true,
        };
        Ok(cfg)
    }

    fn options(&self) -> Result<Dinov2Options> {
        let start = |v: i64, what: &str| -> Result<Option<usize>> {
            match v {
                -1 => Ok(None),
                v if v >= 0 => Ok(Some(v as usize)),
                v => Err(Error::Config(format!("DA3 {what} {v}: expected −1 or a block index"))),
            }
        };
        Ok(Dinov2Options {
            layout: KeyLayout::Original,
            pos_resize: PosEmbedResize::OriginalOffset,
            final_norm_eps: Some(1e-5),
            qk_norm_start: start(self.qknorm_start, "qknorm_start")?,
            rope: start(self.rope_start, "rope_start")?.map(|s| RopeOptions { start: s, base: self.rope_freq }),
            alt_start: start(self.alt_start, "alt_start")?,
            cat_token: self.cat_token,
        })
    }
}

/// An output activation as the package names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Act {
    Exp,
    ExpP1,
    ExpM1,
    Relu,
    Sigmoid,
    Softplus,
    Tanh,
    Linear,
}

impl Act {
    fn parse(s: &str) -> Result<Self> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "exp" => Act::Exp,
            "expp1" => Act::ExpP1,
            "expm1" => Act::ExpM1,
            "relu" => Act::Relu,
            "sigmoid" => Act::Sigmoid,
            "softplus" => Act::Softplus,
            "tanh" => Act::Tanh,
            "linear" => Act::Linear,
            o => return Err(Error::Config(format!("unknown DA3 activation `{o}`"))),
        })
    }

    fn apply(self, x: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Act::Exp => x.exp()?,
            Act::ExpP1 => (x.exp()? + 1.0)?,
            Act::ExpM1 => (x.exp()? - 1.0)?,
            Act::Relu => x.relu()?,
            Act::Sigmoid => candle_nn::ops::sigmoid(x)?,
            // torch softplus (beta 1, threshold 20).
            Act::Softplus => {
                let soft = (x.clamp(f32::MIN, 20f32)?.exp()? + 1.0)?.log()?;
                x.gt(20.0)?.where_cond(x, &soft)?
            }
            Act::Tanh => x.tanh()?,
            Act::Linear => x.clone(),
        })
    }
}

/// A 3×3 conv → ReLU → 1×1 conv output branch (`output_conv2`, `sky_output_conv2`: indices 0 and 2).
struct OutBranch {
    conv: Conv2d,
    proj: Conv2d,
}

impl OutBranch {
    fn load(vb: &Vb, c_in: usize, hidden: usize, c_out: usize) -> Result<Self> {
        Ok(OutBranch { conv: conv2d(&vb.pp(0), c_in, hidden, 3, same3x3(), true)?, proj: conv2d(&vb.pp(2), hidden, c_out, 1, Default::default(), true)? })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.proj.forward(&self.conv.forward_relu(x)?)?)
    }
}

/// The depth part of the DualDPT / DPT heads (the DualDPT ray branch is not loaded).
struct Head {
    norm: Option<LayerNorm>,
    levels: Vec<ReassembleLayer>,
    layer_rn: Vec<Conv2d>,
    fusion: FusionStage,
    conv1: Conv2d,
    main: OutBranch,
    sky: Option<OutBranch>,
    pos_embed: bool,
    output_dim: usize,
    act: Act,
    conf_act: Act,
    sky_act: Act,
    patch: usize,
    down_ratio: usize,
}

const REASSEMBLE_FACTORS: [f64; 4] = [4.0, 2.0, 1.0, 0.5];
const HEAD_HIDDEN: usize = 32;

impl HeadConfig {
    /// Checks every number against the shared config limits ([`crate::config_check`]).
    pub fn validate(&self) -> Result<()> {
        let s = Section::at("head");
        s.count("dim_in", self.dim_in, 2 * MAX_WIDTH)?;
        s.range("output_dim", self.output_dim, 1, 2)?;
        s.range("features", self.features, 2, MAX_WIDTH)?;
        s.each("out_channels", &self.out_channels, 1, MAX_WIDTH)?;
        let p = s.count("patch_size", self.patch_size, MAX_PATCH)?;
        s.range("down_ratio", self.down_ratio, 1, p)?;
        Ok(())
    }
}

impl Head {
    fn load(vb: &Vb, cfg: &HeadConfig) -> Result<Self> {
        let dual = match cfg.class.as_str() {
            "DualDPT" => true,
            "DPT" => false,
            o => return Err(Error::Config(format!("unknown DA3 head `{o}` (DualDPT, DPT)"))),
        };
        if cfg.out_channels.len() != 4 {
            return Err(Error::Config(format!("DA3 head needs 4 out_channels, got {}", cfg.out_channels.len())));
        }
        if !(1..=2).contains(&cfg.output_dim) || cfg.features < 2 || cfg.down_ratio == 0 || cfg.patch_size == 0 {
            return Err(Error::Config(format!("unsupported DA3 head: output_dim {}, features {}, down_ratio {}", cfg.output_dim, cfg.features, cfg.down_ratio)));
        }
        if cfg.use_ln_for_heads {
            return Err(Error::Config("DA3 DPT head with use_ln_for_heads is not supported".into()));
        }
        let pos_embed = cfg.pos_embed.unwrap_or(dual);
        let with_norm = dual || cfg.norm_type.as_deref() == Some("layer");
        if let Some(t) = cfg.norm_type.as_deref().filter(|t| !matches!(*t, "idt" | "layer")) {
            return Err(Error::Config(format!("unknown DA3 head norm_type `{t}`")));
        }
        if pos_embed && (cfg.out_channels.iter().any(|c| c % 4 != 0) || !(cfg.features / 2).is_multiple_of(4)) {
            return Err(Error::Config("the UV position embedding needs channel counts divisible by 4".into()));
        }
        let f = cfg.features;
        let scratch = vb.pp("scratch");
        let levels = (0..4)
            .map(|i| ReassembleLayer::load_parts(&vb.pp("projects").pp(i), &vb.pp("resize_layers").pp(i), cfg.dim_in, cfg.out_channels[i], REASSEMBLE_FACTORS[i]))
            .collect::<Result<_>>()?;
        let layer_rn = (0..4)
            .map(|i| conv2d(&scratch.pp(format!("layer{}_rn", i + 1)), cfg.out_channels[i], f, 3, same3x3(), false))
            .collect::<Result<_>>()?;
        let use_sky = !dual && cfg.use_sky_head.unwrap_or(true);
        Ok(Head {
            norm: if with_norm { Some(layer_norm(&vb.pp("norm"), cfg.dim_in, 1e-5)?) } else { None },
            levels,
            layer_rn,
            fusion: FusionStage::load_original(&scratch, f, 4, "")?,
            conv1: conv2d(&scratch.pp("output_conv1"), f, f / 2, 3, same3x3(), true)?,
            main: OutBranch::load(&scratch.pp("output_conv2"), f / 2, HEAD_HIDDEN, cfg.output_dim)?,
            sky: if use_sky { Some(OutBranch::load(&scratch.pp("sky_output_conv2"), f / 2, HEAD_HIDDEN, 1)?) } else { None },
            pos_embed,
            output_dim: cfg.output_dim,
            act: Act::parse(&cfg.activation)?,
            conf_act: Act::parse(&cfg.conf_activation)?,
            sky_act: Act::parse(&cfg.sky_activation)?,
            patch: cfg.patch_size,
            down_ratio: cfg.down_ratio,
        })
    }

    /// Token maps `[N, 1 + ph·pw, C]` (prefix dropped here) → (depth, confidence, sky), each `[N, H, W]`.
    fn forward(&self, feats: &[Tensor], ph: usize, pw: usize) -> Result<(Tensor, Option<Tensor>, Option<Tensor>)> {
        let (img_h, img_w) = (ph * self.patch, pw * self.patch);
        let aspect = img_w as f64 / img_h as f64;
        let mut rn = Vec::with_capacity(4);
        for ((t, level), conv) in feats.iter().zip(&self.levels).zip(&self.layer_rn) {
            let t = match &self.norm {
                Some(n) => n.forward(t)?,
                None => t.clone(),
            };
            let mut x = level.project(&tokens_to_grid(&t, 1, ph, pw)?)?;
            if self.pos_embed {
                x = add_uv_embedding(&x, aspect)?;
            }
            rn.push(conv.forward(&level.resample(&x)?)?);
        }
        let fused = self.fusion.forward(&rn)?;
        let finest = fused.last().ok_or_else(|| Error::Config("DA3 head fused no levels".into()))?;
        let x = self.conv1.forward(finest)?;
        let mut x = bilinear(&x, img_h / self.down_ratio, img_w / self.down_ratio, true)?;
        if self.pos_embed {
            x = add_uv_embedding(&x, aspect)?;
        }
        let logits = self.main.forward(&x)?;
        let (depth, conf) = if self.output_dim > 1 {
            let conf = self.conf_act.apply(&logits.narrow(1, self.output_dim - 1, 1)?)?.squeeze(1)?;
            (self.act.apply(&logits.narrow(1, 0, 1)?)?.squeeze(1)?, Some(conf))
        } else {
            (self.act.apply(&logits)?.squeeze(1)?, None)
        };
        let sky = match &self.sky {
            Some(b) => Some(self.sky_act.apply(&b.forward(&x)?)?.squeeze(1)?),
            None => None,
        };
        Ok((depth, conf, sky))
    }
}

/// torch `linspace` in f32 (first half from the start, second half from the end).
fn linspace_f32(a: f64, b: f64, n: usize) -> Vec<f32> {
    let (start, end) = (a as f32, b as f32);
    if n <= 1 {
        return vec![start; n];
    }
    let step = (end - start) / (n - 1) as f32;
    (0..n).map(|i| if i < n / 2 { start + step * i as f32 } else { end - step * (n - 1 - i) as f32 }).collect()
}

/// `[sin(p·ω_j), cos(p·ω_j)]` for `ω_j = 100^(−j/q)`, `j < q`: `[2q, len]`.
fn sincos(pos: &[f32], q: usize) -> Vec<f32> {
    let omega: Vec<f32> = (0..q).map(|j| 1.0 / 100f32.powf(j as f32 / q as f32)).collect();
    let mut out = vec![0f32; 2 * q * pos.len()];
    for (j, w) in omega.iter().enumerate() {
        for (i, p) in pos.iter().enumerate() {
            let a = p * w;
            out[j * pos.len() + i] = a.sin();
            out[(q + j) * pos.len() + i] = a.cos();
        }
    }
    out
}

/// Adds the DA3 heads' UV position embedding (`_add_pos_embed`, ratio 0.1) to `x` `[N, C, h, w]`:
/// u spans ±(aspect/diag)·(w−1)/w across columns, v ±(1/diag)·(h−1)/h down rows (`diag = √(aspect² + 1)`,
/// aspect = image W/H); channels `[sin u·ω, cos u·ω, sin v·ω, cos v·ω]`, C/4 frequencies each.
fn add_uv_embedding(x: &Tensor, aspect: f64) -> Result<Tensor> {
    let (_, c, h, w) = x.dims4()?;
    let q = c / 4;
    let diag = (aspect * aspect + 1.0).sqrt();
    let (sx, sy) = (aspect / diag, 1.0 / diag);
    let u = linspace_f32(-sx * (w as f64 - 1.0) / w as f64, sx * (w as f64 - 1.0) / w as f64, w);
    let v = linspace_f32(-sy * (h as f64 - 1.0) / h as f64, sy * (h as f64 - 1.0) / h as f64, h);
    let dev = x.device();
    let eu = Tensor::from_vec(sincos(&u, q), (1, 2 * q, 1, w), dev)?.broadcast_as((1, 2 * q, h, w))?;
    let ev = Tensor::from_vec(sincos(&v, q), (1, 2 * q, h, 1), dev)?.broadcast_as((1, 2 * q, h, w))?;
    let pe = (Tensor::cat(&[eu, ev], 1)? * 0.1)?.to_dtype(x.dtype())?;
    Ok(x.broadcast_add(&pe)?)
}

/// Which DA3 family a checkpoint is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Da3Kind {
    /// Any-view model: depth (up to scale) and confidence.
    AnyView,
    /// DA3Mono: relative depth and sky.
    Mono,
    /// DA3Metric: `metric depth = focal_px · depth / 300`, and sky.
    Metric,
}

/// The outputs of one forward pass, each `[B, S, H, W]`.
#[derive(Debug, Clone)]
pub(crate) struct Da3Output {
    /// Depth (`exp` of the head; relative, or metric after focal scaling for DA3Metric).
    pub depth: Tensor,
    /// Confidence `exp(x) + 1` (any-view models).
    pub depth_conf: Option<Tensor>,
    /// Sky score (ReLU; sky where ≥ 0.3) of the mono / metric models.
    pub sky: Option<Tensor>,
}

/// A loaded Depth Anything 3 depth model.
pub(crate) struct Da3 {
    arch: &'static str,
    backbone: Dinov2,
    out_layers: Vec<usize>,
    head: Head,
}

impl Da3 {
    /// Builds the model from `config.json` and the hub layout (`model.backbone.pretrained.*`,
    /// `model.head.*`; the `model.` prefix may be absent).
    pub(crate) fn load(vb: &Vb, config: &Config) -> Result<Self> {
        let (arch, net, head_cfg) = (config.architecture(), &config.net, &config.head);
        let root = if vb.contains("model.backbone.pretrained.cls_token") {
            vb.pp("model")
        } else if vb.contains("backbone.pretrained.cls_token") {
            vb.clone()
        } else {
            return Err(Error::Config("not a DA3 checkpoint: no `model.backbone.pretrained.cls_token`".into()));
        };
        let bcfg = net.backbone_config()?;
        let width = if net.cat_token { 2 * bcfg.hidden_size } else { bcfg.hidden_size };
        if head_cfg.dim_in != width {
            return Err(Error::Config(format!("head dim_in {} does not match the backbone output width {width}", head_cfg.dim_in)));
        }
        if net.patch_size != head_cfg.patch_size {
            return Err(Error::Config("backbone and head patch sizes differ".into()));
        }
        let backbone = Dinov2::load_with(&root.pp("backbone").pp("pretrained"), &bcfg, &net.options()?)?;
        let head = Head::load(&root.pp("head"), head_cfg)?;
        Ok(Da3 { arch, backbone, out_layers: net.out_layers.clone(), head })
    }

    /// `pixel_values` `[B, S, 3, H, W]` (S views of one scene) → outputs `[B, S, H, W]`.
    pub(crate) fn forward(&self, pixel_values: &Tensor) -> Result<Da3Output> {
        let (b, s, _, _, _) = pixel_values.dims5()?;
        let (feats, ph, pw) = self.backbone.forward_views(pixel_values, &self.out_layers)?;
        let (depth, conf, sky) = self.head.forward(&feats, ph, pw)?;
        let views = |t: Tensor| -> Result<Tensor> {
            let (_, h, w) = t.dims3()?;
            Ok(t.reshape((b, s, h, w))?)
        };
        Ok(Da3Output { depth: views(depth)?, depth_conf: conf.map(views).transpose()?, sky: sky.map(views).transpose()? })
    }
}

impl Model for Da3 {
    fn architecture(&self) -> &str {
        self.arch
    }

    fn input_names(&self) -> Vec<&'static str> {
        vec!["pixel_values"]
    }

    /// `pixel_values` `[B, S, 3, H, W]` → `depth`, `depth_conf` / `sky` `[B, S, H, W]`; a 4-D
    /// `[B, 3, H, W]` input is one view per sample and gives `[B, H, W]` outputs.
    fn forward_named(&self, inputs: &NamedTensors) -> Result<NamedTensors> {
        let x = super::required(inputs, "pixel_values")?;
        let single = match x.rank() {
            4 => true,
            5 => false,
            _ => return Err(Error::Input(format!("pixel_values {:?}: expected [B, S, 3, H, W] or [B, 3, H, W]", x.dims()))),
        };
        let out = self.forward(&if single { x.unsqueeze(1)? } else { x.clone() })?;
        let fix = |t: Tensor| -> Result<Tensor> { Ok(if single { t.squeeze(1)? } else { t }) };
        let mut named = NamedTensors::new();
        named.insert("depth".into(), fix(out.depth)?);
        if let Some(c) = out.depth_conf {
            named.insert("depth_conf".into(), fix(c)?);
        }
        if let Some(s) = out.sky {
            named.insert("sky".into(), fix(s)?);
        }
        Ok(named)
    }
}

/// Sky threshold of the package (`compute_sky_mask`: non-sky where sky < 0.3).
pub const SKY_THRESHOLD: f32 = 0.3;

/// torch `quantile(values, q)` with linear interpolation, computed in f32 like torch; None when empty.
pub(crate) fn quantile_linear(values: &mut [f32], q: f32) -> Option<f32> {
    if values.is_empty() {
        return None;
    }
    values.sort_unstable_by(|a, b| a.total_cmp(b));
    let rank = q * (values.len() - 1) as f32;
    let (lo, hi) = (rank.floor() as usize, (rank.ceil() as usize).min(values.len() - 1));
    let (a, b, wt) = (values[lo], values[hi], rank - rank.floor());
    // torch.lerp
    Some(if wt < 0.5 { a + wt * (b - a) } else { b - (b - a) * (1.0 - wt) })
}

/// The package's `_process_mono_sky_estimation` for one image, made deterministic: when more than 10
/// pixels are sky (`sky ≥ 0.3`) and more than 10 are not, sky pixels get the 0.99 quantile of the
/// non-sky depths. The package takes that quantile over the whole batch at once and, above 100 000
/// non-sky pixels, over 100 000 pixels drawn at random; here it is exact and per image (the same
/// for one image with at most 100 000 non-sky pixels). Returns the value written, if any.
pub fn replace_sky_depth(depth: &mut [f32], sky: &[f32]) -> Option<f32> {
    let mut non_sky: Vec<f32> = depth.iter().zip(sky).filter(|(_, s)| **s < SKY_THRESHOLD).map(|(d, _)| *d).collect();
    let n_sky = depth.len().min(sky.len()) - non_sky.len();
    if non_sky.len() <= 10 || n_sky <= 10 {
        return None;
    }
    let q = quantile_linear(&mut non_sky, 0.99)?;
    for (d, s) in depth.iter_mut().zip(sky) {
        if *s >= SKY_THRESHOLD {
            *d = q;
        }
    }
    Some(q)
}

/// DA3Metric's conversion (`metric = focal · output / 300`) in place, `focal_px` in pixels of the
/// network input.
pub(crate) fn scale_to_metric(depth: &mut [f32], focal_px: f32) {
    let s = focal_px / 300.0;
    depth.iter_mut().for_each(|d| *d *= s);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_names_map_to_architectures_and_presets() {
        assert_eq!(architecture_for_model_name("da3-small"), Some(ARCH_ANY_VIEW));
        assert_eq!(architecture_for_model_name("da3-large-1.1"), Some(ARCH_ANY_VIEW));
        assert_eq!(architecture_for_model_name("da3mono-large"), Some(ARCH_MONO));
        assert_eq!(architecture_for_model_name("da3metric-large"), Some(ARCH_METRIC));
        assert_eq!(architecture_for_model_name("depth-anything"), None);
        let (arch, net, head) = Da3Config::from_json(&serde_json::json!({"model_name": "da3-small"})).unwrap();
        assert_eq!((arch.as_str(), net.name.as_str(), head.dim_in, head.features), ("da3", "vits", 768, 64));
        assert!(Da3Config::from_json(&serde_json::json!({"model_name": "da3nested-giant-large"})).is_err());
    }

    #[test]
    fn quantile_and_sky_replacement() {
        let mut v = vec![3.0, 1.0, 2.0, 4.0];
        assert_eq!(quantile_linear(&mut v, 0.5), Some(2.5));
        let mut depth: Vec<f32> = (0..40).map(|i| i as f32).collect();
        let sky: Vec<f32> = (0..40).map(|i| if i >= 20 { 1.0 } else { 0.0 }).collect();
        let q = replace_sky_depth(&mut depth, &sky).unwrap();
        assert!((q - 18.81).abs() < 1e-4);
        assert!(depth[20..].iter().all(|d| *d == q) && depth[5] == 5.0);
        let mut few = vec![1.0f32; 15];
        assert!(replace_sky_depth(&mut few, &[0.0; 15]).is_none());
    }
}
