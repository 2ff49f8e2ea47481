//! Pipeline against tensor parallelism for the same transformer on 2 devices: training
//! throughput and bytes moved per step, in one run.
//!
//! The transformer of `spmd_bench` (V256 T128 D256 H8 L4 F1024, f32, batch 16, Adam,
//! lr 1e-3) trained
//! - on one device, as a placed program ([`Strategy::place`]) and as a compiled SPMD
//!   step on a `1x1` mesh;
//! - as a pipeline of K = 2 stages (blocks 0–1 on device 0, 2–3 on device 1, by device
//!   scopes), the whole batch at once, then in 4 micro-batches (GPipe);
//! - by SPMD tensor parallelism on a `1x2` mesh (Megatron's specs,
//!   [`Strategy::compile_train_step`]);
//! - optionally (`dxk`) 2 data-parallel replicas of the 2-stage pipeline, 2
//!   micro-batches each, on 4 devices.
//!
//! Each figure is the median of 5 timed runs (after one untimed run) of `STEPS` steps
//! from the same initial state. Bytes moved: a placed step's transfers between devices
//! (activations forward, their cotangents back), the SPMD step's collectives.
//!
//! `cargo run --release -p meshwork-strategy --example pipeline_bench [dxk] [steps=N]`

#![allow(clippy::print_stdout, missing_docs)]

use std::time::Instant;

use meshwork_nn::Pipeline;
use meshwork_nn::{Optimizer, TrainStep};
use meshwork_program::{Builder, Program, Tensor, Value};
use meshwork_strategy::Strategy;
use meshwork_strategy::partition::{Shardings, megatron_spec};
use meshwork_strategy::placed::PlaceOptions;
use meshwork_strategy::sharding::Mesh;
use meshwork_strategy::types::DType;

#[path = "common/mod.rs"]
mod common;
use common::{Noise, TRANSFORMER, median, spec};

const BATCH: usize = 16;
const LR: f64 = 1e-3;

type Error = Box<dyn std::error::Error>;

/// A row: tokens/s, bytes moved per step, transfers (or collectives) per step.
struct Row {
    rate: f64,
    bytes: u64,
    moves: usize,
}

/// The loss program over `layout` (`None`: no device scopes).
fn loss_program(layout: Option<&Pipeline>) -> Result<(Program, Value), Error> {
    let model = TRANSFORMER;
    let mut b = Builder::new();
    let rows = b.param("rows", spec(&[BATCH, model.seq + 1], DType::I32))?;
    let loss = match layout {
        None => model.loss(&mut b, rows, DType::F32)?,
        Some(p) if p.replicas.len() == 1 && p.micro_batches == 1 => {
            let stages: Vec<&str> = p.replicas[0].iter().map(String::as_str).collect();
            model.loss_on(&mut b, rows, DType::F32, &stages)?
        }
        Some(p) => model.loss_pipelined(&mut b, rows, DType::F32, p)?,
    };
    Ok((b.finish(&[loss])?, loss))
}

/// Trains the placed program of `layout` on `devices` devices.
fn placed(layout: Option<&Pipeline>, devices: usize, batches: &[Tensor]) -> Result<Row, Error> {
    let (program, loss) = loss_program(layout)?;
    let weights: Vec<Value> = (1..program.params().len()).map(|k| Value(k as u32)).collect();
    let step = TrainStep::new(&program, loss, &weights, Optimizer::adam())?;
    let sp = &step.program;
    let carry: Vec<(usize, usize)> = (1..sp.results().len()).map(|r| (r, r)).collect();
    let strategy = Strategy::data_parallel(devices)?;
    let placed = strategy.place(sp, &carry, &PlaceOptions::default())?;
    let init = common::transformer_init(&program, &mut Noise(0x9e37_79b9_7f4a_7c15))?;
    let state = step.init_state()?;
    let first_state = 1 + weights.len();
    let mut rates = Vec::new();
    for run in 0..6 {
        for (name, t) in &init {
            placed.set(name, t.clone())?;
        }
        for (k, t) in state.iter().enumerate() {
            placed.set(&sp.params()[first_state + k].name, t.clone())?;
        }
        let t0 = Instant::now();
        for (s, rows) in batches.iter().enumerate() {
            let [lr, count] = step.scalars(LR, s)?;
            placed.step(&[rows.clone(), lr, count])?;
        }
        if run > 0 {
            rates.push(
                (batches.len() * BATCH * TRANSFORMER.seq) as f64 / t0.elapsed().as_secs_f64(),
            );
        }
    }
    Ok(Row { rate: median(rates), bytes: placed.transfer_bytes(), moves: placed.transfers().len() })
}

