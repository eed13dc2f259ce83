//! SAM 3's config as transformers 5.24 writes it (`Sam3Config`, or a `sam3_video` config whose
//! `detector_config` is one), parsed once and checked against the shared limits.
use serde::Deserialize;
use serde_json::Value;

use crate::config_check::{Section, MAX_IMAGE_SIZE, MAX_INPUT_CHANNELS, MAX_LAYERS, MAX_MLP_WIDTH, MAX_PATCH, MAX_WIDTH};
use crate::error::{Error, Result};

/// The most text positions a config may ask for (CLIP's context is 77; SAM 3 uses 32).
pub const MAX_TEXT_CONTEXT: usize = 1024;
/// The largest vocabulary a config may name.
pub const MAX_VOCAB: usize = 1 << 20;
/// The most object queries a config may name (SAM 3 has 200).
pub const MAX_QUERIES: usize = 4096;
/// The FPN scale factors of the published checkpoint, the only ones edgerun builds.
pub const SCALE_FACTORS: [f64; 4] = [4.0, 2.0, 1.0, 0.5];

/// The Perception Encoder ViT (`vision_config.backbone_config`).
#[derive(Debug, Clone, Deserialize)]
pub struct VitConfig {
    /// Token width.
    #[serde(default = "d1024")]
    pub hidden_size: usize,
    /// MLP width.
    #[serde(default = "d4736")]
    pub intermediate_size: usize,
    /// Blocks.
    #[serde(default = "d32")]
    pub num_hidden_layers: usize,
    /// Attention heads.
    #[serde(default = "d16")]
    pub num_attention_heads: usize,
    /// Input channels.
    #[serde(default = "d3")]
    pub num_channels: usize,
    /// The input side (the rotary positions of the global blocks are laid out for it).
    #[serde(default = "d1008")]
    pub image_size: usize,
    /// Patch side.
    #[serde(default = "d14")]
    pub patch_size: usize,
    /// The side the position embedding was trained at (its grid is tiled over the input's).
    #[serde(default = "d336")]
    pub pretrain_image_size: usize,
    /// MLP activation.
    #[serde(default = "gelu")]
    pub hidden_act: String,
    /// LayerNorm epsilon as transformers reads it (the original uses 1e-5, see [`super::Sam3Path`]).
    #[serde(default = "eps6")]
    pub layer_norm_eps: f64,
    /// Window side of the windowed blocks, in patches.
    #[serde(default = "d24")]
    pub window_size: usize,
    /// The blocks that attend globally.
    #[serde(default = "global_layers")]
    pub global_attn_indexes: Vec<usize>,
    /// LayerScale (absent in SAM 3).
    #[serde(default)]
    pub layer_scale_init_value: Option<f64>,
    /// `{"rope_theta": …, "rope_type": "axial"}`.
    #[serde(default)]
    pub rope_parameters: Option<Value>,
}

/// `vision_config`.
#[derive(Debug, Clone, Deserialize)]
pub struct VisionConfig {
    /// The ViT.
    #[serde(default = "default_vit")]
    pub backbone_config: VitConfig,
    /// Width of the FPN levels.
    #[serde(default = "d256")]
    pub fpn_hidden_size: usize,
    /// Scale of each FPN level against the ViT grid.
    #[serde(default = "scale_factors")]
    pub scale_factors: Vec<f64>,
}

/// The CLIP text encoder (`text_config`, a `clip_text_model`).
#[derive(Debug, Clone, Deserialize)]
pub struct TextConfig {
    /// Vocabulary size.
    #[serde(default = "d49408")]
    pub vocab_size: usize,
    /// Token width.
    #[serde(default = "d1024")]
    pub hidden_size: usize,
    /// MLP width.
    #[serde(default = "d4096")]
    pub intermediate_size: usize,
    /// Blocks.
    #[serde(default = "d24")]
    pub num_hidden_layers: usize,
    /// Attention heads.
    #[serde(default = "d16")]
    pub num_attention_heads: usize,
    /// Text context (tokens per prompt).
    #[serde(default = "d32")]
    pub max_position_embeddings: usize,
    /// MLP activation.
    #[serde(default = "gelu")]
    pub hidden_act: String,
    /// LayerNorm epsilon.
    #[serde(default = "eps5")]
    pub layer_norm_eps: f64,
}

