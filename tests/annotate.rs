//! `edgerun annotate`: end-to-end on a generated image tree with the tiny fixture models, resume after
//! kill -9 at random points, failed inputs, fallback models, sharding + merge, the cached input list.
mod common;
use common::{annotate_outputs as outputs, dev, device_arg, fixture, small_model};
use std::collections::HashMap;
use std::io::Cursor;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use edgerun::annotate::journal::{journal_path, read_records};
use edgerun::annotate::{self, Config, RunOptions, Shard, StageKind, Status};
use image::{ImageFormat, RgbImage};


struct Models {
    depth: PathBuf,
    seg: PathBuf,
}

fn models(root: &Path) -> Models {
    Models {
        depth: small_model("da2_relative_p14", &root.join("depth"), r#"{"size": {"height": 42, "width": 42}, "ensure_multiple_of": 14, "keep_aspect_ratio": true}"#),
        seg: small_model("segformer_uneven", &root.join("seg"), r#"{"size": {"height": 32, "width": 32}}"#),
    }
}

fn pattern(w: u32, h: u32, seed: u32) -> RgbImage {
    RgbImage::from_fn(w, h, |x, y| {
        let v = x.wrapping_mul(7 + seed) ^ y.wrapping_mul(13 + 2 * seed);
        image::Rgb([(v % 251) as u8, ((x + y + seed * 29) % 256) as u8, ((x * y + seed) % 253) as u8])
    })
}

fn encode(img: &RgbImage, fmt: ImageFormat) -> Vec<u8> {
    let mut buf = Cursor::new(Vec::new());
    img.write_to(&mut buf, fmt).unwrap();
    buf.into_inner()
}

/// A tree of `n` small images in nested directories, two sizes, PNG and JPEG. Returns the relative paths.
fn image_tree(root: &Path, n: usize) -> Vec<String> {
    let mut rels = Vec::new();
    for i in 0..n {
        let dir = ["", "flight_a", "flight_b/row_1", "flight_b/row_2"][i % 4];
        let (w, h) = if i % 3 == 0 { (30, 22) } else { (24, 24) };
        let (fmt, ext) = if i % 2 == 0 { (ImageFormat::Png, "png") } else { (ImageFormat::Jpeg, "jpg") };
        let rel = if dir.is_empty() { format!("img_{i:03}.{ext}") } else { format!("{dir}/img_{i:03}.{ext}") };
        let p = root.join(&rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, encode(&pattern(w, h, i as u32), fmt)).unwrap();
        rels.push(rel);
    }
    rels.sort();
    rels
}

fn config(m: &Models, batch: usize) -> Config {
    let mut c = Config { stages: vec![StageKind::Depth, StageKind::Edges, StageKind::Segmentation], device: device_arg(), batch: edgerun::runner::BatchSetting::Fixed(batch), ..Default::default() };
    c.depth.model = m.depth.to_string_lossy().into_owned();
    c.segmentation.model = m.seg.to_string_lossy().into_owned();
    c.segmentation.visualize = true;
    c.progress.mode = "none".into();
    c.decode_threads = 2;
    c
}

fn opts(cfg: &Config, input: &Path, output: &Path) -> RunOptions {
    RunOptions { config: cfg.clone(), input: input.into(), output: output.into(), shard: Shard::default(), retry_failed: false, rescan: false }
}


/// Files anywhere under `dir` that look like temp files.
fn temp_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if e.file_name().to_string_lossy().contains(".tmp-") {
                out.push(p);
            }
        }
    }
    out
}

fn ok_counts(output: &Path, stage: StageKind, tag: &str) -> HashMap<String, usize> {
    let mut m = HashMap::new();
    for r in read_records(&journal_path(output, stage, tag)).unwrap() {
        if r.status == Status::Ok {
            *m.entry(r.input).or_default() += 1;
        }
    }
    m
}

