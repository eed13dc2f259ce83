//! The end-of-run summary of `annotate` (also written as `summary.json`).
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Per-stage numbers of a run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StageSummary {
    /// Items finished ok in this run.
    pub done: usize,
    /// Items skipped because an earlier run finished them.
    pub skipped: usize,
    /// Items that failed in this run.
    pub failed: usize,
    /// Items skipped because an earlier run recorded them as failed (see `--retry-failed`).
    pub skipped_failed: usize,
    /// Items the stage's cadence (`every = K`) passed over, in this run or an earlier one.
    #[serde(default)]
    pub cadence_skipped: usize,
    /// Seconds the model of this stage was computing (batches including its pre/postprocessing).
    pub model_s: f64,
    /// Seconds spent producing and writing this stage's outputs, summed over writer threads.
    pub write_s: f64,
    /// Outputs of this stage produced by each model.
    pub by_model: BTreeMap<String, usize>,
    /// Whether this run loaded a model for this stage (false when no batch needed one, e.g. every
    /// input was already done; always false for `edges`).
    #[serde(default)]
    pub model_loaded: bool,
}

impl StageSummary {
    /// Adds what another pass of this stage did: items done and failed, model and write time,
    /// outputs per model.
    pub(crate) fn add_work(&mut self, other: StageSummary) {
        self.done += other.done;
        self.failed += other.failed;
        self.model_s += other.model_s;
        self.write_s += other.write_s;
        for (m, c) in other.by_model {
            *self.by_model.entry(m).or_default() += c;
        }
    }
}

/// A failed item.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Failure {
    /// Stage.
    pub stage: String,
    /// Input path (relative).
    pub input: String,
    /// Why.
    pub reason: String,
}

/// The end-of-run summary (`summary.json`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Input directory.
    pub input_dir: String,
    /// Output directory.
    pub output_dir: String,
    /// `K/N`.
    pub shard: String,
    /// Inputs listed (all shards).
    pub listed: usize,
    /// Inputs of this shard.
    pub in_shard: usize,
    /// Inputs with at least one stage run in this run.
    pub processed: usize,
    /// Inputs whose every stage was already recorded.
    pub skipped: usize,
    /// Inputs with a failed stage in this run.
    pub failed: usize,
    /// Whether the input list came from the cache.
    pub listing_cached: bool,
    /// Seconds listing the inputs and reading journals.
    pub setup_s: f64,
    /// Seconds loading models.
    pub load_s: f64,
    /// Seconds from the first batch read to the last record written.
    pub pipeline_s: f64,
    /// Total wall seconds.
    pub wall_s: f64,
    /// `processed / pipeline_s`.
    pub images_per_s: f64,
    /// Seconds any model was computing.
    pub model_busy_s: f64,
    /// `model_busy_s / pipeline_s`: how much of the pipeline's time the model was busy.
    pub model_busy_fraction: f64,
    /// `model_busy_s / wall_s` (wall time including listing and model loading).
    pub model_busy_fraction_wall: f64,
    /// Seconds the inference thread waited for decoded batches.
    pub wait_input_s: f64,
    /// Seconds the inference thread waited for writer capacity (the disk).
    pub wait_output_s: f64,
    /// Seconds reading and decoding, summed over decode threads.
    pub decode_s: f64,
    /// Per stage.
    pub stages: BTreeMap<String, StageSummary>,
    /// Failures of this run (at most 1000 listed; see the journals for all).
    pub failures: Vec<Failure>,
    /// Files the listing could not include.
    pub unlisted: Vec<String>,
    /// Stale temp files removed at startup.
    pub stale_temps_removed: usize,
}

impl Summary {
    /// Human-readable lines.
    pub fn render(&self) -> String {
        let mut s = format!(
            "annotate {} → {} (shard {}): {} inputs in shard ({} listed), {} processed, {} already done, {} failed\n",
            self.input_dir, self.output_dir, self.shard, self.in_shard, self.listed, self.processed, self.skipped, self.failed
        );
        for (name, st) in &self.stages {
            let model = if name == "edges" { format!("{:>9}", "-") } else { format!("{:>8.2}s", st.model_s) };
            s += &format!(
                "  {name:<13} done {:>6}  skipped {:>6}  failed {:>4}{}  model {model}  write {:>7.2}s\n",
                st.done,
                st.skipped,
                st.failed,
                if st.skipped_failed > 0 { format!(" (+{} earlier)", st.skipped_failed) } else { String::new() },
                st.write_s
            );
        }
        s += &format!(
            "  wall {:.2}s (setup {:.2}s, model load {:.2}s, pipeline {:.2}s): {:.2} img/s, model busy {:.0}% of the pipeline \
             ({:.0}% of the wall) time; it waited {:.2}s for input, {:.2}s for the disk",
            self.wall_s,
            self.setup_s,
            self.load_s,
            self.pipeline_s,
            self.images_per_s,
            100.0 * self.model_busy_fraction,
            100.0 * self.model_busy_fraction_wall,
            self.wait_input_s,
            self.wait_output_s
        );
        for f in self.failures.iter().take(10) {
            s += &format!("\n  failed: {} [{}]: {}", f.input, f.stage, f.reason);
        }
        if self.failures.len() > 10 {
            s += &format!("\n  … {} more failures in summary.json and the journals", self.failures.len() - 10);
        }
        s
    }
}
