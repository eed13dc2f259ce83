//! DPT neck blocks (reassemble, 3×3 projections, feature fusion) shared by the depth and height models.
use candle_core::{Module, Tensor};
use candle_nn::{Conv2dConfig, ConvTranspose2dConfig};
use crate::nn::conv::Conv2d;
use crate::nn::conv_transpose::ConvTranspose2d;

use crate::nn::interpolate::bilinear;
use crate::nn::layers::{conv2d, conv_transpose2d};
use crate::error::{Error, Result};
use crate::weights::Vb;

/// 3×3, stride 1, padding 1.
pub(crate) fn same3x3() -> Conv2dConfig {
    Conv2dConfig { padding: 1, ..Default::default() }
}

/// How a reassemble layer changes the token grid's resolution.
pub(crate) enum Resample {
    /// Transposed conv, kernel = stride = factor.
    Up(ConvTranspose2d),
    /// No change.
    Identity,
    /// 3×3 conv with stride 1/factor, padding 1.
    Down(Conv2d),
}

/// One reassemble layer: 1×1 projection then resample.
pub(crate) struct ReassembleLayer {
    projection: Conv2d,
    resize: Resample,
}

impl ReassembleLayer {
    /// Loads `projection` and `resize` under `vb`.
    pub(crate) fn load(vb: &Vb, in_c: usize, channels: usize, factor: f64) -> Result<Self> {
        Self::load_parts(&vb.pp("projection"), &vb.pp("resize"), in_c, channels, factor)
    }

    /// Loads the 1×1 projection from `projection_vb` and the resample conv from `resize_vb` (the original
    /// DPT layout keeps them in separate lists: `projects.{i}`, `resize_layers.{i}`).
    pub(crate) fn load_parts(projection_vb: &Vb, resize_vb: &Vb, in_c: usize, channels: usize, factor: f64) -> Result<Self> {
        crate::config_check::check_reassemble_factor(&crate::config_check::Section::root(), "reassemble factor", factor)?;
        let projection = conv2d(projection_vb, in_c, channels, 1, Default::default(), true)?;
        let resize = if factor > 1.0 {
            let f = factor.round() as usize;
            if (f as f64 - factor).abs() > 1e-9 {
                return Err(Error::Config(format!("reassemble factor {factor} is not an integer")));
            }
            Resample::Up(conv_transpose2d(resize_vb, channels, channels, f, ConvTranspose2dConfig { stride: f, ..Default::default() })?)
        } else if factor == 1.0 {
            Resample::Identity
        } else if factor > 0.0 {
            let s = (1.0 / factor) as usize;
            Resample::Down(conv2d(resize_vb, channels, channels, 3, Conv2dConfig { stride: s, padding: 1, ..Default::default() }, true)?)
        } else {
            return Err(Error::Config(format!("bad reassemble factor {factor}")));
        };
        Ok(ReassembleLayer { projection, resize })
    }

    /// Maps an NCHW grid to its level's resolution and width.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.resample(&self.project(x)?)
    }

    /// The 1×1 projection alone.
    pub(crate) fn project(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.projection.forward(x)?)
    }

    /// The resample step alone (after [`ReassembleLayer::project`]).
    pub(crate) fn resample(&self, x: &Tensor) -> Result<Tensor> {
        Ok(match &self.resize {
            Resample::Up(c) => c.forward(x)?,
            Resample::Identity => x.clone(),
            Resample::Down(c) => c.forward(x)?,
        })
    }
}

/// Drops the first `prefix` tokens of `[B, prefix + ph·pw, C]` and lays the rest out as `[B, C, ph, pw]`.
pub(crate) fn tokens_to_grid(tokens: &Tensor, prefix: usize, ph: usize, pw: usize) -> Result<Tensor> {
    let (b, n, c) = tokens.dims3()?;
    if n != prefix + ph * pw {
        return Err(Error::Input(format!("{n} tokens do not make {prefix} + {ph}×{pw}")));
    }
    Ok(crate::kernels::cpu_slice::transpose_last_two(&tokens.narrow(1, prefix, ph * pw)?)?.reshape((b, c, ph, pw))?)
}

/// Tensor names inside a fusion layer: transformers (`HF`) or original DPT (`ORIGINAL`: `out_conv`,
/// `resConfUnit{1,2}.conv{1,2}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FusionNames {
    /// The 1×1 output conv.
    pub projection: &'static str,
    /// The residual unit on the skip input.
    pub residual1: &'static str,
    /// The residual unit after the merge.
    pub residual2: &'static str,
    /// The residual unit's first conv.
    pub conv1: &'static str,
    /// The residual unit's second conv.
    pub conv2: &'static str,
}

impl FusionNames {
    /// transformers DPT / Depth Anything.
    pub(crate) const HF: FusionNames =
        FusionNames { projection: "projection", residual1: "residual_layer1", residual2: "residual_layer2", conv1: "convolution1", conv2: "convolution2" };
    /// Original DPT / Depth Anything (`scratch.refinenetK`).
    pub(crate) const ORIGINAL: FusionNames = FusionNames { projection: "out_conv", residual1: "resConfUnit1", residual2: "resConfUnit2", conv1: "conv1", conv2: "conv2" };
}

/// The pre-activation residual unit `x + conv2(relu(conv1(relu(x))))`.
pub(crate) struct PreActResidual {
    conv1: Conv2d,
    conv2: Conv2d,
}

