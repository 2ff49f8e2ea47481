//! The crate-graph check: each workspace crate depends only on the crates below it.
//!
//! The layers, each crate with the workspace crates it may depend on (over every
//! dependency kind: normal, build and dev):
//!
//! ```text
//! types                                          the shared vocabulary, the host tensor
//! io placer sharding outfeed executor program    siblings: types only
//! nn          <- program                         layers, optimizers, models
//! partition   <- program sharding placer         the pure passes
//! checkpoint  <- sharding io                     the sharded checkpoint format
//! strategy    <- the siblings, nn, partition, checkpoint   the façade and back ends
//! train       <- strategy nn partition checkpoint program sharding io   the trainer
//! cli         <- train sharding placer io        the `meshwork` binary
//! bridges     <- executor sharding checkpoint io adapters for other libraries
//! xtask       <- nothing
//! ```
//!
//! (`types` is allowed everywhere above it, and `io` everywhere above the siblings.)
//! So siblings never depend on each other,
//! nothing depends on the binary or a bridge, and a new crate must be given its place
//! here before it builds. An edge listed in [`ALLOWED`] is exempt; adding one is an
//! architecture change that ARCHITECTURE.md must describe.

use std::fmt;

use serde_json::Value;

/// The sibling crates, which may depend on `types` only.
pub(crate) const SIBLINGS: [&str; 6] = [
    "meshwork-io",
    "meshwork-placer",
    "meshwork-sharding",
    "meshwork-outfeed",
    "meshwork-executor",
    "meshwork-program",
];
const TYPES: &str = "meshwork-types";
const IO: &str = "meshwork-io";

/// Every workspace crate and the workspace crates it may depend on (besides `types`,
/// which every crate but `types` and `xtask` may use).
pub(crate) const LAYERS: &[(&str, &[&str])] = &[
    ("meshwork-types", &[]),
    ("meshwork-io", &[]),
    ("meshwork-placer", &[]),
    ("meshwork-sharding", &[]),
    ("meshwork-outfeed", &[]),
    ("meshwork-executor", &[]),
    ("meshwork-program", &[]),
    ("meshwork-xla", &["meshwork-program", "meshwork-io"]),
    ("meshwork-pjrt-mock", &[]),
    ("meshwork-nn", &["meshwork-program"]),
    ("meshwork-partition", &["meshwork-program", "meshwork-sharding", "meshwork-placer"]),
    ("meshwork-checkpoint", &["meshwork-sharding", "meshwork-io"]),
    (
        "meshwork-strategy",
        &[
            "meshwork-placer",
            "meshwork-sharding",
            "meshwork-outfeed",
            "meshwork-executor",
            "meshwork-program",
            "meshwork-nn",
            "meshwork-partition",
            "meshwork-checkpoint",
            "meshwork-xla",
        ],
    ),
    (
        "meshwork-train",
        &[
            "meshwork-strategy",
            "meshwork-nn",
            "meshwork-partition",
            "meshwork-checkpoint",
            "meshwork-program",
            "meshwork-sharding",
            "meshwork-xla",
            "meshwork-io",
        ],
    ),
    ("meshwork-cli", &["meshwork-train", "meshwork-sharding", "meshwork-placer", "meshwork-io"]),
    (
        "meshwork-candle",
        &["meshwork-executor", "meshwork-sharding", "meshwork-checkpoint", "meshwork-io"],
    ),
    ("xtask", &[]),
];

/// Edges exempt from the layers, as `(from, to)` package names, with why.
pub(crate) const ALLOWED: &[(&str, &str)] = &[
    // The partitioner's tests partition the models (a dev-dependency only: nn and
    // partition are peers on program).
    ("meshwork-partition", "meshwork-nn"),
    // The program conformance example runs the oracle through XLA too (`--backend
    // xla`; a dev-dependency only: xla lowers programs).
    ("meshwork-program", "meshwork-xla"),
];

/// A forbidden edge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Violation {
    pub(crate) from: String,
    pub(crate) to: String,
    /// `normal`, `dev` or `build`.
    pub(crate) kind: String,
    pub(crate) rule: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} -> {} ({} dependency): {}", self.from, self.to, self.kind, self.rule)
    }
}

/// The workspace crates `from` may depend on, or `None` for a crate with no place in
/// [`LAYERS`].
fn allowed(from: &str) -> Option<Vec<&'static str>> {
    let (_, below) = LAYERS.iter().find(|(name, _)| *name == from)?;
    let mut out = below.to_vec();
    if from != TYPES && from != "xtask" {
        out.push(TYPES);
    }
    // The file formats, like the vocabulary, serve every crate above the siblings
    // (their tests read `.npy` and safetensors files too).
    if !SIBLINGS.contains(&from) && ![TYPES, IO, "xtask", "meshwork-pjrt-mock"].contains(&from) {
        out.push(IO);
    }
    Some(out)
}

/// Checks `cargo metadata --format-version 1 --no-deps` output against the layers.
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
        let may = allowed(from);
        for dependency in dependencies {
            let to = dependency["name"].as_str().ok_or("a dependency without a name")?;
            if !members.contains(&to) || ALLOWED.contains(&(from, to)) {
                continue;
            }
            let kind = dependency["kind"].as_str().unwrap_or("normal").to_owned();
            let rule = match &may {
                None => {
                    Some(format!("{from} has no place in the crate graph (xtask deps::LAYERS)"))
                }
                Some(may) if may.contains(&to) => None,
                Some(_) if SIBLINGS.contains(&from) && SIBLINGS.contains(&to) => {
                    Some("siblings never depend on each other; strategy adapts between them".into())
                }
                Some(may) if may.is_empty() => {
                    Some(format!("{from} depends on no workspace crate"))
                }
                Some(may) => Some(format!("{from} may depend on {} only", may.join(", "))),
            };
            if let Some(rule) = rule {
                violations.push(Violation { from: from.to_owned(), to: to.to_owned(), kind, rule });
            }
        }
    }
    Ok(violations)
}

/// The workspace's crate graph, one line a crate in [`LAYERS`] order: each crate and
/// the workspace crates it depends on (dev-only ones marked).
pub(crate) fn graph(metadata: &Value) -> Result<String, String> {
    let packages =
        metadata["packages"].as_array().ok_or("cargo metadata has no `packages` array")?;
    let members: Vec<&str> = packages.iter().filter_map(|p| p["name"].as_str()).collect();
    let mut out = String::new();
    for (name, _) in LAYERS {
        let Some(package) = packages.iter().find(|p| p["name"] == *name) else { continue };
        let mut deps: Vec<String> = Vec::new();
        for d in package["dependencies"].as_array().into_iter().flatten() {
            let Some(to) = d["name"].as_str().filter(|t| members.contains(t)) else { continue };
            let short = to.trim_start_matches("meshwork-");
            let dev = d["kind"].as_str() == Some("dev");
            let label = if dev { format!("{short} (dev)") } else { short.to_string() };
            let normal_too = package["dependencies"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|e| e["name"] == to && e["kind"].is_null());
            if (!dev || !normal_too) && !deps.contains(&label) {
                deps.push(label);
            }
        }
        let short = name.trim_start_matches("meshwork-");
        out.push_str(&format!(
            "{short:<11} <- {}\n",
            if deps.is_empty() { "-".into() } else { deps.join(", ") }
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
