//! Every op on a fine-tuning path has a backward that agrees with central finite differences in
//! f64 — including the ops whose fast Candle kernels record no backward (edgerun's differentiable
//! paths in `nn::grad`) and Candle's strided conv backward, which is wrong for uneven remainders.
use std::sync::Arc;

use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{Conv2d, Conv2dConfig, ConvTranspose2d, ConvTranspose2dConfig, LayerNorm};
use edgerun::models::chmv2::{self, Chmv2, Chmv2Family};
use edgerun::models::depth_anything::{self, DepthAnything};
use edgerun::models::family::Family;
use edgerun::models::segformer::{self, SegformerFamily, SegformerForSemanticSegmentation};
use edgerun::models::training::TrainingLayout;
use edgerun::train::select::{select, TrainSpec};
use edgerun::nn::grad;
use edgerun::weights::{Trainable, Vb, WeightStore};

const DEV: Device = Device::Cpu;

/// Deterministic pseudo-random values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f64> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 11) as f64 / (1u64 << 52) as f64 - 1.0
        })
        .collect()
}

fn var(shape: &[usize], seed: u64) -> Var {
    let n = shape.iter().product();
    Var::from_tensor(&Tensor::from_vec(values(n, seed), shape, &DEV).unwrap()).unwrap()
}

/// A scalar that weighs every output element differently, so no gradient can cancel out.
fn weigh(y: &Tensor) -> Tensor {
    let w = Tensor::from_vec(values(y.elem_count(), 99), y.dims(), &DEV).unwrap();
    (y * w).unwrap().sum_all().unwrap()
}

/// Checks d f / d v for every Var in `vars` (up to `per_var` coordinates each) against central
/// differences; a Var the backward leaves without a gradient fails the check.
fn check(vars: &[(&str, &Var)], f: &dyn Fn() -> Tensor, per_var: usize) {
    let grads = f().backward().unwrap();
    let all: Vec<Vec<f64>> = vars
        .iter()
        .map(|(name, v)| grads.get(v.as_tensor()).unwrap_or_else(|| panic!("{name}: no gradient")).flatten_all().unwrap().to_vec1::<f64>().unwrap())
        .collect();
    // Errors are measured against the largest gradient of the check: rounding in components many
    // orders below it (an analytically zero key bias) is not an error, a dropped gradient is.
    let scale = all.iter().flatten().fold(1e-3f64, |m, v| m.max(v.abs()));
    for ((name, v), g) in vars.iter().zip(&all) {
        let base = v.as_tensor().flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let n = base.len();
        let step = (n / per_var).max(1);
        for i in (0..n).step_by(step) {
            let eval = |d: f64| {
                let mut p = base.clone();
                p[i] += d;
                v.set(&Tensor::from_vec(p, v.dims(), &DEV).unwrap()).unwrap();
                f().to_scalar::<f64>().unwrap()
            };
            let h = 1e-5;
            let fd = (eval(h) - eval(-h)) / (2.0 * h);
            v.set(&Tensor::from_vec(base.clone(), v.dims(), &DEV).unwrap()).unwrap();
            let err = (fd - g[i]).abs() / scale;
            assert!(err < 1e-6, "{name}[{i}]: backward {} vs finite difference {fd} (largest gradient {scale})", g[i]);
        }
    }
}

#[test]
fn bilinear_by_matmul_equals_the_kernel() {
    let x = Tensor::from_vec(values(2 * 3 * 5 * 7, 1).iter().map(|&v| v as f32).collect::<Vec<_>>(), (2, 3, 5, 7), &DEV).unwrap();
    for &(oh, ow) in &[(10, 14), (11, 20), (3, 4), (5, 7), (1, 9)] {
        for align in [false, true] {
            let fast = x.upsample_bilinear2d(oh, ow, align).unwrap();
            let mm = grad::bilinear_by_matmul(&x, oh, ow, align).unwrap();
            let d = (fast - mm).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(d < 1e-5, "{oh}×{ow} align {align}: max difference {d}");
        }
    }
}

