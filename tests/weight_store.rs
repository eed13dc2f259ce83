//! The weight store on real files written by the Python references and by Candle.
mod common;

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use common::*;
use edgerun::weights::{Format, MetaValue, StoredDType, WeightStore};

#[test]
fn python_gguf_values_and_metadata() {
    let dir = fixture("weights");
    let store = WeightStore::open(dir.join("python.gguf")).unwrap();
    assert_eq!(store.format(), Format::Gguf);
    assert_eq!(store.architecture().as_deref(), Some("test"));
    let m = store.metadata();
    assert_eq!(m["test.string"], MetaValue::String("héllo, gguf ✓".into()));
    assert_eq!(m["test.u32"], MetaValue::U32(4_000_000_000));
    assert_eq!(m["test.i32"], MetaValue::I32(-7));
    assert_eq!(m["test.bool"], MetaValue::Bool(true));
    assert_eq!(store.entries()["proj_q8_0"].dtype, StoredDType::Ggml(GgmlDType::Q8_0));
    assert_eq!(store.entries()["proj_q8_0"].shape, vec![4, 64]);
    let want = tensors(&dir, "python_gguf_dequant.safetensors");
    for (name, w) in &want {
        let got = store.tensor(name, DType::F32, &Device::Cpu).unwrap();
        assert_close(name, &got, w, 1e-7);
    }
    assert!(store.qtensor("proj_q8_0", &Device::Cpu).unwrap().is_some(), "Q8_0 stays quantized");
    assert!(store.qtensor("weight_f32", &Device::Cpu).unwrap().is_none());
}

#[test]
fn sharded_safetensors_from_save_pretrained() {
    let dir = fixture("weights/sharded");
    let store = WeightStore::open(&dir).unwrap();
    assert_eq!(store.files().len(), 3);
    for (name, w) in &tensors(&dir, "expected_tensors.safetensors") {
        assert_close(name, &store.tensor(name, DType::F32, &Device::Cpu).unwrap(), w, 0.0);
        // f16 materialisation rounds but keeps the values.
        let h = store.tensor(name, DType::F16, &Device::Cpu).unwrap();
        assert_eq!(h.dtype(), DType::F16);
        assert_close(name, &h, w, 1e-3);
    }
}

#[test]
fn candle_written_gguf_and_safetensors() {
    let tmp = tempfile::tempdir().unwrap();
    let dev = Device::Cpu;
    let w = Tensor::randn(0f32, 1.0, (8, 256), &dev).unwrap();
    let b = Tensor::randn(0f32, 1.0, 8, &dev).unwrap();
    let q4k = QTensor::quantize(&w, GgmlDType::Q4K).unwrap();
    let q8 = QTensor::quantize(&w, GgmlDType::Q8_0).unwrap();
    let bf = QTensor::quantize(&b, GgmlDType::F32).unwrap();
    let gguf = tmp.path().join("candle.gguf");
    let mut f = std::fs::File::create(&gguf).unwrap();
    let arch = gguf_file::Value::String("candle_test".into());
    gguf_file::write(&mut f, &[("general.architecture", &arch)], &[("w.q4k", &q4k), ("w.q8", &q8), ("b", &bf)]).unwrap();
    drop(f);
    let store = WeightStore::open(&gguf).unwrap();
    assert_eq!(store.architecture().as_deref(), Some("candle_test"));
    for (name, q) in [("w.q4k", &q4k), ("w.q8", &q8)] {
        let got = store.tensor(name, DType::F32, &dev).unwrap();
        assert_close(name, &got, &q.dequantize(&dev).unwrap(), 0.0);
    }
    assert_close("b", &store.tensor("b", DType::F32, &dev).unwrap(), &b, 0.0);

    let st = tmp.path().join("model.safetensors");
    candle_core::safetensors::save(&[("w", w.clone()), ("b", b.to_dtype(DType::F16).unwrap())].into_iter().collect(), &st).unwrap();
    let store = WeightStore::open(&st).unwrap();
    assert_close("w", &store.tensor("w", DType::F32, &dev).unwrap(), &w, 0.0);
    assert_eq!(store.entries()["b"].dtype, StoredDType::Plain(DType::F16));
}

#[test]
fn remap_loads_an_original_layout_with_fused_qkv() {
    let tmp = tempfile::tempdir().unwrap();
    let dev = Device::Cpu;
    let qkv = Tensor::arange(0f32, 24.0, &dev).unwrap().reshape((6, 4)).unwrap();
    let st = tmp.path().join("orig.safetensors");
    candle_core::safetensors::save(&[("blocks.0.attn.qkv.weight".to_string(), qkv.clone())].into_iter().collect(), &st).unwrap();
    let split = std::sync::Arc::new(|name: &str| {
        let rest = name.strip_prefix("layer.0.")?;
        let part = ["query.weight", "key.weight", "value.weight"].iter().position(|p| *p == rest)?;
        Some(edgerun::weights::Alias { name: "blocks.0.attn.qkv.weight".into(), chunk: Some((part, 3)) })
    });
    let store = WeightStore::open(&st).unwrap().with_remap(split);
    let k = store.tensor("layer.0.key.weight", DType::F32, &dev).unwrap();
    assert_close("key", &k, &qkv.narrow(0, 2, 2).unwrap(), 0.0);
    assert_eq!(store.info("layer.0.value.weight").unwrap().1, vec![2, 4]);
    assert!(!store.contains("layer.1.key.weight"));
}

#[test]
fn inspect_lists_tensors_and_totals() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_edgerun"))
        .args(["inspect", fixture("weights/python.gguf").to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success());
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(s.contains("format:       gguf"), "{s}");
    assert!(s.contains("architecture: test"), "{s}");
    assert!(s.contains("proj_q8_0") && s.contains("q8_0") && s.contains("[4, 64]"), "{s}");
    assert!(s.contains("total: 3 tensors"), "{s}");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_edgerun"))
        .args(["inspect", "--json", fixture("weights/sharded").to_str().unwrap()])
        .output()
        .unwrap();
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["architecture"], "depth_anything");
    assert_eq!(j["files"].as_array().unwrap().len(), 3);
}
