//! The XLA back end beside the interpreter and JAX, in one run: training throughput of
//! the benchmark transformer (V256 T128 D256 H8 L4 F1024, f32, Adam; tokens/s) and of
//! an MLP (256 -> 1024 -> 16, f32, batch 256, SGD; samples/s), each compiled by
//! `Strategy::compile_train_step` on one device and run on the interpreter and on XLA
//! through a PJRT plugin, medians of 5 runs, beside JAX's `jit` of the same model
//! (`strategy/benches/jax/`, its 1x1 row, on one forced host device) where python3 can
//! import jax.
//!
//! ```text
//! MESHWORK_PJRT_PLUGIN=/path/to/plugin.so \
//!     cargo run --release -p meshwork-strategy --example xla_bench [-- ARGS]
//! ```
//!
//! ARGS: `small` (the transformer at batch 16), `small64` (batch 64), `gpt2` (GPT-2
//! small size: V50304 T1024 D768 H12 L12 F3072, batch 8, no interpreter run),
//! `mlp`; default `small mlp`. `nojax` skips JAX, `nointerp` the interpreter, and
//! `steps=N` sets the steps per timed run (default 10).

#![allow(clippy::print_stdout, clippy::print_stderr, missing_docs, unsafe_code)]

#[path = "common/mod.rs"]
mod common;

use std::sync::Arc;

use common::{Model, Noise, spec};
use meshwork_nn as nn;
use meshwork_program::{Builder, Tensor, Value};
use meshwork_strategy::Strategy;
use meshwork_strategy::backend::Xla;
use meshwork_strategy::partition::Shardings;
use meshwork_strategy::sharding::Mesh;
use meshwork_strategy::types::DType;

/// The MLP of the comparison: 256 -> hidden -> 16 with ReLU and softmax cross-entropy.
fn mlp_model(hidden: usize, steps: usize) -> Result<Model, Box<dyn std::error::Error>> {
    let (features, classes, batch) = (256, 16, 256);
    let mut b = Builder::new();
    let x = b.param("x", spec(&[batch, features], DType::F32))?;
    let y = b.param("y", spec(&[batch], DType::I32))?;
    let h = nn::linear(&mut b, x, hidden, "w1", Some("b1"))?;
    let h = b.relu(h)?;
    let z = nn::linear(&mut b, h, classes, "w2", Some("b2"))?;
    let loss = nn::softmax_cross_entropy(&mut b, z, y)?;
    let program = b.finish(&[loss])?;
    let weights: Vec<Value> = (2..program.params().len()).map(|k| Value(k as u32)).collect();
    let mut noise = Noise(7);
    let init = program.params()[2..]
        .iter()
        .map(|p| {
            let d = p.spec.shape.dims();
            let scale = if d.len() == 2 { 1.0 / (d[0] as f64).sqrt() } else { 0.0 };
            Ok((
                p.name.clone(),
                Tensor::f32(d, noise.f32s(p.spec.shape.num_elements(), scale, 0.0))?,
            ))
        })
        .collect::<Result<Vec<_>, meshwork_program::Error>>()?;
    let batches = (0..steps)
        .map(|_| {
            let xs = noise.f32s(batch * features, 1.0, 0.0);
            let ys: Vec<i32> =
                (0..batch).map(|_| (noise.uniform() * classes as f64) as i32).collect();
            Ok(vec![Tensor::f32(&[batch, features], xs)?, Tensor::i32(&[batch], ys)?])
        })
        .collect::<Result<Vec<_>, meshwork_program::Error>>()?;
    Ok(Model {
        program,
        loss,
        weights,
        optimizer: nn::Optimizer::Sgd,
        init,
        batches,
        lr: 0.1,
        per_step: batch,
    })
}

/// A transformer of `model`'s sizes at `batch` rows a step.
fn transformer(
    model: nn::Transformer,
    batch: usize,
    steps: usize,
) -> Result<Model, Box<dyn std::error::Error>> {
    let mut b = Builder::new();
    let rows = b.param("rows", spec(&[batch, model.seq + 1], DType::I32))?;
    let loss = model.loss(&mut b, rows, DType::F32)?;
    let program = b.finish(&[loss])?;
    let weights: Vec<Value> = (1..program.params().len()).map(|k| Value(k as u32)).collect();
    let mut noise = Noise(0x9e37_79b9_7f4a_7c15);
    let init = common::transformer_init(&program, &mut noise)?;
    let batches = common::token_batches(&model, batch, 64.max(batch), steps, &mut noise)?
        .into_iter()
        .map(|t| vec![t])
        .collect();
    Ok(Model {
        program,
        loss,
        weights,
        optimizer: nn::Optimizer::adam(),
        init,
        batches,
        lr: 1e-3,
        per_step: batch * model.seq,
    })
}

