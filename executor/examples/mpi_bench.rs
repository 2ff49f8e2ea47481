//! meshwork's all-reduce, all-gather, reduce-scatter and all-to-all across MPI
//! processes, each beside the bare MPI call of the same buffers (`MPI_Allreduce`,
//! `MPI_Allgather`, `MPI_Reduce_scatter_block`, `MPI_Alltoall`), measured in the same
//! run: one device per process, so the difference is what meshwork adds (the
//! handshake, its deterministic reduction order, the copies). Results are checked
//! equal to MPI's. Both sides reuse their memory from run to run, as a training loop
//! does: meshwork's inputs come from the device's pool (`Runtime::buffer`) and its
//! results go back to it (`Runtime::recycle`); bare MPI's buffers are allocated once.
//!
//! ```text
//! cargo build --release -p meshwork-executor --features mpi --example mpi_bench
//! mpirun -np 2 target/release/examples/mpi_bench [RUNS [MIB | KIBk [xCALLS] [NAME...]]]
//! mpirun -np 4 target/release/examples/mpi_bench [RUNS [MIB | KIBk [xCALLS] [NAME...]]]
//! ```
//!
//! Defaults: 7 runs, 64 MiB per replica, 1 call per run, every case. With `xN` each
//! timed run makes N calls (on N pooled inputs) and the bare side N calls (on N buffer
//! pairs), and times are per call: what the collectives of a training step cost, with
//! the run's own start and end (the hand-off to the device thread, the processes' start
//! skew absorbed by the first agreement, the end-of-run agreement) amortized over N
//! calls instead of carried whole by one. The pools are sized to keep N calls' inputs
//! and results.
//!
//! With an even number of processes, 4 or more, it also times the grouped forms within
//! two groups — the even and the odd replicas, each straddling processes — beside the
//! bare call on each half's own communicator (`MPI_Comm_split`).
//!
//! Prints medians over the runs (each run's time is the slowest process's) and the
//! ratio meshwork / bare MPI (target ≤ 1.3).

#![allow(clippy::print_stdout, missing_docs)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use meshwork_executor::mpi::Mpi;
use meshwork_executor::{ReplicaFn, Runtime, Tensor};
use meshwork_types::{DType, ReduceOp};
use mpi::collective::SystemOperation;
use mpi::topology::{Color, Communicator, SimpleCommunicator};
use mpi::traits::CommunicatorCollectives;

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

/// A program's one input, moved out (a clone would cost a fresh copy of it).
fn first(inputs: Vec<Tensor>) -> Tensor {
    inputs.into_iter().next().expect("one input")
}

/// One collective: meshwork's program, the bare MPI call of the same bytes, and the
/// element count of a replica's result.
struct Case {
    name: &'static str,
    program: Arc<ReplicaFn>,
    bare: fn(&SimpleCommunicator, &[f32], &mut [f32]),
    result_len: fn(len: usize, processes: usize) -> usize,
    /// Within two groups (even and odd replicas), against the bare call on each half's
    /// communicator (`MPI_Comm_split`); needs an even number of processes, 4 or more.
    grouped: bool,
}

