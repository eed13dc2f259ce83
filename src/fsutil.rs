//! Atomic file writes: temp file in the target's directory, fsync, rename, fsync the directory.
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// A file being written that only appears at its final path once `commit` succeeds.
pub struct AtomicFile {
    tmp: PathBuf,
    dest: PathBuf,
    file: Option<File>,
}

impl AtomicFile {
    /// Starts writing `dest` via a hidden temp file beside it.
    pub fn create(dest: impl AsRef<Path>) -> Result<Self> {
        let dest = dest.as_ref().to_path_buf();
        let dir = dest.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let name = dest.file_name().ok_or_else(|| Error::bad_file(&dest, "not a file path"))?;
        let tmp = dir.join(format!(".{}.tmp-{}", name.to_string_lossy(), std::process::id()));
        let file = File::create(&tmp).map_err(|e| Error::io(&tmp, e))?;
        Ok(AtomicFile { tmp, dest, file: Some(file) })
    }

    /// The open temp file.
    pub fn file(&mut self) -> &mut File {
        // Always Some until commit consumes self.
        self.file.as_mut().expect("AtomicFile used after commit")
    }

    /// Flushes, fsyncs and renames into place, then fsyncs the directory.
    pub fn commit(mut self) -> Result<()> {
        let file = self.file.take().expect("AtomicFile committed twice");
        file.sync_all().map_err(|e| Error::io(&self.tmp, e))?;
        drop(file);
        std::fs::rename(&self.tmp, &self.dest).map_err(|e| Error::io(&self.dest, e))?;
        if let Some(dir) = self.dest.parent().filter(|p| !p.as_os_str().is_empty()) {
            if let Ok(d) = File::open(dir) {
                let _ = d.sync_all();
            }
        }
        Ok(())
    }
}

impl Write for AtomicFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.file().write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.file().flush()
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if self.file.take().is_some() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// Writes `bytes` to `dest` atomically.
pub fn write_atomic(dest: impl AsRef<Path>, bytes: &[u8]) -> Result<()> {
    let dest = dest.as_ref();
    let mut f = AtomicFile::create(dest)?;
    f.write_all(bytes).map_err(|e| Error::io(dest, e))?;
    f.commit()
}
