//! `edgerun annotate --watch`: keeps running on the input tree and processes frames as they land
//! (docs/watch.md). One [`Session`] for the whole run (models loaded once); each cycle takes the
//! complete files the [`detect::Detector`] found into the [`queue::FrameQueue`], records the
//! oldest beyond `max_backlog` as skipped, and runs one batch (newest first by default) through
//! the same planning, pipeline, journals and atomic outputs as a one-shot run.
pub(crate) mod detect;
#[cfg(target_os = "linux")]
pub(crate) mod inotify;
#[cfg(target_os = "linux")]
pub(crate) mod mounts;
pub mod queue;
pub(crate) mod signals;
pub mod status;

use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::time::{Duration, Instant};

use super::config::{Fingerprint, StageKind};
use super::hash::{xxh64, xxh64_file};
use super::layout::{create_dirs, possible_outputs, stem_rel};
use super::listing::{list_inputs, InputFile};
use super::scheduler::{ExecStats, ItemInfo};
use super::session::{Session, State, SKIPPED_BACKLOG};
use super::{log, make_summary, write_summary, RunOptions, Summary, SummaryHead};
use crate::error::{Error, Result};
use crate::progress::{Mode, Progress};
use detect::{normalise_extensions, BackendKind, DetectOptions, Detector, Ready};
use queue::{FrameQueue, Order};
use status::{Tracker, WatchStatus};

/// Longest wait for new files while nothing is queued (also how soon a signal is noticed).
const IDLE_WAIT: Duration = Duration::from_millis(200);

/// The frames of the run and what the output names they claim.
struct Frames {
    items: Vec<ItemInfo>,
    arrived: Vec<Instant>,
    coll: Vec<Option<usize>>,
    /// Output stem (and `<stem>.viz` with visualisations) → the item that claimed it.
    claimed: HashMap<String, usize>,
    any_viz: bool,
}

impl Frames {
    /// Adds a frame; a frame whose output names another input already claimed (same name, other
    /// extension) is marked to fail, as the later input of a one-shot run is.
    fn add(&mut self, file: InputFile, at: Instant) -> usize {
        let i = self.items.len();
        let stem = stem_rel(&file.rel);
        let viz = format!("{stem}.viz");
        let owner = |k: &str| self.claimed.get(k).copied().filter(|&j| self.items[j].file.rel != file.rel);
        let hit = owner(&stem).or_else(|| if self.any_viz { owner(&viz) } else { None });
        self.coll.push(hit);
        if hit.is_none() {
            self.claimed.insert(stem.clone(), i);
            if self.any_viz {
                self.claimed.insert(viz, i);
            }
        }
        self.items.push(ItemInfo { stem, file });
        self.arrived.push(at);
        i
    }
}

/// Adds one cycle's pipeline stats to the run's.
fn absorb(total: &mut ExecStats, s: ExecStats) {
    total.pipeline_s += s.pipeline_s;
    total.model_busy_s += s.model_busy_s;
    total.wait_input_s += s.wait_input_s;
    total.wait_output_s += s.wait_output_s;
    total.decode_s += s.decode_s;
    total.failed_items.extend(s.failed_items);
    for f in s.failures {
        if total.failures.len() < 1000 {
            total.failures.push(f);
        }
    }
    for (k, x) in s.stages {
        total.stages.entry(k).or_default().add_work(x);
    }
}

/// The shard that takes a frame under `--watch`: by a hash of its path (the sorted-list batches
/// of a one-shot run are not known while frames arrive).
fn shard_of(rel: &str, count: usize) -> usize {
    (xxh64(rel.as_bytes()) % count.max(1) as u64) as usize
}

