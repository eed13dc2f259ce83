//! Depth Anything (V1/V2, relative and metric): transformers `DepthAnythingForDepthEstimation`.
mod family;
pub mod processor;
mod training;

pub use family::DepthAnythingFamily;
pub use processor::DptProcessor;
use candle_core::{Module, Tensor};
use crate::nn::conv::Conv2d;
use serde::Deserialize;

use super::{Model, NamedTensors};
use crate::config_check::{check_reassemble_factor, Section, MAX_DEPTH_VALUE, MAX_LEVELS, MAX_PATCH, MAX_WIDTH};
use crate::error::{Error, Result};
use crate::models::backbones::dinov2::{Dinov2, Dinov2Config, PosEmbedResize};
use crate::models::backbones::dpt::{same3x3, tokens_to_grid, FusionStage, ReassembleLayer};
use crate::nn::layers::conv2d;
use crate::profile::Span;
use crate::weights::Vb;

/// `DepthAnythingConfig` as transformers 5.24 writes it.
#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    /// The DINOv2 backbone's config.
    pub backbone_config: Dinov2Config,
    /// Token width entering the neck.
    #[serde(default = "d384")]
    pub reassemble_hidden_size: usize,
    /// Backbone patch size.
    #[serde(default = "d14")]
    pub patch_size: usize,
    /// Channels per reassembled level.
    #[serde(default = "neck")]
    pub neck_hidden_sizes: Vec<usize>,
    /// Resolution factor per level.
    #[serde(default = "factors")]
    pub reassemble_factors: Vec<f64>,
    /// Fusion width.
    #[serde(default = "d64")]
    pub fusion_hidden_size: usize,
    /// Which fused map the head reads.
    #[serde(default = "minus1")]
    pub head_in_index: i64,
    /// Width of the head's last hidden conv.
    #[serde(default = "d32")]
    pub head_hidden_size: usize,
    /// `relative` (ReLU) or `metric` (sigmoid × max_depth).
    #[serde(default = "relative")]
    pub depth_estimation_type: String,
    /// Output scale.
    #[serde(default)]
    pub max_depth: Option<f64>,
}

fn d384() -> usize { 384 }
fn d14() -> usize { 14 }
fn d64() -> usize { 64 }
fn d32() -> usize { 32 }
fn minus1() -> i64 { -1 }
fn neck() -> Vec<usize> { vec![96, 192, 384, 768] }
fn factors() -> Vec<f64> { vec![4.0, 2.0, 1.0, 0.5] }
fn relative() -> String { "relative".into() }

impl Config {
    /// Parses `config.json` and checks it.
    pub fn from_json(config: &serde_json::Value) -> Result<Self> {
        let cfg: Config = serde_json::from_value(config.clone()).map_err(|e| Error::Config(format!("depth_anything config: {e}")))?;
        cfg.validate()?;
        cfg.kind()?;
        Ok(cfg)
    }

    /// Whether the head gives relative or metric depth (`depth_estimation_type`).
    pub fn kind(&self) -> Result<DepthKind> {
        match self.depth_estimation_type.as_str() {
            "relative" => Ok(DepthKind::Relative),
            "metric" => Ok(DepthKind::Metric),
            o => Err(Error::Config(format!("unknown depth_estimation_type `{o}`"))),
        }
    }

    /// Checks every number against the shared config limits ([`crate::config_check`]).
    pub fn validate(&self) -> Result<()> {
        let s = Section::root();
        self.backbone_config.validate_in(Section::at("backbone_config"))?;
        s.count("patch_size", self.patch_size, MAX_PATCH)?;
        s.count("reassemble_hidden_size", self.reassemble_hidden_size, MAX_WIDTH)?;
        s.range("neck_hidden_sizes.len()", self.neck_hidden_sizes.len(), 1, MAX_LEVELS)?;
        s.each("neck_hidden_sizes", &self.neck_hidden_sizes, 1, MAX_WIDTH)?;
        for (i, &f) in self.reassemble_factors.iter().enumerate() {
            check_reassemble_factor(&s, &format!("reassemble_factors[{i}]"), f)?;
        }
        s.range("fusion_hidden_size", self.fusion_hidden_size, 2, MAX_WIDTH)?;
        s.count("head_hidden_size", self.head_hidden_size, MAX_WIDTH)?;
        if let Some(m) = self.max_depth {
            s.positive("max_depth", m, MAX_DEPTH_VALUE)?;
        }
        Ok(())
    }
}

