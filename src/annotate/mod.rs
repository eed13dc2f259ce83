//! `edgerun annotate`: the crash-safe, resumable, shardable dataset pipeline
//! (depth → edges → segmentation → canopy height).
//!
//! - [`config`]: the TOML configuration and its commented default;
//! - [`listing`]: the sorted input list, cached and rebuilt only when the input tree changed;
//! - [`shard`]: `--shard K/N` and its SLURM / Kubernetes defaults;
//! - [`journal`]: per-stage completion journals (append-only JSON lines) and `--merge`;
//! - [`layout`]: output paths, directory creation, stale temp-file cleanup;
//! - [`stages`]: the model stages behind one trait and the fallback chain;
//! - [`decode`]: reading and decoding inputs under size limits;
//! - [`scheduler`]: decode pool → batched inference → writer pool → journal;
//! - [`progress`]: the progress display and the summary.
pub mod config;
pub mod decode;
pub mod hash;
pub mod journal;
pub mod layout;
pub mod listing;
pub mod summary;
pub(crate) mod scheduler;
pub mod shard;
pub mod stages;
pub mod tiled;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub use config::{Config, Fingerprint, FloatFormat, StageKind, DEFAULT_CONFIG};
pub use journal::{MergedStage, Record, Status};
pub use summary::Summary;

/// Prints an `annotate:` line on stderr without breaking the progress bar.
pub fn log(msg: &str) {
    crate::progress::log("annotate", msg)
}
pub use shard::Shard;

use crate::error::{Error, Result};
use crate::runner::{PassLog, KILLED_FOR_MEMORY};
use journal::{journal_path, manifest_dir, passes_path, read_records, stage_journals, Index, Journal};
use layout::{collisions, create_dirs, expected_outputs, output_rel, possible_outputs, remove_stale_temps, stem_rel, OutputKind};
use listing::{list_inputs, InputFile};
use crate::progress::{Mode, Progress};
use summary::StageSummary;
use scheduler::{ChunkJob, Exec, ItemInfo, Member, StageSet};
use stages::{Devices, ModelChain};
use tiled::{TiledOut, TiledRun, TiledWork};

/// One run's inputs.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// The configuration (with command-line overrides applied).
    pub config: Config,
    /// Input directory.
    pub input: PathBuf,
    /// Output directory.
    pub output: PathBuf,
    /// This process's shard.
    pub shard: Shard,
    /// Retry inputs an earlier run recorded as failed.
    pub retry_failed: bool,
    /// Re-list the input tree even when the cached list looks current.
    pub rescan: bool,
}

enum State {
    Done,
    SkipFailed,
    Pending,
}

fn same_input(r: &Record, f: &InputFile, fp: Fingerprint) -> bool {
    r.size == f.size
        && match fp {
            Fingerprint::Mtime => r.mtime_ns == f.mtime_ns,
            Fingerprint::Content => f.hash.is_some() && r.hash == f.hash.map(|h| format!("xxh64:{h:016x}")),
        }
}

/// Whether an input's stage is done (its expected outputs, or its one tiled GeoTIFF `tiled`, recorded
/// for this very input), failed before, or still to do.
fn state(idx: &Index, f: &InputFile, expected: &[String], tiled: &str, fp: Fingerprint, retry_failed: bool) -> State {
    let Some((ok, failed)) = idx.by_input.get(&f.rel) else { return State::Pending };
    let complete = |outputs: &[String]| expected.iter().all(|e| outputs.contains(e)) || outputs == [tiled];
    if ok.as_ref().is_some_and(|r| same_input(r, f, fp) && complete(&r.outputs)) {
        return State::Done;
    }
    if !retry_failed && failed.as_ref().is_some_and(|r| same_input(r, f, fp)) {
        return State::SkipFailed;
    }
    State::Pending
}

/// Whether the input's latest failed record says it was killed for memory (twice alone in a pass):
/// the stage's passes leave it out, so that it cannot kill the run again.
fn killed_for_memory(idx: &Index, f: &InputFile, fp: Fingerprint) -> bool {
    idx.by_input.get(&f.rel).and_then(|(_, failed)| failed.as_ref()).is_some_and(|r| same_input(r, f, fp) && r.reason.as_deref() == Some(KILLED_FOR_MEMORY))
}

