//! Feedback: a progress bar with rate and ETA on a terminal, plain periodic lines otherwise (stderr),
//! and the end-of-run summary (also written as `summary.json`).
use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

static BAR_ON_SCREEN: AtomicBool = AtomicBool::new(false);

/// Prints a message line on stderr without breaking the progress bar.
pub fn log(msg: &str) {
    let mut e = std::io::stderr().lock();
    if BAR_ON_SCREEN.swap(false, Ordering::Relaxed) {
        let _ = write!(e, "\r\x1b[2K");
    }
    let _ = writeln!(e, "annotate: {msg}");
}

/// How progress is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// A redrawn bar (terminals).
    Bar,
    /// A line every interval.
    Lines,
    /// Nothing.
    None,
}

impl Mode {
    /// From the config value (`auto` picks by whether stderr is a terminal).
    pub fn from_config(s: &str) -> Mode {
        match s {
            "bar" => Mode::Bar,
            "lines" => Mode::Lines,
            "none" => Mode::None,
            _ if std::io::stderr().is_terminal() => Mode::Bar,
            _ => Mode::Lines,
        }
    }
}

fn hms(s: f64) -> String {
    if !s.is_finite() {
        return "?".into();
    }
    let s = s.round() as u64;
    if s >= 3600 {
        format!("{}h{:02}m", s / 3600, s / 60 % 60)
    } else if s >= 60 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        format!("{s}s")
    }
}

/// Counts finished items and draws progress.
pub struct Progress {
    mode: Mode,
    total: usize,
    done: usize,
    failed: usize,
    start: Instant,
    last: Instant,
    interval: Duration,
}

impl Progress {
    /// Progress over `total` items.
    pub fn new(mode: Mode, total: usize, interval: Duration) -> Self {
        let now = Instant::now();
        Progress { mode, total, done: 0, failed: 0, start: now, last: now, interval }
    }

    /// One item finished (all its pending stages recorded); `failed` if any stage failed.
    pub fn item_done(&mut self, failed: bool) {
        self.done += 1;
        self.failed += failed as usize;
    }

    fn line(&self) -> String {
        let el = self.start.elapsed().as_secs_f64();
        let rate = if el > 0.0 { self.done as f64 / el } else { 0.0 };
        let eta = if rate > 0.0 { (self.total - self.done.min(self.total)) as f64 / rate } else { f64::INFINITY };
        let pct = if self.total > 0 { 100.0 * self.done as f64 / self.total as f64 } else { 100.0 };
        let failed = if self.failed > 0 { format!(", {} failed", self.failed) } else { String::new() };
        match self.mode {
            Mode::Bar => {
                const W: usize = 28;
                let fill = (W * self.done.min(self.total)).checked_div(self.total).unwrap_or(W);
                format!(
                    "[{}{}] {}/{} {pct:.0}% {rate:.2} img/s {} ETA {}{failed}",
                    "#".repeat(fill),
                    ".".repeat(W - fill),
                    self.done,
                    self.total,
                    hms(el),
                    hms(eta)
                )
            }
            _ => format!("{}/{} items ({pct:.1}%), {rate:.2} img/s, elapsed {}, ETA {}{failed}", self.done, self.total, hms(el), hms(eta)),
        }
    }

    /// Redraws when due (bar: 5 times a second; lines: every interval).
    pub fn tick(&mut self) {
        let every = match self.mode {
            Mode::None => return,
            Mode::Bar => Duration::from_millis(200),
            Mode::Lines => self.interval,
        };
        if self.last.elapsed() < every {
            return;
        }
        self.last = Instant::now();
        self.draw();
    }

    fn draw(&self) {
        let mut e = std::io::stderr().lock();
        match self.mode {
            Mode::Bar => {
                let _ = write!(e, "\r\x1b[2Kannotate {}", self.line());
                let _ = e.flush();
                BAR_ON_SCREEN.store(true, Ordering::Relaxed);
            }
            Mode::Lines => {
                let _ = writeln!(e, "annotate: {}", self.line());
            }
            Mode::None => {}
        }
    }

    /// Final redraw (ends the bar's line).
    pub fn finish(&mut self) {
        if self.mode == Mode::Bar {
            self.draw();
            let _ = writeln!(std::io::stderr());
            BAR_ON_SCREEN.store(false, Ordering::Relaxed);
        }
    }
}

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
