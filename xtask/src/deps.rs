//! The crate-graph check: siblings never depend on each other.
//!
//! Rules, over every dependency kind (normal, build and dev):
//! - placer, sharding, outfeed, executor and program (the siblings) depend on no other
//!   sibling;
//! - `types` depends on no workspace crate;
//! - no workspace crate depends on `strategy` (the façade is the leaf), but the bridges
//!   (adapters for other libraries, under `bridges/`), which sit on top of it;
//! - nothing depends on a bridge;
//! - `xtask` depends on no workspace crate.
//!
//! An edge listed in [`ALLOWED`] is exempt; adding one is an architecture change that
//! ARCHITECTURE.md must describe.

use std::fmt;

use serde_json::Value;

/// The sibling crates, which may depend on `types` only.
pub(crate) const SIBLINGS: [&str; 5] = [
    "meshwork-placer",
    "meshwork-sharding",
    "meshwork-outfeed",
    "meshwork-executor",
    "meshwork-program",
];
const TYPES: &str = "meshwork-types";
const FACADE: &str = "meshwork-strategy";
/// The bridges to other libraries: leaves above the façade.
pub(crate) const BRIDGES: [&str; 1] = ["meshwork-candle"];
const XTASK: &str = "xtask";

/// Edges exempt from the rules, as `(from, to)` package names. Empty: none so far.
pub(crate) const ALLOWED: &[(&str, &str)] = &[];

/// A forbidden edge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Violation {
    pub(crate) from: String,
    pub(crate) to: String,
    /// `normal`, `dev` or `build`.
    pub(crate) kind: String,
    pub(crate) rule: &'static str,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} -> {} ({} dependency): {}", self.from, self.to, self.kind, self.rule)
    }
}

/// Checks `cargo metadata --format-version 1 --no-deps` output against the rules.
pub(crate) fn check(metadata: &Value) -> Result<Vec<Violation>, String> {
    let packages =
        metadata["packages"].as_array().ok_or("cargo metadata has no `packages` array")?;
    let members: Vec<&str> = packages.iter().filter_map(|p| p["name"].as_str()).collect();
    let mut violations = Vec::new();
    for package in packages {
        let from = package["name"].as_str().ok_or("a package without a name")?;
        let dependencies = package["dependencies"]
            .as_array()
            .ok_or_else(|| format!("package {from} has no `dependencies` array"))?;
        for dependency in dependencies {
            let to = dependency["name"].as_str().ok_or("a dependency without a name")?;
            if !members.contains(&to) || ALLOWED.contains(&(from, to)) {
                continue;
            }
            let kind = dependency["kind"].as_str().unwrap_or("normal").to_owned();
            let rule = if SIBLINGS.contains(&from) && SIBLINGS.contains(&to) {
                Some("siblings never depend on each other; strategy adapts between them")
            } else if from == TYPES {
                Some("types depends on no workspace crate")
            } else if from == XTASK {
                Some("xtask depends on no workspace crate")
            } else if to == FACADE && !BRIDGES.contains(&from) {
                Some("nothing depends on the strategy façade (but a bridge)")
            } else if BRIDGES.contains(&to) {
                Some("nothing depends on a bridge")
            } else {
                None
            };
            if let Some(rule) = rule {
                violations.push(Violation { from: from.to_owned(), to: to.to_owned(), kind, rule });
            }
        }
    }
    Ok(violations)
}

#[cfg(test)]
mod tests;
