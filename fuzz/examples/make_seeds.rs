//! Writes a few tiny valid weight files as fuzzing seeds:
//! `cargo run --example make_seeds -- corpus` fills `corpus/{safetensors_header,gguf_header,store_load}/`.
use std::io::Cursor;
use std::path::Path;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use edgerun::quantize::gguf_writer::{plan, GgufWriter};
use edgerun::weights::MetaValue;

fn st(header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

fn gguf(meta: Vec<(String, MetaValue)>, tensors: Vec<(&str, Vec<usize>, GgmlDType)>) -> Vec<u8> {
    let dev = Device::Cpu;
    let mut blobs = vec![];
    for (_, shape, dt) in &tensors {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
        let t = Tensor::from_vec(v, shape.as_slice(), &dev).unwrap();
        blobs.push(QTensor::quantize(&t, *dt).unwrap().data().unwrap().to_vec());
    }
    let planned = plan(tensors.into_iter().map(|(n, s, d)| (n.to_string(), s, d)).collect()).unwrap();
    let mut w = GgufWriter::new(Cursor::new(Vec::new()), &meta, planned).unwrap();
    for b in &blobs {
        w.write_tensor(b).unwrap();
    }
    w.finish().unwrap().into_inner()
}

fn main() {
    let root = std::env::args().nth(1).unwrap_or_else(|| "corpus".into());
    let root = Path::new(&root);
    let f32s: Vec<u8> = [1.0f32, -2.0, 0.5, 3.0, 0.0, 7.0].iter().flat_map(|x| x.to_le_bytes()).collect();
    let sts = vec![
        st(r#"{"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}}"#, &f32s),
        st(
            r#"{"__metadata__":{"format":"pt"},"a":{"dtype":"F16","shape":[2],"data_offsets":[0,4]},"b":{"dtype":"I64","shape":[1],"data_offsets":[4,12]},"c":{"dtype":"U8","shape":[],"data_offsets":[12,13]}}"#,
            &[0, 60, 0, 188, 7, 0, 0, 0, 0, 0, 0, 0, 1],
        ),
    ];
    let s = |x: &str| MetaValue::String(x.into());
    let ggufs = vec![
        gguf(
            vec![
                ("general.architecture".into(), s("toy")),
                ("edgerun.config".into(), s(r#"{"model_type":"toy"}"#)),
                ("toy.n".into(), MetaValue::U32(2)),
                ("toy.list".into(), MetaValue::Array(vec![MetaValue::I8(1), MetaValue::I8(-1)])),
                ("toy.names".into(), MetaValue::Array(vec![s("a"), s("bc")])),
                ("toy.f".into(), MetaValue::F64(0.5)),
                ("toy.b".into(), MetaValue::Bool(true)),
            ],
            vec![("n", vec![4], GgmlDType::F32), ("e", vec![2, 2], GgmlDType::F16), ("q", vec![1, 32], GgmlDType::Q8_0)],
        ),
        gguf(vec![("general.alignment".into(), MetaValue::U32(32))], vec![("q4", vec![32], GgmlDType::Q4_0), ("k", vec![256], GgmlDType::Q4K)]),
        gguf(vec![], vec![("q6", vec![256], GgmlDType::Q6K)]),
    ];
    let mut n = 0;
    for (target, files) in [("safetensors_header", &sts), ("gguf_header", &ggufs)] {
        let dir = root.join(target);
        std::fs::create_dir_all(&dir).unwrap();
        for (i, f) in files.iter().enumerate() {
            std::fs::write(dir.join(format!("seed{i}")), f).unwrap();
            n += 1;
        }
    }
    let dir = root.join("store_load");
    std::fs::create_dir_all(&dir).unwrap();
    for (i, f) in sts.iter().chain(&ggufs).enumerate() {
        std::fs::write(dir.join(format!("seed{i}")), f).unwrap();
        n += 1;
    }
    println!("wrote {n} seeds under {}", root.display());
}
