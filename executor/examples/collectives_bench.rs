//! All-reduce, all-gather, reduce-scatter and all-to-all of f32 across 8 devices, each
//! beside the memory-traffic bound: the bytes the collective must read and write, at
//! the bandwidth of a memcpy as large as the replicas' inputs together, measured in the
//! same run.
//!
//! `cargo run --release -p meshwork-executor --example collectives_bench [-- RUNS MIB...]`
//! (defaults: 5 runs, 8 and 64 MiB per replica). Prints medians, algorithm and bus
//! bandwidth (nccl-tests definitions) and the ratio to the bound. Rows:
//! - plain calls on a runtime whose devices keep buffer pools (the default): the host
//!   fills each run's inputs in buffers from the pools (`Runtime::buffer`), the
//!   collectives give their consumed inputs back to the pools, and the host hands each
//!   run's results back (`Runtime::recycle`) once done with them, as a training loop
//!   would, so a warm run neither faults in nor frees pages;
//! - `(fresh)`: the same call with pooling off, every result in fresh pages;
//! - `*_into`: the caller passes the previous run's output as the output buffer.

#![allow(clippy::print_stdout, missing_docs)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use meshwork_executor::{Program, ReplicaGroups, Runtime, Tensor};
use meshwork_types::{DType, ReduceOp};
use ndarray::{ArrayD, IxDyn};

const DEVICES: usize = 8;

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

/// Bytes per second of a memcpy of `bytes`, split over the cores as the devices are.
fn memcpy_bandwidth(bytes: usize, runs: usize) -> f64 {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let chunk = bytes.div_ceil(threads);
    let mut copy = || {
        std::thread::scope(|s| {
            for (d, c) in dst.chunks_mut(chunk).zip(src.chunks(chunk)) {
                s.spawn(move || d.copy_from_slice(c));
            }
        })
    };
    copy();
    let t = median(
        (0..runs)
            .map(|_| {
                let start = Instant::now();
                copy();
                start.elapsed()
            })
            .collect(),
    );
    std::hint::black_box(&dst);
    bytes as f64 / t.as_secs_f64()
}

