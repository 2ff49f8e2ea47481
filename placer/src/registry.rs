//! What the placer needs to know about ops: their input/output kinds, which device
//! types have kernels for them (with kernel priorities), and TF's op flags.

use std::collections::HashMap;

/// How a tensor is passed: by value, by reference (TF1 `Ref(T)`), or as a resource
/// handle. Ref and resource edges force colocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ArgKind {
    /// A plain tensor.
    Value,
    /// A reference to a (TF1) variable's buffer.
    Ref,
    /// A resource handle (`DT_RESOURCE`).
    Resource,
}

/// A kernel registration: the op runs on `device_type`, preferred by `priority`
/// (higher first; 0 when unset).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Kernel {
    /// The device type (`CPU`, `GPU`, …).
    pub device_type: String,
    /// Kernel priority; higher wins over device-type priority.
    pub priority: i32,
}

/// An op as the placer sees it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct OpDef {
    /// Kinds of the op's inputs, in order.
    pub inputs: Vec<ArgKind>,
    /// Kinds of the op's outputs, in order.
    pub outputs: Vec<ArgKind>,
    /// Kernels, one per supported device type.
    pub kernels: Vec<Kernel>,
    /// The op only reads metadata of its input (Shape, Size, Rank): TF places it with
    /// its input.
    pub is_metadata: bool,
    /// The op is an identity (TF's identity heuristic applies).
    pub is_identity: bool,
    /// Ref/resource inputs do not force colocation (TF's
    /// `InputColocationExemptionRegistry`: IdentityN, PartitionedCall, …).
    pub input_colocation_exempt: bool,
}

impl OpDef {
    /// An op with these input and output kinds, kernels for `device_types` (priority 0)
    /// and no flags.
    pub fn new(inputs: &[ArgKind], outputs: &[ArgKind], device_types: &[&str]) -> OpDef {
        OpDef {
            inputs: inputs.to_vec(),
            outputs: outputs.to_vec(),
            kernels: device_types
                .iter()
                .map(|t| Kernel { device_type: (*t).to_owned(), priority: 0 })
                .collect(),
            ..OpDef::default()
        }
    }

    /// TF's `IsGeneratorNode`: no inputs and one output that is not a ref. The placer
    /// places such nodes last, next to their consumers.
    pub fn is_generator(&self) -> bool {
        self.inputs.is_empty() && self.outputs.len() == 1 && self.outputs[0] != ArgKind::Ref
    }

    /// TF's `IsRefOrResourceGeneratorNode`: no inputs and one ref or resource output. A
    /// requested device on such a node is treated like an assignment.
    pub fn is_ref_or_resource_generator(&self) -> bool {
        self.inputs.is_empty() && self.outputs.len() == 1 && self.outputs[0] != ArgKind::Value
    }
}

/// Where the placer looks up ops. The executor's kernels implement it; [`Registry`] is
/// a ready-made map.
pub trait OpRegistry {
    /// The op called `name`, if registered.
    fn op(&self, name: &str) -> Option<&OpDef>;
}

impl<R: OpRegistry + ?Sized> OpRegistry for &R {
    fn op(&self, name: &str) -> Option<&OpDef> {
        (**self).op(name)
    }
}

/// A map from op names to [`OpDef`]s.
#[derive(Debug, Clone, Default)]
pub struct Registry {
    ops: HashMap<String, OpDef>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Registry {
        Registry::default()
    }

    /// Registers (or replaces) `op`.
    pub fn insert(&mut self, name: &str, op: OpDef) -> &mut Registry {
        self.ops.insert(name.to_owned(), op);
        self
    }
}

impl OpRegistry for Registry {
    fn op(&self, name: &str) -> Option<&OpDef> {
        self.ops.get(name)
    }
}
