use std::fs;

use super::*;

/// A temporary workspace with one crate's `src/`, removed when the test ends.
fn scratch() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    fs::create_dir_all(dir.path().join("krate/src")).unwrap();
    dir
}

#[test]
fn the_workspace_is_tidy() {
    assert_eq!(check(&crate::workspace_root()).unwrap(), Vec::<String>::new());
}

#[test]
fn stubs_ignored_tests_and_undocumented_roots_are_reported() {
    let tmp = scratch();
    let dir = tmp.path().to_path_buf();
    let stub = ["fn f() { ", "todo", "!() }\n"].concat();
    fs::write(dir.join("krate/src/lib.rs"), ["pub mod m;\n", &stub].concat()).unwrap();
    let ignored = ["#[test]\n#[", "ignore]\nfn t() {}\n"].concat();
    fs::write(dir.join("krate/src/m.rs"), ignored).unwrap();
    // Files under target/ and hidden folders are not read.
    fs::create_dir_all(dir.join("target")).unwrap();
    fs::write(dir.join("target/x.rs"), &stub).unwrap();

    let problems = source_rules(&dir).unwrap();
    assert_eq!(problems.len(), 3, "{problems:#?}");
    assert!(problems[0].starts_with("krate/src/lib.rs:2:"), "{}", problems[0]);
    assert!(problems[1].contains("opens with a `//!` doc"), "{}", problems[1]);
    assert!(problems[2].starts_with("krate/src/m.rs:2:"), "{}", problems[2]);
}

#[test]
fn a_documented_root_without_stubs_passes() {
    let tmp = scratch();
    let dir = tmp.path().to_path_buf();
    fs::write(dir.join("krate/src/lib.rs"), "//! A crate.\npub fn f() {}\n").unwrap();
    assert_eq!(source_rules(&dir).unwrap(), Vec::<String>::new());
}
