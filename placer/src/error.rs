//! The placer's error type: one variant per TensorFlow error class, each naming the
//! node, the devices involved, and the constraint that led there.

use std::fmt;

use crate::MergeConflict;

/// Why two nodes had to share a device.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Constraint {
    /// Both are in colocation group `loc:@group`.
    Group {
        /// The group key (a node name, or a name no node has).
        group: String,
    },
    /// A ref or resource edge `src → dst`.
    ResourceEdge {
        /// Source node.
        src: String,
        /// Destination node.
        dst: String,
    },
}

impl fmt::Display for Constraint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Constraint::Group { group } => write!(f, "colocation group loc:@{group}"),
            Constraint::ResourceEdge { src, dst } => {
                write!(f, "the reference/resource edge {src} -> {dst}")
            }
        }
    }
}

/// Which device names of two groups conflict across a resource edge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NameKind {
    /// Devices the framework assigned.
    Assigned,
    /// Devices requested on resource generators.
    Resource,
}

impl fmt::Display for NameKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            NameKind::Assigned => "assigned",
            NameKind::Resource => "resource",
        })
    }
}

/// A member of a colocation group, for error reports.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GroupMember {
    /// Node name.
    pub node: String,
    /// Its op.
    pub op: String,
    /// Its requested device (empty for none).
    pub requested: String,
    /// Its framework-assigned device, if any.
    pub assigned: Option<String>,
}

