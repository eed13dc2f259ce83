//! CutMix and MixUp for the dense tasks, as timm's `Mixup` defines them in its `batch` mode: one λ per
//! micro-batch drawn from Beta(α, α), sample i mixed with sample B−1−i (`x.flip(0)`), the CutMix box
//! from `rand_bbox` with λ corrected to `1 − box area / image area`. The targets follow the images:
//! CutMix pastes the same box of the target; MixUp mixes regression targets with the same weights (a
//! pixel ignored in either is ignored) and keeps both class maps, whose losses are mixed instead.
use candle_core::{DType, Tensor};

use super::rng::SplitMix;
use crate::error::{Error, Result};

/// The mixing settings, with timm `Mixup`'s names and meaning (batch mode).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MixConfig {
    /// MixUp's Beta(α, α) parameter (0 = no MixUp).
    pub mixup_alpha: f64,
    /// CutMix's Beta(α, α) parameter (0 = no CutMix).
    pub cutmix_alpha: f64,
    /// Probability that a micro-batch is mixed at all.
    pub mix_prob: f64,
    /// With both on: probability of CutMix rather than MixUp.
    pub switch_prob: f64,
}

/// A CutMix box: rows `yl..yh`, columns `xl..xh` (timm's `(yl, yh, xl, xh)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BBox {
    /// First row.
    pub yl: usize,
    /// One past the last row.
    pub yh: usize,
    /// First column.
    pub xl: usize,
    /// One past the last column.
    pub xh: usize,
}

/// What one micro-batch gets.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Mix {
    /// Left as it is.
    None,
    /// `λ·x + (1 − λ)·x.flip(0)`.
    MixUp {
        /// The weight of the sample itself.
        lam: f64,
    },
    /// The box of `x.flip(0)` pasted into `x`; `lam` is the corrected `1 − box area / area`.
    CutMix {
        /// The share of the sample's own pixels.
        lam: f64,
        /// The pasted box.
        bbox: BBox,
    },
}

/// Which target pixels a loss counts, for mixing regression targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetRule {
    /// Class ids: MixUp keeps both maps (the losses are mixed).
    Classes,
    /// Values: finite ones, and with `positive` only those > 0, are counted.
    Values {
        /// Whether only positive values count (`silog`).
        positive: bool,
    },
}

/// The targets of a micro-batch: one map per sample, or (MixUp on class maps) two with the weight of
/// the first.
#[derive(Debug, Clone)]
pub enum Targets {
    /// `[B, H, W]`.
    One(Tensor),
    /// The loss is `lam · loss(pred, a) + (1 − lam) · loss(pred, b)`.
    Two {
        /// The samples' own targets `[B, H, W]`.
        a: Tensor,
        /// Their partners' (`a.flip(0)`).
        b: Tensor,
        /// The weight of `a`.
        lam: f64,
    },
}

impl Targets {
    /// Sample `i`'s targets (batch of one).
    pub fn sample(&self, i: usize) -> Result<Targets> {
        Ok(match self {
            Targets::One(t) => Targets::One(t.narrow(0, i, 1)?),
            Targets::Two { a, b, lam } => Targets::Two { a: a.narrow(0, i, 1)?, b: b.narrow(0, i, 1)?, lam: *lam },
        })
    }
}

/// timm's `rand_bbox` for a box centred at (`cy`, `cx`) (its two `randint` draws): sides
/// `int(H·√(1−λ))` × `int(W·√(1−λ))`, clipped to the image.
pub fn rand_bbox(h: usize, w: usize, lam: f64, cy: usize, cx: usize) -> BBox {
    let ratio = (1.0 - lam).max(0.0).sqrt();
    let (cut_h, cut_w) = ((h as f64 * ratio) as i64, (w as f64 * ratio) as i64);
    let clip = |v: i64, hi: usize| v.clamp(0, hi as i64) as usize;
    let (cy, cx) = (cy as i64, cx as i64);
    BBox { yl: clip(cy - cut_h / 2, h), yh: clip(cy + (cut_h + 1) / 2, h), xl: clip(cx - cut_w / 2, w), xh: clip(cx + (cut_w + 1) / 2, w) }
}

/// timm's `correct_lam`: `1 − box area / image area`.
pub fn cutmix_lam(h: usize, w: usize, b: BBox) -> f64 {
    1.0 - ((b.yh - b.yl) * (b.xh - b.xl)) as f64 / (h * w) as f64
}

impl MixConfig {
    /// Whether anything mixes.
    pub fn enabled(&self) -> bool {
        (self.mixup_alpha > 0.0 || self.cutmix_alpha > 0.0) && self.mix_prob > 0.0
    }

