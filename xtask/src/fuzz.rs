//! `cargo xtask fuzz [SECONDS]`: every reader a user's file reaches, under libFuzzer.
//!
//! The targets (`fuzz/`, outside the workspace) are built with the coverage
//! instrumentation `cargo fuzz` uses (`-Cpasses=sancov-module` and friends, stable
//! flags: no sanitizer, so no nightly), in `target/fuzz`. Each target first replays
//! its kept regressions (`fuzz/regressions/<target>/`: crashes found before, each a
//! test that must now pass), then fuzzes for SECONDS (default 20) from a corpus
//! seeded with the repository's real files (checkpoints, safetensors, `.npy`,
//! tokenizers, configs, an ELF image). A crash fails the task, naming the input
//! libFuzzer saved under `target/fuzz-artifacts/<target>/`: copy it into the
//! target's regressions folder once fixed. The last lines are a table: target,
//! executions, seconds, corpus size.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{Result, run, workspace_root};

/// Each target, the longest input it is given, and its seeds (repository files;
/// `+` joins several files into one input with the targets' separator).
const TARGETS: &[(&str, usize, &[&str])] = &[
    (
        "safetensors",
        1 << 19,
        &[
            "train/testdata/gpt2/model/model.safetensors",
            "train/testdata/jax/init.safetensors",
            "train/testdata/main-job/step-00000010/shard-0.safetensors",
            "train/testdata/main-job/step-00000010/shard-1.safetensors",
        ],
    ),
    (
        "npy",
        1 << 16,
        &["train/testdata/gpt2/tokens.npy", "train/testdata/jax/x.npy", "train/testdata/jax/y.npy"],
    ),
    ("plugin_precheck", 1 << 16, &[]),
    (
        "checkpoint",
        1 << 16,
        &[
            "train/testdata/main-job/step-00000010/index.json+train/testdata/main-job/step-00000010/shard-0.safetensors",
        ],
    ),
    (
        "hf_folder",
        1 << 19,
        &[
            "train/testdata/gpt2/model/config.json++train/testdata/gpt2/model/model.safetensors",
            "train/testdata/llama/model/config.json++train/testdata/llama/model/model.safetensors",
            "train/testdata/qwen3/model/config.json++train/testdata/qwen3/model/model.safetensors",
        ],
    ),
    (
        "tokenizer",
        1 << 15,
        &[
            "train/testdata/gpt2/tokenizer.json+train/testdata/gpt2/corpus.txt",
            "train/testdata/llama/tokenizer.json+train/testdata/llama/corpus.txt",
        ],
    ),
    (
        "hf_configs",
        1 << 14,
        &[
            "train/testdata/gpt2/model/generation_config.json+train/testdata/llama/tokenizer_config.json",
            "train/testdata/llama/model/generation_config.json+train/testdata/mistral/tokenizer_config.json",
        ],
    ),
    ("jsonl", 1 << 14, &["train/testdata/gpt2/docs.jsonl"]),
];

/// What separates files in one input (`fuzz/src/lib.rs`'s `SEP`).
const SEP: &[u8] = b"\xffMESHWORK-FUZZ\xff";

/// The coverage flags `cargo fuzz` passes (less its sanitizer).
const RUSTFLAGS: &str = "-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
     -Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
     -Cllvm-args=-sanitizer-coverage-pc-table -Cllvm-args=-sanitizer-coverage-trace-compares \
     --cfg fuzzing";

