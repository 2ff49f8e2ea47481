//! meshwork's all-reduce across MPI processes beside a bare MPI all-reduce of the same
//! buffers, measured in the same run: one device per process, so the difference is
//! what meshwork adds (the handshake, its deterministic reduction order, the copies).
//!
//! ```text
//! cargo build --release -p meshwork-executor --features mpi --example mpi_bench
//! mpirun -np 2 target/release/examples/mpi_bench [RUNS [MIB]]   # default 7 runs, 64 MiB
//! ```
//!
//! Prints medians over the runs (each run's time is the slowest process's) and the
//! ratio meshwork / bare MPI.

#![allow(clippy::print_stdout, missing_docs)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use meshwork_executor::mpi::Mpi;
use meshwork_executor::{Program, Runtime, Tensor};
use meshwork_types::ReduceOp;
use mpi::collective::SystemOperation;
use mpi::topology::SimpleCommunicator;
use mpi::traits::CommunicatorCollectives;
use ndarray::{ArrayD, IxDyn};

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

/// The slowest process's time for `f`, every process starting together.
fn timed(world: &SimpleCommunicator, f: impl FnOnce()) -> Duration {
    world.barrier();
    let start = Instant::now();
    f();
    let mine = start.elapsed().as_secs_f64();
    let mut slowest = 0.0f64;
    world.all_reduce_into(&mine, &mut slowest, SystemOperation::max());
    Duration::from_secs_f64(slowest)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let runs = args.first().copied().unwrap_or(7).max(5);
    let mib = args.get(1).copied().unwrap_or(64);
    let len = mib * (1 << 20) / 4;

    let mpi = Mpi::init(None)?;
    let world = SimpleCommunicator::world();
    let runtime = Runtime::new(1)?.with_interconnect(mpi.interconnect());
    let program: Arc<Program> =
        Arc::new(|ctx, i| Ok(vec![ctx.all_reduce(ReduceOp::Sum, i[0].clone())?]));
    let value = mpi.process() as f32 + 1.0;

    let mut ours = Vec::new();
    let mut bare = Vec::new();
    // One warm-up of each, then alternate so load changes hit both alike.
    for run in 0..=runs {
        let input = vec![vec![Tensor::F32(ArrayD::from_elem(IxDyn(&[len]), value))]];
        let mut out = Vec::new();
        let t = timed(&world, || out = runtime.run(program.clone(), input).expect("all-reduce"));
        let want = (1..=mpi.processes()).sum::<usize>() as f32;
        assert!(matches!(&out[0][0], Tensor::F32(a) if a.iter().all(|&x| x == want)));
        drop(out);

        let send = vec![value; len];
        let mut recv = vec![0f32; len];
        let b = timed(&world, || {
            world.all_reduce_into(&send[..], &mut recv[..], SystemOperation::sum())
        });
        assert!(recv.iter().all(|&x| x == want));
        if run > 0 {
            ours.push(t);
            bare.push(b);
        }
    }
    if mpi.process() == 0 {
        let (o, b) = (median(ours), median(bare));
        println!(
            "all-reduce f32, {} processes x {mib} MiB, median of {runs}: meshwork {:.1} ms, \
             bare MPI {:.1} ms, ratio {:.2} (target <= 1.3)",
            mpi.processes(),
            o.as_secs_f64() * 1e3,
            b.as_secs_f64() * 1e3,
            o.as_secs_f64() / b.as_secs_f64()
        );
    }
    Ok(())
}
