//! meshwork's workflows, run as `cargo xtask <task>` (see `cargo xtask help`).
//!
//! This crate depends on no workspace crate, so it builds in seconds; it shells out to
//! cargo for everything and checks the workspace's architecture rules itself.

// xtask talks to a person on the terminal.
#![allow(clippy::print_stdout, clippy::print_stderr)]

mod cuda;
mod deps;
mod fuzz;
mod mpi;
mod tidy;
mod xla;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

const HELP: &str = "\
cargo xtask <task>

tasks:
  ci              everything CI checks: fmt, clippy (all features, so MPI too), tests,
                  the model checks, Miri, the MPI test, the XLA test, the Hugging Face
                  export check (skipped without transformers), the fuzz targets
                  (12 s each), the CUDA compiles (cuda-aot), docs, dependency edges,
                  tidy (benchmarks are type-checked by clippy's --all-targets)
  model           the shuttle model checks (outfeed receiver, executor rendezvous)
  miri            the executor's unsafe code (direct all-reduce and reduce-scatter,
                  zeroed allocation) under Miri
                  (needs `rustup toolchain install nightly --component miri`)
  mpi-test        the executor over MPI: 2 processes x 2 devices under mpirun, the
                  strategy and training on XLA devices across 2 processes, and
                  a dying process that must abort the job (needs openmpi-bin,
                  libopenmpi-dev and libclang-dev; fetches the pinned PJRT plugin),
                  and `meshwork train` built with --features mpi under mpirun
  mpi-bench       the transformer benchmark under mpirun (release build): 2 ranks
                  x 1 core against 1 process x 2 cores on 2x1 and 2x2, both back
                  ends, tokens/s and MPI bytes per step beside the minimum
  test            the README test command: cargo test --workspace
  xla-test        the XLA back end with the pinned CPU plugin (MESHWORK_PJRT_PLUGIN,
                  or xla-cpu-pjrt installed under target/pjrt/ with pip): the tests
                  that need a plugin, the 1500 oracle programs through XLA, and the
                  loader's failure paths under valgrind
  cuda-aot        compile for NVIDIA GPUs without one: the pinned CUDA plugin
                  (jax-cuda13-pjrt 0.11.2 and the nvidia-* wheels with ptxas, hash-checked,
                  cached in ~/.cache/meshwork-ci/wheels, unpacked under target/pjrt-cuda/),
                  its tests, and six `meshwork inspect --target` compiles checked
  gpu-bench DIR   on a machine with an NVIDIA GPU: the GPU benchmark beside JAX and
                  PyTorch, figures written to DIR
  xla-oracle      all 1500 oracle programs on random meshes of 1-8 XLA CPU devices with
                  random shardings, split by meshwork's partitioner and by XLA's
                  (xla-test runs a seeded tenth)
  pjrt            install the pinned CPU plugin under target/pjrt/ and print its path
  bench [ARGS]    run every crate's benchmarks (ARGS go to `cargo bench`)
  docs            cargo doc --workspace --no-deps with warnings denied
  fuzz [SECONDS]  every reader a user's file reaches under libFuzzer (fuzz/): kept
                  regressions replayed, then SECONDS (default 20) per target from
                  seeds of the repository's real files; a table of executions
  deps            check the crate graph: each crate depends only on the layers below it
  tidy            source rules: no stub macros, no ignored or should-panic tests,
                  every lib.rs opens with a //! doc; ARCHITECTURE.md against the
                  tree: every workspace member named, the meshwork commands and the
                  files holding `unsafe` listed exactly
  help            this text
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let task = args.first().map(String::as_str).unwrap_or("help");
    let rest = &args[args.len().min(1)..];
    let result = match task {
        "ci" => ci(),
        "test" => test(),
        "bench" => cargo(&[&["bench", "--workspace"], &strs(rest)[..]].concat()),
        "docs" => docs(),
        "model" => model_check(),
        "mpi-test" => mpi::mpi_test(),
        "mpi-bench" => mpi::mpi_bench(),
        "xla-test" => xla::xla_test(),
        "xla-oracle" => xla::xla_oracle(),
        "cuda-aot" => cuda::cuda_aot(),
        "gpu-bench" => match rest.first() {
            Some(dir) => cuda::gpu_bench(Path::new(dir)),
            None => Err("gpu-bench needs an output folder: cargo xtask gpu-bench OUT_DIR".into()),
        },
        "pjrt" => xla::plugin().map(|p| println!("{}", p.display())),
        "miri" => miri(),
        "deps" => deps_check(),
        "fuzz" => fuzz::fuzz(rest),
        "tidy" => tidy_check(),
        "help" | "--help" | "-h" => {
            print!("{HELP}");
            Ok(())
        }
        other => Err(format!("unknown task `{other}`\n\n{HELP}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("xtask {task}: {message}");
            ExitCode::FAILURE
        }
    }
}

