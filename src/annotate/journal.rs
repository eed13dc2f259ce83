//! Per-stage completion journals: append-only JSON lines under `<output_dir>/manifests/`, one record per
//! finished item, written only after the item's outputs are durable and fsynced in batches.
//!
//! `<stage>.jsonl` belongs to the unsharded run (and is what `--merge` writes); shard K of N appends to
//! `<stage>.shard-K-of-N.jsonl`. A journal is locked while a run appends to it. On open, a torn or
//! unparsable tail (a run killed mid-write, or a crash before the data reached the disk) is truncated
//! away before anything is appended; unparsable lines elsewhere are ignored.
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::config::StageKind;
use crate::error::{Error, Result};
use crate::fsutil::{open_in_place, read_input_if_exists, try_lock, InPlace, Lock};
use crate::paths::check_relative;

/// The outcome of an item in a stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// The outputs were written.
    Ok,
    /// The item could not be processed; `reason` says why.
    Failed,
}

/// One journal line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// Input path relative to the input directory.
    pub input: String,
    /// Input size in bytes.
    pub size: u64,
    /// Input modification time (ns since the epoch).
    pub mtime_ns: i64,
    /// `xxh64:<16 hex>` of the input (content fingerprints).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hash: Option<String>,
    /// ok or failed.
    pub status: Status,
    /// The model that produced the outputs (as named in the config).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Output files, relative to the output directory.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub outputs: Vec<String>,
    /// Why the item failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The shard that wrote it (`K/N`).
    pub shard: String,
    /// Wall-clock time of the record (ms since the epoch).
    pub unix_ms: u64,
}

impl Record {
    /// Whether `input` and every output are plain relative paths ([`check_relative`]); a record
    /// that fails is treated as unreadable (a journal is read back from disk, so it is untrusted).
    pub(crate) fn paths_are_safe(&self) -> bool {
        check_relative(&self.input).is_ok() && self.outputs.iter().all(|o| check_relative(o).is_ok())
    }
}

/// Milliseconds since the epoch.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// Largest journal read back (about 20 million records).
const MAX_JOURNAL: u64 = 1 << 32;

/// The directory a journal lies in: the root its in-place writes must stay inside.
fn parent(path: &Path) -> &Path {
    path.parent().unwrap_or(Path::new(""))
}

/// The manifests directory of an output directory.
pub fn manifest_dir(output: &Path) -> PathBuf {
    output.join("manifests")
}

/// The journal path of `stage` for the shard tag (`""` or `.shard-K-of-N`).
pub fn journal_path(output: &Path, stage: StageKind, tag: &str) -> PathBuf {
    manifest_dir(output).join(format!("{}{tag}.jsonl", stage.name()))
}

/// The pass log of `stage` for the shard tag (`<stage>.passes<tag>.jsonl`, [`crate::runner::PassLog`]):
/// the passes begun and ended, so that a run after a kill for memory takes less per pass.
pub fn passes_path(output: &Path, stage: StageKind, tag: &str) -> PathBuf {
    manifest_dir(output).join(format!("{}.passes{tag}.jsonl", stage.name()))
}

/// All journals of `stage` in `output`: `(path, is_shard_journal)`, sorted.
pub(crate) fn stage_journals(output: &Path, stage: StageKind) -> Result<Vec<(PathBuf, bool)>> {
    let dir = manifest_dir(output);
    let mut out = Vec::new();
    let rd = match std::fs::read_dir(&dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(Error::io(&dir, e)),
    };
    let prefix = format!("{}.shard-", stage.name());
    let whole = format!("{}.jsonl", stage.name());
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name == whole {
            out.push((e.path(), false));
        } else if name.starts_with(&prefix) && name.ends_with(".jsonl") {
            out.push((e.path(), true));
        }
    }
    out.sort();
    Ok(out)
}

