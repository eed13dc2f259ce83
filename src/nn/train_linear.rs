//! The linear layer of f32 CPU training as one op ([`crate::kernels::linear_train`]): all rows in one
//! GEMM with the bias, a backward of two GEMMs and a column sum, each gradient only for an operand
//! that records.
use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};

use crate::kernels::cpu_slice::{contiguous_f32, with_f32, with_f32_pair};
use crate::kernels::linear_train::{bias_grad, forward, input_grad, weight_grad, Sizes};

/// Whether [`linear`] runs `x` by `w`: f32 on the CPU, something recording.
pub(crate) fn applies(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> bool {
    let f32_cpu = |t: &Tensor| t.device().is_cpu() && t.dtype() == DType::F32;
    f32_cpu(x) && f32_cpu(w) && bias.is_none_or(f32_cpu) && w.rank() == 2 && (x.track_op() || w.track_op() || bias.is_some_and(|b| b.track_op()))
}

/// `x [rows, k] · Wᵀ + bias` → `[rows, n]`, with `w` `[n, k]` (or `[k, n]` when `transposed`).
pub(crate) fn linear(x: &Tensor, w: &Tensor, transposed: bool, bias: Option<&Tensor>) -> Result<Tensor> {
    let (rows, k) = x.dims2()?;
    let (a, b) = w.dims2()?;
    let n = if transposed { b } else { a };
    if (if transposed { a } else { b }) != k {
        candle_core::bail!("linear: input has {k} features, the weight {:?} expects otherwise", w.dims());
    }
    let op = TrainLinear(Sizes { rows, k, n, transposed });
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    match bias {
        Some(b) => x.apply_op3_arc(&w, &b.contiguous()?, std::sync::Arc::new(Box::new(op))),
        None => x.apply_op2_arc(&w, std::sync::Arc::new(Box::new(op))),
    }
}

/// The op: its sizes.
struct TrainLinear(Sizes);

impl TrainLinear {
    fn forward(&self, x: &[f32], w: &[f32], bias: Option<&[f32]>) -> Result<(CpuStorage, Shape)> {
        let s = &self.0;
        match crate::profile::tally("linear forward", || forward(s, x, w, bias)) {
            Some(y) => Ok((CpuStorage::F32(y), Shape::from((s.rows, s.n)))),
            None => candle_core::bail!("linear: operand sizes do not match {s:?}"),
        }
    }

    fn backward(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>, g: &Tensor) -> Result<[Option<Tensor>; 3]> {
        let s = &self.0;
        let g = g.to_dtype(DType::F32)?.contiguous()?;
        let sizes = || candle_core::Error::Msg(format!("linear backward: operand sizes do not match {s:?}"));
        let gx = if x.track_op() {
            let v = crate::profile::tally("linear backward: input", || with_f32_pair(w, &g, |w, g| input_grad(s, w, g).ok_or_else(sizes)))?;
            Some(Tensor::from_vec(v, x.shape(), x.device())?)
        } else {
            None
        };
        let gw = if w.track_op() {
            let v = crate::profile::tally("linear backward: weight", || with_f32_pair(x, &g, |x, g| weight_grad(s, x, g).ok_or_else(sizes)))?;
            Some(Tensor::from_vec(v, w.shape(), w.device())?)
        } else {
            None
        };
        let gb = match bias {
            Some(b) if b.track_op() => Some(Tensor::from_vec(with_f32(&g, |g| Ok(bias_grad(s.n, g)))?, s.n, b.device())?),
            _ => None,
        };
        Ok([gx, gw, gb])
    }
}

impl CustomOp2 for TrainLinear {
    fn name(&self) -> &'static str {
        "train-linear"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        self.forward(contiguous_f32(s1, l1)?, contiguous_f32(s2, l2)?, None)
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _y: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let [gx, gw, _] = self.backward(x, w, None, g)?;
        Ok((gx, gw))
    }
}

impl CustomOp3 for TrainLinear {
    fn name(&self) -> &'static str {
        "train-linear-bias"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout, s3: &CpuStorage, l3: &Layout) -> Result<(CpuStorage, Shape)> {
        self.forward(contiguous_f32(s1, l1)?, contiguous_f32(s2, l2)?, Some(contiguous_f32(s3, l3)?))
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, b: &Tensor, _y: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let [gx, gw, gb] = self.backward(x, w, Some(b), g)?;
        Ok((gx, gw, gb))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_values::spread;
    use candle_core::{Device, Var};

    /// The op and Candle's matmul + bias in f64: the same output and gradients, for a weight held
    /// either way, and no gradient for an operand that does not record.
    #[test]
    fn the_training_linear_equals_candles_ops_with_its_gradients() {
        let dev = Device::Cpu;
        let max_abs = |t: &Tensor| t.abs().unwrap().max_all().unwrap().to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap();
        for transposed in [false, true] {
            let x = Var::from_tensor(&spread((7, 5), 1, &dev)).unwrap();
            let w = Var::from_tensor(&spread(if transposed { (5, 3) } else { (3, 5) }, 2, &dev)).unwrap();
            let b = spread(3, 3, &dev);
            let gy = spread((7, 3), 4, &dev);
            let y = linear(x.as_tensor(), w.as_tensor(), transposed, Some(&b)).unwrap();
            let g = (&y * &gy).unwrap().sum_all().unwrap().backward().unwrap();
            assert!(g.get(&b).is_none());
            let wide = |t: &Tensor| Var::from_tensor(&t.to_dtype(DType::F64).unwrap()).unwrap();
            let (x64, w64) = (wide(x.as_tensor()), wide(w.as_tensor()));
            let wt = if transposed { w64.as_tensor().clone() } else { w64.as_tensor().t().unwrap() };
            let y64 = x64.as_tensor().matmul(&wt).unwrap().broadcast_add(&b.to_dtype(DType::F64).unwrap()).unwrap();
            let g64 = (&y64 * gy.to_dtype(DType::F64).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
            assert!(max_abs(&(y.to_dtype(DType::F64).unwrap() - &y64).unwrap()) < 1e-5);
            for (a, r) in [(&x, &x64), (&w, &w64)] {
                let (ga, gr) = (g.get(a.as_tensor()).unwrap().to_dtype(DType::F64).unwrap(), g64.get(r.as_tensor()).unwrap());
                assert!(max_abs(&(&ga - gr).unwrap()) <= 1e-5 * max_abs(gr).max(1.0));
            }
        }
    }
}