type Result<T = (), E = String> = std::result::Result<T, E>;

fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

fn ci() -> Result {
    step("fmt", || cargo(&["fmt", "--all", "--check"]))?;
    step("clippy", || {
        cargo(&[
            "clippy",
            "--workspace",
            "--all-targets",
            "--all-features",
            "--",
            "-D",
            "warnings",
        ])?;
        // `--all-targets` leaves out the `test = false` targets (those that need a
        // plugin) and overrides any `--test` beside it: they are named in a run of
        // their own.
        let mut args = vec!["clippy", "--workspace", "--all-features"];
        for (_, target) in xla::PLUGIN_TESTS.iter().chain(&[("meshwork-xla", "cuda")]) {
            args.extend(["--test", target]);
        }
        args.extend(["--", "-D", "warnings"]);
        cargo(&args)
    })?;
    step("test", test)?;
    step("test (optional features)", || {
        // The README command builds default features; the serde impls and proptest
        // strategies behind features are tested here.
        cargo(&[
            "test",
            "-p",
            "meshwork-types",
            "-p",
            "meshwork-sharding",
            "--all-features",
            "--lib",
        ])?;
        // The MPI link's own unit tests (an abort serialized with the calls in flight),
        // in one process: the `mpi` feature needs the MPI library CI installs.
        cargo(&["test", "-p", "meshwork-executor", "--features", "mpi", "--lib", "mpi::"])
    })?;
    step("model check (shuttle)", model_check)?;
    step("miri (executor's unsafe code)", miri)?;
    step("mpi test", mpi::mpi_test)?;
    step("xla test", xla::xla_test)?;
    step("hf export check (skipped, and says so, where transformers is absent)", hf_export)?;
    step("fuzz (every reader a user's file reaches, 8 s a target)", || {
        fuzz::fuzz(&["8".to_string()])
    })?;
    step("cuda aot (compiles for H100s without a GPU)", cuda::cuda_aot)?;
    step("docs", docs)?;
    step("deps", deps_check)?;
    step("tidy", tidy_check)?;
    // Benchmarks are checked by clippy (`--all-targets`); building them again in the
    // bench profile cost five of CI's thirty minutes.
    println!("xtask ci: all checks passed");
    Ok(())
}

/// Exports a trained GPT-2 with `meshwork train --export-hf` and loads it with
/// `transformers` (`train/tests/hf/export_check.py`): the same loss within 1e-9. The
/// script says it skipped, and passes, where `transformers` is not installed.
fn hf_export() -> Result {
    let cli = workspace_cli()?;
    let status = Command::new("python3")
        .arg("train/tests/hf/export_check.py")
        .arg(&cli)
        .current_dir(workspace_root())
        .status()
        .map_err(|e| format!("cannot run python3: {e}"))?;
    if status.success() { Ok(()) } else { Err("the Hugging Face export check failed".into()) }
}

/// The `meshwork` binary as the README's test command builds it (the workspace's
/// features, so nothing is compiled again where the test step ran), put back in
/// `target/debug` if a build with other features (the MPI step's) replaced it there.
/// (Run alone, outside CI, this builds every workspace test first.)
pub(crate) fn workspace_cli() -> Result<PathBuf> {
    let output =
        cargo_cmd(&["test", "--workspace", "--no-run", "--message-format=json-render-diagnostics"])
            .stderr(std::process::Stdio::inherit())
            .output()
            .map_err(|e| format!("cannot run cargo: {e}"))?;
    if !output.status.success() {
        return Err(format!("building the workspace's tests failed ({})", output.status));
    }
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| {
            m["reason"] == "compiler-artifact"
                && m["target"]["name"] == "meshwork"
                && m["target"]["kind"][0] == "bin"
                && m["profile"]["test"] == false
        })
        .find_map(|m| m["executable"].as_str().map(PathBuf::from))
        .ok_or_else(|| "cargo built no `meshwork` binary".to_string())
}

