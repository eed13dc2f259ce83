//! The one place files are opened: inputs (regular files only, never blocking on a FIFO), files
//! rewritten in place (never through a link, never outside their root), atomic file writes (temp
//! file in the target's directory, fsync, rename, fsync the directory), whole-directory swaps that
//! never replace an input, and output-directory locks. Nothing leaves a temp file or folder behind.
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Component, Path, PathBuf};
use std::sync::Mutex;

use crate::error::{Error, Result};

/// The files and directories this process reads as inputs: identities (device, inode) and
/// canonical paths (a directory swap checks whether an input lies inside what it replaces).
static INPUTS: Mutex<Option<Inputs>> = Mutex::new(None);

#[derive(Default)]
struct Inputs {
    /// Each input's identity and the path it was registered by (an identity counts only while that
    /// path still names it: a deleted input's inode may be reused by a new file).
    ids: HashMap<FileId, PathBuf>,
    paths: Vec<PathBuf>,
}

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

/// What a path is, in words, for a refusal.
fn kind_of(meta: &std::fs::Metadata) -> &'static str {
    let t = meta.file_type();
    if t.is_symlink() {
        "a symbolic link"
    } else if t.is_dir() {
        "a directory"
    } else if t.is_file() {
        "a regular file"
    } else {
        "not a regular file (FIFO, socket or device)"
    }
}

/// Open flags that make an open of a FIFO return at once (O_NONBLOCK; no effect on regular files),
/// and with `no_follow` refuse a symbolic link as the last component (O_NOFOLLOW).
fn nonblocking(o: &mut OpenOptions, no_follow: bool) {
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        o.custom_flags(libc::O_NONBLOCK | if no_follow { libc::O_NOFOLLOW } else { 0 });
    }
    #[cfg(not(unix))]
    let _ = (o, no_follow);
}

/// Refuses an input that is not a regular file (a FIFO would block the open forever; a device or a
/// directory is never an input), before opening it.
pub(crate) fn check_input_file(path: &Path) -> Result<std::fs::Metadata> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if !meta.is_file() {
        return Err(Error::bad_file(path, format!("cannot be read as an input: it is {}", kind_of(&meta))));
    }
    Ok(meta)
}

/// Reads a small input file whole: a regular file of at most `limit` bytes.
pub(crate) fn read_input(path: &Path, limit: u64) -> Result<Vec<u8>> {
    let file = open_input(path)?;
    let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    if len > limit {
        return Err(Error::bad_file(path, format!("is {len} bytes, more than the {limit} bytes such a file may have")));
    }
    let mut bytes = Vec::with_capacity(len as usize);
    // A file that grows while it is read is cut at one byte over the limit, and refused.
    file.take(limit + 1).read_to_end(&mut bytes).map_err(|e| Error::io(path, e))?;
    if bytes.len() as u64 > limit {
        return Err(Error::bad_file(path, format!("grew past the {limit} bytes such a file may have while it was read")));
    }
    Ok(bytes)
}

/// [`read_input`] of a file that may be missing: `None` when it does not exist.
pub(crate) fn read_input_if_exists(path: &Path, limit: u64) -> Result<Option<Vec<u8>>> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        _ => read_input(path, limit).map(Some),
    }
}

/// Opens an input for reading: a regular file, checked before the open and again on the opened file
/// (so a swap in between is caught); the open itself never blocks (O_NONBLOCK), even on a FIFO put
/// in its place meanwhile. Every file a command reads is opened here.
pub(crate) fn open_input(path: &Path) -> Result<File> {
    check_input_file(path)?;
    let mut o = OpenOptions::new();
    o.read(true);
    nonblocking(&mut o, false);
    let file = o.open(path).map_err(|e| Error::io(path, e))?;
    let meta = file.metadata().map_err(|e| Error::io(path, e))?;
    if !meta.is_file() {
        return Err(Error::bad_file(path, format!("cannot be read as an input: it is {}", kind_of(&meta))));
    }
    Ok(file)
}

/// [`read_input`] as UTF-8 text.
pub(crate) fn read_input_text(path: &Path, limit: u64) -> Result<String> {
    String::from_utf8(read_input(path, limit)?).map_err(|_| Error::bad_file(path, "is not UTF-8 text"))
}

