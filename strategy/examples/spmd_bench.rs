//! Training throughput of compiled SPMD training steps (`Strategy::compile_train_step`:
//! parameters and optimizer state resident on the devices, a step moves its batch in
//! and its loss out) on the meshes 1x1, 2x1, 1x2 and 2x2 (`data x model`), beside
//! JAX's `jit` + `NamedSharding` of the same model on the same meshes, in one run:
//!
//! 1. the transformer of `nn/testdata` at V256 T128 D256 H8 L4 F1024,
//!    f32, batch 16, Adam (lr 1e-3), rows over `data`, Megatron's specs over `model`
//!    (tokens/s), beside `strategy/benches/jax/transformer_train_jax.py`;
//! 2. the MLP 256 -> 1024 -> 16, f32, batch 256, SGD (lr 0.1), `w1`/`b1` by columns
//!    and `w2` by rows over `model`, the batch over `data` (samples/s), beside
//!    `strategy/benches/jax/mlp_train_jax.py`.
//!
//! Each figure is the median of 5 timed runs (after one untimed run) of `STEPS` steps
//! (10 for the transformer, 20 for the MLP). Beside each mesh: the bytes a step moves
//! between devices (the partitioner's collectives) and the minimum the shardings
//! require (computed here from the model's sizes: the data-parallel gradient
//! all-reduce of every weight's local part, and Megatron's two all-reduces per block
//! each way of a block's activations, with the same bandwidth-optimal costs).
//!
//! JAX runs when `python3` can import it (`pip install jax==0.10.2 numpy`); otherwise
//! its column says so.
//!
//! `cargo run --release -p meshwork-strategy --example spmd_bench [transformer] [mlp] [DxM ...]`
//! (the sections and meshes named, or all of them; `nojax` skips JAX; `steps=N` runs N
//! steps per run instead of 10 and 20).

#![allow(clippy::print_stdout, missing_docs)]

use meshwork_nn::Optimizer;
use meshwork_program::{Builder, Tensor};
use meshwork_strategy::Strategy;
use meshwork_strategy::partition::{Shardings, megatron_spec};
use meshwork_strategy::sharding::Mesh;
use meshwork_strategy::types::DType;

#[path = "common/mod.rs"]
mod common;
use common::{Model, Noise, jax, jax_figure, spec, time_runs};

const MESHES: [(usize, usize); 4] = [(1, 1), (2, 1), (1, 2), (2, 2)];

/// The bandwidth-optimal all-reduce cost of `bytes` per device over `k` devices,
/// summed over the `devices` of the mesh (the partitioner's convention).
fn all_reduce_bytes(bytes: u64, k: u64, devices: u64) -> u64 {
    if k <= 1 { 0 } else { 2 * (k - 1) * bytes / k * devices }
}

struct Row {
    rate: f64,
    ms: f64,
    moved: u64,
    minimum: u64,
    /// Collectives, and the launches that carry them.
    collectives: (usize, usize),
}

