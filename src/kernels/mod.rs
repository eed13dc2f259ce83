//! CPU compute kernels: AMX and VNNI int8 products, f16 tiles, the f32 GEMM paths, Winograd and
//! direct convolutions, depthwise and channels-last convolutions, fused attention and fast math.
//! Every `unsafe` of the compute path lives in this module; the layers in [`crate::nn`] call it.
pub mod amx;
pub(crate) mod attention_train;
pub(crate) mod bilinear_cpu;
pub mod conv2d;
pub(crate) mod conv_grad;
pub(crate) mod conv_nhwc;
pub mod conv_transpose;
pub(crate) mod cpu_slice;
pub mod depthwise;
pub mod direct_conv;
pub mod fast_math;
pub(crate) mod folded_decode;
pub(crate) mod fused_attention;
pub mod gemm;
pub(crate) mod group_norm;
pub(crate) mod half_amx;
pub mod int8_attention;
pub mod int8_gemm;
pub(crate) mod layer_norm_train;
pub(crate) mod linear_train;
pub(crate) mod log_softmax;
pub mod mixlog;
pub(crate) mod panel_gemm;
pub(crate) mod q8_rows;
pub mod residual;
#[cfg(test)]
pub(crate) mod test_values;
pub(crate) mod winograd;
