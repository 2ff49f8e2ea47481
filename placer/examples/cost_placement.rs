//! Cost-aware placement against TF's choice, under one cost model, on 4 GPUs: a
//! transformer block with 4 heads, an MLP with 4-way sharded layers, and random layered
//! DAGs. Prints both estimated makespans and their ratio.
//!
//! `cargo run --release -p meshwork-placer --example cost_placement`

#![allow(clippy::print_stdout, missing_docs)]

#[path = "../tests/it/graphs.rs"]
mod graphs;

use graphs::{gpus, model, random_layered, registry, sharded_mlp, transformer_block};
use meshwork_placer::{PlacerOptions, place_with_cost};

fn main() {
    let (set, ops, costs) = (gpus(4), registry(), model());
    let mut cases: Vec<(String, meshwork_placer::Graph)> = vec![
        ("transformer block, 4 heads".into(), transformer_block(4)),
        ("MLP, 3 layers x 4 shards".into(), sharded_mlp(3)),
    ];
    cases.extend(
        (0..5).map(|seed| (format!("random layered DAG, seed {seed}"), random_layered(seed, 6, 4))),
    );
    for (name, graph) in cases {
        let r =
            place_with_cost(&graph, &set, &ops, PlacerOptions::default(), &costs).expect("places");
        let tf = r.tf_makespan.expect("TF's choice fits");
        let used = r.devices.iter().collect::<std::collections::BTreeSet<_>>().len();
        println!(
            "{name:<32} {:>3} nodes: cost-aware {:>7.2} ms on {used} device(s), TF's choice {:>7.2} ms: {:.2}x",
            graph.len(),
            r.makespan * 1e3,
            tf * 1e3,
            r.makespan / tf
        );
    }
}
