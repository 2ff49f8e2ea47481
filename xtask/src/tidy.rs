//! Source rules that neither rustc nor clippy checks.
//!
//! - No stubs or skipped tests in any `.rs` file: neither of the two stub macros
//!   (`todo`, `unimplemented`) is called, and no test carries the `ignore` or
//!   `should_panic` attribute.
//! - Every crate's `src/lib.rs` (and xtask's `src/main.rs`) opens with a `//!` doc.
//! - ARCHITECTURE.md stays a true map ([`architecture`]): it names every workspace
//!   member, lists the `meshwork` binary's commands exactly, and lists exactly the files
//!   that hold `unsafe` code.

use std::fs;
use std::path::{Path, PathBuf};

/// The forbidden fragments, assembled so that this file does not contain them.
fn forbidden() -> [(String, &'static str); 4] {
    [
        (["todo", "!("].concat(), "a stub is not done"),
        (["unimplemented", "!("].concat(), "a stub is not done"),
        (["#[", "ignore"].concat(), "an ignored test hides a failure"),
        (["#[", "should_panic"].concat(), "bad input gets a typed error, not a panic"),
    ]
}

mod architecture;

/// Every problem found under `root`, one line each (`path:line: what`): the source
/// rules, then ARCHITECTURE.md against the tree.
pub(crate) fn check(root: &Path) -> Result<Vec<String>, String> {
    let mut problems = source_rules(root)?;
    problems.extend(architecture::check(root)?);
    Ok(problems)
}

/// The source rules' problems under `root`: stubs, skipped tests, undocumented roots.
fn source_rules(root: &Path) -> Result<Vec<String>, String> {
    let mut files = Vec::new();
    collect_rust_files(root, &mut files)?;
    files.sort();
    let forbidden = forbidden();
    let mut problems = Vec::new();
    for file in &files {
        let text =
            fs::read_to_string(file).map_err(|e| format!("cannot read {}: {e}", file.display()))?;
        let shown = file.strip_prefix(root).unwrap_or(file).display().to_string();
        for (number, line) in text.lines().enumerate() {
            for (fragment, why) in &forbidden {
                if line.contains(fragment.as_str()) {
                    problems.push(format!("{shown}:{}: `{fragment}`: {why}", number + 1));
                }
            }
        }
        let is_crate_root = file.ends_with("src/lib.rs") || file.ends_with("xtask/src/main.rs");
        if is_crate_root && !text.starts_with("//!") {
            problems.push(format!("{shown}:1: a crate root opens with a `//!` doc"));
        }
    }
    Ok(problems)
}

fn collect_rust_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), String> {
    let entries = fs::read_dir(dir).map_err(|e| format!("cannot list {}: {e}", dir.display()))?;
    for entry in entries {
        let entry = entry.map_err(|e| format!("cannot list {}: {e}", dir.display()))?;
        let path = entry.path();
        let name = entry.file_name();
        if name == "target" || name.to_string_lossy().starts_with('.') {
            continue;
        }
        let file_type = entry.file_type().map_err(|e| format!("{}: {e}", path.display()))?;
        if file_type.is_dir() {
            collect_rust_files(&path, out)?;
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            out.push(path);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
