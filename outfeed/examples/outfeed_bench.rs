//! 8 device threads stream frames to host callbacks through the receiver, beside anchors
//! measured in the same run: a bare crossbeam bounded channel moving the same payloads
//! (8 producers → 1 consumer), bare channels in the receiver's own shape (one per
//! producer, two consumer threads), and memcpy of the same bytes between two buffers of
//! the run's size. Payloads are built before the clock starts (a device produces them; the
//! outfeed moves them). Medians of 9 runs each, the measures' runs interleaved; the
//! ratios (in-memory outfeed against each bare-channel anchor and memcpy) are the medians of
//! each run's ratio, so the machine's drift between runs cancels out.
//!
//! `cargo run --release -p meshwork-outfeed --example outfeed_bench [-- RUNS]`

#![allow(clippy::print_stdout, missing_docs)]

use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use meshwork_outfeed::{
    Config, Delivery, Receiver, Registry, Sender, Source, StreamSink, StreamSource, channel,
};

const SOURCES: usize = 8;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn registry(bytes: usize) -> Registry {
    let mut r = Registry::new();
    r.register(1, "payload", vec![format!("u8[{bytes}]").parse().unwrap()]).unwrap();
    r
}

/// Frames per source for a payload size (about 256 MiB per run in all, so a run
/// streams for tens of milliseconds and thread start-up is a small part of it; at
/// most 20k frames per source for small payloads, at least 8 for large ones).
fn frames(bytes: usize) -> usize {
    ((256 << 20) / SOURCES / bytes).clamp(8, 20_000)
}

fn outfeed_in_memory(bytes: usize) -> Duration {
    let n = frames(bytes);
    let seen = Arc::new(AtomicU64::new(0));
    let counter = seen.clone();
    let cb = move |d: &Delivery| {
        counter.fetch_add(d.payload().len() as u64, Ordering::Relaxed);
        Ok(())
    };
    let payloads: Vec<Vec<Vec<u8>>> =
        (0..SOURCES).map(|_| (0..n).map(|_| vec![7u8; bytes]).collect()).collect();
    let start = Instant::now();
    let mut sources: Vec<Box<dyn Source>> = Vec::new();
    let mut sinks = Vec::new();
    for _ in 0..SOURCES {
        let (sink, source) = channel(64);
        sinks.push(sink);
        sources.push(Box::new(source));
    }
    let config = Config { budget: 8 << 20, workers: 2, ..Config::default() };
    let mut receiver = Receiver::start(registry(bytes), sources, Arc::new(cb), None, config);
    let devices: Vec<_> = sinks
        .into_iter()
        .zip(payloads)
        .map(|(sink, payloads)| {
            std::thread::spawn(move || {
                let mut s = Sender::new(registry(bytes), sink);
                for p in payloads {
                    s.send_bytes(1, p).unwrap();
                }
                s.shutdown().unwrap();
            })
        })
        .collect();
    for d in devices {
        d.join().unwrap();
    }
    let report = receiver.join();
    let t = start.elapsed();
    assert!(report.errors.is_empty());
    assert_eq!(seen.load(Ordering::Relaxed), (SOURCES * n * bytes) as u64);
    t
}

fn outfeed_tcp(bytes: usize) -> Duration {
    let n = frames(bytes);
    let seen = Arc::new(AtomicU64::new(0));
    let counter = seen.clone();
    let cb = move |d: &Delivery| {
        counter.fetch_add(d.payload().len() as u64, Ordering::Relaxed);
        Ok(())
    };
    let payload = vec![7u8; bytes];
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let start = Instant::now();
    let devices: Vec<_> = (0..SOURCES)
        .map(|_| {
            let payload = payload.clone();
            std::thread::spawn(move || {
                let mut s = Sender::new(
                    registry(bytes),
                    StreamSink::tcp(std::net::TcpStream::connect(addr).unwrap()),
                );
                for _ in 0..n {
                    s.send_bytes(1, payload.clone()).unwrap();
                }
                s.shutdown().unwrap();
            })
        })
        .collect();
    let sources: Vec<Box<dyn Source>> = (0..SOURCES)
        .map(|_| {
            Box::new(StreamSource::tcp(listener.accept().unwrap().0).unwrap()) as Box<dyn Source>
        })
        .collect();
    let config = Config { budget: 8 << 20, workers: 2, ..Config::default() };
    let mut receiver = Receiver::start(registry(bytes), sources, Arc::new(cb), None, config);
    for d in devices {
        d.join().unwrap();
    }
    let report = receiver.join();
    let t = start.elapsed();
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(seen.load(Ordering::Relaxed), (SOURCES * n * bytes) as u64);
    t
}

/// The anchor: the same payloads (built before the clock starts, as the devices') through one
/// crossbeam bounded channel to one consumer that reads their length.
fn bare_channel(bytes: usize) -> Duration {
    let n = frames(bytes);
    let payloads: Vec<Vec<Vec<u8>>> =
        (0..SOURCES).map(|_| (0..n).map(|_| vec![7u8; bytes]).collect()).collect();
    let start = Instant::now();
    let (tx, rx) = crossbeam::channel::bounded::<Vec<u8>>(64);
    let producers: Vec<_> = payloads
        .into_iter()
        .map(|payloads| {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for p in payloads {
                    tx.send(p).unwrap();
                }
            })
        })
        .collect();
    drop(tx);
    let mut total = 0u64;
    for p in rx.iter() {
        total += p.len() as u64;
    }
    for p in producers {
        p.join().unwrap();
    }
    assert_eq!(total, (SOURCES * n * bytes) as u64);
    start.elapsed()
}

