//! An image's result does not depend on the batch it is computed in: every model family gives
//! bit-identical outputs for an image alone and inside a batch of three (with a different image
//! beside it). The out-of-memory back-off and `--batch auto` change batch sizes at run time, and
//! `annotate` promises the same bytes whether a run was interrupted, resumed or sharded. On the CPU
//! only: on a GPU, cuBLAS and cuDNN choose kernels by shape, and the promise is the f32 bound.
mod common;

use candle_core::{DType, Tensor};
use edgerun::models::NamedTensors;

fn outputs(m: &dyn edgerun::models::Model, x: &Tensor) -> Vec<(String, Tensor)> {
    let mut inputs = NamedTensors::new();
    inputs.insert("pixel_values".into(), x.clone());
    let mut v: Vec<(String, Tensor)> = m.forward_named(&inputs).unwrap().into_iter().collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

#[test]
fn every_family_gives_the_same_bits_alone_and_in_a_batch() {
    let dev = common::dev();
    // Small grids included: the GEMM kernels change blocking with the row count.
    let cases: [(&str, &[(usize, usize)]); 7] = [
        ("da2_relative_p14", &[(28, 42), (14, 14), (56, 70)]),
        ("chmv2_tiny", &[(64, 64), (32, 48), (16, 16)]),
        ("chmv2_reg4", &[(64, 64), (32, 48)]),
        ("chmv2_gated", &[(64, 64)]),
        ("segformer_tiny", &[(32, 32), (64, 48)]),
        ("da3_mono", &[(28, 42), (56, 56)]),
        ("da3_anyview", &[(28, 42), (56, 56)]),
    ];
    for (fixture, sizes) in cases {
        let m = common::load_model(&common::fixture(fixture), DType::F32);
        for &(h, w) in sizes {
            let x = Tensor::randn(0f32, 1., (1, 3, h, w), &dev).unwrap();
            let other = Tensor::randn(0f32, 1., (1, 3, h, w), &dev).unwrap();
            let batch = Tensor::cat(&[&other, &x, &other], 0).unwrap();
            for ((name, alone), (_, batched)) in outputs(m.as_ref(), &x).iter().zip(outputs(m.as_ref(), &batch)) {
                let a = alone.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let b = batched.get(1).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
                assert_eq!(a.len(), b.len(), "{fixture} {h}×{w} {name}");
                if dev.is_cpu() {
                    let differ = a.iter().zip(&b).filter(|(p, q)| p.to_bits() != q.to_bits()).count();
                    assert_eq!(differ, 0, "{fixture} {h}×{w} `{name}`: {differ} of {} values differ between batch 1 and batch 3", a.len());
                } else {
                    // cuBLAS / cuDNN pick their kernels by shape: the same values within the f32 bound.
                    let scale = a.iter().fold(1f32, |m, v| m.max(v.abs()));
                    let err = a.iter().zip(&b).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
                    assert!(err <= 1e-4 * scale, "{fixture} {h}×{w} `{name}`: batch 1 and batch 3 differ by {err} (max |value| {scale})");
                }
            }
        }
    }
}
