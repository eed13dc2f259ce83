//! Weights are held once: after a tensor is copied out of the weight store's file mapping, the
//! mapped pages no longer count in the process's resident memory (read from /proc/self/smaps).
#![cfg(target_os = "linux")]

use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use candle_core::Module;
use edgerun::nn::Linear;
use edgerun::weights::{Alias, Vb, WeightStore};

/// Resident bytes of this process's mappings of `path`, and the kernel page size.
fn mapped_rss(path: &Path) -> (usize, usize) {
    let path = path.canonicalize().unwrap();
    let want = path.to_str().unwrap();
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let (mut inside, mut seen, mut rss_kb, mut page_kb) = (false, false, 0, 4);
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if first.contains('-') && first.chars().all(|c| c.is_ascii_hexdigit() || c == '-') {
            inside = line.ends_with(want);
            seen |= inside;
        } else if inside {
            let mut f = line.split_whitespace();
            match (f.next(), f.next().and_then(|v| v.parse::<usize>().ok())) {
                (Some("Rss:"), Some(kb)) => rss_kb += kb,
                (Some("KernelPageSize:"), Some(kb)) => page_kb = kb,
                _ => {}
            }
        }
    }
    assert!(seen, "{want} is not mapped");
    (rss_kb * 1024, page_kb * 1024)
}

/// Asserts that (almost) none of `path`'s pages are resident in this process. Reading a tensor out
/// of the mapping would leave its pages, and through the kernel's fault-around often its neighbours'
/// pages, resident; the store reads with `pread` and so maps none.
fn assert_released(path: &Path, what: &str) {
    let (rss, page) = mapped_rss(path);
    let file = std::fs::metadata(path).unwrap().len() as usize;
    assert!(rss <= page, "{what}: {rss} bytes of the {file}-byte file stay resident after loading (at most one page expected)");
}

/// Four 1 MiB f32 matrices whose data starts off page boundaries, a bias and an odd-sized vector.
fn matrices(dev: &Device) -> Vec<(String, Tensor)> {
    let mut v: Vec<(String, Tensor)> = (0..4)
        .map(|i| (format!("layer.{i}.weight"), Tensor::randn(0f32, 1.0, (512, 512), dev).unwrap()))
        .collect();
    v.push(("layer.0.bias".into(), Tensor::randn(0f32, 1.0, 512, dev).unwrap()));
    v.push(("odd".into(), Tensor::randn(0f32, 1.0, 7, dev).unwrap()));
    v
}

#[test]
fn safetensors_pages_are_released_after_loading() {
    let tmp = tempfile::tempdir().unwrap();
    let dev = Device::Cpu;
    let want = matrices(&dev);
    let path = tmp.path().join("model.safetensors");
    candle_core::safetensors::save(&want.iter().cloned().collect(), &path).unwrap();
    let store = WeightStore::open(&path).unwrap();
    assert_released(&path, "after open");
    let mut held = Vec::new();
    for (name, w) in &want {
        let got = store.tensor(name, DType::F32, &dev).unwrap();
        assert_eq!((&got - w).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap(), 0.0, "{name}");
        held.push(got);
    }
    assert_released(&path, "f32 as f32");
    // Converting loads read the same pages and release them too.
    for (name, _) in &want {
        held.push(store.tensor(name, DType::F16, &dev).unwrap());
    }
    assert_released(&path, "f32 as f16");
}

#[test]
fn a_chunk_reads_only_its_rows_and_owns_them() {
    let tmp = tempfile::tempdir().unwrap();
    let dev = Device::Cpu;
    let qkv = Tensor::randn(0f32, 1.0, (3 * 512, 512), &dev).unwrap();
    let path = tmp.path().join("fused.safetensors");
    candle_core::safetensors::save(&[("qkv".to_string(), qkv.clone())].into_iter().collect(), &path).unwrap();
    let split = Arc::new(|name: &str| {
        let part = ["q", "k", "v"].iter().position(|p| *p == name)?;
        Some(Alias { name: "qkv".into(), chunk: Some((part, 3)) })
    });
    let store = WeightStore::open(&path).unwrap().with_remap(split);
    let k = store.tensor("k", DType::F32, &dev).unwrap();
    assert_eq!(k.dims(), [512, 512]);
    let diff = (&k - qkv.narrow(0, 512, 512).unwrap()).unwrap().abs().unwrap().max_all().unwrap();
    assert_eq!(diff.to_scalar::<f32>().unwrap(), 0.0);
    assert_released(&path, "a chunk");
    // k owns its rows: a narrowed view of the whole fused tensor would hold 3× its size.
    let (storage, layout) = k.storage_and_layout();
    assert_eq!((layout.start_offset(), layout.shape().elem_count()), (0, 512 * 512));
    drop(storage);
}

#[test]
fn a_file_truncated_after_opening_is_an_error_not_a_crash() {
    let tmp = tempfile::tempdir().unwrap();
    let dev = Device::Cpu;
    let path = tmp.path().join("model.safetensors");
    candle_core::safetensors::save(&matrices(&dev).into_iter().collect(), &path).unwrap();
    let store = WeightStore::open(&path).unwrap();
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(len / 2).unwrap();
    let last = store.entries().values().max_by_key(|e| e.start).unwrap().name.clone();
    let err = store.tensor(&last, DType::F32, &dev).unwrap_err().to_string();
    assert!(err.contains(&last) && err.contains("cannot read"), "{err}");
}

