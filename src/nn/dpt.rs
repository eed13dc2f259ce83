//! DPT neck blocks (reassemble, 3×3 projections, feature fusion) shared by the depth and height models.
use candle_core::{Module, Tensor};
use candle_nn::{Conv2d, Conv2dConfig, ConvTranspose2d, ConvTranspose2dConfig};

use super::interpolate::bilinear;
use super::layers::{conv2d, conv_transpose2d};
use crate::error::{Error, Result};
use crate::weights::Vb;

/// 3×3, stride 1, padding 1.
pub fn same3x3() -> Conv2dConfig {
    Conv2dConfig { padding: 1, ..Default::default() }
}

/// How a reassemble layer changes the token grid's resolution.
pub enum Resample {
    /// Transposed conv, kernel = stride = factor.
    Up(ConvTranspose2d),
    /// No change.
    Identity,
    /// 3×3 conv with stride 1/factor, padding 1.
    Down(Conv2d),
}

/// One reassemble layer: 1×1 projection then resample.
pub struct ReassembleLayer {
    projection: Conv2d,
    resize: Resample,
}

impl ReassembleLayer {
    /// Loads `projection` and `resize` under `vb`.
    pub fn load(vb: &Vb, in_c: usize, channels: usize, factor: f64) -> Result<Self> {
        let projection = conv2d(&vb.pp("projection"), in_c, channels, 1, Default::default(), true)?;
        let resize = if factor > 1.0 {
            let f = factor.round() as usize;
            if (f as f64 - factor).abs() > 1e-9 {
                return Err(Error::Config(format!("reassemble factor {factor} is not an integer")));
            }
            Resample::Up(conv_transpose2d(&vb.pp("resize"), channels, channels, f, ConvTranspose2dConfig { stride: f, ..Default::default() })?)
        } else if factor == 1.0 {
            Resample::Identity
        } else if factor > 0.0 {
            let s = (1.0 / factor) as usize;
            Resample::Down(conv2d(&vb.pp("resize"), channels, channels, 3, Conv2dConfig { stride: s, padding: 1, ..Default::default() }, true)?)
        } else {
            return Err(Error::Config(format!("bad reassemble factor {factor}")));
        };
        Ok(ReassembleLayer { projection, resize })
    }

    /// Maps an NCHW grid to its level's resolution and width.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = self.projection.forward(x)?;
        Ok(match &self.resize {
            Resample::Up(c) => c.forward(&x)?,
            Resample::Identity => x,
            Resample::Down(c) => c.forward(&x)?,
        })
    }
}

/// Drops the first `prefix` tokens of `[B, prefix + ph·pw, C]` and lays the rest out as `[B, C, ph, pw]`.
pub fn tokens_to_grid(tokens: &Tensor, prefix: usize, ph: usize, pw: usize) -> Result<Tensor> {
    let (b, n, c) = tokens.dims3()?;
    if n != prefix + ph * pw {
        return Err(Error::Input(format!("{n} tokens do not make {prefix} + {ph}×{pw}")));
    }
    Ok(tokens.narrow(1, prefix, ph * pw)?.reshape((b, ph, pw, c))?.permute((0, 3, 1, 2))?.contiguous()?)
}

/// The pre-activation residual unit `x + conv2(relu(conv1(relu(x))))`.
pub struct PreActResidual {
    conv1: Conv2d,
    conv2: Conv2d,
}

impl PreActResidual {
    /// Loads `convolution1` and `convolution2` under `vb`.
    pub fn load(vb: &Vb, c: usize) -> Result<Self> {
        Ok(PreActResidual {
            conv1: conv2d(&vb.pp("convolution1"), c, c, 3, same3x3(), true)?,
            conv2: conv2d(&vb.pp("convolution2"), c, c, 3, same3x3(), true)?,
        })
    }

    /// Applies the unit.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.conv2.forward(&self.conv1.forward(&x.relu()?)?.relu()?)?;
        Ok((h + x)?)
    }
}

/// A fusion layer: add the residual unit of the skip input, refine, upsample (align_corners=True), 1×1.
pub struct FusionLayer {
    projection: Conv2d,
    residual1: Option<PreActResidual>,
    residual2: PreActResidual,
}

impl FusionLayer {
    /// Loads `projection`, `residual_layer1` (when `with_skip`) and `residual_layer2` under `vb`.
    pub fn load(vb: &Vb, c: usize, with_skip: bool) -> Result<Self> {
        Ok(FusionLayer {
            projection: conv2d(&vb.pp("projection"), c, c, 1, Default::default(), true)?,
            residual1: if with_skip { Some(PreActResidual::load(&vb.pp("residual_layer1"), c)?) } else { None },
            residual2: PreActResidual::load(&vb.pp("residual_layer2"), c)?,
        })
    }

    /// Fuses `x` with optional `skip`, then resizes to `size` (×2 when None).
    pub fn forward(&self, x: &Tensor, skip: Option<&Tensor>, size: Option<(usize, usize)>) -> Result<Tensor> {
        let mut x = x.clone();
        if let (Some(skip), Some(r1)) = (skip, &self.residual1) {
            let (_, _, h, w) = x.dims4()?;
            let skip = bilinear(skip, h, w, false)?;
            x = (x + r1.forward(&skip)?)?;
        }
        let x = self.residual2.forward(&x)?;
        let (_, _, h, w) = x.dims4()?;
        let (oh, ow) = size.unwrap_or((2 * h, 2 * w));
        let x = bilinear(&x, oh, ow, true)?;
        Ok(self.projection.forward(&x)?)
    }
}

/// The fusion stage: coarsest level first, each fused result resized to the next level's size.
pub struct FusionStage {
    layers: Vec<FusionLayer>,
}

impl FusionStage {
    /// Loads `layers.{i}` under `vb`; layer 0 takes no skip input.
    pub fn load(vb: &Vb, c: usize, levels: usize) -> Result<Self> {
        let layers = (0..levels).map(|i| FusionLayer::load(&vb.pp("layers").pp(i), c, i > 0)).collect::<Result<_>>()?;
        Ok(FusionStage { layers })
    }

    /// Fuses features given finest first; returns the fused maps, coarsest first.
    pub fn forward(&self, features: &[Tensor]) -> Result<Vec<Tensor>> {
        let rev: Vec<&Tensor> = features.iter().rev().collect();
        let mut out: Vec<Tensor> = Vec::with_capacity(rev.len());
        for (i, (feat, layer)) in rev.iter().zip(&self.layers).enumerate() {
            let size = match rev.get(i + 1) {
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
