//! Hostile and clumsy input to every command, table-driven, through the real binary. Each case
//! asserts the exit code, a message naming the culprit, no panic text, a time bound, the inputs and
//! special files unchanged, nothing created outside `out/`, and no temp file left anywhere.
mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{device_arg, fixture};

/// How long any case may take before it counts as a hang.
const TIME_BOUND: Duration = Duration::from_secs(60);

/// One case: builds its inputs under `root` and returns the arguments (`out/` is where outputs go).
struct Case {
    name: &'static str,
    setup: fn(&Path) -> Vec<String>,
    code: i32,
    /// A fragment the error message must contain (the culprit: file, flag or value).
    culprit: &'static str,
}

fn s(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// Copies a fixture model directory to `root/name`.
fn model(root: &Path, fixture_name: &str, name: &str) -> PathBuf {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(fixture(fixture_name)).unwrap().flatten() {
        let n = e.file_name();
        let n = n.to_string_lossy();
        if n == "config.json" || n.starts_with("model.") || n == "preprocessor_config.json" {
            std::fs::copy(e.path(), dir.join(&*n)).unwrap();
        }
    }
    dir
}

/// A copy of a fixture model whose `config.json` has `patch` applied at the top level (or under
/// `backbone_config` for keys given as `backbone_config.KEY`).
fn model_with(root: &Path, fixture_name: &str, patch: &[(&str, serde_json::Value)]) -> PathBuf {
    let dir = model(root, fixture_name, "m");
    let p = dir.join("config.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    for (k, val) in patch {
        match k.split_once('.') {
            Some((outer, inner)) => v[outer][inner] = val.clone(),
            None => v[*k] = val.clone(),
        }
    }
    std::fs::write(&p, serde_json::to_vec(&v).unwrap()).unwrap();
    dir
}

fn fifo(p: &Path) {
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    assert!(Command::new("mkfifo").arg(p).status().unwrap().success());
}

fn png(p: &Path, w: u32, h: u32) {
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    image::RgbImage::from_fn(w, h, |x, y| image::Rgb([(x * 13) as u8, (y * 7) as u8, 90])).save(p).unwrap();
}

fn images(root: &Path) -> PathBuf {
    let d = root.join("in");
    png(&d.join("a.png"), 20, 16);
    png(&d.join("sub/b.png"), 18, 18);
    d
}

fn args(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| x.to_string()).collect()
}

fn image_cmd(root: &Path, cmd: &str, fixture_name: &str, extra: &[&str]) -> Vec<String> {
    let m = model(root, fixture_name, "m");
    let input = images(root);
    let mut a = vec![cmd.to_string(), "--model".into(), s(&m), s(&input), "--out".into(), s(&root.join("out")), "--device".into(), device_arg()];
    a.extend(extra.iter().map(|x| x.to_string()));
    a
}

fn npy_header(dict: &str) -> Vec<u8> {
    let mut h = dict.as_bytes().to_vec();
    while !(10 + h.len() + 1).is_multiple_of(64) {
        h.push(b' ');
    }
    h.push(b'\n');
    let mut b = b"\x93NUMPY\x01\x00".to_vec();
    b.extend((h.len() as u16).to_le_bytes());
    b.extend(h);
    b
}

fn depth_dir_with(root: &Path, file: &str, bytes: &[u8]) -> Vec<String> {
    let d = root.join("in");
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join(file), bytes).unwrap();
    args(&["edges", "--depth", &s(&d), "--out", &s(&root.join("out"))])
}

fn annotate_with(root: &Path, toml: &str) -> Vec<String> {
    let input = images(root);
    let m = model(root, "da2_relative_p14", "m");
    let cfg = root.join("annotate.toml");
    std::fs::write(&cfg, format!("stages = [\"depth\"]\ndevice = \"{}\"\n[depth]\nmodel = \"{}\"\n{toml}", device_arg(), s(&m))).unwrap();
    args(&["annotate", "--config", &s(&cfg), "--progress", "none", &s(&input), &s(&root.join("out"))])
}

