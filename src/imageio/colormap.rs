//! Colour maps for visualising scalar maps (depth, edges, height).

/// Maps `values` to RGB with a perceptual (inferno-like) ramp after min–max normalisation.
pub fn colorize(values: &[f32]) -> Vec<u8> {
    const STOPS: [[f32; 3]; 6] = [
        [0.0, 0.0, 4.0],
        [40.0, 11.0, 84.0],
        [101.0, 21.0, 110.0],
        [159.0, 42.0, 99.0],
        [212.0, 72.0, 66.0],
        [252.0, 255.0, 164.0],
    ];
    let finite = values.iter().copied().filter(|v| v.is_finite());
    let (lo, hi) = finite.fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), v| (a.min(v), b.max(v)));
    let span = if hi > lo { hi - lo } else { 1.0 };
    let mut out = Vec::with_capacity(values.len() * 3);
    for &v in values {
        let t = if v.is_finite() { ((v - lo) / span).clamp(0.0, 1.0) } else { 0.0 };
        let x = t * (STOPS.len() - 1) as f32;
        let i = (x.floor() as usize).min(STOPS.len() - 2);
        let f = x - i as f32;
        for (a, b) in STOPS[i].iter().zip(&STOPS[i + 1]) {
            out.push((a * (1.0 - f) + b * f).round() as u8);
        }
    }
    out
}
