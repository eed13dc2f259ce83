//! SegFormer parity against transformers 5.24.0 fixtures (tests/fixtures/segformer_*, written by
//! tools/fixtures/segformer.py): logits and encoder stage outputs, batch 2, square / non-square /
//! non-divisible inputs, both depthwise-conv implementations; plus input validation and the fused
//! resize+argmax post-processing.
mod common;
use common::dev;
use std::path::PathBuf;
use std::sync::Arc;

use candle_core::{DType, Tensor};
use edgerun::models::segformer::{Config, DecodeHeadImpl, SegformerForSemanticSegmentation};
use edgerun::tasks::segment::resize_argmax;
use edgerun::models::NamedTensors;
use edgerun::kernels::depthwise::DepthwiseImpl;
use edgerun::tensor_io::read_tensors;
use edgerun::weights::{Vb, WeightStore};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

fn open(name: &str) -> (Arc<WeightStore>, NamedTensors, NamedTensors) {
    let dir = fixture(name);
    let store = Arc::new(WeightStore::open(&dir).unwrap());
    let input = read_tensors(&dir.join("input.safetensors"), DType::F32, &dev()).unwrap();
    let expected = read_tensors(&dir.join("expected.safetensors"), DType::F32, &dev()).unwrap();
    (store, input, expected)
}

fn vec4(t: &Tensor) -> (Vec<usize>, Vec<f32>) {
    (t.dims().to_vec(), t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap())
}

/// max abs err ≤ 1e-4 × max(1, max|ref|).
fn assert_close(what: &str, got: &Tensor, want: &Tensor) {
    let (gd, g) = vec4(got);
    let (wd, w) = vec4(want);
    assert_eq!(gd, wd, "{what}: shape");
    let scale = w.iter().fold(1f32, |m, v| m.max(v.abs()));
    let err = g.iter().zip(&w).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    eprintln!("{what}: max abs err {err:.2e} (tolerance {:.2e})", 1e-4 * scale);
    assert!(err <= 1e-4 * scale, "{what}: max abs err {err} > {}", 1e-4 * scale);
}

/// Identical argmax over the class axis, except where the reference's top-2 logits are within 1e-4.
fn assert_argmax(what: &str, got: &Tensor, want: &Tensor) {
    let (dims, g) = vec4(got);
    let (_, w) = vec4(want);
    let (b, c, h, wd) = (dims[0], dims[1], dims[2], dims[3]);
    let plane = h * wd;
    let mut mismatches = 0;
    for bi in 0..b {
        for p in 0..plane {
            let at = |v: &[f32], k: usize| v[(bi * c + k) * plane + p];
            let arg = |v: &[f32]| (0..c).fold(0, |best, k| if at(v, k) > at(v, best) { k } else { best });
            let (ag, aw) = (arg(&g), arg(&w));
            if ag != aw {
                let mut vals: Vec<f32> = (0..c).map(|k| at(&w, k)).collect();
                vals.sort_by(|a, b| b.partial_cmp(a).unwrap());
                assert!(vals[0] - vals[1] <= 1e-4, "{what}: argmax differs at batch {bi} pixel {p} ({ag} vs {aw})");
                mismatches += 1;
            }
        }
    }
    assert!(mismatches * 100 < b * plane, "{what}: {mismatches} near-tie argmax differences");
}

