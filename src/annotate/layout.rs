//! Where outputs go: `<output_dir>/<stage>/<input path without extension>.<ext>`, plus creating the
//! output directories once up front and removing temp files a killed run left behind.
use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};

use super::config::{Config, StageKind};
use crate::error::{Error, Result};

/// What an output file is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OutputKind {
    /// The stage's data (`.npy` or class-id `.png`).
    Main,
    /// The PNG visualisation (`.viz.png`).
    Viz,
    /// The GeoTIFF (CHM on georeferenced inputs).
    GeoTiff,
}

/// `a/b/img.jpg` → `a/b/img`.
pub(crate) fn stem_rel(rel: &str) -> String {
    let (dir, name) = match rel.rfind('/') {
        Some(i) => (&rel[..=i], &rel[i + 1..]),
        None => ("", rel),
    };
    let base = match name.rfind('.') {
        Some(i) if i > 0 => &name[..i],
        _ => name,
    };
    format!("{dir}{base}")
}

/// The output path (relative to the output directory, `/`-separated) of one kind of output.
pub(crate) fn output_rel(stage: StageKind, stem: &str, kind: OutputKind) -> String {
    let ext = match (stage, kind) {
        (StageKind::Segmentation, OutputKind::Main) => "png",
        (_, OutputKind::Main) => "npy",
        (_, OutputKind::Viz) => "viz.png",
        (_, OutputKind::GeoTiff) => "tif",
    };
    format!("{}/{stem}.{ext}", stage.name())
}

/// The outputs a finished item must have (the GeoTIFF is conditional and not included).
pub(crate) fn expected_outputs(cfg: &Config, stage: StageKind, stem: &str) -> Vec<String> {
    let mut v = vec![output_rel(stage, stem, OutputKind::Main)];
    if cfg.visualize(stage) {
        v.push(output_rel(stage, stem, OutputKind::Viz));
    }
    v
}

/// Every output name an item may write (for temp-file cleanup).
pub(crate) fn possible_outputs(stage: StageKind, stem: &str) -> [String; 3] {
    [output_rel(stage, stem, OutputKind::Main), output_rel(stage, stem, OutputKind::Viz), output_rel(stage, stem, OutputKind::GeoTiff)]
}

/// Marks inputs whose output names collide with an earlier input's (e.g. `a.jpg` and `a.png`):
/// returns, per input, the earlier input it collides with.
pub(crate) fn collisions(stems: &[String], any_viz: bool) -> Vec<Option<usize>> {
    let mut claimed: HashMap<String, usize> = HashMap::new();
    let mut out = vec![None; stems.len()];
    for (i, s) in stems.iter().enumerate() {
        let viz = format!("{s}.viz");
        let hit = claimed.get(s).copied().or_else(|| if any_viz { claimed.get(&viz).copied() } else { None });
        if let Some(j) = hit {
            out[i] = Some(j);
            continue;
        }
        claimed.insert(s.clone(), i);
        if any_viz {
            claimed.insert(viz, i);
        }
    }
    out
}

/// Creates each distinct directory once.
pub(crate) fn create_dirs(output: &Path, rel_files: impl IntoIterator<Item = String>) -> Result<usize> {
    let dirs: BTreeSet<PathBuf> = rel_files.into_iter().filter_map(|r| Path::new(&r).parent().map(|p| output.join(p))).collect();
    for d in &dirs {
        std::fs::create_dir_all(d).map_err(|e| Error::io(d, e))?;
    }
    Ok(dirs.len())
}

/// Whether `name` is an `AtomicFile` temp name (`.<dest>.tmp-<pid>`); returns `<dest>`.
pub(crate) fn temp_dest(name: &str) -> Option<&str> {
    let rest = name.strip_prefix('.')?;
    let i = rest.rfind(".tmp-")?;
    let pid = &rest[i + 5..];
    (!pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()) && i > 0).then(|| &rest[..i])
}

/// Removes `AtomicFile` temp files in `dirs`: all of them (`owned = None`, unsharded runs), or only
/// those whose destination is in `owned` (other shards may be writing beside us). Returns the count.
pub(crate) fn remove_stale_temps(dirs: &BTreeSet<PathBuf>, owned: Option<&HashSet<PathBuf>>) -> Result<usize> {
    let mut removed = 0;
    for dir in dirs {
        let rd = match std::fs::read_dir(dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(Error::io(dir, e)),
        };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(dest) = temp_dest(&name) else { continue };
            if owned.is_none_or(|o| o.contains(&dir.join(dest))) {
                let p = e.path();
                match std::fs::remove_file(&p) {
                    Ok(()) => removed += 1,
                    Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
                    Err(err) => return Err(Error::io(&p, err)),
                }
            }
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!(stem_rel("a/b/img.jpg"), "a/b/img");
        assert_eq!(stem_rel("x.tar.png"), "x.tar");
        assert_eq!(stem_rel("d.x/.hidden"), "d.x/.hidden");
        assert_eq!(output_rel(StageKind::Segmentation, "a/img", OutputKind::Main), "segmentation/a/img.png");
        assert_eq!(output_rel(StageKind::Depth, "a/img", OutputKind::Viz), "depth/a/img.viz.png");
        assert_eq!(temp_dest(".img.npy.tmp-1234"), Some("img.npy"));
        assert_eq!(temp_dest(".img.npy.tmp-"), None);
        assert_eq!(temp_dest("img.npy"), None);
        let stems: Vec<String> = ["a", "a", "b.viz", "b"].iter().map(|s| s.to_string()).collect();
        assert_eq!(collisions(&stems, true), vec![None, Some(0), None, Some(2)]);
        let stems: Vec<String> = ["b", "b.viz"].iter().map(|s| s.to_string()).collect();
        assert_eq!(collisions(&stems, true), vec![None, Some(0)]);
        assert_eq!(collisions(&stems, false), vec![None, None]);
    }
}
