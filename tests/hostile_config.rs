//! Hostile numbers in model configs, preprocessor configs and the annotate TOML: every one is an
//! error (not a panic, an abort or a hang) that names the file, the key, the value and the limit.
mod common;
use common::fixture;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use edgerun::weights::WeightStore;
use serde_json::{json, Value};

/// A copy of fixture `name` with `config.json`'s value at JSON pointer `ptr` replaced by `v`.
fn patched_model(name: &str, ptr: &str, v: Value) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixture(name)).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dir.path().join(p.file_name().unwrap())).unwrap();
    }
    let cfg_path = dir.path().join("config.json");
    let mut cfg: Value = serde_json::from_slice(&std::fs::read(&cfg_path).unwrap()).unwrap();
    let (parent, key) = ptr.rsplit_once('/').unwrap();
    match cfg.pointer_mut(parent).unwrap_or_else(|| panic!("{name}: no {parent}")) {
        Value::Object(m) => {
            m.insert(key.to_string(), v);
        }
        Value::Array(a) => a[key.parse::<usize>().unwrap()] = v,
        _ => panic!("{name}: {parent} is not a container"),
    }
    std::fs::write(&cfg_path, serde_json::to_vec(&cfg).unwrap()).unwrap();
    dir
}

fn load_err(dir: &Path) -> String {
    let store = WeightStore::open(dir).unwrap();
    match edgerun::models::load(Arc::new(store), &Device::Cpu, DType::F32) {
        Ok(_) => panic!("{}: a hostile config was accepted", dir.display()),
        Err(e) => {
            assert!(matches!(e, edgerun::Error::Config(_)), "not a config error: {e}");
            e.to_string()
        }
    }
}

fn assert_names(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "`{p}` missing from: {msg}");
    }
}

const HUGE: u64 = 1 << 40;

