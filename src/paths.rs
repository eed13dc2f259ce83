//! Joining relative paths read from files the program did not just write (input-list caches,
//! journals, manifests) onto the directory they are relative to, without ever leaving it.
use std::path::{Component, Path, PathBuf};

use crate::error::{Error, Result};

/// Checks that `rel` is a plain relative path: not empty, no NUL, not absolute, and only normal
/// components (no `..`, no `.`, no root or drive prefix). Returns it as a `Path`.
pub(crate) fn check_relative(rel: &str) -> Result<&Path> {
    let bad = |why: &str| Err(Error::Input(format!("path `{}` {why}", rel.escape_debug())));
    if rel.is_empty() {
        return bad("is empty");
    }
    if rel.contains('\0') {
        return bad("contains a NUL byte");
    }
    let p = Path::new(rel);
    if p.is_absolute() || p.has_root() {
        return bad("is absolute");
    }
    // Path::components hides `a/./b` and `a//b`; the segments are checked as written.
    for seg in rel.split(|c| c == '/' || std::path::is_separator(c)) {
        match seg {
            "" => return bad("has an empty component"),
            "." => return bad("has a `.` component"),
            ".." => return bad("has a `..` component"),
            _ => {}
        }
    }
    for c in p.components() {
        match c {
            Component::Normal(_) => {}
            Component::ParentDir => return bad("has a `..` component"),
            Component::CurDir => return bad("has a `.` component"),
            Component::RootDir | Component::Prefix(_) => return bad("is absolute"),
        }
    }
    Ok(p)
}

/// `root.join(rel)` for an untrusted `rel`: refused unless [`check_relative`] accepts it and the
/// longest existing prefix of the result, with every symlink resolved, is still inside `root`
/// (which must exist). The returned path is the plain join (symlinks inside `root` are kept).
pub fn safe_join(root: &Path, rel: &str) -> Result<PathBuf> {
    let rel_path = check_relative(rel)?;
    let root_c = root.canonicalize().map_err(|e| Error::io(root, e))?;
    let joined = root.join(rel_path);
    let mut probe = joined.as_path();
    loop {
        match probe.canonicalize() {
            Ok(c) if c.starts_with(&root_c) => return Ok(joined),
            Ok(c) => {
                return Err(Error::Input(format!(
                    "path `{}` leaves {} through a symlink (to {})",
                    rel.escape_debug(),
                    root.display(),
                    c.display()
                )))
            }
            // Something is there (a dangling or looping symlink, an unreadable directory) but it
            // cannot be resolved: refused, since following it later could leave the root.
            Err(e) if probe.symlink_metadata().is_ok() => {
                return Err(Error::Input(format!("path `{}` under {} cannot be resolved: {e}", rel.escape_debug(), root.display())))
            }
            Err(_) => match probe.parent() {
                Some(parent) if parent.starts_with(root) && parent != probe => probe = parent,
                _ => return Ok(joined),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lexical_rules() {
        for ok in ["a", "a/b.png", "dir with space/x"] {
            assert!(check_relative(ok).is_ok(), "{ok}");
        }
        for bad in ["", "/abs", "../x", "a/../../x", "./a", "a/./b", "a//b", "a/", ".", "..", "a\0b"] {
            assert!(check_relative(bad).is_err(), "{bad:?}");
        }
    }
}
