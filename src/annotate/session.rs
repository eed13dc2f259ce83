//! What one `annotate` process keeps between batches: the open journals and what they record, the
//! pass logs, the loaded model chains, the stages' cadence counters. A one-shot run plans its whole
//! list once; `--watch` plans each batch of arrived frames against the same session, so models are
//! loaded once per process.
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::config::{Config, Fingerprint, StageKind};
use super::journal::{journal_path, manifest_dir, passes_path, read_records, stage_journals, Index, Journal, Record, Status};
use super::layout::{expected_outputs, output_rel, possible_outputs, OutputKind};
use super::listing::InputFile;
use super::scheduler::{self, ChunkJob, Exec, ExecStats, ItemInfo, Member, StageSet};
use super::stages::{Devices, ModelChain};
use super::summary::{Failure, StageSummary};
use super::tiled::{self, TiledOut, TiledRun, TiledWork};
use super::{log, RunOptions, Shard};
use crate::error::{Error, Result};
use crate::progress::Progress;
use crate::runner::{PassLog, KILLED_FOR_MEMORY};

/// The reason recorded for a frame `--max-backlog` dropped from the queue; such a record does not
/// count as an earlier failure: the next run processes the frame.
pub(crate) const SKIPPED_BACKLOG: &str = "skipped: the backlog of waiting frames was over --max-backlog (a later run processes it)";

/// The start of the reason recorded for a frame a stage's `every = K` passed over.
pub(crate) const SKIPPED_CADENCE: &str = "not run on this frame: every =";

/// Where an input's stage stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum State {
    /// Its outputs are recorded for this very input.
    Done,
    /// An earlier run recorded it failed (not retried without `--retry-failed`).
    SkipFailed,
    /// The stage's `every = K` passed over it, and the stage still has that cadence.
    Cadence,
    /// Still to do.
    Pending,
}

/// Whether the record describes this very file (size and the configured fingerprint).
pub(crate) fn same_input(r: &Record, f: &InputFile, fp: Fingerprint) -> bool {
    r.size == f.size
        && match fp {
            Fingerprint::Mtime => r.mtime_ns == f.mtime_ns,
            Fingerprint::Content => f.hash.is_some() && r.hash == f.hash.map(|h| format!("xxh64:{h:016x}")),
        }
}

/// Whether an input's stage is done (its expected outputs, or its one tiled GeoTIFF `tiled`, recorded
/// for this very input), failed before, passed over by the stage's cadence `every`, or still to do.
fn state(idx: &Index, f: &InputFile, expected: &[String], tiled: &str, fp: Fingerprint, retry_failed: bool, every: usize) -> State {
    let Some((ok, failed)) = idx.by_input.get(&f.rel) else { return State::Pending };
    let complete = |outputs: &[String]| expected.iter().all(|e| outputs.contains(e)) || outputs == [tiled];
    if ok.as_ref().is_some_and(|r| same_input(r, f, fp) && complete(&r.outputs)) {
        return State::Done;
    }
    let Some(r) = failed.as_ref().filter(|r| same_input(r, f, fp)) else { return State::Pending };
    match r.reason.as_deref() {
        Some(SKIPPED_BACKLOG) => State::Pending,
        Some(why) if why.starts_with(SKIPPED_CADENCE) => {
            if every > 1 {
                State::Cadence
            } else {
                State::Pending
            }
        }
        _ if retry_failed => State::Pending,
        _ => State::SkipFailed,
    }
}

/// Whether the input's latest failed record says it was killed for memory (twice alone in a pass):
/// the stage's passes leave it out, so that it cannot kill the run again.
fn killed_for_memory(idx: &Index, f: &InputFile, fp: Fingerprint) -> bool {
    idx.by_input.get(&f.rel).and_then(|(_, failed)| failed.as_ref()).is_some_and(|r| same_input(r, f, fp) && r.reason.as_deref() == Some(KILLED_FOR_MEMORY))
}

/// Refuses a stage whose device cannot run its dtype (bf16 on the CPU) or is not available: a device
/// error (exit code 3), before any output is created.
fn check_devices(cfg: &Config, stages: &[StageKind]) -> Result<()> {
    for &k in stages.iter().filter(|k| k.has_model()) {
        for spec in cfg.model_chain(k)? {
            let device = crate::device::parse_device(&spec.device)?;
            crate::device::check_dtype(&device, crate::device::parse_dtype(&spec.dtype)?)?;
        }
    }
    Ok(())
}