fn npy(path: &Path) -> ((usize, usize), Vec<f32>) {
    edgerun::imageio::npy::read_npy_2d(path).unwrap()
}

#[test]
fn end_to_end_outputs_match_the_tasks_and_a_rerun_skips_everything() {
    let t = tempfile::tempdir().unwrap();
    let m = models(&t.path().join("models"));
    let input = t.path().join("in");
    let rels = image_tree(&input, 9);
    let out = t.path().join("out");
    let cfg = config(&m, 3);
    let s = annotate::run(&opts(&cfg, &input, &out)).unwrap();
    assert_eq!((s.processed, s.failed, s.skipped), (9, 0, 0), "{}", s.render());
    for st in ["depth", "edges", "segmentation"] {
        assert_eq!(s.stages[st].done, 9, "{st}");
        assert_eq!(s.stages[st].model_loaded, st != "edges", "{st}: a model is loaded for the model stages only");
    }
    assert!(out.join("summary.json").is_file());

    // Outputs mirror the tree and equal what the task APIs produce.
    let est = edgerun::tasks::depth::DepthEstimator::load(&m.depth, &dev(), candle_core::DType::F32).unwrap();
    let seg = edgerun::tasks::segment::Segmenter::load(&m.seg, &dev(), candle_core::DType::F32).unwrap();
    for rel in &rels {
        let stem = rel.rsplit_once('.').unwrap().0;
        let img = image::open(input.join(rel)).unwrap().into_rgb8();
        let (w, h) = (img.width() as usize, img.height() as usize);
        let ((dh, dw), depth) = npy(&out.join(format!("depth/{stem}.npy")));
        assert_eq!((dh, dw), (h, w));
        let want = est.predict(&[&img], 1).unwrap().remove(0);
        let max = want.values.iter().fold(0f32, |a, v| a.max(v.abs())).max(1.0);
        assert_eq!(depth.len(), want.values.len(), "{rel}");
        for (a, b) in depth.iter().zip(&want.values) {
            assert!((a - b).abs() <= 2e-3 * max, "{rel}: depth {a} vs {b}");
        }
        // Edges are the Sobel magnitude of the stored depth.
        let t = candle_core::Tensor::from_vec(depth.clone(), (1, 1, h, w), &dev()).unwrap();
        let e = edgerun::edges::sobel_magnitude(&t).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let (_, edges) = npy(&out.join(format!("edges/{stem}.npy")));
        let e16: Vec<f32> = e.iter().map(|v| half::f16::from_f32(*v).to_f32()).collect();
        assert_eq!(edges, e16, "{rel}: edges");
        let mask = image::open(out.join(format!("segmentation/{stem}.png"))).unwrap().into_luma8();
        let want = seg.segment(&[&img]).unwrap().remove(0);
        assert_eq!(mask.as_raw().iter().map(|&v| v as u32).collect::<Vec<_>>(), want, "{rel}: mask");
        assert!(out.join(format!("segmentation/{stem}.viz.png")).is_file());
    }
    for st in [StageKind::Depth, StageKind::Edges, StageKind::Segmentation] {
        let c = ok_counts(&out, st, "");
        assert_eq!(c.len(), 9);
        assert!(c.values().all(|&n| n == 1));
    }
    let before = outputs(&out);

    // A rerun finds everything done and loads no model.
    let s = annotate::run(&opts(&cfg, &input, &out)).unwrap();
    assert_eq!((s.processed, s.skipped), (0, 9));
    for (st, x) in &s.stages {
        assert!(!x.model_loaded, "{st}: no model is loaded when nothing is to do");
    }
    assert_eq!(outputs(&out), before);

    // Edges alone read the depth maps on disk and reproduce the same bytes.
    std::fs::remove_dir_all(out.join("edges")).unwrap();
    std::fs::remove_file(journal_path(&out, StageKind::Edges, "")).unwrap();
    let mut only_edges = cfg.clone();
    only_edges.stages = vec![StageKind::Edges];
    only_edges.depth.model = "/nonexistent".into();
    let s = annotate::run(&opts(&only_edges, &input, &out)).unwrap();
    assert_eq!((s.processed, s.failed), (9, 0));
    assert!(!s.stages["edges"].model_loaded);
    assert_eq!(outputs(&out), before);
    assert!(temp_files(&out).is_empty());
}

