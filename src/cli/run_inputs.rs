//! The loop of the direct commands (`depth`, `segment`, `chm`, `edges`): inputs taken a batch at a
//! time, every failure reported with its reason and the run carried on (or stopped, with
//! `--fail-fast`), progress on stderr, and a summary at the end. Any failure makes the exit code 2.
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use edgerun::inputs::InputItem;
use edgerun::progress::{log, Mode, Progress};

use super::common::UsageError;

/// How a run goes.
pub struct RunSpec {
    /// The command's name (log prefix).
    pub command: &'static str,
    /// Largest number of inputs per forward pass.
    pub batch: usize,
    /// Stop at the first failure, with its error.
    pub fail_fast: bool,
    /// Progress display.
    pub progress: Mode,
}

/// Parses `--progress`.
pub fn progress_mode(s: &str) -> anyhow::Result<Mode> {
    Mode::parse(s).ok_or_else(|| UsageError(format!("--progress `{s}`: expected auto, bar, lines or none")).into())
}

/// Where an item's output with `suffix` goes (`OUT/<out_stem><suffix>`), its directory created.
pub fn output_path(out: &Path, item: &InputItem, suffix: &str) -> anyhow::Result<PathBuf> {
    let p = out.join(format!("{}{suffix}", item.out_stem));
    if let Some(dir) = p.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create output directory {}", dir.display()))?;
    }
    Ok(p)
}

/// Creates the output directory.
pub fn create_out_dir(dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create output directory {}", dir.display()))
}

struct Tally {
    command: &'static str,
    fail_fast: bool,
    progress: Progress,
    done: usize,
    failed: Vec<(PathBuf, String)>,
}

impl Tally {
    /// Records a failed item; with `--fail-fast` it ends the run with `e`.
    fn fail(&mut self, item: &InputItem, e: anyhow::Error) -> anyhow::Result<()> {
        if self.fail_fast {
            return Err(e.context(format!("{} failed (--fail-fast)", item.path.display())));
        }
        let msg = super::message(&e);
        let why = msg.strip_prefix(&format!("{}: ", item.path.display())).unwrap_or(&msg).to_string();
        log(self.command, &format!("FAILED {}: {why}", item.path.display()));
        self.failed.push((item.path.clone(), why));
        self.progress.item_done(true);
        Ok(())
    }

    fn ok(&mut self) {
        self.done += 1;
        self.progress.item_done(false);
        self.progress.tick();
    }

    /// Prints the summary; any failure is an error (exit code 2).
    fn finish(mut self, start: Instant) -> anyhow::Result<()> {
        self.progress.finish();
        let secs = start.elapsed().as_secs_f64();
        let rate = if secs > 0.0 { self.done as f64 / secs } else { 0.0 };
        let msg = format!("{} done, {} failed, {secs:.2} s, {rate:.2} images/s", self.done, self.failed.len());
        log(self.command, &msg);
        if self.failed.is_empty() {
            return Ok(());
        }
        for (p, why) in self.failed.iter().take(20) {
            log(self.command, &format!("  failed: {}: {why}", p.display()));
        }
        if self.failed.len() > 20 {
            log(self.command, &format!("  … and {} more (listed above)", self.failed.len() - 20));
        }
        Err(UsageError(format!("{} of {} inputs failed (listed above)", self.failed.len(), self.failed.len() + self.done)).into())
    }
}

/// Runs `items` through `load` (per item: decoding), `predict` (per batch of loaded items) and
/// `write` (per item). A failed load or write fails that item; a failed batch is retried item by
/// item so that one bad input does not fail its neighbours. A device error or an I/O error while
/// writing (a full disk) ends the run.
pub fn run_items<L, P>(
    spec: &RunSpec,
    items: &[InputItem],
    mut load: impl FnMut(&InputItem) -> anyhow::Result<L>,
    mut predict: impl FnMut(&[&InputItem], &[&L]) -> anyhow::Result<Vec<P>>,
    mut write: impl FnMut(&InputItem, &L, P) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let start = Instant::now();
    let progress = Progress::new(spec.command, spec.progress, items.len(), Duration::from_secs(10));
    let mut t = Tally { command: spec.command, fail_fast: spec.fail_fast, progress, done: 0, failed: Vec::new() };
    let mut pending: Vec<&InputItem> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        match &item.problem {
            Some(why) => t.fail(item, edgerun::Error::bad_file(&item.path, why.clone()).into())?,
            None => pending.push(item),
        }
        if pending.len() < spec.batch.max(1) && i + 1 < items.len() {
            continue;
        }
        let mut loaded = Vec::with_capacity(pending.len());
        for it in pending.drain(..) {
            match load(it) {
                Ok(l) => loaded.push((it, l)),
                Err(e) => t.fail(it, e)?,
            }
        }
        if loaded.is_empty() {
            continue;
        }
        let (batch_items, batch_data): (Vec<&InputItem>, Vec<&L>) = loaded.iter().map(|(it, l)| (*it, l)).unzip();
        let results = match predict(&batch_items, &batch_data) {
            Ok(r) if r.len() == loaded.len() => r.into_iter().map(Ok).collect(),
            Ok(r) => anyhow::bail!("{}: {} results for {} inputs (a bug)", spec.command, r.len(), loaded.len()),
            Err(e) if loaded.len() == 1 || spec.fail_fast => vec![Err(e)],
            // One input may have failed the whole batch: each is tried alone.
            Err(_) => loaded.iter().map(|(it, l)| predict(&[*it], &[l]).and_then(|mut r| r.pop().context("no result"))).collect(),
        };
        for ((it, l), r) in loaded.iter().zip(results) {
            match r.and_then(|p| write(it, l, p)) {
                Ok(()) => t.ok(),
                // A device or disk failure would fail every later item the same way.
                Err(e) if matches!(super::exit_code(&e), 3 | 4) => return Err(e.context(format!("{} stopped at {}", spec.command, it.path.display()))),
                Err(e) => t.fail(it, e)?,
            }
        }
    }
    t.finish(start)
}