#[test]
fn model_config_numbers_are_bounded() {
    // (fixture, JSON pointer, value, what the message must name besides config.json)
    let cases: &[(&str, &str, Value, &[&str])] = &[
        ("da2_tiny", "/patch_size", json!(0), &["`patch_size`", "= 0", "1..=64"]),
        ("da2_tiny", "/backbone_config/hidden_size", json!(HUGE), &["backbone_config.hidden_size", "1099511627776", "16384"]),
        ("da2_tiny", "/backbone_config/num_attention_heads", json!(HUGE), &["backbone_config.num_attention_heads", "1024"]),
        ("da2_tiny", "/backbone_config/num_attention_heads", json!(3), &["backbone_config.num_attention_heads", "= 3", "does not divide"]),
        ("da2_tiny", "/backbone_config/num_hidden_layers", json!(100_000), &["backbone_config.num_hidden_layers", "100000", "256"]),
        ("da2_tiny", "/backbone_config/mlp_ratio", json!(1e300), &["backbone_config.mlp_ratio", "64"]),
        ("da2_tiny", "/backbone_config/image_size", json!(100_000), &["backbone_config.image_size", "100000", "8192"]),
        ("da2_tiny", "/backbone_config/patch_size", json!(0), &["backbone_config.patch_size", "= 0", "1..=64"]),
        ("da2_tiny", "/backbone_config/layer_norm_eps", json!(-1.0), &["backbone_config.layer_norm_eps", "-1"]),
        ("da2_tiny", "/reassemble_factors/0", json!(1e9), &["reassemble_factors[0]", "1000000000", "16"]),
        ("da2_tiny", "/neck_hidden_sizes/0", json!(0), &["neck_hidden_sizes[0]", "= 0", "16384"]),
        ("da2_tiny", "/fusion_hidden_size", json!(HUGE), &["fusion_hidden_size", "1099511627776", "16384"]),
        ("da2_tiny", "/max_depth", json!(1e300), &["max_depth", "1000000"]),
        ("segformer_tiny", "/hidden_sizes/0", json!(HUGE), &["hidden_sizes[0]", "1099511627776", "16384"]),
        ("segformer_tiny", "/sr_ratios/0", json!(0), &["sr_ratios[0]", "= 0", "1..=64"]),
        ("segformer_tiny", "/num_attention_heads/1", json!(3), &["num_attention_heads[1]", "= 3", "hidden_sizes[1]"]),
        ("segformer_tiny", "/depths/0", json!(100_000), &["depths[0]", "100000", "256"]),
        ("segformer_tiny", "/mlp_ratios/0", json!(1e12), &["mlp_ratios[0]", "64"]),
        ("segformer_tiny", "/decoder_hidden_size", json!(HUGE), &["decoder_hidden_size", "16384"]),
        ("chmv2_tiny", "/patch_size", json!(0), &["`patch_size`", "= 0"]),
        ("chmv2_tiny", "/number_output_channels", json!(HUGE), &["number_output_channels", "65536"]),
        ("chmv2_tiny", "/backbone_config/num_register_tokens", json!(1_000_000_000_000u64), &["backbone_config.num_register_tokens", "256"]),
        ("chmv2_tiny", "/backbone_config/intermediate_size", json!(HUGE), &["backbone_config.intermediate_size", "65536"]),
        ("chmv2_tiny", "/reassemble_factors/1", json!(1e-9), &["reassemble_factors[1]", "16"]),
        ("chmv2_tiny", "/backbone_config/rope_theta", json!(-5.0), &["backbone_config.rope_theta", "-5"]),
        ("lgatr_tiny", "/attention/num_heads", json!(HUGE), &["attention.num_heads", "1099511627776", "1024"]),
        ("lgatr_tiny", "/mlp/mlp_ratio", json!(HUGE), &["mlp.mlp_ratio", "16"]),
        ("lgatr_tiny", "/hidden_mv_channels", json!(HUGE), &["hidden_mv_channels", "1024"]),
        ("lgatr_tiny", "/attention/attn_ratio", json!(HUGE), &["attention.attn_ratio", "16"]),
        ("lgatr_tiny", "/num_blocks", json!(100_000), &["num_blocks", "256"]),
        ("lgatr_slim_tiny", "/num_heads", json!(HUGE), &["num_heads", "1024"]),
        ("lgatr_slim_tiny", "/hidden_s_channels", json!(HUGE), &["hidden_s_channels", "16384"]),
        ("da3_mono", "/net/embed_dim", json!(0), &["net.embed_dim", "= 0"]),
        ("da3_mono", "/net/img_size", json!(100_000), &["net.img_size", "8192"]),
        ("da3_mono", "/net/num_heads", json!(HUGE), &["net.num_heads", "1024"]),
        ("da3_mono", "/head/down_ratio", json!(1000), &["head.down_ratio", "1000"]),
        ("da3_mono", "/head/features", json!(HUGE), &["head.features", "16384"]),
        ("sam3_tiny", "/vision_config/backbone_config/patch_size", json!(0), &["vision_config.backbone_config.patch_size", "= 0"]),
        ("sam3_tiny", "/vision_config/backbone_config/hidden_size", json!(HUGE), &["vision_config.backbone_config.hidden_size", "16384"]),
        ("sam3_tiny", "/vision_config/backbone_config/window_size", json!(0), &["vision_config.backbone_config.window_size", "= 0"]),
        ("sam3_tiny", "/vision_config/backbone_config/global_attn_indexes", json!([1, 99]), &["global_attn_indexes[1]", "99"]),
        ("sam3_tiny", "/vision_config/backbone_config/image_size", json!(HUGE), &["vision_config.backbone_config.image_size", "8192"]),
        ("sam3_tiny", "/vision_config/scale_factors", json!([2.0, 1.0]), &["vision_config.scale_factors", "[2.0, 1.0]"]),
        ("sam3_tiny", "/text_config/max_position_embeddings", json!(HUGE), &["text_config.max_position_embeddings", "1024"]),
        ("sam3_tiny", "/text_config/vocab_size", json!(0), &["text_config.vocab_size", "= 0"]),
        ("sam3_tiny", "/detr_decoder_config/num_queries", json!(HUGE), &["detr_decoder_config.num_queries", "4096"]),
        ("sam3_tiny", "/detr_encoder_config/num_layers", json!(100_000), &["detr_encoder_config.num_layers", "256"]),
        ("sam3_tiny", "/detr_decoder_config/hidden_size", json!(24), &["detr_decoder_config.hidden_size", "= 24", "share one width"]),
        ("sam3_tiny", "/mask_decoder_config/num_attention_heads", json!(5), &["mask_decoder_config.num_attention_heads", "= 5"]),
        ("sam3_tiny", "/geometry_encoder_config/hidden_act", json!("swoosh"), &["geometry_encoder_config.hidden_act", "swoosh"]),
    ];
    for (name, ptr, v, parts) in cases {
        let dir = patched_model(name, ptr, v.clone());
        let msg = load_err(dir.path());
        assert_names(&msg, parts);
        assert_names(&msg, &["config.json"]);
    }
}

