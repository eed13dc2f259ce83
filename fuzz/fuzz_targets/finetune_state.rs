//! Fuzzes the finetune resume-state reader on arbitrary bytes as `state/state.safetensors`: it must
//! return Ok or Err, never panic; a state it accepts holds only finite tensors, and checking it
//! against a run never panics either.
#![no_main]
use std::sync::OnceLock;

use candle_core::Device;
use edgerun::train::outputs::load_state;
use libfuzzer_sys::fuzz_target;

fn dir() -> &'static tempfile::TempDir {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("a temp dir"))
}

fuzz_target!(|data: &[u8]| {
    let path = dir().path().join("state.safetensors");
    std::fs::write(&path, data).expect("the state file is written");
    if let Ok((tensors, meta)) = load_state(&path, &Device::Cpu) {
        for (name, t) in &tensors {
            let v = t.flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("an f32 tensor");
            assert!(v.iter().all(|x| x.is_finite()), "`{name}`: a non-finite tensor was accepted");
        }
        let _ = meta.check(&path, 1000, &meta.fingerprint.clone());
        let _ = meta.check(&path, 0, "another run");
    }
});
