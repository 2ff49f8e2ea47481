//! The XLA back end's checks: the pinned CPU plugin (installed under `target/pjrt/`
//! from its wheel when no `MESHWORK_PJRT_PLUGIN` is set), the tests that need it, the
//! oracle programs through XLA, and the loader's failure paths under valgrind.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{Result, cargo_cmd, run, workspace_root};

/// The pinned plugin: OpenXLA's CPU plugin wheel (PJRT API 0.81).
const REQUIREMENT: &str = "xla-cpu-pjrt==0.0.1";
/// The wheel's SHA-256, checked by pip (`--require-hashes`).
const SHA256: &str = "55837b6b7b47daa717f2d9a5a03563ea0ceaa338d06a81a1e2d3f060d960decc";
/// The plugin's path inside the wheel.
const MEMBER: &str = "xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so";

/// The plugin the XLA checks use: `MESHWORK_PJRT_PLUGIN` if set (it must exist), else
/// the pinned wheel's, installed under `target/pjrt/` on first use.
pub(crate) fn plugin() -> Result<PathBuf> {
    if let Some(p) = file_named_by("MESHWORK_PJRT_PLUGIN") {
        return p;
    }
    let dir = workspace_root().join("target").join("pjrt");
    let so = dir.join("xla_cpu_pjrt.so");
    if so.is_file() {
        return Ok(so);
    }
    install(&dir, &so)?;
    Ok(so)
}

/// The file the environment variable `var` names, if it is set and not empty (an error
/// when that is not a file).
pub(crate) fn file_named_by(var: &str) -> Option<Result<PathBuf>> {
    let p = PathBuf::from(std::env::var_os(var).filter(|p| !p.is_empty())?);
    Some(if p.is_file() {
        Ok(p)
    } else {
        Err(format!("{var} names {}, which is not a file", p.display()))
    })
}

/// Downloads the pinned wheel with pip (hash checked) and unpacks the plugin.
fn install(dir: &Path, so: &Path) -> Result {
    println!("xtask: installing {REQUIREMENT} under {}", dir.display());
    let wheels = dir.join("wheel");
    std::fs::create_dir_all(&wheels)
        .map_err(|e| format!("cannot create {}: {e}", wheels.display()))?;
    let requirements = dir.join("requirements.txt");
    std::fs::write(&requirements, format!("{REQUIREMENT} --hash=sha256:{SHA256}\n"))
        .map_err(|e| format!("cannot write {}: {e}", requirements.display()))?;
    run(Command::new("python3")
        .args(["-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"])
        .args(["--require-hashes", "-r"])
        .arg(&requirements)
        .arg("-d")
        .arg(&wheels))
    .map_err(|e| format!("{e} (the XLA checks need python3 with pip to fetch the plugin)"))?;
    let wheel = std::fs::read_dir(&wheels)
        .map_err(|e| e.to_string())?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or("pip downloaded no wheel")?;
    // Unpacked to a temporary name, then renamed: an interrupted install leaves no
    // half-written plugin behind.
    let partial = dir.join("xla_cpu_pjrt.so.partial");
    let script = "import sys, zipfile, shutil\n\
                  with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, \
                  open(sys.argv[3], 'wb') as dst:\n    shutil.copyfileobj(src, dst)\n";
    run(Command::new("python3").args(["-c", script]).arg(&wheel).arg(MEMBER).arg(&partial))?;
    std::fs::rename(&partial, so).map_err(|e| format!("cannot rename {}: {e}", partial.display()))
}

/// The tests that need a plugin, `(package, test target)`: targets with `test =
/// false`, so `cargo test` (the README's command, the test step) neither builds nor
/// runs them. They are built by name with `--workspace`, so their dependencies'
/// features resolve as the test step's did and its libraries are used as built.
pub(crate) const PLUGIN_TESTS: [(&str, &str); 6] = [
    ("meshwork-xla", "plugin"),
    ("meshwork-xla", "semantics"),
    ("meshwork-strategy", "xla"),
    ("meshwork-strategy", "xla_oracle"),
    ("meshwork-cli", "cli_xla_plugin"),
    ("meshwork-train", "xla"),
];