/// A PNG whose header declares `w`×`h` (valid CRCs), with a tiny IDAT.
fn png_declaring(w: u32, h: u32) -> Vec<u8> {
    fn crc32(data: &[u8]) -> u32 {
        let mut c = 0xFFFF_FFFFu32;
        for &b in data {
            c ^= b as u32;
            for _ in 0..8 {
                c = if c & 1 != 0 { 0xEDB8_8320 ^ (c >> 1) } else { c >> 1 };
            }
        }
        !c
    }
    fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
        out.extend((data.len() as u32).to_be_bytes());
        let mut body = kind.to_vec();
        body.extend(data);
        out.extend(&body);
        out.extend(crc32(&body).to_be_bytes());
    }
    let mut v = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = Vec::new();
    ihdr.extend(w.to_be_bytes());
    ihdr.extend(h.to_be_bytes());
    ihdr.extend([8, 2, 0, 0, 0]);
    chunk(&mut v, b"IHDR", &ihdr);
    chunk(&mut v, b"IDAT", &[0x78, 0x9c, 0x03, 0x00, 0x00, 0x00, 0x00, 0x01]);
    chunk(&mut v, b"IEND", &[]);
    v
}

#[test]
fn bad_inputs_are_recorded_failed_with_a_reason_and_the_rest_complete() {
    let t = tempfile::tempdir().unwrap();
    let m = models(&t.path().join("models"));
    let input = t.path().join("in");
    image_tree(&input, 5);
    let mut jpeg = encode(&pattern(24, 24, 3), ImageFormat::Jpeg);
    for b in &mut jpeg[4..60] {
        *b = 0xFF;
    }
    let bomb = png_declaring(100_000, 100_000);
    // The crafted header is well-formed: the decoder reads the declared size.
    assert_eq!(image::ImageReader::new(Cursor::new(&bomb)).with_guessed_format().unwrap().into_dimensions().unwrap(), (100_000, 100_000));
    std::fs::write(input.join("flight_a/corrupt.jpg"), &jpeg).unwrap();
    std::fs::write(input.join("flight_a/empty.png"), b"").unwrap();
    std::fs::write(input.join("bomb.png"), &bomb).unwrap();
    std::fs::write(input.join("notes.jpg"), b"flight notes: not an image\n").unwrap();
    std::fs::write(input.join("readme.txt"), b"ignored: not an image extension").unwrap();
    let out = t.path().join("out");
    let cfg = config(&m, 2);
    let s = annotate::run(&opts(&cfg, &input, &out)).unwrap();
    assert_eq!((s.listed, s.processed, s.failed), (9, 9, 4), "{}", s.render());
    let expect = [
        ("flight_a/corrupt.jpg", "cannot"),
        ("flight_a/empty.png", "file is empty"),
        // Beyond the image limits, so tiled and read by rows: its data ends in the first rows.
        ("bomb.png", "100000×100000 px, beyond the whole-image limit"),
        ("notes.jpg", "not a recognised image format"),
    ];
    for st in [StageKind::Depth, StageKind::Edges, StageKind::Segmentation] {
        let recs = read_records(&journal_path(&out, st, "")).unwrap();
        assert_eq!(recs.len(), 9, "{st:?}");
        for (name, why) in expect {
            let r = recs.iter().find(|r| r.input == name).unwrap_or_else(|| panic!("{name} not journaled"));
            assert_eq!(r.status, Status::Failed, "{name}");
            let reason = r.reason.as_deref().unwrap_or("");
            // A tiled input's edges are refused as such, whatever became of its depth.
            let why = if name == "bomb.png" && st == StageKind::Edges { "not computed from a tiled depth map" } else { why };
            assert!(reason.contains(why), "{st:?} {name}: reason `{reason}` lacks `{why}`");
            assert!(r.outputs.is_empty());
        }
        assert_eq!(recs.iter().filter(|r| r.status == Status::Ok).count(), 5);
    }
    assert!(!out.join("depth/bomb.npy").exists() && !out.join("depth/notes.npy").exists());

    // Failed inputs are skipped on resume, and retried with --retry-failed.
    let s = annotate::run(&opts(&cfg, &input, &out)).unwrap();
    assert_eq!((s.processed, s.stages["depth"].skipped_failed), (0, 4));
    std::fs::write(input.join("notes.jpg"), encode(&pattern(24, 24, 9), ImageFormat::Jpeg)).unwrap();
    let mut o = opts(&cfg, &input, &out);
    o.retry_failed = true;
    o.rescan = true;
    let s = annotate::run(&o).unwrap();
    assert_eq!((s.processed, s.failed), (4, 3), "{}", s.render());
    assert!(out.join("depth/notes.npy").is_file());
    assert!(temp_files(&out).is_empty());
}