/// Trains the SPMD step on a `1xM` mesh with Megatron's specs.
fn tensor_parallel(m: usize, batches: &[Tensor]) -> Result<Row, Error> {
    let (program, loss) = loss_program(None)?;
    let weights: Vec<Value> = (1..program.params().len()).map(|k| Value(k as u32)).collect();
    let mesh = Mesh::iota(&[("data", 1), ("model", m)])?;
    let mut shardings = Shardings::new(mesh).with("rows", "P('data')")?;
    for p in &program.params()[1..] {
        shardings = shardings.with_spec(&p.name, megatron_spec(&p.name, p.spec.shape.rank()));
    }
    let strategy = Strategy::data_parallel(m)?;
    let mut step =
        strategy.compile_train_step(&program, loss, &weights, Optimizer::adam(), &shardings)?;
    let init = common::transformer_init(&program, &mut Noise(0x9e37_79b9_7f4a_7c15))?;
    let mut rates = Vec::new();
    for run in 0..6 {
        for (name, t) in &init {
            step.set(name, t)?;
        }
        step.reset_optimizer()?;
        let t0 = Instant::now();
        for rows in batches {
            step.step(std::slice::from_ref(rows), LR)?;
        }
        if run > 0 {
            rates.push(
                (batches.len() * BATCH * TRANSFORMER.seq) as f64 / t0.elapsed().as_secs_f64(),
            );
        }
    }
    let partitioned = step.compiled().partitioned();
    Ok(Row {
        rate: median(rates),
        bytes: partitioned.bytes_moved(),
        moves: partitioned.collectives().len(),
    })
}

fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let steps =
        args.iter().find_map(|a| a.strip_prefix("steps=")?.parse::<usize>().ok()).unwrap_or(10);
    let m = TRANSFORMER;
    let batches = common::token_batches(&m, BATCH, 512, steps, &mut Noise(0x5eed))?;
    println!(
        "Transformer V{} T{} D{} H{} L{} F{}, f32, batch {BATCH}, Adam, {steps} steps per run, \
         median of 5 runs ({} cores)",
        m.vocab,
        m.seq,
        m.dim,
        m.heads,
        m.layers,
        m.ffn,
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!(
        "  layout                                   devices   tokens/s   ms/step   vs 1 device   MB moved/step   transfers (collectives)"
    );
    let print = |name: &str, devices: usize, row: &Row, base: f64| {
        println!(
            "  {name:<40} {devices:>7}   {:>8.0}   {:>7.1}   {:>10.2}x   {:>13.2}   {:>8}",
            row.rate,
            1e3 * (BATCH * m.seq) as f64 / row.rate,
            row.rate / base,
            row.bytes as f64 / 1e6,
            row.moves
        );
    };
    let one = placed(None, 1, &batches)?;
    print("one device (placed)", 1, &one, one.rate);
    print("one device (SPMD 1x1)", 1, &tensor_parallel(1, &batches)?, one.rate);
    let k2 = Pipeline::cpus(1, 2, 1);
    print("pipeline K=2, whole batch", 2, &placed(Some(&k2), 2, &batches)?, one.rate);
    let k2m4 = Pipeline::cpus(1, 2, 4);
    print("pipeline K=2, 4 micro-batches (GPipe)", 2, &placed(Some(&k2m4), 2, &batches)?, one.rate);
    print("SPMD tensor parallel 1x2 (Megatron)", 2, &tensor_parallel(2, &batches)?, one.rate);
    if args.iter().any(|a| a == "dxk") {
        let dk = Pipeline::cpus(2, 2, 2);
        print("D=2 x pipeline K=2, 2 micro-batches", 4, &placed(Some(&dk), 4, &batches)?, one.rate);
    }
    // What a pipeline must move: each stage boundary's activations forward and their
    // cotangents back, [B, T, D] f32 each way (micro-batching cuts them, adds none).
    let boundary = 2 * (BATCH * m.seq * m.dim * 4) as u64;
    println!(
        "  minimum for a 2-stage pipeline: {:.2} MB/step (activations and cotangents at the boundary)",
        boundary as f64 / 1e6
    );
    Ok(())
}
