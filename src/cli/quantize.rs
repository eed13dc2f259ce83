//! `edgerun quantize <in> <out.gguf> --type T [--recipe R]`.
use std::path::PathBuf;

use anyhow::Context;
use edgerun::quantize::{quantize, Recipe};
use edgerun::weights::dtype::{ggml_name, parse_ggml_name};

/// Arguments of `quantize`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The source model (directory, `.safetensors` or `.gguf`).
    input: PathBuf,
    /// The GGUF file to write.
    output: PathBuf,
    /// Target type for matrices: f16, q8_0, q4_0, q4k, q6k (also f32, q5_0, q5k, ...).
    #[arg(long = "type", value_name = "TYPE")]
    qtype: String,
    /// A recipe TOML (default: `quantize/<arch>.toml` rules built in for the architecture, else generic).
    #[arg(long)]
    recipe: Option<PathBuf>,
    /// Print only the summary, not one line per tensor.
    #[arg(long)]
    quiet: bool,
}

/// Runs `quantize`.
pub fn run(a: Args) -> anyhow::Result<()> {
    let target = parse_ggml_name(&a.qtype).with_context(|| format!("unknown --type `{}`", a.qtype))?;
    let recipe = match &a.recipe {
        Some(p) => Recipe::from_file(p)?,
        None => {
            let arch = edgerun::weights::WeightStore::open(&a.input)
                .with_context(|| format!("cannot open {}", a.input.display()))?
                .architecture()
                .unwrap_or_default();
            Recipe::builtin(&arch)?.unwrap_or_default()
        }
    };
    anyhow::ensure!(a.output != a.input, "output must differ from input");
    let quiet = a.quiet;
    let s = quantize(&a.input, &a.output, target, &recipe, |r| {
        if !quiet {
            println!(
                "{:<60} {:<6} {:>18} {:>10} -> {:>10}  rel.err {:.2e}",
                r.name,
                ggml_name(r.dtype),
                format!("{:?}", r.shape),
                r.bytes_in,
                r.bytes_out,
                r.rel_error
            );
        }
    })
    .with_context(|| format!("quantizing {} into {}", a.input.display(), a.output.display()))?;
    println!(
        "wrote {}: {} tensors, {} -> {} bytes ({:.1}%), max rel.err {:.2e}",
        a.output.display(),
        s.tensors,
        s.bytes_in,
        s.bytes_out,
        100.0 * s.bytes_out as f64 / s.bytes_in.max(1) as f64,
        s.max_rel_error
    );
    Ok(())
}
