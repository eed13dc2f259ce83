//! The memory limits of the cgroups that hold this process: each group from the process's own up to
//! the root of its hierarchy, as the kernel applies them (cgroup v2: `memory.max` and `memory.high`
//! of every ancestor; cgroup v1: `memory.limit_in_bytes` of the own group and of each ancestor whose
//! `memory.use_hierarchy` charges its children to it). The groups come from `/proc/self/cgroup`, their
//! directories from the cgroup mounts in `/proc/self/mountinfo`.
//!
//! Everything is read under a root directory (`/` in a run, a fake tree in tests), and every file is
//! untrusted: a number that does not parse, a path that leaves its mount, a file too long is ignored
//! with a reason ([`Limits::ignored`]), never a panic.
use std::path::{Path, PathBuf};

use super::procfs::{mib, parse_u64, read_small, stat_field};

/// v1 reports "no limit" as a page-rounded `i64::MAX`; any limit from 2⁶⁰ bytes on is none.
const UNLIMITED: u64 = 1 << 60;
/// Most levels walked from the own group up (a deeper path is refused as malformed).
const MAX_DEPTH: usize = 64;
/// Longest cgroup path accepted.
const MAX_PATH: usize = 4096;

/// One limit that applies to this process and how much of it is left.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Headroom {
    /// Bytes left under the limit: the limit less the group's usage, not counting the inactive file
    /// cache that the kernel reclaims before it kills anything.
    pub bytes: u64,
    /// Where the figure came from (`cgroup v1 /a/b: limit 700 MiB, usage 210 MiB (95 MiB reclaimable file cache)`).
    pub source: String,
}

/// The limits found and what was ignored.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Limits {
    /// Every limit that applies, own group first.
    pub limits: Vec<Headroom>,
    /// What could not be read or made no sense, with the reason.
    pub ignored: Vec<String>,
}

/// A cgroup mount: the hierarchy's path it shows (`root`) and where it is mounted.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Mount {
    root: String,
    point: String,
    fstype: String,
    options: String,
}

/// The process's memory groups: the v1 `memory` hierarchy's and the v2 (unified) one's.
#[derive(Debug, Default, PartialEq, Eq)]
struct Groups {
    v1: Option<String>,
    v2: Option<String>,
}

/// Undoes mountinfo's octal escapes (`\040` for a space).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b.get(i + 1..i + 4).filter(|d| b[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match octal.and_then(|d| u8::from_str_radix(std::str::from_utf8(d).ok()?, 8).ok()) {
            Some(v) => {
                out.push(v);
                i += 4;
            }
            None => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The cgroup mounts of a `/proc/self/mountinfo` text (lines that do not parse are skipped).
fn parse_mountinfo(text: &str) -> Vec<Mount> {
    let mut out = Vec::new();
    for line in text.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let Some(sep) = fields.iter().position(|f| *f == "-") else { continue };
        let (Some(root), Some(point), Some(fstype), Some(options)) = (fields.get(3), fields.get(4), fields.get(sep + 1), fields.get(sep + 3)) else {
            continue;
        };
        if sep < 6 || !fstype.starts_with("cgroup") {
            continue;
        }
        out.push(Mount { root: unescape(root), point: unescape(point), fstype: fstype.to_string(), options: options.to_string() });
    }
    out
}

/// Whether a group path is usable: absolute, bounded, no `..` (a group outside the process's
/// cgroup namespace shows as `/../..`).
fn check_group(path: &str) -> Result<(), String> {
    if !path.starts_with('/') || path.len() > MAX_PATH || path.contains('\0') {
        return Err(format!("`{}` is not an absolute cgroup path", path.chars().take(80).collect::<String>()));
    }
    if path.split('/').any(|c| c == ".." || c == ".") {
        return Err(format!("`{path}` is outside this process's cgroup namespace"));
    }
    Ok(())
}

/// The memory groups named in a `/proc/self/cgroup` text.
fn parse_proc_cgroup(text: &str, ignored: &mut Vec<String>) -> Groups {
    let mut g = Groups::default();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            ignored.push(format!("/proc/self/cgroup: `{}` is not `id:controllers:path`", line.chars().take(80).collect::<String>()));
            continue;
        };
        let slot = if id == "0" && controllers.is_empty() {
            &mut g.v2
        } else if controllers.split(',').any(|c| c == "memory") {
            &mut g.v1
        } else {
            continue;
        };
        match check_group(path) {
            Ok(()) => *slot = Some(path.to_string()),
            Err(why) => ignored.push(format!("/proc/self/cgroup: {why}")),
        }
    }
    g
}