#[test]
fn bilinear_backward_matches_finite_differences() {
    for align in [false, true] {
        let x = var(&[1, 2, 4, 5], 2);
        check(&[("x", &x)], &|| weigh(&grad::bilinear(x.as_tensor(), 7, 11, align).unwrap()), 40);
        check(&[("x", &x)], &|| weigh(&grad::bilinear(x.as_tensor(), 3, 3, align).unwrap()), 40);
    }
}

#[test]
fn layer_norm_and_softmax_backward_match_finite_differences() {
    let (x, w, b) = (var(&[2, 3, 6], 3), var(&[6], 4), var(&[6], 5));
    let norm = LayerNorm::new(w.as_tensor().clone(), b.as_tensor().clone(), 1e-6);
    check(&[("x", &x), ("weight", &w), ("bias", &b)], &|| weigh(&grad::layer_norm(&norm, x.as_tensor()).unwrap()), 36);
    check(&[("x", &x)], &|| weigh(&grad::softmax_last_dim(x.as_tensor()).unwrap()), 36);
}

#[test]
fn the_fast_kernels_drop_gradients_that_the_grad_paths_keep() {
    // Guards the premise: if Candle starts recording these backwards, nn::grad can be simplified.
    let x = var(&[2, 6], 6);
    let fused = candle_nn::ops::softmax_last_dim(x.as_tensor()).unwrap();
    assert!(weigh(&fused).backward().unwrap().get(x.as_tensor()).is_none());
    let ours = grad::softmax_last_dim(x.as_tensor()).unwrap();
    assert!(weigh(&ours).backward().unwrap().get(x.as_tensor()).is_some());
}

