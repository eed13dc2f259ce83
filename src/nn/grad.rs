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
pub fn linear_matrix(n_in: usize, n_out: usize, align_corners: bool) -> Vec<f32> {
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

/// Conv2d whose backward Candle gets right. Candle 0.11.1 derives the input gradient's
/// `output_padding` from the height alone and applies it to the width too, so a strided conv whose
/// axes leave different remainders fails in backward (4×5 input, stride 2: a 4×6 gradient; Candle
/// computes that gradient even when only the weights train). [`super::conv::Conv2d`] calls this when `x`
/// or the weights record: a strided conv is applied to the explicitly padded input cut to the rows and columns its
/// windows read, which leaves no remainder on either axis.
pub fn conv2d(conv: &super::conv::Conv2d, x: &Tensor) -> Result<Tensor> {
    let cfg = conv.config();
    if cfg.stride == 1 {
        return conv.forward_candle(x);
    }
    let (_, _, h, w) = x.dims4()?;
    let (_, _, kh, kw) = conv.weight().dims4()?;
    let p = cfg.padding;
    let span = |n: usize, k: usize| {
        let reach = cfg.dilation * (k - 1) + 1;
        let out = (n + 2 * p).saturating_sub(reach) / cfg.stride + 1;
        (out - 1) * cfg.stride + reach
    };
    let xp = x.pad_with_zeros(2, p, p)?.pad_with_zeros(3, p, p)?;
    let xp = xp.narrow(2, 0, span(h, kh))?.narrow(3, 0, span(w, kw))?;
    let y = xp.conv2d(conv.weight(), 0, cfg.stride, cfg.dilation, cfg.groups)?;
    match conv.bias() {
        Some(b) => y.broadcast_add(&b.reshape((1, b.dim(0)?, 1, 1))?),
        None => Ok(y),
    }
}