/// The directory levels of `group` under `mount`, own group first, each with its cgroup path.
fn levels(root: &Path, mount: &Mount, group: &str) -> Result<Vec<(PathBuf, String)>, String> {
    let base = mount.root.trim_end_matches('/');
    let rel = if base.is_empty() {
        group
    } else if group == base || group.starts_with(&format!("{base}/")) {
        &group[base.len()..]
    } else {
        return Err(format!("group {group} is outside the mount of {base} at {}", mount.point));
    };
    let parts: Vec<&str> = rel.split('/').filter(|c| !c.is_empty()).collect();
    if parts.len() > MAX_DEPTH {
        return Err(format!("group {group} is nested more than {MAX_DEPTH} levels deep"));
    }
    let point = root.join(mount.point.trim_start_matches('/'));
    Ok((0..=parts.len())
        .rev()
        .map(|n| {
            let dir = parts[..n].iter().fold(point.clone(), |d, p| d.join(p));
            let name = format!("{base}/{}", parts[..n].join("/"));
            let name = if name.len() > 1 { name.trim_end_matches('/').to_string() } else { name };
            (dir, name)
        })
        .collect())
}

/// A limit file's value: `None` for "max" (no limit), an error for anything but a number.
fn read_limit(file: &Path) -> Option<Result<Option<u64>, String>> {
    let text = read_small(file)?;
    let t = text.trim();
    Some(if t == "max" { Ok(None) } else { parse_u64(t).map(|v| (v < UNLIMITED).then_some(v)).ok_or_else(|| format!("{}: `{}` is not a byte count", file.display(), t.chars().take(40).collect::<String>())) })
}

/// The headroom under `limit` of a group using `usage` bytes of which `reclaimable` are inactive
/// file cache.
fn headroom(version: &str, name: &str, file: &str, limit: u64, usage: u64, reclaimable: u64) -> Headroom {
    let reclaimable = reclaimable.min(usage);
    let held = usage - reclaimable;
    Headroom {
        bytes: limit.saturating_sub(held),
        source: format!(
            "cgroup {version} {name}: {file} {}, usage {} ({} reclaimable file cache)",
            mib(limit),
            mib(usage),
            mib(reclaimable)
        ),
    }
}

/// Reads `usage` and the reclaimable file cache of a group; `None` with a reason when the usage
/// cannot be read.
fn usage(dir: &Path, usage_file: &str, inactive_key: &str, ignored: &mut Vec<String>) -> Option<(u64, u64)> {
    let path = dir.join(usage_file);
    let Some(text) = read_small(&path) else {
        ignored.push(format!("{}: unreadable, so the limit beside it is not used", path.display()));
        return None;
    };
    let Some(used) = parse_u64(text.trim()) else {
        ignored.push(format!("{}: `{}` is not a byte count", path.display(), text.trim().chars().take(40).collect::<String>()));
        return None;
    };
    let stat = dir.join("memory.stat");
    let reclaimable = match read_small(&stat).map(|t| stat_field(&t, inactive_key)) {
        Some(Some(v)) => v,
        Some(None) => {
            ignored.push(format!("{}: no readable `{inactive_key}`: no file cache counted as reclaimable", stat.display()));
            0
        }
        None => 0,
    };
    Some((used, reclaimable))
}

/// The v2 limits (`memory.max`, `memory.high`) of every level.
fn v2_limits(levels: &[(PathBuf, String)], out: &mut Limits) {
    for (dir, name) in levels {
        let mut found = Vec::new();
        for file in ["memory.max", "memory.high"] {
            match read_limit(&dir.join(file)) {
                Some(Ok(Some(limit))) => found.push((file, limit)),
                Some(Ok(None)) | None => {}
                Some(Err(why)) => out.ignored.push(why),
            }
        }
        if found.is_empty() {
            continue;
        }
        if let Some((used, reclaimable)) = usage(dir, "memory.current", "inactive_file", &mut out.ignored) {
            out.limits.extend(found.into_iter().map(|(file, limit)| headroom("v2", name, file, limit, used, reclaimable)));
        }
    }
}