fn members(list: &[GroupMember]) -> String {
    list.iter()
        .map(|m| {
            let mut s = format!("{} ({}) '{}'", m.node, m.op, m.requested);
            if let Some(a) = &m.assigned {
                s.push_str(&format!(" assigned {a}"));
            }
            s
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Everything that can go wrong while reading a graph or placing it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A vocabulary value (dtype, shape, device id) in the input was invalid.
    #[error(transparent)]
    Types(#[from] meshwork_types::Error),
    /// A device name that TF's `ParseFullName` rejects.
    #[error("malformed device name '{input}'")]
    MalformedDeviceName {
        /// The text as given.
        input: String,
    },

    // ---- inputs ----------------------------------------------------------------------
    /// A device-set entry that is not a fully specified name.
    #[error("device '{name}' is not fully specified (/job:J/replica:R/task:T/device:TYPE:ID)")]
    PartialDeviceName {
        /// The name.
        name: String,
    },
    /// A device listed twice.
    #[error("device '{name}' is listed twice")]
    DuplicateDevice {
        /// The name.
        name: String,
    },
    /// A device name that is not in the device set.
    #[error("no device '{name}' in the device set")]
    UnknownDevice {
        /// The name.
        name: String,
    },
    /// Two nodes with one name.
    #[error("two nodes are named '{name}'")]
    DuplicateNode {
        /// The name.
        name: String,
    },
    /// An edge to or from a node the graph does not have.
    #[error("edge between '{referenced_by}' and '{name}': no node is named '{name}'")]
    UnknownNode {
        /// The missing node.
        name: String,
        /// The node at the other end of the edge.
        referenced_by: String,
    },
    /// A node whose op the registry does not know.
    #[error("node '{node}' uses op '{op}', which is not registered")]
    UnknownOp {
        /// The node.
        node: String,
        /// The op.
        op: String,
    },
    /// A data edge into an input the op does not have, or out of a missing output.
    #[error(
        "edge {src}:{src_output} -> {node}:{input}: op '{op}' has {inputs} inputs and '{src}' has {outputs} outputs"
    )]
    BadEdge {
        /// Destination node.
        node: String,
        /// Its op.
        op: String,
        /// The input index used.
        input: usize,
        /// Inputs the op has.
        inputs: usize,
        /// Source node.
        src: String,
        /// The output index used.
        src_output: usize,
        /// Outputs the source's op has.
        outputs: usize,
    },
    /// An op input that no edge feeds.
    #[error("input {input} of node '{node}' (op '{op}') is not fed")]
    MissingInput {
        /// The node.
        node: String,
        /// Its op.
        op: String,
        /// The input.
        input: usize,
    },
    /// Two data edges into one input.
    #[error("input {input} of node '{node}' is fed twice")]
    DuplicateInput {
        /// The node.
        node: String,
        /// The input.
        input: usize,
    },
    /// The graph has a cycle through this node.
    #[error("the graph has a cycle through node '{node}'")]
    Cycle {
        /// A node on the cycle.
        node: String,
    },
    /// JSON that does not parse or does not have the expected fields.
    #[error("invalid JSON at line {line}, column {column}: {message}")]
    Json {
        /// Line (1-based).
        line: usize,
        /// Column (1-based).
        column: usize,
        /// serde's description.
        message: String,
    },
    /// The device set is empty.
    #[error("No devices are registered")]
    NoDevices,

    // ---- TF's placement errors ------------------------------------------------------
    /// A requested device that does not parse (TF: "Malformed device specification").
    #[error("Malformed device specification '{spec}' in node {node}")]
    MalformedDeviceSpec {
        /// The node.
        node: String,
        /// The request.
        spec: String,
    },
    /// An assigned device that does not parse.
    #[error("Malformed assigned device '{device}' on node {node}")]
    MalformedAssignedDevice {
        /// The node.
        node: String,
        /// The assigned device.
        device: String,
    },
    /// An assigned device that is not in the device set (partial names included).
    #[error("Assigned device '{device}' does not match any device (node {node}); available devices are [{}]", available.join(", "))]
    AssignedDeviceNotFound {
        /// The node.
        node: String,
        /// The assigned device.
        device: String,
        /// The device set.
        available: Vec<String>,
    },
    /// An assigned device of a type the node has no kernel for.
    #[error(
        "Assigned device '{device}' does not have registered OpKernel support for {op} (node {node})"
    )]
    AssignedDeviceUnsupported {
        /// The node.
        node: String,
        /// The assigned device.
        device: String,
        /// The op.
        op: String,
    },
    /// No device type in the set has a kernel for the op.
    #[error("No OpKernel was registered to support Op '{op}' used by {{{{node {node}}}}}; registered devices: [{}]", device_types.join(", "))]
    NoKernel {
        /// The node.
        node: String,
        /// The op.
        op: String,
        /// Device types in the set.
        device_types: Vec<String>,
    },
    /// Colocating two nodes would merge incompatible device requests.
    #[error(
        "Cannot colocate nodes {{{{colocation_node {node}}}}} and {{{{colocation_node {other}}}}}: {conflict} (required by {constraint})"
    )]
    CannotColocate {
        /// The node being colocated.
        node: String,
        /// The node (group) it was colocated with.
        other: String,
        /// Why they had to be colocated.
        constraint: Box<Constraint>,
        /// The conflicting names.
        conflict: MergeConflict,
    },
    /// Colocating two nodes leaves no device type that supports both groups.
    #[error("Cannot colocate nodes {{{{colocation_node {node}}}}} and {{{{colocation_node {other}}}}} because no device type supports both of those nodes and the other nodes colocated with them. Supported types: [{}] vs [{}] (required by {constraint})", node_types.join(", "), other_types.join(", "))]
    NoCommonDeviceType {
        /// The node being colocated.
        node: String,
        /// The node (group) it was colocated with.
        other: String,
        /// Why they had to be colocated.
        constraint: Box<Constraint>,
        /// Device types the node's group supports.
        node_types: Vec<String>,
        /// Device types the other group supports.
        other_types: Vec<String>,
    },
    /// A ref/resource edge joins groups pinned to incompatible devices (an error even
    /// with soft placement).
    #[error(
        "Cannot place the graph because a reference or resource edge connects colocation groups with incompatible {kind} devices: {src_device} vs {dst_device}. The edge src node is {src}, and the dst node is {dst}."
    )]
    ResourceEdgeIncompatible {
        /// Source node.
        src: String,
        /// Destination node.
        dst: String,
        /// Which names conflict.
        kind: NameKind,
        /// The source group's name.
        src_device: String,
        /// The destination group's name.
        dst_device: String,
    },
    /// Colocating the two ends of a ref/resource edge failed.
    #[error(
        "Nodes were connected by a reference or resource connection (requiring them to be on the same device), but the two nodes were assigned two different devices: {cause}"
    )]
    RefEdgeColocation {
        /// Source node.
        src: String,
        /// Destination node.
        dst: String,
        /// What failed.
        cause: Box<Error>,
    },
    /// The node's own request matches no device.
    #[error("Cannot assign a device for operation {node}: {{{{node {node}}}}} was explicitly assigned to {requested} but available devices are [ {} ]. Make sure the device specification refers to a valid device.{}", available.join(", "), if *looks_like_gpu { " The requested device appears to be a GPU, but no device of that type is registered (device types are case-sensitive)." } else { "" })]
    ExplicitDeviceNotFound {
        /// The node.
        node: String,
        /// Its request.
        requested: String,
        /// The device set, sorted.
        available: Vec<String>,
        /// The request names a `gpu`-like type (any case) that no device has.
        looks_like_gpu: bool,
    },
    /// The node's request matches devices, none of a type with a kernel.
    #[error(
        "Cannot assign a device for operation {node}: Could not satisfy explicit device specification '{requested}' because no supported kernel for {device_type} devices is available (op {op})"
    )]
    NoKernelForRequestedType {
        /// The node.
        node: String,
        /// Its request.
        requested: String,
        /// The requested type.
        device_type: String,
        /// The op.
        op: String,
    },
    /// The node's (typeless) request matches devices, none supported.
    #[error(
        "Cannot assign a device for operation {node}: Could not satisfy explicit device specification '{requested}'"
    )]
    CouldNotSatisfy {
        /// The node.
        node: String,
        /// Its request.
        requested: String,
    },
    /// The node's colocation group requires a device nothing satisfies.
    #[error("Cannot assign a device for operation {node}: Could not satisfy explicit device specification '{requested}' because the node {{{{colocation_node {node}}}}} was colocated with a group of nodes that required incompatible device '{group_requested}'. All available devices [{}]. Group: {}", available.join(", "), members(.group))]
    IncompatibleGroup {
        /// The node.
        node: String,
        /// Its own request.
        requested: String,
        /// The group's merged request.
        group_requested: String,
        /// The device set.
        available: Vec<String>,
        /// The group's members and their requests.
        group: Vec<GroupMember>,
    },
    /// No device supports every node of the group.
    #[error(
        "Cannot assign a device for operation {node}: Node had no OpKernel registered to support this operation: Operation was {op}"
    )]
    NoSupportedDevice {
        /// The node.
        node: String,
        /// Its op.
        op: String,
    },
    /// Cost-aware placement: no allowed device has memory left for the group.
    #[error("no device allowed for node {node}'s colocation group has {group_bytes} bytes of memory left (allowed: [{}])", devices.join(", "))]
    MemoryCapExceeded {
        /// A node of the group.
        node: String,
        /// Bytes the whole group needs.
        group_bytes: u64,
        /// The allowed devices.
        devices: Vec<String>,
    },
    /// A placement moved a node to a device its constraints do not allow, or split a
    /// colocation group ([`Placement::with_devices`](crate::Placement::with_devices)).
    #[error("node {node} cannot go to device {device}: {problem}")]
    Disallowed {
        /// The node.
        node: String,
        /// The device index it was given.
        device: usize,
        /// What is wrong.
        problem: String,
    },
    /// A framework-assigned device conflicts with its group's assignment.
    #[error(
        "Constraining by assigned device should not cause an error: node {node} is assigned '{device}' but its group is pinned to '{group_device}'"
    )]
    AssignedConflict {
        /// The node.
        node: String,
        /// Its assigned device.
        device: String,
        /// The group's device.
        group_device: String,
    },
}

