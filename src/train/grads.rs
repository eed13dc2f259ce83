//! Gradients of the trainable parameters, summed over the micro-batches of one optimiser step, with
//! PyTorch's `clip_grad_norm_`. A parameter that received no gradient is an error naming it: Candle
//! silently drops gradients through some ops, and training would otherwise just not move it.
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

use crate::error::{Error, Result};

/// One accumulated gradient per parameter (f32, detached), in the parameters' order.
pub struct Grads {
    names: Vec<String>,
    vars: Vec<Var>,
    sums: Vec<Option<Tensor>>,
    touched: Vec<bool>,
}

impl Grads {
    /// An empty accumulator for `params`.
    pub fn new(params: &[(String, Var)]) -> Self {
        Grads { names: params.iter().map(|(n, _)| n.clone()).collect(), vars: params.iter().map(|(_, v)| v.clone()).collect(), sums: vec![None; params.len()], touched: vec![false; params.len()] }
    }

    /// Adds one backward pass's gradients; every parameter must have received one. Gradients are
    /// detached: a Var's gradient in a `GradStore` still records the graph it was computed from, and
    /// keeping it would keep every activation alive.
    pub fn accumulate(&mut self, store: &GradStore) -> Result<()> {
        self.add_available(store)?;
        self.finish_pass()
    }

    /// Adds the gradients `store` has (one part of a pass split into pieces, as activation
    /// checkpointing does); [`Grads::finish_pass`] then checks that the parts covered every parameter.
    pub(crate) fn add_available(&mut self, store: &GradStore) -> Result<()> {
        for ((var, sum), touched) in self.vars.iter().zip(self.sums.iter_mut()).zip(self.touched.iter_mut()) {
            let Some(g) = store.get(var.as_tensor()) else { continue };
            let g = g.detach().to_dtype(DType::F32)?;
            *sum = Some(match sum.take() {
                Some(s) => (s + g)?,
                None => g,
            });
            *touched = true;
        }
        Ok(())
    }

    /// Ends a backward pass: an error naming the first parameter that received no gradient in it.
    pub(crate) fn finish_pass(&mut self) -> Result<()> {
        let missing = self.touched.iter().position(|t| !t);
        self.touched.iter_mut().for_each(|t| *t = false);
        match missing {
            Some(i) => Err(Error::Input(format!("parameter `{}` received no gradient (an op on its path records no backward)", self.names[i]))),
            None => Ok(()),
        }
    }

    /// The accumulated gradient of parameter `i`.
    pub fn get(&self, i: usize) -> Option<&Tensor> {
        self.sums.get(i).and_then(Option::as_ref)
    }

    /// `clip_grad_norm_`: the total 2-norm over all gradients; when it exceeds `max_norm`, every
    /// gradient is scaled by `max_norm / (total + 1e-6)`. Returns the total before clipping; a
    /// non-finite total is an error (PyTorch's `error_if_nonfinite=True`).
    pub fn clip_norm(&mut self, max_norm: f64) -> Result<f64> {
        let mut squares = 0f64;
        for s in self.sums.iter().flatten() {
            let n = s.sqr()?.sum_all()?.sqrt()?.to_scalar::<f32>()? as f64;
            squares += n * n;
        }
        let total = squares.sqrt() as f32 as f64;
        if !total.is_finite() {
            return Err(Error::Input(format!("the gradient norm is {total}")));
        }
        let coef = (max_norm / (total + 1e-6)).min(1.0) as f32 as f64;
        if coef < 1.0 {
            for s in self.sums.iter_mut().flatten() {
                *s = (&*s * coef)?;
            }
        }
        Ok(total)
    }

    /// Empties the accumulator for the next step.
    pub fn clear(&mut self) {
        self.sums.iter_mut().for_each(|s| *s = None);
    }
}
