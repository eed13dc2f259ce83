//! The one output writer: atomic file writes (temp file in the target's directory, fsync, rename,
//! fsync the directory) that refuse to replace an input of the run or anything but a regular file,
//! and leave no temp file behind on any error.
use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::error::{Error, Result};

/// Identities (device, inode) of the files this process reads as inputs.
static INPUTS: Mutex<Option<HashSet<FileId>>> = Mutex::new(None);

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum FileId {
    #[cfg(unix)]
    Inode(u64, u64),
    #[cfg(not(unix))]
    Path(PathBuf),
}

fn file_id(path: &Path) -> Option<FileId> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(path).ok()?;
        Some(FileId::Inode(m.dev(), m.ino()))
    }
    #[cfg(not(unix))]
    {
        path.canonicalize().ok().map(FileId::Path)
    }
}

/// Largest configuration-like file read whole (config.json, preprocessor configs, recipes, class maps).
pub(crate) const MAX_TEXT_INPUT: u64 = 64 << 20;

/// Refuses an input that is not a regular file (a FIFO would block the open forever; a device or a
/// directory is never an input), before opening it.
pub(crate) fn check_input_file(path: &Path) -> Result<std::fs::Metadata> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if !meta.is_file() {
        let what = if meta.is_dir() { "a directory" } else { "not a regular file (FIFO, socket or device)" };
        return Err(Error::bad_file(path, format!("cannot be read as an input: it is {what}")));
    }
    Ok(meta)
}

/// Reads a small input file whole: a regular file of at most `limit` bytes.
pub(crate) fn read_input(path: &Path, limit: u64) -> Result<Vec<u8>> {
    let meta = check_input_file(path)?;
    if meta.len() > limit {
        return Err(Error::bad_file(path, format!("is {} bytes, more than the {limit} bytes such a file may have", meta.len())));
    }
    std::fs::read(path).map_err(|e| Error::io(path, e))
}

/// Opens an input for reading: a regular file (checked before the open, so a FIFO never blocks it,
/// and again on the opened file, so a swap in between is caught).
pub(crate) fn open_input(path: &Path) -> Result<std::fs::File> {
    check_input_file(path)?;
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    if !file.metadata().map_err(|e| Error::io(path, e))?.is_file() {
        return Err(Error::bad_file(path, "cannot be read as an input: it is not a regular file"));
    }
    Ok(file)
}

/// Opens a state file for reading and appending, created if missing: never through a symbolic link,
/// never a FIFO, device or directory, never a registered input.
pub(crate) fn open_append(path: &Path) -> Result<std::fs::File> {
    check_output_target(path)?;
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.is_file() {
            return Err(Error::bad_file(path, "cannot be appended to: it is not a regular file (a link, FIFO, socket, device or directory)"));
        }
    }
    let file = std::fs::OpenOptions::new().read(true).append(true).create(true).open(path).map_err(|e| Error::io(path, e))?;
    if !file.metadata().map_err(|e| Error::io(path, e))?.is_file() {
        return Err(Error::bad_file(path, "cannot be appended to: it is not a regular file"));
    }
    Ok(file)
}

/// [`read_input`] as UTF-8 text.
pub(crate) fn read_input_text(path: &Path, limit: u64) -> Result<String> {
    String::from_utf8(read_input(path, limit)?).map_err(|_| Error::bad_file(path, "is not UTF-8 text"))
}

/// Records `path` as an input of this run: no [`AtomicFile`] will replace it (whatever path names it).
pub fn register_input(path: &Path) {
    if let Some(id) = file_id(path) {
        if let Ok(mut g) = INPUTS.lock() {
            g.get_or_insert_with(HashSet::new).insert(id);
        }
    }
}

fn is_registered_input(path: &Path) -> bool {
    let Some(id) = file_id(path) else { return false };
    INPUTS.lock().map(|g| g.as_ref().is_some_and(|s| s.contains(&id))).unwrap_or(false)
}

/// Refuses `dest` when it exists and is not a regular file (a FIFO, a device, a directory, or a
/// symlink to one), or when it is an input of this run.
pub(crate) fn check_output_target(dest: &Path) -> Result<()> {
    match std::fs::metadata(dest) {
        Ok(m) if !m.is_file() => {
            let what = if m.is_dir() { "a directory" } else { "not a regular file (FIFO, socket or device)" };
            Err(Error::Input(format!("{}: refusing to write over it: it is {what}", dest.display())))
        }
        Ok(_) if is_registered_input(dest) => {
            Err(Error::Input(format!("{}: refusing to write over it: it is an input of this run", dest.display())))
        }
        _ => Ok(()),
    }
}

/// A file being written that only appears at its final path once `commit` succeeds.
pub(crate) struct AtomicFile {
    tmp: PathBuf,
    dest: PathBuf,
    file: Option<File>,
}

impl AtomicFile {
    /// Starts writing `dest` via a hidden temp file beside it (see [`check_output_target`]).
    pub(crate) fn create(dest: impl AsRef<Path>) -> Result<Self> {
        let dest = dest.as_ref().to_path_buf();
        check_output_target(&dest)?;
        let dir = dest.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let name = dest.file_name().ok_or_else(|| Error::bad_file(&dest, "not a file path"))?;
        let tmp = dir.join(format!(".{}.tmp-{}", name.to_string_lossy(), std::process::id()));
        // A stale temp file (or anything planted under its name) is removed, never followed.
        let _ = std::fs::remove_file(&tmp);
        let file = OpenOptions::new().write(true).create_new(true).open(&tmp).map_err(|e| Error::io(&tmp, e))?;
        Ok(AtomicFile { tmp, dest, file: Some(file) })
    }