fn check_case(name: &str, suffixes: &[&str]) {
    let (store, input, expected) = open(name);
    // Through the registry, as the CLI does.
    let model = edgerun::models::load(store.clone(), &dev(), DType::F32).unwrap();
    assert_eq!(model.architecture(), "segformer");
    assert_eq!(model.input_names(), vec!["pixel_values"]);
    // Directly, for the stage outputs and the grouped-conv path.
    let vb = Vb::new(store.clone(), DType::F32, dev());
    let mut direct = SegformerForSemanticSegmentation::load(&vb, &Config::from_json(store.config()).unwrap()).unwrap();
    for sfx in suffixes {
        let x = &input[&format!("pixel_values{sfx}")];
        let want = &expected[&format!("logits{sfx}")];
        let mut named = NamedTensors::new();
        named.insert("pixel_values".into(), x.clone());
        let out = model.forward_named(&named).unwrap();
        assert_eq!(out.keys().collect::<Vec<_>>(), vec!["logits"]);
        let got = &out["logits"];
        assert_close(&format!("{name} logits{sfx}"), got, want);
        assert_argmax(&format!("{name} logits{sfx}"), got, want);

        // Both Mix-FFN depthwise paths x both decode-head evaluations.
        for imp in [DepthwiseImpl::Auto, DepthwiseImpl::Grouped] {
            for head in [DecodeHeadImpl::Folded, DecodeHeadImpl::Literal] {
                direct.set_depthwise_impl(imp);
                direct.set_decode_head_impl(head);
                let (logits, hidden) = direct.forward_with_hidden(x).unwrap();
                assert_close(&format!("{name} logits{sfx} ({imp:?}, {head:?})"), &logits, want);
                assert_argmax(&format!("{name} logits{sfx} ({imp:?}, {head:?})"), &logits, want);
                assert_eq!(hidden.len(), 4);
                for (i, h) in hidden.iter().enumerate() {
                    let key = format!("encoder_hidden_states{sfx}.{i}");
                    assert_close(&format!("{name} {key} ({imp:?})"), h, &expected[&key]);
                }
            }
        }
    }
}

#[test]
fn tiny_matches_transformers() {
    check_case("segformer_tiny", &[""]);
}

#[test]
fn uneven_non_square_and_odd_sizes_match_transformers() {
    check_case("segformer_uneven", &["", "_odd"]);
}

#[test]
fn batch_items_are_independent() {
    let (store, input, expected) = open("segformer_uneven");
    let vb = Vb::new(store.clone(), DType::F32, dev());
    let m = SegformerForSemanticSegmentation::load(&vb, &Config::from_json(store.config()).unwrap()).unwrap();
    let x1 = input["pixel_values"].narrow(0, 1, 1).unwrap();
    let got = m.forward(&x1).unwrap();
    assert_close("second batch item alone", &got, &expected["logits"].narrow(0, 1, 1).unwrap());
}

#[test]
fn config_and_labels() {
    let (store, _, _) = open("segformer_uneven");
    let vb = Vb::new(store.clone(), DType::F32, dev());
    let m = SegformerForSemanticSegmentation::load(&vb, &Config::from_json(store.config()).unwrap()).unwrap();
    let c = m.config();
    assert_eq!(c.num_labels(), 5);
    assert_eq!(c.labels(), vec!["background", "building", "road", "vegetation", "water"]);
    assert_eq!(c.depths, vec![1, 2, 3, 1]);
    assert_eq!(c.stage_sizes(70, 90).unwrap(), vec![(18, 23), (9, 12), (5, 6), (3, 3)]);
    // B0 defaults from an empty config.
    let b0 = edgerun::models::segformer::Config::from_json(&serde_json::json!({})).unwrap();
    assert_eq!(b0.hidden_sizes, vec![32, 64, 160, 256]);
    assert_eq!(b0.decoder_hidden_size, 256);
    assert_eq!(b0.num_labels(), 2);
    assert_eq!(b0.stage_sizes(512, 512).unwrap(), vec![(128, 128), (64, 64), (32, 32), (16, 16)]);
}

