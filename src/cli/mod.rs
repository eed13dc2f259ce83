//! Command-line parsing (argh) and dispatch.
mod annotate;
mod chm;
mod common;
mod depth;
mod doctor;
mod edges;
mod finetune;
mod forward;
mod inspect;
mod lgatr;
mod quantize;
mod run_inputs;
mod segment;
mod segment_open;
mod tiled;

pub use common::is_broken_pipe;

use argh::FromArgs;

/// Perception and physics models at the edge.
#[derive(FromArgs, Debug)]
pub struct Cli {
    /// print the version and the compiled-in features, then exit
    #[argh(switch, short = 'V')]
    version: bool,
    /// CPU threads for compute (default: Candle's choice, the physical core count); may also be
    /// given after the subcommand
    #[argh(option)]
    threads: Option<usize>,
    #[argh(subcommand)]
    command: Option<Command>,
}

#[derive(FromArgs, Debug)]
#[argh(subcommand)]
enum Command {
    Inspect(inspect::Args),
    Quantize(quantize::Args),
    Forward(forward::Args),
    Depth(depth::Args),
    Edges(edges::Args),
    Doctor(doctor::Args),
    Segment(segment::Args),
    Chm(chm::Args),
    Annotate(annotate::Args),
    Lgatr(lgatr::Args),
    Finetune(finetune::Args),
}

/// What parsing the command line came to.
pub enum Parsed {
    /// A command to run.
    Run(Box<Cli>),
    /// Print this text (help, version) and exit with this code (0 or 2).
    Exit(String, u8),
}

/// `--threads N` (or `--threads=N`) anywhere before a `--` is moved in front of the subcommand, so the
/// option stays global as it always was.
fn hoist_threads(args: Vec<String>) -> Vec<String> {
    let mut front = Vec::new();
    let mut rest = Vec::with_capacity(args.len());
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        if a == "--" {
            rest.push(a);
            rest.extend(it.by_ref());
            break;
        }
        if a == "--threads" {
            front.push(a);
            front.extend(it.next());
        } else if let Some(v) = a.strip_prefix("--threads=") {
            front.push("--threads".to_string());
            front.push(v.to_string());
        } else {
            rest.push(a);
        }
    }
    front.extend(rest);
    front
}

/// Parses the process's arguments. Usage errors exit with 2, as bad input does.
pub fn parse() -> Parsed {
    let mut raw = std::env::args_os();
    let _program = raw.next();
    let mut args = Vec::new();
    for (i, a) in raw.enumerate() {
        match a.into_string() {
            Ok(s) => args.push(s),
            Err(a) => {
                let msg = format!(
                    "edgerun: error: argument {} (`{}`) is not valid UTF-8; rename the file or pass its directory",
                    i + 1,
                    a.to_string_lossy()
                );
                return Parsed::Exit(msg, 2);
            }
        }
    }
    let args = hoist_threads(args);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    match Cli::from_args(&["edgerun"], &refs) {
        Ok(cli) if cli.version => Parsed::Exit(version_text(), 0),
        Ok(cli) if cli.command.is_none() => Parsed::Exit("edgerun: error: give a command (see `edgerun --help`)".into(), 2),
        Ok(cli) => Parsed::Run(Box::new(cli)),
        Err(early) => match early.status {
            Ok(()) => Parsed::Exit(early.output, 0),
            Err(()) => Parsed::Exit(format!("edgerun: error: {}\nRun `edgerun --help` (or `edgerun <command> --help`) for more information.", early.output.trim_end()), 2),
        },
    }
}

fn version_text() -> String {
    format!("edgerun {}", env!("EDGERUN_LONG_VERSION"))
}

/// Runs the parsed command.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    if let Some(n) = cli.threads {
        common::check_threads(n)?;
        edgerun::device::set_threads(n);
    }
    let Some(command) = cli.command else { return Ok(()) };
    match command {
        Command::Inspect(a) => inspect::run(a),
        Command::Quantize(a) => quantize::run(a),
        Command::Forward(a) => forward::run(a),
        Command::Depth(a) => depth::run(a),
        Command::Edges(a) => edges::run(a),
        Command::Doctor(a) => doctor::run(a),
        Command::Segment(a) => segment::run(a),
        Command::Annotate(a) => annotate::run(a),
        Command::Lgatr(a) => lgatr::run(a),
        Command::Chm(a) => chm::run(a),
        Command::Finetune(a) => finetune::run(a),
    }
}

/// Exit codes: 2 bad input/config, 3 device unavailable, 4 I/O error on a named file, 1 anything else.
pub fn exit_code(e: &anyhow::Error) -> u8 {
    use edgerun::Error;
    for cause in e.chain() {
        if let Some(err) = cause.downcast_ref::<Error>() {
            return match err {
                Error::BadFile { .. } | Error::BadTensor { .. } | Error::Config(_) | Error::Input(_) => 2,
                Error::Device(_) => 3,
                Error::Io { .. } => 4,
                Error::Candle(_) | Error::OutOfMemory(_) => 1,
            };
        }
        if cause.downcast_ref::<common::UsageError>().is_some() {
            return 2;
        }
    }
    1
}

/// The message of an error: its causes joined with `: `, each printed once (a cause whose text the
/// message already holds, such as an I/O error an outer error quotes, is not repeated).
pub fn message(e: &anyhow::Error) -> String {
    let mut msg = String::new();
    for cause in e.chain() {
        let text = match cause.downcast_ref::<edgerun::Error>() {
            Some(edgerun::Error::Candle(c)) => edgerun::Error::candle_message(c),
            _ => cause.to_string().trim().to_string(),
        };
        if text.is_empty() || msg.contains(&text) {
            continue;
        }
        if !msg.is_empty() {
            msg.push_str(": ");
        }
        msg.push_str(&text);
    }
    msg
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &[&str]) -> Vec<String> {
        s.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn threads_is_hoisted_from_anywhere_before_double_dash() {
        assert_eq!(hoist_threads(v(&["depth", "--threads", "2", "x"])), v(&["--threads", "2", "depth", "x"]));
        assert_eq!(hoist_threads(v(&["depth", "--threads=3"])), v(&["--threads", "3", "depth"]));
        assert_eq!(hoist_threads(v(&["depth", "--", "--threads", "2"])), v(&["depth", "--", "--threads", "2"]));
    }

    #[test]
    fn message_prints_each_cause_once() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "No such file or directory (os error 2)");
        let e = anyhow::Error::new(edgerun::Error::io("/nonexistent", io)).context("cannot load depth model /nonexistent");
        let m = message(&e);
        assert_eq!(m.matches("os error 2").count(), 1, "{m}");
        assert!(m.starts_with("cannot load depth model /nonexistent: /nonexistent: "), "{m}");
    }
}
