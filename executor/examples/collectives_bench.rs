//! All-reduce, all-gather, reduce-scatter and all-to-all of f32 across 8 devices, each
//! beside two memory-traffic bounds measured in the same run, over a working set as
//! large as the replicas' inputs together:
//! - `bound`: the bytes the collective must read and write, at the bandwidth of a memcpy
//!   (read and written bytes priced alike);
//! - `r/w bound`: the bytes it must read at the bandwidth of a streaming read, plus the
//!   bytes it must write at the bandwidth of a fill. On this VM the two differ: the
//!   write bandwidth (and so memcpy's) swings by up to 1.6× between runs while reads
//!   change little, so a read-mostly collective such as reduce-scatter is 0.9× the
//!   first bound one minute and 1.25× the next; the second follows both.
//!
//! Beside the all-reduce, the plain all-gather and the reduce-scatters, JAX's `psum`,
//! `all_gather` and `psum_scatter` of the same sizes (`benches/jax/collectives_jax.py
//! --serve`, 8 forced host devices, `shard_map`; needs `pip install jax==0.10.2
//! numpy`), run between the two halves of meshwork's runs of the same case (so a drift
//! of the machine shows on both). Every timed call of either comes right after the same
//! pass of the yardsticks over the working set, which also leaves meshwork's freshly
//! written inputs out of the caches, as JAX's are. "vs JAX" is the ratio of the two
//! medians.
//!
//! `cargo run --release -p meshwork-executor --example collectives_bench [-- RUNS MIB... NAME...]`
//! (defaults: 11 runs, 8 and 64 MiB per replica, every case; a NAME keeps the cases whose
//! names contain it, `fused` the fused all-reduce). Prints medians, algorithm and bus
//! bandwidth (nccl-tests definitions) and the ratios to the bounds and to JAX. Rows:
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

use meshwork_executor::{ReplicaFn, ReplicaGroups, Runtime, Tensor};
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

/// The bounds' yardsticks over a working set, one pass each, split over the cores as
/// the devices are: a memcpy, a streaming read (a sum) and a fill, of buffers whose
/// pages are already mapped.
struct Probe {
    src: Vec<f32>,
    dst: Vec<f32>,
    threads: usize,
}

/// Seconds per byte of each yardstick, measured once.
#[derive(Clone, Copy)]
struct Rates {
    copy: f64,
    read: f64,
    fill: f64,
}

impl Probe {
    fn new(bytes: usize) -> Probe {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let mut probe = Probe { src: vec![1.0; bytes / 4], dst: vec![0.0; bytes / 4], threads };
        probe.measure();
        probe
    }

    /// One pass of each yardstick.
    fn measure(&mut self) -> Rates {
        let chunk = self.src.len().div_ceil(self.threads);
        let bytes = (self.src.len() * 4) as f64;
        // The fill first and the read last, so the pass leaves clean lines in the
        // caches, not dirty ones for the next measured call to write back.
        let start = Instant::now();
        std::thread::scope(|s| {
            for d in self.dst.chunks_mut(chunk) {
                s.spawn(move || d.fill(2.0));
            }
        });
        let fill = start.elapsed().as_secs_f64() / bytes;
        std::hint::black_box(&self.dst);
        let start = Instant::now();
        std::thread::scope(|s| {
            for (d, c) in self.dst.chunks_mut(chunk).zip(self.src.chunks(chunk)) {
                s.spawn(move || d.copy_from_slice(c));
            }
        });
        let copy = start.elapsed().as_secs_f64() / bytes;
        let start = Instant::now();
        let sum = std::thread::scope(|s| {
            let sums: Vec<_> = self
                .src
                .chunks(chunk)
                .map(|c| {
                    s.spawn(move || {
                        let mut acc = [0.0f32; 16];
                        for x in c.chunks_exact(16) {
                            for (a, &x) in acc.iter_mut().zip(x) {
                                *a += x;
                            }
                        }
                        acc.iter().sum::<f32>()
                    })
                })
                .collect();
            sums.into_iter().map(|h| h.join().expect("a sum")).sum::<f32>()
        });
        let read = start.elapsed().as_secs_f64() / bytes;
        std::hint::black_box(sum);
        Rates { copy, read, fill }
    }
}

