//! One-cycle learning rate exactly as `torch.optim.lr_scheduler.OneCycleLR` computes it, indexed by
//! the optimiser step it applies to (step k uses the schedule after k scheduler steps).
use crate::error::{Error, Result};

/// How each phase interpolates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Anneal {
    /// `end + (start − end)/2 · (1 + cos(π·pct))`.
    Cos,
    /// `start + (end − start)·pct`.
    Linear,
}

/// One-cycle settings. Defaults are PyTorch's, except `cycle_momentum` (off here).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OneCycleConfig {
    /// Peak learning rate.
    pub max_lr: f64,
    /// Optimiser steps in the cycle.
    pub total_steps: usize,
    /// Fraction of the steps spent increasing the rate.
    pub pct_start: f64,
    /// `initial_lr = max_lr / div_factor`.
    pub div_factor: f64,
    /// `min_lr = initial_lr / final_div_factor`.
    pub final_div_factor: f64,
    /// Interpolation.
    pub anneal: Anneal,
    /// Up, down to the initial rate, then down to the minimum (the original paper).
    pub three_phase: bool,
    /// Cycle AdamW's β1 inversely to the rate.
    pub cycle_momentum: bool,
    /// β1 at the peak rate.
    pub base_momentum: f64,
    /// β1 at the start and end.
    pub max_momentum: f64,
}

impl Default for OneCycleConfig {
    fn default() -> Self {
        OneCycleConfig {
            max_lr: 1e-3,
            total_steps: 1,
            pct_start: 0.3,
            div_factor: 25.0,
            final_div_factor: 1e4,
            anneal: Anneal::Cos,
            three_phase: false,
            cycle_momentum: false,
            base_momentum: 0.85,
            max_momentum: 0.95,
        }
    }
}

/// A phase: ends at `end_step`, interpolating (lr, momentum) from `start` to `end`.
#[derive(Debug, Clone, Copy)]
struct Phase {
    end_step: f64,
    lr: (f64, f64),
    momentum: (f64, f64),
}

/// The schedule.
#[derive(Debug, Clone)]
pub struct OneCycle {
    cfg: OneCycleConfig,
    phases: Vec<Phase>,
}

impl OneCycle {
    /// Builds the phases; refuses what PyTorch refuses (no steps, `pct_start` outside [0, 1]).
    pub fn new(cfg: OneCycleConfig) -> Result<Self> {
        if cfg.total_steps == 0 {
            return Err(Error::Config("one-cycle schedule: total_steps must be positive".into()));
        }
        if !(0.0..=1.0).contains(&cfg.pct_start) {
            return Err(Error::Config(format!("one-cycle schedule: pct_start {} is outside [0, 1]", cfg.pct_start)));
        }
        let initial = cfg.max_lr / cfg.div_factor;
        let min = initial / cfg.final_div_factor;
        let total = cfg.total_steps as f64;
        let (lo, hi) = (cfg.base_momentum, cfg.max_momentum);
        let up = cfg.pct_start * total - 1.0;
        let phases = if cfg.three_phase {
            vec![
                Phase { end_step: up, lr: (initial, cfg.max_lr), momentum: (hi, lo) },
                Phase { end_step: 2.0 * cfg.pct_start * total - 2.0, lr: (cfg.max_lr, initial), momentum: (lo, hi) },
                Phase { end_step: total - 1.0, lr: (initial, min), momentum: (hi, hi) },
            ]
        } else {
            vec![
                Phase { end_step: up, lr: (initial, cfg.max_lr), momentum: (hi, lo) },
                Phase { end_step: total - 1.0, lr: (cfg.max_lr, min), momentum: (lo, hi) },
            ]
        };
        Ok(OneCycle { cfg, phases })
    }

    fn anneal(&self, (start, end): (f64, f64), pct: f64) -> f64 {
        match self.cfg.anneal {
            Anneal::Cos => end + (start - end) / 2.0 * ((std::f64::consts::PI * pct).cos() + 1.0),
            Anneal::Linear => (end - start) * pct + start,
        }
    }

    /// (lr, momentum) after `step` scheduler steps; past `total_steps` is an error, as in PyTorch.
    fn at(&self, step: usize) -> Result<(f64, f64)> {
        if step > self.cfg.total_steps {
            return Err(Error::Config(format!("one-cycle schedule stepped {step} times; it has {} steps", self.cfg.total_steps)));
        }
        let s = step as f64;
        let mut start = 0.0;
        for (i, p) in self.phases.iter().enumerate() {
            if s <= p.end_step || i == self.phases.len() - 1 {
                let pct = (s - start) / (p.end_step - start);
                return Ok((self.anneal(p.lr, pct), self.anneal(p.momentum, pct)));
            }
            start = p.end_step;
        }
        Err(Error::Config("one-cycle schedule has no phases".into()))
    }

    /// The learning rate of optimiser step `step` (0-based).
    pub fn lr(&self, step: usize) -> Result<f64> {
        Ok(self.at(step)?.0)
    }

    /// AdamW's β1 for step `step` when momentum cycles, else None.
    pub fn momentum(&self, step: usize) -> Result<Option<f64>> {
        Ok(if self.cfg.cycle_momentum { Some(self.at(step)?.1) } else { None })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_low_peaks_at_max_and_refuses_to_run_past_the_end() {
        let s = OneCycle::new(OneCycleConfig { max_lr: 1.0, total_steps: 10, ..Default::default() }).unwrap();
        assert!((s.lr(0).unwrap() - 1.0 / 25.0).abs() < 1e-15);
        assert!((s.lr(2).unwrap() - 1.0).abs() < 1e-15, "peak at pct_start·total − 1");
        assert!((s.lr(9).unwrap() - 1.0 / 25.0 / 1e4).abs() < 1e-15);
        assert!(s.lr(10).is_ok() && s.lr(11).is_err());
        assert_eq!(s.momentum(0).unwrap(), None);
        assert!(OneCycle::new(OneCycleConfig { total_steps: 0, ..Default::default() }).is_err());
    }
}
