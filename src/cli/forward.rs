//! `edgerun forward --model M --input in.safetensors --output out.safetensors`.
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use argh::FromArgs;
use edgerun::fsutil::register_input;
use edgerun::tensor_io::{read_tensors, DiscardSink, SafetensorsSink};
use edgerun::weights::WeightStore;

use super::common::{check_count, compute};

/// Run a model's raw forward pass on preprocessed tensors.
#[derive(FromArgs, Debug)]
#[argh(subcommand, name = "forward")]
pub struct Args {
    /// model directory or `.gguf` file (required)
    #[argh(option)]
    model: PathBuf,
    /// input tensors (safetensors, reference names such as `pixel_values`) (required)
    #[argh(option)]
    input: PathBuf,
    /// where to write the outputs (safetensors) (required)
    #[argh(option)]
    output: PathBuf,
    /// device: cpu, cuda[:N], metal or auto (default auto)
    #[argh(option, default = "String::from(\"auto\")")]
    device: String,
    /// compute dtype: f32 (default), f16, bf16
    #[argh(option, default = "String::from(\"f32\")")]
    dtype: String,
    /// run the forward pass N times (1 to 10000) and print timings as one JSON line on stderr
    #[argh(option)]
    repeat: Option<usize>,
}

/// Most forward passes `--repeat` accepts.
const MAX_REPEAT: usize = 10_000;

/// Runs `forward`.
pub fn run(a: Args) -> anyhow::Result<()> {
    let n = a.repeat.unwrap_or(1);
    check_count("--repeat", n, 1, MAX_REPEAT)?;
    let (device, dtype) = compute(&a.device, &a.dtype)?;
    let t0 = Instant::now();
    let store = Arc::new(WeightStore::open(&a.model).with_context(|| format!("cannot open model {}", a.model.display()))?);
    let model = edgerun::models::load(store, &device, dtype).with_context(|| format!("cannot load model {}", a.model.display()))?;
    device.synchronize()?;
    let load_ms = t0.elapsed().as_secs_f64() * 1e3;
    let inputs = read_tensors(&a.input, dtype, &device).with_context(|| format!("cannot read inputs {}", a.input.display()))?;
    register_input(&a.input);
    let mut times = Vec::with_capacity(n);
    // Passes before the last hand their outputs to nothing; the last writes them to the file as they
    // are made (SAM 3 writes each prompt's masks and drops them), its time less the writing.
    for _ in 1..n {
        let t = Instant::now();
        edgerun::device::on_pool_worker(&device, || model.forward_into(&inputs, &mut DiscardSink))?;
        device.synchronize()?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let mut sink = SafetensorsSink::create(&a.output).with_context(|| format!("cannot write {}", a.output.display()))?;
    let t = Instant::now();
    edgerun::device::on_pool_worker(&device, || model.forward_into(&inputs, &mut sink))?;
    device.synchronize()?;
    times.push(t.elapsed().saturating_sub(sink.busy()).as_secs_f64() * 1e3);
    sink.commit().with_context(|| format!("cannot write {}", a.output.display()))?;
    if a.repeat.is_some() {
        eprintln!("{}", serde_json::json!({"load_ms": load_ms, "forward_ms": times}));
    }
    Ok(())
}
