//! Ops whose fast kernels record no backward (fused LayerNorm, `softmax_last_dim`, bilinear
//! upsampling): while autograd records through their inputs, f32 CPU tensors take one op each with
//! its own one-pass backward (LayerNorm, bilinear), other devices and dtypes a differentiable path
//! built from Candle ops; otherwise the fast kernel, so inference speed is unchanged.
use candle_core::{CpuStorage, DType, Layout, Module, Shape, Tensor, D};
use candle_nn::LayerNorm;

use candle_core::Result;

use crate::kernels::cpu_slice::{contiguous_f32, with_f32, with_f32_pair};

/// Whether a backward pass could reach through `t` (a trainable `Var`, or computed from one).
pub fn records(t: &Tensor) -> bool {
    t.track_op()
}

/// LayerNorm over the last dimension; the unfused formula when `x` or the norm's parameters record
/// (or in f64, which the fused kernel lacks).
pub fn layer_norm(norm: &LayerNorm, x: &Tensor) -> Result<Tensor> {
    let recording = records(x) || records(norm.weight()) || norm.bias().is_some_and(records) || x.dtype() == DType::F64;
    match (recording, norm.bias()) {
        (true, Some(bias)) if norm.remove_mean() && [x, norm.weight(), bias].iter().all(|t| t.device().is_cpu() && t.dtype() == DType::F32) => {
            let op = TrainLayerNorm { eps: norm.eps() as f32 };
            x.contiguous()?.apply_op3_arc(&norm.weight().contiguous()?, &bias.contiguous()?, std::sync::Arc::new(Box::new(op)))
        }
        (true, Some(bias)) if norm.remove_mean() => candle_nn::ops::layer_norm_slow(x, norm.weight(), bias, norm.eps() as f32),
        _ => norm.forward(x),
    }
}

/// Bilinear resize of f32 CPU maps for training: the inference kernel forward, its transpose (each
/// output gradient back onto its four source samples) as the backward, instead of two dense
/// interpolation matmuls each way.
struct TrainBilinear {
    size: (usize, usize),
    align_corners: bool,
}

impl candle_core::CustomOp1 for TrainBilinear {
    fn name(&self) -> &'static str {
        "train-bilinear"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (b, c, h, w) = l.shape().dims4()?;
        let (oh, ow) = self.size;
        let src = contiguous_f32(s, l)?;
        let y = crate::profile::tally("bilinear forward", || crate::kernels::bilinear_cpu::resize(src, (h, w), self.size, self.align_corners));
        Ok((CpuStorage::F32(y), Shape::from((b, c, oh, ow))))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, gy: &Tensor) -> Result<Option<Tensor>> {
        let (_, _, h, w) = x.dims4()?;
        let gy = gy.to_dtype(DType::F32)?;
        let gx = with_f32(&gy, |dy| Ok(crate::profile::tally("bilinear backward", || crate::kernels::bilinear_cpu::resize_backward(dy, (h, w), self.size, self.align_corners))))?;
        Tensor::from_vec(gx, x.shape(), x.device()).map(Some)
    }
}

/// LayerNorm `(x, gamma, beta)` over the last dimension with its one-pass backward
/// ([`crate::kernels::layer_norm_train`]), for f32 CPU training.
struct TrainLayerNorm {
    eps: f32,
}