struct Case {
    name: &'static str,
    program: Arc<Program>,
    /// Bytes read plus written, over all replicas, as a multiple of one input.
    traffic: fn(n: f64) -> f64,
    /// (bytes nccl-tests counts, as a multiple of one input; bus-bandwidth factor).
    nccl: fn(n: f64) -> (f64, f64),
    /// The program takes the previous run's output as its output buffer (`*_into`).
    reuse: bool,
    /// Runs with pooling off.
    fresh: bool,
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let runs = args.first().copied().unwrap_or(5).max(5);
    let sizes: Vec<usize> = if args.len() > 1 { args[1..].to_vec() } else { vec![8, 64] };
    let pooled = Runtime::new(DEVICES).expect("devices");
    let unpooled = Runtime::new(DEVICES).expect("devices").with_pool(0, 0);
    let cases = [
        Case {
            name: "all_reduce",
            program: Arc::new(|ctx, i| {
                Ok(vec![ctx.all_reduce(ReduceOp::Sum, i.into_iter().next().unwrap())?])
            }),
            traffic: |n| 2.0 * n,
            nccl: |n| (1.0, 2.0 * (n - 1.0) / n),
            reuse: false,
            fresh: false,
        },
        Case {
            name: "all_gather",
            program: Arc::new(|ctx, i| Ok(vec![ctx.all_gather(0, i.into_iter().next().unwrap())?])),
            traffic: |n| 2.0 * n * n,
            nccl: |n| (n, (n - 1.0) / n),
            reuse: false,
            fresh: false,
        },
        Case {
            name: "all_gather (fresh)",
            program: Arc::new(|ctx, i| Ok(vec![ctx.all_gather(0, i.into_iter().next().unwrap())?])),
            traffic: |n| 2.0 * n * n,
            nccl: |n| (n, (n - 1.0) / n),
            reuse: false,
            fresh: true,
        },
        Case {
            name: "all_gather_into",
            program: Arc::new(|ctx, i| {
                let all = ReplicaGroups::all(ctx.num_replicas());
                let mut i = i.into_iter();
                let (x, out) = (i.next().unwrap(), i.next().unwrap());
                Ok(vec![ctx.all_gather_into(&all, 0, x, out)?])
            }),
            traffic: |n| 2.0 * n * n,
            nccl: |n| (n, (n - 1.0) / n),
            reuse: true,
            fresh: false,
        },
        Case {
            name: "reduce_scatter",
            program: Arc::new(|ctx, i| {
                Ok(vec![ctx.reduce_scatter(ReduceOp::Sum, 0, i.into_iter().next().unwrap())?])
            }),
            traffic: |n| n + 1.0,
            nccl: |n| (1.0, (n - 1.0) / n),
            reuse: false,
            fresh: false,
        },
        Case {
            name: "all_to_all",
            program: Arc::new(|ctx, i| {
                Ok(vec![ctx.all_to_all(0, 0, i.into_iter().next().unwrap())?])
            }),
            traffic: |n| 2.0 * n,
            nccl: |n| (1.0, (n - 1.0) / n),
            reuse: false,
            fresh: false,
        },
        Case {
            name: "all_to_all (fresh)",
            program: Arc::new(|ctx, i| {
                Ok(vec![ctx.all_to_all(0, 0, i.into_iter().next().unwrap())?])
            }),
            traffic: |n| 2.0 * n,
            nccl: |n| (1.0, (n - 1.0) / n),
            reuse: false,
            fresh: true,
        },
        Case {
            name: "reduce_scatter (fresh)",
            program: Arc::new(|ctx, i| {
                Ok(vec![ctx.reduce_scatter(ReduceOp::Sum, 0, i.into_iter().next().unwrap())?])
            }),
            traffic: |n| n + 1.0,
            nccl: |n| (1.0, (n - 1.0) / n),
            reuse: false,
            fresh: true,
        },
        Case {
            name: "all_to_all_into",
            program: Arc::new(|ctx, i| {
                let all = ReplicaGroups::all(ctx.num_replicas());
                let mut i = i.into_iter();
                let (x, out) = (i.next().unwrap(), i.next().unwrap());
                Ok(vec![ctx.all_to_all_into(&all, 0, 0, x, out)?])
            }),
            traffic: |n| 2.0 * n,
            nccl: |n| (1.0, (n - 1.0) / n),
            reuse: true,
            fresh: false,
        },
    ];
    fused(&pooled, runs);
    for mib in sizes {
        let bytes = mib << 20;
        let elements = bytes / 4;
        // The bound's bandwidth: a memcpy as large as the replicas' inputs together,
        // the working set the collective streams through (a memcpy of one input can
        // run from the last-level cache, which 8 inputs together may not fit).
        let copy_bw = memcpy_bandwidth(DEVICES * bytes, runs);
        println!(
            "{DEVICES} × {mib} MiB f32 per replica; memcpy of {} MiB {:.2} GB/s (of {mib} MiB {:.2} GB/s), {} threads, medians of {runs}",
            DEVICES * mib,
            copy_bw / 1e9,
            memcpy_bandwidth(bytes, runs) / 1e9,
            std::thread::available_parallelism().map_or(1, |n| n.get())
        );
        println!(
            "  {:<22} {:>10} {:>12} {:>12} {:>12} {:>8}",
            "collective", "time ms", "algbw GB/s", "busbw GB/s", "bound ms", "ratio"
        );
        for case in &cases {
            pooled.release_pools();
            let mut times = Vec::with_capacity(runs);
            let mut previous: Option<Vec<Vec<Tensor>>> = None;
            let rt = if case.fresh { &unpooled } else { &pooled };
            for i in 0..=runs {
                // Each replica's input, r everywhere, in a buffer from its device's
                // pool (as a training loop's would be; fresh pages when pooling is off).
                let mut ins: Vec<Vec<Tensor>> = (0..DEVICES)
                    .map(|r| {
                        let mut x = rt.buffer(r, DType::F32, &[elements]).expect("a buffer");
                        if let Tensor::F32(a) = &mut x {
                            a.fill(r as f32);
                        }
                        vec![x]
                    })
                    .collect();
                if case.reuse {
                    let result_len = if case.name.starts_with("all_gather") {
                        elements * DEVICES
                    } else {
                        elements
                    };
                    for (r, input) in ins.iter_mut().enumerate() {
                        let buffer = match previous.as_mut() {
                            Some(p) => p[r].pop().expect("one output"),
                            None => Tensor::F32(ArrayD::zeros(IxDyn(&[result_len]))),
                        };
                        input.push(buffer);
                    }
                }
                let start = Instant::now();
                let out = rt.run(case.program.clone(), ins).expect("runs");
                let t = start.elapsed();
                if case.reuse {
                    previous = Some(out);
                } else if case.fresh {
                    drop(out);
                } else {
                    for (device, o) in out.into_iter().enumerate() {
                        o.into_iter().for_each(|t| rt.recycle(device, t).expect("a device"));
                    }
                }
                if i > 0 {
                    times.push(t); // the first run faults pages in
                }
            }
            let t = median(times).as_secs_f64();
            let n = DEVICES as f64;
            // A memcpy of B bytes reads and writes B each, so traffic T takes T/2 copies.
            let bound = (case.traffic)(n) * bytes as f64 / 2.0 / copy_bw;
            let (counted, factor) = (case.nccl)(n);
            let algbw = counted * bytes as f64 / t;
            println!(
                "  {:<22} {:>10.1} {:>12.2} {:>12.2} {:>12.1} {:>7.2}×",
                case.name,
                t * 1e3,
                algbw / 1e9,
                algbw * factor / 1e9,
                bound * 1e3,
                t / bound
            );
        }
    }
}

