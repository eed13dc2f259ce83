//! CHMv2 canopy height (transformers `CHMv2ForDepthEstimation`): a DINOv3 ViT backbone and a DPT
//! head whose bin logits become heights in metres.
//!
//! Head: per level, readout (`project`: tokens ‖ cls → Linear → GELU; `add`; `ignore`), the DPT
//! reassemble layer, a 3×3 conv to the fusion width; fusion from the coarsest level, every layer
//! upsampling ×2 (the first has no residual unit for a skip input); `conv_depth` (3×3 → ×2 bilinear →
//! 3×3 → ReLU → 1×1 to the bins); then [`FeaturesToDepth`] (`chmv2_mixlog` for the hub checkpoint).
mod family;
pub mod processor;
mod training;

pub use family::Chmv2Family;
pub use processor::Chmv2Processor;

use candle_core::{DType, Module, Tensor, D};
use crate::nn::conv::Conv2d;
use crate::kernels::cpu_slice::transpose_last_two;
use crate::profile::Span;
use serde::Deserialize;

use crate::kernels::mixlog::{mixlog_heights, mixlog_heights_from_hidden, MixLog};
use super::{Model, NamedTensors};
use crate::config_check::{check_reassemble_factor, Section, MAX_CLASSES, MAX_DEPTH_VALUE, MAX_LEVELS, MAX_PATCH, MAX_WIDTH};
use crate::error::{Error, Result};
use crate::models::backbones::dinov3::{Dinov3, Dinov3Config, Dinov3Features};
use crate::models::backbones::dpt::{same3x3, FusionResize, FusionStage, ReassembleLayer};
use crate::nn::layers::conv2d;
use crate::nn::linear::Linear;
use crate::weights::Vb;

/// `CHMv2Config` as transformers 5.24 writes it.
#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    /// The DINOv3 backbone's config.
    pub backbone_config: Dinov3Config,
    /// Patch size used to size the head's grids.
    #[serde(default = "p16")]
    pub patch_size: usize,
    /// Resolution factor per level.
    #[serde(default)]
    pub reassemble_factors: Option<Vec<f64>>,
    /// Channels per reassembled level.
    #[serde(default)]
    pub post_process_channels: Option<Vec<usize>>,
    /// Fusion width.
    #[serde(default = "d256")]
    pub fusion_hidden_size: usize,
    /// Width of the head's hidden conv.
    #[serde(default = "d128")]
    pub head_hidden_size: usize,
    /// Number of depth bins.
    #[serde(default = "d256")]
    pub number_output_channels: usize,
    /// `project`, `add` or `ignore`.
    #[serde(default = "project")]
    pub readout_type: String,
    /// Smallest bin value.
    #[serde(default = "min_depth")]
    pub min_depth: f64,
    /// Largest bin value (metres).
    #[serde(default = "max_depth")]
    pub max_depth: f64,
    /// `linear`, `log` or `chmv2_mixlog`.
    #[serde(default = "mixlog")]
    pub bins_strategy: String,
    /// `linear`, `softmax`, `sigmoid` or `chmv2_mixlog`.
    #[serde(default = "mixlog")]
    pub norm_strategy: String,
}

fn p16() -> usize { 16 }
fn d256() -> usize { 256 }
fn d128() -> usize { 128 }
fn project() -> String { "project".into() }
fn min_depth() -> f64 { 0.001 }
fn max_depth() -> f64 { 96.0 }
fn mixlog() -> String { "chmv2_mixlog".into() }

