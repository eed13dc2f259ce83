//! edgerun: perception and physics models at the edge, on Candle.
pub mod device;
pub mod edges;
pub mod fsutil;
pub mod imageio;
pub mod error;
pub mod models;
pub mod preprocess;
pub mod nn;
pub mod quantize;
pub mod tasks;
pub mod tensor_io;
pub mod weights;

pub use error::{Error, Result};
