//! A language model's fine-tuning step on this machine's CPUs, beside PyTorch's in the
//! same run: `meshwork train --preset P` — `gpt2` (GPT-2 small, 124M, V50257, tied
//! embeddings, biases; the default) or `smollm2-135m` (SmolLM2's Llama shape: 30 blocks
//! of width 576, 9 heads over 3 key/value heads, V49152, tied) — at context T (default
//! 256), f32, AdamW, one device, on the interpreter and on XLA-CPU (when
//! `MESHWORK_PJRT_PLUGIN` names a plugin), then `train/benches/torch_lm_cpu.py`
//! (`transformers`' model of the same config, eager, the same threads) where python3
//! imports torch and transformers. Tokens/s, each the median of the timed steps after
//! one untimed step (which compiles).
//!
//! ```text
//! cargo run --release -p meshwork-train --example lm_cpu_bench [-- B ... preset=P t=T steps=N notorch]
//! ```
//!
//! Default batches 1 2 4, T 256, 4 timed steps. The weights are drawn at random (the
//! step's work is a fine-tuning step's).

#![allow(clippy::print_stdout, clippy::print_stderr, missing_docs)]

use std::sync::atomic::AtomicBool;
use std::time::Instant;

use meshwork_train::{BackendKind, Check, Config, ModelKind, Observer, Step, Trainer};

/// Records when each step ended.
struct Clock(Vec<Instant>);

impl Observer for Clock {
    fn start(&mut self, _: &meshwork_train::Start) {
        self.0.push(Instant::now());
    }
    fn step(&mut self, _: &Step) {
        self.0.push(Instant::now());
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Tokens/s of `steps` timed steps of `preset` at batch `b` and context `t` on
/// `backend`.
fn meshwork(
    preset: &str,
    (b, t, steps): (usize, usize, usize),
    backend: BackendKind,
) -> Result<f64, String> {
    let config = Config {
        preset: Some(preset.into()),
        seq: Some(t),
        batch: Some(b),
        steps: Some(steps + 1),
        optimizer: Some(meshwork_train::OptimizerKind::AdamW),
        lr: Some(1e-4),
        backend,
        check: Check::Never,
        max_memory: 16 << 30,
        ..Config::new(ModelKind::Auto)
    };
    let mut clock = Clock(Vec::new());
    Trainer::new(&config)
        .and_then(|tr| tr.run(&mut clock, &AtomicBool::new(false)))
        .map_err(|e| e.to_string())?;
    // The first step (after `start`) compiles lazily on XLA: left out.
    let times: Vec<f64> = clock.0.windows(2).skip(1).map(|w| (w[1] - w[0]).as_secs_f64()).collect();
    Ok((b * t) as f64 / median(times))
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut batches: Vec<usize> = args.iter().filter_map(|a| a.parse().ok()).collect();
    if batches.is_empty() {
        batches = vec![1, 2, 4];
    }
    let value = |key: &str, default: usize| {
        args.iter()
            .find_map(|a| a.strip_prefix(key).and_then(|v| v.parse().ok()))
            .unwrap_or(default)
    };
    let (t, steps) = (value("t=", 256), value("steps=", 4));
    let preset = args.iter().find_map(|a| a.strip_prefix("preset=")).unwrap_or("gpt2");
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("--preset {preset}, f32, AdamW, one device, T {t}, {threads} threads; tokens/s");
    let xla = std::env::var_os("MESHWORK_PJRT_PLUGIN").is_some();
    let mut rows: Vec<(usize, String, String, String)> = Vec::new();
    for &b in &batches {
        let show = |r: Result<f64, String>| match r {
            Ok(x) => format!("{x:.0}"),
            Err(e) => format!("failed: {e}"),
        };
        let interp = show(meshwork(preset, (b, t, steps), BackendKind::Interpreter));
        let on_xla = if xla {
            let backend = BackendKind::Xla { plugin: None, partitioner: Default::default() };
            show(meshwork(preset, (b, t, steps), backend))
        } else {
            "-".into()
        };
        rows.push((b, interp, on_xla, "-".into()));
    }
    if !args.iter().any(|a| a == "notorch") {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/torch_lm_cpu.py");
        let out = std::process::Command::new("python3")
            .arg(script)
            .args([preset.to_string(), threads.to_string(), t.to_string(), steps.to_string()])
            .args(batches.iter().map(ToString::to_string))
            .output();
        match out {
            Ok(o) if o.status.success() => {
                for line in String::from_utf8_lossy(&o.stdout).lines() {
                    let f: Vec<&str> = line.split_whitespace().collect();
                    if let [_, b, _, rate] = f[..]
                        && let Some(row) = rows.iter_mut().find(|r| r.0.to_string() == b)
                    {
                        row.3 = rate.parse::<f64>().map_or(rate.into(), |x| format!("{x:.0}"));
                    }
                }
            }
            Ok(o) => eprintln!("PyTorch's anchor failed: {}", String::from_utf8_lossy(&o.stderr)),
            Err(e) => eprintln!("PyTorch's anchor did not run: {e}"),
        }
    }
    println!("| batch | interpreter | XLA-CPU | PyTorch eager |");
    println!("|---|---|---|---|");
    for (b, i, x, p) in rows {
        println!("| {b} | {i} | {x} | {p} |");
    }
}