impl Config {
    /// Parses `config.json` and checks it.
    pub fn from_json(config: &serde_json::Value) -> Result<Self> {
        let cfg: Config = serde_json::from_value(config.clone()).map_err(|e| Error::Config(format!("chmv2 config: {e}")))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks every number against the shared config limits ([`crate::config_check`]).
    pub fn validate(&self) -> Result<()> {
        let s = Section::root();
        self.backbone_config.validate_in(Section::at("backbone_config"))?;
        s.count("patch_size", self.patch_size, MAX_PATCH)?;
        if let Some(f) = &self.reassemble_factors {
            s.range("reassemble_factors.len()", f.len(), 1, MAX_LEVELS)?;
            for (i, &v) in f.iter().enumerate() {
                check_reassemble_factor(&s, &format!("reassemble_factors[{i}]"), v)?;
            }
        }
        if let Some(c) = &self.post_process_channels {
            s.range("post_process_channels.len()", c.len(), 1, MAX_LEVELS)?;
            s.each("post_process_channels", c, 1, MAX_WIDTH)?;
        }
        s.range("fusion_hidden_size", self.fusion_hidden_size, 2, MAX_WIDTH)?;
        s.count("head_hidden_size", self.head_hidden_size, MAX_WIDTH)?;
        s.count("number_output_channels", self.number_output_channels, MAX_CLASSES)?;
        s.real("min_depth", self.min_depth, -MAX_DEPTH_VALUE, MAX_DEPTH_VALUE)?;
        s.real("max_depth", self.max_depth, -MAX_DEPTH_VALUE, MAX_DEPTH_VALUE)?;
        Ok(())
    }
}

/// How the class token enters each level's patch tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Readout {
    /// `GELU(Linear([tokens ‖ cls]))`.
    Project,
    /// `tokens + cls`.
    Add,
    /// Class token unused.
    Ignore,
}

/// The bin centres' spacing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BinsStrategy {
    /// `linspace(min, max, n)`.
    Linear,
    /// `exp(linspace(ln min, ln max, n))`.
    Log,
    /// CHMv2: linear and log bins (to `max/8`) blended from log at the first bin to linear at the last.
    MixLog,
}

/// How bin logits become bin weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NormStrategy {
    /// `(relu(x) + 0.1) / Σ`.
    Linear,
    /// Softmax over the bins.
    Softmax,
    /// `sigmoid(x) / Σ`.
    Sigmoid,
    /// CHMv2: `(relu(x) + shift) / Σ`, weighted bins, × 8.
    MixLog,
}

/// `torch.linspace(start, end, n)` in float32 (start + i·step below the halfway point, end − … above).
fn linspace(start: f32, end: f32, n: usize) -> Vec<f32> {
    if n == 1 {
        return vec![start];
    }
    let step = (end - start) / (n - 1) as f32;
    let half = n / 2;
    (0..n).map(|i| if i < half { start + step * i as f32 } else { end - step * (n - i - 1) as f32 }).collect()
}

/// Bin logits `[B, n, H, W]` → heights `[B, H, W]` (transformers `CHMv2FeaturesToDepth`), in f32.
#[derive(Debug, Clone)]
pub struct FeaturesToDepth {
    bins: BinsStrategy,
    norm: NormStrategy,
    min_depth: f64,
    max_depth: f64,
}

const MIXLOG_MAX_CLAMP: f64 = 1e-4;
const MIXLOG_EPS_SHIFT: f64 = 1e-8;
const MIXLOG_EPS: f64 = 1e-12;
/// Those constants for the fused f32 pass.
const MIXLOG: MixLog = MixLog { max_clamp: MIXLOG_MAX_CLAMP as f32, eps_shift: MIXLOG_EPS_SHIFT as f32, eps: MIXLOG_EPS as f32, scale: 8.0 };

