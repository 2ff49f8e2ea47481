//! Training throughput of the main job's MLP on a wider model (hidden 1024) for the
//! meshes 1x1, 2x1, 1x2 and 2x2, side by side in one run, each the median of 5 runs;
//! then the transformer `meshwork train --model transformer` trains (its training step
//! as the CLI compiles it: V256 T128 D256 H8 L4 F1024, f32, batch 16, Adam, Megatron's
//! shardings) on the same meshes beside `strategy/benches/jax/transformer_train_jax.py`
//! (the copy of `../shared/bench`'s script) run in the same process tree, tokens/s.
//!
//! `cargo run --release -p meshwork-strategy --example train_bench [-- HIDDEN STEPS
//! TRANSFORMER_STEPS]` (defaults 1024, 20 and 10; `nojax` skips JAX).

#![allow(clippy::print_stdout, missing_docs)]

#[path = "common/mlp.rs"]
mod mlp;
use mlp::{Dataset, Params, TrainConfig};

use meshwork_strategy::Strategy;
use meshwork_strategy::partition::{Shardings, megatron_spec};
use meshwork_strategy::sharding::Mesh;
use meshwork_strategy::types::DType;

#[path = "common/mod.rs"]
mod common;

/// The transformer beside JAX: tokens/s per mesh.
fn transformer(steps: usize, jax: bool) -> Result<(), Box<dyn std::error::Error>> {
    let batch = 16;
    let train = common::transformer_model(batch, steps)?;
    let jax_lines =
        if jax { common::jax("transformer_train_jax.py", &[&steps.to_string()]) } else { None };
    println!(
        "Transformer V256 T128 D256 H8 L4 F1024, f32, batch {batch}, Adam, {steps} steps per run, median of 5 runs"
    );
    println!("  mesh    tokens/s   ms/step   JAX tokens/s   vs JAX");
    for (d, m) in [(1, 1), (2, 1), (1, 2), (2, 2)] {
        let mesh = Mesh::iota(&[("data", d), ("model", m)])?;
        let mut shardings = Shardings::new(mesh).with("rows", "P('data')")?;
        for p in &train.program.params()[1..] {
            shardings = shardings.with_spec(&p.name, megatron_spec(&p.name, p.spec.shape.rank()));
        }
        let strategy = Strategy::data_parallel(d * m)?;
        let (rate, _, _) = common::time_runs(&strategy, &train, &shardings)?;
        let (j, vs) = match common::jax_figure(&jax_lines, d, m) {
            Some(j) => (format!("{j:>12.0}"), format!("{:>6.2}x", rate / j)),
            None => (format!("{:>12}", "no JAX"), format!("{:>7}", "-")),
        };
        println!(
            "  {d}x{m}  {rate:>10.0}  {:>8.2}   {j}  {vs}",
            1e3 * train.per_step as f64 / rate
        );
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let nojax = std::env::args().any(|a| a == "nojax");
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let hidden = args.first().copied().unwrap_or(1024);
    let steps = args.get(1).copied().unwrap_or(20);
    let (features, classes, batch) = (256, 16, 256);
    let data = Dataset::synthetic(1, 4096, features, classes);
    let init = Params::init(1, features, hidden, classes);
    println!(
        "MLP {features} -> {hidden} -> {classes}, f32, batch {batch}, {steps} steps per run, median of 5 runs ({} cores)",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!("  mesh   samples/s   ms/step   vs 1x1");
    let mut base = None;
    for (d, m) in [(1, 1), (2, 1), (1, 2), (2, 2)] {
        let config = TrainConfig {
            data: d,
            model: m,
            steps,
            batch,
            lr: 0.1,
            dtype: DType::F32,
            ..TrainConfig::default()
        };
        let mut rates: Vec<f64> =
            (0..5)
                .map(|_| {
                    let report = mlp::train(&config, &data, &init, &mut |_| {
                        std::ops::ControlFlow::Continue(())
                    })?;
                    Ok((steps * batch) as f64 / report.elapsed.as_secs_f64())
                })
                .collect::<Result<_, mlp::Error>>()?;
        rates.sort_by(|a, b| a.total_cmp(b));
        let rate = rates[rates.len() / 2];
        let base = *base.get_or_insert(rate);
        println!(
            "  {d}x{m}  {rate:>11.0}  {:>8.2}   {:.2}x",
            1e3 * batch as f64 / rate,
            rate / base
        );
    }
    transformer(args.get(2).copied().unwrap_or(10).max(1), !nojax)
}
