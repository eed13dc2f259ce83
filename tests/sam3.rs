//! SAM 3 against its two references on the tiny random-weight fixture (`tools/fixtures/sam3_tiny.py`:
//! windowed and global ViT blocks, every stack two layers deep): transformers' `Sam3Model` path and
//! the original `sam3` package's grounding on the same weights, every output within the f32 bound.
mod common;

use candle_core::{DType, Tensor};
use common::{assert_close, dev, fixture, tensors, F32_REL};
use edgerun::models::sam3::{Config, Sam3, Sam3Path};
use edgerun::models::{Checkpoint, Model, NamedTensors};
use edgerun::weights::Vb;

fn load(path: Sam3Path) -> Sam3 {
    let dir = fixture("sam3_tiny");
    let ckpt = Checkpoint::open(&dir).unwrap();
    let config = ckpt.config::<Config>().unwrap().clone();
    let vb = Vb::new(ckpt.store().clone(), DType::F32, dev());
    Sam3::load_with(&vb, &config, path).unwrap()
}

fn run(path: Sam3Path) -> NamedTensors {
    load(path).forward_named(&tensors(&fixture("sam3_tiny"), "input.safetensors")).unwrap()
}

/// `t` with the padded text positions (mask 0) zeroed, as the two references' text encoders differ
/// there only (the original's has no key-padding mask; no output reads those positions).
fn valid_positions(t: &Tensor, mask: &Tensor) -> Tensor {
    t.broadcast_mul(&mask.unsqueeze(2).unwrap()).unwrap()
}

#[test]
fn transformers_path_matches_sam3model() {
    let got = run(Sam3Path::Transformers);
    let want = tensors(&fixture("sam3_tiny"), "expected.safetensors");
    for (name, w) in &want {
        assert_close(&format!("transformers path: {name}"), &got[name], w, F32_REL);
    }
}

#[test]
fn original_path_matches_the_sam3_package() {
    let got = run(Sam3Path::Original);
    let want = tensors(&fixture("sam3_tiny_original"), "expected.safetensors");
    let mask = tensors(&fixture("sam3_tiny"), "input.safetensors")["attention_mask"].clone();
    for (name, w) in &want {
        if name == "text_features" {
            assert_close("original path: text_features (tokens)", &valid_positions(&got[name], &mask), &valid_positions(w, &mask), F32_REL);
        } else {
            assert_close(&format!("original path: {name}"), &got[name], w, F32_REL);
        }
    }
}

/// The two paths differ where the references do (the geometry token, the ViT's LayerNorm eps):
/// a test of either path could not pass with the other's outputs.
#[test]
fn the_paths_differ_where_the_references_do() {
    let hf = tensors(&fixture("sam3_tiny"), "expected.safetensors");
    let orig = tensors(&fixture("sam3_tiny_original"), "expected.safetensors");
    let (err, _) = common::errors(&hf["pred_logits"], &orig["pred_logits"]);
    assert!(err > 1e-2, "the references agree on pred_logits ({err}): the fixture shows no difference");
}
