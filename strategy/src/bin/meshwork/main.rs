//! `meshwork`: train a model on a device mesh, and look at shardings and placements.
//!
//! ```text
//! meshwork train [--mesh 2x2] [--steps 200] [--batch 64] ...   the main job
//! meshwork shard --shape 8,8 --mesh 2x4 --axes a,b --spec "P('a','b')"
//! meshwork reshard --shape 8,8 --mesh 2x4 --axes a,b --from "P('a','b')" --to "P('b')"
//! meshwork place GRAPH.json --devices CPU:0,CPU:1 [--dot] [--explain NODE]
//! ```
//!
//! Errors are one line on stderr naming the flag and the problem, with exit status 2.

// The command line talks to a person.
#![allow(clippy::print_stdout, clippy::print_stderr)]

mod args;
mod inspect;
mod npy;
mod train;

use std::process::ExitCode;

use args::Usage;

const HELP: &str = "\
meshwork — run one model on many devices

usage:
  meshwork train [flags]      train an MLP on a data x model device mesh (the main job)
  meshwork shard [flags]      draw which device holds which block of a sharded array
  meshwork reshard [flags]    the transfer plan between two shardings
  meshwork place GRAPH.json   place a dataflow graph's ops on devices (TensorFlow's rules)
  meshwork help [COMMAND]     this text, or a command's flags

Errors exit with status 2 and one line naming the problem and the flag.
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (command, rest) = match args.split_first() {
        Some((c, rest)) => (c.as_str(), rest),
        None => ("help", &[][..]),
    };
    let wants_help = rest.iter().any(|a| a == "--help" || a == "-h");
    let result = match command {
        "train" if wants_help => {
            print!("{}", train::HELP);
            Ok(())
        }
        "shard" | "reshard" | "place" if wants_help => {
            print!("{}", inspect::HELP);
            Ok(())
        }
        "train" => train::run(rest),
        "shard" => inspect::shard(rest),
        "reshard" => inspect::reshard(rest),
        "place" => inspect::place(rest),
        "help" | "--help" | "-h" => {
            match rest.first().map(String::as_str) {
                Some("train") => print!("{}", train::HELP),
                Some("shard" | "reshard" | "place") => print!("{}", inspect::HELP),
                _ => print!("{HELP}"),
            }
            Ok(())
        }
        other => Err(Usage(format!("unknown command {other:?}; try `meshwork help`"))),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(Usage(message)) => {
            eprintln!("meshwork: error: {message}");
            ExitCode::from(2)
        }
    }
}
