//! The multi-head attention every SAM 3 stack uses (`Sam3Attention`: q/k/v/o projections with
//! biases, scale `head_dim^-1/2`), an additive bias for key padding or relative positions, and the
//! MLPs around it.
use candle_core::{DType, Module, Tensor, D};

use crate::error::{Error, Result};
use crate::nn::activation::Activation;
use crate::nn::attention::{merge_heads, sdpa, split_heads};
use crate::nn::Linear;
use crate::weights::Vb;

/// `o(softmax(q(x_q) k(x_k)ᵀ / √d + bias) v(x_v))`.
pub(crate) struct Attention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    heads: usize,
    dim: usize,
}

impl Attention {
    /// Loads `q_proj`, `k_proj`, `v_proj` and `o_proj` under `vb`.
    pub(crate) fn load(vb: &Vb, dim: usize, heads: usize) -> Result<Self> {
        Self::load_named(vb, dim, heads, "o_proj")
    }

    /// As [`Attention::load`] with the output projection named `out` (CLIP's `out_proj`).
    pub(crate) fn load_named(vb: &Vb, dim: usize, heads: usize, out: &str) -> Result<Self> {
        if heads == 0 || !dim.is_multiple_of(heads) {
            return Err(Error::Config(format!("width {dim} is not a positive multiple of {heads} heads")));
        }
        Ok(Attention {
            q: Linear::load(&vb.pp("q_proj"), dim, dim, true)?,
            k: Linear::load(&vb.pp("k_proj"), dim, dim, true)?,
            v: Linear::load(&vb.pp("v_proj"), dim, dim, true)?,
            o: Linear::load(&vb.pp(out), dim, dim, true)?,
            heads,
            dim,
        })
    }

    /// Attention of `query` `[B, Nq, D]` over `key`/`value` `[B, Nk, D]` (batch 1 broadcasts),
    /// `bias` broadcastable to `[B, heads, Nq, Nk]`.
    pub(crate) fn forward(&self, query: &Tensor, key: &Tensor, value: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        let kv = self.keys_values(key, value)?;
        self.attend(query, &kv, bias)
    }

    /// The per-head keys and values of `key`/`value` `[B, Nk, D]`, to attend to more than once.
    pub(crate) fn keys_values(&self, key: &Tensor, value: &Tensor) -> Result<(Tensor, Tensor)> {
        Ok((split_heads(&self.k.forward(key)?, self.heads)?, split_heads(&self.v.forward(value)?, self.heads)?))
    }

    /// Attention of `query` over keys and values from [`Attention::keys_values`].
    pub(crate) fn attend(&self, query: &Tensor, (k, v): &(Tensor, Tensor), bias: Option<&Tensor>) -> Result<Tensor> {
        let q = split_heads(&self.q.forward(query)?, self.heads)?;
        let b = q.dim(0)?;
        let (k, v) = match k.dim(0)? {
            kb if kb == b => (k.clone(), v.clone()),
            1 => (k.broadcast_as((b, k.dim(1)?, k.dim(2)?, k.dim(3)?))?, v.broadcast_as((b, v.dim(1)?, v.dim(2)?, v.dim(3)?))?),
            kb => return Err(Error::Input(format!("attention: {b} queries' batch against {kb} keys'"))),
        };
        let scale = 1.0 / ((self.dim / self.heads) as f64).sqrt();
        let o = sdpa(&q, &k, &v, scale, bias)?;
        Ok(self.o.forward(&merge_heads(&o)?)?)
    }
}

/// `fc2(act(fc1 x))` (`Sam3MLP`, CLIP's MLP).
pub(crate) struct Mlp {
    fc1: Linear,
    act: Activation,
    fc2: Linear,
    hidden: usize,
}

impl Mlp {
    /// Loads `fc1` and `fc2` under `vb`.
    pub(crate) fn load(vb: &Vb, dim: usize, hidden: usize, act: &str) -> Result<Self> {
        Ok(Mlp { fc1: Linear::load(&vb.pp("fc1"), dim, hidden, true)?, act: Activation::from_name(act)?, fc2: Linear::load(&vb.pp("fc2"), hidden, dim, true)?, hidden })
    }