impl candle_core::CustomOp3 for TrainLayerNorm {
    fn name(&self) -> &'static str {
        "train-layer-norm"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout, s3: &CpuStorage, l3: &Layout) -> Result<(CpuStorage, Shape)> {
        let (x, gamma, beta) = (contiguous_f32(s1, l1)?, contiguous_f32(s2, l2)?, contiguous_f32(s3, l3)?);
        match crate::profile::tally("layer norm forward", || crate::kernels::layer_norm_train::forward(x, gamma.len(), gamma, Some(beta), self.eps)) {
            Some(y) => Ok((CpuStorage::F32(y), l1.shape().clone())),
            None => candle_core::bail!("layer norm: input {:?} does not end in the norm's {} values", l1.dims(), gamma.len()),
        }
    }

    fn bwd(&self, x: &Tensor, gamma: &Tensor, beta: &Tensor, _y: &Tensor, gy: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let gs = gamma.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let (dx, dg, db) = with_f32_pair(x, &gy.to_dtype(DType::F32)?, |xs, dy| {
            crate::profile::tally("layer norm backward", || crate::kernels::layer_norm_train::backward(xs, gs.len(), &gs, dy, self.eps))
                .ok_or_else(|| candle_core::Error::Msg(format!("layer norm backward: input {:?} does not end in the norm's {} values", x.dims(), gs.len())))
        })?;
        let keep = |t: &Tensor, g: Vec<f32>| -> Result<Option<Tensor>> { if t.track_op() { Tensor::from_vec(g, t.shape(), t.device()).map(Some) } else { Ok(None) } };
        Ok((keep(x, dx)?, keep(gamma, dg)?, keep(beta, db)?))
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

/// Log-softmax over the channels (dimension 1) of `[B, C, H, W]` scores: one op with a one-pass
/// backward for f32 CPU tensors ([`crate::kernels::log_softmax`]), Candle's formula otherwise.
pub fn log_softmax_channels(x: &Tensor) -> Result<Tensor> {
    if x.device().is_cpu() && x.dtype() == DType::F32 && x.rank() == 4 && x.elem_count() > 0 {
        return x.contiguous()?.apply_op1_arc(std::sync::Arc::new(Box::new(LogSoftmaxChannels)));
    }
    let max = x.max_keepdim(1)?.detach();
    let shifted = x.broadcast_sub(&max)?;
    shifted.broadcast_sub(&shifted.exp()?.sum_keepdim(1)?.log()?)
}

/// Per pixel of `[B, C, H, W]` scores, the log-probability of class `target` (`[B, H, W]`, u32, each
/// `< C`) and the mean log-probability over the classes, each `[B, H, W]`: the cross-entropy's and the
/// label smoothing's terms. On f32 CPU tensors one op whose backward recomputes the probabilities
/// (no `[B, C, H, W]` log-probabilities kept, no scattered gradient of that size); Candle's formula
/// otherwise.
pub fn class_log_probs(x: &Tensor, target: &Tensor) -> Result<(Tensor, Tensor)> {
    let (b, c, h, w) = x.dims4()?;
    if target.dims() != [b, h, w] {
        candle_core::bail!("class targets {:?} do not match scores {:?}", target.dims(), x.dims());
    }
    let target = target.to_dtype(DType::U32)?.contiguous()?;
    if x.device().is_cpu() && x.dtype() == DType::F32 && x.elem_count() > 0 {
        let both = x.contiguous()?.apply_op2_arc(&target, std::sync::Arc::new(Box::new(ClassLogProbs { classes: c })))?;
        return Ok((both.narrow(1, 0, 1)?.squeeze(1)?, both.narrow(1, 1, 1)?.squeeze(1)?));
    }
    let all = log_softmax_channels(x)?;
    Ok((all.gather(&target.unsqueeze(1)?, 1)?.squeeze(1)?, all.mean(1)?))
}

/// [`class_log_probs`] as one op: `(scores, target)` → `[B, 2, H, W]`.
struct ClassLogProbs {
    classes: usize,
}

impl candle_core::CustomOp2 for ClassLogProbs {
    fn name(&self) -> &'static str {
        "class-log-probs"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (b, c, h, w) = l1.shape().dims4()?;
        let Some((t0, t1)) = l2.contiguous_offsets() else { candle_core::bail!("class targets must be contiguous") };
        let (x, target) = (contiguous_f32(s1, l1)?, &s2.as_slice::<u32>()?[t0..t1]);
        match crate::profile::tally("class log-probs forward", || crate::kernels::log_softmax::target_and_mean(x, target, c, h * w)) {
            Some(y) => Ok((CpuStorage::F32(y), Shape::from((b, 2, h, w)))),
            None => candle_core::bail!("class log-probs: scores {:?} and targets {:?} disagree, or a target is ≥ {}", l1.dims(), l2.dims(), self.classes),
        }
    }

    fn bwd(&self, x: &Tensor, target: &Tensor, _y: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (_, c, h, w) = x.dims4()?;
        let t = target.flatten_all()?.to_vec1::<u32>()?;
        let dx = with_f32_pair(x, &g.to_dtype(DType::F32)?, |xs, dy| {
            crate::profile::tally("class log-probs backward", || crate::kernels::log_softmax::target_and_mean_backward(xs, &t, dy, c, h * w))
                .ok_or_else(|| candle_core::Error::Msg(format!("class log-probs backward: scores {:?} and targets disagree", x.dims())))
        })?;
        Ok((Some(Tensor::from_vec(dx, x.shape(), x.device())?), None))
    }
}

