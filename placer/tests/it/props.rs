//! Properties of the placer over random graphs: hard constraints hold, colocated nodes
//! share a device, the device listing order does not matter, device names roundtrip.

use meshwork_placer::{
    ArgKind::{Ref, Resource, Value},
    DeviceName, DeviceSet, Edge, Graph, Kernel, Node, OpDef, Placement, PlacerOptions, Registry,
    place,
};
use proptest::prelude::*;

fn op(
    inputs: &[meshwork_placer::ArgKind],
    outputs: &[meshwork_placer::ArgKind],
    kernels: &[(&str, i32)],
) -> OpDef {
    OpDef {
        inputs: inputs.to_vec(),
        outputs: outputs.to_vec(),
        kernels: kernels
            .iter()
            .map(|(t, p)| Kernel { device_type: (*t).into(), priority: *p })
            .collect(),
        ..OpDef::default()
    }
}

const OPS: [&str; 13] = [
    "Const", "Var", "RefVar", "Read", "Assign", "Add", "CpuOnly", "GpuOnly", "Id", "Shape", "IdN",
    "DS", "It",
];

fn registry() -> Registry {
    let all = [("CPU", 0), ("GPU", 0), ("XLA_CPU", 0)];
    let both = [("CPU", 0), ("GPU", 0)];
    let mut r = Registry::new();
    r.insert("Const", op(&[], &[Value], &all))
        .insert("Var", op(&[], &[Resource], &both))
        .insert("RefVar", op(&[], &[Ref], &[("CPU", 0)]))
        .insert("Read", op(&[Resource], &[Value], &both))
        .insert("Assign", op(&[Ref, Value], &[], &both))
        .insert("Add", op(&[Value, Value], &[Value], &all))
        .insert("CpuOnly", op(&[Value], &[Value], &[("CPU", 0)]))
        .insert("GpuOnly", op(&[Value], &[Value], &[("GPU", 0)]))
        .insert("Id", OpDef { is_identity: true, ..op(&[Value], &[Value], &both) })
        .insert("Shape", OpDef { is_metadata: true, ..op(&[Value], &[Value], &both) })
        .insert(
            "IdN",
            OpDef { input_colocation_exempt: true, ..op(&[Resource], &[Resource], &both) },
        )
        .insert("DS", op(&[], &[Resource], &[("CPU", 2), ("GPU", 1)]))
        .insert("It", op(&[Resource], &[Value], &[("CPU", 1), ("GPU", 2)]));
    r
}

const REQUESTS: [&str; 10] = [
    "",
    "/device:CPU:0",
    "/device:CPU:1",
    "/device:GPU:0",
    "/gpu:1",
    "/job:localhost",
    "/job:localhost/device:CPU:*",
    "/device:XLA_CPU:0",
    "/task:1",
    "/cpu:7",
];

/// A random graph description: per node (op, request, inputs as earlier-node picks,
/// colocation picks), plus the device counts.
#[derive(Debug, Clone)]
struct Case {
    nodes: Vec<(usize, usize, Vec<usize>, Vec<usize>)>,
    cpus: usize,
    gpus: usize,
    xla: bool,
    soft: bool,
}

fn case() -> impl Strategy<Value = Case> {
    let node = (
        0..OPS.len(),
        prop_oneof![3 => Just(0usize), 2 => 1..REQUESTS.len()],
        proptest::collection::vec(any::<usize>(), 2),
        proptest::collection::vec(any::<usize>(), 0..2),
    );
    (
        proptest::collection::vec(node, 1..24),
        1..4usize,
        0..3usize,
        any::<bool>(),
        prop_oneof![3 => Just(true), 1 => Just(false)],
    )
        .prop_map(|(nodes, cpus, gpus, xla, soft)| Case { nodes, cpus, gpus, xla, soft })
}

fn devices(case: &Case) -> Vec<String> {
    let mut names: Vec<String> =
        (0..case.cpus).map(|i| format!("/job:localhost/replica:0/task:0/device:CPU:{i}")).collect();
    names.extend((0..case.gpus).map(|i| format!("/job:localhost/replica:0/task:0/device:GPU:{i}")));
    if case.xla {
        names.push("/job:localhost/replica:0/task:0/device:XLA_CPU:0".into());
    }
    names
}

/// Builds the graph: each input of a node's op is fed by an earlier node (picked
/// deterministically from the case) whose first output has the right kind; a node with
/// no such earlier node becomes a `Const`.
fn build(case: &Case, registry: &Registry) -> Graph {
    use meshwork_placer::OpRegistry;
    let mut g = Graph::new();
    let mut ops: Vec<&str> = Vec::new();
    let mut edges = Vec::new();
    for (i, (op_index, request, picks, colocation)) in case.nodes.iter().enumerate() {
        let mut op = OPS[*op_index];
        let def = registry.op(op).unwrap();
        let mut inputs = Vec::new();
        for (k, kind) in def.inputs.iter().enumerate() {
            let fits: Vec<usize> = (0..i)
                .filter(|&j| registry.op(ops[j]).unwrap().outputs.first() == Some(kind))
                .collect();
            if fits.is_empty() {
                op = "Const";
                inputs.clear();
                break;
            }
            inputs.push(fits[picks[k % picks.len()] % fits.len()]);
        }
        let coloc: Vec<String> = colocation
            .iter()
            .map(|&c| {
                if i > 0 && c % 4 != 0 { format!("n{}", c % i) } else { format!("ghost{}", c % 2) }
            })
            .collect();
        let name = format!("n{i}");
        g.add_node(Node {
            name: name.clone(),
            op: op.into(),
            requested_device: REQUESTS[*request].into(),
            assigned_device: None,
            colocation: coloc,
        })
        .unwrap();
        for (k, src) in inputs.into_iter().enumerate() {
            edges.push((src, name.clone(), k));
        }
        ops.push(op);
    }
    for (src, dst, k) in edges {
        g.add_edge(&format!("n{src}"), 0, &dst, k).unwrap();
    }
    g
}

