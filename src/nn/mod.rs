//! Layers that the backbones and model files compose: linear, convolutions, attention,
//! interpolation, activations, rotary embeddings and the differentiable fallbacks training needs.
//! The arithmetic behind them is in [`crate::kernels`].
pub mod activation;
pub mod attention;
pub mod conv;
pub mod conv_transpose;
pub(crate) mod dense_conv;
pub mod grad;
pub mod group_norm;
pub mod interpolate;
pub mod layers;
pub mod linear;
pub mod rope;
pub(crate) mod train_linear;
pub(crate) mod rope2d;

pub use linear::Linear;
