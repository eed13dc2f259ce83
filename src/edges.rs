//! Edges from depth: batched Sobel gradient magnitude.
use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;

use crate::error::{Error, Result};

/// Sobel kernels `[2, 1, 3, 3]`: x (left→right) and y (top→bottom) derivatives.
const SOBEL: [f32; 18] = [
    -1.0, 0.0, 1.0, -2.0, 0.0, 2.0, -1.0, 0.0, 1.0, //
    -1.0, -2.0, -1.0, 0.0, 0.0, 0.0, 1.0, 2.0, 1.0,
];

/// Gradient magnitude `sqrt(gx² + gy²)` of `depth` `[B, 1, H, W]` with the 3×3 Sobel kernels,
/// borders replicated (so image borders are not edges); computed in f32, returned `[B, 1, H, W]`.
pub fn sobel_magnitude(depth: &Tensor) -> Result<Tensor> {
    let (b, c, h, w) = depth.dims4()?;
    if c != 1 || h < 2 || w < 2 {
        return Err(Error::Input(format!("edges need depth maps [B, 1, H ≥ 2, W ≥ 2], got {:?}", depth.dims())));
    }
    let x = depth.to_dtype(DType::F32)?;
    if matches!(depth.device(), Device::Cpu) {
        let v = x.flatten_all()?.to_vec1::<f32>()?;
        let out: Vec<f32> = v.chunks_exact(h * w).flat_map(|m| sobel_map(m, h, w)).collect();
        return Ok(Tensor::from_vec(out, (b, 1, h, w), depth.device())?);
    }
    sobel_conv(&x)
}

/// The same operator as one 2-output convolution (used on GPU devices).
fn sobel_conv(x: &Tensor) -> Result<Tensor> {
    let x = x.pad_with_same(2, 1, 1)?.pad_with_same(3, 1, 1)?;
    let k = Tensor::from_slice(&SOBEL, (2, 1, 3, 3), x.device())?;
    let g = x.conv2d(&k, 0, 1, 1, 1)?;
    Ok(g.sqr()?.sum_keepdim(1)?.sqrt()?)
}

/// Sobel magnitude of one row-major `h`×`w` map with replicated borders (rows in parallel).
pub(crate) fn sobel_map(v: &[f32], h: usize, w: usize) -> Vec<f32> {
    let mut out = vec![0f32; h * w];
    out.par_chunks_mut(w).enumerate().for_each(|(y, row)| {
        let up = &v[y.saturating_sub(1) * w..][..w];
        let mid = &v[y * w..][..w];
        let down = &v[(y + 1).min(h - 1) * w..][..w];
        for (x, o) in row.iter_mut().enumerate() {
            let (l, r) = (x.saturating_sub(1), (x + 1).min(w - 1));
            let gx = (up[r] - up[l]) + 2.0 * (mid[r] - mid[l]) + (down[r] - down[l]);
            let gy = (down[l] - up[l]) + 2.0 * (down[x] - up[x]) + (down[r] - up[r]);
            *o = (gx * gx + gy * gy).sqrt();
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn direct_and_convolution_paths_agree() {
        let (b, h, w) = (2, 9, 13);
        let v: Vec<f32> = (0..b * h * w).map(|i| ((i * 37) % 23) as f32 * 0.3).collect();
        let t = Tensor::from_vec(v, (b, 1, h, w), &Device::Cpu).unwrap();
        let a = sobel_magnitude(&t).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let c = sobel_conv(&t).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for (x, y) in a.iter().zip(&c) {
            assert!((x - y).abs() < 1e-4, "{x} vs {y}");
        }
    }
}
