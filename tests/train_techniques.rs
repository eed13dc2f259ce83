//! Label smoothing and CutMix / MixUp against PyTorch 2.15 and timm 1.0.31
//! (tests/fixtures/train_techniques, tools/fixtures/train_techniques.py): smoothed cross-entropy value
//! and gradient (f64 and f32), timm's `rand_bbox` + λ correction, and a batch mixed by timm's own
//! `Mixup._mix_batch` with its draws fixed (images, depth and class targets, the mixed losses).
use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, Var};
use edgerun::tensor_io::read_tensors;
use edgerun::train::losses;
use edgerun::train::mix::{cutmix_lam, rand_bbox, BBox, Mix, TargetRule, Targets};

fn fixture(file: &str, dtype: DType) -> HashMap<String, Tensor> {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/train_techniques").join(file);
    read_tensors(&p, dtype, &Device::Cpu).unwrap().into_iter().collect()
}

fn values(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

/// Max |a − b| (NaN only where both are NaN) ≤ tol × max(1, max |b|); returns the error.
fn close(what: &str, a: &Tensor, b: &Tensor, tol: f64) -> f64 {
    assert_eq!(a.dims(), b.dims(), "{what}: shapes");
    let (a, b) = (values(a), values(b));
    let mut err = 0f64;
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert_eq!(x.is_nan(), y.is_nan(), "{what}[{i}]: {x} vs {y}");
        if !y.is_nan() {
            err = err.max((x - y).abs());
        }
    }
    let scale = b.iter().filter(|v| !v.is_nan()).fold(1f64, |m, v| m.max(v.abs()));
    eprintln!("{what}: max error {err:.2e} of scale {scale:.3}");
    assert!(err <= tol * scale, "{what}: max error {err:e} > {tol:e} × {scale}");
    err
}

fn grad_of(x: &Tensor, f: impl Fn(&Tensor) -> Tensor) -> (Tensor, Tensor) {
    let v = Var::from_tensor(x).unwrap();
    let value = f(v.as_tensor());
    let g = value.backward().unwrap().get(v.as_tensor()).cloned().unwrap();
    (value.reshape(1).unwrap(), g)
}

#[test]
fn label_smoothing_matches_pytorch_in_f64_and_f32() {
    let f = fixture("smoothing.safetensors", DType::F64);
    let target = f["ls.target"].to_dtype(DType::U32).unwrap();
    for eps in [0.1, 0.3] {
        for (dtype, tag, tol) in [(DType::F64, "64", 1e-10), (DType::F32, "32", 1e-4)] {
            let logits = f["ls.logits"].to_dtype(dtype).unwrap();
            let (v, g) = grad_of(&logits, |x| losses::cross_entropy_smoothed(x, &target, 255, eps).unwrap());
            close(&format!("ε {eps} value ({tag})"), &v, &f[&format!("ls.{eps}.value{tag}")], tol);
            close(&format!("ε {eps} gradient ({tag})"), &g, &f[&format!("ls.{eps}.grad{tag}")], tol);
        }
    }
    // ε = 0 is the plain cross-entropy, and the smoothing changes the value.
    let logits = &f["ls.logits"];
    let plain = losses::cross_entropy(logits, &target, 255).unwrap().to_scalar::<f64>().unwrap();
    assert_eq!(losses::cross_entropy_smoothed(logits, &target, 255, 0.0).unwrap().to_scalar::<f64>().unwrap(), plain);
    assert!((losses::cross_entropy_smoothed(logits, &target, 255, 0.1).unwrap().to_scalar::<f64>().unwrap() - plain).abs() > 1e-3);
}

#[test]
fn cutmix_boxes_match_timm_rand_bbox() {
    let f = fixture("mix.safetensors", DType::F64);
    let (rows_in, rows_out) = (values(&f["bbox.in"]), values(&f["bbox.out"]));
    assert_eq!(rows_in.len() / 5, rows_out.len() / 5);
    for (i, (r, o)) in rows_in.chunks(5).zip(rows_out.chunks(5)).enumerate() {
        let (h, w) = (r[0] as usize, r[1] as usize);
        let b = rand_bbox(h, w, r[2], r[3] as usize, r[4] as usize);
        assert_eq!([b.yl, b.yh, b.xl, b.xh].map(|v| v as f64), [o[0], o[1], o[2], o[3]], "row {i}: {r:?}");
        assert!((cutmix_lam(h, w, b) - o[4]).abs() < 1e-15, "row {i}: λ {} vs {}", cutmix_lam(h, w, b), o[4]);
    }
}

#[test]
fn cutmix_of_a_batch_matches_timm() {
    let f32s = fixture("mix.safetensors", DType::F32);
    let f = fixture("mix.safetensors", DType::F64);
    let p = values(&f["cut.params"]);
    let (h, w) = (10, 13);
    let bbox = rand_bbox(h, w, p[0], p[1] as usize, p[2] as usize);
    assert_eq!(bbox, BBox { yl: p[4] as usize, yh: p[5] as usize, xl: p[6] as usize, xh: p[7] as usize });
    let mix = Mix::CutMix { lam: cutmix_lam(h, w, bbox), bbox };
    assert!((cutmix_lam(h, w, bbox) - p[3]).abs() < 1e-15);
    close("cutmix images", &mix.images(&f32s["x"]).unwrap(), &f32s["cut.x"], 0.0);
    let Targets::One(depth) = mix.targets(&f32s["depth"], TargetRule::Values { positive: false }).unwrap() else { panic!("one target") };
    close("cutmix depth", &depth, &f32s["cut.depth"], 0.0);
    let Targets::One(classes) = mix.targets(&f32s["classes"], TargetRule::Classes).unwrap() else { panic!("one target") };
    close("cutmix classes", &classes, &f32s["cut.classes"], 0.0);
    let classes = classes.to_dtype(DType::U32).unwrap();
    let (v, g) = grad_of(&f["logits"], |x| losses::cross_entropy_smoothed(x, &classes, 255, 0.1).unwrap());
    close("cutmix smoothed CE value", &v, &f["cut.ce.value"], 1e-10);
    close("cutmix smoothed CE gradient", &g, &f["cut.ce.grad"], 1e-10);
}

#[test]
fn mixup_of_a_batch_matches_timm() {
    let f32s = fixture("mix.safetensors", DType::F32);
    let f = fixture("mix.safetensors", DType::F64);
    let lam = values(&f["up.lam"])[0];
    let mix = Mix::MixUp { lam };
    close("mixup images", &mix.images(&f32s["x"]).unwrap(), &f32s["up.x"], 1e-6);
    let Targets::One(depth) = mix.targets(&f32s["depth"], TargetRule::Values { positive: false }).unwrap() else { panic!("one target") };
    close("mixup depth", &depth, &f32s["up.depth"], 1e-6);
    let classes = f["classes"].clone();
    let Targets::Two { a, b, lam: l } = mix.targets(&classes, TargetRule::Classes).unwrap() else { panic!("two targets") };
    assert_eq!(l, lam);
    let (a, b) = (a.to_dtype(DType::U32).unwrap(), b.to_dtype(DType::U32).unwrap());
    let (v, g) = grad_of(&f["logits"], |x| losses::cross_entropy_pair(x, &a, &b, lam, 255, 0.1).unwrap());
    close("mixup CE value", &v, &f["up.ce.value"], 1e-10);
    close("mixup CE gradient", &g, &f["up.ce.grad"], 1e-10);
}