fn device_name<'a>(set: &'a DeviceSet, p: &Placement, i: usize) -> &'a str {
    set.devices()[p.devices()[i]].name()
}

proptest! {
    /// Whenever placement succeeds: every node sits on a device type it has a kernel for;
    /// ref/resource edges join nodes on one device; without soft placement every
    /// `loc:@` group shares a device and every request of a node outside ref/resource
    /// edges is honoured; nodes of one colocation group share a device.
    #[test]
    fn prop_placements_satisfy_hard_constraints(case in case()) {
        use meshwork_placer::OpRegistry;
        let registry = registry();
        let graph = build(&case, &registry);
        let set = DeviceSet::new(&devices(&case)).unwrap();
        let options = PlacerOptions { allow_soft_placement: case.soft, log_device_placement: false };
        let Ok(p) = place(&graph, &set, &registry, options) else { return Ok(()) };
        let mut on_resource_edge = vec![false; graph.len()];
        for (src, dst, edge) in graph.edges() {
            let Edge::Data { dst_input, .. } = edge else { continue };
            let def = registry.op(&graph.node(dst).op).unwrap();
            if def.inputs[dst_input] != Value && !def.input_colocation_exempt {
                prop_assert_eq!(p.device(src), p.device(dst), "ref/resource edge {} -> {}", graph.node(src).name, graph.node(dst).name);
                on_resource_edge[src.index()] = true;
                on_resource_edge[dst.index()] = true;
            }
        }
        for (id, node) in graph.nodes() {
            let device = &set.devices()[p.device(id)];
            let def = registry.op(&node.op).unwrap();
            prop_assert!(def.kernels.iter().any(|k| k.device_type == device.device_type()), "{} on {}", node.name, device);
            if !case.soft && !on_resource_edge[id.index()] && let Ok(request) = DeviceName::parse(&node.requested_device) {
                prop_assert!(request.matches(device.parsed()), "{} requested {} got {}", node.name, node.requested_device, device);
            }
            if !case.soft {
                for target in &node.colocation {
                    let others = graph.nodes().filter(|(_, m)| &m.name == target || m.colocation.contains(target));
                    for (other, m) in others {
                        prop_assert_eq!(p.device(id), p.device(other), "{} and {} share loc:@{}", node.name, m.name, target);
                    }
                }
            }
        }
        for i in 0..graph.len() {
            for j in 0..graph.len() {
                if p.groups()[i] == p.groups()[j] {
                    prop_assert_eq!(p.devices()[i], p.devices()[j]);
                }
            }
        }
    }

    /// Listing the same devices in another order gives the same placement (by name), or
    /// the same error.
    #[test]
    fn prop_device_order_does_not_matter(case in case(), seed in any::<u64>()) {
        let registry = registry();
        let graph = build(&case, &registry);
        let names = devices(&case);
        let mut shuffled = names.clone();
        let mut state = seed | 1;
        for k in (1..shuffled.len()).rev() {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            shuffled.swap(k, (state % (k as u64 + 1)) as usize);
        }
        let (a, b) = (DeviceSet::new(&names).unwrap(), DeviceSet::new(&shuffled).unwrap());
        let options = PlacerOptions { allow_soft_placement: case.soft, log_device_placement: false };
        match (place(&graph, &a, &registry, options), place(&graph, &b, &registry, options)) {
            (Ok(pa), Ok(pb)) => {
                for i in 0..graph.len() {
                    prop_assert_eq!(device_name(&a, &pa, i), device_name(&b, &pb, i));
                }
            }
            (Err(ea), Err(eb)) => prop_assert_eq!(ea.tf_class(), eb.tf_class()),
            (ra, rb) => prop_assert!(false, "{:?} vs {:?}", ra.err(), rb.err()),
        }
    }

    /// Printing a parsed name and parsing it again is stable.
    #[test]
    fn prop_device_names_parse_print_parse(parts in proptest::collection::vec(proptest::sample::select(vec![
        "/job:", "/replica:", "/task:", "/device:", "/cpu:", "/gpu:", "/GPU:", "CPU", "GPU", "gpu", "xla_cpu",
        "worker", "ps", "*", ":", "0", "1", "12", "/", "_", "a",
    ]), 0..10)) {
        let text: String = parts.concat();
        if let Ok(name) = DeviceName::parse(&text) {
            let printed = name.to_string();
            let again = DeviceName::parse(&printed).expect("printed names parse");
            prop_assert_eq!(again.to_string(), printed.clone());
            // An id without a type is not printed (TF's ParsedNameToString); anything
            // else comes back exactly.
            if name.id.is_none() || name.device_type.is_some() {
                prop_assert_eq!(again, name);
            }
        }
    }
}
