//! Benchmarks of meshwork-sharding: data movement over a 2×4 mesh (16 MiB of f32; the
//! `shard_bench` example runs the 256 MiB case beside a memcpy), and the text and
//! lowering paths.
//!
//! `cargo bench -p meshwork-sharding` (or `cargo xtask bench`).

#![allow(missing_docs)]

use divan::Bencher;
use divan::counter::BytesCount;
use meshwork_sharding::{
    HloSharding, Mesh, Mode, NamedSharding, ReshardPlan, Sharding, assemble_into, shard_into,
};
use ndarray::{ArrayD, IxDyn};

const SHAPE: [usize; 2] = [2048, 2048];
const SPECS: [&str; 3] = ["P('a','b')", "P(('a','b'), None)", "P()"];

fn main() {
    divan::main();
}

fn sharding(spec: &str) -> Sharding {
    let mesh = Mesh::iota(&[("a", 2), ("b", 4)]).expect("mesh");
    NamedSharding::new(mesh, spec.parse().expect("spec"))
        .expect("named")
        .to_sharding(2)
        .expect("lowers")
}

fn global() -> ArrayD<f32> {
    ArrayD::from_shape_fn(IxDyn(&SHAPE), |i| (i[0] * SHAPE[1] + i[1]) as f32)
}

fn buffers(s: &Sharding) -> Vec<ArrayD<f32>> {
    s.index_map(&SHAPE, Mode::Strict)
        .expect("divisible")
        .iter()
        .map(|e| {
            ArrayD::from_elem(IxDyn(&e.ranges.iter().map(|r| r.len()).collect::<Vec<_>>()), 0.0)
        })
        .collect()
}

fn bytes(buffers: &[ArrayD<f32>]) -> BytesCount {
    BytesCount::new(buffers.iter().map(|b| b.len() * 4).sum::<usize>())
}

#[divan::bench(args = SPECS)]
fn shard(bencher: Bencher<'_, '_>, spec: &str) {
    let s = sharding(spec);
    let x = global();
    let mut out = buffers(&s);
    bencher.counter(bytes(&out)).bench_local(|| {
        let mut views: Vec<_> = out.iter_mut().map(|b| b.view_mut()).collect();
        shard_into(&x.view(), &s, Mode::Strict, &mut views).expect("shards");
    });
}

#[divan::bench(args = SPECS)]
fn assemble(bencher: Bencher<'_, '_>, spec: &str) {
    let s = sharding(spec);
    let x = global();
    let mut shards = buffers(&s);
    let mut views: Vec<_> = shards.iter_mut().map(|b| b.view_mut()).collect();
    shard_into(&x.view(), &s, Mode::Strict, &mut views).expect("shards");
    let mut out = ArrayD::from_elem(IxDyn(&SHAPE), 0.0f32);
    bencher.counter(BytesCount::new(x.len() * 4)).bench_local(|| {
        let views: Vec<_> = shards.iter().map(|b| b.view()).collect();
        assemble_into(&views, &s, Mode::Strict, &mut out.view_mut()).expect("assembles");
    });
}

#[divan::bench]
fn reshard_ab_to_ba(bencher: Bencher<'_, '_>) {
    let (from, to) = (sharding("P('a','b')"), sharding("P('b','a')"));
    let x = global();
    let mut src = buffers(&from);
    let mut views: Vec<_> = src.iter_mut().map(|b| b.view_mut()).collect();
    shard_into(&x.view(), &from, Mode::Strict, &mut views).expect("shards");
    let plan = ReshardPlan::new(&from, &to, &SHAPE, Mode::Strict).expect("plan");
    let mut dst = buffers(&to);
    bencher.counter(BytesCount::new(plan.bytes_moved(4))).bench_local(|| {
        let src: Vec<_> = src.iter().map(|b| b.view()).collect();
        let mut out: Vec<_> = dst.iter_mut().map(|b| b.view_mut()).collect();
        plan.apply_into(&src, &mut out).expect("applies");
    });
}

#[divan::bench]
fn reshard_plan(bencher: Bencher<'_, '_>) {
    let (from, to) = (sharding("P('a','b')"), sharding("P('b','a')"));
    bencher.bench(|| ReshardPlan::new(&from, &to, &SHAPE, Mode::Strict).expect("plan"));
}

#[divan::bench(args = [
    "{devices=[2,4]<=[8]}",
    "{devices=[4,2,2]<=[2,2,4]T(2,1,0) last_tile_dims={unreduced, replicated}}",
    "{devices=[2,2,4]9,13,3,8,15,12,14,11,10,0,7,2,1,4,5,6 last_tile_dim_replicate}",
])]
fn parse_and_print(text: &str) -> String {
    divan::black_box(text).parse::<HloSharding>().expect("parses").to_string()
}

#[divan::bench]
fn lower_named_sharding(bencher: Bencher<'_, '_>) {
    let mesh = Mesh::iota(&[("a", 2), ("b", 2), ("c", 4)]).expect("mesh");
    let named = NamedSharding::new(mesh, "P(('c','a'), None, unreduced={})".parse().expect("spec"))
        .expect("named");
    bencher.bench(|| named.to_hlo(3).expect("lowers"));
}
