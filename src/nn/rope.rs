//! DINOv3's 2-D rotary position embedding (transformers `DINOv3ViTRopePositionEmbedding`).
//!
//! Patch-centre coordinates are normalised per axis to [−1, 1] (`2·(i + 0.5)/n − 1`), multiplied by
//! `2π · inv_freq` with `inv_freq_j = 1 / θ^(4j/D)` (j < D/4), laid out `[y-freqs, x-freqs]` and tiled
//! twice to the head width D (`[y, x, y, x]`); queries and keys of the patch tokens are rotated with
//! `x·cos + rotate_half(x)·sin`. Prefix tokens (class, registers) are left as they are.
//!
//! Because the table is tiled, the second half of every row repeats the first, so the rotation is the
//! standard "rotate half" RoPE on pairs `(i, i + D/2)` and runs through Candle's fused `rope` kernel with
//! the first half of the table. Prefix rows get `cos = 1, sin = 0`, which leaves them bit-exact.
use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};

/// The per-head inverse frequencies, computed as PyTorch does in float32:
/// `1 / θ ** arange(0, 1, 4 / D)`.
pub(crate) fn inv_freq(head_dim: usize, theta: f64) -> Result<Vec<f32>> {
    if head_dim == 0 || !head_dim.is_multiple_of(4) {
        return Err(Error::Config(format!("RoPE head width {head_dim} is not a positive multiple of 4")));
    }
    if !(theta.is_finite() && theta > 0.0) {
        return Err(Error::Config(format!("rope_theta {theta} must be positive")));
    }
    let step = 4.0 / head_dim as f64;
    // torch.arange for floating types computes `start + i * step` in double, then rounds to float32.
    let n = head_dim / 4;
    let base = theta as f32;
    Ok((0..n).map(|j| 1.0f32 / base.powf((j as f64 * step) as f32)).collect())
}

/// Normalised patch-centre coordinates `(y, x)` for an `ph`×`pw` grid, row-major (float32, as PyTorch).
pub(crate) fn patch_coords(ph: usize, pw: usize) -> Vec<(f32, f32)> {
    let axis = |n: usize| -> Vec<f32> { (0..n).map(|i| 2.0f32 * ((i as f64 + 0.5) as f32 / n as f32) - 1.0).collect() };
    let (ys, xs) = (axis(ph), axis(pw));
    let mut out = Vec::with_capacity(ph * pw);
    for &y in &ys {
        for &x in &xs {
            out.push((y, x));
        }
    }
    out
}

/// The full `[N, D]` cos and sin tables for the patch tokens, exactly as transformers returns them.
pub fn tables(ph: usize, pw: usize, head_dim: usize, theta: f64) -> Result<(Vec<f32>, Vec<f32>)> {
    let f = inv_freq(head_dim, theta)?;
    let two_pi = (2.0 * std::f64::consts::PI) as f32;
    let quarter = head_dim / 4;
    let n = ph * pw;
    let mut cos = vec![0f32; n * head_dim];
    let mut sin = vec![0f32; n * head_dim];
    for (t, (y, x)) in patch_coords(ph, pw).into_iter().enumerate() {
        for rep in 0..2 {
            for (axis, c) in [y, x].into_iter().enumerate() {
                for (j, &fj) in f.iter().enumerate() {
                    let a = two_pi * c * fj;
                    let i = t * head_dim + rep * 2 * quarter + axis * quarter + j;
                    cos[i] = a.cos();
                    sin[i] = a.sin();
                }
            }
        }
    }
    Ok((cos, sin))
}

/// A RoPE table for one token layout: `prefix` unrotated tokens followed by an `ph`×`pw` patch grid.
#[derive(Debug, Clone)]
pub struct Rope2d {
    /// `[prefix + N, D/2]`, in the compute dtype.
    cos: Tensor,
    /// `[prefix + N, D/2]`, in the compute dtype.
    sin: Tensor,
    head_dim: usize,
}

impl Rope2d {
    /// Builds the table for `prefix` leading tokens and an `ph`×`pw` grid, head width `head_dim`.
    pub fn new(prefix: usize, ph: usize, pw: usize, head_dim: usize, theta: f64, dtype: DType, device: &Device) -> Result<Self> {
        let (cos, sin) = tables(ph, pw, head_dim, theta)?;
        let half = head_dim / 2;
        let n = prefix + ph * pw;
        let mut c = vec![1f32; n * half];
        let mut s = vec![0f32; n * half];
        for t in 0..ph * pw {
            let dst = (prefix + t) * half;
            c[dst..dst + half].copy_from_slice(&cos[t * head_dim..t * head_dim + half]);
            s[dst..dst + half].copy_from_slice(&sin[t * head_dim..t * head_dim + half]);
        }
        let cos = Tensor::from_vec(c, (n, half), device)?.to_dtype(dtype)?;
        let sin = Tensor::from_vec(s, (n, half), device)?.to_dtype(dtype)?;
        Ok(Rope2d { cos, sin, head_dim })
    }

    /// Rotates `x` `[B, heads, prefix + N, D]` (queries or keys).
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let (_, _, n, d) = x.dims4()?;
        if d != self.head_dim || n != self.cos.dim(0)? {
            return Err(Error::Input(format!(
                "RoPE table is for {} tokens of width {}, got {n} of width {d}",
                self.cos.dim(0)?,
                self.head_dim
            )));
        }
        let x = x.contiguous()?;
        let (cos, sin) = if x.dtype() == self.cos.dtype() {
            (self.cos.clone(), self.sin.clone())
        } else {
            (self.cos.to_dtype(x.dtype())?, self.sin.to_dtype(x.dtype())?)
        };
        // Candle's fused kernel records no backward: the rotate-half formula while autograd records.
        if super::grad::records(&x) {
            Ok(candle_nn::rotary_emb::rope_slow(&x, &cos, &sin)?)
        } else {
            Ok(candle_nn::rotary_emb::rope(&x, &cos, &sin)?)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fused_rope_matches_rotate_half_on_patches_and_keeps_prefix() {
        let (prefix, ph, pw, d) = (2, 3, 5, 12);
        let dev = Device::Cpu;
        let n = prefix + ph * pw;
        let vals: Vec<f32> = (0..2 * n * d).map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0).collect();
        let x = Tensor::from_vec(vals.clone(), (1, 2, n, d), &dev).unwrap();
        let r = Rope2d::new(prefix, ph, pw, d, 100.0, DType::F32, &dev).unwrap();
        let y = r.apply(&x).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let (cos, sin) = tables(ph, pw, d, 100.0).unwrap();
        for h in 0..2 {
            for t in 0..n {
                for i in 0..d {
                    let at = (h * n + t) * d;
                    let want = if t < prefix {
                        vals[at + i]
                    } else {
                        let p = (t - prefix) * d;
                        let rot = if i < d / 2 { -vals[at + i + d / 2] } else { vals[at + i - d / 2] };
                        vals[at + i] * cos[p + i] + rot * sin[p + i]
                    };
                    assert!((y[at + i] - want).abs() < 1e-6, "h{h} t{t} i{i}: {} vs {want}", y[at + i]);
                }
            }
        }
    }

    #[test]
    fn rejects_bad_widths() {
        assert!(inv_freq(6, 100.0).is_err());
        assert!(inv_freq(8, 0.0).is_err());
        assert_eq!(inv_freq(8, 100.0).unwrap(), vec![1.0, 0.1]);
    }
}