/// The anchor in the outfeed's own shape: a bounded channel (64) per source, and two
/// consumer threads each draining its half of them (source `s` on thread `s % 2`, a
/// burst of each in turn, a select when none has one), reading each payload's length.
fn bare_channels(bytes: usize) -> Duration {
    use crossbeam::channel::{Receiver as Rx, Select, TryRecvError};
    let n = frames(bytes);
    let payloads: Vec<Vec<Vec<u8>>> =
        (0..SOURCES).map(|_| (0..n).map(|_| vec![7u8; bytes]).collect()).collect();
    let start = Instant::now();
    let mut halves: [Vec<Rx<Vec<u8>>>; 2] = [Vec::new(), Vec::new()];
    let producers: Vec<_> = payloads
        .into_iter()
        .enumerate()
        .map(|(s, payloads)| {
            let (tx, rx) = crossbeam::channel::bounded::<Vec<u8>>(64);
            halves[s % 2].push(rx);
            std::thread::spawn(move || {
                for p in payloads {
                    tx.send(p).unwrap();
                }
            })
        })
        .collect();
    let consumers: Vec<_> = halves
        .into_iter()
        .map(|mut rxs| {
            std::thread::spawn(move || {
                let mut total = 0u64;
                while !rxs.is_empty() {
                    let mut progress = false;
                    let mut i = 0;
                    while i < rxs.len() {
                        let mut ended = false;
                        for _ in 0..64 {
                            match rxs[i].try_recv() {
                                Ok(p) => {
                                    total += p.len() as u64;
                                    progress = true;
                                }
                                Err(TryRecvError::Empty) => break,
                                Err(TryRecvError::Disconnected) => {
                                    ended = true;
                                    break;
                                }
                            }
                        }
                        if ended {
                            rxs.swap_remove(i);
                            progress = true;
                        } else {
                            i += 1;
                        }
                    }
                    if !progress {
                        let mut select = Select::new();
                        rxs.iter().for_each(|r| {
                            select.recv(r);
                        });
                        select.ready();
                    }
                }
                total
            })
        })
        .collect();
    for p in producers {
        p.join().unwrap();
    }
    let total: u64 = consumers.into_iter().map(|c| c.join().unwrap()).sum();
    assert_eq!(total, (SOURCES * n * bytes) as u64);
    start.elapsed()
}

/// One copy of the run's bytes between two warm buffers of that size.
fn memcpy(bytes: usize) -> Duration {
    let total = SOURCES * frames(bytes) * bytes;
    let src = vec![7u8; total];
    let mut dst = vec![0u8; total];
    dst.copy_from_slice(&src);
    let start = Instant::now();
    std::hint::black_box(&mut dst[..]).copy_from_slice(std::hint::black_box(&src));
    start.elapsed()
}

fn main() {
    let runs: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(9).max(5);
    println!("outfeed_bench: {SOURCES} sources -> callbacks (2 workers), median of {runs}");
    for bytes in [64usize, 4 << 10, 1 << 20] {
        let n = SOURCES * frames(bytes);
        let mb = (n * bytes) as f64 / 1e6;
        // The runs of each measure interleaved, so the machine's load changes hit all
        // of them alike.
        let mut times = [(); 5].map(|_| Vec::with_capacity(runs));
        for _ in 0..runs {
            let fs: [&dyn Fn(usize) -> Duration; 5] =
                [&outfeed_in_memory, &outfeed_tcp, &bare_channel, &memcpy, &bare_channels];
            for (t, f) in times.iter_mut().zip(fs) {
                t.push(f(bytes));
            }
        }
        // Ratios to the anchors run by run (each run's measures sit side by side in
        // time), then their median: the machine's drift between runs cancels out.
        let ratio = |a: &[Duration], b: &[Duration]| {
            let mut r: Vec<f64> =
                a.iter().zip(b).map(|(a, b)| a.as_secs_f64() / b.as_secs_f64()).collect();
            r.sort_by(f64::total_cmp);
            r[r.len() / 2]
        };
        let (vs_chan, vs_copy) = (ratio(&times[2], &times[0]), ratio(&times[3], &times[0]));
        let vs_chans = ratio(&times[4], &times[0]);
        let [mem, tcp, chan, copy, chans] = times.map(median);
        let rate = |t: Duration| n as f64 / t.as_secs_f64();
        let bw = |t: Duration| mb / 1e3 / t.as_secs_f64();
        println!(
            "  {bytes:>7} B x {n:>6}: in-memory {:>9.0} frames/s {:>6.2} GB/s | tcp {:>9.0} frames/s {:>6.2} GB/s | bare channel {:>9.0} frames/s ({:.2}x) | 8 channels, 2 threads {:>9.0} frames/s ({:.2}x) | memcpy {:>6.2} GB/s ({:.2}x)",
            rate(mem),
            bw(mem),
            rate(tcp),
            bw(tcp),
            rate(chan),
            vs_chan,
            rate(chans),
            vs_chans,
            bw(copy),
            vs_copy,
        );
    }
}
