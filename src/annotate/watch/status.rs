//! What a watch run shows: `<output_dir>/status.json` (replaced atomically every
//! `status_interval_s`) and the progress line: queue depth, frames done / failed / skipped,
//! per-stage latency from arrival to output (p50 / p95), throughput, the models and devices in use.
use std::collections::{BTreeMap, VecDeque};
use std::path::Path;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::annotate::config::StageKind;
use crate::annotate::journal::unix_ms;
use crate::error::{Error, Result};

/// Latency samples kept per stage (the latest).
const SAMPLES: usize = 10_000;
/// Window of the recent throughput, seconds.
const RATE_WINDOW_S: f64 = 60.0;

/// Per-stage numbers of the status file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StageStatus {
    /// Frames recorded ok by this run.
    pub done: usize,
    /// Frames recorded failed by this run.
    pub failed: usize,
    /// Seconds from a frame's arrival to this stage's record, median (latest samples).
    pub latency_p50_s: f64,
    /// The same, 95th percentile.
    pub latency_p95_s: f64,
    /// Samples behind the percentiles.
    pub latency_samples: usize,
    /// The model batches go to first (empty until loaded; none for edges).
    pub model: String,
    /// Its device.
    pub device: String,
}

/// `status.json`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WatchStatus {
    /// `watching`, `stopping` (a signal: the batch in flight finishes) or `finished`.
    pub state: String,
    /// Input directory.
    pub input_dir: String,
    /// How files are noticed: `inotify` or `poll`.
    pub backend: String,
    /// `newest` or `oldest`.
    pub order: String,
    /// Frames waiting to be processed.
    pub queue: usize,
    /// Files seen but not yet complete.
    pub settling: usize,
    /// Frames that joined the queue.
    pub arrived: usize,
    /// Frames with every stage recorded ok.
    pub done: usize,
    /// Frames with a failed stage.
    pub failed: usize,
    /// Frames recorded skipped over `--max-backlog`.
    pub skipped_backlog: usize,
    /// Complete frames found already done by an earlier run.
    pub already_done: usize,
    /// Frames finished per second over the last minute.
    pub frames_per_s: f64,
    /// Frames finished per second since the start.
    pub frames_per_s_total: f64,
    /// Seconds since the start.
    pub uptime_s: f64,
    /// When this file was written (ms since the epoch).
    pub updated_unix_ms: u64,
    /// Per stage.
    pub stages: BTreeMap<String, StageStatus>,
}

/// Collects what the status shows.
pub(crate) struct Tracker {
    start: Instant,
    latencies: BTreeMap<StageKind, VecDeque<f64>>,
    finished_at: VecDeque<Instant>,
    /// The status as last updated.
    pub s: WatchStatus,
}

/// The `q` quantile of `v` (nearest rank); 0 when empty.
pub(crate) fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = (q * s.len() as f64).ceil() as usize;
    s[rank.clamp(1, s.len()) - 1]
}

impl Tracker {
    /// A tracker for the stages.
    pub(crate) fn new(base: WatchStatus, stages: &[StageKind]) -> Self {
        let mut s = base;
        for k in stages {
            s.stages.insert(k.name().to_string(), StageStatus::default());
        }
        Tracker { start: Instant::now(), latencies: stages.iter().map(|k| (*k, VecDeque::new())).collect(), finished_at: VecDeque::new(), s }
    }

    /// One (item, stage) record written at `at` for a frame that arrived at `arrived`.
    pub(crate) fn recorded(&mut self, stage: StageKind, arrived: Instant, at: Instant, ok: bool) {
        let st = self.s.stages.entry(stage.name().to_string()).or_default();
        if ok {
            st.done += 1;
        } else {
            st.failed += 1;
        }
        let l = self.latencies.entry(stage).or_default();
        if l.len() == SAMPLES {
            l.pop_front();
        }
        l.push_back(at.saturating_duration_since(arrived).as_secs_f64());
    }

    /// A frame finished (every stage recorded).
    pub(crate) fn frame_finished(&mut self, failed: bool) {
        if failed {
            self.s.failed += 1;
        } else {
            self.s.done += 1;
        }
        self.finished_at.push_back(Instant::now());
    }

    /// Refreshes the derived numbers.
    pub(crate) fn update(&mut self, models: &BTreeMap<StageKind, (String, String)>) {
        let now = Instant::now();
        while self.finished_at.front().is_some_and(|t| now.duration_since(*t).as_secs_f64() > RATE_WINDOW_S) {
            self.finished_at.pop_front();
        }
        let up = now.duration_since(self.start).as_secs_f64();
        self.s.uptime_s = up;
        self.s.frames_per_s = self.finished_at.len() as f64 / up.clamp(1e-3, RATE_WINDOW_S);
        self.s.frames_per_s_total = if up > 0.0 { (self.s.done + self.s.failed) as f64 / up } else { 0.0 };
        self.s.updated_unix_ms = unix_ms();
        for (k, l) in &self.latencies {
            let v: Vec<f64> = l.iter().copied().collect();
            let st = self.s.stages.entry(k.name().to_string()).or_default();
            st.latency_p50_s = quantile(&v, 0.5);
            st.latency_p95_s = quantile(&v, 0.95);
            st.latency_samples = v.len();
            if let Some((m, d)) = models.get(k) {
                st.model = m.clone();
                st.device = d.clone();
            }
        }
    }

    /// Writes `status<tag>.json` into `output` atomically.
    pub(crate) fn write(&self, output: &Path, tag: &str) -> Result<()> {
        let json = serde_json::to_vec_pretty(&self.s).map_err(|e| Error::Config(e.to_string()))?;
        crate::fsutil::write_atomic(output.join(format!("status{tag}.json")), &json)
    }

    /// The progress line: the same numbers in one line.
    pub(crate) fn line(&self) -> String {
        let s = &self.s;
        let mut out = format!(
            "queue {}{}, done {}, failed {}, skipped {}, {:.2} frames/s",
            s.queue,
            if s.settling > 0 { format!(" (+{} being written)", s.settling) } else { String::new() },
            s.done,
            s.failed,
            s.skipped_backlog,
            s.frames_per_s
        );
        for (name, st) in &s.stages {
            if st.latency_samples > 0 {
                out += &format!("; {name} p50 {:.2}s p95 {:.2}s", st.latency_p50_s, st.latency_p95_s);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_by_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.5), 50.0);
        assert_eq!(quantile(&v, 0.95), 95.0);
        assert_eq!(quantile(&[3.0], 0.95), 3.0);
        assert_eq!(quantile(&[], 0.5), 0.0);
    }
}
