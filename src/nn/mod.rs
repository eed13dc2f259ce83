//! Shared building blocks that the model files compose.
pub mod activation;
pub mod amx;
pub mod attention;
pub mod bilinear_cpu;
pub mod conv;
pub mod conv_nhwc;
pub mod conv_transpose;
pub mod cpu_slice;
pub mod dinov2;
pub mod dinov3;
pub mod direct_conv;
pub mod dpt;
pub mod fast_math;
pub mod fused_attention;
pub mod grad;
pub(crate) mod half_amx;
pub mod depthwise;
pub mod int8_attention;
pub mod int8_gemm;
pub mod interpolate;
pub mod layers;
pub mod linear;
pub mod panel_gemm;
pub mod q8_rows;
pub mod residual;
pub mod rope;
pub mod rope2d;
#[cfg(test)]
pub(crate) mod test_values;
pub mod winograd;

pub use linear::Linear;
