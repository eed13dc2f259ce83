//! Fuzzes the GGUF metadata reader: a GGUF header declaring `data[0]` key/value pairs, followed by
//! the rest of the bytes. It must return Ok or Err, never panic, and what it accepts must stay within
//! the decoded-metadata budget (small here, so that a blow-up is reachable in a few KiB of input).
#![no_main]
use edgerun::weights::{gguf, Limits, MetaValue};
use libfuzzer_sys::fuzz_target;

const BUDGET: u64 = 64 << 10;

fuzz_target!(|data: &[u8]| {
    let Some((&n_kv, rest)) = data.split_first() else { return };
    let mut bytes = b"GGUF".to_vec();
    bytes.extend(3u32.to_le_bytes());
    bytes.extend(0u64.to_le_bytes());
    bytes.extend(u64::from(n_kv).to_le_bytes());
    bytes.extend(rest);
    let limits = Limits { max_metadata_bytes: BUDGET, ..Limits::default() };
    if let Ok(h) = gguf::parse(&bytes, 0, &limits) {
        let used: u64 = h.metadata.iter().map(|(k, v)| k.len() as u64 + MetaValue::SIZE + v.decoded_bytes()).sum();
        assert!(used <= BUDGET, "{used} bytes of metadata decoded, over the {BUDGET} budget");
    }
});
