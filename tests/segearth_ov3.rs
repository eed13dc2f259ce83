//! SegEarth-OV-3 against its official segmentor (`tools/fixtures/segearth_ov3.py`: the official logic on
//! the `sam3` package, the tiny random-weight SAM 3 of `sam3_tiny`) on the bundled example images: with
//! synonyms, thresholds, a background class and the sliding window. Every pixel takes the reference's
//! class except exact near-ties (the two best scores, or the best and `prob_thd`, within 2e-5; at most
//! 0.1 % of pixels), and the per-class scores are within the f32 bound.
mod common;

use candle_core::{DType, Tensor};
use common::{dev, fixture, tensors, F32_REL};
use edgerun::imageio::resample::{resize_with, Filter, Rounding};
use edgerun::models::Checkpoint;
use edgerun::tasks::open_vocab::{ClassList, OpenVocabSegmenter, Params, Slide};

const IMAGES: [&str; 4] = ["scene_0", "scene_1", "scene_2", "scene_3"];
/// The reference scores keep every 8th pixel of every 8th row.
const STRIDE: usize = 8;
const TIE: f32 = 2e-5;

fn case_params(case: &str) -> Params {
    match case {
        "openearthmap" => Params { conf: 0.1, prob_thd: 0.1, bg_idx: 0, slide: None },
        "openearthmap_slide" => Params { conf: 0.1, prob_thd: 0.1, bg_idx: 0, slide: Some(Slide { crop: 96, stride: 64 }) },
        "plain" => Params { conf: 0.3, prob_thd: 0.0, bg_idx: 0, slide: None },
        "threshold" => Params { conf: 0.2, prob_thd: 0.35, bg_idx: 5, slide: Some(Slide { crop: 80, stride: 48 }) },
        _ => unreachable!(),
    }
}

fn image(name: &str) -> image::RgbImage {
    image::open(fixture("segearth_ov3").join(format!("{name}.png"))).unwrap().to_rgb8()
}

fn check_case(case: &str) {
    let dir = fixture("segearth_ov3");
    let want = tensors(&dir, "expected.safetensors");
    let classes = ClassList::read(&dir.join(format!("{case}.txt"))).unwrap();
    let params = case_params(case);
    let ckpt = Checkpoint::open(&fixture("sam3_tiny")).unwrap();
    let seg = OpenVocabSegmenter::load(&ckpt, &dev(), DType::F32, classes, params).unwrap();
    let (mut differ, mut total, mut worst) = (0usize, 0usize, 0f32);
    for name in IMAGES {
        let img = image(name);
        let (got, scores) = seg.segment(&img).unwrap();
        let (w, h) = (scores.width, scores.height);
        let want_classes = want[&format!("{case}/{name}/classes")].flatten_all().unwrap().to_vec1::<u8>().unwrap();
        assert_eq!(want_classes.len(), got.len(), "{case}/{name}: class map size");
        let plane = w * h;
        for (i, (&g, &r)) in got.iter().zip(&want_classes).enumerate() {
            if g == r {
                continue;
            }
            differ += 1;
            let score = |c: u8| if (c as usize) < scores.classes { scores.values[c as usize * plane + i] } else { params.prob_thd };
            let best = (0..scores.classes).map(|c| scores.values[c * plane + i]).fold(f32::NEG_INFINITY, f32::max);
            let gap = (score(g) - score(r)).abs().min((best - params.prob_thd).abs());
            assert!(gap <= TIE, "{case}/{name}: pixel ({}, {}) is class {g}, the reference's {r}, scores {} apart", i % w, i / w, gap);
        }
        total += plane;
        let want_scores = &want[&format!("{case}/{name}/scores")];
        let (c, sh, sw) = want_scores.dims3().unwrap();
        assert_eq!(c, scores.classes);
        let mut sub = Vec::with_capacity(c * sh * sw);
        for k in 0..c {
            for y in (0..h).step_by(STRIDE) {
                for x in (0..w).step_by(STRIDE) {
                    sub.push(scores.values[k * plane + y * w + x]);
                }
            }
        }
        let got_scores = Tensor::from_vec(sub, (c, sh, sw), &candle_core::Device::Cpu).unwrap();
        worst = worst.max(common::assert_close(&format!("{case}/{name} scores"), &got_scores, want_scores, F32_REL));
    }
    let share = differ as f64 / total as f64;
    eprintln!("{case}: {differ} of {total} pixels differ (near-ties), max score error {worst:.2e}");
    assert!(share <= 1e-3, "{case}: {differ} of {total} pixels differ");
}

#[test]
fn class_synonyms_and_thresholds_match_the_official_segmentor() {
    check_case("openearthmap");
}

#[test]
fn sliding_window_matches_the_official_segmentor() {
    check_case("openearthmap_slide");
}

#[test]
fn plain_class_list_matches_the_official_segmentor() {
    check_case("plain");
}

#[test]
fn background_index_and_probability_threshold_match_the_official_segmentor() {
    check_case("threshold");
}

/// The view's resize is torchvision's on the uint8 image (the original `Sam3Processor`), which
/// Pillow's differs from by a level on some pixels.
#[test]
fn view_resize_equals_torchvisions_uint8_resize() {
    for (src, dst, (w, h)) in [("scene_3", "resize_up", (200, 150)), ("scene_1", "resize_down", (53, 37))] {
        let want = image(dst);
        let got = resize_with(&image(src), w, h, Filter::Bilinear, Rounding::Torch);
        assert_eq!(got.as_raw(), want.as_raw(), "{src} → {w}x{h}");
        let pillow = resize_with(&image(src), w, h, Filter::Bilinear, Rounding::Pillow);
        assert_ne!(pillow.as_raw(), want.as_raw(), "{src} → {w}x{h}: Pillow's rounding already equals torchvision's: the check shows nothing");
    }
}
