//! Fuzzes the `.npy` reader on arbitrary bytes: Ok or Err, never a panic, and what it accepts is a
//! C-order 2-D array whose values fill the rest of the input exactly.
#![no_main]
use edgerun::imageio::npy::{decode_npy_2d, parse_header};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = parse_header(data);
    if let Ok(((h, w), v)) = decode_npy_2d(data) {
        assert!(h > 0 && w > 0);
        assert_eq!(h.checked_mul(w), Some(v.len()));
        assert!(v.len() * 2 < data.len());
    }
});