#[test]
fn strided_conv_backward_is_right_for_uneven_remainders() {
    let (x, w, b) = (var(&[2, 3, 4, 5], 7), var(&[4, 3, 3, 3], 8), var(&[4], 9));
    let conv = edgerun::nn::conv::Conv2d::new(w.as_tensor().clone(), Some(b.as_tensor().clone()), Conv2dConfig { stride: 2, padding: 1, ..Default::default() });
    // Candle's own backward fails on this shape (its input gradient comes out 4×6).
    assert!(weigh(&conv.forward_candle(x.as_tensor()).unwrap()).backward().is_err());
    let y = conv.forward(x.as_tensor()).unwrap();
    let want = conv.forward_candle(&x.as_tensor().detach()).unwrap();
    assert_eq!(y.dims(), want.dims());
    let d = (y.detach() - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f64>().unwrap();
    assert!(d < 1e-12, "forward differs by {d}");
    check(&[("x", &x), ("weight", &w), ("bias", &b)], &|| weigh(&conv.forward(x.as_tensor()).unwrap()), 30);
}

#[test]
fn conv_and_transposed_conv_backward_match_finite_differences() {
    let (x, w, b) = (var(&[1, 3, 5, 4], 10), var(&[2, 3, 3, 3], 11), var(&[2], 12));
    let conv = Conv2d::new(w.as_tensor().clone(), Some(b.as_tensor().clone()), Conv2dConfig { padding: 1, ..Default::default() });
    check(&[("x", &x), ("weight", &w), ("bias", &b)], &|| weigh(&conv.forward(x.as_tensor()).unwrap()), 30);
    let (wt, bt) = (var(&[3, 2, 2, 2], 13), var(&[2], 14));
    let up = ConvTranspose2d::new(wt.as_tensor().clone(), Some(bt.as_tensor().clone()), ConvTranspose2dConfig { stride: 2, ..Default::default() });
    check(&[("x", &x), ("weight", &wt), ("bias", &bt)], &|| weigh(&up.forward(x.as_tensor()).unwrap()), 30);
}

#[test]
fn activations_backward_match_finite_differences() {
    let x = var(&[3, 7], 15);
    check(&[("x", &x)], &|| weigh(&x.as_tensor().gelu_erf().unwrap()), 21);
    check(&[("x", &x)], &|| weigh(&candle_nn::ops::sigmoid(x.as_tensor()).unwrap()), 21);
    check(&[("x", &x)], &|| weigh(&x.as_tensor().relu().unwrap()), 21);
}

/// The whole Depth Anything path that `train = "last:1"` trains — backbone block (LayerNorm,
/// attention softmax, GELU MLP, layer scale), final norm, neck (reassemble, strided conv,
/// transposed convs, fusion with bilinear resizes) and head — in f64 at an uneven 4×5 patch grid.
#[test]
fn depth_anything_backward_matches_finite_differences() {
    let store = Arc::new(WeightStore::open("tests/fixtures/da2_relative_p14").unwrap());
    let chosen = |n: &str| !n.starts_with("backbone.") || n.starts_with("backbone.encoder.layer.3.") || n.starts_with("backbone.layernorm.");
    let trainable = Trainable::new(chosen);
    let vb = Vb::new(store.clone(), DType::F64, DEV).with_trainable(trainable.clone());
    let model = DepthAnything::load(&vb, &depth_anything::Config::from_json(store.config()).unwrap()).unwrap();
    let vars = trainable.vars();
    // Every selected tensor the model reads became a Var; transformers stores an unused residual
    // unit for the first fusion layer, which is never loaded.
    let unused = |n: &str| n.starts_with("neck.fusion_stage.layers.0.residual_layer1.");
    let expect: Vec<&String> = store.entries().keys().filter(|n| chosen(n) && !unused(n)).collect();
    assert_eq!(vars.iter().map(|(n, _)| n).collect::<Vec<_>>(), expect);
    let x = Tensor::from_vec(values(3 * 56 * 70, 16), (1, 3, 56, 70), &DEV).unwrap();
    let f = || weigh(&model.forward(&x).unwrap());
    let pick: Vec<(&str, &Var)> = vars.iter().map(|(n, v)| (n.as_str(), v)).collect();
    check(&pick, &f, 3);
}

/// Loads `fixture` in f64 with the tensors `spec` selects as Vars; checks that every selected tensor
/// the model reads became a Var and returns them.
fn trainable_f64<M>(fixture: &str, layout: Option<TrainingLayout>, spec: TrainSpec, load: impl Fn(&Vb, &serde_json::Value) -> M) -> (M, Vec<(String, Var)>) {
    let store = Arc::new(WeightStore::open(fixture).unwrap());
    let names: Vec<String> = store.entries().keys().cloned().collect();
    let chosen = select(&layout.unwrap(), spec, &names).unwrap();
    let trainable = Trainable::new({
        let chosen = chosen.clone();
        move |n| chosen.contains(n)
    });
    let vb = Vb::new(store.clone(), DType::F64, DEV).with_trainable(trainable.clone());
    let model = load(&vb, store.config());
    let vars = trainable.vars();
    let unused = |n: &str| n.ends_with("mask_token");
    let expect: Vec<&String> = chosen.iter().filter(|n| !unused(n)).collect();
    assert_eq!(vars.iter().map(|(n, _)| n).collect::<Vec<_>>(), expect, "{fixture}: every selected tensor trains");
    (model, vars)
}

/// SegFormer as `train = "last:3"` trains it — the last block of stage 2, its stage norm, stage 3's
/// overlapping patch embedding (strided conv), both stage-3 blocks (sequence-reduction-free
/// attention, Mix-FFN with the channels-last depthwise kernel and fused GELU) and the unfolded
/// decode head (projections, bilinear upsampling, `linear_fuse`, eval-mode BatchNorm, classifier) —
/// in f64 at an uneven 36×44 input (stage grids 9×11, 5×6, 3×3, 2×2).
#[test]
fn segformer_backward_matches_finite_differences() {
    let (model, vars) = trainable_f64("tests/fixtures/segformer_tiny", SegformerFamily::TRAINING, TrainSpec::Last(3), |vb, c| {
        SegformerForSemanticSegmentation::load(vb, &segformer::Config::from_json(c).unwrap()).unwrap()
    });
    assert!(vars.iter().any(|(n, _)| n == "segformer.encoder.patch_embeddings.3.proj.weight"));
    assert!(vars.iter().any(|(n, _)| n == "decode_head.batch_norm.weight"));
    let x = Tensor::from_vec(values(3 * 36 * 44, 30), (1, 3, 36, 44), &DEV).unwrap();
    let f = || weigh(&model.forward(&x).unwrap());
    let pick: Vec<(&str, &Var)> = vars.iter().map(|(n, v)| (n.as_str(), v)).collect();
    check(&pick, &f, 2);
}

/// SegFormer with every parameter training, the sequence-reduction convs (stride 8, 4, 2) included.
#[test]
fn segformer_backward_reaches_every_parameter() {
    let (model, vars) = trainable_f64("tests/fixtures/segformer_tiny", SegformerFamily::TRAINING, TrainSpec::All, |vb, c| {
        SegformerForSemanticSegmentation::load(vb, &segformer::Config::from_json(c).unwrap()).unwrap()
    });
    let x = Tensor::from_vec(values(3 * 36 * 44, 31), (1, 3, 36, 44), &DEV).unwrap();
    let f = || weigh(&model.forward(&x).unwrap());
    let pick: Vec<(&str, &Var)> = vars.iter().filter(|(n, _)| n.contains(".sr.") || n.contains("patch_embeddings.0.")).map(|(n, v)| (n.as_str(), v)).collect();
    assert!(pick.len() >= 8);
    check(&pick, &f, 2);
    let grads = f().backward().unwrap();
    for (n, v) in &vars {
        assert!(grads.get(v.as_tensor()).is_some(), "{n}: no gradient");
    }
}

/// CHMv2 as `train = "last:1"` trains it — the last DINOv3 block (RoPE attention, layer scale), the
/// final norm, the readout projection, reassemble (transposed convs), fusion, the conv head and the
/// mixlog bins → heights stage — in f64 at a 3×4 patch grid.
#[test]
fn chmv2_backward_matches_finite_differences() {
    let (model, vars) = trainable_f64("tests/fixtures/chmv2_tiny", Chmv2Family::TRAINING, TrainSpec::Last(1), |vb, c| Chmv2::load(vb, &chmv2::Config::from_json(c).unwrap()).unwrap());
    assert!(vars.iter().any(|(n, _)| n.starts_with("backbone.layer.1.")) && !vars.iter().any(|(n, _)| n.starts_with("backbone.layer.0.")));
    let x = Tensor::from_vec(values(3 * 48 * 64, 32), (1, 3, 48, 64), &DEV).unwrap();
    let f = || weigh(&model.forward(&x).unwrap());

    let pick: Vec<(&str, &Var)> = vars.iter().map(|(n, v)| (n.as_str(), v)).collect();
    check(&pick, &f, 2);
}

#[test]
fn losses_backward_match_finite_differences() {
    use edgerun::train::losses;
    let p = Var::from_tensor(&Tensor::from_vec(values(2 * 3 * 4, 20).iter().map(|v| v + 1.5).collect::<Vec<_>>(), (2, 3, 4), &DEV).unwrap()).unwrap();
    let mut t = values(2 * 3 * 4, 21).iter().map(|v| 1.2 + v).collect::<Vec<_>>();
    t[3] = f64::NAN;
    t[17] = f64::INFINITY;
    let t = Tensor::from_vec(t, (2, 3, 4), &DEV).unwrap();
    check(&[("pred", &p)], &|| losses::silog(p.as_tensor(), &t, 0.5).unwrap(), 24);
    check(&[("pred", &p)], &|| losses::ssi(p.as_tensor(), &t).unwrap(), 24);
    check(&[("pred", &p)], &|| losses::l1(p.as_tensor(), &t).unwrap(), 24);
    let x = var(&[2, 4, 2, 3], 22);
    let classes = Tensor::new(&[[[0u32, 3, 255], [1, 2, 2]], [[3, 255, 0], [1, 1, 0]]], &DEV).unwrap();
    check(&[("logits", &x)], &|| losses::cross_entropy(x.as_tensor(), &classes, 255).unwrap(), 48);
    check(&[("logits", &x)], &|| losses::focal(x.as_tensor(), &classes, 2.0, 255).unwrap(), 48);
    check(&[("logits", &x)], &|| losses::cross_entropy_smoothed(x.as_tensor(), &classes, 255, 0.2).unwrap(), 48);
    let partner = Tensor::new(&[[[3u32, 255, 0], [1, 1, 0]], [[0u32, 3, 255], [1, 2, 2]]], &DEV).unwrap();
    check(&[("logits", &x)], &|| losses::cross_entropy_pair(x.as_tensor(), &classes, &partner, 0.35, 255, 0.1).unwrap(), 48);
}

/// Every parameter's gradient of `weigh(forward(x))` with `fixture` loaded in `dtype`, `spec` training.
fn model_gradients<M>(fixture: &str, layout: Option<TrainingLayout>, spec: TrainSpec, dtype: DType, load: &dyn Fn(&Vb, &serde_json::Value) -> M, forward: &dyn Fn(&M, &Tensor) -> Tensor, x: &Tensor) -> Vec<(String, Tensor)> {
    let store = Arc::new(WeightStore::open(fixture).unwrap());
    let names: Vec<String> = store.entries().keys().cloned().collect();
    let chosen = select(&layout.unwrap(), spec, &names).unwrap();
    let trainable = Trainable::new(move |n| chosen.contains(n));
    let vb = Vb::new(store.clone(), dtype, DEV).with_trainable(trainable.clone());
    let model = load(&vb, store.config());
    let y = forward(&model, &x.to_dtype(dtype).unwrap()).to_dtype(DType::F64).unwrap();
    let grads = weigh(&y).backward().unwrap();
    trainable.vars().into_iter().map(|(n, v)| {
        let g = grads.get(v.as_tensor()).unwrap_or_else(|| panic!("{fixture} {n}: no gradient")).to_dtype(DType::F64).unwrap();
        (n, g)
    }).collect()
}

/// The f32 training kernels (convs, attention, LayerNorm, GELU and bilinear resizes with their own
/// backward) against the f64 paths checked by finite differences above, through whole models with
/// every parameter training: each parameter's gradient within 1e-4 of the largest.
#[test]
fn f32_training_kernels_give_the_f64_gradients_through_whole_models() {
    type Load<M> = dyn Fn(&Vb, &serde_json::Value) -> M;
    fn compare<M>(fixture: &str, layout: Option<TrainingLayout>, spec: TrainSpec, load: &Load<M>, forward: &dyn Fn(&M, &Tensor) -> Tensor, x: &Tensor) {
        let fast = model_gradients(fixture, layout, spec, DType::F32, load, forward, x);
        let exact = model_gradients(fixture, layout, spec, DType::F64, load, forward, x);
        let scale = exact.iter().map(|(_, g)| g.abs().unwrap().max_all().unwrap().to_scalar::<f64>().unwrap()).fold(1.0f64, f64::max);
        for ((name, a), (_, b)) in fast.iter().zip(&exact) {
            let err = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f64>().unwrap();
            assert!(err <= 1e-4 * scale, "{fixture} {name}: f32 gradient off by {err} (largest gradient {scale})");
        }
    }
    let da2 = |vb: &Vb, c: &serde_json::Value| DepthAnything::load(vb, &depth_anything::Config::from_json(c).unwrap()).unwrap();
    let x = Tensor::from_vec(values(3 * 56 * 70, 40), (1, 3, 56, 70), &DEV).unwrap();
    compare("tests/fixtures/da2_relative_p14", depth_anything::DepthAnythingFamily::TRAINING, TrainSpec::All, &da2, &|m, x| m.forward(x).unwrap(), &x);
    let seg = |vb: &Vb, c: &serde_json::Value| SegformerForSemanticSegmentation::load(vb, &segformer::Config::from_json(c).unwrap()).unwrap();
    let x = Tensor::from_vec(values(2 * 3 * 36 * 44, 41), (2, 3, 36, 44), &DEV).unwrap();
    compare("tests/fixtures/segformer_tiny", SegformerFamily::TRAINING, TrainSpec::All, &seg, &|m, x| m.forward(x).unwrap(), &x);
    let chm = |vb: &Vb, c: &serde_json::Value| Chmv2::load(vb, &chmv2::Config::from_json(c).unwrap()).unwrap();
    let x = Tensor::from_vec(values(3 * 48 * 64, 42), (1, 3, 48, 64), &DEV).unwrap();
    compare("tests/fixtures/chmv2_tiny", Chmv2Family::TRAINING, TrainSpec::All, &chm, &|m, x| m.forward(x).unwrap(), &x);
}
