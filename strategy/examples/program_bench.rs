//! The program layer's fast interpreter beside its anchors, measured in one run:
//!
//! 1. GEMM f32 at 256/512/1024 cubed (a `dot_general` program) as GFLOP/s, beside
//!    `matrixmultiply` on one thread (ndarray's `dot`) and JAX's `jax.jit(jnp.dot)`;
//! 2. a 5-op elementwise chain over 16 Mi f32 (one fused pass) beside the
//!    memory-traffic bound (a copy of the same bytes on the same threads);
//! 3. the training step of `train_bench`'s MLP (256 -> 1024 -> 16, f32, batch 256,
//!    SGD) as one program, beside the hand-written step of `common/mlp.rs` on a 1x1 mesh and
//!    JAX's jit step on one device.
//!
//! JAX's figures come from `strategy/benches/jax/*.py`, run here when `python3` can
//! import jax (`pip install jax==0.10.2 numpy`); otherwise those rows say so.
//!
//! `cargo run --release -p meshwork-strategy --example program_bench [gemm] [chain] [mlp]`
//! (the sections named, or all of them).

#![allow(clippy::print_stdout, missing_docs)]

#[path = "common/mlp.rs"]
mod mlp;
use mlp::{Dataset, Params, TrainConfig};

use std::time::Instant;

use meshwork_nn::{Optimizer, TrainStep};
use meshwork_program::fast::{Executable, Options};
use meshwork_program::{Builder, Env, Tensor};
use meshwork_strategy::types::{DType, Shape, TensorSpec};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn spec(dims: &[usize]) -> TensorSpec {
    TensorSpec::new(DType::F32, Shape::new(dims).expect("a small shape"))
}

/// `n` values in [-0.5, 0.5) from SplitMix64 (the stream the trainer draws from).
fn noise(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

/// Runs a JAX script of `strategy/benches/jax/`, returning its stdout lines, or `None`
/// when JAX is absent.
fn jax(script: &str) -> Option<Vec<String>> {
    let path = format!("{}/benches/jax/{script}", env!("CARGO_MANIFEST_DIR"));
    let out = std::process::Command::new("python3").arg(&path).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).lines().map(String::from).collect())
}

/// A JAX figure: the number before `unit` on the line containing `key`.
fn figure(lines: &Option<Vec<String>>, key: &str, unit: &str) -> Option<f64> {
    let line = lines.as_ref()?.iter().find(|l| l.contains(key))?;
    line.split(unit).next()?.split_whitespace().last()?.parse().ok()
}

fn gemm(jax_lines: &Option<Vec<String>>) -> Result<(), meshwork_program::Error> {
    println!("GEMM f32 n^3 (GFLOP/s, median of 9)");
    println!("    n   meshwork   matrixmultiply 1T   JAX     vs JAX   vs mm 1T");
    for n in [256usize, 512, 1024] {
        let mut b = Builder::new();
        let x = b.param("a", spec(&[n, n]))?;
        let y = b.param("b", spec(&[n, n]))?;
        let z = b.matmul(x, y)?;
        let exe = Executable::compile(&b.finish(&[z])?, Options::default());
        let (a, c) = (noise(n * n, 1), noise(n * n, 2));
        let inputs = [Tensor::f32(&[n, n], a.clone())?, Tensor::f32(&[n, n], c.clone())?];
        let flops = 2.0 * (n as f64).powi(3);
        let mut ts = Vec::new();
        for _ in 0..10 {
            let t = Instant::now();
            let out = exe.run(&inputs, &Env::local())?;
            ts.push(t.elapsed().as_secs_f64());
            exe.recycle(out);
        }
        let ours = flops / median(ts[1..].to_vec()) / 1e9;
        let (aa, cc) = (
            ndarray::Array2::from_shape_vec((n, n), a).expect("n x n"),
            ndarray::Array2::from_shape_vec((n, n), c).expect("n x n"),
        );
        let mut ts = Vec::new();
        for _ in 0..10 {
            let t = Instant::now();
            std::hint::black_box(aa.dot(&cc));
            ts.push(t.elapsed().as_secs_f64());
        }
        let mm = flops / median(ts[1..].to_vec()) / 1e9;
        let j = figure(jax_lines, &format!("{n}^3"), "GFLOP/s");
        let (js, jr) = match j {
            Some(j) => (format!("{j:6.1}"), format!("{:.2}x", ours / j)),
            None => ("absent".into(), "-".into()),
        };
        println!("  {n:>4}   {ours:8.1}   {mm:17.1}   {js}   {jr:>6}   {:.2}x", ours / mm);
    }
    Ok(())
}

