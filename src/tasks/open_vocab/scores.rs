//! SegEarth-OV-3's score arithmetic, on the CPU in f32 and in the official code's order: a prompt's
//! map from its kept queries' masks and its semantic map, the sliding window's sums, the classes'
//! maxima over their synonyms and the thresholded argmax.
use rayon::prelude::*;

use crate::kernels::bilinear_cpu::axis_taps;
use crate::models::sam3::{sigmoid, PromptMaps};

/// Per-class scores of an image: `classes` planes of `height × width`, row-major.
#[derive(Debug, Clone)]
pub struct ClassScores {
    /// Planes.
    pub classes: usize,
    /// Rows.
    pub height: usize,
    /// Columns.
    pub width: usize,
    /// `classes · height · width` scores.
    pub values: Vec<f32>,
}

/// One prompt's score map at `h × w` into `out`: the maximum of 0, each kept query's
/// σ(bilinear(mask logits)) · score and σ(bilinear(semantic logits)), times the presence score
/// (`_inference_single_view`; bilinear with `align_corners=False`).
pub fn prompt_scores(maps: &PromptMaps, h: usize, w: usize, out: &mut [f32]) {
    let (mh, mw) = maps.size;
    let plane = mh * mw;
    let (rows, cols) = (axis_taps(mh, h), axis_taps(mw, w));
    let lerp = |p: &[f32], (y0, y1, ly1): (usize, usize, f32), (x0, x1, lx1): (usize, usize, f32)| {
        let (ly0, lx0) = (1.0 - ly1, 1.0 - lx1);
        ly0 * (lx0 * p[y0 * mw + x0] + lx1 * p[y0 * mw + x1]) + ly1 * (lx0 * p[y1 * mw + x0] + lx1 * p[y1 * mw + x1])
    };
    out.par_chunks_mut(w).zip(rows.par_iter()).for_each(|(row, &ty)| {
        for (o, &tx) in row.iter_mut().zip(&cols) {
            let mut s = 0f32;
            for (k, &score) in maps.scores.iter().enumerate() {
                s = s.max(sigmoid(lerp(&maps.masks[k * plane..][..plane], ty, tx)) * score);
            }
            s = s.max(sigmoid(lerp(&maps.semantic, ty, tx)));
            *o = s * maps.presence;
        }
    });
}

/// `acc[c] = max(acc[c], v)` over a plane.
pub fn max_into(acc: &mut [f32], v: &[f32]) {
    acc.par_iter_mut().zip(v.par_iter()).for_each(|(a, &b)| *a = a.max(b));
}

/// The class id of each pixel: the argmax over classes (ties to the lowest id), `bg_idx` where the
/// best score is below `prob_thd`.
pub fn classify(scores: &ClassScores, prob_thd: f32, bg_idx: u8) -> Vec<u8> {
    let n = scores.height * scores.width;
    let mut out = vec![0u8; n];
    out.par_chunks_mut(scores.width.max(1)).enumerate().for_each(|(y, row)| {
        for (x, o) in row.iter_mut().enumerate() {
            let i = y * scores.width + x;
            let (mut best, mut arg) = (f32::NEG_INFINITY, 0usize);
            for c in 0..scores.classes {
                let v = scores.values[c * n + i];
                if c == 0 || v > best {
                    best = v;
                    arg = c;
                }
            }
            *o = if best < prob_thd { bg_idx } else { arg as u8 };
        }
    });
    out
}

/// The sliding windows `(x0, y0, x1, y1)` over a `w × h` image, in the official order (rows of
/// windows top to bottom): `crop` at `stride`, the last of each axis moved back to end at the edge.
pub fn windows(w: usize, h: usize, crop: usize, stride: usize) -> Vec<(usize, usize, usize, usize)> {
    let grids = |n: usize| (n + stride - 1).saturating_sub(crop) / stride + 1;
    let mut out = Vec::new();
    for hi in 0..grids(h) {
        for wi in 0..grids(w) {
            let (y2, x2) = ((hi * stride + crop).min(h), (wi * stride + crop).min(w));
            out.push((x2.saturating_sub(crop), y2.saturating_sub(crop), x2, y2));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_cover_the_image_and_end_at_its_edges() {
        assert_eq!(windows(160, 120, 96, 64), vec![(0, 0, 96, 96), (64, 0, 160, 96), (0, 24, 96, 120), (64, 24, 160, 120)]);
        assert_eq!(windows(50, 40, 96, 64), vec![(0, 0, 50, 40)]);
        assert_eq!(windows(200, 96, 96, 96).len(), 3);
    }

    #[test]
    fn classify_takes_the_first_best_and_the_background_below_the_threshold() {
        let s = ClassScores { classes: 3, height: 1, width: 3, values: vec![0.2, 0.5, 0.05, 0.6, 0.5, 0.01, 0.6, 0.1, 0.02] };
        assert_eq!(classify(&s, 0.0, 0), vec![1, 0, 0]);
        assert_eq!(classify(&s, 0.1, 2), vec![1, 0, 2]);
    }

    #[test]
    fn a_prompt_map_is_the_best_of_its_queries_and_semantic_map_times_presence() {
        let maps = PromptMaps { presence: 0.5, scores: vec![0.9], masks: vec![10.0; 4], semantic: vec![-10.0; 4], size: (2, 2) };
        let mut out = vec![0f32; 9];
        prompt_scores(&maps, 3, 3, &mut out);
        assert!(out.iter().all(|&v| (v - sigmoid(10.0) * 0.9 * 0.5).abs() < 1e-7));
        let maps = PromptMaps { scores: vec![], masks: vec![], semantic: vec![0.0; 4], ..maps };
        prompt_scores(&maps, 3, 3, &mut out);
        assert!(out.iter().all(|&v| (v - 0.25).abs() < 1e-7));
    }
}
