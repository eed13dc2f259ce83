//! The `edgerun` command-line tool.
mod alloc;
mod cli;

use std::io::Write;
use std::process::ExitCode;

/// musl's malloc maps and unmaps every large block; the static builds cache them (src/alloc.rs).
#[cfg(target_env = "musl")]
#[global_allocator]
static GLOBAL: alloc::CachingAlloc = alloc::CachingAlloc::new();

/// A panic is a bug: one line on stderr (no backtrace dump), and `main` exits with 1. `annotate`
/// still isolates a panicking stage (it records the item as failed and goes on).
fn install_panic_hook() {
    std::panic::set_hook(Box::new(|info| {
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        let at = info.location().map(|l| format!(" at {}:{}", l.file(), l.line())).unwrap_or_default();
        let _ = writeln!(std::io::stderr(), "edgerun: internal error (please report it): {msg}{at}");
    }));
}

fn main() -> ExitCode {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    alloc::keep_freed_blocks_in_glibc_heap();
    edgerun::device::quiet_candle_barrier_pool();
    install_panic_hook();
    let args = match cli::parse() {
        cli::Parsed::Run(args) => args,
        cli::Parsed::Exit(text, code) => {
            let _ = if code == 0 { writeln!(std::io::stdout(), "{text}") } else { writeln!(std::io::stderr(), "{text}") };
            return ExitCode::from(code);
        }
    };
    match std::panic::catch_unwind(|| cli::run(*args)) {
        Ok(Ok(())) => ExitCode::SUCCESS,
        // The reader of our stdout is gone (`edgerun inspect M | head -1`): end quietly, as grep does.
        Ok(Err(e)) if cli::is_broken_pipe(&e) => ExitCode::SUCCESS,
        Ok(Err(e)) => {
            let _ = writeln!(std::io::stderr(), "edgerun: error: {}", cli::message(&e));
            ExitCode::from(cli::exit_code(&e))
        }
        Err(_) => ExitCode::from(1),
    }
}