/// How [`open_in_place`] opens a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum InPlace {
    /// Read and append, created if missing (journals, logs, locks).
    Append,
    /// Read and write from empty, created if missing (scratch files).
    Rewrite,
}

/// Refuses `path` unless it lies under `root` through real directories: no `..`, and no component
/// between `root` and the file a symbolic link (which would lead the write elsewhere).
fn check_inside(root: &Path, path: &Path) -> Result<()> {
    let rel = path.strip_prefix(root).map_err(|_| Error::Input(format!("{}: refusing to write it: it is not inside {}", path.display(), root.display())))?;
    let mut at = root.to_path_buf();
    let parts: Vec<Component<'_>> = rel.components().collect();
    for (i, c) in parts.iter().enumerate() {
        let Component::Normal(name) = c else {
            return Err(Error::Input(format!("{}: refusing to write it: `..` or a root in its path under {}", path.display(), root.display())));
        };
        at.push(name);
        if i + 1 < parts.len() {
            match std::fs::symlink_metadata(&at) {
                Ok(m) if m.is_dir() => {}
                Ok(m) => return Err(Error::Input(format!("{}: refusing to write through it: it is {}, not a directory inside {}", at.display(), kind_of(&m), root.display()))),
                Err(e) => return Err(Error::io(&at, e)),
            }
        }
    }
    Ok(())
}

/// Creates directory `dir` under `root` (and `root` itself): every component below `root` must be a
/// real directory, never a symbolic link to one (so nothing written under `dir` lands elsewhere).
pub(crate) fn create_dir_in(root: &Path, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(root).map_err(|e| Error::io(root, e))?;
    let rel = dir.strip_prefix(root).map_err(|_| Error::Input(format!("{} is not inside {}", dir.display(), root.display())))?;
    let mut at = root.to_path_buf();
    for c in rel.components() {
        let Component::Normal(name) = c else {
            return Err(Error::Input(format!("{}: `..` or a root in its path under {}", dir.display(), root.display())));
        };
        at.push(name);
        match std::fs::symlink_metadata(&at) {
            Ok(m) if m.is_dir() => {}
            Ok(m) => return Err(Error::Input(format!("{}: refusing to use it as an output directory: it is {}", at.display(), kind_of(&m)))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => match std::fs::create_dir(&at) {
                Ok(()) => {}
                // Another process (a shard starting beside this one) made it first: a real directory will do.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && std::fs::symlink_metadata(&at).is_ok_and(|m| m.is_dir()) => {}
                Err(e) => return Err(Error::io(&at, e)),
            },
            Err(e) => return Err(Error::io(&at, e)),
        }
    }
    Ok(())
}

/// The one writer of files appended to or rewritten in place (journals, logs, spill files, locks):
/// `path` must lie under `root` through real directories ([`create_dir_in`]), and be absent or a
/// regular file that is no input of this run — never a symbolic link (refused by the open itself,
/// O_NOFOLLOW), a FIFO (O_NONBLOCK: the open cannot block), a device or a directory.
pub(crate) fn open_in_place(root: &Path, path: &Path, mode: InPlace) -> Result<File> {
    check_inside(root, path)?;
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.is_file() {
            return Err(Error::Input(format!("{}: refusing to write it in place: it is {}", path.display(), kind_of(&meta))));
        }
    }
    check_output_target(path)?;
    let mut o = OpenOptions::new();
    o.read(true).create(true);
    match mode {
        InPlace::Append => o.append(true),
        InPlace::Rewrite => o.write(true).truncate(true),
    };
    nonblocking(&mut o, true);
    let file = o.open(path).map_err(|e| Error::io(path, e))?;
    let meta = file.metadata().map_err(|e| Error::io(path, e))?;
    if !meta.is_file() {
        return Err(Error::Input(format!("{}: refusing to write it in place: it is {}", path.display(), kind_of(&meta))));
    }
    Ok(file)
}

