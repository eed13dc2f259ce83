//! The weight store: one memory-mapped view over a model directory (config.json + safetensors,
//! single or sharded) or a single GGUF file, with validated headers and lazy, by-name tensor loading.
pub mod dtype;
pub mod entry;
pub mod gguf;
pub mod limits;
#[cfg(unix)]
mod mapped;
pub(crate) mod remap;
pub mod safetensors;
mod store;
pub mod trainable;
pub mod vb;

pub use dtype::StoredDType;
pub use gguf::MetaValue;
pub use limits::Limits;
pub use remap::{Alias, Remap};
pub use store::{Format, WeightStore, CONFIG_METADATA_KEY};
pub use trainable::Trainable;
pub use vb::Vb;
