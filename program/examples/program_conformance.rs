//! Runs the program conformance rules over oracle files in the format of
//! `program/testdata/FORMAT.md` (default: the vendored `testdata/cases.jsonl`):
//!
//! ```text
//! cargo run -p meshwork-program --example program_conformance -- \
//!     [--backend interp|xla] [--pjrt-plugin PATH] FILE.jsonl...
//! ```
//!
//! For each case: the program builds with JAX's output specs, its text reads back, and
//! the outputs and `vjp`'s gradients match JAX's within `1e-9 (1 + |want|)` when run by
//! **both** interpreters (the reference and the fast one; `--backend interp`, the
//! default) or by XLA through a PJRT plugin on one device (`--backend xla`; the plugin
//! named by `--pjrt-plugin` or `MESHWORK_PJRT_PLUGIN`). The cases run on every core.
//! Prints each failing case, then `N passed, M failed` as the last line; exits 1 if any
//! failed, 2 on bad flags.

#![allow(clippy::print_stdout, clippy::print_stderr, missing_docs, unsafe_code)]

#[path = "../tests/it/oracle.rs"]
mod oracle;

use std::process::ExitCode;

/// What runs the cases.
enum Backend {
    Interpreters,
    Xla(meshwork_xla::Session),
}

fn main() -> ExitCode {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let (mut backend, mut plugin) = (String::from("interp"), None);
    while args.first().is_some_and(|a| a.starts_with("--")) {
        let flag = args.remove(0);
        let Some(value) = (!args.is_empty()).then(|| args.remove(0)) else {
            eprintln!("program_conformance: {flag} needs a value");
            return ExitCode::from(2);
        };
        match flag.as_str() {
            "--backend" => backend = value,
            "--pjrt-plugin" => plugin = Some(std::path::PathBuf::from(value)),
            _ => {
                eprintln!("program_conformance: unknown flag {flag}");
                return ExitCode::from(2);
            }
        }
    }
    let backend = match backend.as_str() {
        "interp" => Backend::Interpreters,
        "xla" => {
            // XLA's own logging to standard error is silenced unless asked for.
            if std::env::var_os("TF_CPP_MIN_LOG_LEVEL").is_none() {
                // SAFETY: no other thread runs yet (first thing in main).
                unsafe { std::env::set_var("TF_CPP_MIN_LOG_LEVEL", "2") };
            }
            let session = meshwork_xla::find::plugin_path(plugin.as_deref())
                .and_then(|p| meshwork_xla::find::load(&p))
                .and_then(|p| meshwork_xla::Session::new(&p, 1));
            match session {
                Ok(s) => Backend::Xla(s),
                Err(e) => {
                    eprintln!("program_conformance: {e}");
                    return ExitCode::from(2);
                }
            }
        }
        other => {
            eprintln!("program_conformance: --backend is interp or xla, not {other}");
            return ExitCode::from(2);
        }
    };
    let mut paths = args;
    if paths.is_empty() {
        paths.push(concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/cases.jsonl").to_owned());
    }
    let mut cases = Vec::new();
    for path in &paths {
        match std::fs::read_to_string(path) {
            Ok(text) => cases.extend(
                text.lines().enumerate().map(|(n, l)| (path.as_str(), n + 1, l.to_owned())),
            ),
            Err(e) => {
                eprintln!("program_conformance: cannot read {path}: {e}");
                return ExitCode::from(2);
            }
        }
    }
    // The cases are independent: one worker per core takes the next case (compiling
    // through XLA is mostly one thread per program), each failure kept with its place.
    let next = std::sync::atomic::AtomicUsize::new(0);
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get()).min(cases.len());
    let mut failures: Vec<(usize, String)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers.max(1))
            .map(|_| {
                scope.spawn(|| {
                    let mut failed = Vec::new();
                    loop {
                        let k = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some((path, line_no, line)) = cases.get(k) else { break };
                        if let Err(e) = check_line(&backend, line) {
                            failed.push((k, format!("{path}:{line_no}{e}")));
                        }
                    }
                    failed
                })
            })
            .collect();
        // A worker that panicked outside a case (never a case's own panic) ends the
        // run as it ended the worker: its cases are not counted as passed.
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    failures.sort();
    for (_, line) in &failures {
        println!("{line}");
    }
    let (failed, passed) = (failures.len(), cases.len() - failures.len());
    println!("{passed} passed, {failed} failed");
    if failed == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}

/// One case (a line of JSON) on `backend`: `Err` with the case's id and what failed.
fn check_line(backend: &Backend, line: &str) -> Result<(), String> {
    let case: serde_json::Value =
        serde_json::from_str(line).map_err(|e| format!(": invalid JSON: {e}"))?;
    // A malformed case is a failure of that case, not a crash of the run.
    std::panic::catch_unwind(|| match backend {
        Backend::Interpreters => oracle::check_case(&case),
        Backend::Xla(session) => oracle::check_case_with(&case, "xla", &|p, i| {
            session.run(p, i).map_err(|e| e.to_string())
        }),
    })
    .unwrap_or_else(|_| Err("the case is malformed".into()))
    .map_err(|e| format!(" ({}): {e}", case["id"].as_str().unwrap_or("?")))
}
