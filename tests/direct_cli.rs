//! The direct commands (`depth`, `segment`, `chm`, `edges`) as a field user runs them: they go on
//! past bad inputs, name each failure, print a summary and exit 2; `--fail-fast` stops at the first;
//! outputs mirror the input tree; and the command line itself (argh) keeps its flags and exit codes.
mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::{device_arg as device, fixture};

fn edgerun(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_edgerun")).args(args).output().expect("run edgerun")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}


fn write_png(path: &Path, w: u32, h: u32, seed: u8) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb([(x * 7) as u8 ^ seed, (y * 5) as u8, seed.wrapping_mul(3)]));
    img.save(path).unwrap();
}

fn write_jpg(path: &Path, w: u32, h: u32) -> Vec<u8> {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb([(x * 3) as u8, (y * 9) as u8, 77]));
    img.save(path).unwrap();
    std::fs::read(path).unwrap()
}

/// An input tree with good images and one of each kind of bad input, sorted so that bad ones come
/// first: `a_truncated.jpg`, `b_empty.png`, `c_huge.png` (a header declaring 100000×100000),
/// `d_good.png`, `e_garbage.jpg`, `sub/d_good.png`, `z_good.jpg`.
fn mixed_tree(root: &Path) -> Vec<&'static str> {
    let jpg = write_jpg(&root.join("z_good.jpg"), 40, 30);
    std::fs::write(root.join("a_truncated.jpg"), &jpg[..jpg.len() / 3]).unwrap();
    std::fs::write(root.join("b_empty.png"), b"").unwrap();
    let mut huge = Vec::new();
    {
        let mut enc = png::Encoder::new(&mut huge, 1, 1);
        enc.set_color(png::ColorType::Rgb);
        enc.write_header().unwrap().write_image_data(&[0, 0, 0]).unwrap();
    }
    // Patch IHDR width/height to 100000 (the CRC no longer matches: the header check must refuse first).
    huge[16..20].copy_from_slice(&100_000u32.to_be_bytes());
    huge[20..24].copy_from_slice(&100_000u32.to_be_bytes());
    std::fs::write(root.join("c_huge.png"), &huge).unwrap();
    write_png(&root.join("d_good.png"), 36, 28, 1);
    std::fs::write(root.join("e_garbage.jpg"), b"\xff\xd8\xff\xe0 this is not a jpeg at all").unwrap();
    write_png(&root.join("sub/d_good.png"), 30, 44, 2);
    vec!["a_truncated.jpg", "b_empty.png", "c_huge.png", "e_garbage.jpg"]
}

fn assert_no_panic(o: &Output) {
    let e = stderr(o);
    assert_ne!(o.status.code(), Some(101), "panicked: {e}");
    assert!(!e.contains("panicked") && !e.contains("internal error"), "panic text: {e}");
}

fn assert_goes_on(cmd: &str, model: PathBuf, suffix: &str) {
    let t = tempfile::tempdir().unwrap();
    let (input, out) = (t.path().join("in"), t.path().join("out"));
    let bad = mixed_tree(&input);
    let dev = device();
    let o = edgerun(&[cmd, "--model", model.to_str().unwrap(), input.to_str().unwrap(), "--out", out.to_str().unwrap(), "--device", &dev, "--batch", "2", "--progress", "none"]);
    assert_no_panic(&o);
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{cmd}: some inputs failed → exit 2: {e}");
    for good in ["d_good", "sub/d_good", "z_good"] {
        assert!(out.join(format!("{good}{suffix}")).is_file(), "{cmd}: {good}{suffix} missing; stderr: {e}");
    }
    for b in &bad {
        assert!(e.contains(&format!("FAILED {}", input.join(b).display())), "{cmd}: {b} not reported: {e}");
    }
    assert!(e.contains("3 done, 4 failed"), "{cmd}: summary: {e}");
    assert!(e.contains("images/s"), "{cmd}: summary: {e}");
    assert!(e.contains("4 of 7 inputs failed"), "{cmd}: {e}");
    // Nothing was written for the bad inputs, and no temp file is left.
    let written: Vec<String> = walk(&out);
    assert!(written.iter().all(|f| !f.contains("truncated") && !f.contains("empty") && !f.contains("huge") && !f.contains("garbage")), "{written:?}");
    assert!(written.iter().all(|f| !f.contains(".tmp-")), "temp file left: {written:?}");
}

