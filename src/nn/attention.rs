//! Scaled dot-product attention: the fused CPU kernel for f32 inference, otherwise Candle ops that
//! bound the size of the score matrix they materialise.
use candle_core::Tensor;

use crate::kernels::fused_attention;
use crate::error::{Error, Result};

/// Largest score block (elements) materialised at once; longer query sets are processed in chunks.
const MAX_SCORE_ELEMS: usize = 64 << 20;

/// `softmax(q kᵀ · scale) v` for `q` `[B, H, Nq, D]`, `k`/`v` `[B, H, Nk, D]`, optional additive
/// `bias` broadcastable to `[B, H, Nq, Nk]`; any strides. Returns a contiguous `[B, H, Nq, D]`.
pub fn sdpa(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, bias: Option<&Tensor>) -> Result<Tensor> {
    if bias.is_none() && fused_attention::applies(q, k, v) {
        return fused_attention::attention(q, k, v, scale as f32);
    }
    sdpa_candle(q, k, v, scale, bias)
}

/// [`sdpa`] from Candle ops, query chunks bounding the score block (autograd records through it;
/// the reference that the fused kernel is measured against).
pub fn sdpa_candle(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, bias: Option<&Tensor>) -> Result<Tensor> {
    let (k, v) = (&k.contiguous()?, &v.contiguous()?);
    let (b, h, nq, _) = q.dims4()?;
    let nk = k.dim(2)?;
    let q = (q * scale)?;
    // A transposed (strided) k multiplies faster than a contiguous copy of kᵀ.
    let kt = k.t()?;
    let per_row = b * h * nk;
    let chunk = (MAX_SCORE_ELEMS / per_row.max(1)).max(1);
    let attend = |q: &Tensor, bias: Option<Tensor>| -> Result<Tensor> {
        let s = q.matmul(&kt)?;
        let s = match bias {
            Some(bias) => s.broadcast_add(&bias)?,
            None => s,
        };
        let p = crate::nn::grad::softmax_last_dim(&s)?;
        Ok(p.matmul(v)?)
    };
    if chunk >= nq {
        return attend(&q.contiguous()?, bias.cloned());
    }
    let mut outs = Vec::with_capacity(nq.div_ceil(chunk));
    let mut start = 0;
    while start < nq {
        let len = chunk.min(nq - start);
        let qc = q.narrow(2, start, len)?.contiguous()?;
        let bc = match bias {
            Some(bias) if bias.dim(2)? == nq => Some(bias.narrow(2, start, len)?),
            Some(bias) => Some(bias.clone()),
            None => None,
        };
        outs.push(attend(&qc, bc)?);
        start += len;
    }
    Ok(Tensor::cat(&outs, 2)?)
}

/// Splits `[B, N, heads·D]` into a `[B, heads, N, D]` view (no copy).
pub(crate) fn split_heads(x: &Tensor, heads: usize) -> Result<Tensor> {
    let (b, n, c) = x.dims3()?;
    Ok(x.reshape((b, n, heads, c / heads))?.transpose(1, 2)?)
}

/// Splits a fused projection `[B, N, 3·heads·D]` (all of q, then k, then v) into three
/// `[B, heads, N, D]` views of it (no copy: the fused attention reads them in place).
pub(crate) fn split_fused_qkv(t: &Tensor, heads: usize) -> Result<(Tensor, Tensor, Tensor)> {
    let (b, n, c) = t.dims3()?;
    if heads == 0 || c % (3 * heads) != 0 {
        return Err(Error::Input(format!("attention: a fused q/k/v width of {c} does not split into 3 x {heads} heads")));
    }
    let t = t.reshape((b, n, 3, heads, c / (3 * heads)))?;
    let part = |i: usize| -> Result<Tensor> { Ok(t.narrow(2, i, 1)?.squeeze(2)?.transpose(1, 2)?) };
    Ok((part(0)?, part(1)?, part(2)?))
}

/// Merges `[B, heads, N, D]` back into `[B, N, heads·D]`.
pub(crate) fn merge_heads(x: &Tensor) -> Result<Tensor> {
    let (b, h, n, d) = x.dims4()?;
    Ok(x.transpose(1, 2)?.reshape((b, n, h * d))?)
}