/// Named input tensors: name, values, shape.
type Inputs<'a> = &'a [(&'a str, Vec<f32>, Vec<usize>)];

fn lgatr_with(root: &Path, patch: &[(&str, serde_json::Value)], input: Option<Inputs<'_>>) -> Vec<String> {
    let m = model_with(root, "lgatr_tiny", patch);
    let inp = match input {
        None => fixture("lgatr_tiny").join("input.safetensors"),
        Some(tensors) => {
            let p = root.join("events.safetensors");
            let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
                .iter()
                .map(|(n, data, shape)| {
                    let bytes: &[u8] = bytemuck_f32(data);
                    (n.to_string(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes).unwrap())
                })
                .collect();
            safetensors::serialize_to_file(views, None, &p).unwrap();
            p
        }
    };
    args(&["lgatr", "--model", &s(&m), "--input", &s(&inp), "--output", &s(&root.join("out/o.safetensors")), "--device", &device_arg()])
}

fn bytemuck_f32(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and any byte pattern is a valid u8.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

fn cases() -> Vec<Case> {
    vec![
        // ---- inspect ----
        Case { name: "inspect missing file", setup: |r| args(&["inspect", &s(&r.join("nope.gguf"))]), code: 4, culprit: "nope.gguf" },
        Case {
            name: "inspect FIFO as weight file",
            setup: |r| {
                let m = model(r, "da2_relative_p14", "m");
                std::fs::remove_file(m.join("model.safetensors")).unwrap();
                fifo(&m.join("model.safetensors"));
                args(&["inspect", &s(&m)])
            },
            code: 2,
            culprit: "model.safetensors",
        },
        Case {
            name: "inspect FIFO as config.json",
            setup: |r| {
                let m = model(r, "da2_relative_p14", "m");
                std::fs::remove_file(m.join("config.json")).unwrap();
                fifo(&m.join("config.json"));
                args(&["inspect", &s(&m)])
            },
            code: 2,
            culprit: "config.json",
        },
        Case { name: "inspect a directory with no weights", setup: |r| { std::fs::create_dir_all(r.join("empty")).unwrap(); args(&["inspect", &s(&r.join("empty"))]) }, code: 2, culprit: "empty" },
        Case { name: "inspect a device", setup: |_| args(&["inspect", "/dev/zero"]), code: 2, culprit: "/dev/zero" },
        // ---- quantize ----
        Case {
            name: "quantize onto its own input through ..",
            setup: |r| {
                let q = r.join("q");
                std::fs::create_dir_all(&q).unwrap();
                std::fs::copy(fixture("da2_relative_p14").join("model.safetensors"), q.join("x.safetensors")).unwrap();
                args(&["quantize", &s(&q.join("x.safetensors")), &s(&r.join("q/../q/x.safetensors")), "--type", "q8_0"])
            },
            code: 2,
            culprit: "input of this run",
        },
        Case {
            name: "quantize onto a FIFO",
            setup: |r| {
                let m = model(r, "da2_relative_p14", "m");
                fifo(&r.join("out/f.gguf"));
                args(&["quantize", &s(&m), &s(&r.join("out/f.gguf")), "--type", "q8_0"])
            },
            code: 2,
            culprit: "f.gguf",
        },
        Case {
            name: "quantize onto a directory",
            setup: |r| {
                let m = model(r, "da2_relative_p14", "m");
                std::fs::create_dir_all(r.join("out/d.gguf")).unwrap();
                args(&["quantize", &s(&m), &s(&r.join("out/d.gguf")), "--type", "q8_0"])
            },
            code: 2,
            culprit: "d.gguf",
        },
        Case {
            name: "quantize unknown type",
            setup: |r| args(&["quantize", &s(&model(r, "da2_relative_p14", "m")), &s(&r.join("out/x.gguf")), "--type", "q3_weird"]),
            code: 1,
            culprit: "q3_weird",
        },
        Case {
            name: "quantize recipe is a FIFO",
            setup: |r| {
                fifo(&r.join("recipe.toml"));
                args(&["quantize", &s(&model(r, "da2_relative_p14", "m")), &s(&r.join("out/x.gguf")), "--type", "q8_0", "--recipe", &s(&r.join("recipe.toml"))])
            },
            code: 2,
            culprit: "recipe.toml",
        },
        Case {
            name: "quantize recipe missing",
            setup: |r| args(&["quantize", &s(&model(r, "da2_relative_p14", "m")), &s(&r.join("out/x.gguf")), "--type", "q8_0", "--recipe", &s(&r.join("nope.toml"))]),
            code: 4,
            culprit: "nope.toml",
        },
        // ---- forward ----
        Case { name: "forward --repeat 0", setup: |r| forward(r, &["--repeat", "0"]), code: 2, culprit: "--repeat" },
        Case { name: "forward --repeat 1e12", setup: |r| forward(r, &["--repeat", "1000000000000"]), code: 2, culprit: "--repeat" },
        Case { name: "forward --threads 0", setup: |r| forward(r, &["--threads", "0"]), code: 2, culprit: "--threads" },
        Case { name: "forward --threads 100000", setup: |r| forward(r, &["--threads", "100000"]), code: 2, culprit: "--threads" },
        Case {
            name: "forward input missing",
            setup: |r| args(&["forward", "--model", &s(&model(r, "da2_relative_p14", "m")), "--input", &s(&r.join("nope.safetensors")), "--output", &s(&r.join("out/o.safetensors"))]),
            code: 4,
            culprit: "nope.safetensors",
        },
        Case {
            name: "forward input garbage",
            setup: |r| {
                std::fs::write(r.join("in.safetensors"), b"\x05\x00\x00\x00\x00\x00\x00\x00{{{{{").unwrap();
                args(&["forward", "--model", &s(&model(r, "da2_relative_p14", "m")), "--input", &s(&r.join("in.safetensors")), "--output", &s(&r.join("out/o.safetensors"))])
            },
            code: 2,
            culprit: "in.safetensors",
        },
        Case {
            name: "forward output is its input",
            setup: |r| {
                std::fs::create_dir_all(r.join("out")).unwrap();
                std::fs::copy(fixture("da2_relative_p14").join("input.safetensors"), r.join("out/io.safetensors")).unwrap();
                let io = s(&r.join("out/io.safetensors"));
                args(&["forward", "--model", &s(&model(r, "da2_relative_p14", "m")), "--input", &io, "--output", &io, "--device", &device_arg()])
            },
            code: 2,
            culprit: "input of this run",
        },
        Case {
            name: "forward output is a FIFO",
            setup: |r| {
                fifo(&r.join("out/o.safetensors"));
                forward(r, &[])
            },
            code: 2,
            culprit: "o.safetensors",
        },
        Case {
            name: "forward model with weights that do not fit the config",
            setup: |r| {
                let m = model_with(r, "da2_relative_p14", &[("backbone_config.hidden_size", serde_json::json!(48))]);
                args(&["forward", "--model", &s(&m), "--input", &s(&fixture("da2_relative_p14").join("input.safetensors")), "--output", &s(&r.join("out/o.safetensors"))])
            },
            code: 2,
            culprit: "m",
        },
        // ---- depth ----
        Case { name: "depth model missing", setup: |r| { let i = images(r); args(&["depth", "--model", &s(&r.join("nope")), &s(&i), "--out", &s(&r.join("out"))]) }, code: 4, culprit: "nope" },
        Case { name: "depth --batch 0", setup: |r| image_cmd(r, "depth", "da2_relative_p14", &["--batch", "0"]), code: 2, culprit: "--batch" },
        Case { name: "depth --batch words", setup: |r| image_cmd(r, "depth", "da2_relative_p14", &["--batch", "lots"]), code: 2, culprit: "lots" },
        Case { name: "depth --mem-budget 0", setup: |r| image_cmd(r, "depth", "da2_relative_p14", &["--mem-budget", "0"]), code: 2, culprit: "--mem-budget" },
        Case { name: "depth --focal -1", setup: |r| image_cmd(r, "depth", "da2_relative_p14", &["--focal", "-1"]), code: 2, culprit: "focal" },
        Case { name: "depth --dtype bf16 on the CPU", setup: |r| { let mut a = image_cmd(r, "depth", "da2_relative_p14", &[]); a.retain(|x| x != &device_arg()); a.retain(|x| x != "--device"); a.extend(args(&["--device", "cpu", "--dtype", "bf16"])); a }, code: 3, culprit: "bf16" },
        Case { name: "depth --device that is not compiled in", setup: |r| { let mut a = image_cmd(r, "depth", "da2_relative_p14", &[]); let i = a.iter().position(|x| x == "--device").unwrap(); a[i + 1] = "metal".into(); a }, code: 3, culprit: "etal" },
        Case { name: "depth --progress nonsense", setup: |r| image_cmd(r, "depth", "da2_relative_p14", &["--progress", "loud"]), code: 2, culprit: "loud" },
        Case {
            name: "depth --out is the input directory",
            setup: |r| {
                let i = images(r);
                args(&["depth", "--model", &s(&model(r, "da2_relative_p14", "m")), &s(&i), "--out", &s(&i)])
            },
            code: 2,
            culprit: "input directory",
        },
        Case {
            name: "depth tree with a truncated JPEG",
            setup: |r| {
                let i = images(r);
                let p = i.join("t.jpg");
                image::RgbImage::from_fn(30, 20, |x, y| image::Rgb([x as u8 * 5, y as u8 * 9, 7])).save(&p).unwrap();
                let b = std::fs::read(&p).unwrap();
                std::fs::write(&p, &b[..b.len() / 2]).unwrap();
                image_cmd_at(r, &i, "depth", "da2_relative_p14")
            },
            code: 2,
            culprit: "t.jpg",
        },
        Case {
            name: "depth tree with a zero-byte image",
            setup: |r| {
                let i = images(r);
                std::fs::write(i.join("z.png"), b"").unwrap();
                image_cmd_at(r, &i, "depth", "da2_relative_p14")
            },
            code: 2,
            culprit: "z.png",
        },
        Case {
            name: "depth tree with a symlink loop and a FIFO",
            setup: |r| {
                let i = images(r);
                std::os::unix::fs::symlink(&i, i.join("sub/loop")).unwrap();
                fifo(&i.join("f.png"));
                image_cmd_at(r, &i, "depth", "da2_relative_p14")
            },
            code: 2,
            culprit: "f.png",
        },
        Case {
            name: "depth tree with a name that is not UTF-8",
            setup: |r| {
                use std::os::unix::ffi::OsStrExt;
                let i = images(r);
                let name = std::ffi::OsStr::from_bytes(b"bad\xff.png");
                std::fs::copy(i.join("a.png"), i.join(name)).unwrap();
                image_cmd_at(r, &i, "depth", "da2_relative_p14")
            },
            code: 2,
            culprit: "not UTF-8",
        },
        Case { name: "depth with a segmentation model", setup: |r| image_cmd(r, "depth", "segformer_tiny", &[]), code: 2, culprit: "segformer" },
        // ---- segment ----
        Case { name: "segment --size 0x5", setup: |r| image_cmd(r, "segment", "segformer_tiny", &["--size", "0x5"]), code: 2, culprit: "0x5" },
        Case { name: "segment --size 100000x100000", setup: |r| image_cmd(r, "segment", "segformer_tiny", &["--size", "100000x100000"]), code: 2, culprit: "100000x100000" },
        Case { name: "segment with a depth model", setup: |r| image_cmd(r, "segment", "da2_relative_p14", &[]), code: 2, culprit: "depth_anything" },
        Case {
            name: "segment --classes is a FIFO",
            setup: |r| {
                fifo(&r.join("classes.toml"));
                let c = s(&r.join("classes.toml"));
                image_cmd(r, "segment", "segformer_tiny", &["--classes", &c])
            },
            code: 2,
            culprit: "classes.toml",
        },
        Case {
            name: "segment --classes missing",
            setup: |r| {
                let c = s(&r.join("nope.toml"));
                image_cmd(r, "segment", "segformer_tiny", &["--classes", &c])
            },
            code: 4,
            culprit: "nope.toml",
        },
        // ---- chm ----
        Case { name: "chm --head-dtype bf16 on the CPU", setup: |r| { let mut a = image_cmd(r, "chm", "chmv2_tiny", &["--head-dtype", "bf16"]); let i = a.iter().position(|x| x == "--device").unwrap(); a[i + 1] = "cpu".into(); a }, code: 3, culprit: "bf16" },
        Case { name: "chm with a depth model", setup: |r| image_cmd(r, "chm", "da2_relative_p14", &[]), code: 2, culprit: "depth_anything" },
        Case {
            name: "chm truncated TIFF",
            setup: |r| {
                let i = images(r);
                let b = std::fs::read(fixture("chmv2_geotiff").join("scene.tif")).unwrap();
                std::fs::write(i.join("cut.tif"), &b[..b.len() / 2]).unwrap();
                image_cmd_at(r, &i, "chm", "chmv2_tiny")
            },
            code: 2,
            culprit: "cut.tif",
        },
        // ---- edges ----
        Case { name: "edges --depth missing", setup: |r| args(&["edges", "--depth", &s(&r.join("nope")), "--out", &s(&r.join("out"))]), code: 2, culprit: "nope" },
        Case { name: "edges garbage npy", setup: |r| depth_dir_with(r, "g.depth.npy", b"\x93NUMPY\x01\x00garbage"), code: 2, culprit: "g.depth.npy" },
        Case {
            name: "edges npy longer than its file",
            setup: |r| {
                let mut b = npy_header("{'descr': '<f4', 'fortran_order': False, 'shape': (1000, 1000), }");
                b.extend([0u8; 16]);
                depth_dir_with(r, "short.depth.npy", &b)
            },
            code: 2,
            culprit: "short.depth.npy",
        },
        Case {
            name: "edges npy of one pixel",
            setup: |r| {
                let mut b = npy_header("{'descr': '<f4', 'fortran_order': False, 'shape': (1, 1), }");
                b.extend(1f32.to_le_bytes());
                depth_dir_with(r, "dot.depth.npy", &b)
            },
            code: 2,
            culprit: "dot.depth.npy",
        },
        Case {
            name: "edges npy of the wrong dtype",
            setup: |r| {
                let mut b = npy_header("{'descr': '<i8', 'fortran_order': False, 'shape': (2, 2), }");
                b.extend([0u8; 32]);
                depth_dir_with(r, "int.depth.npy", &b)
            },
            code: 2,
            culprit: "int.depth.npy",
        },
        Case {
            name: "edges FIFO depth map",
            setup: |r| {
                let d = r.join("in");
                fifo(&d.join("f.depth.npy"));
                args(&["edges", "--depth", &s(&d), "--out", &s(&r.join("out"))])
            },
            code: 2,
            culprit: "f.depth.npy",
        },
        // ---- annotate ----
        Case {
            name: "annotate into its input directory",
            setup: |r| {
                let mut a = annotate_with(r, "");
                let n = a.len();
                a[n - 1] = a[n - 2].clone();
                a
            },
            code: 2,
            culprit: "input directory",
        },
        Case { name: "annotate batch 0", setup: |r| annotate_with(r, "batch = 0\n"), code: 2, culprit: "batch" },
        Case { name: "annotate batch words", setup: |r| annotate_with(r, "batch = \"lots\"\n"), code: 2, culprit: "lots" },
        Case { name: "annotate mem_budget_mb 0", setup: |r| annotate_with(r, "mem_budget_mb = 0\n"), code: 2, culprit: "mem_budget_mb" },
        Case { name: "annotate unknown key", setup: |r| annotate_with(r, "bogus_key = 1\n"), code: 2, culprit: "bogus_key" },
        Case { name: "annotate bf16 on the CPU", setup: |r| { let mut a = annotate_with(r, "dtype = \"bf16\"\n"); a.extend(args(&["--device", "cpu"])); a }, code: 3, culprit: "bf16" },
        Case { name: "annotate --shard 5/2", setup: |r| { let mut a = annotate_with(r, ""); a.extend(args(&["--shard", "5/2"])); a }, code: 2, culprit: "5/2" },
        Case { name: "annotate --batch 0", setup: |r| { let mut a = annotate_with(r, ""); a.extend(args(&["--batch", "0"])); a }, code: 2, culprit: "0" },
        Case {
            name: "annotate config is a FIFO",
            setup: |r| {
                let i = images(r);
                fifo(&r.join("cfg.toml"));
                args(&["annotate", "--config", &s(&r.join("cfg.toml")), &s(&i), &s(&r.join("out"))])
            },
            code: 2,
            culprit: "cfg.toml",
        },
        Case { name: "annotate without directories", setup: |_| args(&["annotate", "--progress", "none"]), code: 2, culprit: "input_dir" },
        // ---- lgatr ----
        Case {
            name: "lgatr config that does not fit its weights",
            setup: |r| lgatr_with(r, &[("hidden_mv_channels", serde_json::json!(24))], None),
            code: 2,
            culprit: "m",
        },
        Case {
            name: "lgatr with a depth model",
            setup: |r| {
                let m = model(r, "da2_relative_p14", "m");
                args(&["lgatr", "--model", &s(&m), "--input", &s(&fixture("lgatr_tiny").join("input.safetensors")), "--output", &s(&r.join("out/o.safetensors"))])
            },
            code: 2,
            culprit: "depth_anything",
        },
        Case {
            name: "lgatr input missing",
            setup: |r| {
                let m = model(r, "lgatr_tiny", "m");
                args(&["lgatr", "--model", &s(&m), "--input", &s(&r.join("nope.safetensors")), "--output", &s(&r.join("out/o.safetensors"))])
            },
            code: 4,
            culprit: "nope.safetensors",
        },
        // ---- doctor and the command line ----
        Case { name: "doctor --models missing", setup: |r| args(&["doctor", "--models", &s(&r.join("nope"))]), code: 4, culprit: "nope" },
        Case { name: "unknown command", setup: |_| args(&["teleport"]), code: 2, culprit: "teleport" },
        Case { name: "unknown flag", setup: |r| image_cmd(r, "depth", "da2_relative_p14", &["--turbo"]), code: 2, culprit: "--turbo" },
    ]
}

fn forward(r: &Path, extra: &[&str]) -> Vec<String> {
    let m = model(r, "da2_relative_p14", "m");
    let mut a = args(&["forward", "--model", &s(&m), "--input", &s(&fixture("da2_relative_p14").join("input.safetensors")), "--output", &s(&r.join("out/o.safetensors")), "--device", &device_arg()]);
    a.extend(extra.iter().map(|x| x.to_string()));
    a
}

fn image_cmd_at(r: &Path, input: &Path, cmd: &str, fixture_name: &str) -> Vec<String> {
    let m = model(r, fixture_name, "m");
    args(&[cmd, "--model", &s(&m), &s(input), "--out", &s(&r.join("out")), "--device", &device_arg(), "--progress", "none"])
}

/// Every entry under `root` except `out/`: path → (kind, size, modification time).
fn snapshot(root: &Path) -> BTreeMap<PathBuf, (String, u64, std::time::SystemTime)> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p == root.join("out") {
                continue;
            }
            let m = std::fs::symlink_metadata(&p).unwrap();
            let kind = format!("{:?}", m.file_type());
            if m.is_dir() {
                stack.push(p.clone());
            }
            out.insert(p, (kind, if m.is_file() { m.len() } else { 0 }, m.modified().unwrap()));
        }
    }
    out
}