/// [`log_softmax_channels`] as one op.
struct LogSoftmaxChannels;

impl candle_core::CustomOp1 for LogSoftmaxChannels {
    fn name(&self) -> &'static str {
        "log-softmax-channels"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (_, c, h, w) = l.shape().dims4()?;
        let x = contiguous_f32(s, l)?;
        match crate::profile::tally("log-softmax forward", || crate::kernels::log_softmax::forward(x, c, h * w)) {
            Some(y) => Ok((CpuStorage::F32(y), l.shape().clone())),
            None => candle_core::bail!("log-softmax: bad shape {:?}", l.dims()),
        }
    }

    fn bwd(&self, x: &Tensor, logp: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        let (_, c, h, w) = x.dims4()?;
        let dx = with_f32_pair(logp, &g.to_dtype(DType::F32)?, |lp, dy| {
            crate::profile::tally("log-softmax backward", || crate::kernels::log_softmax::backward(lp, dy, c, h * w)).ok_or_else(|| candle_core::Error::Msg(format!("log-softmax backward: bad shape {:?}", x.dims())))
        })?;
        Tensor::from_vec(dx, x.shape(), x.device()).map(Some)
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
    let (_, _, h, w) = x.dims4()?;
    let nonempty = h * w * oh * ow > 0;
    if records(x) && x.device().is_cpu() && x.dtype() == DType::F32 && nonempty {
        x.contiguous()?.apply_op1_arc(std::sync::Arc::new(Box::new(TrainBilinear { size: (oh, ow), align_corners })))
    } else if records(x) {
        bilinear_by_matmul(x, oh, ow, align_corners)
    } else if let Some(y) = crate::kernels::bilinear_cpu::bilinear(x, oh, ow, align_corners)? {
        Ok(y)
    } else {
        x.upsample_bilinear2d(oh, ow, align_corners)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_values::spread;
    use candle_core::{Device, Var};

    fn max_abs(t: &Tensor) -> f64 {
        t.abs().unwrap().max_all().unwrap().to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap()
    }

    /// The f32 training LayerNorm op and Candle's formula in f64: the same output and gradients of
    /// the input, weight and bias.
    #[test]
    fn the_training_layer_norm_equals_the_formula_with_its_gradients() {
        let dev = Device::Cpu;
        let (x, w, bias) = (spread((2, 5, 16), 1, &dev), spread(16, 2, &dev), spread(16, 3, &dev));
        let gy = spread((2, 5, 16), 4, &dev);
        let run = |dt: DType| {
            let vars = [&x, &w, &bias].map(|t| Var::from_tensor(&t.to_dtype(dt).unwrap()).unwrap());
            let norm = LayerNorm::new(vars[1].as_tensor().clone(), vars[2].as_tensor().clone(), 1e-6);
            let y = layer_norm(&norm, vars[0].as_tensor()).unwrap();
            let g = (&y * gy.to_dtype(dt).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
            let grads: Vec<Tensor> = vars.iter().map(|v| g.get(v.as_tensor()).unwrap().to_dtype(DType::F64).unwrap()).collect();
            (y.to_dtype(DType::F64).unwrap(), grads)
        };
        let ((y, g), (y64, g64)) = (run(DType::F32), run(DType::F64));
        assert!(max_abs(&(y - y64).unwrap()) < 1e-5);
        for (got, want) in g.iter().zip(&g64) {
            assert!(max_abs(&(got - want).unwrap()) <= 1e-4 * max_abs(want).max(1.0));
        }
    }

    /// The f32 training resize and the interpolation matmuls in f64: the same output and input
    /// gradient, up and down, with and without aligned corners.
    #[test]
    fn the_training_bilinear_equals_the_matmul_form_with_its_gradient() {
        let dev = Device::Cpu;
        let x = spread((2, 3, 5, 7), 1, &dev);
        for (oh, ow, align) in [(11, 9, false), (11, 9, true), (3, 4, false), (8, 13, true)] {
            let gy = spread((2, 3, oh, ow), 2, &dev);
            let run = |dt: DType, f: &dyn Fn(&Tensor) -> Result<Tensor>| {
                let v = Var::from_tensor(&x.to_dtype(dt).unwrap()).unwrap();
                let y = f(v.as_tensor()).unwrap();
                let g = (&y * gy.to_dtype(dt).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
                (y.to_dtype(DType::F64).unwrap(), g.get(v.as_tensor()).unwrap().to_dtype(DType::F64).unwrap())
            };
            let (y, g) = run(DType::F32, &|t| bilinear(t, oh, ow, align));
            let (y64, g64) = run(DType::F64, &|t| bilinear_by_matmul(t, oh, ow, align));
            assert!(max_abs(&(y - y64).unwrap()) < 1e-5);
            assert!(max_abs(&(&g - &g64).unwrap()) <= 1e-5 * max_abs(&g64).max(1.0), "{oh}×{ow} align {align}");
        }
    }

    /// The f32 log-softmax op over channels and Candle's formula in f64: output and gradient.
    #[test]
    fn the_channel_log_softmax_equals_the_formula_with_its_gradient() {
        let dev = Device::Cpu;
        let x = spread((2, 7, 5, 3), 1, &dev);
        let gy = spread((2, 7, 5, 3), 2, &dev);
        let run = |dt: DType, f: &dyn Fn(&Tensor) -> Result<Tensor>| {
            let v = Var::from_tensor(&x.to_dtype(dt).unwrap()).unwrap();
            let y = f(v.as_tensor()).unwrap();
            let g = (&y * gy.to_dtype(dt).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
            (y.to_dtype(DType::F64).unwrap(), g.get(v.as_tensor()).unwrap().to_dtype(DType::F64).unwrap())
        };
        let (y, g) = run(DType::F32, &log_softmax_channels);
        let (y64, g64) = run(DType::F64, &|t| {
            let shifted = t.broadcast_sub(&t.max_keepdim(1)?.detach())?;
            shifted.broadcast_sub(&shifted.exp()?.sum_keepdim(1)?.log()?)
        });
        assert!(max_abs(&(y - y64).unwrap()) < 1e-5);
        assert!(max_abs(&(&g - &g64).unwrap()) <= 1e-5 * max_abs(&g64).max(1.0));
    }

    /// The fused per-pixel log-probabilities and the log-softmax formula in f64: both outputs and the
    /// gradient through a weighted sum of them.
    #[test]
    fn class_log_probs_equal_the_formula_with_their_gradient() {
        let dev = Device::Cpu;
        let x = spread((2, 5, 3, 4), 1, &dev);
        let target = Tensor::from_vec((0..24u32).map(|i| i * 3 % 5).collect::<Vec<_>>(), (2, 3, 4), &dev).unwrap();
        let (ga, gb) = (spread((2, 3, 4), 2, &dev), spread((2, 3, 4), 3, &dev));
        let run = |dt: DType, fused: bool| {
            let v = Var::from_tensor(&x.to_dtype(dt).unwrap()).unwrap();
            let (a, b) = if fused {
                class_log_probs(v.as_tensor(), &target).unwrap()
            } else {
                let all = log_softmax_channels(v.as_tensor()).unwrap();
                (all.gather(&target.unsqueeze(1).unwrap(), 1).unwrap().squeeze(1).unwrap(), all.mean(1).unwrap())
            };
            let loss = ((&a * ga.to_dtype(dt).unwrap()).unwrap().sum_all().unwrap() + (&b * gb.to_dtype(dt).unwrap()).unwrap().sum_all().unwrap()).unwrap();
            let g = loss.backward().unwrap().get(v.as_tensor()).unwrap().to_dtype(DType::F64).unwrap();
            (a.to_dtype(DType::F64).unwrap(), b.to_dtype(DType::F64).unwrap(), g)
        };
        let ((a, b, g), (a64, b64, g64)) = (run(DType::F32, true), run(DType::F64, false));
        assert!(max_abs(&(a - a64).unwrap()) < 1e-5 && max_abs(&(b - b64).unwrap()) < 1e-5);
        assert!(max_abs(&(&g - &g64).unwrap()) <= 1e-5 * max_abs(&g64).max(1.0));
    }
}
