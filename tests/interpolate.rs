//! Interpolation ops against `torch.nn.functional.interpolate`.
mod common;

use common::*;
use edgerun::nn::interpolate::{bicubic, bicubic_map, bilinear, Resize};

#[test]
fn bicubic_by_size_and_by_scale_factor() {
    let dir = fixture("interpolate");
    let i = tensors(&dir, "input.safetensors");
    let e = tensors(&dir, "expected.safetensors");
    let x = &i["x"];
    assert_close("bicubic size 5x7", &bicubic(x, Resize::Size(5, 7)).unwrap(), &e["bicubic_size_5x7"], 1e-5);
    assert_close("bicubic size 3x2", &bicubic(x, Resize::Size(3, 2)).unwrap(), &e["bicubic_size_3x2"], 1e-5);
    let s = Resize::ScaleFactor(5.1 / 4.0, 7.1 / 4.0);
    assert_close("bicubic scale (n+0.1)/g", &bicubic(x, s).unwrap(), &e["bicubic_scale_5x7"], 1e-5);
}

#[test]
fn bicubic_map_matches_tensor_op() {
    let dir = fixture("interpolate");
    let i = tensors(&dir, "input.safetensors");
    let e = tensors(&dir, "expected.safetensors");
    let plane = i["x"].get(0).unwrap().get(0).unwrap();
    let v = plane.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let got = bicubic_map(&v, 4, 4, 5, 7).unwrap();
    let want = e["bicubic_size_5x7"].get(0).unwrap().get(0).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(want.len(), 5 * 7);
    assert_eq!(got.len(), want.len(), "a 5x7 map");
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() < 1e-5, "{g} vs {w}");
    }
}

#[test]
fn bilinear_both_corner_modes() {
    let dir = fixture("interpolate");
    let i = tensors(&dir, "input.safetensors");
    let e = tensors(&dir, "expected.safetensors");
    let y = &i["y"];
    for (name, h, w, ac) in [("bilinear_true_13x9", 13, 9, true), ("bilinear_false_13x9", 13, 9, false), ("bilinear_false_3x4", 3, 4, false), ("bilinear_true_3x4", 3, 4, true)] {
        assert_close(name, &bilinear(y, h, w, ac).unwrap(), &e[name], 1e-5);
    }
}
