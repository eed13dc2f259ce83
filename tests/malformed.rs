//! The weight store against hostile and truncated files: every malformed file must be rejected with an
//! error naming the file (and the tensor where there is one) — never a panic, never an allocation sized
//! by a number the file declares. Valid files are built programmatically and must round-trip.
//!
//! Everything is generated here, at test time, into temporary directories; nothing big is committed.
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use edgerun::weights::{gguf, safetensors as st, Format, Limits, MetaValue, WeightStore};
use safetensors::tensor::TensorView;

#[path = "common/weight_files.rs"]
mod weight_files;
use weight_files::*;

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

fn limits() -> Limits {
    Limits::default()
}

/// Parses as safetensors, turning a panic into a test failure that names the case.
fn st_parse(case: &str, bytes: &[u8]) -> Result<st::SafetensorsHeader, String> {
    catch_unwind(AssertUnwindSafe(|| st::parse(bytes, 0, &limits())))
        .unwrap_or_else(|_| panic!("safetensors parser panicked on case `{case}`"))
}

/// Parses as GGUF, turning a panic into a test failure that names the case.
fn gguf_parse(case: &str, bytes: &[u8]) -> Result<gguf::GgufHeader, String> {
    catch_unwind(AssertUnwindSafe(|| gguf::parse(bytes, 0, &limits())))
        .unwrap_or_else(|_| panic!("GGUF parser panicked on case `{case}`"))
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    if let Some(parent) = p.parent() {
        std::fs::create_dir_all(parent).unwrap();
    }
    std::fs::write(&p, bytes).unwrap();
    p
}

/// Opens `path` and, when that works, loads every tensor every way the store offers.
fn open_and_load(path: &Path) -> edgerun::Result<WeightStore> {
    let store = WeightStore::open(path)?;
    load_all(&store)?;
    Ok(store)
}

fn load_all(store: &WeightStore) -> edgerun::Result<()> {
    let names: Vec<String> = store.entries().keys().cloned().collect();
    for name in names {
        store.tensor(&name, DType::F32, &Device::Cpu)?;
        store.qtensor(&name, &Device::Cpu)?;
    }
    Ok(())
}

/// Asserts that opening `path` fails, without panicking, with a message holding every fragment and the
/// file name. Returns the message.
fn expect_open_err(case: &str, path: &Path, fragments: &[&str]) -> String {
    let r = catch_unwind(AssertUnwindSafe(|| open_and_load(path)))
        .unwrap_or_else(|_| panic!("WeightStore panicked on case `{case}`"));
    let msg = match r {
        Ok(_) => panic!("case `{case}`: {} was accepted", path.display()),
        Err(e) => e.to_string(),
    };
    let fname = path.file_name().unwrap().to_string_lossy().to_string();
    assert!(msg.contains(&fname), "case `{case}`: message does not name the file `{fname}`: {msg}");
    for f in fragments {
        assert!(msg.contains(f), "case `{case}`: message lacks `{f}`: {msg}");
    }
    msg
}

/// A safetensors file from a literal JSON header and a data section.
fn st_raw(header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

/// A safetensors case that must fail both in the parser and through the store.
fn bad_st(dir: &Path, case: &str, bytes: &[u8], fragments: &[&str]) {
    let e = st_parse(case, bytes).err().unwrap_or_else(|| panic!("case `{case}` was accepted by the parser"));
    for f in fragments {
        assert!(e.contains(f), "case `{case}`: parser message lacks `{f}`: {e}");
    }
    let path = write(dir, &format!("{case}.safetensors"), bytes);
    expect_open_err(case, &path, fragments);
}

/// A GGUF case that must fail both in the parser and through the store.
fn bad_gguf(dir: &Path, case: &str, bytes: &[u8], fragments: &[&str]) {
    let e = gguf_parse(case, bytes).err().unwrap_or_else(|| panic!("case `{case}` was accepted by the parser"));
    for f in fragments {
        assert!(e.contains(f), "case `{case}`: parser message lacks `{f}`: {e}");
    }
    let path = write(dir, &format!("{case}.gguf"), bytes);
    expect_open_err(case, &path, fragments);
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Cut points: every offset up to `dense`, then a spread of later ones, never the full length.
fn cut_points(len: usize, dense: usize) -> Vec<usize> {
    let mut v: Vec<usize> = (0..len.min(dense)).collect();
    let mut i = dense;
    while i < len {
        v.push(i);
        i += 97;
    }
    v.extend([len.saturating_sub(1), len.saturating_sub(2), len.saturating_sub(33)]);
    v.retain(|&c| c < len);
    v.sort();
    v.dedup();
    v
}

// ---------------------------------------------------------------------------------------------
// Valid files round-trip
// ---------------------------------------------------------------------------------------------

#[test]
fn safetensors_valid_file_round_trips_as_f32_and_f16() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "model.safetensors", &valid_st());
    let store = WeightStore::open(&path).unwrap();
    assert_eq!(store.format(), Format::Safetensors);
    assert_eq!(store.entries().len(), 3);
    assert_eq!(store.metadata().get("format").and_then(|v| v.as_str()), Some("pt"));
    let a = store.tensor("enc.a.weight", DType::F32, &Device::Cpu).unwrap();
    assert_eq!(a.dims(), &[2, 3]);
    assert_eq!(a.flatten_all().unwrap().to_vec1::<f32>().unwrap(), ramp(6));
    let a16 = store.tensor("enc.a.weight", DType::F16, &Device::Cpu).unwrap();
    assert_eq!(a16.dtype(), DType::F16);
    let back = a16.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert!(max_abs_diff(&back, &ramp(6)) < 4e-3);
    let h = store.tensor("enc.h", DType::F32, &Device::Cpu).unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(h, vec![0.5, -1.25, 2.0, 65504.0]);
    let i = store.tensor("idx", DType::F32, &Device::Cpu).unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(i, vec![7.0, -3.0]);
    assert!(store.qtensor("enc.a.weight", &Device::Cpu).unwrap().is_none());
    let e = store.tensor_shaped("enc.a.weight", &[3, 2], DType::F32, &Device::Cpu).unwrap_err().to_string();
    assert!(e.contains("enc.a.weight") && e.contains("expected shape"), "{e}");
    let e = store.tensor("missing", DType::F32, &Device::Cpu).unwrap_err().to_string();
    assert!(e.contains("missing") && e.contains("not found"), "{e}");
}

