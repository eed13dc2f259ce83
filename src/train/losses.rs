//! Training losses, differentiable through Candle's autograd (only ops with a backward). Regression
//! targets mark ignored pixels with NaN (or ±inf); an all-ignored batch is an error, never a NaN.
use candle_core::{DType, Tensor};

use crate::error::{Error, Result};

/// Smallest prediction taken into a logarithm (a relative model's ReLU output can be 0).
pub(crate) const LOG_FLOOR: f64 = 1e-12;

/// (mask as 0/1 in `pred`'s dtype, target with ignored pixels set to `fill`, count of valid pixels).
fn valid(pred: &Tensor, target: &Tensor, positive: bool, fill: f64) -> Result<(Tensor, Tensor, f64)> {
    if pred.dims() != target.dims() {
        return Err(Error::Input(format!("prediction {:?} and target {:?} differ in shape", pred.dims(), target.dims())));
    }
    let t = target.to_dtype(DType::F64)?;
    let finite = t.abs()?.le(f64::MAX)?; // false for NaN and ±inf
    let keep = if positive { finite.mul(&t.gt(0.0)?)? } else { finite };
    let safe = keep.where_cond(&t, &t.ones_like()?.affine(0.0, fill)?)?.to_dtype(pred.dtype())?;
    let mask = keep.to_dtype(pred.dtype())?;
    let n = mask.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
    if n == 0.0 {
        return Err(Error::Input("every target pixel of the batch is ignored (NaN, infinite or out of range)".into()));
    }
    Ok((mask, safe, n))
}

/// Mean absolute error over valid pixels.
pub fn l1(pred: &Tensor, target: &Tensor) -> Result<Tensor> {
    let (mask, t, n) = valid(pred, target, false, 0.0)?;
    Ok(((pred - t)?.abs()? * mask)?.sum_all()?.affine(1.0 / n, 0.0)?)
}

/// Scale-invariant log loss (Depth Anything V2 metric training, `SiLogLoss`): with
/// `d = log(target) − log(pred)` over pixels whose target is finite and positive,
/// `sqrt(mean(d²) − λ·mean(d)²)`; predictions are floored at [`LOG_FLOOR`] before the log.
pub fn silog(pred: &Tensor, target: &Tensor, lambda: f64) -> Result<Tensor> {
    let (mask, t, n) = valid(pred, target, true, 1.0)?;
    let d = ((t.log()? - pred.clamp(LOG_FLOOR, f64::MAX)?.log()?)? * &mask)?;
    let mean = d.sum_all()?.affine(1.0 / n, 0.0)?;
    let mean_sq = d.sqr()?.sum_all()?.affine(1.0 / n, 0.0)?;
    Ok((mean_sq - (mean.sqr()? * lambda)?)?.sqrt()?)
}

/// Scale-and-shift-invariant loss for relative depth (MiDaS): per image, the least-squares scale `s`
/// and shift `t` aligning the prediction to the target over valid pixels (closed form, gradients flow
/// through both; an image whose system is singular gets s = t = 0), then the mean absolute error of
/// `s·pred + t` over all valid pixels of the batch. `pred`, `target`: `[B, H, W]`.
pub fn ssi(pred: &Tensor, target: &Tensor) -> Result<Tensor> {
    let (mask, t, n) = valid(pred, target, false, 0.0)?;
    let sum = |x: &Tensor| -> Result<Tensor> { Ok(x.flatten_from(1)?.sum(1)?) };
    let pm = (pred * &mask)?;
    let a00 = sum(&(&pm * pred)?)?;
    let a01 = sum(&pm)?;
    let a11 = sum(&mask)?;
    let b0 = sum(&(&pm * &t)?)?;
    let b1 = sum(&(&mask * &t)?)?;
    let det = ((&a00 * &a11)? - a01.sqr()?)?;
    let ok = det.ne(0.0)?;
    let safe_det = ok.where_cond(&det, &det.ones_like()?)?;
    let zero = det.zeros_like()?;
    let scale = ok.where_cond(&((((&a11 * &b0)? - (&a01 * &b1)?)? / &safe_det)?), &zero)?;
    let shift = ok.where_cond(&((((&a00 * &b1)? - (&a01 * &b0)?)? / &safe_det)?), &zero)?;
    let rank = pred.rank();
    let per_image = |v: &Tensor| -> Result<Tensor> {
        let mut shape = vec![v.dim(0)?];
        shape.extend(std::iter::repeat_n(1, rank - 1));
        Ok(v.reshape(shape)?)
    };
    let aligned = pred.broadcast_mul(&per_image(&scale)?)?.broadcast_add(&per_image(&shift)?)?;
    Ok(((aligned - t)?.abs()? * mask)?.sum_all()?.affine(1.0 / n, 0.0)?)
}

