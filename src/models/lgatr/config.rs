//! Typed configs mirroring lgatr 2.0.0's constructor keyword arguments (`config.json` minus
//! `model_type`), with lgatr's defaults. Unknown keys are rejected.
use serde::Deserialize;

use crate::config_check::{mul, Section, MAX_HEADS, MAX_LAYERS, MAX_WIDTH};
use crate::error::{Error, Result};

/// Largest multivector (or 4-vector) channel count of an L-GATr layer.
pub(crate) const MAX_MV_CHANNELS: usize = 1024;
/// Largest L-GATr `attn_ratio` / `mlp_ratio`.
pub(crate) const MAX_LGATR_RATIO: usize = 16;
/// Largest L-GATr `num_layers_mlp`.
pub(crate) const MAX_MLP_LAYERS: usize = 16;

fn yes() -> bool {
    true
}
fn default_heads() -> usize {
    8
}
fn one() -> usize {
    1
}
fn two() -> usize {
    2
}
fn four() -> usize {
    4
}
fn gelu() -> String {
    "gelu".into()
}
fn sigmoid() -> Option<String> {
    Some("sigmoid".into())
}
fn default_init() -> String {
    "default".into()
}

/// `lgatr.PrimitivesConfig`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PrimitivesConfig {
    /// SO⁺(1,3) only (10-element linear basis, scalar↔pseudoscalar mixing); `false`: Pin(1,3), 5 maps.
    #[serde(default = "yes")]
    pub subgroup: bool,
    /// `false` zeroes the bivector part of the geometric product in `GeometricBilinear`.
    #[serde(default = "yes")]
    pub bivector: bool,
    /// `false` replaces `GeometricBilinear` by a gated nonlinearity + `EquiLinear`.
    #[serde(default = "yes")]
    pub geometric_product: bool,
    /// Kernel choice in lgatr; no numerical effect here.
    #[serde(default = "yes")]
    pub sparse_gp: bool,
    /// Kernel choice in lgatr; no numerical effect here.
    #[serde(default)]
    pub sparse_linear: bool,
}

impl Default for PrimitivesConfig {
    fn default() -> Self {
        Self { subgroup: true, bivector: true, geometric_product: true, sparse_gp: true, sparse_linear: false }
    }
}

impl PrimitivesConfig {
}

/// `lgatr.SelfAttentionConfig`. The channel fields are overwritten by the enclosing block (as in
/// lgatr) and only accepted for compatibility.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AttentionConfig {
    /// Input multivector channels.
    #[serde(default)]
    pub in_mv_channels: Option<usize>,
    /// Output multivector channels.
    #[serde(default)]
    pub out_mv_channels: Option<usize>,
    /// Input scalar channels.
    #[serde(default)]
    pub in_s_channels: usize,
    /// Output scalar channels.
    #[serde(default)]
    pub out_s_channels: usize,
    /// Extra multivector channels of queries and keys.
    #[serde(default)]
    pub additional_qk_mv_channels: usize,
    /// Extra scalar channels of queries and keys.
    #[serde(default)]
    pub additional_qk_s_channels: usize,
    /// Initialisation of the output projection (training only).
    #[serde(default = "default_init")]
    pub output_init: String,
    /// Dropout probability (inference: none).
    #[serde(default)]
    pub dropout_prob: Option<f64>,
    /// Attention heads.
    #[serde(default = "default_heads")]
    pub num_heads: usize,
    /// One key/value head shared by all query heads.
    #[serde(default)]
    pub multi_query: bool,
    /// Attention channels relative to the hidden channels.
    #[serde(default = "one")]
    pub attn_ratio: usize,
    /// A learned scale per attention head.
    #[serde(default)]
    pub head_scale: bool,
}

/// `lgatr.MLPConfig`. `mv_channels`, `s_channels` and `dropout_prob` are overwritten by the block.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct MlpConfig {
    /// Multivector channels (set by the block).
    #[serde(default)]
    pub mv_channels: Option<usize>,
    /// Scalar channels (set by the block).
    #[serde(default)]
    pub s_channels: usize,
    /// Dropout probability (inference: none).
    #[serde(default)]
    pub dropout_prob: Option<f64>,
    /// The MLP's scalar nonlinearity (`gelu`, `relu`, `sigmoid`).
    #[serde(default = "gelu")]
    pub nonlinearity: String,
    /// MLP hidden channels relative to the hidden channels.
    #[serde(default = "four")]
    pub mlp_ratio: usize,
    /// Linear layers per MLP.
    #[serde(default = "two")]
    pub num_layers_mlp: usize,
}