#[test]
fn fallback_models_are_used_and_recorded() {
    let t = tempfile::tempdir().unwrap();
    let m = models(&t.path().join("models"));
    let input = t.path().join("in");
    image_tree(&input, 3);
    let broken = t.path().join("models/broken");
    std::fs::create_dir_all(&broken).unwrap();
    std::fs::write(broken.join("config.json"), b"{ not json").unwrap();
    let mut cfg = config(&m, 2);
    cfg.stages = vec![StageKind::Depth];
    // A budget below one batch: batches then go through one at a time (never a deadlock).
    cfg.memory_mb = 1;
    let good = cfg.depth.model.clone();
    cfg.depth.model = broken.to_string_lossy().into_owned();
    cfg.depth.fallback = vec![edgerun::annotate::config::ModelRef::Path(good.clone())];
    let out = t.path().join("out");
    let s = annotate::run(&opts(&cfg, &input, &out)).unwrap();
    assert_eq!((s.processed, s.failed), (3, 0));
    assert_eq!(s.stages["depth"].by_model.get(&good), Some(&3));
    for r in read_records(&journal_path(&out, StageKind::Depth, "")).unwrap() {
        assert_eq!(r.model.as_deref(), Some(good.as_str()));
    }
    // Without a loadable model the run stops with a config error naming the models.
    cfg.depth.fallback.clear();
    let err = annotate::run(&opts(&cfg, &input, &t.path().join("out2"))).unwrap_err().to_string();
    assert!(err.contains("no depth model could be loaded") && err.contains("broken"), "{err}");
}

#[test]
fn three_shards_merged_equal_one_unsharded_run() {
    let t = tempfile::tempdir().unwrap();
    let m = models(&t.path().join("models"));
    let input = t.path().join("in");
    let rels = image_tree(&input, 11);
    let cfg = config(&m, 2);
    let whole = t.path().join("whole");
    annotate::run(&opts(&cfg, &input, &whole)).unwrap();
    let sharded = t.path().join("sharded");
    let mut seen = 0;
    for k in 0..3 {
        let mut o = opts(&cfg, &input, &sharded);
        o.shard = Shard::new(k, 3).unwrap();
        let s = annotate::run(&o).unwrap();
        seen += s.in_shard;
        assert!(journal_path(&sharded, StageKind::Depth, &o.shard.tag()).is_file());
    }
    assert_eq!(seen, rels.len());
    let report = annotate::merge(&sharded).unwrap();
    assert_eq!(report.stages["depth"].ok, rels.len());
    assert_eq!(report.summary.as_ref().unwrap().processed, rels.len());
    assert_eq!(outputs(&sharded), outputs(&whole), "sharded outputs differ from the unsharded run");
    let key = |p: &Path, st| {
        let mut v: Vec<_> = read_records(&journal_path(p, st, "")).unwrap().into_iter().map(|r| (r.input, r.status, r.model, r.outputs, r.size, r.mtime_ns)).collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    };
    for st in [StageKind::Depth, StageKind::Edges, StageKind::Segmentation] {
        assert_eq!(key(&sharded, st), key(&whole, st), "{st:?} manifest");
    }
    // After the merge an unsharded run over the sharded output has nothing left to do.
    let s = annotate::run(&opts(&cfg, &input, &sharded)).unwrap();
    assert_eq!(s.processed, 0);
}

