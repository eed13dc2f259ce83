//! Using the memory there is and never dying of it: how much the device can spare
//! ([`available`]), how many items a forward pass may take ([`plan`]), and backing off when a
//! pass runs out of memory anyway ([`backoff`]). Per-item activation estimates per model family
//! live with the models (`models::footprint`).
pub mod available;
pub mod backoff;
pub mod plan;

pub use available::available_bytes;
pub use backoff::{is_out_of_memory, AdaptiveBatch};
pub use plan::{BatchSetting, MemoryBudget};
