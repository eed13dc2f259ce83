//! The one recursive directory walker of every command (`annotate`, `depth`, `segment`, `chm`,
//! `edges`): sorted, safe against symlink loops, hidden entries skipped, and every name it cannot
//! handle (not UTF-8, unreadable, not a regular file) reported instead of silently dropped.
use std::collections::HashSet;
use std::fs::Metadata;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// A file found by [`walk_tree`].
#[derive(Debug, Clone)]
pub(crate) struct WalkedFile {
    /// Path relative to the root, `/`-separated.
    pub rel: String,
    /// The path as found (root joined with `rel`).
    pub path: PathBuf,
    /// Its metadata (symlinks followed).
    pub meta: Metadata,
}

/// A directory visited by [`walk_tree`].
#[derive(Debug, Clone)]
pub(crate) struct WalkedDir {
    /// Path relative to the root (`""` for the root), `/`-separated.
    pub rel: String,
    /// Its metadata, read before its entries (so an entry added meanwhile changes its mtime).
    pub meta: Metadata,
}

/// Everything a walk found.
#[derive(Debug, Default)]
pub(crate) struct Walk {
    /// Accepted regular files, sorted by `rel`.
    pub files: Vec<WalkedFile>,
    /// Directories visited, parents before children.
    pub dirs: Vec<WalkedDir>,
    /// Entries that could not be handled, with the reason (accepted names only, plus unreadable
    /// directories and names that are not UTF-8).
    pub problems: Vec<(PathBuf, String)>,
}

/// Walks `root` recursively. `accept` decides on a file name (e.g. by extension); an accepted name
/// that is not a regular file (FIFO, socket, device) is reported, never opened. A directory whose
/// canonical path is `exclude` (an output directory inside the input tree) or was already visited
/// (a symlink loop) is not entered. A symlink that leads outside the root is reported and not
/// followed, for every command (every listed path then stays inside the root when joined again);
/// the root itself may be a symlink.
pub(crate) fn walk_tree(root: &Path, accept: &dyn Fn(&str) -> bool, exclude: Option<&Path>) -> Result<Walk> {
    let mut w = Walk::default();
    let mut seen = HashSet::new();
    let root_c = root.canonicalize().map_err(|e| Error::io(root, e))?;
    let opts = Opts { accept, exclude, confine: &root_c };
    visit(root, "", &opts, &mut seen, &mut w)?;
    w.files.sort_by(|a, b| a.rel.cmp(&b.rel));
    Ok(w)
}

struct Opts<'a> {
    accept: &'a dyn Fn(&str) -> bool,
    exclude: Option<&'a Path>,
    /// The canonical root symlinks must stay inside.
    confine: &'a Path,
}

fn visit(dir: &Path, rel: &str, o: &Opts<'_>, seen: &mut HashSet<PathBuf>, w: &mut Walk) -> Result<()> {
    let canon = dir.canonicalize().map_err(|e| Error::io(dir, e))?;
    if !seen.insert(canon) {
        return Ok(());
    }
    let meta = std::fs::metadata(dir).map_err(|e| Error::io(dir, e))?;
    w.dirs.push(WalkedDir { rel: rel.to_string(), meta });
    let mut entries: Vec<(String, PathBuf)> = Vec::new();
    for e in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let e = match e {
            Ok(e) => e,
            Err(err) => {
                w.problems.push((dir.to_path_buf(), format!("cannot read an entry: {err}")));
                continue;
            }
        };
        match e.file_name().to_str() {
            Some(n) if n.starts_with('.') => {}
            Some(n) => entries.push((n.to_string(), e.path())),
            None => w.problems.push((e.path(), "file name is not UTF-8 (rename it to process it)".into())),
        }
    }
    entries.sort();
    for (name, path) in entries {
        let child_rel = if rel.is_empty() { name.clone() } else { format!("{rel}/{name}") };
        let md = match std::fs::metadata(&path) {
            Ok(m) => m,
            Err(err) => {
                if (o.accept)(&name) {
                    w.problems.push((path, err.to_string()));
                }
                continue;
            }
        };
        let is_link = std::fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_symlink());
        if is_link && (md.is_dir() || (o.accept)(&name)) && !path.canonicalize().is_ok_and(|c| c.starts_with(o.confine)) {
            w.problems.push((path, "symlink to outside the input root; not followed".into()));
            continue;
        }
        if md.is_dir() {
            if o.exclude.is_some_and(|x| path.canonicalize().is_ok_and(|c| c == x)) {
                continue;
            }
            match visit(&path, &child_rel, o, seen, w) {
                Ok(()) => {}
                Err(e) => w.problems.push((path, e.to_string())),
            }
        } else if (o.accept)(&name) {
            if md.is_file() {
                w.files.push(WalkedFile { rel: child_rel, path, meta: md });
            } else {
                w.problems.push((path, "not a regular file (FIFO, socket or device)".into()));
            }
        }
    }
    Ok(())
}

/// Whether `name` has one of `extensions` (lower-case, without the dot), case-insensitively.
pub(crate) fn has_extension(name: &str, extensions: &[&str]) -> bool {
    Path::new(name).extension().and_then(|e| e.to_str()).is_some_and(|e| extensions.iter().any(|x| x.eq_ignore_ascii_case(e)))
}
