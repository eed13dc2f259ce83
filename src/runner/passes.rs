//! Passes that a kill could end. The kernel's out-of-memory kill cannot be caught, so before each
//! forward pass the runner records it — its size and its items — in a small append-only log, fsynced,
//! and records its end after it. A later run that finds a pass begun and never ended asks the kernel
//! whether it killed something for memory since ([`crate::memory::oom`]). If it did, or nobody can
//! tell, that run and the later ones take at most half that pass's size per pass (down to 1; the
//! smallest such pass counts, so reruns converge), and an item that was
//! alone in such a pass twice is handed back to be recorded as failed ([`KILLED_FOR_MEMORY`]) so
//! the run goes on. A pass ended otherwise (a plain `kill -9`, a crash: the kernel's count did not
//! move) changes nothing.
//!
//! One JSON object a line: `begin` (units, items, the kernel's count), `end`, `killed` (a pass that a
//! later run found unended, and its verdict), `failed` (an item given up, for logs that keep them).
//! Opening a log compacts it, by an atomic rewrite, to the lines that still matter; it is locked
//! while a run appends to it.
//!
//! Test seam: with `EDGERUN_INJECT_KILL_ABOVE=N`, a pass over more than N units ends the process
//! right after its `begin` is durable (exit status 137, as a kill leaves it), counting a kill for
//! memory in `EDGERUN_OOM_COUNT_FILE` when that is set.
use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::fsutil::{try_lock, write_atomic, Lock};
use crate::memory::oom::{count_injected_kill, Mark, Verdict};

/// The reason an item killed for memory twice is recorded with.
pub const KILLED_FOR_MEMORY: &str =
    "killed for memory: the kernel ended the run twice while this item was alone in a forward pass (out of memory even at batch 1)";

/// The environment variable of the kill hook.
pub(crate) const INJECT_KILL_ENV: &str = "EDGERUN_INJECT_KILL_ABOVE";

/// Largest log read back (it is compacted at every open, so a few KiB in practice).
const MAX_LOG: u64 = 16 << 20;

/// Items named in a `begin` line (a pass never holds more than `MAX_BATCH`).
const MAX_ITEMS: usize = 1024;

/// One line of the log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "lowercase")]
enum Line {
    /// A pass about to run.
    Begin {
        /// Units (images, tiles) in the pass.
        units: usize,
        /// The items they belong to.
        items: Vec<String>,
        /// The kernel's kill count when it began.
        #[serde(default)]
        mark: Mark,
    },
    /// The pass before it ended (well or with an error, but not killed).
    End,
    /// A pass an earlier run found begun and never ended.
    Killed {
        /// Units in the pass.
        units: usize,
        /// Its items.
        items: Vec<String>,
        /// What ended it.
        verdict: Verdict,
    },
    /// An item given up ([`KILLED_FOR_MEMORY`]).
    Failed {
        /// The item.
        item: String,
        /// Why.
        reason: String,
    },
}

/// What opening a log found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Recovery {
    /// At most this many units per pass in this run: half the pass that was killed for memory.
    pub ceiling: Option<usize>,
    /// Items that were alone in a pass killed for memory twice: record them as failed, then
    /// [`PassLog::settle`] them.
    pub to_fail: Vec<String>,
    /// Items given up by earlier runs (kept in logs settled with a reason).
    pub failed: Vec<(String, String)>,
    /// What was found, one line each, for the run's log.
    pub notes: Vec<String>,
}

/// A pass log open for appending (locked).
#[derive(Debug)]
pub struct PassLog {
    path: PathBuf,
    file: File,
    /// The compacted lines (what a rewrite keeps).
    kept: Vec<Line>,
    /// A `begin` without its `end` yet.
    in_pass: bool,
}

fn inject_kill_above() -> Option<usize> {
    static LIMIT: OnceLock<Option<usize>> = OnceLock::new();
    *LIMIT.get_or_init(|| std::env::var(INJECT_KILL_ENV).ok().and_then(|v| v.trim().parse().ok()))
}

/// Opens `path` for appending and locks it.
fn open_locked(path: &Path) -> Result<File> {
    let file = crate::fsutil::open_in_place(path.parent().unwrap_or(Path::new("")), path, crate::fsutil::InPlace::Append)?;
    if try_lock(&file) == Lock::Busy {
        return Err(Error::Config(format!("{} is locked: another edgerun run is using this output", path.display())));
    }
    Ok(file)
}