struct Case {
    name: &'static str,
    program: Arc<ReplicaFn>,
    /// Bytes read and bytes written, over all replicas, as multiples of one input.
    traffic: fn(n: f64) -> (f64, f64),
    /// (bytes nccl-tests counts, as a multiple of one input; bus-bandwidth factor).
    nccl: fn(n: f64) -> (f64, f64),
    /// The program takes the previous run's output as its output buffer (`*_into`).
    reuse: bool,
    /// Runs with pooling off.
    fresh: bool,
    /// JAX's counterpart (`collectives_jax.py --serve`), timed call by call between ours.
    jax: Option<&'static str>,
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    // Other arguments pick the cases whose names contain one of them (all by default).
    let only: Vec<String> =
        std::env::args().skip(1).filter(|a| a.parse::<usize>().is_err()).collect();
    let runs = args.first().copied().unwrap_or(11).max(5);
    let sizes: Vec<usize> = if args.len() > 1 { args[1..].to_vec() } else { vec![8, 64] };
    let pooled = Runtime::new(DEVICES).expect("devices");
    let unpooled = Runtime::new(DEVICES).expect("devices").with_pool(0, 0);
    let cases = [
        Case {
            name: "all_reduce",
            program: Arc::new(|ctx, i| {
                Ok(vec![ctx.all_reduce(ReduceOp::Sum, i.into_iter().next().unwrap())?])
            }),
            traffic: |n| (n, n),
            nccl: |n| (1.0, 2.0 * (n - 1.0) / n),
            reuse: false,
            fresh: false,
            jax: Some("psum"),
        },
        Case {
            name: "all_gather",
            program: Arc::new(|ctx, i| Ok(vec![ctx.all_gather(0, i.into_iter().next().unwrap())?])),
            traffic: |n| (n * n, n * n),
            nccl: |n| (n, (n - 1.0) / n),
            reuse: false,
            fresh: false,
            jax: Some("all_gather"),
        },
        Case {
            name: "all_gather (fresh)",
            program: Arc::new(|ctx, i| Ok(vec![ctx.all_gather(0, i.into_iter().next().unwrap())?])),
            traffic: |n| (n * n, n * n),
            nccl: |n| (n, (n - 1.0) / n),
            reuse: false,
            fresh: true,
            jax: None,
        },
        Case {
            name: "all_gather_into",
            program: Arc::new(|ctx, i| {
                let all = ReplicaGroups::all(ctx.num_replicas());
                let mut i = i.into_iter();
                let (x, out) = (i.next().unwrap(), i.next().unwrap());
                Ok(vec![ctx.all_gather_into(&all, 0, x, out)?])
            }),
            traffic: |n| (n * n, n * n),
            nccl: |n| (n, (n - 1.0) / n),
            reuse: true,
            fresh: false,
            jax: None,
        },
        Case {
            name: "reduce_scatter",
            program: Arc::new(|ctx, i| {
                Ok(vec![ctx.reduce_scatter(ReduceOp::Sum, 0, i.into_iter().next().unwrap())?])
            }),
            traffic: |n| (n, 1.0),
            nccl: |n| (1.0, (n - 1.0) / n),
            reuse: false,
            fresh: false,
            jax: Some("psum_scatter"),
        },
        Case {
            name: "all_to_all",
            program: Arc::new(|ctx, i| {
                Ok(vec![ctx.all_to_all(0, 0, i.into_iter().next().unwrap())?])
            }),
            traffic: |n| (n, n),
            nccl: |n| (1.0, (n - 1.0) / n),
            reuse: false,
            fresh: false,
            jax: None,
        },
        Case {
            name: "all_to_all (fresh)",
            program: Arc::new(|ctx, i| {
                Ok(vec![ctx.all_to_all(0, 0, i.into_iter().next().unwrap())?])
            }),
            traffic: |n| (n, n),
            nccl: |n| (1.0, (n - 1.0) / n),
            reuse: false,
            fresh: true,
            jax: None,
        },
        Case {
            name: "reduce_scatter (fresh)",
            program: Arc::new(|ctx, i| {
                Ok(vec![ctx.reduce_scatter(ReduceOp::Sum, 0, i.into_iter().next().unwrap())?])
            }),
            traffic: |n| (n, 1.0),
            nccl: |n| (1.0, (n - 1.0) / n),
            reuse: false,
            fresh: true,
            jax: Some("psum_scatter"),
        },
        Case {
            name: "all_to_all_into",
            program: Arc::new(|ctx, i| {
                let all = ReplicaGroups::all(ctx.num_replicas());
                let mut i = i.into_iter();
                let (x, out) = (i.next().unwrap(), i.next().unwrap());
                Ok(vec![ctx.all_to_all_into(&all, 0, 0, x, out)?])
            }),
            traffic: |n| (n, n),
            nccl: |n| (1.0, (n - 1.0) / n),
            reuse: true,
            fresh: false,
            jax: None,
        },
    ];
    let cases: Vec<Case> = cases
        .into_iter()
        .filter(|c| only.is_empty() || only.iter().any(|o| c.name.contains(o.as_str())))
        .collect();
    if only.is_empty() || only.iter().any(|o| "fused".contains(o.as_str())) {
        fused(&pooled, runs);
    }
    let mut jax = Jax::start();
    if jax.is_none() {
        println!("JAX: not run (needs python3 with `pip install jax==0.10.2 numpy`)");
    }
    for mib in sizes {
        let bytes = mib << 20;
        let elements = bytes / 4;
        // The bounds' bandwidths: over a working set as large as the replicas' inputs
        // together, the set the collective streams through (one input alone can run
        // from the last-level cache, which 8 together may not fit), measured again
        // beside every case, as the machine's memory state drifts.
        println!(
            "{DEVICES} × {mib} MiB f32 per replica over {} MiB, {} threads, medians of {runs}",
            DEVICES * mib,
            std::thread::available_parallelism().map_or(1, |n| n.get())
        );
        println!(
            "  {:<22} {:>8} {:>10} {:>10} {:>9} {:>7} {:>10} {:>7} {:>8} {:>7}   memcpy / read / fill GB/s",
            "collective",
            "time ms",
            "algbw GB/s",
            "busbw GB/s",
            "bound ms",
            "ratio",
            "r/w bound",
            "ratio",
            "JAX ms",
            "vs JAX",
        );
        let mut probe = Probe::new(DEVICES * bytes);
        for case in &cases {
            // The last case's buffers go back to the system on the reaper thread; let
            // it finish before this case's runs share the cores with it.
            pooled.release_pools();
            std::thread::sleep(Duration::from_millis(500));
            let mut times = Vec::with_capacity(runs);
            let mut jax_times = Vec::with_capacity(runs);
            let mut previous: Option<Vec<Vec<Tensor>>> = None;
            let rt = if case.fresh { &unpooled } else { &pooled };
            // One call: the inputs made, then (when measuring) a pass of each yardstick,
            // which also leaves the inputs out of the caches as JAX's are, then the call.
            let mut once = |probe: Option<&mut Probe>| -> (Duration, Option<Rates>) {
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
                let rates = probe.map(Probe::measure);
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
                (t, rates)
            };
            // Warm loops, as a training loop runs: meshwork's runs in two halves with
            // JAX's runs between them (A-B-A, so a drift of the machine's state shows in
            // both), each half after one untimed run (the first faults pages in; after
            // JAX's runs, XLA's worker threads spin for a while and would take the cores).
            let first_half = runs / 2;
            // Each timed run right after a pass of each yardstick, so its bounds are
            // those of the machine's state at that moment.
            let mut timed = |n: usize, times: &mut Vec<(Duration, Rates)>, probe: &mut Probe| {
                once(None);
                for _ in 0..n {
                    let (t, rates) = once(Some(&mut *probe));
                    times.push((t, rates.expect("measured")));
                }
            };
            timed(first_half, &mut times, &mut probe);
            if let (Some(op), Some(j)) = (case.jax, jax.as_mut()) {
                let _ = j.time(op, mib);
                for _ in 0..runs {
                    // The same pass before each of JAX's calls as before meshwork's.
                    probe.measure();
                    jax_times.extend(j.time(op, mib));
                }
            }
            timed(runs - first_half, &mut times, &mut probe);
            let n = DEVICES as f64;
            let (reads, writes) = (case.traffic)(n);
            // A memcpy of B bytes reads and writes B each, so traffic T takes T/2 copies.
            let bound = |r: &Rates| (reads + writes) * bytes as f64 / 2.0 * r.copy;
            let rw_bound = |r: &Rates| (reads * r.read + writes * r.fill) * bytes as f64;
            let ratio = |f: &dyn Fn(&Rates) -> f64| {
                median_f64(times.iter().map(|(t, r)| t.as_secs_f64() / f(r)).collect())
            };
            let (bound_ratio, rw_ratio) = (ratio(&bound), ratio(&rw_bound));
            let bound_ms = 1e3 * median_f64(times.iter().map(|(_, r)| bound(r)).collect());
            let rw_ms = 1e3 * median_f64(times.iter().map(|(_, r)| rw_bound(r)).collect());
            let rates =
                |f: fn(&Rates) -> f64| 1e-9 / median_f64(times.iter().map(|(_, r)| f(r)).collect());
            let (copy_gbs, read_gbs, fill_gbs) =
                (rates(|r| r.copy), rates(|r| r.read), rates(|r| r.fill));
            let t = median(times.iter().map(|(t, _)| *t).collect()).as_secs_f64();
            let (jax_ms, vs_jax) = match jax_times.len() {
                0 => ("—".to_string(), "—".to_string()),
                _ => {
                    let j = median(jax_times).as_secs_f64();
                    (format!("{:.1}", j * 1e3), format!("{:.2}×", j / t))
                }
            };
            let (counted, factor) = (case.nccl)(n);
            let algbw = counted * bytes as f64 / t;
            println!(
                "  {:<22} {:>8.1} {:>10.2} {:>10.2} {:>9.1} {:>6.2}× {:>10.1} {:>6.2}× {:>8} {:>7}   {:.1} / {:.1} / {:.1}",
                case.name,
                t * 1e3,
                algbw / 1e9,
                algbw * factor / 1e9,
                bound_ms,
                bound_ratio,
                rw_ms,
                rw_ratio,
                jax_ms,
                vs_jax,
                copy_gbs,
                read_gbs,
                fill_gbs,
            );
        }
    }
}

