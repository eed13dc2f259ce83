//! Rust side of the L-GATr benchmark (issue 7); the PyTorch side is `tools/bench/lgatr.py`,
//! which writes the benchmark directory (config.json, model.safetensors, input.safetensors,
//! expected.safetensors) for a top-tagging-sized LGATr at 32 × 200 particles.
//!
//! ```text
//! /work/venv/bin/python tools/bench/lgatr.py --dir /tmp/lgatr_bench
//! LGATR_BENCH_DIR=/tmp/lgatr_bench cargo test --release --bench lgatr -- --ignored --nocapture
//! # peak RSS: run the built binary (path printed by cargo) under /usr/bin/time -v, with
//! # LGATR_BENCH_RUNS=1
//! ```
//!
//! The tests here are `#[ignore]`d (they need the directory and take seconds); the micro
//! benchmark of the geometric-product implementations needs nothing and is also ignored.
use std::path::PathBuf;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use edgerun::models::lgatr::bilinear::{geometric_product_with, GpImpl};
use edgerun::models::NamedTensors;

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

fn max_abs(a: &Tensor) -> f64 {
    a.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap()
}

/// CPU time (user + system) of this process in seconds, from /proc/self/stat (Linux; 0 elsewhere).
fn cpu_seconds() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else { return 0.0 };
    let Some(rest) = stat.rsplit(')').next() else { return 0.0 };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

/// Forward time of the benchmark net on the benchmark input, and its agreement with lgatr.
#[test]
#[ignore]
fn lgatr_top_tagging_forward() {
    let dir = PathBuf::from(std::env::var("LGATR_BENCH_DIR").unwrap_or_else(|_| "/tmp/lgatr_bench".into()));
    let runs: usize = std::env::var("LGATR_BENCH_RUNS").ok().and_then(|v| v.parse().ok()).unwrap_or(3);
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("config.json")).expect("run tools/bench/lgatr.py first"),
    )
    .unwrap();
    let t0 = Instant::now();
    let vb = unsafe {
        candle_nn::VarBuilder::from_mmaped_safetensors(&[dir.join("model.safetensors")], DType::F32, &Device::Cpu)
    }
    .unwrap();
    let model = edgerun::models::lgatr::load(vb, &config).unwrap();
    let load_s = t0.elapsed().as_secs_f64();
    let input: NamedTensors =
        candle_core::safetensors::load(dir.join("input.safetensors"), &Device::Cpu).unwrap().into_iter().collect();
    let mut times = vec![];
    let mut cpu = vec![];
    let mut out = NamedTensors::new();
    for _ in 0..runs {
        let (t, c) = (Instant::now(), cpu_seconds());
        out = model.forward_named(&input).unwrap();
        times.push((t.elapsed().as_secs_f64() * 1000.0).round() / 1000.0);
        cpu.push(((cpu_seconds() - c) * 100.0).round() / 100.0);
    }
    let min = times.iter().cloned().fold(f64::INFINITY, f64::min);
    let min_cpu = cpu.iter().cloned().fold(f64::INFINITY, f64::min);
    println!(
        "edgerun lgatr: threads {} load {:.3}s forward wall {times:?} (min {min:.3}s) cpu {cpu:?} (min {min_cpu:.2}s)",
        candle_core::utils::get_num_threads(),
        load_s,
    );
    if let Ok(exp) = candle_core::safetensors::load(dir.join("expected.safetensors"), &Device::Cpu) {
        for k in ["outputs_mv", "outputs_s"] {
            let err = max_abs_diff(&out[k], &exp[k]);
            let tol = 1e-4 * max_abs(&exp[k]).max(1.0);
            println!("{k}: max abs error vs lgatr {err:.2e} (max |ref| {:.3})", max_abs(&exp[k]));
            assert!(err <= tol, "{k}: {err} > {tol}");
        }
    }
}

