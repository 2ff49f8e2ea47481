//! `meshwork`: train a model on a device mesh, and look at shardings and placements.
//!
//! ```text
//! meshwork train [--mesh 2x2] [--steps 200] [--batch 64] ...   the main job
//! meshwork shard --shape 8,8 --mesh 2x4 --axes a,b --spec "P('a','b')"
//! meshwork reshard --shape 8,8 --mesh 2x4 --axes a,b --from "P('a','b')" --to "P('b')"
//! meshwork place GRAPH.json --devices CPU:0,CPU:1 [--dot] [--explain NODE]
//! ```
//!
//! Errors are one line on stderr naming the flag and the problem, with exit status 2
//! (bad input), 1 (a training run that failed) or 130 (interrupted); a reader that
//! closes standard output ends the command quietly.

// The command line talks to a person.
#![allow(clippy::print_stdout, clippy::print_stderr)]

mod args;
mod cnn;
mod inspect;
mod lm;
mod npy;
mod train;

use std::process::ExitCode;

use args::{Exit, note, out};

const HELP: &str = "\
meshwork — run one model on many devices

usage:
  meshwork train [flags]      train an MLP on a data x model device mesh (the main job);
                              --model transformer|cnn|mlp trains the reference
                              transformer, a CNN, or the MLP through the same trainer
  meshwork shard [flags]      draw which device holds which block of a sharded array
  meshwork reshard [flags]    the transfer plan between two shardings
  meshwork place GRAPH.json   place a dataflow graph's ops on devices (TensorFlow's rules)
  meshwork inspect --model transformer --mesh DxM
                              the transformer's training step as each device runs it
  meshwork help [COMMAND]     this text, or a command's flags
  meshwork --version          the version

Bad input exits with status 2 and one line naming the problem and the flag; a failed
training run exits with 1, an interrupted one (Ctrl-C, SIGTERM) with 130.
";

fn main() -> ExitCode {
    let result = arguments().and_then(|args| dispatch(&args));
    match result {
        Ok(()) | Err(Exit::Closed) => ExitCode::SUCCESS,
        Err(Exit::Usage(message)) => {
            note(format_args!("meshwork: error: {message}"));
            ExitCode::from(2)
        }
        Err(Exit::Failed(message)) => {
            note(format_args!("meshwork: error: {message}"));
            ExitCode::from(1)
        }
        Err(Exit::Interrupted) => ExitCode::from(130),
    }
}

/// The arguments after the program name; each must be UTF-8.
fn arguments() -> Result<Vec<String>, Exit> {
    std::env::args_os()
        .skip(1)
        .enumerate()
        .map(|(k, a)| {
            a.into_string().map_err(|a| {
                Exit::Usage(format!(
                    "argument {} ({:?}) is not valid UTF-8; meshwork takes UTF-8 arguments and paths",
                    k + 1,
                    a.to_string_lossy()
                ))
            })
        })
        .collect()
}

/// `train`'s `--model` (default `mlp`): `mlp`, `transformer` or `cnn`.
fn train_model(rest: &[String]) -> Result<&str, Exit> {
    let mut model = "mlp";
    for (k, a) in rest.iter().enumerate() {
        if let Some(v) = a.strip_prefix("--model=") {
            model = v;
        } else if a == "--model" {
            model = rest.get(k + 1).map_or("", String::as_str);
        }
    }
    match model {
        "mlp" | "transformer" | "cnn" => Ok(model),
        other => Err(Exit::Usage(format!("--model {other:?} is not mlp, transformer or cnn"))),
    }
}

/// `rest` without its `--model X` or `--model=X` (`help train --model cnn`).
fn without_model(rest: &[String]) -> Vec<&String> {
    let mut out = Vec::with_capacity(rest.len());
    let mut skip = false;
    for a in rest {
        if std::mem::take(&mut skip) || a.starts_with("--model=") {
            continue;
        }
        if a == "--model" {
            skip = true;
            continue;
        }
        out.push(a);
    }
    out
}

fn dispatch(args: &[String]) -> Result<(), Exit> {
    let (command, rest) = match args.split_first() {
        Some((c, rest)) => (c.as_str(), rest),
        None => ("help", &[][..]),
    };
    let wants_help = rest.iter().any(|a| a == "--help" || a == "-h");
    let model = train_model(rest)?;
    match command {
        "train" if wants_help && model == "transformer" => out(format_args!("{}", lm::HELP)),
        "train" if wants_help && model == "cnn" => out(format_args!("{}", cnn::HELP)),
        "train" if model == "cnn" => lm::run(rest),
        "train" if wants_help => out(format_args!("{}", train::HELP)),
        "train" if model == "transformer" => lm::run(rest),
        // `--model mlp` named: the MLP through the program layer's trainer (every
        // training flag); without `--model`, the main job's own path.
        "train" if rest.iter().any(|a| a == "--model" || a.starts_with("--model=")) => {
            lm::run(rest)
        }
        "inspect" if wants_help => out(format_args!("{}", lm::INSPECT_HELP)),
        "inspect" if model == "transformer" => lm::inspect(rest),
        "inspect" => Err(Exit::Usage("inspect needs --model transformer".into())),
        "shard" | "reshard" | "place" if wants_help => out(format_args!("{}", inspect::HELP)),
        "train" => train::run(rest),
        "shard" => inspect::shard(rest),
        "reshard" => inspect::reshard(rest),
        "place" => inspect::place(rest),
        "--version" | "-V" | "version" => {
            if let Some(extra) = rest.first() {
                return Err(Exit::Usage(format!("version takes no argument ({extra:?})")));
            }
            out(format_args!("meshwork {}\n", env!("CARGO_PKG_VERSION")))
        }
        "help" | "--help" | "-h" => match without_model(rest).as_slice() {
            [] => out(format_args!("{HELP}")),
            [topic] => match topic.as_str() {
                "train" if model == "transformer" => out(format_args!("{}", lm::HELP)),
                "train" if model == "cnn" => out(format_args!("{}", cnn::HELP)),
                "train" => out(format_args!("{}", train::HELP)),
                "inspect" => out(format_args!("{}", lm::INSPECT_HELP)),
                "shard" | "reshard" | "place" => out(format_args!("{}", inspect::HELP)),
                other => Err(Exit::Usage(format!(
                    "no help on {other:?}; the commands are train, inspect, shard, reshard and place"
                ))),
            },
            [_, extra, ..] => {
                Err(Exit::Usage(format!("help takes one command ({extra:?} is extra)")))
            }
        },
        other => Err(Exit::Usage(format!("unknown command {other:?}; try `meshwork help`"))),
    }
}