/// What planning a set of batches found.
#[derive(Default)]
pub(crate) struct Plan {
    /// Batches with pending work.
    pub jobs: Vec<ChunkJob>,
    /// Inputs run in tiles.
    pub tiled_work: Vec<TiledWork>,
    /// Output files to be written (their directories are created up front).
    pub pending_outputs: Vec<String>,
    /// Directories this plan's outputs may go to (temp-file cleanup).
    pub shard_dirs: BTreeSet<PathBuf>,
    /// Output files this shard may write (temp-file cleanup beside other shards).
    pub owned: HashSet<PathBuf>,
    /// Inputs with nothing to do.
    pub skipped_items: usize,
}

impl Plan {
    /// Items the pipeline runs.
    pub(crate) fn pipeline_items(&self) -> BTreeSet<usize> {
        self.jobs.iter().flat_map(|j| j.members.iter().filter(|m| !m.pending.is_empty()).map(|m| m.item)).collect()
    }

    /// Items with any work (pipeline or tiles).
    pub(crate) fn todo_items(&self) -> BTreeSet<usize> {
        let mut s = self.pipeline_items();
        s.extend(self.tiled_work.iter().map(|w| w.item));
        s
    }

    /// Whether a model stage is needed by some batch or tiled input.
    pub(crate) fn needs(&self, k: StageKind) -> bool {
        self.jobs.iter().any(|j| j.run.has(k)) || self.tiled_work.iter().any(|w| w.stage == k)
    }
}

/// One process's open state.
pub(crate) struct Session {
    /// The configuration.
    pub cfg: Config,
    /// Stages, in pipeline order.
    pub stages: Vec<StageKind>,
    /// This process's shard.
    pub shard: Shard,
    /// Shard tag of file names (`""` or `.shard-K-of-N`).
    pub tag: String,
    /// The output directory.
    pub output: PathBuf,
    /// Its canonical path (left out of the input listing).
    pub out_c: PathBuf,
    /// `<output>/manifests`.
    pub mdir: PathBuf,
    /// Whether progress and notes are off.
    pub quiet: bool,
    journals: HashMap<StageKind, Journal>,
    indexes: HashMap<StageKind, Index>,
    pass_logs: HashMap<StageKind, (PassLog, Option<usize>)>,
    chains: Vec<ModelChain>,
    devices: Devices,
    /// Frames each stage with `every > 1` has been offered.
    cadence: HashMap<StageKind, u64>,
    /// Per stage: skipped counts, and whether a model was loaded.
    pub stage_summary: BTreeMap<StageKind, StageSummary>,
}

impl Session {
    /// Checks the run's options and opens the journals (nothing else is created before the checks).
    pub(crate) fn open(opts: &RunOptions) -> Result<Session> {
        let cfg = &opts.config;
        cfg.validate()?;
        let stages = cfg.stage_list();
        let shard = opts.shard;
        let tag = shard.tag();
        if !opts.input.is_dir() {
            return Err(Error::Input(format!("input {} is not a directory", opts.input.display())));
        }
        let output = &opts.output;
        let in_c = opts.input.canonicalize().map_err(|e| Error::io(&opts.input, e))?;
        if output.canonicalize().is_ok_and(|out_c| out_c == in_c) {
            return Err(Error::Config("the output directory must not be the input directory".into()));
        }
        check_devices(cfg, &stages)?;
        let mdir = manifest_dir(output);
        crate::fsutil::create_dir_in(output, &mdir)?;
        let out_c = output.canonicalize().map_err(|e| Error::io(output, e))?;
        let quiet = cfg.progress.mode == "none";
        let mut s = Session {
            cfg: cfg.clone(),
            stage_summary: stages.iter().map(|k| (*k, StageSummary::default())).collect(),
            stages,
            shard,
            tag,
            output: output.clone(),
            out_c,
            mdir,
            quiet,
            journals: HashMap::new(),
            indexes: HashMap::new(),
            pass_logs: HashMap::new(),
            chains: Vec::new(),
            devices: Devices::default(),
            cadence: HashMap::new(),
        };
        s.open_journals()?;
        Ok(s)
    }

    /// Logs a note unless progress is off.
    pub(crate) fn say(&self, m: &str) {
        if !self.quiet {
            log(m)
        }
    }