/// One of the prompt-side transformer stacks (geometry encoder, DETR encoder and decoder).
#[derive(Debug, Clone, Deserialize)]
pub struct StackConfig {
    /// Token width.
    #[serde(default = "d256")]
    pub hidden_size: usize,
    /// Layers.
    #[serde(default = "d6")]
    pub num_layers: usize,
    /// Attention heads.
    #[serde(default = "d8")]
    pub num_attention_heads: usize,
    /// MLP width.
    #[serde(default = "d2048")]
    pub intermediate_size: usize,
    /// MLP activation.
    #[serde(default = "relu")]
    pub hidden_act: String,
    /// Object queries (the DETR decoder).
    #[serde(default = "d200")]
    pub num_queries: usize,
}

/// `mask_decoder_config`.
#[derive(Debug, Clone, Deserialize)]
pub struct MaskDecoderConfig {
    /// Width.
    #[serde(default = "d256")]
    pub hidden_size: usize,
    /// Pixel-decoder stages stored (one fewer than the FPN levels are used).
    #[serde(default = "d3")]
    pub num_upsampling_stages: usize,
    /// Attention heads of the prompt cross-attention.
    #[serde(default = "d8")]
    pub num_attention_heads: usize,
}

/// A SAM 3 config (`model_type: "sam3"`, or the `detector_config` of a `sam3_video` config).
#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    /// Image encoder.
    #[serde(default = "default_vision")]
    pub vision_config: VisionConfig,
    /// Text encoder.
    #[serde(default = "default_text")]
    pub text_config: TextConfig,
    /// Geometry (box) prompt encoder.
    #[serde(default = "default_geometry")]
    pub geometry_encoder_config: StackConfig,
    /// DETR encoder.
    #[serde(default = "default_stack")]
    pub detr_encoder_config: StackConfig,
    /// DETR decoder.
    #[serde(default = "default_stack")]
    pub detr_decoder_config: StackConfig,
    /// Mask decoder.
    #[serde(default = "default_mask_decoder")]
    pub mask_decoder_config: MaskDecoderConfig,
}

fn d3() -> usize { 3 }
fn d6() -> usize { 6 }
fn d8() -> usize { 8 }
fn d14() -> usize { 14 }
fn d16() -> usize { 16 }
fn d24() -> usize { 24 }
fn d32() -> usize { 32 }
fn d200() -> usize { 200 }
fn d256() -> usize { 256 }
fn d336() -> usize { 336 }
fn d1008() -> usize { 1008 }
fn d1024() -> usize { 1024 }
fn d2048() -> usize { 2048 }
fn d4096() -> usize { 4096 }
fn d4736() -> usize { 4736 }
fn d49408() -> usize { 49408 }
fn eps5() -> f64 { 1e-5 }
fn eps6() -> f64 { 1e-6 }
fn gelu() -> String { "gelu".into() }
fn relu() -> String { "relu".into() }
fn global_layers() -> Vec<usize> { vec![7, 15, 23, 31] }
fn scale_factors() -> Vec<f64> { SCALE_FACTORS.to_vec() }

fn from_empty<T: serde::de::DeserializeOwned>() -> T {
    serde_json::from_value(Value::Object(Default::default())).unwrap_or_else(|_| unreachable!("every field has a default"))
}
fn default_vit() -> VitConfig { from_empty() }
fn default_vision() -> VisionConfig { from_empty() }
fn default_text() -> TextConfig { from_empty() }
fn default_stack() -> StackConfig { from_empty() }
fn default_mask_decoder() -> MaskDecoderConfig { from_empty() }
fn default_geometry() -> StackConfig {
    StackConfig { num_layers: 3, ..from_empty() }
}