impl FeaturesToDepth {
    /// Parses the strategies; unknown names are a config error.
    pub fn new(bins: &str, norm: &str, min_depth: f64, max_depth: f64) -> Result<Self> {
        let bins = match bins {
            "linear" => BinsStrategy::Linear,
            "log" => BinsStrategy::Log,
            "chmv2_mixlog" => BinsStrategy::MixLog,
            o => return Err(Error::Config(format!("unknown bins_strategy `{o}` (linear, log, chmv2_mixlog)"))),
        };
        let norm = match norm {
            "linear" => NormStrategy::Linear,
            "softmax" => NormStrategy::Softmax,
            "sigmoid" => NormStrategy::Sigmoid,
            "chmv2_mixlog" => NormStrategy::MixLog,
            o => return Err(Error::Config(format!("unknown norm_strategy `{o}` (linear, softmax, sigmoid, chmv2_mixlog)"))),
        };
        if !(min_depth.is_finite() && max_depth.is_finite() && min_depth < max_depth) {
            return Err(Error::Config(format!("need finite min_depth < max_depth, got {min_depth}, {max_depth}")));
        }
        if bins != BinsStrategy::Linear && min_depth <= 0.0 {
            return Err(Error::Config(format!("log-spaced bins need min_depth > 0, got {min_depth}")));
        }
        Ok(FeaturesToDepth { bins, norm, min_depth, max_depth })
    }

    /// The `n` bin values (as transformers computes them in float32).
    pub fn bins(&self, n: usize) -> Vec<f32> {
        let (lo, hi) = (self.min_depth as f32, self.max_depth as f32);
        match self.bins {
            BinsStrategy::Linear => linspace(lo, hi, n),
            BinsStrategy::Log => linspace(lo.ln(), hi.ln(), n).into_iter().map(f32::exp).collect(),
            BinsStrategy::MixLog => {
                let m = (self.max_depth / 8.0) as f32;
                let lin = linspace(lo, m, n);
                let log: Vec<f32> = linspace(lo.ln(), m.ln(), n).into_iter().map(f32::exp).collect();
                let t = linspace(1.0, 0.0, n);
                (0..n).map(|i| t[i] * log[i] + (1.0 - t[i]) * lin[i]).collect()
            }
        }
    }

    /// [`FeaturesToDepth::forward`] of `conv(hidden)` for a 1×1 `conv`, without storing the
    /// logits, and per item whether a logit was not finite: `None` unless the normalisation is
    /// `chmv2_mixlog` over several bins and `hidden` is an f32 CPU map (see
    /// [`mixlog_heights_from_hidden`]).
    fn forward_from_hidden(&self, hidden: &Tensor, conv: &Conv2d) -> Result<Option<(Tensor, Vec<bool>)>> {
        let n = conv.weight().dim(0)?;
        if self.norm != NormStrategy::MixLog || n < 2 {
            return Ok(None);
        }
        let plain = conv.config().padding == 0 && conv.config().stride == 1 && conv.config().groups == 1;
        if !plain {
            return Ok(None);
        }
        mixlog_heights_from_hidden(hidden, conv.weight(), conv.bias(), &self.bins(n), &MIXLOG)
    }

    /// Heights `[B, H, W]` (f32) from bin logits `[B, n, H, W]` (any float dtype).
    pub fn forward(&self, logits: &Tensor) -> Result<Tensor> {
        // f32 (f64 stays f64, for gradient checks).
        let dt = if logits.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
        let x = logits.to_dtype(dt)?;
        let (_, n, _, _) = x.dims4()?;
        if n == 1 {
            return Ok((x.relu()? + self.min_depth)?.squeeze(1)?);
        }
        if self.norm == NormStrategy::MixLog && x.track_op() && x.device().is_cpu() && dt == DType::F32 {
            return Ok(x.contiguous()?.apply_op1_arc(std::sync::Arc::new(Box::new(TrainMixLog { bins: self.bins(n) })))?);
        }
        if self.norm == NormStrategy::MixLog {
            if let Some(heights) = mixlog_heights(&x, &self.bins(n), &MIXLOG)? {
                return Ok(heights);
            }
        }
        let bins = Tensor::from_vec(self.bins(n), (1, n, 1, 1), x.device())?.to_dtype(dt)?;
        let out = match self.norm {
            NormStrategy::MixLog => {
                let y = x.relu()?;
                let min = y.min_keepdim(1)?;
                let shift = (min.neg()?.clamp(0.0, MIXLOG_MAX_CLAMP)? + MIXLOG_EPS_SHIFT)?;
                let y = y.broadcast_add(&shift)?;
                let denom = y.sum_keepdim(1)?;
                // nan_to_num(nan, ±inf → 1)
                let finite = denom.abs()?.lt(f64::INFINITY)?;
                let denom = finite.where_cond(&denom, &denom.ones_like()?)?.clamp(MIXLOG_EPS, f64::INFINITY)?;
                let w = y.broadcast_div(&denom)?;
                let bins = bins.clamp(MIXLOG_EPS, f64::INFINITY)?;
                let out = w.broadcast_mul(&bins)?.sum_keepdim(1)?.clamp(MIXLOG_EPS, f64::INFINITY)?;
                (out * 8.0)?
            }
            norm => {
                let w = match norm {
                    NormStrategy::Linear => {
                        let y = (x.relu()? + 0.1)?;
                        y.broadcast_div(&y.sum_keepdim(1)?)?
                    }
                    NormStrategy::Softmax => candle_nn::ops::softmax(&x, 1)?,
                    _ => {
                        let y = candle_nn::ops::sigmoid(&x)?;
                        y.broadcast_div(&y.sum_keepdim(1)?)?
                    }
                };
                w.broadcast_mul(&bins)?.sum_keepdim(1)?
            }
        };
        Ok(out.squeeze(1)?)
    }
}