/// Runs `annotate --watch` until a signal or `idle_exit_s` without new frames.
pub fn run(opts: &RunOptions) -> Result<Summary> {
    let t0 = Instant::now();
    let stop = signals::Stop::install()?;
    let mut s = Session::open(opts)?;
    let cfg = s.cfg.clone();
    let w = cfg.watch.clone();
    let order = Order::parse(&w.order).ok_or_else(|| Error::Config(format!("[watch] order `{}` is not newest or oldest", w.order)))?;
    let mode = Mode::from_config(&cfg.progress.mode);

    // What is there at the start: the pass logs of killed runs and stale temp files refer to it.
    let listing = list_inputs(&opts.input, &cfg.extensions, Some(&s.out_c), cfg.fingerprint, &s.mdir.join(format!("filelist{}.json", s.tag)), opts.rescan)?;
    let root = listing.root.clone();
    let present: Vec<ItemInfo> = listing.files.iter().map(|f| ItemInfo { stem: stem_rel(&f.rel), file: f.clone() }).collect();
    let given_up = s.open_pass_logs(&present)?;
    let stale = remove_stale(&s, &present)?;
    let mut total = ExecStats::default();
    Session::add_given_up(&mut total, &present, given_up);
    drop(present);

    let exclude = Some(s.out_c.clone()).filter(|o| o.starts_with(&root));
    let dopts = DetectOptions {
        root: root.clone(),
        exclude,
        extensions: normalise_extensions(&cfg.extensions),
        settle: Duration::from_secs_f64(w.settle_s),
        poll_every: Duration::from_secs_f64(w.poll_interval_s),
        close_is_complete: w.close_is_complete,
    };
    let (mut det, note) = Detector::new(dopts, &w.backend);
    if let Some(n) = note {
        s.say(&n);
    }
    let backend = match det.kind() {
        BackendKind::Inotify => "inotify",
        BackendKind::Poll => "poll",
    };
    s.say(&format!(
        "watching {} ({backend}, {} first{}); stop with SIGTERM or Ctrl-C",
        opts.input.display(),
        w.order,
        if w.max_backlog > 0 { format!(", at most {} waiting", w.max_backlog) } else { String::new() }
    ));
    let base = WatchStatus { state: "watching".into(), input_dir: opts.input.display().to_string(), backend: backend.into(), order: w.order.clone(), ..Default::default() };
    let mut tracker = Tracker::new(base, &s.stages);
    let mut frames = Frames { items: Vec::new(), arrived: Vec::new(), coll: Vec::new(), claimed: HashMap::new(), any_viz: s.stages.iter().any(|k| cfg.visualize(*k)) };
    let mut queue = FrameQueue::new(order);
    let mut processed: BTreeSet<usize> = BTreeSet::new();
    let (mut round, mut last_arrival, mut load_s) = (0u64, Instant::now(), 0.0);
    let (mut last_status, mut last_line) = (Instant::now(), Instant::now());
    let status_every = Duration::from_secs_f64(w.status_interval_s);
    let line_every = if mode == Mode::Bar { Duration::from_millis(200) } else { Duration::from_secs_f64(cfg.progress.interval_s.max(0.1)) };
    let idle_exit = (w.idle_exit_s > 0.0).then(|| Duration::from_secs_f64(w.idle_exit_s));
    tracker.write(&s.output, &s.tag)?;

    while !stop.asked() {
        let ready = det.wait(if queue.is_empty() { IDLE_WAIT } else { Duration::ZERO })?;
        for p in det.problems.drain(..) {
            s.say(&format!("not listed: {p}"));
        }
        if !ready.is_empty() {
            round += 1;
            last_arrival = Instant::now();
        }
        for r in ready {
            arrive(&mut s, &mut frames, &mut queue, &mut tracker, &root, r, round, opts.retry_failed);
        }
        let dropped = queue.over(w.max_backlog);
        for &i in &dropped {
            let pending: Vec<StageKind> = s.states(&frames.items[i], opts.retry_failed).into_iter().filter(|(_, st)| *st == State::Pending).map(|(k, _)| k).collect();
            s.record_failed(&frames.items, i, &pending, SKIPPED_BACKLOG)?;
            tracker.s.skipped_backlog += 1;
        }
        if !dropped.is_empty() {
            s.sync()?;
        }
        if !queue.is_empty() && !stop.asked() {
            let batch = queue.take(cfg.chunk_len());
            let mut plan = s.plan(&frames.items, &root, &frames.coll, &[batch], opts.retry_failed)?;
            create_dirs(&s.output, std::mem::take(&mut plan.pending_outputs))?;
            let t_load = Instant::now();
            s.load_chains(&plan)?;
            load_s += t_load.elapsed().as_secs_f64();
            let todo = plan.todo_items();
            let stats = s.execute(&frames.items, &root, plan, Progress::new("annotate", Mode::None, todo.len(), Duration::from_secs(3600)), true)?;
            for &(item, stage, at, ok) in &stats.recorded {
                tracker.recorded(stage, frames.arrived[item], at, ok);
            }
            for i in &todo {
                tracker.frame_finished(stats.failed_items.contains(i));
            }
            processed.extend(todo);
            absorb(&mut total, stats);
        }
        tracker.s.queue = queue.len();
        tracker.s.settling = det.settling();
        if last_status.elapsed() >= status_every {
            tracker.update(&s.models_in_use());
            tracker.write(&s.output, &s.tag)?;
            last_status = Instant::now();
        }
        if last_line.elapsed() >= line_every {
            tracker.update(&s.models_in_use());
            crate::progress::status_line("annotate", mode, &tracker.line());
            last_line = Instant::now();
        }
        if idle_exit.is_some_and(|d| queue.is_empty() && det.settling() == 0 && last_arrival.elapsed() >= d) {
            s.say(&format!("no new frame for {:.0} s (--idle-exit): stopping", w.idle_exit_s));
            break;
        }
    }
    crate::progress::end_status_line(mode);
    if stop.asked() {
        s.say("stopping: the batch in flight has finished");
    }
    s.sync()?;
    tracker.s.queue = queue.len();
    tracker.s.state = "finished".into();
    tracker.update(&s.models_in_use());
    tracker.write(&s.output, &s.tag)?;
    if !s.quiet {
        log(&tracker.line());
    }
    let head = SummaryHead {
        input: &opts.input,
        listed: frames.items.len(),
        in_shard: frames.items.len(),
        processed: processed.len(),
        skipped: tracker.s.already_done,
        listing_cached: listing.from_cache,
        unlisted: Vec::new(),
        stale_temps_removed: stale,
        setup_s: 0.0,
        load_s,
    };
    let (output, tag) = (s.output.clone(), s.tag.clone());
    let summary = make_summary(&s, head, total, t0);
    drop(s);
    write_summary(&output, &tag, &summary)?;
    Ok(summary)
}

