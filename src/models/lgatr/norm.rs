//! `EquiLayerNorm` on the fused per-item layout `[mv (C, 16) | s (S)]`.
//!
//! mv: `x / sqrt(max(mean_c abs_squared_norm(x_c), 0.01))` (a clamp floor, not an additive eps);
//! scalars: `layer_norm` over S (eps 1e-5, biased variance, no bias); then the optional
//! per-(channel, grade) gains `weight_mv (C, 5)` and `weight_s (S,)`.
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;

use super::algebra::GRADE_INDEX;
use super::kernels::{kernel_ok, EquiNormKernel};
use super::primitives::metric_grades_tensor;
use crate::error::{Error, Result};

/// lgatr's `EquiLayerNorm` epsilon (clamp floor on the mean squared norm).
pub(crate) const MV_EPSILON: f64 = 0.01;
/// `torch.nn.functional.layer_norm`'s default epsilon.
pub(crate) const S_EPSILON: f64 = 1e-5;

/// Layer norm over the last dim (no affine), as `F.layer_norm`.
pub(crate) fn scalar_layer_norm(s: &Tensor) -> Result<Tensor> {
    let mean = s.mean_keepdim(candle_core::D::Minus1)?;
    let d = s.broadcast_sub(&mean)?;
    let var = d.sqr()?.mean_keepdim(candle_core::D::Minus1)?;
    Ok(d.broadcast_mul(&(var + S_EPSILON)?.sqrt()?.recip()?)?)
}

/// An `EquiLayerNorm` over `C` mv channels and `S` scalars, on rows `(R, 16C + S)`.
#[derive(Debug, Clone)]
pub struct EquiNorm {
    c: usize,
    s: usize,
    w16: Option<Tensor>,
    ws: Option<Tensor>,
    gains: Option<Vec<f64>>,
    grades: Tensor,
}

impl EquiNorm {
    /// No-affine norm (`EquiLayerNorm()`).
    pub fn plain(c: usize, s: usize, device: &Device, dtype: DType) -> Result<Self> {
        Ok(Self { c, s, w16: None, ws: None, gains: None, grades: metric_grades_tensor(device, dtype)? })
    }

    /// Loads `weight_mv (C, 5)` and `weight_s (S,)` when `affine`.
    pub fn load(vb: &VarBuilder, c: usize, s: usize, affine: bool) -> Result<Self> {
        let mut n = Self::plain(c, s, vb.device(), vb.dtype())?;
        if affine {
            let wmv = vb.get((c, 5), "weight_mv")?.to_dtype(DType::F64)?.to_vec2::<f64>()?;
            let w16: Vec<f64> = wmv.iter().flat_map(|g| GRADE_INDEX.iter().map(move |&k| g[k])).collect();
            n.w16 = Some(Tensor::from_vec(w16.clone(), 16 * c, vb.device())?.to_dtype(vb.dtype())?);
            let mut gains = w16;
            if s > 0 {
                let ws = vb.get(s, "weight_s")?;
                gains.extend(ws.to_dtype(DType::F64)?.to_vec1::<f64>()?);
                n.ws = Some(ws);
            }
            n.gains = Some(gains);
        }
        Ok(n)
    }

    /// Row width `16C + S`.
    pub fn width(&self) -> usize {
        16 * self.c + self.s
    }

    /// `(R, 16C + S)` → same (a row kernel on CPU, tensor ops elsewhere).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (_, w) = x.dims2()?;
        if w != self.width() {
            return Err(Error::Input(format!("EquiLayerNorm expects width {}, got {w}", self.width())));
        }
        if !kernel_ok(x) {
            return self.forward_reference(x);
        }
        let k =
            EquiNormKernel { c: self.c, s: self.s, mv_eps: MV_EPSILON, s_eps: S_EPSILON, gains: self.gains.clone() };
        Ok(x.contiguous()?.apply_op1_no_bwd(&k)?)
    }

    /// The tensor-op form of [`Self::forward`] (any device).
    pub fn forward_reference(&self, x: &Tensor) -> Result<Tensor> {
        let (r, w) = x.dims2()?;
        if w != self.width() {
            return Err(Error::Input(format!("EquiLayerNorm expects width {}, got {w}", self.width())));
        }
        let cw = 16 * self.c;
        let mut parts = Vec::with_capacity(2);
        if self.c > 0 {
            let mv = if self.s == 0 { x.clone() } else { x.narrow(1, 0, cw)? };
            let sq = mv.sqr()?.reshape((r * self.c, 16))?;
            let asn = sq.matmul(&self.grades)?.abs()?.sum_keepdim(1)?.reshape((r, self.c))?;
            let inv = asn.mean_keepdim(1)?.maximum(MV_EPSILON)?.sqrt()?.recip()?;
            let mut y = mv.broadcast_mul(&inv)?;
            if let Some(w) = &self.w16 {
                y = y.broadcast_mul(w)?;
            }
            parts.push(y);
        }
        if self.s > 0 {
            let s = if self.c == 0 { x.clone() } else { x.narrow(1, cw, self.s)? };
            let mut y = scalar_layer_norm(&s)?;
            if let Some(w) = &self.ws {
                y = y.broadcast_mul(w)?;
            }
            parts.push(y);
        }
        Ok(if parts.len() == 1 { parts.remove(0) } else { Tensor::cat(&parts, 1)? })
    }
}
