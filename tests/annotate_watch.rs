//! `edgerun annotate --watch` as it is used on board: a generator writes frames (slowly, in pieces,
//! some under temporary names renamed into place) faster than the pipeline runs them; the run
//! processes each exactly once, newest first while overloaded, with the same bytes as a one-shot
//! run; `--max-backlog` skips the oldest (a later run does them); kill -9 mid-burst and a restart
//! reach the same outcome; SIGTERM stops in bounded time; `every = K` passes frames over.
mod common;
use common::{annotate_outputs as outputs, device_arg, small_model};
use std::collections::HashMap;
use std::io::{Cursor, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use edgerun::annotate::journal::{journal_path, read_records};
use edgerun::annotate::watch::status::WatchStatus;
use edgerun::annotate::{self, Config, RunOptions, Shard, StageKind, Status};
use image::{ImageFormat, RgbImage};

const STAGES: [StageKind; 3] = [StageKind::Depth, StageKind::Edges, StageKind::Segmentation];

fn pattern(w: u32, h: u32, seed: u32) -> RgbImage {
    RgbImage::from_fn(w, h, |x, y| {
        let v = x.wrapping_mul(7 + seed) ^ y.wrapping_mul(13 + 2 * seed);
        image::Rgb([(v % 251) as u8, ((x + y + seed * 29) % 256) as u8, ((x * y + seed) % 253) as u8])
    })
}

/// Frame `i`: its relative path and its encoded bytes (PNG or JPEG, two sizes, some in a
/// directory that appears during the run).
fn frame(i: usize) -> (String, Vec<u8>) {
    let (fmt, ext) = if i.is_multiple_of(2) { (ImageFormat::Png, "png") } else { (ImageFormat::Jpeg, "jpg") };
    let (w, h) = if i.is_multiple_of(3) { (30, 22) } else { (24, 24) };
    let mut buf = Cursor::new(Vec::new());
    pattern(w, h, i as u32).write_to(&mut buf, fmt).unwrap();
    let dir = if i >= 6 && i % 4 == 1 { "flight_b/" } else { "" };
    (format!("{dir}frame_{i:04}.{ext}"), buf.into_inner())
}

/// Writes frame `i` the way cameras do: in pieces with pauses (the file is visible half-written),
/// or under a temporary name renamed into place (hidden, or with a `.tmp` extension).
fn write_frame(input: &Path, i: usize, pause: Duration) -> String {
    let (rel, bytes) = frame(i);
    let dest = input.join(&rel);
    std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
    let name = dest.file_name().unwrap().to_string_lossy().into_owned();
    let path = match i % 3 {
        0 => dest.clone(),
        1 => dest.with_file_name(format!(".{name}.part")),
        _ => dest.with_file_name(format!("{name}.tmp")),
    };
    let mut f = std::fs::File::create(&path).unwrap();
    for piece in bytes.chunks(bytes.len().div_ceil(4)) {
        f.write_all(piece).unwrap();
        f.flush().unwrap();
        std::thread::sleep(pause);
    }
    drop(f);
    if path != dest {
        std::fs::rename(&path, &dest).unwrap();
    }
    rel
}

struct Setup {
    _t: tempfile::TempDir,
    root: PathBuf,
    input: PathBuf,
    config: PathBuf,
}

/// Tiny models, an empty input directory and a config file (`extra` appended to its top level,
/// `seg_extra` to `[segmentation]`).
fn setup(extra: &str, seg_extra: &str) -> Setup {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().to_path_buf();
    let depth = small_model("da2_relative_p14", &root.join("models/depth"), r#"{"size": {"height": 42, "width": 42}, "ensure_multiple_of": 14, "keep_aspect_ratio": true}"#);
    let seg = small_model("segformer_uneven", &root.join("models/seg"), r#"{"size": {"height": 32, "width": 32}}"#);
    let input = root.join("in");
    std::fs::create_dir_all(&input).unwrap();
    let config = root.join("annotate.toml");
    let text = format!(
        "stages = [\"depth\", \"edges\", \"segmentation\"]\ndevice = \"{}\"\nbatch = 2\ndecode_threads = 2\n{extra}\n\
         [progress]\nmode = \"none\"\n[depth]\nmodel = {:?}\n[segmentation]\nmodel = {:?}\nvisualize = true\n{seg_extra}\n",
        device_arg(),
        depth.to_string_lossy(),
        seg.to_string_lossy()
    );
    std::fs::write(&config, text).unwrap();
    Setup { _t: t, root, input, config }
}

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_edgerun"))
}

fn signal(child: &Child, sig: &str) {
    let st = Command::new("kill").arg(format!("-{sig}")).arg(child.id().to_string()).status().unwrap();
    assert!(st.success());
}

fn watch(s: &Setup, out: &Path, args: &[&str]) -> Child {
    let mut c = bin();
    c.arg("annotate").arg("--watch").arg("--config").arg(&s.config).args(args).arg(&s.input).arg(out);
    c.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap()
}

/// Waits for the child at most `limit`.
fn wait_for(child: &mut Child, limit: Duration) -> ExitStatus {
    let t = Instant::now();
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return st;
        }
        if t.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the watch run did not end within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn stderr_of(child: &mut Child) -> String {
    let mut s = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = std::io::Read::read_to_string(&mut e, &mut s);
    }
    s
}


/// A one-shot run over `input` into a fresh `out`.
fn one_shot(s: &Setup, out: &Path) -> annotate::Summary {
    let mut cfg = Config::load(&s.config).unwrap();
    cfg.watch = Default::default();
    annotate::run(&RunOptions { config: cfg, input: s.input.clone(), output: out.into(), shard: Shard::default(), retry_failed: false, rescan: true }).unwrap()
}

/// Per input: the records of a stage's journal, in journal order.
fn records(out: &Path, stage: StageKind) -> Vec<annotate::Record> {
    read_records(&journal_path(out, stage, "")).unwrap()
}

fn ok_counts(out: &Path, stage: StageKind) -> HashMap<String, usize> {
    let mut m = HashMap::new();
    for r in records(out, stage).into_iter().filter(|r| r.status == Status::Ok) {
        *m.entry(r.input).or_default() += 1;
    }
    m
}

/// Every ok record describes the file as finally written (size and mtime): nothing was read
/// half-written; and no record failed.
fn assert_whole_files_only(s: &Setup, out: &Path) {
    for st in STAGES {
        for r in records(out, st) {
            assert_eq!(r.status, Status::Ok, "{}: {} failed: {:?}", st.name(), r.input, r.reason);
            let m = std::fs::metadata(s.input.join(&r.input)).unwrap();
            assert_eq!(r.size, m.len(), "{}: {} was read at {} bytes, it has {}", st.name(), r.input, r.size, m.len());
        }
    }
}

fn status(out: &Path) -> WatchStatus {
    serde_json::from_slice(&std::fs::read(out.join("status.json")).unwrap()).unwrap()
}

/// The generator: `n` frames, one every `gap`, each written in pieces `pause` apart.
fn generate(input: PathBuf, n: usize, gap: Duration, pause: Duration) -> std::thread::JoinHandle<Vec<String>> {
    std::thread::spawn(move || {
        (0..n)
            .map(|i| {
                let rel = write_frame(&input, i, pause);
                std::thread::sleep(gap);
                rel
            })
            .collect()
    })
}

/// A burst above the pipeline's rate, then nothing: every frame once, newest first while behind,
/// the bytes of a one-shot run, nothing read half-written, the status file says so. The pipeline
/// falls behind for certain: it is stopped (SIGSTOP) while frames 4 to 19 are written.
fn burst(extra: &str, pause: Duration) {
    let s = setup(extra, "");
    let out = s.root.join("out");
    let mut child = watch(&s, &out, &["--idle-exit", "3"]);
    let mut frames: Vec<String> = (0..4).map(|i| write_frame(&s.input, i, pause)).collect();
    let t = Instant::now();
    while records(&out, StageKind::Depth).is_empty() && t.elapsed() < Duration::from_secs(120) {
        std::thread::sleep(Duration::from_millis(10));
    }
    signal(&child, "STOP");
    frames.extend((4..20).map(|i| write_frame(&s.input, i, Duration::ZERO)));
    signal(&child, "CONT");
    frames.extend((20..24).map(|i| write_frame(&s.input, i, pause)));
    let st = wait_for(&mut child, Duration::from_secs(240));
    assert!(st.success(), "watch run failed: {}", stderr_of(&mut child));
    for stage in STAGES {
        let c = ok_counts(&out, stage);
        assert_eq!(c.len(), frames.len(), "{}: every frame recorded", stage.name());
        assert!(c.values().all(|&n| n == 1), "{}: each exactly once: {c:?}", stage.name());
    }
    assert_whole_files_only(&s, &out);
    // Newest first: of the frames that waited together, the last written went before the first.
    let order: Vec<usize> = records(&out, StageKind::Depth).iter().map(|r| frames.iter().position(|f| *f == r.input).unwrap()).collect();
    let pos = |i: usize| order.iter().position(|&x| x == i).unwrap();
    assert!(pos(19) < pos(4), "the newest waiting frame was not taken first: processing order {order:?}");
    let reference = s.root.join("one_shot");
    let summary = one_shot(&s, &reference);
    assert_eq!(summary.processed, frames.len());
    assert_eq!(outputs(&out), outputs(&reference), "watch outputs differ from a one-shot run's");
    let status = status(&out);
    assert_eq!((status.state.as_str(), status.done, status.failed, status.queue), ("finished", frames.len(), 0, 0));
    assert_eq!(status.stages["depth"].latency_samples, frames.len());
    assert!(status.stages["depth"].latency_p95_s >= status.stages["depth"].latency_p50_s);
    assert!(!status.stages["depth"].model.is_empty() && status.stages["depth"].device.starts_with(&device_arg()[..3]));
}

#[test]
fn a_burst_is_processed_once_newest_first_with_one_shot_bytes() {
    burst("", Duration::from_millis(10));
}

#[test]
fn polling_never_reads_a_frame_being_written() {
    // Each frame stays half-written for 160 ms, across several re-listings.
    burst("[watch]\nbackend = \"poll\"\npoll_interval_s = 0.05\nsettle_s = 1.0\n", Duration::from_millis(40));
}

#[test]
fn over_max_backlog_the_oldest_are_skipped_and_a_later_run_does_them() {
    let s = setup("", "");
    let out = s.root.join("out");
    let mut child = watch(&s, &out, &["--idle-exit", "3", "--max-backlog", "2"]);
    // The pipeline is stopped while 18 frames arrive: 16 are over the bound.
    let mut frames: Vec<String> = (0..2).map(|i| write_frame(&s.input, i, Duration::from_millis(2))).collect();
    let t = Instant::now();
    while records(&out, StageKind::Depth).is_empty() && t.elapsed() < Duration::from_secs(120) {
        std::thread::sleep(Duration::from_millis(10));
    }
    signal(&child, "STOP");
    frames.extend((2..20).map(|i| write_frame(&s.input, i, Duration::ZERO)));
    signal(&child, "CONT");
    assert!(wait_for(&mut child, Duration::from_secs(240)).success(), "{}", stderr_of(&mut child));
    let skipped: Vec<String> = records(&out, StageKind::Depth)
        .into_iter()
        .filter(|r| r.status == Status::Failed)
        .inspect(|r| assert!(r.reason.as_deref().unwrap_or("").contains("--max-backlog"), "{r:?}"))
        .map(|r| r.input)
        .collect();
    let done = ok_counts(&out, StageKind::Depth);
    assert!(skipped.len() >= 10, "a burst of 18 over a backlog of 2 skips the oldest: {skipped:?}");
    assert!(done.contains_key(&frames[19]) && !done.contains_key(&frames[2]), "the newest were kept, the oldest skipped");
    assert_eq!(done.len() + skipped.len(), frames.len(), "each frame processed or skipped: {done:?} {skipped:?}");
    assert!(skipped.iter().all(|f| !done.contains_key(f)));
    assert_eq!(status(&out).skipped_backlog, skipped.len());
    // A later run processes the skipped frames (only them), with the bytes of a one-shot run.
    let s2 = one_shot(&s, &out);
    assert_eq!(s2.processed, skipped.len());
    for stage in STAGES {
        assert!(ok_counts(&out, stage).values().all(|&n| n == 1));
        assert_eq!(ok_counts(&out, stage).len(), frames.len());
    }
    let reference = s.root.join("one_shot");
    one_shot(&s, &reference);
    assert_eq!(outputs(&out), outputs(&reference));
}

#[test]
fn kill_9_during_the_burst_then_a_restart_reaches_the_same_outcome() {
    let s = setup("", "");
    let out = s.root.join("out");
    let mut child = watch(&s, &out, &[]);
    let gen = generate(s.input.clone(), 24, Duration::from_millis(60), Duration::from_millis(10));
    // Kill once some frames are journalled and others still arrive.
    let t = Instant::now();
    while records(&out, StageKind::Segmentation).len() < 2 && t.elapsed() < Duration::from_secs(120) && !gen.is_finished() {
        std::thread::sleep(Duration::from_millis(10));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let before = records(&out, StageKind::Depth).len();
    let mut child = watch(&s, &out, &["--idle-exit", "3"]);
    let frames = gen.join().unwrap();
    assert!(wait_for(&mut child, Duration::from_secs(240)).success(), "{}", stderr_of(&mut child));
    assert!(before < frames.len(), "the kill came during the burst ({before} of {} recorded)", frames.len());
    for stage in STAGES {
        let c = ok_counts(&out, stage);
        assert_eq!(c.len(), frames.len(), "{}", stage.name());
        assert!(c.values().all(|&n| n == 1), "{}: {c:?}", stage.name());
    }
    assert_whole_files_only(&s, &out);
    let reference = s.root.join("one_shot");
    one_shot(&s, &reference);
    assert_eq!(outputs(&out), outputs(&reference));
}

#[test]
fn sigterm_stops_within_bounded_time_with_valid_journals_and_a_second_signal_at_once() {
    let s = setup("", "");
    for i in 0..12 {
        write_frame(&s.input, i, Duration::ZERO);
    }
    for (signals, out) in [(1, s.root.join("out1")), (2, s.root.join("out2"))] {
        let mut child = watch(&s, &out, &["--settle", "0.2"]);
        let t = Instant::now();
        while records(&out, StageKind::Depth).is_empty() && t.elapsed() < Duration::from_secs(120) {
            std::thread::sleep(Duration::from_millis(10));
        }
        signal(&child, "TERM");
        if signals == 2 {
            signal(&child, "INT");
        }
        let sent = Instant::now();
        let st = wait_for(&mut child, Duration::from_secs(60));
        assert!(sent.elapsed() < Duration::from_secs(60));
        if signals == 1 {
            assert!(st.success(), "SIGTERM: exit 0 after the batch in flight: {st:?} {}", stderr_of(&mut child));
            assert_eq!(status(&out).state, "finished");
        } else {
            // At once (130), unless the run had already finished its batch and exited cleanly.
            assert!(st.code() == Some(130) || st.success(), "second signal: {st:?}");
        }
        // What was journalled is valid: every ok record's outputs exist.
        for stage in STAGES {
            for r in records(&out, stage) {
                assert_eq!(r.status, Status::Ok);
                for o in &r.outputs {
                    assert!(out.join(o).is_file(), "{o} of a journalled record is missing");
                }
            }
        }
    }
    // A later run finishes the rest with one-shot bytes.
    let out = s.root.join("out1");
    one_shot(&s, &out);
    let reference = s.root.join("one_shot");
    one_shot(&s, &reference);
    assert_eq!(outputs(&out), outputs(&reference));
}

#[test]
fn every_k_passes_frames_over_and_every_1_fills_them_in() {
    let s = setup("", "every = 3");
    for i in 0..7 {
        write_frame(&s.input, i, Duration::ZERO);
    }
    let out = s.root.join("out");
    let sum = one_shot(&s, &out);
    assert_eq!(sum.stages["segmentation"].done, 3, "frames 0, 3, 6 of the sorted list");
    assert_eq!(sum.stages["segmentation"].cadence_skipped, 4);
    assert_eq!(sum.stages["depth"].done, 7);
    let passed: Vec<annotate::Record> = records(&out, StageKind::Segmentation).into_iter().filter(|r| r.status == Status::Failed).collect();
    assert_eq!(passed.len(), 4);
    assert!(passed.iter().all(|r| r.reason.as_deref() == Some("not run on this frame: every = 3")), "{passed:?}");
    // The same cadence leaves them; every = 1 processes them.
    let again = one_shot(&s, &out);
    assert_eq!((again.processed, again.stages["segmentation"].cadence_skipped), (0, 4));
    let text = std::fs::read_to_string(&s.config).unwrap().replace("every = 3", "every = 1");
    std::fs::write(&s.config, text).unwrap();
    let fill = one_shot(&s, &out);
    assert_eq!((fill.processed, fill.stages["segmentation"].done), (4, 4));
    let reference = s.root.join("one_shot");
    one_shot(&s, &reference);
    assert_eq!(outputs(&out), outputs(&reference));
}

#[test]
fn watch_options_without_watch_and_bad_values_are_usage_or_config_errors() {
    let s = setup("", "");
    let out = s.root.join("out");
    for (args, want) in [
        (vec!["--order", "newest"], "options of --watch"),
        (vec!["--watch", "--order", "sideways"], "newest or oldest"),
        (vec!["--watch", "--idle-exit", "-1"], "idle_exit_s"),
        (vec!["--watch", "--settle", "NaN"], "settle_s"),
    ] {
        let o = bin().arg("annotate").arg("--config").arg(&s.config).args(&args).arg(&s.input).arg(&out).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(want), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn two_watching_shards_split_the_frames_and_merge_to_one_shot_bytes() {
    let s = setup("", "");
    let out = s.root.join("out");
    let mut shards: Vec<Child> = ["0/2", "1/2"].iter().map(|k| watch(&s, &out, &["--idle-exit", "3", "--shard", k])).collect();
    let frames = generate(s.input.clone(), 12, Duration::from_millis(5), Duration::from_millis(2)).join().unwrap();
    for c in &mut shards {
        assert!(wait_for(c, Duration::from_secs(240)).success(), "{}", stderr_of(c));
    }
    let per_shard: Vec<usize> = ["0-of-2", "1-of-2"]
        .iter()
        .map(|t| read_records(&journal_path(&out, StageKind::Depth, &format!(".shard-{t}"))).unwrap().len())
        .collect();
    assert_eq!(per_shard.iter().sum::<usize>(), frames.len(), "each frame taken by one shard: {per_shard:?}");
    assert!(per_shard.iter().all(|&n| n > 0), "both shards took frames: {per_shard:?}");
    assert!(out.join("status.shard-0-of-2.json").is_file() && out.join("status.shard-1-of-2.json").is_file());
    let o = bin().arg("annotate").arg("--merge").arg(&out).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for stage in STAGES {
        let c = ok_counts(&out, stage);
        assert_eq!(c.len(), frames.len());
        assert!(c.values().all(|&n| n == 1));
    }
    let reference = s.root.join("one_shot");
    one_shot(&s, &reference);
    assert_eq!(outputs(&out), outputs(&reference));
}
