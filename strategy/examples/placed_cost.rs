//! Cost-aware placement of programs without device scopes: the estimated and the
//! measured step time of [`Strategy::place_with_cost`]'s placement beside
//! TensorFlow's default placement ([`Strategy::place`]: everything on device 0), on
//! 2 devices, with kernel rates and the link measured on this machine first.
//!
//! 1. A mixture of 4 experts trained by SGD (f32; each expert `tanh(x W) V`, batch
//!    256, 512 → 512 → 128): independent branches that the cost pass spreads.
//! 2. An MLP of 6 layers trained by SGD (f32, batch 64, 512 wide) whose memory one
//!    device must not hold: each device capped at 60% of what the whole step needs.
//!
//! Measured figures are medians of 30 steps (after 3 untimed ones).
//!
//! `cargo run --release -p meshwork-strategy --example placed_cost`

#![allow(clippy::print_stdout, missing_docs)]

use std::time::Instant;

use meshwork_nn::{Optimizer, TrainStep};
use meshwork_program::{Builder, Program, Tensor, Value};
use meshwork_strategy::Strategy;
use meshwork_strategy::placed::{PlaceOptions, Placed};
use meshwork_strategy::types::DType;

#[path = "common/mod.rs"]
mod common;
use common::{Noise, median, spec};

type Error = Box<dyn std::error::Error>;

/// A training step of `program` (weights: every parameter but the first `fed`) and
/// its carry.
fn train_step(
    program: &Program,
    loss: Value,
    fed: usize,
) -> Result<(TrainStep, Vec<(usize, usize)>), Error> {
    let weights: Vec<Value> = (fed..program.params().len()).map(|k| Value(k as u32)).collect();
    let step = TrainStep::new(program, loss, &weights, Optimizer::Sgd)?;
    let carry = (1..step.program.results().len()).map(|r| (r, r - 1 + fed)).collect();
    Ok((step, carry))
}