/// The tests that need a plugin, the oracle through XLA, and the loader under valgrind.
pub(crate) fn xla_test() -> Result {
    let plugin = plugin()?;
    println!("xtask: PJRT plugin {}", plugin.display());
    let with_plugin = |cmd: &mut Command| {
        cmd.env("MESHWORK_PJRT_PLUGIN", &plugin).env("TF_CPP_MIN_LOG_LEVEL", "2");
    };
    // One build of every plugin test (over the whole workspace, as the test step
    // built: its libraries are used as they are), then each test target run from its
    // package's folder as cargo runs it.
    let mut build =
        cargo_cmd(&["test", "--workspace", "--no-run", "--message-format=json-render-diagnostics"]);
    for (_, target) in PLUGIN_TESTS {
        build.args(["--test", target]);
    }
    build.stderr(std::process::Stdio::inherit());
    let output = build.output().map_err(|e| format!("cannot run cargo: {e}"))?;
    if !output.status.success() {
        return Err(format!("building the plugin tests failed ({})", output.status));
    }
    let artifacts: Vec<serde_json::Value> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .filter(|m: &serde_json::Value| m["reason"] == "compiler-artifact")
        .collect();
    for (package, target) in PLUGIN_TESTS {
        let artifact = artifacts
            .iter()
            .find(|m| {
                m["package_id"].as_str().is_some_and(|id| id.contains(&format!("#{package}@")))
                    && m["target"]["name"] == target
                    && m["profile"]["test"] == true
            })
            .ok_or_else(|| format!("cargo built no `{target}` test of {package}"))?;
        let exe = artifact["executable"].as_str().ok_or("a test without an executable")?;
        let manifest = artifact["manifest_path"].as_str().ok_or("no manifest path")?;
        let dir = Path::new(manifest).parent().ok_or("a manifest without a folder")?;
        println!("xtask: {package} {target}");
        let mut cmd = Command::new(exe);
        cmd.current_dir(dir);
        with_plugin(&mut cmd);
        run(&mut cmd)?;
    }
    // The conformance example as a program (`cargo test` would build it with the test
    // harness), over the workspace too.
    let output = cargo_cmd(&[
        "build",
        "--workspace",
        "--example",
        "program_conformance",
        "--message-format=json-render-diagnostics",
    ])
    .stderr(std::process::Stdio::inherit())
    .output()
    .map_err(|e| format!("cannot run cargo: {e}"))?;
    if !output.status.success() {
        return Err(format!("building the conformance example failed ({})", output.status));
    }
    let example = String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| {
            m["reason"] == "compiler-artifact" && m["target"]["name"] == "program_conformance"
        })
        .find_map(|m| m["executable"].as_str().map(PathBuf::from))
        .ok_or("cargo built no program_conformance example")?;
    let mut conformance = Command::new(example);
    conformance.args(["--backend", "xla"]).current_dir(workspace_root());
    with_plugin(&mut conformance);
    run(&mut conformance)?;
    valgrind()
}

/// Every oracle program on XLA meshes with both partitioners (the strategy's
/// `xla_oracle` test with `MESHWORK_XLA_ORACLE=all`).
pub(crate) fn xla_oracle() -> Result {
    let plugin = plugin()?;
    let mut all = cargo_cmd(&[
        "test",
        "--release",
        "-p",
        "meshwork-strategy",
        "--test",
        "xla_oracle",
        "--",
        "--nocapture",
    ]);
    all.env("MESHWORK_PJRT_PLUGIN", &plugin)
        .env("TF_CPP_MIN_LOG_LEVEL", "2")
        .env("MESHWORK_XLA_ORACLE", "all");
    run(&mut all)
}

/// The mock-plugin tests (`xla/tests/mock.rs`) under valgrind's memcheck: a leaked
/// plugin error, a read past the API table or a use after free fails the step.
pub(crate) fn valgrind() -> Result {
    // Built and run once natively first: that also builds the mock plugin itself.
    run(&mut cargo_cmd(&["test", "--workspace", "--test", "mock"]))?;
    let output =
        cargo_cmd(&["test", "--workspace", "--test", "mock", "--no-run", "--message-format=json"])
            .output()
            .map_err(|e| format!("cannot run cargo: {e}"))?;
    let binary = String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == "mock")
        .find_map(|m| m["executable"].as_str().map(PathBuf::from))
        .ok_or("cargo built no `mock` test binary")?;
    run(Command::new("valgrind")
        .args([
            "--error-exitcode=99",
            "--leak-check=full",
            "--errors-for-leak-kinds=definite",
            "-q",
        ])
        .arg(&binary)
        .arg("--test-threads=1")
        .current_dir(workspace_root().join("xla")))
    .map_err(|e| format!("{e} (valgrind's memcheck over the PJRT loader's failure paths)"))
}