/// Reads the log's lines: the ones that parse, and how many did not.
fn read_lines(path: &Path, notes: &mut Vec<String>) -> Result<Vec<Line>> {
    let len = match std::fs::metadata(path) {
        Ok(m) => m.len(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io(path, e)),
    };
    if len > MAX_LOG {
        notes.push(format!("{}: {len} bytes, more than a pass log holds: started afresh", path.display()));
        return Ok(Vec::new());
    }
    let bytes = crate::fsutil::read_input(path, MAX_LOG)?;
    let mut bad = 0;
    let lines: Vec<Line> = bytes
        .split(|&b| b == b'\n')
        .filter(|l| !l.iter().all(u8::is_ascii_whitespace))
        .filter_map(|l| serde_json::from_slice::<Line>(l).map_err(|_| bad += 1).ok())
        .collect();
    if bad > 0 {
        notes.push(format!("{}: ignored {bad} unreadable lines (a torn last line is what a kill mid-write leaves)", path.display()));
    }
    Ok(lines)
}

/// How a pass's items read in a message: the first few names.
fn names(items: &[String]) -> String {
    let mut s = items.iter().take(3).map(String::as_str).collect::<Vec<_>>().join(", ");
    if items.len() > 3 {
        s.push_str(&format!(" and {} more", items.len() - 3));
    }
    s
}

/// A killed pass's alone item, when it was one item alone and killed for memory (or unknown).
fn alone(line: &Line) -> Option<&str> {
    match line {
        Line::Killed { units: 1, items, verdict, .. } if items.len() == 1 && *verdict != Verdict::Interrupted => Some(items[0].as_str()),
        _ => None,
    }
}

impl PassLog {
    /// Opens (creating) and locks the log at `path`, judges a pass left unended, compacts the log
    /// and says what this run must do ([`Recovery`]).
    pub fn open(path: &Path) -> Result<(PassLog, Recovery)> {
        let file = open_locked(path)?;
        let mut rec = Recovery::default();
        let lines = read_lines(path, &mut rec.notes)?;
        let now = Mark::now();
        // Walk the log: kills (old and newly found) and what was given up.
        let mut kills: Vec<Line> = Vec::new();
        let mut failed: Vec<(String, String)> = Vec::new();
        let mut pending: Option<(usize, Vec<String>, Mark)> = None;
        let judge = |units: usize, items: Vec<String>, mark: Mark, notes: &mut Vec<String>| {
            let verdict = mark.verdict(&now);
            let why = match verdict {
                Verdict::Memory => "the kernel has killed for memory since it began",
                Verdict::Unknown => "whether for memory cannot be told (another boot, or no kill count): taken as memory",
                Verdict::Interrupted => "not for memory (the kernel's kill count did not change): nothing changes",
            };
            notes.push(format!("an earlier run was stopped during a pass of {units} ({}): {why}", names(&items)));
            Line::Killed { units, items, verdict }
        };
        for line in lines {
            match line {
                Line::Begin { units, items, mark } => {
                    if let Some((u, i, m)) = pending.take() {
                        kills.push(judge(u, i, m, &mut rec.notes));
                    }
                    pending = Some((units, items, mark));
                }
                Line::End => {
                    // Items that came through a pass since are no longer counted as killed alone.
                    if let Some((_, items, _)) = pending.take() {
                        kills.retain(|k| alone(k).is_none_or(|a| !items.iter().any(|i| i == a)));
                    }
                }
                k @ Line::Killed { .. } => kills.push(k),
                Line::Failed { item, reason } => failed.push((item, reason)),
            }
        }
        if let Some((u, i, m)) = pending.take() {
            kills.push(judge(u, i, m, &mut rec.notes));
        }
        // The smallest pass killed for memory sets the ceiling, for this run and the next ones.
        let smallest = kills
            .iter()
            .enumerate()
            .filter_map(|(i, k)| match k {
                Line::Killed { units, verdict, .. } if *verdict != Verdict::Interrupted => Some((*units, i)),
                _ => None,
            })
            .min();
        if let Some((units, _)) = smallest {
            let c = (units / 2).max(1);
            rec.ceiling = Some(c);
            rec.notes.push(format!("at most {c} per pass (half the smallest pass killed for memory; remove {} to plan afresh)", path.display()));
        }
        let mut counts: HashMap<&str, usize> = HashMap::new();
        for a in kills.iter().filter_map(alone) {
            *counts.entry(a).or_default() += 1;
        }
        let mut to_fail: Vec<String> = counts.into_iter().filter(|(a, n)| *n >= 2 && !failed.iter().any(|(f, _)| f == a)).map(|(a, _)| a.to_string()).collect();
        to_fail.sort();
        // Keep: the alone kills, the smallest kill, what was given up.
        let kept: Vec<Line> = kills
            .iter()
            .enumerate()
            .filter(|(i, k)| alone(k).is_some() || smallest.is_some_and(|(_, at)| at == *i))
            .map(|(_, k)| k.clone())
            .chain(failed.iter().map(|(item, reason)| Line::Failed { item: item.clone(), reason: reason.clone() }))
            .collect();
        rec.to_fail = to_fail;
        rec.failed = failed;
        let mut log = PassLog { path: path.to_path_buf(), file, kept, in_pass: false };
        log.rewrite()?;
        Ok((log, rec))
    }

