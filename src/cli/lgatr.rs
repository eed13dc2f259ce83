//! `edgerun lgatr --model M --input events.safetensors --output out.safetensors`: batches of
//! particle events of different lengths (padded and masked, no cross-talk between events).
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use edgerun::models::lgatr::{forward_events, pack_events, unpack_events};
use edgerun::tensor_io::{read_tensors, write_tensors};
use edgerun::weights::WeightStore;

use super::common::Compute;

/// Arguments of `lgatr`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// L-GATr or L-GATr-slim model directory (`config.json` + `model.safetensors`).
    #[arg(long)]
    model: PathBuf,
    /// Packed events: each input `[ΣN, …]` (the items of all events concatenated) plus `lengths` `[E]`.
    #[arg(long)]
    input: PathBuf,
    /// Where to write the packed outputs (same layout, with `lengths`).
    #[arg(long)]
    output: PathBuf,
    /// Most events per padded forward pass (0: all at once).
    #[arg(long, default_value_t = 64)]
    batch: usize,
    #[command(flatten)]
    compute: Compute,
}

/// Runs `lgatr`.
pub fn run(a: Args) -> anyhow::Result<()> {
    let (device, dtype) = a.compute.resolve()?;
    let store = Arc::new(WeightStore::open(&a.model).with_context(|| format!("cannot open model {}", a.model.display()))?);
    let arch = store.architecture().unwrap_or_default();
    anyhow::ensure!(arch == "lgatr" || arch == "lgatr_slim", "{}: `{arch}` is not an L-GATr model", a.model.display());
    let model = edgerun::models::load(store, &device, dtype).with_context(|| format!("cannot load model {}", a.model.display()))?;
    let packed = read_tensors(&a.input, dtype, &device).with_context(|| format!("cannot read {}", a.input.display()))?;
    let events = unpack_events(&packed).with_context(|| format!("bad events in {}", a.input.display()))?;
    let outputs = forward_events(model.as_ref(), &events, a.batch)?;
    write_tensors(&a.output, &pack_events(&outputs)?).with_context(|| format!("cannot write {}", a.output.display()))?;
    eprintln!("lgatr: {} events", events.len());
    Ok(())
}