impl PreActResidual {
    /// Loads `names.conv1` and `names.conv2` under `vb`.
    pub(crate) fn load_named(vb: &Vb, c: usize, names: &FusionNames) -> Result<Self> {
        Ok(PreActResidual {
            conv1: conv2d(&vb.pp(names.conv1), c, c, 3, same3x3(), true)?,
            conv2: conv2d(&vb.pp(names.conv2), c, c, 3, same3x3(), true)?,
        })
    }

    /// Applies the unit.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.conv2.forward_pre_relu(&self.conv1.forward_pre_relu(x, None)?, Some(x))?)
    }
}

/// A fusion layer: add the residual unit of the skip input, refine, upsample (align_corners=True), 1×1
/// (computed as 1×1, then upsample).
pub(crate) struct FusionLayer {
    projection: Conv2d,
    residual1: Option<PreActResidual>,
    residual2: PreActResidual,
}

impl FusionLayer {
    /// Loads `projection`, `residual_layer1` (when `with_skip`) and `residual_layer2` under `vb`.
    pub(crate) fn load(vb: &Vb, c: usize, with_skip: bool) -> Result<Self> {
        Self::load_named(vb, c, with_skip, &FusionNames::HF)
    }

    /// Loads with the given tensor names.
    pub(crate) fn load_named(vb: &Vb, c: usize, with_skip: bool, names: &FusionNames) -> Result<Self> {
        Ok(FusionLayer {
            projection: conv2d(&vb.pp(names.projection), c, c, 1, Default::default(), true)?,
            residual1: if with_skip { Some(PreActResidual::load_named(&vb.pp(names.residual1), c, names)?) } else { None },
            residual2: PreActResidual::load_named(&vb.pp(names.residual2), c, names)?,
        })
    }

    /// Fuses `x` with optional `skip`, then resizes to `size` (×2 when None).
    pub(crate) fn forward(&self, x: &Tensor, skip: Option<&Tensor>, size: Option<(usize, usize)>) -> Result<Tensor> {
        let mut x = x.clone();
        if let (Some(skip), Some(r1)) = (skip, &self.residual1) {
            let (_, _, h, w) = x.dims4()?;
            let skip = bilinear(skip, h, w, false)?;
            x = (x + r1.forward(&skip)?)?;
        }
        let x = self.residual2.forward(&x)?;
        let (_, _, h, w) = x.dims4()?;
        let (oh, ow) = size.unwrap_or((2 * h, 2 * w));
        // The 1×1 projection before the resize, at a quarter of the pixels: both are linear per
        // pixel and per channel and the align_corners weights of each output pixel sum to one, so
        // they commute (bias included) up to rounding.
        let x = self.projection.forward(&x)?;
        bilinear(&x, oh, ow, true)
    }
}

/// How each fusion layer resizes its output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FusionResize {
    /// To the next (finer) level's size; the last layer doubles (DPT, Depth Anything).
    NextLevel,
    /// Always ×2 by scale factor, whatever the next level's size (CHMv2); the skip input is then
    /// resized (bilinear, align_corners=False) to the running map when the sizes differ.
    Double,
}

/// The fusion stage: coarsest level first, each fused result resized to the next level's size
/// (or doubled, see [`FusionResize`]).
pub(crate) struct FusionStage {
    layers: Vec<FusionLayer>,
    resize: FusionResize,
}

impl FusionStage {
    /// Loads `layers.{i}` under `vb`; layer 0 takes no skip input.
    pub(crate) fn load(vb: &Vb, c: usize, levels: usize) -> Result<Self> {
        let layers = (0..levels).map(|i| FusionLayer::load(&vb.pp("layers").pp(i), c, i > 0)).collect::<Result<_>>()?;
        Ok(FusionStage { layers, resize: FusionResize::NextLevel })
    }

    /// Loads `{i}` directly under `vb` (e.g. `head.fusion_layers.{i}`); layer 0 has no residual unit
    /// for a skip input.
    pub(crate) fn load_flat(vb: &Vb, c: usize, levels: usize, resize: FusionResize) -> Result<Self> {
        let layers = (0..levels).map(|i| FusionLayer::load(&vb.pp(i), c, i > 0)).collect::<Result<_>>()?;
        Ok(FusionStage { layers, resize })
    }

    /// Loads the original layout under `vb` (`scratch`): layer i (coarsest first) is
    /// `refinenet{levels − i}{suffix}` (e.g. suffix `_aux` for Depth Anything 3's second branch).
    pub(crate) fn load_original(vb: &Vb, c: usize, levels: usize, suffix: &str) -> Result<Self> {
        let layers = (0..levels)
            .map(|i| FusionLayer::load_named(&vb.pp(format!("refinenet{}{suffix}", levels - i)), c, i > 0, &FusionNames::ORIGINAL))
            .collect::<Result<_>>()?;
        Ok(FusionStage { layers, resize: FusionResize::NextLevel })
    }

    /// Fuses features given finest first; returns the fused maps, coarsest first.
    pub(crate) fn forward(&self, features: &[Tensor]) -> Result<Vec<Tensor>> {
        let rev: Vec<&Tensor> = features.iter().rev().collect();
        let mut out: Vec<Tensor> = Vec::with_capacity(rev.len());
        for (i, (feat, layer)) in rev.iter().zip(&self.layers).enumerate() {
            let size = match rev.get(i + 1).filter(|_| self.resize == FusionResize::NextLevel) {
                Some(next) => {
                    let (_, _, h, w) = next.dims4()?;
                    Some((h, w))
                }
                None => None,
            };
            let fused = match out.last() {
                None => layer.forward(feat, None, size)?,
                Some(prev) => layer.forward(prev, Some(feat), size)?,
            };
            out.push(fused);
        }
        Ok(out)
    }
}
