//! The input list: a sorted recursive listing of image files, cached in the output directory and
//! rebuilt only when a directory of the input tree changed (directory mtimes), or on `--rescan`.
//!
//! A file rewritten in place (same name, no directory entry change) is only noticed with `--rescan`
//! (which, with content fingerprints, also re-hashes every input); new, removed and renamed files
//! (including atomic replace-by-rename) are always noticed.
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::config::Fingerprint;
use super::hash::xxh64_file;
use crate::error::{Error, Result};
use crate::walk::{has_extension, walk_tree};
use crate::paths::{check_relative, safe_join};

/// Largest cached input list read back (about 5 million entries); a larger one is rebuilt.
const MAX_CACHE: u64 = 1 << 30;

/// One input file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InputFile {
    /// Path relative to the input root, `/`-separated.
    pub rel: String,
    /// Size in bytes.
    pub size: u64,
    /// Modification time, nanoseconds since the Unix epoch.
    pub mtime_ns: i64,
    /// XXH64 of the contents (content fingerprints only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hash: Option<u64>,
}

/// The listed inputs.
#[derive(Debug, Clone)]
pub struct Listing {
    /// The input root.
    pub root: PathBuf,
    /// Inputs sorted by `rel`.
    pub files: Vec<InputFile>,
    /// Files that could not be listed (non-UTF-8 names, unreadable entries), with the reason.
    pub skipped: Vec<String>,
    /// Whether the list came from the cache.
    pub from_cache: bool,
    /// Problems with the cached list that made it be rebuilt (e.g. entries leaving the input root).
    pub warnings: Vec<String>,
}

#[derive(Serialize, Deserialize)]
struct Cache {
    version: u32,
    root: String,
    extensions: Vec<String>,
    exclude: Option<String>,
    fingerprint: Fingerprint,
    /// Directories (relative, "" = root) and their mtimes; -1 = changed during the scan.
    dirs: Vec<(String, i64)>,
    files: Vec<InputFile>,
    skipped: Vec<String>,
}

const CACHE_VERSION: u32 = 1;
/// Directories modified this close to the scan are not trusted next time (timestamp granularity).
const RACY_NS: i64 = 2_000_000_000;

/// Nanoseconds since the epoch of a modification time.
pub fn mtime_ns(m: &std::fs::Metadata) -> i64 {
    match m.modified() {
        Ok(t) => match t.duration_since(UNIX_EPOCH) {
            Ok(d) => d.as_nanos().min(i64::MAX as u128) as i64,
            Err(e) => -(e.duration().as_nanos().min(i64::MAX as u128) as i64),
        },
        Err(_) => 0,
    }
}

fn now_ns() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as i64).unwrap_or(0)
}

/// Lists `root` (excluding `exclude`, e.g. an output directory inside it, and hidden entries),
/// using and refreshing the cache at `cache_path`.
pub fn list_inputs(
    root: &Path,
    extensions: &[String],
    exclude: Option<&Path>,
    fingerprint: Fingerprint,
    cache_path: &Path,
    rescan: bool,
) -> Result<Listing> {
    let root_c = root.canonicalize().map_err(|e| Error::io(root, e))?;
    if !root_c.is_dir() {
        return Err(Error::Input(format!("{} is not a directory", root.display())));
    }
    let exclude_c = exclude.and_then(|p| p.canonicalize().ok()).filter(|p| p.starts_with(&root_c));
    let exts: Vec<String> = extensions.iter().map(|e| e.trim_start_matches('.').to_ascii_lowercase()).collect();
    let root_s = root_c.to_string_lossy().into_owned();
    let exclude_s = exclude_c.as_ref().map(|p| p.to_string_lossy().into_owned());

    let mut warnings = Vec::new();
    let old: Option<Cache> = crate::fsutil::read_input(cache_path, MAX_CACHE)
        .ok()
        .and_then(|b| serde_json::from_slice::<Cache>(&b).ok())
        .filter(|c| c.version == CACHE_VERSION && c.root == root_s && c.extensions == exts && c.exclude == exclude_s)
        .filter(|c| match untrusted_entries(&root_c, c) {
            Ok(()) => true,
            Err(e) => {
                warnings.push(format!("{}: {e}; cached list dropped and rebuilt", cache_path.display()));
                false
            }
        });
    if let Some(c) = &old {
        if !rescan && c.fingerprint == fingerprint && dirs_unchanged(&root_c, &c.dirs) {
            return Ok(Listing { root: root_c, files: c.files.clone(), skipped: c.skipped.clone(), from_cache: true, warnings });
        }
    }

    let start = now_ns();
    let ext_refs: Vec<&str> = exts.iter().map(String::as_str).collect();
    let walked = walk_tree(&root_c, &|name| has_extension(name, &ext_refs), exclude_c.as_deref())?;
    // A directory modified during the scan is not trusted next time (-1).
    let dirs: Vec<(String, i64)> = walked
        .dirs
        .iter()
        .map(|d| {
            let m = mtime_ns(&d.meta);
            (d.rel.clone(), if m >= start - RACY_NS { -1 } else { m })
        })
        .collect();
    let mut files: Vec<InputFile> =
        walked.files.iter().map(|f| InputFile { rel: f.rel.clone(), size: f.meta.len(), mtime_ns: mtime_ns(&f.meta), hash: None }).collect();
    let skipped: Vec<String> = walked.problems.iter().map(|(p, why)| format!("{}: {why}", p.display())).collect();
    if fingerprint == Fingerprint::Content {
        // Hashes of unchanged files (same size and mtime) are reused, except on `--rescan`.
        let known: HashMap<(&str, u64, i64), u64> = old
            .as_ref()
            .filter(|_| !rescan)
            .map(|c| c.files.iter().filter_map(|f| f.hash.map(|h| ((f.rel.as_str(), f.size, f.mtime_ns), h))).collect())
            .unwrap_or_default();
        let hashes: Vec<Option<u64>> = files
            .par_iter()
            .map(|f| known.get(&(f.rel.as_str(), f.size, f.mtime_ns)).copied().or_else(|| xxh64_file(&root_c.join(&f.rel)).ok()))
            .collect();
        for (f, h) in files.iter_mut().zip(hashes) {
            f.hash = h;
        }
    }
    let cache = Cache { version: CACHE_VERSION, root: root_s, extensions: exts, exclude: exclude_s, fingerprint, dirs, files, skipped };
    // The cache is an optimisation: failing to write it is not an error.
    if let Ok(bytes) = serde_json::to_vec(&cache) {
        let _ = crate::fsutil::write_atomic(cache_path, &bytes);
    }
    Ok(Listing { root: root_c, files: cache.files, skipped: cache.skipped, from_cache: false, warnings })
}

/// Checks every path of a cache read from disk: files must stay inside the input root
/// ([`safe_join`]), directories must be plain relative paths (`""` is the root).
fn untrusted_entries(root: &Path, c: &Cache) -> Result<()> {
    for f in &c.files {
        safe_join(root, &f.rel)?;
    }
    for (d, _) in c.dirs.iter().filter(|(d, _)| !d.is_empty()) {
        check_relative(d)?;
    }
    Ok(())
}

fn dirs_unchanged(root: &Path, dirs: &[(String, i64)]) -> bool {
    !dirs.is_empty()
        && dirs.iter().all(|(rel, m)| {
            *m >= 0 && std::fs::metadata(if rel.is_empty() { root.to_path_buf() } else { root.join(rel) }).is_ok_and(|md| md.is_dir() && mtime_ns(&md) == *m)
        })
}