    /// The mix of one micro-batch of `h`×`w` images, drawn as timm's `_params_per_batch` and
    /// `cutmix_bbox_and_lam` draw it (numpy's stream replaced by `rng`): whether to mix
    /// (`rand() < mix_prob`), with both on whether CutMix (`rand() < switch_prob`), λ ~ Beta(α, α),
    /// and for CutMix the box centre uniform over the rows and columns.
    pub(crate) fn draw(&self, rng: &mut SplitMix, h: usize, w: usize) -> Mix {
        if !self.enabled() || rng.uniform(0.0, 1.0) >= self.mix_prob {
            return Mix::None;
        }
        let (mixup, cutmix) = (self.mixup_alpha > 0.0, self.cutmix_alpha > 0.0);
        let use_cutmix = if mixup && cutmix { rng.uniform(0.0, 1.0) < self.switch_prob } else { cutmix };
        let alpha = if use_cutmix { self.cutmix_alpha } else { self.mixup_alpha };
        let lam = rng.beta(alpha, alpha);
        if lam == 1.0 {
            return Mix::None;
        }
        if !use_cutmix {
            return Mix::MixUp { lam };
        }
        let cy = rng.below(h as u64) as usize;
        let cx = rng.below(w as u64) as usize;
        let bbox = rand_bbox(h, w, lam, cy, cx);
        Mix::CutMix { lam: cutmix_lam(h, w, bbox), bbox }
    }
}

/// `x.flip(0)`.
fn flip0(x: &Tensor) -> Result<Tensor> {
    let b = x.dim(0)?;
    let idx = Tensor::from_vec((0..b as u32).rev().collect::<Vec<_>>(), b, x.device())?;
    Ok(x.index_select(&idx, 0)?)
}

/// A 0/1 (u8) map of `bbox` over the last two dimensions of `shape`, broadcast to `shape`.
fn box_mask(shape: &[usize], b: BBox, device: &candle_core::Device) -> Result<Tensor> {
    let (h, w) = (shape[shape.len() - 2], shape[shape.len() - 1]);
    let mut m = vec![0u8; h * w];
    for y in b.yl..b.yh {
        m[y * w + b.xl..y * w + b.xh].fill(1);
    }
    Ok(Tensor::from_vec(m, (h, w), device)?.broadcast_as(shape)?)
}

impl Mix {
    /// The mixed images `[B, C, H, W]` (timm: `x.mul_(λ).add_(x.flip(0).mul_(1 − λ))`, or the box of
    /// `x.flip(0)` pasted).
    pub fn images(&self, x: &Tensor) -> Result<Tensor> {
        match *self {
            Mix::None => Ok(x.clone()),
            Mix::MixUp { lam } => Ok((x.affine(lam, 0.0)? + flip0(x)?.affine(1.0 - lam, 0.0)?)?),
            Mix::CutMix { bbox, .. } => Ok(box_mask(x.dims(), bbox, x.device())?.where_cond(&flip0(x)?, x)?),
        }
    }

