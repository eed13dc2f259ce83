//! Builders of small valid weight files (safetensors and GGUF), shared by `tests/malformed.rs` (which
//! corrupts them) and `examples/fuzz_seeds.rs` (which writes them as the fuzzers' seed corpus).
#![allow(dead_code)]
use std::collections::HashMap;
use std::io::Cursor;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use edgerun::quantize::gguf_writer::{plan, GgufWriter};
use edgerun::weights::MetaValue;
use safetensors::tensor::TensorView;

/// Little-endian bytes of f32 values.
pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// `n` deterministic values in [-3, 3] (a sampled sine).
pub fn ramp(n: usize) -> Vec<f32> {
    (0..n).map(|i| (i as f32 * 0.37).sin() * 3.0).collect()
}

/// A valid safetensors file written by the `safetensors` crate: f32, f16, i64 tensors and metadata.
pub fn valid_st_with(big: usize) -> Vec<u8> {
    let a = f32_bytes(&ramp(6));
    let h: Vec<u8> = [0.5f32, -1.25, 2.0, 65504.0].iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect();
    let i: Vec<u8> = [7i64, -3].iter().flat_map(|x| x.to_le_bytes()).collect();
    let b = f32_bytes(&ramp(big));
    let mut tensors = vec![
        ("enc.a.weight".to_string(), TensorView::new(safetensors::Dtype::F32, vec![2, 3], &a).unwrap()),
        ("enc.h".to_string(), TensorView::new(safetensors::Dtype::F16, vec![4], &h).unwrap()),
        ("idx".to_string(), TensorView::new(safetensors::Dtype::I64, vec![2], &i).unwrap()),
    ];
    if big > 0 {
        tensors.push(("big".to_string(), TensorView::new(safetensors::Dtype::F32, vec![big], &b).unwrap()));
    }
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize(tensors, Some(meta)).unwrap()
}

/// [`valid_st_with`] without the large tensor.
pub fn valid_st() -> Vec<u8> {
    valid_st_with(0)
}

/// A small GGUF byte builder for hand-made (possibly hostile) files.
#[derive(Clone)]
pub struct G {
    /// File magic (`GGUF`).
    pub magic: [u8; 4],
    /// Format version.
    pub version: u32,
    /// Declared tensor count (None: the real one).
    pub n_tensors: Option<u64>,
    /// Declared metadata count (None: the real one).
    pub n_kv: Option<u64>,
    /// Encoded metadata entries.
    pub kv: Vec<u8>,
    /// Metadata entries added.
    pub nkv: u64,
    /// Encoded tensor infos.
    pub infos: Vec<u8>,
    /// Tensor infos added.
    pub nt: u64,
    /// Data section alignment used by `build`.
    pub alignment: usize,
    /// Data section bytes.
    pub data: Vec<u8>,
}

/// A GGUF string: u64 length, then the bytes.
pub fn gstr(s: &[u8]) -> Vec<u8> {
    let mut v = (s.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(s);
    v
}

impl G {
    /// An empty version-3 file with alignment 32.
    pub fn new() -> Self {
        G { magic: *b"GGUF", version: 3, n_tensors: None, n_kv: None, kv: vec![], nkv: 0, infos: vec![], nt: 0, alignment: 32, data: vec![] }
    }
    /// Appends a metadata entry with a raw key, type id and encoded value.
    pub fn kv_raw(mut self, key: &[u8], ty: u32, value: &[u8]) -> Self {
        self.kv.extend(gstr(key));
        self.kv.extend(ty.to_le_bytes());
        self.kv.extend_from_slice(value);
        self.nkv += 1;
        self
    }
    /// Appends a string metadata entry.
    pub fn kv_str(self, key: &str, v: &str) -> Self {
        self.kv_raw(key.as_bytes(), 8, &gstr(v.as_bytes()))
    }
    /// Appends a u32 metadata entry.
    pub fn kv_u32(self, key: &str, v: u32) -> Self {
        self.kv_raw(key.as_bytes(), 4, &v.to_le_bytes())
    }
    /// Appends a tensor info; `dims` innermost first, as GGUF stores them.
    pub fn tensor_raw(mut self, name: &[u8], dims: &[u64], ty: u32, offset: u64) -> Self {
        self.infos.extend(gstr(name));
        self.infos.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            self.infos.extend(d.to_le_bytes());
        }
        self.infos.extend(ty.to_le_bytes());
        self.infos.extend(offset.to_le_bytes());
        self.nt += 1;
        self
    }
    /// Appends a tensor info with a UTF-8 name.
    pub fn tensor(self, name: &str, dims: &[u64], ty: u32, offset: u64) -> Self {
        self.tensor_raw(name.as_bytes(), dims, ty, offset)
    }
    /// Appends bytes to the data section.
    pub fn data(mut self, d: &[u8]) -> Self {
        self.data.extend_from_slice(d);
        self
    }
    /// Magic, version, counts, metadata and tensor infos (no padding, no data).
    pub fn header(&self) -> Vec<u8> {
        let mut out = self.magic.to_vec();
        out.extend(self.version.to_le_bytes());
        out.extend(self.n_tensors.unwrap_or(self.nt).to_le_bytes());
        out.extend(self.n_kv.unwrap_or(self.nkv).to_le_bytes());
        out.extend_from_slice(&self.kv);
        out.extend_from_slice(&self.infos);
        out
    }
    /// The whole file: header, padding to the alignment, data.
    pub fn build(&self) -> Vec<u8> {
        let mut out = self.header();
        while !out.len().is_multiple_of(self.alignment) {
            out.push(0);
        }
        out.extend_from_slice(&self.data);
        out
    }
}

