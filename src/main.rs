//! The `edgerun` command-line tool.
mod cli;

use std::process::ExitCode;

use clap::Parser;

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
