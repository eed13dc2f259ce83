//! Noticing complete frames in the input tree: inotify on Linux ([`super::inotify`]), a polling
//! re-listing elsewhere and on network filesystems. A file is complete when
//! - its writer closed it (inotify, unless `close_is_complete = false`);
//! - it was renamed into place (inotify `MOVED_TO`, or a directory moved in whole): written under a
//!   temporary name the listing ignores (hidden, or without an image extension) and then renamed;
//! - or its size and mtime stayed the same for `settle_s` (polling; under inotify, files found by a
//!   listing rather than seen being written, and files created by a link rather than written).
//!   An empty file never settles (a writer that created it has not written yet).
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::annotate::listing::mtime_ns;
use crate::error::Result;
use crate::walk::{has_extension, walk_tree};

/// A file that became complete.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Ready {
    /// Path relative to the input root, `/`-separated.
    pub rel: String,
    /// Size in bytes.
    pub size: u64,
    /// Modification time (ns since the epoch).
    pub mtime_ns: i64,
}

/// A file seen but not yet complete.
#[derive(Debug, Clone)]
struct Candidate {
    size: u64,
    mtime_ns: i64,
    /// When (size, mtime) was last seen changing.
    since: Instant,
    /// A writer opened it (inotify): its close, not the settle time, makes it complete.
    awaiting_close: bool,
}

/// How the detector learns of files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BackendKind {
    /// inotify events (Linux).
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    Inotify,
    /// Re-listing the tree every `poll_interval_s`.
    Poll,
}

/// The detector's settings.
#[derive(Debug, Clone)]
pub(crate) struct DetectOptions {
    /// Canonical input root.
    pub root: PathBuf,
    /// Canonical output directory when inside the root (never listed).
    pub exclude: Option<PathBuf>,
    /// Accepted extensions, lower-case, without the dot.
    pub extensions: Vec<String>,
    /// Settle time.
    pub settle: Duration,
    /// Poll / settle-check interval.
    pub poll_every: Duration,
    /// Whether a close after writing completes a file.
    pub close_is_complete: bool,
}

/// What an event source reports about a path relative to the root.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
pub(crate) enum Event {
    /// A file was created or written to (a writer has it open).
    Writing(String),
    /// A file was created without being opened for writing (a link).
    Created(String),
    /// A writer closed the file.
    Closed(String),
    /// A file was renamed into place.
    MovedIn(String),
    /// A file went away.
    Gone(String),
    /// A directory appeared (`moved` = renamed in whole): list it.
    Dir { rel: String, moved: bool },
    /// Events were lost: list the whole tree.
    Rescan,
}

/// Finds complete frames.
pub(crate) struct Detector {
    o: DetectOptions,
    kind: BackendKind,
    #[cfg(target_os = "linux")]
    inotify: Option<super::inotify::Source>,
    candidates: HashMap<String, Candidate>,
    /// Files already reported, with the (size, mtime) reported.
    reported: HashMap<String, (u64, i64)>,
    last_scan: Option<Instant>,
    last_check: Instant,
    /// Files a listing could not include (reported once each).
    pub problems: Vec<String>,
    seen_problems: std::collections::HashSet<String>,
}

impl Detector {
    /// A detector on `o.root`, with inotify when `want` allows and it works (else polling; the
    /// reason is returned as a note).
    pub(crate) fn new(o: DetectOptions, want: &str) -> (Detector, Option<String>) {
        let d = Detector {
            kind: BackendKind::Poll,
            #[cfg(target_os = "linux")]
            inotify: None,
            candidates: HashMap::new(),
            reported: HashMap::new(),
            last_scan: None,
            last_check: Instant::now(),
            problems: Vec::new(),
            seen_problems: Default::default(),
            o,
        };
        if want == "poll" {
            return (d, None);
        }
        d.start_inotify(want)
    }

    #[cfg(target_os = "linux")]
    fn start_inotify(mut self, want: &str) -> (Detector, Option<String>) {
        if want == "auto" {
            if let Some(fs) = super::mounts::network_fs(&self.o.root) {
                let why = format!("{} is on a network filesystem ({fs}): polling every {:?}", self.o.root.display(), self.o.poll_every);
                return (self, Some(why));
            }
        }
        match super::inotify::Source::new(&self.o.root, self.o.exclude.as_deref()) {
            Ok(src) => {
                self.inotify = Some(src);
                self.kind = BackendKind::Inotify;
                (self, None)
            }
            Err(e) => {
                let why = format!("inotify is not available ({e}): polling every {:?}", self.o.poll_every);
                (self, Some(why))
            }
        }
    }