impl VitConfig {
    /// The rotary base (`rope_parameters.rope_theta`, 10000 by default).
    pub fn rope_theta(&self) -> Result<f64> {
        let Some(p) = &self.rope_parameters else { return Ok(10_000.0) };
        if let Some(t) = p.get("rope_type").and_then(|t| t.as_str()) {
            if t != "axial" {
                return Err(Error::Config(format!("`vision_config.backbone_config.rope_parameters.rope_type` = `{t}`: only `axial` is supported")));
            }
        }
        Ok(p.get("rope_theta").and_then(|t| t.as_f64()).unwrap_or(10_000.0))
    }

    /// The patch grid side of an input at [`VitConfig::image_size`].
    pub fn grid(&self) -> usize {
        self.image_size / self.patch_size.max(1)
    }

    /// The window side of block `i` (0 for a global block).
    pub fn window_of(&self, i: usize) -> usize {
        if self.global_attn_indexes.contains(&i) {
            0
        } else {
            self.window_size
        }
    }

    fn validate(&self, s: Section) -> Result<()> {
        let d = s.count("hidden_size", self.hidden_size, MAX_WIDTH)?;
        let heads = s.heads("num_attention_heads", self.num_attention_heads, "hidden_size", d)?;
        if !(d / heads).is_multiple_of(4) {
            return Err(s.bad("num_attention_heads", format!("gives a head width of {}, not a multiple of 4 (axial RoPE)", d / heads)));
        }
        s.count("intermediate_size", self.intermediate_size, MAX_MLP_WIDTH)?;
        let layers = s.count("num_hidden_layers", self.num_hidden_layers, MAX_LAYERS)?;
        s.count("num_channels", self.num_channels, MAX_INPUT_CHANNELS)?;
        let p = s.count("patch_size", self.patch_size, MAX_PATCH)?;
        s.range("image_size", self.image_size, p, MAX_IMAGE_SIZE)?;
        s.range("pretrain_image_size", self.pretrain_image_size, p, MAX_IMAGE_SIZE)?;
        s.range("window_size", self.window_size, 1, self.grid())?;
        s.each("global_attn_indexes", &self.global_attn_indexes, 0, layers - 1)?;
        s.positive("layer_norm_eps", self.layer_norm_eps, 1.0)?;
        if self.layer_scale_init_value.is_some() {
            return Err(s.bad("layer_scale_init_value", "is set: SAM 3's ViT has no LayerScale"));
        }
        let theta = self.rope_theta()?;
        s.positive("rope_parameters.rope_theta", theta, 1e9)?;
        crate::nn::activation::Activation::from_name(&self.hidden_act).map_err(|e| s.bad("hidden_act", e))?;
        Ok(())
    }
}

impl TextConfig {
    fn validate(&self, s: Section) -> Result<()> {
        let d = s.count("hidden_size", self.hidden_size, MAX_WIDTH)?;
        s.heads("num_attention_heads", self.num_attention_heads, "hidden_size", d)?;
        s.count("intermediate_size", self.intermediate_size, MAX_MLP_WIDTH)?;
        s.count("num_hidden_layers", self.num_hidden_layers, MAX_LAYERS)?;
        s.count("vocab_size", self.vocab_size, MAX_VOCAB)?;
        s.range("max_position_embeddings", self.max_position_embeddings, 2, MAX_TEXT_CONTEXT)?;
        s.positive("layer_norm_eps", self.layer_norm_eps, 1.0)?;
        crate::nn::activation::Activation::from_name(&self.hidden_act).map_err(|e| s.bad("hidden_act", e))?;
        Ok(())
    }
}