/// Times the model's steps compiled on one device of `strategy`: 1 untimed and 5 timed
/// runs from the same initial state, each run all its steps in one host call
/// (`run_steps`: on XLA every step is enqueued before any loss is read back, as JAX's
/// loop dispatches its steps and blocks once at the end); the median rate.
fn time_steps(strategy: &Strategy, model: &Model) -> Result<f64, meshwork_strategy::Error> {
    let mut step = strategy.compile_train_step(
        &model.program,
        model.loss,
        &model.weights,
        model.optimizer,
        &one_device()?,
    )?;
    let lrs = vec![model.lr; model.batches.len()];
    let mut rates = Vec::new();
    for run in 0..6 {
        for (name, t) in &model.init {
            step.set(name, t)?;
        }
        step.reset_optimizer()?;
        let t0 = std::time::Instant::now();
        step.run_steps(&model.batches, &lrs)?;
        let dt = t0.elapsed().as_secs_f64();
        if run > 0 {
            rates.push((model.batches.len() * model.per_step) as f64 / dt);
        }
    }
    Ok(common::median(rates))
}

fn one_device() -> Result<Shardings, meshwork_strategy::Error> {
    Ok(Shardings::new(Mesh::iota(&[("data", 1), ("model", 1)])?))
}

/// A JAX script of `strategy/benches/jax/` on one forced host device, as meshwork's XLA
/// runs on one device (the scripts force 4 unless told), its stdout lines; `None`
/// when JAX is absent.
fn jax_one_device(script: &str, args: &[&str]) -> Option<Vec<String>> {
    let path = format!("{}/benches/jax/{script}", env!("CARGO_MANIFEST_DIR"));
    let out = std::process::Command::new("python3")
        .arg(&path)
        .args(args)
        .env("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).lines().map(String::from).collect())
}

/// One row: the interpreter's and XLA's medians, and JAX's figure.
fn row(
    what: &str,
    unit: &str,
    model: &Model,
    xla: &Strategy,
    interp: bool,
    jax: Option<f64>,
) -> Result<(), Box<dyn std::error::Error>> {
    let interp = if interp { Some(time_steps(&Strategy::data_parallel(1)?, model)?) } else { None };
    let on_xla = time_steps(xla, model)?;
    let cell = |v: Option<f64>| v.map_or(format!("{:>12}", "-"), |v| format!("{v:>12.0}"));
    let ratio =
        |v: Option<f64>| v.map_or(format!("{:>9}", "-"), |v| format!("{:>8.2}x", on_xla / v));
    println!(
        "  {what:<34} {} {} {}  {unit}   XLA/interp {}  XLA/JAX {}",
        cell(interp),
        cell(Some(on_xla)),
        cell(jax),
        ratio(interp),
        ratio(jax)
    );
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("TF_CPP_MIN_LOG_LEVEL").is_none() {
        // SAFETY: first thing in main, before any other thread.
        unsafe { std::env::set_var("TF_CPP_MIN_LOG_LEVEL", "2") };
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |f: &str| args.iter().any(|a| a == f);
    let steps: usize =
        args.iter().find_map(|a| a.strip_prefix("steps=")?.parse().ok()).unwrap_or(10);
    let mut which: Vec<&str> = args
        .iter()
        .map(String::as_str)
        .filter(|a| ["small", "small64", "gpt2", "mlp"].contains(a))
        .collect();
    if which.is_empty() {
        which = vec!["small", "mlp"];
    }
    let plugin = meshwork_xla::find::plugin_path(None)?;
    let plugin = meshwork_xla::find::load(&plugin)?;
    let backend = Arc::new(Xla::new(&plugin)?);
    let device = backend
        .session()
        .client()
        .devices()
        .first()
        .map(|d| d.kind().to_string())
        .unwrap_or_default();
    let xla = Strategy::data_parallel(1)?.with_backend(backend);
    println!(
        "meshwork on one device ({} cores here; XLA device: {device}, plugin PJRT {}.{}); {steps} steps per run, median of 5 runs",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        plugin.version().0,
        plugin.version().1,
    );
    println!("  {:<34} {:>12} {:>12} {:>12}", "model", "interpreter", "XLA", "JAX");
    let jax_on = !flag("nojax");
    let interp = !flag("nointerp");
    for w in which {
        match w {
            "small" | "small64" => {
                let batch = if w == "small" { 16 } else { 64 };
                let jax = if jax_on {
                    jax_one_device("transformer_train_jax.py", &[&steps.to_string()])
                } else {
                    None
                };
                let model = transformer(common::TRANSFORMER, batch, steps)?;
                let jax_rate = if batch == 16 { common::jax_figure(&jax, 1, 1) } else { None };
                row(
                    &format!("transformer V256 D256 L4, batch {batch}"),
                    "tokens/s",
                    &model,
                    &xla,
                    interp,
                    jax_rate,
                )?;
            }
            "gpt2" => {
                let gpt2 = nn::Transformer {
                    vocab: 50304,
                    seq: 1024,
                    dim: 768,
                    heads: 12,
                    layers: 12,
                    ffn: 3072,
                };
                let model = transformer(gpt2, 8, steps)?;
                row("GPT-2 small size, batch 8", "tokens/s", &model, &xla, false, None)?;
            }
            _ => {
                let jax = if jax_on {
                    jax_one_device("mlp_train_jax.py", &["1024", &steps.to_string()])
                } else {
                    None
                };
                let model = mlp_model(1024, steps)?;
                row(
                    "MLP 256 -> 1024 -> 16, batch 256",
                    "samples/s",
                    &model,
                    &xla,
                    interp,
                    common::jax_figure(&jax, 1, 1),
                )?;
            }
        }
    }
    Ok(())
}
