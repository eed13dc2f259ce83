//! `edgerun inspect <file|dir>`.
use std::path::PathBuf;

use anyhow::Context;
use argh::FromArgs;
use edgerun::weights::{Format, WeightStore};

use super::common::outln;

/// List a weight file's architecture, tensors, metadata and totals.
#[derive(FromArgs, Debug)]
#[argh(subcommand, name = "inspect")]
pub struct Args {
    /// a model directory, `.safetensors` or `.gguf` file
    #[argh(positional, arg_name = "PATH")]
    path: PathBuf,
    /// print as JSON instead of a table
    #[argh(switch)]
    json: bool,
}

fn human(bytes: usize) -> String {
    let b = bytes as f64;
    match bytes {
        n if n >= 1 << 30 => format!("{:.2} GiB", b / (1u64 << 30) as f64),
        n if n >= 1 << 20 => format!("{:.2} MiB", b / (1u64 << 20) as f64),
        n if n >= 1 << 10 => format!("{:.1} KiB", b / 1024.0),
        n => format!("{n} B"),
    }
}

/// Runs `inspect`.
pub fn run(a: Args) -> anyhow::Result<()> {
    let store = WeightStore::open(&a.path).with_context(|| format!("cannot open {}", a.path.display()))?;
    let arch = edgerun::models::architecture(&store).unwrap_or_else(|| "unknown".into());
    let format = match store.format() {
        Format::Safetensors => "safetensors",
        Format::Gguf => "gguf",
    };
    let params: usize = store.entries().values().map(|e| e.numel()).sum();
    if a.json {
        let tensors: Vec<_> = store
            .entries()
            .values()
            .map(|e| serde_json::json!({"name": e.name, "dtype": e.dtype.name(), "shape": e.shape, "bytes": e.len}))
            .collect();
        let metadata: serde_json::Map<String, serde_json::Value> =
            store.metadata().iter().map(|(k, v)| (k.clone(), serde_json::Value::String(v.summary()))).collect();
        let j = serde_json::json!({
            "path": a.path, "format": format, "architecture": arch, "files": store.files(),
            "tensors": tensors, "metadata": metadata, "total_bytes": store.total_bytes(), "parameters": params,
        });
        outln!("{}", serde_json::to_string_pretty(&j)?);
        return Ok(());
    }
    outln!("path:         {}", a.path.display());
    outln!("format:       {format} ({} file{})", store.files().len(), if store.files().len() == 1 { "" } else { "s" });
    outln!("architecture: {arch}");
    if !store.metadata().is_empty() {
        outln!("metadata:");
        for (k, v) in store.metadata() {
            outln!("  {k} = {}", v.summary());
        }
    }
    let width = store.entries().keys().map(|k| k.len()).max().unwrap_or(4).max(4);
    outln!("tensors:");
    outln!("  {:<width$}  {:<6}  {:<20}  {:>12}", "name", "dtype", "shape", "bytes");
    for e in store.entries().values() {
        outln!("  {:<width$}  {:<6}  {:<20}  {:>12}", e.name, e.dtype.name(), format!("{:?}", e.shape), e.len);
    }
    outln!("total: {} tensors, {params} parameters, {} ({} bytes)", store.entries().len(), human(store.total_bytes()), store.total_bytes());
    Ok(())
}