/// Records `path` as an input of this run: no [`AtomicFile`] will replace it (whatever path names it),
/// and no [`DirSwap`] will replace a directory holding it.
pub fn register_input(path: &Path) {
    let id = file_id(path);
    let canon = path.canonicalize().ok();
    if let Ok(mut g) = INPUTS.lock() {
        let inputs = g.get_or_insert_with(Inputs::default);
        if let Some(id) = id {
            inputs.ids.insert(id, path.to_path_buf());
        }
        inputs.paths.extend(canon);
    }
}

fn is_registered_input(path: &Path) -> bool {
    let Some(id) = file_id(path) else { return false };
    let registered = INPUTS.lock().ok().and_then(|g| g.as_ref()?.ids.get(&id).cloned());
    registered.is_some_and(|p| file_id(&p).as_ref() == Some(&id))
}

/// A registered input at or under `dir`, if any.
fn input_inside(dir: &Path) -> Option<PathBuf> {
    let dir = dir.canonicalize().ok()?;
    let g = INPUTS.lock().ok()?;
    g.as_ref()?.paths.iter().find(|p| p.starts_with(&dir)).cloned()
}

/// Refuses `dest` when it exists and is not a regular file (a FIFO, a device, a directory, or a
/// symlink to one), or when it is an input of this run.
pub(crate) fn check_output_target(dest: &Path) -> Result<()> {
    match std::fs::metadata(dest) {
        Ok(m) if !m.is_file() => Err(Error::Input(format!("{}: refusing to write over it: it is {}", dest.display(), kind_of(&m)))),
        Ok(_) if is_registered_input(dest) => {
            Err(Error::Input(format!("{}: refusing to write over it: it is an input of this run", dest.display())))
        }
        _ => Ok(()),
    }
}

/// Refuses to replace directory `dest` whole when it exists as anything but a real directory (a
/// file, a symbolic link, a FIFO), or when it is or holds an input of this run.
pub(crate) fn check_dir_target(dest: &Path) -> Result<()> {
    match std::fs::symlink_metadata(dest) {
        Ok(m) if !m.is_dir() => {
            return Err(Error::Input(format!("{}: refusing to replace it with a directory: it is {}", dest.display(), kind_of(&m))));
        }
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io(dest, e)),
    }
    if let Some(input) = input_inside(dest) {
        let what = match dest.canonicalize() {
            Ok(d) if d == input => "it is an input of this run".to_string(),
            _ => format!("it holds {}, an input of this run", input.display()),
        };
        return Err(Error::Input(format!("{}: refusing to replace it: {what}", dest.display())));
    }
    Ok(())
}

/// Removes whatever `p` is (a directory tree, a file, a link — never followed); absent is fine.
fn remove_any(p: &Path) -> Result<()> {
    match std::fs::symlink_metadata(p) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(p).map_err(|e| Error::io(p, e)),
        Ok(_) => std::fs::remove_file(p).map_err(|e| Error::io(p, e)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io(p, e)),
    }
}

/// The hidden siblings of a swapped directory: `.NAME.tmp` (being built) and `.NAME.old` (being replaced).
fn swap_siblings(dir: &Path) -> Result<(PathBuf, PathBuf)> {
    let name = dir.file_name().and_then(|n| n.to_str()).ok_or_else(|| Error::bad_file(dir, "not a directory name"))?;
    let parent = dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    Ok((parent.join(format!(".{name}.tmp")), parent.join(format!(".{name}.old"))))
}

/// A directory built beside `dest` (`.NAME.tmp`) that replaces it whole on [`DirSwap::commit`], so
/// `dest` is at every moment the previous complete directory or the new one. The one way a command
/// replaces a directory: it refuses a `dest` that is no real directory or holds an input
/// ([`check_dir_target`]), and an uncommitted swap (an error, a full disk) removes its folder.
pub(crate) struct DirSwap {
    tmp: PathBuf,
    old: PathBuf,
    dest: PathBuf,
    done: bool,
}

impl DirSwap {
    /// Starts building a replacement for `dest` (a stale `.NAME.tmp` is removed first).
    pub(crate) fn create(dest: &Path) -> Result<Self> {
        check_dir_target(dest)?;
        let (tmp, old) = swap_siblings(dest)?;
        remove_any(&tmp)?;
        std::fs::create_dir(&tmp).map_err(|e| Error::io(&tmp, e))?;
        Ok(DirSwap { tmp, old, dest: dest.to_path_buf(), done: false })
    }

