//! `meshwork`: train a model on a CPU device mesh, and look at shardings, placements
//! and partitioned training steps.
//!
//! ```text
//! meshwork train [--mesh 2x2] [--steps 200] [--batch 64] ...   the main job
//! meshwork train --model transformer|cnn ...                   the other models
//! meshwork inspect --model transformer --mesh 1x2              a partitioned step
//! meshwork shard --shape 8,8 --mesh 2x4 --axes a,b --spec "P('a','b')"
//! meshwork reshard --shape 8,8 --mesh 2x4 --axes a,b --from "P('a','b')" --to "P('b')"
//! meshwork place GRAPH.json --devices CPU:0,CPU:1 [--dot] [--explain NODE]
//! ```
//!
//! A thin crate: flags are parsed with `clap` into `meshwork-train`'s `Config` (or the
//! tools' arguments), and everything else is the libraries'. Errors are one line on
//! stderr naming the flag and the problem, with exit status 2 (bad input), 1 (a
//! training run that failed) or 130 (interrupted); a reader that closes standard
//! output ends the command quietly.

// The flags' doc comments are their `--help` text, written for people: `[rows,
// classes]` there is a shape, not an intra-doc link.
#![allow(rustdoc::broken_intra_doc_links)]

mod args;
mod out;
mod tools;
mod train;

use std::ffi::OsString;
use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches};

use crate::args::{Cli, Command};
use crate::out::{Exit, note};

fn main() -> ExitCode {
    quiet_xla();
    // Every rank of an MPI job parses the same arguments: process 0 alone speaks.
    if cfg!(feature = "mpi") && train::launcher_rank().is_some_and(|r| r > 0) {
        out::silence();
    }
    match run(std::env::args_os().collect()) {
        Ok(()) | Err(Exit::Closed) => ExitCode::SUCCESS,
        Err(Exit::Usage(message)) => {
            note(format_args!("meshwork: error: {}", out::readable(&message)));
            ExitCode::from(2)
        }
        Err(Exit::Failed(message)) => {
            note(format_args!("meshwork: error: {}", out::readable(&message)));
            ExitCode::from(1)
        }
        Err(Exit::Interrupted) => ExitCode::from(130),
    }
}

/// XLA's own logging (a PJRT plugin's, to standard error) off unless the user asked for
/// it with `TF_CPP_MIN_LOG_LEVEL`: meshwork's lines are what a run prints.
#[allow(unsafe_code)]
fn quiet_xla() {
    if std::env::var_os("TF_CPP_MIN_LOG_LEVEL").is_none() {
        // SAFETY: the first thing `main` does, before any other thread exists, so no
        // thread reads the environment while it changes.
        unsafe { std::env::set_var("TF_CPP_MIN_LOG_LEVEL", "2") };
    }
}

/// Every argument as UTF-8 (meshwork takes UTF-8 arguments and paths).
fn utf8(argv: Vec<OsString>) -> Result<Vec<String>, Exit> {
    argv.into_iter()
        .enumerate()
        .map(|(k, a)| {
            a.into_string().map_err(|a| {
                Exit::Usage(format!(
                    "argument {k} ({:?}) is not valid UTF-8; meshwork takes UTF-8 arguments and paths",
                    a.to_string_lossy()
                ))
            })
        })
        .collect()
}

