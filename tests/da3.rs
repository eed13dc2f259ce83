//! Parity of Depth Anything 3 against fixtures from the `depth-anything-3` 0.1.1 package's own
//! classes (tools/fixtures/da3.py), and the DA3 preprocessing, sky and checkpoint handling.
mod common;

use std::sync::Arc;

use candle_core::{DType, Tensor};
use common::*;
use edgerun::imageio::{load_rgb, ImageLimits};
use edgerun::models::da3::replace_sky_depth;
use edgerun::models::da3::Da3Processor;
use edgerun::tasks::depth::DepthEstimator;
use edgerun::tensor_io::{read_tensors, write_tensors};
use edgerun::weights::WeightStore;

fn parity(name: &str, suffix: &str, outputs: &[&str]) {
    let dir = fixture(name);
    let model = load_model(&dir, DType::F32);
    let inputs = tensors(&dir, &format!("input{suffix}.safetensors"));
    let expected = tensors(&dir, &format!("expected{suffix}.safetensors"));
    let out = model.forward_named(&inputs).expect("forward");
    for o in outputs {
        assert_close(&format!("{name}{suffix} {o}"), &out[*o], &expected[*o], F32_REL);
    }
}

#[test]
fn anyview_single_view_rope_qknorm_camera_token() {
    parity("da3_anyview", "", &["depth", "depth_conf"]);
}

#[test]
fn anyview_two_views_cross_view_attention() {
    parity("da3_anyview", "_s2", &["depth", "depth_conf"]);
}

#[test]
fn anyview_three_views_reference_view_reordering() {
    parity("da3_anyview", "_s3", &["depth", "depth_conf"]);
}

#[test]
fn anyview_four_d_input_is_one_view_per_sample() {
    let dir = fixture("da3_anyview");
    let model = load_model(&dir, DType::F32);
    let mut inputs = tensors(&dir, "input.safetensors");
    let x = inputs["pixel_values"].squeeze(1).unwrap();
    inputs.insert("pixel_values".into(), x);
    let expected = tensors(&dir, "expected.safetensors");
    let out = model.forward_named(&inputs).unwrap();
    assert_eq!(out["depth"].dims(), &[2, 42, 70]);
    assert_close("4-D depth", &out["depth"], &expected["depth"].squeeze(1).unwrap(), F32_REL);
}

#[test]
fn mono_depth_and_sky() {
    parity("da3_mono", "", &["depth", "sky"]);
}

#[test]
fn mono_sky_replacement_matches_the_package_per_image() {
    let dir = fixture("da3_mono");
    let model = load_model(&dir, DType::F32);
    let out = model.forward_named(&tensors(&dir, "input.safetensors")).unwrap();
    let expected = tensors(&dir, "expected.safetensors");
    let (b, h, w) = out["depth"].dims3().unwrap();
    let mut replaced = Vec::new();
    for k in 0..b {
        let mut d = out["depth"].get(k).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let s = out["sky"].get(k).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(replace_sky_depth(&mut d, &s).is_some(), "fixture should have sky and non-sky pixels");
        replaced.extend(d);
    }
    let got = Tensor::from_vec(replaced, (b, h, w), &dev()).unwrap();
    assert_close("depth_sky_replaced", &got, &expected["depth_sky_replaced"], F32_REL);
}

#[test]
fn ray_branch_and_camera_modules_are_never_read() {
    let src = fixture("da3_anyview");
    let tmp = tempfile::tempdir().unwrap();
    let all = read_tensors(&src.join("model.safetensors"), DType::F32, &dev()).unwrap();
    let n_all = all.len();
    let kept: edgerun::models::NamedTensors =
        all.into_iter().filter(|(k, _)| !(k.contains("_aux") || k.starts_with("model.cam_enc.") || k.starts_with("model.cam_dec."))).collect();
    assert!(kept.len() < n_all - 50, "the fixture should hold aux / camera tensors");
    write_tensors(&tmp.path().join("model.safetensors"), &kept).unwrap();
    std::fs::copy(src.join("config.json"), tmp.path().join("config.json")).unwrap();
    let model = load_model(tmp.path(), DType::F32);
    let out = model.forward_named(&tensors(&src, "input.safetensors")).unwrap();
    let expected = tensors(&src, "expected.safetensors");
    assert_close("depth without aux/camera tensors", &out["depth"], &expected["depth"], F32_REL);
}