/// `lgatr.LGATr(...)` keyword arguments.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LgatrConfig {
    /// Transformer blocks.
    pub num_blocks: usize,
    /// Input multivector channels.
    pub in_mv_channels: usize,
    /// Output multivector channels.
    pub out_mv_channels: usize,
    /// Multivector channels inside the blocks.
    pub hidden_mv_channels: usize,
    /// Input scalar channels.
    pub in_s_channels: usize,
    /// Output scalar channels.
    pub out_s_channels: usize,
    /// Scalar channels inside the blocks.
    pub hidden_s_channels: usize,
    /// The attention layers' settings (lgatr `SelfAttentionConfig`).
    pub attention: AttentionConfig,
    /// The MLPs' settings (lgatr `MLPConfig`).
    pub mlp: MlpConfig,
    /// The geometric-algebra primitives' settings.
    #[serde(default)]
    pub primitives: Option<PrimitivesConfig>,
    /// Input multivector channels added back into every block.
    #[serde(default)]
    pub reinsert_mv_channels: Option<Vec<usize>>,
    /// Input scalar channels added back into every block.
    #[serde(default)]
    pub reinsert_s_channels: Option<Vec<usize>>,
    /// Only shifts the MLP layer indices at inference (dropout layers are identities in eval mode).
    #[serde(default)]
    pub dropout_prob: Option<f64>,
    /// Whether the norms have learned scales.
    #[serde(default = "yes")]
    pub norm_elementwise_affine: bool,
    /// Activation checkpointing in lgatr (training only).
    #[serde(default)]
    pub checkpoint_blocks: bool,
    /// Mixed precision in lgatr (no effect here).
    #[serde(default)]
    pub naive_amp: bool,
    /// `torch.compile` in lgatr (no effect here).
    #[serde(default)]
    pub compile: bool,
    /// `torch.compile` arguments in lgatr (no effect here).
    #[serde(default)]
    pub compile_kwargs: Option<serde_json::Value>,
    /// lgatr's activation memory budget (no effect here).
    #[serde(default)]
    pub activation_memory_budget: Option<f64>,
    /// Not a `config.json` key: set by the loader to hold the folded equivariant maps in f16 (an
    /// f16 file) or rounded to Q8_0 for the int8 GEMM (a Q8_0 file on a CPU that has an int8 kernel).
    #[serde(skip)]
    pub hold_maps: super::equi_linear::MapStorage,
}

/// `lgatr.LGATrSlim(...)` keyword arguments.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SlimConfig {
    /// Transformer blocks.
    pub num_blocks: usize,
    /// Input 4-vector channels.
    pub in_v_channels: usize,
    /// Output 4-vector channels.
    pub out_v_channels: usize,
    /// 4-vector channels inside the blocks.
    pub hidden_v_channels: usize,
    /// Input scalar channels.
    pub in_s_channels: usize,
    /// Output scalar channels.
    pub out_s_channels: usize,
    /// Scalar channels inside the blocks.
    pub hidden_s_channels: usize,
    /// Attention heads.
    pub num_heads: usize,
    /// The MLP's scalar nonlinearity (`gelu`, `relu`, `sigmoid`).
    #[serde(default = "gelu")]
    pub nonlinearity: String,
    /// `null` means "same as `nonlinearity`".
    #[serde(default = "sigmoid")]
    pub nonlinearity_v: Option<String>,
    /// MLP hidden channels relative to the hidden channels.
    #[serde(default = "two")]
    pub mlp_ratio: usize,
    /// Attention channels relative to the hidden channels.
    #[serde(default = "one")]
    pub attn_ratio: usize,
    /// Linear layers per MLP.
    #[serde(default = "two")]
    pub num_layers_mlp: usize,
    /// Dropout probability (inference: none).
    #[serde(default)]
    pub dropout_prob: Option<f64>,
    /// Whether the norms have learned scales.
    #[serde(default = "yes")]
    pub norm_elementwise_affine: bool,
    /// Activation checkpointing in lgatr (training only).
    #[serde(default)]
    pub checkpoint_blocks: bool,
    /// Mixed precision in lgatr (no effect here).
    #[serde(default)]
    pub naive_amp: bool,
    /// `torch.compile` in lgatr (no effect here).
    #[serde(default)]
    pub compile: bool,
    /// `torch.compile` arguments in lgatr (no effect here).
    #[serde(default)]
    pub compile_kwargs: Option<serde_json::Value>,
    /// lgatr's activation memory budget (no effect here).
    #[serde(default)]
    pub activation_memory_budget: Option<f64>,
}

/// Pointwise nonlinearities of lgatr's `get_nonlinearity`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Nonlinearity {
    /// `F.gelu(approximate="tanh")`.
    Gelu,
    /// `F.relu`.
    Relu,
    /// `F.sigmoid`.
    Sigmoid,
    /// `F.tanh`.
    Tanh,
    /// `F.silu`.
    Silu,
}

