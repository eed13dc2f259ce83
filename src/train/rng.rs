//! SplitMix64: a small, seedable generator for data order and augmentation, so that a run is a
//! function of (seed, step) and a resumed run draws exactly what an uninterrupted one would.
/// A SplitMix64 stream.
#[derive(Debug, Clone)]
pub(crate) struct SplitMix(u64);

impl SplitMix {
    /// A stream from `seed`.
    pub(crate) fn new(seed: u64) -> Self {
        SplitMix(seed)
    }

    /// A stream derived from several keys (seed, epoch, index…).
    pub(crate) fn keyed(keys: &[u64]) -> Self {
        let mut s = SplitMix(0x9e37_79b9_7f4a_7c15);
        for &k in keys {
            s.0 ^= k;
            s.next_u64();
        }
        s
    }

    /// The next 64 random bits.
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[lo, hi)`.
    pub(crate) fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64)
    }

    /// Standard normal (Box–Muller).
    pub(crate) fn normal(&mut self) -> f64 {
        let u1 = self.uniform(f64::MIN_POSITIVE, 1.0);
        let u2 = self.uniform(0.0, 1.0);
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// Uniform integer in `0..n` (`n` ≥ 1; numpy's `randint(0, n)` range).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// The logarithm of a Gamma(`shape`, 1) draw (Marsaglia–Tsang; shapes below 1 boosted by
    /// `U^(1/shape)`, kept in the log domain so that tiny shapes do not underflow).
    pub(crate) fn ln_gamma_draw(&mut self, shape: f64) -> f64 {
        if shape < 1.0 {
            let u = self.uniform(f64::MIN_POSITIVE, 1.0);
            return self.ln_gamma_draw(shape + 1.0) + u.ln() / shape;
        }
        let d = shape - 1.0 / 3.0;
        let c = 1.0 / (9.0 * d).sqrt();
        loop {
            let x = self.normal();
            let v = (1.0 + c * x).powi(3);
            if v <= 0.0 {
                continue;
            }
            let u = self.uniform(f64::MIN_POSITIVE, 1.0);
            if u.ln() < 0.5 * x * x + d - d * v + d * v.ln() {
                return (d * v).ln();
            }
        }
    }

    /// A Beta(`a`, `b`) draw (`a`, `b` > 0), as the ratio of two Gamma draws.
    pub(crate) fn beta(&mut self, a: f64, b: f64) -> f64 {
        let (x, y) = (self.ln_gamma_draw(a), self.ln_gamma_draw(b));
        // x / (x + y) = 1 / (1 + e^(ln y − ln x)).
        1.0 / (1.0 + (y - x).exp())
    }

    /// A permutation of `0..n` (Fisher–Yates).
    pub(crate) fn permutation(&mut self, n: usize) -> Vec<usize> {
        let mut p: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            let j = (self.next_u64() % (i as u64 + 1)) as usize;
            p.swap(i, j);
        }
        p
    }
}