/// Parses journal bytes: the records, the byte length of the prefix ending with the last good record,
/// and the number of unparsable lines (or records with unsafe paths) before it.
fn parse(bytes: &[u8]) -> (Vec<Record>, usize, usize) {
    let mut records = Vec::new();
    let mut good_end = 0;
    let mut bad_before = 0;
    let mut bad_pending = 0;
    let mut pos = 0;
    while pos < bytes.len() {
        let Some(nl) = bytes[pos..].iter().position(|&b| b == b'\n') else { break };
        let line = &bytes[pos..pos + nl];
        pos += nl + 1;
        if line.iter().all(|b| b.is_ascii_whitespace()) {
            continue;
        }
        match serde_json::from_slice::<Record>(line) {
            Ok(r) if r.paths_are_safe() => {
                records.push(r);
                good_end = pos;
                bad_before += bad_pending;
                bad_pending = 0;
            }
            _ => bad_pending += 1,
        }
    }
    (records, good_end, bad_before)
}

/// Reads the records of a journal without modifying it (a torn tail is ignored).
pub fn read_records(path: &Path) -> Result<Vec<Record>> {
    Ok(read_input_if_exists(path, MAX_JOURNAL)?.map(|b| parse(&b).0).unwrap_or_default())
}

/// What opening a journal found.
#[derive(Debug, Clone, Default)]
pub struct Recovery {
    /// Bytes of torn or unparsable tail truncated away.
    pub truncated_bytes: u64,
    /// Unparsable lines kept (not at the tail) and ignored.
    pub bad_lines: usize,
}

/// A journal open for appending (locked for this process).
pub struct Journal {
    path: PathBuf,
    file: File,
    unsynced: usize,
    last_sync: Instant,
    sync_every: usize,
    sync_interval: Duration,
}

impl Journal {
    /// Opens (creating) and locks `path`, truncates a torn tail and returns its records.
    pub fn open(path: &Path, sync_every: usize, sync_interval: Duration) -> Result<(Journal, Vec<Record>, Recovery)> {
        let mut file = open_in_place(parent(path), path, InPlace::Append)?;
        if file.metadata().map_err(|e| Error::io(path, e))?.len() > MAX_JOURNAL {
            return Err(Error::bad_file(path, format!("more than {MAX_JOURNAL} bytes: not a journal this run can read")));
        }
        if try_lock(&file) == Lock::Busy {
            return Err(Error::Config(format!(
                "{} is locked: another `edgerun annotate` is writing this output (same shard); wait for it or stop it",
                path.display()
            )));
        }
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes).map_err(|e| Error::io(path, e))?;
        let (records, good_end, bad_lines) = parse(&bytes);
        let mut rec = Recovery { truncated_bytes: 0, bad_lines };
        if good_end < bytes.len() {
            file.set_len(good_end as u64).map_err(|e| Error::io(path, e))?;
            file.sync_all().map_err(|e| Error::io(path, e))?;
            rec.truncated_bytes = (bytes.len() - good_end) as u64;
        }
        let j = Journal { path: path.to_path_buf(), file, unsynced: 0, last_sync: Instant::now(), sync_every: sync_every.max(1), sync_interval };
        Ok((j, records, rec))
    }

    /// The journal's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one record (one `write` of the whole line) and fsyncs when a batch is due.
    pub fn append(&mut self, r: &Record) -> Result<()> {
        let mut line = serde_json::to_vec(r).map_err(|e| Error::bad_file(&self.path, e.to_string()))?;
        line.push(b'\n');
        self.file.write_all(&line).map_err(|e| Error::io(&self.path, e))?;
        self.unsynced += 1;
        if self.unsynced >= self.sync_every || self.last_sync.elapsed() >= self.sync_interval {
            self.sync()?;
        }
        Ok(())
    }

    /// fsyncs if records were appended since the last sync and the interval has passed.
    pub(crate) fn sync_if_due(&mut self) -> Result<()> {
        if self.unsynced > 0 && self.last_sync.elapsed() >= self.sync_interval {
            self.sync()?;
        }
        Ok(())
    }

    /// fsyncs now.
    pub fn sync(&mut self) -> Result<()> {
        if self.unsynced > 0 {
            self.file.sync_data().map_err(|e| Error::io(&self.path, e))?;
        }
        self.unsynced = 0;
        self.last_sync = Instant::now();
        Ok(())
    }
}

impl Drop for Journal {
    fn drop(&mut self) {
        let _ = self.sync();
    }
}

/// The latest ok and latest failed record of each input.
#[derive(Debug, Default)]
pub(crate) struct Index {
    /// By input path: (latest ok, latest failed).
    pub by_input: HashMap<String, (Option<Record>, Option<Record>)>,
}

