//! Opt-in stage timing: set `EDGERUN_PROFILE=1` to print how long each model stage takes.
use std::sync::OnceLock;
use std::time::Instant;

fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("EDGERUN_PROFILE").is_some_and(|v| v != "0"))
}

/// Times a stage from creation to drop and prints it on stderr when profiling is on.
pub(crate) struct Span {
    name: &'static str,
    start: Option<Instant>,
}

impl Span {
    /// Starts timing `name`.
    pub(crate) fn new(name: &'static str) -> Self {
        Span { name, start: enabled().then(Instant::now) }
    }
}

impl Drop for Span {
    fn drop(&mut self) {
        if let Some(t) = self.start {
            eprintln!("[profile] {:<24} {:8.1} ms{}", self.name, t.elapsed().as_secs_f64() * 1e3, peak_rss());
        }
    }
}

/// `  RSS N MiB (peak M MiB)`: the process's resident memory now and its high-water mark so far,
/// where the system tells them.
fn peak_rss() -> String {
    let Some(status) = crate::memory::procfs::read_small(std::path::Path::new("/proc/self/status")) else { return String::new() };
    let kib = |key: &str| status.lines().find_map(|l| l.strip_prefix(key).and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok()));
    match (kib("VmRSS:"), kib("VmHWM:")) {
        (Some(now), Some(peak)) => format!("  RSS {} MiB (peak {} MiB)", now / 1024, peak / 1024),
        _ => String::new(),
    }
}

/// Time totals by op name since the last [`print_tallies`] (training steps' per-op profile).
static TALLIES: std::sync::Mutex<Vec<(&'static str, u32, f64)>> = std::sync::Mutex::new(Vec::new());

/// Runs `f`, adding its wall time to the tally of `name` when profiling is on.
pub(crate) fn tally<R>(name: &'static str, f: impl FnOnce() -> R) -> R {
    if !enabled() {
        return f();
    }
    let start = Instant::now();
    let r = f();
    let ms = start.elapsed().as_secs_f64() * 1e3;
    if let Ok(mut t) = TALLIES.lock() {
        match t.iter_mut().find(|(n, _, _)| *n == name) {
            Some(entry) => {
                entry.1 += 1;
                entry.2 += ms;
            }
            None => t.push((name, 1, ms)),
        }
    }
    r
}

/// Prints the tallies under `title` (most time first) on stderr and clears them, when profiling is on.
pub(crate) fn print_tallies(title: &str) {
    if !enabled() {
        return;
    }
    let Ok(mut t) = TALLIES.lock() else { return };
    t.sort_by(|a, b| b.2.total_cmp(&a.2));
    eprintln!("[profile] {title}{}", peak_rss());
    for (name, count, ms) in t.drain(..) {
        eprintln!("[profile]   {name:<34} {count:5}× {ms:9.1} ms");
    }
}
