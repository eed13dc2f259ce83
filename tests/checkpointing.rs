//! Activation checkpointing (kept on the device or spilled to a file) gives the gradients of a plain
//! backward (≤ 1e-6 relative, f32) for `last:N` and `all` on the tiny metric Depth Anything
//! (DINOv2) and CHMv2 (DINOv3, RoPE) fixtures.
use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use edgerun::models::training::Trainee;
use edgerun::models::Checkpoint;
use edgerun::train::recompute::{KeptInputs, SpillFile};
use edgerun::train::grads::Grads;
use edgerun::train::losses;
use edgerun::train::select::{select, TrainSpec};
use edgerun::weights::{Trainable, Vb};

fn model(fixture: &str, spec: TrainSpec) -> (Box<dyn Trainee>, Vec<(String, candle_core::Var)>) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(fixture);
    let ckpt = Checkpoint::open(&dir).unwrap();
    let names: Vec<String> = ckpt.store().entries().keys().cloned().collect();
    let chosen = select(&ckpt.family().training().unwrap(), spec, &names).unwrap();
    let trainable = Trainable::new(move |n| chosen.contains(n));
    let vb = Vb::new(ckpt.store().clone(), DType::F32, Device::Cpu).with_trainable(trainable.clone());
    let m = ckpt.trainee(&vb).unwrap();
    (m, trainable.vars())
}

fn check(fixture: &str, spec: TrainSpec, (h, w): (usize, usize)) {
    let (m, params) = model(fixture, spec);
    let walk = m.block_walk().unwrap();
    let first_trained = match spec {
        TrainSpec::Last(n) => walk.block_count() - n,
        _ => 0,
    };
    let x = Tensor::randn(0f32, 1.0, (2, 3, h, w), &Device::Cpu).unwrap();
    let pred = m.forward(&x).unwrap();
    let target = Tensor::randn(0f32, 1.0, pred.dims(), &Device::Cpu).unwrap().abs().unwrap();
    let mut plain = Grads::new(&params);
    let loss = losses::l1(&pred, &target).unwrap();
    let want_loss = loss.to_scalar::<f32>().unwrap() as f64;
    plain.accumulate(&loss.backward().unwrap()).unwrap();
    let spill_path = std::env::temp_dir().join(format!("edgerun-ckpt-{}-{fixture}-{first_trained}.spill", std::process::id()));
    let stores = [KeptInputs::Device(HashMap::new()), KeptInputs::Spill(SpillFile::create(spill_path.parent().unwrap(), &spill_path).unwrap())];
    for mut kept in stores {
        let mut grads = Grads::new(&params);
        let l = edgerun::train::recompute::checkpointed_step(walk, &x, first_trained, &mut kept, &mut grads, &|p| losses::l1(p, &target)).unwrap();
        assert!((l - want_loss).abs() <= 1e-6 * want_loss, "{fixture}: loss {l} vs {want_loss}");
        // Relative to the largest gradient: the key biases' gradients are zero up to rounding
        // (they cancel in the softmax), so their own scale is noise.
        let largest = (0..params.len()).map(|i| plain.get(i).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap()).fold(0f32, f32::max);
        for (i, (name, _)) in params.iter().enumerate() {
            let (a, b) = (grads.get(i).unwrap(), plain.get(i).unwrap());
            let scale = b.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap().max(1e-2 * largest);
            let err = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(err <= 1e-6 * scale, "{fixture} {name}: max difference {err:e} of {scale:e}");
        }
    }
    let _ = std::fs::remove_file(spill_path);
}

#[test]
fn checkpointed_gradients_equal_plain_backward_for_the_last_blocks() {
    check("da2_metric_p14", TrainSpec::Last(2), (56, 70));
}

#[test]
fn checkpointed_gradients_equal_plain_backward_for_everything() {
    check("da2_metric_p14", TrainSpec::All, (56, 70));
}

#[test]
fn checkpointed_chmv2_gradients_equal_plain_backward() {
    check("chmv2_tiny", TrainSpec::Last(1), (48, 64));
    check("chmv2_tiny", TrainSpec::All, (48, 64));
}