#[test]
fn gguf_quantized_and_plain_pages_are_released_after_loading() {
    let tmp = tempfile::tempdir().unwrap();
    let dev = Device::Cpu;
    let want = matrices(&dev);
    let q: Vec<(String, QTensor)> = want
        .iter()
        .enumerate()
        .map(|(i, (n, t))| {
            let ty = match (t.rank(), i % 2) {
                (1, _) => GgmlDType::F32,
                (_, 0) => GgmlDType::Q8_0,
                _ => GgmlDType::Q4K,
            };
            (n.clone(), QTensor::quantize(t, ty).unwrap())
        })
        .collect();
    let path = tmp.path().join("model.gguf");
    let mut f = std::fs::File::create(&path).unwrap();
    let refs: Vec<(&str, &QTensor)> = q.iter().map(|(n, t)| (n.as_str(), t)).collect();
    gguf_file::write(&mut f, &[], &refs).unwrap();
    drop(f);
    let store = Arc::new(WeightStore::open(&path).unwrap());
    assert_released(&path, "after open");
    // Quantized weights stay in the mapping: loading them reads nothing.
    let held: Vec<QTensor> = q.iter().filter_map(|(n, _)| store.qtensor(n, &dev).unwrap()).collect();
    assert_eq!(held.len(), 4);
    assert_released(&path, "quantized kept quantized");
    for ((name, t), got) in q.iter().zip(&held) {
        assert_eq!(got.dtype(), t.dtype(), "{name}");
        let diff = (got.dequantize(&dev).unwrap() - t.dequantize(&dev).unwrap()).unwrap();
        assert_eq!(diff.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap(), 0.0, "{name}");
    }
    // Using them maps their pages; releasing takes them out again and they still read the same.
    assert!(mapped_rss(&path).0 > 0, "dequantizing reads the mapped blocks");
    store.release_pages();
    assert_released(&path, "quantized after release_pages");
    let again = held[0].dequantize(&dev).unwrap();
    assert_eq!((again - q[0].1.dequantize(&dev).unwrap()).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap(), 0.0);
    store.release_pages();
    // Dense loads of quantized tensors read into memory they own.
    let dense: Vec<Tensor> = q.iter().map(|(n, _)| store.tensor(n, DType::F32, &dev).unwrap()).collect();
    assert_eq!(dense.len(), q.len());
    assert_released(&path, "quantized dequantized");
    // A quantized linear layer is warmed up (Candle repacks it) and leaves no mapped page behind,
    // and computes x·dequant(W)ᵀ + b.
    let vb = Vb::new(store.clone(), DType::F32, dev.clone());
    for i in 0..4 {
        let lin = Linear::load(&vb.pp(format!("layer.{i}")), 512, 512, i == 0).unwrap();
        assert!(lin.is_quantized());
        assert_released(&path, "quantized linear");
        let x = Tensor::randn(0f32, 1.0, (3, 512), &dev).unwrap();
        let mut want = x.matmul(&q[i].1.dequantize(&dev).unwrap().t().unwrap()).unwrap();
        if i == 0 {
            want = want.broadcast_add(&want_bias(&q)).unwrap();
        }
        let got = lin.forward(&x).unwrap();
        let err = (got - &want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        let scale = want.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        // Candle's kernels quantize the activations to 8 bits.
        assert!(err <= 0.02 * scale, "layer.{i}: max error {err} for values up to {scale}");
        store.release_pages();
        assert_released(&path, "quantized linear after a forward pass");
    }
}

fn want_bias(q: &[(String, QTensor)]) -> Tensor {
    q.iter().find(|(n, _)| n == "layer.0.bias").unwrap().1.dequantize(&Device::Cpu).unwrap()
}

#[test]
fn quantized_chunks_match_the_dequantized_whole() {
    let tmp = tempfile::tempdir().unwrap();
    let dev = Device::Cpu;
    let w = QTensor::quantize(&Tensor::randn(0f32, 1.0, (64, 256), &dev).unwrap(), GgmlDType::Q4K).unwrap();
    let b = QTensor::quantize(&Tensor::randn(0f32, 1.0, 64, &dev).unwrap(), GgmlDType::Q8_0).unwrap();
    let path = tmp.path().join("q.gguf");
    let mut f = std::fs::File::create(&path).unwrap();
    gguf_file::write(&mut f, &[], &[("w", &w), ("b", &b)]).unwrap();
    drop(f);
    // w splits into whole blocks (rows); b's 64 values into 4 parts of 16 cut its 32-value blocks.
    let split = Arc::new(|name: &str| {
        let (base, part) = name.split_once('.')?;
        let n = if base == "w" { 2 } else { 4 };
        Some(Alias { name: base.into(), chunk: Some((part.parse().ok()?, n)) })
    });
    let store = WeightStore::open(&path).unwrap().with_remap(split);
    for (base, n, q) in [("w", 2, &w), ("b", 4, &b)] {
        let whole = q.dequantize(&dev).unwrap();
        let d0 = whole.dim(0).unwrap() / n;
        for i in 0..n {
            let got = store.tensor(&format!("{base}.{i}"), DType::F32, &dev).unwrap();
            let want = whole.narrow(0, i * d0, d0).unwrap();
            let diff = (&got - &want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert_eq!(diff, 0.0, "{base}.{i}");
            let (_, layout) = got.storage_and_layout();
            assert_eq!(layout.start_offset(), 0, "{base}.{i} owns its part");
        }
    }
    assert!(store.qtensor("w.0", &dev).unwrap().is_none(), "chunks are dense");
}