/// The v1 limits of the own group and of each ancestor that charges it (`memory.use_hierarchy`).
fn v1_limits(levels: &[(PathBuf, String)], out: &mut Limits) {
    for (i, (dir, name)) in levels.iter().enumerate() {
        if i > 0 {
            // A parent's limit covers its children only when it has hierarchical accounting on
            // (always since Linux 5.x; 0 was possible before). Unreadable: assume it does.
            let file = dir.join("memory.use_hierarchy");
            match read_small(&file).map(|t| t.trim().to_string()) {
                Some(t) if t == "0" => break,
                Some(t) if t == "1" => {}
                Some(t) => out.ignored.push(format!("{}: `{}` is not 0 or 1: taken as 1", file.display(), t.chars().take(40).collect::<String>())),
                None => {}
            }
        }
        let limit = match read_limit(&dir.join("memory.limit_in_bytes")) {
            Some(Ok(Some(limit))) => limit,
            Some(Ok(None)) | None => continue,
            Some(Err(why)) => {
                out.ignored.push(why);
                continue;
            }
        };
        if let Some((used, reclaimable)) = usage(dir, "memory.usage_in_bytes", "total_inactive_file", &mut out.ignored) {
            out.limits.push(headroom("v1", name, "limit", limit, used, reclaimable));
        }
    }
}

/// The own memory group's out-of-memory kill count (any OOM killer's kills of its processes: v2
/// `memory.events`, v1 `memory.oom_control`, `oom_kill`) and the group's path; `None` when it cannot
/// be read.
pub(crate) fn own_oom_kills(root: &Path) -> Option<(String, u64)> {
    let mut ignored = Vec::new();
    let groups = parse_proc_cgroup(&read_small(&root.join("proc/self/cgroup"))?, &mut ignored);
    let mounts = parse_mountinfo(&read_small(&root.join("proc/self/mountinfo"))?);
    let candidates = [(true, groups.v2, "memory.events"), (false, groups.v1, "memory.oom_control")];
    candidates.into_iter().find_map(|(v2, group, file)| {
        let group = group?;
        let mount = mounts.iter().find(|m| if v2 { m.fstype == "cgroup2" } else { m.fstype == "cgroup" && m.options.split(',').any(|o| o == "memory") })?;
        let (dir, name) = levels(root, mount, &group).ok()?.into_iter().next()?;
        let n = stat_field(&read_small(&dir.join(file))?, "oom_kill")?;
        Some((name, n))
    })
}

