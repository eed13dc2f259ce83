//! `edgerun finetune --config finetune.toml [overrides]`: on-device fine-tuning; `--print-config`
//! prints the commented default.
use std::path::PathBuf;

use anyhow::Context;
use argh::FromArgs;
use edgerun::train::config::{FinetuneConfig, DEFAULT_TOML};
use edgerun::train::finetune::finetune;

use super::common::{compute, outln, usage};

/// Fine-tune a model on labelled images (AdamW, one-cycle LR, accumulation, EMA; resumable).
#[derive(FromArgs, Debug)]
#[argh(subcommand, name = "finetune")]
pub struct Args {
    /// configuration file (TOML); see --print-config
    #[argh(option)]
    config: Option<PathBuf>,
    /// print the commented default configuration and exit
    #[argh(switch)]
    print_config: bool,
    /// model directory or GGUF file (overrides `model`)
    #[argh(option)]
    model: Option<PathBuf>,
    /// task: depth, segmentation or chm (overrides `task`)
    #[argh(option)]
    task: Option<edgerun::tasks::Task>,
    /// data directory with images/ and targets/ (overrides `data`)
    #[argh(option)]
    data: Option<PathBuf>,
    /// output directory (overrides `out`)
    #[argh(option)]
    out: Option<PathBuf>,
    /// training resolution HxW, e.g. 518x518 (overrides `input_size`)
    #[argh(option)]
    input_size: Option<String>,
    /// passes over the training split (overrides `epochs`)
    #[argh(option)]
    epochs: Option<usize>,
    /// images per micro-batch (overrides `batch`)
    #[argh(option)]
    batch: Option<usize>,
    /// micro-batches per optimiser step (overrides `accumulate`)
    #[argh(option)]
    accumulate: Option<usize>,
    /// what trains: head, last:N or all (overrides `train`)
    #[argh(option)]
    train: Option<edgerun::train::select::TrainSpec>,
    /// keep only each trained block's input and recompute blocks in backward (overrides the file)
    #[argh(switch)]
    checkpoint_activations: bool,
    /// move kept block inputs off the device: host memory from a GPU, a spill file on a CPU (implies
    /// --checkpoint-activations)
    #[argh(switch)]
    offload: bool,
    /// device: cpu, cuda[:N], metal or auto
    #[argh(option, default = "String::from(\"auto\")")]
    device: String,
}

fn parse_size(s: &str) -> anyhow::Result<[usize; 2]> {
    let parsed = s.split_once(['x', 'X']).and_then(|(h, w)| Some([h.trim().parse().ok()?, w.trim().parse().ok()?]));
    parsed.ok_or_else(|| anyhow::Error::new(edgerun::Error::Config(format!("--input-size `{s}`: expected HxW, e.g. 518x518"))))
}

impl Args {
    fn config(&self) -> anyhow::Result<FinetuneConfig> {
        let mut c = match &self.config {
            Some(p) => FinetuneConfig::load(p).with_context(|| format!("cannot use config {}", p.display()))?,
            None => FinetuneConfig::from_toml("model = \"\"\ntask = \"depth\"\ndata = \"\"\nout = \"\"\n", std::path::Path::new("."))?,
        };
        if let Some(v) = &self.model { c.model = v.clone() }
        if let Some(v) = self.task { c.task = v }
        if let Some(v) = &self.data { c.data = v.clone() }
        if let Some(v) = &self.out { c.out = v.clone() }
        if let Some(v) = &self.input_size { c.input_size = parse_size(v)? }
        if let Some(v) = self.epochs { c.epochs = v }
        if let Some(v) = self.batch { c.batch = v }
        if let Some(v) = self.accumulate { c.accumulate = v }
        if let Some(v) = self.train { c.train = v }
        c.checkpoint_activations |= self.checkpoint_activations;
        c.offload |= self.offload;
        c.validate()?;
        Ok(c)
    }
}

/// Runs `finetune`.
pub fn run(a: Args) -> anyhow::Result<()> {
    if a.print_config {
        usage(a.config.is_none() && a.model.is_none() && a.data.is_none() && a.out.is_none(), || "--print-config takes no other argument".into())?;
        outln!("{}", DEFAULT_TOML.trim_end());
        return Ok(());
    }
    let cfg = a.config()?;
    let (device, _) = compute(&a.device, "f32")?;
    let summary = edgerun::device::on_pool_worker(&device, || finetune(&cfg, &device, &mut |line| eprintln!("finetune: {line}")))?;
    let rate = if summary.seconds > 0.0 { summary.steps_taken as f64 / summary.seconds } else { 0.0 };
    let best = summary.best_val.map_or("none (no validation split)".to_string(), |v| format!("{v:.6}"));
    outln!(
        "{} of {} steps taken ({rate:.3} steps/s), best val_loss {best}; model in {}",
        summary.steps_taken,
        summary.total_steps,
        cfg.out.join("best").display()
    );
    Ok(())
}