    /// The folder to fill.
    pub(crate) fn path(&self) -> &Path {
        &self.tmp
    }

    /// Swaps the new folder in (`dest` → `.NAME.old`, `.NAME.tmp` → `dest`, `.NAME.old` removed).
    pub(crate) fn commit(mut self) -> Result<()> {
        check_dir_target(&self.dest)?;
        remove_any(&self.old)?;
        let had = self.dest.exists();
        if had {
            std::fs::rename(&self.dest, &self.old).map_err(|e| Error::io(&self.dest, e))?;
        }
        if let Err(e) = std::fs::rename(&self.tmp, &self.dest) {
            if had {
                let _ = std::fs::rename(&self.old, &self.dest);
            }
            return Err(Error::io(&self.dest, e));
        }
        self.done = true;
        remove_any(&self.old)?;
        if let Some(parent) = self.dest.parent().filter(|p| !p.as_os_str().is_empty()) {
            if let Ok(d) = File::open(parent) {
                let _ = d.sync_all();
            }
        }
        Ok(())
    }
}

impl Drop for DirSwap {
    fn drop(&mut self) {
        if !self.done {
            let _ = remove_any(&self.tmp);
        }
    }
}

/// Finishes a [`DirSwap`] that a crash interrupted: `dest` missing but its `.NAME.old` a directory →
/// put back; a leftover `.NAME.tmp` removed.
pub(crate) fn recover_dir_swap(dest: &Path) -> Result<()> {
    let (tmp, old) = swap_siblings(dest)?;
    let old_is_dir = std::fs::symlink_metadata(&old).is_ok_and(|m| m.is_dir());
    if std::fs::symlink_metadata(dest).is_err() && old_is_dir {
        std::fs::rename(&old, dest).map_err(|e| Error::io(dest, e))?;
    }
    remove_any(&tmp)
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

/// How long a busy lock is tried again before it counts as held by another run: a process that
/// another thread of ours forks holds a copy of a file we just closed (and its lock) until it execs.
const LOCK_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

/// An exclusive, non-blocking advisory lock on `f` (`flock` on Linux), released when `f` is closed
/// or the process dies (so a kill -9 never leaves a stale lock); busy for [`LOCK_GRACE`] before
/// [`Lock::Busy`].
pub(crate) fn try_lock(f: &File) -> Lock {
    let deadline = std::time::Instant::now() + LOCK_GRACE;
    loop {
        match f.try_lock() {
            Ok(()) => return Lock::Held,
            Err(std::fs::TryLockError::WouldBlock) if std::time::Instant::now() < deadline => std::thread::sleep(std::time::Duration::from_millis(20)),
            Err(std::fs::TryLockError::WouldBlock) => return Lock::Busy,
            Err(std::fs::TryLockError::Error(_)) => return Lock::Unsupported,
        }
    }
}

/// The lock file of an output directory a command owns whole.
pub const DIR_LOCK: &str = ".edgerun.lock";

/// Held while a command owns an output directory (released on drop, or when the process dies).
#[derive(Debug)]
pub(crate) struct DirLock {
    _file: File,
}

/// Locks output directory `dir` (created if missing) for `command`, through `dir/.edgerun.lock`; a
/// second run on the same directory is refused, naming it.
pub(crate) fn lock_dir(dir: &Path, command: &str) -> Result<DirLock> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let path = dir.join(DIR_LOCK);
    let file = open_in_place(dir, &path, InPlace::Append)?;
    if try_lock(&file) == Lock::Busy {
        return Err(Error::Config(format!(
            "{}: locked: another `edgerun {command}` is writing this output directory; wait for it to finish or use another",
            dir.display()
        )));
    }
    Ok(DirLock { _file: file })
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

    #[test]
    fn a_dir_swap_that_fails_leaves_no_folder_and_the_old_directory() {
        // A write that fails part-way (a full disk) drops the swap: `.last.tmp` goes, `last` stays.
        let d = tempfile::tempdir().unwrap();
        let dest = d.path().join("last");
        std::fs::create_dir(&dest).unwrap();
        std::fs::write(dest.join("model.safetensors"), b"old").unwrap();
        let swap = DirSwap::create(&dest).unwrap();
        std::fs::write(swap.path().join("model.safetensors"), b"half").unwrap();
        drop(swap);
        assert_eq!(names(d.path()), vec!["last"]);
        assert_eq!(std::fs::read(dest.join("model.safetensors")).unwrap(), b"old");
        let swap = DirSwap::create(&dest).unwrap();
        std::fs::write(swap.path().join("model.safetensors"), b"new").unwrap();
        swap.commit().unwrap();
        assert_eq!(names(d.path()), vec!["last"]);
        assert_eq!(std::fs::read(dest.join("model.safetensors")).unwrap(), b"new");
    }

    #[test]
    fn a_dir_swap_refuses_a_file_a_link_and_an_input() {
        let d = tempfile::tempdir().unwrap();
        let file = d.path().join("last");
        std::fs::write(&file, b"x").unwrap();
        let e = DirSwap::create(&file).err().unwrap().to_string();
        assert!(e.contains("last") && e.contains("regular file"), "{e}");
        let model = d.path().join("best");
        std::fs::create_dir(&model).unwrap();
        std::fs::write(model.join("model.safetensors"), b"m").unwrap();
        register_input(&model.join("model.safetensors"));
        let e = DirSwap::create(&model).err().unwrap().to_string();
        assert!(e.contains("input of this run"), "{e}");
        #[cfg(unix)]
        {
            std::os::unix::fs::symlink(&model, d.path().join("linked")).unwrap();
            let e = DirSwap::create(&d.path().join("linked")).err().unwrap().to_string();
            assert!(e.contains("symbolic link"), "{e}");
        }
        assert_eq!(names(d.path()).iter().filter(|n| n.starts_with('.')).count(), 0, "{:?}", names(d.path()));
    }

    #[cfg(unix)]
    #[test]
    fn in_place_writes_refuse_links_fifos_and_leaving_the_root() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("out");
        std::fs::create_dir(&root).unwrap();
        let outside = d.path().join("precious");
        std::fs::write(&outside, b"keep").unwrap();
        std::os::unix::fs::symlink(&outside, root.join("log.jsonl")).unwrap();
        std::os::unix::fs::symlink(d.path(), root.join("state")).unwrap();
        assert!(std::process::Command::new("mkfifo").arg(root.join("fifo")).status().unwrap().success());
        for (path, why) in [
            (root.join("log.jsonl"), "symbolic link"),
            (root.join("state/x"), "symbolic link"),
            (root.join("fifo"), "FIFO"),
            (root.join("../precious"), "`..`"),
            (outside.clone(), "not inside"),
        ] {
            for mode in [InPlace::Append, InPlace::Rewrite] {
                let e = open_in_place(&root, &path, mode).err().unwrap().to_string();
                assert!(e.contains(why), "{}: {e}", path.display());
            }
        }
        assert!(create_dir_in(&root, &root.join("state")).is_err());
        assert_eq!(std::fs::read(&outside).unwrap(), b"keep");
        let mut f = open_in_place(&root, &root.join("ok.jsonl"), InPlace::Append).unwrap();
        f.write_all(b"line\n").unwrap();
        create_dir_in(&root, &root.join("a/b")).unwrap();
        assert!(root.join("a/b").is_dir());
    }

    #[cfg(unix)]
    #[test]
    fn inputs_refuse_fifos_without_blocking() {
        let d = tempfile::tempdir().unwrap();
        let fifo = d.path().join("x.safetensors");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        let t = std::time::Instant::now();
        assert!(open_input(&fifo).err().unwrap().to_string().contains("FIFO"));
        assert!(read_input(&fifo, 10).is_err());
        assert!(t.elapsed().as_secs() < 5);
    }

    #[test]
    fn a_second_lock_on_an_output_directory_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let held = lock_dir(d.path(), "finetune").unwrap();
        let e = lock_dir(d.path(), "finetune").unwrap_err().to_string();
        assert!(e.contains("locked") && e.contains("finetune"), "{e}");
        drop(held);
        lock_dir(d.path(), "finetune").unwrap();
    }
}
