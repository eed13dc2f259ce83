//! 2-D rotary position embedding of VGGT / Depth Anything 3 (`RotaryPositionEmbedding2D`).
//!
//! Each head vector is split in halves: the first half rotates with the token's row (y), the second
//! with its column (x). Within a half of width `d`, frequency `k < d/2` is `base^(-2k/d)`, the angle
//! table is `cat(θ, θ)` and `x' = x·cos + rotate_half(x)·sin` with `rotate_half([a, b]) = [−b, a]`.
//! The tables are computed in f32 as the reference does.
use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};

/// Per-token cos/sin tables `[N, head_dim]` for a fixed token order.
#[derive(Debug, Clone)]
pub(crate) struct Rope2d {
    cos: Tensor,
    sin: Tensor,
    /// The distinct quarter of each half of the tables, `[2N, head_dim / 4]` (row 2t: token t's
    /// y angles, row 2t + 1: its x angles): Candle's fused rotate-half kernel over half-heads.
    cos_halves: Tensor,
    sin_halves: Tensor,
    head_dim: usize,
}

impl Rope2d {
    /// Tables for explicit `(y, x)` token positions.
    pub(crate) fn new(positions: &[(usize, usize)], head_dim: usize, base: f32, dtype: DType, device: &Device) -> Result<Self> {
        if head_dim == 0 || !head_dim.is_multiple_of(4) {
            return Err(Error::Config(format!("2-D RoPE needs a head dimension divisible by 4, got {head_dim}")));
        }
        let half = head_dim / 2;
        let quarter = half / 2;
        let inv: Vec<f32> = (0..quarter).map(|k| 1.0 / base.powf((2 * k) as f32 / half as f32)).collect();
        let n = positions.len();
        let mut cos = vec![0f32; n * head_dim];
        let mut sin = vec![0f32; n * head_dim];
        for (t, &(y, x)) in positions.iter().enumerate() {
            for (part, p) in [(0, y), (1, x)] {
                for (k, f) in inv.iter().enumerate() {
                    let a = p as f32 * f;
                    let (s, c) = (a.sin(), a.cos());
                    for j in [k, k + quarter] {
                        cos[t * head_dim + part * half + j] = c;
                        sin[t * head_dim + part * half + j] = s;
                    }
                }
            }
        }
        let cos = Tensor::from_vec(cos, (n, head_dim), device)?.to_dtype(dtype)?;
        let sin = Tensor::from_vec(sin, (n, head_dim), device)?.to_dtype(dtype)?;
        let halves = |t: &Tensor| -> Result<Tensor> { Ok(t.reshape((n, 2, 2, quarter))?.narrow(2, 0, 1)?.reshape((2 * n, quarter))?) };
        Ok(Rope2d { cos_halves: halves(&cos)?, sin_halves: halves(&sin)?, cos, sin, head_dim })
    }

    /// Positions of a `ph`×`pw` patch grid, `(y + 1, x + 1)` row-major after `prefix` tokens at `(0, 0)`;
    /// with `uniform`, every patch is at `(1, 1)` (the reference's `pos_nodiff` for global attention).
    /// The whole sequence is repeated `views` times (tokens of several views concatenated).
    pub(crate) fn grid_positions(ph: usize, pw: usize, prefix: usize, views: usize, uniform: bool) -> Vec<(usize, usize)> {
        let mut pos = Vec::with_capacity(views * (prefix + ph * pw));
        for _ in 0..views {
            pos.extend(std::iter::repeat_n((0, 0), prefix));
            for y in 0..ph {
                for x in 0..pw {
                    pos.push(if uniform { (1, 1) } else { (y + 1, x + 1) });
                }
            }
        }
        pos
    }

