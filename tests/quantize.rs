//! `edgerun quantize`: GGUF copies of a fixture model run within measured error bounds.
mod common;

use candle_core::quantized::GgmlDType;
use candle_core::DType;
use common::*;
use edgerun::quantize::{quantize, Recipe};
use edgerun::weights::{StoredDType, WeightStore};

fn quantized_parity(qtype: GgmlDType, rel_bound: f32) -> f32 {
    let dir = fixture("da2_relative_p14");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("model.gguf");
    let mut reports = Vec::new();
    let summary = quantize(&dir, &out, qtype, &Recipe::default(), |r| reports.push(r.clone())).unwrap();
    let store = WeightStore::open(&out).unwrap();
    assert_eq!(store.architecture().as_deref(), Some("depth_anything"), "config travels in the GGUF metadata");
    assert_eq!(store.entries().len(), summary.tensors);
    assert_eq!(summary.bytes_out, std::fs::metadata(&out).unwrap().len());
    // Matrices are quantized, norms and biases stay f32.
    let q = &store.entries()["backbone.encoder.layer.0.attention.attention.query.weight"];
    assert_eq!(q.dtype, StoredDType::Ggml(qtype));
    assert_eq!(store.entries()["backbone.encoder.layer.0.norm1.weight"].dtype, StoredDType::Ggml(GgmlDType::F32));
    let model = load_model(&out, DType::F32);
    let inputs = tensors(&dir, "input.safetensors");
    let expected = tensors(&dir, "expected.safetensors");
    let got = model.forward_named(&inputs).unwrap();
    assert_close(&format!("{qtype:?} GGUF"), &got["predicted_depth"], &expected["predicted_depth"], rel_bound)
}

#[test]
fn f16_gguf_within_bound() {
    quantized_parity(GgmlDType::F16, 2e-3);
}

#[test]
fn q8_0_gguf_within_bound() {
    quantized_parity(GgmlDType::Q8_0, 2e-2);
}

#[test]
fn k_quant_falls_back_when_inner_dim_does_not_fit() {
    // Hidden size 32 is not a multiple of 256: Q4K must fall back to Q8_0 (the default recipe).
    let dir = fixture("da2_relative_p14");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m.gguf");
    quantize(&dir, &out, GgmlDType::Q4K, &Recipe::default(), |_| {}).unwrap();
    let store = WeightStore::open(&out).unwrap();
    let q = &store.entries()["backbone.encoder.layer.0.mlp.fc1.weight"];
    assert_eq!(q.dtype, StoredDType::Ggml(GgmlDType::Q8_0));
}

#[test]
fn no_partial_file_on_failure() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m.gguf");
    let err = quantize(&tmp.path().join("missing"), &out, GgmlDType::Q8_0, &Recipe::default(), |_| {});
    assert!(err.is_err());
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0, "nothing left behind");
}

#[test]
fn builtin_depth_anything_recipe_keeps_convs_float() {
    let r = Recipe::builtin("depth_anything").unwrap().expect("recipe ships");
    let w = "backbone.encoder.layer.3.mlp.fc1.weight";
    assert_eq!(r.choose(w, &[1536, 384], GgmlDType::Q8_0), GgmlDType::Q8_0);
    assert_eq!(r.choose(w, &[1536, 384], GgmlDType::Q4K), GgmlDType::Q8_0, "384 does not fit 256-blocks");
    assert_eq!(r.choose("backbone.encoder.layer.3.mlp.fc1.weight", &[4096, 1024], GgmlDType::Q4K), GgmlDType::Q4K);
    assert_eq!(r.choose("neck.convs.0.weight", &[64, 48, 3, 3], GgmlDType::Q4K), GgmlDType::F16);
    assert_eq!(r.choose("backbone.embeddings.position_embeddings", &[1, 1370, 384], GgmlDType::Q8_0), GgmlDType::F32);
    assert_eq!(r.choose("backbone.encoder.layer.0.norm1.weight", &[384], GgmlDType::Q8_0), GgmlDType::F32);
}

#[test]
fn recipe_file_errors_name_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("bad.toml");
    std::fs::write(&p, "arch = \"x\"\nfloat = \"q4k\"\n").unwrap();
    let e = Recipe::from_file(&p).unwrap_err().to_string();
    assert!(e.contains("bad.toml") && e.contains("float"), "{e}");
}

#[test]
fn segformer_gguf_with_scalar_tensors_runs() {
    // SegFormer checkpoints carry a rank-0 `num_batches_tracked`; GGUF stores it as [1].
    let dir = fixture("segformer_uneven");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("seg.gguf");
    let recipe = Recipe::builtin("segformer").unwrap().expect("segformer recipe ships");
    quantize(&dir, &out, GgmlDType::F16, &recipe, |_| {}).unwrap();
    let model = load_model(&out, DType::F32);
    let inputs = tensors(&dir, "input.safetensors");
    let expected = tensors(&dir, "expected.safetensors");
    let got = model.forward_named(&inputs).unwrap();
    assert_close("segformer f16 GGUF", &got["logits"], &expected["logits"], 1e-2);
}
