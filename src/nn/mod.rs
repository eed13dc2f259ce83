//! Shared building blocks that the model files compose.
pub mod layers;
pub mod linear;

pub use linear::Linear;
