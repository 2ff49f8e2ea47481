//! JSON in and out: graphs in the format of the TensorFlow oracle's cases, op catalogs,
//! and placements.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{ArgKind, DeviceSet, Error, Graph, Kernel, Node, OpDef, Placement, Registry, Result};

/// A data input of a node: `src:src_output`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InputJson {
    /// The producing node.
    pub src: String,
    /// Its output index.
    #[serde(default)]
    pub src_output: usize,
}

/// A node as JSON (the oracle's format; unknown fields are ignored).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeJson {
    /// Unique name.
    pub name: String,
    /// Op name.
    pub op: String,
    /// Requested device, `""` for none.
    #[serde(default)]
    pub requested_device: String,
    /// Framework-assigned device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub assigned_device: Option<String>,
    /// `loc:@` targets without the prefix.
    #[serde(default)]
    pub colocation: Vec<String>,
    /// Data inputs in input order.
    #[serde(default)]
    pub inputs: Vec<InputJson>,
    /// Control inputs.
    #[serde(default)]
    pub control_inputs: Vec<String>,
}

/// A graph as JSON: nodes in id order, each with its inputs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct GraphJson {
    /// The nodes.
    pub nodes: Vec<NodeJson>,
}

impl GraphJson {
    /// Builds the graph: nodes in order, then for each node (in order) its data inputs
    /// and its control inputs (TF's edge order).
    pub fn to_graph(&self) -> Result<Graph> {
        let mut graph = Graph::new();
        for n in &self.nodes {
            graph.add_node(Node {
                name: n.name.clone(),
                op: n.op.clone(),
                requested_device: n.requested_device.clone(),
                assigned_device: n.assigned_device.clone(),
                colocation: n.colocation.clone(),
            })?;
        }
        for n in &self.nodes {
            for (k, input) in n.inputs.iter().enumerate() {
                graph.add_edge(&input.src, input.src_output, &n.name, k)?;
            }
            for c in &n.control_inputs {
                graph.add_control_edge(c, &n.name)?;
            }
        }
        Ok(graph)
    }

    /// The JSON form of `graph`.
    pub fn from_graph(graph: &Graph) -> GraphJson {
        let mut nodes: Vec<NodeJson> = graph
            .nodes()
            .map(|(_, n)| NodeJson {
                name: n.name.clone(),
                op: n.op.clone(),
                requested_device: n.requested_device.clone(),
                assigned_device: n.assigned_device.clone(),
                colocation: n.colocation.clone(),
                inputs: Vec::new(),
                control_inputs: Vec::new(),
            })
            .collect();
        let mut data: Vec<Vec<(usize, InputJson)>> = vec![Vec::new(); nodes.len()];
        for (src, dst, edge) in graph.edges() {
            let src_name = graph.node(src).name.clone();
            match edge {
                crate::Edge::Data { src_output, dst_input } => {
                    data[dst.index()].push((dst_input, InputJson { src: src_name, src_output }))
                }
                crate::Edge::Control => nodes[dst.index()].control_inputs.push(src_name),
            }
        }
        for (node, mut inputs) in nodes.iter_mut().zip(data) {
            inputs.sort_by_key(|(k, _)| *k);
            node.inputs = inputs.into_iter().map(|(_, i)| i).collect();
        }
        GraphJson { nodes }
    }
}

/// Parses a graph from JSON text (`{"nodes": [...]}`).
pub fn graph_from_json(text: &str) -> Result<Graph> {
    let parsed: GraphJson = serde_json::from_str(text).map_err(json_error)?;
    parsed.to_graph()
}

/// An op in the oracle's catalog format.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpJson {
    /// Input kinds: `float`, `float_ref`, `resource`, `int32`, `string`, … (`*_ref` is a
    /// ref, `resource` a resource handle, anything else a value).
    pub inputs: Vec<String>,
    /// Output kinds.
    pub outputs: Vec<String>,
    /// Device types with kernels, in TF's priority order.
    pub supported_device_types: Vec<String>,
    /// Kernel priorities per type, if any (default 0).
    #[serde(default)]
    pub kernel_priorities: BTreeMap<String, i32>,
    /// TF's identity flag.
    #[serde(default)]
    pub is_identity: bool,
    /// TF's metadata flag.
    #[serde(default)]
    pub is_metadata: bool,
    /// Exempt from ref/resource input colocation.
    #[serde(default)]
    pub input_colocation_exempt: bool,
}

fn kind(s: &str) -> ArgKind {
    if s == "resource" {
        ArgKind::Resource
    } else if s.ends_with("_ref") {
        ArgKind::Ref
    } else {
        ArgKind::Value
    }
}

/// A registry from an op catalog (`{"OpName": {...}, ...}`).
pub fn registry_from_catalog(catalog: &BTreeMap<String, OpJson>) -> Registry {
    let mut registry = Registry::new();
    for (name, op) in catalog {
        registry.insert(
            name,
            OpDef {
                inputs: op.inputs.iter().map(|s| kind(s)).collect(),
                outputs: op.outputs.iter().map(|s| kind(s)).collect(),
                kernels: op
                    .supported_device_types
                    .iter()
                    .map(|t| Kernel {
                        device_type: t.clone(),
                        priority: op.kernel_priorities.get(t).copied().unwrap_or(0),
                    })
                    .collect(),
                is_metadata: op.is_metadata,
                is_identity: op.is_identity,
                input_colocation_exempt: op.input_colocation_exempt,
            },
        );
    }
    registry
}

/// A placement as JSON: node name → full device name, in node order.
pub fn placement_to_json(
    graph: &Graph,
    devices: &DeviceSet,
    placement: &Placement,
) -> serde_json::Value {
    let map: serde_json::Map<String, serde_json::Value> = graph
        .nodes()
        .map(|(id, n)| {
            (
                n.name.clone(),
                serde_json::Value::String(
                    devices.devices()[placement.device(id)].name().to_owned(),
                ),
            )
        })
        .collect();
    serde_json::Value::Object(map)
}

pub(crate) fn json_error(e: serde_json::Error) -> Error {
    Error::Json { line: e.line(), column: e.column(), message: e.to_string() }
}