/// Geometric product on 32·200·32 multivector pairs: CPU kernel vs dense GEMM vs gather.
#[test]
#[ignore]
fn geometric_product_implementations() {
    let n = 32 * 200 * 32;
    let x = Tensor::randn(0f32, 1.0, (n, 16), &Device::Cpu).unwrap();
    let y = Tensor::randn(0f32, 1.0, (n, 16), &Device::Cpu).unwrap();
    let reference = geometric_product_with(&x, &y, GpImpl::Dense).unwrap();
    for imp in [GpImpl::Kernel, GpImpl::Dense, GpImpl::Gather] {
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let t = Instant::now();
            let g = geometric_product_with(&x, &y, imp).unwrap();
            best = best.min(t.elapsed().as_secs_f64());
            assert!(max_abs_diff(&g, &reference) < 1e-4);
        }
        println!("geometric product {imp:?}: {:.1} ms for {n} products", best * 1e3);
    }
}

fn best_of<F: FnMut() -> Tensor>(mut f: F) -> f64 {
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t = Instant::now();
        let _ = f();
        best = best.min(t.elapsed().as_secs_f64());
    }
    best * 1e3
}

/// Per-op timings at the benchmark shapes (T = 6400 items, C = 16, S = 32, 8 heads of 4 mv + 8 s).
#[test]
#[ignore]
fn op_profile() {
    use edgerun::models::lgatr::attention::sdpa;
    use edgerun::models::lgatr::mlp::gate_fused;
    use edgerun::models::lgatr::norm::EquiNorm;
    use edgerun::models::lgatr::Nonlinearity;
    let dev = Device::Cpu;
    let t = 6400;
    for (k, m) in [(288, 1728), (576, 288), (288, 1056), (544, 576)] {
        let x = Tensor::randn(0f32, 1.0, (t, k), &dev).unwrap();
        let w = Tensor::randn(0f32, 1.0, (k, m), &dev).unwrap();
        let ms = best_of(|| x.matmul(&w).unwrap());
        println!("gemm {t}x{k} @ {k}x{m}: {ms:.1} ms ({:.1} GFLOP/s)", 2.0 * (t * k * m) as f64 / ms / 1e6);
    }
    let q = Tensor::randn(0f32, 1.0, (32, 8, 200, 72), &dev).unwrap();
    let k = Tensor::randn(0f32, 1.0, (32, 8, 200, 72), &dev).unwrap();
    let v = Tensor::randn(0f32, 1.0, (32, 8, 200, 72), &dev).unwrap();
    println!("sdpa (32,8,200,72): {:.1} ms", best_of(|| sdpa(&q, &k, &v, None).unwrap()));
    let kt = k.reshape((256, 200, 72)).unwrap().transpose(1, 2).unwrap();
    let kc = kt.contiguous().unwrap();
    let q3 = q.reshape((256, 200, 72)).unwrap();
    println!("  q@kT (strided kT): {:.1} ms", best_of(|| q3.matmul(&kt).unwrap()));
    println!("  q@kT (contiguous kT): {:.1} ms", best_of(|| q3.matmul(&kc).unwrap()));
    let sc = q3.matmul(&kc).unwrap();
    println!("  softmax: {:.1} ms", best_of(|| candle_nn::ops::softmax_last_dim(&sc).unwrap()));
    let v3 = v.reshape((256, 200, 72)).unwrap();
    println!("  p@v: {:.1} ms", best_of(|| sc.matmul(&v3).unwrap()));
    let n = EquiNorm::plain(16, 32, &dev, DType::F32).unwrap();
    let x = Tensor::randn(0f32, 1.0, (t, 288), &dev).unwrap();
    println!("norm (6400, 16mv+32s): {:.1} ms", best_of(|| n.forward(&x).unwrap()));
    let nq = EquiNorm::plain(4, 8, &dev, DType::F32).unwrap();
    let xq = Tensor::randn(0f32, 1.0, (t * 24, 72), &dev).unwrap();
    println!("qkv norm (6400*24, 4mv+8s): {:.1} ms", best_of(|| nq.forward(&xq).unwrap()));
    let xg = Tensor::randn(0f32, 1.0, (t, 576), &dev).unwrap();
    println!("gate (6400, 32mv+64s): {:.1} ms", best_of(|| gate_fused(&xg, 32, 64, Nonlinearity::Gelu).unwrap()));
    let lr = Tensor::randn(0f32, 1.0, (t, 2 * 32 * 16 + 32), &dev).unwrap();
    println!(
        "gp_fused (6400, 32 ch): {:.1} ms",
        best_of(|| edgerun::models::lgatr::bilinear::gp_fused(&lr, 32, 32, true).unwrap())
    );
}