/// Every file under `dir`, relative, sorted; not the command's state file of its passes
/// (`OUT/.edgerun-<command>.passes.jsonl`, tests/memory_limit.rs).
fn walk(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if !p.file_name().is_some_and(|n| n.to_string_lossy().starts_with(".edgerun-")) {
                out.push(p.strip_prefix(dir).unwrap().to_string_lossy().into_owned());
            }
        }
    }
    out.sort();
    out
}

#[test]
fn depth_goes_on_past_bad_inputs_and_exits_2() {
    assert_goes_on("depth", fixture("da2_relative_p14"), ".depth.npy");
}

#[test]
fn segment_goes_on_past_bad_inputs_and_exits_2() {
    assert_goes_on("segment", fixture("segformer_tiny"), ".seg.png");
}

#[test]
fn chm_goes_on_past_bad_inputs_and_exits_2() {
    assert_goes_on("chm", fixture("chmv2_tiny"), ".chm.npy");
}

#[test]
fn fail_fast_stops_at_the_first_bad_input() {
    let t = tempfile::tempdir().unwrap();
    let (input, out) = (t.path().join("in"), t.path().join("out"));
    mixed_tree(&input);
    let dev = device();
    let model = fixture("da2_relative_p14");
    let o = edgerun(&["depth", "--model", model.to_str().unwrap(), input.to_str().unwrap(), "--out", out.to_str().unwrap(), "--device", &dev, "--fail-fast"]);
    assert_no_panic(&o);
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{e}");
    assert!(e.contains("a_truncated.jpg") && e.contains("--fail-fast"), "{e}");
    assert!(!out.join("d_good.depth.npy").exists() && !out.join("z_good.depth.npy").exists(), "went on after the first failure");
}

#[test]
fn outputs_mirror_the_input_tree_and_collisions_are_reported() {
    let t = tempfile::tempdir().unwrap();
    let (input, out) = (t.path().join("in"), t.path().join("out"));
    write_png(&input.join("a.png"), 20, 20, 3);
    write_png(&input.join("sub/a.png"), 24, 20, 4);
    write_png(&input.join("sub/deeper/b.png"), 20, 26, 5);
    write_jpg(&input.join("sub/a.jpg"), 26, 20);
    let dev = device();
    let model = fixture("da2_relative_p14");
    let o = edgerun(&["depth", "--model", model.to_str().unwrap(), input.to_str().unwrap(), "--out", out.to_str().unwrap(), "--device", &dev, "--png"]);
    assert_no_panic(&o);
    let e = stderr(&o);
    // `sub/a.jpg` sorts before `sub/a.png`: the PNG's outputs would overwrite the JPEG's.
    assert_eq!(o.status.code(), Some(2), "{e}");
    assert!(e.contains("sub/a.png") && e.contains("would overwrite"), "{e}");
    assert_eq!(
        walk(&out),
        ["a.depth.npy", "a.depth.png", "sub/a.depth.npy", "sub/a.depth.png", "sub/deeper/b.depth.npy", "sub/deeper/b.depth.png"],
        "{e}"
    );
    // The mirrored maps are each of their own image: `a` and `sub/a` differ in size.
    let a = std::fs::metadata(out.join("a.depth.npy")).unwrap().len();
    let sub_a = std::fs::metadata(out.join("sub/a.depth.npy")).unwrap().len();
    assert_ne!(a, sub_a);
}

#[test]
fn output_inside_the_input_tree_is_skipped_and_equal_to_it_is_refused() {
    let t = tempfile::tempdir().unwrap();
    let input = t.path().join("in");
    write_png(&input.join("a.png"), 20, 20, 3);
    let dev = device();
    let model = fixture("da2_relative_p14");
    let m = model.to_str().unwrap();
    let out = input.join("out");
    for _ in 0..2 {
        // With --png the outputs are images: the second run must not take them for inputs.
        let o = edgerun(&["depth", "--model", m, input.to_str().unwrap(), "--out", out.to_str().unwrap(), "--device", &dev, "--png"]);
        assert!(o.status.success(), "{}", stderr(&o));
    }
    assert_eq!(walk(&out), ["a.depth.npy", "a.depth.png"]);
    let o = edgerun(&["depth", "--model", m, input.to_str().unwrap(), "--out", input.to_str().unwrap(), "--device", &dev]);
    assert_no_panic(&o);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("is the input directory"), "{}", stderr(&o));
    assert!(!input.join("a.depth.npy").exists());
}

