//! Feedback on stderr for every command that runs over many inputs: a progress bar with rate and ETA
//! on a terminal, plain periodic lines otherwise, and log lines that do not break the bar.
use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

static BAR_ON_SCREEN: AtomicBool = AtomicBool::new(false);

/// Prints `<label>: <msg>` on stderr without breaking the progress bar.
pub fn log(label: &str, msg: &str) {
    let mut e = std::io::stderr().lock();
    if BAR_ON_SCREEN.swap(false, Ordering::Relaxed) {
        let _ = write!(e, "\r\x1b[2K");
    }
    let _ = writeln!(e, "{label}: {msg}");
}

/// Shows a one-line status of a long-running command: redrawn in place (bar) or printed (lines).
pub(crate) fn status_line(label: &str, mode: Mode, text: &str) {
    let mut e = std::io::stderr().lock();
    match mode {
        Mode::Bar => {
            let _ = write!(e, "\r\x1b[2K{label} {text}");
            let _ = e.flush();
            BAR_ON_SCREEN.store(true, Ordering::Relaxed);
        }
        Mode::Lines => {
            let _ = writeln!(e, "{label}: {text}");
        }
        Mode::None => {}
    }
}

/// Ends a status line drawn in place.
pub(crate) fn end_status_line(mode: Mode) {
    if mode == Mode::Bar && BAR_ON_SCREEN.swap(false, Ordering::Relaxed) {
        let _ = writeln!(std::io::stderr());
    }
}

/// How progress is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// A redrawn bar (terminals).
    Bar,
    /// A line every interval.
    Lines,
    /// Nothing.
    None,
}

impl Mode {
    /// From the config value (`auto` picks by whether stderr is a terminal).
    pub(crate) fn from_config(s: &str) -> Mode {
        match s {
            "bar" => Mode::Bar,
            "lines" => Mode::Lines,
            "none" => Mode::None,
            _ if std::io::stderr().is_terminal() => Mode::Bar,
            _ => Mode::Lines,
        }
    }

    /// Parses `auto`, `bar`, `lines` or `none`.
    pub fn parse(s: &str) -> Option<Mode> {
        matches!(s, "auto" | "bar" | "lines" | "none").then(|| Mode::from_config(s))
    }
}

fn hms(s: f64) -> String {
    if !s.is_finite() {
        return "?".into();
    }
    let s = s.round() as u64;
    if s >= 3600 {
        format!("{}h{:02}m", s / 3600, s / 60 % 60)
    } else if s >= 60 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        format!("{s}s")
    }
}

/// Counts finished items and draws progress.
pub struct Progress {
    label: &'static str,
    mode: Mode,
    total: usize,
    done: usize,
    failed: usize,
    start: Instant,
    last: Instant,
    interval: Duration,
}

impl Progress {
    /// Progress over `total` items, its lines prefixed with `label` (the command).
    pub fn new(label: &'static str, mode: Mode, total: usize, interval: Duration) -> Self {
        let now = Instant::now();
        Progress { label, mode, total, done: 0, failed: 0, start: now, last: now, interval }
    }

    /// One item finished; `failed` if it (or any of its stages) failed.
    pub fn item_done(&mut self, failed: bool) {
        self.done += 1;
        self.failed += failed as usize;
    }

    fn line(&self) -> String {
        let el = self.start.elapsed().as_secs_f64();
        let rate = if el > 0.0 { self.done as f64 / el } else { 0.0 };
        let eta = if rate > 0.0 { (self.total - self.done.min(self.total)) as f64 / rate } else { f64::INFINITY };
        let pct = if self.total > 0 { 100.0 * self.done as f64 / self.total as f64 } else { 100.0 };
        let failed = if self.failed > 0 { format!(", {} failed", self.failed) } else { String::new() };
        match self.mode {
            Mode::Bar => {
                const W: usize = 28;
                let fill = (W * self.done.min(self.total)).checked_div(self.total).unwrap_or(W);
                format!(
                    "[{}{}] {}/{} {pct:.0}% {rate:.2} img/s {} ETA {}{failed}",
                    "#".repeat(fill),
                    ".".repeat(W - fill),
                    self.done,
                    self.total,
                    hms(el),
                    hms(eta)
                )
            }
            _ => format!("{}/{} items ({pct:.1}%), {rate:.2} img/s, elapsed {}, ETA {}{failed}", self.done, self.total, hms(el), hms(eta)),
        }
    }

    /// Redraws when due (bar: 5 times a second; lines: every interval).
    pub fn tick(&mut self) {
        let every = match self.mode {
            Mode::None => return,
            Mode::Bar => Duration::from_millis(200),
            Mode::Lines => self.interval,
        };
        if self.last.elapsed() < every {
            return;
        }
        self.last = Instant::now();
        self.draw();
    }

    fn draw(&self) {
        let mut e = std::io::stderr().lock();
        match self.mode {
            Mode::Bar => {
                let _ = write!(e, "\r\x1b[2K{} {}", self.label, self.line());
                let _ = e.flush();
                BAR_ON_SCREEN.store(true, Ordering::Relaxed);
            }
            Mode::Lines => {
                let _ = writeln!(e, "{}: {}", self.label, self.line());
            }
            Mode::None => {}
        }
    }

    /// Final redraw (ends the bar's line).
    pub fn finish(&mut self) {
        if self.mode == Mode::Bar {
            self.draw();
            let _ = writeln!(std::io::stderr());
            BAR_ON_SCREEN.store(false, Ordering::Relaxed);
        }
    }
}