    #[cfg(not(target_os = "linux"))]
    fn start_inotify(self, _want: &str) -> (Detector, Option<String>) {
        let why = format!("no inotify on this system: polling every {:?}", self.o.poll_every);
        (self, Some(why))
    }

    /// The backend in use.
    pub(crate) fn kind(&self) -> BackendKind {
        self.kind
    }

    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    fn accepted(&self, rel: &str) -> bool {
        let name = rel.rsplit('/').next().unwrap_or(rel);
        let exts: Vec<&str> = self.o.extensions.iter().map(String::as_str).collect();
        !name.starts_with('.') && !rel.split('/').any(|c| c.starts_with('.')) && has_extension(name, &exts)
    }

    fn stat(&self, rel: &str) -> Option<(u64, i64)> {
        let m = std::fs::metadata(self.o.root.join(rel)).ok().filter(|m| m.is_file())?;
        Some((m.len(), mtime_ns(&m)))
    }

    /// A file is ready: reported unless this very version was.
    fn ready(&mut self, rel: &str, out: &mut Vec<Ready>) {
        self.candidates.remove(rel);
        let Some((size, mtime_ns)) = self.stat(rel) else { return };
        if self.reported.get(rel) == Some(&(size, mtime_ns)) {
            return;
        }
        self.reported.insert(rel.to_string(), (size, mtime_ns));
        out.push(Ready { rel: rel.to_string(), size, mtime_ns });
    }

    /// A file to watch until it settles (or, `awaiting_close`, until its writer closes it).
    fn candidate(&mut self, rel: &str, awaiting_close: bool) {
        let Some((size, mtime_ns)) = self.stat(rel) else { return };
        if self.reported.get(rel) == Some(&(size, mtime_ns)) && !awaiting_close {
            return;
        }
        let now = Instant::now();
        let c = self.candidates.entry(rel.to_string()).or_insert(Candidate { size, mtime_ns, since: now, awaiting_close });
        c.awaiting_close |= awaiting_close;
        if (c.size, c.mtime_ns) != (size, mtime_ns) {
            *c = Candidate { size, mtime_ns, since: now, awaiting_close: c.awaiting_close };
        }
    }

