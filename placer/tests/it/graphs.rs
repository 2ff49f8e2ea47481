//! Layered and random DAGs with costs, for the cost-aware placement tests and the
//! `cost_placement` example.

#![allow(dead_code)]

use meshwork_placer::{
    ArgKind::Value, DeviceSet, Graph, Node, OpCost, OpDef, Registry, TableCostModel,
};

pub(crate) fn registry() -> Registry {
    let mut r = Registry::new();
    for (name, inputs) in [("Input", 0), ("MatMul", 1), ("Attention", 1)] {
        r.insert(name, OpDef::new(&vec![Value; inputs], &[Value], &["GPU", "CPU"]));
    }
    for k in 1..=4 {
        r.insert(&format!("Concat{k}"), OpDef::new(&vec![Value; k], &[Value], &["GPU", "CPU"]));
    }
    r
}

pub(crate) fn gpus(n: usize) -> DeviceSet {
    let names: Vec<String> =
        (0..n).map(|i| format!("/job:w/replica:0/task:0/device:GPU:{i}")).collect();
    DeviceSet::new(&names).unwrap()
}

pub(crate) fn model() -> TableCostModel {
    let mut m = TableCostModel::default();
    m.ops
        .insert("MatMul".into(), OpCost { compute: 4e-3, memory: 64 << 20, output_bytes: 4 << 20 });
    m.ops.insert(
        "Attention".into(),
        OpCost { compute: 6e-3, memory: 16 << 20, output_bytes: 4 << 20 },
    );
    for k in 1..=4 {
        m.ops.insert(
            format!("Concat{k}"),
            OpCost { compute: 2e-4, memory: 0, output_bytes: 16 << 20 },
        );
    }
    m
}

/// One transformer block with `heads` attention heads (QKV matmul → attention → output
/// projection per head), a concat, then a two-layer MLP.
pub(crate) fn transformer_block(heads: usize) -> Graph {
    let mut g = Graph::new();
    g.add_node(Node::new("x", "Input")).unwrap();
    let mut outs = Vec::new();
    for h in 0..heads {
        for (name, op, src) in [
            ("qkv", "MatMul", "x".to_owned()),
            ("attn", "Attention", format!("qkv{h}")),
            ("proj", "MatMul", format!("attn{h}")),
        ] {
            g.add_node(Node::new(&format!("{name}{h}"), op)).unwrap();
            g.add_edge(&src, 0, &format!("{name}{h}"), 0).unwrap();
        }
        outs.push(format!("proj{h}"));
    }
    g.add_node(Node::new("concat", &format!("Concat{heads}"))).unwrap();
    for (k, o) in outs.iter().enumerate() {
        g.add_edge(o, 0, "concat", k).unwrap();
    }
    for (name, src) in [("mlp1", "concat"), ("mlp2", "mlp1")] {
        g.add_node(Node::new(name, "MatMul")).unwrap();
        g.add_edge(src, 0, name, 0).unwrap();
    }
    g
}

/// An MLP of `layers` layers, each split column-wise into 4 shards whose outputs are
/// concatenated (tensor parallelism, unrolled).
pub(crate) fn sharded_mlp(layers: usize) -> Graph {
    let mut g = Graph::new();
    g.add_node(Node::new("x", "Input")).unwrap();
    let mut prev = "x".to_owned();
    for l in 0..layers {
        let cat = format!("cat{l}");
        g.add_node(Node::new(&cat, "Concat4")).unwrap();
        for s in 0..4 {
            let name = format!("l{l}s{s}");
            g.add_node(Node::new(&name, "MatMul")).unwrap();
            g.add_edge(&prev, 0, &name, 0).unwrap();
            g.add_edge(&name, 0, &cat, s).unwrap();
        }
        prev = cat;
    }
    g
}

/// `layers` layers of 1..=`width` MatMuls, each fed by a random node of the previous
/// layer; a final Concat-free sink chain keeps it connected.
pub(crate) fn random_layered(seed: u64, layers: usize, width: usize) -> Graph {
    let mut next = xorshift(seed);
    let mut g = Graph::new();
    g.add_node(Node::new("x", "Input")).unwrap();
    let mut prev = vec!["x".to_owned()];
    for l in 0..layers {
        let count = 2 + next(width - 1);
        let mut layer = Vec::new();
        for k in 0..count {
            let name = format!("l{l}n{k}");
            g.add_node(Node::new(&name, "MatMul")).unwrap();
            g.add_edge(&prev[next(prev.len())], 0, &name, 0).unwrap();
            layer.push(name);
        }
        prev = layer;
    }
    g
}

/// A small deterministic generator: each call gives a number in `0..n` (xorshift64).
pub(crate) fn xorshift(seed: u64) -> impl FnMut(usize) -> usize {
    let mut state = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    move |n: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % n as u64) as usize
    }
}