impl Index {
    /// Adds records in order (a later record of the same status replaces an earlier one).
    pub(crate) fn add(&mut self, records: impl IntoIterator<Item = Record>) {
        for r in records {
            let e = self.by_input.entry(r.input.clone()).or_default();
            let slot = if r.status == Status::Ok { &mut e.0 } else { &mut e.1 };
            if slot.as_ref().is_none_or(|old| old.unix_ms <= r.unix_ms) {
                *slot = Some(r);
            }
        }
    }
}

/// What `merge` did for one stage.
#[derive(Debug, Clone, Serialize)]
pub struct MergedStage {
    /// Journals read.
    pub journals: usize,
    /// Inputs with an ok record.
    pub ok: usize,
    /// Inputs with only failed records.
    pub failed: usize,
}

/// Combines every journal of each stage into `<stage>.jsonl` (one record per input: the latest ok, else
/// the latest failed; sorted by input), written atomically. Shard journals are kept. Run it when no
/// annotate run is writing to `output`.
pub fn merge(output: &Path) -> Result<BTreeMap<String, MergedStage>> {
    let mut out = BTreeMap::new();
    for stage in StageKind::ALL {
        let journals = stage_journals(output, stage)?;
        if journals.is_empty() {
            continue;
        }
        let whole = journal_path(output, stage, "");
        // Refuse while an unsharded run holds the journal we are about to replace.
        let guard = open_in_place(parent(&whole), &whole, InPlace::Append)?;
        if try_lock(&guard) == Lock::Busy {
            return Err(Error::Config(format!("{} is locked by a running `edgerun annotate`; merge when it has finished", whole.display())));
        }
        let mut index = Index::default();
        for (p, _) in &journals {
            index.add(read_records(p)?);
        }
        let mut inputs: Vec<&String> = index.by_input.keys().collect();
        inputs.sort();
        let mut bytes = Vec::new();
        let (mut ok, mut failed) = (0, 0);
        for k in inputs {
            let (o, f) = &index.by_input[k];
            let r = match (o, f) {
                (Some(o), _) => {
                    ok += 1;
                    o
                }
                (None, Some(f)) => {
                    failed += 1;
                    f
                }
                (None, None) => continue,
            };
            bytes.extend(serde_json::to_vec(r).map_err(|e| Error::bad_file(&whole, e.to_string()))?);
            bytes.push(b'\n');
        }
        crate::fsutil::write_atomic(&whole, &bytes)?;
        out.insert(stage.name().to_string(), MergedStage { journals: journals.len(), ok, failed });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(input: &str, status: Status, t: u64) -> Record {
        Record { input: input.into(), size: 1, mtime_ns: 2, hash: None, status, model: None, outputs: vec![], reason: None, shard: "0/1".into(), unix_ms: t }
    }

    #[test]
    fn torn_tail_is_truncated_and_appends_start_on_a_fresh_line() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("j.jsonl");
        let mut bytes = serde_json::to_vec(&rec("a", Status::Ok, 1)).unwrap();
        bytes.extend(b"\nnot json\n");
        bytes.extend(serde_json::to_vec(&rec("b", Status::Failed, 2)).unwrap());
        let torn = b"\n{\"input\":\"c\",\"si";
        bytes.extend(torn);
        std::fs::write(&p, &bytes).unwrap();
        let (mut j, records, rec_) = Journal::open(&p, 10, Duration::from_secs(1)).unwrap();
        assert_eq!(records.len(), 2);
        assert_eq!(rec_.bad_lines, 1);
        assert_eq!(rec_.truncated_bytes, torn.len() as u64 - 1);
        j.append(&rec("d", Status::Ok, 3)).unwrap();
        drop(j);
        let again = read_records(&p).unwrap();
        assert_eq!(again.iter().map(|r| r.input.as_str()).collect::<Vec<_>>(), ["a", "b", "d"]);
    }

    #[test]
    fn a_locked_journal_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("j.jsonl");
        let (_j, _, _) = Journal::open(&p, 10, Duration::from_secs(1)).unwrap();
        assert!(Journal::open(&p, 10, Duration::from_secs(1)).is_err());
    }
}