    /// Lists `dir` (relative, `""` = the root): each accepted file becomes a candidate, or ready at
    /// once when `moved_in` (renamed into place with its directory).
    fn scan(&mut self, dir: &str, moved_in: bool, out: &mut Vec<Ready>) -> Result<()> {
        let base = if dir.is_empty() { self.o.root.clone() } else { self.o.root.join(dir) };
        let exts: Vec<&str> = self.o.extensions.iter().map(String::as_str).collect();
        let w = match walk_tree(&base, &|n| has_extension(n, &exts), self.o.exclude.as_deref()) {
            Ok(w) => w,
            Err(e) if !dir.is_empty() => {
                // A directory that vanished between its event and the listing.
                crate::annotate::log(&format!("watch: cannot list {}: {e}", base.display()));
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        for (p, why) in &w.problems {
            let line = format!("{}: {why}", p.display());
            if self.seen_problems.insert(line.clone()) {
                self.problems.push(line);
            }
        }
        #[cfg(target_os = "linux")]
        if let Some(src) = &mut self.inotify {
            for d in &w.dirs {
                let rel = join(dir, &d.rel);
                src.watch_dir(&self.o.root, &rel);
            }
        }
        for f in &w.files {
            let rel = join(dir, &f.rel);
            if moved_in {
                self.ready(&rel, out);
            } else {
                self.candidate(&rel, false);
            }
        }
        Ok(())
    }

    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    fn handle(&mut self, e: Event, out: &mut Vec<Ready>) -> Result<()> {
        match e {
            Event::Dir { rel, moved } => self.scan(&rel, moved, out)?,
            Event::Rescan => self.scan("", false, out)?,
            Event::Gone(rel) => {
                self.candidates.remove(&rel);
            }
            Event::Writing(rel) if self.accepted(&rel) => self.candidate(&rel, true),
            Event::Created(rel) if self.accepted(&rel) => self.candidate(&rel, false),
            Event::Closed(rel) if self.accepted(&rel) => {
                if self.o.close_is_complete {
                    self.ready(&rel, out)
                } else {
                    self.candidate(&rel, false);
                    if let Some(c) = self.candidates.get_mut(&rel) {
                        c.awaiting_close = false;
                    }
                }
            }
            Event::MovedIn(rel) if self.accepted(&rel) => self.ready(&rel, out),
            _ => {}
        }
        Ok(())
    }

    /// Checks the candidates: ready when unchanged for the settle time (those awaiting a close only
    /// when the settle time is not to be trusted, `close_is_complete = false`).
    fn check_settled(&mut self, out: &mut Vec<Ready>) {
        let now = Instant::now();
        let rels: Vec<String> = self.candidates.keys().cloned().collect();
        for rel in rels {
            let Some((size, mtime_ns)) = self.stat(&rel) else {
                self.candidates.remove(&rel);
                continue;
            };
            let Some(c) = self.candidates.get_mut(&rel) else { continue };
            if (c.size, c.mtime_ns) != (size, mtime_ns) {
                *c = Candidate { size, mtime_ns, since: now, awaiting_close: c.awaiting_close };
            } else if size > 0 && now.duration_since(c.since) >= self.o.settle && !(c.awaiting_close && self.o.close_is_complete) {
                self.ready(&rel, out);
            }
        }
    }

    /// Waits up to `timeout` for complete files; returns as soon as some are found (or at once
    /// with the first listing).
    pub(crate) fn wait(&mut self, timeout: Duration) -> Result<Vec<Ready>> {
        let deadline = Instant::now() + timeout;
        let mut out = Vec::new();
        loop {
            if self.last_scan.is_none() || (self.kind == BackendKind::Poll && self.last_scan.is_some_and(|t| t.elapsed() >= self.o.poll_every)) {
                self.scan("", false, &mut out)?;
                self.last_scan = Some(Instant::now());
            }
            #[cfg(target_os = "linux")]
            if let Some(src) = &mut self.inotify {
                let events = src.read()?;
                for e in events {
                    self.handle(e, &mut out)?;
                }
            }
            if self.last_check.elapsed() >= self.o.poll_every.min(self.o.settle).max(Duration::from_millis(20)) {
                self.check_settled(&mut out);
                self.last_check = Instant::now();
            }
            let now = Instant::now();
            if !out.is_empty() || now >= deadline {
                return Ok(out);
            }
            std::thread::sleep((deadline - now).min(Duration::from_millis(25)));
        }
    }

    /// Whether some file is still being written or settling.
    pub(crate) fn settling(&self) -> usize {
        self.candidates.len()
    }
}

/// `dir/rel` with `""` as the root.
fn join(dir: &str, rel: &str) -> String {
    match (dir.is_empty(), rel.is_empty()) {
        (true, _) => rel.to_string(),
        (false, true) => dir.to_string(),
        (false, false) => format!("{dir}/{rel}"),
    }
}

/// The accepted extensions, normalised.
pub(crate) fn normalise_extensions(exts: &[String]) -> Vec<String> {
    exts.iter().map(|e| e.trim_start_matches('.').to_ascii_lowercase()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn opts(root: &Path, settle_ms: u64) -> DetectOptions {
        DetectOptions {
            root: root.canonicalize().unwrap(),
            exclude: None,
            extensions: vec!["png".into(), "jpg".into()],
            settle: Duration::from_millis(settle_ms),
            poll_every: Duration::from_millis(20),
            close_is_complete: true,
        }
    }

    #[test]
    fn polling_waits_for_a_file_to_settle_and_reports_each_version_once() {
        let t = tempfile::tempdir().unwrap();
        let (mut d, _) = Detector::new(opts(t.path(), 300), "poll");
        assert_eq!(d.kind(), BackendKind::Poll);
        std::fs::write(t.path().join("a.png"), b"12").unwrap();
        std::fs::write(t.path().join(".b.png.part"), b"12").unwrap();
        std::fs::write(t.path().join("c.txt"), b"12").unwrap();
        assert!(d.wait(Duration::from_millis(100)).unwrap().is_empty(), "not settled yet");
        let got = d.wait(Duration::from_secs(5)).unwrap();
        assert_eq!(got.iter().map(|r| r.rel.as_str()).collect::<Vec<_>>(), ["a.png"]);
        assert!(d.wait(Duration::from_millis(600)).unwrap().is_empty(), "reported once");
        std::fs::rename(t.path().join(".b.png.part"), t.path().join("sub_b.png")).unwrap();
        let got = d.wait(Duration::from_secs(5)).unwrap();
        assert_eq!(got[0].rel, "sub_b.png");
    }

    #[test]
    fn names_under_hidden_directories_or_without_an_image_extension_are_not_frames() {
        let t = tempfile::tempdir().unwrap();
        let (d, _) = Detector::new(opts(t.path(), 10), "poll");
        assert!(d.accepted("a/b.PNG"));
        assert!(!d.accepted("a/.b.png"));
        assert!(!d.accepted(".tmp/b.png"));
        assert!(!d.accepted("a/b.png.part"));
        assert_eq!((join("", "a.png"), join("d", ""), join("d", "a.png")), ("a.png".to_string(), "d".to_string(), "d/a.png".to_string()));
    }
}