/// Median seconds per step of `placed` (weights set to small noise).
fn measure(
    placed: &Placed<'_>,
    step: &TrainStep,
    program: &Program,
    fed: &[Tensor],
) -> Result<f64, Error> {
    let mut noise = Noise(3);
    for p in &program.params()[fed.len()..] {
        let n = p.spec.shape.num_elements();
        placed.set(&p.name, Tensor::f32(p.spec.shape.dims(), noise.f32s(n, 0.05, 0.0))?)?;
    }
    let mut times = Vec::new();
    for s in 0..33 {
        let [lr, count] = step.scalars(1e-3, s)?;
        let mut feeds = fed.to_vec();
        feeds.extend([lr, count]);
        let t = Instant::now();
        placed.step(&feeds)?;
        if s >= 3 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    Ok(median(times))
}

fn report(
    name: &str,
    tf: &Placed<'_>,
    by_cost: &Placed<'_>,
    tf_estimate: f64,
    measured: (f64, f64),
) {
    let estimate = by_cost.estimate().expect("placed by cost");
    println!("{name}");
    println!(
        "  placement        devices used   estimated ms/step   measured ms/step   MB moved/step"
    );
    println!(
        "  TF default       {:>12}   {:>17.2}   {:>16.2}   {:>13.2}",
        tf.parts().count(),
        1e3 * tf_estimate,
        1e3 * measured.0,
        tf.transfer_bytes() as f64 / 1e6
    );
    println!(
        "  by cost          {:>12}   {:>17.2}   {:>16.2}   {:>13.2}",
        by_cost.parts().count(),
        1e3 * estimate.makespan,
        1e3 * measured.1,
        by_cost.transfer_bytes() as f64 / 1e6
    );
    println!(
        "  speedup: estimated {:.2}x, measured {:.2}x; resident MB per device (by cost): {:?}",
        tf_estimate / estimate.makespan,
        measured.0 / measured.1,
        estimate.memory.iter().map(|&m| (m as f64 / 1e5).round() / 10.0).collect::<Vec<_>>()
    );
}

fn main() -> Result<(), Error> {
    let strategy = Strategy::data_parallel(2)?;
    let t = Instant::now();
    let cost = strategy.measure_cost()?;
    let r = cost.rates("CPU");
    println!(
        "Measured in {:.2} s on {} cores: f32 matmul {:.1} GFLOP/s, elementwise {:.0} M/s, tanh {:.0} M/s, \
         dispatch {:.1} us; f64 matmul {:.1} GFLOP/s; link {:.2} GB/s, {:.1} us",
        t.elapsed().as_secs_f64(),
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        r.single.matmul_flops / 1e9,
        r.single.elements / 1e6,
        r.single.transcendentals / 1e6,
        r.single.overhead * 1e6,
        r.double.matmul_flops / 1e9,
        cost.bandwidth / 1e9,
        cost.latency * 1e6
    );
    let options = PlaceOptions::default();
    let mut noise = Noise(11);

    // 1. A mixture of experts.
    let (batch, width, hidden, out) = (256, 512, 512, 128);
    let mut b = Builder::new();
    let x = b.param("x", spec(&[batch, width], DType::F32))?;
    let y = b.param("y", spec(&[batch, out], DType::F32))?;
    let mut sum = None;
    for e in 0..4 {
        let w = b.param(&format!("expert{e}.w"), spec(&[width, hidden], DType::F32))?;
        let v = b.param(&format!("expert{e}.v"), spec(&[hidden, out], DType::F32))?;
        let h = b.matmul(x, w)?;
        let h = b.tanh(h)?;
        let o = b.matmul(h, v)?;
        sum = Some(match sum {
            None => o,
            Some(s) => b.add(s, o)?,
        });
    }
    let d = b.sub(sum.expect("four experts"), y)?;
    let sq = b.mul(d, d)?;
    let loss = b.reduce_mean(sq, &[0, 1], false)?;
    let program = b.finish(&[loss])?;
    let (step, carry) = train_step(&program, loss, 2)?;
    let tf = strategy.place(&step.program, &carry, &options)?;
    let by_cost = strategy.place_with_cost(&step.program, &carry, &options, &cost)?;
    let fed = [
        Tensor::f32(&[batch, width], noise.f32s(batch * width, 1.0, 0.0))?,
        Tensor::f32(&[batch, out], noise.f32s(batch * out, 1.0, 0.0))?,
    ];
    let measured =
        (measure(&tf, &step, &program, &fed)?, measure(&by_cost, &step, &program, &fed)?);
    let tf_estimate = by_cost.estimate().and_then(|e| e.tf_makespan).unwrap_or(f64::NAN);
    report(
        "Mixture of 4 experts, f32, batch 256, 512 -> 512 -> 128, SGD",
        &tf,
        &by_cost,
        tf_estimate,
        measured,
    );

    // 2. An MLP under memory caps.
    let (batch, width, layers) = (64, 512, 6);
    let mut b = Builder::new();
    let x = b.param("x", spec(&[batch, width], DType::F32))?;
    let mut h = x;
    for l in 0..layers {
        let w = b.param(&format!("layers.{l}.w"), spec(&[width, width], DType::F32))?;
        h = b.matmul(h, w)?;
        h = b.tanh(h)?;
    }
    let sq = b.mul(h, h)?;
    let loss = b.reduce_mean(sq, &[0, 1], false)?;
    let program = b.finish(&[loss])?;
    let (step, carry) = train_step(&program, loss, 1)?;
    let free = strategy.place_with_cost(&step.program, &carry, &options, &cost)?;
    let total: u64 = free.estimate().map_or(0, |e| e.memory.iter().sum());
    let cap = total * 6 / 10;
    let capped = cost.clone().with_capacity(cap);
    let tf = strategy.place(&step.program, &carry, &options)?;
    let by_cost = strategy.place_with_cost(&step.program, &carry, &options, &capped)?;
    let fed = [Tensor::f32(&[batch, width], noise.f32s(batch * width, 1.0, 0.0))?];
    let measured =
        (measure(&tf, &step, &program, &fed)?, measure(&by_cost, &step, &program, &fed)?);
    // TF's default does not fit the caps; its estimate is the uncapped model's.
    let tf_estimate = free.estimate().and_then(|e| e.tf_makespan).unwrap_or(f64::NAN);
    report(
        &format!(
            "MLP {layers} x {width}, f32, batch {batch}, SGD; each device capped at {:.1} MB of the step's {:.1} MB",
            cap as f64 / 1e6,
            total as f64 / 1e6
        ),
        &tf,
        &by_cost,
        tf_estimate,
        measured,
    );
    Ok(())
}
