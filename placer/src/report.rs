//! Looking at a placement: why a node landed where it did, and a DOT drawing coloured
//! by device.

use std::fmt;
use std::fmt::Write as _;

use crate::error::GroupMember;
use crate::{
    ArgKind, DeviceSet, Edge, Error, Graph, OpRegistry, Placement, PlacerOptions, Reason, Result,
    place,
};

/// Why a node went where it did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Explanation {
    /// The node.
    pub node: String,
    /// Its op.
    pub op: String,
    /// The device it was placed on.
    pub device: String,
    /// How the device was chosen.
    pub reason: Reason,
    /// Every member of its colocation group (itself included).
    pub group: Vec<GroupMember>,
    /// The constraints that tied the group together and narrowed its devices, in words.
    pub constraints: Vec<String>,
    /// Device types with kernels for every member (present in the device set).
    pub kernel_types: Vec<String>,
    /// The devices the constraints allowed the group, best first.
    pub candidates: Vec<String>,
}

impl fmt::Display for Explanation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{} ({}) -> {}", self.node, self.op, self.device)?;
        let why = match self.reason {
            Reason::PreAssigned => "the framework had already assigned it".to_owned(),
            Reason::FirstCandidate => format!(
                "first of {} allowed device(s), in TF's order (kernel priority, device-type priority, local, name)",
                self.candidates.len()
            ),
            Reason::FollowsInput => "a metadata op, placed with its input".to_owned(),
            Reason::IdentityFollowsInput => {
                "an identity whose input and output request the same device, placed with its input"
                    .to_owned()
            }
            Reason::FollowsConsumers => "a generator, placed with all of its consumers".to_owned(),
        };
        writeln!(f, "  why: {why}")?;
        let members: Vec<String> =
            self.group.iter().map(|m| format!("{} ({})", m.node, m.op)).collect();
        writeln!(f, "  colocation group of {}: {}", self.group.len(), members.join(", "))?;
        for c in &self.constraints {
            writeln!(f, "  constraint: {c}")?;
        }
        writeln!(f, "  kernels for every member: [{}]", self.kernel_types.join(", "))?;
        write!(f, "  allowed devices: [{}]", self.candidates.join(", "))
    }
}

/// Places the graph (with the placement log on) and explains where `node` went.
pub fn explain(
    graph: &Graph,
    devices: &DeviceSet,
    registry: &dyn OpRegistry,
    options: PlacerOptions,
    node: &str,
) -> Result<Explanation> {
    let id = graph.id(node).ok_or_else(|| Error::UnknownNode {
        name: node.to_owned(),
        referenced_by: "explain".to_owned(),
    })?;
    let options = PlacerOptions { log_device_placement: true, ..options };
    let placement = place(graph, devices, registry, options)?;
    let entry = placement.log().iter().find(|e| e.node == id).expect("every node is logged");
    let root = placement.groups()[id.index()];
    let in_group: Vec<usize> =
        (0..graph.len()).filter(|&j| placement.groups()[j] == root).collect();
    let group: Vec<GroupMember> = in_group
        .iter()
        .map(|&j| {
            let n = graph.node(crate::NodeId(j as u32));
            GroupMember {
                node: n.name.clone(),
                op: n.op.clone(),
                requested: n.requested_device.clone(),
                assigned: n.assigned_device.clone(),
            }
        })
        .collect();
    let mut constraints = Vec::new();
    for &j in &in_group {
        let n = graph.node(crate::NodeId(j as u32));
        if let Some(a) = &n.assigned_device {
            constraints.push(format!("{} is assigned to {a}", n.name));
        } else if !n.requested_device.is_empty() {
            constraints.push(format!("{} requests '{}'", n.name, n.requested_device));
        }
        for target in &n.colocation {
            constraints.push(format!("{} has loc:@{target}", n.name));
        }
    }
    for (src, dst, edge) in graph.edges() {
        let Edge::Data { dst_input, .. } = edge else { continue };
        if placement.groups()[dst.index()] != root {
            continue;
        }
        let op = registry.op(&graph.node(dst).op).expect("placed ops are registered");
        if op.inputs[dst_input] != ArgKind::Value && !op.input_colocation_exempt {
            constraints.push(format!(
                "{} -> {} is a reference/resource edge",
                graph.node(src).name,
                graph.node(dst).name
            ));
        }
    }
    let types = devices.prioritized_types();
    let kernel_types = types
        .into_iter()
        .filter(|t| {
            in_group.iter().all(|&j| {
                let op = registry.op(&graph.node(crate::NodeId(j as u32)).op).expect("registered");
                op.kernels.iter().any(|k| &k.device_type == t)
            })
        })
        .collect();
    let name = |d: usize| devices.devices()[d].name().to_owned();
    let n = graph.node(id);
    Ok(Explanation {
        node: n.name.clone(),
        op: n.op.clone(),
        device: name(placement.device(id)),
        reason: entry.reason,
        group,
        constraints,
        kernel_types,
        candidates: placement.allowed(id).iter().map(|&d| name(d as usize)).collect(),
    })
}

/// Colours for devices, cycled (ColorBrewer "Set3").
const PALETTE: [&str; 12] = [
    "#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69", "#fccde5",
    "#d9d9d9", "#bc80bd", "#ccebc5", "#ffed6f",
];

fn quote(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

/// The placement as a table: one line per node (name, op, full device name) under a
/// header, columns padded to their widest entry.
pub fn table(graph: &Graph, devices: &DeviceSet, placement: &Placement) -> String {
    let width = graph.nodes().map(|(_, n)| n.name.len()).max().unwrap_or(4).max(4);
    let op_width = graph.nodes().map(|(_, n)| n.op.len()).max().unwrap_or(2).max(2);
    let mut out = format!("{:width$}  {:op_width$}  device\n", "node", "op");
    for (id, n) in graph.nodes() {
        let device = devices.devices()[placement.device(id)].name();
        let _ = writeln!(out, "{:width$}  {:op_width$}  {device}", n.name, n.op);
    }
    out
}

/// The placed graph in Graphviz DOT: one colour per device (with a legend), data edges
/// solid, control edges dashed.
pub fn to_dot(graph: &Graph, devices: &DeviceSet, placement: &Placement) -> String {
    let mut out =
        String::from("digraph placement {\n  rankdir=LR;\n  node [shape=box, style=filled];\n");
    for (id, n) in graph.nodes() {
        let d = placement.device(id);
        let device = devices.devices()[d].parsed().local_name();
        let label = format!("{}\\n{}\\n{}", n.name, n.op, device.trim_start_matches("/device:"));
        let _ = writeln!(
            out,
            "  {} [label={}, fillcolor={}];",
            quote(&n.name),
            quote(&label).replace("\\\\n", "\\n"),
            quote(PALETTE[d % PALETTE.len()])
        );
    }
    for (src, dst, edge) in graph.edges() {
        let style = if edge == Edge::Control { " [style=dashed]" } else { "" };
        let _ = writeln!(
            out,
            "  {} -> {}{style};",
            quote(&graph.node(src).name),
            quote(&graph.node(dst).name)
        );
    }
    out.push_str("  subgraph cluster_legend {\n    label=\"devices\";\n");
    for (d, device) in devices.devices().iter().enumerate() {
        let _ = writeln!(
            out,
            "    {} [label={}, fillcolor={}];",
            quote(&format!("device {d}")),
            quote(device.name()),
            quote(PALETTE[d % PALETTE.len()])
        );
    }
    out.push_str("  }\n}\n");
    out
}
