//! L-GATr packed events: `lengths` must be exact non-negative integers with a sum that fits, the
//! event count is bounded, and empty events cost time linear in their number.
mod common;
use common::fixture;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use edgerun::models::lgatr::{forward_events, pack_events, unpack_events};
use edgerun::models::NamedTensors;
use edgerun::weights::WeightStore;

/// `n` items (`[n, 1, 16]` multivectors, `[n, 2]` scalars) plus `lengths`.
fn packed(n: usize, lengths: Tensor) -> NamedTensors {
    let mut p = NamedTensors::new();
    let mv: Vec<f32> = (0..n * 16).map(|i| ((i * 7) % 13) as f32 * 0.1 - 0.6).collect();
    let s: Vec<f32> = (0..n * 2).map(|i| ((i * 5) % 11) as f32 * 0.1 - 0.5).collect();
    p.insert("multivectors".into(), Tensor::from_vec(mv, (n, 1, 16), &Device::Cpu).unwrap());
    p.insert("scalars".into(), Tensor::from_vec(s, (n, 2), &Device::Cpu).unwrap());
    p.insert("lengths".into(), lengths);
    p
}

#[test]
fn lengths_must_be_exact_counts_that_add_up() {
    let cpu = &Device::Cpu;
    let cases: Vec<(Tensor, &str)> = vec![
        (Tensor::new(&[2.0f32, 3.0], cpu).unwrap(), "integer"),
        (Tensor::new(&[f32::NAN, 5.0], cpu).unwrap(), "integer"),
        (Tensor::new(&[2.5f64, 2.5], cpu).unwrap(), "integer"),
        (Tensor::new(&[i64::MAX, i64::MAX, 7], cpu).unwrap(), "overflows"),
        (Tensor::new(&[6i64, -1], cpu).unwrap(), "negative"),
        (Tensor::new(&[[2i64, 3]], cpu).unwrap(), "1-D"),
        (Tensor::new(&[2i64, 2], cpu).unwrap(), "Σ lengths"),
    ];
    for (lengths, why) in cases {
        let e = unpack_events(&packed(5, lengths)).expect_err(why).to_string();
        assert!(e.contains(why), "{why}: {e}");
    }
    assert_eq!(unpack_events(&packed(5, Tensor::new(&[2u32, 0, 3], cpu).unwrap())).unwrap().len(), 3);
}

#[test]
fn event_count_is_bounded() {
    let lengths = Tensor::zeros(2_000_000, DType::I64, &Device::Cpu).unwrap();
    let e = unpack_events(&packed(0, lengths)).unwrap_err().to_string();
    assert!(e.contains("2000000") && e.contains("1048576"), "{e}");
}

#[test]
fn many_empty_events_take_linear_time() {
    let store = WeightStore::open(fixture("lgatr_tiny")).unwrap();
    let model = edgerun::models::load(Arc::new(store), &Device::Cpu, DType::F32).unwrap();
    let e = 200_000;
    let mut lens = vec![0i64; e];
    lens[17] = 3;
    lens[e - 1] = 2;
    let t = std::time::Instant::now();
    let events = unpack_events(&packed(5, Tensor::new(lens.as_slice(), &Device::Cpu).unwrap())).unwrap();
    let out = forward_events(model.as_ref(), &events, 64).unwrap();
    assert_eq!(out.len(), e);
    assert_eq!(out[0]["outputs_mv"].dims(), [0, 1, 16]);
    assert_eq!(out[17]["outputs_mv"].dims(), [3, 1, 16]);
    let back = pack_events(&out).unwrap();
    assert_eq!(back["outputs_s"].dims(), [5, 1]);
    assert_eq!(back["lengths"].to_vec1::<i64>().unwrap(), lens);
    // A forward pass per group of 64 empty events (the old behaviour) takes minutes here.
    assert!(t.elapsed().as_secs() < 60, "{:?}", t.elapsed());

    // Only empty events: one forward pass gives the output shapes.
    let events = unpack_events(&packed(0, Tensor::zeros(1000, DType::I64, &Device::Cpu).unwrap())).unwrap();
    let out = forward_events(model.as_ref(), &events, 8).unwrap();
    assert!(out.iter().all(|o| o["outputs_s"].dims() == [0, 1]));
}
