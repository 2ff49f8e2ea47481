//! Shard, assemble and reshard 256 MiB of f32 over 8 devices (a 2×4 mesh), each
//! figure printed beside a plain memcpy of the same bytes measured in the same run.
//!
//! `cargo run --release -p meshwork-sharding --example shard_bench [-- RUNS [MIB]]`
//! (defaults: 9 runs, 256 MiB). Prints medians and the ratio to memcpy.

#![allow(clippy::print_stdout, missing_docs)]

use std::time::{Duration, Instant};

use meshwork_sharding::{
    Mesh, Mode, NamedSharding, ReshardPlan, Sharding, assemble_into, shard_into,
};
use ndarray::{ArrayD, IxDyn};

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

fn time(runs: usize, mut f: impl FnMut()) -> Duration {
    f(); // warm up: fault in every page once
    median(
        (0..runs)
            .map(|_| {
                let start = Instant::now();
                f();
                start.elapsed()
            })
            .collect(),
    )
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn sharding(mesh: &Mesh, spec: &str) -> Sharding {
    NamedSharding::new(mesh.clone(), spec.parse().expect("spec"))
        .expect("named")
        .to_sharding(2)
        .expect("lowers")
}

fn buffers(sharding: &Sharding, shape: &[usize]) -> Vec<ArrayD<f32>> {
    sharding
        .index_map(shape, Mode::Strict)
        .expect("divisible")
        .iter()
        .map(|e| {
            ArrayD::from_elem(IxDyn(&e.ranges.iter().map(|r| r.len()).collect::<Vec<_>>()), 0.0)
        })
        .collect()
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let runs = args.first().copied().unwrap_or(9).max(7);
    let mib = args.get(1).copied().unwrap_or(256);
    let elements = mib * (1 << 20) / 4;
    let side = (elements as f64).sqrt() as usize / 8 * 8;
    let shape = [side, elements / side / 8 * 8];
    let bytes = shape[0] * shape[1] * 4;
    let global = ArrayD::from_shape_fn(IxDyn(&shape), |i| (i[0] * shape[1] + i[1]) as f32);
    let mesh = Mesh::iota(&[("a", 2), ("b", 4)]).expect("mesh");
    println!(
        "shard_bench: f32{shape:?} = {:.0} MiB over 8 devices, mesh 2x4, median of {runs} runs",
        bytes as f64 / (1 << 20) as f64
    );

    // The anchor: one memcpy of the same bytes into a warm buffer.
    let src = global.as_slice().expect("contiguous");
    let mut copy = vec![0.0f32; src.len()];
    let memcpy = time(runs, || {
        std::hint::black_box(&mut copy[..]).copy_from_slice(std::hint::black_box(src))
    });
    println!(
        "  memcpy {:>37.1} ms  ({:.1} GB/s)",
        ms(memcpy),
        bytes as f64 / memcpy.as_secs_f64() / 1e9
    );

    for spec in ["P('a','b')", "P(('a','b'), None)"] {
        let s = sharding(&mesh, spec);
        let mut shards = buffers(&s, &shape);
        let t = time(runs, || {
            let mut views: Vec<_> = shards.iter_mut().map(|b| b.view_mut()).collect();
            shard_into(&global.view(), &s, Mode::Strict, &mut views).expect("shards");
        });
        println!("  shard_into    {spec:<20} {:>8.1} ms  {:.2}x memcpy", ms(t), ratio(t, memcpy));
        let mut out = ArrayD::from_elem(IxDyn(&shape), 0.0f32);
        let t = time(runs, || {
            let views: Vec<_> = shards.iter().map(|b| b.view()).collect();
            assemble_into(&views, &s, Mode::Strict, &mut out.view_mut()).expect("assembles");
        });
        assert_eq!(out, global, "assemble(shard(x)) == x");
        println!("  assemble_into {spec:<20} {:>8.1} ms  {:.2}x memcpy", ms(t), ratio(t, memcpy));
    }

    let from = sharding(&mesh, "P('a','b')");
    let to = sharding(&mesh, "P('b','a')");
    let plan = ReshardPlan::new(&from, &to, &shape, Mode::Strict).expect("plan");
    let moved = plan.bytes_moved(4);
    let mut src_shards = buffers(&from, &shape);
    {
        let mut views: Vec<_> = src_shards.iter_mut().map(|b| b.view_mut()).collect();
        shard_into(&global.view(), &from, Mode::Strict, &mut views).expect("shards");
    }
    let mut dst_shards = buffers(&to, &shape);
    let t = time(runs, || {
        let src: Vec<_> = src_shards.iter().map(|b| b.view()).collect();
        let mut dst: Vec<_> = dst_shards.iter_mut().map(|b| b.view_mut()).collect();
        plan.apply_into(&src, &mut dst).expect("applies");
    });
    // The anchor for a reshard: memcpy of the bytes it moves between devices.
    let moved_elems = moved / 4;
    let anchor = time(runs, || copy[..moved_elems].copy_from_slice(&src[..moved_elems]));
    println!(
        "  reshard P('a','b') -> P('b','a')  {:>8.1} ms  moves {:.0} of {:.0} MiB; memcpy of those bytes {:.1} ms: {:.2}x",
        ms(t),
        moved as f64 / (1 << 20) as f64,
        bytes as f64 / (1 << 20) as f64,
        ms(anchor),
        ratio(t, anchor)
    );
}

fn ratio(a: Duration, b: Duration) -> f64 {
    a.as_secs_f64() / b.as_secs_f64()
}