#[test]
fn safetensors_sharded_directory_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let a = f32_bytes(&ramp(8));
    let b = f32_bytes(&[1.0, -2.0, 3.5]);
    let s1 = safetensors::serialize([("layer.0.w", TensorView::new(safetensors::Dtype::F32, vec![2, 4], &a).unwrap())], None).unwrap();
    let s2 = safetensors::serialize([("layer.1.b", TensorView::new(safetensors::Dtype::F32, vec![3], &b).unwrap())], None).unwrap();
    write(d, "model-00001-of-00002.safetensors", &s1);
    write(d, "model-00002-of-00002.safetensors", &s2);
    write(
        d,
        "model.safetensors.index.json",
        br#"{"metadata":{"total_size":44},"weight_map":{"layer.0.w":"model-00001-of-00002.safetensors","layer.1.b":"model-00002-of-00002.safetensors"}}"#,
    );
    write(d, "config.json", br#"{"model_type":"toy","hidden_size":4}"#);
    let store = WeightStore::open(d).unwrap();
    assert_eq!(store.files().len(), 2);
    assert_eq!(store.architecture().as_deref(), Some("toy"));
    assert_eq!(store.config()["hidden_size"], 4);
    let w = store.tensor("layer.0.w", DType::F32, &Device::Cpu).unwrap();
    assert_eq!(w.flatten_all().unwrap().to_vec1::<f32>().unwrap(), ramp(8));
    let b16 = store.tensor("layer.1.b", DType::F16, &Device::Cpu).unwrap();
    assert_eq!(b16.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap(), vec![1.0, -2.0, 3.5]);
    assert!(store.file_of(&store.entries()["layer.1.b"]).ends_with("model-00002-of-00002.safetensors"));
}

#[test]
fn safetensors_model_directory_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "model.safetensors", &valid_st());
    write(dir.path(), "config.json", br#"{"model_type":"toy"}"#);
    let store = open_and_load(dir.path()).unwrap();
    assert_eq!(store.architecture().as_deref(), Some("toy"));
}

#[test]
fn gguf_valid_file_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let (bytes, values) = valid_gguf_with(0);
    let path = write(dir.path(), "model.gguf", &bytes);
    let store = WeightStore::open(&path).unwrap();
    assert_eq!(store.format(), Format::Gguf);
    assert_eq!(store.architecture().as_deref(), Some("toy"));
    assert_eq!(store.config()["hidden_size"], 4);
    assert_eq!(store.metadata().get("toy.layers"), Some(&MetaValue::U32(1)));
    assert_eq!(store.metadata().get("toy.list"), Some(&MetaValue::Array(vec![MetaValue::I32(1), MetaValue::I32(-2)])));
    for (name, shape, want) in &values {
        let (_, s) = store.info(name).unwrap();
        assert_eq!(&s, shape, "{name}");
        let got = store.tensor(name, DType::F32, &Device::Cpu).unwrap();
        assert_eq!(got.dims(), shape.as_slice(), "{name}");
        let got = got.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let tol = match name.as_str() {
            "norm.weight" => 0.0,
            "emb" => 2e-3,
            "blk.0.q8" => 0.03,
            _ => 0.5,
        };
        assert!(max_abs_diff(&got, want) <= tol, "{name}: max diff {} > {tol}", max_abs_diff(&got, want));
        let g16 = store.tensor(name, DType::F16, &Device::Cpu).unwrap();
        assert_eq!(g16.dtype(), DType::F16);
    }
    let q = store.qtensor("blk.0.q8", &Device::Cpu).unwrap().expect("q8_0 stays quantized");
    assert_eq!(q.dtype(), GgmlDType::Q8_0);
    assert_eq!(q.shape().dims(), &[2, 64]);
    assert!(store.qtensor("norm.weight", &Device::Cpu).unwrap().is_none());
}

#[test]
fn gguf_hand_built_file_parses() {
    let h = gguf_parse("small", &small_gguf().build()).unwrap();
    assert_eq!(h.version, 3);
    assert_eq!(h.tensors.len(), 1);
    assert_eq!(h.tensors[0].shape, vec![2, 2]);
    // v2 and an explicit power-of-two alignment are accepted too.
    let mut g = small_gguf().kv_u32("general.alignment", 64);
    g.alignment = 64;
    g.version = 2;
    let dir = tempfile::tempdir().unwrap();
    let store = open_and_load(&write(dir.path(), "a64.gguf", &g.build())).unwrap();
    let w = store.tensor("w", DType::F32, &Device::Cpu).unwrap();
    assert_eq!(w.to_vec2::<f32>().unwrap(), vec![vec![1.0, 2.0], vec![3.0, 4.0]]);
}

// ---------------------------------------------------------------------------------------------
// Truncation everywhere
// ---------------------------------------------------------------------------------------------

#[test]
fn empty_files_are_rejected() {
    let dir = tempfile::tempdir().unwrap();
    assert!(st_parse("empty", &[]).unwrap_err().contains("too short"));
    assert!(gguf_parse("empty", &[]).unwrap_err().contains("truncated"));
    expect_open_err("empty st", &write(dir.path(), "empty.safetensors", &[]), &["empty"]);
    expect_open_err("empty gguf", &write(dir.path(), "empty.gguf", &[]), &["empty"]);
    expect_open_err("empty shard", &write(dir.path(), "sub/model.safetensors", &[]), &["empty"]);
    write(dir.path(), "sub/config.json", b"{}");
    expect_open_err("empty shard in dir", &dir.path().join("sub"), &["model.safetensors", "empty"]);
    // Shorter than the length field / the magic.
    bad_st(dir.path(), "seven_bytes", &[1, 0, 0, 0, 0, 0, 0], &["too short"]);
    bad_gguf(dir.path(), "three_bytes", b"GGU", &["magic", "truncated"]);
}

