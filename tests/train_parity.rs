//! The training core against PyTorch and timm (tests/fixtures/train_parity, tools/fixtures/train.py):
//! AdamW + OneCycleLR + clip_grad_norm_ + ModelEmaV3 over three steps of two accumulated micro-batches,
//! the one-cycle schedule in all its shapes, and every loss's value and gradient.
use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, Var};
use edgerun::tensor_io::read_tensors;
use edgerun::train::adamw::{AdamW, AdamWConfig};
use edgerun::train::ema::{Ema, EmaConfig};
use edgerun::train::grads::Grads;
use edgerun::train::losses;
use edgerun::train::schedule::{Anneal, OneCycle, OneCycleConfig};

fn fixture(file: &str, dtype: DType) -> HashMap<String, Tensor> {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/train_parity").join(file);
    read_tensors(&p, dtype, &Device::Cpu).unwrap().into_iter().collect()
}

/// Max |a − b| ≤ tol × max(1, max |b|).
fn close(what: &str, a: &Tensor, b: &Tensor, tol: f64) {
    assert_eq!(a.dims(), b.dims(), "{what}: shapes");
    let a = a.to_dtype(DType::F64).unwrap();
    let b = b.to_dtype(DType::F64).unwrap();
    let err = (&a - &b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f64>().unwrap();
    let scale = b.abs().unwrap().max_all().unwrap().to_scalar::<f64>().unwrap().max(1.0);
    eprintln!("{what}: max error {:.2e} of scale {scale:.3}", err);
    assert!(err <= tol * scale, "{what}: max error {err:e} > {tol:e} × {scale}");
}

fn values(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

#[test]
fn adamw_one_cycle_clipping_and_ema_match_pytorch_and_timm() {
    let f = fixture("run.safetensors", DType::F32);
    let names = ["layer1.bias", "layer1.weight", "layer2.bias", "layer2.weight"];
    let params: Vec<(String, Var)> = names.iter().map(|n| (n.to_string(), Var::from_tensor(&f[&format!("init.{n}")]).unwrap())).collect();
    let var = |n: &str| params.iter().find(|(k, _)| k == n).unwrap().1.as_tensor().clone();
    let forward = |x: &Tensor| -> Tensor {
        let h = x.matmul(&var("layer1.weight").t().unwrap()).unwrap().broadcast_add(&var("layer1.bias")).unwrap().tanh().unwrap();
        h.matmul(&var("layer2.weight").t().unwrap()).unwrap().broadcast_add(&var("layer2.bias")).unwrap()
    };
    let sched = OneCycle::new(OneCycleConfig { max_lr: 0.05, total_steps: 3, pct_start: 0.4, ..Default::default() }).unwrap();
    let mut adam = AdamW::new(params.clone(), AdamWConfig { lr: sched.lr(0).unwrap(), weight_decay: 0.05, ..Default::default() }).unwrap();
    let named = || params.iter().map(|(n, v)| (n.clone(), v.as_tensor().clone())).collect::<Vec<_>>();
    let mut ema = Ema::new(&named(), EmaConfig { decay: 0.9, use_warmup: true, ..Default::default() }).unwrap();
    let mut grads = Grads::new(&params);
    let f64s = fixture("run.safetensors", DType::F64);
    let (want_lr, want_norm) = (values(&f64s["lr"]), values(&f64s["grad_norm"]));
    for step in 0..3 {
        for micro in 0..2 {
            let i = 2 * step + micro;
            let loss = (forward(&f[&format!("x.{i}")]) - &f[&format!("y.{i}")]).unwrap().sqr().unwrap().mean_all().unwrap();
            grads.accumulate(&(loss / 2.0).unwrap().backward().unwrap()).unwrap();
        }
        let lr = sched.lr(step).unwrap();
        assert!((lr - want_lr[step]).abs() <= 1e-12 * want_lr[step], "lr of step {step}: {lr} vs {}", want_lr[step]);
        adam.set_lr(lr);
        let norm = grads.clip_norm(0.5).unwrap();
        assert!(norm > 0.5, "clipping bites");
        assert!((norm - want_norm[step]).abs() <= 1e-5 * want_norm[step], "grad norm of step {step}: {norm} vs {}", want_norm[step]);
        adam.step(&grads).unwrap();
        grads.clear();
        ema.update(&named(), step as u64 + 1).unwrap();
        for (n, v) in &params {
            close(&format!("step {step} {n}"), v.as_tensor(), &f[&format!("param.{step}.{n}")], 1e-5);
        }
        for (n, t) in ema.tensors() {
            close(&format!("step {step} ema {n}"), t, &f[&format!("ema.{step}.{n}")], 1e-5);
        }
    }
    assert_eq!(adam.step_count(), 3);
}

#[test]
fn one_cycle_matches_pytorch_in_every_shape() {
    let f = fixture("schedule.safetensors", DType::F64);
    let base = OneCycleConfig { max_lr: 0.1, total_steps: 100, pct_start: 0.25, ..Default::default() };
    let shapes = [
        ("cos", base),
        ("linear", OneCycleConfig { anneal: Anneal::Linear, ..base }),
        ("three_phase", OneCycleConfig { three_phase: true, ..base }),
        ("momentum", OneCycleConfig { cycle_momentum: true, ..base }),
    ];
    for (name, cfg) in shapes {
        let s = OneCycle::new(cfg).unwrap();
        let (lrs, betas) = (values(&f[&format!("{name}.lr")]), values(&f[&format!("{name}.beta1")]));
        for k in 0..100 {
            let lr = s.lr(k).unwrap();
            assert!((lr - lrs[k]).abs() <= 1e-12 * lrs[k].max(1e-9), "{name} step {k}: {lr} vs {}", lrs[k]);
            match s.momentum(k).unwrap() {
                Some(b) => assert!((b - betas[k]).abs() <= 1e-12, "{name} β1 of step {k}: {b} vs {}", betas[k]),
                None => assert_eq!(betas[k], 0.9, "{name}: β1 is not cycled"),
            }
        }
        assert!(s.lr(100).is_ok() && s.lr(101).is_err(), "{name}: PyTorch raises past total_steps");
    }
}

#[test]
fn losses_and_their_gradients_match_pytorch_in_f64() {
    let f = fixture("losses.safetensors", DType::F64);
    let (pred, target) = (&f["depth.pred"], &f["depth.target"]);
    type Loss = fn(&Tensor, &Tensor) -> edgerun::Result<Tensor>;
    let depth: [(&str, Loss); 3] = [("silog", |p, t| losses::silog(p, t, 0.5)), ("ssi", losses::ssi), ("l1", losses::l1)];
    for (name, loss) in depth {
        let p = Var::from_tensor(pred).unwrap();
        let v = loss(p.as_tensor(), target).unwrap();
        close(&format!("{name} value"), &v.reshape(1).unwrap(), &f[&format!("{name}.value")], 1e-10);
        let g = v.backward().unwrap().get(p.as_tensor()).cloned().unwrap();
        close(&format!("{name} gradient"), &g, &f[&format!("{name}.grad")], 1e-10);
    }
    let logits = &f["seg.logits"];
    let classes = read_tensors(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/train_parity/losses.safetensors"), DType::F64, &Device::Cpu)
        .unwrap()
        .remove("seg.target")
        .unwrap()
        .to_dtype(DType::U32)
        .unwrap();
    type SegLoss = fn(&Tensor, &Tensor) -> edgerun::Result<Tensor>;
    let seg: [(&str, SegLoss); 2] = [("ce", |x, t| losses::cross_entropy(x, t, 255)), ("focal", |x, t| losses::focal(x, t, 2.0, 255))];
    for (name, loss) in seg {
        let x = Var::from_tensor(logits).unwrap();
        let v = loss(x.as_tensor(), &classes).unwrap();
        close(&format!("{name} value"), &v.reshape(1).unwrap(), &f[&format!("{name}.value")], 1e-10);
        let g = v.backward().unwrap().get(x.as_tensor()).cloned().unwrap();
        close(&format!("{name} gradient"), &g, &f[&format!("{name}.grad")], 1e-10);
    }
}

#[test]
fn all_ignored_batches_and_missing_gradients_are_errors() {
    let p = Tensor::ones((1, 2, 2), DType::F32, &Device::Cpu).unwrap();
    let t = Tensor::full(f32::NAN, (1, 2, 2), &Device::Cpu).unwrap();
    for r in [losses::l1(&p, &t), losses::ssi(&p, &t), losses::silog(&p, &t, 0.5)] {
        assert!(r.unwrap_err().to_string().contains("ignored"));
    }
    let logits = Tensor::zeros((1, 3, 1, 2), DType::F32, &Device::Cpu).unwrap();
    let all_ignored = Tensor::new(&[[[255u32, 255]]], &Device::Cpu).unwrap();
    assert!(losses::cross_entropy(&logits, &all_ignored, 255).is_err());
    let bad_class = Tensor::new(&[[[7u32, 0]]], &Device::Cpu).unwrap();
    assert!(losses::cross_entropy(&logits, &bad_class, 255).unwrap_err().to_string().contains("class"));
    // A parameter behind Candle's fused softmax gets no gradient: named, not silently skipped.
    let w = Var::new(&[1f32, 2.0, 3.0], &Device::Cpu).unwrap();
    let params = vec![("head.w".to_string(), w.clone())];
    let y = candle_nn::ops::softmax_last_dim(&w.as_tensor().unsqueeze(0).unwrap()).unwrap();
    let store = (y.sum_all().unwrap() * 1.0).unwrap().backward().unwrap();
    let err = Grads::new(&params).accumulate(&store).unwrap_err().to_string();
    assert!(err.contains("head.w") && err.contains("no gradient"), "{err}");
}