/// The memory limits that apply to this process, read under `root` (`/` for the real system).
pub fn limits(root: &Path) -> Limits {
    let mut out = Limits::default();
    let Some(cgroup) = read_small(&root.join("proc/self/cgroup")) else {
        out.ignored.push("/proc/self/cgroup: unreadable (no cgroups)".into());
        return out;
    };
    let groups = parse_proc_cgroup(&cgroup, &mut out.ignored);
    if groups.v1.is_none() && groups.v2.is_none() {
        return out;
    }
    let Some(mountinfo) = read_small(&root.join("proc/self/mountinfo")) else {
        out.ignored.push("/proc/self/mountinfo: unreadable, so the cgroup directories are unknown".into());
        return out;
    };
    let mounts = parse_mountinfo(&mountinfo);
    let find = |v2: bool, group: &str| {
        let candidates: Vec<&Mount> = mounts
            .iter()
            .filter(|m| if v2 { m.fstype == "cgroup2" } else { m.fstype == "cgroup" && m.options.split(',').any(|o| o == "memory") })
            .collect();
        let fits = candidates.iter().find(|m| levels(root, m, group).is_ok()).or(candidates.first()).copied();
        fits.ok_or_else(|| format!("no {} mount in /proc/self/mountinfo for group {group}", if v2 { "cgroup2" } else { "cgroup v1 memory" }))
    };
    for (v2, group) in [(true, &groups.v2), (false, &groups.v1)] {
        let Some(group) = group else { continue };
        match find(v2, group).and_then(|m| levels(root, m, group)) {
            Ok(lv) if v2 => v2_limits(&lv, &mut out),
            Ok(lv) => v1_limits(&lv, &mut out),
            Err(why) => out.ignored.push(why),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake `/` with `/proc/self/{cgroup,mountinfo}` and the given files.
    fn tree(cgroup: &str, mountinfo: &str, files: &[(&str, &str)]) -> tempfile::TempDir {
        let t = tempfile::tempdir().unwrap();
        let w = |rel: &str, text: &str| {
            let p = t.path().join(rel.trim_start_matches('/'));
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        };
        w("proc/self/cgroup", cgroup);
        w("proc/self/mountinfo", mountinfo);
        for (rel, text) in files {
            w(rel, text);
        }
        t
    }

    const V1_MOUNTS: &str = "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n\
        32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n\
        35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n\
        41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n";
    const V2_MOUNTS: &str = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n";
    const MIB: u64 = 1 << 20;

    fn bytes(l: &Limits) -> Vec<u64> {
        l.limits.iter().map(|h| h.bytes).collect()
    }

    #[test]
    fn v1_reads_the_own_group_and_its_hierarchical_ancestors_not_just_the_root() {
        let m = "/sys/fs/cgroup/memory";
        let t = tree(
            "9:name=systemd:/\n4:memory:/jobs/a\n1:cpu:/\n0::/\n",
            V1_MOUNTS,
            &[
                (&format!("{m}/memory.limit_in_bytes"), "9223372036854771712\n"),
                (&format!("{m}/memory.usage_in_bytes"), "5000000000\n"),
                (&format!("{m}/memory.use_hierarchy"), "1\n"),
                (&format!("{m}/jobs/memory.limit_in_bytes"), &format!("{}\n", 2048 * MIB)),
                (&format!("{m}/jobs/memory.usage_in_bytes"), &format!("{}\n", 1500 * MIB)),
                (&format!("{m}/jobs/memory.use_hierarchy"), "1\n"),
                (&format!("{m}/jobs/a/memory.limit_in_bytes"), &format!("{}\n", 700 * MIB)),
                (&format!("{m}/jobs/a/memory.usage_in_bytes"), &format!("{}\n", 200 * MIB)),
                (&format!("{m}/jobs/a/memory.stat"), &format!("cache 1\ninactive_file 7\ntotal_inactive_file {}\n", 50 * MIB)),
            ],
        );
        let l = limits(t.path());
        assert_eq!(bytes(&l), [550 * MIB, 548 * MIB], "{l:?}");
        assert!(l.limits[0].source.starts_with("cgroup v1 /jobs/a: limit 700 MiB, usage 200 MiB (50 MiB reclaimable"), "{l:?}");
        assert!(l.limits[1].source.starts_with("cgroup v1 /jobs: limit 2048 MiB"), "{l:?}");
        assert!(l.ignored.is_empty(), "{l:?}");
    }

    #[test]
    fn v1_stops_at_a_parent_that_does_not_charge_its_children() {
        let m = "/sys/fs/cgroup/memory";
        let t = tree(
            "4:memory:/p/c\n",
            V1_MOUNTS,
            &[
                (&format!("{m}/p/memory.limit_in_bytes"), "1000\n"),
                (&format!("{m}/p/memory.usage_in_bytes"), "10\n"),
                (&format!("{m}/p/memory.use_hierarchy"), "0\n"),
                (&format!("{m}/p/c/memory.limit_in_bytes"), "5000\n"),
                (&format!("{m}/p/c/memory.usage_in_bytes"), "1000\n"),
            ],
        );
        assert_eq!(bytes(&limits(t.path())), [4000]);
    }

    #[test]
    fn v2_takes_max_and_high_of_every_level_up_to_the_mount() {
        let c = "/sys/fs/cgroup";
        let t = tree(
            "0::/user.slice/job.scope\n",
            V2_MOUNTS,
            &[
                (&format!("{c}/user.slice/memory.max"), &format!("{}\n", 4096 * MIB)),
                (&format!("{c}/user.slice/memory.high"), "max\n"),
                (&format!("{c}/user.slice/memory.current"), &format!("{}\n", 1024 * MIB)),
                (&format!("{c}/user.slice/job.scope/memory.max"), "max\n"),
                (&format!("{c}/user.slice/job.scope/memory.high"), &format!("{}\n", 700 * MIB)),
                (&format!("{c}/user.slice/job.scope/memory.current"), &format!("{}\n", 300 * MIB)),
                (&format!("{c}/user.slice/job.scope/memory.stat"), &format!("anon 1\ninactive_file {}\n", 100 * MIB)),
            ],
        );
        let l = limits(t.path());
        assert_eq!(bytes(&l), [500 * MIB, 3072 * MIB], "{l:?}");
        assert!(l.limits[0].source.contains("/user.slice/job.scope: memory.high 700 MiB"), "{l:?}");
    }

    #[test]
    fn a_container_sees_its_group_at_the_mount_root() {
        // Docker on cgroup v1 without a cgroup namespace: the mount's root is the container's group.
        let mounts = "35 31 0:32 /docker/abc /sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory\n";
        let m = "/sys/fs/cgroup/memory";
        let t = tree(
            "4:memory:/docker/abc\n",
            mounts,
            &[(&format!("{m}/memory.limit_in_bytes"), "1000000\n"), (&format!("{m}/memory.usage_in_bytes"), "400000\n")],
        );
        let l = limits(t.path());
        assert_eq!(bytes(&l), [600_000]);
        assert!(l.limits[0].source.contains("/docker/abc"), "{l:?}");
    }

    #[test]
    fn unlimited_groups_give_no_limit() {
        let c = "/sys/fs/cgroup";
        let t = tree("0::/a\n", V2_MOUNTS, &[(&format!("{c}/a/memory.max"), "max\n"), (&format!("{c}/a/memory.high"), "max\n"), (&format!("{c}/a/memory.current"), "5\n")]);
        let l = limits(t.path());
        assert!(l.limits.is_empty() && l.ignored.is_empty(), "{l:?}");
        let t = tree("4:memory:/\n", V1_MOUNTS, &[("sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n"), ("sys/fs/cgroup/memory/memory.usage_in_bytes", "1\n")]);
        assert!(limits(t.path()).limits.is_empty());
    }

    #[test]
    fn malformed_files_are_ignored_with_a_reason() {
        let c = "/sys/fs/cgroup";
        let t = tree(
            "garbage\n0::/a/b\n",
            V2_MOUNTS,
            &[
                (&format!("{c}/a/memory.max"), "-5\n"),
                (&format!("{c}/a/memory.current"), "1\n"),
                (&format!("{c}/a/b/memory.max"), "1000\n"),
                (&format!("{c}/a/b/memory.current"), "lots\n"),
                (&format!("{c}/a/b/memory.high"), "99999999999999999999999999\n"),
            ],
        );
        let l = limits(t.path());
        assert!(l.limits.is_empty(), "{l:?}");
        let why = l.ignored.join("\n");
        for want in ["not `id:controllers:path`", "`-5` is not a byte count", "`lots` is not a byte count", "`99999999999999999999999999` is not a byte count"] {
            assert!(why.contains(want), "{want}: {why}");
        }
        // A group outside the namespace, a missing mount, too deep, nothing at all: reasons, no panic.
        let t = tree("0::/../../x\n", V2_MOUNTS, &[]);
        assert!(limits(t.path()).ignored.iter().any(|w| w.contains("outside this process's cgroup namespace")));
        let t = tree("4:memory:/a\n", V2_MOUNTS, &[]);
        assert!(limits(t.path()).ignored.iter().any(|w| w.contains("no cgroup v1 memory mount")));
        let t = tree(&format!("0::{}\n", "/d".repeat(MAX_DEPTH + 1)), V2_MOUNTS, &[]);
        assert!(limits(t.path()).ignored.iter().any(|w| w.contains("levels deep")));
        let t = tempfile::tempdir().unwrap();
        assert!(limits(t.path()).ignored.iter().any(|w| w.contains("unreadable")));
    }

    #[test]
    fn the_own_group_kill_count_is_read_from_v2_or_v1() {
        let t = tree("0::/a\n", V2_MOUNTS, &[("sys/fs/cgroup/a/memory.events", "low 0\nhigh 2\nmax 3\noom 1\noom_kill 4\n")]);
        assert_eq!(own_oom_kills(t.path()), Some(("/a".into(), 4)));
        let t = tree("4:memory:/b\n0::/\n", V1_MOUNTS, &[("sys/fs/cgroup/memory/b/memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")]);
        assert_eq!(own_oom_kills(t.path()), Some(("/b".into(), 2)));
        let t = tree("4:memory:/b\n", V1_MOUNTS, &[("sys/fs/cgroup/memory/b/memory.oom_control", "oom_kill many\n")]);
        assert_eq!(own_oom_kills(t.path()), None);
    }

    #[test]
    fn mountinfo_escapes_and_short_lines() {
        let m = parse_mountinfo("1 2 0:1 / /sys/fs/cgroup/my\\040mem rw - cgroup cgroup rw,memory\nshort line\n1 2 3 - x\n");
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].point, "/sys/fs/cgroup/my mem");
        assert_eq!(unescape("a\\0"), "a\\0");
    }
}
