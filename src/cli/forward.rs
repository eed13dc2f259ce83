//! `edgerun forward --model M --input in.safetensors --output out.safetensors`.
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use edgerun::device::{parse_device, parse_dtype};
use edgerun::tensor_io::{read_tensors, write_tensors};
use edgerun::weights::WeightStore;

/// Arguments of `forward`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Model directory or `.gguf` file.
    #[arg(long)]
    model: PathBuf,
    /// Input tensors (safetensors, reference names such as `pixel_values`).
    #[arg(long)]
    input: PathBuf,
    /// Where to write the outputs (safetensors).
    #[arg(long)]
    output: PathBuf,
    /// cpu, cuda[:N], metal or auto.
    #[arg(long, default_value = "auto")]
    device: String,
    /// Compute dtype: f32, f16, bf16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Run the forward pass N times and print timings as one JSON line on stderr.
    #[arg(long)]
    repeat: Option<usize>,
}

/// Runs `forward`.
pub fn run(a: Args) -> anyhow::Result<()> {
    let device = parse_device(&a.device)?;
    let dtype = parse_dtype(&a.dtype)?;
    let t0 = Instant::now();
    let store = Arc::new(WeightStore::open(&a.model).with_context(|| format!("cannot open model {}", a.model.display()))?);
    let model = edgerun::models::load(store, &device, dtype).with_context(|| format!("cannot load model {}", a.model.display()))?;
    device.synchronize()?;
    let load_ms = t0.elapsed().as_secs_f64() * 1e3;
    let inputs = read_tensors(&a.input, dtype, &device).with_context(|| format!("cannot read inputs {}", a.input.display()))?;
    let n = a.repeat.unwrap_or(1);
    anyhow::ensure!(n >= 1, "--repeat must be at least 1");
    let mut times = Vec::with_capacity(n);
    let mut outputs = None;
    for _ in 0..n {
        let t = Instant::now();
        let out = model.forward_named(&inputs)?;
        device.synchronize()?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
        outputs = Some(out);
    }
    let outputs = outputs.context("no forward pass ran")?;
    write_tensors(&a.output, &outputs).with_context(|| format!("cannot write {}", a.output.display()))?;
    if a.repeat.is_some() {
        eprintln!("{}", serde_json::json!({"load_ms": load_ms, "forward_ms": times}));
    }
    Ok(())
}
