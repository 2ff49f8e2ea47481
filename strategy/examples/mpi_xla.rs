//! Training across processes on XLA (`cargo xtask mpi-test`): run under `mpirun -np 2`,
//! each process a PJRT client of 2 CPU devices (`MESHWORK_PJRT_PLUGIN`), the four
//! positions of a 2x2 `data × model` mesh over both processes. The pinned CPU plugin
//! has no collectives across processes, so each process runs XLA executables of the
//! segments between collectives, and meshwork's executor runs the collectives over
//! MPI (`backend::Xla`'s host collectives).
//!
//! A small transformer (f64, Megatron shardings, Adam) trains 4 steps. In every
//! process the losses and the final weights must equal (relative 1e-12) those of the
//! same run on 4 local XLA devices with XLA's own collectives, and on the interpreter
//! on 4 local devices; the interpreter spread over the two processes the same way
//! must too. A checkpoint saved across the processes (into the new directory given
//! as the argument) must restore on the spread step and on a one-process strategy.
//! Exits non-zero otherwise.
//!
//! `bench [steps=N]` times the benchmark transformer instead (build with
//! `--release`): tokens/s on the 2x2 mesh spread over the two processes (XLA with
//! host collectives, and the interpreter), then, in process 0 alone, on 4 local
//! devices: XLA with its own collectives, XLA with host collectives, the interpreter.
//! (`--bind-to none`: Open MPI otherwise pins each process to one core, and process
//! 0's one-process runs would get a core where the spread runs got two.)
//!
//! ```text
//! mpirun -np 2 target/debug/examples/mpi_xla CHECKPOINT_DIR
//! mpirun -np 2 --bind-to none target/release/examples/mpi_xla bench [steps=N]
//! ```

#![allow(clippy::print_stdout, clippy::print_stderr, missing_docs, unsafe_code)]

#[path = "common/mod.rs"]
mod common;

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use common::Model;
use meshwork_strategy::backend::{Backend, Xla};
use meshwork_strategy::executor::Runtime;
use meshwork_strategy::executor::mpi::Mpi;
use meshwork_strategy::partition::{Shardings, megatron_spec};
use meshwork_strategy::sharding::Mesh;
use meshwork_strategy::{DeviceAssignment, Strategy, Tensor, Topology};

const POSITIONS: usize = 4;
const PROCESSES: usize = 2;

type Error = Box<dyn std::error::Error>;

/// A strategy of the 4 positions: spread over the MPI processes, or all local.
fn strategy(mpi: Option<&Mpi>) -> Result<Strategy, Error> {
    match mpi {
        Some(mpi) => {
            let topology = Topology::new(vec![POSITIONS], POSITIONS / PROCESSES)?;
            let runtime =
                Runtime::new(POSITIONS / PROCESSES)?.with_interconnect(mpi.interconnect());
            Ok(Strategy::new(DeviceAssignment::build(&topology, &[1], None)?)?
                .with_runtime(runtime)?)
        }
        None => Ok(Strategy::data_parallel(POSITIONS)?),
    }
}

fn shardings(program: &meshwork_strategy::program::Program) -> Result<Shardings, Error> {
    let mesh = Mesh::iota(&[("data", 2), ("model", 2)])?;
    let mut s = Shardings::new(mesh).with("rows", "P('data')")?;
    for p in &program.params()[1..] {
        s = s.with_spec(&p.name, megatron_spec(&p.name, p.spec.shape.rank()));
    }
    Ok(s)
}

/// What a run gives: the losses, then the final weights (gathered from every
/// process) by name.
type Run = (Vec<f64>, Vec<(String, Tensor)>);

/// Trains `model` from its initial weights on `strategy`, saving a checkpoint into
/// `save` afterwards when given.
fn train(strategy: &Strategy, model: &Model, save: Option<&Path>) -> Result<Run, Error> {
    let mut step = strategy.compile_train_step(
        &model.program,
        model.loss,
        &model.weights,
        model.optimizer,
        &shardings(&model.program)?,
    )?;
    for (name, t) in &model.init {
        step.set(name, t)?;
    }
    let losses = step.run_steps(&model.batches, &vec![model.lr; model.batches.len()])?;
    let weights = model
        .init
        .iter()
        .map(|(name, _)| Ok((name.clone(), step.get(name)?)))
        .collect::<Result<Vec<_>, Error>>()?;
    if let Some(dir) = save {
        step.save_checkpoint(dir)?;
        // Back from the checkpoint after the weights were overwritten.
        for (name, t) in &model.init {
            step.set(name, t)?;
        }
        step.restore_checkpoint(dir)?;
        for (name, want) in &weights {
            if step.get(name)? != *want {
                return Err(format!("{name} restored differs from the one saved").into());
            }
        }
    }
    Ok((losses, weights))
}

