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
//! - [`session`]: journals, pass logs and loaded models kept between batches; planning;
//! - [`watch`]: `--watch`, frames processed as they land;
//! - [`progress`]: the progress display and the summary.
pub mod config;
pub mod decode;
pub mod hash;
pub mod journal;
pub mod layout;
pub mod listing;
pub mod summary;
pub(crate) mod scheduler;
pub(crate) mod session;
pub mod shard;
pub mod stages;
pub mod tiled;
pub mod watch;

use std::collections::BTreeMap;
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
use journal::{journal_path, manifest_dir};
use layout::{collisions, create_dirs, stem_rel};
use listing::list_inputs;
use crate::progress::{Mode, Progress};
use scheduler::ItemInfo;
use session::{Plan, Session};

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

fn summary_path(output: &Path, tag: &str) -> PathBuf {
    output.join(format!("summary{tag}.json"))
}

/// Runs (or resumes) an annotation of `opts.input` into `opts.output`.
pub fn run(opts: &RunOptions) -> Result<Summary> {
    let t0 = Instant::now();
    let mut s = Session::open(opts)?;
    let cfg = opts.config.clone();
    let (shard, tag, output) = (s.shard, s.tag.clone(), s.output.clone());

    // Inputs.
    let listing = list_inputs(&opts.input, &cfg.extensions, Some(&s.out_c), cfg.fingerprint, &s.mdir.join(format!("filelist{tag}.json")), opts.rescan)?;
    for w in &listing.warnings {
        log(&format!("warning: {w}"));
    }
    for u in &listing.skipped {
        s.say(&format!("not listed: {u}"));
    }
    let items: Vec<ItemInfo> = listing.files.iter().map(|f| ItemInfo { stem: stem_rel(&f.rel), file: f.clone() }).collect();
    let stems: Vec<String> = items.iter().map(|i| i.stem.clone()).collect();
    let coll = collisions(&stems, s.stages.iter().any(|k| cfg.visualize(*k)));
    let given_up = s.open_pass_logs(&items)?;

    // Plan: whole batches of the sorted list; this shard's; what each member still needs.
    let n = items.len();
    let b = cfg.chunk_len();
    let groups: Vec<Vec<usize>> = (0..n.div_ceil(b)).filter(|c| shard.owns_chunk(*c)).map(|c| (c * b..((c + 1) * b).min(n)).collect()).collect();
    let in_shard: usize = groups.iter().map(Vec::len).sum();
    let mut plan = s.plan(&items, &listing.root, &coll, &groups, opts.retry_failed)?;
    s.sync()?;

    // Output directories once, up front; temp files of killed runs removed.
    create_dirs(&output, std::mem::take(&mut plan.pending_outputs))?;
    let stale = remove_stale_temps_of(&s, &mut plan)?;
    let todo_items = plan.todo_items().len();
    let skipped_items = plan.skipped_items;
    s.say(&format!(
        "{} inputs{} in {}; shard {shard}: {in_shard} inputs, {todo_items} to do, {skipped_items} already done",
        items.len(),
        if listing.from_cache { " (cached list)" } else { "" },
        opts.input.display()
    ));
    let setup_s = t0.elapsed().as_secs_f64();

    // Models (only for stages some batch runs).
    let t_load = Instant::now();
    s.load_chains(&plan)?;
    let load_s = t_load.elapsed().as_secs_f64();

    let progress = Progress::new("annotate", Mode::from_config(&cfg.progress.mode), plan.pipeline_items().len(), Duration::from_secs_f64(cfg.progress.interval_s.max(0.1)));
    let mut stats = s.execute(&items, &listing.root, plan, progress, false)?;
    Session::add_given_up(&mut stats, &items, given_up);

    let head = SummaryHead {
        input: &opts.input,
        listed: items.len(),
        in_shard,
        processed: todo_items,
        skipped: skipped_items,
        listing_cached: listing.from_cache,
        unlisted: listing.skipped.clone(),
        stale_temps_removed: stale,
        setup_s,
        load_s,
    };
    let summary = make_summary(&s, head, stats, t0);
    drop(s);
    write_summary(&output, &tag, &summary)?;
    Ok(summary)
}

