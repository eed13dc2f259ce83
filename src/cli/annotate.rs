//! `edgerun annotate [--config annotate.toml] <input_dir> <output_dir>`: the resumable dataset pipeline;
//! `--print-config` prints the commented default configuration, `--merge <output_dir>` combines shards.
use std::path::PathBuf;

use anyhow::Context;
use argh::FromArgs;
use edgerun::annotate::{self, Config, Fingerprint, RunOptions, Shard, StageKind};
use edgerun::runner::BatchSetting;

use super::common::{outln, usage, UsageError};

/// Annotate a dataset (depth → edges → segmentation → canopy height): resumable, shardable.
#[derive(FromArgs, Debug)]
#[argh(subcommand, name = "annotate")]
pub struct Args {
    /// INPUT_DIR (searched recursively, sorted) and OUTPUT_DIR (`<stage>/` trees, `manifests/`
    /// journals, `summary.json`)
    #[argh(positional, arg_name = "INPUT_DIR OUTPUT_DIR")]
    dirs: Vec<PathBuf>,
    /// configuration file (TOML); see --print-config
    #[argh(option)]
    config: Option<PathBuf>,
    /// print the commented default configuration and exit
    #[argh(switch)]
    print_config: bool,
    /// combine the shard journals and summaries of OUTPUT_DIR and exit
    #[argh(option, arg_name = "OUTPUT_DIR")]
    merge: Option<PathBuf>,
    /// stages to run, comma-separated (depth, edges, segmentation, chm)
    #[argh(option)]
    stages: Option<String>,
    /// primary model of a stage: STAGE=PATH (repeatable)
    #[argh(option, long = "model", arg_name = "STAGE=PATH")]
    models: Vec<String>,
    /// device for every stage: cpu, cuda[:N], metal or auto
    #[argh(option)]
    device: Option<String>,
    /// compute dtype for every stage: f32, f16, bf16
    #[argh(option)]
    dtype: Option<String>,
    /// images per forward pass: auto or a number from 1 to 256
    #[argh(option)]
    batch: Option<BatchSetting>,
    /// memory for activations in MiB (default: what the device can spare, less 10 %)
    #[argh(option)]
    mem_budget: Option<u64>,
    /// bound (MiB) on decoded images and results in flight
    #[argh(option)]
    memory_mb: Option<u64>,
    /// decode threads (0 = automatic)
    #[argh(option)]
    decode_threads: Option<usize>,
    /// writer threads
    #[argh(option)]
    write_threads: Option<usize>,
    /// write PNG visualisations for every stage
    #[argh(switch)]
    visualize: bool,
    /// input identity on resume: mtime or content
    #[argh(option)]
    fingerprint: Option<String>,
    /// this process's shard K/N (0-based); default from SLURM_ARRAY_TASK_ID/_COUNT or JOB_COMPLETION_INDEX
    #[argh(option)]
    shard: Option<String>,
    /// number of shards when the index comes from JOB_COMPLETION_INDEX (or to override SLURM's count)
    #[argh(option)]
    shard_count: Option<usize>,
    /// retry inputs an earlier run recorded as failed
    #[argh(switch)]
    retry_failed: bool,
    /// re-list the input tree even if the cached list looks current (and, with content fingerprints,
    /// re-hash every input): notices files rewritten in place
    #[argh(switch)]
    rescan: bool,
    /// progress display: auto, bar, lines or none
    #[argh(option)]
    progress: Option<String>,
    /// keep running: process frames as they land in INPUT_DIR until SIGTERM / Ctrl-C (a second
    /// one stops at once) or --idle-exit; writes OUTPUT_DIR/status.json (docs/watch.md)
    #[argh(switch)]
    watch: bool,
    /// with --watch: which waiting frame goes first, newest (default) or oldest
    #[argh(option)]
    order: Option<String>,
    /// with --watch: record the oldest waiting frames beyond N as skipped (a later run processes
    /// them); 0 = no bound
    #[argh(option, arg_name = "N")]
    max_backlog: Option<usize>,
    /// with --watch: stop after SECS without a new frame
    #[argh(option, arg_name = "SECS")]
    idle_exit: Option<f64>,
    /// with --watch: a file not seen being closed is complete once its size and mtime were stable
    /// this long (default 2)
    #[argh(option, arg_name = "SECS")]
    settle: Option<f64>,
}

impl Args {
    /// Whether any option of a pipeline run (not `--print-config` / `--merge`) was given.
    fn has_run_options(&self) -> bool {
        !self.dirs.is_empty()
            || self.config.is_some()
            || self.stages.is_some()
            || !self.models.is_empty()
            || self.device.is_some()
            || self.dtype.is_some()
            || self.batch.is_some()
            || self.mem_budget.is_some()
            || self.memory_mb.is_some()
            || self.decode_threads.is_some()
            || self.write_threads.is_some()
            || self.visualize
            || self.fingerprint.is_some()
            || self.shard.is_some()
            || self.shard_count.is_some()
            || self.retry_failed
            || self.rescan
            || self.progress.is_some()
            || self.watch
            || self.watch_options()
    }

    /// Whether an option that only `--watch` takes was given.
    fn watch_options(&self) -> bool {
        self.order.is_some() || self.max_backlog.is_some() || self.idle_exit.is_some() || self.settle.is_some()
    }
}