impl Nonlinearity {
    /// Parses lgatr's label.
    pub fn parse(label: &str) -> Result<Self> {
        Ok(match label {
            "gelu" => Self::Gelu,
            "relu" => Self::Relu,
            "sigmoid" => Self::Sigmoid,
            "tanh" => Self::Tanh,
            "silu" => Self::Silu,
            other => {
                return Err(Error::Config(format!(
                    "unsupported nonlinearity `{other}` (lgatr knows gelu, relu, sigmoid, tanh, silu)"
                )))
            }
        })
    }

    /// Applies it elementwise.
    pub fn apply(&self, x: &candle_core::Tensor) -> Result<candle_core::Tensor> {
        Ok(match self {
            Self::Gelu => x.gelu()?,
            Self::Relu => x.relu()?,
            Self::Sigmoid => candle_nn::ops::sigmoid(x)?,
            Self::Tanh => x.tanh()?,
            Self::Silu => x.silu()?,
        })
    }
}

fn parse<T: serde::de::DeserializeOwned>(config: &serde_json::Value, what: &str) -> Result<T> {
    let mut v = config.clone();
    if let Some(obj) = v.as_object_mut() {
        obj.remove("model_type");
    } else {
        return Err(Error::Config(format!("{what} config must be a JSON object")));
    }
    serde_json::from_value(v).map_err(|e| Error::Config(format!("{what}: {e}")))
}

impl LgatrConfig {
    /// Parses `config.json` (the `model_type` key is ignored) and validates it.
    pub fn from_json(config: &serde_json::Value) -> Result<Self> {
        let c: Self = parse(config, "lgatr")?;
        c.validate()?;
        Ok(c)
    }

    /// The primitives config (lgatr's default when absent).
    pub fn primitives(&self) -> PrimitivesConfig {
        self.primitives.clone().unwrap_or_default()
    }

    /// Per-head multivector channels of the attention: `max(attn_ratio·C // H, 1)`.
    pub fn head_mv_channels(&self) -> usize {
        (self.attention.attn_ratio.saturating_mul(self.hidden_mv_channels) / self.attention.num_heads.max(1)).max(1)
    }

    /// Per-head scalar channels: `0` without scalars, else `max(attn_ratio·S // H, 4)`.
    pub fn head_s_channels(&self) -> usize {
        if self.hidden_s_channels == 0 {
            0
        } else {
            (self.attention.attn_ratio.saturating_mul(self.hidden_s_channels) / self.attention.num_heads.max(1)).max(4)
        }
    }

    /// Checks what lgatr would reject at construction, plus what this port does not support.
    pub fn validate(&self) -> Result<()> {
        let p = self.primitives();
        let s = Section::root();
        s.range("num_blocks", self.num_blocks, 0, MAX_LAYERS)?;
        s.range("in_mv_channels", self.in_mv_channels, 0, MAX_MV_CHANNELS)?;
        s.range("out_mv_channels", self.out_mv_channels, 0, MAX_MV_CHANNELS)?;
        s.count("hidden_mv_channels", self.hidden_mv_channels, MAX_MV_CHANNELS)?;
        s.range("in_s_channels", self.in_s_channels, 0, MAX_WIDTH)?;
        s.range("out_s_channels", self.out_s_channels, 0, MAX_WIDTH)?;
        s.range("hidden_s_channels", self.hidden_s_channels, 0, MAX_WIDTH)?;
        let a = Section::at("attention");
        a.count("num_heads", self.attention.num_heads, MAX_HEADS)?;
        a.count("attn_ratio", self.attention.attn_ratio, MAX_LGATR_RATIO)?;
        a.range("additional_qk_mv_channels", self.attention.additional_qk_mv_channels, 0, MAX_MV_CHANNELS)?;
        a.range("additional_qk_s_channels", self.attention.additional_qk_s_channels, 0, MAX_WIDTH)?;
        let m = Section::at("mlp");
        m.count("mlp_ratio", self.mlp.mlp_ratio, MAX_LGATR_RATIO)?;
        m.count("num_layers_mlp", self.mlp.num_layers_mlp, MAX_MLP_LAYERS)?;
        // The sizes these imply (all heads' channels, the MLP width), checked before anything is built.
        mul("attention.num_heads × per-head channels", self.attention.num_heads, 16 * self.head_mv_channels() + self.head_s_channels())?;
        mul("mlp.mlp_ratio × hidden_mv_channels", self.mlp.mlp_ratio, self.hidden_mv_channels)?;
        for (key, v) in [("reinsert_mv_channels", &self.reinsert_mv_channels), ("reinsert_s_channels", &self.reinsert_s_channels)] {
            if let Some(v) = v {
                s.range(&format!("{key}.len()"), v.len(), 0, MAX_WIDTH)?;
            }
        }
        Nonlinearity::parse(&self.mlp.nonlinearity)?;
        if p.geometric_product && self.hidden_s_channels == 0 {
            return Err(Error::Config(
                "GeometricBilinear needs scalar channels (lgatr: almost_unit_scalar init requires in_s_channels > 0); \
                 use hidden_s_channels > 0 or primitives.geometric_product = false"
                    .into(),
            ));
        }
        if let Some(ch) = &self.reinsert_mv_channels {
            if let Some(bad) = ch.iter().find(|&&c| c >= self.in_mv_channels) {
                return Err(Error::Config(format!(
                    "reinsert_mv_channels: channel {bad} out of range for in_mv_channels = {}",
                    self.in_mv_channels
                )));
            }
        }
        if let Some(ch) = &self.reinsert_s_channels {
            if let Some(bad) = ch.iter().find(|&&c| c >= self.in_s_channels) {
                return Err(Error::Config(format!(
                    "reinsert_s_channels: channel {bad} out of range for in_s_channels = {}",
                    self.in_s_channels
                )));
            }
            if self.hidden_s_channels == 0 && !ch.is_empty() {
                return Err(Error::Config("reinsert_s_channels needs hidden_s_channels > 0".into()));
            }
        }
        if !matches!(self.attention.output_init.as_str(), "default" | "small" | "unit_scalar" | "almost_unit_scalar") {
            return Err(Error::Config(format!("attention.output_init `{}` unknown", self.attention.output_init)));
        }
        Ok(())
    }
}

