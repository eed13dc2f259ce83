//! Parity of Depth Anything (V2 layout) against transformers 5.24 fixtures.
mod common;

use candle_core::DType;
use common::*;

fn parity(name: &str) {
    let dir = fixture(name);
    let model = load_model(&dir, DType::F32);
    let inputs = tensors(&dir, "input.safetensors");
    let expected = tensors(&dir, "expected.safetensors");
    let out = model.forward_named(&inputs).expect("forward");
    assert_close(name, &out["predicted_depth"], &expected["predicted_depth"], F32_REL);
}

#[test]
fn tiny_transformers_test_config() {
    parity("da2_tiny");
}

#[test]
fn relative_patch14_non_square_resized_pos_embed() {
    parity("da2_relative_p14");
}

#[test]
fn metric_patch14_non_square() {
    parity("da2_metric_p14");
}

#[test]
fn sharded_checkpoint_gives_the_same_model() {
    parity("weights/sharded");
}
