//! The inputs of a direct command (`depth`, `segment`, `chm`, `edges`): files and directories from the
//! command line expanded through the shared walker into items, each with the output stem that mirrors
//! its place in the input tree (`DIR/sub/a.jpg` → `OUT/sub/a.<ext>`), as `annotate` lays its outputs.
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::walk::walk_tree;

/// One input of a run.
#[derive(Debug, Clone)]
pub struct InputItem {
    /// The file to read.
    pub path: PathBuf,
    /// Output path stem relative to the output directory, `/`-separated, without the suffix
    /// (`sub/a` for `DIR/sub/a.jpg`).
    pub out_stem: String,
    /// Why this item cannot be processed (it is reported as failed), if so.
    pub problem: Option<String>,
}

/// The name of `name` without the first of `suffixes` it ends with (case-insensitive).
fn strip_suffix<'a>(name: &'a str, suffixes: &[&str]) -> Option<&'a str> {
    suffixes.iter().find_map(|s| {
        let cut = name.len().checked_sub(s.len())?;
        (cut > 0 && name.is_char_boundary(cut) && name[cut..].eq_ignore_ascii_case(s)).then(|| &name[..cut])
    })
}

/// Image files: the suffixes that `depth`, `segment` and `chm` pick up in a directory.
pub const IMAGE_SUFFIXES: &[&str] = &[".png", ".jpg", ".jpeg", ".tif", ".tiff"];

/// Expands `args` into items. Directories are walked recursively (files ending with one of
/// `suffixes`); a file given by name is taken whatever its name. Missing files, non-regular files,
/// names the walker could not handle and items whose outputs would collide with an earlier item's
/// become items with a `problem`. `out`, the output directory when its files could be taken for
/// inputs (images), is skipped when it lies inside an input directory and refused when it is one.
pub fn collect_inputs(args: &[PathBuf], suffixes: &[&str], out: Option<&Path>) -> Result<Vec<InputItem>> {
    let out_c = out.and_then(|o| o.canonicalize().ok());
    let mut items = Vec::new();
    for arg in args {
        let meta = std::fs::metadata(arg);
        if meta.as_ref().is_ok_and(|m| m.is_dir()) {
            let dir_c = arg.canonicalize().map_err(|e| Error::io(arg, e))?;
            if out_c.as_ref() == Some(&dir_c) {
                return Err(Error::Input(format!(
                    "the output directory is the input directory {}: choose another --out",
                    arg.display()
                )));
            }
            let walked = walk_tree(arg, &|name| strip_suffix(name, suffixes).is_some(), out_c.as_deref())?;
            for f in walked.files {
                let out_stem = strip_suffix(&f.rel, suffixes).unwrap_or(&f.rel).to_string();
                items.push(InputItem { path: f.path, out_stem, problem: None });
            }
            for (path, why) in walked.problems {
                let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                items.push(InputItem { path, out_stem: name, problem: Some(why) });
            }
            continue;
        }
        let name = arg.file_name().and_then(|n| n.to_str()).map(str::to_string);
        let out_stem = match &name {
            Some(n) => strip_suffix(n, suffixes).or_else(|| Path::new(n).file_stem().and_then(|s| s.to_str())).unwrap_or(n).to_string(),
            None => String::new(),
        };
        let problem = match (&meta, &name) {
            (Err(e), _) => Some(e.to_string()),
            (Ok(m), _) if !m.is_file() => Some("not a regular file (FIFO, socket or device)".into()),
            (Ok(_), None) => Some("file name is not UTF-8 (rename it to process it)".into()),
            _ => None,
        };
        items.push(InputItem { path: arg.clone(), out_stem, problem });
    }
    mark_collisions(&mut items);
    Ok(items)
}

/// Marks every item whose outputs would overwrite an earlier item's (`a.jpg` and `a.png` in one
/// directory, or the same file name given from two places).
fn mark_collisions(items: &mut [InputItem]) {
    let mut claimed: HashMap<String, PathBuf> = HashMap::new();
    for it in items.iter_mut().filter(|i| i.problem.is_none()) {
        match claimed.get(&it.out_stem) {
            Some(first) => {
                it.problem = Some(format!("its outputs would overwrite those of {} (same output name `{}`); rename one", first.display(), it.out_stem))
            }
            None => {
                claimed.insert(it.out_stem.clone(), it.path.clone());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suffixes_are_stripped_case_insensitively_and_never_to_nothing() {
        assert_eq!(strip_suffix("a.JPG", IMAGE_SUFFIXES), Some("a"));
        assert_eq!(strip_suffix("x.depth.npy", &[".depth.npy"]), Some("x"));
        assert_eq!(strip_suffix(".png", IMAGE_SUFFIXES), None);
        assert_eq!(strip_suffix("a.gif", IMAGE_SUFFIXES), None);
        assert_eq!(strip_suffix("é.png", IMAGE_SUFFIXES), Some("é"));
    }
}
