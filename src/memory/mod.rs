//! How much memory a device can spare ([`available`]), for the batch planner in
//! [`crate::runner`]. Per-item activation estimates live with the model families
//! (`models::footprint`).
pub mod available;

pub(crate) use available::available_bytes;
