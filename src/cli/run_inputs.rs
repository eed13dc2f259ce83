//! The loop of the direct commands (`depth`, `segment`, `chm`, `edges`): inputs taken a batch at a
//! time, every failure reported with its reason and the run carried on (or stopped, with
//! `--fail-fast`), progress on stderr, and a summary at the end. Any failure makes the exit code 2.
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use candle_core::Device;
use edgerun::inputs::InputItem;
use edgerun::runner::{BatchSetting, ItemRunner, MemoryBudget, MemoryFailure, PassLog, KILLED_FOR_MEMORY};
use edgerun::progress::{log, Mode, Progress};

use super::common::UsageError;

/// How a run goes.
pub struct RunSpec {
    /// The command's name (log prefix).
    pub command: &'static str,
    /// `--batch`: a fixed cap, or planned from the budget.
    pub batch: BatchSetting,
    /// What activations may use (`--mem-budget`, else what the device can spare).
    pub budget: MemoryBudget,
    /// The device the model runs on (synchronised after running out of memory).
    pub device: Device,
    /// Stop at the first failure, with its error.
    pub fail_fast: bool,
    /// Progress display.
    pub progress: Mode,
    /// The state file of the passes ([`PassLog`]), so that a run after a kill for memory takes
    /// less per pass (`None`: not kept).
    pub state: Option<PathBuf>,
}

/// The state file of `command`'s passes in `out` (`OUT/.edgerun-<command>.passes.jsonl`).
pub fn state_file(out: &Path, command: &str) -> PathBuf {
    out.join(format!(".edgerun-{command}.passes.jsonl"))
}

/// The memory budget (`--mem-budget`, else what `device` can spare less the margin); under
/// `--batch auto` where it came from is logged.
pub fn resolve_budget(command: &str, batch: BatchSetting, flag_mib: Option<u64>, device: &Device) -> anyhow::Result<MemoryBudget> {
    let (budget, why) = MemoryBudget::explain(flag_mib, device)?;
    if batch == BatchSetting::Auto {
        log(command, &format!("memory budget {why}"));
    }
    Ok(budget)
}

/// What a run's state file says: the log (when kept), the ceiling its recovery set, and the inputs
/// given up (path → reason).
struct State {
    passes: Option<PassLog>,
    ceiling: Option<usize>,
    given_up: HashMap<String, String>,
}

