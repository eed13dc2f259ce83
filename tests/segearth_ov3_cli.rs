//! Open-vocabulary segmentation as a user runs it: `edgerun segment` with a SAM 3 model writes the
//! official segmentor's class maps (the `segearth_ov3` fixture), whole or in tiles; `annotate`'s
//! segmentation stage runs SAM 3 with a SegFormer fallback that writes the same class table; and bad
//! class lists and flags get a clear error naming the file or flag, never a panic.
mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::{fixture, tensors};

fn edgerun(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_edgerun")).args(args).output().expect("run edgerun")
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn gray(p: &Path) -> Vec<u8> {
    image::open(p).unwrap().to_luma8().into_raw()
}

fn sam3() -> PathBuf {
    fixture("sam3_tiny")
}

/// The fixture's images copied into a fresh input folder.
fn inputs(root: &Path) -> PathBuf {
    let dir = root.join("in");
    std::fs::create_dir_all(&dir).unwrap();
    for n in ["scene_0", "scene_1", "scene_2", "scene_3"] {
        std::fs::copy(fixture("segearth_ov3").join(format!("{n}.png")), dir.join(format!("{n}.png"))).unwrap();
    }
    dir
}

#[test]
fn segment_writes_the_official_class_maps_with_names_scores_and_palette() {
    let t = tempfile::tempdir().unwrap();
    let (input, out) = (inputs(t.path()), t.path().join("out"));
    let classes = fixture("segearth_ov3").join("threshold.txt");
    let o = edgerun(&["segment", "--model", s(&sam3()), "--classes", s(&classes), "--conf", "0.2", "--prob-thd", "0.35", "--bg-idx", "5", "--slide", "80:48", "--scores", "--palette", s(&input), "--out", s(&out), "--device", "cpu"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let want = tensors(&fixture("segearth_ov3"), "expected.safetensors");
    for n in ["scene_0", "scene_1", "scene_2", "scene_3"] {
        let got = gray(&out.join(format!("{n}.seg.png")));
        let expected = want[&format!("threshold/{n}/classes")].flatten_all().unwrap().to_vec1::<u8>().unwrap();
        assert!(got == expected, "{n}: the class map differs from the reference's");
        assert!(out.join(format!("{n}.seg.color.png")).is_file());
        let npy = std::fs::read(out.join(format!("{n}.scores.npy"))).unwrap();
        let img = image::open(input.join(format!("{n}.png"))).unwrap();
        assert_eq!(npy.len(), 128 + 2 * 6 * img.width() as usize * img.height() as usize, "{n}: scores (6 classes, float16)");
    }
    let png = std::fs::File::open(out.join("scene_0.seg.png")).unwrap();
    let reader = png::Decoder::new(std::io::BufReader::new(png)).read_info().unwrap();
    let info = reader.info();
    let meta = info.uncompressed_latin1_text.iter().find(|c| c.keyword == "edgerun:classes").map(|c| c.text.clone());
    let meta = meta.or_else(|| info.utf8_text.iter().find(|c| c.keyword == "edgerun:classes").and_then(|c| c.get_text().ok()));
    let meta = meta.or_else(|| info.compressed_latin1_text.iter().find(|c| c.keyword == "edgerun:classes").and_then(|c| c.get_text().ok()));
    let v: serde_json::Value = serde_json::from_str(&meta.expect("edgerun:classes metadata")).unwrap();
    assert_eq!(v["classes"], serde_json::json!(["road", "building", "grass", "tree", "car", "clutter"]));
    assert_eq!(v["bg_idx"], 5);
}

#[test]
fn prompts_and_presets_name_the_same_classes_as_a_class_file() {
    let t = tempfile::tempdir().unwrap();
    let input = inputs(t.path());
    let file = fixture("segearth_ov3").join("openearthmap.txt");
    let model = sam3();
    let run = |name: &str, extra: &[&str]| {
        let out = t.path().join(name);
        let mut args = vec!["segment", "--model", s(&model), "--device", "cpu", "--out", s(&out), s(&input)];
        args.extend_from_slice(extra);
        let o = edgerun(&args);
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        gray(&out.join("scene_1.seg.png"))
    };
    let by_file = run("file", &["--classes", s(&file), "--conf", "0.1", "--prob-thd", "0.1"]);
    let by_preset = run("preset", &["--preset", "OpenEarthMap"]);
    let by_prompts = run("prompts", &["--prompts", "background;bareland,barren;grass;pavement;road;tree,forest;water,river;cropland;building,roof,house", "--conf", "0.1", "--prob-thd", "0.1"]);
    assert!(by_file == by_preset, "the preset's class map differs from the class file's");
    assert!(by_file == by_prompts, "--prompts' class map differs from the class file's");
    let want = tensors(&fixture("segearth_ov3"), "expected.safetensors");
    assert!(by_file == want["openearthmap/scene_1/classes"].flatten_all().unwrap().to_vec1::<u8>().unwrap(), "the class map differs from the reference's");
}

#[test]
fn tiles_of_a_raster_blend_class_scores_then_threshold() {
    let t = tempfile::tempdir().unwrap();
    let input = inputs(t.path()).join("scene_1.png");
    let out = t.path().join("out");
    let o = edgerun(&["segment", "--model", s(&sam3()), "--preset", "potsdam", "--prob-thd", "0.45", "--tile", "96", "--overlap", "16", s(&input), "--out", s(&out), "--device", "cpu"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let tif = image::open(out.join("scene_1.seg.tif")).unwrap().to_luma8();
    assert_eq!(tif.dimensions(), (200, 150));
    let ids: std::collections::BTreeSet<u8> = tif.pixels().map(|p| p.0[0]).collect();
    assert!(ids.contains(&5), "the potsdam background (5) below prob_thd: {ids:?}");
    assert!(ids.iter().all(|&i| i < 6), "{ids:?}");
}

#[test]
fn annotate_runs_sam3_and_its_segformer_fallback_writes_the_same_class_table() {
    let t = tempfile::tempdir().unwrap();
    let input = inputs(t.path());
    let config = |model: &str| {
        format!(
            "stages = [\"segmentation\"]\ndevice = \"cpu\"\n[segmentation]\nmodel = \"{model}\"\nfallback = [\"{}\"]\npreset = \"openearthmap\"\nslide = [96, 64]\n",
            fixture("segformer_uneven").display()
        )
    };
    let run = |name: &str, model: &str| {
        let cfg = t.path().join(format!("{name}.toml"));
        std::fs::write(&cfg, config(model)).unwrap();
        let out = t.path().join(name);
        let o = edgerun(&["annotate", "--config", s(&cfg), s(&input), s(&out)]);
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        out
    };
    let out = run("sam3", s(&sam3()));
    let journal = std::fs::read_to_string(out.join("manifests/segmentation.jsonl")).unwrap();
    assert_eq!(journal.lines().filter(|l| l.contains(&format!("\"model\":\"{}\"", sam3().display()))).count(), 4, "{journal}");
    let want = tensors(&fixture("segearth_ov3"), "expected.safetensors");
    assert!(gray(&out.join("segmentation/scene_2.png")) == want["openearthmap_slide/scene_2/classes"].flatten_all().unwrap().to_vec1::<u8>().unwrap(), "annotate's class map differs from the reference's");

    let out = run("fallback", &t.path().join("missing-model").display().to_string());
    let journal = std::fs::read_to_string(out.join("manifests/segmentation.jsonl")).unwrap();
    assert!(journal.lines().all(|l| l.contains("segformer_uneven")), "{journal}");
    let ids: std::collections::BTreeSet<u8> = gray(&out.join("segmentation/scene_0.png")).into_iter().collect();
    // segformer_uneven's labels: background, building, road, vegetation, water; the OpenEarthMap
    // classes: background 0, road 4, water 6, building 8 (vegetation names none: background).
    assert!(ids.iter().all(|i| [0, 4, 6, 8].contains(i)), "{ids:?}");
}

#[test]
fn bad_class_lists_and_flags_get_a_clear_error() {
    let t = tempfile::tempdir().unwrap();
    let input = inputs(t.path()).join("scene_3.png");
    let file = |name: &str, bytes: &[u8]| {
        let p = t.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    };
    let many: String = (0..300).map(|i| format!("class{i}\n")).collect();
    let model = sam3();
    let prompts: String = (0..4100).map(|i| format!("p{i}")).collect::<Vec<_>>().join(",");
    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec!["--classes".into(), s(&file("latin1.txt", b"caf\xe9\nroad")).into()], "UTF-8"),
        (vec!["--classes".into(), s(&file("empty.txt", b"\n\n")).into()], "no classes"),
        (vec!["--classes".into(), s(&file("gap.txt", b"road\n\ntree")).into()], "line 2: an empty class"),
        (vec!["--classes".into(), s(&file("syn.txt", b"road,,street")).into()], "empty synonym"),
        (vec!["--classes".into(), s(&file("many.txt", many.as_bytes())).into()], "uint8"),
        (vec!["--classes".into(), s(&t.path().join("absent.txt")).into()], "absent.txt"),
        (vec!["--prompts".into(), prompts], "more than 4096 prompts"),
        (vec!["--prompts".into(), "road;;tree".into()], "class 2: an empty class"),
        (vec!["--prompts".into(), "road".into(), "--classes".into(), s(&file("ok.txt", b"road")).into()], "not both"),
        (vec!["--preset".into(), "mars".into()], "preset `mars` is not one of openearthmap"),
        (vec!["--prompts".into(), "road;tree".into(), "--bg-idx".into(), "2".into()], "bg_idx 2 is not a class id"),
        (vec!["--prompts".into(), "road".into(), "--conf".into(), "1.5".into()], "conf 1.5"),
        (vec!["--prompts".into(), "road".into(), "--prob-thd".into(), "NaN".into()], "prob_thd NaN"),
        (vec!["--prompts".into(), "road".into(), "--slide".into(), "64:x".into()], "--slide `64:x`"),
        (vec!["--prompts".into(), "road".into(), "--slide".into(), "64:128".into()], "the stride 1 to the crop"),
        (vec!["--prompts".into(), "road".into(), "--size".into(), "64x64".into()], "--size does not apply"),
        (vec![], "needs its classes named"),
    ];
    for (extra, want) in cases {
        let out = t.path().join("out");
        let mut args: Vec<&str> = vec!["segment", "--model", s(&model), "--device", "cpu", "--out", s(&out), s(&input)];
        args.extend(extra.iter().map(String::as_str));
        let o = edgerun(&args);
        let err = stderr(&o);
        assert!(!o.status.success() && err.contains(want), "{extra:?}: want `{want}` in:\n{err}");
        assert!(!err.contains("panicked"), "{extra:?}: {err}");
        assert!(!out.join("scene_3.seg.png").exists(), "{extra:?}: an output was written");
    }
    // A SegFormer takes none of SAM 3's flags.
    let o = edgerun(&["segment", "--model", s(&fixture("segformer_uneven")), "--prompts", "road", s(&input), "--out", s(&t.path().join("o2"))]);
    assert!(!o.status.success() && stderr(&o).contains("--prompts needs a SAM 3 model"), "{}", stderr(&o));
}

/// A prompt longer than the text context is cut as the reference's tokenizer cuts it (start, the
/// first tokens, end): it segments, and the same as another that shares those tokens.
#[test]
fn a_prompt_longer_than_the_context_is_cut_as_the_reference_cuts_it() {
    let t = tempfile::tempdir().unwrap();
    let input = inputs(t.path()).join("scene_3.png");
    let run = |name: &str, prompts: &str| {
        let out = t.path().join(name);
        let o = edgerun(&["segment", "--model", s(&sam3()), "--device", "cpu", "--prompts", prompts, "--scores", s(&input), "--out", s(&out)]);
        assert!(o.status.success(), "{}", stderr(&o));
        std::fs::read(out.join("scene_3.scores.npy")).unwrap()
    };
    // The tiny context is 8 tokens: start, 6 more, end; one-letter words are one token each, so these
    // prompts share their first 6 tokens and differ after.
    assert!(run("long", "road;a b c d e f g h") == run("cut", "road;a b c d e f x"), "a cut prompt's scores changed with what was cut");
    assert!(run("long2", "road;a b c d e f g h") != run("other", "road;a b c d e x"), "different prompts gave the same scores");
}

/// A GGUF that stores the classes' prompt features (and no text encoder) segments as the full model
/// does; its stored prompts, one class each, are the classes when none are named.
#[test]
fn a_gguf_with_stored_prompts_segments_without_its_text_encoder() {
    let t = tempfile::tempdir().unwrap();
    let input = inputs(t.path()).join("scene_2.png");
    let classes = fixture("segearth_ov3").join("plain.txt");
    let gguf = t.path().join("sam3-plain.gguf");
    let o = edgerun(&["quantize", "--type", "f32", "--prompts", s(&classes), "--quiet", s(&sam3()), s(&gguf)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let run = |name: &str, model: &Path, extra: &[&str]| {
        let out = t.path().join(name);
        let mut args = vec!["segment", "--model", s(model), "--device", "cpu", "--conf", "0.3", s(&input), "--out", s(&out)];
        args.extend_from_slice(extra);
        let o = edgerun(&args);
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        gray(&out.join("scene_2.seg.png"))
    };
    let want = tensors(&fixture("segearth_ov3"), "expected.safetensors")["plain/scene_2/classes"].flatten_all().unwrap().to_vec1::<u8>().unwrap();
    assert!(run("stored", &gguf, &["--classes", s(&classes)]) == want, "the stored prompts' class map differs from the reference's");
    assert!(run("implied", &gguf, &[]) == want, "the stored prompts as classes differ from the class file's");
    let o = edgerun(&["segment", "--model", s(&gguf), "--prompts", "tree;lake", s(&input), "--out", s(&t.path().join("x"))]);
    assert!(!o.status.success() && stderr(&o).contains("\"lake\" is not among the 5 this file stores"), "{}", stderr(&o));
}