#[test]
fn the_cached_input_list_is_rebuilt_only_when_the_tree_changes() {
    let t = tempfile::tempdir().unwrap();
    let m = models(&t.path().join("models"));
    let input = t.path().join("in");
    image_tree(&input, 4);
    // Age the directories so their mtimes are trusted (fresh ones are rescanned: timestamp granularity).
    let old = std::time::SystemTime::now() - Duration::from_secs(3600);
    for d in ["", "flight_a", "flight_b", "flight_b/row_1", "flight_b/row_2"] {
        std::fs::File::open(input.join(d)).unwrap().set_modified(old).unwrap();
    }
    let mut cfg = config(&m, 2);
    cfg.stages = vec![StageKind::Depth];
    let out = t.path().join("out");
    assert!(!annotate::run(&opts(&cfg, &input, &out)).unwrap().listing_cached);
    let s = annotate::run(&opts(&cfg, &input, &out)).unwrap();
    assert!(s.listing_cached && s.processed == 0);
    std::fs::write(input.join("flight_b/row_2/new.png"), encode(&pattern(20, 20, 1), ImageFormat::Png)).unwrap();
    let s = annotate::run(&opts(&cfg, &input, &out)).unwrap();
    assert!(!s.listing_cached);
    assert_eq!((s.listed, s.processed), (5, 1));
    assert!(out.join("depth/flight_b/row_2/new.npy").is_file());
}

#[test]
fn colliding_output_names_fail_the_later_input() {
    let t = tempfile::tempdir().unwrap();
    let m = models(&t.path().join("models"));
    let input = t.path().join("in");
    std::fs::create_dir_all(&input).unwrap();
    std::fs::write(input.join("a.jpg"), encode(&pattern(20, 20, 1), ImageFormat::Jpeg)).unwrap();
    std::fs::write(input.join("a.png"), encode(&pattern(20, 20, 2), ImageFormat::Png)).unwrap();
    let mut cfg = config(&m, 2);
    cfg.stages = vec![StageKind::Depth];
    let out = t.path().join("out");
    let s = annotate::run(&opts(&cfg, &input, &out)).unwrap();
    assert_eq!((s.processed, s.failed), (2, 1));
    let recs = read_records(&journal_path(&out, StageKind::Depth, "")).unwrap();
    let r = recs.iter().find(|r| r.input == "a.png").unwrap();
    assert!(r.status == Status::Failed && r.reason.as_deref().unwrap().contains("collide with those of a.jpg"));
}

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_edgerun"))
}

#[test]
fn print_config_is_the_parseable_default() {
    let out = bin().args(["annotate", "--print-config"]).output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.lines().filter(|l| l.trim_start().starts_with('#')).count() > 20, "the default is commented");
    assert_eq!(Config::from_toml(&text, Path::new(".")).unwrap(), Config::default());
}

/// A small xorshift generator (seed from `EDGERUN_KILL_SEED` or the clock; printed for reproduction).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Inputs that have a record (ok or failed) in every stage's journal under `out`.
fn recorded_everywhere(out: &Path) -> usize {
    let mut per_stage = [StageKind::Depth, StageKind::Edges, StageKind::Segmentation]
        .map(|st| read_records(&journal_path(out, st, "")).unwrap().into_iter().map(|r| r.input).collect::<std::collections::HashSet<_>>());
    let [a, b, c] = &mut per_stage;
    a.retain(|i| b.contains(i) && c.contains(i));
    a.len()
}