impl Error {
    /// TF's error class for this error (the oracle's `error_class`).
    pub fn tf_class(&self) -> &'static str {
        match self {
            Error::MalformedDeviceSpec { .. } => "malformed_device_spec",
            Error::MalformedAssignedDevice { .. } => "malformed_assigned_device",
            Error::AssignedDeviceNotFound { .. } => "assigned_device_not_found",
            Error::AssignedDeviceUnsupported { .. } => "assigned_device_unsupported",
            Error::NoKernel { .. } => "no_kernel_registered",
            Error::CannotColocate { .. } => "cannot_colocate_merge",
            Error::NoCommonDeviceType { .. } => "cannot_colocate_no_common_type",
            Error::ResourceEdgeIncompatible { kind: NameKind::Assigned, .. } => {
                "resource_edge_incompatible_assigned"
            }
            Error::ResourceEdgeIncompatible { kind: NameKind::Resource, .. } => {
                "resource_edge_incompatible_resource"
            }
            Error::RefEdgeColocation { .. } => "ref_edge_colocation_failed",
            Error::ExplicitDeviceNotFound { .. } => "explicit_device_not_found",
            Error::NoKernelForRequestedType { .. } => "no_supported_kernel_for_requested_type",
            Error::CouldNotSatisfy { .. } => "could_not_satisfy",
            Error::IncompatibleGroup { .. } => "colocated_with_incompatible_group",
            Error::NoSupportedDevice { .. } => "node_had_no_kernel",
            Error::AssignedConflict { .. } => "assigned_conflict",
            Error::MemoryCapExceeded { .. } => "memory_cap_exceeded",
            Error::NoDevices => "no_devices",
            _ => "invalid_input",
        }
    }

    /// The node TF attributes the error to, if any.
    pub fn node(&self) -> Option<&str> {
        match self {
            Error::MalformedDeviceSpec { node, .. }
            | Error::MalformedAssignedDevice { node, .. }
            | Error::AssignedDeviceNotFound { node, .. }
            | Error::AssignedDeviceUnsupported { node, .. }
            | Error::NoKernel { node, .. }
            | Error::CannotColocate { node, .. }
            | Error::NoCommonDeviceType { node, .. }
            | Error::ExplicitDeviceNotFound { node, .. }
            | Error::NoKernelForRequestedType { node, .. }
            | Error::CouldNotSatisfy { node, .. }
            | Error::IncompatibleGroup { node, .. }
            | Error::NoSupportedDevice { node, .. }
            | Error::AssignedConflict { node, .. }
            | Error::MemoryCapExceeded { node, .. }
            | Error::Disallowed { node, .. }
            | Error::UnknownOp { node, .. }
            | Error::BadEdge { node, .. }
            | Error::DuplicateInput { node, .. }
            | Error::MissingInput { node, .. }
            | Error::Cycle { node } => Some(node),
            Error::RefEdgeColocation { dst, .. } => Some(dst),
            _ => None,
        }
    }

    /// The two nodes an error about a pair of nodes names, in TF's order: the nodes of
    /// `Cannot colocate nodes A and B` (also when that is the cause of a failed
    /// ref/resource edge: its source, then its destination), or a ref/resource edge's
    /// source and destination.
    pub fn node_pair(&self) -> Option<(&str, &str)> {
        match self {
            Error::CannotColocate { node, other, .. }
            | Error::NoCommonDeviceType { node, other, .. } => Some((node, other)),
            Error::RefEdgeColocation { cause, .. } => cause.node_pair(),
            Error::ResourceEdgeIncompatible { src, dst, .. } => Some((src, dst)),
            _ => None,
        }
    }

    /// The two device names whose merge failed (TF's `Cannot merge devices with
    /// incompatible ...`), also when that is the cause of a failed ref/resource edge.
    pub fn merge_conflict(&self) -> Option<&MergeConflict> {
        match self {
            Error::CannotColocate { conflict, .. } => Some(conflict),
            Error::RefEdgeColocation { cause, .. } => cause.merge_conflict(),
            _ => None,
        }
    }
}

/// `Result` with the placer's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
