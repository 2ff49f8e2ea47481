//! Cost-aware placement: it keeps every constraint and memory cap, is never estimated
//! slower than TF's choice, and is faster on layered and random DAGs with parallelism.

use meshwork_placer::{Error, PlacerOptions, TableCostModel, place_with_cost};
use proptest::prelude::*;

use crate::graphs::{gpus, model, random_layered, registry, sharded_mlp, transformer_block};

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
