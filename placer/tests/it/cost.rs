//! Cost-aware placement: it keeps every constraint and memory cap, is never estimated
//! slower than TF's choice, and is faster on layered and random DAGs with parallelism.

use meshwork_placer::{
    ArgKind::Value, DeviceSet, Error, Graph, Node, OpCost, OpDef, PlacerOptions, Registry,
    TableCostModel, place_with_cost,
};
use proptest::prelude::*;

fn registry() -> Registry {
    let mut r = Registry::new();
    for (name, inputs) in [("Input", 0), ("MatMul", 1), ("Attention", 1)] {
        r.insert(name, OpDef::new(&vec![Value; inputs], &[Value], &["GPU", "CPU"]));
    }
    for k in 1..=4 {
        r.insert(&format!("Concat{k}"), OpDef::new(&vec![Value; k], &[Value], &["GPU", "CPU"]));
    }
    r
}

fn gpus(n: usize) -> DeviceSet {
    let names: Vec<String> =
        (0..n).map(|i| format!("/job:w/replica:0/task:0/device:GPU:{i}")).collect();
    DeviceSet::new(&names).unwrap()
}

fn model() -> TableCostModel {
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
fn transformer_block(heads: usize) -> Graph {
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
fn sharded_mlp(layers: usize) -> Graph {
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

#[test]
fn layered_dags_get_faster_than_tfs_choice() {
    for (graph, what) in
        [(transformer_block(4), "transformer block"), (sharded_mlp(3), "sharded MLP")]
    {
        let result =
            place_with_cost(&graph, &gpus(4), &registry(), PlacerOptions::default(), &model())
                .unwrap();
        let tf = result.tf_makespan.unwrap();
        assert!(result.makespan < 0.6 * tf, "{what}: {} vs TF {tf}", result.makespan);
        let used: std::collections::BTreeSet<usize> = result.devices.iter().copied().collect();
        assert!(used.len() > 1, "{what} stays on one device");
    }
}

#[test]
fn memory_caps_hold_or_fail_loudly() {
    let graph = transformer_block(4);
    let mut m = model();
    // Every device fits a little over one head's weights (3 × 64 + 16 MiB).
    m.default_capacity = 220 << 20;
    let err =
        place_with_cost(&graph, &gpus(2), &registry(), PlacerOptions::default(), &m).unwrap_err();
    assert!(matches!(err, Error::MemoryCapExceeded { .. }), "{err}");
    m.default_capacity = 500 << 20;
    let result =
        place_with_cost(&graph, &gpus(4), &registry(), PlacerOptions::default(), &m).unwrap();
    assert!(result.memory.iter().all(|&b| b <= 500 << 20), "{:?}", result.memory);
    // TF's choice (all on GPU:0) would need 4 × 208 + 2 × 64 MiB there.
    assert_eq!(result.tf_makespan, None);
}

#[test]
fn random_layered_dags_mostly_get_faster() {
    let mut faster = 0;
    let total = 40;
    for seed in 0..total {
        let graph = random_layered(seed, 6, 4);
        let r = place_with_cost(&graph, &gpus(4), &registry(), PlacerOptions::default(), &model())
            .unwrap();
        let tf = r.tf_makespan.unwrap();
        assert!(r.makespan <= tf, "seed {seed}: {} > {tf}", r.makespan);
        if r.makespan < tf {
            faster += 1;
        }
    }
    assert!(faster * 10 >= total * 9, "only {faster} of {total} got faster");
}

/// `layers` layers of 1..=`width` MatMuls, each fed by a random node of the previous
/// layer; a final Concat-free sink chain keeps it connected.
fn random_layered(seed: u64, layers: usize, width: usize) -> Graph {
    let mut state = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    let mut next = |n: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % n as u64) as usize
    };
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

fn arbitrary_model() -> impl Strategy<Value = TableCostModel> {
    (1u64..50, 1u64..50, 1u64..64, 1e6f64..1e11, 0u64..2, 100u64..2000).prop_map(
        |(mm, att, bytes, bw, tight, cap)| {
            let mut m = model();
            m.ops.get_mut("MatMul").unwrap().compute = mm as f64 * 1e-4;
            m.ops.get_mut("Attention").unwrap().compute = att as f64 * 1e-4;
            m.default_op.output_bytes = bytes << 20;
            m.bandwidth = bw;
            if tight == 1 {
                m.default_capacity = cap << 20;
            }
            m
        },
    )
}

proptest! {
    /// Whatever the costs: every node is on a device its group was allowed, each group
    /// on one device, every device within its memory, never estimated slower than a
    /// TF choice that fits.
    #[test]
    fn prop_cost_placement_keeps_constraints_and_caps(seed in 0u64..1000, heads in 1usize..5, model in arbitrary_model(), devices in 1usize..5) {
        let graph = if seed % 2 == 0 { random_layered(seed, 4, 4) } else { transformer_block(heads) };
        let set = gpus(devices);
        let tf = meshwork_placer::place(&graph, &set, &registry(), PlacerOptions::default()).unwrap();
        match place_with_cost(&graph, &set, &registry(), PlacerOptions::default(), &model) {
            Ok(r) => {
                for (id, _) in graph.nodes() {
                    prop_assert!(tf.allowed(id).contains(&(r.devices[id.index()] as u32)));
                }
                for i in 0..graph.len() {
                    for j in 0..graph.len() {
                        if tf.groups()[i] == tf.groups()[j] {
                            prop_assert_eq!(r.devices[i], r.devices[j]);
                        }
                    }
                }
                let mut used = vec![0u64; set.devices().len()];
                for (id, n) in graph.nodes() {
                    used[r.devices[id.index()]] += model.ops.get(&n.op).unwrap_or(&model.default_op).memory;
                }
                prop_assert_eq!(&used, &r.memory);
                prop_assert!(used.iter().all(|&b| b <= model.default_capacity));
                if let Some(t) = r.tf_makespan {
                    prop_assert!(r.makespan <= t);
                }
            }
            Err(Error::MemoryCapExceeded { .. }) => {}
            Err(e) => prop_assert!(false, "{e}"),
        }
    }
}
