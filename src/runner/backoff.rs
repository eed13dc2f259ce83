//! Out-of-memory back-off. A forward pass that fails for lack of memory ([`Error::OutOfMemory`]) is
//! retried on the same items with half the batch (after synchronising the device, so freed buffers
//! are back in the pool); after [`GROW_AFTER`] passes without running out, the batch doubles again
//! up to its cap; at batch 1 the item fails with the reason and the run goes on. No item is lost or
//! done twice.
//!
//! A CPU allocation failure aborts the process (Rust cannot catch it), so the back-off is tested
//! through a hook: with `EDGERUN_INJECT_OOM_ABOVE=N` set, every forward pass over more than `N`
//! items fails as a device that runs out of memory does.
use std::sync::OnceLock;

use candle_core::Device;

use crate::error::{Error, Result};

/// Passes without running out of memory before the batch grows again.
pub(crate) const GROW_AFTER: usize = 4;

/// The environment variable of the injection hook.
pub(crate) const INJECT_ENV: &str = "EDGERUN_INJECT_OOM_ABOVE";

/// An error that may be a device running out of memory (the back-off halves the batch on one).
pub trait MemoryFailure {
    /// Whether it is.
    fn is_out_of_memory(&self) -> bool;
}

impl MemoryFailure for Error {
    fn is_out_of_memory(&self) -> bool {
        matches!(self, Error::OutOfMemory(_))
    }
}

fn inject_limit() -> Option<usize> {
    static LIMIT: OnceLock<Option<usize>> = OnceLock::new();
    *LIMIT.get_or_init(|| std::env::var(INJECT_ENV).ok().and_then(|v| v.trim().parse().ok()))
}

/// The injection hook: call before every forward pass over `items` items.
pub fn check_injected_oom(items: usize) -> Result<()> {
    match inject_limit() {
        Some(limit) if items > limit => Err(Error::OutOfMemory(format!(
            "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\") (injected: a forward pass over {items} items, {INJECT_ENV}={limit})"
        ))),
        _ => Ok(()),
    }
}

/// A batch size that halves when a pass runs out of memory and grows back after successes.
#[derive(Debug, Clone)]
pub struct AdaptiveBatch {
    cap: usize,
    current: usize,
    streak: usize,
}

impl AdaptiveBatch {
    /// Starts at `cap` (at least 1).
    pub fn new(cap: usize) -> Self {
        let cap = cap.max(1);
        AdaptiveBatch { cap, current: cap, streak: 0 }
    }

    /// The batch the next pass takes.
    pub fn current(&self) -> usize {
        self.current
    }

    /// The planned cap.
    pub fn cap(&self) -> usize {
        self.cap
    }

    /// Changes the cap (a new plan, e.g. for another input size); the batch never exceeds it.
    pub(crate) fn set_cap(&mut self, cap: usize) {
        self.cap = cap.max(1);
        self.current = self.current.min(self.cap);
    }

