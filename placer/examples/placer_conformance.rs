//! Replays TF placer oracle cases:
//! `cargo run --release -p meshwork-placer --example placer_conformance -- FILE.jsonl...`
//! (default: the vendored oracle). Prints each failing case, then `N passed, M failed`;
//! exits 1 if any failed.

#![allow(clippy::print_stdout, clippy::print_stderr, missing_docs)]

#[path = "../tests/it/conformance.rs"]
mod conformance;

use std::process::ExitCode;

fn main() -> ExitCode {
    let mut paths: Vec<String> = std::env::args().skip(1).collect();
    if paths.is_empty() {
        paths.push(concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/oracle/cases.jsonl").to_owned());
    }
    let (mut passed, mut failed) = (0usize, 0usize);
    for path in &paths {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("conformance: cannot read {path}: {e}");
                return ExitCode::from(2);
            }
        };
        let mut lines = text.lines();
        let registry = match lines.next().map(conformance::registry) {
            Some(Ok(r)) => r,
            Some(Err(e)) => {
                eprintln!("conformance: {path}: {e}");
                return ExitCode::from(2);
            }
            None => continue,
        };
        for (n, line) in lines.enumerate() {
            let bad = conformance::check(&registry, line);
            if bad.is_empty() {
                passed += 1;
            } else {
                failed += 1;
                println!("FAIL {path}:{}: {}", n + 2, bad.join("; "));
            }
        }
    }
    println!("{passed} passed, {failed} failed");
    if failed == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}