/// The mixlog heights of f32 CPU training as one op: the inference pass forward, a one-pass
/// backward ([`crate::kernels::mixlog::mixlog_backward`]) instead of a dozen ops over the
/// `[B, bins, H, W]` logits.
struct TrainMixLog {
    bins: Vec<f32>,
}

impl candle_core::CustomOp1 for TrainMixLog {
    fn name(&self) -> &'static str {
        "train-mixlog-heights"
    }

    fn cpu_fwd(&self, s: &candle_core::CpuStorage, l: &candle_core::Layout) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let (b, n, h, w) = l.shape().dims4()?;
        let xs = crate::kernels::cpu_slice::contiguous_f32(s, l)?;
        match crate::profile::tally("mixlog forward", || crate::kernels::mixlog::mixlog_forward(xs, (b, n, h * w), &self.bins, &MIXLOG)) {
            Some(y) => Ok((candle_core::CpuStorage::F32(y), candle_core::Shape::from((b, h, w)))),
            None => candle_core::bail!("mixlog: logits {:?} do not match {} bins", l.dims(), self.bins.len()),
        }
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, gy: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let (b, n, h, w) = x.dims4()?;
        let dx = crate::kernels::cpu_slice::with_f32_pair(x, &gy.to_dtype(DType::F32)?, |xs, dy| {
            crate::profile::tally("mixlog backward", || crate::kernels::mixlog::mixlog_backward(xs, dy, (b, n, h * w), &self.bins, &MIXLOG))
                .ok_or_else(|| candle_core::Error::Msg(format!("mixlog backward: logits {:?} do not match {} bins", x.dims(), self.bins.len())))
        })?;
        Tensor::from_vec(dx, x.shape(), x.device()).map(Some)
    }
}

/// The upsampling conv head: 3×3 → bilinear ×2 (align_corners=True) → 3×3 → ReLU → 1×1.
struct ConvDepth {
    conv0: Conv2d,
    conv2: Conv2d,
    conv4: Conv2d,
}

impl ConvDepth {
    /// The map before the last 1×1 conv: 3×3 → bilinear ×2 → 3×3 → ReLU.
    fn hidden(&self, x: &Tensor) -> Result<Tensor> {
        let x = self.conv0.forward(x)?;
        let (_, _, h, w) = x.dims4()?;
        Ok(self.conv2.forward_upsampled(&x, (2 * h, 2 * w), true, true)?)
    }
}

/// Compute dtypes of the model's parts; the bins → metres stage always runs in f32 (its 1e-8 / 1e-12
/// epsilons underflow in f16, which turns pixels whose bins all ReLU to zero into 0/0 = NaN).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Precision {
    /// DINOv3 backbone (patch embedding, blocks, norms, RoPE).
    pub backbone: DType,
    /// DPT head: readout, reassemble, fusion, `conv_depth`.
    pub head: DType,
}