/// Opens the state file of `spec` when it has one. A state file that cannot be kept is said, and the
/// run goes on without it.
fn open_state(spec: &RunSpec) -> anyhow::Result<State> {
    let none = || State { passes: None, ceiling: None, given_up: HashMap::new() };
    let Some(path) = &spec.state else { return Ok(none()) };
    let (mut passes, rec) = match PassLog::open(path) {
        Ok(x) => x,
        Err(e) => {
            log(spec.command, &format!("not keeping the state of the passes ({e}): a run killed for memory would be retried at the same batch"));
            return Ok(none());
        }
    };
    for n in &rec.notes {
        log(spec.command, n);
    }
    passes.settle(&rec.to_fail, Some(KILLED_FOR_MEMORY))?;
    let hint = format!("; remove {} to try again", path.display());
    let given_up = rec.failed.into_iter().chain(rec.to_fail.into_iter().map(|i| (i, KILLED_FOR_MEMORY.to_string()))).map(|(i, why)| (i, format!("{why}{hint}"))).collect();
    Ok(State { passes: Some(passes), ceiling: rec.ceiling, given_up })
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

/// A failed pass or item as the runner sees it: whether a device ran out of memory, however wrapped.
struct Failed(anyhow::Error);

impl MemoryFailure for Failed {
    fn is_out_of_memory(&self) -> bool {
        self.0.chain().any(|c| c.downcast_ref::<edgerun::Error>().is_some_and(MemoryFailure::is_out_of_memory))
    }
}

impl RunSpec {
    /// A runner for this command's `--batch` and budget.
    pub fn runner(&self) -> ItemRunner {
        ItemRunner::new(self.batch, self.budget)
    }
}

/// Runs `items` through `load` (per item: decoding), `predict` (per batch of loaded items) and
/// `write` (per item). Batches are planned from `size(loaded item)` (estimated activation bytes;
/// `None`: one item per pass under `--batch auto`) and back off when a pass runs out of memory
/// ([`ItemRunner`]). A failed load or write fails that item; a failed batch is retried item by
/// item so that one bad input does not fail its neighbours. A device error or an I/O error while
/// writing (a full disk) ends the run.
pub fn run_items<L, P>(
    spec: &RunSpec,
    items: &[InputItem],
    mut load: impl FnMut(&InputItem) -> anyhow::Result<L>,
    size: impl Fn(&L) -> Option<u64>,
    mut predict: impl FnMut(&[&InputItem], &[&L]) -> anyhow::Result<Vec<P>>,
    mut write: impl FnMut(&InputItem, &L, P) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    if items.is_empty() {
        return Err(edgerun::Error::Input("no input images found".into()).into());
    }
    let start = Instant::now();
    let progress = Progress::new(spec.command, spec.progress, items.len(), Duration::from_secs(10));
    let mut t = Tally { command: spec.command, fail_fast: spec.fail_fast, progress, done: 0, failed: Vec::new() };
    let mut runner = spec.runner();
    let State { mut passes, ceiling, given_up } = open_state(spec)?;
    if let Some(c) = ceiling {
        runner.limit_to(c);
    }
    let mut fatal: Option<edgerun::Error> = None;
    let mut loaded: Vec<(&InputItem, L)> = Vec::new();
    // The most bytes one loaded item needs; the planned batch is the budget over it.
    let mut worst = 0u64;
    let command = spec.command;
    let mut next = items.iter().peekable();
    while next.peek().is_some() || !loaded.is_empty() {
        // Load until the batch the loaded items allow is full (or the inputs run out).
        while let Some(item) = next.peek().copied() {
            if !loaded.is_empty() && loaded.len() >= runner.cap_for(Some(worst), usize::MAX) {
                break;
            }
            next.next();
            if let Some(why) = &item.problem {
                t.fail(item, edgerun::Error::bad_file(&item.path, why.clone()).into())?;
                continue;
            }
            if let Some(why) = given_up.get(item.path.to_string_lossy().as_ref()) {
                t.fail(item, anyhow::anyhow!("{}: {why}", item.path.display()))?;
                continue;
            }
            match load(item) {
                Ok(l) => {
                    worst = worst.max(size(&l).unwrap_or(0));
                    loaded.push((item, l));
                }
                Err(e) => t.fail(item, e)?,
            }
        }
        if loaded.is_empty() {
            continue;
        }
        runner.plan(Some(worst), usize::MAX, &mut |m| log(command, &m));
        let batch: Vec<(&InputItem, L)> = std::mem::take(&mut loaded);
        worst = 0;
        let indices: Vec<usize> = (0..batch.len()).collect();
        let results = runner.batch().run(
            &indices,
            Some(&spec.device),
            |got, want| Failed(anyhow::anyhow!("{command}: {got} results for {want} inputs (a bug)")),
            &mut |m| log(command, &m),
            |idx| {
                let its: Vec<&InputItem> = idx.iter().map(|&i| batch[i].0).collect();
                let data: Vec<&L> = idx.iter().map(|&i| &batch[i].1).collect();
                if let Some(p) = passes.as_mut() {
                    let keys: Vec<String> = its.iter().map(|it| it.path.to_string_lossy().into_owned()).collect();
                    if let Err(e) = p.begin(keys.len(), &keys.iter().map(String::as_str).collect::<Vec<_>>()) {
                        let msg = e.to_string();
                        fatal.get_or_insert(e);
                        return Err(Failed(anyhow::anyhow!("the pass could not be recorded: {msg}")));
                    }
                }
                let r = predict(&its, &data).map_err(Failed);
                if let Some(Err(e)) = passes.as_mut().map(PassLog::end) {
                    fatal.get_or_insert(e);
                }
                r
            },
        );
        if let Some(e) = fatal.take() {
            return Err(anyhow::Error::from(e).context(format!("{command}: cannot keep the state of the passes")));
        }
        for ((it, l), r) in batch.iter().zip(results) {
            match r.map_err(|f| f.0).and_then(|p| write(it, l, p)) {
                Ok(()) => t.ok(),
                // A device or disk failure would fail every later item the same way.
                Err(e) if matches!(super::exit_code(&e), 3 | 4) => return Err(e.context(format!("{} stopped at {}", spec.command, it.path.display()))),
                Err(e) => t.fail(it, e)?,
            }
        }
    }
    t.finish(start)
}
