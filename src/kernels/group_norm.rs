//! GroupNorm (optionally followed by ReLU) in one pass over fresh storage on the CPU for f32
//! inference, where Candle's form holds five full-size intermediates (SAM 3's pixel decoder normalises
//! 256 × 288² maps: 81 MiB each); Candle's ops elsewhere and whenever autograd records.
use candle_core::{DType, Tensor};
use rayon::prelude::*;

use super::cpu_slice::with_contiguous;

/// `relu?(groupnorm(x) · weight + bias)` for `x` `[B, C, …]`, `weight` and `bias` `[C]`, `C` a
/// multiple of `groups`; mean and biased variance per (batch, group) as `nn.GroupNorm` takes them.
pub(crate) fn group_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, groups: usize, eps: f64, relu: bool) -> candle_core::Result<Tensor> {
    let dims = x.dims();
    if dims.len() < 2 || groups == 0 || !dims[1].is_multiple_of(groups) || weight.dims() != [dims[1]] || bias.dims() != [dims[1]] {
        candle_core::bail!("group norm: input {dims:?} with {groups} groups and weight {:?}, bias {:?}", weight.dims(), bias.dims());
    }
    let one_pass = [x, weight, bias].iter().all(|t| t.dtype() == DType::F32 && t.device().is_cpu() && !t.track_op()) && x.elem_count() > 0;
    let spatial: usize = dims[2..].iter().product();
    if one_pass && spatial > 0 {
        let out = with_contiguous(x, |xs: &[f32]| {
            with_contiguous(weight, |w: &[f32]| with_contiguous(bias, |b: &[f32]| normalized(xs, w, b, spatial, groups, eps, relu)))
        })?;
        if let Some(Ok(Some(Ok(Some(out))))) = out {
            return Tensor::from_vec(out, dims, x.device());
        }
    }
    by_ops(x, weight, bias, groups, eps, relu)
}

/// The one-pass form over contiguous `xs` `[B, C, spatial]` (`C` = `w.len()`).
fn normalized(xs: &[f32], w: &[f32], b: &[f32], spatial: usize, groups: usize, eps: f64, relu: bool) -> Vec<f32> {
    let channels = w.len();
    let per_group = channels / groups;
    // `xs` holds B·C·S values: a group is `per_group` channel rows of S, contiguous.
    let group_len = per_group * spatial;
    let mut out = Vec::with_capacity(xs.len());
    out.spare_capacity_mut().par_chunks_mut(group_len).zip(xs.par_chunks(group_len)).enumerate().for_each(|(i, (o, xg))| {
        let n = xg.len() as f64;
        let mean = xg.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
        let var = xg.iter().map(|&v| (f64::from(v) - mean).powi(2)).sum::<f64>() / n;
        let inv = 1.0 / (var + eps).sqrt();
        let first = (i % groups) * per_group;
        for (c, (oc, xc)) in o.chunks_exact_mut(spatial).zip(xg.chunks_exact(spatial)).enumerate() {
            let scale = inv * f64::from(w[first + c]);
            let shift = f64::from(b[first + c]) - mean * scale;
            for (o, &v) in oc.iter_mut().zip(xc) {
                let y = (f64::from(v) * scale + shift) as f32;
                o.write(if relu { y.max(0.0) } else { y });
            }
        }
    });
    // SAFETY: `xs.len()` is B·groups·group_len, so the chunks cover it, and each chunk is exactly its
    // `per_group` rows of `spatial` values: every element was written.
    unsafe { out.set_len(xs.len()) };
    out
}

/// Candle's ops, as `candle_nn::GroupNorm` computes it (autograd records through them).
fn by_ops(x: &Tensor, weight: &Tensor, bias: &Tensor, groups: usize, eps: f64, relu: bool) -> candle_core::Result<Tensor> {
    let dims = x.dims();
    let mut affine = vec![1; dims.len()];
    affine[1] = dims[1];
    let g = x.reshape((dims[0], groups, ()))?;
    let n = g.dim(2)? as f64;
    let centred = g.broadcast_sub(&(g.sum_keepdim(2)? / n)?)?;
    let var = (centred.sqr()?.sum_keepdim(2)? / n)?;
    let y = centred.broadcast_div(&(var + eps)?.sqrt()?)?.reshape(dims)?;
    let y = y.broadcast_mul(&weight.reshape(affine.as_slice())?)?.broadcast_add(&bias.reshape(affine.as_slice())?)?;
    if relu {
        y.relu()
    } else {
        Ok(y)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn randn(shape: &[usize], seed: u64) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|i| (((i as u64 * 2654435761 + seed * 97) % 1000) as f32 / 250.0 - 2.0) * 1.7 + 0.3).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    #[test]
    fn one_pass_equals_candles_group_norm_with_and_without_relu() {
        let x = randn(&[2, 8, 5, 7], 1);
        let (w, b) = (randn(&[8], 2), randn(&[8], 3));
        for relu in [false, true] {
            let reference = candle_nn::GroupNorm::new(w.clone(), b.clone(), 8, 4, 1e-5).unwrap();
            let mut want = candle_nn::Module::forward(&reference, &x).unwrap();
            if relu {
                want = want.relu().unwrap();
            }
            let got = group_norm(&x, &w, &b, 4, 1e-5, relu).unwrap();
            let err = (got - &want).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
            assert!(err < 1e-5, "relu {relu}: {err}");
        }
    }

    #[test]
    fn recording_inputs_take_candles_ops_and_get_gradients() {
        let x = Var::from_tensor(&randn(&[1, 4, 3, 3], 4)).unwrap();
        let (w, b) = (randn(&[4], 5), randn(&[4], 6));
        let y = group_norm(x.as_tensor(), &w, &b, 2, 1e-5, true).unwrap();
        let grads = y.sum_all().unwrap().backward().unwrap();
        assert!(grads.get(x.as_tensor()).is_some(), "the gradient reaches x");
        let plain = group_norm(&x.as_tensor().detach(), &w, &b, 2, 1e-5, true).unwrap();
        let err = (y - plain).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
        assert!(err < 1e-5, "{err}");
    }

    #[test]
    fn mismatched_shapes_are_an_error() {
        let x = randn(&[1, 6, 2, 2], 7);
        assert!(group_norm(&x, &randn(&[6], 1), &randn(&[6], 2), 4, 1e-5, false).is_err(), "6 channels in 4 groups");
        assert!(group_norm(&x, &randn(&[5], 1), &randn(&[6], 2), 3, 1e-5, false).is_err(), "weight length");
    }
}