impl Precision {
    /// Everything in `dtype` (except the bins stage).
    pub fn uniform(dtype: DType) -> Self {
        Precision { backbone: dtype, head: dtype }
    }
}

/// A loaded CHMv2 model.
pub struct Chmv2 {
    backbone: Dinov3,
    readout: Option<Readout>,
    readout_projects: Vec<Linear>,
    reassemble: Vec<ReassembleLayer>,
    convs: Vec<Conv2d>,
    fusion: FusionStage,
    conv_depth: ConvDepth,
    to_depth: FeaturesToDepth,
    patch: usize,
    precision: Precision,
}

impl Chmv2 {
    /// Builds the model from the hub layout (`backbone.*`, `head.*`), computing in `vb`'s dtype.
    pub fn load(vb: &Vb, config: &Config) -> Result<Self> {
        Self::load_with(vb, config, Precision::uniform(vb.dtype()))
    }

    /// As [`Chmv2::load`], with per-part compute dtypes.
    pub fn load_with(vb: &Vb, cfg: &Config, precision: Precision) -> Result<Self> {
        let bb = &cfg.backbone_config;
        if bb.patch()? != cfg.patch_size {
            return Err(Error::Config(format!("patch_size {} differs from the backbone's {}", cfg.patch_size, bb.patch()?)));
        }
        if !bb.reshape_hidden_states {
            return Err(Error::Config(
                "backbone reshape_hidden_states=false is not supported (the transformers CHMv2 head mis-reads flat tokens)".into(),
            ));
        }
        let readout = match (cfg.readout_type.as_str(), bb.return_class_token) {
            (_, false) => None,
            ("project", true) => Some(Readout::Project),
            ("add", true) => Some(Readout::Add),
            ("ignore", true) => Some(Readout::Ignore),
            (o, true) => return Err(Error::Config(format!("unknown readout_type `{o}` (project, add, ignore)"))),
        };
        let factors = cfg.reassemble_factors.clone().unwrap_or_else(|| vec![4.0, 2.0, 1.0, 0.5]);
        let channels = cfg.post_process_channels.clone().unwrap_or_else(|| vec![128, 256, 512, 1024]);
        let levels = bb.feature_indices()?.len();
        if levels == 0 || channels.len() != levels || factors.len() != levels {
            return Err(Error::Config(format!(
                "{levels} backbone feature maps, {} post_process_channels and {} reassemble_factors must agree",
                channels.len(),
                factors.len()
            )));
        }
        let f = cfg.fusion_hidden_size;
        if f < 2 || cfg.head_hidden_size == 0 || cfg.number_output_channels == 0 {
            return Err(Error::Config("fusion_hidden_size ≥ 2, head_hidden_size and number_output_channels must be positive".into()));
        }
        let to_depth = FeaturesToDepth::new(&cfg.bins_strategy, &cfg.norm_strategy, cfg.min_depth, cfg.max_depth)?;
        let backbone = Dinov3::load(&vb.with_dtype(precision.backbone).pp("backbone"), bb)?;
        let d = bb.hidden_size;
        let head = vb.with_dtype(precision.head).pp("head");
        let rs = head.pp("reassemble_stage");
        let readout_projects = if readout == Some(Readout::Project) {
            (0..levels).map(|i| Linear::load(&rs.pp("readout_projects").pp(i).pp(0), 2 * d, d, true)).collect::<Result<_>>()?
        } else {
            Vec::new()
        };
        let reassemble = (0..levels)
            .map(|i| ReassembleLayer::load(&rs.pp("layers").pp(i), d, channels[i], factors[i]))
            .collect::<Result<_>>()?;
        let convs = channels
            .iter()
            .enumerate()
            .map(|(i, &c)| conv2d(&head.pp("convs").pp(i), c, f, 3, same3x3(), false))
            .collect::<Result<_>>()?;
        let fusion = FusionStage::load_flat(&head.pp("fusion_layers"), f, levels, FusionResize::Double)?;
        let cd = head.pp("conv_depth").pp("head");
        let conv_depth = ConvDepth {
            conv0: conv2d(&cd.pp(0), f, f / 2, 3, same3x3(), true)?,
            conv2: conv2d(&cd.pp(2), f / 2, cfg.head_hidden_size, 3, same3x3(), true)?,
            conv4: conv2d(&cd.pp(4), cfg.head_hidden_size, cfg.number_output_channels, 1, Default::default(), true)?,
        };
        Ok(Chmv2 { backbone, readout, readout_projects, reassemble, convs, fusion, conv_depth, to_depth, patch: cfg.patch_size, precision })
    }

