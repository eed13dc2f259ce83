//! The inotify event source (Linux): one watch per directory of the input tree (inotify is not
//! recursive: new directories get theirs as they appear), events read without blocking.
use std::collections::HashMap;
use std::io::ErrorKind;
use std::path::Path;

use inotify::{EventMask, Inotify, WatchDescriptor, WatchMask};

use super::detect::Event;
use crate::error::{Error, Result};

/// Open inotify instance and the directory of each watch.
pub(crate) struct Source {
    inotify: Inotify,
    dirs: HashMap<WatchDescriptor, String>,
    exclude: Option<std::path::PathBuf>,
    buf: Vec<u8>,
}

fn mask() -> WatchMask {
    WatchMask::CREATE | WatchMask::MODIFY | WatchMask::CLOSE_WRITE | WatchMask::MOVED_TO | WatchMask::MOVED_FROM | WatchMask::DELETE | WatchMask::ONLYDIR
}

impl Source {
    /// An inotify instance watching `root` (its subdirectories are added by the first listing).
    pub(crate) fn new(root: &Path, exclude: Option<&Path>) -> std::io::Result<Source> {
        let inotify = Inotify::init()?;
        let wd = inotify.watches().add(root, mask())?;
        let mut dirs = HashMap::new();
        dirs.insert(wd, String::new());
        Ok(Source { inotify, dirs, exclude: exclude.map(Path::to_path_buf), buf: vec![0; 64 * 1024] })
    }

    /// Watches the directory `rel` (relative to `root`); a failure (e.g. the watch limit) is
    /// logged, and the directory's files are then found by the settle checks of listings only.
    pub(crate) fn watch_dir(&mut self, root: &Path, rel: &str) {
        let path = if rel.is_empty() { root.to_path_buf() } else { root.join(rel) };
        if self.exclude.as_deref().is_some_and(|x| path.canonicalize().is_ok_and(|c| c == x)) {
            return;
        }
        match self.inotify.watches().add(&path, mask()) {
            Ok(wd) => {
                self.dirs.insert(wd, rel.to_string());
            }
            Err(e) => crate::annotate::log(&format!("watch: cannot watch {}: {e}", path.display())),
        }
    }

    /// The events pending now (none when nothing happened).
    pub(crate) fn read(&mut self) -> Result<Vec<Event>> {
        let mut out = Vec::new();
        loop {
            let events = match self.inotify.read_events(&mut self.buf) {
                Ok(ev) => ev,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(out),
                Err(e) => return Err(Error::Input(format!("reading inotify events: {e}"))),
            };
            let mut n = 0;
            for ev in events {
                n += 1;
                if ev.mask.contains(EventMask::Q_OVERFLOW) {
                    out.push(Event::Rescan);
                    continue;
                }
                if ev.mask.contains(EventMask::IGNORED) {
                    self.dirs.remove(&ev.wd);
                    continue;
                }
                let (Some(dir), Some(name)) = (self.dirs.get(&ev.wd), ev.name.and_then(|n| n.to_str())) else { continue };
                let rel = if dir.is_empty() { name.to_string() } else { format!("{dir}/{name}") };
                if ev.mask.contains(EventMask::ISDIR) {
                    if ev.mask.intersects(EventMask::CREATE | EventMask::MOVED_TO) && !name.starts_with('.') {
                        out.push(Event::Dir { rel, moved: ev.mask.contains(EventMask::MOVED_TO) });
                    }
                    continue;
                }
                out.push(if ev.mask.contains(EventMask::CLOSE_WRITE) {
                    Event::Closed(rel)
                } else if ev.mask.contains(EventMask::MOVED_TO) {
                    Event::MovedIn(rel)
                } else if ev.mask.intersects(EventMask::MOVED_FROM | EventMask::DELETE) {
                    Event::Gone(rel)
                } else if ev.mask.contains(EventMask::MODIFY) {
                    Event::Writing(rel)
                } else {
                    Event::Created(rel)
                });
            }
            if n == 0 {
                return Ok(out);
            }
        }
    }
}
