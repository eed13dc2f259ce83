//! `edgerun inspect <file|dir>`.
use std::path::PathBuf;

use anyhow::Context;
use edgerun::weights::{Format, WeightStore};

/// Arguments of `inspect`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A model directory, `.safetensors` or `.gguf` file.
    path: PathBuf,
    /// Print as JSON instead of a table.
    #[arg(long)]
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
    let arch = store.architecture().unwrap_or_else(|| "unknown".into());
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
        println!("{}", serde_json::to_string_pretty(&j)?);
        return Ok(());
    }
    println!("path:         {}", a.path.display());
    println!("format:       {format} ({} file{})", store.files().len(), if store.files().len() == 1 { "" } else { "s" });
    println!("architecture: {arch}");
    if !store.metadata().is_empty() {
        println!("metadata:");
        for (k, v) in store.metadata() {
            println!("  {k} = {}", v.summary());
        }
    }
    let width = store.entries().keys().map(|k| k.len()).max().unwrap_or(4).max(4);
    println!("tensors:");
    println!("  {:<width$}  {:<6}  {:<20}  {:>12}", "name", "dtype", "shape", "bytes");
    for e in store.entries().values() {
        println!("  {:<width$}  {:<6}  {:<20}  {:>12}", e.name, e.dtype.name(), format!("{:?}", e.shape), e.len);
    }
    println!("total: {} tensors, {params} parameters, {} ({} bytes)", store.entries().len(), human(store.total_bytes()), store.total_bytes());
    Ok(())
}