/// Parses `argv` (the program name first) and runs its command.
fn run(argv: Vec<OsString>) -> Result<(), Exit> {
    let argv = utf8(argv)?;
    // `help COMMAND [--model M]` is `COMMAND --help [--model M]`.
    let argv = match argv.get(1).map(String::as_str) {
        Some("help") => {
            let rest = &argv[2..];
            let topics: Vec<&String> = without_model(rest);
            match topics.as_slice() {
                [] => vec![argv[0].clone(), "--help".into()],
                [topic] if args::commands().contains(topic) => {
                    let mut a = vec![argv[0].clone(), (*topic).clone(), "--help".into()];
                    a.extend(rest.iter().filter(|r| !topics.contains(r)).cloned());
                    a
                }
                [topic] => {
                    return Err(Exit::Usage(format!(
                        "no help on {topic:?}; the commands are {}",
                        args::commands().join(", ")
                    )));
                }
                [_, extra, ..] => {
                    return Err(Exit::Usage(format!(
                        "help takes one command ({extra:?} is extra)"
                    )));
                }
            }
        }
        _ => argv,
    };
    let model = args::model_named(&argv);
    let notes = args::train_notes(model);
    let command = Cli::command()
        .mut_subcommand("train", |c| c.after_help(notes.clone()).after_long_help(notes));
    let matches = match command.try_get_matches_from(&argv) {
        Ok(m) => m,
        Err(e) => return args::clap_exit(e, &argv),
    };
    let cli = Cli::from_arg_matches(&matches).map_err(|e| Exit::Usage(args::one_line(&e)))?;
    match cli.command {
        None => out::out(format_args!("{}", Cli::command().render_long_help())),
        Some(Command::Train(a)) => train::run(&a),
        Some(Command::Inspect(a)) => {
            let config = a.config()?;
            let text = if a.target.is_some() {
                meshwork_train::inspect_target(&config, a.json, a.optimized_hlo.as_deref())
            } else if a.json {
                meshwork_train::inspect_json(&config)
            } else {
                meshwork_train::inspect(&config)
            }
            .map_err(train::exit)?;
            out::out(format_args!("{text}"))
        }
        Some(Command::Generate(a)) => {
            // --logits names a new file in a folder that is there, known before the work.
            if let Some(path) = &a.logits {
                let parent = path.parent().filter(|p| !p.as_os_str().is_empty());
                if std::fs::symlink_metadata(path).is_ok() {
                    return Err(Exit::Usage(format!(
                        "--logits: {} exists; meshwork writes only new files here",
                        path.display()
                    )));
                }
                if parent.is_some_and(|p| !p.is_dir()) {
                    return Err(Exit::Usage(format!(
                        "--logits: {} is not in a folder that exists",
                        path.display()
                    )));
                }
            }
            let got = meshwork_train::generate::generate(&a.config()?).map_err(train::exit)?;
            for w in &got.warnings {
                note(format_args!("meshwork generate: warning: {}", out::readable(w)));
            }
            if let Some(path) = &a.logits {
                meshwork_train::files::write_new(path, &got.logits_npy()).map_err(|e| {
                    Exit::Usage(format!("--logits: cannot write {}: {e}", path.display()))
                })?;
            }
            let text = if a.json {
                let mut json = serde_json::json!({"prompt_ids": got.prompt_ids, "ids": got.ids});
                if let Some(t) = &got.text {
                    json["text"] = t.clone().into();
                }
                format!("{json}\n")
            } else if let Some(t) = &got.text {
                format!("{t}\n")
            } else {
                let ids: Vec<String> = got.ids.iter().map(i64::to_string).collect();
                format!("{}\n", ids.join(" "))
            };
            out::out(format_args!("{text}"))
        }
        Some(Command::Eval(a)) => {
            let e = meshwork_train::evaluate(&a.train.config()?).map_err(train::exit)?;
            let text = if a.json {
                let json = serde_json::json!({
                    "loss": e.loss, "perplexity": e.perplexity, "tokens": e.tokens,
                });
                format!("{json}\n")
            } else {
                format!("loss {}  perplexity {}  tokens {}\n", e.loss, e.perplexity, e.tokens)
            };
            out::out(format_args!("{text}"))
        }
        Some(Command::Export(a)) => {
            meshwork_train::export(&a.config()).map_err(train::exit)?;
            let written: Vec<String> =
                [&a.hf, &a.lora].into_iter().flatten().map(|d| d.display().to_string()).collect();
            out::out(format_args!("wrote {}\n", written.join(" and ")))
        }
        Some(Command::Tokenize(a)) => {
            let n = meshwork_train::tokenize::tokenize_to(
                &a.text,
                &a.tokenizer,
                a.seq,
                &a.out,
                a.max_memory,
            )
            .map_err(train::exit)?;
            out::out(format_args!(
                "wrote {n} rows of {} tokens to {}\n",
                a.seq + 1,
                a.out.display()
            ))
        }
        Some(Command::Shard(a)) => tools::shard(&a),
        Some(Command::Reshard(a)) => tools::reshard(&a),
        Some(Command::Place(a)) => tools::place(&a),
        Some(Command::Version) => {
            out::out(format_args!("meshwork {}\n", env!("CARGO_PKG_VERSION")))
        }
    }
}

/// `args` without a `--model X` or `--model=X` (`help train --model cnn`).
fn without_model(args: &[String]) -> Vec<&String> {
    let mut out = Vec::with_capacity(args.len());
    let mut skip = false;
    for a in args {
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
