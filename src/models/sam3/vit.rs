//! SAM 3's Perception Encoder ViT (`Sam3ViTModel`): a bias-free patch embedding plus a pretrain-size
//! absolute position embedding tiled (not interpolated) over the patch grid, a pre-LayerNorm, then
//! pre-norm blocks whose attention is windowed (zero-padded windows of `window_size` patches) except
//! in the global blocks, every block rotating queries and keys with a 2-D axial RoPE on interleaved
//! pairs (x frequencies on the first half of the pairs, y on the second; the global blocks' positions
//! scaled by `window_size / grid`). No LayerScale; the output is the last block's.
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Conv2dConfig, LayerNorm};

use super::config::VitConfig;
use crate::error::{Error, Result};
use crate::models::backbones::dinov2::{Ffn, SelfAttention};
use crate::nn::activation::Activation;
use crate::nn::conv::Conv2d;
use crate::nn::grad::layer_norm as norm;
use crate::nn::layers::{conv2d, layer_norm};
use crate::nn::Linear;
use crate::weights::Vb;

/// The cos and sin tables `[T, head_dim/2]` of the axial RoPE over a `side × side` grid whose
/// positions are scaled by `scale`, as transformers computes them in float32.
pub(crate) fn axial_rope_tables(side: usize, head_dim: usize, theta: f64, scale: f64) -> (Vec<f32>, Vec<f32>) {
    let spatial = head_dim / 2;
    let quarter = head_dim / 4;
    // inv_freq = 1 / θ ** (arange(0, spatial, 2) / spatial), float32
    let inv: Vec<f32> = (0..quarter).map(|k| 1.0 / (theta as f32).powf((2 * k) as f32 / spatial as f32)).collect();
    let scale = scale as f32;
    let mut cos = Vec::with_capacity(side * side * spatial);
    let mut sin = Vec::with_capacity(side * side * spatial);
    for y in 0..side {
        for x in 0..side {
            let (px, py) = (x as f32 * scale, y as f32 * scale);
            for j in 0..spatial {
                let a = if j < quarter { px * inv[j] } else { py * inv[j - quarter] };
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
    }
    (cos, sin)
}

/// A RoPE table for one token layout.
struct RopeTable {
    cos: Tensor,
    sin: Tensor,
}

impl RopeTable {
    fn new(side: usize, head_dim: usize, theta: f64, scale: f64, dtype: DType, device: &Device) -> Result<Self> {
        let (c, s) = axial_rope_tables(side, head_dim, theta, scale);
        let shape = (side * side, head_dim / 2);
        Ok(RopeTable { cos: Tensor::from_vec(c, shape, device)?.to_dtype(dtype)?, sin: Tensor::from_vec(s, shape, device)?.to_dtype(dtype)? })
    }

    /// Rotates queries or keys `[B, heads, T, head_dim]`.
    fn rotate(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.contiguous()?;
        let (cos, sin) = (self.cos.to_dtype(x.dtype())?, self.sin.to_dtype(x.dtype())?);
        Ok(candle_nn::rotary_emb::rope_i(&x, &cos, &sin)?)
    }
}

/// `[B, H, W, C]` → windows `[B·nh·nw, ws², C]` (zero-padded to whole windows).
pub(crate) fn window_partition(x: &Tensor, ws: usize) -> Result<Tensor> {
    let (b, h, w, c) = x.dims4()?;
    let (ph, pw) = ((ws - h % ws) % ws, (ws - w % ws) % ws);
    let x = if ph > 0 || pw > 0 { x.pad_with_zeros(1, 0, ph)?.pad_with_zeros(2, 0, pw)? } else { x.clone() };
    let (nh, nw) = ((h + ph) / ws, (w + pw) / ws);
    Ok(x.reshape(vec![b, nh, ws, nw, ws, c])?.permute(vec![0, 1, 3, 2, 4, 5])?.contiguous()?.reshape((b * nh * nw, ws * ws, c))?)
}

/// The inverse of [`window_partition`]: windows back to `[B, H, W, C]`, padding dropped.
pub(crate) fn window_unpartition(x: &Tensor, ws: usize, (h, w): (usize, usize)) -> Result<Tensor> {
    let (nh, nw) = (h.div_ceil(ws), w.div_ceil(ws));
    let (n, _, c) = x.dims3()?;
    let b = n / (nh * nw);
    let x = x.reshape(vec![b, nh, nw, ws, ws, c])?.permute(vec![0, 1, 3, 2, 4, 5])?.contiguous()?.reshape((b, nh * ws, nw * ws, c))?;
    if nh * ws == h && nw * ws == w {
        return Ok(x);
    }
    Ok(x.narrow(1, 0, h)?.narrow(2, 0, w)?.contiguous()?)
}

/// One block: `x + attn(LN1 x)` (in windows where `window > 0`), then `x + mlp(LN2 x)`.
struct Block {
    norm1: LayerNorm,
    attn: SelfAttention,
    norm2: LayerNorm,
    mlp: Ffn,
    window: usize,
}

impl Block {
    fn load(vb: &Vb, c: &VitConfig, eps: f64, window: usize) -> Result<Self> {
        let d = c.hidden_size;
        let a = vb.pp("attention");
        let proj = |n: &str| Linear::load(&a.pp(n), d, d, true);
        let attn = SelfAttention::from_linears(proj("q_proj")?, proj("k_proj")?, proj("v_proj")?, proj("o_proj")?, d, c.num_attention_heads)?;
        let m = vb.pp("mlp");
        let mlp = Ffn::Mlp {
            fc1: Linear::load(&m.pp("fc1"), d, c.intermediate_size, true)?,
            act: Activation::from_name(&c.hidden_act)?,
            fc2: Linear::load(&m.pp("fc2"), c.intermediate_size, d, true)?,
        };
        Ok(Block { norm1: layer_norm(&vb.pp("layer_norm1"), d, eps)?, attn, norm2: layer_norm(&vb.pp("layer_norm2"), d, eps)?, mlp, window })
    }

    /// `x` `[B, H·W, C]` of an `h × w` grid.
    fn forward(&self, x: &Tensor, (h, w): (usize, usize), rope: &RopeTable) -> Result<Tensor> {
        let (b, n, c) = x.dims3()?;
        let rotate = |t: &Tensor| rope.rotate(t);
        let y = norm(&self.norm1, x)?;
        let y = if self.window > 0 {
            let win = window_partition(&y.reshape((b, h, w, c))?, self.window)?;
            let out = self.attn.forward_rotated(&win, &rotate)?;
            window_unpartition(&out, self.window, (h, w))?.reshape((b, n, c))?
        } else {
            self.attn.forward_rotated(&y, &rotate)?
        };
        let x = (x + y)?;
        let y = self.mlp.forward(&norm(&self.norm2, &x)?)?;
        Ok((x + y)?)
    }
}

/// The ViT (`vision_encoder.backbone`).
pub(crate) struct Vit {
    patch: Conv2d,
    /// The tiled position embedding `[1, N, D]`.
    pos: Tensor,
    pre_norm: LayerNorm,
    blocks: Vec<Block>,
    window_rope: RopeTable,
    global_rope: RopeTable,
    grid: usize,
    config: VitConfig,
}

impl Vit {
    /// Loads `embeddings.*`, `layer_norm` and `layers.*` under `vb`; every LayerNorm takes `eps`.
    pub(crate) fn load(vb: &Vb, c: &VitConfig, eps: f64) -> Result<Self> {
        let (d, p) = (c.hidden_size, c.patch_size);
        let e = vb.pp("embeddings");
        let patch = conv2d(&e.pp("patch_embeddings").pp("projection"), c.num_channels, d, p, Conv2dConfig { stride: p, ..Default::default() }, false)?;
        let pre = c.pretrain_image_size / p;
        let table = e.get((1, pre * pre, d), "position_embeddings")?;
        let grid = c.grid();
        let index: Vec<u32> = (0..grid * grid).map(|t| ((t / grid % pre) * pre + t % grid % pre) as u32).collect();
        let index = Tensor::from_vec(index, grid * grid, vb.device())?;
        let pos = table.squeeze(0)?.index_select(&index, 0)?.unsqueeze(0)?;
        let blocks = (0..c.num_hidden_layers).map(|i| Block::load(&vb.pp("layers").pp(i), c, eps, c.window_of(i))).collect::<Result<_>>()?;
        let head_dim = d / c.num_attention_heads;
        let theta = c.rope_theta()?;
        let window_rope = RopeTable::new(c.window_size, head_dim, theta, 1.0, vb.dtype(), vb.device())?;
        let global_rope = RopeTable::new(grid, head_dim, theta, c.window_size as f64 / grid as f64, vb.dtype(), vb.device())?;
        Ok(Vit { patch, pos, pre_norm: layer_norm(&vb.pp("layer_norm"), d, eps)?, blocks, window_rope, global_rope, grid, config: c.clone() })
    }

    /// The last block's tokens `[B, grid², D]` of `pixel_values` `[B, C, S, S]` (`S` = `image_size`).
    pub(crate) fn forward(&self, pixel_values: &Tensor) -> Result<Tensor> {
        let (_, ch, h, w) = pixel_values.dims4()?;
        let s = self.config.image_size;
        if ch != self.config.num_channels || h != s || w != s {
            return Err(Error::Input(format!(
                "SAM 3 takes pixel_values [B, {}, {s}, {s}] (its global blocks' positions are laid out for {s}²), got {:?}",
                self.config.num_channels,
                pixel_values.dims()
            )));
        }
        let x = self.patch.forward(pixel_values)?;
        let x = x.flatten_from(2)?.transpose(1, 2)?.broadcast_add(&self.pos)?;
        let mut x = norm(&self.pre_norm, &x.contiguous()?)?;
        let g = (self.grid, self.grid);
        for b in &self.blocks {
            let rope = if b.window > 0 { &self.window_rope } else { &self.global_rope };
            x = b.forward(&x, g, rope)?;
        }
        Ok(x)
    }

    /// The patch grid side.
    pub(crate) fn grid(&self) -> usize {
        self.grid
    }
}
