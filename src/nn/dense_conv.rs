//! The differentiable dense conv of f32 CPU training: the forward by the inference kernels
//! ([`crate::kernels::conv2d::conv_f32`]), the backward by [`crate::kernels::conv_grad`] (Candle's
//! own conv backward runs a transposed conv, 2–3× slower, and derives one axis's padding from the
//! other). Each gradient is computed only for an operand that records.
use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};

use crate::kernels::conv2d::Dense;
use crate::kernels::conv_grad::{bias_grad, input_grad, weight_grad};
use crate::kernels::cpu_slice::{contiguous_f32, with_f32, with_f32_pair};

/// Whether [`conv`] runs `x` by `w` (f32 on the CPU, one group, no dilation).
pub(crate) fn applies(x: &Tensor, w: &Tensor, groups: usize, dilation: usize) -> bool {
    x.device().is_cpu() && x.dtype() == DType::F32 && w.dtype() == DType::F32 && groups == 1 && dilation == 1 && x.rank() == 4 && w.rank() == 4
}

/// `conv(x, w) + bias` with zero padding `pad` and `stride`, differentiable in all three; the
/// caller checks [`applies`].
pub(crate) fn conv(x: &Tensor, w: &Tensor, bias: Option<&Tensor>, pad: usize, stride: usize) -> Result<Tensor> {
    let ((b, c, h, wd), (o, wc, kh, kw)) = (x.dims4()?, w.dims4()?);
    if wc != c {
        candle_core::bail!("conv2d: input has {c} channels, the weight expects {wc}");
    }
    let g = Dense { b, c, h, w: wd, o, kh, kw, pad, stride };
    if stride == 0 || g.output().is_none() {
        candle_core::bail!("conv2d: a {kh}×{kw} kernel (stride {stride}) does not fit a {h}×{wd} input padded by {pad}");
    }
    let op = DenseConv(g);
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    match bias {
        Some(bias) => x.apply_op3_arc(&w, &bias.contiguous()?, std::sync::Arc::new(Box::new(op))),
        None => x.apply_op2_arc(&w, std::sync::Arc::new(Box::new(op))),
    }
}

/// The op: its geometry (the operands' shapes are checked against it).
struct DenseConv(Dense);

impl DenseConv {
    fn forward(&self, operands: &[(&CpuStorage, &Layout)]) -> Result<(CpuStorage, Shape)> {
        let g = &self.0;
        let xs = contiguous_f32(operands[0].0, operands[0].1)?;
        let ws = contiguous_f32(operands[1].0, operands[1].1)?;
        let bias = operands.get(2).map(|&(s, l)| contiguous_f32(s, l)).transpose()?;
        let Some((oh, ow)) = g.output() else { candle_core::bail!("dense conv: the kernel does not fit the input") };
        match crate::profile::tally("conv forward", || crate::kernels::conv2d::conv_f32(g, xs, ws, bias)) {
            Some(y) => Ok((CpuStorage::F32(y), Shape::from((g.b, g.o, oh, ow)))),
            None => candle_core::bail!("dense conv: operand sizes do not match {g:?}"),
        }
    }

    /// The gradients of the input, weight and bias that record.
    fn backward(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>, gy: &Tensor) -> Result<[Option<Tensor>; 3]> {
        let g = &self.0;
        let Some((oh, ow)) = g.output() else { candle_core::bail!("dense conv: the kernel does not fit the input") };
        let dev = x.device();
        let gy = gy.to_dtype(DType::F32)?.contiguous()?;
        let sizes = || candle_core::Error::Msg(format!("dense conv backward: operand sizes do not match {g:?}"));
        let gx = if x.track_op() {
            let v = crate::profile::tally("conv backward: input", || with_f32_pair(w, &gy, |ws, dy| input_grad(g, ws, dy).ok_or_else(sizes)))?;
            Some(Tensor::from_vec(v, (g.b, g.c, g.h, g.w), dev)?)
        } else {
            None
        };
        let gw = if w.track_op() {
            let v = crate::profile::tally("conv backward: weight", || with_f32_pair(x, &gy, |xs, dy| weight_grad(g, xs, dy).ok_or_else(sizes)))?;
            Some(Tensor::from_vec(v, (g.o, g.c, g.kh, g.kw), dev)?)
        } else {
            None
        };
        let gb = match bias {
            Some(b) if b.track_op() => Some(Tensor::from_vec(with_f32(&gy, |dy| Ok(bias_grad(g.b, g.o, oh * ow, dy)))?, g.o, dev)?),
            _ => None,
        };
        Ok([gx, gw, gb])
    }
}