    /// Patch size; padded inputs are multiples of it.
    pub fn patch_size(&self) -> usize {
        self.patch
    }

    /// The per-part compute dtypes.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// The backbone.
    pub fn backbone(&self) -> &Dinov3 {
        &self.backbone
    }

    /// The bin → height stage.
    pub fn features_to_depth(&self) -> &FeaturesToDepth {
        &self.to_depth
    }

    /// Backbone features of `pixel_values` (what the head reads; cacheable when the backbone is frozen).
    pub(crate) fn backbone_features(&self, pixel_values: &Tensor) -> Result<Dinov3Features> {
        let _span = Span::new("chmv2.backbone");
        self.backbone.forward_features(&pixel_values.to_dtype(self.precision.backbone)?)
    }

    /// The DPT head on backbone features → bin logits `[B, bins, H', W']`.
    pub(crate) fn decode_logits(&self, feats: &Dinov3Features) -> Result<Tensor> {
        Ok(self.conv_depth.conv4.forward(&self.decode_hidden(feats)?)?)
    }

    /// The DPT head up to its last 1×1 conv: the hidden map `[B, head_hidden_size, H', W']`.
    fn decode_hidden(&self, feats: &Dinov3Features) -> Result<Tensor> {
        let hd = self.precision.head;
        let span = Span::new("chmv2.reassemble");
        let mut levels = Vec::with_capacity(feats.maps.len());
        for (i, map) in feats.maps.iter().enumerate() {
            let map = &map.to_dtype(hd)?;
            let cls = feats.cls.get(i).map(|c| c.to_dtype(hd)).transpose()?;
            let x = match (self.readout, cls.as_ref()) {
                (Some(Readout::Project), Some(cls)) => {
                    let (b, d, h, w) = map.dims4()?;
                    // The transposes by the tiled parallel kernel: Candle's strided copies of
                    // these maps ran on one core (~45 ms of a forward).
                    let tokens = transpose_last_two(&map.flatten_from(2)?)?;
                    let readout = cls.unsqueeze(1)?.expand((b, h * w, d))?;
                    let t = self.readout_projects[i].forward_gelu(&Tensor::cat(&[&tokens, &readout], D::Minus1)?)?;
                    transpose_last_two(&t)?.reshape((b, d, h, w))?
                }
                (Some(Readout::Add), Some(cls)) => map.broadcast_add(&cls.unsqueeze(2)?.unsqueeze(3)?)?,
                _ => map.clone(),
            };
            levels.push(self.convs[i].forward(&self.reassemble[i].forward(&x)?)?);
        }
        drop(span);
        let span = Span::new("chmv2.fusion");
        let fused = self.fusion.forward(&levels)?;
        drop(span);
        let last = fused.last().ok_or_else(|| Error::Config("no fusion levels".into()))?;
        let _span = Span::new("chmv2.head");
        self.conv_depth.hidden(last)
    }

    /// `pixel_values` `[B, 3, H, W]` → bin logits `[B, bins, H', W']` (H' = 2^(levels+1)·⌈coarsest⌉,
    /// which equals H for power-of-two patch grids).
    pub fn head_logits(&self, pixel_values: &Tensor) -> Result<Tensor> {
        Ok(self.head_logits_checked(pixel_values)?.0)
    }

