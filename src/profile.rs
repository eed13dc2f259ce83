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
            eprintln!("[profile] {:<24} {:8.1} ms", self.name, t.elapsed().as_secs_f64() * 1e3);
        }
    }
}
