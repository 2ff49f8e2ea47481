//! Training throughput of the main job's MLP on a wider model (hidden 1024) for the
//! meshes 1x1, 2x1, 1x2 and 2x2, side by side in one run, each the median of 5 runs.
//!
//! `cargo run --release -p meshwork-strategy --example train_bench [-- HIDDEN STEPS]`

#![allow(clippy::print_stdout, missing_docs)]

use meshwork_strategy::mlp::{self, Dataset, Params, TrainConfig};
use meshwork_strategy::types::DType;

fn main() -> Result<(), meshwork_strategy::Error> {
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
                .collect::<Result<_, meshwork_strategy::Error>>()?;
        rates.sort_by(|a, b| a.total_cmp(b));
        let rate = rates[rates.len() / 2];
        let base = *base.get_or_insert(rate);
        println!(
            "  {d}x{m}  {rate:>11.0}  {:>8.2}   {:.2}x",
            1e3 * batch as f64 / rate,
            rate / base
        );
    }
    Ok(())
}
