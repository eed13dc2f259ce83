//! Paths read back from files the program did not just write (the input-list cache, journals) are
//! untrusted: `..`, absolute paths and symlinks out of the root never make `annotate` read outside
//! the input root or create anything outside the output directory.
mod common;
use common::fixture;
use std::io::Cursor;
use std::path::{Path, PathBuf};

use edgerun::annotate::journal::read_records;
use edgerun::annotate::listing::{list_inputs, mtime_ns};
use edgerun::annotate::{self, Config, Fingerprint, RunOptions, Shard, StageKind};
use edgerun::paths::safe_join;
use serde_json::json;

fn png(path: &Path) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let img = image::RgbImage::from_fn(20, 16, |x, y| image::Rgb([(x * 9) as u8, (y * 13) as u8, 7]));
    let mut buf = Cursor::new(Vec::new());
    img.write_to(&mut buf, image::ImageFormat::Png).unwrap();
    std::fs::write(path, buf.into_inner()).unwrap();
}

/// Every path under `dir`, relative, sorted.
fn tree(dir: &Path) -> Vec<String> {
    fn walk(base: &Path, d: &Path, out: &mut Vec<String>) {
        for e in std::fs::read_dir(d).unwrap().flatten() {
            let p = e.path();
            out.push(p.strip_prefix(base).unwrap().to_string_lossy().into_owned());
            if p.is_dir() && !p.is_symlink() {
                walk(base, &p, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

/// `T/data/in` (one image), `T/secret/s.png` outside it, `T/out` for the outputs.
struct Layout {
    _t: tempfile::TempDir,
    top: PathBuf,
    input: PathBuf,
    output: PathBuf,
    secret: PathBuf,
}

fn layout() -> Layout {
    let t = tempfile::tempdir().unwrap();
    let top = t.path().canonicalize().unwrap();
    let input = top.join("data").join("in");
    png(&input.join("a.png"));
    let secret = top.join("secret").join("s.png");
    png(&secret);
    let output = top.join("out");
    Layout { _t: t, top, input, output, secret }
}

fn default_exts() -> Vec<String> {
    Config::default().extensions
}

/// Writes a cache that today's code trusts (current directory mtimes) listing `a.png` and `extra`.
fn hostile_cache(l: &Layout, extra: &[&str]) -> PathBuf {
    let mdir = l.output.join("manifests");
    std::fs::create_dir_all(&mdir).unwrap();
    let md = |p: &Path| std::fs::metadata(p).unwrap();
    let file = |rel: &str, p: &Path| json!({"rel": rel, "size": md(p).len(), "mtime_ns": mtime_ns(&md(p))});
    let mut files = vec![file("a.png", &l.input.join("a.png"))];
    files.extend(extra.iter().map(|r| file(r, &l.secret)));
    let cache = json!({
        "version": 1,
        "root": l.input.to_string_lossy(),
        "extensions": default_exts(),
        "exclude": null,
        "fingerprint": "mtime",
        "dirs": [["", mtime_ns(&md(&l.input))], ["../../secret", mtime_ns(&md(l.secret.parent().unwrap()))]],
        "files": files,
        "skipped": [],
    });
    let p = mdir.join("filelist.json");
    std::fs::write(&p, serde_json::to_vec(&cache).unwrap()).unwrap();
    p
}

#[test]
fn a_hostile_input_list_cache_is_dropped_and_rebuilt() {
    let l = layout();
    let abs = l.secret.to_string_lossy().into_owned();
    let cache = hostile_cache(&l, &["../../secret/s.png", &abs]);
    let listing = list_inputs(&l.input, &default_exts(), None, Fingerprint::Mtime, &cache, false).unwrap();
    assert!(!listing.from_cache, "a cache with `..` and absolute entries was trusted");
    assert_eq!(listing.files.iter().map(|f| f.rel.as_str()).collect::<Vec<_>>(), ["a.png"]);
    assert!(listing.warnings.iter().any(|w| w.contains("..") && w.contains("filelist.json")), "{:?}", listing.warnings);
    // The rewritten cache holds only the real input, and is trusted next time.
    let again = list_inputs(&l.input, &default_exts(), None, Fingerprint::Mtime, &cache, false).unwrap();
    assert!(again.warnings.is_empty(), "{:?}", again.warnings);
    assert_eq!(again.files.len(), 1);
}

#[test]
fn annotate_never_reads_or_writes_outside_its_roots() {
    let l = layout();
    let models = l.top.join("models");
    std::fs::create_dir_all(&models).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture("da2_relative_p14").join(f), models.join(f)).unwrap();
    }
    std::fs::write(models.join("preprocessor_config.json"), r#"{"size": {"height": 28, "width": 28}, "ensure_multiple_of": 14}"#).unwrap();
    let abs = l.secret.to_string_lossy().into_owned();
    hostile_cache(&l, &["../../secret/s.png", &abs]);
    let outside_before: Vec<String> = tree(&l.top).into_iter().filter(|p| !p.starts_with("out")).collect();

    let mut cfg = Config { stages: vec![StageKind::Depth, StageKind::Edges], device: "cpu".into(), ..Default::default() };
    cfg.depth.model = models.to_string_lossy().into_owned();
    cfg.progress.mode = "none".into();
    let opts = RunOptions { config: cfg, input: l.input.clone(), output: l.output.clone(), shard: Shard::default(), retry_failed: false, rescan: false };
    let summary = annotate::run(&opts).unwrap();
    assert_eq!(summary.listed, 1);
    let outside_after: Vec<String> = tree(&l.top).into_iter().filter(|p| !p.starts_with("out")).collect();
    assert_eq!(outside_before, outside_after, "annotate created files outside its output directory");
    let inputs: Vec<String> = read_records(&l.output.join("manifests").join("depth.jsonl")).unwrap().into_iter().map(|r| r.input).collect();
    assert_eq!(inputs, ["a.png"]);
    assert!(tree(&l.output).iter().all(|p| !p.contains("secret") && !p.contains("s.npy")), "{:?}", tree(&l.output));
}

#[test]
fn journal_records_with_unsafe_paths_are_ignored_and_never_merged() {
    let l = layout();
    let mdir = l.output.join("manifests");
    std::fs::create_dir_all(&mdir).unwrap();
    let rec = |input: &str, outputs: &[&str]| {
        json!({"input": input, "size": 1, "mtime_ns": 2, "status": "ok", "outputs": outputs, "shard": "0/2", "unix_ms": 3}).to_string()
    };
    let lines = [
        rec("a.png", &["depth/a.npy"]),
        rec("../../secret/s.png", &["depth/s.npy"]),
        rec("/etc/passwd", &["depth/p.npy"]),
        rec("b.png", &["../../escape.npy"]),
        rec("c.png", &["/abs.npy"]),
        rec("", &["depth/e.npy"]),
    ];
    let shard = mdir.join("depth.shard-0-of-2.jsonl");
    std::fs::write(&shard, lines.join("\n") + "\n").unwrap();
    let got: Vec<String> = read_records(&shard).unwrap().into_iter().map(|r| r.input).collect();
    assert_eq!(got, ["a.png"]);
    annotate::merge(&l.output).unwrap();
    let merged: Vec<String> = read_records(&mdir.join("depth.jsonl")).unwrap().into_iter().map(|r| r.input).collect();
    assert_eq!(merged, ["a.png"]);
    let text = std::fs::read_to_string(mdir.join("depth.jsonl")).unwrap();
    assert!(!text.contains("secret") && !text.contains("passwd") && !text.contains("escape"), "{text}");
}

#[cfg(unix)]
#[test]
fn safe_join_refuses_what_leaves_the_root() {
    let l = layout();
    let root = &l.input;
    std::os::unix::fs::symlink(l.secret.parent().unwrap(), root.join("out_link")).unwrap();
    std::os::unix::fs::symlink(root.join("a.png"), root.join("in_link.png")).unwrap();
    std::os::unix::fs::symlink(l.top.join("missing"), root.join("dangling")).unwrap();
    for ok in ["a.png", "in_link.png", "new/dir/x.png"] {
        assert_eq!(safe_join(root, ok).unwrap(), root.join(ok), "{ok}");
    }
    for (bad, why) in [
        ("../secret/s.png", ".."),
        ("../../secret/s.png", ".."),
        (l.secret.to_str().unwrap(), "absolute"),
        ("", "empty"),
        (".", "`.`"),
        ("a/./b", "`.`"),
        ("a//b", "empty"),
        ("a\0b", "NUL"),
        ("out_link/s.png", "symlink"),
        ("out_link/new.png", "symlink"),
        ("dangling", "cannot be resolved"),
        ("dangling/x.png", "cannot be resolved"),
    ] {
        let e = safe_join(root, bad).expect_err(bad).to_string();
        assert!(e.contains(why), "{bad:?}: {e}");
    }
    // The scan does not follow the link out of the root either, so a rebuilt list always passes.
    let cache = l.output.join("filelist.json");
    std::fs::create_dir_all(&l.output).unwrap();
    let listing = list_inputs(root, &default_exts(), None, Fingerprint::Mtime, &cache, true).unwrap();
    let rels: Vec<&str> = listing.files.iter().map(|f| f.rel.as_str()).collect();
    assert_eq!(rels, ["a.png", "in_link.png"]);
    assert!(listing.skipped.iter().any(|s| s.contains("out_link") && s.contains("outside")), "{:?}", listing.skipped);
}