/// The even and the odd replicas of `n`, the groups of the grouped cases.
fn halves(n: usize) -> Vec<Vec<usize>> {
    vec![(0..n).step_by(2).collect(), (1..n).step_by(2).collect()]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let runs = args.first().and_then(|a| a.parse().ok()).unwrap_or(7usize).max(5);
    // MiB per replica, or KiB with a `k` suffix (latency: what meshwork adds per call).
    let size = args.get(1).map_or("64", String::as_str);
    let (kib, unit) = match size.strip_suffix('k') {
        Some(k) => (k.parse::<usize>()?, "KiB"),
        None => (size.parse::<usize>()? << 10, "MiB"),
    };
    let len = (kib << 10) / 4;
    let mib = if unit == "KiB" { kib } else { kib >> 10 };
    // `xN`: N calls per run (per call times: what a training step's collectives cost
    // once the run is under way); further arguments keep the cases whose names contain
    // one of them.
    let rest = &args[args.len().min(2)..];
    let calls = rest
        .iter()
        .find_map(|a| a.strip_prefix('x').and_then(|n| n.parse::<usize>().ok()))
        .unwrap_or(1)
        .max(1);
    let names: Vec<&String> = rest.iter().filter(|a| !a.starts_with('x')).collect();

    let mpi = Mpi::init(None)?;
    let world = SimpleCommunicator::world();
    let processes = mpi.processes();
    // Room in the pool for N calls' inputs and results (the largest, an all-gather's,
    // is `processes` inputs), twice over.
    let pool = (1usize << 30).max(2 * calls * (processes + 1) * len * 4);
    let runtime = Runtime::new(1)?.with_pool(pool, 1 << 20).with_interconnect(mpi.interconnect());
    // Every element a small integer that varies with the process and the position, so
    // sums are exact and a piece or chunk out of place shows in the comparison.
    let values: Vec<f32> = (0..len).map(|i| (mpi.process() + 1 + i % 7) as f32).collect();
    let cases = [
        Case {
            name: "all_reduce",
            program: Arc::new(|ctx, i| Ok(vec![ctx.all_reduce(ReduceOp::Sum, first(i))?])),
            bare: |w, s, r| w.all_reduce_into(s, r, SystemOperation::sum()),
            result_len: |len, _| len,
            grouped: false,
        },
        Case {
            name: "all_gather",
            program: Arc::new(|ctx, i| Ok(vec![ctx.all_gather(0, first(i))?])),
            bare: |w, s, r| w.all_gather_into(s, r),
            result_len: |len, p| len * p,
            grouped: false,
        },
        Case {
            name: "reduce_scatter",
            program: Arc::new(|ctx, i| Ok(vec![ctx.reduce_scatter(ReduceOp::Sum, 0, first(i))?])),
            bare: |w, s, r| w.reduce_scatter_block_into(s, r, SystemOperation::sum()),
            result_len: |len, p| len / p,
            grouped: false,
        },
        Case {
            name: "all_to_all",
            program: Arc::new(|ctx, i| Ok(vec![ctx.all_to_all(0, 0, first(i))?])),
            bare: |w, s, r| w.all_to_all_into(s, r),
            result_len: |len, _| len,
            grouped: false,
        },
        Case {
            name: "all_reduce (halves)",
            program: Arc::new(|ctx, i| {
                let g = ctx.groups(halves(ctx.num_replicas()))?;
                Ok(vec![ctx.all_reduce_in(&g, ReduceOp::Sum, first(i))?])
            }),
            bare: |w, s, r| w.all_reduce_into(s, r, SystemOperation::sum()),
            result_len: |len, _| len,
            grouped: true,
        },
        Case {
            name: "all_gather (halves)",
            program: Arc::new(|ctx, i| {
                let g = ctx.groups(halves(ctx.num_replicas()))?;
                Ok(vec![ctx.all_gather_in(&g, 0, first(i))?])
            }),
            bare: |w, s, r| w.all_gather_into(s, r),
            result_len: |len, p| len * (p / 2),
            grouped: true,
        },
        Case {
            name: "reduce_scatter (halves)",
            program: Arc::new(|ctx, i| {
                let g = ctx.groups(halves(ctx.num_replicas()))?;
                Ok(vec![ctx.reduce_scatter_in(&g, ReduceOp::Sum, 0, first(i))?])
            }),
            bare: |w, s, r| w.reduce_scatter_block_into(s, r, SystemOperation::sum()),
            result_len: |len, p| len / (p / 2),
            grouped: true,
        },
        Case {
            name: "all_to_all (halves)",
            program: Arc::new(|ctx, i| {
                let g = ctx.groups(halves(ctx.num_replicas()))?;
                Ok(vec![ctx.all_to_all_in(&g, 0, 0, first(i))?])
            }),
            bare: |w, s, r| w.all_to_all_into(s, r),
            result_len: |len, _| len,
            grouped: true,
        },
    ];
    // The grouped cases' bare calls run on this process's half of the world.
    let half = (processes >= 4 && processes % 2 == 0)
        .then(|| world.split_by_color(Color::with_value((mpi.process() % 2) as i32)))
        .flatten();
    if mpi.process() == 0 {
        println!(
            "f32, {processes} processes x 1 device, {mib} {unit} per replica, {calls} call(s) \
             per run (times per call), median of {runs} \
             (each run's time is the slowest process's)"
        );
        if half.is_some() {
            println!(
                "  (halves: bare MPI on each half's own communicator; meshwork's exchanges \
                 run over all processes)"
            );
        }
        println!(
            "  {:<24} {:>12} {:>12} {:>8}",
            "collective", "meshwork ms", "bare MPI ms", "ratio"
        );
    }

    for case in cases
        .iter()
        .filter(|c| names.is_empty() || names.iter().any(|n| c.name.contains(n.as_str())))
    {
        let comm = match (case.grouped, &half) {
            (false, _) => &world,
            (true, Some(half)) => half,
            (true, None) => continue,
        };
        let mut ours = Vec::new();
        let mut bare = Vec::new();
        // Both sides as a training loop runs them, reusing their memory: meshwork's
        // input filled in a buffer from the device's pool and its result recycled to
        // it; bare MPI's send and receive buffers allocated once.
        // A buffer pair per call, as a step's collectives have their own tensors.
        let sends: Vec<Vec<f32>> = (0..calls).map(|_| values.clone()).collect();
        let mut recvs = vec![vec![0f32; (case.result_len)(len, processes)]; calls];
        // `calls` calls of the case's program in one run, one per input.
        let one = case.program.clone();
        let program: Arc<ReplicaFn> = Arc::new(move |ctx, inputs| {
            let mut outs = Vec::new();
            for x in inputs {
                outs.extend(one(ctx, vec![x])?);
            }
            Ok(outs)
        });
        // One warm-up of each, then alternate so load changes hit both alike.
        for run in 0..=runs {
            let mut inputs = Vec::new();
            for _ in 0..calls {
                let mut x = runtime.buffer(0, DType::F32, &[len])?;
                if let Tensor::F32(a) = &mut x {
                    a.as_slice_mut().expect("standard layout").copy_from_slice(&values);
                }
                inputs.push(x);
            }
            let mut out = Vec::new();
            let t =
                timed(&world, || out = runtime.run(program.clone(), vec![inputs]).expect("runs"));
            let mine = out.pop().expect("one replica's outputs");

            recvs.iter_mut().for_each(|r| r.fill(0.0));
            let b = timed(&world, || {
                for (send, recv) in sends.iter().zip(recvs.iter_mut()) {
                    (case.bare)(comm, &send[..], &mut recv[..]);
                }
            });
            for (o, recv) in mine.into_iter().zip(&recvs) {
                match &o {
                    Tensor::F32(a) => assert!(
                        a.as_slice().expect("standard layout") == &recv[..],
                        "{}: meshwork and bare MPI disagree",
                        case.name
                    ),
                    other => panic!("{other:?}"),
                }
                runtime.recycle(0, o)?;
            }
            if run > 0 {
                ours.push(t / calls as u32);
                bare.push(b / calls as u32);
            }
        }
        if mpi.process() == 0 {
            let (o, b) = (median(ours), median(bare));
            println!(
                "  {:<24} {:>12.3} {:>12.3} {:>7.2}×",
                case.name,
                o.as_secs_f64() * 1e3,
                b.as_secs_f64() * 1e3,
                o.as_secs_f64() / b.as_secs_f64()
            );
        }
    }
    Ok(())
}