fn summary_path(output: &Path, tag: &str) -> PathBuf {
    output.join(format!("summary{tag}.json"))
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

/// Runs (or resumes) an annotation of `opts.input` into `opts.output`.
pub fn run(opts: &RunOptions) -> Result<Summary> {
    let t0 = Instant::now();
    let cfg = &opts.config;
    cfg.validate()?;
    let stages = cfg.stage_list();
    let shard = opts.shard;
    let tag = shard.tag();
    if !opts.input.is_dir() {
        return Err(Error::Input(format!("input {} is not a directory", opts.input.display())));
    }
    let output = &opts.output;
    // Refusals come before anything is created.
    let in_c = opts.input.canonicalize().map_err(|e| Error::io(&opts.input, e))?;
    if output.canonicalize().is_ok_and(|out_c| out_c == in_c) {
        return Err(Error::Config("the output directory must not be the input directory".into()));
    }
    check_devices(cfg, &stages)?;
    let mdir = manifest_dir(output);
    crate::fsutil::create_dir_in(output, &mdir)?;
    let out_c = output.canonicalize().map_err(|e| Error::io(output, e))?;
    let quiet = cfg.progress.mode == "none";
    let say = |m: &str| {
        if !quiet {
            log(m)
        }
    };

    // Inputs.
    let listing = list_inputs(&opts.input, &cfg.extensions, Some(&out_c), cfg.fingerprint, &mdir.join(format!("filelist{tag}.json")), opts.rescan)?;
    for w in &listing.warnings {
        log(&format!("warning: {w}"));
    }
    for s in &listing.skipped {
        say(&format!("not listed: {s}"));
    }
    let items: Vec<ItemInfo> = listing.files.iter().map(|f| ItemInfo { stem: stem_rel(&f.rel), file: f.clone() }).collect();
    let stems: Vec<String> = items.iter().map(|i| i.stem.clone()).collect();
    let coll = collisions(&stems, stages.iter().any(|k| cfg.visualize(*k)));

    // Journals.
    let sync_interval = Duration::from_secs_f64(cfg.journal.sync_interval_s);
    let mut journals = HashMap::new();
    let mut indexes = HashMap::new();
    for &k in &stages {
        let own = journal_path(output, k, &tag);
        let (j, recs, rec) = Journal::open(&own, cfg.journal.sync_every, sync_interval)?;
        if rec.truncated_bytes > 0 {
            say(&format!("{}: dropped a torn last record ({} bytes) left by an interrupted run", own.display(), rec.truncated_bytes));
        }
        if rec.bad_lines > 0 {
            say(&format!("{}: ignoring {} unreadable lines (malformed, or paths that are absolute or contain `..`)", own.display(), rec.bad_lines));
        }
        let mut idx = Index::default();
        for (p, is_shard) in stage_journals(output, k)? {
            // Unsharded runs see every shard's work; a shard sees the merged (unsharded) journal.
            if p != own && (shard.is_whole() || !is_shard) {
                idx.add(read_records(&p)?);
            }
        }
        idx.add(recs);
        journals.insert(k, j);
        indexes.insert(k, idx);
    }

    // Pass logs: a pass that a kill for memory ended halves the stage's batch in this run; an input
    // that was alone in such a pass twice is recorded as failed, so the run goes on.
    let mut pass_logs = HashMap::new();
    let mut given_up: Vec<(StageKind, usize)> = Vec::new();
    for &k in stages.iter().filter(|k| k.has_model()) {
        let (mut passes, rec) = PassLog::open(&passes_path(output, k, &tag))?;
        for n in &rec.notes {
            log(&format!("{}: {n}", k.name()));
        }
        if !rec.to_fail.is_empty() {
            let (Some(j), Some(idx)) = (journals.get_mut(&k), indexes.get_mut(&k)) else { continue };
            for key in &rec.to_fail {
                let Some(i) = items.iter().position(|it| it.file.rel == *key) else { continue };
                let f = &items[i].file;
                let known = idx.by_input.get(key).is_some_and(|(ok, failed)| {
                    [ok, failed].into_iter().flatten().any(|r| same_input(r, f, cfg.fingerprint) && (r.status == Status::Ok || r.reason.as_deref() == Some(KILLED_FOR_MEMORY)))
                });
                if !known {
                    let r = scheduler::record(&items, &shard.to_string(), i, Status::Failed, None, vec![], Some(KILLED_FOR_MEMORY.to_string()));
                    j.append(&r)?;
                    idx.add([r]);
                    given_up.push((k, i));
                }
                log(&format!("{}: {key}: {KILLED_FOR_MEMORY}", k.name()));
            }
            j.sync()?;
            passes.settle(&rec.to_fail, None)?;
        }
        pass_logs.insert(k, (passes, rec.ceiling));
    }

    // Plan: whole batches of the sorted list; this shard's; what each member still needs.
    let mut summary_stages: BTreeMap<StageKind, StageSummary> = stages.iter().map(|k| (*k, StageSummary::default())).collect();
    let n = items.len();
    let b = cfg.chunk_len();
    let mut jobs = Vec::new();
    let mut in_shard = 0;
    let mut skipped_items = 0;
    let mut shard_dirs: BTreeSet<PathBuf> = BTreeSet::new();
    let mut owned: HashSet<PathBuf> = HashSet::new();
    let mut pending_outputs: Vec<String> = Vec::new();
    let mut tiled_work: Vec<TiledWork> = Vec::new();
    let limits = cfg.image_limits();
    for c in 0..n.div_ceil(b) {
        if !shard.owns_chunk(c) {
            continue;
        }
        let range = c * b..((c + 1) * b).min(n);
        in_shard += range.len();
        let mut members = Vec::with_capacity(range.len());
        for i in range {
            let it = &items[i];
            let mut pending = StageSet::default();
            let mut tiled_here = false;
            let mut left_out = StageSet::default();
            let pre_failed = coll[i].map(|j| format!("its output names collide with those of {} (same name, other extension)", items[j].file.rel));
            for &k in &stages {
                let expected = expected_outputs(cfg, k, &it.stem);
                let tiled_rel = output_rel(k, &it.stem, OutputKind::GeoTiff);
                match state(&indexes[&k], &it.file, &expected, &tiled_rel, cfg.fingerprint, opts.retry_failed) {
                    State::Done => summary_stages.get_mut(&k).map(|s| s.skipped += 1).unwrap_or(()),
                    State::SkipFailed => {
                        if killed_for_memory(&indexes[&k], &it.file, cfg.fingerprint) {
                            left_out.insert(k);
                        }
                        if let Some(s) = summary_stages.get_mut(&k) {
                            s.skipped_failed += 1;
                        }
                    }
                    State::Pending if pre_failed.is_none() && tiled::is_tiled(cfg, k, &listing.root.join(&it.file.rel), &limits) => {
                        tiled_work.push(TiledWork { item: i, stage: k });
                        tiled_here = true;
                        pending_outputs.push(tiled_rel);
                    }
                    State::Pending => {
                        pending.insert(k);
                        pending_outputs.push(output_rel(k, &it.stem, OutputKind::Main));
                    }
                }
                for o in possible_outputs(k, &it.stem) {
                    let p = output.join(o);
                    if let Some(d) = p.parent() {
                        shard_dirs.insert(d.to_path_buf());
                    }
                    if !shard.is_whole() {
                        owned.insert(p);
                    }
                }
            }
            if pending.is_empty() && !tiled_here {
                skipped_items += 1;
            }
            members.push(Member { item: i, pending, decode: false, read_depth: false, pre_failed, left_out });
        }
        let run = members
            .iter()
            .filter(|m| m.pre_failed.is_none())
            .fold(StageSet::default(), |acc, m| {
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
        jobs.push(ChunkJob { members, run });
    }

    // Output directories once, up front; temp files of killed runs removed.
    create_dirs(output, pending_outputs)?;
    for f in [summary_path(output, &tag), mdir.join(format!("filelist{tag}.json"))] {
        owned.insert(f);
    }
    for k in &stages {
        owned.insert(journal_path(output, *k, ""));
        owned.insert(passes_path(output, *k, &tag));
    }
    shard_dirs.insert(output.to_path_buf());
    shard_dirs.insert(mdir.clone());
    let stale = remove_stale_temps(&shard_dirs, if shard.is_whole() { None } else { Some(&owned) })?;
    if stale > 0 {
        say(&format!("removed {stale} temp files left by an interrupted run"));
    }
    let pipeline_items: BTreeSet<usize> = jobs.iter().flat_map(|j| j.members.iter().filter(|m| !m.pending.is_empty()).map(|m| m.item)).collect();
    let todo_items = pipeline_items.len() + tiled_work.iter().map(|w| w.item).collect::<BTreeSet<_>>().difference(&pipeline_items).count();
    say(&format!(
        "{} inputs{} in {}; shard {shard}: {in_shard} inputs, {todo_items} to do, {skipped_items} already done",
        items.len(),
        if listing.from_cache { " (cached list)" } else { "" },
        opts.input.display()
    ));
    let setup_s = t0.elapsed().as_secs_f64();

    // Models (only for stages some batch runs).
    let t_load = Instant::now();
    let mut devices = Devices::default();
    let mut chains = Vec::new();
    for &k in stages.iter().filter(|k| k.has_model()) {
        if jobs.iter().any(|j| j.run.has(k)) || tiled_work.iter().any(|w| w.stage == k) {
            let mut chain = ModelChain::new(k, cfg)?;
            if let Some((passes, ceiling)) = pass_logs.remove(&k) {
                chain.set_passes(passes, ceiling);
            }
            chain.load_primary(cfg, &mut devices, &mut |m| log(&m))?;
            chains.push(chain);
            if let Some(s) = summary_stages.get_mut(&k) {
                s.model_loaded = true;
            }
        }
    }
    let load_s = t_load.elapsed().as_secs_f64();

    let progress = Progress::new("annotate", Mode::from_config(&cfg.progress.mode), pipeline_items.len(), Duration::from_secs_f64(cfg.progress.interval_s.max(0.1)));
    let mut stats = if jobs.is_empty() {
        scheduler::ExecStats::default()
    } else {
        scheduler::execute(Exec {
            cfg,
            input_root: &listing.root,
            output,
            items: &items,
            jobs,
            chains: &mut chains,
            devices: &mut devices,
            journals: &mut journals,
            shard: shard.to_string(),
            progress,
        })?
    };
    // Inputs run in tiles, after the pipeline (one large raster at a time).
    if !tiled_work.is_empty() {
        let t_tiled = Instant::now();
        let x = TiledRun { cfg, input_root: &listing.root, output, items: &items, shard: &shard.to_string(), verbose: !quiet };
        let t = tiled::run_tiled(&x, &tiled_work, &mut chains, &mut devices, &mut journals, &mut |m| log(&m))?;
        add_tiled(&mut stats, t, t_tiled.elapsed().as_secs_f64());
    }
    drop(journals);
    for (k, i) in given_up {
        stats.failed_items.insert(i);
        stats.stages.entry(k).or_default().failed += 1;
        stats.failures.push(summary::Failure { stage: k.name().into(), input: items[i].file.rel.clone(), reason: KILLED_FOR_MEMORY.into() });
    }

    let mut summary = Summary {
        input_dir: opts.input.display().to_string(),
        output_dir: output.display().to_string(),
        shard: shard.to_string(),
        listed: items.len(),
        in_shard,
        processed: todo_items,
        skipped: skipped_items,
        failed: stats.failed_items.len(),
        listing_cached: listing.from_cache,
        setup_s,
        load_s,
        pipeline_s: stats.pipeline_s,
        wall_s: 0.0,
        images_per_s: if stats.pipeline_s > 0.0 { todo_items as f64 / stats.pipeline_s } else { 0.0 },
        model_busy_s: stats.model_busy_s,
        model_busy_fraction: if stats.pipeline_s > 0.0 { stats.model_busy_s / stats.pipeline_s } else { 0.0 },
        model_busy_fraction_wall: 0.0,
        wait_input_s: stats.wait_input_s,
        wait_output_s: stats.wait_output_s,
        decode_s: stats.decode_s,
        stages: BTreeMap::new(),
        failures: stats.failures,
        unlisted: listing.skipped.clone(),
        stale_temps_removed: stale,
    };
    for (k, mut s) in summary_stages {
        if let Some(x) = stats.stages.get(&k) {
            s.done = x.done;
            s.failed = x.failed;
            s.model_s = x.model_s;
            s.write_s = x.write_s;
            s.by_model = x.by_model.clone();
        }
        summary.stages.insert(k.name().to_string(), s);
    }
    summary.wall_s = t0.elapsed().as_secs_f64();
    summary.model_busy_fraction_wall = if summary.wall_s > 0.0 { summary.model_busy_s / summary.wall_s } else { 0.0 };
    let json = serde_json::to_vec_pretty(&summary).map_err(|e| Error::Config(e.to_string()))?;
    crate::fsutil::write_atomic(summary_path(output, &tag), &json)?;
    Ok(summary)
}

/// Adds the tiled runs' counts and times to the pipeline's.
fn add_tiled(stats: &mut scheduler::ExecStats, t: TiledOut, seconds: f64) {
    stats.pipeline_s += seconds;
    stats.failed_items.extend(t.failed_items);
    stats.failures.extend(t.failures);
    for (k, s) in t.stages {
        let e = stats.stages.entry(k).or_default();
        e.done += s.done;
        e.failed += s.failed;
        e.model_s += s.model_s;
        stats.model_busy_s += s.model_s;
        for (m, c) in s.by_model {
            *e.by_model.entry(m).or_default() += c;
        }
    }
}

/// What `--merge` did.
#[derive(Debug, Clone)]
pub struct MergeReport {
    /// Per stage.
    pub stages: BTreeMap<String, MergedStage>,
    /// The combined summary, when shard summaries were found.
    pub summary: Option<Summary>,
}

/// Combines the shard journals of `output` into `<stage>.jsonl` and the shard summaries into
/// `summary.json`. Run it when no shard is running.
pub fn merge(output: &Path) -> Result<MergeReport> {
    if !manifest_dir(output).is_dir() {
        return Err(Error::Input(format!("{} has no manifests/ directory: not an annotate output", output.display())));
    }
    let stages = journal::merge(output)?;
    let mut shards = Vec::new();
    let rd = std::fs::read_dir(output).map_err(|e| Error::io(output, e))?;
    let mut paths: Vec<PathBuf> = rd
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("summary.shard-") && n.ends_with(".json")))
        .collect();
    paths.sort();
    for p in &paths {
        let bytes = crate::fsutil::read_input(p, crate::fsutil::MAX_TEXT_INPUT)?;
        shards.push(serde_json::from_slice::<Summary>(&bytes).map_err(|e| Error::bad_file(p, e.to_string()))?);
    }
    let summary = if shards.is_empty() {
        None
    } else {
        let mut m = Summary { shard: format!("merged from {} shard summaries", shards.len()), ..Default::default() };
        let mut busy_total = 0.0;
        let mut pipe_total = 0.0;
        for s in &shards {
            m.input_dir = s.input_dir.clone();
            m.output_dir = s.output_dir.clone();
            m.listed = m.listed.max(s.listed);
            m.in_shard += s.in_shard;
            m.processed += s.processed;
            m.skipped += s.skipped;
            m.failed += s.failed;
            m.setup_s = m.setup_s.max(s.setup_s);
            m.load_s = m.load_s.max(s.load_s);
            m.pipeline_s = m.pipeline_s.max(s.pipeline_s);
            m.wall_s = m.wall_s.max(s.wall_s);
            m.model_busy_s += s.model_busy_s;
            busy_total += s.model_busy_s;
            pipe_total += s.pipeline_s;
            m.wait_input_s += s.wait_input_s;
            m.wait_output_s += s.wait_output_s;
            m.decode_s += s.decode_s;
            m.stale_temps_removed += s.stale_temps_removed;
            m.failures.extend(s.failures.iter().cloned());
            for (k, st) in &s.stages {
                let e = m.stages.entry(k.clone()).or_default();
                e.done += st.done;
                e.skipped += st.skipped;
                e.failed += st.failed;
                e.skipped_failed += st.skipped_failed;
                e.model_s += st.model_s;
                e.write_s += st.write_s;
                e.model_loaded |= st.model_loaded;
                for (mm, c) in &st.by_model {
                    *e.by_model.entry(mm.clone()).or_default() += c;
                }
            }
        }
        m.images_per_s = if m.pipeline_s > 0.0 { m.processed as f64 / m.pipeline_s } else { 0.0 };
        m.model_busy_fraction = if pipe_total > 0.0 { busy_total / pipe_total } else { 0.0 };
        let wall_total: f64 = shards.iter().map(|s| s.wall_s).sum();
        m.model_busy_fraction_wall = if wall_total > 0.0 { busy_total / wall_total } else { 0.0 };
        let json = serde_json::to_vec_pretty(&m).map_err(|e| Error::Config(e.to_string()))?;
        crate::fsutil::write_atomic(summary_path(output, ""), &json)?;
        Some(m)
    };
    Ok(MergeReport { stages, summary })
}