/// Removes the temp files killed runs left beside the plan's outputs and the state files (only
/// this shard's when sharded).
fn remove_stale_temps_of(s: &Session, plan: &mut Plan) -> Result<usize> {
    let mut owned = std::mem::take(&mut plan.owned);
    for f in [summary_path(&s.output, &s.tag), s.mdir.join(format!("filelist{}.json", s.tag))] {
        owned.insert(f);
    }
    for k in &s.stages {
        owned.insert(journal_path(&s.output, *k, ""));
    }
    s.remove_stale_temps(std::mem::take(&mut plan.shard_dirs), owned)
}

/// The counts of a run that are not in its [`ExecStats`].
pub(crate) struct SummaryHead<'a> {
    /// The input directory as given.
    pub input: &'a Path,
    /// Inputs listed (all shards).
    pub listed: usize,
    /// Inputs of this shard.
    pub in_shard: usize,
    /// Inputs with work.
    pub processed: usize,
    /// Inputs with nothing to do.
    pub skipped: usize,
    /// Whether the list came from the cache.
    pub listing_cached: bool,
    /// Files the listing could not include.
    pub unlisted: Vec<String>,
    /// Stale temp files removed.
    pub stale_temps_removed: usize,
    /// Seconds of setup.
    pub setup_s: f64,
    /// Seconds loading models.
    pub load_s: f64,
}

/// The summary of a run from its counts and the pipeline's stats.
pub(crate) fn make_summary(s: &Session, h: SummaryHead<'_>, stats: scheduler::ExecStats, t0: Instant) -> Summary {
    let mut summary = Summary {
        input_dir: h.input.display().to_string(),
        output_dir: s.output.display().to_string(),
        shard: s.shard.to_string(),
        listed: h.listed,
        in_shard: h.in_shard,
        processed: h.processed,
        skipped: h.skipped,
        failed: stats.failed_items.len(),
        listing_cached: h.listing_cached,
        setup_s: h.setup_s,
        load_s: h.load_s,
        pipeline_s: stats.pipeline_s,
        wall_s: 0.0,
        images_per_s: if stats.pipeline_s > 0.0 { h.processed as f64 / stats.pipeline_s } else { 0.0 },
        model_busy_s: stats.model_busy_s,
        model_busy_fraction: if stats.pipeline_s > 0.0 { stats.model_busy_s / stats.pipeline_s } else { 0.0 },
        model_busy_fraction_wall: 0.0,
        wait_input_s: stats.wait_input_s,
        wait_output_s: stats.wait_output_s,
        decode_s: stats.decode_s,
        stages: BTreeMap::new(),
        failures: stats.failures,
        unlisted: h.unlisted,
        stale_temps_removed: h.stale_temps_removed,
    };
    for (k, st) in &s.stage_summary {
        let mut st = st.clone();
        if let Some(x) = stats.stages.get(k) {
            st.done = x.done;
            st.failed = x.failed;
            st.model_s = x.model_s;
            st.write_s = x.write_s;
            st.by_model = x.by_model.clone();
        }
        summary.stages.insert(k.name().to_string(), st);
    }
    summary.wall_s = t0.elapsed().as_secs_f64();
    summary.model_busy_fraction_wall = if summary.wall_s > 0.0 { summary.model_busy_s / summary.wall_s } else { 0.0 };
    summary
}

/// Writes `summary<tag>.json` atomically.
pub(crate) fn write_summary(output: &Path, tag: &str, summary: &Summary) -> Result<()> {
    let json = serde_json::to_vec_pretty(summary).map_err(|e| Error::Config(e.to_string()))?;
    crate::fsutil::write_atomic(summary_path(output, tag), &json)
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
                e.cadence_skipped += st.cadence_skipped;
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
