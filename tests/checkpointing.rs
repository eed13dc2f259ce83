//! Activation checkpointing (kept on the device or spilled to a file) gives the gradients of a plain
//! backward (≤ 1e-6 relative, f32) for `last:2` and `all` on the tiny metric Depth Anything fixture.
use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use edgerun::models::depth_anything::DepthAnything;
use edgerun::train::checkpointing::{checkpointed_step, KeptInputs, SpillFile};
use edgerun::train::grads::Grads;
use edgerun::train::losses;
use edgerun::weights::{Trainable, Vb, WeightStore};

fn model(train: fn(&str) -> bool) -> (DepthAnything, Vec<(String, candle_core::Var)>) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/da2_metric_p14");
    let store = Arc::new(WeightStore::open(dir).unwrap());
    let trainable = Trainable::new(train);
    let vb = Vb::new(store.clone(), DType::F32, Device::Cpu).with_trainable(trainable.clone());
    let m = DepthAnything::load(&vb, store.config()).unwrap();
    (m, trainable.vars())
}

fn check(train: fn(&str) -> bool, first_trained: usize) {
    let (m, params) = model(train);
    let x = Tensor::randn(0f32, 1.0, (2, 3, 56, 70), &Device::Cpu).unwrap();
    let target = Tensor::randn(0f32, 1.0, (2, 56, 70), &Device::Cpu).unwrap().abs().unwrap();
    let mut plain = Grads::new(&params);
    let loss = losses::l1(&m.forward(&x).unwrap(), &target).unwrap();
    let want_loss = loss.to_scalar::<f32>().unwrap() as f64;
    plain.accumulate(&loss.backward().unwrap()).unwrap();
    let spill_path = std::env::temp_dir().join(format!("edgerun-ckpt-{}-{first_trained}.spill", std::process::id()));
    let stores = [KeptInputs::Device(HashMap::new()), KeptInputs::Spill(SpillFile::create(&spill_path).unwrap())];
    for mut kept in stores {
        let mut grads = Grads::new(&params);
        let l = checkpointed_step(&m, &x, first_trained, &mut kept, &mut grads, &|p| losses::l1(p, &target)).unwrap();
        assert!((l - want_loss).abs() <= 1e-6 * want_loss, "loss {l} vs {want_loss}");
        // Relative to the largest gradient: the key biases' gradients are zero up to rounding
        // (they cancel in the softmax), so their own scale is noise.
        let largest = (0..params.len()).map(|i| plain.get(i).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap()).fold(0f32, f32::max);
        for (i, (name, _)) in params.iter().enumerate() {
            let (a, b) = (grads.get(i).unwrap(), plain.get(i).unwrap());
            let scale = b.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap().max(1e-2 * largest);
            let err = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(err <= 1e-6 * scale, "{name}: max difference {err:e} of {scale:e}");
        }
    }
    let _ = std::fs::remove_file(spill_path);
}

#[test]
fn checkpointed_gradients_equal_plain_backward_for_the_last_blocks() {
    check(|n| !n.starts_with("backbone.") || n.starts_with("backbone.encoder.layer.2.") || n.starts_with("backbone.encoder.layer.3.") || n.starts_with("backbone.layernorm."), 2);
}

#[test]
fn checkpointed_gradients_equal_plain_backward_for_everything() {
    check(|n| n != "backbone.embeddings.mask_token", 0);
}