fn chain() -> Result<(), meshwork_program::Error> {
    let n = 16 << 20;
    let threads = Options::default().threads;
    let mut b = Builder::new();
    let x = b.param("x", spec(&[n]))?;
    let (c1, c2, c3) =
        (b.constant(1.5, DType::F32)?, b.constant(0.25, DType::F32)?, b.constant(0.1, DType::F32)?);
    let y = b.mul(x, c1)?;
    let y = b.add(y, c2)?;
    let y = b.mul(y, x)?;
    let y = b.sub(y, c3)?;
    let y = b.relu(y)?;
    let exe = Executable::compile(&b.finish(&[y])?, Options::default());
    let input = [Tensor::f32(&[n], noise(n, 3))?];
    // The bound: reading and writing the same bytes once, on the same threads (glibc's
    // copy of this size streams its stores past the caches, as the chain does).
    let src = noise(n, 4);
    let mut dst = vec![0f32; n];
    let mut copy = || {
        std::thread::scope(|s| {
            let per = n.div_ceil(threads);
            for (d, c) in dst.chunks_mut(per).zip(src.chunks(per)) {
                s.spawn(move || d.copy_from_slice(c));
            }
        })
    };
    // Rounds alternate the two, so a noisy neighbour slows both alike; each round
    // times 5 runs of each and keeps their medians.
    let (mut ours, mut bounds, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    copy();
    exe.recycle(exe.run(&input, &Env::local())?);
    for _ in 0..9 {
        let mut ts = Vec::new();
        for _ in 0..5 {
            let t = Instant::now();
            copy();
            ts.push(t.elapsed().as_secs_f64());
        }
        let bound = median(ts);
        let mut ts = Vec::new();
        for _ in 0..5 {
            let t = Instant::now();
            let out = exe.run(&input, &Env::local())?;
            ts.push(t.elapsed().as_secs_f64());
            exe.recycle(out);
        }
        let t = median(ts);
        ours.push(t);
        bounds.push(bound);
        ratios.push(t / bound);
    }
    let (ours, bound) = (median(ours), median(bounds));
    let mut r = ratios.clone();
    r.sort_by(f64::total_cmp);
    println!();
    println!(
        "Elementwise chain relu((x*1.5+0.25)*x-0.1), 16 Mi f32, {threads} threads (9 alternating rounds)"
    );
    println!(
        "  meshwork {:.2} ms ({:.1} GB/s)   bound {:.2} ms ({:.1} GB/s)   {:.2}x the bound (per-round ratios {:.2}..{:.2})",
        ours * 1e3,
        (8 * n) as f64 / ours / 1e9,
        bound * 1e3,
        (8 * n) as f64 / bound / 1e9,
        r[r.len() / 2],
        r[0],
        r[r.len() - 1]
    );
    Ok(())
}

fn mlp_step(jax_lines: &Option<Vec<String>>) -> Result<(), Box<dyn std::error::Error>> {
    let (features, hidden, classes, batch, steps) = (256, 1024, 16, 256, 20);
    let data = Dataset::synthetic(1, 4096, features, classes);
    let init = Params::init(1, features, hidden, classes);
    // The program: the same model and loss as mlp.rs and the JAX script.
    let mut b = Builder::new();
    let x = b.param("x", spec(&[batch, features]))?;
    let y = b.param("y", spec(&[batch, classes]))?;
    let w1 = b.param("w1", spec(&[features, hidden]))?;
    let b1 = b.param("b1", spec(&[hidden]))?;
    let w2 = b.param("w2", spec(&[hidden, classes]))?;
    let b2 = b.param("b2", spec(&[classes]))?;
    let h = b.matmul(x, w1)?;
    let h = b.add(h, b1)?;
    let h = b.relu(h)?;
    let z = b.matmul(h, w2)?;
    let z = b.add(z, b2)?;
    let lp = b.log_softmax(z, -1)?;
    let picked = b.mul(y, lp)?;
    let s = b.reduce_sum(picked, &[0, 1], false)?;
    let nb = b.constant(-(batch as f64), DType::F32)?;
    let loss = b.div(s, nb)?;
    let program = b.finish(&[loss])?;
    let step = TrainStep::new(&program, loss, &[w1, b1, w2, b2], Optimizer::Sgd)?;
    let exe = Executable::compile(&step.program, Options::default());
    let f32s = |a: &ndarray::ArrayD<f64>| a.iter().map(|&v| v as f32).collect::<Vec<f32>>();
    let xs = f32s(&data.x.clone().into_dyn());
    let ys: Vec<f32> = {
        let mut v = vec![0f32; data.rows() * classes];
        for (r, &c) in data.labels.iter().enumerate() {
            v[r * classes + c] = 1.0;
        }
        v
    };
    let batches: Vec<[Tensor; 2]> = (0..steps)
        .map(|s| {
            let r0 = (s * batch) % data.rows();
            Ok([
                Tensor::f32(
                    &[batch, features],
                    xs[r0 * features..(r0 + batch) * features].to_vec(),
                )?,
                Tensor::f32(&[batch, classes], ys[r0 * classes..(r0 + batch) * classes].to_vec())?,
            ])
        })
        .collect::<Result<_, meshwork_program::Error>>()?;
    let params0 = vec![
        Tensor::f32(&[features, hidden], f32s(&init.w1.clone().into_dyn()))?,
        Tensor::f32(&[hidden], f32s(&init.b1.clone().into_dyn()))?,
        Tensor::f32(&[hidden, classes], f32s(&init.w2.clone().into_dyn()))?,
        Tensor::f32(&[classes], f32s(&init.b2.clone().into_dyn()))?,
    ];
    let mut rates = Vec::new();
    let mut last_loss = 0.0;
    for _ in 0..6 {
        let mut params = params0.clone();
        let t = Instant::now();
        for (s, [bx, by]) in batches.iter().enumerate() {
            let mut inputs = vec![bx.clone(), by.clone()];
            inputs.append(&mut params);
            inputs.extend(step.scalars(0.1, s)?);
            let mut out = exe.run_owned(inputs, &Env::local())?;
            params = out.split_off(1);
            last_loss = out[0].to_f64()[0];
            exe.recycle(out);
        }
        rates.push((steps * batch) as f64 / t.elapsed().as_secs_f64());
    }
    let ours = median(rates[1..].to_vec());
    let config = TrainConfig { steps, batch, lr: 0.1, dtype: DType::F32, ..TrainConfig::default() };
    let mut hand = Vec::new();
    for _ in 0..5 {
        let report =
            mlp::train(&config, &data, &init, &mut |_| std::ops::ControlFlow::Continue(()))?;
        hand.push((steps * batch) as f64 / report.elapsed.as_secs_f64());
    }
    let hand = median(hand);
    let j = figure(jax_lines, "1x1", "samples/s");
    println!();
    println!(
        "MLP train step {features} -> {hidden} -> {classes}, f32, batch {batch}, SGD, {steps} steps per run (samples/s, median of 5)"
    );
    println!(
        "  program {ours:.0} (last loss {last_loss:.4})   hand-written mlp.rs 1x1 {hand:.0} ({:.2}x)",
        ours / hand
    );
    match j {
        Some(j) => println!("  JAX jit 1 device {j:.0}   program vs JAX {:.2}x", ours / j),
        None => println!("  JAX absent"),
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!(
        "program_bench: fast interpreter, {} threads on {} cores",
        Options::default().threads,
        std::thread::available_parallelism().map_or(1, usize::from)
    );
    // Sections to run: any of `gemm`, `chain`, `mlp` as arguments; all by default.
    let only: Vec<String> = std::env::args().skip(1).collect();
    let run = |name: &str| only.is_empty() || only.iter().any(|o| o == name);
    let gemm_jax = if run("gemm") { jax("gemm_jax.py") } else { None };
    if run("gemm") {
        gemm(&gemm_jax)?;
    }
    if run("chain") {
        chain()?;
    }
    let mlp_jax = if run("mlp") { jax("mlp_train_jax.py") } else { None };
    if run("mlp") {
        mlp_step(&mlp_jax)?;
    }
    println!();
    for l in gemm_jax.iter().chain(&mlp_jax).flatten() {
        println!("  [jax] {l}");
    }
    Ok(())
}