impl SlimConfig {
    /// Parses `config.json` (the `model_type` key is ignored) and validates it.
    pub fn from_json(config: &serde_json::Value) -> Result<Self> {
        let c: Self = parse(config, "lgatr_slim")?;
        c.validate()?;
        Ok(c)
    }

    /// Per-head vector channels: `max(attn_ratio·C // H, 1)`.
    pub(crate) fn head_v_channels(&self) -> usize {
        (self.attn_ratio.saturating_mul(self.hidden_v_channels) / self.num_heads.max(1)).max(1)
    }

    /// Per-head scalar channels: `max(attn_ratio·S // H, 4)`.
    pub fn head_s_channels(&self) -> usize {
        (self.attn_ratio.saturating_mul(self.hidden_s_channels) / self.num_heads.max(1)).max(4)
    }

    /// The scalar and vector nonlinearities.
    pub fn nonlinearities(&self) -> Result<(Nonlinearity, Nonlinearity)> {
        let s = Nonlinearity::parse(&self.nonlinearity)?;
        let v = match &self.nonlinearity_v {
            Some(l) => Nonlinearity::parse(l)?,
            None => s,
        };
        Ok((s, v))
    }

    /// Checks what lgatr would reject at construction.
    pub fn validate(&self) -> Result<()> {
        let s = Section::root();
        s.range("num_blocks", self.num_blocks, 0, MAX_LAYERS)?;
        s.range("in_v_channels", self.in_v_channels, 0, MAX_MV_CHANNELS)?;
        s.range("out_v_channels", self.out_v_channels, 0, MAX_MV_CHANNELS)?;
        s.range("hidden_v_channels", self.hidden_v_channels, 0, MAX_MV_CHANNELS)?;
        s.range("in_s_channels", self.in_s_channels, 0, MAX_WIDTH)?;
        s.range("out_s_channels", self.out_s_channels, 0, MAX_WIDTH)?;
        s.range("hidden_s_channels", self.hidden_s_channels, 0, MAX_WIDTH)?;
        s.count("num_heads", self.num_heads, MAX_HEADS)?;
        s.count("attn_ratio", self.attn_ratio, MAX_LGATR_RATIO)?;
        s.count("mlp_ratio", self.mlp_ratio, MAX_LGATR_RATIO)?;
        if self.num_layers_mlp < 2 {
            return Err(Error::Config(format!("SlimMLP needs num_layers_mlp >= 2, got {}", self.num_layers_mlp)));
        }
        s.range("num_layers_mlp", self.num_layers_mlp, 2, MAX_MLP_LAYERS)?;
        mul("num_heads × per-head channels", self.num_heads, 4 * self.head_v_channels() + self.head_s_channels())?;
        if self.in_s_channels == 0 {
            return Err(Error::Config("LGATrSlim requires scalar inputs (in_s_channels > 0)".into()));
        }
        if self.hidden_v_channels + self.hidden_s_channels == 0 {
            return Err(Error::Config("hidden_v_channels + hidden_s_channels must be positive".into()));
        }
        self.nonlinearities()?;
        Ok(())
    }
}
