//! What the device can spare right now: on the CPU the smaller of the cgroup's headroom and
//! `MemAvailable`; on CUDA the driver's free memory; on Metal the recommended working set less what
//! is allocated.
use candle_core::Device;

/// Bytes the device can spare now, if it can tell.
pub(crate) fn available_bytes(device: &Device) -> Option<u64> {
    match device {
        Device::Cpu => cpu_available(),
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => d.cuda_stream().context().mem_get_info().ok().map(|(free, _total)| free as u64),
        #[cfg(feature = "metal")]
        Device::Metal(d) => {
            let m = d.device();
            Some((m.recommended_max_working_set_size() as u64).saturating_sub(m.current_allocated_size() as u64))
        }
        #[allow(unreachable_patterns)]
        _ => None,
    }
}

/// `MemAvailable` from `/proc/meminfo`, capped by the cgroup's limit minus its usage (v2 or v1).
pub(crate) fn cpu_available() -> Option<u64> {
    let mem = std::fs::read_to_string("/proc/meminfo").ok().and_then(|t| meminfo_available(&t));
    let cgroup = cgroup_headroom();
    match (mem, cgroup) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// `MemAvailable` (bytes) in a `/proc/meminfo` text.
pub(crate) fn meminfo_available(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
}

fn read_u64(path: &str) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// The cgroup's limit minus its current usage, when a limit is set.
fn cgroup_headroom() -> Option<u64> {
    // cgroup v2 (unified): the process's own group, else the root mount.
    let v2 = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|t| t.lines().find_map(|l| l.strip_prefix("0::").map(str::to_string)))
        .map(|g| format!("/sys/fs/cgroup{}", g.trim_end_matches('/')));
    for dir in v2.into_iter().chain(["/sys/fs/cgroup".to_string()]) {
        if let (Some(max), Some(cur)) = (read_u64(&format!("{dir}/memory.max")), read_u64(&format!("{dir}/memory.current"))) {
            return Some(max.saturating_sub(cur));
        }
    }
    let (max, cur) = (read_u64("/sys/fs/cgroup/memory/memory.limit_in_bytes")?, read_u64("/sys/fs/cgroup/memory/memory.usage_in_bytes")?);
    // v1 reports "no limit" as a huge number.
    (max < 1 << 60).then(|| max.saturating_sub(cur))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_available_is_read_in_bytes() {
        let t = "MemTotal:       24000000 kB\nMemFree:         1000 kB\nMemAvailable:   12345678 kB\n";
        assert_eq!(meminfo_available(t), Some(12_345_678 * 1024));
        assert_eq!(meminfo_available("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn this_machine_reports_some_memory() {
        assert!(cpu_available().is_some_and(|b| b > 0));
    }
}
