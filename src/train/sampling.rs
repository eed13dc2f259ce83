//! Hard-example sampling: each epoch's samples drawn with replacement (PyTorch's
//! `WeightedRandomSampler(weights, n, replacement=True)`) with weights from the per-sample training
//! losses of the epochs before, mixed with the uniform weight so that every sample keeps a chance of
//! at least `(1 − fraction) / n`. The losses are part of the resume state.
use super::rng::SplitMix;

/// A per-sample loss not known yet (the sample was never trained on).
pub const UNSEEN: f32 = -1.0;

/// Sampling weights (summing to 1) from `losses` (`UNSEEN` where unknown; those get the mean of the
/// known ones): `(1 − fraction)/n + fraction · loss_i / Σ loss`. None when nothing is known yet or
/// every known loss is 0 (the caller keeps the plain permutation).
pub fn weights(losses: &[f32], fraction: f64) -> Option<Vec<f64>> {
    let known: Vec<f64> = losses.iter().filter(|&&l| l >= 0.0).map(|&l| l as f64).collect();
    if known.is_empty() || losses.is_empty() {
        return None;
    }
    let mean = known.iter().sum::<f64>() / known.len() as f64;
    let filled: Vec<f64> = losses.iter().map(|&l| if l >= 0.0 { l as f64 } else { mean }).collect();
    let total: f64 = filled.iter().sum();
    if !(total > 0.0 && total.is_finite()) {
        return None;
    }
    let n = losses.len() as f64;
    Some(filled.iter().map(|l| (1.0 - fraction) / n + fraction * l / total).collect())
}

/// `count` indices drawn with replacement with probabilities `weights` (summing to 1).
pub(crate) fn draw(rng: &mut SplitMix, weights: &[f64], count: usize) -> Vec<usize> {
    let mut cum = Vec::with_capacity(weights.len());
    let mut acc = 0.0;
    for w in weights {
        acc += w;
        cum.push(acc);
    }
    let last = weights.len().saturating_sub(1);
    (0..count)
        .map(|_| {
            let u = rng.uniform(0.0, acc);
            cum.partition_point(|&c| c <= u).min(last)
        })
        .collect()
}

/// The order of an epoch's `n` training samples: a permutation drawn from `rng` when `fraction` is 0
/// or no loss is known, else `n` loss-weighted draws.
pub(crate) fn epoch_order(rng: &mut SplitMix, n: usize, losses: Option<&[f32]>, fraction: f64) -> Vec<usize> {
    match losses.filter(|_| fraction > 0.0).and_then(|l| weights(l, fraction)) {
        Some(w) => draw(rng, &w, n),
        None => rng.permutation(n),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_fill_unseen_with_the_mean_and_keep_every_sample() {
        let w = weights(&[1.0, UNSEEN, 3.0, 0.0], 0.5).unwrap();
        // Known: 1, 3, 0 (mean 4/3); filled: 1, 4/3, 3, 0 (sum 16/3): 0.125 + 0.5·l·3/16.
        let want = [0.125 + 1.5 / 16.0, 0.125 + 2.0 / 16.0, 0.125 + 4.5 / 16.0, 0.125];
        for (a, b) in w.iter().zip(want) {
            assert!((a - b).abs() < 1e-12, "{w:?}");
        }
        assert!(weights(&[UNSEEN, UNSEEN], 0.5).is_none() && weights(&[0.0, 0.0], 0.5).is_none());
    }

    /// The draws follow the weights: every count within 5 standard deviations of its expectation
    /// (a fixed seed: deterministic), and a permutation when nothing is known.
    #[test]
    fn draws_follow_the_weights() {
        let losses = [0.1f32, 0.5, 2.0, UNSEEN, 0.0, 4.0];
        let w = weights(&losses, 0.8).unwrap();
        let n = 60_000;
        let picks = draw(&mut SplitMix::keyed(&[3, 1]), &w, n);
        let mut counts = [0usize; 6];
        for p in picks {
            counts[p] += 1;
        }
        for (i, (&c, &p)) in counts.iter().zip(&w).enumerate() {
            let (mean, sd) = (n as f64 * p, (n as f64 * p * (1.0 - p)).sqrt());
            assert!((c as f64 - mean).abs() < 5.0 * sd, "sample {i}: {c} draws, expected {mean:.0} ± {sd:.0} ({counts:?})");
        }
        assert!(counts[4] > 0, "a zero loss keeps a chance");
        let mut p = epoch_order(&mut SplitMix::new(1), 6, Some(&[UNSEEN; 6]), 0.8);
        p.sort();
        assert_eq!(p, (0..6).collect::<Vec<_>>());
        assert_eq!(epoch_order(&mut SplitMix::new(1), 6, Some(&losses), 0.0), SplitMix::new(1).permutation(6));
    }
}
