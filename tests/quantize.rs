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

/// A GGUF whose first tensor (`a.weight`, f32) reads fine and whose second (`z`, Q8_1: a valid GGML
/// type that cannot be loaded for compute) fails when `quantize` reaches it, after `a.weight` is written.
fn gguf_failing_at_second_tensor() -> Vec<u8> {
    use edgerun::quantize::gguf_writer::{plan, GgufWriter};
    let a: Vec<u8> = (0..64).flat_map(|i| (i as f32 * 0.1).to_le_bytes()).collect();
    let planned = plan(vec![("a.weight".into(), vec![2, 32], GgmlDType::F32), ("z".into(), vec![32], GgmlDType::Q8_1)]).unwrap();
    let mut w = GgufWriter::new(std::io::Cursor::new(Vec::new()), &[], planned).unwrap();
    w.write_tensor(&a).unwrap();
    w.write_tensor(&[0u8; 36]).unwrap();
    w.finish().unwrap().into_inner()
}

#[test]
fn no_partial_file_on_failure() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("bad.gguf");
    std::fs::write(&input, gguf_failing_at_second_tensor()).unwrap();
    let out_dir = tmp.path().join("out");
    std::fs::create_dir(&out_dir).unwrap();
    let out = out_dir.join("m.gguf");
    std::fs::write(&out, b"an earlier output").unwrap();
    let listing = || std::fs::read_dir(&out_dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect::<Vec<_>>();
    // While the first tensor is reported, its bytes are in a temp file beside the output.
    let mut during = Vec::new();
    let err = quantize(&input, &out, GgmlDType::Q8_0, &Recipe::default(), |r| during.push((r.name.clone(), listing())))
        .expect_err("the Q8_1 tensor cannot be read");
    assert!(err.to_string().contains("`z`") && err.to_string().contains("cannot be loaded"), "{err}");
    assert_eq!(during.len(), 1, "failed at the second tensor: {during:?}");
    assert_eq!(during[0].0, "a.weight");
    assert!(during[0].1.iter().any(|n| n.starts_with(".m.gguf.tmp-")), "no temp file mid-write: {during:?}");
    // Afterwards: the earlier output untouched, no temp file.
    assert_eq!(listing(), vec!["m.gguf"]);
    assert_eq!(std::fs::read(&out).unwrap(), b"an earlier output");
    // A missing input fails before anything is created.
    let err = quantize(&tmp.path().join("missing"), &out_dir.join("n.gguf"), GgmlDType::Q8_0, &Recipe::default(), |_| {});
    assert!(err.is_err());
    assert_eq!(listing(), vec!["m.gguf"]);
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

/// `fixture` quantized to `qtype` by the built-in SegFormer recipe, run against its expected
/// logits within `rel`; `check` sees the written store first.
fn segformer_gguf_within(fixture_name: &str, qtype: GgmlDType, rel: f32, check: impl Fn(&WeightStore)) {
    let dir = fixture(fixture_name);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("seg.gguf");
    let recipe = Recipe::builtin("segformer").unwrap().expect("segformer recipe ships");
    quantize(&dir, &out, qtype, &recipe, |_| {}).unwrap();
    check(&WeightStore::open(&out).unwrap());
    let model = load_model(&out, DType::F32);
    let got = model.forward_named(&tensors(&dir, "input.safetensors")).unwrap();
    let expected = tensors(&dir, "expected.safetensors");
    assert_close(&format!("{fixture_name} {qtype:?} GGUF"), &got["logits"], &expected["logits"], rel);
}

#[test]
fn segformer_gguf_with_scalar_tensors_runs() {
    // SegFormer checkpoints carry a rank-0 `num_batches_tracked`; GGUF stores it as [1].
    segformer_gguf_within("segformer_uneven", GgmlDType::F16, 1e-2, |_| {});
}

#[test]
fn segformer_q8_0_gguf_within_bound() {
    // segformer_tiny's third stage is 32 wide: its linears, its sequence-reduction conv (2·2·32
    // values a patch) and its Mix-FFN's second linear run the int8 GEMM where the CPU has one;
    // the narrower stages keep f32.
    segformer_gguf_within("segformer_tiny", GgmlDType::Q8_0, 3e-2, |store| {
        let query = &store.entries()["segformer.encoder.block.2.0.attention.self.query.weight"];
        assert_eq!(query.dtype, StoredDType::Ggml(GgmlDType::Q8_0));
    });
}
