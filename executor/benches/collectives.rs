//! Benchmarks of meshwork-executor: collectives across 8 devices at 4 KiB (latency)
//! and 4 MiB per replica (the `collectives_bench` example runs 8 and 64 MiB beside the
//! memory-traffic bound).
//!
//! `cargo bench -p meshwork-executor` (or `cargo xtask bench`).

#![allow(missing_docs)]

use std::sync::{Arc, LazyLock};

use divan::Bencher;
use divan::counter::BytesCount;
use meshwork_executor::{ReplicaFn, Runtime, Tensor};
use meshwork_types::ReduceOp;
use ndarray::{ArrayD, IxDyn};

const DEVICES: usize = 8;
static RUNTIME: LazyLock<Runtime> = LazyLock::new(|| Runtime::new(DEVICES).expect("devices"));

fn main() {
    divan::main();
}

fn bench(bencher: Bencher<'_, '_>, bytes: usize, program: Arc<ReplicaFn>) {
    let inputs: Vec<Vec<Tensor>> = (0..DEVICES)
        .map(|r| vec![Tensor::F32(ArrayD::from_elem(IxDyn(&[bytes / 4]), r as f32))])
        .collect();
    bencher
        .counter(BytesCount::new(bytes * DEVICES))
        .with_inputs(|| inputs.clone())
        .bench_local_values(|ins| RUNTIME.run(program.clone(), ins).expect("runs"));
}

#[divan::bench(args = [4 << 10, 4 << 20])]
fn all_reduce(bencher: Bencher<'_, '_>, bytes: usize) {
    bench(
        bencher,
        bytes,
        Arc::new(|ctx, i| Ok(vec![ctx.all_reduce(ReduceOp::Sum, i[0].clone())?])),
    );
}

#[divan::bench(args = [4 << 10, 4 << 20])]
fn all_gather(bencher: Bencher<'_, '_>, bytes: usize) {
    bench(bencher, bytes, Arc::new(|ctx, i| Ok(vec![ctx.all_gather(0, i[0].clone())?])));
}

#[divan::bench(args = [4 << 10, 4 << 20])]
fn reduce_scatter(bencher: Bencher<'_, '_>, bytes: usize) {
    bench(
        bencher,
        bytes,
        Arc::new(|ctx, i| Ok(vec![ctx.reduce_scatter(ReduceOp::Sum, 0, i[0].clone())?])),
    );
}

#[divan::bench(args = [4 << 10, 4 << 20])]
fn all_to_all(bencher: Bencher<'_, '_>, bytes: usize) {
    bench(bencher, bytes, Arc::new(|ctx, i| Ok(vec![ctx.all_to_all(0, 0, i[0].clone())?])));
}

#[divan::bench]
fn barrier(bencher: Bencher<'_, '_>) {
    let program: Arc<ReplicaFn> =
        Arc::new(|ctx, _| ctx.barrier().map(|()| vec![]).map_err(Into::into));
    bencher.bench_local(|| RUNTIME.run(program.clone(), vec![vec![]; DEVICES]).expect("runs"));
}