    /// The targets `[B, H, W]` of the mixed images: CutMix pastes the same box; MixUp mixes values
    /// where both are counted (NaN, i.e. ignored, elsewhere) and keeps both class maps.
    pub fn targets(&self, t: &Tensor, rule: TargetRule) -> Result<Targets> {
        if t.rank() != 3 {
            return Err(Error::Input(format!("targets {:?}: expected [B, H, W]", t.dims())));
        }
        match (*self, rule) {
            (Mix::None, _) => Ok(Targets::One(t.clone())),
            (Mix::CutMix { bbox, .. }, _) => Ok(Targets::One(box_mask(t.dims(), bbox, t.device())?.where_cond(&flip0(t)?, t)?)),
            (Mix::MixUp { lam }, TargetRule::Classes) => Ok(Targets::Two { a: t.clone(), b: flip0(t)?, lam }),
            (Mix::MixUp { lam }, TargetRule::Values { positive }) => {
                let b = flip0(t)?;
                let counted = |v: &Tensor| -> Result<Tensor> {
                    let v = v.to_dtype(DType::F64)?;
                    let finite = v.abs()?.le(f64::MAX)?;
                    Ok(if positive { finite.mul(&v.gt(0.0)?)? } else { finite })
                };
                let both = counted(t)?.mul(&counted(&b)?)?;
                let mixed = (t.affine(lam, 0.0)? + b.affine(1.0 - lam, 0.0)?)?;
                Ok(Targets::One(both.where_cond(&mixed, &t.ones_like()?.affine(0.0, f64::NAN)?)?))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// λ ~ Beta(α, α): mean ½ and variance 1/(4(2α+1)), over many draws of a fixed seed.
    #[test]
    fn lambda_follows_beta() {
        for alpha in [0.2, 1.0, 4.0] {
            let mut rng = SplitMix::new(7);
            let n = 40_000;
            let v: Vec<f64> = (0..n).map(|_| rng.beta(alpha, alpha)).collect();
            assert!(v.iter().all(|x| (0.0..=1.0).contains(x)));
            let mean = v.iter().sum::<f64>() / n as f64;
            let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
            let want = 1.0 / (4.0 * (2.0 * alpha + 1.0));
            assert!((mean - 0.5).abs() < 0.01, "α {alpha}: mean {mean}");
            assert!((var - want).abs() < 0.03 * want + 1e-3, "α {alpha}: variance {var} vs {want}");
            // P(λ < 0.25) against the Beta CDF: for α = 1 (uniform) exactly 0.25.
            if alpha == 1.0 {
                let p = v.iter().filter(|&&x| x < 0.25).count() as f64 / n as f64;
                assert!((p - 0.25).abs() < 0.01, "{p}");
            }
        }
    }

    /// The sampler's CutMix boxes follow `rand_bbox`'s rules: sides `int(H·√(1−λ₀))` before clipping,
    /// centres uniform over every row and column, λ corrected to the clipped area.
    #[test]
    fn cutmix_draws_follow_rand_bbox() {
        let cfg = MixConfig { mixup_alpha: 0.0, cutmix_alpha: 1.0, mix_prob: 1.0, switch_prob: 0.5 };
        let (h, w) = (13, 20);
        let mut rows = vec![0usize; h];
        let mut cols = vec![0usize; w];
        for s in 0..4000u64 {
            match cfg.draw(&mut SplitMix::keyed(&[s, 2]), h, w) {
                Mix::CutMix { lam, bbox } => {
                    assert!(bbox.yl <= bbox.yh && bbox.yh <= h && bbox.xl <= bbox.xh && bbox.xh <= w);
                    assert_eq!(lam, cutmix_lam(h, w, bbox));
                    // Replay the draw: the same λ₀ and centre give this box.
                    let mut r = SplitMix::keyed(&[s, 2]);
                    r.uniform(0.0, 1.0);
                    let lam0 = r.beta(1.0, 1.0);
                    let (cy, cx) = (r.below(h as u64) as usize, r.below(w as u64) as usize);
                    assert_eq!(bbox, rand_bbox(h, w, lam0, cy, cx));
                    rows[cy] += 1;
                    cols[cx] += 1;
                }
                other => panic!("CutMix only, always: {other:?}"),
            }
        }
        assert!(rows.iter().all(|&c| c > 4000 / h / 2) && cols.iter().all(|&c| c > 4000 / w / 2), "{rows:?} {cols:?}");
    }

    #[test]
    fn mix_prob_and_switch_prob_choose_as_timm() {
        let cfg = MixConfig { mixup_alpha: 1.0, cutmix_alpha: 1.0, mix_prob: 0.6, switch_prob: 0.25 };
        let (mut none, mut up, mut cut) = (0, 0, 0);
        for s in 0..20_000u64 {
            match cfg.draw(&mut SplitMix::keyed(&[s]), 8, 8) {
                Mix::None => none += 1,
                Mix::MixUp { .. } => up += 1,
                Mix::CutMix { .. } => cut += 1,
            }
        }
        let f = |c: i32| c as f64 / 20_000.0;
        assert!((f(none) - 0.4).abs() < 0.015 && (f(cut) - 0.15).abs() < 0.015 && (f(up) - 0.45).abs() < 0.015, "{none} {up} {cut}");
        let off = MixConfig { mixup_alpha: 0.0, cutmix_alpha: 0.0, ..cfg };
        assert_eq!(off.draw(&mut SplitMix::new(1), 8, 8), Mix::None);
    }

    #[test]
    fn regression_mixup_ignores_a_pixel_ignored_in_either() {
        let dev = candle_core::Device::Cpu;
        let t = Tensor::new(&[[[1f32, f32::NAN, 0.0]], [[3.0, 5.0, 2.0]]], &dev).unwrap();
        let Targets::One(m) = Mix::MixUp { lam: 0.25 }.targets(&t, TargetRule::Values { positive: true }).unwrap() else { panic!() };
        let v: Vec<f32> = m.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(v[0], 0.25 * 1.0 + 0.75 * 3.0);
        assert!(v[1].is_nan() && v[2].is_nan() && v[4].is_nan() && v[5].is_nan(), "{v:?}");
        assert_eq!(v[3], 0.25 * 3.0 + 0.75 * 1.0);
    }
}
