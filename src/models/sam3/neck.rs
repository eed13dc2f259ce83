//! SAM 3's FPN neck (`Sam3VisionNeck`) and its sine position encodings. Each level maps the ViT grid
//! `[B, C, g, g]` to width `fpn_hidden_size`: ×4 by two 2×2 transposed convs with a GELU between,
//! ×2 by one, ×1 as it is; then a 1×1 and a 3×3 conv. The ×0.5 level that transformers also
//! computes is dropped by every consumer, so it is not built.
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Conv2dConfig, ConvTranspose2dConfig};

use crate::error::Result;
use crate::nn::activation::gelu_erf;
use crate::nn::conv::Conv2d;
use crate::nn::conv_transpose::ConvTranspose2d;
use crate::nn::layers::{conv2d, conv_transpose2d};
use crate::weights::Vb;

/// The levels that are used: ×4, ×2, ×1 of the ViT grid.
pub(crate) const LEVELS: usize = 3;

/// `temperature^(2·⌊k/2⌋ / n)` for `k < n`, in float32 as PyTorch computes it.
fn sine_divisors(n: usize, temperature: f32) -> Vec<f32> {
    (0..n).map(|k| temperature.powf((2 * (k / 2)) as f32 / n as f32)).collect()
}

/// `[sin(v/t₀), cos(v/t₁), sin(v/t₂), …]` of one coordinate, appended to `out`.
fn push_sine(out: &mut Vec<f32>, v: f32, divisors: &[f32]) {
    for (k, t) in divisors.iter().enumerate() {
        let a = v / t;
        out.push(if k % 2 == 0 { a.sin() } else { a.cos() });
    }
}

/// The normalised 2-D sine encoding of an `h × w` grid (`Sam3SinePositionEmbedding`, `normalize`,
/// scale 2π), `[h·w, 2·n]` row-major: `[pos_y, pos_x]` per token, `n` features each.
pub(crate) fn grid_sine(h: usize, w: usize, n: usize) -> Vec<f32> {
    let div = sine_divisors(n, 10_000.0);
    let scale = (2.0 * std::f64::consts::PI) as f32;
    let eps = 1e-6f32;
    let mut out = Vec::with_capacity(h * w * 2 * n);
    for i in 0..h {
        let y = (i + 1) as f32 / (h as f32 + eps) * scale;
        for j in 0..w {
            let x = (j + 1) as f32 / (w as f32 + eps) * scale;
            push_sine(&mut out, y, &div);
            push_sine(&mut out, x, &div);
        }
    }
    out
}

/// The un-normalised sine encoding of boxes `[…, 4]` (cx, cy, w, h) as the DETR decoder conditions
/// its queries (`encode_boxes`: each coordinate × 2π, `[pos_y, pos_x, pos_w, pos_h]`, `n` each).
pub(crate) fn box_sine(boxes: &[f32], n: usize) -> Vec<f32> {
    let div = sine_divisors(n, 10_000.0);
    let scale = (2.0 * std::f64::consts::PI) as f32;
    let mut out = Vec::with_capacity(boxes.len() * n);
    for b in boxes.chunks_exact(4) {
        for c in [1, 0, 2, 3] {
            push_sine(&mut out, b[c] * scale, &div);
        }
    }
    out
}

/// The grid encoding as a `[1, h·w, 2n]` tensor.
pub(crate) fn grid_sine_tensor(h: usize, w: usize, n: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    Ok(Tensor::from_vec(grid_sine(h, w, n), (1, h * w, 2 * n), device)?.to_dtype(dtype)?)
}

/// One FPN level.
struct FpnLevel {
    up: Vec<ConvTranspose2d>,
    proj1: Conv2d,
    proj2: Conv2d,
}

impl FpnLevel {
    fn load(vb: &Vb, c: usize, d: usize, scale: f64) -> Result<Self> {
        let ct = ConvTranspose2dConfig { stride: 2, ..Default::default() };
        let layers = vb.pp("scale_layers");
        let (up, inner) = if scale == 4.0 {
            (vec![conv_transpose2d(&layers.pp(0), c, c / 2, 2, ct)?, conv_transpose2d(&layers.pp(2), c / 2, c / 4, 2, ct)?], c / 4)
        } else if scale == 2.0 {
            (vec![conv_transpose2d(&layers.pp(0), c, c / 2, 2, ct)?], c / 2)
        } else {
            (Vec::new(), c)
        };
        Ok(FpnLevel {
            up,
            proj1: conv2d(&vb.pp("proj1"), inner, d, 1, Conv2dConfig::default(), true)?,
            proj2: conv2d(&vb.pp("proj2"), d, d, 3, Conv2dConfig { padding: 1, ..Default::default() }, true)?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut x = x.clone();
        for (i, up) in self.up.iter().enumerate() {
            if i > 0 {
                x = gelu_erf(&x)?;
            }
            x = up.forward(&x)?;
        }
        Ok(self.proj2.forward(&self.proj1.forward(&x)?)?)
    }
}

/// The neck (`vision_encoder.neck`).
pub(crate) struct Neck {
    levels: Vec<FpnLevel>,
}

impl Neck {
    /// Loads `fpn_layers.{0,1,2}` under `vb` for a ViT of width `c`.
    pub(crate) fn load(vb: &Vb, c: usize, d: usize) -> Result<Self> {
        let levels = super::config::SCALE_FACTORS[..LEVELS].iter().enumerate().map(|(i, &s)| FpnLevel::load(&vb.pp("fpn_layers").pp(i), c, d, s)).collect::<Result<_>>()?;
        Ok(Neck { levels })
    }

    /// The three levels `[B, D, 4g, 4g]`, `[B, D, 2g, 2g]`, `[B, D, g, g]` of the ViT map `[B, C, g, g]`.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        self.levels.iter().map(|l| l.forward(x)).collect()
    }
}