/// A complete file joins the run: its frame is queued unless an earlier run finished it.
#[allow(clippy::too_many_arguments)]
fn arrive(s: &mut Session, frames: &mut Frames, queue: &mut FrameQueue, tracker: &mut Tracker, root: &Path, r: Ready, round: u64, retry_failed: bool) {
    if !s.shard.is_whole() && shard_of(&r.rel, s.shard.count) != s.shard.index {
        return;
    }
    let hash = match s.cfg.fingerprint {
        Fingerprint::Content => xxh64_file(&root.join(&r.rel)).ok(),
        Fingerprint::Mtime => None,
    };
    let i = frames.add(InputFile { rel: r.rel, size: r.size, mtime_ns: r.mtime_ns, hash }, Instant::now());
    if s.states(&frames.items[i], retry_failed).iter().all(|(_, st)| *st != State::Pending) {
        tracker.s.already_done += 1;
        return;
    }
    tracker.s.arrived += 1;
    queue.push(round, frames.items[i].file.mtime_ns, i);
}

/// Removes the temp files a killed run left beside the outputs of the inputs present at the start
/// and the state files (only this shard's when sharded).
fn remove_stale(s: &Session, present: &[ItemInfo]) -> Result<usize> {
    let mut dirs = BTreeSet::new();
    let mut owned = std::collections::HashSet::new();
    for it in present {
        for k in &s.stages {
            for o in possible_outputs(*k, &it.stem) {
                let p = s.output.join(o);
                if let Some(d) = p.parent() {
                    dirs.insert(d.to_path_buf());
                }
                owned.insert(p);
            }
        }
    }
    owned.insert(s.output.join(format!("status{}.json", s.tag)));
    s.remove_stale_temps(dirs, owned)
}
