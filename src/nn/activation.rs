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
    pub fn from_name(name: &str) -> Result<Self> {
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
            Activation::Gelu => x.gelu_erf(),
            Activation::GeluTanh => x.gelu(),
            Activation::Silu => x.silu(),
            Activation::Relu => x.relu(),
        }
    }
}