impl StackConfig {
    fn validate(&self, s: Section, decoder: bool) -> Result<()> {
        let d = s.count("hidden_size", self.hidden_size, MAX_WIDTH)?;
        s.heads("num_attention_heads", self.num_attention_heads, "hidden_size", d)?;
        s.count("num_layers", self.num_layers, MAX_LAYERS)?;
        s.count("intermediate_size", self.intermediate_size, MAX_MLP_WIDTH)?;
        if decoder {
            s.count("num_queries", self.num_queries, MAX_QUERIES)?;
            if !d.is_multiple_of(4) {
                return Err(s.bad("hidden_size", format!("= {d}: the box sine encoding needs a multiple of 4")));
            }
        }
        crate::nn::activation::Activation::from_name(&self.hidden_act).map_err(|e| s.bad("hidden_act", e))?;
        Ok(())
    }
}

impl Config {
    /// Parses a `sam3` config, or the `detector_config` of a `sam3_video` one (the hub checkpoint
    /// `facebook/sam3`), and checks it.
    pub fn from_json(arch: &str, v: &Value) -> Result<Self> {
        let v = if arch == "sam3_video" {
            v.get("detector_config").ok_or_else(|| Error::Config("a `sam3_video` config without `detector_config`".into()))?
        } else {
            v
        };
        let c: Config = serde_json::from_value(v.clone()).map_err(|e| Error::Config(format!("SAM 3 config: {e}")))?;
        c.validate()?;
        Ok(c)
    }

    /// The width every prompt-side part shares (the FPN's, the DETR encoder's and decoder's, the
    /// geometry encoder's and the mask decoder's).
    pub fn width(&self) -> usize {
        self.detr_encoder_config.hidden_size
    }

    /// The ViT.
    pub fn vit(&self) -> &VitConfig {
        &self.vision_config.backbone_config
    }

    fn validate(&self) -> Result<()> {
        self.vit().validate(Section::at("vision_config.backbone_config"))?;
        let s = Section::at("vision_config");
        s.count("fpn_hidden_size", self.vision_config.fpn_hidden_size, MAX_WIDTH)?;
        if self.vision_config.scale_factors != SCALE_FACTORS {
            return Err(s.bad("scale_factors", format!("= {:?}: edgerun builds SAM 3's {SCALE_FACTORS:?}", self.vision_config.scale_factors)));
        }
        if !self.vit().hidden_size.is_multiple_of(4) {
            return Err(Section::at("vision_config.backbone_config").bad("hidden_size", "must be a multiple of 4 (the FPN's 4x level quarters it)"));
        }
        self.text_config.validate(Section::at("text_config"))?;
        self.geometry_encoder_config.validate(Section::at("geometry_encoder_config"), false)?;
        self.detr_encoder_config.validate(Section::at("detr_encoder_config"), false)?;
        self.detr_decoder_config.validate(Section::at("detr_decoder_config"), true)?;
        let m = Section::at("mask_decoder_config");
        let d = self.width();
        m.heads("num_attention_heads", self.mask_decoder_config.num_attention_heads, "hidden_size", self.mask_decoder_config.hidden_size)?;
        m.range("num_upsampling_stages", self.mask_decoder_config.num_upsampling_stages, 2, MAX_LAYERS)?;
        if !d.is_multiple_of(8) {
            return Err(Section::at("detr_encoder_config").bad("hidden_size", format!("= {d}: the pixel decoder's GroupNorm needs a multiple of 8")));
        }
        for (key, w) in [
            ("vision_config.fpn_hidden_size", self.vision_config.fpn_hidden_size),
            ("geometry_encoder_config.hidden_size", self.geometry_encoder_config.hidden_size),
            ("detr_decoder_config.hidden_size", self.detr_decoder_config.hidden_size),
            ("mask_decoder_config.hidden_size", self.mask_decoder_config.hidden_size),
        ] {
            if w != d {
                return Err(Error::Config(format!("`{key}` = {w} differs from `detr_encoder_config.hidden_size` = {d}: SAM 3's parts share one width")));
            }
        }
        Ok(())
    }
}
