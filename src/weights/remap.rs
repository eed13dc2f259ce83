//! Name remapping, so one model can load both the hub layout and an original layout.
use std::sync::Arc;

/// Where a requested tensor can be found under another name.
#[derive(Debug, Clone, PartialEq)]
pub struct Alias {
    /// The name stored in the file.
    pub name: String,
    /// Take part `.0` of `.1` equal parts along dimension 0 (e.g. one of q/k/v in a fused qkv).
    pub chunk: Option<(usize, usize)>,
}

/// A rule mapping a requested (hub) name to where it is stored, or None when it does not apply.
pub type Remap = Arc<dyn Fn(&str) -> Option<Alias> + Send + Sync>;
