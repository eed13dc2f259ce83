//! AdamW exactly as `torch.optim.AdamW` computes it (single-tensor path, `amsgrad=False`):
//! `p ← p·(1 − lr·wd)`, `m ← lerp(m, g, 1 − β1)`, `v ← β2·v + (1 − β2)·g²`,
//! `p ← p − lr/(1 − β1ᵗ) · m / (√v / √(1 − β2ᵗ) + ε)`.
use std::collections::HashMap;

use candle_core::{DType, Tensor, Var};

use super::grads::Grads;
use crate::error::{Error, Result};

/// AdamW hyper-parameters (defaults: PyTorch's).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    /// Learning rate.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Denominator epsilon.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 1e-2 }
    }
}

/// The optimiser: named parameters and their f32 moments.
pub struct AdamW {
    params: Vec<(String, Var)>,
    exp_avg: Vec<Tensor>,
    exp_avg_sq: Vec<Tensor>,
    cfg: AdamWConfig,
    steps: u64,
}

impl AdamW {
    /// An optimiser over `params` with zeroed moments.
    pub fn new(params: Vec<(String, Var)>, cfg: AdamWConfig) -> Result<Self> {
        let zeros = params.iter().map(|(_, p)| Ok(Tensor::zeros(p.shape(), DType::F32, p.device())?)).collect::<Result<Vec<_>>>()?;
        Ok(AdamW { exp_avg: zeros.clone(), exp_avg_sq: zeros, params, cfg, steps: 0 })
    }

    /// The parameters, in the order gradients are given.
    pub fn params(&self) -> &[(String, Var)] {
        &self.params
    }

    /// Sets the learning rate of the next step.
    pub fn set_lr(&mut self, lr: f64) {
        self.cfg.lr = lr;
    }

    /// Sets β1 of the next step (one-cycle momentum cycling).
    pub(crate) fn set_beta1(&mut self, beta1: f64) {
        self.cfg.beta1 = beta1;
    }

    /// One optimiser step with the accumulated `grads`.
    pub fn step(&mut self, grads: &Grads) -> Result<()> {
        self.steps += 1;
        let AdamWConfig { lr, beta1, beta2, eps, weight_decay } = self.cfg;
        let t = self.steps as i32;
        let step_size = lr / (1.0 - beta1.powi(t));
        let bc2_sqrt = (1.0 - beta2.powi(t)).sqrt();
        for (i, (name, p)) in self.params.iter().enumerate() {
            let g = grads.get(i).ok_or_else(|| Error::Input(format!("parameter `{name}` has no gradient for this step")))?.to_dtype(DType::F32)?;
            let m = &self.exp_avg[i];
            let m = (m + ((&g - m)? * (1.0 - beta1))?)?;
            let v = ((&self.exp_avg_sq[i] * beta2)? + (g.sqr()? * (1.0 - beta2))?)?;
            let denom = ((v.sqrt()? / bc2_sqrt)? + eps)?;
            let decayed = (p.as_tensor().detach().to_dtype(DType::F32)? * (1.0 - lr * weight_decay))?;
            let updated = (decayed - ((&m / denom)? * step_size)?)?;
            p.set(&updated.to_dtype(p.dtype())?)?;
            self.exp_avg[i] = m;
            self.exp_avg_sq[i] = v;
        }
        Ok(())
    }

    /// Steps taken (PyTorch's `state["step"]`).
    pub fn step_count(&self) -> u64 {
        self.steps
    }

    /// The moments as named tensors (`exp_avg.<param>`, `exp_avg_sq.<param>`).
    pub fn state(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::with_capacity(2 * self.params.len());
        for (i, (n, _)) in self.params.iter().enumerate() {
            out.push((format!("exp_avg.{n}"), self.exp_avg[i].clone()));
            out.push((format!("exp_avg_sq.{n}"), self.exp_avg_sq[i].clone()));
        }
        out
    }

    /// Restores moments saved by [`AdamW::state`] and the step count; names what is missing or misshaped.
    pub(crate) fn load_state(&mut self, tensors: &HashMap<String, Tensor>, step_count: u64) -> Result<()> {
        for (i, (n, p)) in self.params.iter().enumerate() {
            for (key, slot) in [(format!("exp_avg.{n}"), &mut self.exp_avg[i]), (format!("exp_avg_sq.{n}"), &mut self.exp_avg_sq[i])] {
                let t = tensors.get(&key).ok_or_else(|| Error::Input(format!("optimiser state has no `{key}`")))?;
                if t.dims() != p.dims() {
                    return Err(Error::Input(format!("optimiser state `{key}` has shape {:?}, the parameter {:?}", t.dims(), p.dims())));
                }
                *slot = t.to_dtype(DType::F32)?.to_device(p.device())?;
            }
        }
        self.steps = step_count;
        Ok(())
    }
}
