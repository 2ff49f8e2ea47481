//! meshwork's placer: assigns every op of a dataflow graph to a device.
//!
//! [`place`] makes the decisions TensorFlow 2.21's placer makes — device-name specs and
//! their merges ([`DeviceName`]), colocation groups built from ref/resource edges and
//! `loc:@` lists (union-find, in TF's order), kernel support per device type with kernel
//! and type priorities, soft placement, TF's generator/metadata/identity heuristics —
//! and reports TF's failures as typed [`Error`]s that name the node, the devices and
//! the constraint. It matches TensorFlow on the vendored oracle (300 cases) and on TF's
//! own placer tests. Beyond TF: [`place_with_cost`] chooses among the devices the
//! constraints allow by an estimated schedule under memory caps, [`explain`] says why a
//! node landed where it did, [`to_dot`] draws the result, and graphs load from JSON.
//!
//! It is **not** an executor: it never runs an op, and it knows the executor's kernels
//! only through the [`OpRegistry`] trait it owns. It does not shard tensors (that is
//! `meshwork-sharding`), and it does not look inside function-call ops (TF's
//! `InspectingPlacer`).
//!
//! ```
//! use meshwork_placer::{ArgKind, DeviceSet, Graph, Node, OpDef, PlacerOptions, Registry, place};
//!
//! let mut ops = Registry::new();
//! ops.insert("VarHandleOp", OpDef::new(&[], &[ArgKind::Resource], &["CPU", "GPU"]))
//!     .insert("ReadVariableOp", OpDef::new(&[ArgKind::Resource], &[ArgKind::Value], &["CPU", "GPU"]));
//! let mut graph = Graph::new();
//! graph.add_node(Node::new("w", "VarHandleOp").on("/device:CPU:0"))?;
//! graph.add_node(Node::new("read", "ReadVariableOp"))?;
//! graph.add_edge("w", 0, "read", 0)?;
//! let devices = DeviceSet::new(&[
//!     "/job:localhost/replica:0/task:0/device:CPU:0",
//!     "/job:localhost/replica:0/task:0/device:GPU:0",
//! ])?;
//! let placement = place(&graph, &devices, &ops, PlacerOptions::default())?;
//! // The resource edge keeps the read with its variable, off the preferred GPU.
//! let read = graph.id("read").unwrap();
//! assert_eq!(devices.devices()[placement.device(read)].name(), "/job:localhost/replica:0/task:0/device:CPU:0");
//! # Ok::<(), meshwork_placer::Error>(())
//! ```

mod cost;
mod device;
mod error;
mod graph;
mod json;
mod name;
mod place;
mod registry;
mod report;

pub use cost::{CostModel, CostPlacement, OpCost, TableCostModel, place_with_cost};
pub use device::{COMPOSITE, DEFAULT_TYPE_PRIORITIES, Device, DeviceSet};
pub use error::{Constraint, Error, GroupMember, NameKind, Result};
pub use graph::{Edge, Graph, Node, NodeId};
pub use json::{
    GraphJson, InputJson, NodeJson, OpJson, graph_from_json, placement_to_json,
    registry_from_catalog,
};
pub use name::{DeviceName, MergeConflict, MergeMode, NameField, compare_full_names};
pub use place::{LogEntry, Placement, PlacerOptions, Reason, place};
pub use registry::{ArgKind, Kernel, OpDef, OpRegistry, Registry};
pub use report::{Explanation, explain, table, to_dot};