/// Whether the head ends in ReLU (relative disparity) or sigmoid × max_depth (metres).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DepthKind {
    /// Affine-invariant inverse depth.
    Relative,
    /// Metric depth in metres.
    Metric,
}

/// The depth head: conv → resize to input → conv → ReLU → 1×1 conv → activation × max_depth.
struct Head {
    conv1: Conv2d,
    conv2: Conv2d,
    conv3: Conv2d,
    kind: DepthKind,
    max_depth: f64,
}

/// A loaded Depth Anything model.
pub struct DepthAnything {
    backbone: Dinov2,
    indices: Vec<usize>,
    reassemble: Vec<ReassembleLayer>,
    convs: Vec<Conv2d>,
    fusion: FusionStage,
    head: Head,
    head_in: usize,
    patch: usize,
}

impl DepthAnything {
    /// Builds the model from the hub layout (`backbone.*`, `neck.*`, `head.*`).
    pub fn load(vb: &Vb, cfg: &Config) -> Result<Self> {
        let kind = cfg.kind()?;
        let indices = cfg.backbone_config.feature_indices()?;
        let levels = cfg.neck_hidden_sizes.len().min(cfg.reassemble_factors.len());
        if levels == 0 || indices.len() != cfg.neck_hidden_sizes.len() {
            return Err(Error::Config(format!(
                "{} backbone feature maps for {} neck levels",
                indices.len(),
                cfg.neck_hidden_sizes.len()
            )));
        }
        let backbone = Dinov2::load(&vb.pp("backbone"), &cfg.backbone_config, PosEmbedResize::HfSize)?;
        let neck = vb.pp("neck");
        let reassemble = (0..levels)
            .map(|i| {
                ReassembleLayer::load(
                    &neck.pp("reassemble_stage").pp("layers").pp(i),
                    cfg.reassemble_hidden_size,
                    cfg.neck_hidden_sizes[i],
                    cfg.reassemble_factors[i],
                )
            })
            .collect::<Result<_>>()?;
        let f = cfg.fusion_hidden_size;
        let convs = cfg
            .neck_hidden_sizes
            .iter()
            .enumerate()
            .map(|(i, &c)| conv2d(&neck.pp("convs").pp(i), c, f, 3, same3x3(), false))
            .collect::<Result<_>>()?;
        let fusion = FusionStage::load(&neck.pp("fusion_stage"), f, cfg.neck_hidden_sizes.len())?;
        let h = vb.pp("head");
        let head = Head {
            conv1: conv2d(&h.pp("conv1"), f, f / 2, 3, same3x3(), true)?,
            conv2: conv2d(&h.pp("conv2"), f / 2, cfg.head_hidden_size, 3, same3x3(), true)?,
            conv3: conv2d(&h.pp("conv3"), cfg.head_hidden_size, 1, 1, Default::default(), true)?,
            kind,
            max_depth: cfg.max_depth.unwrap_or(1.0),
        };
        let n = cfg.neck_hidden_sizes.len() as i64;
        let head_in = if cfg.head_in_index < 0 { cfg.head_in_index + n } else { cfg.head_in_index };
        if !(0..n).contains(&head_in) {
            return Err(Error::Config(format!("head_in_index {} out of range", cfg.head_in_index)));
        }
        Ok(DepthAnything { backbone, indices, reassemble, convs, fusion, head, head_in: head_in as usize, patch: cfg.patch_size })
    }

    /// Whether outputs are relative or metric.
    pub fn kind(&self) -> DepthKind {
        self.head.kind
    }

    /// Patch size; input sides are used in multiples of it.
    pub fn patch_size(&self) -> usize {
        self.patch
    }

    /// `pixel_values` `[B, 3, H, W]` → `predicted_depth` `[B, H', W']` (H' = ⌊H/p⌋·p).
    pub fn forward(&self, pixel_values: &Tensor) -> Result<Tensor> {
        let span = Span::new("da2.backbone");
        let features = self.backbone_features(pixel_values)?;
        drop(span);
        self.decode(&features)
    }

