//! The `edgerun` command-line tool.
mod alloc;
mod cli;

use std::process::ExitCode;

use clap::Parser;

/// musl's malloc maps and unmaps every large block; the static builds cache them (src/alloc.rs).
#[cfg(target_env = "musl")]
#[global_allocator]
static GLOBAL: alloc::CachingAlloc = alloc::CachingAlloc::new();

fn main() -> ExitCode {
    let args = cli::Cli::parse();
    match cli::run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("edgerun: error: {e:#}");
            ExitCode::from(cli::exit_code(&e))
        }
    }
}
