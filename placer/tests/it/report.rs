//! `explain` and `to_dot`.

use meshwork_placer::{
    ArgKind::{Ref, Value},
    DeviceSet, Graph, Node, OpDef, PlacerOptions, Reason, Registry, explain, place, to_dot,
};

fn setup() -> (Graph, DeviceSet, Registry) {
    let mut r = Registry::new();
    r.insert("Var", OpDef::new(&[], &[Ref], &["CPU", "GPU"]))
        .insert("Const", OpDef::new(&[], &[Value], &["CPU", "GPU"]))
        .insert("Assign", OpDef::new(&[Ref, Value], &[Value], &["CPU", "GPU"]))
        .insert(
            "Shape",
            OpDef { is_metadata: true, ..OpDef::new(&[Value], &[Value], &["CPU", "GPU"]) },
        );
    let mut g = Graph::new();
    g.add_node(Node::new("var", "Var").on("/device:CPU:1")).unwrap();
    g.add_node(Node::new("init", "Const")).unwrap();
    g.add_node(Node::new("assign", "Assign")).unwrap();
    g.add_node(Node::new("shape", "Shape")).unwrap();
    g.add_node(Node::new("other", "Const").colocate_with(&["shape"])).unwrap();
    g.add_edge("var", 0, "assign", 0).unwrap();
    g.add_edge("init", 0, "assign", 1).unwrap();
    g.add_edge("assign", 0, "shape", 0).unwrap();
    g.add_control_edge("var", "other").unwrap();
    let set = DeviceSet::new(&[
        "/job:w/replica:0/task:0/device:CPU:0",
        "/job:w/replica:0/task:0/device:CPU:1",
        "/job:w/replica:0/task:0/device:GPU:0",
    ])
    .unwrap();
    (g, set, r)
}

#[test]
fn explain_names_the_group_constraints_and_candidates() {
    let (g, set, r) = setup();
    let e = explain(&g, &set, &r, PlacerOptions::default(), "assign").unwrap();
    assert_eq!(e.device, "/job:w/replica:0/task:0/device:CPU:1");
    assert_eq!(e.candidates, ["/job:w/replica:0/task:0/device:CPU:1"]);
    let members: Vec<&str> = e.group.iter().map(|m| m.node.as_str()).collect();
    assert_eq!(members, ["var", "assign"]);
    assert!(
        e.constraints.contains(&"var requests '/device:CPU:1'".to_owned()),
        "{:?}",
        e.constraints
    );
    assert!(
        e.constraints.contains(&"var -> assign is a reference/resource edge".to_owned()),
        "{:?}",
        e.constraints
    );
    assert_eq!(e.kernel_types, ["GPU", "CPU"]);
    let text = e.to_string();
    assert!(
        text.starts_with("assign (Assign) -> /job:w/replica:0/task:0/device:CPU:1\n"),
        "{text}"
    );

    let shape = explain(&g, &set, &r, PlacerOptions::default(), "shape").unwrap();
    assert_eq!(shape.reason, Reason::FollowsInput);
    assert_eq!(shape.device, e.device);
    let init = explain(&g, &set, &r, PlacerOptions::default(), "init").unwrap();
    assert_eq!(init.reason, Reason::FollowsConsumers);
    assert!(explain(&g, &set, &r, PlacerOptions::default(), "nope").is_err());
}

#[test]
fn dot_colours_by_device_and_dashes_control_edges() {
    let (g, set, r) = setup();
    let p = place(&g, &set, &r, PlacerOptions::default()).unwrap();
    let dot = to_dot(&g, &set, &p);
    assert!(dot.starts_with("digraph placement {"));
    assert!(dot.contains("\"var\" -> \"assign\";"), "{dot}");
    assert!(dot.contains("\"var\" -> \"other\" [style=dashed];"), "{dot}");
    assert!(dot.contains("\"var\" [label=\"var\\nVar\\nCPU:1\", fillcolor=\"#ffffb3\"];"), "{dot}");
    assert!(
        dot.contains(
            "\"device 1\" [label=\"/job:w/replica:0/task:0/device:CPU:1\", fillcolor=\"#ffffb3\"];"
        ),
        "{dot}"
    );
    assert!(dot.trim_end().ends_with('}'));
}