/// Kills the CLI with SIGKILL a fixed number of times at random points and resumes; the result must
/// equal an uninterrupted run. Kill delays are drawn from a seeded RNG (`EDGERUN_KILL_SEED=<u64>`
/// reproduces a run's draws; the seed is printed) within the reference run's measured duration. A run
/// that finishes before its kill starts a fresh output tree; the loop only ends right after a kill
/// that left some but not all inputs journaled, so the final comparison always follows a resume from
/// a kill mid-run.
#[test]
fn kill_9_at_random_points_then_resume_gives_identical_outputs_done_once() {
    const KILLS: usize = 8;
    const MAX_RUNS: usize = 60;
    let t = tempfile::tempdir().unwrap();
    let m = models(&t.path().join("models"));
    let input = t.path().join("in");
    let rels = image_tree(&input, 24);
    std::fs::write(input.join("flight_a/broken.jpg"), b"\xFF\xD8\xFF\xE0 truncated").unwrap();
    let n_items = rels.len() + 1;
    let toml = format!(
        "stages = [\"depth\", \"edges\", \"segmentation\"]\ndevice = {:?}\nbatch = 3\nwrite_threads = 2\ndecode_threads = 2\n\
         [journal]\nsync_every = 4\n[progress]\nmode = \"none\"\n\
         [depth]\nmodel = {:?}\nvisualize = true\n[segmentation]\nmodel = {:?}\n",
        device_arg(),
        m.depth.to_string_lossy(),
        m.seg.to_string_lossy()
    );
    let cfg_path = t.path().join("annotate.toml");
    std::fs::write(&cfg_path, toml).unwrap();
    let run_to = |out: &Path| {
        bin().arg("annotate").arg("--config").arg(&cfg_path).arg(&input).arg(out).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap()
    };
    let stderr_of = |child: &mut std::process::Child| {
        let mut e = String::new();
        std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut e).unwrap();
        e
    };

    let reference = t.path().join("reference");
    let t0 = Instant::now();
    let o = run_to(&reference).wait_with_output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let full = t0.elapsed();
    let want = outputs(&reference);
    assert_eq!(want.len(), rels.len() * 4, "depth npy+viz, edges, segmentation");

    let seed = match std::env::var("EDGERUN_KILL_SEED") {
        Ok(v) => v.trim().parse::<u64>().unwrap_or_else(|_| panic!("EDGERUN_KILL_SEED={v}: not a u64")),
        Err(_) => std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64,
    };
    eprintln!("kill test: seed {seed} (EDGERUN_KILL_SEED={seed} reproduces the draws), uninterrupted run {full:?}");
    let mut rng = Rng(seed | 1);
    let out = t.path().join("killed");
    let (mut runs, mut kills, mut finished, mut kills_since_wipe) = (0, 0, 0, 0);
    let mut left_after_last_kill = 0;
    // Delays are fractions of the uninterrupted run's time, scaled down after a run finished before
    // its kill (a resumed run has less to do) and back up after a kill.
    let mut scale = 1.0f64;
    let mid_run = |left: usize| left > 0 && left < n_items;
    while kills < KILLS || !mid_run(left_after_last_kill) {
        assert!(runs < MAX_RUNS, "{kills} kills in {runs} runs ({finished} finished first; seed {seed})");
        runs += 1;
        let mut child = run_to(&out);
        std::thread::sleep(full.mul_f64(scale * (0.02 + 0.98 * rng.unit())));
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "run {runs} after {kills_since_wipe} kills failed (seed {seed}): {}", stderr_of(&mut child));
            finished += 1;
            scale = (scale * 0.7).max(0.02);
            // Start over on a fresh tree, so the next kills land in every phase of a run.
            std::fs::remove_dir_all(&out).unwrap();
            kills_since_wipe = 0;
            left_after_last_kill = 0;
            continue;
        }
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        kills += 1;
        kills_since_wipe += 1;
        scale = (scale * 1.15).min(1.0);
        left_after_last_kill = n_items - recorded_everywhere(&out);
        let last = kills >= KILLS && mid_run(left_after_last_kill);
        if kills % 3 == 0 || last {
            // A torn journal record, as a crash mid-write leaves it.
            use std::io::Write;
            let p = journal_path(&out, StageKind::Segmentation, "");
            if p.exists() {
                std::fs::OpenOptions::new().append(true).open(&p).unwrap().write_all(b"{\"input\":\"flight_b/ro").unwrap();
            }
        }
        if last && out.join("depth").is_dir() {
            // A temp file, as a kill inside an atomic write leaves it (the final resume must remove it).
            std::fs::write(out.join("depth").join(".img_001.npy.tmp-99999"), b"partial").unwrap();
        }
    }
    eprintln!(
        "kill test: {kills} kills in {runs} runs ({finished} finished first), {kills_since_wipe} kills since the last fresh start, \
         {left_after_last_kill} of {n_items} inputs left after the last one"
    );
    assert!(kills_since_wipe >= 1 && mid_run(left_after_last_kill), "the final resume must follow a kill mid-run");
    let o = run_to(&out).wait_with_output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let summary: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("summary.json")).unwrap()).unwrap();
    assert!(summary["processed"].as_u64().unwrap() >= 1, "the final run resumed interrupted work: {summary}");

    let got = outputs(&out);
    assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>(), "output file sets differ");
    for (k, v) in &want {
        assert!(got[k] == *v, "{k} differs from the uninterrupted run (seed {seed})");
    }
    assert!(temp_files(&out).is_empty(), "temp files left: {:?}", temp_files(&out));
    for st in [StageKind::Depth, StageKind::Edges, StageKind::Segmentation] {
        let recs = read_records(&journal_path(&out, st, "")).unwrap();
        let bytes = std::fs::read(journal_path(&out, st, "")).unwrap();
        assert!(bytes.ends_with(b"\n"), "{st:?}: journal ends with a torn record");
        let c = ok_counts(&out, st, "");
        assert_eq!(c.len(), rels.len(), "{st:?}");
        assert!(c.values().all(|&n| n == 1), "{st:?}: an item was journaled ok twice (seed {seed})");
        let failed: Vec<_> = recs.iter().filter(|r| r.status == Status::Failed).collect();
        assert!(failed.len() <= 1 && failed.iter().all(|r| r.input == "flight_a/broken.jpg"), "{st:?}: {failed:?}");
        // Since the last fresh start every item is recorded exactly once.
        assert!(recs.len() <= n_items, "{st:?}: {} records for {n_items} items", recs.len());
    }
}

