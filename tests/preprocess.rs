//! Preprocessing parity with the transformers DPT image processor (PIL and torchvision backends).
mod common;

use common::*;
use edgerun::imageio::{load_rgb, resample::Filter, ImageLimits};
use edgerun::models::processor::{dpt_output_size, to_pixel_values, IMAGENET_MEAN, IMAGENET_STD};

/// One 8-bit level after normalisation is 1/255/std ≤ 0.0175.
const ONE_LEVEL: f32 = 1.0 / 255.0 / 0.224 + 1e-4;

fn case(image: &str, target: usize, key: &str) {
    let dir = fixture("da2_preprocess");
    let expected = tensors(&dir, "expected.safetensors");
    let img = load_rgb(&dir.join(image), &ImageLimits::default()).unwrap();
    let (h, w) = dpt_output_size(img.height() as usize, img.width() as usize, target, target, 14, true);
    let got = to_pixel_values(&img, h, w, Filter::Bicubic, IMAGENET_MEAN, IMAGENET_STD, &dev()).unwrap();
    // Pillow's fixed-point resampler, reproduced exactly: only float rounding of the normalisation remains.
    assert_close(&format!("{key} vs PIL"), &got, &expected[&format!("pixel_values_{key}_pil")], 1e-5);
    // torchvision's uint8 antialias kernel rounds differently: at most one level apart.
    let (err, _) = errors(&got, &expected[&format!("pixel_values_{key}")]);
    eprintln!("{key} vs torchvision: max abs error {err:e}");
    assert!(err <= ONE_LEVEL, "{key}: {err} exceeds one 8-bit level");
}

#[test]
fn upscale_matches_processor() {
    case("image_up.png", 56, "up");
}

#[test]
fn downscale_matches_processor() {
    case("image_down.png", 70, "down");
}

#[test]
fn output_size_rule() {
    // 640×480 → 518×686 as in the transformers tests.
    assert_eq!(dpt_output_size(480, 640, 518, 518, 14, true), (518, 686));
    assert_eq!(dpt_output_size(75, 100, 56, 56, 14, true), (56, 70));
    assert_eq!(dpt_output_size(150, 120, 70, 70, 14, true), (84, 70));
}
