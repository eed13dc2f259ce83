//! What the device can spare right now, and where that figure came from: on the CPU the smallest of
//! `MemAvailable` and the headroom under every cgroup limit that applies ([`super::cgroup`]); on CUDA
//! the driver's free memory, capped the same way when the GPU's memory is the system's (an
//! integrated GPU, as on a Jetson); on Metal the recommended working set less what is allocated.
use std::path::Path;

use candle_core::Device;

use super::cgroup::{limits, Headroom};
use super::procfs::{meminfo_available, mib, read_small};

/// What a device can spare and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Available {
    /// Bytes the device can spare now.
    pub bytes: u64,
    /// Where the figure came from (the smallest of those looked at).
    pub source: String,
    /// The other figures looked at, and what was ignored with the reason.
    pub others: Vec<String>,
}

impl Available {
    /// The smallest of `figures` (`None` when there is none); `ignored` joins the others.
    fn smallest(figures: Vec<Headroom>, ignored: Vec<String>) -> Option<Available> {
        let at = figures.iter().enumerate().min_by_key(|(_, h)| h.bytes).map(|(i, _)| i)?;
        let mut others: Vec<String> = Vec::new();
        let mut chosen = None;
        for (i, h) in figures.into_iter().enumerate() {
            if i == at {
                chosen = Some(h);
            } else {
                others.push(format!("{} spare: {}", mib(h.bytes), h.source));
            }
        }
        others.extend(ignored.into_iter().map(|w| format!("ignored: {w}")));
        chosen.map(|h| Available { bytes: h.bytes, source: h.source, others })
    }
}

/// What `device` can spare now, if it can tell.
pub(crate) fn available(device: &Device) -> Option<Available> {
    match device {
        Device::Cpu => cpu_available(),
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => cuda_available(d),
        #[cfg(feature = "metal")]
        Device::Metal(d) => {
            let m = d.device();
            let (set, used) = (m.recommended_max_working_set_size() as u64, m.current_allocated_size() as u64);
            Some(Available { bytes: set.saturating_sub(used), source: format!("Metal: recommended working set {} less {} allocated", mib(set), mib(used)), others: vec![] })
        }
        #[allow(unreachable_patterns)]
        _ => None,
    }
}

/// The driver's free memory; on an integrated GPU (unified memory) no more than the CPU can spare.
#[cfg(feature = "cuda")]
fn cuda_available(d: &candle_core::CudaDevice) -> Option<Available> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
    let stream = d.cuda_stream();
    let ctx = stream.context();
    let (free, total) = ctx.mem_get_info().ok()?;
    let gpu = Headroom { bytes: free as u64, source: format!("CUDA driver: {} free of {}", mib(free as u64), mib(total as u64)) };
    let integrated = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_INTEGRATED).is_ok_and(|v| v != 0);
    if !integrated {
        return Available::smallest(vec![gpu], vec![]);
    }
    // The GPU allocates from the system's memory: the cgroup limits and MemAvailable bind too.
    let mut figures = vec![gpu];
    let mut ignored = vec!["the GPU is integrated (unified memory): the system's limits apply to it".to_string()];
    if let Some(cpu) = cpu_available() {
        figures.push(Headroom { bytes: cpu.bytes, source: cpu.source });
        ignored.extend(cpu.others);
    }
    Available::smallest(figures, ignored)
}

/// The machine's memory (`MemTotal` in `/proc/meminfo`), in bytes, when it can be read.
pub fn mem_total() -> Option<u64> {
    let text = read_small(Path::new("/proc/meminfo"))?;
    super::procfs::stat_field(&text, "MemTotal:")?.checked_mul(1024)
}

/// What the CPU can spare: the smallest of `MemAvailable` and every cgroup limit's headroom.
pub fn cpu_available() -> Option<Available> {
    cpu_available_at(Path::new("/"))
}

/// [`cpu_available`] reading `/proc` and the cgroup mounts under `root` (a fake tree in tests).
pub fn cpu_available_at(root: &Path) -> Option<Available> {
    let mut l = limits(root);
    match read_small(&root.join("proc/meminfo")).map(|t| meminfo_available(&t)) {
        Some(Some(b)) => l.limits.push(Headroom { bytes: b, source: format!("MemAvailable (/proc/meminfo) {}", mib(b)) }),
        Some(None) => l.ignored.push("/proc/meminfo: no readable MemAvailable".into()),
        None => l.ignored.push("/proc/meminfo: unreadable".into()),
    }
    Available::smallest(l.limits, l.ignored)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_smallest_figure_wins_and_the_others_are_listed() {
        let t = tempfile::tempdir().unwrap();
        let w = |rel: &str, text: &str| {
            let p = t.path().join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        };
        w("proc/meminfo", "MemTotal: 24000000 kB\nMemAvailable: 20000000 kB\n");
        w("proc/self/cgroup", "4:memory:/job\n");
        w("proc/self/mountinfo", "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n");
        w("sys/fs/cgroup/memory/job/memory.limit_in_bytes", &format!("{}\n", 700u64 << 20));
        w("sys/fs/cgroup/memory/job/memory.usage_in_bytes", &format!("{}\n", 100u64 << 20));
        let a = cpu_available_at(t.path()).unwrap();
        assert_eq!(a.bytes, 600 << 20);
        assert!(a.source.starts_with("cgroup v1 /job: limit 700 MiB"), "{a:?}");
        assert!(a.others.iter().any(|o| o.contains("MemAvailable")), "{a:?}");
        // Without the group's files MemAvailable is what is left.
        std::fs::remove_file(t.path().join("sys/fs/cgroup/memory/job/memory.limit_in_bytes")).unwrap();
        let a = cpu_available_at(t.path()).unwrap();
        assert_eq!((a.bytes, a.source.as_str()), (20_000_000 * 1024, "MemAvailable (/proc/meminfo) 19531 MiB"));
        // Nothing readable at all: no figure, no panic.
        assert_eq!(cpu_available_at(&t.path().join("nowhere")), None);
    }

    #[test]
    fn this_machine_reports_some_memory() {
        assert!(cpu_available().is_some_and(|a| a.bytes > 0));
    }
}