    fn open_journals(&mut self) -> Result<()> {
        let sync_interval = Duration::from_secs_f64(self.cfg.journal.sync_interval_s);
        for &k in &self.stages.clone() {
            let own = journal_path(&self.output, k, &self.tag);
            let (j, recs, rec) = Journal::open(&own, self.cfg.journal.sync_every, sync_interval)?;
            if rec.truncated_bytes > 0 {
                self.say(&format!("{}: dropped a torn last record ({} bytes) left by an interrupted run", own.display(), rec.truncated_bytes));
            }
            if rec.bad_lines > 0 {
                self.say(&format!("{}: ignoring {} unreadable lines (malformed, or paths that are absolute or contain `..`)", own.display(), rec.bad_lines));
            }
            let mut idx = Index::default();
            for (p, is_shard) in stage_journals(&self.output, k)? {
                // Unsharded runs see every shard's work; a shard sees the merged (unsharded) journal.
                if p != own && (self.shard.is_whole() || !is_shard) {
                    idx.add(read_records(&p)?);
                }
            }
            idx.add(recs);
            self.journals.insert(k, j);
            self.indexes.insert(k, idx);
        }
        Ok(())
    }

    /// Opens the pass logs: a pass that a kill for memory ended halves the stage's batch in this
    /// run; an input that was alone in such a pass twice is recorded as failed, so the run goes on.
    /// Returns those inputs `(stage, item)`.
    pub(crate) fn open_pass_logs(&mut self, items: &[ItemInfo]) -> Result<Vec<(StageKind, usize)>> {
        let mut given_up = Vec::new();
        let fp = self.cfg.fingerprint;
        let shard = self.shard.to_string();
        for &k in self.stages.iter().filter(|k| k.has_model()) {
            let (mut passes, rec) = PassLog::open(&passes_path(&self.output, k, &self.tag))?;
            for n in &rec.notes {
                log(&format!("{}: {n}", k.name()));
            }
            if !rec.to_fail.is_empty() {
                let (Some(j), Some(idx)) = (self.journals.get_mut(&k), self.indexes.get_mut(&k)) else { continue };
                for key in &rec.to_fail {
                    let Some(i) = items.iter().position(|it| it.file.rel == *key) else { continue };
                    let f = &items[i].file;
                    let known = idx.by_input.get(key).is_some_and(|(ok, failed)| {
                        [ok, failed].into_iter().flatten().any(|r| same_input(r, f, fp) && (r.status == Status::Ok || r.reason.as_deref() == Some(KILLED_FOR_MEMORY)))
                    });
                    if !known {
                        let r = scheduler::record(items, &shard, i, Status::Failed, None, vec![], Some(KILLED_FOR_MEMORY.to_string()));
                        j.append(&r)?;
                        idx.add([r]);
                        given_up.push((k, i));
                    }
                    log(&format!("{}: {key}: {KILLED_FOR_MEMORY}", k.name()));
                }
                j.sync()?;
                passes.settle(&rec.to_fail, None)?;
            }
            self.pass_logs.insert(k, (passes, rec.ceiling));
        }
        Ok(given_up)
    }

    /// A stage's cadence (`every`; edges follow depth).
    fn every(&self, k: StageKind) -> usize {
        self.cfg.every(k)
    }

    /// Where each stage of `item` stands.
    pub(crate) fn states(&self, it: &ItemInfo, retry_failed: bool) -> Vec<(StageKind, State)> {
        self.stages
            .iter()
            .map(|&k| {
                let expected = expected_outputs(&self.cfg, k, &it.stem);
                let tiled_rel = output_rel(k, &it.stem, OutputKind::GeoTiff);
                (k, state(&self.indexes[&k], &it.file, &expected, &tiled_rel, self.cfg.fingerprint, retry_failed, self.every(k)))
            })
            .collect()
    }

    /// Appends a failed record of `item` with `reason` to each stage in `stages`.
    pub(crate) fn record_failed(&mut self, items: &[ItemInfo], item: usize, stages: &[StageKind], reason: &str) -> Result<()> {
        let shard = self.shard.to_string();
        for k in stages {
            let r = scheduler::record(items, &shard, item, Status::Failed, None, vec![], Some(reason.to_string()));
            if let Some(j) = self.journals.get_mut(k) {
                j.append(&r)?;
            }
        }
        Ok(())
    }

