//! Bad input gets a typed error that names what was wrong.

use meshwork_placer::{
    ArgKind::Value, DeviceSet, Error, Graph, Node, OpDef, PlacerOptions, Registry, graph_from_json,
    place,
};

fn registry() -> Registry {
    let mut r = Registry::new();
    r.insert("Const", OpDef::new(&[], &[Value], &["CPU"]))
        .insert("Add", OpDef::new(&[Value, Value], &[Value], &["CPU"]));
    r
}

fn cpus() -> DeviceSet {
    DeviceSet::new(&["/job:localhost/replica:0/task:0/device:CPU:0"]).unwrap()
}

fn place_err(g: &Graph) -> Error {
    place(g, &cpus(), &registry(), PlacerOptions::default()).unwrap_err()
}

#[test]
fn graph_construction_errors() {
    let mut g = Graph::new();
    g.add_node(Node::new("a", "Const")).unwrap();
    assert_eq!(g.add_node(Node::new("a", "Const")), Err(Error::DuplicateNode { name: "a".into() }));
    assert_eq!(
        g.add_edge("a", 0, "missing", 0),
        Err(Error::UnknownNode { name: "missing".into(), referenced_by: "a".into() })
    );
    assert_eq!(
        g.add_control_edge("ghost", "a"),
        Err(Error::UnknownNode { name: "ghost".into(), referenced_by: "a".into() })
    );
}

#[test]
fn unknown_ops_and_bad_edges() {
    let mut g = Graph::new();
    g.add_node(Node::new("a", "Conv9D")).unwrap();
    assert_eq!(place_err(&g), Error::UnknownOp { node: "a".into(), op: "Conv9D".into() });

    let mut g = Graph::new();
    g.add_node(Node::new("a", "Const")).unwrap();
    g.add_node(Node::new("b", "Add")).unwrap();
    g.add_edge("a", 0, "b", 0).unwrap();
    assert_eq!(place_err(&g), Error::MissingInput { node: "b".into(), op: "Add".into(), input: 1 });
    g.add_edge("a", 0, "b", 0).unwrap();
    assert_eq!(place_err(&g), Error::DuplicateInput { node: "b".into(), input: 0 });

    let mut g = Graph::new();
    g.add_node(Node::new("a", "Const")).unwrap();
    g.add_node(Node::new("b", "Add")).unwrap();
    g.add_edge("a", 0, "b", 0).unwrap();
    g.add_edge("a", 3, "b", 1).unwrap();
    let err = place_err(&g);
    assert!(matches!(&err, Error::BadEdge { src_output: 3, outputs: 1, .. }), "{err}");
    let mut g = Graph::new();
    g.add_node(Node::new("a", "Const")).unwrap();
    g.add_node(Node::new("b", "Add")).unwrap();
    g.add_edge("a", 0, "b", 0).unwrap();
    g.add_edge("a", 0, "b", 1).unwrap();
    g.add_edge("a", 0, "b", 2).unwrap();
    assert!(matches!(place_err(&g), Error::BadEdge { input: 2, inputs: 2, .. }));
}

#[test]
fn cycles_are_errors() {
    let mut g = Graph::new();
    for n in ["a", "b", "c"] {
        g.add_node(Node::new(n, "Add")).unwrap();
    }
    g.add_node(Node::new("k", "Const")).unwrap();
    g.add_edge("k", 0, "a", 0).unwrap();
    g.add_edge("c", 0, "a", 1).unwrap();
    g.add_edge("a", 0, "b", 0).unwrap();
    g.add_edge("k", 0, "b", 1).unwrap();
    g.add_edge("b", 0, "c", 0).unwrap();
    g.add_edge("k", 0, "c", 1).unwrap();
    let err = place_err(&g);
    assert!(
        matches!(&err, Error::Cycle { node } if ["a", "b", "c"].contains(&node.as_str())),
        "{err}"
    );
    // A control edge closes a cycle too.
    let mut g = Graph::new();
    g.add_node(Node::new("x", "Const")).unwrap();
    g.add_node(Node::new("y", "Const")).unwrap();
    g.add_control_edge("x", "y").unwrap();
    g.add_control_edge("y", "x").unwrap();
    assert!(matches!(place_err(&g), Error::Cycle { .. }));
}

#[test]
fn device_set_errors() {
    assert_eq!(
        DeviceSet::new(&["/device:CPU:0"]).err(),
        Some(Error::PartialDeviceName { name: "/device:CPU:0".into() })
    );
    assert_eq!(
        DeviceSet::new(&["/job:a/replica:0/task:0/device:CPU:0", "/job:a/replica:0/task:0/cpu:0"])
            .err(),
        Some(Error::DuplicateDevice { name: "/job:a/replica:0/task:0/device:CPU:0".into() })
    );
    assert_eq!(
        DeviceSet::new(&["CPU:0"]).err(),
        Some(Error::MalformedDeviceName { input: "CPU:0".into() })
    );
    assert_eq!(
        cpus().with_default_local_device("/job:x/replica:0/task:0/device:CPU:0").err(),
        Some(Error::UnknownDevice { name: "/job:x/replica:0/task:0/device:CPU:0".into() })
    );
    let empty = DeviceSet::new::<&str>(&[]).unwrap();
    let mut g = Graph::new();
    g.add_node(Node::new("a", "Const")).unwrap();
    assert_eq!(place(&g, &empty, &registry(), PlacerOptions::default()), Err(Error::NoDevices));
}

#[test]
fn json_errors_say_where() {
    let err = graph_from_json("{\"nodes\": [{\"name\": \"a\"}]}").unwrap_err();
    assert!(matches!(&err, Error::Json { line: 1, .. }), "{err}");
    assert!(err.to_string().contains("missing field `op`"), "{err}");
    let err = graph_from_json("{\"nodes\": [\n{\"name\": \"a\", \"op\": \"Const\"},\n{\"name\": \"b\", \"op\": \"Add\", \"inputs\": [{\"src\": \"zz\"}]}]}").unwrap_err();
    assert_eq!(err, Error::UnknownNode { name: "zz".into(), referenced_by: "b".into() });
    let err =
        graph_from_json("{\"nodes\": [\n{\"name\": \"a\", \"op\": \"Const\"}, ]}").unwrap_err();
    assert!(matches!(&err, Error::Json { line: 2, .. }), "{err}");
    // A good graph roundtrips through JSON.
    let text = "{\"nodes\": [{\"name\": \"a\", \"op\": \"Const\", \"requested_device\": \"/cpu:0\"}, {\"name\": \"b\", \"op\": \"Add\", \"inputs\": [{\"src\": \"a\"}, {\"src\": \"a\"}], \"control_inputs\": [\"a\"], \"colocation\": [\"a\"]}]}";
    let g = graph_from_json(text).unwrap();
    let json = meshwork_placer::GraphJson::from_graph(&g);
    let again = json.to_graph().unwrap();
    assert_eq!(meshwork_placer::GraphJson::from_graph(&again), json);
    assert_eq!(json.nodes[1].control_inputs, ["a"]);
}