fn f64s(t: &Tensor) -> Vec<f64> {
    match t {
        Tensor::F64(a) => a.iter().copied().collect(),
        Tensor::F32(a) => a.iter().map(|&x| f64::from(x)).collect(),
        _ => Vec::new(),
    }
}

/// Whether `got` equals `want` within `rel` (relative to the largest magnitude).
fn close(got: &[f64], want: &[f64], rel: f64) -> bool {
    let scale = want.iter().fold(1e-30f64, |m, x| m.max(x.abs()));
    got.len() == want.len() && got.iter().zip(want).all(|(a, b)| (a - b).abs() <= rel * scale)
}

fn compare(what: &str, got: &Run, want: &Run) -> Result<(), Error> {
    if !close(&got.0, &want.0, 1e-12) {
        return Err(format!("{what}: losses {:?}, want {:?}", got.0, want.0).into());
    }
    for ((name, a), (_, b)) in got.1.iter().zip(&want.1) {
        if !close(&f64s(a), &f64s(b), 1e-12) {
            return Err(format!("{what}: weight {name} differs").into());
        }
    }
    Ok(())
}

/// The small f64 transformer the check trains: 4 steps of 8 rows.
fn small_model() -> Result<Model, Error> {
    use meshwork_strategy::nn::{Optimizer, Transformer};
    use meshwork_strategy::program::{Builder, Value};
    use meshwork_strategy::types::DType;
    let model = Transformer { vocab: 32, seq: 8, dim: 16, heads: 2, layers: 2, ffn: 32 };
    let mut b = Builder::new();
    let rows = b.param("rows", common::spec(&[8, model.seq + 1], DType::I32))?;
    let loss = model.loss(&mut b, rows, DType::F64)?;
    let program = b.finish(&[loss])?;
    let weights: Vec<Value> = (1..program.params().len()).map(|k| Value(k as u32)).collect();
    let mut noise = common::Noise(7);
    let init = common::transformer_init(&program, &mut noise)?
        .into_iter()
        .map(|(n, t)| match t {
            Tensor::F32(a) => (n, Tensor::F64(a.mapv(f64::from))),
            t => (n, t),
        })
        .collect();
    let batches =
        common::token_batches(&model, 8, 24, 4, &mut noise)?.into_iter().map(|t| vec![t]).collect();
    Ok(Model {
        program,
        loss,
        weights,
        optimizer: Optimizer::adam(),
        init,
        batches,
        lr: 1e-2,
        per_step: 8 * model.seq,
    })
}

fn check(mpi: &Mpi, plugin: &meshwork_xla::Plugin) -> Result<(), Error> {
    let p = mpi.process();
    let dir = std::env::args_os().nth(1).ok_or("give a new checkpoint directory")?;
    let model = small_model()?;
    let xla2: Arc<dyn Backend> = Arc::new(Xla::with_devices(plugin, 2)?);
    let spread = train(&strategy(Some(mpi))?.with_backend(xla2), &model, Some(Path::new(&dir)))?;
    let interp_spread = train(&strategy(Some(mpi))?, &model, None)?;
    let xla4: Arc<dyn Backend> = Arc::new(Xla::with_devices(plugin, 4)?);
    let local_xla = train(&strategy(None)?.with_backend(xla4), &model, None)?;
    let local_interp = train(&strategy(None)?, &model, None)?;
    compare("XLA over 2 processes vs 4 local XLA devices", &spread, &local_xla)?;
    compare("XLA over 2 processes vs the interpreter on 4 devices", &spread, &local_interp)?;
    compare("the interpreter over 2 processes vs on 4 devices", &interp_spread, &local_interp)?;
    println!(
        "process {p}: 2 processes x 2 XLA devices train like 4 local ones (losses {:.6?})",
        spread.0
    );
    // The checkpoint the two processes saved, on one process's strategy.
    let one = strategy(None)?;
    let mut step = one.compile_train_step(
        &model.program,
        model.loss,
        &model.weights,
        model.optimizer,
        &shardings(&model.program)?,
    )?;
    step.restore_checkpoint(&dir)?;
    for (name, want) in &spread.1 {
        if step.get(name)? != *want {
            return Err(format!("process {p}: {name} from the checkpoint differs").into());
        }
    }
    println!("process {p}: the checkpoint saved across the processes restores in one");
    // The job's key-value store as a PJRT client's (what a client spanning processes
    // would exchange its topology through): each process's value reaches the other.
    use meshwork_xla::KeyValueStore;
    let store = meshwork_strategy::backend::MpiKeyValueStore(mpi.key_value_store());
    store.put(format!("topology/{p}").as_bytes(), format!("node {p}").as_bytes())?;
    let q = 1 - p;
    let theirs =
        store.get(format!("topology/{q}").as_bytes(), Some(std::time::Duration::from_secs(30)))?;
    if theirs.as_deref() != Some(format!("node {q}").as_bytes()) {
        return Err(format!("process {p}: topology/{q} is {theirs:?}").into());
    }
    println!(
        "process {p}: the MPI key-value store, as the KeyValueStore PJRT's callbacks call, \
         carries each process's value"
    );
    Ok(())
}