    /// Syncs every journal.
    pub(crate) fn sync(&mut self) -> Result<()> {
        for j in self.journals.values_mut() {
            j.sync()?;
        }
        Ok(())
    }

    /// Whether the stage's cadence passes over the next frame it is offered (counting it).
    fn cadence_skips(&mut self, k: StageKind) -> bool {
        let every = self.every(k) as u64;
        if every <= 1 {
            return false;
        }
        let n = self.cadence.entry(k).or_default();
        let skip = !n.is_multiple_of(every);
        *n += 1;
        skip
    }

    /// Plans `groups` (each one batch of item indices, in order): what each member still needs,
    /// which inputs run in tiles. Frames a stage's cadence passes over are recorded here.
    pub(crate) fn plan(&mut self, items: &[ItemInfo], input_root: &Path, coll: &[Option<usize>], groups: &[Vec<usize>], retry_failed: bool) -> Result<Plan> {
        let mut p = Plan::default();
        let limits = self.cfg.image_limits();
        let shard_str = self.shard.to_string();
        for group in groups {
            let mut members = Vec::with_capacity(group.len());
            for &i in group {
                let it = &items[i];
                let mut pending = StageSet::default();
                let mut tiled_here = false;
                let mut left_out = StageSet::default();
                let pre_failed = coll[i].map(|j| format!("its output names collide with those of {} (same name, other extension)", items[j].file.rel));
                let mut depth_skipped = false;
                for (k, st) in self.states(it, retry_failed) {
                    let mut st = st;
                    depth_skipped |= k == StageKind::Depth && st == State::Cadence;
                    if st == State::Pending && pre_failed.is_none() {
                        let skip = if k == StageKind::Edges { depth_skipped } else { self.cadence_skips(k) };
                        if skip {
                            depth_skipped |= k == StageKind::Depth;
                            let r = scheduler::record(items, &shard_str, i, Status::Failed, None, vec![], Some(format!("{SKIPPED_CADENCE} {}", self.every(k))));
                            if let Some(j) = self.journals.get_mut(&k) {
                                j.append(&r)?;
                            }
                            st = State::Cadence;
                            left_out.insert(k);
                        }
                    }
                    let summary = self.stage_summary.entry(k).or_default();
                    match st {
                        State::Done => summary.skipped += 1,
                        State::Cadence => summary.cadence_skipped += 1,
                        State::SkipFailed => {
                            if killed_for_memory(&self.indexes[&k], &it.file, self.cfg.fingerprint) {
                                left_out.insert(k);
                            }
                            summary.skipped_failed += 1;
                        }
                        State::Pending if pre_failed.is_none() && tiled::is_tiled(&self.cfg, k, &input_root.join(&it.file.rel), &limits) => {
                            p.tiled_work.push(TiledWork { item: i, stage: k });
                            tiled_here = true;
                            p.pending_outputs.push(output_rel(k, &it.stem, OutputKind::GeoTiff));
                        }
                        State::Pending => {
                            pending.insert(k);
                            p.pending_outputs.push(output_rel(k, &it.stem, OutputKind::Main));
                        }
                    }
                    for o in possible_outputs(k, &it.stem) {
                        let path = self.output.join(o);
                        if let Some(d) = path.parent() {
                            p.shard_dirs.insert(d.to_path_buf());
                        }
                        if !self.shard.is_whole() {
                            p.owned.insert(path);
                        }
                    }
                }
                if pending.is_empty() && !tiled_here {
                    p.skipped_items += 1;
                }
                members.push(Member { item: i, pending, decode: false, read_depth: false, pre_failed, left_out });
            }
            let run = members.iter().filter(|m| m.pre_failed.is_none()).fold(StageSet::default(), |acc, m| {
                let mut s = StageSet::default();
                for k in m.pending.iter().filter(|k| k.has_model()) {
                    s.insert(k);
                }
                acc.union(s)
            });
            if members.iter().all(|m| m.pending.is_empty()) {
                continue;
            }
            for m in &mut members {
                m.decode = !run.is_empty() && m.pre_failed.is_none();
                m.read_depth = m.pending.has(StageKind::Edges) && !m.pending.has(StageKind::Depth) && m.pre_failed.is_none();
            }
            p.jobs.push(ChunkJob { members, run });
        }
        Ok(p)
    }

