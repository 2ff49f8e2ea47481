//! meshwork's placer: assigns every op of a dataflow graph to a device.
//!
//! It makes the decisions TensorFlow 2.21's placer makes — device-name specs and their
//! merges, colocation groups built from `loc:@` lists and ref/resource edges, kernel
//! support per device type, soft placement — and reports the same failures as typed
//! errors that name the nodes and the chain of constraints. On top of that it can choose
//! by cost among the devices the constraints allow.
//!
//! It is **not** an executor: it never runs an op, and it knows nothing of the executor's
//! kernels except through the op registry trait it owns. It does not shard tensors (that
//! is `meshwork-sharding`).
//!
//! The graph, registry and placement API arrive with the placer issue; so far the crate
//! holds its error type:
//!
//! ```
//! use meshwork_placer::Error;
//! use meshwork_types::Shape;
//!
//! let err: Error = "[2,x]".parse::<Shape>().unwrap_err().into();
//! assert!(err.to_string().contains("dimension 1"));
//! ```

mod cost;
mod device;
mod error;
mod graph;
mod json;
mod name;
mod place;
mod registry;

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