/// 200 gradients of 4–64 KiB each (f32, sizes from a fixed sequence), all-reduced
/// one call per tensor, then fused into buckets of 1 MiB and of 25 MiB (PyTorch DDP's
/// default), beside the memory-traffic bound of the same bytes.
fn fused(rt: &Runtime, runs: usize) {
    let sizes: Vec<usize> = (0..200u64)
        .map(|i| {
            let x = (i + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40;
            (4 + (x % 61) as usize) << 10
        })
        .collect();
    let total: usize = sizes.iter().sum();
    let copy_bw = memcpy_bandwidth(DEVICES * total, runs);
    println!(
        "{DEVICES} replicas × 200 tensors of 4–64 KiB f32 ({:.2} MiB per replica); memcpy of {:.2} MiB {:.2} GB/s, medians of {runs}",
        total as f64 / (1 << 20) as f64,
        (DEVICES * total) as f64 / (1 << 20) as f64,
        copy_bw / 1e9
    );
    println!(
        "  {:<22} {:>10} {:>12} {:>8} {:>12}",
        "all_reduce", "time ms", "bound ms", "ratio", "vs unfused"
    );
    let inputs: Vec<Vec<Tensor>> = (0..DEVICES)
        .map(|r| {
            sizes
                .iter()
                .map(|&b| Tensor::F32(ArrayD::from_elem(IxDyn(&[b / 4]), r as f32)))
                .collect()
        })
        .collect();
    let unfused: Arc<Program> = Arc::new(|ctx, i| {
        i.into_iter().map(|t| ctx.all_reduce(ReduceOp::Sum, t).map_err(Into::into)).collect()
    });
    let fused = |bucket: usize| -> Arc<Program> {
        Arc::new(move |ctx, i| {
            let all = ReplicaGroups::all(ctx.num_replicas());
            Ok(ctx.all_reduce_fused(&all, ReduceOp::Sum, i, bucket)?)
        })
    };
    let bound = 2.0 * DEVICES as f64 * total as f64 / 2.0 / copy_bw;
    let mut first = None;
    for (name, program) in [
        ("unfused (200 calls)", unfused),
        ("fused, 1 MiB buckets", fused(1 << 20)),
        ("fused, 25 MiB buckets", fused(25 << 20)),
    ] {
        let mut times = Vec::with_capacity(runs);
        for i in 0..=runs {
            let ins = inputs.clone();
            let start = Instant::now();
            let out = rt.run(program.clone(), ins).expect("runs");
            let t = start.elapsed();
            drop(out);
            if i > 0 {
                times.push(t);
            }
        }
        let t = median(times).as_secs_f64();
        let base = *first.get_or_insert(t);
        println!(
            "  {:<22} {:>10.2} {:>12.2} {:>7.2}× {:>11.2}×",
            name,
            t * 1e3,
            bound * 1e3,
            t / bound,
            base / t
        );
    }
}
