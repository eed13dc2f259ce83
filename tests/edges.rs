//! Sobel edges from depth.
mod common;
use common::dev;
use candle_core::Tensor;
use edgerun::edges::sobel_magnitude;

fn naive(v: &[f32], h: usize, w: usize) -> Vec<f32> {
    let at = |y: i64, x: i64| v[(y.clamp(0, h as i64 - 1) as usize) * w + x.clamp(0, w as i64 - 1) as usize];
    let mut out = vec![0f32; h * w];
    for y in 0..h as i64 {
        for x in 0..w as i64 {
            let gx = at(y - 1, x + 1) + 2.0 * at(y, x + 1) + at(y + 1, x + 1) - at(y - 1, x - 1) - 2.0 * at(y, x - 1) - at(y + 1, x - 1);
            let gy = at(y + 1, x - 1) + 2.0 * at(y + 1, x) + at(y + 1, x + 1) - at(y - 1, x - 1) - 2.0 * at(y - 1, x) - at(y - 1, x + 1);
            out[y as usize * w + x as usize] = (gx * gx + gy * gy).sqrt();
        }
    }
    out
}

#[test]
fn ramp_has_constant_interior_gradient() {
    let (h, w) = (6, 9);
    let v: Vec<f32> = (0..h * w).map(|i| 0.5 * (i % w) as f32 + 2.0 * (i / w) as f32).collect();
    let t = Tensor::from_vec(v, (1, 1, h, w), &dev()).unwrap();
    let e = sobel_magnitude(&t).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let expect = 8.0 * (0.5f32 * 0.5 + 2.0 * 2.0).sqrt();
    for y in 1..h - 1 {
        for x in 1..w - 1 {
            assert!((e[y * w + x] - expect).abs() < 1e-4, "({y},{x}): {} vs {expect}", e[y * w + x]);
        }
    }
}

#[test]
fn batched_matches_naive_with_replicated_borders() {
    let (b, h, w) = (3, 7, 11);
    let v: Vec<f32> = (0..b * h * w).map(|i| ((i * 7919) % 97) as f32 / 13.0).collect();
    let t = Tensor::from_vec(v.clone(), (b, 1, h, w), &dev()).unwrap();
    let e = sobel_magnitude(&t).unwrap();
    assert_eq!(e.dims(), &[b, 1, h, w]);
    let e = e.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for k in 0..b {
        let want = naive(&v[k * h * w..(k + 1) * h * w], h, w);
        for (i, (g, n)) in e[k * h * w..(k + 1) * h * w].iter().zip(&want).enumerate() {
            assert!((g - n).abs() < 1e-4, "batch {k} pixel {i}: {g} vs {n}");
        }
    }
}

#[test]
fn rejects_multichannel_input() {
    let t = Tensor::zeros((1, 2, 4, 4), candle_core::DType::F32, &dev()).unwrap();
    assert!(sobel_magnitude(&t).is_err());
}
