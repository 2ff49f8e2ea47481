//! Runs the sharding conformance rules over oracle files:
//! `cargo run --release -p meshwork-sharding --example sharding_conformance -- FILE.jsonl...`
//! Prints each failing case, then `N passed, M failed`; exits 1 if any failed.

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
        for (n, line) in text.lines().enumerate() {
            let rec: serde_json::Value = match serde_json::from_str(line) {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("conformance: {path}:{}: invalid JSON: {e}", n + 1);
                    return ExitCode::from(2);
                }
            };
            let bad = conformance::check(&rec);
            if bad.is_empty() {
                passed += 1;
            } else {
                failed += 1;
                println!("FAIL {} ({}:{}): {}", rec["id"], path, n + 1, bad.join("; "));
            }
        }
    }
    println!("{passed} passed, {failed} failed");
    if failed == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}
