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

/// The tiny fixture's prompts with transformers' token ids for them (`prompts.json`).
fn tiny_prompts() -> (Vec<String>, Tensor, Tensor) {
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(fixture("sam3_tiny").join("prompts.json")).unwrap()).unwrap();
    let texts: Vec<String> = v["prompts"].as_array().unwrap().iter().map(|p| p.as_str().unwrap().to_string()).collect();
    let rows = |k: &str| -> Vec<f32> { v[k].as_array().unwrap().iter().flat_map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32)).collect() };
    let shape = (texts.len(), rows("input_ids").len() / texts.len());
    let ids = Tensor::from_vec(rows("input_ids"), shape, &dev()).unwrap();
    let mask = Tensor::from_vec(rows("attention_mask"), shape, &dev()).unwrap();
    (texts, ids, mask)
}

fn inputs_with(ids: &Tensor, mask: &Tensor) -> NamedTensors {
    let mut inputs = tensors(&fixture("sam3_tiny"), "input.safetensors");
    inputs.insert("input_ids".into(), ids.clone());
    inputs.insert("attention_mask".into(), mask.clone());
    inputs
}

#[test]
fn prompts_by_text_equal_prompts_by_transformers_ids() {
    let model = load(Sam3Path::Original);
    let (texts, ids, mask) = tiny_prompts();
    let by_text = model.prompt_features(&texts).unwrap();
    let by_ids = model.prompt_features_from_ids(&ids.to_dtype(DType::U32).unwrap(), &mask).unwrap();
    assert_eq!(common::errors(&by_text.features, &by_ids.features).0, 0.0);
    assert_eq!(common::errors(&by_text.mask, &by_ids.mask).0, 0.0);
}

/// `edgerun quantize --prompts`: the prompts' features computed once and stored, the text encoder left
/// out; the file grounds its stored prompts as the full model grounds their token ids, and refuses
/// others by name.
#[test]
fn stored_prompts_replace_the_text_encoder() {
    use edgerun::quantize::{quantize_with, Recipe};
    let (texts, ids, mask) = tiny_prompts();
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tmp.path().join("stored.gguf");
    let stored: Vec<String> = vec![texts[3].clone(), texts[0].clone()];
    let recipe = Recipe::builtin("sam3").unwrap().unwrap();
    quantize_with(&fixture("sam3_tiny"), &gguf, candle_core::quantized::GgmlDType::F32, &recipe, Some(&stored), |_| {}).unwrap();
    let store = edgerun::weights::WeightStore::open(&gguf).unwrap();
    assert!(!store.entries().keys().any(|k| k.starts_with("text_encoder.") || k.starts_with("text_projection.")), "the text encoder is left out");
    let ckpt = Checkpoint::open(&gguf).unwrap();
    let config = ckpt.config::<Config>().unwrap().clone();
    let model = Sam3::load(&Vb::new(ckpt.store().clone(), DType::F32, dev()), &config).unwrap();
    assert!(!model.has_text_encoder());
    assert_eq!(model.stored_prompts(), stored.as_slice());
    let mut image = tensors(&fixture("sam3_tiny"), "input.safetensors");
    image.retain(|k, _| k == "pixel_values");
    let got = model.forward_named(&image).unwrap();
    let pick = |t: &Tensor| Tensor::cat(&[t.narrow(0, 3, 1).unwrap(), t.narrow(0, 0, 1).unwrap()], 0).unwrap();
    let want = load(Sam3Path::Original).forward_named(&inputs_with(&pick(&ids), &pick(&mask))).unwrap();
    for k in ["pred_masks", "pred_boxes", "pred_logits", "presence_logits", "semantic_seg"] {
        assert_close(&format!("stored prompts: {k}"), &got[k], &want[k], F32_REL);
    }
    let err = model.prompt_features(&["road"]).expect_err("not stored").to_string();
    assert!(err.contains("road") && err.contains("water, tree") && err.contains("no text encoder"), "{err}");
}

/// A GGUF made without `--prompts` keeps the text encoder and carries the tokenizer in its metadata.
#[test]
fn a_gguf_carries_the_tokenizer() {
    use edgerun::quantize::{quantize, Recipe};
    let (texts, _, _) = tiny_prompts();
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tmp.path().join("m.gguf");
    quantize(&fixture("sam3_tiny"), &gguf, candle_core::quantized::GgmlDType::F16, &Recipe::builtin("sam3").unwrap().unwrap(), |_| {}).unwrap();
    let ckpt = Checkpoint::open(&gguf).unwrap();
    let model = Sam3::load(&Vb::new(ckpt.store().clone(), DType::F32, dev()), ckpt.config::<Config>().unwrap()).unwrap();
    let from_gguf = model.prompt_features(&texts).unwrap();
    let from_dir = load(Sam3Path::Original).prompt_features(&texts).unwrap();
    assert_close("f16 GGUF prompt features", &from_gguf.features, &from_dir.features, 2e-2);
}

