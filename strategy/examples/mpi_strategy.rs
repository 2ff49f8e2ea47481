//! The strategy across MPI processes (`cargo xtask mpi-test`): run under
//! `mpirun -np 2`, each process with 2 of the 4 replicas and its host's input
//! pipeline. Four steps of data-parallel least squares must give, in every process,
//! the weights a one-process strategy computes from the global batches; a checkpoint
//! saved across the processes (into the new directory given as the argument, or
//! `$TMPDIR/meshwork-mpi-strategy-ckpt`, which must not exist) must restore in each.
//! Exits non-zero otherwise.
//!
//! ```text
//! mpirun -np 2 target/debug/examples/mpi_strategy [CHECKPOINT_DIR]
//! ```

#![allow(clippy::print_stdout, clippy::print_stderr, missing_docs)]

use std::process::ExitCode;

use meshwork_strategy::executor::Runtime;
use meshwork_strategy::executor::mpi::Mpi;
use meshwork_strategy::{
    DeviceAssignment, DistributedBatch, ReduceOp, Remainder, Strategy, Tensor, Topology,
    VariableOptions,
};
use ndarray::{Array2, ArrayD, Axis, Ix2, IxDyn, Slice};

const REPLICAS: usize = 4;
const PROCESSES: usize = 2;

fn f64s(shape: &[usize], v: Vec<f64>) -> Tensor {
    Tensor::F64(ArrayD::from_shape_vec(IxDyn(shape), v).expect("shape"))
}

fn mat(t: &Tensor) -> Array2<f64> {
    match t {
        Tensor::F64(a) => a.clone().into_dimensionality::<Ix2>().expect("2-D"),
        _ => unreachable!("f64 inputs"),
    }
}

/// Global batch `b`: x [8, 3], y [8, 1].
fn batch(b: usize) -> Vec<Tensor> {
    let x = (0..24).map(|i| ((i * 7 + b * 13) % 11) as f64 / 5.0 - 1.0).collect();
    let y = (0..8).map(|i| ((i * 3 + b) % 5) as f64 / 2.0).collect();
    vec![f64s(&[8, 3], x), f64s(&[8, 1], y)]
}

fn strategy() -> Result<Strategy, meshwork_strategy::Error> {
    let topology = Topology::new(vec![REPLICAS], REPLICAS / PROCESSES)?;
    Strategy::new(DeviceAssignment::build(&topology, &[1], None)?)
}

fn train(
    s: &Strategy,
    batches: Vec<DistributedBatch>,
) -> Result<Vec<f64>, meshwork_strategy::Error> {
    let w =
        s.create_variable("w", f64s(&[3, 1], vec![0.1, -0.2, 0.3]), VariableOptions::default())?;
    for b in batches {
        let v = w.clone();
        s.run(
            move |ctx, a| {
                let (x, y, w) = (mat(&a[0]), mat(&a[1]), mat(&ctx.read(&v)?));
                let g = ctx.all_reduce(
                    ReduceOp::Sum,
                    Tensor::F64(x.t().dot(&(x.dot(&w) - &y)).into_dyn()),
                )?;
                ctx.assign(&v, Tensor::F64((w - mat(&g) * 0.05).into_dyn()))?;
                Ok(vec![])
            },
            &b.args,
        )?;
    }
    match s.read_variable(&w)? {
        Tensor::F64(a) => Ok(a.iter().copied().collect()),
        _ => unreachable!("f64 weights"),
    }
}

fn check() -> Result<(), String> {
    let e = |e: meshwork_strategy::Error| e.to_string();
    let mpi = Mpi::init(Some(PROCESSES)).map_err(|e| e.to_string())?;
    let runtime = Runtime::new(REPLICAS / PROCESSES)
        .map_err(|e| e.to_string())?
        .with_interconnect(mpi.interconnect());
    let spread = strategy().map_err(e)?.with_runtime(runtime).map_err(e)?;
    let p = mpi.process();
    let batches: Vec<DistributedBatch> = spread
        .distribute_datasets_from_function(
            &|ctx| {
                let (h, n) = (ctx.input_pipeline_id, ctx.num_input_pipelines);
                Box::new((0..4).map(move |b| {
                    let rows = 8 / n;
                    batch(b)
                        .into_iter()
                        .map(|t| match t {
                            Tensor::F64(a) => Tensor::F64(
                                a.slice_axis(Axis(0), Slice::from(h * rows..(h + 1) * rows))
                                    .to_owned(),
                            ),
                            other => other,
                        })
                        .collect()
                }))
            },
            Remainder::Drop,
        )
        .collect::<Result<_, _>>()
        .map_err(e)?;
    let got = train(&spread, batches).map_err(e)?;
    let one = strategy().map_err(e)?;
    let global = one
        .distribute_dataset((0..4).map(batch), Remainder::Drop)
        .collect::<Result<_, _>>()
        .map_err(e)?;
    let want = train(&one, global).map_err(e)?;
    if got.iter().zip(&want).any(|(a, b)| (a - b).abs() > 1e-12 * b.abs()) {
        return Err(format!("process {p}: weights {got:?}, one process gives {want:?}"));
    }
    println!(
        "process {p}: replicas {:?} with its host's pipeline train like one process",
        spread.local_replicas()
    );
    let dir = std::env::args_os()
        .nth(1)
        .map_or_else(|| std::env::temp_dir().join("meshwork-mpi-strategy-ckpt"), Into::into);
    let w = spread.variables()[0].clone();
    spread.save_checkpoint(&dir).map_err(e)?;
    spread.assign_variable(&w, &f64s(&[3, 1], vec![0.0; 3])).map_err(e)?;
    spread.restore_checkpoint(&dir).map_err(e)?;
    let back = match spread.read_variable(&w).map_err(e)? {
        Tensor::F64(a) => a.iter().copied().collect::<Vec<_>>(),
        _ => unreachable!("f64 weights"),
    };
    if back != got {
        return Err(format!("process {p}: restored {back:?}, saved {got:?}"));
    }
    println!("process {p}: the checkpoint process 0 wrote restores here");
    Ok(())
}

fn main() -> ExitCode {
    match check() {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("mpi_strategy: {message}");
            ExitCode::FAILURE
        }
    }
}
