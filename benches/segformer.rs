//! SegFormer-B0 at 512×512 with random weights at the real config (nvidia/segformer-b0-finetuned-ade-512-512
//! shapes, 150 classes): forward time with the depthwise kernel vs Candle's grouped conv, and the
//! Mix-FFN depthwise conv alone at the four B0 stage shapes.
//!
//! ```text
//! cargo test --release --bench segformer -- --ignored --nocapture
//! # one implementation per process for peak RSS (the binary path is printed by cargo):
//! SEGFORMER_BENCH_IMPL=default /usr/bin/time -v target/release/deps/segformer-<hash> --ignored --exact b0_512_forward
//! SEGFORMER_BENCH_IMPL=naive   /usr/bin/time -v target/release/deps/segformer-<hash> --ignored --exact b0_512_forward
//! ```
//! The random checkpoint is written once to `$SEGFORMER_BENCH_DIR` (default /tmp/segformer_b0_random).
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use edgerun::models::segformer::{DecodeHeadImpl, SegformerForSemanticSegmentation};
use edgerun::models::NamedTensors;
use edgerun::nn::depthwise::{depthwise_conv2d, depthwise_conv2d_grouped, depthwise_conv2d_nhwc, DepthwiseConfig, DepthwiseImpl, DwActivation};
use edgerun::weights::{Vb, WeightStore};

const HIDDEN: [usize; 4] = [32, 64, 160, 256];
const DEPTHS: [usize; 4] = [2, 2, 2, 2];
const SR: [usize; 4] = [8, 4, 2, 1];
const PATCH: [usize; 4] = [7, 3, 3, 3];
const DECODER: usize = 256;
const LABELS: usize = 150;

fn randn(shape: &[usize], std: f64) -> Tensor {
    Tensor::randn(0f32, std as f32, shape, &Device::Cpu).unwrap()
}

/// Hub-named B0 tensors: conv/linear N(0, 1/sqrt(fan_in)), biases N(0, 0.02), norms 1, BN stats (0, 1).
fn b0_tensors() -> NamedTensors {
    let mut t = NamedTensors::new();
    let mut put = |name: String, v: Tensor| {
        t.insert(name, v);
    };
    let lin = |o: usize, i: usize| randn(&[o, i], 1.0 / (i as f64).sqrt());
    let ones = |n: usize| Tensor::ones(n, DType::F32, &Device::Cpu).unwrap();
    let bias = |n: usize| randn(&[n], 0.02);
    for s in 0..4 {
        let c = HIDDEN[s];
        let cin = if s == 0 { 3 } else { HIDDEN[s - 1] };
        let k = PATCH[s];
        let pe = format!("segformer.encoder.patch_embeddings.{s}");
        put(format!("{pe}.proj.weight"), randn(&[c, cin, k, k], 1.0 / ((cin * k * k) as f64).sqrt()));
        put(format!("{pe}.proj.bias"), bias(c));
        put(format!("{pe}.layer_norm.weight"), ones(c));
        put(format!("{pe}.layer_norm.bias"), bias(c));
        for j in 0..DEPTHS[s] {
            let b = format!("segformer.encoder.block.{s}.{j}");
            for n in ["layer_norm_1", "layer_norm_2"] {
                put(format!("{b}.{n}.weight"), ones(c));
                put(format!("{b}.{n}.bias"), bias(c));
            }
            for n in ["query", "key", "value"] {
                put(format!("{b}.attention.self.{n}.weight"), lin(c, c));
                put(format!("{b}.attention.self.{n}.bias"), bias(c));
            }
            if SR[s] > 1 {
                let r = SR[s];
                put(format!("{b}.attention.self.sr.weight"), randn(&[c, c, r, r], 1.0 / ((c * r * r) as f64).sqrt()));
                put(format!("{b}.attention.self.sr.bias"), bias(c));
                put(format!("{b}.attention.self.layer_norm.weight"), ones(c));
                put(format!("{b}.attention.self.layer_norm.bias"), bias(c));
            }
            put(format!("{b}.attention.output.dense.weight"), lin(c, c));
            put(format!("{b}.attention.output.dense.bias"), bias(c));
            put(format!("{b}.mlp.dense1.weight"), lin(4 * c, c));
            put(format!("{b}.mlp.dense1.bias"), bias(4 * c));
            put(format!("{b}.mlp.dwconv.dwconv.weight"), randn(&[4 * c, 1, 3, 3], 1.0 / 3.0));
            put(format!("{b}.mlp.dwconv.dwconv.bias"), bias(4 * c));
            put(format!("{b}.mlp.dense2.weight"), lin(c, 4 * c));
            put(format!("{b}.mlp.dense2.bias"), bias(c));
        }
        put(format!("segformer.encoder.layer_norm.{s}.weight"), ones(c));
        put(format!("segformer.encoder.layer_norm.{s}.bias"), bias(c));
        put(format!("decode_head.linear_c.{s}.proj.weight"), lin(DECODER, c));
        put(format!("decode_head.linear_c.{s}.proj.bias"), bias(DECODER));
    }
    put("decode_head.linear_fuse.weight".into(), randn(&[DECODER, 4 * DECODER, 1, 1], 1.0 / ((4 * DECODER) as f64).sqrt()));
    put("decode_head.batch_norm.weight".into(), ones(DECODER));
    put("decode_head.batch_norm.bias".into(), bias(DECODER));
    put("decode_head.batch_norm.running_mean".into(), Tensor::zeros(DECODER, DType::F32, &Device::Cpu).unwrap());
    put("decode_head.batch_norm.running_var".into(), ones(DECODER));
    put("decode_head.classifier.weight".into(), lin(LABELS, DECODER).reshape((LABELS, DECODER, 1, 1)).unwrap());
    put("decode_head.classifier.bias".into(), bias(LABELS));
    t
}

