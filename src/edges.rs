//! Edges from depth: batched Sobel gradient magnitude.
use candle_core::{DType, Tensor};

use crate::error::{Error, Result};

/// Sobel kernels `[2, 1, 3, 3]`: x (left→right) and y (top→bottom) derivatives.
const SOBEL: [f32; 18] = [
    -1.0, 0.0, 1.0, -2.0, 0.0, 2.0, -1.0, 0.0, 1.0, //
    -1.0, -2.0, -1.0, 0.0, 0.0, 0.0, 1.0, 2.0, 1.0,
];

/// Gradient magnitude `sqrt(gx² + gy²)` of `depth` `[B, 1, H, W]` with the 3×3 Sobel kernels,
/// borders replicated (so image borders are not edges); computed in f32, returned `[B, 1, H, W]`.
pub fn sobel_magnitude(depth: &Tensor) -> Result<Tensor> {
    let (_, c, h, w) = depth.dims4()?;
    if c != 1 || h < 2 || w < 2 {
        return Err(Error::Input(format!("edges need depth maps [B, 1, H ≥ 2, W ≥ 2], got {:?}", depth.dims())));
    }
    let x = depth.to_dtype(DType::F32)?;
    let x = x.pad_with_same(2, 1, 1)?.pad_with_same(3, 1, 1)?;
    let k = Tensor::from_slice(&SOBEL, (2, 1, 3, 3), depth.device())?;
    let g = x.conv2d(&k, 0, 1, 1, 1)?;
    Ok(g.sqr()?.sum_keepdim(1)?.sqrt()?)
}