    /// Runs `items` through `f` in passes of at most [`current`](Self::current) items and returns
    /// one result per item, in order. `device` is synchronised after a memory failure; `log` gets every batch change. A pass that fails for another reason is retried item by
    /// item, so one bad item does not fail its neighbours. `f` must return one result per item
    /// (`wrong_count` makes the error when it does not).
    pub fn run<T, R, E: MemoryFailure>(
        &mut self,
        items: &[T],
        device: Option<&Device>,
        wrong_count: impl Fn(usize, usize) -> E,
        log: &mut dyn FnMut(String),
        mut f: impl FnMut(&[T]) -> std::result::Result<Vec<R>, E>,
    ) -> Vec<std::result::Result<R, E>> {
        let mut out = Vec::with_capacity(items.len());
        let mut start = 0;
        let sync = || {
            if let Some(d) = device {
                let _ = d.synchronize();
            }
        };
        while start < items.len() {
            let n = self.current.min(items.len() - start);
            let chunk = &items[start..start + n];
            match f(chunk) {
                Ok(rs) if rs.len() == n => {
                    out.extend(rs.into_iter().map(Ok));
                    start += n;
                    self.streak += 1;
                    if self.streak >= GROW_AFTER && self.current < self.cap {
                        let grown = self.current.saturating_mul(2).min(self.cap);
                        log(format!("batch {} → {grown} after {} passes without running out of memory", self.current, self.streak));
                        self.current = grown;
                        self.streak = 0;
                    }
                }
                Ok(rs) => {
                    out.extend((0..n).map(|_| Err(wrong_count(rs.len(), n))));
                    start += n;
                }
                Err(e) if e.is_out_of_memory() && n > 1 => {
                    let halved = (n / 2).max(1);
                    log(format!("out of memory on a batch of {n}: batch {n} → {halved}, retrying the same items"));
                    self.current = halved;
                    self.streak = 0;
                    sync();
                }
                Err(e) if n == 1 => {
                    if e.is_out_of_memory() {
                        log("out of memory at batch 1: the item is recorded as failed".into());
                        self.streak = 0;
                        sync();
                    }
                    out.push(Err(e));
                    start += 1;
                }
                Err(_) => {
                    for it in chunk {
                        let r = f(std::slice::from_ref(it)).and_then(|mut r| match (r.pop(), r.is_empty()) {
                            (Some(x), true) => Ok(x),
                            (x, _) => Err(wrong_count(r.len() + usize::from(x.is_some()), 1)),
                        });
                        if r.as_ref().err().is_some_and(MemoryFailure::is_out_of_memory) {
                            sync();
                        }
                        out.push(r);
                    }
                    start += n;
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A test error: out of memory, or another failure.
    #[derive(Debug, Clone, PartialEq)]
    enum Fail {
        Oom,
        Bad(String),
    }

    impl MemoryFailure for Fail {
        fn is_out_of_memory(&self) -> bool {
            *self == Fail::Oom
        }
    }

    /// A pass fails for lack of memory above `limit` items; the item 999 is a bad input.
    fn model(limit: usize, calls: &mut Vec<Vec<u32>>) -> impl FnMut(&[u32]) -> std::result::Result<Vec<u32>, Fail> + '_ {
        move |xs: &[u32]| {
            calls.push(xs.to_vec());
            if xs.len() > limit {
                return Err(Fail::Oom);
            }
            if xs.contains(&999) {
                return Err(Fail::Bad("bad item 999".into()));
            }
            Ok(xs.iter().map(|x| x * 10).collect())
        }
    }

    /// Per item its result, then the items of each pass, then the log lines.
    type Outcome = (Vec<std::result::Result<u32, Fail>>, Vec<Vec<u32>>, Vec<String>);

    fn run(b: &mut AdaptiveBatch, items: &[u32], limit: usize) -> Outcome {
        let mut calls = Vec::new();
        let mut logs = Vec::new();
        let r = b.run(items, None, |g, w| Fail::Bad(format!("{g} for {w}")), &mut |m| logs.push(m), model(limit, &mut calls));
        (r, calls, logs)
    }

    #[test]
    fn halves_on_oom_retries_the_same_items_and_loses_none() {
        let mut b = AdaptiveBatch::new(8);
        let items: Vec<u32> = (0..20).collect();
        let (r, calls, logs) = run(&mut b, &items, 3);
        assert_eq!(r, items.iter().map(|x| Ok(x * 10)).collect::<Vec<_>>());
        assert_eq!(calls[0], (0..8).collect::<Vec<_>>());
        assert_eq!(calls[1], (0..4).collect::<Vec<_>>());
        assert_eq!(calls[2], (0..2).collect::<Vec<_>>());
        // Every item succeeded exactly once.
        let mut done: Vec<u32> = calls.iter().filter(|c| c.len() <= 3).flatten().copied().collect();
        done.sort();
        assert_eq!(done, items);
        assert!(logs.iter().any(|l| l.contains("batch 8 → 4")), "{logs:?}");
        assert!(logs.iter().any(|l| l.contains("batch 4 → 2")), "{logs:?}");
        // After GROW_AFTER good passes it tried 4 again, ran out, and went back to 2.
        assert!(logs.iter().any(|l| l.contains("batch 2 → 4 after 4 passes")), "{logs:?}");
        assert!(b.current() <= 4);
    }

    #[test]
    fn grows_back_to_the_cap_when_memory_allows() {
        let mut b = AdaptiveBatch::new(8);
        let (_, _, _) = run(&mut b, &(0..8).collect::<Vec<_>>(), 1);
        assert!(b.current() <= 2);
        let (r, _, logs) = run(&mut b, &(0..64).collect::<Vec<_>>(), 100);
        assert!(r.iter().all(|x| x.is_ok()));
        assert_eq!(b.current(), 8, "{logs:?}");
    }

    #[test]
    fn fails_an_item_at_batch_one_and_goes_on() {
        let mut b = AdaptiveBatch::new(4);
        let (r, _, logs) = run(&mut b, &[1, 2, 3], 0);
        assert!(r.iter().all(|x| x.as_ref().is_err_and(MemoryFailure::is_out_of_memory)), "{r:?}");
        assert!(logs.iter().any(|l| l.contains("recorded as failed")));
    }

    #[test]
    fn a_bad_item_fails_alone_without_changing_the_batch() {
        let mut b = AdaptiveBatch::new(4);
        let (r, _, logs) = run(&mut b, &[11, 12, 999, 14, 15], 10);
        assert_eq!(r, vec![Ok(110), Ok(120), Err(Fail::Bad("bad item 999".into())), Ok(140), Ok(150)]);
        assert_eq!(b.current(), 4);
        assert!(logs.is_empty(), "{logs:?}");
    }

    #[test]
    fn candle_oom_errors_become_out_of_memory_through_wrapping() {
        let oom = candle_core::Error::Msg("DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")".into());
        assert!(Error::from(oom.context("in the backbone")).is_out_of_memory());
        assert!(Error::from(candle_core::Error::Msg("CUBLAS_STATUS_ALLOC_FAILED".into())).is_out_of_memory());
        assert!(!Error::Input("out of memory".into()).is_out_of_memory());
        assert!(!Error::from(candle_core::Error::Msg("shape mismatch".into())).is_out_of_memory());
        assert!(check_injected_oom(0).is_ok());
    }
}
