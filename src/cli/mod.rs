//! Command-line parsing and dispatch.
mod annotate;
mod chm;
mod common;
mod depth;
mod doctor;
mod edges;
mod forward;
mod lgatr;
mod inspect;
mod quantize;
mod segment;

use clap::{Parser, Subcommand};

/// Perception and physics models at the edge.
#[derive(Parser, Debug)]
#[command(name = "edgerun", version = env!("EDGERUN_LONG_VERSION"), about)]
pub struct Cli {
    /// CPU threads for compute (default: Candle's choice, the physical core count).
    #[arg(long, global = true)]
    threads: Option<usize>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// List a weight file's architecture, tensors, metadata and totals.
    Inspect(inspect::Args),
    /// Write a GGUF copy of a model with quantized matrices.
    Quantize(quantize::Args),
    /// Run a model's raw forward pass on preprocessed tensors.
    Forward(forward::Args),
    /// Monocular depth for images: `<stem>.depth.npy` (float16) and optional PNG.
    Depth(depth::Args),
    /// Sobel edges of existing depth maps.
    Edges(edges::Args),
    /// Report devices, memory, threads, CPU features and whether models load.
    Doctor(doctor::Args),
    /// Semantic segmentation (SegFormer) of images: `<stem>.seg.png` (uint8 class ids).
    Segment(segment::Args),
    /// Canopy height (CHMv2) in metres: `<stem>.chm.npy` (float16) and, for GeoTIFF input, a georeferenced float32 `<stem>.chm.tif`.
    Chm(chm::Args),
    /// Annotate a dataset (depth → edges → segmentation → canopy height): resumable, shardable.
    Annotate(annotate::Args),
    /// L-GATr on batches of particle events of different lengths.
    Lgatr(lgatr::Args),
}

/// Runs the parsed command.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    if let Some(n) = cli.threads {
        anyhow::ensure!(n > 0, "--threads must be at least 1");
        edgerun::device::set_threads(n);
    }
    match cli.command {
        Command::Inspect(a) => inspect::run(a),
        Command::Quantize(a) => quantize::run(a),
        Command::Forward(a) => forward::run(a),
        Command::Depth(a) => depth::run(a),
        Command::Edges(a) => edges::run(a),
        Command::Doctor(a) => doctor::run(a),
        Command::Segment(a) => segment::run(a),
        Command::Annotate(a) => annotate::run(a),
        Command::Lgatr(a) => lgatr::run(a),
        Command::Chm(a) => chm::run(a),
    }
}

/// Exit codes: 2 bad input/config, 3 device unavailable, 1 anything else.
pub fn exit_code(e: &anyhow::Error) -> u8 {
    use edgerun::Error;
    for cause in e.chain() {
        if let Some(err) = cause.downcast_ref::<Error>() {
            return match err {
                Error::BadFile { .. } | Error::BadTensor { .. } | Error::Config(_) | Error::Input(_) => 2,
                Error::Device(_) => 3,
                Error::Io { .. } => 4,
                Error::Candle(_) => 1,
            };
        }
    }
    1
}