    /// Loads the model chains the plan needs and this session has not loaded yet.
    pub(crate) fn load_chains(&mut self, plan: &Plan) -> Result<()> {
        for &k in self.stages.clone().iter().filter(|k| k.has_model()) {
            if !plan.needs(k) || self.chains.iter().any(|c| c.kind() == k) {
                continue;
            }
            let mut chain = ModelChain::new(k, &self.cfg)?;
            if let Some((passes, ceiling)) = self.pass_logs.remove(&k) {
                chain.set_passes(passes, ceiling);
            }
            chain.load_primary(&self.cfg, &mut self.devices, &mut |m| log(&m))?;
            self.chains.push(chain);
            self.chains.sort_by_key(|c| c.kind());
            if let Some(s) = self.stage_summary.get_mut(&k) {
                s.model_loaded = true;
            }
        }
        Ok(())
    }

    /// Per loaded stage: the model batches go to first and its device (for the status file).
    pub(crate) fn models_in_use(&self) -> BTreeMap<StageKind, (String, String)> {
        self.chains.iter().filter_map(|c| c.in_use().map(|(m, d)| (c.kind(), (m.to_string(), d)))).collect()
    }

    /// Runs a plan: the pipeline over its batches, then its tiled inputs. With `track`, the stats
    /// list when each (item, stage) record was written.
    pub(crate) fn execute(&mut self, items: &[ItemInfo], input_root: &Path, plan: Plan, progress: Progress, track: bool) -> Result<ExecStats> {
        let Plan { jobs, tiled_work, .. } = plan;
        let mut stats = if jobs.is_empty() {
            ExecStats::default()
        } else {
            scheduler::execute(Exec {
                cfg: &self.cfg,
                input_root,
                output: &self.output,
                items,
                jobs,
                chains: &mut self.chains,
                devices: &mut self.devices,
                journals: &mut self.journals,
                shard: self.shard.to_string(),
                progress,
                track,
            })?
        };
        // Inputs run in tiles, after the pipeline (one large raster at a time).
        if !tiled_work.is_empty() {
            let t = std::time::Instant::now();
            let x = TiledRun { cfg: &self.cfg, input_root, output: &self.output, items, shard: &self.shard.to_string(), verbose: !self.quiet };
            let out = tiled::run_tiled(&x, &tiled_work, &mut self.chains, &mut self.devices, &mut self.journals, &mut |m| log(&m))?;
            if track {
                let now = std::time::Instant::now();
                stats.recorded.extend(tiled_work.iter().map(|w| (w.item, w.stage, now, !out.failed_items.contains(&w.item))));
            }
            add_tiled(&mut stats, out, t.elapsed().as_secs_f64());
        }
        Ok(stats)
    }

    /// Removes the temp files killed runs left in `dirs` (with the output and manifest folders);
    /// when sharded only those of `owned` paths (with this shard's pass logs), so that other
    /// shards' files in flight stay.
    pub(crate) fn remove_stale_temps(&self, mut dirs: BTreeSet<PathBuf>, mut owned: HashSet<PathBuf>) -> Result<usize> {
        for k in &self.stages {
            owned.insert(passes_path(&self.output, *k, &self.tag));
        }
        dirs.insert(self.output.clone());
        dirs.insert(self.mdir.clone());
        let n = super::layout::remove_stale_temps(&dirs, if self.shard.is_whole() { None } else { Some(&owned) })?;
        if n > 0 {
            self.say(&format!("removed {n} temp files left by an interrupted run"));
        }
        Ok(n)
    }

    /// Adds the failures of inputs given up for memory to the stats.
    pub(crate) fn add_given_up(stats: &mut ExecStats, items: &[ItemInfo], given_up: Vec<(StageKind, usize)>) {
        for (k, i) in given_up {
            stats.failed_items.insert(i);
            stats.stages.entry(k).or_default().failed += 1;
            stats.failures.push(Failure { stage: k.name().into(), input: items[i].file.rel.clone(), reason: KILLED_FOR_MEMORY.into() });
        }
    }
}

/// Adds the tiled runs' counts and times to the pipeline's.
fn add_tiled(stats: &mut ExecStats, t: TiledOut, seconds: f64) {
    stats.pipeline_s += seconds;
    stats.failed_items.extend(t.failed_items);
    stats.failures.extend(t.failures);
    for (k, s) in t.stages {
        stats.model_busy_s += s.model_s;
        stats.stages.entry(k).or_default().add_work(s);
    }
}