fn median_f64(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// JAX's side, interleaved with meshwork's calls: `benches/jax/collectives_jax.py --serve`
/// (8 forced host devices, `shard_map`) answering one timed call per request, when
/// `python3` has jax.
struct Jax {
    child: std::process::Child,
    input: std::process::ChildStdin,
    output: std::io::BufReader<std::process::ChildStdout>,
}

impl Jax {
    fn start() -> Option<Jax> {
        use std::io::BufRead;
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/jax/collectives_jax.py");
        let mut child = std::process::Command::new("python3")
            .args([script, "--serve"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .ok()?;
        let input = child.stdin.take()?;
        let mut output = std::io::BufReader::new(child.stdout.take()?);
        let mut ready = String::new();
        output.read_line(&mut ready).ok()?;
        if ready.trim() != "ready" {
            let _ = child.kill();
            return None;
        }
        Some(Jax { child, input, output })
    }

    /// One timed call of JAX's `op` on `mib` MiB per device (compiled and warmed the
    /// first time).
    fn time(&mut self, op: &str, mib: usize) -> Option<Duration> {
        use std::io::{BufRead, Write};
        writeln!(self.input, "{op} {mib}").ok()?;
        let mut line = String::new();
        self.output.read_line(&mut line).ok()?;
        let ms: f64 = line.trim().parse().ok()?;
        Some(Duration::from_secs_f64(ms / 1e3))
    }
}

impl Drop for Jax {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
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
    let unfused: Arc<ReplicaFn> = Arc::new(|ctx, i| {
        i.into_iter().map(|t| ctx.all_reduce(ReduceOp::Sum, t).map_err(Into::into)).collect()
    });
    let fused = |bucket: usize| -> Arc<ReplicaFn> {
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