/// Per-pixel log-probability of the target class and the 0/1 mask of counted pixels.
fn target_log_prob(logits: &Tensor, target: &Tensor, ignore_index: u32) -> Result<(Tensor, Tensor, f64)> {
    let (_, logp, mask, n) = class_log_probs(logits, target, ignore_index)?;
    Ok((logp, mask, n))
}

/// The mean log-probability over the classes `[B, H, W]`, the log-probability of the target class
/// `[B, H, W]`, the 0/1 mask of counted pixels and their count.
fn class_log_probs(logits: &Tensor, target: &Tensor, ignore_index: u32) -> Result<(Tensor, Tensor, Tensor, f64)> {
    let (b, c, h, w) = logits.dims4()?;
    if target.dims() != [b, h, w] {
        return Err(Error::Input(format!("class targets {:?} do not match logits {:?}", target.dims(), logits.dims())));
    }
    let t = target.to_dtype(DType::U32)?;
    let keep = t.ne(ignore_index)?;
    let out_of_range = keep.mul(&t.ge(c as u32)?)?.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
    if out_of_range > 0.0 {
        return Err(Error::Input(format!("{out_of_range} target pixels name a class ≥ {c} (and are not the ignore index {ignore_index})")));
    }
    let idx = keep.where_cond(&t, &t.zeros_like()?)?;
    let (logp, mean) = crate::nn::grad::class_log_probs(logits, &idx)?;
    let mask = keep.to_dtype(logits.dtype())?;
    let n = mask.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
    if n == 0.0 {
        return Err(Error::Input(format!("every target pixel of the batch is the ignore index {ignore_index}")));
    }
    Ok((mean, logp, mask, n))
}

/// Cross-entropy of `logits` `[B, C, H, W]` against class ids `[B, H, W]`, mean over pixels that
/// are not `ignore_index` (`F.cross_entropy(…, ignore_index=…)`).
pub fn cross_entropy(logits: &Tensor, target: &Tensor, ignore_index: u32) -> Result<Tensor> {
    let (logp, mask, n) = target_log_prob(logits, target, ignore_index)?;
    Ok((logp * mask)?.sum_all()?.affine(-1.0 / n, 0.0)?)
}

/// Cross-entropy with label smoothing ε, as `F.cross_entropy(logits, target, ignore_index=…,
/// label_smoothing=ε)` defines it: `(1 − ε) · NLL + ε · mean over classes of −log p_c`, both terms summed
/// over the pixels that are not `ignore_index` and divided by their count. ε = 0 is [`cross_entropy`].
pub fn cross_entropy_smoothed(logits: &Tensor, target: &Tensor, ignore_index: u32, smoothing: f64) -> Result<Tensor> {
    if smoothing == 0.0 {
        return cross_entropy(logits, target, ignore_index);
    }
    let (mean, logp, mask, n) = class_log_probs(logits, target, ignore_index)?;
    let nll = (logp * &mask)?.sum_all()?.affine(-1.0 / n, 0.0)?;
    let smooth = (mean * &mask)?.sum_all()?.affine(-1.0 / n, 0.0)?;
    Ok((nll.affine(1.0 - smoothing, 0.0)? + smooth.affine(smoothing, 0.0)?)?)
}

/// MixUp's loss on class maps: `λ · CE(logits, a) + (1 − λ) · CE(logits, b)`, each term the
/// label-smoothed cross-entropy of [`cross_entropy_smoothed`].
pub fn cross_entropy_pair(logits: &Tensor, a: &Tensor, b: &Tensor, lam: f64, ignore_index: u32, smoothing: f64) -> Result<Tensor> {
    let la = cross_entropy_smoothed(logits, a, ignore_index, smoothing)?;
    let lb = cross_entropy_smoothed(logits, b, ignore_index, smoothing)?;
    Ok((la.affine(lam, 0.0)? + lb.affine(1.0 - lam, 0.0)?)?)
}

/// Multi-class focal loss `−(1 − p_t)^γ · log p_t` (Lin et al.; torchvision's `sigmoid_focal_loss`
/// with the softmax probability of the target class), mean over pixels that are not `ignore_index`.
pub fn focal(logits: &Tensor, target: &Tensor, gamma: f64, ignore_index: u32) -> Result<Tensor> {
    let (logp, mask, n) = target_log_prob(logits, target, ignore_index)?;
    let weight = logp.exp()?.affine(-1.0, 1.0)?.clamp(0.0, 1.0)?.powf(gamma)?;
    Ok((weight * logp * mask)?.sum_all()?.affine(-1.0 / n, 0.0)?)
}

