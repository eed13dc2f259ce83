//! The one item runner: how many items a forward pass takes and what happens when a pass runs out
//! of memory, for the direct commands, `annotate`'s stages and the tiles of a large raster alike.
//! [`plan`] holds the settings (`--batch`, `--mem-budget`), [`backoff`] the halving and regrowing
//! batch, and [`ItemRunner`] puts them together: it plans ("a fixed batch, or the budget divided by
//! the per-item estimate"), logs the plan, and runs items in passes that back off. [`passes`] keeps
//! the log that lets a run killed for memory be followed by one that takes less per pass.
pub(crate) mod backoff;
pub mod passes;
pub mod plan;

pub use backoff::{check_injected_oom, AdaptiveBatch, MemoryFailure};
pub use passes::{PassLog, Recovery, KILLED_FOR_MEMORY};
pub use plan::{BatchSetting, MemoryBudget};

/// Plans batches and runs items through a model in passes that back off when memory runs out.
#[derive(Debug, Clone)]
pub struct ItemRunner {
    setting: BatchSetting,
    budget: MemoryBudget,
    batch: AdaptiveBatch,
    planned: Option<usize>,
    /// At most this many per pass, whatever the plan (after a run killed for memory).
    ceiling: Option<usize>,
}

impl ItemRunner {
    /// A runner for `setting` within `budget`, one item per pass until [`ItemRunner::plan`] runs.
    pub fn new(setting: BatchSetting, budget: MemoryBudget) -> Self {
        ItemRunner { setting, budget, batch: AdaptiveBatch::new(1), planned: None, ceiling: None }
    }

    /// A runner of at most `n` items per pass.
    pub fn fixed(n: usize) -> Self {
        ItemRunner { setting: BatchSetting::Fixed(n), budget: MemoryBudget::FALLBACK, batch: AdaptiveBatch::new(n), planned: Some(n), ceiling: None }
    }

    /// Never more than `n` per pass from now on (a [`Recovery::ceiling`]), whatever the plan.
    pub fn limit_to(&mut self, n: usize) {
        let n = n.max(1);
        self.ceiling = Some(self.ceiling.map_or(n, |c| c.min(n)));
        self.batch.set_cap(self.batch.cap().min(n));
    }

    /// The memory budget it plans with.
    pub fn budget(&self) -> MemoryBudget {
        self.budget
    }

    /// The batch the settings allow for items of at most `per_item` estimated bytes (`None`: the
    /// model cannot tell, so one item per pass under `auto`), and under `auto` at most `most`.
    /// Under `auto` the test hook `EDGERUN_PLAN_BATCH` replaces the budget's plan; a
    /// [`ItemRunner::limit_to`] ceiling bounds every plan.
    pub fn cap_for(&self, per_item: Option<u64>, most: usize) -> usize {
        let cap = match (self.setting, per_item, plan::forced_plan()) {
            (BatchSetting::Fixed(n), _, _) => n,
            (BatchSetting::Auto, _, Some(n)) => n.min(most.max(1)),
            (BatchSetting::Auto, None | Some(0), _) => 1,
            (BatchSetting::Auto, Some(b), _) => self.budget.batch_for(BatchSetting::Auto, b).min(most.max(1)),
        };
        self.ceiling.map_or(cap, |c| cap.min(c))
    }

    /// Plans the next passes for items of at most `per_item` bytes ([`ItemRunner::cap_for`]) and
    /// returns the cap; under `auto`, a changed plan is logged.
    pub fn plan(&mut self, per_item: Option<u64>, most: usize, log: &mut dyn FnMut(String)) -> usize {
        let cap = self.cap_for(per_item, most);
        if self.planned != Some(cap) && self.setting == BatchSetting::Auto {
            let mib = |b: u64| b as f64 / f64::from(1u32 << 20);
            let forced = if plan::forced_plan().is_some() { format!(" (forced by {})", plan::FORCE_PLAN_ENV) } else { String::new() };
            let ceiling = match self.ceiling {
                Some(c) if cap == c => format!(", at most {c} after a run killed for memory"),
                _ => String::new(),
            };
            log(format!(
                "batch auto: up to {cap} per pass{forced} (budget {:.0} MiB, about {:.0} MiB per image{ceiling})",
                mib(self.budget.bytes),
                mib(per_item.unwrap_or(0))
            ));
        }
        match self.planned.replace(cap) {
            // The first plan starts there; later ones never exceed it (the batch may be below
            // it after running out of memory, and grows back by itself).
            None => self.batch = AdaptiveBatch::new(cap),
            Some(_) => self.batch.set_cap(cap),
        }
        cap
    }

    /// The batch the next pass takes (the plan, or less after running out of memory).
    pub fn current(&self) -> usize {
        self.batch.current()
    }

    /// The batch that runs the passes ([`AdaptiveBatch::run`]: one result per item, in order; a
    /// pass that runs out of memory retried on the same items with half the batch).
    pub fn batch(&mut self) -> &mut AdaptiveBatch {
        &mut self.batch
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_a_fixed_batch_or_the_budget_over_the_estimate_and_logs_changes() {
        let mut logs = Vec::new();
        let mut auto = ItemRunner::new(BatchSetting::Auto, MemoryBudget { bytes: 1000 << 20 });
        assert_eq!(auto.plan(Some(300 << 20), 64, &mut |m| logs.push(m)), 3);
        assert_eq!(auto.plan(Some(300 << 20), 64, &mut |m| logs.push(m)), 3);
        assert_eq!(auto.plan(Some(300 << 20), 2, &mut |m| logs.push(m)), 2);
        assert_eq!(auto.plan(None, 64, &mut |m| logs.push(m)), 1);
        assert_eq!(logs.len(), 3, "{logs:?}");
        assert!(logs[0].contains("up to 3 per pass (budget 1000 MiB, about 300 MiB per image)"), "{logs:?}");
        let mut fixed = ItemRunner::new(BatchSetting::Fixed(7), MemoryBudget { bytes: 1 });
        assert_eq!(fixed.plan(Some(1 << 40), 2, &mut |m| logs.push(m)), 7);
        assert_eq!(logs.len(), 3, "a fixed batch is not logged");
        assert_eq!(ItemRunner::fixed(5).current(), 5);
    }

    #[test]
    fn a_ceiling_bounds_every_plan_fixed_or_auto() {
        let mut logs = Vec::new();
        let mut auto = ItemRunner::new(BatchSetting::Auto, MemoryBudget { bytes: 1000 << 20 });
        auto.limit_to(2);
        assert_eq!(auto.plan(Some(100 << 20), 64, &mut |m| logs.push(m)), 2);
        assert!(logs[0].contains("at most 2 after a run killed for memory"), "{logs:?}");
        assert_eq!(auto.current(), 2);
        let mut fixed = ItemRunner::fixed(8);
        fixed.limit_to(4);
        fixed.limit_to(6);
        assert_eq!((fixed.cap_for(None, 64), fixed.current()), (4, 4));
    }
}