#[test]
fn a_gguf_config_is_named_as_its_metadata() {
    use candle_core::quantized::GgmlDType;
    use edgerun::quantize::{quantize, recipe::Recipe};
    let dir = patched_model("da2_tiny", "/patch_size", json!(0));
    let gguf = dir.path().join("m.gguf");
    quantize(dir.path(), &gguf, GgmlDType::F16, &Recipe::default(), |_| {}).unwrap();
    let msg = load_err(&gguf);
    assert_names(&msg, &["m.gguf", "edgerun.config", "`patch_size`", "= 0", "1..=64"]);
}

#[test]
fn the_shipped_fixtures_are_within_the_limits() {
    for name in ["da2_tiny", "segformer_tiny", "chmv2_tiny", "lgatr_tiny", "lgatr_slim_tiny", "da3_mono", "da3_anyview"] {
        let store = WeightStore::open(fixture(name)).unwrap();
        edgerun::models::load(Arc::new(store), &Device::Cpu, DType::F32).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

/// A directory holding only a `preprocessor_config.json` with `v`.
fn preprocessor(v: Value) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("preprocessor_config.json");
    std::fs::write(&p, serde_json::to_vec(&v).unwrap()).unwrap();
    (dir, p)
}

#[test]
fn preprocessor_numbers_are_bounded() {
    use edgerun::models::chmv2::Chmv2Processor as ChmPreprocess;
    use edgerun::models::depth_anything::DptProcessor as DepthPreprocess;
    let depth: &[(Value, &[&str])] = &[
        (json!({"size": {"height": 100002, "width": 518}}), &["size.height", "100002", "8192"]),
        (json!({"size": {"height": 518, "width": 0}}), &["size.width", "= 0"]),
        (json!({"ensure_multiple_of": 1000000}), &["ensure_multiple_of", "1000000", "1024"]),
        (json!({"image_std": [0.0, 1.0, 1.0]}), &["image_std[0]", "= 0"]),
        (json!({"image_mean": [1e30, 0.0, 0.0]}), &["image_mean[0]", "10000"]),
    ];
    for (v, parts) in depth {
        let (dir, _) = preprocessor(v.clone());
        let msg = DepthPreprocess::for_model(dir.path()).expect_err("accepted").to_string();
        assert_names(&msg, parts);
        assert_names(&msg, &["preprocessor_config.json"]);
    }
    let chm: &[(Value, &[&str])] = &[
        (json!({"size_divisor": 1000000}), &["size_divisor", "1000000", "1024"]),
        (json!({"do_resize": true, "ensure_multiple_of": 1000000}), &["ensure_multiple_of", "1024"]),
        (json!({"size": {"height": 100002, "width": 384}}), &["size.height", "8192"]),
        (json!({"rescale_factor": 1e9}), &["rescale_factor", "1000000000"]),
    ];
    for (v, parts) in chm {
        let (_dir, p) = preprocessor(v.clone());
        let msg = ChmPreprocess::from_file(&p).expect_err("accepted").to_string();
        assert_names(&msg, parts);
        assert_names(&msg, &["preprocessor_config.json"]);
    }
    let seg: &[(Value, &[&str])] = &[
        (json!({"size": {"height": 100002, "width": 512}}), &["size.height", "100002", "8192"]),
        (json!({"size": 100002}), &["size.height", "8192"]),
        (json!({"rescale_factor": -1.0}), &["rescale_factor", "-1"]),
    ];
    for (v, parts) in seg {
        let (dir, _) = preprocessor(v.clone());
        let msg = edgerun::models::segformer::SegformerProcessor::from_model_path(dir.path()).expect_err("accepted").to_string();
        assert_names(&msg, parts);
        assert_names(&msg, &["preprocessor_config.json"]);
    }
}

#[test]
fn shared_ops_refuse_degenerate_sizes() {
    use edgerun::nn::interpolate::{bicubic, bicubic_map, bilinear, Resize};
    let x = Tensor::zeros((1, 2, 4, 4), DType::F32, &Device::Cpu).unwrap();
    assert!(bilinear(&x, 0, 0, true).is_err());
    assert!(bilinear(&x, 8, 0, false).is_err());
    assert!(bicubic(&x, Resize::ScaleFactor(1e12, 1e12)).is_err());
    assert!(bicubic(&x, Resize::Size(0, 3)).is_err());
    assert!(bicubic(&x, Resize::Size(1 << 40, 3)).is_err());
    assert!(bicubic_map(&[0.0; 15], 4, 4, 8, 8).is_err());
    assert!(bicubic_map(&[0.0; 16], 4, 4, 0, 8).is_err());
    let img = image::RgbImage::new(4, 4);
    let pre = edgerun::models::processor::to_pixel_values(&img, 100_000, 100_000, edgerun::imageio::resample::Filter::Bilinear, [0.0; 3], [1.0; 3], &Device::Cpu);
    assert!(pre.unwrap_err().to_string().contains("100000"));
    let seg = edgerun::models::segformer::SegformerProcessor { size: Some((100_000, 100_000)), ..Default::default() };
    assert!(seg.apply(&img, &Device::Cpu).is_err());
    let da3 = edgerun::models::da3::Da3Processor { process_res: 10_000_000, ..Default::default() };
    assert!(da3.pixel_values(&img, &Device::Cpu).is_err());
}

#[test]
fn annotate_numbers_are_bounded_before_anything_is_created() {
    use edgerun::annotate::{Config, RunOptions, Shard};
    let cases: &[(&str, &[&str])] = &[
        ("prefetch = 1000000000", &["`prefetch`", "1000000000", "1024"]),
        ("batch = 1000000000", &["1000000000", "256"]),
        ("memory_mb = 1000000000000", &["`memory_mb`", "1048576"]),
        ("decode_threads = 100000", &["`decode_threads`", "1024"]),
        ("write_threads = 100000", &["`write_threads`", "1024"]),
        ("[journal]\nsync_every = 0", &["journal.sync_every", "= 0"]),
        ("[journal]\nsync_interval_s = 1e300", &["journal.sync_interval_s"]),
        ("[progress]\ninterval_s = nan", &["progress.interval_s", "NaN"]),
        ("[limits]\nmax_side = 0", &["limits.max_side", "= 0"]),
        ("[segmentation]\ninput_size = [100000, 100000]", &["segmentation.input_size.height", "8192"]),
    ];
    for (toml, parts) in cases {
        // A value the TOML reader already refuses (e.g. a batch that is not `auto` or 1..=256) is
        // refused the same way: by name and limit, before anything is created.
        let mut cfg = match Config::from_toml(&format!("stages = [\"edges\"]\n{toml}\n"), Path::new(".")) {
            Ok(c) => c,
            Err(e) => {
                assert_names(&e.to_string(), parts);
                continue;
            }
        };
        cfg.stages = vec![edgerun::annotate::StageKind::Edges];
        assert_names(&cfg.validate().expect_err(toml).to_string(), parts);
        let input = tempfile::tempdir().unwrap();
        let out_parent = tempfile::tempdir().unwrap();
        let output = out_parent.path().join("out");
        let opts = RunOptions { config: cfg, input: input.path().to_path_buf(), output: output.clone(), shard: Shard::default(), retry_failed: false, rescan: false };
        assert!(edgerun::annotate::run(&opts).is_err(), "{toml}");
        assert!(!output.exists(), "{toml}: a refused config created {}", output.display());
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("annotate.toml");
    std::fs::write(&file, "prefetch = 1000000000\n").unwrap();
    assert_names(&Config::load(&file).unwrap().validate().unwrap_err().to_string(), &["annotate.toml", "`prefetch`", "1000000000", "1024"]);
}