/// Writes (once) and returns the random B0 checkpoint directory.
fn b0_dir() -> PathBuf {
    let dir = PathBuf::from(std::env::var("SEGFORMER_BENCH_DIR").unwrap_or_else(|_| "/tmp/segformer_b0_random".into()));
    if !dir.join("model.safetensors").exists() {
        std::fs::create_dir_all(&dir).unwrap();
        let id2label: serde_json::Map<String, serde_json::Value> =
            (0..LABELS).map(|i| (i.to_string(), serde_json::Value::String(format!("class_{i}")))).collect();
        let cfg = serde_json::json!({"model_type": "segformer", "architectures": ["SegformerForSemanticSegmentation"], "id2label": id2label});
        std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
        edgerun::tensor_io::write_tensors(&dir.join("model.safetensors"), &b0_tensors()).unwrap();
    }
    dir
}

fn load(imp: DepthwiseImpl, head: DecodeHeadImpl) -> SegformerForSemanticSegmentation {
    let store = Arc::new(WeightStore::open(b0_dir()).unwrap());
    let vb = Vb::new(store.clone(), DType::F32, Device::Cpu);
    let mut m = SegformerForSemanticSegmentation::load(&vb, store.config()).unwrap();
    m.set_depthwise_impl(imp);
    m.set_decode_head_impl(head);
    m
}

fn time_forward(m: &SegformerForSemanticSegmentation, x: &Tensor, runs: usize) -> (Tensor, Vec<f64>) {
    let mut out = m.forward(x).unwrap(); // warm-up
    let mut ms = Vec::new();
    for _ in 0..runs {
        let t = Instant::now();
        out = m.forward(x).unwrap();
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    (out, ms)
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Full B0 forward at 1×3×512×512. `SEGFORMER_BENCH_IMPL` = default (channels-last depthwise kernel +
/// folded decode head) | naive (Candle grouped conv + literal head) | kernel_literal | grouped_folded |
/// all (the default: every variant, in one process).
#[test]
#[ignore]
fn b0_512_forward() {
    let runs: usize = std::env::var("SEGFORMER_BENCH_RUNS").ok().and_then(|v| v.parse().ok()).unwrap_or(3);
    let which = std::env::var("SEGFORMER_BENCH_IMPL").unwrap_or_else(|_| "all".into());
    let x = randn(&[1, 3, 512, 512], 1.0);
    let mut outs = Vec::new();
    for (name, imp, head) in [
        ("default", DepthwiseImpl::Auto, DecodeHeadImpl::Folded),
        ("naive", DepthwiseImpl::Grouped, DecodeHeadImpl::Literal),
        ("kernel_literal", DepthwiseImpl::Auto, DecodeHeadImpl::Literal),
        ("grouped_folded", DepthwiseImpl::Grouped, DecodeHeadImpl::Folded),
    ] {
        if which != "all" && which != name {
            continue;
        }
        let t = Instant::now();
        let m = load(imp, head);
        let load_ms = t.elapsed().as_secs_f64() * 1e3;
        let (out, ms) = time_forward(&m, &x, runs);
        assert_eq!(out.dims(), [1, LABELS, 128, 128]);
        eprintln!(
            "{{\"bench\":\"segformer_b0_512\",\"depthwise\":\"{name}\",\"threads\":{},\"load_ms\":{load_ms:.1},\"forward_ms\":{ms:?},\"median_ms\":{:.1}}}",
            candle_core::utils::get_num_threads(),
            median(&ms)
        );
        outs.push(out);
    }
    for o in outs.iter().skip(1) {
        let d = (&outs[0] - o).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
        let scale = o.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
        eprintln!("variant vs first: logits max abs diff {d:e} (max |logit| {scale})");
        assert!(d <= 1e-4 * scale.max(1.0));
    }
}

/// The Mix-FFN depthwise 3×3 alone at the B0 shapes for a 512² input (B = 1): NCHW kernel, the
/// channels-last kernel with bias + GELU fused, and Candle's grouped conv (+ bias; + GELU in the last column).
#[test]
#[ignore]
fn b0_depthwise_shapes() {
    let cfg = DepthwiseConfig { stride: 1, padding: 1, dilation: 1 };
    for (c, hw) in [(128, 128), (256, 64), (640, 32), (1024, 16)] {
        let x = randn(&[1, c, hw, hw], 1.0);
        let w = randn(&[c, 1, 3, 3], 0.3);
        let b = randn(&[c], 0.1);
        let xt = x.permute((0, 2, 3, 1)).unwrap().contiguous().unwrap();
        let time = |f: &dyn Fn()| {
            f();
            let n = 5;
            let t = Instant::now();
            for _ in 0..n {
                f();
            }
            t.elapsed().as_secs_f64() * 1e3 / n as f64
        };
        let k = time(&|| {
            depthwise_conv2d(&x, &w, Some(&b), cfg).unwrap();
        });
        let kn = time(&|| {
            depthwise_conv2d_nhwc(&xt, &w, Some(&b), DwActivation::GeluErf, cfg).unwrap();
        });
        let g = time(&|| {
            depthwise_conv2d_grouped(&x, &w, Some(&b), cfg).unwrap();
        });
        let gg = time(&|| {
            depthwise_conv2d_grouped(&x, &w, Some(&b), cfg).unwrap().gelu_erf().unwrap();
        });
        eprintln!(
            "depthwise 3x3 C={c} {hw}x{hw}: NCHW kernel {k:.2} ms, NHWC kernel+bias+GELU {kn:.2} ms, grouped conv2d {g:.2} ms ({:.0}x NCHW), grouped+GELU {gg:.2} ms",
            g / k
        );
    }
}
