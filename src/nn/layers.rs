//! Thin loaders for Candle's standard layers from a `Vb`.
use candle_nn::{Conv2dConfig, ConvTranspose2dConfig, LayerNorm};

use super::conv::Conv2d;
use super::conv_transpose::ConvTranspose2d;

use crate::error::Result;
use crate::weights::Vb;

/// Loads a LayerNorm (`weight`, `bias`) of width `dim` with `eps`.
pub fn layer_norm(vb: &Vb, dim: usize, eps: f64) -> Result<LayerNorm> {
    let w = vb.get(dim, "weight")?;
    let b = vb.get(dim, "bias")?;
    Ok(LayerNorm::new(w, b, eps))
}

/// Loads a Conv2d with square kernel `k`.
pub fn conv2d(vb: &Vb, in_c: usize, out_c: usize, k: usize, cfg: Conv2dConfig, bias: bool) -> Result<Conv2d> {
    let w = vb.get((out_c, in_c / cfg.groups, k, k), "weight")?;
    let b = if bias { Some(vb.get(out_c, "bias")?) } else { None };
    Ok(Conv2d::new(w, b, cfg))
}

/// Loads a ConvTranspose2d with square kernel `k` (weight layout `[in, out, k, k]`).
pub(crate) fn conv_transpose2d(vb: &Vb, in_c: usize, out_c: usize, k: usize, cfg: ConvTranspose2dConfig) -> Result<ConvTranspose2d> {
    let w = vb.get((in_c, out_c, k, k), "weight")?;
    let b = vb.get(out_c, "bias")?;
    Ok(ConvTranspose2d::new(w, Some(b), cfg))
}
