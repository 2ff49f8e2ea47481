use serde_json::{Value, json};

use super::*;

/// `cargo metadata --no-deps` of the real workspace.
fn workspace_metadata() -> Value {
    let output = crate::cargo_cmd(&["metadata", "--format-version", "1", "--no-deps"])
        .output()
        .expect("cargo metadata runs");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    serde_json::from_slice(&output.stdout).expect("cargo metadata prints JSON")
}

/// Adds a dependency `from -> to` of `kind` (null for normal) to the metadata.
fn add_edge(metadata: &mut Value, from: &str, to: &str, kind: Value) {
    let package = metadata["packages"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|p| p["name"] == from)
        .unwrap_or_else(|| panic!("no package {from}"));
    package["dependencies"]
        .as_array_mut()
        .unwrap()
        .push(json!({ "name": to, "kind": kind, "path": "irrelevant" }));
}

/// The one violation adding `from -> to` of `kind` makes.
fn one_violation(from: &str, to: &str, kind: Value) -> Violation {
    let mut metadata = workspace_metadata();
    add_edge(&mut metadata, from, to, kind.clone());
    let violations = check(&metadata).unwrap();
    assert_eq!(violations.len(), 1, "{from} -> {to} ({kind}): {violations:?}");
    let v = violations[0].clone();
    assert_eq!((v.from.as_str(), v.to.as_str()), (from, to));
    assert_eq!(v.kind, kind.as_str().unwrap_or("normal"));
    v
}

#[test]
fn the_workspace_passes_and_every_member_has_a_layer() {
    let metadata = workspace_metadata();
    assert_eq!(check(&metadata).unwrap(), vec![]);
    for p in metadata["packages"].as_array().unwrap() {
        let name = p["name"].as_str().unwrap();
        assert!(LAYERS.iter().any(|(n, _)| *n == name), "{name} has no layer");
    }
}

#[test]
fn every_sibling_edge_fails() {
    for from in SIBLINGS {
        for to in SIBLINGS.into_iter().filter(|&to| to != from) {
            for kind in [Value::Null, json!("dev"), json!("build")] {
                let v = one_violation(from, to, kind);
                assert!(v.to_string().contains("siblings never depend on each other"), "{v}");
            }
        }
    }
}

/// Every edge that points up or sideways fails: a layer below on one above, anything
/// on the binary or a bridge, types or xtask on any workspace crate.
#[test]
fn edges_that_point_up_fail() {
    for (from, to, says) in [
        ("meshwork-types", "meshwork-sharding", "meshwork-types depends on no workspace crate"),
        ("xtask", "meshwork-types", "xtask depends on no workspace crate"),
        (
            "meshwork-placer",
            "meshwork-strategy",
            "meshwork-placer may depend on meshwork-types only",
        ),
        ("meshwork-program", "meshwork-nn", "may depend on meshwork-types only"),
        (
            "meshwork-nn",
            "meshwork-partition",
            "meshwork-nn may depend on meshwork-program, meshwork-types, meshwork-io only",
        ),
        ("meshwork-checkpoint", "meshwork-strategy", "may depend on"),
        ("meshwork-strategy", "meshwork-train", "may depend on"),
        ("meshwork-train", "meshwork-cli", "may depend on"),
        ("meshwork-strategy", "meshwork-candle", "may depend on"),
        ("meshwork-candle", "meshwork-strategy", "may depend on"),
        ("meshwork-cli", "meshwork-strategy", "may depend on"),
    ] {
        let v = one_violation(from, to, Value::Null);
        assert!(v.rule.contains(says), "{from} -> {to}: {v}");
    }
}

#[test]
fn a_crate_without_a_layer_fails() {
    let mut metadata = workspace_metadata();
    metadata["packages"]
        .as_array_mut()
        .unwrap()
        .push(json!({ "name": "meshwork-new", "dependencies": [{ "name": "meshwork-types", "kind": null }] }));
    let violations = check(&metadata).unwrap();
    assert_eq!(violations.len(), 1);
    assert!(violations[0].rule.contains("has no place in the crate graph"), "{:?}", violations[0]);
}

#[test]
fn allowed_edges_and_external_crates_pass() {
    let mut metadata = workspace_metadata();
    add_edge(&mut metadata, "meshwork-strategy", "meshwork-placer", Value::Null);
    add_edge(&mut metadata, "meshwork-placer", "meshwork-types", json!("dev"));
    add_edge(&mut metadata, "meshwork-cli", "meshwork-train", json!("dev"));
    add_edge(&mut metadata, "meshwork-types", "serde", Value::Null);
    assert_eq!(check(&metadata).unwrap(), vec![]);
    let graph = graph(&workspace_metadata()).unwrap();
    assert!(graph.lines().any(|l| l.starts_with("cli") && l.contains("train")), "{graph}");
    assert!(graph.lines().any(|l| l == "types       <- -"), "{graph}");
}

#[test]
fn malformed_metadata_is_an_error() {
    assert!(check(&json!({})).is_err());
    assert!(check(&json!({ "packages": [{ "name": "x" }] })).is_err());
}