#[test]
fn safetensors_truncated_at_every_offset_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    for full in [valid_st(), valid_st_with(4000)] {
        assert!(st_parse("full", &full).is_ok());
        let cuts = cut_points(full.len(), 512);
        for (k, &cut) in cuts.iter().enumerate() {
            let case = format!("st_cut_{}_{cut}", full.len());
            let r = st_parse(&case, &full[..cut]);
            assert!(r.is_err(), "{case} was accepted");
            // Through the store for a sample of the cut points (and always for the empty file).
            if k % 16 == 0 && cut > 0 {
                let p = write(dir.path(), &format!("{case}.safetensors"), &full[..cut]);
                expect_open_err(&case, &p, &[]);
            }
        }
    }
}

#[test]
fn gguf_truncated_at_every_offset_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    for full in [valid_gguf(), valid_gguf_with(100).0, small_gguf().build()] {
        assert!(gguf_parse("full", &full).is_ok());
        let cuts = cut_points(full.len(), 640);
        for (k, &cut) in cuts.iter().enumerate() {
            let case = format!("gguf_cut_{}_{cut}", full.len());
            let r = gguf_parse(&case, &full[..cut]);
            assert!(r.is_err(), "{case} was accepted");
            if k % 16 == 0 && cut > 0 {
                let p = write(dir.path(), &format!("{case}.gguf"), &full[..cut]);
                expect_open_err(&case, &p, &[]);
            }
        }
    }
}

#[test]
fn truncation_inside_tensor_data_names_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let full = valid_st();
    bad_st(dir.path(), "st_data_cut", &full[..full.len() - 3], &["truncated", "`"]);
    let g = valid_gguf();
    let msg = gguf_parse("gguf_data_cut", &g[..g.len() - 5]).unwrap_err();
    assert!(msg.contains("blk.0.q4") && msg.contains("truncated"), "{msg}");
    bad_gguf(dir.path(), "gguf_data_cut", &g[..g.len() - 5], &["blk.0.q4", "truncated"]);
}

// ---------------------------------------------------------------------------------------------
// safetensors: header
// ---------------------------------------------------------------------------------------------

#[test]
fn safetensors_header_length_is_checked() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut b = st_raw("{}", &[]);
    b[..8].copy_from_slice(&1000u64.to_le_bytes());
    bad_st(d, "hdr_past_end", &b, &["header length 1000", "past the end"]);
    b[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    bad_st(d, "hdr_u64_max", &b, &["exceeds the limit"]);
    b[..8].copy_from_slice(&((100u64 << 20) + 1).to_le_bytes());
    bad_st(d, "hdr_over_limit", &b, &["exceeds the limit"]);
    b[..8].copy_from_slice(&(1u64 << 63).to_le_bytes());
    bad_st(d, "hdr_2_63", &b, &["exceeds the limit"]);
    // Length 0: an empty header is not JSON.
    bad_st(d, "hdr_zero", &0u64.to_le_bytes(), &["not a valid JSON object"]);
    // An empty object is a valid, empty file.
    assert_eq!(st_parse("empty_object", &st_raw("{}", &[])).unwrap().tensors.len(), 0);
}

#[test]
fn safetensors_header_must_be_a_json_object() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for (case, h) in [
        ("json_array", "[]"),
        ("json_string", "\"x\""),
        ("json_null", "null"),
        ("json_number", "12"),
        ("json_unclosed", "{\"a\": {"),
        ("json_garbage", "GGUF\u{3}\0\0\0"),
        ("json_trailing", "{} {}"),
        ("json_spaces", "        "),
    ] {
        bad_st(d, case, &st_raw(h, &[]), &["not a valid JSON object"]);
    }
    // Invalid UTF-8 inside the JSON text.
    let mut raw = b"{\"w\xff\xfe\":{}}".to_vec();
    let mut b = (raw.len() as u64).to_le_bytes().to_vec();
    b.append(&mut raw);
    bad_st(d, "json_bad_utf8", &b, &["not a valid JSON object"]);
    // Deep nesting hits serde_json's recursion limit instead of the stack.
    let deep = format!("{{\"w\":{}{}}}", "[".repeat(100_000), "]".repeat(100_000));
    bad_st(d, "json_deep", &st_raw(&deep, &[]), &["not a valid JSON object"]);
    let deep_obj = format!("{}{}", "{\"a\":".repeat(50_000), "}".repeat(50_000));
    bad_st(d, "json_deep_obj", &st_raw(&deep_obj, &[]), &[]);
}

