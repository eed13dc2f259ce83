//! edgerun: perception and physics models at the edge, on Candle.
#![warn(missing_docs, unreachable_pub, clippy::unwrap_used, clippy::expect_used)]
pub mod annotate;
pub(crate) mod config_check;
pub mod cuda_arch;
pub mod device;
pub mod edges;
pub mod fsutil;
pub mod geotiff;
pub mod imageio;
pub mod inputs;
pub mod error;
pub mod kernels;
pub mod models;
pub(crate) mod profile;
pub mod progress;
pub mod nn;
pub mod paths;
pub mod quantize;
pub mod runner;
pub mod tasks;
pub(crate) mod jpegdec;
pub(crate) mod tiffio;
pub mod tiling;
pub mod train;
pub mod tensor_io;
pub mod memory;
pub mod walk;
pub mod weights;

pub use error::{Error, Result};
