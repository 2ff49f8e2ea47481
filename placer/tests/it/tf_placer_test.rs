//! TensorFlow's `placer_test.cc`, ported case by case (sections B1–B5 and B7 of the test
//! list; the function-call cases of B6 need function bodies, which the placer does not
//! model). Case numbers refer to that list.

use meshwork_placer::{
    ArgKind::{self, Ref, Resource, Value},
    Constraint, DeviceSet, Error, Graph, Kernel, Node, OpDef, Placement, PlacerOptions, Registry,
    place,
};

const CPU: &str = "FakeCPU";
const GPU: &str = "FakeGPU";
const K_CPU: &str = "/device:FakeCPU:0";
const K_GPU: &str = "/device:FakeGPU:0";
const K_FULL_CPU: &str = "/job:a/replica:0/task:0/device:FakeCPU:0";
const K_FULL_GPU: &str = "/job:a/replica:0/task:0/device:FakeGPU:0";

fn op(inputs: &[ArgKind], outputs: &[ArgKind], kernels: &[(&str, i32)]) -> OpDef {
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

/// TF's fake ops and kernels (placer_test.cc L136-219, 524-562, 998-1020, 1942-1956).
fn registry() -> Registry {
    let both = [(CPU, 0), (GPU, 0)];
    let cpu = [(CPU, 0)];
    let gpu = [(GPU, 0)];
    let mut r = Registry::new();
    r.insert("TestVariable", op(&[], &[Ref], &both))
        .insert("VariableCPU", op(&[], &[Ref], &cpu))
        .insert("VariableGPU", op(&[], &[Ref], &gpu))
        .insert("VariableNoKernels", op(&[], &[Ref], &[]))
        .insert("TestAdd", op(&[Value, Value], &[Value], &both))
        .insert("TestRelu", op(&[Value], &[Value], &both))
        .insert("ReluCPU", op(&[Value], &[Value], &cpu))
        .insert("ReluGPU", op(&[Value], &[Value], &gpu))
        .insert("TestAssign", op(&[Ref, Value], &[], &both))
        .insert("AssignCPU", op(&[Ref, Value], &[], &cpu))
        .insert("AssignGPU", op(&[Ref, Value], &[], &gpu))
        .insert("TestInput", op(&[], &[Value, Value], &cpu))
        .insert("TestCPUGPUOutput", op(&[], &[Value], &both))
        .insert("TestGPUOutput", op(&[], &[Value], &gpu))
        .insert("TestDevice", op(&[], &[Value, Value], &gpu))
        .insert("TestDeviceEnforce", op(&[Ref], &[Value], &both))
        .insert("Shape", OpDef { is_metadata: true, ..op(&[Value], &[Value], &both) })
        .insert("TestDatasetOp", op(&[Value], &[Value], &[(CPU, 2), (GPU, 1)]))
        .insert("TestXlaOp", op(&[Value], &[Value], &[("XLA_CPU", 2), (CPU, 1)]))
        .insert("CreateDatasetCPU", op(&[], &[Resource], &cpu))
        .insert("CreateDatasetGPU", op(&[], &[Resource], &gpu))
        .insert("CreateDatasetSP", op(&[], &[Resource], &[(CPU, 2), (GPU, 1)]))
        .insert("CreateDatasetRP", op(&[], &[Resource], &[(CPU, 1), (GPU, 2)]))
        .insert("CreateDatasetNP", op(&[], &[Resource], &both))
        .insert("IteratorNP", op(&[Resource], &[Value], &both))
        .insert("IteratorSP", op(&[Resource], &[Value], &[(CPU, 2), (GPU, 1)]))
        .insert("IteratorRP", op(&[Resource], &[Value], &[(CPU, 1), (GPU, 2)]))
        .insert("IteratorGPU", op(&[Resource], &[Value], &gpu))
        .insert("TestHandleVariable", op(&[], &[Resource], &both))
        .insert("HandleVariableCPU", op(&[], &[Resource], &cpu))
        .insert("HandleVariableGPU", op(&[], &[Resource], &gpu))
        .insert("TestHandleAssign", op(&[Resource, Value], &[], &both))
        .insert("HandleAssignCPU", op(&[Resource, Value], &[], &cpu))
        .insert("HandleAssignGPU", op(&[Resource, Value], &[], &gpu))
        .insert("TestTwoHandlesIn", op(&[Resource, Resource], &[], &both))
        // Real ops the tests use, with the dtypes the tests give them.
        .insert("_ArgResource", op(&[], &[Resource], &both))
        .insert("_Arg", op(&[], &[Value], &both))
        .insert(
            "IdentityResource",
            OpDef { is_identity: true, ..op(&[Resource], &[Resource], &both) },
        )
        .insert("Identity", OpDef { is_identity: true, ..op(&[Value], &[Value], &both) })
        .insert("Cast", op(&[Value], &[Value], &cpu))
        .insert("ConvertToListOfCooTensorsV2", op(&[Value], &[Value], &cpu));
    r
}

/// TF's fixture (L226-247): FakeCPU:0..9 with FakeGPU:9..0 inserted in reverse,
/// interleaved; XLA_CPU:0; COMPOSITE:0. FakeCPU priority 50, FakeGPU 51.
fn devices() -> DeviceSet {
    let mut names = Vec::new();
    for i in 0..10 {
        names.push(format!("/job:a/replica:0/task:0/device:FakeCPU:{i}"));
        names.push(format!("/job:a/replica:0/task:0/device:FakeGPU:{}", 9 - i));
    }
    names.push("/job:a/replica:0/task:0/device:XLA_CPU:0".into());
    names.push("/job:a/replica:0/task:0/device:COMPOSITE:0".into());
    DeviceSet::new(&names).unwrap().with_type_priority(CPU, 50).with_type_priority(GPU, 51)
}

/// A graph built from `(name, op, request, inputs)`; inputs are `"src"` or `"src:k"`
/// (data, in order) or `"^src"` (control).
fn graph(nodes: &[(&str, &str, &str, &[&str])]) -> Graph {
    let mut g = Graph::new();
    for (name, op, request, _) in nodes {
        g.add_node(Node::new(name, op).on(request)).unwrap();
    }
    for (name, _, _, inputs) in nodes {
        let mut k = 0;
        for input in *inputs {
            if let Some(src) = input.strip_prefix('^') {
                g.add_control_edge(src, name).unwrap();
            } else {
                let (src, out) =
                    input.split_once(':').map_or((*input, 0), |(s, o)| (s, o.parse().unwrap()));
                g.add_edge(src, out, name, k).unwrap();
                k += 1;
            }
        }
    }
    g
}

/// Rebuilds `g` with some nodes changed.
fn edit(g: &Graph, f: impl Fn(&mut Node)) -> Graph {
    let mut out = Graph::new();
    for (_, n) in g.nodes() {
        let mut n = n.clone();
        f(&mut n);
        out.add_node(n).unwrap();
    }
    for (s, d, e) in g.edges() {
        match e {
            meshwork_placer::Edge::Data { src_output, dst_input } => {
                out.add_edge(&g.node(s).name, src_output, &g.node(d).name, dst_input).unwrap()
            }
            meshwork_placer::Edge::Control => {
                out.add_control_edge(&g.node(s).name, &g.node(d).name).unwrap()
            }
        }
    }
    out
}

struct Placed {
    graph: Graph,
    set: DeviceSet,
    placement: Placement,
}

impl Placed {
    fn dev(&self, name: &str) -> &str {
        self.set.devices()[self.placement.device(self.graph.id(name).unwrap())].name()
    }
    fn dev_type(&self, name: &str) -> &str {
        self.set.devices()[self.placement.device(self.graph.id(name).unwrap())].device_type()
    }
    fn colocated(&self, a: &str, b: &str) -> bool {
        self.dev(a) == self.dev(b)
    }
}

fn run_with(g: &Graph, set: DeviceSet, soft: bool) -> Result<Placed, Error> {
    let options = PlacerOptions { allow_soft_placement: soft, log_device_placement: true };
    let placement = place(g, &set, &registry(), options)?;
    Ok(Placed { graph: g.clone(), set, placement })
}

/// TF's `Place(&g)`: soft placement on.
fn run(g: &Graph) -> Placed {
    run_with(g, devices(), true).unwrap_or_else(|e| panic!("{e}"))
}

fn fail(g: &Graph, soft: bool) -> Error {
    match run_with(g, devices(), soft) {
        Ok(p) => panic!("expected an error, placed {:?}", p.placement.devices()),
        Err(e) => e,
    }
}

fn assigned(g: &Graph, name: &str, device: &str) -> Graph {
    edit(g, |n| {
        if n.name == name {
            n.assigned_device = Some(device.into());
        }
    })
}

// ---- B1 -----------------------------------------------------------------------------------

#[test]
fn b01_no_constraints() {
    let p = run(&graph(&[
        ("in", "TestInput", "", &[]),
        ("n1", "TestRelu", "", &["in:0"]),
        ("n2", "TestRelu", "", &["in:1"]),
    ]));
    assert_eq!(p.dev_type("in"), CPU);
    assert_eq!((p.dev_type("n1"), p.dev_type("n2")), (GPU, GPU));
}

#[test]
fn b02_prioritized_kernels_beat_type_priority() {
    let p = run(&graph(&[
        ("in", "TestInput", "", &[]),
        ("n1", "TestDatasetOp", "", &["in:0"]),
        ("n2", "TestDatasetOp", "", &["in:1"]),
    ]));
    assert_eq!((p.dev_type("in"), p.dev_type("n1"), p.dev_type("n2")), (CPU, CPU, CPU));
}

#[test]
fn b03_xla_types_dropped_unless_assigned() {
    let g = graph(&[
        ("in", "TestInput", "", &[]),
        ("n1", "TestXlaOp", "", &["in:0"]),
        ("n2", "TestXlaOp", "", &["in:1"]),
    ]);
    let p = run(&assigned(&g, "n2", "/job:a/replica:0/task:0/device:XLA_CPU:0"));
    assert_eq!((p.dev_type("n1"), p.dev_type("n2")), (CPU, "XLA_CPU"));
}

#[test]
fn b04_gpu_input_into_prioritized_kernel() {
    let p = run(&graph(&[("in", "TestGPUOutput", "", &[]), ("n1", "TestDatasetOp", "", &["in"])]));
    assert_eq!((p.dev_type("in"), p.dev_type("n1")), (GPU, CPU));
}

#[test]
fn b05_gpu_input_colocated_with_prioritized_kernel() {
    let g = graph(&[
        ("in", "TestGPUOutput", "", &[]),
        ("n1", "TestDatasetOp", "", &["in"]),
        ("n2", "TestDatasetOp", "", &["in"]),
    ]);
    let g = edit(&g, |n| {
        if n.name == "n1" {
            n.colocation = vec!["in".into()];
        }
    });
    let p = run(&g);
    assert_eq!((p.dev_type("in"), p.dev_type("n1"), p.dev_type("n2")), (GPU, GPU, CPU));
}

#[test]
fn b06_to_b15_dataset_and_iterator_priorities() {
    for (ds, it, want) in [
        ("CreateDatasetSP", "IteratorNP", CPU),
        ("CreateDatasetRP", "IteratorNP", GPU),
        ("CreateDatasetNP", "IteratorSP", CPU),
        ("CreateDatasetNP", "IteratorRP", GPU),
        ("CreateDatasetSP", "IteratorGPU", GPU),
        ("CreateDatasetCPU", "IteratorRP", CPU),
        ("CreateDatasetSP", "IteratorSP", CPU),
        ("CreateDatasetRP", "IteratorRP", GPU),
        ("CreateDatasetSP", "IteratorRP", GPU),
        ("CreateDatasetRP", "IteratorSP", GPU),
    ] {
        let p = run(&graph(&[("ds", ds, "", &[]), ("it", it, "", &["ds"])]));
        assert_eq!((p.dev_type("ds"), p.dev_type("it")), (want, want), "{ds} -> {it}");
    }
}

// ---- B2 -----------------------------------------------------------------------------------

#[test]
fn b16_device_type_constraints() {
    let p = run(&graph(&[
        ("in", "TestInput", "", &[]),
        ("var_cpu", "VariableCPU", "", &[]),
        ("assign_cpu", "AssignCPU", "", &["var_cpu", "in"]),
        ("var_gpu", "VariableGPU", "", &[]),
        ("assign_gpu", "AssignGPU", "", &["var_gpu", "in:1"]),
    ]));
    assert_eq!((p.dev_type("in"), p.dev_type("var_cpu")), (CPU, CPU));
    assert!(p.colocated("var_cpu", "assign_cpu"));
    assert_eq!(p.dev_type("var_gpu"), GPU);
    assert!(p.colocated("var_gpu", "assign_gpu"));
}

#[test]
fn b17_metadata_colocated_with_input() {
    let p = run(&graph(&[
        ("var_cpu", "VariableCPU", "", &[]),
        ("shape_op", "Shape", "", &["var_cpu"]),
    ]));
    assert_eq!(p.dev_type("var_cpu"), CPU);
    assert!(p.colocated("var_cpu", "shape_op"));
}

#[test]
fn b18_generator_follows_single_consumer() {
    let p = run(&graph(&[
        ("var_cpu", "VariableCPU", "", &[]),
        ("in", "TestCPUGPUOutput", "", &[]),
        ("assign", "TestAssign", "", &["var_cpu", "in"]),
    ]));
    assert!(p.colocated("in", "var_cpu") && p.colocated("in", "assign"));
}

#[test]
fn b19_generator_heuristic_ignored_on_wrong_device() {
    let p = run(&graph(&[
        ("var_cpu", "VariableCPU", "", &[]),
        ("in", "TestGPUOutput", "", &[]),
        ("assign", "TestAssign", "", &["var_cpu", "in"]),
    ]));
    assert_eq!((p.dev_type("in"), p.dev_type("var_cpu")), (GPU, CPU));
    assert!(p.colocated("var_cpu", "assign"));
}

#[test]
fn b20_generator_heuristic_ignored_on_wrong_partial_device() {
    let p = run(&graph(&[
        ("var_cpu", "VariableCPU", "", &[]),
        ("in", "TestCPUGPUOutput", "/device:FakeCPU:1", &[]),
        ("assign", "TestAssign", "", &["var_cpu", "in"]),
    ]));
    assert_eq!(p.dev("in"), "/job:a/replica:0/task:0/device:FakeCPU:1");
    assert_eq!(p.dev("var_cpu"), K_FULL_CPU);
    assert_eq!(p.dev("assign"), K_FULL_CPU);
}

#[test]
fn b21_partial_spec() {
    let p =
        run(&graph(&[("in", "TestInput", "/job:a", &[]), ("var", "TestVariable", "/job:a", &[])]));
    assert_eq!((p.dev_type("in"), p.dev_type("var")), (CPU, GPU));
    assert!(p.dev("in").starts_with("/job:a/") && p.dev("var").starts_with("/job:a/"));
}

#[test]
fn b22_assigned_device_preserved() {
    let g = graph(&[("in", "TestInput", "", &[])]);
    let p = run(&assigned(&g, "in", "/job:a/replica:0/task:0/device:FakeCPU:7"));
    assert_eq!(p.dev("in"), "/job:a/replica:0/task:0/device:FakeCPU:7");
}

#[test]
fn b23_partial_spec_gpu_to_cpu() {
    let p = run(&graph(&[("in", "TestInput", K_GPU, &[]), ("var", "TestVariable", K_GPU, &[])]));
    assert_eq!(p.dev_type("in"), CPU);
    assert_eq!(p.dev("var"), K_FULL_GPU);
}

#[test]
fn b24_resource_move() {
    let p =
        run(&graph(&[("ds", "CreateDatasetSP", K_CPU, &[]), ("it", "IteratorGPU", "", &["ds"])]));
    assert_eq!((p.dev_type("ds"), p.dev_type("it")), (GPU, GPU));
}

#[test]
fn b25_assigned_gpu_device_to_cpu_op() {
    let g = assigned(&graph(&[("in", "TestInput", "", &[])]), "in", K_FULL_GPU);
    let err = fail(&g, true);
    assert!(
        matches!(&err, Error::AssignedDeviceUnsupported { device, op, .. } if device == K_FULL_GPU && op == "TestInput"),
        "{err}"
    );
    assert!(err.to_string().contains("Assigned device '/job:a/replica:0/task:0/device:FakeGPU:0' does not have registered OpKernel support for TestInput"));
}

#[test]
fn b26_reference_connection() {
    let ok = [
        ("TestVariable", "TestAssign", GPU),
        ("TestVariable", "AssignCPU", CPU),
        ("TestVariable", "AssignGPU", GPU),
        ("VariableCPU", "TestAssign", CPU),
        ("VariableCPU", "AssignCPU", CPU),
        ("VariableGPU", "TestAssign", GPU),
        ("VariableGPU", "AssignGPU", GPU),
    ];
    for (v, a, want) in ok {
        let p = run(&graph(&[
            ("in", "TestInput", "", &[]),
            ("var", v, "", &[]),
            ("assign", a, "", &["var", "in"]),
        ]));
        assert_eq!(p.dev_type("var"), want, "{v}/{a}");
        assert!(p.colocated("var", "assign"), "{v}/{a}");
    }
    for (v, a) in [("VariableCPU", "AssignGPU"), ("VariableGPU", "AssignCPU")] {
        let err = fail(
            &graph(&[
                ("in", "TestInput", "", &[]),
                ("var", v, "", &[]),
                ("assign", a, "", &["var", "in"]),
            ]),
            true,
        );
        assert!(err.to_string().contains("no device type supports both of those nodes"), "{err}");
    }
}

#[test]
fn b27_resource_handle() {
    let ok = [
        ("TestHandleVariable", "TestHandleAssign", GPU),
        ("TestHandleVariable", "HandleAssignCPU", CPU),
        ("TestHandleVariable", "HandleAssignGPU", GPU),
        ("HandleVariableCPU", "TestHandleAssign", CPU),
        ("HandleVariableCPU", "HandleAssignCPU", CPU),
        ("HandleVariableGPU", "HandleAssignGPU", GPU),
        ("HandleVariableGPU", "TestHandleAssign", GPU),
    ];
    for (v, a, want) in ok {
        let p = run(&graph(&[
            ("in", "TestInput", "", &[]),
            ("var", v, "", &[]),
            ("assign", a, "", &["var", "in"]),
        ]));
        assert_eq!(p.dev_type("var"), want, "{v}/{a}");
        assert!(p.colocated("var", "assign"), "{v}/{a}");
    }
    for (v, a) in
        [("HandleVariableGPU", "HandleAssignCPU"), ("HandleVariableCPU", "HandleAssignGPU")]
    {
        let g = graph(&[
            ("in", "TestInput", "", &[]),
            ("var", v, "", &[]),
            ("assign", a, "", &["var", "in"]),
        ]);
        assert!(run_with(&g, devices(), true).is_err(), "{v}/{a}");
    }
}

#[test]
fn b28_resource_handles_on_different_devices_fail() {
    let g = graph(&[
        ("var_cpu", "TestHandleVariable", "", &[]),
        ("var_gpu", "TestHandleVariable", "", &[]),
        ("two_handles_in", "TestTwoHandlesIn", "", &["var_cpu", "var_gpu"]),
    ]);
    for soft in [false, true] {
        let requested = edit(&g, |n| match n.name.as_str() {
            "var_cpu" => n.requested_device = K_FULL_CPU.into(),
            "var_gpu" => n.requested_device = K_FULL_GPU.into(),
            _ => {}
        });
        let err = fail(&requested, soft);
        assert!(
            err.to_string().contains("Cannot place the graph because a reference or resource edge connects colocation groups with incompatible resource devices: /job:a/replica:0/task:0/device:FakeGPU:0 vs /job:a/replica:0/task:0/device:FakeCPU:0"),
            "{err}"
        );
        let assigned = assigned(&assigned(&g, "var_cpu", K_FULL_CPU), "var_gpu", K_FULL_GPU);
        let err = fail(&assigned, soft);
        assert!(err.to_string().contains("incompatible assigned devices: /job:a/replica:0/task:0/device:FakeGPU:0 vs /job:a/replica:0/task:0/device:FakeCPU:0"), "{err}");
    }
}

#[test]
fn b29_reference_connection_ignores_infeasible_request() {
    let gpu = "/job:a/task:0/device:FakeGPU:0";
    let g = graph(&[
        ("in", "TestDevice", gpu, &[]),
        ("var_0", "TestVariable", gpu, &[]),
        ("assign", "TestAssign", "/job:a/task:0/device:FakeCPU:0", &["var_0", "in"]),
    ]);
    let p = run_with(&g, devices(), false).unwrap();
    assert_eq!((p.dev_type("var_0"), p.dev_type("assign")), (GPU, GPU));
}

#[test]
fn b30_more_specific_destination_refines() {
    let g = graph(&[
        ("in", "TestCPUGPUOutput", "/job:a/task:0", &[]),
        ("var_0", "TestVariable", "/job:a/task:0", &[]),
        ("assign", "TestAssign", "/job:a/task:0/device:FakeCPU:0", &["var_0", "in"]),
    ]);
    let p = run_with(&g, devices(), false).unwrap();
    assert_eq!((p.dev_type("var_0"), p.dev_type("assign")), (CPU, CPU));
}

#[test]
fn b31_no_source_device() {
    let g = graph(&[
        ("in", "TestDevice", K_GPU, &[]),
        ("var_0", "TestVariable", "", &[]),
        ("assign", "TestAssign", "/job:a/task:0/device:FakeCPU:0", &["var_0", "in"]),
    ]);
    let p = run_with(&g, devices(), false).unwrap();
    assert_eq!((p.dev_type("var_0"), p.dev_type("assign")), (CPU, CPU));
}

#[test]
fn b32_resource_handle_on_composite_device() {
    let composite = "/job:a/replica:0/task:0/device:COMPOSITE:0";
    let g = graph(&[
        ("in", "TestInput", "", &[]),
        ("var", "HandleVariableCPU", "", &[]),
        ("assign", "TestHandleAssign", "", &["var", "in"]),
    ]);
    let g = assigned(&g, "var", composite);
    let p = run(&g);
    assert_eq!((p.dev("var"), p.dev("assign")), (composite, composite));
    let p = run(&assigned(&g, "assign", K_FULL_CPU));
    assert_eq!((p.dev("var"), p.dev("assign")), (composite, K_FULL_CPU));
}

// ---- B3 -----------------------------------------------------------------------------------

fn with_groups(g: &Graph, groups: &[(&str, &[&str])]) -> Graph {
    edit(g, |n| {
        if let Some((_, targets)) = groups.iter().find(|(name, _)| *name == n.name) {
            n.colocation = targets.iter().map(|t| (*t).into()).collect();
        }
    })
}

#[test]
fn b33_to_b35_colocation_groups() {
    let base = graph(&[
        ("in", "TestInput", "", &[]),
        ("colocated_1", "TestRelu", "", &["in"]),
        ("foo", "TestRelu", "", &["in"]),
    ]);
    let p = run(&with_groups(&base, &[("colocated_1", &["in"])]));
    assert!(p.colocated("in", "colocated_1") && !p.colocated("in", "foo"));
    assert_eq!(p.dev_type("foo"), GPU);
    let p = run(&with_groups(&base, &[("colocated_1", &["in"]), ("foo", &["in", "colocated_1"])]));
    assert!(p.colocated("in", "colocated_1") && p.colocated("in", "foo"));
    let p = run(&with_groups(&base, &[("colocated_1", &["in"]), ("foo", &["colocated_1"])]));
    assert!(p.colocated("in", "colocated_1") && p.colocated("in", "foo"));
}

#[test]
fn b36_invalid_multiple_colocation_groups() {
    let g = graph(&[
        ("in", "TestInput", "", &[]),
        ("colocated_1", "ReluCPU", "", &["in"]),
        ("foo", "ReluGPU", "", &["in"]),
    ]);
    let g = with_groups(&g, &[("colocated_1", &["in"]), ("foo", &["in", "colocated_1"])]);
    let p = run(&g);
    assert_eq!((p.dev_type("in"), p.dev_type("colocated_1"), p.dev_type("foo")), (CPU, CPU, GPU));
    let err = fail(&g, false);
    assert!(
        err.to_string().contains("Cannot colocate nodes {{colocation_node foo}} and {{colocation_node in}}") && err.to_string().contains("because no device type supports both of those nodes and the other nodes colocated with them"),
        "{err}"
    );
    assert!(
        matches!(&err, Error::NoCommonDeviceType { constraint, .. } if **constraint == Constraint::Group { group: "in".into() })
    );
}

fn reference_groups(var3: &str, var3_request: &str, assign3_group: &str) -> Graph {
    let g = graph(&[
        ("in", "TestInput", "", &[]),
        ("var1", "VariableCPU", "", &[]),
        ("var2", "VariableCPU", "", &[]),
        ("var3", var3, var3_request, &[]),
        ("assign1", "TestAssign", "", &["var1", "in"]),
        ("assign2", "TestAssign", "", &["var2", "in"]),
        ("assign3", "TestAssign", "", &["var3", "in"]),
    ]);
    with_groups(
        &g,
        &[("assign1", &["var1"]), ("assign2", &["var2"]), ("assign3", &[assign3_group])],
    )
}

#[test]
fn b37_colocation_group_with_reference_connections() {
    let p = run(&reference_groups("VariableCPU", "/device:COMPOSITE:0", "var3"));
    assert_eq!(p.dev_type("in"), CPU);
    for n in ["var1", "var2", "assign1", "assign2"] {
        assert!(p.colocated("in", n), "{n}");
    }
    assert_eq!(p.dev_type("var3"), "COMPOSITE");
    assert!(p.colocated("var3", "assign3"));
}

#[test]
fn b38_unsatisfiable_reference_connections() {
    let g = reference_groups("VariableGPU", "", "var2");
    assert!(run_with(&g, devices(), true).is_ok());
    let err = fail(&g, false);
    assert!(err.to_string().contains("Cannot colocate nodes {{colocation_node assign3}} and {{colocation_node var2}} because no device type supports both of those nodes and the other nodes colocated with them"), "{err}");
}

#[test]
fn b39_colocation_and_reference_connections() {
    let mut nodes: Vec<(String, &str, Vec<String>, Vec<String>)> =
        vec![("in".into(), "TestInput", vec![], vec![])];
    for i in 0..100 {
        let (var, assign) = (format!("var_{i}"), format!("assign_{i}"));
        let (vg, ag) = if i < 10 {
            (vec![], vec![])
        } else {
            (vec![format!("var_{}", i % 6)], vec![format!("assign_{}", i % 3)])
        };
        nodes.push((var.clone(), "TestVariable", vec![], vg));
        nodes.push((assign, "TestAssign", vec![var, "in".into()], ag));
    }
    let mut g = Graph::new();
    for (name, op, _, groups) in &nodes {
        g.add_node(
            Node::new(name, op)
                .colocate_with(&groups.iter().map(String::as_str).collect::<Vec<_>>()),
        )
        .unwrap();
    }
    for (name, _, inputs, _) in &nodes {
        for (k, src) in inputs.iter().enumerate() {
            g.add_edge(src, 0, name, k).unwrap();
        }
    }
    let p = run(&g);
    for i in 0..100 {
        assert!(p.colocated(&format!("var_{i}"), &format!("assign_{i}")), "{i}");
        if i >= 10 {
            assert!(p.colocated(&format!("var_{i}"), &format!("var_{}", i % 6)), "{i}");
            assert!(p.colocated(&format!("assign_{i}"), &format!("assign_{}", i % 3)), "{i}");
        }
    }
}

// ---- B4 -----------------------------------------------------------------------------------

#[test]
fn b40_empty_device_set() {
    let err = run_with(
        &graph(&[("in", "TestInput", "", &[])]),
        DeviceSet::new::<&str>(&[]).unwrap(),
        true,
    )
    .err()
    .unwrap();
    assert_eq!(err, Error::NoDevices);
    assert!(err.to_string().contains("No devices are registered"));
}

#[test]
fn b41_heterogeneous_device_set_failure() {
    let set = DeviceSet::new(&[
        "/job:b/replica:0/task:0/device:FakeGPU:0",
        "/job:b/replica:0/task:1/device:FakeCPU:0",
    ])
    .unwrap()
    .with_type_priority(CPU, 50)
    .with_type_priority(GPU, 51);
    let g = graph(&[
        ("in", "TestInput", "", &[]),
        ("var", "VariableGPU", "", &[]),
        ("assign", "TestAssign", "/job:b/task:1", &["var", "in"]),
    ]);
    let err = run_with(&g, set, true).err().unwrap();
    assert!(
        err.to_string()
            .contains("colocated with a group of nodes that required incompatible device"),
        "{err}"
    );
    let Error::IncompatibleGroup { group, .. } = &err else { panic!("{err}") };
    let ops: Vec<&str> = group.iter().map(|m| m.op.as_str()).collect();
    assert_eq!(ops, ["VariableGPU", "TestAssign"]);
}

#[test]
fn b42_to_b44_unknown_devices() {
    let err = fail(&graph(&[("in", "TestInput", "/job:foo", &[])]), true);
    assert!(
        matches!(&err, Error::ExplicitDeviceNotFound { .. })
            && err.to_string().contains("/job:foo"),
        "{err}"
    );
    let err = fail(&assigned(&graph(&[("in", "TestInput", "", &[])]), "in", "/job:foo"), true);
    assert!(
        err.to_string().contains("Assigned device '/job:foo' does not match any device"),
        "{err}"
    );
}

#[test]
fn b45_no_kernels_registered() {
    let err = fail(&graph(&[("var", "VariableNoKernels", "", &[])]), true);
    assert!(
        err.to_string().contains(
            "No OpKernel was registered to support Op 'VariableNoKernels' used by {{node var}}"
        ),
        "{err}"
    );
}

#[test]
fn b46_b47_no_kernels_local_and_remote() {
    let set = DeviceSet::new(&[
        "/job:b/replica:0/task:0/device:FakeGPU:0",
        "/job:b/replica:0/task:0/device:FakeCPU:0",
    ])
    .unwrap()
    .with_default_local_device("/job:b/replica:0/task:0/device:FakeCPU:0")
    .unwrap();
    let g = graph(&[("var", "VariableNoKernels", "/job:b/replica:0/task:0/device:FakeGPU:0", &[])]);
    let err = run_with(&g, set, false).err().unwrap();
    assert!(
        err.to_string().contains(
            "No OpKernel was registered to support Op 'VariableNoKernels' used by {{node var}}"
        ),
        "{err}"
    );

    let mut set = DeviceSet::new(&["/job:b/replica:0/task:0/device:FakeCPU:0"]).unwrap();
    set.add("/job:b/replica:0/task:1/device:FakeGPU:0", false).unwrap();
    let set = set.with_default_local_device("/job:b/replica:0/task:0/device:FakeCPU:0").unwrap();
    let g = graph(&[("var", "VariableNoKernels", "/job:b/replica:0/task:1/device:FakeGPU:0", &[])]);
    let p = run_with(&g, set, false).unwrap();
    assert_eq!(p.dev("var"), "/job:b/replica:0/task:1/device:FakeGPU:0");
}

#[test]
fn b48_no_devices_of_the_kernels_type() {
    let set = DeviceSet::new(&["/job:a/replica:0/task:0/device:FakeCPU:0"]).unwrap();
    let err = run_with(&graph(&[("var", "VariableGPU", "", &[])]), set, true).err().unwrap();
    assert!(
        err.to_string().contains(
            "No OpKernel was registered to support Op 'VariableGPU' used by {{node var}}"
        ),
        "{err}"
    );
    assert!(err.to_string().contains("FakeCPU"), "{err}");
}

#[test]
fn b49_to_b51_malformed_and_partial_names() {
    let err = fail(&graph(&[("in", "TestInput", "/foo:bar", &[])]), true);
    assert!(err.to_string().contains("Malformed device specification '/foo:bar'"), "{err}");
    let err = fail(&assigned(&graph(&[("in", "TestInput", "", &[])]), "in", "/foo:bar"), true);
    assert!(err.to_string().contains("Malformed assigned device '/foo:bar'"), "{err}");
    let err = fail(&assigned(&graph(&[("in", "TestInput", "", &[])]), "in", "/job:a"), true);
    assert!(
        err.to_string().contains("Assigned device '/job:a' does not match any device"),
        "{err}"
    );
}

#[test]
fn b52_to_b54_nonexistent_gpu() {
    let g = graph(&[("in", "TestDevice", "/device:FakeGPU:11", &[])]);
    assert!(run(&g).dev("in").contains("/device:FakeGPU:0"));
    let err = fail(&g, false);
    let text = err.to_string();
    assert!(text.contains("/device:FakeGPU:11"), "{text}");
    assert!(
        text.contains("Cannot assign a device for operation in") && text.contains("{{node in}}"),
        "{text}"
    );
}

#[test]
fn b55_unsupported_device() {
    let err = fail(&graph(&[("var", "VariableGPU", K_CPU, &[])]), false);
    let text = err.to_string();
    assert!(
        text.contains("/device:FakeCPU:0")
            && text.contains("no supported kernel for FakeCPU devices is available"),
        "{text}"
    );
}

#[test]
fn b56_nonexistent_device() {
    let err = fail(&graph(&[("var", "VariableGPU", "/job:foo/replica:17", &[])]), false);
    let text = err.to_string();
    assert!(
        text.contains("was explicitly assigned to /job:foo/replica:17")
            && text.contains("but available devices"),
        "{text}"
    );
}

#[test]
fn b57_lower_case_gpu_is_explained() {
    let err = fail(&graph(&[("var", "VariableGPU", "/device:gpu:0", &[])]), false);
    assert!(err.to_string().contains("The requested device appears to be a GPU"), "{err}");
}

#[test]
fn b58_b59_soft_placement() {
    assert_eq!(run(&graph(&[("a", "TestInput", K_GPU, &[])])).dev_type("a"), CPU);
    let p = run(&graph(&[
        ("var_gpu", "VariableGPU", "", &[]),
        ("force_gpu", "TestDeviceEnforce", K_CPU, &["var_gpu"]),
        ("var_cpu", "VariableCPU", "", &[]),
        ("force_cpu", "TestDeviceEnforce", K_GPU, &["var_cpu"]),
    ]));
    assert_eq!(p.dev_type("var_gpu"), GPU);
    assert!(p.colocated("var_gpu", "force_gpu"));
    assert_eq!(p.dev_type("var_cpu"), CPU);
    assert!(p.colocated("var_cpu", "force_cpu"));
}

#[test]
fn b60_unsatisfiable_constraint_with_reference_connections() {
    let err = fail(
        &graph(&[
            ("var", "VariableGPU", "", &[]),
            ("in", "TestInput", "", &[]),
            ("assign", "AssignCPU", "", &["var", "in"]),
        ]),
        true,
    );
    assert!(
        err.to_string().contains(
            "Cannot colocate nodes {{colocation_node var}} and {{colocation_node assign}}"
        ),
        "{err}"
    );
    assert!(
        matches!(&err, Error::RefEdgeColocation { src, dst, .. } if src == "var" && dst == "assign")
    );
}

// ---- B5 -----------------------------------------------------------------------------------

fn two_variables() -> Graph {
    graph(&[
        ("var1_cpu", "VariableCPU", "", &[]),
        ("var2_cpu", "VariableCPU", "", &[]),
        ("in", "TestCPUGPUOutput", "", &[]),
        ("assign1", "TestAssign", "", &["var1_cpu", "in"]),
        ("assign2", "TestAssign", "", &["var2_cpu", "in"]),
    ])
}

#[test]
fn b61_generator_follows_consumers() {
    let p = run(&two_variables());
    for n in ["var1_cpu", "assign1", "var2_cpu", "assign2"] {
        assert!(p.colocated("in", n), "{n}");
    }
}

#[test]
fn b62_generator_does_not_follow_disagreeing_consumers() {
    let g = assigned(
        &assigned(&two_variables(), "var1_cpu", "/job:a/replica:0/task:0/device:FakeCPU:1"),
        "var2_cpu",
        "/job:a/replica:0/task:0/device:FakeCPU:2",
    );
    let p = run(&g);
    assert!(p.colocated("assign1", "var1_cpu") && p.colocated("assign2", "var2_cpu"));
    assert_eq!(p.dev_type("in"), GPU);
}

fn arg_identities() -> Graph {
    let g = graph(&[
        ("a", "_ArgResource", K_GPU, &[]),
        ("b", "_ArgResource", K_CPU, &[]),
        ("id1", "IdentityResource", "", &["a"]),
        ("id2", "IdentityResource", "", &["b"]),
    ]);
    with_groups(&g, &[("id1", &["id2"])])
}

#[test]
fn b63_requested_device_on_resource_generator_is_treated_as_assigned() {
    let p = run(&arg_identities());
    assert_eq!(
        (p.dev_type("a"), p.dev_type("id1"), p.dev_type("b"), p.dev_type("id2")),
        (GPU, GPU, CPU, CPU)
    );
    let err = fail(&arg_identities(), false);
    assert!(
        err.to_string().contains("Cannot colocate nodes {{colocation_node id2}} and {{colocation_node id1}}") && err.to_string().contains("Cannot merge devices with incompatible types: '/device:FakeCPU:0' and '/device:FakeGPU:0'"),
        "{err}"
    );
}

fn overridable() -> Graph {
    let g = graph(&[
        ("a", "_ArgResource", "", &[]),
        ("b", "_ArgResource", "", &[]),
        ("id_a", "IdentityResource", K_GPU, &["a"]),
        ("id_b", "IdentityResource", K_CPU, &["b"]),
        ("id1", "IdentityResource", "", &["id_a"]),
        ("id2", "IdentityResource", "", &["id_b"]),
    ]);
    with_groups(&g, &[("id1", &["id2"])])
}

#[test]
fn b64_requested_device_can_be_overridden() {
    let p = run(&overridable());
    for n in ["b", "id_a", "id_b", "id1", "id2"] {
        assert!(p.colocated("a", n), "{n}");
    }
}

#[test]
fn b65_assigned_device_of_colocated_node_is_respected() {
    let g = assigned(
        &graph(&[("a", "_ArgResource", "", &[]), ("iter", "IteratorGPU", "", &["a"])]),
        "a",
        K_FULL_CPU,
    );
    let err = fail(&g, true);
    assert!(err.to_string().contains("{{colocation_node iter}} was colocated with a group of nodes that required incompatible device '/job:a/replica:0/task:0/device:FakeCPU:0'"), "{err}");
}

#[test]
fn b66_assigned_devices_are_not_overridden() {
    let g = edit(&overridable(), |n| match n.name.as_str() {
        "id_a" => {
            n.requested_device.clear();
            n.assigned_device = Some(K_FULL_GPU.into());
        }
        "id_b" => {
            n.requested_device.clear();
            n.assigned_device = Some(K_FULL_CPU.into());
        }
        _ => {}
    });
    let p = run(&g);
    assert_eq!((p.dev_type("a"), p.dev_type("id_a"), p.dev_type("id1")), (GPU, GPU, GPU));
    assert_eq!((p.dev_type("b"), p.dev_type("id_b"), p.dev_type("id2")), (CPU, CPU, CPU));
    let err = fail(&g, false);
    assert!(err.to_string().contains("Cannot colocate nodes {{colocation_node id2}} and {{colocation_node id1}}: Cannot merge devices with incompatible types: '/job:a/replica:0/task:0/device:FakeCPU:0' and '/job:a/replica:0/task:0/device:FakeGPU:0'"), "{err}");
}

// ---- B7 -----------------------------------------------------------------------------------

const TASK0: &str = "/job:b/replica:0/task:0/device:FakeCPU:0";
const TASK1: &str = "/job:b/replica:0/task:1/device:FakeCPU:0";

fn identity_chain(extra: bool, drop_tail: bool) -> Result<Placed, Error> {
    let set = DeviceSet::new(&[TASK0, TASK1]).unwrap().with_type_priority(CPU, 50);
    let mut nodes: Vec<(&str, &str, &str, &[&str])> = vec![
        ("a", "_Arg", TASK1, &[]),
        ("identity1", "Identity", TASK1, &["a"]),
        ("identity2", "Identity", "", &["identity1"]),
    ];
    if !drop_tail {
        nodes.push(("cast", "Cast", TASK1, &["identity2"]));
        nodes.push(("coo", "ConvertToListOfCooTensorsV2", TASK1, &["cast"]));
    }
    if extra {
        nodes.push(("identity3", "Identity", "", &["identity2"]));
    }
    run_with(&graph(&nodes), set, false)
}

#[test]
fn b88_identity_matches_input_and_output_placement() {
    assert_eq!(identity_chain(false, false).unwrap().dev("identity2"), TASK1);
}

#[test]
fn b89_identity_without_output_does_not_crash() {
    assert!(identity_chain(false, true).is_ok());
}

#[test]
fn b90_identity_does_not_match_with_multiple_outputs() {
    assert_eq!(identity_chain(true, false).unwrap().dev("identity2"), TASK0);
}
