//! Places TF-style graphs of 100k and 1M nodes on 8 CPU devices and prints the time and
//! nodes per second (median of 7 runs), beside the time to clone the graph — a pass
//! that touches every node once, measured in the same run.
//!
//! The graph (as in the TF measurement it is compared with): chains of
//! Const → AddV2 → Identity plus VarHandleOp → ReadVariableOp pairs, 30% of nodes
//! requesting `/device:CPU:k`, one node in ten colocated (`loc:@`) with an earlier node,
//! soft placement on.
//!
//! `cargo run --release -p meshwork-placer --example place_bench [-- NODES...]`

#![allow(clippy::print_stdout, missing_docs)]

use std::time::{Duration, Instant};

use meshwork_placer::{ArgKind, DeviceSet, Graph, Node, OpDef, PlacerOptions, Registry, place};

struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 33) as usize) % n
    }
}

fn registry() -> Registry {
    use ArgKind::{Resource, Value};
    let cpu = ["CPU"];
    let mut r = Registry::new();
    r.insert("Const", OpDef::new(&[], &[Value], &cpu))
        .insert("AddV2", OpDef::new(&[Value, Value], &[Value], &cpu))
        .insert("Identity", OpDef { is_identity: true, ..OpDef::new(&[Value], &[Value], &cpu) })
        .insert("VarHandleOp", OpDef::new(&[], &[Resource], &cpu))
        .insert("ReadVariableOp", OpDef::new(&[Resource], &[Value], &cpu));
    r
}

/// A graph of `n` nodes in the shape described above.
fn build(n: usize) -> Graph {
    let mut rng = Lcg(20240601);
    let mut g = Graph::new();
    let mut names: Vec<String> = Vec::with_capacity(n);
    let mut last_value: Option<usize> = None;
    while names.len() < n {
        let i = names.len();
        let name = format!("n{i}");
        let request =
            if rng.below(10) < 3 { format!("/device:CPU:{}", rng.below(8)) } else { String::new() };
        let colocation: Vec<String> = if i > 0 && rng.below(10) == 0 {
            vec![names[rng.below(i)].clone()]
        } else {
            Vec::new()
        };
        let kind = rng.below(5);
        let (op, inputs): (&str, Vec<usize>) = match (kind, last_value) {
            (0, _) | (_, None) => ("Const", vec![]),
            (1, Some(v)) => ("AddV2", vec![v, rng.below(i)]),
            (2, Some(v)) => ("Identity", vec![v]),
            (3, _) => ("VarHandleOp", vec![]),
            _ => ("Const", vec![]),
        };
        let op = if op == "AddV2" && !is_value(&g, inputs[1]) { "Identity" } else { op };
        let inputs = if op == "Identity" { vec![inputs[0]] } else { inputs };
        g.add_node(Node {
            name: name.clone(),
            op: op.into(),
            requested_device: request,
            assigned_device: None,
            colocation,
        })
        .unwrap();
        for (k, &src) in inputs.iter().enumerate() {
            g.add_edge(&names[src], 0, &name, k).unwrap();
        }
        names.push(name.clone());
        if op == "VarHandleOp" && names.len() < n {
            let read = format!("n{}", names.len());
            let request = if rng.below(10) < 3 {
                format!("/device:CPU:{}", rng.below(8))
            } else {
                String::new()
            };
            let colocation: Vec<String> = if rng.below(10) == 0 {
                vec![names[rng.below(names.len())].clone()]
            } else {
                Vec::new()
            };
            let node = Node {
                name: read.clone(),
                op: "ReadVariableOp".into(),
                requested_device: request,
                assigned_device: None,
                colocation,
            };
            g.add_node(node).unwrap();
            g.add_edge(&name, 0, &read, 0).unwrap();
            names.push(read);
            last_value = Some(names.len() - 1);
        } else if op != "VarHandleOp" {
            last_value = Some(i);
        }
    }
    g
}

fn is_value(g: &Graph, i: usize) -> bool {
    g.node(g.id(&format!("n{i}")).unwrap()).op != "VarHandleOp"
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let sizes: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let sizes = if sizes.is_empty() { vec![100_000, 1_000_000] } else { sizes };
    let devices: Vec<String> =
        (0..8).map(|i| format!("/job:localhost/replica:0/task:0/device:CPU:{i}")).collect();
    let set = DeviceSet::new(&devices).unwrap();
    let registry = registry();
    let options = PlacerOptions { allow_soft_placement: true, log_device_placement: false };
    for n in sizes {
        let graph = build(n);
        let requests = graph.nodes().filter(|(_, n)| !n.requested_device.is_empty()).count();
        let groups = graph.nodes().filter(|(_, n)| !n.colocation.is_empty()).count();
        let runs = 7;
        let place_time = median(
            (0..runs)
                .map(|_| {
                    let start = Instant::now();
                    let p = place(&graph, &set, &registry, options).expect("places");
                    let t = start.elapsed();
                    std::hint::black_box(p);
                    t
                })
                .collect(),
        );
        let clone_time = median(
            (0..runs)
                .map(|_| {
                    let start = Instant::now();
                    let c = graph.clone();
                    let t = start.elapsed();
                    std::hint::black_box(c);
                    t
                })
                .collect(),
        );
        println!(
            "place_bench: {n} nodes ({requests} requests, {groups} loc:@ attributes) on 8 devices: place {:.1} ms = {:.2} M nodes/s; graph clone {:.1} ms ({:.2}x)",
            place_time.as_secs_f64() * 1e3,
            n as f64 / place_time.as_secs_f64() / 1e6,
            clone_time.as_secs_f64() * 1e3,
            place_time.as_secs_f64() / clone_time.as_secs_f64(),
        );
    }
}
