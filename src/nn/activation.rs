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
    if !x.device().is_cpu() || x.dtype() != candle_core::DType::F32 || x.track_op() {
        return x.gelu_erf();
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
