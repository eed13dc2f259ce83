//! Whether a path lies on a network filesystem (Linux, from `/proc/self/mountinfo`): inotify sees
//! only this machine's writes there, so `backend = "auto"` polls instead.
use std::path::Path;

/// Filesystem types whose files other machines may write.
const NETWORK_FS: &[&str] = &["nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "ceph", "glusterfs", "lustre", "fuse.sshfs", "fuse.s3fs", "afs", "virtiofs", "fuse.glusterfs"];

/// The network filesystem type `path` (canonical) is on, if any.
pub(crate) fn network_fs(path: &Path) -> Option<String> {
    let text = crate::memory::procfs::read_small(Path::new("/proc/self/mountinfo"))?;
    fs_type_of(&text, path).filter(|t| NETWORK_FS.contains(&t.as_str()))
}

/// `\040`-style escapes of mountinfo paths decoded.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)) {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The type of the mount with the longest mount point containing `path`.
fn fs_type_of(mountinfo: &str, path: &Path) -> Option<String> {
    let mut best: Option<(usize, String)> = None;
    for line in mountinfo.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        let (Some(mp), Some(sep)) = (fields.get(4), fields.iter().position(|f| *f == "-")) else { continue };
        let Some(fstype) = fields.get(sep + 1) else { continue };
        let mp = unescape(mp);
        if path.starts_with(&mp) && best.as_ref().is_none_or(|(len, _)| mp.len() >= *len) {
            best = Some((mp.len(), fstype.to_string()));
        }
    }
    best.map(|(_, t)| t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_mount_point_decides() {
        let info = "22 1 8:1 / / rw - ext4 /dev/sda1 rw\n\
                    40 22 0:50 / /mnt/flight\\040data rw - nfs4 host:/x rw\n\
                    41 22 0:51 / /mnt rw - tmpfs tmpfs rw\n";
        assert_eq!(fs_type_of(info, Path::new("/mnt/flight data/a")).as_deref(), Some("nfs4"));
        assert_eq!(fs_type_of(info, Path::new("/mnt/other")).as_deref(), Some("tmpfs"));
        assert_eq!(fs_type_of(info, Path::new("/home")).as_deref(), Some("ext4"));
    }
}