#[test]
fn canopy_height_writes_npy_and_a_georeferenced_geotiff_for_geotiff_inputs() {
    let t = tempfile::tempdir().unwrap();
    let input = t.path().join("in");
    std::fs::create_dir_all(input.join("tiles")).unwrap();
    for f in ["scene.tif", "rotated_be.tif", "plain.png"] {
        std::fs::copy(fixture("chmv2_geotiff").join(f), input.join("tiles").join(f)).unwrap();
    }
    let mut cfg = Config { stages: vec![StageKind::Chm], device: device_arg(), batch: edgerun::runner::BatchSetting::Fixed(2), ..Default::default() };
    cfg.chm.model = fixture("chmv2_tiny").to_string_lossy().into_owned();
    cfg.chm.visualize = true;
    cfg.progress.mode = "none".into();
    let out = t.path().join("out");
    let s = annotate::run(&opts(&cfg, &input, &out)).unwrap();
    assert_eq!((s.processed, s.failed), (3, 0), "{}", s.render());
    let est = edgerun::tasks::chm::ChmEstimator::load(
        &fixture("chmv2_tiny"),
        &dev(),
        edgerun::models::chmv2::Precision::uniform(candle_core::DType::F32),
    )
    .unwrap();
    for stem in ["scene", "rotated_be", "plain"] {
        let src = input.join("tiles").join(if stem == "plain" { "plain.png".to_string() } else { format!("{stem}.tif") });
        let img = image::open(&src).unwrap().into_rgb8();
        let ((h, w), v) = npy(&out.join(format!("chm/tiles/{stem}.npy")));
        assert_eq!((h, w), (img.height() as usize, img.width() as usize));
        let want = est.predict(&[&img], &["x".into()], 1).unwrap().remove(0);
        let want16: Vec<f32> = want.values.iter().map(|x| half::f16::from_f32(*x).to_f32()).collect();
        // Equal up to one float16 step: thread scheduling can change float summation order.
        assert_eq!(v.len(), want16.len(), "{stem}");
        for (a, b) in v.iter().zip(&want16) {
            assert!((a - b).abs() <= 2e-3 * b.abs().max(1.0), "{stem}: {a} vs {b}");
        }
        assert!(out.join(format!("chm/tiles/{stem}.viz.png")).is_file());
        let tif = out.join(format!("chm/tiles/{stem}.tif"));
        let geo_in = edgerun::geotiff::GeoReference::read(&src).unwrap();
        assert_eq!(tif.is_file(), geo_in.is_some(), "{stem}: GeoTIFF only for georeferenced inputs");
        if let Some(g) = geo_in {
            let g_out = edgerun::geotiff::GeoReference::read(&tif).unwrap().expect("output is georeferenced");
            assert_eq!(g_out.tags, g.tags, "{stem}: georeferencing tags");
        }
    }
    let recs = read_records(&journal_path(&out, StageKind::Chm, "")).unwrap();
    let scene = recs.iter().find(|r| r.input == "tiles/scene.tif").unwrap();
    assert_eq!(scene.outputs, vec!["chm/tiles/scene.npy", "chm/tiles/scene.tif", "chm/tiles/scene.viz.png"]);
}