impl CustomOp2 for DenseConv {
    fn name(&self) -> &'static str {
        "dense-conv2d"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        self.forward(&[(s1, l1), (s2, l2)])
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _y: &Tensor, gy: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let [gx, gw, _] = self.backward(x, w, None, gy)?;
        Ok((gx, gw))
    }
}

impl CustomOp3 for DenseConv {
    fn name(&self) -> &'static str {
        "dense-conv2d-bias"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout, s3: &CpuStorage, l3: &Layout) -> Result<(CpuStorage, Shape)> {
        self.forward(&[(s1, l1), (s2, l2), (s3, l3)])
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, bias: &Tensor, _y: &Tensor, gy: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let [gx, gw, gb] = self.backward(x, w, Some(bias), gy)?;
        Ok((gx, gw, gb))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_values::spread;
    use candle_core::{Device, Var};

    /// The dense op's gradients equal Candle's conv backward's (in f64, where Candle's is exact
    /// for these stride-1 and evenly strided shapes), and nothing is computed for what does not record.
    #[test]
    fn gradients_equal_candles_conv_backward() {
        let dev = Device::Cpu;
        for (i, &(c, h, w, o, k, pad, stride)) in [(3, 8, 8, 4, 3, 1, 1), (4, 6, 6, 5, 1, 0, 1), (2, 9, 9, 3, 3, 1, 2)].iter().enumerate() {
            let x = Var::from_tensor(&spread((2, c, h, w), 1 + i as u64, &dev)).unwrap();
            let wt = Var::from_tensor(&spread((o, c, k, k), 5 + i as u64, &dev)).unwrap();
            let bias = Var::from_tensor(&spread(o, 9 + i as u64, &dev)).unwrap();
            let y = conv(x.as_tensor(), wt.as_tensor(), Some(bias.as_tensor()), pad, stride).unwrap();
            let gy = spread(y.dims(), 13 + i as u64, &dev);
            let grads = (&y * &gy).unwrap().sum_all().unwrap().backward().unwrap();
            let f64v = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
            let (x64, w64, b64) = (Var::from_tensor(&f64v(x.as_tensor())).unwrap(), Var::from_tensor(&f64v(wt.as_tensor())).unwrap(), Var::from_tensor(&f64v(bias.as_tensor())).unwrap());
            let y64 = x64.as_tensor().conv2d(w64.as_tensor(), pad, stride, 1, 1).unwrap().broadcast_add(&b64.as_tensor().reshape((1, o, 1, 1)).unwrap()).unwrap();
            let reference = (&y64 * f64v(&gy)).unwrap().sum_all().unwrap().backward().unwrap();
            assert!((f64v(&y) - &y64).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f64>().unwrap() < 1e-4);
            for (got, want) in [(&x, &x64), (&wt, &w64), (&bias, &b64)] {
                let (g, r) = (f64v(grads.get(got.as_tensor()).unwrap()), reference.get(want.as_tensor()).unwrap());
                let err = (&g - r).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f64>().unwrap();
                let scale = r.abs().unwrap().max_all().unwrap().to_scalar::<f64>().unwrap().max(1.0);
                assert!(err <= 1e-4 * scale, "case {i}: gradient error {err}");
            }
        }
    }

    #[test]
    fn operands_that_do_not_record_get_no_gradient() {
        let dev = Device::Cpu;
        let x = spread((1, 3, 6, 6), 1, &dev);
        let wt = Var::from_tensor(&spread((2, 3, 3, 3), 2, &dev)).unwrap();
        let y = conv(&x, wt.as_tensor(), None, 1, 1).unwrap();
        let grads = y.sum_all().unwrap().backward().unwrap();
        assert!(grads.get(&x).is_none());
        assert!(grads.get(wt.as_tensor()).is_some());
    }
}