    /// Rotates `x` `[B, H, N, head_dim]` whose N tokens follow this table's order.
    pub(crate) fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let (b, h, n, d) = x.dims4()?;
        if d != self.head_dim || n != self.cos.dim(0)? {
            return Err(Error::Input(format!("RoPE table is {:?}, tokens are {:?}", self.cos.dims(), x.dims())));
        }
        if super::grad::records(x) || x.dtype() != self.cos.dtype() {
            return self.apply_unfused(x);
        }
        // Each half of a head is a rotate-half RoPE of its own (y, then x): the halves as rows of
        // width d/2 go through Candle's fused kernel, with the same products and sums as the
        // formula (one pass instead of seven; 7 % of a DA3-Small forward).
        let halves = x.contiguous()?.reshape((b, h, 2 * n, d / 2))?;
        Ok(candle_nn::rotary_emb::rope(&halves, &self.cos_halves, &self.sin_halves)?.reshape((b, h, n, d))?)
    }

    /// [`Self::apply`] as the reference writes it, from ops that autograd records.
    fn apply_unfused(&self, x: &Tensor) -> Result<Tensor> {
        let (b, h, n, d) = x.dims4()?;
        let q = d / 4;
        let parts = x.reshape((b, h, n, 4, q))?;
        let p = |i: usize| parts.narrow(3, i, 1);
        let rot = Tensor::cat(&[p(1)?.neg()?, p(0)?, p(3)?.neg()?, p(2)?], 3)?.reshape((b, h, n, d))?;
        Ok((x.broadcast_mul(&self.cos)? + rot.broadcast_mul(&self.sin)?)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::D;

    #[test]
    fn position_zero_is_identity_and_norm_is_kept() {
        let dev = Device::Cpu;
        let r = Rope2d::new(&Rope2d::grid_positions(2, 3, 1, 1, false), 8, 100.0, DType::F32, &dev).unwrap();
        let x = Tensor::arange(0f32, (7 * 8) as f32, &dev).unwrap().reshape((1, 1, 7, 8)).unwrap();
        let y = r.apply(&x).unwrap();
        let first = y.narrow(2, 0, 1).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(first, (0..8).map(|v| v as f32).collect::<Vec<_>>());
        let nx = x.sqr().unwrap().sum(D::Minus1).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let ny = y.sqr().unwrap().sum(D::Minus1).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for (a, b) in nx.iter().zip(&ny) {
            assert!((a - b).abs() <= 1e-3 * a.max(1.0), "{a} vs {b}");
        }
    }

    #[test]
    fn the_fused_rotation_is_the_formula_bit_for_bit() {
        let dev = Device::Cpu;
        let (ph, pw, d) = (3, 5, 16);
        let r = Rope2d::new(&Rope2d::grid_positions(ph, pw, 1, 1, false), d, 100.0, DType::F32, &dev).unwrap();
        let n = 1 + ph * pw;
        let xv: Vec<f32> = (0..2 * 3 * n * d).map(|i| ((i * 7919) % 997) as f32 / 97.0 - 5.0).collect();
        let x = Tensor::from_vec(xv, (2, 3, n, d), &dev).unwrap();
        let fused = r.apply(&x).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let formula = r.apply_unfused(&x).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(fused.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), formula.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        // Strided input (a transposed view) as the attention passes it.
        let xt = x.transpose(1, 2).unwrap().contiguous().unwrap().transpose(1, 2).unwrap();
        assert_eq!(r.apply(&xt).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap(), formula);
    }

    /// Written from the definition in the module docs, not from `apply`: head_dim 8, so each half has
    /// width 4 with frequencies 1 and base^(-1/2); pairs (0, 2), (1, 3) turn by y·θ, (4, 6), (5, 7) by x·θ.
    #[test]
    fn each_half_rotates_by_its_own_coordinate() {
        let dev = Device::Cpu;
        let base = 100f32;
        let pos = [(0, 0), (2, 5), (3, 1), (1, 4)];
        let r = Rope2d::new(&pos, 8, base, DType::F32, &dev).unwrap();
        let xv: Vec<f32> = (0..pos.len() * 8).map(|i| ((i * 7) % 11) as f32 - 5.0).collect();
        let x = Tensor::from_vec(xv.clone(), (1, 1, pos.len(), 8), &dev).unwrap();
        let y = r.apply(&x).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let theta = [1.0f32, 1.0 / base.sqrt()];
        for (t, &(py, px)) in pos.iter().enumerate() {
            let v = &xv[t * 8..(t + 1) * 8];
            let mut want = [0f32; 8];
            for (start, p) in [(0, py), (4, px)] {
                for (k, th) in theta.iter().enumerate() {
                    let (c, s) = ((p as f32 * th).cos(), (p as f32 * th).sin());
                    let (i, j) = (start + k, start + k + 2);
                    want[i] = v[i] * c - v[j] * s;
                    want[j] = v[j] * c + v[i] * s;
                }
            }
            for (d, w) in want.iter().enumerate() {
                let g = y[t * 8 + d];
                assert!((g - w).abs() <= 1e-5 * w.abs().max(1.0), "token {t} at {:?}, dim {d}: {g} vs {w}", pos[t]);
            }
        }
    }
}