    /// Applies it, in blocks of rows whose hidden layer holds at most [`MLP_HIDDEN_BLOCK`] values
    /// (the DETR encoder's is 2048 wide over every prompt's 5184 image tokens).
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let d = x.dim(D::Minus1)?;
        let rows = x.elem_count() / d.max(1);
        let block = (MLP_HIDDEN_BLOCK / self.hidden.max(1)).max(1);
        if rows <= block {
            return self.forward_rows(x);
        }
        let flat = x.reshape((rows, d))?;
        let mut parts = Vec::with_capacity(rows.div_ceil(block));
        let mut start = 0;
        while start < rows {
            let len = block.min(rows - start);
            parts.push(self.forward_rows(&flat.narrow(0, start, len)?)?);
            start += len;
        }
        let mut shape = x.dims().to_vec();
        if let Some(last) = shape.last_mut() {
            *last = parts[0].dim(1)?;
        }
        Ok(Tensor::cat(&parts, 0)?.reshape(shape)?)
    }

    fn forward_rows(&self, x: &Tensor) -> Result<Tensor> {
        let h = match self.act {
            Activation::Gelu => self.fc1.forward_gelu(x)?,
            act => act.forward(&self.fc1.forward(x)?)?,
        };
        Ok(self.fc2.forward(&h)?)
    }
}

/// The most hidden-layer values an [`Mlp`] holds at once (64 MiB in f32).
const MLP_HIDDEN_BLOCK: usize = 16 << 20;

/// ReLU between linear layers, none after the last (`Sam3DecoderMLP`, the mask embedder).
pub(crate) struct ReluMlp {
    layers: Vec<Linear>,
}

impl ReluMlp {
    /// Loads `names` (in order) under `vb`, widths `dims[i] → dims[i + 1]`.
    pub(crate) fn load(vb: &Vb, names: &[&str], dims: &[usize]) -> Result<Self> {
        if dims.len() != names.len() + 1 {
            return Err(Error::Config(format!("an MLP of {} layers needs {} widths", names.len(), names.len() + 1)));
        }
        let layers = names.iter().enumerate().map(|(i, n)| Linear::load(&vb.pp(n), dims[i], dims[i + 1], true)).collect::<Result<_>>()?;
        Ok(ReluMlp { layers })
    }

    /// Applies it.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = x.clone();
        for (i, l) in self.layers.iter().enumerate() {
            h = l.forward(&h)?;
            if i + 1 < self.layers.len() {
                h = h.relu()?;
            }
        }
        Ok(h)
    }
}

/// The additive key-padding bias `[B, 1, 1, L]` (0 where `mask` is 1, −∞ where it is 0) of a
/// prompt mask `[B, L]`, in `dtype`.
pub(crate) fn padding_bias(mask: &Tensor, dtype: DType) -> Result<Tensor> {
    let (b, l) = mask.dims2()?;
    let valid = mask.to_dtype(DType::F32)?.ge(0.5)?;
    let zeros = Tensor::zeros((b, l), DType::F32, mask.device())?;
    let neg = Tensor::full(f32::NEG_INFINITY, (b, l), mask.device())?;
    Ok(valid.where_cond(&zeros, &neg)?.to_dtype(dtype)?.reshape((b, 1, 1, l))?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn the_mlp_in_row_blocks_equals_it_whole() {
        let dev = Device::Cpu;
        let (d, hidden) = (4, 4096);
        let lin = |o: usize, i: usize| Linear::from_tensors(Tensor::randn(0f32, 0.1, (o, i), &dev).unwrap(), Some(Tensor::randn(0f32, 0.1, o, &dev).unwrap())).unwrap();
        let mlp = Mlp { fc1: lin(hidden, d), act: Activation::Relu, fc2: lin(d, hidden), hidden };
        let x = Tensor::randn(0f32, 1.0, (2, 5000, d), &dev).unwrap();
        assert!(2 * 5000 > MLP_HIDDEN_BLOCK / hidden, "the input spans several blocks");
        let blocks = mlp.forward(&x).unwrap();
        let whole = mlp.forward_rows(&x).unwrap();
        assert_eq!(blocks.dims(), whole.dims());
        let err = (blocks - whole).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(err, 0.0);
    }
}