    /// The DINOv2 backbone.
    pub fn backbone(&self) -> &Dinov2 {
        &self.backbone
    }

    /// Which hidden states (0 = embeddings, i = after block i) feed the neck.
    pub(crate) fn feature_indices(&self) -> &[usize] {
        &self.indices
    }

    /// The backbone's token maps for the neck (what a frozen backbone hands a trainable head).
    pub(crate) fn backbone_features(&self, pixel_values: &Tensor) -> Result<BackboneFeatures> {
        let (tokens, ph, pw) = self.backbone.forward_features(pixel_values, &self.indices)?;
        Ok(BackboneFeatures { tokens, ph, pw })
    }

    /// Neck and head on backbone features → `predicted_depth` `[B, ph·p, pw·p]`.
    pub fn decode(&self, features: &BackboneFeatures) -> Result<Tensor> {
        let BackboneFeatures { tokens, ph, pw } = features;
        let (ph, pw) = (*ph, *pw);
        let span = Span::new("da2.reassemble");
        let mut feats = Vec::with_capacity(tokens.len());
        for ((t, re), conv) in tokens.iter().zip(&self.reassemble).zip(&self.convs) {
            let grid = tokens_to_grid(t, 1, ph, pw)?;
            feats.push(conv.forward(&re.forward(&grid)?)?);
        }
        drop(span);
        let span = Span::new("da2.fusion");
        let fused = self.fusion.forward(&feats)?;
        drop(span);
        let _span = Span::new("da2.head");
        let x = &fused[self.head_in];
        let x = self.head.conv1.forward(x)?;
        let x = self.head.conv2.forward_upsampled(&x, (ph * self.patch, pw * self.patch), true, true)?;
        let x = self.head.conv3.forward(&x)?;
        let x = match self.head.kind {
            DepthKind::Relative => x.relu()?,
            DepthKind::Metric => candle_nn::ops::sigmoid(&x)?,
        };
        Ok((x * self.head.max_depth)?.squeeze(1)?)
    }
}

/// Backbone token maps `[B, 1 + ph·pw, D]` per neck level, on a `ph`×`pw` patch grid.
#[derive(Clone)]
pub struct BackboneFeatures {
    /// One token map per neck level.
    pub tokens: Vec<Tensor>,
    /// Patch rows.
    pub ph: usize,
    /// Patch columns.
    pub pw: usize,
}

impl BackboneFeatures {
    /// Image `i` of the batch alone.
    pub fn item(&self, i: usize) -> Result<Self> {
        let tokens = self.tokens.iter().map(|t| Ok(t.narrow(0, i, 1)?.contiguous()?)).collect::<Result<_>>()?;
        Ok(BackboneFeatures { tokens, ph: self.ph, pw: self.pw })
    }

    /// Stacks single-image features (same grid) into one batch.
    pub fn stack(items: &[&BackboneFeatures]) -> Result<Self> {
        let first = items.first().ok_or_else(|| Error::Input("no features to stack".into()))?;
        let levels = first.tokens.len();
        let tokens = (0..levels)
            .map(|l| Ok(Tensor::cat(&items.iter().map(|f| f.tokens[l].clone()).collect::<Vec<_>>(), 0)?))
            .collect::<Result<_>>()?;
        Ok(BackboneFeatures { tokens, ph: first.ph, pw: first.pw })
    }

    /// Bytes the token maps hold.
    pub fn bytes(&self) -> usize {
        self.tokens.iter().map(|t| t.elem_count() * t.dtype().size_in_bytes()).sum()
    }
}

impl Model for DepthAnything {
    fn architecture(&self) -> &str {
        "depth_anything"
    }

    fn input_names(&self) -> Vec<&'static str> {
        vec!["pixel_values"]
    }

    fn forward_named(&self, inputs: &NamedTensors) -> Result<NamedTensors> {
        let x = super::required(inputs, "pixel_values")?;
        let mut out = NamedTensors::new();
        out.insert("predicted_depth".into(), self.forward(x)?);
        Ok(out)
    }
}