    /// Rewrites the log as its kept lines (atomically) and locks the new file.
    fn rewrite(&mut self) -> Result<()> {
        let mut bytes = Vec::new();
        for l in &self.kept {
            bytes.extend(serde_json::to_vec(l).map_err(|e| Error::bad_file(&self.path, e.to_string()))?);
            bytes.push(b'\n');
        }
        write_atomic(&self.path, &bytes)?;
        self.file = open_locked(&self.path)?;
        Ok(())
    }

    /// Forgets the kills of `items` (recorded as failed elsewhere, or to be retried); with a
    /// `reason`, the log keeps them as given up (for runs that have no other record).
    pub fn settle(&mut self, items: &[String], reason: Option<&str>) -> Result<()> {
        if items.is_empty() {
            return Ok(());
        }
        if self.in_pass {
            return Err(Error::Config(format!("{}: settled during a pass (a bug)", self.path.display())));
        }
        self.kept.retain(|k| alone(k).is_none_or(|a| !items.iter().any(|i| i == a)));
        if let Some(reason) = reason {
            self.kept.extend(items.iter().map(|i| Line::Failed { item: i.clone(), reason: reason.to_string() }));
        }
        self.rewrite()
    }

    fn append(&mut self, line: &Line) -> Result<()> {
        let mut bytes = serde_json::to_vec(line).map_err(|e| Error::bad_file(&self.path, e.to_string()))?;
        bytes.push(b'\n');
        self.file.write_all(&bytes).map_err(|e| Error::io(&self.path, e))?;
        self.file.sync_data().map_err(|e| Error::io(&self.path, e))
    }

    /// Records a pass of `units` units over `items`, durably, before it runs.
    pub fn begin(&mut self, units: usize, items: &[&str]) -> Result<()> {
        let items: Vec<String> = items.iter().take(MAX_ITEMS).map(|s| s.to_string()).collect();
        self.append(&Line::Begin { units, items, mark: Mark::now() })?;
        self.in_pass = true;
        if inject_kill_above().is_some_and(|n| units > n) {
            count_injected_kill();
            std::process::exit(137);
        }
        Ok(())
    }

    /// Records that the pass begun last ended (it was not killed).
    pub fn end(&mut self) -> Result<()> {
        if !self.in_pass {
            return Ok(());
        }
        self.in_pass = false;
        self.append(&Line::End)
    }
}

impl Drop for PassLog {
    /// A pass left by an error or a panic was not killed.
    fn drop(&mut self) {
        let _ = self.end();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn items(n: &[&str]) -> Vec<String> {
        n.iter().map(|s| s.to_string()).collect()
    }

    /// A `begin` line from another boot (verdict: unknown, taken as memory), or of this boot with
    /// a count far above any real one (verdict: interrupted).
    fn begin(units: usize, its: &[&str], memory: bool) -> Line {
        let now = Mark::now();
        let mark = if memory || now.boot.is_none() { Mark { oom_kills: Some(0), boot: Some("0000-another-boot".into()), group: None } } else { Mark { oom_kills: Some(u64::MAX), ..now } };
        Line::Begin { units, items: items(its), mark }
    }

    fn write(path: &Path, lines: &[Line]) {
        let mut b = Vec::new();
        for l in lines {
            b.extend(serde_json::to_vec(l).unwrap());
            b.push(b'\n');
        }
        std::fs::write(path, b).unwrap();
    }

    #[test]
    fn a_pass_begun_and_never_ended_halves_the_next_run() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("depth.passes.jsonl");
        let (mut log, rec) = PassLog::open(&p).unwrap();
        assert_eq!(rec, Recovery::default());
        log.begin(4, &["a", "b", "c", "d"]).unwrap();
        log.end().unwrap();
        drop(log);
        write(&p, &[begin(4, &["a", "b", "c", "d"], false), Line::End, begin(8, &["e", "f", "g", "h", "i", "j", "k", "l"], true)]);
        let (log, rec) = PassLog::open(&p).unwrap();
        assert_eq!(rec.ceiling, Some(4), "{rec:?}");
        assert!(rec.notes.iter().any(|n| n.contains("a pass of 8 (e, f, g and 5 more)")), "{rec:?}");
        drop(log);
        // The ceiling stays for later runs, passes or not, and a smaller kill lowers it.
        let (mut log, rec) = PassLog::open(&p).unwrap();
        assert_eq!(rec.ceiling, Some(4));
        log.begin(4, &["e", "f", "g", "h"]).unwrap();
        log.end().unwrap();
        drop(log);
        assert_eq!(PassLog::open(&p).unwrap().1.ceiling, Some(4));
        let mut lines = std::fs::read_to_string(&p).unwrap();
        lines.push_str(&serde_json::to_string(&begin(4, &["e", "f", "g", "h"], true)).unwrap());
        lines.push('\n');
        std::fs::write(&p, &lines).unwrap();
        assert_eq!(PassLog::open(&p).unwrap().1.ceiling, Some(2));
        assert_eq!(std::fs::read_to_string(&p).unwrap().lines().count(), 1, "compacted to the smallest kill");
    }

