//! Image decoding with size limits, and atomic writers for the output formats (NPY, PNG).
pub mod colormap;
pub mod cv_resize;
pub mod decode;
pub mod npy;
pub mod png_out;
pub mod resample;

pub use decode::{load_rgb, rgb_to_tensor, ImageLimits};
pub use npy::write_npy_f16;
pub use png_out::{write_png_gray8, write_png_rgb8};

use std::path::{Path, PathBuf};

/// File extensions treated as images when a directory is given.
pub const IMAGE_EXTENSIONS: &[&str] = &["png", "jpg", "jpeg", "tif", "tiff"];

/// Expands files and directories (recursively, sorted) into image paths.
pub fn collect_images(inputs: &[PathBuf]) -> crate::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for p in inputs {
        if p.is_dir() {
            walk(p, &mut out)?;
        } else {
            out.push(p.clone());
        }
    }
    Ok(out)
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> crate::Result<()> {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| crate::Error::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            walk(&p, out)?;
        } else if p
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| IMAGE_EXTENSIONS.contains(&e.to_ascii_lowercase().as_str()))
        {
            out.push(p);
        }
    }
    Ok(())
}

/// The file stem used to name outputs (`a/b/img.jpg` → `img`).
pub fn stem(path: &Path) -> String {
    path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "image".into())
}
