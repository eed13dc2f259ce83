//! An exponential moving average of the weights exactly as timm's `ModelEmaV3` keeps it:
//! `decay(step)` with optional warm-up `1 − (1 + t/γ)^(−p)` (t = step − update_after_step − 1,
//! decay 0 — a copy — while t ≤ 0), clamped to [min_decay, decay]; `ema ← lerp(ema, model, 1 − decay)`.
use std::collections::HashMap;

use candle_core::{DType, Tensor};

use crate::error::{Error, Result};

/// EMA settings (defaults: timm's).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EmaConfig {
    /// Target decay.
    pub decay: f64,
    /// Lower bound of the warmed-up decay.
    pub min_decay: f64,
    /// Ramp the decay up with the step.
    pub use_warmup: bool,
    /// Warm-up γ.
    pub warmup_gamma: f64,
    /// Warm-up power.
    pub warmup_power: f64,
    /// Steps before the average starts (it copies the weights until then).
    pub update_after_step: u64,
}

impl Default for EmaConfig {
    fn default() -> Self {
        EmaConfig { decay: 0.9999, min_decay: 0.0, use_warmup: false, warmup_gamma: 1.0, warmup_power: 2.0 / 3.0, update_after_step: 0 }
    }
}

/// The averaged copies (f32, detached) of named tensors.
pub struct Ema {
    values: Vec<(String, Tensor)>,
    cfg: EmaConfig,
}

impl Ema {
    /// Starts the average at the current `params`.
    pub fn new(params: &[(String, Tensor)], cfg: EmaConfig) -> Result<Self> {
        let values = params.iter().map(|(n, t)| Ok((n.clone(), t.detach().to_dtype(DType::F32)?.copy()?))).collect::<Result<_>>()?;
        Ok(Ema { values, cfg })
    }

    /// timm's `get_decay(step)`.
    pub(crate) fn decay_at(&self, step: u64) -> f64 {
        let t = step.saturating_sub(self.cfg.update_after_step + 1);
        if t == 0 {
            return 0.0;
        }
        if self.cfg.use_warmup {
            let d = 1.0 - (1.0 + t as f64 / self.cfg.warmup_gamma).powf(-self.cfg.warmup_power);
            d.min(self.cfg.decay).max(self.cfg.min_decay)
        } else {
            self.cfg.decay
        }
    }

    /// Moves the average towards `params` (same names and order as at creation) for optimiser
    /// step `step` (1 after the first step, as timm's training loop counts).
    pub fn update(&mut self, params: &[(String, Tensor)], step: u64) -> Result<()> {
        if params.len() != self.values.len() {
            return Err(Error::Input(format!("EMA of {} tensors updated with {}", self.values.len(), params.len())));
        }
        let w = 1.0 - self.decay_at(step);
        for ((name, ema), (pname, p)) in self.values.iter_mut().zip(params) {
            if name != pname {
                return Err(Error::Input(format!("EMA tensor `{name}` updated with `{pname}`")));
            }
            let p = p.detach().to_dtype(DType::F32)?;
            // torch.lerp: start + w·(end − start) for w < 0.5, else end − (end − start)·(1 − w).
            let diff = (&p - &*ema)?;
            *ema = if w < 0.5 { (&*ema + (diff * w)?)? } else { (p - (diff * (1.0 - w))?)? };
        }
        Ok(())
    }

    /// The averaged tensors.
    pub fn tensors(&self) -> &[(String, Tensor)] {
        &self.values
    }

    /// Restores saved averages (every name present, shapes matching).
    pub fn load(&mut self, tensors: &HashMap<String, Tensor>) -> Result<()> {
        for (name, v) in self.values.iter_mut() {
            let t = tensors.get(name).ok_or_else(|| Error::Input(format!("EMA state has no `{name}`")))?;
            if t.dims() != v.dims() {
                return Err(Error::Input(format!("EMA state `{name}` has shape {:?}, expected {:?}", t.dims(), v.dims())));
            }
            *v = t.to_dtype(DType::F32)?.to_device(v.device())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decay_follows_timm() {
        let e = Ema { values: vec![], cfg: EmaConfig { decay: 0.999, use_warmup: true, ..Default::default() } };
        assert_eq!(e.decay_at(1), 0.0, "the first update copies");
        assert!((e.decay_at(2) - (1.0 - 2f64.powf(-2.0 / 3.0))).abs() < 1e-15);
        assert_eq!(e.decay_at(10_000_000), 0.999);
        let late = Ema { values: vec![], cfg: EmaConfig { update_after_step: 5, ..Default::default() } };
        assert_eq!(late.decay_at(6), 0.0);
        assert_eq!(late.decay_at(7), 0.9999);
    }
}
