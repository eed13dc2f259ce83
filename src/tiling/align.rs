//! Bringing relative depth tiles to a common scale: each tile's values `v` are replaced by `a·v + b`,
//! with `(a, b)` the least-squares fit of `v` to the already-aligned neighbouring tiles' values on
//! the pixels they share (every [`STEP`]-th pixel of each overlap in both directions).
use std::ops::Range;

/// Sampling step over the overlaps when fitting.
pub(crate) const STEP: usize = 2;
/// Fewest sample pairs for a scale fit; with fewer only the shift is fitted.
pub(crate) const MIN_PAIRS: usize = 16;

/// Running sums of `(v, u)` pairs for the fit `a·v + b ≈ u`.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Fit {
    n: f64,
    sv: f64,
    su: f64,
    svv: f64,
    svu: f64,
}

impl Fit {
    /// Adds one pair (ignored unless both are finite).
    pub(crate) fn add(&mut self, v: f32, u: f32) {
        if v.is_finite() && u.is_finite() {
            let (v, u) = (v as f64, u as f64);
            self.n += 1.0;
            self.sv += v;
            self.su += u;
            self.svv += v * v;
            self.svu += v * u;
        }
    }

    /// `(a, b)`: identity without pairs; shift only with fewer than [`MIN_PAIRS`] pairs, a flat
    /// tile, or a fitted scale that is not positive and finite (relative depth never inverts).
    pub(crate) fn solve(&self) -> (f32, f32) {
        if self.n == 0.0 {
            return (1.0, 0.0);
        }
        let (mv, mu) = (self.sv / self.n, self.su / self.n);
        let var = self.svv / self.n - mv * mv;
        let cov = self.svu / self.n - mv * mu;
        let shift_only = (1.0, (mu - mv) as f32);
        if (self.n as usize) < MIN_PAIRS || var <= 1e-12 * (1.0 + mv * mv) {
            return shift_only;
        }
        let a = cov / var;
        if !(a.is_finite() && a > 1e-6) {
            return shift_only;
        }
        (a as f32, (mu - a * mv) as f32)
    }
}

/// A tile placed in the raster: its one-plane values and where they lie.
#[derive(Debug, Clone)]
pub(crate) struct Placed<'a> {
    /// Row-major values, `rows.len() · cols.len()`.
    pub values: &'a [f32],
    /// Raster rows covered.
    pub rows: Range<usize>,
    /// Raster columns covered.
    pub cols: Range<usize>,
}

/// Adds to `fit` the pairs (tile value, neighbour value) on the pixels `tile` and `neighbour` share.
pub(crate) fn add_overlap(fit: &mut Fit, tile: &Placed, neighbour: &Placed) {
    let (r0, r1) = (tile.rows.start.max(neighbour.rows.start), tile.rows.end.min(neighbour.rows.end));
    let (c0, c1) = (tile.cols.start.max(neighbour.cols.start), tile.cols.end.min(neighbour.cols.end));
    let (tw, nw) = (tile.cols.len(), neighbour.cols.len());
    for y in (r0..r1).step_by(STEP) {
        for x in (c0..c1).step_by(STEP) {
            let v = tile.values[(y - tile.rows.start) * tw + (x - tile.cols.start)];
            let u = neighbour.values[(y - neighbour.rows.start) * nw + (x - neighbour.cols.start)];
            fit.add(v, u);
        }
    }
}

/// Applies `a·v + b` in place.
pub fn apply(values: &mut [f32], (a, b): (f32, f32)) {
    if (a, b) != (1.0, 0.0) {
        values.iter_mut().for_each(|v| *v = a * *v + b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recovers_scale_and_shift() {
        let mut f = Fit::default();
        for i in 0..100 {
            let v = i as f32 * 0.1;
            f.add(v, 2.5 * v - 1.0);
        }
        let (a, b) = f.solve();
        assert!((a - 2.5).abs() < 1e-4 && (b + 1.0).abs() < 1e-4, "{a} {b}");
        let mut flat = Fit::default();
        for _ in 0..100 {
            flat.add(3.0, 5.0);
        }
        assert_eq!(flat.solve(), (1.0, 2.0));
        assert_eq!(Fit::default().solve(), (1.0, 0.0));
    }
}