#[test]
fn safetensors_entries_are_validated() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let data = [0u8; 64];
    let cases: &[(&str, &str, &[&str])] = &[
        ("entry_not_object", r#"{"w":5}"#, &["`w`", "malformed entry"]),
        ("entry_missing_offsets", r#"{"w":{"dtype":"F32","shape":[1]}}"#, &["`w`", "malformed entry"]),
        ("entry_missing_dtype", r#"{"w":{"shape":[1],"data_offsets":[0,4]}}"#, &["`w`", "malformed entry"]),
        ("entry_extra_field", r#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1}}"#, &["`w`", "malformed entry"]),
        ("entry_negative_dim", r#"{"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}"#, &["`w`", "malformed entry"]),
        ("entry_float_dim", r#"{"w":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}}"#, &["`w`", "malformed entry"]),
        ("entry_dim_too_big_for_u64", r#"{"w":{"dtype":"F32","shape":[18446744073709551616],"data_offsets":[0,4]}}"#, &["`w`", "malformed entry"]),
        ("entry_shape_string", r#"{"w":{"dtype":"F32","shape":"1","data_offsets":[0,4]}}"#, &["`w`", "malformed entry"]),
        ("entry_three_offsets", r#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4,8]}}"#, &["`w`", "malformed entry"]),
        ("entry_one_offset", r#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[4]}}"#, &["`w`", "malformed entry"]),
        ("entry_negative_offset", r#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}}"#, &["`w`", "malformed entry"]),
        ("dtype_unknown", r#"{"w":{"dtype":"F7","shape":[1],"data_offsets":[0,4]}}"#, &["`w`", "unknown or unsupported dtype `F7`"]),
        ("dtype_empty", r#"{"w":{"dtype":"","shape":[1],"data_offsets":[0,4]}}"#, &["`w`", "unknown or unsupported dtype"]),
        ("dtype_lowercase", r#"{"w":{"dtype":"f32","shape":[1],"data_offsets":[0,4]}}"#, &["`w`", "unknown or unsupported dtype"]),
        ("dtype_fp8", r#"{"w":{"dtype":"F8_E4M3","shape":[1],"data_offsets":[0,1]}}"#, &["`w`", "unknown or unsupported dtype"]),
        ("dtype_number", r#"{"w":{"dtype":0,"shape":[1],"data_offsets":[0,4]}}"#, &["`w`", "malformed entry"]),
        ("zero_dim", r#"{"w":{"dtype":"F32","shape":[2,0],"data_offsets":[0,0]}}"#, &["`w`", "zero dimension"]),
        ("absurd_rank", r#"{"w":{"dtype":"F32","shape":[1,1,1,1,1,1,1,1,1],"data_offsets":[0,4]}}"#, &["`w`", "rank 9 exceeds"]),
        ("huge_rank", &format!(r#"{{"w":{{"dtype":"F32","shape":[{}1],"data_offsets":[0,4]}}}}"#, "1,".repeat(100_000)), &["`w`", "rank 100001 exceeds"]),
        ("dim_over_limit", r#"{"w":{"dtype":"U8","shape":[4294967297],"data_offsets":[0,4]}}"#, &["`w`", "exceeds the limit"]),
        ("dims_overflow_u64", r#"{"w":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,4]}}"#, &["`w`", "overflows"]),
        ("dims_overflow_u64_3", r#"{"w":{"dtype":"U8","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,4]}}"#, &["`w`", "overflows"]),
        ("numel_overflow", r#"{"w":{"dtype":"F64","shape":[2147483648,2147483648,4],"data_offsets":[0,4]}}"#, &["`w`", "element count", "overflows"]),
        ("bytes_overflow", r#"{"w":{"dtype":"F64","shape":[2147483648,2147483648,2],"data_offsets":[0,4]}}"#, &["`w`", "byte size overflows"]),
        ("huge_but_fits_u64", r#"{"w":{"dtype":"U8","shape":[4294967296,1073741824],"data_offsets":[0,4]}}"#, &["`w`", "need 4611686018427387904"]),
        ("offsets_past_end", r#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[56,72]}}"#, &["`w`", "past the end of the data section"]),
        ("offsets_u64_max", r#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[18446744073709551600,18446744073709551615]}}"#, &["`w`", "past the end"]),
        ("offsets_reversed", r#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}}"#, &["`w`", "reversed"]),
        ("offsets_reversed_huge", r#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[18446744073709551615,0]}}"#, &["`w`", "reversed"]),
        ("wrong_length_short", r#"{"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}}"#, &["`w`", "need 16"]),
        ("wrong_length_long", r#"{"w":{"dtype":"F16","shape":[3],"data_offsets":[0,8]}}"#, &["`w`", "need 6"]),
        ("overlap", r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}}"#, &["overlap", "`a`", "`b`"]),
        ("alias_same_bytes", r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"b":{"dtype":"I32","shape":[4],"data_offsets":[0,16]}}"#, &["overlap"]),
        ("duplicate_name", r#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#, &["duplicate tensor name `w`"]),
        ("duplicate_metadata", r#"{"__metadata__":{},"__metadata__":{}}"#, &["duplicate", "__metadata__"]),
        ("metadata_not_strings", r#"{"__metadata__":{"a":1}}"#, &["__metadata__", "strings"]),
        ("metadata_not_object", r#"{"__metadata__":[1]}"#, &["__metadata__"]),
    ];
    for (case, header, frags) in cases {
        bad_st(d, case, &st_raw(header, &data), frags);
    }
    // A name longer than the string limit.
    let long = "n".repeat((1 << 20) + 1);
    let h = format!(r#"{{"{long}":{{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}}}"#);
    bad_st(d, "name_too_long", &st_raw(&h, &data), &["tensor name", "over the limit"]);
}

#[test]
fn safetensors_tensor_count_is_capped() {
    let many: Vec<String> = (0..5).map(|i| format!(r#""t{i}":{{"dtype":"U8","shape":[1],"data_offsets":[{i},{}]}}"#, i + 1)).collect();
    let b = st_raw(&format!("{{{}}}", many.join(",")), &[0u8; 5]);
    let small = Limits { max_tensors: 3, ..Limits::default() };
    let e = st::parse(&b, 0, &small).unwrap_err();
    assert!(e.contains("5 tensors, more than the limit of 3"), "{e}");
    // Exactly at the cap (metadata does not count as a tensor).
    let three: Vec<String> = many[..3].to_vec();
    let b3 = st_raw(&format!(r#"{{"__metadata__":{{}},{}}}"#, three.join(",")), &[0u8; 5]);
    assert_eq!(st::parse(&b3, 0, &small).unwrap().tensors.len(), 3);
    let b4 = st_raw(&format!("{{{}}}", many[..4].join(",")), &[0u8; 5]);
    assert!(st::parse(&b4, 0, &small).unwrap_err().contains("4 tensors"));
    assert_eq!(st::parse(&b, 0, &Limits::default()).unwrap().tensors.len(), 5);
    let e = st::parse(&b, 0, &Limits { max_header_bytes: 16, ..Limits::default() }).unwrap_err();
    assert!(e.contains("exceeds the limit of 16"), "{e}");
}

// ---------------------------------------------------------------------------------------------
// safetensors: directories, shards and config.json
// ---------------------------------------------------------------------------------------------

fn shard_dir(index: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "config.json", br#"{"model_type":"toy"}"#);
    write(dir.path(), "model.safetensors.index.json", index.as_bytes());
    write(dir.path(), "a.safetensors", &valid_st());
    dir
}

fn expect_dir_err(case: &str, dir: &Path, fragments: &[&str]) -> String {
    let r = catch_unwind(AssertUnwindSafe(|| open_and_load(dir))).unwrap_or_else(|_| panic!("panicked on `{case}`"));
    let msg = r.err().unwrap_or_else(|| panic!("case `{case}` was accepted")).to_string();
    for f in fragments {
        assert!(msg.contains(f), "case `{case}`: message lacks `{f}`: {msg}");
    }
    msg
}

#[test]
fn sharded_index_is_validated() {
    let idx = "model.safetensors.index.json";
    let cases: &[(&str, &str, &[&str])] = &[
        ("missing_shard", r#"{"weight_map":{"enc.a.weight":"a.safetensors","x":"missing.safetensors"}}"#, &["missing.safetensors"]),
        ("traversal", r#"{"weight_map":{"x":"../x.safetensors"}}"#, &[idx, "../x.safetensors", "plain file name"]),
        ("traversal_backslash", r#"{"weight_map":{"x":"..\\x.safetensors"}}"#, &[idx, "plain file name"]),
        ("absolute", r#"{"weight_map":{"x":"/etc/passwd"}}"#, &[idx, "plain file name"]),
        ("subdir", r#"{"weight_map":{"x":"sub/a.safetensors"}}"#, &[idx, "plain file name"]),
        ("dotdot", r#"{"weight_map":{"x":".."}}"#, &[idx, "plain file name"]),
        ("dot", r#"{"weight_map":{"x":"."}}"#, &[idx, "plain file name"]),
        ("empty_name", r#"{"weight_map":{"x":""}}"#, &[idx, "plain file name"]),
        ("empty_map", r#"{"weight_map":{}}"#, &[idx, "empty"]),
        ("no_map", r#"{"metadata":{}}"#, &[idx, "weight_map"]),
        ("map_not_object", r#"{"weight_map":["a.safetensors"]}"#, &[idx, "weight_map"]),
        ("shard_not_string", r#"{"weight_map":{"x":3}}"#, &[idx, "`x`", "not a string"]),
        ("index_not_json", r#"{"weight_map":"#, &[idx, "invalid JSON"]),
        ("index_not_object", r#"["a.safetensors"]"#, &[idx, "JSON object"]),
    ];
    for (case, index, frags) in cases {
        let dir = shard_dir(index);
        expect_dir_err(case, dir.path(), frags);
    }
    // The index is fine but a shard is malformed: the message names the shard.
    let dir = shard_dir(r#"{"weight_map":{"x":"a.safetensors","y":"b.safetensors"}}"#);
    write(dir.path(), "b.safetensors", &st_raw("{", &[]));
    expect_dir_err("bad_shard", dir.path(), &["b.safetensors", "not a valid JSON object"]);
    // The same tensor in two shards.
    let dir = shard_dir(r#"{"weight_map":{"x":"a.safetensors","y":"b.safetensors"}}"#);
    write(dir.path(), "b.safetensors", &valid_st());
    expect_dir_err("tensor_in_two_shards", dir.path(), &["b.safetensors", "more than one shard", "tensor `"]);
}

#[test]
fn config_json_is_validated() {
    for (case, cfg, frags) in [
        ("config_not_json", &b"{\"model_type\": "[..], &["config.json", "invalid JSON"][..]),
        ("config_not_object", b"[1,2]", &["config.json", "JSON object"]),
        ("config_bad_utf8", b"{\"a\":\"\xff\"}", &["config.json", "invalid JSON"]),
        ("config_empty", b"", &["config.json", "invalid JSON"]),
    ] {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "model.safetensors", &valid_st());
        write(dir.path(), "config.json", cfg);
        expect_dir_err(case, dir.path(), frags);
        // Also when the safetensors file itself is opened and the config sits beside it.
        expect_dir_err(case, &dir.path().join("model.safetensors"), frags);
    }
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "model.safetensors", &valid_st());
    expect_dir_err("config_missing", dir.path(), &["no config.json"]);
    let dir = tempfile::tempdir().unwrap();
    expect_dir_err("empty_dir", dir.path(), &["no model.safetensors"]);
    write(dir.path(), "a.gguf", &valid_gguf());
    write(dir.path(), "b.gguf", &valid_gguf());
    expect_dir_err("two_ggufs", dir.path(), &["several .gguf"]);
}

// ---------------------------------------------------------------------------------------------
// GGUF: header, metadata
// ---------------------------------------------------------------------------------------------

#[test]
fn gguf_magic_and_version_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut g = small_gguf();
    g.magic = *b"GGUG";
    bad_gguf(d, "bad_magic", &g.build(), &["bad magic"]);
    g.magic = *b"FUGG";
    bad_gguf(d, "bad_magic_reversed", &g.build(), &["bad magic"]);
    // A file named .gguf that is really safetensors.
    bad_gguf(d, "safetensors_named_gguf", &valid_st(), &["bad magic"]);
    for v in [0u32, 1, 4, u32::MAX] {
        let mut g = small_gguf();
        g.version = v;
        bad_gguf(d, &format!("version_{v}"), &g.build(), &["unsupported GGUF version"]);
    }
}

#[test]
fn gguf_counts_are_capped() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for n in [100_001u64, 1 << 40, u64::MAX] {
        let mut g = small_gguf();
        g.n_tensors = Some(n);
        bad_gguf(d, &format!("tensors_{n}"), &g.build(), &["tensors, more than the limit"]);
        let mut g = small_gguf();
        g.n_kv = Some(n);
        bad_gguf(d, &format!("kv_{n}"), &g.build(), &["metadata entries, more than the limit"]);
    }
    // Counts within the caps but more entries than the file holds.
    let mut g = small_gguf();
    g.n_tensors = Some(100_000);
    bad_gguf(d, "tensors_more_than_present", &g.header(), &["name of tensor #1", "truncated"]);
    let mut g = small_gguf();
    g.n_kv = Some(65_536);
    bad_gguf(d, "kv_more_than_present", &g.build(), &[]);
    let small = Limits { max_tensors: 0, ..Limits::default() };
    assert!(gguf::parse(&small_gguf().build(), 0, &small).unwrap_err().contains("limit of 0"));
}

#[test]
fn gguf_giant_strings_and_arrays_are_rejected_before_allocation() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let giant = 1u64 << 60;
    // Key with a declared length of 2^60.
    let mut g = G::new();
    g.kv.extend(giant.to_le_bytes());
    g.kv.extend(b"abc");
    g.nkv = 1;
    bad_gguf(d, "giant_key", &g.build(), &["metadata key #0", "over the limit"]);
    // String value of 2^60 bytes, and of u64::MAX.
    for (case, n) in [("giant_string", giant), ("giant_string_max", u64::MAX), ("string_just_over", (1 << 20) + 1)] {
        let mut v = n.to_le_bytes().to_vec();
        v.extend(b"xyz");
        bad_gguf(d, case, &G::new().kv_raw(b"k", 8, &v).build(), &["metadata `k`", "over the limit"]);
    }
    // String value within the limit but longer than the file.
    let mut v = 1000u64.to_le_bytes().to_vec();
    v.extend(b"xyz");
    bad_gguf(d, "string_past_end", &G::new().kv_raw(b"k", 8, &v).build(), &["metadata `k`", "truncated"]);
    // Arrays of 2^50 elements, of every element type.
    for elem in [0u32, 4, 8, 9, 10, 12] {
        let mut v = elem.to_le_bytes().to_vec();
        v.extend((1u64 << 50).to_le_bytes());
        let case = format!("giant_array_{elem}");
        bad_gguf(d, &case, &G::new().kv_raw(b"arr", 9, &v).build(), &["metadata `arr`", "exceeds the limit"]);
    }
    // Arrays within the element cap but larger than the bytes that follow.
    for (elem, n) in [(0u32, 1u64 << 24), (10, 1 << 20), (8, 1 << 22), (9, 1 << 23)] {
        let mut v = elem.to_le_bytes().to_vec();
        v.extend(n.to_le_bytes());
        v.extend([0u8; 64]);
        let case = format!("array_past_end_{elem}");
        bad_gguf(d, &case, &G::new().kv_raw(b"arr", 9, &v).build(), &["metadata `arr`", "cannot fit"]);
    }
    // An array of strings whose elements each declare 2^60 bytes.
    let mut v = 8u32.to_le_bytes().to_vec();
    v.extend(4u64.to_le_bytes());
    for _ in 0..4 {
        v.extend(giant.to_le_bytes());
    }
    bad_gguf(d, "array_of_giant_strings", &G::new().kv_raw(b"arr", 9, &v).build(), &["over the limit"]);
    // A tensor name of 2^60 bytes.
    let mut g = G::new();
    g.infos.extend(giant.to_le_bytes());
    g.nt = 1;
    bad_gguf(d, "giant_tensor_name", &g.build(), &["name of tensor #0", "over the limit"]);
    let small = Limits { max_string_bytes: 2, ..Limits::default() };
    assert!(gguf::parse(&small_gguf().build(), 0, &small).unwrap_err().contains("over the limit of 2"));
}

fn nested_array(depth: usize) -> Vec<u8> {
    // depth levels of arrays of one array each, ending with an array of one u8.
    let mut v = vec![];
    for _ in 0..depth {
        v.extend(9u32.to_le_bytes());
        v.extend(1u64.to_le_bytes());
    }
    v.extend(0u32.to_le_bytes());
    v.extend(1u64.to_le_bytes());
    v.push(7);
    v
}

#[test]
fn gguf_metadata_values_are_validated() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // Nesting: allowed up to the limit, rejected past it, and a very deep declaration fails fast.
    assert!(gguf_parse("nest_ok", &G::new().kv_raw(b"n", 9, &nested_array(3)).build()).is_ok());
    bad_gguf(d, "nest_5", &G::new().kv_raw(b"n", 9, &nested_array(5)).build(), &["metadata `n`", "nested deeper"]);
    bad_gguf(d, "nest_10000", &G::new().kv_raw(b"n", 9, &nested_array(10_000)).build(), &["nested deeper"]);
    // Unknown types, bad booleans, bad UTF-8.
    bad_gguf(d, "unknown_value_type", &G::new().kv_raw(b"k", 13, &[0; 8]).build(), &["metadata `k`", "unknown metadata value type 13"]);
    bad_gguf(d, "unknown_value_type_max", &G::new().kv_raw(b"k", u32::MAX, &[0; 8]).build(), &["unknown metadata value type"]);
    let mut arr = 77u32.to_le_bytes().to_vec();
    arr.extend(1u64.to_le_bytes());
    bad_gguf(d, "unknown_array_type", &G::new().kv_raw(b"k", 9, &arr).build(), &["metadata `k`", "unknown array element type 77"]);
    bad_gguf(d, "bad_bool", &G::new().kv_raw(b"k", 7, &[2]).build(), &["metadata `k`", "invalid boolean"]);
    bad_gguf(d, "bad_utf8_key", &G::new().kv_raw(b"k\xff", 4, &[0; 4]).build(), &["metadata key #0", "UTF-8"]);
    bad_gguf(d, "bad_utf8_value", &G::new().kv_raw(b"k", 8, &gstr(b"\xc3\x28")).build(), &["metadata `k`", "UTF-8"]);
    let g = G::new().tensor_raw(b"w\xe2\x82", &[4], 0, 0).data(&[0; 16]);
    bad_gguf(d, "bad_utf8_tensor_name", &g.build(), &["name of tensor #0", "UTF-8"]);
    // Duplicate keys.
    let g = small_gguf().kv_u32("k", 1).kv_u32("k", 2);
    bad_gguf(d, "duplicate_key", &g.build(), &["duplicate metadata key `k`"]);
    // Value truncated right after its type.
    bad_gguf(d, "value_missing", &G::new().kv_raw(b"k", 10, &[]).header(), &["metadata `k`", "truncated"]);
}

#[test]
fn gguf_alignment_is_validated() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for a in [0u32, 3, 24, 1 << 21, u32::MAX] {
        bad_gguf(d, &format!("alignment_{a}"), &small_gguf().kv_u32("general.alignment", a).build(), &["general.alignment", "power of two"]);
    }
    let g = small_gguf().kv_str("general.alignment", "32");
    bad_gguf(d, "alignment_string", &g.build(), &["general.alignment"]);
    let g = small_gguf().kv_raw(b"general.alignment", 5, &(-32i32).to_le_bytes());
    bad_gguf(d, "alignment_negative", &g.build(), &["general.alignment"]);
    let g = small_gguf().kv_raw(b"general.alignment", 6, &32f32.to_le_bytes());
    bad_gguf(d, "alignment_float", &g.build(), &["general.alignment"]);
    // Offsets must honour the alignment.
    let g = G::new().tensor("a", &[4], 0, 0).tensor("b", &[4], 0, 16).data(&[0; 64]);
    bad_gguf(d, "offset_unaligned", &g.build(), &["tensor `b`", "not aligned to 32"]);
    let g = G::new().tensor("a", &[4], 0, 1).data(&[0; 64]);
    bad_gguf(d, "offset_odd", &g.build(), &["tensor `a`", "not aligned"]);
}

#[test]
fn gguf_quantized_data_must_be_aligned_for_candle() {
    // With `general.alignment` 1 a file may place block data at an odd byte. Candle reinterprets the
    // bytes as blocks with f16 fields in place, so that is rejected; plain f32 data is copied and loads.
    let dir = tempfile::tempdir().unwrap();
    let want = ramp(32);
    let q = QTensor::quantize(&Tensor::from_vec(want.clone(), 32, &Device::Cpu).unwrap(), GgmlDType::Q8_0).unwrap();
    let qb = q.data().unwrap().to_vec();
    let mk = |ty: u32, dims: &[u64], off: u64, payload: &[u8]| {
        let mut g = G::new().kv_u32("general.alignment", 1).tensor("q", dims, ty, off);
        g.alignment = 1;
        g.data(&[vec![0u8; off as usize], payload.to_vec()].concat()).build()
    };
    let hl = (mk(8, &[32], 0, &qb).len() - qb.len()) as u64;
    let odd = (1 + 4 * 8 - hl % 4) % 4; // absolute start ≡ 1 (mod 4)
    let even = (4 - hl % 4) % 4; // absolute start ≡ 0 (mod 4)
    bad_gguf(dir.path(), "q8_odd_offset", &mk(8, &[32], odd, &qb), &["tensor `q`", "4-byte aligned"]);
    let store = open_and_load(&write(dir.path(), "q8_aligned.gguf", &mk(8, &[32], even, &qb))).unwrap();
    let got = store.tensor("q", DType::F32, &Device::Cpu).unwrap().to_vec1::<f32>().unwrap();
    assert!(max_abs_diff(&got, &want) < 0.03);
    let f = f32_bytes(&[1.5, -2.0, 3.0]);
    let store = open_and_load(&write(dir.path(), "f32_odd.gguf", &mk(0, &[3], odd, &f))).unwrap();
    assert_eq!(store.tensor("q", DType::F32, &Device::Cpu).unwrap().to_vec1::<f32>().unwrap(), vec![1.5, -2.0, 3.0]);
}

// ---------------------------------------------------------------------------------------------
// GGUF: tensor infos
// ---------------------------------------------------------------------------------------------

#[test]
fn gguf_tensor_infos_are_validated() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let data = [0u8; 256];
    let one = |dims: &[u64], ty: u32, off: u64| G::new().tensor("w", dims, ty, off).data(&data).build();
    let cases: Vec<(&str, Vec<u8>, Vec<&str>)> = vec![
        ("rank_0", one(&[], 0, 0), vec!["tensor `w`", "rank 0"]),
        ("rank_5", one(&[1, 1, 1, 1, 1], 0, 0), vec!["tensor `w`", "rank 5"]),
        ("zero_dim", one(&[4, 0], 0, 0), vec!["tensor `w`", "zero dimension"]),
        ("dim_over_limit", one(&[(1 << 32) + 1], 0, 0), vec!["tensor `w`", "exceeds the limit"]),
        ("dim_u64_max", one(&[u64::MAX], 0, 0), vec!["tensor `w`", "exceeds the limit"]),
        ("dims_overflow", one(&[1 << 32, 1 << 32, 1 << 32], 0, 0), vec!["tensor `w`", "overflows"]),
        ("dims_overflow_2", one(&[1 << 32, 1 << 32], 0, 0), vec!["tensor `w`", "overflows"]),
        ("bytes_overflow", one(&[1 << 31, 1 << 31, 2], 0, 0), vec!["tensor `w`", "byte size overflows"]),
        ("huge_fits_u64", one(&[1 << 32, 1 << 28], 0, 0), vec!["tensor `w`", "past the end"]),
        ("unknown_type_4", one(&[4], 4, 0), vec!["tensor `w`", "unknown GGML type 4"]),
        ("unknown_type_99", one(&[4], 99, 0), vec!["tensor `w`", "unknown GGML type 99"]),
        ("unknown_type_max", one(&[4], u32::MAX, 0), vec!["tensor `w`", "unknown GGML type"]),
        ("q4_0_inner_not_block", one(&[16, 2], 2, 0), vec!["tensor `w`", "block size 32"]),
        ("q4k_inner_not_block", one(&[384], 12, 0), vec!["tensor `w`", "block size 256"]),
        ("offset_past_end", one(&[4], 0, 256), vec!["tensor `w`", "past the end"]),
        ("offset_partly_past_end", one(&[16], 0, 224), vec!["tensor `w`", "past the end"]),
        ("offset_near_u64_max", one(&[4], 0, u64::MAX - 31), vec!["tensor `w`", "past the end"]),
        ("q8_past_end", one(&[32, 8], 8, 0), vec!["tensor `w`", "past the end"]),
    ];
    for (case, bytes, frags) in &cases {
        bad_gguf(d, case, bytes, frags);
    }
    // Truncated tensor infos: rank present, dims missing; type missing; offset missing.
    let mut g = G::new();
    g.infos.extend(gstr(b"w"));
    g.infos.extend(3u32.to_le_bytes());
    g.infos.extend(4u64.to_le_bytes());
    g.nt = 1;
    bad_gguf(d, "dims_truncated", &g.header(), &["tensor `w`", "truncated"]);
    let mut g = G::new();
    g.infos.extend(gstr(b"w"));
    g.infos.extend(u32::MAX.to_le_bytes());
    g.nt = 1;
    bad_gguf(d, "rank_u32_max", &g.header(), &["tensor `w`", "rank"]);
    // Duplicate names, overlaps.
    let g = G::new().tensor("w", &[4], 0, 0).tensor("w", &[4], 0, 32).data(&data);
    bad_gguf(d, "duplicate_tensor", &g.build(), &["duplicate tensor name `w`"]);
    let g = G::new().tensor("a", &[16], 0, 0).tensor("b", &[4], 0, 32).data(&data);
    bad_gguf(d, "overlap", &g.build(), &["overlap", "`a`", "`b`"]);
    let g = G::new().tensor("a", &[4], 0, 64).tensor("b", &[2, 2], 0, 64).data(&data);
    bad_gguf(d, "same_offset", &g.build(), &["overlap"]);
    // Q8_1 / Q8K parse (they are valid GGML types) but cannot be loaded for compute: a clear error.
    let g = G::new().tensor("q81", &[32], 9, 0).data(&data);
    bad_gguf_load(d, "q8_1_load", &g.build(), &["q81", "cannot be loaded"]);
    let g = G::new().tensor("q8k", &[256], 15, 0).data(&[0u8; 512]);
    bad_gguf_load(d, "q8k_load", &g.build(), &["q8k", "cannot be loaded"]);
}

/// A GGUF that parses but one of whose tensors must fail to load.
fn bad_gguf_load(dir: &Path, case: &str, bytes: &[u8], fragments: &[&str]) {
    assert!(gguf_parse(case, bytes).is_ok(), "case `{case}` should parse");
    let path = write(dir, &format!("{case}.gguf"), bytes);
    expect_open_err(case, &path, fragments);
}

#[test]
fn gguf_config_metadata_is_validated() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let open_only = |case: &str, bytes: Vec<u8>, frags: &[&str]| {
        assert!(gguf_parse(case, &bytes).is_ok());
        expect_open_err(case, &write(d, &format!("{case}.gguf"), &bytes), frags);
    };
    open_only("config_not_json", small_gguf().kv_str("edgerun.config", "{model_type: toy").build(), &["edgerun.config", "not valid JSON"]);
    open_only("config_not_object", small_gguf().kv_str("edgerun.config", "[1]").build(), &["edgerun.config", "JSON object"]);
    open_only("config_empty", small_gguf().kv_str("edgerun.config", "").build(), &["edgerun.config", "not valid JSON"]);
    open_only("config_not_string", small_gguf().kv_u32("edgerun.config", 1).build(), &["edgerun.config", "must be a string"]);
    let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
    open_only("config_deep", small_gguf().kv_str("edgerun.config", &deep).build(), &["edgerun.config"]);
}

#[test]
fn single_bit_flips_never_panic() {
    // A cheap deterministic stand-in for the fuzzer: flip every bit of the headers of valid files.
    let st_full = valid_st();
    let hl = 8 + u64::from_le_bytes(st_full[..8].try_into().unwrap()) as usize;
    for i in 0..hl {
        for b in 0..8 {
            let mut m = st_full.clone();
            m[i] ^= 1 << b;
            let _ = st_parse(&format!("st flip {i}.{b}"), &m);
        }
    }
    let g = valid_gguf();
    for i in 0..g.len().min(700) {
        for b in 0..8 {
            let mut m = g.clone();
            m[i] ^= 1 << b;
            if let Ok(h) = gguf_parse(&format!("gguf flip {i}.{b}"), &m) {
                // Whatever parses must also stay inside the file.
                for t in &h.tensors {
                    assert!(t.start + t.len <= m.len(), "flip {i}.{b}: `{}` out of bounds", t.name);
                }
            }
        }
    }
}

/// The committed seeds of the weight-file targets (fuzz/corpus-seeds) are what `cargo run --example
/// fuzz_seeds` writes today: every seed present, byte for byte, nothing else there, each tiny and
/// valid for its target.
#[test]
fn committed_fuzz_seeds_are_current_and_valid() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus-seeds");
    let seeds = fuzz_seeds();
    let mut want: Vec<String> = seeds.iter().map(|(t, n, _)| format!("{t}/{n}")).collect();
    want.sort();
    // The weight-file targets' seeds are generated; other targets' seeds (config_model, npy_reader)
    // are written by hand.
    let generated: std::collections::BTreeSet<&str> = seeds.iter().map(|(t, _, _)| *t).collect();
    let mut have = Vec::new();
    for t in std::fs::read_dir(&root).unwrap() {
        let t = t.unwrap();
        if !generated.contains(t.file_name().to_string_lossy().as_ref()) {
            continue;
        }
        for f in std::fs::read_dir(t.path()).unwrap() {
            have.push(format!("{}/{}", t.file_name().to_string_lossy(), f.unwrap().file_name().to_string_lossy()));
        }
    }
    have.sort();
    assert_eq!(have, want, "fuzz/corpus-seeds is stale: regenerate with `cargo run --example fuzz_seeds`");
    let dir = tempfile::tempdir().unwrap();
    for (target, name, bytes) in &seeds {
        let case = format!("{target}/{name}");
        assert!(bytes.len() < 2048, "{case}: {} bytes", bytes.len());
        assert!(std::fs::read(root.join(&case)).unwrap() == *bytes, "{case} differs: regenerate with `cargo run --example fuzz_seeds`");
        let is_gguf = bytes.starts_with(b"GGUF");
        match *target {
            "safetensors_header" => assert!(!is_gguf && st_parse(&case, bytes).is_ok(), "{case}"),
            "gguf_header" => assert!(is_gguf && gguf_parse(&case, bytes).is_ok(), "{case}"),
            _ => {
                let p = write(dir.path(), &format!("{name}.{}", if is_gguf { "gguf" } else { "safetensors" }), bytes);
                open_and_load(&p).unwrap_or_else(|e| panic!("{case}: {e}"));
            }
        }
    }
}

#[test]
fn metadata_summary_elides_long_multibyte_strings() {
    let s = MetaValue::String("€".repeat(50)).summary();
    assert!(s.contains("(150 bytes)") && s.contains(&"€".repeat(33)) && !s.contains(&"€".repeat(34)), "{s}");
    let arr = MetaValue::Array((0..20).map(MetaValue::U8).collect()).summary();
    assert_eq!(arr, "[20 elements]");
}