/// Tokens/s of `model` on `strategy`: the median of 3 timed runs after one untimed.
fn rate(strategy: &Strategy, model: &Model) -> Result<f64, Error> {
    let mut step = strategy.compile_train_step(
        &model.program,
        model.loss,
        &model.weights,
        model.optimizer,
        &shardings(&model.program)?,
    )?;
    let lrs = vec![model.lr; model.batches.len()];
    let mut rates = Vec::new();
    for run in 0..4 {
        for (name, t) in &model.init {
            step.set(name, t)?;
        }
        step.reset_optimizer()?;
        let t0 = Instant::now();
        step.run_steps(&model.batches, &lrs)?;
        if run > 0 {
            rates.push((model.batches.len() * model.per_step) as f64 / t0.elapsed().as_secs_f64());
        }
    }
    Ok(common::median(rates))
}

fn bench(mpi: &Mpi, plugin: &meshwork_xla::Plugin) -> Result<(), Error> {
    let steps = std::env::args().find_map(|a| a.strip_prefix("steps=")?.parse().ok()).unwrap_or(5);
    let model = common::transformer_model(16, steps)?;
    let xla2: Arc<dyn Backend> = Arc::new(Xla::with_devices(plugin, 2)?);
    let spread_xla = rate(&strategy(Some(mpi))?.with_backend(xla2), &model)?;
    let spread_interp = rate(&strategy(Some(mpi))?, &model)?;
    if mpi.process() != 0 {
        return Ok(());
    }
    // Process 0 alone from here (process 1 waits in MPI's finalize).
    let xla4 = Arc::new(Xla::with_devices(plugin, 4)?);
    let local_xla = rate(&strategy(None)?.with_backend(xla4), &model)?;
    let hosted = Arc::new(Xla::with_devices(plugin, 4)?.with_host_collectives());
    let local_hosted = rate(&strategy(None)?.with_backend(hosted), &model)?;
    let local_interp = rate(&strategy(None)?, &model)?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "Transformer V256 T128 D256 H8 L4 F1024, f32, batch 16, Adam, 2x2 mesh (data x model), \
         {steps} steps per run, median of 3 ({cores} cores), tokens/s:"
    );
    println!("  2 processes x 2 devices: XLA, host collectives over MPI {spread_xla:>8.0}");
    println!("  2 processes x 2 devices: interpreter over MPI          {spread_interp:>8.0}");
    println!("  1 process x 4 devices:   XLA, its own collectives      {local_xla:>8.0}");
    println!("  1 process x 4 devices:   XLA, host collectives         {local_hosted:>8.0}");
    println!("  1 process x 4 devices:   interpreter                   {local_interp:>8.0}");
    println!(
        "  tokens/s against XLA's own collectives in one process: host collectives {:.2}x, \
         over MPI {:.2}x",
        local_hosted / local_xla,
        spread_xla / local_xla
    );
    Ok(())
}

fn main() -> ExitCode {
    if std::env::var_os("TF_CPP_MIN_LOG_LEVEL").is_none() {
        // SAFETY: first thing in main, before any other thread.
        unsafe { std::env::set_var("TF_CPP_MIN_LOG_LEVEL", "2") };
    }
    let run = || -> Result<(), Error> {
        let mpi = Mpi::init(Some(PROCESSES))?;
        let path = meshwork_xla::find::plugin_path(None)?;
        let plugin = meshwork_xla::find::load(&path)?;
        if std::env::args().any(|a| a == "bench") {
            bench(&mpi, &plugin)
        } else {
            check(&mpi, &plugin)
        }
    };
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mpi_xla: {e}");
            ExitCode::FAILURE
        }
    }
}
