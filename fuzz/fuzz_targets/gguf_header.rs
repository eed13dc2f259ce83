//! Fuzzes the GGUF parser on arbitrary bytes: it must return Ok or Err, never panic, and whatever it
//! accepts must lie inside the input.
#![no_main]
use edgerun::weights::{gguf, Limits};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = gguf::parse(data, 0, &Limits::default()) {
        for t in &h.tensors {
            assert!(t.start.checked_add(t.len).is_some_and(|e| e <= data.len()), "`{}` out of bounds", t.name);
            assert_eq!(t.dtype.bytes_for(t.numel()), Some(t.len), "`{}` length mismatch", t.name);
        }
    }
});
