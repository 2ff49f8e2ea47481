//! The binary on XLA end to end, with the plugin `MESHWORK_PJRT_PLUGIN` names (`test =
//! false`: `cargo xtask xla-test` and CI build and run it by name): the main job and
//! the transformer train, check every step against the interpreter, and exit 0; the
//! process exits cleanly with the plugin loaded.

use std::process::Command;

fn meshwork(args: &[&str]) -> std::process::Output {
    assert!(
        std::env::var_os("MESHWORK_PJRT_PLUGIN").is_some(),
        "set MESHWORK_PJRT_PLUGIN to a PJRT plugin (cargo xtask xla-test does)"
    );
    // The binary silences XLA's logging itself (whatever the test runner set).
    Command::new(env!("CARGO_BIN_EXE_meshwork"))
        .args(args)
        .env_remove("TF_CPP_MIN_LOG_LEVEL")
        .output()
        .expect("the binary runs")
}

#[test]
fn the_main_job_and_the_transformer_train_on_xla() {
    let dir = tempfile::tempdir().unwrap();
    let losses = dir.path().join("losses.json");
    let out = meshwork(&[
        "train",
        "--backend",
        "xla",
        "--steps",
        "20",
        "--losses-json",
        losses.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    let summary = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(summary.contains("on XLA (cpu)"), "{summary}");
    assert!(summary.contains("every step equal to one device's"), "{summary}");
    // No XLA log lines: meshwork's lines are what a run prints.
    assert!(!err.contains("cpu_device_count"), "{err}");
    let list: Vec<f64> = serde_json::from_slice(&std::fs::read(&losses).unwrap()).unwrap();
    assert_eq!(list.len(), 20);
    assert!(list[19] < list[0]);
    let out = meshwork(&["train", "--model", "transformer", "--backend", "xla", "--steps", "3"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
}
