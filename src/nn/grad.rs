//! Ops whose fast Candle kernels record no backward (fused LayerNorm, `softmax_last_dim`, bilinear
//! upsampling): each takes a differentiable path built from ops with a backward whenever autograd is
//! recording through its inputs, and the fast kernel otherwise, so inference speed is unchanged.
use candle_core::{DType, Module, Tensor, D};
use candle_nn::LayerNorm;

use candle_core::Result;

/// Whether a backward pass could reach through `t` (a trainable `Var`, or computed from one).
pub fn records(t: &Tensor) -> bool {
    t.track_op()
}

/// LayerNorm over the last dimension; the unfused formula when `x` or the norm's parameters record
/// (or in f64, which the fused kernel lacks).
pub fn layer_norm(norm: &LayerNorm, x: &Tensor) -> Result<Tensor> {
    let recording = records(x) || records(norm.weight()) || norm.bias().is_some_and(records) || x.dtype() == DType::F64;
    match (recording, norm.bias()) {
        (true, Some(bias)) if norm.remove_mean() => candle_nn::ops::layer_norm_slow(x, norm.weight(), bias, norm.eps() as f32),
        _ => norm.forward(x),
    }
}

/// Softmax over the last dimension; `exp(x − max) / Σ` from differentiable ops when `x` records.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    if records(x) {
        candle_nn::ops::softmax(x, D::Minus1)
    } else {
        candle_nn::ops::softmax_last_dim(x)
    }
}

/// The `[out, in]` matrix of 1-D linear interpolation with PyTorch's `align_corners` rule
/// (output-to-input scale `in / out` when not aligning corners, negative sources clamped to 0).
pub(crate) fn linear_matrix(n_in: usize, n_out: usize, align_corners: bool) -> Vec<f32> {
    let mut m = vec![0f32; n_out * n_in];
    for (row, tap) in m.chunks_exact_mut(n_in).zip(crate::kernels::bilinear_cpu::taps(n_in, n_out, align_corners)) {
        row[tap.lo] += 1.0 - tap.t;
        row[tap.hi] += tap.t;
    }
    m
}

/// Bilinear resize of `[B, C, H, W]` as two interpolation matmuls (rows, then columns), which Candle
/// can differentiate; equal to `upsample_bilinear2d` up to rounding.
pub fn bilinear_by_matmul(x: &Tensor, oh: usize, ow: usize, align_corners: bool) -> Result<Tensor> {
    let (b, c, h, w) = x.dims4()?;
    let dev = x.device();
    let dt = match x.dtype() {
        DType::F64 => DType::F64,
        _ => DType::F32,
    };
    let my = Tensor::from_vec(linear_matrix(h, oh, align_corners), (oh, h), dev)?.to_dtype(dt)?;
    let mx = Tensor::from_vec(linear_matrix(w, ow, align_corners), (ow, w), dev)?.to_dtype(dt)?;
    let xf = x.to_dtype(dt)?.reshape((b * c, h, w))?;
    let y = my.broadcast_left(b * c)?.matmul(&xf)?.broadcast_matmul(&mx.t()?)?;
    y.reshape((b, c, oh, ow))?.to_dtype(x.dtype())
}

/// Bilinear resize (PyTorch `align_corners` semantics): the fast kernel, or the matmul form when
/// `x` records a backward.
pub fn bilinear(x: &Tensor, oh: usize, ow: usize, align_corners: bool) -> Result<Tensor> {
    if records(x) {
        bilinear_by_matmul(x, oh, ow, align_corners)
    } else if let Some(y) = crate::kernels::bilinear_cpu::bilinear(x, oh, ow, align_corners)? {
        Ok(y)
    } else {
        x.upsample_bilinear2d(oh, ow, align_corners)
    }
}
