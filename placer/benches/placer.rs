//! Benchmarks of meshwork-placer: TF-style placement of synthetic graphs (the
//! `place_bench` example runs the 100k/1M-node cases with nodes per second), device-name
//! parsing and cost-aware placement.
//!
//! `cargo bench -p meshwork-placer` (or `cargo xtask bench`).

#![allow(missing_docs)]

use divan::Bencher;
use divan::counter::ItemsCount;
use meshwork_placer::{
    ArgKind, DeviceName, DeviceSet, Graph, Node, OpDef, PlacerOptions, Registry, TableCostModel,
    place, place_with_cost,
};

fn main() {
    divan::main();
}

fn registry() -> Registry {
    use ArgKind::{Resource, Value};
    let mut r = Registry::new();
    r.insert("Const", OpDef::new(&[], &[Value], &["CPU"]))
        .insert("Add", OpDef::new(&[Value, Value], &[Value], &["CPU"]))
        .insert("Var", OpDef::new(&[], &[Resource], &["CPU"]))
        .insert("Read", OpDef::new(&[Resource], &[Value], &["CPU"]));
    r
}

/// `n` nodes: Const/Add chains and Var→Read pairs, 30% with a device request, 10%
/// colocated with an earlier node.
fn graph(n: usize) -> Graph {
    let mut g = Graph::new();
    let mut state = 0x2545F4914F6CDD1Du64;
    let mut next = |k: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % k as u64) as usize
    };
    let mut last = None;
    for i in 0..n {
        let name = format!("n{i}");
        let request = if next(10) < 3 { format!("/device:CPU:{}", next(8)) } else { String::new() };
        let coloc = if i > 0 && next(10) == 0 { vec![format!("n{}", next(i))] } else { vec![] };
        let (op, inputs) = match (i % 4, last) {
            (1, Some(v)) => ("Add", vec![v, v]),
            (2, _) => ("Var", vec![]),
            (3, _) if i > 0 && g.node(g.id(&format!("n{}", i - 1)).unwrap()).op == "Var" => {
                ("Read", vec![i - 1])
            }
            _ => ("Const", vec![]),
        };
        g.add_node(Node {
            name: name.clone(),
            op: op.into(),
            requested_device: request,
            assigned_device: None,
            colocation: coloc,
        })
        .unwrap();
        for (k, src) in inputs.into_iter().enumerate() {
            g.add_edge(&format!("n{src}"), 0, &name, k).unwrap();
        }
        if op != "Var" {
            last = Some(i);
        }
    }
    g
}

fn devices() -> DeviceSet {
    let names: Vec<String> =
        (0..8).map(|i| format!("/job:localhost/replica:0/task:0/device:CPU:{i}")).collect();
    DeviceSet::new(&names).unwrap()
}

#[divan::bench(args = [1_000, 10_000, 100_000])]
fn place_graph(bencher: Bencher<'_, '_>, n: usize) {
    let (g, set, r) = (graph(n), devices(), registry());
    let options = PlacerOptions { allow_soft_placement: true, log_device_placement: false };
    bencher.counter(ItemsCount::new(n)).bench(|| place(&g, &set, &r, options).unwrap());
}

#[divan::bench(args = ["/job:worker/replica:0/task:3/device:GPU:7", "/cpu:0", "/job:*/device:XLA_CPU:*"])]
fn parse_device_name(name: &str) -> DeviceName {
    DeviceName::parse(divan::black_box(name)).unwrap()
}

#[divan::bench(args = [1_000, 10_000])]
fn cost_aware(bencher: Bencher<'_, '_>, n: usize) {
    let (g, set, r) = (graph(n), devices(), registry());
    let model = TableCostModel::default();
    let options = PlacerOptions { allow_soft_placement: true, log_device_placement: false };
    bencher
        .counter(ItemsCount::new(n))
        .bench(|| place_with_cost(&g, &set, &r, options, &model).unwrap());
}
