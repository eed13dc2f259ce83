//! Scaled dot-product attention: the fused CPU kernel for f32 inference, the training kernel of
//! [`crate::kernels::attention_train`] (its own backward) for f32 CPU training, otherwise Candle ops
//! that bound the size of the score matrix they materialise.
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor};

use crate::kernels::cpu_slice::contiguous_f32;
use crate::kernels::{attention_train, fused_attention};
use crate::error::{Error, Result};

/// Largest score block (elements) materialised at once; longer query sets are processed in chunks.
const MAX_SCORE_ELEMS: usize = 64 << 20;

/// `softmax(q kᵀ · scale) v` for `q` `[B, H, Nq, D]`, `k`/`v` `[B, H, Nk, D]`, optional additive
/// `bias` broadcastable to `[B, H, Nq, Nk]`; any strides. Returns a contiguous `[B, H, Nq, D]`.
pub fn sdpa(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, bias: Option<&Tensor>) -> Result<Tensor> {
    if bias.is_none() && fused_attention::applies(q, k, v) {
        return fused_attention::attention(q, k, v, scale as f32);
    }
    if bias.is_none() && trains_on_cpu(q, k, v) {
        return train_attention(q, k, v, scale);
    }
    sdpa_candle(q, k, v, scale, bias)
}

/// Whether [`train_attention`] runs these operands: f32 on the CPU, rank 4, one of them recording.
pub(crate) fn trains_on_cpu(q: &Tensor, k: &Tensor, v: &Tensor) -> bool {
    let all = [q, k, v];
    all.iter().all(|t| t.device().is_cpu() && t.dtype() == DType::F32 && t.rank() == 4) && all.iter().any(|t| t.track_op())
}

/// [`sdpa`] without a bias as one op whose backward recomputes the probabilities
/// ([`crate::kernels::attention_train`]): the graph keeps q, k, v and the output, not the scores.
pub fn train_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    let (b, h, nq, d) = q.dims4()?;
    let (kb, kh, nk, kd) = k.dims4()?;
    if (kb, kh, kd) != (b, h, d) || v.dims() != k.dims() {
        return Err(Error::Input(format!("attention: q {:?}, k {:?} and v {:?} do not agree", q.dims(), k.dims(), v.dims())));
    }
    let op = TrainAttention { s: attention_train::Heads { heads: b * h, nq, nk, d }, scale: scale as f32 };
    Ok(q.contiguous()?.apply_op3_arc(&k.contiguous()?, &v.contiguous()?, std::sync::Arc::new(Box::new(op)))?)
}

/// The training attention op: its sizes and scale.
struct TrainAttention {
    s: attention_train::Heads,
    scale: f32,
}

impl CustomOp3 for TrainAttention {
    fn name(&self) -> &'static str {
        "train-attention"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout, s3: &CpuStorage, l3: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (q, k, v) = (contiguous_f32(s1, l1)?, contiguous_f32(s2, l2)?, contiguous_f32(s3, l3)?);
        match crate::profile::tally("attention forward", || attention_train::forward(&self.s, q, k, v, self.scale)) {
            Some(o) => Ok((CpuStorage::F32(o), l1.shape().clone())),
            None => candle_core::bail!("attention: operand sizes do not match {:?}", self.s),
        }
    }

    fn bwd(&self, q: &Tensor, k: &Tensor, v: &Tensor, o: &Tensor, go: &Tensor) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let go = go.to_dtype(DType::F32)?.contiguous()?;
        let all = [q, k, v, o, &go].map(|t| t.contiguous().and_then(|t| t.flatten_all()?.to_vec1::<f32>()));
        let [q_, k_, v_, o_, go_] = all;
        let (q_, k_, v_, o_, go_) = (q_?, k_?, v_?, o_?, go_?);
        let (dq, dk, dv) = crate::profile::tally("attention backward", || attention_train::backward(&self.s, &q_, &k_, &v_, &o_, &go_, self.scale))
            .ok_or_else(|| candle_core::Error::Msg(format!("attention backward: operand sizes do not match {:?}", self.s)))?;
        let keep = |t: &Tensor, g: Vec<f32>| -> candle_core::Result<Option<Tensor>> { if t.track_op() { Tensor::from_vec(g, t.shape(), t.device()).map(Some) } else { Ok(None) } };
        Ok((keep(q, dq)?, keep(k, dk)?, keep(v, dv)?))
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_values::spread;
    use candle_core::{Device, Var};

    fn max_abs(t: &Tensor) -> f64 {
        t.abs().unwrap().max_all().unwrap().to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap()
    }

    /// The training op through a fused q/k/v projection's views: the output and every gradient equal
    /// Candle's formula in f64 (whose backward is Candle's own).
    #[test]
    fn the_training_op_equals_the_formula_with_its_gradients() {
        let dev = Device::Cpu;
        let (b, n, heads, d) = (2, 9, 3, 4);
        let qkv = Var::from_tensor(&spread((b, n, 3 * heads * d), 1, &dev)).unwrap();
        let gy = spread((b, heads, n, d), 2, &dev);
        let run = |t: &Tensor, f: &dyn Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>| {
            let (q, k, v) = split_fused_qkv(t, heads).unwrap();
            let y = f(&q, &k, &v).unwrap();
            let g = (&y * gy.to_dtype(t.dtype()).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
            (y, g)
        };
        let scale = 0.5;
        let (y, g) = run(qkv.as_tensor(), &|q, k, v| train_attention(q, k, v, scale));
        let wide = Var::from_tensor(&qkv.as_tensor().to_dtype(DType::F64).unwrap()).unwrap();
        let (y64, g64) = run(wide.as_tensor(), &|q, k, v| sdpa_candle(q, k, v, scale, None));
        assert!(max_abs(&(y.to_dtype(DType::F64).unwrap() - &y64).unwrap()) < 1e-5);
        let (got, want) = (g.get(qkv.as_tensor()).unwrap().to_dtype(DType::F64).unwrap(), g64.get(wide.as_tensor()).unwrap());
        assert!(max_abs(&(&got - want).unwrap()) <= 1e-4 * max_abs(want).max(1.0));
        assert!(max_abs(want) > 0.1, "the gradient must not be trivially zero");
    }
}
