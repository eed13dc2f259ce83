//! `edgerun annotate [--config annotate.toml] <input_dir> <output_dir>`: the resumable dataset pipeline;
//! `--print-config` prints the commented default configuration, `--merge <output_dir>` combines shards.
use std::path::PathBuf;

use anyhow::Context;
use edgerun::annotate::{self, Config, Fingerprint, RunOptions, Shard, StageKind};

/// Arguments of `annotate`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Input directory (searched recursively, sorted).
    #[arg(required_unless_present_any = ["print_config", "merge"])]
    input: Option<PathBuf>,
    /// Output directory: `<stage>/` trees, `manifests/` journals, `summary.json`.
    #[arg(required_unless_present_any = ["print_config", "merge"])]
    output: Option<PathBuf>,
    /// Configuration file (TOML); see --print-config.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Print the commented default configuration and exit.
    #[arg(long, exclusive = true)]
    print_config: bool,
    /// Combine the shard journals and summaries of OUTPUT_DIR and exit.
    #[arg(long, value_name = "OUTPUT_DIR", conflicts_with_all = ["input", "output", "config"])]
    merge: Option<PathBuf>,
    /// Stages to run, comma-separated (depth, edges, segmentation, chm).
    #[arg(long, value_delimiter = ',')]
    stages: Option<Vec<String>>,
    /// Primary model of a stage: STAGE=PATH (repeatable).
    #[arg(long = "model", value_name = "STAGE=PATH")]
    models: Vec<String>,
    /// Device for every stage: cpu, cuda[:N], metal or auto.
    #[arg(long)]
    device: Option<String>,
    /// Compute dtype for every stage: f32, f16, bf16.
    #[arg(long)]
    dtype: Option<String>,
    /// Images per forward pass.
    #[arg(long)]
    batch: Option<usize>,
    /// Bound (MiB) on decoded images and results in flight.
    #[arg(long)]
    memory_mb: Option<u64>,
    /// Decode threads (0 = automatic).
    #[arg(long)]
    decode_threads: Option<usize>,
    /// Writer threads.
    #[arg(long)]
    write_threads: Option<usize>,
    /// Write PNG visualisations for every stage.
    #[arg(long)]
    visualize: bool,
    /// Input identity on resume: mtime or content.
    #[arg(long)]
    fingerprint: Option<String>,
    /// This process's shard K/N (0-based); default from SLURM_ARRAY_TASK_ID/_COUNT or JOB_COMPLETION_INDEX.
    #[arg(long)]
    shard: Option<String>,
    /// Number of shards when the index comes from JOB_COMPLETION_INDEX (or to override SLURM's count).
    #[arg(long)]
    shard_count: Option<usize>,
    /// Retry inputs an earlier run recorded as failed.
    #[arg(long)]
    retry_failed: bool,
    /// Re-list the input tree even if the cached list looks current (and, with content fingerprints,
    /// re-hash every input): notices files rewritten in place.
    #[arg(long)]
    rescan: bool,
    /// Progress display: auto, bar, lines or none.
    #[arg(long)]
    progress: Option<String>,
}

fn apply_overrides(a: &Args, cfg: &mut Config) -> anyhow::Result<()> {
    if let Some(s) = &a.stages {
        cfg.stages = s.iter().filter(|s| !s.trim().is_empty()).map(|s| StageKind::parse(s)).collect::<Result<_, _>>()?;
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
    Ok(())
}

/// Runs `annotate`.
pub fn run(a: Args) -> anyhow::Result<()> {
    if a.print_config {
        print!("{}", annotate::DEFAULT_CONFIG);
        return Ok(());
    }
    if let Some(dir) = &a.merge {
        let r = annotate::merge(dir).with_context(|| format!("cannot merge {}", dir.display()))?;
        anyhow::ensure!(!r.stages.is_empty(), "no journals in {}", annotate::journal::manifest_dir(dir).display());
        for (stage, m) in &r.stages {
            println!("{stage}: {} ok, {} failed (from {} journals) → manifests/{stage}.jsonl", m.ok, m.failed, m.journals);
        }
        if let Some(s) = &r.summary {
            println!("summary.json: {} inputs processed by {}, {} failed", s.processed, s.shard, s.failed);
        }
        return Ok(());
    }
    let (Some(input), Some(output)) = (a.input.clone(), a.output.clone()) else {
        anyhow::bail!("give <input_dir> and <output_dir>");
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
    let summary = annotate::run(&opts).with_context(|| format!("annotate {} → {}", opts.input.display(), opts.output.display()))?;
    if opts.config.progress.mode != "none" {
        eprintln!("{}", summary.render());
    }
    Ok(())
}
