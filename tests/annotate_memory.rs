//! `edgerun annotate` under memory pressure: with `EDGERUN_INJECT_OOM_ABOVE` every forward pass over
//! N images fails as a device out of memory does; the batch halves, the same images are retried, the
//! journal records each image exactly once, and the outputs equal those of a batch-1 run.
mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::{device_arg as device, small_model};

/// Twelve images of one size in two directories.
fn tree(root: &Path) {
    for i in 0..12u32 {
        let img = image::RgbImage::from_fn(28, 21, |x, y| image::Rgb([(x * 9 + i * 13) as u8, (y * 11 + i) as u8, ((x ^ y) + i * 7) as u8]));
        let p = root.join(if i % 2 == 0 { "a" } else { "b/c" }).join(format!("img_{i:02}.png"));
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        img.save(p).unwrap();
    }
}

fn annotate(models: &Path, input: &Path, out: &Path, batch: &str, inject: Option<&str>) -> Output {
    let depth = models.join("depth");
    let seg = models.join("seg");
    let dev = device();
    let mut c = Command::new(env!("CARGO_BIN_EXE_edgerun"));
    c.args(["annotate", "--stages", "depth,edges,segmentation", "--device", &dev, "--batch", batch, "--progress", "none"]);
    c.arg("--model").arg(format!("depth={}", depth.display()));
    c.arg("--model").arg(format!("segmentation={}", seg.display()));
    c.arg(input).arg(out);
    if let Some(n) = inject {
        c.env("EDGERUN_INJECT_OOM_ABOVE", n);
    }
    c.output().unwrap()
}

/// Every file under the stage directories, relative path → bytes.
fn outputs(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack: Vec<PathBuf> = ["depth", "edges", "segmentation"].iter().map(|s| dir.join(s)).collect();
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.insert(p.strip_prefix(dir).unwrap().to_string_lossy().into_owned(), std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

/// (input, status) of every journal record of `stage`.
fn journal(dir: &Path, stage: &str) -> Vec<(String, String)> {
    let text = std::fs::read_to_string(dir.join("manifests").join(format!("{stage}.jsonl"))).unwrap();
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let input = v.get("input").or_else(|| v.get("file")).and_then(|x| x.as_str()).unwrap_or_default().to_string();
            (input, v.get("status").and_then(|x| x.as_str()).unwrap_or_default().to_string())
        })
        .collect()
}

fn setup(t: &Path) -> (PathBuf, PathBuf) {
    let models = t.join("models");
    small_model("da2_relative_p14", &models.join("depth"), r#"{"size": {"height": 42, "width": 42}, "ensure_multiple_of": 14, "keep_aspect_ratio": true}"#);
    small_model("segformer_uneven", &models.join("seg"), r#"{"size": {"height": 32, "width": 32}}"#);
    let input = t.join("in");
    tree(&input);
    (models, input)
}

#[test]
fn injected_out_of_memory_backs_off_and_journals_each_image_once() {
    let t = tempfile::tempdir().unwrap();
    let (models, input) = setup(t.path());
    let reference = t.path().join("ref");
    let o = annotate(&models, &input, &reference, "1", None);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = t.path().join("oom");
    let o = annotate(&models, &input, &out, "8", Some("2"));
    let e = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "{e}");
    for stage in ["depth", "segmentation"] {
        assert!(e.contains(&format!("{stage}: out of memory on a batch of 8: batch 8 → 4, retrying the same items")), "{e}");
        assert!(e.contains(&format!("{stage}: out of memory on a batch of 4: batch 4 → 2")), "{e}");
    }
    for stage in ["depth", "edges", "segmentation"] {
        let mut recs = journal(&out, stage);
        assert_eq!(recs.len(), 12, "{stage}: {recs:?}");
        recs.sort();
        recs.dedup_by(|a, b| a.0 == b.0);
        assert_eq!(recs.len(), 12, "{stage}: an image journaled twice");
        assert!(recs.iter().all(|(_, s)| s == "ok"), "{stage}: {recs:?}");
    }
    let (a, b) = (outputs(&reference), outputs(&out));
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    let differ: Vec<&String> = a.iter().filter(|(k, v)| b.get(*k) != Some(v)).map(|(k, _)| k).collect();
    assert!(differ.is_empty(), "outputs differ from the batch-1 run: {differ:?}");
}

#[test]
fn out_of_memory_at_batch_one_records_each_image_failed_once() {
    let t = tempfile::tempdir().unwrap();
    let (models, input) = setup(t.path());
    let out = t.path().join("oom0");
    let o = annotate(&models, &input, &out, "auto", Some("0"));
    let e = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(e.contains("recorded as failed"), "{e}");
    for stage in ["depth", "segmentation"] {
        let recs = journal(&out, stage);
        assert_eq!(recs.len(), 12, "{stage}: {recs:?}");
        assert!(recs.iter().all(|(_, s)| s == "failed"), "{stage}: {recs:?}");
    }
    // A rerun without the pressure retries them (--retry-failed) and completes every image.
    let dev = device();
    let o = Command::new(env!("CARGO_BIN_EXE_edgerun"))
        .args(["annotate", "--stages", "depth,edges,segmentation", "--device", &dev, "--progress", "none", "--retry-failed"])
        .arg("--model")
        .arg(format!("depth={}", models.join("depth").display()))
        .arg("--model")
        .arg(format!("segmentation={}", models.join("seg").display()))
        .arg(&input)
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(outputs(&out).keys().filter(|k| k.starts_with("depth/")).count(), 12);
}
