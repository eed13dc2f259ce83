//! `edgerun inspect` on malformed files: a clear message naming the file and the problem on stderr and
//! exit code 2 (bad input) — never a panic (exit code 101).
use std::io::Cursor;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use candle_core::quantized::GgmlDType;
use edgerun::quantize::gguf_writer::{plan, GgufWriter};
use edgerun::weights::MetaValue;

fn edgerun(args: &[&std::ffi::OsStr]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_edgerun")).args(args).output().expect("run edgerun")
}

fn inspect(path: &Path) -> (i32, String, String) {
    let out = edgerun(&["inspect".as_ref(), path.as_os_str()]);
    let code = out.status.code().expect("edgerun was killed by a signal");
    (code, String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(&p, bytes).unwrap();
    p
}

/// `inspect` on `path` must fail with `code`, a stderr naming `name_in_msg` and every fragment, and no panic.
fn expect_fail(path: &Path, code: i32, name_in_msg: &str, fragments: &[&str]) {
    let (got, _, err) = inspect(path);
    assert_ne!(got, 101, "edgerun panicked on {}: {err}", path.display());
    assert!(!err.contains("panicked"), "panic on {}: {err}", path.display());
    assert_eq!(got, code, "exit code for {}: stderr: {err}", path.display());
    assert!(err.contains("edgerun: error:"), "{err}");
    assert!(err.contains(name_in_msg), "stderr does not name `{name_in_msg}`: {err}");
    for f in fragments {
        assert!(err.contains(f), "stderr lacks `{f}`: {err}");
    }
}

fn gstr(s: &[u8]) -> Vec<u8> {
    let mut v = (s.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(s);
    v
}

/// A GGUF header with one metadata entry (raw type and value) and no tensors.
fn gguf_with_kv(key: &str, ty: u32, value: &[u8]) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    b.extend(1u64.to_le_bytes());
    b.extend(gstr(key.as_bytes()));
    b.extend(ty.to_le_bytes());
    b.extend_from_slice(value);
    b
}

fn valid_gguf(config: &str) -> Vec<u8> {
    let planned = plan(vec![("w.weight".into(), vec![2, 32], GgmlDType::Q8_0), ("b".into(), vec![2], GgmlDType::F32)]).unwrap();
    let meta = vec![("edgerun.config".to_string(), MetaValue::String(config.into()))];
    let mut w = GgufWriter::new(Cursor::new(Vec::new()), &meta, planned).unwrap();
    w.write_tensor(&[0u8; 68]).unwrap();
    w.write_tensor(&[0u8; 8]).unwrap();
    w.finish().unwrap().into_inner()
}

fn st_raw(header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

#[test]
fn inspect_valid_gguf_succeeds() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(dir.path(), "good.gguf", &valid_gguf(r#"{"model_type":"toy"}"#));
    let (code, out, err) = inspect(&p);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("w.weight") && out.contains("q8_0") && out.contains("toy"), "{out}");
}

#[test]
fn inspect_bad_gguf_exits_2() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    expect_fail(&write(d, "bad.gguf", b"GGUG\x03\0\0\0garbage"), 2, "bad.gguf", &["bad magic"]);
    expect_fail(&write(d, "empty.gguf", b""), 2, "empty.gguf", &["empty"]);
    let good = valid_gguf("{}");
    expect_fail(&write(d, "truncated.gguf", &good[..good.len() - 1]), 2, "truncated.gguf", &["tensor `", "truncated"]);
    expect_fail(&write(d, "header_cut.gguf", &good[..30]), 2, "header_cut.gguf", &["truncated"]);
    let mut v = (1u64 << 60).to_le_bytes().to_vec();
    v.extend(b"x");
    expect_fail(&write(d, "giant_string.gguf", &gguf_with_kv("k", 8, &v)), 2, "giant_string.gguf", &["metadata `k`", "over the limit"]);
    let mut v = 0u32.to_le_bytes().to_vec();
    v.extend((1u64 << 50).to_le_bytes());
    expect_fail(&write(d, "giant_array.gguf", &gguf_with_kv("arr", 9, &v)), 2, "giant_array.gguf", &["metadata `arr`", "exceeds the limit"]);
    expect_fail(&write(d, "align0.gguf", &gguf_with_kv("general.alignment", 4, &0u32.to_le_bytes())), 2, "align0.gguf", &["general.alignment"]);
    let mut v2 = good.clone();
    v2[4] = 9;
    expect_fail(&write(d, "version.gguf", &v2), 2, "version.gguf", &["unsupported GGUF version 9"]);
    expect_fail(&write(d, "config.gguf", &valid_gguf("{not json")), 2, "config.gguf", &["edgerun.config", "not valid JSON"]);
}

#[test]
fn inspect_bad_safetensors_exits_2() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut b = st_raw("{}", &[]);
    b[..8].copy_from_slice(&1_000_000u64.to_le_bytes());
    expect_fail(&write(d, "hdr.safetensors", &b), 2, "hdr.safetensors", &["header length", "past the end"]);
    expect_fail(&write(d, "json.safetensors", &st_raw("[1,2]", &[])), 2, "json.safetensors", &["not a valid JSON object"]);
    let h = r#"{"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}}"#;
    expect_fail(&write(d, "dims.safetensors", &st_raw(h, &[0; 4])), 2, "dims.safetensors", &["`w`", "overflows"]);
    let h = r#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#;
    expect_fail(&write(d, "short.safetensors", &st_raw(h, &[0; 8])), 2, "short.safetensors", &["`w`", "truncated"]);
    let h = r#"{"w":{"dtype":"X9","shape":[1],"data_offsets":[0,4]}}"#;
    expect_fail(&write(d, "dtype.safetensors", &st_raw(h, &[0; 4])), 2, "dtype.safetensors", &["`w`", "unknown or unsupported dtype"]);
    let h = r#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#;
    expect_fail(&write(d, "dup.safetensors", &st_raw(h, &[0; 8])), 2, "dup.safetensors", &["duplicate tensor name `w`"]);
    expect_fail(&write(d, "tiny.safetensors", b"\x01\x02"), 2, "tiny.safetensors", &["too short"]);
}

#[test]
fn inspect_bad_model_directory_exits_2() {
    let good_st = st_raw(r#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#, &[0; 4]);
    // config.json that is not JSON.
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "model.safetensors", &good_st);
    write(dir.path(), "config.json", b"{\"model_type\": ");
    expect_fail(dir.path(), 2, "config.json", &["invalid JSON"]);
    // An index whose shard escapes the directory.
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "config.json", b"{}");
    write(dir.path(), "model.safetensors.index.json", br#"{"weight_map":{"w":"../x.safetensors"}}"#);
    expect_fail(dir.path(), 2, "model.safetensors.index.json", &["../x.safetensors", "plain file name"]);
    // An empty weight map.
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "config.json", b"{}");
    write(dir.path(), "model.safetensors.index.json", br#"{"weight_map":{}}"#);
    expect_fail(dir.path(), 2, "model.safetensors.index.json", &["empty"]);
}

#[test]
fn inspect_missing_files_fail_cleanly() {
    // I/O errors (missing file, missing shard) have their own exit code (4), but never 101.
    let dir = tempfile::tempdir().unwrap();
    expect_fail(&dir.path().join("nope.gguf"), 4, "nope.gguf", &[]);
    write(dir.path(), "config.json", b"{}");
    write(dir.path(), "model.safetensors.index.json", br#"{"weight_map":{"w":"gone.safetensors"}}"#);
    expect_fail(dir.path(), 4, "gone.safetensors", &[]);
}
