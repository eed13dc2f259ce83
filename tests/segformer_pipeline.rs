//! SegFormer pre/post-processing parity with `SegformerImageProcessor` (transformers 5.24.0, fixture
//! tests/fixtures/segformer_preprocess from tools/fixtures/segformer_preprocess.py), class maps, and the
//! `edgerun segment` command end to end on the tiny fixture model.
mod common;
use common::{dev, device_arg};
use std::path::PathBuf;

use candle_core::{DType, Tensor};
use edgerun::imageio::{load_rgb, ImageLimits};
use edgerun::models::segformer::SegformerProcessor as Preprocess;
use edgerun::tasks::segment::{resize_argmax, ClassMap, Segmenter, MAX_UINT8_CLASSES};
use edgerun::tensor_io::read_tensors;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

fn values(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

fn max_err(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    values(a).iter().zip(values(b)).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// One 8-bit level after normalisation: 1/255/min(std).
const ONE_LEVEL: f32 = 1.0 / 255.0 / 0.224 + 1e-4;

#[test]
fn preprocess_matches_processor() {
    let dir = fixture("segformer_preprocess");
    let exp = read_tensors(&dir.join("expected.safetensors"), DType::F32, &dev()).unwrap();
    for (tag, size) in [("up", (48, 64)), ("down", (64, 48))] {
        let img = load_rgb(&dir.join(format!("image_{tag}.png")), &ImageLimits::default()).unwrap();
        let pre = Preprocess { size: Some(size), ..Preprocess::default() };
        let got = pre.apply(&img, &dev()).unwrap();
        // Pillow BILINEAR reproduced exactly: only float rounding of the normalisation remains.
        let e = max_err(&got, &exp[&format!("pixel_values_{tag}_pil")]);
        assert!(e <= 1e-5, "{tag} vs PIL backend: {e}");
        // torchvision's uint8 antialias kernel (the 5.x default backend) rounds differently: ≤ one level.
        let e = max_err(&got, &exp[&format!("pixel_values_{tag}")]);
        eprintln!("{tag} vs torchvision backend: {e:e}");
        assert!(e <= ONE_LEVEL, "{tag} vs torchvision backend: {e}");
    }
}

#[test]
fn preprocess_config_parsing() {
    let d = Preprocess::from_json(&serde_json::json!({})).unwrap();
    assert_eq!(d.size, Some((512, 512)));
    // Older hub checkpoints write `size: 512` (square).
    let p = Preprocess::from_json(&serde_json::json!({"size": 640, "resample": 2, "do_reduce_labels": true})).unwrap();
    assert_eq!(p.size, Some((640, 640)));
    let p = Preprocess::from_json(&serde_json::json!({"size": {"height": 256, "width": 320}})).unwrap();
    assert_eq!(p.size, Some((256, 320)));
    assert_eq!(Preprocess::from_json(&serde_json::json!({"do_resize": false})).unwrap().size, None);
    assert!(Preprocess::from_json(&serde_json::json!({"size": {"shortest_edge": 512}})).is_err());
    assert!(Preprocess::from_json(&serde_json::json!({"resample": 5})).is_err());
    assert!(Preprocess::from_json(&serde_json::json!({"image_std": [0.2, 0.0, 0.2]})).is_err());
    // No preprocessor_config.json next to the fixture model: defaults.
    assert_eq!(Preprocess::from_model_path(&fixture("segformer_tiny")).unwrap().size, Some((512, 512)));
}

#[test]
fn postprocess_matches_processor() {
    let dir = fixture("segformer_preprocess");
    let exp = read_tensors(&dir.join("expected.safetensors"), DType::F32, &dev()).unwrap();
    let logits = &exp["logits"];
    for (i, (h, w)) in [(50usize, 37usize), (16, 12)].into_iter().enumerate() {
        let want = values(&exp[&format!("seg_{i}")]);
        let got = resize_argmax(&logits.get(i).unwrap(), h, w).unwrap();
        let up = logits.get(i).unwrap().unsqueeze(0).unwrap().upsample_bilinear2d(h, w, false).unwrap();
        let upv = values(&up);
        let c = logits.dim(1).unwrap();
        for p in 0..h * w {
            if got[p] as f32 != want[p] {
                let mut v: Vec<f32> = (0..c).map(|k| upv[k * h * w + p]).collect();
                v.sort_by(|a, b| b.partial_cmp(a).unwrap());
                assert!(v[0] - v[1] <= 1e-4, "seg_{i} pixel {p}: {} vs {}", got[p], want[p]);
            }
        }
    }
}

fn labels(names: &[&str]) -> Vec<String> {
    names.iter().map(|s| s.to_string()).collect()
}

#[test]
fn class_maps() {
    let ckpt = labels(&["wall", "building", "sky", "bed ", "tree", "road", "water", "house"]);
    let m = ClassMap::parse(
        r#"
default = "background"
[[class]]
name = "background"
[[class]]
name = "building"
labels = ["Building", 7]
color = [200, 10, 10]
[[class]]
name = "road"
labels = ["road"]
[[class]]
name = "vegetation"
labels = ["tree", "BED"]
"#,
        &ckpt,
    )
    .unwrap();
    assert_eq!(m.names, vec!["background", "building", "road", "vegetation"]);
    assert_eq!(m.lut, vec![0, 1, 0, 3, 3, 2, 0, 1]);
    assert_eq!(m.apply(&[1, 7, 5, 6, 4]).unwrap(), vec![1, 1, 2, 0, 3]);
    assert!(m.apply(&[8]).is_err());
    assert_eq!(m.colors[1], [200, 10, 10]);
    assert_eq!(m.colorize(&[1]), vec![200, 10, 10]);
    let meta: serde_json::Value = serde_json::from_str(&m.metadata_json()).unwrap();
    assert_eq!(meta["classes"][1], "building");
    assert_eq!(meta["mapping"][1]["checkpoint_labels"], serde_json::json!([[1, "building"], [7, "house"]]));

    let bad = |t: &str| ClassMap::parse(t, &ckpt).unwrap_err().to_string();
    assert!(bad("[[class]]\nname = \"a\"\nlabels = [\"wall\"]").contains("not mapped"));
    assert!(bad("default = \"a\"\n[[class]]\nname = \"a\"\nlabels = [\"lava\"]").contains("no label `lava`"));
    assert!(bad("default = \"a\"\n[[class]]\nname = \"a\"\nlabels = [9]").contains("outside"));
    assert!(bad("default = \"a\"\n[[class]]\nname = \"a\"\nlabels = [1]\n[[class]]\nname = \"b\"\nlabels = [\"building\"]").contains("both"));
    assert!(bad("default = \"z\"\n[[class]]\nname = \"a\"").contains("not a class"));
    assert!(bad("[[class]]\nname = \"a\"\n[[class]]\nname = \"A\"").contains("twice"));
    let many: String = (0..256).map(|i| format!("[[class]]\nname = \"c{i}\"\n")).collect();
    assert!(bad(&format!("default = \"c0\"\n{many}")).contains("at most 255"));

    // Identity: fine up to 255 checkpoint classes, a clear error above.
    let n255: Vec<String> = (0..MAX_UINT8_CLASSES).map(|i| format!("c{i}")).collect();
    assert_eq!(ClassMap::identity(&n255).unwrap().lut.len(), 255);
    let n256: Vec<String> = (0..256).map(|i| format!("c{i}")).collect();
    let e = ClassMap::identity(&n256).unwrap_err().to_string();
    assert!(e.contains("256 classes") && e.contains("--classes"), "{e}");
}

#[test]
fn shipped_ade20k_class_map_parses() {
    // The example map in models/ against the ADE20K id2label names of the nvidia/segformer-*-ade checkpoints.
    let ade = std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/segformer-ade20k-5class.toml")).unwrap();
    let names: Vec<String> = ADE20K.iter().map(|s| s.to_string()).collect();
    let m = ClassMap::parse(&ade, &names).unwrap();
    assert_eq!(m.names, vec!["background", "building", "road", "vegetation", "water"]);
    assert_eq!(m.lut[1], 1); // building
    assert_eq!(m.lut[6], 2); // road
    assert_eq!(m.lut[4], 3); // tree
    assert_eq!(m.lut[21], 4); // water
    assert_eq!(m.lut[0], 0); // wall -> background
}

/// ADE20K-150 `id2label` (huggingface/label-files `ade20k-id2label.json`; note "bed " with a space).
const ADE20K: [&str; 150] = [
    "wall", "building", "sky", "floor", "tree", "ceiling", "road", "bed ", "windowpane", "grass", "cabinet", "sidewalk",
    "person", "earth", "door", "table", "mountain", "plant", "curtain", "chair", "car", "water", "painting", "sofa",
    "shelf", "house", "sea", "mirror", "rug", "field", "armchair", "seat", "fence", "desk", "rock", "wardrobe", "lamp",
    "bathtub", "railing", "cushion", "base", "box", "column", "signboard", "chest of drawers", "counter", "sand", "sink",
    "skyscraper", "fireplace", "refrigerator", "grandstand", "path", "stairs", "runway", "case", "pool table", "pillow",
    "screen door", "stairway", "river", "bridge", "bookcase", "blind", "coffee table", "toilet", "flower", "book", "hill",
    "bench", "countertop", "stove", "palm", "kitchen island", "computer", "swivel chair", "boat", "bar", "arcade machine",
    "hovel", "bus", "towel", "light", "truck", "tower", "chandelier", "awning", "streetlight", "booth",
    "television receiver", "airplane", "dirt track", "apparel", "pole", "land", "bannister", "escalator", "ottoman",
    "bottle", "buffet", "poster", "stage", "van", "ship", "fountain", "conveyer belt", "canopy", "washer", "plaything",
    "swimming pool", "stool", "barrel", "basket", "waterfall", "tent", "bag", "minibike", "cradle", "oven", "ball", "food",
    "step", "tank", "trade name", "microwave", "pot", "animal", "bicycle", "lake", "dishwasher", "screen", "blanket",
    "sculpture", "hood", "sconce", "vase", "traffic light", "tray", "ashcan", "fan", "pier", "crt screen", "plate",
    "monitor", "bulletin board", "shower", "radiator", "glass", "clock", "flag",
];

#[test]
fn segmenter_runs_batched_and_matches_single() {
    let mut seg = Segmenter::load(&fixture("segformer_uneven"), &dev(), DType::F32).unwrap();
    seg.set_input_size(Some((64, 96)));
    assert_eq!(seg.labels().len(), 5);
    let dir = fixture("segformer_preprocess");
    let a = load_rgb(&dir.join("image_up.png"), &ImageLimits::default()).unwrap();
    let b = load_rgb(&dir.join("image_down.png"), &ImageLimits::default()).unwrap();
    let both = seg.segment(&[&a, &b]).unwrap();
    assert_eq!(both[0].len(), 30 * 40);
    assert_eq!(both[1].len(), 150 * 120);
    assert!(both.iter().flatten().all(|&i| i < 5));
    let single = seg.segment(&[&b]).unwrap();
    assert_eq!(single[0].len(), both[1].len());
    // Same input alone: identical up to float noise from batched matmuls (allow rare near-tie flips).
    let diff = single[0].iter().zip(&both[1]).filter(|(x, y)| x != y).count();
    assert!(diff * 1000 <= single[0].len(), "{diff} pixels differ");
    // A non-SegFormer model is refused.
    assert!(Segmenter::load(&fixture("da2_tiny"), &dev(), DType::F32).is_err());
}

#[test]
fn segment_cli_end_to_end() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let map = tmp.path().join("map.toml");
    std::fs::write(&map, "default = \"other\"\n[[class]]\nname = \"other\"\n[[class]]\nname = \"built\"\nlabels = [\"building\", \"road\"]\n").unwrap();
    let img = fixture("segformer_preprocess").join("image_up.png");
    let run = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_edgerun"))
            .args(["segment", "--model"])
            .arg(fixture("segformer_tiny"))
            .args(["--size", "64x64", "--device", &device_arg(), "--out"])
            .arg(&out)
            .args(args)
            .output()
            .unwrap()
    };
    let r = run(&["--palette", "--classes", map.to_str().unwrap(), img.to_str().unwrap()]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let mask = image::open(out.join("image_up.seg.png")).unwrap();
    assert_eq!(mask.color(), image::ColorType::L8);
    assert_eq!((mask.width(), mask.height()), (40, 30));
    let ids = mask.to_luma8().into_raw();
    assert!(ids.iter().all(|&v| v < 2));
    let color = image::open(out.join("image_up.seg.color.png")).unwrap();
    assert_eq!(color.color(), image::ColorType::Rgb8);
    // Metadata: the class names and the mapping, in a text chunk.
    let bytes = std::fs::read(out.join("image_up.seg.png")).unwrap();
    let text = String::from_utf8_lossy(&bytes);
    assert!(text.contains("edgerun:classes") && text.contains("\"built\"") && text.contains("\"road\""));

    // Same result as the library path (checkpoint ids → map).
    let mut seg = Segmenter::load(&fixture("segformer_tiny"), &dev(), DType::F32).unwrap();
    seg.set_input_size(Some((64, 64)));
    let m = ClassMap::load(&map, seg.labels()).unwrap();
    let a = load_rgb(&img, &ImageLimits::default()).unwrap();
    assert_eq!(m.apply(&seg.segment(&[&a]).unwrap()[0]).unwrap(), ids);

    // Errors: a bad class map, a missing model.
    std::fs::write(&map, "[[class]]\nname = \"x\"\nlabels = [\"lava\"]\n").unwrap();
    let r = run(&["--classes", map.to_str().unwrap(), img.to_str().unwrap()]);
    assert!(!r.status.success());
    assert!(String::from_utf8_lossy(&r.stderr).contains("lava"));
}
