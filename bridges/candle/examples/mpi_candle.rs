//! Run under `mpirun -np 2` (`cargo xtask mpi-test` does): a candle MLP trained with
//! DDP and with FSDP on 2 processes × 2 devices must give, step for step, the losses
//! and final parameters of the same training on 4 devices in one process, in f64,
//! within 1e-12 relative (the hierarchical sums add the 4 replicas' values in another
//! order: (0 + 1) + (2 + 3)). Every process checks; a difference exits non-zero.

#![allow(clippy::print_stdout, clippy::print_stderr, missing_docs)]

use std::collections::HashMap;
use std::process::ExitCode;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{AdamW, Linear, ParamsAdamW, VarBuilder, linear, loss};
use meshwork_candle::{Config, Devices, Trainer};
use meshwork_executor::Runtime;
use meshwork_executor::mpi::Mpi;

struct Mlp(Linear, Linear);

impl Mlp {
    fn new(vb: VarBuilder<'_>) -> candle_core::Result<Mlp> {
        Ok(Mlp(linear(6, 5, vb.pp("l1"))?, linear(5, 3, vb.pp("l2"))?))
    }
    fn loss(&self, b: &[Tensor]) -> candle_core::Result<Tensor> {
        loss::cross_entropy(&self.1.forward(&self.0.forward(&b[0])?.tanh()?)?, &b[1])
    }
}

fn batch(s: usize) -> candle_core::Result<Vec<Tensor>> {
    let x: Vec<f64> = (0..16 * 6).map(|i| (((i * 7 + s * 13) % 23) as f64 - 11.0) / 7.0).collect();
    let y: Vec<u32> = (0..16).map(|r| ((r * 5 + s) % 3) as u32).collect();
    Ok(vec![Tensor::from_vec(x, (16, 6), &Device::Cpu)?, Tensor::from_vec(y, 16, &Device::Cpu)?])
}

/// A run's losses, final parameters' values, and starting values.
type Run = (Vec<f64>, Vec<(String, Vec<f64>)>, HashMap<String, Tensor>);

/// Trains 5 steps from `init` (or the model's initializers).
fn train(
    devices: &Devices,
    config: Config,
    init: Option<HashMap<String, Tensor>>,
) -> Result<Run, Box<dyn std::error::Error>> {
    let adamw = ParamsAdamW { lr: 0.05, weight_decay: 0.1, ..Default::default() };
    let config = config.with_dtype(DType::F64);
    let mut t = match init {
        Some(v) => Trainer::<Mlp, AdamW>::with_values(devices, config, adamw, v, Mlp::new)?,
        None => Trainer::<Mlp, AdamW>::new(devices, config, adamw, Mlp::new)?,
    };
    let start: HashMap<String, Tensor> = t.parameters()?.into_iter().collect();
    let mut losses = Vec::new();
    for s in 0..5 {
        losses.push(t.step(&batch(s)?, |m: &Mlp, b: &[Tensor]| m.loss(b))?);
    }
    let mut values = Vec::new();
    for (name, v) in t.parameters()? {
        values.push((name, v.flatten_all()?.to_vec1::<f64>()?));
    }
    Ok((losses, values, start))
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mpi_candle: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let mpi = Mpi::init(Some(2))?;
    let p = mpi.process();
    let joined = Devices::from_runtime(Runtime::new(2)?.with_interconnect(mpi.interconnect()));
    let local = Devices::cpu(4)?;
    for (name, config) in [("DDP", Config::ddp()), ("FSDP", Config::fsdp())] {
        // Each process's candle initializers draw other values; the trainer starts
        // every replica from global replica 0's, and the local run from the same.
        let (losses, values, start) = train(&joined, config.clone(), None)?;
        let (want, want_values, _) = train(&local, config, Some(start))?;
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.abs().max(1e-300);
        let same_losses =
            losses.len() == want.len() && losses.iter().zip(&want).all(|(a, b)| close(*a, *b));
        let same_values = values.len() == want_values.len()
            && values.iter().zip(&want_values).all(|((n, a), (m, b))| {
                n == m && a.len() == b.len() && a.iter().zip(b).all(|(x, y)| close(*x, *y))
            });
        if !same_losses || !same_values {
            return Err(format!(
                "process {p}, {name}: 2 processes x 2 devices gave {losses:?}, 4 local devices {want:?}"
            )
            .into());
        }
        println!(
            "process {p}: {name} on 2 processes x 2 devices equals 4 local devices within 1e-12: {losses:?}"
        );
    }
    Ok(())
}