#[test]
fn hub_config_is_recognised_by_model_name_and_bad_shapes_are_errors() {
    let src = fixture("da3_mono");
    let tmp = tempfile::tempdir().unwrap();
    std::fs::copy(src.join("model.safetensors"), tmp.path().join("model.safetensors")).unwrap();
    std::fs::write(tmp.path().join("config.json"), r#"{"model_name": "da3mono-large"}"#).unwrap();
    let store = WeightStore::open(tmp.path()).unwrap();
    assert_eq!(edgerun::models::architecture(&store).as_deref(), Some("da3_mono"));
    // the preset is ViT-L; the tiny weights do not fit it: an error, not a panic
    let err = edgerun::models::load(Arc::new(store), &dev(), DType::F32).err().expect("shape mismatch must fail");
    assert!(err.to_string().contains("shape") || err.to_string().contains("expected"), "{err}");
    std::fs::write(tmp.path().join("config.json"), r#"{"model_name": "da3nested-giant-large"}"#).unwrap();
    let store = WeightStore::open(tmp.path()).unwrap();
    assert!(edgerun::models::load(Arc::new(store), &dev(), DType::F32).is_err());
}

#[test]
fn bad_inputs_are_errors() {
    let model = load_model(&fixture("da3_anyview"), DType::F32);
    let mut inputs = edgerun::models::NamedTensors::new();
    inputs.insert("pixel_values".into(), Tensor::zeros((1, 1, 3, 40, 42), DType::F32, &dev()).unwrap());
    assert!(model.forward_named(&inputs).is_err(), "H not a multiple of 14");
    inputs.insert("pixel_values".into(), Tensor::zeros((3, 42, 42), DType::F32, &dev()).unwrap());
    assert!(model.forward_named(&inputs).is_err(), "3-D input");
}

#[test]
fn preprocessing_matches_the_package_input_processor() {
    let dir = fixture("da3_preprocess");
    let expected = tensors(&dir, "expected.safetensors");
    let pre = Da3Processor { process_res: 70, ..Default::default() };
    for tag in ["up", "down", "exact", "portrait"] {
        let img = load_rgb(&dir.join(format!("image_{tag}.png")), &ImageLimits::default()).unwrap();
        let resized = pre.resize(&img).unwrap();
        let want_u8 = &expected[&format!("resized_uint8_{tag}")];
        let (_, h, w) = want_u8.dims3().unwrap();
        assert_eq!((resized.height() as usize, resized.width() as usize), (h, w), "{tag} size");
        let got_u8 = Tensor::from_vec(resized.as_raw().iter().map(|v| *v as f32).collect::<Vec<_>>(), (h, w, 3), &dev())
            .unwrap()
            .permute((2, 0, 1))
            .unwrap();
        let diff = (got_u8 - want_u8).unwrap().abs().unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let max = diff.iter().cloned().fold(0f32, f32::max);
        let n_off = diff.iter().filter(|d| **d > 0.0).count();
        eprintln!("{tag}: {h}x{w}, max |Δ| {max} levels, {n_off} of {} values differ", diff.len());
        // Only `up` (30x40 -> 52x70 -> 56x70) enlarges, so only it goes through cv2's cubic, which may
        // differ by one level right at rounding ties; the other three shrink (INTER_AREA) and are bit-exact.
        if tag == "up" {
            assert!(max <= 1.0 && n_off * 1000 <= diff.len(), "{tag} (cubic): max {max}, {n_off} values differ");
        } else {
            assert_eq!(n_off, 0, "{tag} (area): must be bit-exact, max {max} levels");
        }
        let pv = pre.pixel_values(&img, &dev()).unwrap();
        let (err, _) = errors(&pv, &expected[&format!("pixel_values_{tag}")]);
        assert!(err <= 1.0 / 255.0 / 0.224 + 1e-5, "{tag}: pixel_values max error {err}");
    }
}

#[test]
fn preprocessing_sizes_follow_upper_bound_resize() {
    let pre = Da3Processor::default();
    // 640x480: longest to 504 -> 504x378 -> 378 = 27*14
    assert_eq!(pre.sizes(480, 640), ((378, 504), (378, 504)));
    // 1080x1920: 283.5 -> 284 (half to even) -> 280
    assert_eq!(pre.sizes(1080, 1920), ((284, 504), (280, 504)));
    // square, already 504
    assert_eq!(pre.sizes(504, 504), ((504, 504), (504, 504)));
    // 7 = 14/2: ties go up
    let small = Da3Processor { process_res: 70, ..Default::default() };
    assert_eq!(small.sizes(21, 70).1, (28, 70));
}

#[test]
fn depth_estimator_writes_da3_outputs_at_image_size() {
    let est = DepthEstimator::load(&fixture("da3_anyview"), &dev(), DType::F32)
        .unwrap()
        .with_processor(Arc::new(Da3Processor { process_res: 56, ..Default::default() }));
    let img = load_rgb(&fixture("da3_preprocess").join("image_down.png"), &ImageLimits::default()).unwrap();
    // Two other images of the same size, so all share one network input size and one forward pass.
    let flipped = image::imageops::flip_horizontal(&img);
    let inverted = image::RgbImage::from_fn(img.width(), img.height(), |x, y| image::Rgb(img.get_pixel(x, y).0.map(|c| 255 - c)));
    let p = est.predict_all(&[&img, &flipped], 2).unwrap();
    assert_eq!(p.len(), 2);
    assert_eq!((p[0].depth.height, p[0].depth.width), (100, 150));
    let conf = p[0].confidence.as_ref().expect("any-view models give a confidence");
    assert!(conf.values.iter().all(|v| v.is_finite()));
    assert!(p[0].sky.is_none());

    // Batched images are independent: replacing the second image changes its outputs and leaves the
    // first image's depth and confidence as they were, and as the first image gets alone.
    let q = est.predict_all(&[&img, &inverted], 2).unwrap();
    let alone = est.predict_all(&[&img], 1).unwrap();
    let rel = |a: &[f32], b: &[f32]| {
        assert_eq!(a.len(), b.len());
        let scale = b.iter().fold(1f32, |m, v| m.max(v.abs()));
        a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max) / scale
    };
    assert!(rel(&p[1].depth.values, &q[1].depth.values) > 1e-2, "the second image was replaced");
    assert!(rel(&p[0].depth.values, &p[1].depth.values) > 1e-2, "different images, different depth");
    for (what, a, b) in [
        ("depth, other neighbour", &p[0].depth, &q[0].depth),
        ("depth, alone", &p[0].depth, &alone[0].depth),
        ("confidence, other neighbour", conf, q[0].confidence.as_ref().unwrap()),
    ] {
        let e = rel(&a.values, &b.values);
        assert!(e <= F32_REL, "first image's {what}: max relative difference {e:e}");
    }

    let mono = DepthEstimator::load(&fixture("da3_mono"), &dev(), DType::F32)
        .unwrap()
        .with_processor(Arc::new(Da3Processor { process_res: 56, ..Default::default() }));
    let p = mono.predict_all(&[&img], 1).unwrap();
    assert!(p[0].sky.is_some() && p[0].confidence.is_none());
}

#[test]
fn quantized_gguf_with_the_builtin_recipe_loads_and_runs() {
    use candle_core::quantized::GgmlDType;
    use edgerun::quantize::{quantize, Recipe};
    let dir = fixture("da3_mono");
    let recipe = Recipe::builtin("da3_mono").unwrap().expect("built-in DA3 recipe");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("da3_q8.gguf");
    let mut quantized = Vec::new();
    quantize(&dir, &out, GgmlDType::Q8_0, &recipe, |r| {
        if r.dtype == GgmlDType::Q8_0 {
            quantized.push(r.name.clone());
        }
    })
    .unwrap();
    // width 24: only fc2 (inner 96) fits Q8_0's 32-blocks; the rest falls back to f16
    assert!(quantized.iter().any(|n| n.ends_with("mlp.fc2.weight")), "{quantized:?}");
    assert!(quantized.iter().all(|n| n.starts_with("model.backbone.pretrained.blocks.")), "{quantized:?}");
    let m = load_model(&out, DType::F32);
    let got = m.forward_named(&tensors(&dir, "input.safetensors")).unwrap();
    let (err, max_ref) = errors(&got["depth"], &tensors(&dir, "expected.safetensors")["depth"]);
    eprintln!("da3_mono Q8_0 GGUF: max abs error {err:.4} (max|ref| {max_ref:.2})");
    // Measured 0.0088; the bound is 3.4× that.
    assert!(err <= 0.03, "depth max abs error {err}");
}

fn edgerun_depth(args: &[&std::ffi::OsStr]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_edgerun")).args(["depth", "--device", &device_arg()]).args(args).output().expect("run edgerun")
}

#[test]
fn cli_depth_writes_confidence_and_sky_mask() {
    let img = fixture("da3_preprocess").join("image_up.png");
    for (model, conf, sky) in [("da3_anyview", true, false), ("da3_mono", false, true)] {
        let out = tempfile::tempdir().unwrap();
        let o = edgerun_depth(&["--model".as_ref(), fixture(model).as_os_str(), "--out".as_ref(), out.path().as_os_str(), img.as_os_str()]);
        assert!(o.status.success(), "{model}: {}", String::from_utf8_lossy(&o.stderr));
        let ((h, w), d) = edgerun::imageio::npy::read_npy_2d(&out.path().join("image_up.depth.npy")).unwrap();
        assert_eq!((h, w), (30, 40));
        assert!(d.iter().all(|v| v.is_finite() && *v > 0.0), "{model}: depth is exp, so positive");
        assert_eq!(out.path().join("image_up.conf.npy").exists(), conf, "{model}");
        assert_eq!(out.path().join("image_up.sky.png").exists(), sky, "{model}");
    }
}

#[test]
fn metric_model_needs_a_focal_and_scales_by_it() {
    let tmp = tempfile::tempdir().unwrap();
    let src = fixture("da3_mono");
    std::fs::copy(src.join("model.safetensors"), tmp.path().join("model.safetensors")).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    cfg["model_type"] = "da3_metric".into();
    std::fs::write(tmp.path().join("config.json"), cfg.to_string()).unwrap();
    let img = load_rgb(&fixture("da3_preprocess").join("image_down.png"), &ImageLimits::default()).unwrap();
    let da3 = Da3Processor { process_res: 70, ..Default::default() };
    let pre = Arc::new(da3);
    let metric = DepthEstimator::load(tmp.path(), &dev(), DType::F32).unwrap().with_processor(pre.clone());
    assert!(metric.predict(&[&img], 1).is_err(), "no focal: error");
    // 100x150 -> 42x70: width scaled by 70/150, height by 42/100 (a non-uniform resize, so a swapped
    // w/h ratio gives another factor). focal' = 900 * (70/150 + 42/100) / 2 = 399 px at the network
    // input, so metric = mono * 399/300 = 1.33 * mono (swapped ratios would give 1.47, no scaling 1).
    assert_eq!(da3.input_size(100, 150), (42, 70));
    let factor = 900.0 * (70.0 / 150.0 + 42.0 / 100.0) / 2.0 / 300.0;
    assert!((factor - 1.33f32).abs() < 1e-6);
    let d_metric = metric.with_focal(Some(900.0)).unwrap().predict(&[&img], 1).unwrap();
    let mono = DepthEstimator::load(&src, &dev(), DType::F32).unwrap().with_processor(pre);
    let d_mono = mono.predict(&[&img], 1).unwrap();
    assert_eq!(d_metric[0].values.len(), 100 * 150);
    assert_eq!(d_metric[0].values.len(), d_mono[0].values.len());
    for (a, b) in d_metric[0].values.iter().zip(&d_mono[0].values) {
        assert!((a - factor * b).abs() <= 1e-5 * (factor * b).abs().max(1.0), "{a} vs {factor} * {b}");
    }
    assert!(DepthEstimator::load(&src, &dev(), DType::F32).unwrap().with_focal(Some(-1.0)).is_err());
}