    /// As [`Chmv2::head_logits`], also naming, per batch item, the first stage whose output was not
    /// finite (`backbone`, `head`). The check matters: Candle's ReLU maps NaN to 0, so a NaN inside
    /// the head would otherwise come out as plausible-looking uniform-bin heights.
    pub(crate) fn head_logits_checked(&self, pixel_values: &Tensor) -> Result<(Tensor, Vec<Option<&'static str>>)> {
        let (hidden, mut bad) = self.hidden_checked(pixel_values)?;
        let logits = self.conv_depth.conv4.forward(&hidden)?;
        flag_non_finite(&logits, "head", &mut bad)?;
        Ok((logits, bad))
    }

    /// The head's hidden map before its last 1×1 conv, and the items whose backbone output was
    /// not finite.
    fn hidden_checked(&self, pixel_values: &Tensor) -> Result<(Tensor, Vec<Option<&'static str>>)> {
        let feats = self.backbone_features(pixel_values)?;
        let mut bad = vec![None; pixel_values.dim(0)?];
        for t in feats.maps.iter().chain(&feats.cls) {
            flag_non_finite(t, "backbone", &mut bad)?;
        }
        Ok((self.decode_hidden(&feats)?, bad))
    }

    /// Heights `[B, H', W']` (f32) and, per batch item, the first stage that was not finite
    /// (`backbone`, `head`, `bins`); such items must not be used. In f32 on the CPU with the
    /// `chmv2_mixlog` normalisation, the last 1×1 conv and the bins run band by band and the
    /// logits are never stored.
    pub(crate) fn forward_checked(&self, pixel_values: &Tensor) -> Result<(Tensor, Vec<Option<&'static str>>)> {
        let (hidden, mut bad) = self.hidden_checked(pixel_values)?;
        let _span = Span::new("chmv2.logits+bins");
        let depth = match self.to_depth.forward_from_hidden(&hidden, &self.conv_depth.conv4)? {
            Some((depth, head_bad)) => {
                for (b, non_finite) in bad.iter_mut().zip(head_bad) {
                    if b.is_none() && non_finite {
                        *b = Some("head");
                    }
                }
                depth
            }
            None => {
                let logits = self.conv_depth.conv4.forward(&hidden)?;
                flag_non_finite(&logits, "head", &mut bad)?;
                self.to_depth.forward(&logits)?
            }
        };
        flag_non_finite(&depth, "bins", &mut bad)?;
        Ok((depth, bad))
    }

    /// `pixel_values` `[B, 3, H, W]` → canopy height in metres `[B, H', W']` (f32); an error when any
    /// value is not finite (which image, which stage, which dtype).
    pub fn forward(&self, pixel_values: &Tensor) -> Result<Tensor> {
        let (depth, bad) = self.forward_checked(pixel_values)?;
        if let Some((i, stage)) = bad.iter().enumerate().find_map(|(i, s)| s.map(|s| (i, s))) {
            return Err(Error::Input(format!(
                "non-finite values in the {stage} output for batch item {i} (backbone {:?}, head {:?}); use f32",
                self.precision.backbone, self.precision.head
            )));
        }
        Ok(depth)
    }
}

/// Marks the batch items of `x` (`[B, …]`) that hold a NaN or ±inf with `stage`, unless already marked.
fn flag_non_finite(x: &Tensor, stage: &'static str, bad: &mut [Option<&'static str>]) -> Result<()> {
    let sums = x.to_dtype(DType::F32)?.flatten_from(1)?.abs()?.sum(1)?.to_vec1::<f32>()?;
    for (b, s) in bad.iter_mut().zip(sums) {
        if b.is_none() && !s.is_finite() {
            *b = Some(stage);
        }
    }
    Ok(())
}

impl Model for Chmv2 {
    fn architecture(&self) -> &str {
        "chmv2"
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
