//! Activations named as in transformers' `ACT2FN`.
use candle_core::{Module, Tensor};

use crate::error::{Error, Result};

/// An activation function chosen by its transformers name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// Exact (erf) GELU: `gelu`.
    Gelu,
    /// Tanh-approximated GELU: `gelu_new`, `gelu_pytorch_tanh`.
    GeluTanh,
    /// `silu` / `swish`.
    Silu,
    /// `relu`.
    Relu,
}

impl Activation {
    /// Parses a transformers activation name.
    pub(crate) fn from_name(name: &str) -> Result<Self> {
        Ok(match name {
            "gelu" => Activation::Gelu,
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Activation::GeluTanh,
            "silu" | "swish" => Activation::Silu,
            "relu" => Activation::Relu,
            other => return Err(Error::Config(format!("unsupported activation `{other}`"))),
        })
    }
}

impl Module for Activation {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Activation::Gelu => gelu_erf(x),
            Activation::GeluTanh => x.gelu(),
            Activation::Silu => x.silu(),
            Activation::Relu => x.relu(),
        }
    }
}

/// Exact (erf) GELU: the parallel vectorised kernel for f32 CPU inference, Candle's op otherwise
/// (other devices and dtypes, and while autograd records, for its backward).
pub fn gelu_erf(x: &Tensor) -> candle_core::Result<Tensor> {
    if !x.device().is_cpu() || x.dtype() != candle_core::DType::F32 {
        return x.gelu_erf();
    }
    if x.track_op() {
        return x.contiguous()?.apply_op1_arc(std::sync::Arc::new(Box::new(TrainGelu)));
    }
    let mapped = crate::kernels::cpu_slice::with_contiguous(x, |src: &[f32]| {
        let mut out = vec![0f32; src.len()];
        crate::kernels::fast_math::gelu_erf_map(src, &mut out);
        out
    })?;
    match mapped {
        Some(out) => Tensor::from_vec(out, x.shape(), x.device()),
        None => x.gelu_erf(),
    }
}

/// Exact GELU for f32 CPU training: the vectorised forward and a one-pass backward (Candle's is
/// seven element-wise ops).
struct TrainGelu;

impl candle_core::CustomOp1 for TrainGelu {
    fn name(&self) -> &'static str {
        "train-gelu-erf"
    }

    fn cpu_fwd(&self, s: &candle_core::CpuStorage, l: &candle_core::Layout) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let x = crate::kernels::cpu_slice::contiguous_f32(s, l)?;
        let mut y = vec![0f32; x.len()];
        crate::profile::tally("gelu forward", || crate::kernels::fast_math::gelu_erf_map(x, &mut y));
        Ok((candle_core::CpuStorage::F32(y), l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, gy: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let dx = crate::kernels::cpu_slice::with_f32_pair(x, &gy.to_dtype(candle_core::DType::F32)?, |xs, dy| {
            if xs.len() != dy.len() {
                candle_core::bail!("gelu backward: input {:?} and gradient {:?} differ", x.dims(), gy.dims());
            }
            let mut dx = vec![0f32; xs.len()];
            crate::profile::tally("gelu backward", || crate::kernels::fast_math::gelu_erf_grad_map(xs, dy, &mut dx));
            Ok(dx)
        })?;
        Tensor::from_vec(dx, x.shape(), x.device()).map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var};

    /// The training GELU's gradient against central differences of Candle's f64 GELU.
    #[test]
    fn the_training_gelu_gradient_matches_finite_differences_in_f64() {
        let dev = Device::Cpu;
        let xs: Vec<f32> = (0..81).map(|i| (i as f32 - 40.0) / 8.0).collect();
        let x = Var::from_vec(xs.clone(), 81, &dev).unwrap();
        let y = gelu_erf(x.as_tensor()).unwrap();
        let got = y.sum_all().unwrap().backward().unwrap().get(x.as_tensor()).unwrap().to_vec1::<f32>().unwrap();
        let x64 = Tensor::from_vec(xs.iter().map(|&v| v as f64).collect::<Vec<_>>(), 81, &dev).unwrap();
        let h = 1e-6;
        let fd = ((x64.affine(1.0, h).unwrap().gelu_erf().unwrap() - x64.affine(1.0, -h).unwrap().gelu_erf().unwrap()).unwrap() / (2.0 * h)).unwrap();
        for (g, want) in got.iter().zip(fd.to_vec1::<f64>().unwrap()) {
            assert!((*g as f64 - want).abs() <= 1e-4 * want.abs().max(1.0), "{g} vs {want}");
        }
        let direct = y.to_dtype(DType::F64).unwrap() - x64.gelu_erf().unwrap();
        assert!(direct.unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f64>().unwrap() < 1e-5);
    }
}
