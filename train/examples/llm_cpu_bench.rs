//! A language model's fine-tuning step on this machine's CPUs, beside PyTorch's in the
//! same run.
//!
//! ```text
//! cargo run --release -p meshwork-train --example llm_cpu_bench -- PRESET B [B ...] [steps=N t=T notorch nolora torch-compile]
//! ```
//!
//! `PRESET` is a `--preset` of `meshwork train` with a `transformers` twin in
//! `train/benches/torch_lm_cpu.py`: `gpt2` (GPT-2 small, 124M, V50257, tied
//! embeddings, biases) or `smollm2-135m` (SmolLM2's Llama shape: 30 blocks of width 576,
//! 9 heads over 3 key/value heads, MLP 1536, V49152, tied). At each batch size B it
//! trains the preset's step (f32, AdamW, one device, context T, default 256; random
//! weights, the work of a fine-tuning step) on:
//!
//! - meshwork's interpreter (the default back end);
//! - XLA-CPU (the plugin `MESHWORK_PJRT_PLUGIN` names, else `target/pjrt/xla_cpu_pjrt.so`
//!   where `cargo xtask pjrt` put it; a column of `-` without one);
//! - PyTorch eager (`transformers`' model of the same config, the same threads, where
//!   python3 imports torch and transformers), and with `torch-compile` the same step
//!   under `torch.compile`;
//! - unless `nolora`, the interpreter training a LoRA adapter of rank 16 on the
//!   attention's projections (q, k, v, o; GPT-2's `c_attn` and `attn.c_proj`) over the
//!   frozen base.
//!
//! The back ends take their steps in turns — one step of each, then the next round — so
//! that a machine whose speed drifts (a shared VM's) gives each the same conditions; each
//! back end's first step (which compiles) is left out, and its figure is tokens/s of the
//! median of the `steps` (default 5) timed ones. It prints the machine, a table, LoRA's
//! one-device bytes beside the full step's (`inspect --json`'s, at the first batch size)
//! and, last, `<preset> vs PyTorch eager: best <b1>x <b2>x ..., interpreter <i1>x ...`:
//! tokens/s over PyTorch eager's at each batch size, "best" the faster of meshwork's
//! back ends.

#![allow(clippy::print_stdout, clippy::print_stderr, missing_docs)]

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::AtomicBool;
use std::sync::{Condvar, Mutex};
use std::time::Instant;

use meshwork_train::{
    BackendKind, Check, Config, LoraSettings, ModelKind, Observer, OptimizerKind, Step, Trainer,
};

/// Whose turn it is to take a step, among participants that have not finished.
struct Turns {
    state: Mutex<(usize, Vec<bool>)>,
    changed: Condvar,
}

impl Turns {
    fn new(n: usize) -> Turns {
        Turns { state: Mutex::new((0, vec![false; n])), changed: Condvar::new() }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (usize, Vec<bool>)> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Blocks until it is `me`'s turn.
    fn wait(&self, me: usize) {
        let mut s = self.lock();
        while s.0 != me {
            s = self.changed.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// `me` is done with its turn (for good, when `finished`): the next unfinished
    /// participant's turn.
    fn pass(&self, me: usize, finished: bool) {
        let mut s = self.lock();
        if finished {
            s.1[me] = true;
        }
        if s.0 == me {
            let n = s.1.len();
            if let Some(next) = (1..=n).map(|k| (me + k) % n).find(|&j| !s.1[j]) {
                s.0 = next;
            }
        }
        drop(s);
        self.changed.notify_all();
    }

    /// `me` will take no more turns (it failed, or never started): marked finished,
    /// its turn passed on if it held it.
    fn leave(&self, me: usize) {
        self.pass(me, true);
    }
}

/// Takes participant `.1` out of the turns when dropped.
struct Leave<'a>(&'a Turns, usize);

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        self.0.leave(self.1);
    }
}

/// Times a trainer's steps, each taken in its turn.
struct Timed<'a> {
    turns: &'a Turns,
    me: usize,
    started: Instant,
    seconds: Vec<f64>,
    total: usize,
}