#[cfg(unix)]
#[test]
fn symlink_loops_and_fifos_in_the_tree_neither_hang_nor_stop_the_run() {
    let t = tempfile::tempdir().unwrap();
    let (input, out) = (t.path().join("in"), t.path().join("out"));
    write_png(&input.join("sub/a.png"), 20, 20, 3);
    std::os::unix::fs::symlink(&input, input.join("sub/loop")).unwrap();
    let fifo = input.join("f.png");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let dev = device();
    let model = fixture("da2_relative_p14");
    let mut child = Command::new(env!("CARGO_BIN_EXE_edgerun"))
        .args(["depth", "--model", model.to_str().unwrap(), input.to_str().unwrap(), "--out", out.to_str().unwrap(), "--device", &dev])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > std::time::Duration::from_secs(60) {
            child.kill().unwrap();
            panic!("depth hung on a symlink loop or a FIFO");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let o = child.wait_with_output().unwrap();
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{e}");
    assert!(e.contains("f.png") && e.contains("not a regular file"), "{e}");
    assert!(out.join("sub/a.depth.npy").is_file(), "{e}");
}

#[test]
fn edges_mirror_the_depth_tree_and_go_on_past_bad_maps() {
    let t = tempfile::tempdir().unwrap();
    let (depth, out) = (t.path().join("depth"), t.path().join("edges"));
    let map = |p: &Path, h: usize, w: usize| {
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        let v: Vec<f32> = (0..h * w).map(|i| (i % w) as f32 * 0.5 + (i / w) as f32).collect();
        edgerun::imageio::write_npy_f16(p, &[h, w], &v).unwrap();
    };
    map(&depth.join("a.depth.npy"), 6, 7);
    map(&depth.join("sub/a.depth.npy"), 5, 5);
    map(&depth.join("tiny.depth.npy"), 1, 1);
    std::fs::write(depth.join("broken.depth.npy"), b"\x93NUMPY garbage").unwrap();
    let o = edgerun(&["edges", "--depth", depth.to_str().unwrap(), "--out", out.to_str().unwrap(), "--progress", "lines"]);
    assert_no_panic(&o);
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{e}");
    assert!(e.contains("FAILED") && e.contains("broken.depth.npy") && e.contains("tiny.depth.npy"), "{e}");
    assert!(e.contains("2 done, 2 failed"), "{e}");
    assert_eq!(walk(&out), ["a.edges.npy", "sub/a.edges.npy"]);
    // Beside the depth maps is allowed: edge maps are never taken for depth maps.
    let o = edgerun(&["edges", "--depth", depth.to_str().unwrap(), "--out", depth.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(depth.join("sub/a.edges.npy").is_file());
}

#[test]
fn a_one_pixel_image_with_edges_is_one_failed_input() {
    let t = tempfile::tempdir().unwrap();
    let (input, out) = (t.path().join("in"), t.path().join("out"));
    write_png(&input.join("dot.png"), 1, 1, 9);
    write_png(&input.join("ok.png"), 20, 20, 3);
    let dev = device();
    let model = fixture("da2_relative_p14");
    let o = edgerun(&["depth", "--model", model.to_str().unwrap(), input.to_str().unwrap(), "--out", out.to_str().unwrap(), "--device", &dev, "--edges", "--batch", "2"]);
    assert_no_panic(&o);
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{e}");
    assert!(e.contains("FAILED") && e.contains("dot.png"), "{e}");
    // The bad item wrote nothing at all (not a depth map without its edges).
    assert_eq!(walk(&out), ["ok.depth.npy", "ok.edges.npy"], "{e}");
}

#[test]
fn messages_name_the_problem_once_and_without_debug_formatting() {
    let t = tempfile::tempdir().unwrap();
    write_png(&t.path().join("a.png"), 8, 8, 1);
    let out = t.path().join("out");
    let o = edgerun(&["depth", "--model", "/nonexistent/model", t.path().to_str().unwrap(), "--out", out.to_str().unwrap(), "--device", "cpu"]);
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(4), "{e}");
    assert!(e.contains("/nonexistent/model"), "{e}");
    assert_eq!(e.matches("os error 2").count(), 1, "OS error printed more than once: {e}");
    let da2 = fixture("da2_relative_p14");
    let o = edgerun(&["segment", "--model", da2.to_str().unwrap(), t.path().to_str().unwrap(), "--out", out.to_str().unwrap(), "--device", "cpu"]);
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{e}");
    assert!(e.contains("depth_anything") && !e.contains("Some(") && !e.contains("\"depth_anything\""), "{e}");
    assert!(!out.exists(), "a refused run created its output directory");
}

#[test]
fn usage_errors_exit_2_and_help_exits_0() {
    for args in [
        &["depth"][..],
        &["depth", "--model", "m", "--out", "o"],
        &["depth", "--model", "m", "x", "--out", "o", "--batch", "0"],
        &["depth", "--model", "m", "x", "--out", "o", "--batch", "many"],
        &["--threads", "0", "doctor"],
        &["doctor", "--threads", "100000"],
        &["segment", "--model", "m", "x", "--out", "o", "--size", "100000x100000"],
        &["forward", "--model", "m", "--input", "i", "--output", "o", "--repeat", "1000000000000"],
        &["annotate"],
        &["annotate", "--print-config", "extra"],
        &["nosuchcommand"],
    ] {
        let o = edgerun(args);
        assert_no_panic(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains("edgerun: error:"), "{args:?}: {}", stderr(&o));
    }
    for args in [&["--help"][..], &["depth", "--help"], &["--version"], &["annotate", "--print-config"]] {
        let o = edgerun(args);
        assert_eq!(o.status.code(), Some(0), "{args:?}: {}", stderr(&o));
        assert!(!o.stdout.is_empty(), "{args:?}");
    }
    // `--threads` stays global: accepted before and after the subcommand.
    assert!(edgerun(&["--threads", "1", "doctor"]).status.success());
    assert!(edgerun(&["doctor", "--threads", "1"]).status.success());
}

#[test]
fn bf16_on_the_cpu_is_a_device_error_in_every_command() {
    let t = tempfile::tempdir().unwrap();
    write_png(&t.path().join("a.png"), 8, 8, 1);
    let out = t.path().join("out");
    let (i, o) = (t.path().to_str().unwrap(), out.to_str().unwrap());
    for (cmd, model) in [("depth", "da2_relative_p14"), ("segment", "segformer_tiny"), ("chm", "chmv2_tiny")] {
        let m = fixture(model);
        let r = edgerun(&[cmd, "--model", m.to_str().unwrap(), i, "--out", o, "--device", "cpu", "--dtype", "bf16"]);
        assert_eq!(r.status.code(), Some(3), "{cmd}: {}", stderr(&r));
    }
}

#[cfg(unix)]
#[test]
fn stdout_that_closes_early_ends_quietly_and_a_full_disk_is_exit_4() {
    use std::io::Read;
    let model = fixture("da2_relative_p14");
    let mut child = Command::new(env!("CARGO_BIN_EXE_edgerun"))
        .args(["inspect", model.to_str().unwrap()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = [0u8; 8];
    child.stdout.as_mut().unwrap().read_exact(&mut first).unwrap();
    drop(child.stdout.take());
    let o = child.wait_with_output().unwrap();
    assert_no_panic(&o);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).is_empty(), "{}", stderr(&o));
    if Path::new("/dev/full").exists() {
        let full = std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
        let o = Command::new(env!("CARGO_BIN_EXE_edgerun")).args(["inspect", model.to_str().unwrap()]).stdout(full).output().unwrap();
        assert_no_panic(&o);
        assert_eq!(o.status.code(), Some(4), "{}", stderr(&o));
        assert!(stderr(&o).contains("<stdout>"), "{}", stderr(&o));
    }
}

#[cfg(unix)]
#[test]
fn quantize_never_replaces_its_input_or_a_special_file() {
    let t = tempfile::tempdir().unwrap();
    let q = t.path().join("q");
    std::fs::create_dir_all(&q).unwrap();
    let src = fixture("da2_relative_p14");
    let x = q.join("x.gguf");
    let o = edgerun(&["quantize", src.to_str().unwrap(), x.to_str().unwrap(), "--type", "q8_0", "--quiet"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let before = std::fs::read(&x).unwrap();
    let alias = t.path().join("q/../q/x.gguf");
    let o = edgerun(&["quantize", x.to_str().unwrap(), alias.to_str().unwrap(), "--type", "q4_0", "--quiet"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("input of this run"), "{}", stderr(&o));
    assert_eq!(std::fs::read(&x).unwrap(), before, "the input was overwritten");
    let fifo = t.path().join("fifo.gguf");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let dir = t.path().join("dir.gguf");
    std::fs::create_dir(&dir).unwrap();
    for target in [&fifo, &dir] {
        let o = edgerun(&["quantize", x.to_str().unwrap(), target.to_str().unwrap(), "--type", "q8_0", "--quiet"]);
        assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
        assert!(stderr(&o).contains("refusing to write over it"), "{}", stderr(&o));
    }
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo());
    assert!(dir.is_dir());
    let left: Vec<String> = walk(t.path()).into_iter().filter(|f| f.contains(".tmp-")).collect();
    assert!(left.is_empty(), "temp files left: {left:?}");
}

/// Six different images of one size (one shape, so they batch together).
fn same_size_tree(root: &Path) {
    for i in 0..6u8 {
        write_png(&root.join(format!("img_{i}.png")), 40, 30, 17 * i + 1);
    }
}

fn run_cmd(cmd: &str, model: &Path, input: &Path, out: &Path, batch: &str, env: Option<(&str, &str)>) -> Output {
    let dev = device();
    let mut c = Command::new(env!("CARGO_BIN_EXE_edgerun"));
    c.args([cmd, "--model", model.to_str().unwrap(), input.to_str().unwrap(), "--out", out.to_str().unwrap(), "--device", &dev, "--batch", batch, "--progress", "none"]);
    if let Some((k, v)) = env {
        c.env(k, v);
    }
    c.output().unwrap()
}

/// The same files with the same bytes; on a GPU, `.npy` arrays within the f32 bound plus one f16 step
/// of the stored value instead (cuBLAS and cuDNN choose their kernels by the batch's shape, so batched
/// results differ in the last bits, and an f16 output can round the other way: seen on an H200).
fn same_bytes(a: &Path, b: &Path) {
    let (fa, fb) = (walk(a), walk(b));
    assert_eq!(fa, fb);
    assert!(!fa.is_empty());
    let on_gpu = device() != "cpu";
    for f in fa {
        let (pa, pb) = (a.join(&f), b.join(&f));
        if on_gpu && f.ends_with(".npy") {
            let (sa, va) = edgerun::imageio::npy::read_npy_2d(&pa).unwrap();
            let (sb, vb) = edgerun::imageio::npy::read_npy_2d(&pb).unwrap();
            assert_eq!(sa, sb, "{f}");
            let scale = va.iter().fold(1f32, |m, v| m.max(v.abs()));
            let f16_step = |v: f32| v.abs() * 2f32.powi(-10);
            for (x, y) in va.iter().zip(&vb) {
                let err = (x - y).abs();
                assert!(err <= 1e-4 * scale + f16_step(x.abs().max(y.abs())), "{f}: {x} vs {y} (max |value| {scale}) in {} and {}", a.display(), b.display());
            }
            continue;
        }
        assert!(std::fs::read(&pa).unwrap() == std::fs::read(&pb).unwrap(), "{f} differs between {} and {}", a.display(), b.display());
    }
}

#[test]
fn batched_results_equal_batch_one_results() {
    let t = tempfile::tempdir().unwrap();
    let input = t.path().join("in");
    same_size_tree(&input);
    for (cmd, model) in [("depth", "da2_relative_p14"), ("segment", "segformer_tiny"), ("chm", "chmv2_tiny")] {
        let m = fixture(model);
        let one = t.path().join(format!("{model}-1"));
        let six = t.path().join(format!("{model}-6"));
        for (out, b) in [(&one, "1"), (&six, "6")] {
            let o = run_cmd(cmd, &m, &input, out, b, None);
            assert!(o.status.success(), "{cmd} {model} --batch {b}: {}", stderr(&o));
        }
        same_bytes(&one, &six);
    }
}

#[test]
fn injected_out_of_memory_halves_the_batch_and_loses_nothing() {
    let t = tempfile::tempdir().unwrap();
    let input = t.path().join("in");
    same_size_tree(&input);
    let m = fixture("da2_relative_p14");
    let reference = t.path().join("ref");
    assert!(run_cmd("depth", &m, &input, &reference, "1", None).status.success());
    let out = t.path().join("oom");
    let o = run_cmd("depth", &m, &input, &out, "6", Some(("EDGERUN_INJECT_OOM_ABOVE", "2")));
    let e = stderr(&o);
    assert!(o.status.success(), "{e}");
    assert!(e.contains("out of memory on a batch of 6: batch 6 → 3"), "{e}");
    assert!(e.contains("out of memory on a batch of 3: batch 3 → 1"), "{e}");
    assert!(e.contains("6 done, 0 failed"), "{e}");
    same_bytes(&reference, &out);
    // Out of memory even at batch 1: each item is recorded as failed, the run goes on, exit 2.
    let out = t.path().join("oom0");
    let o = run_cmd("depth", &m, &input, &out, "auto", Some(("EDGERUN_INJECT_OOM_ABOVE", "0")));
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{e}");
    assert!(e.contains("recorded as failed") && e.contains("0 done, 6 failed"), "{e}");
    for i in 0..6 {
        assert!(e.contains(&format!("FAILED {}", input.join(format!("img_{i}.png")).display())), "{e}");
    }
}

#[test]
fn batch_auto_plans_from_the_memory_budget() {
    let t = tempfile::tempdir().unwrap();
    let input = t.path().join("in");
    same_size_tree(&input);
    let m = fixture("da2_relative_p14");
    let dev = device();
    let run = |budget: &str| {
        let out = t.path().join(format!("o{budget}"));
        let o = edgerun(&["depth", "--model", m.to_str().unwrap(), input.to_str().unwrap(), "--out", out.to_str().unwrap(), "--device", &dev, "--mem-budget", budget, "--progress", "none"]);
        assert!(o.status.success(), "{}", stderr(&o));
        stderr(&o)
    };
    // The fixture's images need a few MiB each: 1 MiB allows one per pass, 4096 MiB all six.
    assert!(run("1").contains("batch auto: up to 1 per pass"), "{}", run("1"));
    let big = run("4096");
    let n: usize = big.split("up to ").nth(1).and_then(|s| s.split(' ').next()).and_then(|s| s.parse().ok()).unwrap_or(0);
    assert!(n >= 6, "{big}");
    let o = edgerun(&["depth", "--model", m.to_str().unwrap(), input.to_str().unwrap(), "--out", "x", "--mem-budget", "0"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
}

/// A tiled raster backs off like whole images: with every pass over more than one tile running out
/// of memory, `--batch 4` halves to 1 tile per pass and writes what batch 1 writes.
#[test]
fn injected_out_of_memory_halves_the_tile_batch_too() {
    let t = tempfile::tempdir().unwrap();
    let scene = fixture("chmv2_geotiff").join("scene.tif");
    let m = fixture("chmv2_tiny");
    let tiled = |out: &Path, batch: &str, env: Option<(&str, &str)>| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_edgerun"));
        c.args(["chm", "--model", m.to_str().unwrap(), scene.to_str().unwrap(), "--out", out.to_str().unwrap(), "--device", &device()]);
        c.args(["--tile", "32", "--overlap", "8", "--batch", batch, "--progress", "none"]);
        if let Some((k, v)) = env {
            c.env(k, v);
        }
        c.output().unwrap()
    };
    let reference = t.path().join("ref");
    let o = tiled(&reference, "1", None);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = t.path().join("oom");
    let o = tiled(&out, "4", Some(("EDGERUN_INJECT_OOM_ABOVE", "1")));
    let e = stderr(&o);
    assert!(o.status.success(), "{e}");
    assert!(e.contains("out of memory on a batch of 2: batch 2 → 1"), "{e}");
    same_bytes(&reference, &out);
}
