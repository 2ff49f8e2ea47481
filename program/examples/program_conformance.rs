//! Runs the program conformance rules over oracle files in the format of
//! `program/testdata/FORMAT.md` (default: the vendored `testdata/cases.jsonl`):
//!
//! ```text
//! cargo run --release -p meshwork-program --example program_conformance -- FILE.jsonl...
//! ```
//!
//! For each case: the program builds with JAX's output specs, its text reads back, and
//! the outputs and `vjp`'s gradients match JAX's within `1e-9 (1 + |want|)` when run by
//! **both** interpreters (the reference and the fast one). Prints each failing case,
//! then `N passed, M failed`; exits 1 if any failed.

#![allow(clippy::print_stdout, clippy::print_stderr, missing_docs)]

#[path = "../tests/it/oracle.rs"]
mod oracle;

use std::process::ExitCode;

fn main() -> ExitCode {
    let mut paths: Vec<String> = std::env::args().skip(1).collect();
    if paths.is_empty() {
        paths.push(concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/cases.jsonl").to_owned());
    }
    let (mut passed, mut failed) = (0usize, 0usize);
    for path in &paths {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("program_conformance: cannot read {path}: {e}");
                return ExitCode::from(2);
            }
        };
        for (n, line) in text.lines().enumerate() {
            let case: serde_json::Value = match serde_json::from_str(line) {
                Ok(c) => c,
                Err(e) => {
                    println!("{path}:{}: invalid JSON: {e}", n + 1);
                    failed += 1;
                    continue;
                }
            };
            // A malformed case is a failure of that case, not a crash of the run.
            let outcome = std::panic::catch_unwind(|| oracle::check_case(&case))
                .unwrap_or_else(|_| Err("the case is malformed".into()));
            match outcome {
                Ok(()) => passed += 1,
                Err(e) => {
                    println!("{path}:{} ({}): {e}", n + 1, case["id"].as_str().unwrap_or("?"));
                    failed += 1;
                }
            }
        }
    }
    println!("{passed} passed, {failed} failed");
    if failed == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}