    /// The open temp file (an error only after [`AtomicFile::commit`], which consumes it).
    pub(crate) fn file(&mut self) -> std::io::Result<&mut File> {
        self.file.as_mut().ok_or_else(|| std::io::Error::other("the file was already committed"))
    }

    /// Flushes, fsyncs and renames into place, then fsyncs the directory. On failure the temp file
    /// is removed and `dest` is left as it was.
    pub(crate) fn commit(mut self) -> Result<()> {
        let Some(file) = self.file.take() else { return Err(Error::Input("AtomicFile committed twice".into())) };
        let synced = file.sync_all();
        drop(file);
        // Checked again: the target may have been replaced while the temp file was written.
        let renamed = synced
            .map_err(|e| Error::io(&self.tmp, e))
            .and_then(|()| check_output_target(&self.dest))
            .and_then(|()| std::fs::rename(&self.tmp, &self.dest).map_err(|e| Error::io(&self.dest, e)));
        if let Err(e) = renamed {
            let _ = std::fs::remove_file(&self.tmp);
            return Err(e);
        }
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
        self.file()?.write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.file()?.flush()
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
pub(crate) fn write_atomic(dest: impl AsRef<Path>, bytes: &[u8]) -> Result<()> {
    let dest = dest.as_ref();
    let mut f = AtomicFile::create(dest)?;
    f.write_all(bytes).map_err(|e| Error::io(dest, e))?;
    f.commit()
}

/// What [`try_lock`] got.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Lock {
    /// We hold it (until the file is closed, or the process dies).
    Held,
    /// Another open file holds it.
    Busy,
    /// Locks are not supported here (some network filesystems): carry on without.
    Unsupported,
}

/// An exclusive, non-blocking advisory lock on `f` (`flock` on Linux), released when `f` is closed
/// or the process dies (so a kill -9 never leaves a stale lock).
pub(crate) fn try_lock(f: &std::fs::File) -> Lock {
    match f.try_lock() {
        Ok(()) => Lock::Held,
        Err(std::fs::TryLockError::WouldBlock) => Lock::Busy,
        Err(std::fs::TryLockError::Error(_)) => Lock::Unsupported,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names in `dir`, sorted.
    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    }

    #[test]
    fn writes_go_to_a_hidden_temp_file_until_commit() {
        let d = tempfile::tempdir().unwrap();
        let dest = d.path().join("out.bin");
        let mut f = AtomicFile::create(&dest).unwrap();
        f.write_all(b"data").unwrap();
        f.flush().unwrap();
        assert_eq!(names(d.path()), vec![format!(".out.bin.tmp-{}", std::process::id())]);
        f.commit().unwrap();
        assert_eq!(names(d.path()), vec!["out.bin"]);
        assert_eq!(std::fs::read(&dest).unwrap(), b"data");
    }

    #[test]
    fn drop_without_commit_leaves_nothing() {
        let d = tempfile::tempdir().unwrap();
        let mut f = AtomicFile::create(d.path().join("out.bin")).unwrap();
        f.write_all(&[7u8; 100_000]).unwrap();
        assert_eq!(names(d.path()).len(), 1, "the temp file exists while writing");
        drop(f);
        assert!(names(d.path()).is_empty(), "{:?}", names(d.path()));
    }

    #[test]
    fn an_error_after_a_partial_write_keeps_the_old_file_and_no_temp() {
        let d = tempfile::tempdir().unwrap();
        let dest = d.path().join("out.bin");
        std::fs::write(&dest, b"old").unwrap();
        // A writer that fails part-way, as `quantize` does when a tensor cannot be read.
        let write = |second: Result<&[u8]>| -> Result<()> {
            let mut f = AtomicFile::create(&dest)?;
            f.write_all(b"new, first half").map_err(|e| Error::io(&dest, e))?;
            f.write_all(second?).map_err(|e| Error::io(&dest, e))?;
            f.commit()
        };
        assert!(write(Err(Error::Input("second half unavailable".into()))).is_err());
        assert_eq!(names(d.path()), vec!["out.bin"]);
        assert_eq!(std::fs::read(&dest).unwrap(), b"old");
    }

    #[test]
    fn commit_replaces_an_existing_file() {
        let d = tempfile::tempdir().unwrap();
        let dest = d.path().join("out.bin");
        std::fs::write(&dest, b"an older, longer content").unwrap();
        write_atomic(&dest, b"new").unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), b"new");
        assert_eq!(names(d.path()), vec!["out.bin"]);
    }

    #[test]
    fn a_failed_commit_removes_the_temp_file() {
        let d = tempfile::tempdir().unwrap();
        // A directory is refused at create; one that appears while the temp file is written must make
        // commit fail, leave the directory as it is and remove the temp file.
        let dest = d.path().join("taken");
        std::fs::create_dir(&dest).unwrap();
        assert!(write_atomic(&dest, b"new").unwrap_err().to_string().contains("taken"));
        std::fs::remove_dir(&dest).unwrap();
        let mut f = AtomicFile::create(&dest).unwrap();
        f.write_all(b"new").unwrap();
        std::fs::create_dir(&dest).unwrap();
        std::fs::write(dest.join("inside"), b"x").unwrap();
        let e = f.commit().unwrap_err();
        assert!(e.to_string().contains("taken"), "{e}");
        assert_eq!(names(d.path()), vec!["taken"]);
        assert_eq!(names(&dest), vec!["inside"]);
    }
}
