//! DDP's step time on 2 devices against plain candle's single-device step for the same
//! global batch (and FSDP's beside them), medians of 15 steps after 3 of warm-up, in
//! one run; and the gradient bytes each replica all-reduces per step against the
//! model's parameter bytes.
//!
//! `cargo run --release -p meshwork-candle --example candle_bench [-- BATCH]`

#![allow(clippy::print_stdout, missing_docs)]

use std::time::Instant;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{AdamW, Linear, Optimizer, ParamsAdamW, VarBuilder, VarMap, linear, loss};
use meshwork_candle::{Config, Devices, Trainer};

const SIZES: [usize; 4] = [512, 1024, 1024, 16];

/// A three-layer MLP, 512 -> 1024 -> 1024 -> 16 (1.6M parameters).
struct Mlp(Linear, Linear, Linear);

impl Mlp {
    fn new(vb: VarBuilder<'_>) -> candle_core::Result<Mlp> {
        Ok(Mlp(
            linear(SIZES[0], SIZES[1], vb.pp("fc1"))?,
            linear(SIZES[1], SIZES[2], vb.pp("fc2"))?,
            linear(SIZES[2], SIZES[3], vb.pp("fc3"))?,
        ))
    }
    fn loss(&self, b: &[Tensor]) -> candle_core::Result<Tensor> {
        let h = self.1.forward(&self.0.forward(&b[0])?.relu()?)?.relu()?;
        loss::cross_entropy(&self.2.forward(&h)?, &b[1])
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Seconds per step of `step`, median of 15 after 3 of warm-up.
fn time(
    mut step: impl FnMut() -> Result<(), Box<dyn std::error::Error>>,
) -> Result<f64, Box<dyn std::error::Error>> {
    for _ in 0..3 {
        step()?;
    }
    let mut times = Vec::new();
    for _ in 0..15 {
        let t = Instant::now();
        step()?;
        times.push(t.elapsed().as_secs_f64());
    }
    Ok(median(times))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let batch: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(256);
    let x = Tensor::randn(0f32, 1.0, (batch, SIZES[0]), &Device::Cpu)?;
    let y = Tensor::from_vec(
        (0..batch as u32).map(|i| i % SIZES[3] as u32).collect::<Vec<_>>(),
        batch,
        &Device::Cpu,
    )?;
    let b = vec![x, y];
    let adamw = ParamsAdamW { lr: 1e-3, ..Default::default() };
    // Plain candle, one device.
    let map = VarMap::new();
    let model = Mlp::new(VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu))?;
    let mut opt = AdamW::new(map.all_vars(), adamw.clone())?;
    let one = time(|| Ok(opt.backward_step(&model.loss(&b)?)?))?;
    let single = Devices::cpu(1)?;
    let mut ddp1 = Trainer::<Mlp, AdamW>::new(&single, Config::ddp(), adamw.clone(), Mlp::new)?;
    let one_replica = time(|| {
        ddp1.step(&b, |m: &Mlp, b: &[Tensor]| m.loss(b))?;
        Ok(())
    })?;
    let devices = Devices::cpu(2)?;
    let mut ddp = Trainer::<Mlp, AdamW>::new(&devices, Config::ddp(), adamw.clone(), Mlp::new)?;
    let two = time(|| {
        ddp.step(&b, |m: &Mlp, b: &[Tensor]| m.loss(b))?;
        Ok(())
    })?;
    let mut fsdp = Trainer::<Mlp, AdamW>::new(&devices, Config::fsdp(), adamw, Mlp::new)?;
    let sharded = time(|| {
        fsdp.step(&b, |m: &Mlp, b: &[Tensor]| m.loss(b))?;
        Ok(())
    })?;
    println!(
        "MLP {} -> {} -> {} -> {} (f32, {:.1}M parameters), AdamW, global batch {batch}, {} cores; medians of 15 steps",
        SIZES[0],
        SIZES[1],
        SIZES[2],
        SIZES[3],
        ddp.parameter_bytes() as f64 / 4e6,
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!("  run                          ms/step   samples/s   vs one device");
    for (name, t) in [
        ("candle, one device", one),
        ("meshwork DDP, 1 device", one_replica),
        ("meshwork DDP, 2 devices", two),
        ("meshwork FSDP, 2 devices", sharded),
    ] {
        println!("  {name:<26} {:>9.2}  {:>10.0}   {:>6.2}x", 1e3 * t, batch as f64 / t, one / t);
    }
    println!(
        "  gradient bytes all-reduced per replica and step: {} ({:.4}x the model's {} parameter bytes; the rest is one has-gradient flag per parameter)",
        ddp.gradient_bytes_per_step(),
        ddp.gradient_bytes_per_step() as f64 / ddp.parameter_bytes() as f64,
        ddp.parameter_bytes()
    );
    Ok(())
}
