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

#[test]
fn the_workspace_passes() {
    assert_eq!(check(&workspace_metadata()).unwrap(), vec![]);
}

#[test]
fn every_sibling_edge_fails() {
    for from in SIBLINGS {
        for to in SIBLINGS.into_iter().filter(|&to| to != from) {
            for kind in [Value::Null, json!("dev"), json!("build")] {
                let mut metadata = workspace_metadata();
                add_edge(&mut metadata, from, to, kind.clone());
                let violations = check(&metadata).unwrap();
                assert_eq!(violations.len(), 1, "{from} -> {to} ({kind})");
                let v = &violations[0];
                assert_eq!((v.from.as_str(), v.to.as_str()), (from, to));
                assert_eq!(v.kind, kind.as_str().unwrap_or("normal"));
                assert!(v.to_string().contains("siblings never depend on each other"), "{v}");
            }
        }
    }
}

#[test]
fn types_xtask_and_facade_edges_fail() {
    for (from, to, rule) in [
        ("meshwork-types", "meshwork-sharding", "types depends on no workspace crate"),
        ("xtask", "meshwork-types", "xtask depends on no workspace crate"),
        (
            "meshwork-placer",
            "meshwork-strategy",
            "nothing depends on the strategy façade (but a bridge)",
        ),
        ("meshwork-strategy", "meshwork-candle", "nothing depends on a bridge"),
        ("meshwork-executor", "meshwork-candle", "nothing depends on a bridge"),
    ] {
        let mut metadata = workspace_metadata();
        add_edge(&mut metadata, from, to, Value::Null);
        let violations = check(&metadata).unwrap();
        assert_eq!(violations.len(), 1, "{from} -> {to}");
        assert_eq!(violations[0].rule, rule);
    }
}

#[test]
fn allowed_edges_and_external_crates_pass() {
    let mut metadata = workspace_metadata();
    add_edge(&mut metadata, "meshwork-strategy", "meshwork-placer", Value::Null);
    add_edge(&mut metadata, "meshwork-placer", "meshwork-types", json!("dev"));
    add_edge(&mut metadata, "meshwork-types", "serde", Value::Null);
    assert_eq!(check(&metadata).unwrap(), vec![]);
}

#[test]
fn malformed_metadata_is_an_error() {
    assert!(check(&json!({})).is_err());
    assert!(check(&json!({ "packages": [{ "name": "x" }] })).is_err());
}
