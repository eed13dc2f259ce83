//! Whether the kernel killed something for memory since a moment. The kernel counts its
//! out-of-memory kills, per memory cgroup (`oom_kill` in `memory.events` or `memory.oom_control`:
//! kills of the group's processes by any OOM killer) and for the whole system (`oom_kill` in
//! `/proc/vmstat`, since Linux 4.13), and names each boot (`/proc/sys/kernel/random/boot_id`). Within
//! one boot, the own group's count (when both moments were in the same group), else the system's,
//! says it: risen, a kill for memory happened; unchanged, none did. Another boot, or counts that
//! cannot be read: nobody can tell.
//!
//! Test seam: with `EDGERUN_OOM_COUNT_FILE=PATH` the count is read from PATH (a decimal number)
//! instead, and the kill hook of [`crate::runner::passes`] adds one to it before it ends the process,
//! as the kernel's count rises when it kills.
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::procfs::{parse_u64, read_small, stat_field};

/// The environment variable naming a file that stands in for `/proc/vmstat`'s count.
pub(crate) const COUNT_ENV: &str = "EDGERUN_OOM_COUNT_FILE";

/// The kernel's out-of-memory kill count and the boot it belongs to, at one moment.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Mark {
    /// Out-of-memory kills since boot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oom_kills: Option<u64>,
    /// The boot's id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot: Option<String>,
    /// The own memory group and its out-of-memory kill count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<(String, u64)>,
}

/// What ended a pass that was begun and never ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Verdict {
    /// The kernel killed something for memory since the pass began.
    Memory,
    /// Nobody can tell (another boot, or the count could not be read): taken as memory.
    Unknown,
    /// Not memory: the count did not change (a kill, a crash, a stop).
    Interrupted,
}

fn count_file() -> Option<PathBuf> {
    std::env::var_os(COUNT_ENV).map(PathBuf::from)
}

fn read_count(stand_in: Option<&Path>) -> Option<u64> {
    match stand_in {
        Some(p) => read_small(p).and_then(|t| parse_u64(t.trim())),
        None => read_small(Path::new("/proc/vmstat")).and_then(|t| stat_field(&t, "oom_kill")),
    }
}

fn boot_id() -> Option<String> {
    let t = read_small(Path::new("/proc/sys/kernel/random/boot_id"))?;
    let t = t.trim();
    (!t.is_empty() && t.len() <= 64 && t.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')).then(|| t.to_string())
}

impl Mark {
    /// The count and boot now.
    pub(crate) fn now() -> Mark {
        let stand_in = count_file();
        // The stand-in of the test seam replaces the kernel's counts, the group's too.
        let group = if stand_in.is_some() { None } else { super::cgroup::own_oom_kills(Path::new("/")) };
        Mark { oom_kills: read_count(stand_in.as_deref()), boot: boot_id(), group }
    }

    /// What ended a pass begun at `self`, judged at `now`.
    pub(crate) fn verdict(&self, now: &Mark) -> Verdict {
        if let (Some(a), Some(b), Some((g, then)), Some((h, later))) = (&self.boot, &now.boot, &self.group, &now.group) {
            if a == b && g == h {
                return if later > then { Verdict::Memory } else { Verdict::Interrupted };
            }
        }
        match (&self.boot, &now.boot, self.oom_kills, now.oom_kills) {
            (Some(a), Some(b), Some(then), Some(later)) if a == b => {
                if later > then {
                    Verdict::Memory
                } else {
                    Verdict::Interrupted
                }
            }
            _ => Verdict::Unknown,
        }
    }
}

/// The test seam: adds one to the stand-in count, when one is set (a kill hook "kills for memory").
pub(crate) fn count_injected_kill() {
    if let Some(p) = count_file() {
        let n = read_count(Some(&p)).unwrap_or(0);
        let _ = crate::fsutil::write_atomic(&p, format!("{}\n", n.saturating_add(1)).as_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mark(kills: Option<u64>, boot: Option<&str>) -> Mark {
        Mark { oom_kills: kills, boot: boot.map(str::to_string), group: None }
    }

    #[test]
    fn a_rising_count_in_one_boot_is_memory() {
        assert_eq!(mark(Some(3), Some("b")).verdict(&mark(Some(4), Some("b"))), Verdict::Memory);
        assert_eq!(mark(Some(3), Some("b")).verdict(&mark(Some(3), Some("b"))), Verdict::Interrupted);
        assert_eq!(mark(Some(3), Some("b")).verdict(&mark(Some(9), Some("c"))), Verdict::Unknown, "another boot");
        assert_eq!(mark(None, Some("b")).verdict(&mark(Some(3), Some("b"))), Verdict::Unknown);
        assert_eq!(mark(Some(3), None).verdict(&mark(Some(3), None)), Verdict::Unknown);
        // The own group's count decides when both moments were in the same group: another
        // group's kill (the system's count rose) is not this run's.
        let g = |kills: u64, group: &str, n: u64| Mark { group: Some((group.into(), n)), ..mark(Some(kills), Some("b")) };
        assert_eq!(g(3, "/a", 0).verdict(&g(9, "/a", 0)), Verdict::Interrupted);
        assert_eq!(g(3, "/a", 0).verdict(&g(3, "/a", 1)), Verdict::Memory);
        assert_eq!(g(3, "/a", 0).verdict(&g(4, "/other", 0)), Verdict::Memory, "another group: the system's count");
    }

    #[test]
    fn the_stand_in_count_is_read_defensively() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("count");
        std::fs::write(&p, "7\n").unwrap();
        assert_eq!(read_count(Some(&p)), Some(7));
        std::fs::write(&p, "seven\n").unwrap();
        assert_eq!(read_count(Some(&p)), None);
        assert_eq!(read_count(Some(&d.path().join("missing"))), None);
    }
}