/// The README's test command. Compiles first (`--no-run`) so a build failure and a test
/// failure read differently in the log.
fn test() -> Result {
    cargo(&["test", "--workspace", "--no-run"])?;
    cargo(&["test", "--workspace"])
}

/// The model checks of the outfeed receiver and the executor's rendezvous: their
/// threads, locks and channels swapped for shuttle's (`--cfg shuttle`), in a target
/// directory of its own so the normal build is not invalidated.
fn model_check() -> Result {
    let target = workspace_root().join("target").join("shuttle");
    for package in ["meshwork-outfeed", "meshwork-executor"] {
        run(cargo_cmd(&["test", "-p", package, "--lib", "::model::"])
            .env("RUSTFLAGS", "--cfg shuttle")
            .env("CARGO_TARGET_DIR", &target))?;
    }
    Ok(())
}

/// The executor's direct all-reduce, where threads write each other's buffers, under
/// Miri with strict provenance and several thread schedules. Its own target
/// directory, as Miri builds a different standard library.
fn miri() -> Result {
    let target = workspace_root().join("target").join("miri");
    let mut cmd = Command::new("cargo");
    cmd.args([
        "+nightly",
        "miri",
        "test",
        "-p",
        "meshwork-executor",
        "--lib",
        "--",
        "direct",
        "tensor::zeroed",
    ])
    .env("MIRIFLAGS", "-Zmiri-strict-provenance -Zmiri-many-seeds=0..8")
    .env("CARGO_TARGET_DIR", target)
    .env_remove("RUSTC")
    .current_dir(workspace_root());
    run(&mut cmd)
}

fn docs() -> Result {
    run(cargo_cmd(&["doc", "--workspace", "--no-deps"]).env("RUSTDOCFLAGS", "-D warnings"))
}

fn deps_check() -> Result {
    let output = cargo_cmd(&["metadata", "--format-version", "1", "--no-deps"])
        .output()
        .map_err(|e| format!("cannot run cargo metadata: {e}"))?;
    if !output.status.success() {
        return Err(format!("cargo metadata failed: {}", String::from_utf8_lossy(&output.stderr)));
    }
    let metadata: serde_json::Value = serde_json::from_slice(&output.stdout)
        .map_err(|e| format!("cargo metadata printed invalid JSON: {e}"))?;
    let violations = deps::check(&metadata)?;
    if violations.is_empty() {
        print!("{}", deps::graph(&metadata)?);
        println!("deps: crate graph ok");
        Ok(())
    } else {
        Err(format!(
            "forbidden crate edges (an architecture change: update ARCHITECTURE.md and \
             deps::ALLOWED first):\n  {}",
            violations.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n  ")
        ))
    }
}

fn tidy_check() -> Result {
    let problems = tidy::check(&workspace_root())?;
    if problems.is_empty() {
        println!("tidy: ok");
        Ok(())
    } else {
        Err(format!("{} problem(s):\n  {}", problems.len(), problems.join("\n  ")))
    }
}

fn step(name: &str, f: impl FnOnce() -> Result) -> Result {
    println!("\n=== xtask ci: {name} ===");
    let start = std::time::Instant::now();
    let result = f().map_err(|e| format!("step `{name}` failed: {e}"));
    println!("=== xtask ci: {name}: {} s ===", start.elapsed().as_secs());
    result
}

fn workspace_root() -> PathBuf {
    // xtask/ sits directly under the workspace root.
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask has a parent directory")
        .to_path_buf()
}

fn cargo_cmd(args: &[&str]) -> Command {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args(args).current_dir(workspace_root());
    cmd
}

fn cargo(args: &[&str]) -> Result {
    run(&mut cargo_cmd(args))
}

fn run(cmd: &mut Command) -> Result {
    let status = cmd.status().map_err(|e| format!("cannot start {cmd:?}: {e}"))?;
    if status.success() { Ok(()) } else { Err(format!("{cmd:?} exited with {status}")) }
}