fn transformer(
    jax_lines: &Option<Vec<String>>,
    steps: usize,
    meshes: &[(usize, usize)],
) -> Result<(), Box<dyn std::error::Error>> {
    let model = common::TRANSFORMER;
    let batch = 16;
    let train = common::transformer_model(batch, steps)?;
    let program = train.program.clone();
    println!(
        "Transformer V{} T{} D{} H{} L{} F{}, f32, batch {batch}, Adam, {steps} steps per run, \
         median of 5 runs ({} cores)",
        model.vocab,
        model.seq,
        model.dim,
        model.heads,
        model.layers,
        model.ffn,
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!(
        "  mesh   meshwork tokens/s   ms/step      JAX tokens/s   vs JAX   collectives (launches)   MB moved/step   minimum MB"
    );
    for &(d, m) in meshes {
        let mesh = Mesh::iota(&[("data", d), ("model", m)])?;
        let mut shardings = Shardings::new(mesh).with("rows", "P('data')")?;
        for p in &program.params()[1..] {
            shardings = shardings.with_spec(&p.name, megatron_spec(&p.name, p.spec.shape.rank()));
        }
        let strategy = Strategy::data_parallel(d * m)?;
        let (rate, moved, collectives) = time_runs(&strategy, &train, &shardings)?;
        // The minimum: every weight's gradient (its local part) all-reduced over
        // data, and per block two all-reduces over model each way of a block's
        // activations [B/d, T, D] (Megatron).
        let devices = (d * m) as u64;
        let mut minimum = 0;
        for p in &program.params()[1..] {
            let rank = p.spec.shape.rank();
            let split = megatron_spec(&p.name, rank)
                != meshwork_strategy::sharding::PartitionSpec::replicated();
            let local = (p.spec.shape.num_elements() * 4 / if split { m } else { 1 }) as u64;
            minimum += all_reduce_bytes(local, d as u64, devices);
        }
        let act = (batch / d * model.seq * model.dim * 4) as u64;
        minimum += 4 * model.layers as u64 * all_reduce_bytes(act, m as u64, devices);
        let row =
            Row { rate, ms: 1e3 * (batch * model.seq) as f64 / rate, moved, minimum, collectives };
        print_row(d, m, &row, jax_figure(jax_lines, d, m));
    }
    Ok(())
}

fn print_row(d: usize, m: usize, row: &Row, jax: Option<f64>) {
    let (j, vs) = match jax {
        Some(j) => (format!("{j:>12.0}"), format!("{:>6.2}x", row.rate / j)),
        None => (format!("{:>12}", "no JAX"), format!("{:>7}", "-")),
    };
    println!(
        "  {d}x{m}  {:>17.0}  {:>8.2}   {j}  {vs}   {:>20}   {:>13.2}   {:>10.2}",
        row.rate,
        row.ms,
        format!("{} in {}", row.collectives.0, row.collectives.1),
        row.moved as f64 / 1e6,
        row.minimum as f64 / 1e6
    );
}

fn mlp(
    jax_lines: &Option<Vec<String>>,
    steps: usize,
    meshes: &[(usize, usize)],
) -> Result<(), Box<dyn std::error::Error>> {
    let (features, hidden, classes, batch, rows_total) = (256, 1024, 16, 256, 4096);
    let f32s = |d: &[usize]| spec(d, DType::F32);
    let mut b = Builder::new();
    let x = b.param("x", f32s(&[batch, features]))?;
    let y = b.param("y", f32s(&[batch, classes]))?;
    let w1 = b.param("w1", f32s(&[features, hidden]))?;
    let b1 = b.param("b1", f32s(&[hidden]))?;
    let w2 = b.param("w2", f32s(&[hidden, classes]))?;
    let b2 = b.param("b2", f32s(&[classes]))?;
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
    let mut noise = Noise(7);
    let init = vec![
        (
            "w1".to_string(),
            Tensor::f32(
                &[features, hidden],
                noise.f32s(features * hidden, 1.0 / (features as f64).sqrt(), 0.0),
            )?,
        ),
        ("b1".to_string(), Tensor::f32(&[hidden], vec![0.0; hidden])?),
        (
            "w2".to_string(),
            Tensor::f32(
                &[hidden, classes],
                noise.f32s(hidden * classes, 1.0 / (hidden as f64).sqrt(), 0.0),
            )?,
        ),
        ("b2".to_string(), Tensor::f32(&[classes], vec![0.0; classes])?),
    ];
    let xs = noise.f32s(rows_total * features, 1.0, 0.0);
    let labels: Vec<usize> =
        (0..rows_total).map(|_| (noise.uniform() * classes as f64) as usize % classes).collect();
    let batches: Vec<Vec<Tensor>> = (0..steps)
        .map(|s| {
            let r0 = (s * batch) % rows_total;
            let mut ys = vec![0f32; batch * classes];
            for i in 0..batch {
                ys[i * classes + labels[r0 + i]] = 1.0;
            }
            Ok(vec![
                Tensor::f32(
                    &[batch, features],
                    xs[r0 * features..(r0 + batch) * features].to_vec(),
                )?,
                Tensor::f32(&[batch, classes], ys)?,
            ])
        })
        .collect::<Result<_, meshwork_program::Error>>()?;
    let train = Model {
        program: program.clone(),
        loss,
        weights: vec![w1, b1, w2, b2],
        optimizer: Optimizer::Sgd,
        init,
        batches,
        lr: 0.1,
        per_step: batch,
    };
    println!(
        "MLP {features} -> {hidden} -> {classes}, f32, batch {batch}, SGD, {steps} steps per run, median of 5 runs"
    );
    println!(
        "  mesh  meshwork samples/s   ms/step     JAX samples/s   vs JAX   collectives (launches)   MB moved/step   minimum MB"
    );
    for &(d, m) in meshes {
        let mesh = Mesh::iota(&[("data", d), ("model", m)])?;
        let shardings = Shardings::new(mesh)
            .with("x", "P('data')")?
            .with("y", "P('data')")?
            .with("w1", "P(None, 'model')")?
            .with("b1", "P('model')")?
            .with("w2", "P('model', None)")?
            .with("b2", "P()")?;
        let strategy = Strategy::data_parallel(d * m)?;
        let (rate, moved, collectives) = time_runs(&strategy, &train, &shardings)?;
        // The minimum: the gradients' local parts all-reduced over data; over model,
        // the logits' partial sums [B/d, C] all-reduced forward and the hidden
        // activations' gradient needs none (w1's input is x, not trained through).
        let devices = (d * m) as u64;
        let mut minimum = 0;
        for (n, split) in
            [(features * hidden, true), (hidden, true), (hidden * classes, true), (classes, false)]
        {
            let local = (n * 4 / if split { m } else { 1 }) as u64;
            minimum += all_reduce_bytes(local, d as u64, devices);
        }
        minimum += all_reduce_bytes((batch / d * classes * 4) as u64, m as u64, devices);
        let row = Row { rate, ms: 1e3 * batch as f64 / rate, moved, minimum, collectives };
        print_row(d, m, &row, jax_figure(jax_lines, d, m));
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let sections = ["transformer", "mlp"];
    let named = |s: &str| args.iter().any(|a| a == s);
    let run = |s: &str| named(s) || !sections.iter().any(|s| named(s));
    let mut meshes: Vec<(usize, usize)> =
        MESHES.iter().copied().filter(|(d, m)| named(&format!("{d}x{m}"))).collect();
    if meshes.is_empty() {
        meshes = MESHES.to_vec();
    }
    let jax = |script: &str, args: &[&str]| if named("nojax") { None } else { jax(script, args) };
    let steps_arg = args.iter().find_map(|a| a.strip_prefix("steps=")?.parse::<usize>().ok());
    if run("transformer") {
        let steps = steps_arg.unwrap_or(10);
        let jax_lines = jax("transformer_train_jax.py", &[&steps.to_string()]);
        transformer(&jax_lines, steps, &meshes)?;
    }
    if run("mlp") {
        let steps = steps_arg.unwrap_or(20);
        let jax_lines = jax("mlp_train_jax.py", &["1024", &steps.to_string()]);
        mlp(&jax_lines, steps, &meshes)?;
    }
    Ok(())
}
