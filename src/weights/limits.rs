//! Caps applied while parsing untrusted weight-file headers.

/// Upper bounds on what a weight-file header may declare; anything beyond is rejected before allocation.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest accepted safetensors JSON header, in bytes.
    pub max_header_bytes: u64,
    /// Most tensors one file may declare.
    pub max_tensors: u64,
    /// Most dimensions one tensor may have.
    pub max_rank: usize,
    /// Largest accepted single dimension.
    pub max_dim: u64,
    /// Most metadata entries one file may declare.
    pub max_metadata_entries: u64,
    /// Longest accepted string (names, metadata values), in bytes.
    pub max_string_bytes: u64,
    /// Most elements in one metadata array.
    pub max_array_len: u64,
    /// Deepest nesting of metadata arrays.
    pub max_array_depth: usize,
    /// Most memory all of a file's decoded metadata may take, in bytes (each value counted at its
    /// in-memory size, [`crate::weights::MetaValue::SIZE`], plus its string bytes): a one-byte
    /// boolean takes 32 bytes decoded, so per-array caps alone let a file expand 32×.
    pub max_metadata_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_header_bytes: 100 << 20,
            max_tensors: 100_000,
            max_rank: 8,
            max_dim: 1 << 32,
            max_metadata_entries: 65_536,
            max_string_bytes: 1 << 20,
            max_array_len: 1 << 24,
            max_array_depth: 4,
            max_metadata_bytes: 64 << 20,
        }
    }
}
