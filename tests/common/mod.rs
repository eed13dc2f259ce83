//! Shared helpers for parity tests against committed reference fixtures.
#![allow(dead_code)]
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use edgerun::models::{Model, NamedTensors};
use edgerun::tensor_io::read_tensors;
use edgerun::weights::WeightStore;

/// The fixture directory `tests/fixtures/<name>`.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests").join("fixtures").join(name)
}

/// The device spec of the tests: `EDGERUN_TEST_DEVICE` (`cpu`, `cuda`, `cuda:N`, `metal`), default `cpu`.
/// CLI tests pass it as `--device`, annotate tests as the config's `device`.
pub fn device_arg() -> String {
    std::env::var("EDGERUN_TEST_DEVICE").unwrap_or_else(|_| "cpu".into())
}

/// The device the model tests run on ([`device_arg`], parsed).
pub fn dev() -> Device {
    static DEVICE: std::sync::OnceLock<Device> = std::sync::OnceLock::new();
    DEVICE
        .get_or_init(|| {
            let spec = device_arg();
            edgerun::device::parse_device(&spec).unwrap_or_else(|e| panic!("EDGERUN_TEST_DEVICE={spec}: {e}"))
        })
        .clone()
}

/// Loads a fixture's model (its directory) on the test device in `dtype`.
pub fn load_model(dir: &Path, dtype: DType) -> Box<dyn Model> {
    let store = WeightStore::open(dir).unwrap_or_else(|e| panic!("open {}: {e}", dir.display()));
    edgerun::models::load(Arc::new(store), &dev(), dtype).unwrap_or_else(|e| panic!("load {}: {e}", dir.display()))
}

/// Reads a safetensors file of a fixture as f32 on the test device.
pub fn tensors(dir: &Path, file: &str) -> NamedTensors {
    read_tensors(&dir.join(file), DType::F32, &dev()).unwrap_or_else(|e| panic!("read {file}: {e}"))
}

/// Max |a − b| and max |b|.
pub fn errors(got: &Tensor, want: &Tensor) -> (f32, f32) {
    assert_eq!(got.dims(), want.dims(), "shape mismatch");
    let g = got.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let w = want.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let mut max_err = 0f32;
    let mut max_ref = 0f32;
    for (a, b) in g.iter().zip(&w) {
        assert!(a.is_finite(), "non-finite output");
        max_err = max_err.max((a - b).abs());
        max_ref = max_ref.max(b.abs());
    }
    (max_err, max_ref)
}

/// Asserts max |got − want| ≤ `rel` × max(1, max|want|) and returns the error.
pub fn assert_close(what: &str, got: &Tensor, want: &Tensor, rel: f32) -> f32 {
    let (err, max_ref) = errors(got, want);
    let bound = rel * max_ref.max(1.0);
    assert!(err <= bound, "{what}: max abs error {err:e} > bound {bound:e} (max|ref| {max_ref})");
    eprintln!("{what}: max abs error {err:e} (bound {bound:e}, max|ref| {max_ref})");
    err
}

/// The f32 parity tolerance from the project standard.
pub const F32_REL: f32 = 1e-4;

/// Copies a fixture model into `dir` with a small network input size so the tests stay quick.
pub fn small_model(fixture_name: &str, dir: &Path, preprocessor: &str) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture(fixture_name).join(f), dir.join(f)).unwrap();
    }
    std::fs::write(dir.join("preprocessor_config.json"), preprocessor).unwrap();
    dir.to_path_buf()
}

/// Every file under an annotate output's `dir/<stage>/` folders, relative path → bytes.
pub fn annotate_outputs(dir: &Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    fn walk(base: &Path, d: &Path, out: &mut std::collections::BTreeMap<String, Vec<u8>>) {
        for e in std::fs::read_dir(d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(base, &p, out);
            } else {
                out.insert(p.strip_prefix(base).unwrap().to_string_lossy().into_owned(), std::fs::read(&p).unwrap());
            }
        }
    }
    let mut out = std::collections::BTreeMap::new();
    for s in edgerun::annotate::StageKind::ALL {
        let d = dir.join(s.name());
        if d.is_dir() {
            walk(dir, &d, &mut out);
        }
    }
    out
}
