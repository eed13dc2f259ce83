//! `edgerun lgatr --model M --input events.safetensors --output out.safetensors`: batches of
//! particle events of different lengths (padded and masked, no cross-talk between events).
use std::path::PathBuf;

use anyhow::Context;
use argh::FromArgs;
use edgerun::fsutil::register_input;
use edgerun::models::lgatr::{forward_events, pack_events, unpack_events};
use edgerun::tensor_io::{read_tensors, write_tensors};
use edgerun::models::Checkpoint;
use edgerun::tasks::Task;

use super::common::compute;

/// L-GATr on batches of particle events of different lengths.
#[derive(FromArgs, Debug)]
#[argh(subcommand, name = "lgatr")]
pub struct Args {
    /// an L-GATr or L-GATr-slim model directory (`config.json` + `model.safetensors`) (required)
    #[argh(option)]
    model: PathBuf,
    /// packed events: each input `[ΣN, …]` (the items of all events concatenated) plus `lengths` `[E]` (required)
    #[argh(option)]
    input: PathBuf,
    /// where to write the packed outputs (same layout, with `lengths`) (required)
    #[argh(option)]
    output: PathBuf,
    /// most events per padded forward pass (0: all at once; default 64)
    #[argh(option, default = "64")]
    batch: usize,
    /// device: cpu, cuda[:N], metal or auto (default auto)
    #[argh(option, default = "String::from(\"auto\")")]
    device: String,
    /// compute dtype: f32 (default), f16, bf16
    #[argh(option, default = "String::from(\"f32\")")]
    dtype: String,
}

/// Runs `lgatr`.
pub fn run(a: Args) -> anyhow::Result<()> {
    let (device, dtype) = compute(&a.device, &a.dtype)?;
    let ckpt = Checkpoint::open(&a.model).with_context(|| format!("cannot open model {}", a.model.display()))?;
    anyhow::ensure!(
        ckpt.serves(Task::Events),
        edgerun::Error::Config(format!("{}: a `{}` model, not L-GATr (model_type `lgatr` or `lgatr_slim`)", a.model.display(), ckpt.architecture()))
    );
    let model = ckpt.load(&device, dtype).with_context(|| format!("cannot load model {}", a.model.display()))?;
    let packed = read_tensors(&a.input, dtype, &device).with_context(|| format!("cannot read {}", a.input.display()))?;
    let events = unpack_events(&packed).with_context(|| format!("bad events in {}", a.input.display()))?;
    let outputs = forward_events(model.as_ref(), &events, a.batch)?;
    register_input(&a.input);
    write_tensors(&a.output, &pack_events(&outputs)?).with_context(|| format!("cannot write {}", a.output.display()))?;
    eprintln!("lgatr: {} events", events.len());
    Ok(())
}