#[test]
fn content_fingerprints_survive_mtime_changes_and_catch_content_changes() {
    let t = tempfile::tempdir().unwrap();
    let m = models(&t.path().join("models"));
    let input = t.path().join("in");
    image_tree(&input, 3);
    let mut cfg = config(&m, 2);
    cfg.stages = vec![StageKind::Depth];
    cfg.fingerprint = edgerun::annotate::Fingerprint::Content;
    let out = t.path().join("out");
    annotate::run(&opts(&cfg, &input, &out)).unwrap();
    let rec = &read_records(&journal_path(&out, StageKind::Depth, "")).unwrap()[0];
    assert!(rec.hash.as_deref().is_some_and(|h| h.starts_with("xxh64:") && h.len() == 22), "{rec:?}");
    // Same bytes, new mtime (a copy that did not preserve times): still done.
    let f = input.join("img_000.png");
    std::fs::File::options().write(true).open(&f).unwrap().set_modified(std::time::SystemTime::now() - Duration::from_secs(7)).unwrap();
    let mut o = opts(&cfg, &input, &out);
    o.rescan = true;
    assert_eq!(annotate::run(&o).unwrap().processed, 0);
    // Different bytes, same size and the very same mtime (invisible to "mtime"): redone.
    let md = std::fs::metadata(&f).unwrap();
    let mut bytes = std::fs::read(&f).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x55;
    std::fs::write(&f, &bytes).unwrap();
    std::fs::File::options().write(true).open(&f).unwrap().set_modified(md.modified().unwrap()).unwrap();
    let s = annotate::run(&o).unwrap();
    assert_eq!(s.processed, 1, "{}", s.render());
}
