//! Writes the input to a temporary file (as `.gguf` or `.safetensors`, chosen by its first bytes),
//! opens it through `WeightStore::open` and loads every tensor: errors are fine, panics are not.
#![no_main]
use std::sync::LazyLock;

use candle_core::{DType, Device};
use edgerun::weights::WeightStore;
use libfuzzer_sys::fuzz_target;

// One directory per fuzzing process, reused (and the file overwritten) on every input; on tmpfs when
// there is one, since ext4 flushes a file that is truncated and rewritten on close.
static DIR: LazyLock<tempfile::TempDir> =
    LazyLock::new(|| tempfile::tempdir_in("/dev/shm").or_else(|_| tempfile::tempdir()).expect("temp dir"));

fuzz_target!(|data: &[u8]| {
    let name = if data.starts_with(b"GGUF") { "model.gguf" } else { "model.safetensors" };
    let path = DIR.path().join(name);
    if std::fs::write(&path, data).is_err() {
        return;
    }
    let Ok(store) = WeightStore::open(&path) else { return };
    let _ = store.architecture();
    for v in store.metadata().values() {
        let _ = v.summary();
    }
    let names: Vec<String> = store.entries().keys().cloned().collect();
    for name in names {
        let _ = store.info(&name);
        for dt in [DType::F32, DType::F16] {
            if let Ok(t) = store.tensor(&name, dt, &Device::Cpu) {
                assert_eq!(t.dims(), store.entries()[&name].shape.as_slice());
            }
        }
        let _ = store.qtensor(&name, &Device::Cpu);
    }
});