fn apply_overrides(a: &Args, cfg: &mut Config) -> anyhow::Result<()> {
    if let Some(s) = &a.stages {
        cfg.stages = s.split(',').filter(|s| !s.trim().is_empty()).map(|s| StageKind::parse(s.trim())).collect::<Result<_, _>>()?;
    }
    for m in &a.models {
        let (stage, path) = m.split_once('=').with_context(|| format!("--model `{m}` is not STAGE=PATH"))?;
        let k = StageKind::parse(stage)?;
        let s = cfg.model_stage_mut(k).with_context(|| format!("--model: stage `{stage}` has no model"))?;
        // A path given on the command line is relative to the working directory.
        let p = std::path::absolute(path).with_context(|| format!("--model {m}"))?;
        s.model = p.to_string_lossy().into_owned();
    }
    if let Some(d) = &a.device {
        cfg.device = d.clone();
        for k in [StageKind::Depth, StageKind::Segmentation, StageKind::Chm] {
            if let Some(s) = cfg.model_stage_mut(k) {
                s.device = None;
            }
        }
    }
    if let Some(d) = &a.dtype {
        cfg.dtype = d.clone();
        for k in [StageKind::Depth, StageKind::Segmentation, StageKind::Chm] {
            if let Some(s) = cfg.model_stage_mut(k) {
                s.dtype = None;
            }
        }
    }
    if let Some(b) = a.batch {
        cfg.batch = b;
    }
    if a.mem_budget.is_some() {
        cfg.mem_budget_mb = a.mem_budget;
    }
    if let Some(m) = a.memory_mb {
        cfg.memory_mb = m;
    }
    if let Some(n) = a.decode_threads {
        cfg.decode_threads = n;
    }
    if let Some(n) = a.write_threads {
        cfg.write_threads = n;
    }
    if a.visualize {
        cfg.depth.visualize = true;
        cfg.edges.visualize = true;
        cfg.segmentation.visualize = true;
        cfg.chm.visualize = true;
    }
    if let Some(f) = &a.fingerprint {
        cfg.fingerprint = match f.as_str() {
            "mtime" => Fingerprint::Mtime,
            "content" => Fingerprint::Content,
            other => anyhow::bail!("--fingerprint `{other}`: expected mtime or content"),
        };
    }
    if let Some(p) = &a.progress {
        cfg.progress.mode = p.clone();
    }
    if let Some(o) = &a.order {
        cfg.watch.order = o.clone();
    }
    if let Some(n) = a.max_backlog {
        cfg.watch.max_backlog = n;
    }
    if let Some(s) = a.idle_exit {
        cfg.watch.idle_exit_s = s;
    }
    if let Some(s) = a.settle {
        cfg.watch.settle_s = s;
    }
    Ok(())
}

/// Runs `annotate`.
pub fn run(a: Args) -> anyhow::Result<()> {
    if a.print_config {
        usage(a.merge.is_none() && !a.has_run_options(), || "--print-config takes no other argument".into())?;
        outln!("{}", annotate::DEFAULT_CONFIG.trim_end());
        return Ok(());
    }
    if let Some(dir) = &a.merge {
        usage(!a.has_run_options(), || "--merge OUTPUT_DIR takes no input, output or run option".into())?;
        let r = annotate::merge(dir).with_context(|| format!("cannot merge {}", dir.display()))?;
        anyhow::ensure!(!r.stages.is_empty(), "no journals in {}", annotate::journal::manifest_dir(dir).display());
        for (stage, m) in &r.stages {
            outln!("{stage}: {} ok, {} failed (from {} journals) → manifests/{stage}.jsonl", m.ok, m.failed, m.journals);
        }
        if let Some(s) = &r.summary {
            outln!("summary.json: {} inputs processed by {}, {} failed", s.processed, s.shard, s.failed);
        }
        return Ok(());
    }
    usage(a.watch || !a.watch_options(), || "--order, --max-backlog, --idle-exit and --settle are options of --watch".into())?;
    let Ok([input, output]) = <[PathBuf; 2]>::try_from(a.dirs.clone()) else {
        return Err(UsageError("annotate: give <input_dir> and <output_dir> (or --print-config, or --merge <output_dir>)".into()).into());
    };
    let mut cfg = match &a.config {
        Some(p) => Config::load(p).with_context(|| format!("cannot use config {}", p.display()))?,
        None => Config::default(),
    };
    apply_overrides(&a, &mut cfg)?;
    cfg.validate().context("invalid configuration")?;
    let shard = match &a.shard {
        Some(s) => Shard::parse(s)?,
        None => Shard::from_env(a.shard_count)?.unwrap_or_default(),
    };
    let opts = RunOptions { config: cfg, input, output, shard, retry_failed: a.retry_failed, rescan: a.rescan };
    let summary = if a.watch { annotate::watch::run(&opts) } else { annotate::run(&opts) }
        .with_context(|| format!("annotate {} → {}", opts.input.display(), opts.output.display()))?;
    if opts.config.progress.mode != "none" {
        eprintln!("{}", summary.render());
    }
    // Failed items are recorded and the run goes on; a run in which every item failed is an error
    // (exit 2, as a direct command with failures), so a cluster job whose images all failed fails.
    if summary.processed > 0 && summary.failed == summary.processed {
        let first = summary.failures.first().map(|f| format!("; the first: {}: {}: {}", f.input, f.stage, f.reason)).unwrap_or_default();
        return Err(UsageError(format!(
            "annotate: every one of the {} inputs processed failed (recorded in {}/manifests/){first}",
            summary.processed,
            opts.output.display()
        ))
        .into());
    }
    Ok(())
}