#[test]
fn bad_inputs_and_configs_are_errors() {
    let (store, input, _) = open("segformer_tiny");
    let vb = Vb::new(store.clone(), DType::F32, dev());
    let m = SegformerForSemanticSegmentation::load(&vb, &Config::from_json(store.config()).unwrap()).unwrap();
    let x = &input["pixel_values"];
    // Wrong channel count, wrong rank, too small for the sr=8 reduction of stage 0 (needs ≥ 29 px).
    assert!(m.forward(&x.narrow(1, 0, 2).unwrap()).is_err());
    assert!(m.forward(&x.flatten_from(2).unwrap()).is_err());
    assert!(matches!(m.forward(&x.narrow(2, 0, 16).unwrap()), Err(edgerun::Error::Input(_))));
    assert!(m.forward(&x.narrow(2, 0, 29).unwrap()).is_ok());
    assert!(matches!(
        edgerun::models::Model::forward_named(&m, &NamedTensors::new()),
        Err(edgerun::Error::Input(_))
    ));
    // Inconsistent config lists, unsupported activation, classification-only layout.
    let mut cfg = store.config().clone();
    cfg["depths"] = serde_json::json!([2, 2]);
    assert!(matches!(Config::from_json(&cfg).and_then(|c| SegformerForSemanticSegmentation::load(&vb, &c)), Err(edgerun::Error::Config(_))));
    let mut cfg = store.config().clone();
    cfg["hidden_act"] = serde_json::json!("mish");
    assert!(Config::from_json(&cfg).and_then(|c| SegformerForSemanticSegmentation::load(&vb, &c)).is_err());
    let mut cfg = store.config().clone();
    cfg["reshape_last_stage"] = serde_json::json!(false);
    assert!(Config::from_json(&cfg).and_then(|c| SegformerForSemanticSegmentation::load(&vb, &c)).is_err());
    // Config whose shapes do not match the weights.
    let mut cfg = store.config().clone();
    cfg["hidden_sizes"] = serde_json::json!([8, 16, 32, 64]);
    assert!(Config::from_json(&cfg).and_then(|c| SegformerForSemanticSegmentation::load(&vb, &c)).is_err());
}

#[test]
fn half_precision_runs_close() {
    // bf16 is not tested: Candle 0.11.1's CPU matmul has no bf16 kernel ("unsupported dtype BF16 for op matmul").
    let (store, input, expected) = open("segformer_tiny");
    {
        let dt = DType::F16;
        let vb = Vb::new(store.clone(), dt, dev());
        let m = SegformerForSemanticSegmentation::load(&vb, &Config::from_json(store.config()).unwrap()).unwrap();
        let got = m.forward(&input["pixel_values"]).unwrap();
        assert_eq!(got.dtype(), dt);
        let (gd, g) = vec4(&got);
        let (wd, w) = vec4(&expected["logits"]);
        assert_eq!(gd, wd, "{dt:?}: shape");
        let err = g.iter().zip(&w).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        eprintln!("{dt:?}: max abs err {err}");
        // Measured 0.0054 (logits of max |1.5|); the bound is 3.7× that.
        assert!(err < 0.02, "{dt:?}: max abs err {err}");
    }
}

#[test]
fn resize_argmax_matches_upsample_then_argmax() {
    // Random logits; compare with Candle's bilinear (PyTorch-equivalent) + argmax away from near-ties.
    let (c, h, w) = (7, 9, 13);
    let mut s = 12345u64;
    let v: Vec<f32> = (0..c * h * w)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
        })
        .collect();
    let logits = Tensor::from_vec(v, (c, h, w), &dev()).unwrap();
    for (oh, ow) in [(9, 13), (37, 50), (20, 7), (1, 1), (4, 5)] {
        let got = resize_argmax(&logits, oh, ow).unwrap();
        let up = logits.unsqueeze(0).unwrap().upsample_bilinear2d(oh, ow, false).unwrap().squeeze(0).unwrap();
        let upv = up.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(got.len(), oh * ow);
        for p in 0..oh * ow {
            let vals: Vec<f32> = (0..c).map(|k| upv[k * oh * ow + p]).collect();
            let want = (0..c).fold(0, |b, k| if vals[k] > vals[b] { k } else { b });
            if got[p] as usize != want {
                let mut sorted = vals.clone();
                sorted.sort_by(|a, b| b.partial_cmp(a).unwrap());
                assert!(sorted[0] - sorted[1] < 1e-5, "{oh}x{ow} pixel {p}: {} vs {want}", got[p]);
            }
        }
    }
    assert!(resize_argmax(&logits, 0, 4).is_err());
}
