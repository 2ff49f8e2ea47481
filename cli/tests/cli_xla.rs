//! `--backend xla`'s refusals from the binary, none of which needs a real plugin: no
//! plugin named, a file that is not a plugin, a plugin of another PJRT version and one
//! whose client cannot start (the mock plugin, `xla/mock`). Each is exit 2 with one
//! line naming the flag, before anything is trained or written.

use std::process::{Command, Output};

#[path = "../../xla/tests/common/mock_plugin.rs"]
mod mock_plugin;
use mock_plugin::mock_library as mock;

fn meshwork(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_meshwork"));
    c.args(args).env_remove("MESHWORK_PJRT_PLUGIN");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("the binary runs")
}

/// Exit 2 with one line on standard error containing each of `says`, nothing on
/// standard output.
fn refused(out: &Output, says: &[&str]) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    for s in says {
        assert!(err.contains(s), "want {s:?} in {err:?}");
    }
    assert!(out.stdout.is_empty());
}

#[test]
fn no_plugin_says_how_to_get_one() {
    let out = meshwork(&["train", "--backend", "xla"], &[]);
    refused(
        &out,
        &["--backend", "MESHWORK_PJRT_PLUGIN", "pip install xla-cpu-pjrt", "jax[cuda13]"],
    );
}

#[test]
fn a_file_that_is_not_a_plugin_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let junk = dir.path().join("junk.so");
    std::fs::write(&junk, b"not a plugin").unwrap();
    let out =
        meshwork(&["train", "--backend", "xla", "--pjrt-plugin", junk.to_str().unwrap()], &[]);
    refused(&out, &["--pjrt-plugin", "not a PJRT plugin"]);
    // The same file named by the environment.
    let out = meshwork(
        &["train", "--backend", "xla"],
        &[("MESHWORK_PJRT_PLUGIN", junk.to_str().unwrap())],
    );
    refused(&out, &["--backend", "not a PJRT plugin"]);
}

#[test]
fn a_plugin_of_another_pjrt_version_is_refused() {
    let plugin = mock().to_str().unwrap();
    for version in ["1.0", "0.54"] {
        let out = meshwork(
            &["train", "--backend", "xla", "--pjrt-plugin", plugin],
            &[("MOCK_PJRT_VERSION", version)],
        );
        refused(&out, &[&format!("PJRT API {version}"), "0.81"]);
    }
}

#[test]
fn a_plugin_whose_client_fails_is_refused_with_its_message() {
    let dir = tempfile::tempdir().unwrap();
    let losses = dir.path().join("losses.json");
    let out = meshwork(
        &[
            "train",
            "--backend",
            "xla",
            "--pjrt-plugin",
            mock().to_str().unwrap(),
            "--losses-json",
            losses.to_str().unwrap(),
        ],
        &[],
    );
    refused(&out, &["--pjrt-plugin", "mock plugin: no devices"]);
    assert!(!losses.exists(), "nothing written");
}

#[test]
fn inspect_prints_the_stablehlo_module_without_a_plugin() {
    let out =
        meshwork(&["inspect", "--model", "transformer", "--backend", "xla", "--mesh", "1x2"], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("\"builtin.module\"() ({"), "{text:.200}");
    assert!(text.contains("mhlo.num_replicas = 2 : i32"));
    // The Megatron split's all-reduces over the model axis, and the state donated.
    assert!(text.contains("\"stablehlo.all_reduce\""));
    assert!(text.contains("tf.aliasing_output"));
}

#[test]
fn xlas_partitioner_needs_the_xla_back_end() {
    let out = meshwork(&["train", "--partitioner", "xla", "--mesh", "2x1"], &[]);
    refused(&out, &["--partitioner xla needs --backend xla"]);
}

/// `inspect --target`'s refusals, before any compile: an unknown GPU or a malformed
/// count, a target config the plugin would crash on, a mesh larger than the target,
/// a plugin that cannot compile for GPUs (the mock), flags that need `--target`, and
/// `--attention cudnn` where nothing runs cuDNN.
#[test]
fn gpu_targets_are_refused_with_one_line_naming_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let inspect = |extra: &[&str]| {
        let mut args = vec!["inspect", "--model", "gpt2", "--preset", "tiny"];
        args.extend_from_slice(extra);
        meshwork(&args, &[])
    };
    refused(&inspect(&["--target", "l4"]), &["--target l4", "no GPU `l4`", "h100, a100"]);
    refused(&inspect(&["--target", "h100x0"]), &["--target h100x0", "at least 1"]);
    refused(&inspect(&["--target", "3xh100x1024"]), &["more than 1024 GPUs"]);
    let config = dir.path().join("empty.txtpb");
    std::fs::write(&config, b"").unwrap();
    let c = config.to_str().unwrap();
    refused(
        &inspect(&["--target", "h100", "--target-config", c]),
        &["--target-config", "empty.txtpb", "no gpu_device_info"],
    );
    let zero = dir.path().join("zero.txtpb");
    let h100 = include_str!("../../xla/targets/h100_sxm.txtpb");
    std::fs::write(&zero, h100.replace("core_count: 132", "core_count: 0")).unwrap();
    refused(
        &inspect(&["--target", "h100", "--target-config", zero.to_str().unwrap()]),
        &["core_count must be above 0"],
    );
    let missing = dir.path().join("missing.txtpb");
    refused(
        &inspect(&["--target", "h100", "--target-config", missing.to_str().unwrap()]),
        &["--target-config", "missing.txtpb"],
    );
    refused(&inspect(&["--target", "h100", "--mesh", "2x1"]), &["needs 2 devices", "has 1"]);
    let mock = mock();
    refused(
        &inspect(&["--target", "h100x2", "--pjrt-plugin", mock.to_str().unwrap()]),
        &["--pjrt-plugin", "made no topology", "needs the CUDA plugin"],
    );
    refused(&inspect(&["--optimized-hlo", "x.pb"]), &["--optimized-hlo", "need --target"]);
    refused(&inspect(&["--target-config", c]), &["need --target"]);
    refused(&inspect(&["--target", "h100", "--backend", "interpreter"]), &["drop --backend"]);
    let out =
        meshwork(&["train", "--model", "gpt2", "--preset", "tiny", "--attention", "cudnn"], &[]);
    refused(&out, &["--attention cudnn", "NVIDIA GPUs"]);
}