impl Observer for Timed<'_> {
    fn start(&mut self, _: &meshwork_train::Start) {
        self.turns.wait(self.me);
        self.started = Instant::now();
    }

    fn step(&mut self, _: &Step) {
        self.seconds.push(self.started.elapsed().as_secs_f64());
        let last = self.seconds.len() == self.total;
        self.turns.pass(self.me, last);
        if !last {
            self.turns.wait(self.me);
            self.started = Instant::now();
        }
    }
}

/// One column of the table.
enum Participant {
    Meshwork { name: &'static str, config: Box<Config> },
    Torch { name: &'static str, compile: bool },
}

impl Participant {
    fn name(&self) -> &'static str {
        match self {
            Participant::Meshwork { name, .. } | Participant::Torch { name, .. } => name,
        }
    }
}

/// The step's settings shared by meshwork's runs.
fn config(preset: &str, (b, t, steps): (usize, usize, usize), backend: BackendKind) -> Config {
    Config {
        preset: Some(preset.into()),
        seq: Some(t),
        batch: Some(b),
        steps: Some(steps),
        optimizer: Some(OptimizerKind::AdamW),
        lr: Some(1e-4),
        backend,
        check: Check::Never,
        max_memory: 16 << 30,
        ..Config::new(ModelKind::Auto)
    }
}

/// The LoRA adapter the bench trains: rank 16 (α 16) on the attention's projections.
fn lora(preset: &str) -> LoraSettings {
    let targets: &[&str] = if preset == "gpt2" {
        &["c_attn", "attn.c_proj"]
    } else {
        &["q_proj", "k_proj", "v_proj", "o_proj"]
    };
    LoraSettings {
        r: Some(16),
        alpha: Some(16.0),
        targets: Some(targets.iter().map(|s| s.to_string()).collect()),
        ..LoraSettings::default()
    }
}

/// Runs `me`'s steps in its turns: the seconds of each, the first (which compiles)
/// included, or why it could not run.
fn run_one(
    p: &Participant,
    me: usize,
    turns: &Turns,
    (preset, threads, t, b, steps): (&str, usize, usize, usize, usize),
) -> Result<Vec<f64>, String> {
    match p {
        Participant::Meshwork { config, .. } => {
            let trainer = Trainer::new(config).map_err(|e| e.to_string())?;
            let mut timed =
                Timed { turns, me, started: Instant::now(), seconds: Vec::new(), total: steps };
            trainer.run(&mut timed, &AtomicBool::new(false)).map_err(|e| e.to_string())?;
            Ok(timed.seconds)
        }
        Participant::Torch { compile, .. } => {
            let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/torch_lm_cpu.py");
            // Its messages go to this terminal (a pipe nobody drains could fill and
            // stop it mid-step).
            let mut child = Command::new("python3")
                .arg(script)
                .args([preset.to_string(), threads.to_string(), t.to_string(), b.to_string()])
                .args(compile.then_some("compile"))
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .map_err(|e| format!("python3 did not start: {e}"))?;
            let mut input = child.stdin.take().ok_or("no stdin")?;
            let mut output = BufReader::new(child.stdout.take().ok_or("no stdout")?);
            let mut line = String::new();
            let why = |child: &mut std::process::Child, line: &str| {
                let _ = child.kill();
                let _ = child.wait();
                format!(
                    "PyTorch's anchor failed (its messages are above; it said {:?})",
                    line.trim()
                )
            };
            if output.read_line(&mut line).is_err() || line.trim() != "ready" {
                return Err(why(&mut child, &line));
            }
            let mut seconds = Vec::new();
            for k in 0..steps {
                turns.wait(me);
                line.clear();
                let asked = writeln!(input, "step").and_then(|()| input.flush());
                let answered = asked.is_ok() && output.read_line(&mut line).is_ok();
                let Some(s) = answered.then(|| line.trim().parse::<f64>().ok()).flatten() else {
                    return Err(why(&mut child, &line));
                };
                seconds.push(s);
                turns.pass(me, k + 1 == steps);
            }
            drop(input);
            let _ = child.wait();
            Ok(seconds)
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The machine in words: its CPU model, cores, and whether it has AVX-512.
fn machine() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = info
        .lines()
        .find_map(|l| l.strip_prefix("model name").and_then(|r| r.split(':').nth(1)))
        .map_or("an unknown CPU".to_string(), |m| m.trim().to_string());
    let avx512 = info.lines().any(|l| l.starts_with("flags") && l.contains(" avx512f"));
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    format!("{model}, {cores} cores, {}", if avx512 { "AVX-512" } else { "no AVX-512" })
}

/// The XLA plugin: `MESHWORK_PJRT_PLUGIN`, else the one `cargo xtask pjrt` fetched.
fn plugin() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("MESHWORK_PJRT_PLUGIN") {
        return Some(PathBuf::from(p));
    }
    let fetched = concat!(env!("CARGO_MANIFEST_DIR"), "/../target/pjrt/xla_cpu_pjrt.so");
    std::path::Path::new(fetched).is_file().then(|| PathBuf::from(fetched))
}

/// One device's bytes as `inspect --json` reports them for `config`: the plan's
/// estimate, the step's peak (its values at once, by the interpreter's plan), the
/// parameters and the optimizer state.
fn bytes(config: &Config) -> Result<[f64; 4], String> {
    let json = meshwork_train::inspect_json(config).map_err(|e| e.to_string())?;
    let v: serde_json::Value = serde_json::from_str(&json).map_err(|e| e.to_string())?;
    let number = |v: &serde_json::Value| v.as_f64().ok_or("a number missing from inspect --json");
    Ok([
        number(&v["memory"]["estimate"]["total_bytes"])?,
        number(&v["memory"]["step_peak_bytes"])?,
        number(&v["devices"][0]["param_bytes"])?,
        number(&v["devices"][0]["optimizer_bytes"])?,
    ])
}

/// Bytes in GB.
fn gb(b: f64) -> String {
    format!("{:.2} GB", b / 1e9)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(preset) = args.first().filter(|a| a.parse::<usize>().is_err() && !a.contains('='))
    else {
        eprintln!(
            "usage: llm_cpu_bench PRESET B [B ...] [steps=N t=T notorch nolora torch-compile]"
        );
        std::process::exit(2);
    };
    let mut batches: Vec<usize> = args.iter().filter_map(|a| a.parse().ok()).collect();
    if batches.is_empty() {
        batches = vec![1, 4];
    }
    let value = |key: &str, default: usize| {
        args.iter()
            .find_map(|a| a.strip_prefix(key).and_then(|v| v.parse().ok()))
            .unwrap_or(default)
    };
    let flag = |f: &str| args.iter().any(|a| a == f);
    let (t, steps) = (value("t=", 256), value("steps=", 5).max(1));
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let plugin = plugin();
    println!(
        "# {preset}: f32, AdamW, one device, T {t}, tokens/s (median of {steps} steps taken in turns)"
    );
    println!("# machine: {}; {threads} threads each", machine());
    let mut participants = vec![Participant::Meshwork {
        name: "interpreter",
        config: Box::new(config(preset, (1, t, 1), BackendKind::Interpreter)),
    }];
    if let Some(p) = &plugin {
        let backend = BackendKind::Xla { plugin: Some(p.clone()), partitioner: Default::default() };
        participants.push(Participant::Meshwork {
            name: "XLA-CPU",
            config: Box::new(config(preset, (1, t, 1), backend)),
        });
    } else {
        println!("# XLA-CPU: no plugin (set MESHWORK_PJRT_PLUGIN, or run `cargo xtask pjrt`)");
    }
    if !flag("notorch") {
        participants.push(Participant::Torch { name: "PyTorch eager", compile: false });
        if flag("torch-compile") {
            participants.push(Participant::Torch { name: "torch.compile", compile: true });
        }
    }
    if !flag("nolora") {
        let mut c = config(preset, (1, t, 1), BackendKind::Interpreter);
        c.lora = Some(lora(preset));
        participants
            .push(Participant::Meshwork { name: "LoRA r16 (interpreter)", config: Box::new(c) });
    }
    // Tokens/s by batch size, by participant (`None`: it failed, and why).
    let mut table: Vec<Vec<Result<f64, String>>> = Vec::new();
    for &b in &batches {
        let turns = Turns::new(participants.len());
        let per_row = (preset.as_str(), threads, t, b, steps + 1);
        let sized: Vec<Participant> = participants
            .iter()
            .map(|p| match p {
                Participant::Meshwork { name, config } => Participant::Meshwork {
                    name,
                    config: Box::new(Config {
                        batch: Some(b),
                        steps: Some(steps + 1),
                        ..(**config).clone()
                    }),
                },
                Participant::Torch { name, compile } => {
                    Participant::Torch { name, compile: *compile }
                }
            })
            .collect();
        let results: Vec<Result<Vec<f64>, String>> = std::thread::scope(|s| {
            let handles: Vec<_> = sized
                .iter()
                .enumerate()
                .map(|(me, p)| {
                    let turns = &turns;
                    s.spawn(move || {
                        // Leaves the turns however the participant ends (a panic
                        // too), so the others never wait for it.
                        let _leave = Leave(turns, me);
                        run_one(p, me, turns, per_row)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err("panicked".into())))
                .collect()
        });
        table.push(
            results
                .into_iter()
                .map(|r| {
                    r.and_then(|s| match s.get(1..) {
                        Some(timed) if !timed.is_empty() => {
                            Ok((b * t) as f64 / median(timed.to_vec()))
                        }
                        _ => Err("no timed step".into()),
                    })
                })
                .collect(),
        );
    }
    let names: Vec<&str> = participants.iter().map(Participant::name).collect();
    let find = |name: &str| names.iter().position(|n| *n == name);
    let (interp, xla, torch) = (find("interpreter"), find("XLA-CPU"), find("PyTorch eager"));
    println!("| batch | {} | interpreter / PyTorch | best / PyTorch |", names.join(" | "));
    println!("|---|{}---|---|", "---|".repeat(names.len()));
    let rate = |row: &[Result<f64, String>], k: Option<usize>| {
        k.and_then(|k| row[k].as_ref().ok().copied())
    };
    let (mut best_ratios, mut interp_ratios) = (Vec::new(), Vec::new());
    for (row, &b) in table.iter().zip(&batches) {
        let cells: Vec<String> = row
            .iter()
            .map(|r| match r {
                Ok(x) => format!("{x:.0}"),
                Err(e) => format!("failed: {e}"),
            })
            .collect();
        let best = [rate(row, interp), rate(row, xla)].into_iter().flatten().reduce(f64::max);
        let ratio = |x: Option<f64>| match (x, rate(row, torch)) {
            (Some(x), Some(p)) => format!("{:.2}x", x / p),
            _ => "-".into(),
        };
        let (i, bst) = (ratio(rate(row, interp)), ratio(best));
        println!("| {b} | {} | {i} | {bst} |", cells.join(" | "));
        interp_ratios.push(i);
        best_ratios.push(bst);
    }
    if !flag("nolora") {
        let b = batches[0];
        let full = config(preset, (b, t, 3), BackendKind::Interpreter);
        let adapter = Config { lora: Some(lora(preset)), ..full.clone() };
        // And the adapter over a base held in bf16 (--base-dtype bf16).
        let narrow = Config { base_dtype: Some(meshwork_types::DType::BF16), ..adapter.clone() };
        match (bytes(&full), bytes(&adapter), bytes(&narrow)) {
            (Ok(f), Ok(l), Ok(n)) => {
                println!(
                    "# one device's bytes at batch {b} (inspect --json): estimate / step peak / parameters / optimizer state"
                );
                println!("#   full step:  {}", f.map(gb).join(" / "));
                println!(
                    "#   LoRA r16:   {} ({:.2}x the full step's peak)",
                    l.map(gb).join(" / "),
                    l[1] / f[1].max(1.0)
                );
                println!(
                    "#   LoRA r16, base in bf16: {} ({:.2}x the full step's peak)",
                    n.map(gb).join(" / "),
                    n[1] / f[1].max(1.0)
                );
            }
            (f, l, n) => println!("# bytes: full {f:?}, LoRA {l:?}, bf16 base {n:?}"),
        }
    }
    println!(
        "{preset} vs PyTorch eager: best {}, interpreter {}",
        best_ratios.join(" "),
        interp_ratios.join(" ")
    );
}