pub(crate) fn fuzz(args: &[String]) -> Result {
    let seconds: u64 = match args.first() {
        Some(s) => s.parse().map_err(|_| format!("fuzz takes SECONDS per target, not {s:?}"))?,
        None => 20,
    };
    let root = workspace_root();
    let target_dir = root.join("target").join("fuzz");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    // An explicit target, so that the flags reach the targets' code only, not build
    // scripts and proc macros (which libFuzzer's runtime does not link into).
    let host = host_triple()?;
    run(Command::new(&cargo)
        .args(["build", "--release", "--bins", "--manifest-path", "fuzz/Cargo.toml"])
        .args(["--target", &host])
        .env("RUSTFLAGS", RUSTFLAGS)
        .env("CARGO_TARGET_DIR", &target_dir)
        .env_remove("RUSTC")
        .current_dir(&root))?;
    let mut table = Vec::new();
    for &(name, max_len, seeds) in TARGETS {
        let bin = target_dir.join(&host).join("release").join(name);
        replay(&bin, &root.join("fuzz").join("regressions").join(name))?;
        let corpus = root.join("target").join("fuzz-corpus").join(name);
        std::fs::create_dir_all(&corpus).map_err(|e| format!("{}: {e}", corpus.display()))?;
        for (k, seed) in seeds.iter().enumerate() {
            let bytes = seed_bytes(&root, seed)?;
            std::fs::write(corpus.join(format!("seed-{k}")), bytes).map_err(|e| e.to_string())?;
        }
        if name == "plugin_precheck" {
            for (k, image) in elf_seeds(&bin)?.into_iter().enumerate() {
                std::fs::write(corpus.join(format!("seed-elf-{k}")), image)
                    .map_err(|e| e.to_string())?;
            }
        }
        let artifacts = root.join("target").join("fuzz-artifacts").join(name);
        std::fs::create_dir_all(&artifacts).map_err(|e| e.to_string())?;
        let child = Command::new(&bin)
            .arg(&corpus)
            .arg(format!("-max_total_time={seconds}"))
            .arg(format!("-max_len={max_len}"))
            .arg("-timeout=10")
            .arg("-rss_limit_mb=3072")
            .arg("-print_final_stats=1")
            .arg(format!("-artifact_prefix={}/", artifacts.display()))
            .current_dir(&root)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", bin.display()))?;
        let pid = child.id();
        let output = child.wait_with_output().map_err(|e| format!("{}: {e}", bin.display()))?;
        remove_scratch(pid);
        let log = String::from_utf8_lossy(&output.stderr);
        if !output.status.success() {
            let tail: Vec<&str> = log.lines().rev().take(30).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            return Err(format!(
                "fuzz target {name} failed ({}); its input is in {}:\n{}",
                output.status,
                artifacts.display(),
                tail.join("\n")
            ));
        }
        let runs = stat(&log, "stat::number_of_executed_units:").unwrap_or(0);
        let units = std::fs::read_dir(&corpus).map_or(0, Iterator::count);
        table.push((name, runs, units));
    }
    println!("\nfuzz: {seconds} s per target, no crash");
    println!("{:<16} {:>12} {:>8}", "target", "executions", "corpus");
    for (name, runs, units) in table {
        println!("{name:<16} {runs:>12} {units:>8}");
    }
    Ok(())
}

/// Removes the scratch folders target process `pid` wrote its inputs into
/// (`meshwork-fuzz-<pid>-<name>` in the temporary directory).
fn remove_scratch(pid: u32) {
    let tmp = std::env::temp_dir();
    let prefix = format!("meshwork-fuzz-{pid}-");
    for e in std::fs::read_dir(&tmp).into_iter().flatten().flatten() {
        if e.file_name().to_string_lossy().starts_with(&prefix) {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// Runs each kept regression input once (libFuzzer runs the files it is given).
fn replay(bin: &Path, dir: &Path) -> Result {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(());
    };
    let inputs: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
    if inputs.is_empty() {
        return Ok(());
    }
    let child = Command::new(bin)
        .args(&inputs)
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", bin.display()))?;
    let pid = child.id();
    let output = child.wait_with_output().map_err(|e| e.to_string());
    remove_scratch(pid);
    match output? {
        o if o.status.success() => Ok(()),
        o => Err(format!("a kept regression in {} fails ({})", dir.display(), o.status)),
    }
}

/// A seed: the files `spec` names, joined by [`SEP`] (an empty name: an empty part).
fn seed_bytes(root: &Path, spec: &str) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    for (k, file) in spec.split('+').enumerate() {
        if k > 0 {
            out.extend_from_slice(SEP);
        }
        if !file.is_empty() {
            let path = root.join(file);
            out.extend(std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?);
        }
    }
    Ok(out)
}

/// ELF seeds for the plugin pre-check: a minimal shared-object image made here, and
/// the start of a real ELF file of this machine (the target itself).
fn elf_seeds(bin: &Path) -> Result<Vec<Vec<u8>>> {
    let mut image = vec![0u8; 4096];
    image[..4].copy_from_slice(b"\x7fELF");
    image[4] = 2;
    image[5] = 1;
    image[16..18].copy_from_slice(&3u16.to_le_bytes());
    let machine: u16 = if cfg!(target_arch = "aarch64") { 183 } else { 62 };
    image[18..20].copy_from_slice(&machine.to_le_bytes());
    image[32..40].copy_from_slice(&64u64.to_le_bytes());
    image[54..56].copy_from_slice(&56u16.to_le_bytes());
    image[56..58].copy_from_slice(&1u16.to_le_bytes());
    image[58..60].copy_from_slice(&64u16.to_le_bytes());
    image[64..68].copy_from_slice(&1u32.to_le_bytes());
    image[64 + 32..64 + 40].copy_from_slice(&4096u64.to_le_bytes());
    let real = std::fs::read(bin).map_err(|e| format!("{}: {e}", bin.display()))?;
    Ok(vec![image, real[..real.len().min(1 << 16)].to_vec()])
}

/// This machine's target triple, as rustc names it.
fn host_triple() -> Result<String> {
    let out = Command::new("rustc")
        .arg("-vV")
        .output()
        .map_err(|e| format!("cannot run rustc -vV: {e}"))?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_owned))
        .ok_or_else(|| "rustc -vV names no host".into())
}

/// The number after `key` in libFuzzer's final stats.
fn stat(log: &str, key: &str) -> Option<u64> {
    log.lines().find_map(|l| l.strip_prefix(key)?.trim().parse().ok())
}
