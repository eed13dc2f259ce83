//! `edgerun quantize <in> <out.gguf> --type T [--recipe R]`.
use std::path::PathBuf;

use anyhow::Context;
use argh::FromArgs;
use edgerun::quantize::{quantize_with, Recipe};
use edgerun::weights::dtype::{ggml_name, parse_ggml_name};

use super::common::outln;

/// Write a GGUF copy of a model with quantized matrices.
#[derive(FromArgs, Debug)]
#[argh(subcommand, name = "quantize")]
pub struct Args {
    /// the source model (directory, `.safetensors` or `.gguf`)
    #[argh(positional, arg_name = "INPUT")]
    input: PathBuf,
    /// the GGUF file to write
    #[argh(positional, arg_name = "OUTPUT")]
    output: PathBuf,
    /// target type for matrices: f16, q8_0, q4_0, q4k, q6k (also f32, q5_0, q5k, ...) (required)
    #[argh(option, long = "type", arg_name = "TYPE")]
    qtype: String,
    /// a recipe TOML (default: `quantize/<arch>.toml` rules built in for the architecture, else generic)
    #[argh(option)]
    recipe: Option<PathBuf>,
    /// a prompt list (one per line, or comma-separated): store these prompts' features in the GGUF
    /// and leave the text encoder out (SAM 3)
    #[argh(option, arg_name = "FILE")]
    prompts: Option<PathBuf>,
    /// print only the summary, not one line per tensor
    #[argh(switch)]
    quiet: bool,
}

/// Runs `quantize`.
pub fn run(a: Args) -> anyhow::Result<()> {
    let target = parse_ggml_name(&a.qtype).with_context(|| format!("unknown --type `{}`", a.qtype))?;
    let recipe = match &a.recipe {
        Some(p) => Recipe::from_file(p)?,
        None => {
            let store = edgerun::weights::WeightStore::open(&a.input).with_context(|| format!("cannot open {}", a.input.display()))?;
            let arch = edgerun::models::architecture(&store).unwrap_or_default();
            Recipe::builtin(&arch)?.unwrap_or_default()
        }
    };
    let prompts = match &a.prompts {
        Some(p) => Some(edgerun::models::sam3::prompts::read_prompt_file(p)?),
        None => None,
    };
    let quiet = a.quiet;
    let mut printed = Ok(());
    let s = quantize_with(&a.input, &a.output, target, &recipe, prompts.as_deref(), |r| {
        if !quiet && printed.is_ok() {
            printed = super::common::write_stdout(format_args!(
                "{:<60} {:<6} {:>18} {:>10} -> {:>10}  rel.err {:.2e}",
                r.name,
                ggml_name(r.dtype),
                format!("{:?}", r.shape),
                r.bytes_in,
                r.bytes_out,
                r.rel_error
            ));
        }
    })
    .with_context(|| format!("quantizing {} into {}", a.input.display(), a.output.display()))?;
    printed?;
    outln!(
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