    #[test]
    fn a_plain_kill_changes_nothing() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("log.jsonl");
        if Mark::now().boot.is_none() {
            eprintln!("no boot id here: a plain kill cannot be told from a memory kill");
            return;
        }
        write(&p, &[begin(1, &["a"], false)]);
        let (_, rec) = PassLog::open(&p).unwrap();
        assert_eq!((rec.ceiling, rec.to_fail.len()), (None, 0), "{rec:?}");
        assert!(rec.notes.iter().any(|n| n.contains("not for memory")), "{rec:?}");
    }

    #[test]
    fn an_item_alone_in_a_killed_pass_twice_is_given_up_once() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("log.jsonl");
        write(&p, &[begin(2, &["a", "b"], true)]);
        let (log, rec) = PassLog::open(&p).unwrap();
        assert_eq!((rec.ceiling, rec.to_fail.len()), (Some(1), 0));
        drop(log);
        let mut lines = std::fs::read_to_string(&p).unwrap();
        lines.push_str(&serde_json::to_string(&begin(1, &["a"], true)).unwrap());
        lines.push('\n');
        std::fs::write(&p, &lines).unwrap();
        let (log, rec) = PassLog::open(&p).unwrap();
        assert!(rec.to_fail.is_empty(), "killed alone once: {rec:?}");
        drop(log);
        let mut lines = std::fs::read_to_string(&p).unwrap();
        lines.push_str(&serde_json::to_string(&begin(1, &["a"], true)).unwrap());
        lines.push_str("\n{\"event\":\"begi");
        std::fs::write(&p, &lines).unwrap();
        let (mut log, rec) = PassLog::open(&p).unwrap();
        assert_eq!(rec.to_fail, ["a"], "{rec:?}");
        assert!(rec.notes.iter().any(|n| n.contains("ignored 1 unreadable")), "{rec:?}");
        log.settle(&rec.to_fail, Some(KILLED_FOR_MEMORY)).unwrap();
        drop(log);
        let (_, rec) = PassLog::open(&p).unwrap();
        assert!(rec.to_fail.is_empty(), "{rec:?}");
        assert_eq!(rec.failed, [("a".to_string(), KILLED_FOR_MEMORY.to_string())]);
    }

    #[test]
    fn an_item_that_came_through_a_pass_is_no_longer_counted() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("log.jsonl");
        write(&p, &[begin(1, &["a"], true), begin(1, &["a"], false), Line::End, begin(1, &["a"], true)]);
        let (_, rec) = PassLog::open(&p).unwrap();
        assert!(rec.to_fail.is_empty(), "{rec:?}");
        assert_eq!(rec.ceiling, Some(1));
    }

    #[test]
    fn a_locked_log_is_refused_and_garbage_is_survived() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("log.jsonl");
        std::fs::write(&p, b"\x00\xff garbage\n{\"event\":\"killed\",\"units\":-3}\n").unwrap();
        let (_log, rec) = PassLog::open(&p).unwrap();
        assert!(rec.notes.iter().any(|n| n.contains("ignored 2 unreadable")), "{rec:?}");
        assert!(PassLog::open(&p).unwrap_err().to_string().contains("locked"));
    }
}
