//! Options, checks and helpers shared by the subcommands.
use std::io::Write;

use candle_core::{DType, Device};
use edgerun::device::{check_dtype, parse_device, parse_dtype};

/// A command line that is wrong as written (missing or conflicting arguments), or a run in which
/// some inputs failed: exit code 2.
#[derive(Debug)]
pub struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// Fails with a [`UsageError`] (exit code 2) unless `cond` holds.
pub fn usage(cond: bool, msg: impl FnOnce() -> String) -> anyhow::Result<()> {
    if cond {
        Ok(())
    } else {
        Err(UsageError(msg()).into())
    }
}

/// Most CPU threads `--threads` accepts.
pub const MAX_THREADS: usize = 256;

/// Checks `--threads` (1..=[`MAX_THREADS`]).
pub fn check_threads(n: usize) -> anyhow::Result<()> {
    usage((1..=MAX_THREADS).contains(&n), || format!("--threads {n}: expected 1 to {MAX_THREADS}"))
}

/// Checks a count flag such as `--batch` or `--repeat` (`min..=max`).
pub fn check_count(flag: &str, n: usize, min: usize, max: usize) -> anyhow::Result<()> {
    usage((min..=max).contains(&n), || format!("{flag} {n}: expected {min} to {max}"))
}

/// The parsed `--device` and `--dtype`, checked to work together (exit code 3 if not).
pub fn compute(device: &str, dtype: &str) -> anyhow::Result<(Device, DType)> {
    let (device, dtype) = (parse_device(device)?, parse_dtype(dtype)?);
    check_dtype(&device, dtype)?;
    Ok((device, dtype))
}

/// Writes one line to stdout. A closed pipe (`edgerun inspect M | head -1`) ends the command
/// quietly (see [`is_broken_pipe`]); any other failure (`> /dev/full`) is an I/O error on `<stdout>`.
pub fn write_stdout(args: std::fmt::Arguments) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_fmt(args).and_then(|()| out.write_all(b"\n")).and_then(|()| out.flush()).map_err(|e| edgerun::Error::io("<stdout>", e).into())
}

/// Whether `e` comes from writing to a pipe whose reader has gone.
pub fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| match c.downcast_ref::<edgerun::Error>() {
        Some(edgerun::Error::Io { source, .. }) => source.kind() == std::io::ErrorKind::BrokenPipe,
        _ => c.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe),
    })
}

/// `println!` that returns an error instead of panicking when stdout fails.
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::cli::common::write_stdout(format_args!($($arg)*))?
    };
}
pub(crate) use outln;
