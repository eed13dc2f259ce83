//! Reading the kernel's small text files (`/proc`, `/sys`) defensively: bounded reads, numbers
//! that must parse whole and fit, and MiB for messages.
use std::io::Read;
use std::path::Path;

/// Longest file read (a `memory.stat` is about 1 KiB, `/proc/self/mountinfo` a few KiB).
const MAX_FILE: u64 = 1 << 20;

/// The text of a small file; `None` when it is missing, unreadable, not UTF-8 or longer than 1 MiB.
pub(crate) fn read_small(path: &Path) -> Option<String> {
    let f = crate::fsutil::open_input(path).ok()?;
    let mut text = String::new();
    f.take(MAX_FILE + 1).read_to_string(&mut text).ok()?;
    (text.len() as u64 <= MAX_FILE).then_some(text)
}

/// A decimal count of at most 20 digits that fits a `u64` (no sign, no spaces inside).
pub(crate) fn parse_u64(s: &str) -> Option<u64> {
    (!s.is_empty() && s.len() <= 20 && s.bytes().all(|b| b.is_ascii_digit())).then(|| s.parse().ok()).flatten()
}

/// The value of `key` in a `key value` per line text (`memory.stat`, `/proc/vmstat`).
pub(crate) fn stat_field(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let mut it = l.split_whitespace();
        (it.next() == Some(key)).then(|| it.next().and_then(parse_u64)).flatten()
    })
}

/// `MemAvailable` (bytes) in a `/proc/meminfo` text.
pub(crate) fn meminfo_available(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut it = line.split_whitespace().skip(1);
    let kb = it.next().and_then(parse_u64)?;
    (it.next() == Some("kB")).then(|| kb.checked_mul(1024)).flatten()
}

/// Bytes as whole MiB (rounded) for a message (`700 MiB`).
pub(crate) fn mib(bytes: u64) -> String {
    format!("{} MiB", bytes.saturating_add(1 << 19) >> 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_parse_whole_and_bounded() {
        assert_eq!(parse_u64("123"), Some(123));
        assert_eq!(parse_u64("18446744073709551615"), Some(u64::MAX));
        for bad in ["", "-1", "+1", "1 2", "18446744073709551616", "99999999999999999999999", "0x10", "1.5"] {
            assert_eq!(parse_u64(bad), None, "{bad}");
        }
        assert_eq!(stat_field("cache 5\ninactive_file 7\ntotal_inactive_file 9\n", "inactive_file"), Some(7));
        assert_eq!(stat_field("inactive_file lots\n", "inactive_file"), None);
    }

    #[test]
    fn meminfo_available_is_read_in_bytes() {
        let t = "MemTotal:       24000000 kB\nMemFree:         1000 kB\nMemAvailable:   12345678 kB\n";
        assert_eq!(meminfo_available(t), Some(12_345_678 * 1024));
        assert_eq!(meminfo_available("MemTotal: 1 kB\n"), None);
        assert_eq!(meminfo_available("MemAvailable: 99999999999999999 kB\n"), None, "overflows as bytes");
        assert_eq!(meminfo_available("MemAvailable: 12 MB\n"), None, "unknown unit");
    }

    #[test]
    fn long_files_are_refused() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("big");
        std::fs::write(&p, vec![b'1'; (MAX_FILE + 1) as usize]).unwrap();
        assert_eq!(read_small(&p), None);
        std::fs::write(&p, b"42\n").unwrap();
        assert_eq!(read_small(&p).as_deref(), Some("42\n"));
    }
}