fn temp_files(root: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else { continue };
        for e in rd.flatten() {
            let p = e.path();
            let m = std::fs::symlink_metadata(&p).unwrap();
            if m.is_dir() {
                stack.push(p);
            } else if p.file_name().is_some_and(|n| n.to_string_lossy().contains(".tmp-")) {
                found.push(p);
            }
        }
    }
    found
}

/// Runs case `c` (with `env` set) and returns what went wrong, if anything; `after` checks what the
/// run left under its root.
fn run_case(c: &Case, env: &[(&str, &str)], after: fn(&Path) -> Result<(), String>) -> Option<String> {
    let t = tempfile::tempdir().unwrap();
    let root = t.path();
    let a = (c.setup)(root);
    let before = snapshot(root);
    let start = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_edgerun")).args(&a).envs(env.iter().copied()).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    let mut hung = false;
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > TIME_BOUND {
            child.kill().unwrap();
            hung = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    let mut why = Vec::new();
    if hung {
        why.push(format!("did not finish within {TIME_BOUND:?}"));
    }
    if o.status.code() != Some(c.code) {
        why.push(format!("exit code {:?}, expected {}", o.status.code(), c.code));
    }
    if !err.contains(c.culprit) {
        why.push(format!("the message does not name `{}`", c.culprit));
    }
    if err.contains("panicked") || err.contains("internal error") || err.contains("stack backtrace") {
        why.push("panic text".into());
    }
    if snapshot(root) != before {
        why.push("something outside out/ was created, changed or removed".into());
    }
    let temps = temp_files(root);
    if !temps.is_empty() {
        why.push(format!("temp files left: {temps:?}"));
    }
    if let Err(e) = after(root) {
        why.push(e);
    }
    (!why.is_empty()).then(|| format!("{}: {}\n    args: {a:?}\n    stderr: {}", c.name, why.join("; "), err.trim()))
}

#[cfg(unix)]
#[test]
fn hostile_inputs_get_a_clear_error_and_lose_nothing() {
    let all = cases();
    assert!(all.len() >= 60, "{} cases", all.len());
    let failures: Vec<String> = all.iter().filter_map(|c| run_case(c, &[], |_| Ok(()))).collect();
    assert!(failures.is_empty(), "{} of {} cases failed:\n{}", failures.len(), all.len(), failures.join("\n"));
}

// ---- Third round (#44): finetune's outputs and resume state, FIFOs named directly, symlinked
// outputs, GGUF metadata. Each case may set environment variables and check what the run left.

/// A case of the third round: [`Case`], the environment it runs in, and a check of what it left.
struct Round3 {
    case: Case,
    env: &'static [(&'static str, &'static str)],
    after: fn(&Path) -> Result<(), String>,
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `finetune` on an example's settings (`depth` or `segmentation`) for one epoch into `root/out`,
/// with `data` (the example's own when None) and `flags` after.
fn finetune_with(root: &Path, example: &str, data: Option<&Path>, flags: &[&str]) -> Vec<String> {
    let (toml, model, example_data) = match example {
        "segmentation" => ("finetune_segmentation.toml", "segformer_tiny", "finetune/segmentation"),
        _ => ("finetune.toml", "da2_metric_p14", "finetune/data"),
    };
    let text = std::fs::read_to_string(repo().join("examples").join(toml)).unwrap();
    let kept: String = text.lines().filter(|l| !["model", "data", "out"].contains(&l.split('=').next().unwrap_or("").trim())).map(|l| format!("{l}\n")).collect();
    let data = data.map(Path::to_path_buf).unwrap_or_else(|| repo().join("examples").join(example_data));
    let cfg = root.join("ft.toml");
    std::fs::write(&cfg, format!("model = {:?}\ndata = {:?}\nout = {:?}\n{kept}", fixture(model), data, root.join("out"))).unwrap();
    let mut a = args(&["--threads", "1", "finetune", "--config", &s(&cfg), "--epochs", "1", "--device", &device_arg()]);
    a.extend(flags.iter().map(|x| x.to_string()));
    a
}

fn finetune(root: &Path, flags: &[&str]) -> Vec<String> {
    finetune_with(root, "depth", None, flags)
}

/// A copy of an example's data under `root/data`.
fn copy_data(root: &Path, example_data: &str) -> PathBuf {
    let data = root.join("data");
    for sub in ["images", "targets"] {
        let src = repo().join("examples").join(example_data).join(sub);
        std::fs::create_dir_all(data.join(sub)).unwrap();
        for e in std::fs::read_dir(&src).unwrap().flatten() {
            std::fs::copy(e.path(), data.join(sub).join(e.file_name())).unwrap();
        }
    }
    data
}

/// Replaces a depth target with NaN everywhere (same shape).
fn nan_target(p: &Path) {
    let ((h, w), _) = edgerun::imageio::npy::read_npy_2d(p).unwrap();
    edgerun::imageio::npy::write_npy_f32(p, &[h, w], &vec![f32::NAN; h * w]).unwrap();
}

/// Runs `a` to completion (a setup step: a finished run to resume from).
fn run_ok(a: &[String]) {
    let o = Command::new(env!("CARGO_BIN_EXE_edgerun")).args(a).output().unwrap();
    assert!(o.status.success(), "setup run failed: {}", String::from_utf8_lossy(&o.stderr));
}

/// Rewrites the resume metadata of `state.safetensors` with `edit` applied.
fn tamper_state(p: &Path, edit: fn(&mut serde_json::Value)) {
    let b = std::fs::read(p).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
    let mut meta: serde_json::Value = serde_json::from_str(header["__metadata__"]["edgerun.finetune"].as_str().unwrap()).unwrap();
    edit(&mut meta);
    header["__metadata__"]["edgerun.finetune"] = serde_json::Value::String(meta.to_string());
    let mut h = serde_json::to_vec(&header).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    out.extend(&b[8 + n..]);
    std::fs::write(p, out).unwrap();
}

/// A file outside `out/` that a link inside it points at (the snapshot proves it untouched).
fn precious(root: &Path) -> PathBuf {
    let p = root.join("precious.txt");
    std::fs::write(&p, b"must survive\n").unwrap();
    p
}

fn link(target: &Path, at: &Path) {
    std::fs::create_dir_all(at.parent().unwrap()).unwrap();
    std::os::unix::fs::symlink(target, at).unwrap();
}

/// A GGUF with no tensors and `arrays` boolean arrays of `len` elements each.
fn gguf_with_bool_arrays(p: &Path, arrays: usize, len: u64) {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    b.extend((arrays as u64).to_le_bytes());
    for i in 0..arrays {
        let key = format!("flags.{i}");
        b.extend((key.len() as u64).to_le_bytes());
        b.extend(key.as_bytes());
        b.extend(9u32.to_le_bytes());
        b.extend(7u32.to_le_bytes());
        b.extend(len.to_le_bytes());
        b.extend(std::iter::repeat_n(1u8, len as usize));
    }
    std::fs::write(p, b).unwrap();
}

fn exists(p: &Path) -> bool {
    std::fs::symlink_metadata(p).is_ok()
}

fn nothing_saved(r: &Path) -> Result<(), String> {
    let left: Vec<&str> = ["out/last", "out/best", "out/state/state.safetensors", "out/.last.tmp", "out/.last.old"].into_iter().filter(|p| exists(&r.join(p))).collect();
    if left.is_empty() { Ok(()) } else { Err(format!("saved anyway: {left:?}")) }
}

fn trained(r: &Path) -> Result<(), String> {
    if r.join("out/last/model.safetensors").is_file() { Ok(()) } else { Err("no out/last/model.safetensors".into()) }
}

fn none(_: &Path) -> Result<(), String> {
    Ok(())
}

fn round3() -> Vec<Round3> {
    let plain = |case: Case| Round3 { case, env: &[], after: none };
    vec![
        // 1. FIFOs named directly.
        plain(Case { name: "inspect a FIFO named as a .safetensors", setup: |r| { fifo(&r.join("x.safetensors")); args(&["inspect", &s(&r.join("x.safetensors"))]) }, code: 2, culprit: "x.safetensors" }),
        plain(Case { name: "inspect a FIFO named as a .gguf", setup: |r| { fifo(&r.join("x.gguf")); args(&["inspect", &s(&r.join("x.gguf"))]) }, code: 2, culprit: "x.gguf" }),
        plain(Case {
            name: "forward --input is a FIFO",
            setup: |r| {
                fifo(&r.join("in.safetensors"));
                args(&["forward", "--model", &s(&model(r, "da2_relative_p14", "m")), "--input", &s(&r.join("in.safetensors")), "--output", &s(&r.join("out/o.safetensors"))])
            },
            code: 2,
            culprit: "in.safetensors",
        }),
        plain(Case {
            name: "lgatr --input is a FIFO",
            setup: |r| {
                fifo(&r.join("ev.safetensors"));
                args(&["lgatr", "--model", &s(&model(r, "lgatr_tiny", "m")), "--input", &s(&r.join("ev.safetensors")), "--output", &s(&r.join("out/o.safetensors"))])
            },
            code: 2,
            culprit: "ev.safetensors",
        }),
        plain(Case { name: "quantize a FIFO", setup: |r| { fifo(&r.join("f.safetensors")); args(&["quantize", &s(&r.join("f.safetensors")), &s(&r.join("out/x.gguf")), "--type", "q8_0"]) }, code: 2, culprit: "f.safetensors" }),
        plain(Case {
            name: "depth --model is a FIFO .gguf",
            setup: |r| {
                fifo(&r.join("m.gguf"));
                let i = images(r);
                args(&["depth", "--model", &s(&r.join("m.gguf")), &s(&i), "--out", &s(&r.join("out"))])
            },
            code: 2,
            culprit: "m.gguf",
        }),
        plain(Case { name: "finetune resume state is a FIFO", setup: |r| { fifo(&r.join("out/state/state.safetensors")); finetune(r, &[]) }, code: 2, culprit: "state.safetensors" }),
        plain(Case { name: "finetune log.jsonl is a FIFO", setup: |r| { fifo(&r.join("out/log.jsonl")); finetune(r, &[]) }, code: 2, culprit: "log.jsonl" }),
        plain(Case { name: "annotate journal is a FIFO", setup: |r| { let a = annotate_with(r, ""); fifo(&r.join("out/manifests/depth.jsonl")); a }, code: 2, culprit: "depth.jsonl" }),
        // 2. Outputs written in place through links.
        plain(Case { name: "finetune log.jsonl links out of --out", setup: |r| { link(&precious(r), &r.join("out/log.jsonl")); finetune(r, &[]) }, code: 2, culprit: "log.jsonl" }),
        plain(Case {
            name: "finetune --offload spill file links out of --out",
            setup: |r| {
                link(&precious(r), &r.join("out/state/activations.spill"));
                finetune(r, &["--train", "last:2", "--offload"])
            },
            code: 2,
            culprit: "activations.spill",
        }),
        plain(Case { name: "annotate journal links out of the output", setup: |r| { let a = annotate_with(r, ""); link(&precious(r), &r.join("out/manifests/depth.jsonl")); a }, code: 2, culprit: "depth.jsonl" }),
        plain(Case {
            name: "finetune state/ links out of --out",
            setup: |r| {
                std::fs::create_dir_all(r.join("elsewhere")).unwrap();
                link(&r.join("elsewhere"), &r.join("out/state"));
                finetune(r, &[])
            },
            code: 2,
            culprit: "state",
        }),
        // 3. finetune never replaces its input.
        Round3 {
            case: Case {
                name: "finetune --model OUT/best --out OUT",
                setup: |r| {
                    let best = model(r, "da2_metric_p14", "out/best");
                    finetune(r, &["--model", &s(&best)])
                },
                code: 2,
                culprit: "input of this run",
            },
            env: &[],
            after: |r| {
                let same = std::fs::read(r.join("out/best/model.safetensors")).ok() == std::fs::read(fixture("da2_metric_p14").join("model.safetensors")).ok();
                if same && r.join("out/best/config.json").is_file() { Ok(()) } else { Err("the input model folder was changed".into()) }
            },
        },
        // 4. Nothing non-finite is saved, and the message stays true.
        Round3 {
            case: Case { name: "finetune step turns weights NaN on a save step", setup: |r| finetune(r, &[]), code: 2, culprit: "nothing was saved over the last checkpoint" },
            env: &[("EDGERUN_INJECT_NAN_AT_STEP", "3")],
            after: nothing_saved,
        },
        // 5. One run per output directory.
        Round3 {
            case: Case {
                name: "finetune on an --out another run holds",
                setup: |r| {
                    std::fs::create_dir_all(r.join("out")).unwrap();
                    let f = std::fs::OpenOptions::new().create(true).append(true).open(r.join("out").join(edgerun::fsutil::DIR_LOCK)).unwrap();
                    f.try_lock().unwrap();
                    // Held until this test process ends, as a running `finetune` holds it.
                    std::mem::forget(f);
                    finetune(r, &[])
                },
                code: 2,
                culprit: "locked",
            },
            env: &[],
            after: nothing_saved,
        },
        // 6. Left behind, corrupted, accepted.
        plain(Case {
            name: "finetune state at a step beyond the run",
            setup: |r| {
                let a = finetune(r, &[]);
                run_ok(&a);
                tamper_state(&r.join("out/state/state.safetensors"), |m| {
                    m["step"] = 1000.into();
                    m["adam_steps"] = 1000.into();
                });
                a
            },
            code: 2,
            culprit: "beyond this run's 3 steps",
        }),
        Round3 {
            case: Case {
                name: "finetune log deleted and its saved length set to 1e12",
                setup: |r| {
                    let a = finetune(r, &[]);
                    run_ok(&a);
                    std::fs::remove_file(r.join("out/log.jsonl")).unwrap();
                    tamper_state(&r.join("out/state/state.safetensors"), |m| m["log_len"] = 1_000_000_000_000u64.into());
                    a
                },
                code: 0,
                culprit: "log.jsonl",
            },
            env: &[],
            after: |r| match std::fs::metadata(r.join("out/log.jsonl")) {
                Ok(m) if m.len() < 1 << 20 => Ok(()),
                Ok(m) => Err(format!("log.jsonl padded to {} bytes", m.len())),
                Err(e) => Err(format!("log.jsonl: {e}")),
            },
        },
        Round3 {
            case: Case { name: "finetune OUT/last is a regular file", setup: |r| { std::fs::create_dir_all(r.join("out")).unwrap(); std::fs::write(r.join("out/last"), b"x").unwrap(); finetune(r, &[]) }, code: 2, culprit: "out/last" },
            env: &[],
            after: |r| if r.join("out/last").is_file() && !exists(&r.join("out/.last.old")) { Ok(()) } else { Err("out/last was moved".into()) },
        },
        // 7. GGUF metadata bounded as a whole.
        plain(Case { name: "inspect a GGUF whose metadata expands past the limit", setup: |r| { gguf_with_bool_arrays(&r.join("flags.gguf"), 2, 1_200_000); args(&["inspect", &s(&r.join("flags.gguf"))]) }, code: 2, culprit: "decoded" }),
        // 8. All-ignored targets: skipped with a warning naming the file.
        Round3 {
            case: Case {
                name: "finetune --batch 1 with an all-NaN depth target",
                setup: |r| {
                    let d = copy_data(r, "finetune/data");
                    nan_target(&d.join("targets/scene_04.npy"));
                    finetune_with(r, "depth", Some(&d), &["--batch", "1"])
                },
                code: 0,
                culprit: "scene_04.npy: every target pixel is ignored",
            },
            env: &[],
            after: trained,
        },
        Round3 {
            case: Case {
                name: "finetune with an all-255 class map",
                setup: |r| {
                    let d = copy_data(r, "finetune/segmentation");
                    let p = d.join("targets/tile_03.png");
                    let (w, h) = image::image_dimensions(&p).unwrap();
                    image::GrayImage::from_pixel(w, h, image::Luma([255])).save(&p).unwrap();
                    finetune_with(r, "segmentation", Some(&d), &["--batch", "1"])
                },
                code: 0,
                culprit: "tile_03.png: every target pixel is ignored",
            },
            env: &[],
            after: trained,
        },
        Round3 {
            case: Case {
                name: "finetune with every depth target all-NaN",
                setup: |r| {
                    let d = copy_data(r, "finetune/data");
                    for e in std::fs::read_dir(d.join("targets")).unwrap().flatten() {
                        nan_target(&e.path());
                    }
                    finetune_with(r, "depth", Some(&d), &[])
                },
                code: 2,
                culprit: "nothing to learn from",
            },
            env: &[],
            after: nothing_saved,
        },
        // 9. One symlink rule; annotate's exit code when every item failed.
        plain(Case {
            name: "finetune images/ links out of the data root",
            setup: |r| {
                let d = copy_data(r, "finetune/data");
                std::fs::rename(d.join("images"), r.join("images_elsewhere")).unwrap();
                link(&r.join("images_elsewhere"), &d.join("images"));
                finetune_with(r, "depth", Some(&d), &[])
            },
            code: 2,
            culprit: "out of the data directory",
        }),
        plain(Case {
            name: "depth tree with a symlink out of its root",
            setup: |r| {
                let i = images(r);
                png(&r.join("secret/s.png"), 20, 16);
                link(&r.join("secret/s.png"), &i.join("s.png"));
                image_cmd_at(r, &i, "depth", "da2_relative_p14")
            },
            code: 2,
            culprit: "outside the input root",
        }),
        plain(Case {
            name: "annotate whose every item fails",
            setup: |r| {
                let a = annotate_with(r, "");
                let i = r.join("in");
                std::fs::remove_dir_all(&i).unwrap();
                std::fs::create_dir_all(&i).unwrap();
                std::fs::write(i.join("z.png"), b"").unwrap();
                std::fs::write(i.join("t.png"), b"\x89PNG\r\n\x1a\n").unwrap();
                a
            },
            code: 2,
            culprit: "every one of the 2 inputs processed failed",
        }),
    ]
}

#[cfg(unix)]
#[test]
fn outputs_state_fifos_links_and_metadata_are_refused_or_survived() {
    let all = round3();
    assert!(all.len() >= 26, "{} cases", all.len());
    let failures: Vec<String> = all.iter().filter_map(|c| run_case(&c.case, c.env, c.after)).collect();
    assert!(failures.is_empty(), "{} of {} cases failed:\n{}", failures.len(), all.len(), failures.join("\n"));
}