/// The hub checkpoint's layout: a `sam3_video` config whose `detector_config` is the model's, the
/// detector's tensors under `detector_model.` and tracker tensors beside them (ignored).
#[test]
fn the_hub_layout_loads_as_the_model() {
    let tmp = tempfile::tempdir().unwrap();
    let src = fixture("sam3_tiny");
    let config: serde_json::Value = serde_json::from_slice(&std::fs::read(src.join("config.json")).unwrap()).unwrap();
    let video = serde_json::json!({"model_type": "sam3_video", "detector_config": config, "tracker_config": {}});
    std::fs::write(tmp.path().join("config.json"), serde_json::to_vec(&video).unwrap()).unwrap();
    let mut t = tensors(&src, "model.safetensors");
    let renamed: NamedTensors = std::mem::take(&mut t).into_iter().map(|(k, v)| (format!("detector_model.{k}"), v)).collect();
    let mut all = renamed;
    all.insert("tracker_model.some.weight".into(), Tensor::zeros((2, 2), DType::F32, &dev()).unwrap());
    edgerun::tensor_io::write_tensors(&tmp.path().join("model.safetensors"), &all).unwrap();
    std::fs::copy(src.join("tokenizer.json"), tmp.path().join("tokenizer.json")).unwrap();
    let model = common::load_model(tmp.path(), DType::F32);
    assert_eq!(model.architecture(), "sam3");
    let got = model.forward_named(&tensors(&src, "input.safetensors")).unwrap();
    let want = run(Sam3Path::Original);
    for k in ["pred_masks", "pred_logits", "semantic_seg"] {
        assert_eq!(common::errors(&got[k], &want[k]).0, 0.0, "{k}");
    }
    // The recipe leaves the tracker out of a GGUF copy.
    let gguf = tmp.path().join("m.gguf");
    edgerun::quantize::quantize(tmp.path(), &gguf, candle_core::quantized::GgmlDType::F16, &edgerun::quantize::Recipe::builtin("sam3_video").unwrap().unwrap(), |_| {}).unwrap();
    let store = edgerun::weights::WeightStore::open(&gguf).unwrap();
    assert!(store.contains("detector_model.detr_decoder.query_embed.weight") && !store.contains("tracker_model.some.weight"));
}

/// A checkpoint with a tensor missing or mis-shaped, and a text encoder fed ids past its vocabulary or
/// a mask without a first token: errors that name the file, the tensor or the input.
#[test]
fn bad_weights_and_inputs_are_named() {
    let src = fixture("sam3_tiny");
    let copy = |edit: &dyn Fn(&mut NamedTensors)| {
        let tmp = tempfile::tempdir().unwrap();
        for f in ["config.json", "tokenizer.json"] {
            std::fs::copy(src.join(f), tmp.path().join(f)).unwrap();
        }
        let mut t = tensors(&src, "model.safetensors");
        edit(&mut t);
        edgerun::tensor_io::write_tensors(&tmp.path().join("model.safetensors"), &t).unwrap();
        tmp
    };
    let load_err = |dir: &std::path::Path| -> String {
        match Checkpoint::open(dir).and_then(|c| c.load(&dev(), DType::F32)) {
            Ok(_) => panic!("loaded"),
            Err(e) => e.to_string(),
        }
    };
    let missing = copy(&|t| {
        t.remove("detr_decoder.box_head.layer3.weight");
    });
    let msg = load_err(missing.path());
    assert!(msg.contains("detr_decoder.box_head.layer3.weight"), "{msg}");
    let misshaped = copy(&|t| {
        t.insert("vision_encoder.backbone.layers.1.attention.q_proj.weight".into(), Tensor::zeros((32, 16), DType::F32, &dev()).unwrap());
    });
    let msg = load_err(misshaped.path());
    assert!(msg.contains("vision_encoder.backbone.layers.1.attention.q_proj.weight") && msg.contains(&*misshaped.path().to_string_lossy()) && msg.contains("[32, 16]"), "{msg}");
    let model = load(Sam3Path::Original);
    let ids = Tensor::from_vec(vec![1u32, 300, 2], (1, 3), &dev()).unwrap();
    let ones = Tensor::ones((1, 3), DType::F32, &dev()).unwrap();
    let msg = model.prompt_features_from_ids(&ids, &ones).expect_err("id 300").to_string();
    assert!(msg.contains("300") && msg.contains("vocabulary"), "{msg}");
    let ids = Tensor::from_vec(vec![1u32, 5, 2], (1, 3), &dev()).unwrap();
    let mask = Tensor::from_vec(vec![0f32, 1.0, 1.0], (1, 3), &dev()).unwrap();
    assert!(model.prompt_features_from_ids(&ids, &mask).is_err());
    let mut inputs = tensors(&src, "input.safetensors");
    inputs.insert("pixel_values".into(), Tensor::zeros((1, 3, 48, 64), DType::F32, &dev()).unwrap());
    let msg = model.forward_named(&inputs).expect_err("48x64").to_string();
    assert!(msg.contains("64") && msg.contains("pixel_values"), "{msg}");
}