/// A valid hand-built GGUF: one f32 tensor `w` of shape [2, 2] (dims [2, 2]).
pub fn small_gguf() -> G {
    G::new().kv_str("general.architecture", "toy").tensor("w", &[2, 2], 0, 0).data(&f32_bytes(&[1.0, 2.0, 3.0, 4.0]))
}

/// Name, shape and the f32 values a tensor was written from.
pub type Written = Vec<(String, Vec<usize>, Vec<f32>)>;

/// A valid GGUF written by edgerun's own writer: f32, f16, q8_0 and q4_0 tensors plus the config
/// (and a `big` × 32 Q8_0 tensor when `big > 0`); its bytes and what was written.
pub fn valid_gguf_with(big: usize) -> (Vec<u8>, Written) {
    let dev = Device::Cpu;
    let mut specs: Vec<(String, Vec<usize>, GgmlDType)> = vec![
        ("norm.weight".into(), vec![5], GgmlDType::F32),
        ("emb".into(), vec![3, 4], GgmlDType::F16),
        ("blk.0.q8".into(), vec![2, 64], GgmlDType::Q8_0),
        ("blk.0.q4".into(), vec![3, 32], GgmlDType::Q4_0),
    ];
    if big > 0 {
        specs.push(("big".into(), vec![big, 32], GgmlDType::Q8_0));
    }
    let mut values = vec![];
    let mut blobs = vec![];
    for (name, shape, dt) in &specs {
        let n: usize = shape.iter().product();
        let v = ramp(n);
        let t = Tensor::from_vec(v.clone(), shape.as_slice(), &dev).unwrap();
        let bytes = match dt {
            GgmlDType::F32 => f32_bytes(&v),
            GgmlDType::F16 => v.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect(),
            q => QTensor::quantize(&t, *q).unwrap().data().unwrap().to_vec(),
        };
        values.push((name.clone(), shape.clone(), v));
        blobs.push(bytes);
    }
    let planned = plan(specs).unwrap();
    let meta = vec![
        ("general.architecture".to_string(), MetaValue::String("toy".into())),
        ("edgerun.config".to_string(), MetaValue::String(r#"{"model_type":"toy","hidden_size":4}"#.into())),
        ("toy.layers".to_string(), MetaValue::U32(1)),
        ("toy.list".to_string(), MetaValue::Array(vec![MetaValue::I32(1), MetaValue::I32(-2)])),
    ];
    let mut w = GgufWriter::new(Cursor::new(Vec::new()), &meta, planned).unwrap();
    for b in &blobs {
        w.write_tensor(b).unwrap();
    }
    (w.finish().unwrap().into_inner(), values)
}

/// [`valid_gguf_with`] without the large tensor, bytes only.
pub fn valid_gguf() -> Vec<u8> {
    valid_gguf_with(0).0
}

/// The fuzzers' seed corpus: (fuzz target, file name, bytes). Tiny valid files: the parsers' targets
/// get their own format, `store_load` all of them.
pub fn fuzz_seeds() -> Vec<(&'static str, String, Vec<u8>)> {
    let mut a64 = small_gguf().kv_u32("general.alignment", 64);
    a64.alignment = 64;
    let k = |dt: GgmlDType| {
        let t = Tensor::from_vec(ramp(256), 256, &Device::Cpu).unwrap();
        let b = QTensor::quantize(&t, dt).unwrap().data().unwrap().to_vec();
        let planned = plan(vec![("k".into(), vec![256], dt)]).unwrap();
        let mut w = GgufWriter::new(Cursor::new(Vec::new()), &[], planned).unwrap();
        w.write_tensor(&b).unwrap();
        w.finish().unwrap().into_inner()
    };
    let sts = [valid_st(), valid_st_with(5)];
    let ggufs = [valid_gguf(), small_gguf().build(), a64.build(), k(GgmlDType::Q4K), k(GgmlDType::Q6K)];
    let mut out = Vec::new();
    for (target, files) in [("safetensors_header", &sts[..]), ("gguf_header", &ggufs[..])] {
        for (i, f) in files.iter().enumerate() {
            out.push((target, format!("seed{i}"), f.clone()));
        }
    }
    for (i, f) in sts.iter().chain(&ggufs).enumerate() {
        out.push(("store_load", format!("seed{i}"), f.clone()));
    }
    out
}
