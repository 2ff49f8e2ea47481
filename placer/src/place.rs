//! The placer: TF's `ColocationGraph` (union-find groups with merged device names and
//! supported types) and `Placer::Run` (two passes with TF's heuristics).

use rustc_hash::FxHashMap;

use crate::device::COMPOSITE;
use crate::error::{Constraint, GroupMember, NameKind};
use crate::graph::EMPTY;
use crate::{
    ArgKind, DeviceName, DeviceSet, Edge, Error, Graph, MergeMode, NodeId, OpDef, OpRegistry,
    Result,
};

/// Placement options (TF's `ConfigProto` flags).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PlacerOptions {
    /// Let the placer relax a request's device type and id when nothing matches, and
    /// drop colocations that cannot hold (TF's `allow_soft_placement`; off by default,
    /// as in TF).
    pub allow_soft_placement: bool,
    /// Record why each node went where it did (TF's `log_device_placement`).
    pub log_device_placement: bool,
}

/// How a node's device was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// The framework had already assigned it.
    PreAssigned,
    /// The first of the candidate devices.
    FirstCandidate,
    /// A metadata op placed with its input.
    FollowsInput,
    /// An identity placed with its input (input and output request the same device).
    IdentityFollowsInput,
    /// A generator placed with all its consumers.
    FollowsConsumers,
}

/// One line of the placement log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogEntry {
    /// The node.
    pub node: NodeId,
    /// Its device (index into the device set).
    pub device: usize,
    /// How it was chosen.
    pub reason: Reason,
    /// The candidates it was chosen from, best first.
    pub candidates: Vec<usize>,
}

/// The outcome: a device per node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    devices: Vec<usize>,
    groups: Vec<u32>,
    /// Per group root: the candidate list its first member was placed from.
    allowed: Vec<u32>,
    lists: Vec<Vec<u32>>,
    log: Vec<LogEntry>,
}

impl Placement {
    /// The device (index into the device set) of every node, in node-id order.
    pub fn devices(&self) -> &[usize] {
        &self.devices
    }

    /// The device index of `node`.
    pub fn device(&self, node: NodeId) -> usize {
        self.devices[node.index()]
    }

    /// The colocation group of every node (the id of its group's root node).
    pub fn groups(&self) -> &[u32] {
        &self.groups
    }

    /// The devices the constraints allowed `node`'s colocation group, best first (TF
    /// picks the first unless a heuristic applies). A pre-assigned group allows only its
    /// device.
    pub fn allowed(&self, node: NodeId) -> &[u32] {
        let root = self.groups[node.index()] as usize;
        &self.lists[self.allowed[root] as usize]
    }

    /// The placement log (empty unless `log_device_placement` was set).
    pub fn log(&self) -> &[LogEntry] {
        &self.log
    }

    /// This placement with its nodes on `devices` (one device index per node of
    /// `graph`) — a cost-aware pass's choice ([`place_with_cost`](crate::place_with_cost))
    /// — checked to keep TensorFlow's constraints: every node on a device its group is
    /// allowed, every colocation group on one device. The log is TF's.
    pub fn with_devices(&self, graph: &Graph, devices: Vec<usize>) -> Result<Placement> {
        let name = |i: usize| graph.node(NodeId(i as u32)).name.clone();
        if devices.len() != self.devices.len() {
            return Err(Error::Disallowed {
                node: String::new(),
                device: devices.len(),
                problem: format!("{} devices for {} nodes", devices.len(), self.devices.len()),
            });
        }
        for (i, &d) in devices.iter().enumerate() {
            let root = self.groups[i] as usize;
            if !self.allowed(NodeId(i as u32)).contains(&(d as u32)) {
                return Err(Error::Disallowed {
                    node: name(i),
                    device: d,
                    problem: "its colocation group's constraints do not allow it".into(),
                });
            }
            if devices[root] != d {
                return Err(Error::Disallowed {
                    node: name(i),
                    device: d,
                    problem: format!(
                        "its colocation group ({}) is on {}",
                        name(root),
                        devices[root]
                    ),
                });
            }
        }
        Ok(Placement { devices, ..self.clone() })
    }
}

/// Places every node of `graph` on a device of `devices`, exactly as TensorFlow 2.21's
/// placer does.
pub fn place(
    graph: &Graph,
    devices: &DeviceSet,
    registry: &dyn OpRegistry,
    options: PlacerOptions,
) -> Result<Placement> {
    if devices.devices().is_empty() {
        return Err(Error::NoDevices);
    }
    let mut state = State::new(graph, devices, registry, options)?;
    state.initialize()?;
    state.run()
}

/// A prioritised device-type list: (type index, kernel priority).
type Types = Vec<(u16, i32)>;

#[derive(Debug, Clone, Default)]
struct Names {
    requested: DeviceName,
    assigned: DeviceName,
    resource: DeviceName,
}

/// "No value" for the `u32` indices below.
const NONE: u32 = u32::MAX;

/// A union-find node. Plain indices, no ownership: a million of them are 28 MB and
/// dropping them is free.
#[derive(Debug, Clone, Copy)]
struct Member {
    parent: u32,
    rank: u32,
    /// Index into `State::names`; 0 is the empty entry. Entries are shared (identical
    /// requests point at one) and never changed in place: a change adds an entry.
    names: u32,
    /// The group's device once assigned, or `NONE`. The names then hold it too: until
    /// `pinned_merged`, only implicitly (see [`State::names_of`]).
    pinned: u32,
    pinned_merged: bool,
    /// Index into `State::type_lists`.
    supported: u32,
    /// Index into `State::candidates`, or `NONE` until computed.
    possible: u32,
}

struct State<'a> {
    graph: &'a Graph,
    set: &'a DeviceSet,
    options: PlacerOptions,
    ops: Vec<&'a OpDef>,
    /// Device types in priority order, and per device its type index.
    types: Vec<String>,
    type_priority: Vec<i32>,
    device_type: Vec<u16>,
    composite: Vec<bool>,
    /// Per device type: whether it is an XLA type.
    xla_type: Vec<bool>,
    local_address: DeviceName,
    members: Vec<Member>,
    /// In-edge sources per node (CSR): data inputs in input order, then control inputs.
    in_start: Vec<u32>,
    in_src: Vec<u32>,
    /// Out-edge destinations per node (CSR), in edge order.
    out_start: Vec<u32>,
    out_dst: Vec<u32>,
    /// Per node: pre-assigned device index.
    assigned: Vec<Option<u32>>,
    /// Group device names (entry 0: all empty).
    names: Vec<Names>,
    /// Per device: the `names` entry with every name equal to it, once made.
    device_names: Vec<u32>,
    /// Every distinct supported-types list, and the index of each.
    type_lists: Vec<Types>,
    type_ids: FxHashMap<Types, u32>,
    /// Candidate-device lists, best first.
    candidates: Vec<Vec<u32>>,
    /// Candidates for groups with no request, by supported-types list.
    unconstrained: Vec<u32>,
    /// Candidates for requested groups, by (names entry, supported-types list), and by
    /// (request, supported-types list) for entries with equal requests.
    constrained: FxHashMap<(u32, u32), u32>,
    constrained_by_request: FxHashMap<(DeviceName, u32), u32>,
}

fn merge_err(
    node: &str,
    other: &str,
    constraint: &dyn Fn() -> Constraint,
    conflict: crate::MergeConflict,
) -> Error {
    Error::CannotColocate {
        node: node.to_owned(),
        other: other.to_owned(),
        constraint: Box::new(constraint()),
        conflict,
    }
}

impl<'a> State<'a> {
    fn new(
        graph: &'a Graph,
        set: &'a DeviceSet,
        registry: &'a dyn OpRegistry,
        options: PlacerOptions,
    ) -> Result<State<'a>> {
        let n = graph.len();
        let interned = graph.interned();
        let (op_ids, strings) = (interned.op_ids, interned.strings);
        let mut resolved: Vec<Option<&OpDef>> = vec![None; strings.len()];
        let mut ops = Vec::with_capacity(n);
        for (i, &op) in op_ids.iter().enumerate() {
            let def = match resolved[op as usize] {
                Some(def) => def,
                None => {
                    let def = registry.op(&strings[op as usize]).ok_or_else(|| {
                        let node = graph.node(NodeId(i as u32));
                        Error::UnknownOp { node: node.name.clone(), op: node.op.clone() }
                    })?;
                    resolved[op as usize] = Some(def);
                    def
                }
            };
            ops.push(def);
        }
        let types = set.prioritized_types();
        let type_priority = types.iter().map(|t| set.type_priority(t)).collect();
        let device_type = set
            .devices()
            .iter()
            .map(|d| {
                types
                    .iter()
                    .position(|t| t == d.device_type())
                    .expect("every device's type is listed") as u16
            })
            .collect();
        let composite = set.devices().iter().map(|d| d.device_type() == COMPOSITE).collect();
        let local_address =
            set.default_local_device().map(|d| d.parsed().address_space()).unwrap_or_default();
        let mut state = State {
            graph,
            set,
            options,
            ops,
            types,
            type_priority,
            device_type,
            composite,
            local_address,
            members: Vec::with_capacity(n),
            in_start: Vec::new(),
            in_src: Vec::new(),
            out_start: Vec::new(),
            out_dst: Vec::new(),
            assigned: vec![None; n],
            names: vec![Names::default()],
            device_names: vec![NONE; set.devices().len()],
            type_lists: Vec::new(),
            type_ids: FxHashMap::default(),
            candidates: Vec::new(),
            unconstrained: Vec::new(),
            constrained: FxHashMap::default(),
            constrained_by_request: FxHashMap::default(),
            xla_type: Vec::new(),
        };
        state.xla_type = state.types.iter().map(|t| Self::is_xla(t)).collect();
        state.index_edges()?;
        Ok(state)
    }

    fn name(&self, i: u32) -> &'a str {
        &self.graph.node(NodeId(i)).name
    }

    /// Validates edges against op signatures (every input of every op fed exactly
    /// once) and builds the in/out edge lists (data inputs in input order first, as
    /// TF's `input_edge(k)`), flat, one slice per node.
    fn index_edges(&mut self) -> Result<()> {
        const UNSET: u32 = u32::MAX;
        let n = self.graph.len();
        let mut in_count: Vec<u32> = self.ops.iter().map(|op| op.inputs.len() as u32).collect();
        let mut out_count = vec![0u32; n];
        for (src, dst, edge) in self.graph.edges() {
            if edge == Edge::Control {
                in_count[dst.index()] += 1;
            }
            out_count[src.index()] += 1;
        }
        self.in_start = prefix_sums(&in_count);
        self.out_start = prefix_sums(&out_count);
        self.in_src = vec![UNSET; self.in_start[n] as usize];
        self.out_dst = vec![0; self.out_start[n] as usize];
        let mut next_control: Vec<u32> =
            (0..n).map(|i| self.in_start[i] + self.ops[i].inputs.len() as u32).collect();
        let mut next_out: Vec<u32> = self.out_start[..n].to_vec();
        for (src, dst, edge) in self.graph.edges() {
            let (s, d) = (src.index(), dst.index());
            match edge {
                Edge::Data { src_output, dst_input } => {
                    let (dst_op, src_op) = (self.ops[d], self.ops[s]);
                    if dst_input >= dst_op.inputs.len() || src_output >= src_op.outputs.len() {
                        let node = self.graph.node(dst);
                        return Err(Error::BadEdge {
                            node: node.name.clone(),
                            op: node.op.clone(),
                            input: dst_input,
                            inputs: dst_op.inputs.len(),
                            src: self.name(src.0).to_owned(),
                            src_output,
                            outputs: src_op.outputs.len(),
                        });
                    }
                    let slot = &mut self.in_src[self.in_start[d] as usize + dst_input];
                    if *slot != UNSET {
                        let node = self.name(dst.0).to_owned();
                        return Err(Error::DuplicateInput { node, input: dst_input });
                    }
                    *slot = s as u32;
                }
                Edge::Control => {
                    self.in_src[next_control[d] as usize] = s as u32;
                    next_control[d] += 1;
                }
            }
            self.out_dst[next_out[s] as usize] = d as u32;
            next_out[s] += 1;
        }
        for i in 0..n {
            let start = self.in_start[i] as usize;
            let inputs = &self.in_src[start..start + self.ops[i].inputs.len()];
            if let Some(input) = inputs.iter().position(|&s| s == UNSET) {
                let node = self.graph.node(NodeId(i as u32));
                return Err(Error::MissingInput {
                    node: node.name.clone(),
                    op: node.op.clone(),
                    input,
                });
            }
        }
        self.check_acyclic()
    }

    /// Kahn's algorithm over the flat edge lists: a node never released lies on (or
    /// behind) a cycle.
    fn check_acyclic(&self) -> Result<()> {
        let n = self.graph.len();
        let mut indegree: Vec<u32> =
            (0..n).map(|i| self.in_start[i + 1] - self.in_start[i]).collect();
        let mut ready: Vec<u32> = (0..n as u32).filter(|&i| indegree[i as usize] == 0).collect();
        let mut released = 0;
        while let Some(i) = ready.pop() {
            released += 1;
            for &d in self.out_edges(i) {
                indegree[d as usize] -= 1;
                if indegree[d as usize] == 0 {
                    ready.push(d);
                }
            }
        }
        if released == n {
            return Ok(());
        }
        // Walk back along unreleased inputs until a node repeats: it is on a cycle.
        let mut seen = vec![false; n];
        let mut i = (0..n).find(|&i| indegree[i] > 0).expect("some node is unreleased") as u32;
        while !seen[i as usize] {
            seen[i as usize] = true;
            i = *self
                .in_edges(i)
                .iter()
                .find(|&&s| indegree[s as usize] > 0)
                .expect("an unreleased input");
        }
        Err(Error::Cycle { node: self.name(i).to_owned() })
    }

    /// Sources of a node's in-edges: data inputs in input order, then control inputs.
    fn in_edges(&self, i: u32) -> &[u32] {
        &self.in_src[self.in_start[i as usize] as usize..self.in_start[i as usize + 1] as usize]
    }

    /// Destinations of a node's out-edges.
    fn out_edges(&self, i: u32) -> &[u32] {
        &self.out_dst[self.out_start[i as usize] as usize..self.out_start[i as usize + 1] as usize]
    }

    // ---- device types ------------------------------------------------------------------

    /// TF's `SortPrioritizedDeviceTypeVector`: kernel priority, then type priority,
    /// then type name. (`types` is already in type order, so the index breaks ties.)
    fn sort_types(&self, v: &mut Types) {
        v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    }

    /// TF's `SupportedDeviceTypesForNode`.
    fn supported_for(&self, i: u32) -> Types {
        let op = self.ops[i as usize];
        let mut out: Types = Vec::new();
        for (t, name) in self.types.iter().enumerate() {
            if let Some(k) = op.kernels.iter().find(|k| &k.device_type == name) {
                out.push((t as u16, k.priority));
            }
        }
        if out.is_empty() && self.local_address.has_some_details() {
            // No local kernel, but a request for another address space: assume the
            // remote process has one.
            let requested =
                DeviceName::parse(&self.graph.node(NodeId(i)).requested_device).unwrap_or_default();
            if self.local_address.is_different_address_space(&requested) {
                out = (0..self.types.len()).map(|t| (t as u16, 0)).collect();
            }
        }
        // Stable: types keep their type order within one kernel priority.
        out.sort_by_key(|&(_, p)| std::cmp::Reverse(p));
        out
    }

    /// TF's `Member::MergeSupportedDevices`.
    fn merge_types(&self, target: &Types, other: &Types) -> Types {
        let mut t_int: Types = Vec::new();
        let mut o_int: Types = Vec::new();
        for &(ty, p) in target {
            if let Some(&o) = other.iter().find(|o| o.0 == ty) {
                t_int.push((ty, p));
                o_int.push(o);
            }
        }
        self.sort_types(&mut t_int);
        self.sort_types(&mut o_int);
        let has = |v: &Types| v.iter().any(|&(_, p)| p != 0);
        match (has(&t_int), has(&o_int)) {
            (false, false) | (true, false) => t_int,
            (false, true) => o_int,
            (true, true) => {
                if t_int.iter().map(|x| x.0).eq(o_int.iter().map(|x| x.0)) {
                    t_int
                } else {
                    let mut reset: Types = t_int.into_iter().map(|(t, _)| (t, 0)).collect();
                    self.sort_types(&mut reset);
                    reset
                }
            }
        }
    }

    /// The index of a type list (equal lists share one).
    fn intern_types(&mut self, types: Types) -> u32 {
        if let Some(&id) = self.type_ids.get(&types) {
            return id;
        }
        let id = self.type_lists.len() as u32;
        self.type_lists.push(types.clone());
        self.type_ids.insert(types, id);
        self.unconstrained.push(NONE);
        id
    }

    fn type_names(&self, v: &Types) -> Vec<String> {
        v.iter().map(|&(t, _)| self.types[t as usize].clone()).collect()
    }

    // ---- union-find ----------------------------------------------------------------------

    fn find(&mut self, i: u32) -> u32 {
        let mut root = i;
        while self.members[root as usize].parent != root {
            root = self.members[root as usize].parent;
        }
        let mut cur = i;
        while self.members[cur as usize].parent != root {
            let next = self.members[cur as usize].parent;
            self.members[cur as usize].parent = root;
            cur = next;
        }
        root
    }

    /// The root's names entry, with a lazily pinned device merged in.
    fn names_of(&mut self, root: u32) -> u32 {
        let m = self.members[root as usize];
        if m.pinned != NONE && !m.pinned_merged {
            let d = m.pinned as usize;
            if self.device_names[d] == NONE {
                let device = self.set.devices()[d].parsed().clone();
                self.device_names[d] = self.add_names(Names {
                    requested: device.clone(),
                    assigned: device.clone(),
                    resource: device,
                });
            }
            let m = &mut self.members[root as usize];
            m.names = self.device_names[d];
            m.pinned_merged = true;
        }
        self.members[root as usize].names
    }

    fn add_names(&mut self, names: Names) -> u32 {
        self.names.push(names);
        (self.names.len() - 1) as u32
    }

    /// TF's `ColocateNodes(x, y)`.
    /// `constraint` says why (built only if the colocation fails).
    fn colocate(&mut self, x: u32, y: u32, constraint: &dyn Fn() -> Constraint) -> Result<()> {
        let (xr, yr) = (self.find(x), self.find(y));
        if xr == yr {
            return Ok(());
        }
        let (new, old) = if self.members[xr as usize].rank < self.members[yr as usize].rank {
            (yr, xr)
        } else {
            (xr, yr)
        };
        let (x_name, y_name) = (self.name(x), self.name(y));
        let (new_names, old_names) = (self.names_of(new), self.names_of(old));
        if new_names != 0 || old_names != 0 {
            let mut merged = self.names[new_names as usize].clone();
            let other = &self.names[old_names as usize];
            let soft =
                if self.options.allow_soft_placement { MergeMode::Soft } else { MergeMode::Hard };
            merged
                .assigned
                .merge(&other.assigned, MergeMode::Hard)
                .map_err(|c| merge_err(x_name, y_name, constraint, c))?;
            merged
                .resource
                .merge(&other.resource, MergeMode::Hard)
                .map_err(|c| merge_err(x_name, y_name, constraint, c))?;
            merged
                .requested
                .merge(&other.requested, soft)
                .map_err(|c| merge_err(x_name, y_name, constraint, c))?;
            let (assigned, resource) = (merged.assigned.clone(), merged.resource.clone());
            merged.requested.ensure_specification(&assigned);
            merged.requested.ensure_specification(&resource);
            // TF writes the merged names before checking the types (and keeps them if
            // that check fails).
            self.members[new as usize].names = self.add_names(merged);
        }
        let (nt, ot) = (self.members[new as usize].supported, self.members[old as usize].supported);
        let merged_types = if nt == ot {
            nt
        } else {
            let merged =
                self.merge_types(&self.type_lists[nt as usize], &self.type_lists[ot as usize]);
            self.intern_types(merged)
        };
        if self.type_lists[merged_types as usize].is_empty() {
            let (xr_types, yr_types) = (
                self.type_lists[self.members[xr as usize].supported as usize].clone(),
                self.type_lists[self.members[yr as usize].supported as usize].clone(),
            );
            return Err(Error::NoCommonDeviceType {
                node: x_name.to_owned(),
                other: y_name.to_owned(),
                constraint: Box::new(constraint()),
                node_types: self.type_names(&xr_types),
                other_types: self.type_names(&yr_types),
            });
        }
        self.members[new as usize].supported = merged_types;
        // Union by rank; on a tie x's root wins.
        let (rx, ry) = (self.members[xr as usize].rank, self.members[yr as usize].rank);
        if rx < ry {
            self.members[xr as usize].parent = yr;
        } else {
            self.members[yr as usize].parent = xr;
            if rx == ry {
                self.members[xr as usize].rank += 1;
            }
        }
        Ok(())
    }

    // ---- initialisation -------------------------------------------------------------------

    fn initialize(&mut self) -> Result<()> {
        self.initialize_members()?;
        self.colocate_resource_and_ref_edges()?;
        self.colocate_all_nodes()?;
        if self.xla_type.contains(&true) {
            for i in 0..self.members.len() as u32 {
                let root = self.find(i);
                self.maybe_exclude_xla(root);
            }
        }
        Ok(())
    }

    fn initialize_members(&mut self) -> Result<()> {
        let mut cache: FxHashMap<*const OpDef, u32> = FxHashMap::default();
        // Identical requests share one names entry (per kind: plain, or resource
        // generator); `None` marks a malformed request.
        let request_ids = self.graph.interned().request_ids;
        let mut parsed_requests: FxHashMap<(u32, bool), Option<u32>> = FxHashMap::default();
        for i in 0..self.graph.len() as u32 {
            let node = self.graph.node(NodeId(i));
            let op = self.ops[i as usize];
            let key: *const OpDef = op;
            let supported = match cache.get(&key) {
                Some(&s) => s,
                None => {
                    let s = self.intern_types(self.supported_for(i));
                    // The remote-address-space rule depends on the node's request; only
                    // lists with a local kernel are shared.
                    if !op.kernels.is_empty() {
                        cache.insert(key, s);
                    }
                    s
                }
            };
            let mut member = Member {
                parent: i,
                rank: 0,
                names: 0,
                pinned: NONE,
                pinned_merged: false,
                supported,
                possible: NONE,
            };
            let supported_types = &self.type_lists[supported as usize];
            if let Some(assigned) = &node.assigned_device {
                let parsed =
                    DeviceName::parse(assigned).map_err(|_| Error::MalformedAssignedDevice {
                        node: node.name.clone(),
                        device: assigned.clone(),
                    })?;
                let index = self
                    .set
                    .devices()
                    .iter()
                    .position(|d| d.parsed() == &parsed)
                    .ok_or_else(|| Error::AssignedDeviceNotFound {
                        node: node.name.clone(),
                        device: assigned.clone(),
                        available: self.set.devices().iter().map(|d| d.name().to_owned()).collect(),
                    })?;
                let t = self.device_type[index];
                if !self.composite[index] && !supported_types.iter().any(|&(s, _)| s == t) {
                    return Err(Error::AssignedDeviceUnsupported {
                        node: node.name.clone(),
                        device: assigned.clone(),
                        op: node.op.clone(),
                    });
                }
                member.names = self.add_names(Names {
                    requested: parsed.clone(),
                    assigned: parsed,
                    resource: DeviceName::default(),
                });
                self.assigned[i as usize] = Some(index as u32);
            } else {
                if supported_types.is_empty() {
                    return Err(Error::NoKernel {
                        node: node.name.clone(),
                        op: node.op.clone(),
                        device_types: {
                            let mut t: Vec<String> = self.types.clone();
                            t.sort();
                            t
                        },
                    });
                }
                if !node.requested_device.is_empty() {
                    let generator = op.is_ref_or_resource_generator();
                    let key = (request_ids[i as usize], generator);
                    let entry = match parsed_requests.get(&key) {
                        Some(&entry) => entry,
                        None => {
                            let entry =
                                DeviceName::parse(&node.requested_device).ok().map(|parsed| {
                                    let resource = if generator {
                                        parsed.clone()
                                    } else {
                                        DeviceName::default()
                                    };
                                    self.add_names(Names {
                                        requested: parsed,
                                        resource,
                                        ..Names::default()
                                    })
                                });
                            parsed_requests.insert(key, entry);
                            entry
                        }
                    };
                    member.names = entry.ok_or_else(|| Error::MalformedDeviceSpec {
                        node: node.name.clone(),
                        spec: node.requested_device.clone(),
                    })?;
                }
            }
            self.members.push(member);
        }
        Ok(())
    }

    fn colocate_resource_and_ref_edges(&mut self) -> Result<()> {
        let graph = self.graph;
        for (src, dst, edge) in graph.edges() {
            let Edge::Data { dst_input, .. } = edge else {
                continue;
            };
            let dst_op = self.ops[dst.index()];
            if dst_op.inputs[dst_input] != ArgKind::Value && !dst_op.input_colocation_exempt {
                self.colocate_resource_or_ref_edge(src.0, dst.0)?;
            }
        }
        Ok(())
    }

    /// TF's `ColocateResourceOrRefEdge`.
    fn colocate_resource_or_ref_edge(&mut self, src: u32, dst: u32) -> Result<()> {
        let (sr, dr) = (self.find(src), self.find(dst));
        let (s_index, d_index) = (self.names_of(sr), self.names_of(dr));
        let (s_names, d_names) = (&self.names[s_index as usize], &self.names[d_index as usize]);
        // A composite device's resource feeding a physical device: not colocated.
        let composite_to_physical = |a: &DeviceName, b: &DeviceName| matches!((&a.device_type, &b.device_type), (Some(x), Some(y)) if &**x == COMPOSITE && &**y != COMPOSITE);
        if composite_to_physical(&s_names.assigned, &d_names.assigned)
            || composite_to_physical(&s_names.resource, &d_names.resource)
            || composite_to_physical(&s_names.requested, &d_names.requested)
        {
            return Ok(());
        }
        let (src_name, dst_name) = (self.name(src), self.name(dst));
        for (kind, a, b) in [
            (NameKind::Assigned, &s_names.assigned, &d_names.assigned),
            (NameKind::Resource, &s_names.resource, &d_names.resource),
        ] {
            if !a.is_compatible_with(b) {
                return Err(Error::ResourceEdgeIncompatible {
                    src: src_name.to_owned(),
                    dst: dst_name.to_owned(),
                    kind,
                    src_device: a.to_string(),
                    dst_device: b.to_string(),
                });
            }
        }
        if !s_names.requested.is_compatible_with(&d_names.requested) {
            // The destination's request is silently replaced by the source's.
            let mut d_names = d_names.clone();
            d_names.requested = s_names.requested.clone();
            let (assigned, resource) = (d_names.assigned.clone(), d_names.resource.clone());
            d_names.requested.ensure_specification(&assigned);
            d_names.requested.ensure_specification(&resource);
            self.members[dr as usize].names = self.add_names(d_names);
        }
        let constraint =
            || Constraint::ResourceEdge { src: src_name.to_owned(), dst: dst_name.to_owned() };
        self.colocate(src, dst, &constraint).map_err(|cause| Error::RefEdgeColocation {
            src: src_name.to_owned(),
            dst: dst_name.to_owned(),
            cause: Box::new(cause),
        })
    }

    /// TF's `ColocateAllNodes`: each `loc:@` entry, then the node's own name.
    fn colocate_all_nodes(&mut self) -> Result<()> {
        let graph = self.graph;
        let interned = graph.interned();
        // The anchor (first member) of every group, by the group's string id: a node's
        // name, or a name no node has.
        let mut anchor: Vec<u32> = vec![NONE; interned.strings.len()];
        for i in 0..graph.len() as u32 {
            let own = interned.name_ids[i as usize];
            for &group in interned.colocation(i as usize).iter().chain(std::iter::once(&own)) {
                let slot = &mut anchor[group as usize];
                if *slot == NONE {
                    *slot = i;
                    continue;
                }
                let anchor_node = *slot;
                let constraint =
                    || Constraint::Group { group: interned.strings[group as usize].clone() };
                if let Err(e) = self.colocate(i, anchor_node, &constraint)
                    && !self.options.allow_soft_placement
                {
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    fn is_xla(t: &str) -> bool {
        matches!(t, "XLA_CPU" | "XLA_GPU" | "TPU" | "XLA_CPU_JIT" | "XLA_GPU_JIT" | "XLA_TPU_JIT")
    }

    /// TF's `MaybeExcludeXlaDevices`.
    fn maybe_exclude_xla(&mut self, root: u32) {
        let supported = &self.type_lists[self.members[root as usize].supported as usize];
        if !supported.iter().any(|&(t, _)| self.xla_type[t as usize]) {
            return;
        }
        let names = &self.names[self.members[root as usize].names as usize];
        for n in [&names.requested, &names.assigned, &names.resource] {
            if n.device_type.as_deref().is_some_and(|t| Self::is_xla(t) || t == COMPOSITE) {
                return;
            }
        }
        let non_xla: Types =
            supported.iter().copied().filter(|&(t, _)| !self.xla_type[t as usize]).collect();
        if !non_xla.is_empty() && non_xla.len() < supported.len() {
            self.members[root as usize].supported = self.intern_types(non_xla);
        }
    }

    // ---- candidates -------------------------------------------------------------------------

    /// TF's `FilterSupportedDevices`, sorted by `SortPrioritizedDeviceVector`; the
    /// default local device first.
    fn filter_supported(&self, devices: &[u32], supported: &Types) -> Vec<u32> {
        let default = self.set.default_local_index().map(|d| d as u32);
        let mut found_default = false;
        let mut v: Vec<(u32, i32)> = Vec::new();
        for &(t, prio) in supported {
            for &d in devices {
                if self.device_type[d as usize] == t || self.composite[d as usize] {
                    if Some(d) == default {
                        found_default = true;
                    } else {
                        v.push((d, prio));
                    }
                }
            }
        }
        let all = self.set.devices();
        v.sort_by(|a, b| {
            let (da, db) = (&all[a.0 as usize], &all[b.0 as usize]);
            b.1.cmp(&a.1)
                .then_with(|| {
                    self.type_priority[self.device_type[b.0 as usize] as usize]
                        .cmp(&self.type_priority[self.device_type[a.0 as usize] as usize])
                })
                .then_with(|| db.is_local().cmp(&da.is_local()))
                .then_with(|| da.name().cmp(db.name()))
        });
        let mut out = Vec::with_capacity(v.len() + 1);
        if found_default {
            out.push(default.expect("found"));
        }
        out.extend(v.into_iter().map(|(d, _)| d));
        out.dedup();
        out
    }

    fn matching(&self, pattern: &DeviceName) -> Vec<u32> {
        (0..self.set.devices().len() as u32)
            .filter(|&d| pattern.matches(self.set.devices()[d as usize].parsed()))
            .collect()
    }

    /// TF's `GetDevicesForNode`. Candidate lists are cached per root, and shared between
    /// groups with the same request and supported types.
    fn devices_for(&mut self, i: u32) -> Result<u32> {
        let root = self.find(i);
        let m = self.members[root as usize];
        if m.possible != NONE {
            return Ok(m.possible);
        }
        let supported = m.supported;
        let names_index = self.names_of(root);
        let list = if self.names[names_index as usize].requested.has_some_details() {
            match self.constrained.get(&(names_index, supported)) {
                Some(&list) => list,
                None => {
                    let names = &self.names[names_index as usize];
                    let by_request = (names.requested.clone(), supported);
                    let list = match self.constrained_by_request.get(&by_request) {
                        Some(&list) => list,
                        None => {
                            let types = &self.type_lists[supported as usize];
                            let mut devices = self.matching(&names.requested);
                            if !devices.is_empty() {
                                devices = self.filter_supported(&devices, types);
                            }
                            if devices.is_empty() && self.options.allow_soft_placement {
                                devices = self.soft_candidates(names, types);
                            }
                            if devices.is_empty() {
                                let names = names.clone();
                                return Err(self.no_candidates_error(i, root, &names));
                            }
                            let list = self.add_candidates(devices);
                            self.constrained_by_request.insert(by_request, list);
                            list
                        }
                    };
                    self.constrained.insert((names_index, supported), list);
                    list
                }
            }
        } else if self.unconstrained[supported as usize] != NONE {
            self.unconstrained[supported as usize]
        } else {
            let all: Vec<u32> = (0..self.set.devices().len() as u32).collect();
            let devices = self.filter_supported(&all, &self.type_lists[supported as usize]);
            if devices.is_empty() {
                let node = self.graph.node(NodeId(i));
                return Err(Error::NoSupportedDevice {
                    node: node.name.clone(),
                    op: node.op.clone(),
                });
            }
            let list = self.add_candidates(devices);
            self.unconstrained[supported as usize] = list;
            list
        };
        self.members[root as usize].possible = list;
        Ok(list)
    }

    fn add_candidates(&mut self, devices: Vec<u32>) -> u32 {
        self.candidates.push(devices);
        (self.candidates.len() - 1) as u32
    }

    /// TF's `GetSoftDeviceCandidates`: relax type and id unless assigned or resource
    /// names pin them; then unless only the assigned name pins them (this may move a
    /// resource). Job, replica and task are never relaxed.
    fn soft_candidates(&self, names: &Names, supported: &Types) -> Vec<u32> {
        for keep_resource in [true, false] {
            let mut soft = names.requested.clone();
            let pins_type = names.assigned.device_type.is_some()
                || (keep_resource && names.resource.device_type.is_some());
            let pins_id =
                names.assigned.id.is_some() || (keep_resource && names.resource.id.is_some());
            if !pins_type {
                soft.device_type = None;
            }
            if !pins_id {
                soft.id = None;
            }
            let devices = self.matching(&soft);
            if !devices.is_empty() {
                let devices = self.filter_supported(&devices, supported);
                if !devices.is_empty() {
                    return devices;
                }
            }
        }
        Vec::new()
    }

    fn no_candidates_error(&mut self, i: u32, root: u32, names: &Names) -> Error {
        let node = self.graph.node(NodeId(i));
        let all = || self.set.devices().iter().map(|d| d.name().to_owned()).collect::<Vec<_>>();
        match DeviceName::parse(&node.requested_device) {
            Ok(spec) if spec == names.requested => {
                if self.matching(&spec).is_empty() {
                    let mut available = all();
                    available.sort();
                    Error::ExplicitDeviceNotFound {
                        node: node.name.clone(),
                        requested: node.requested_device.clone(),
                        available,
                        looks_like_gpu: spec
                            .device_type
                            .as_deref()
                            .is_some_and(|t| t.eq_ignore_ascii_case("gpu")),
                    }
                } else if let Some(t) = &spec.device_type {
                    Error::NoKernelForRequestedType {
                        node: node.name.clone(),
                        requested: node.requested_device.clone(),
                        device_type: t.to_string(),
                        op: node.op.clone(),
                    }
                } else {
                    Error::CouldNotSatisfy {
                        node: node.name.clone(),
                        requested: node.requested_device.clone(),
                    }
                }
            }
            _ => {
                let in_group: Vec<u32> =
                    (0..self.graph.len() as u32).filter(|&j| self.find(j) == root).collect();
                let group = in_group
                    .into_iter()
                    .map(|j| {
                        let n = self.graph.node(NodeId(j));
                        GroupMember {
                            node: n.name.clone(),
                            op: n.op.clone(),
                            requested: n.requested_device.clone(),
                            assigned: n.assigned_device.clone(),
                        }
                    })
                    .collect();
                Error::IncompatibleGroup {
                    node: node.name.clone(),
                    requested: node.requested_device.clone(),
                    group_requested: names.requested.to_string(),
                    available: all(),
                    group,
                }
            }
        }
    }

    // ---- assignment ---------------------------------------------------------------------------

    /// TF's `Member::AssignDevice`: merges the device's full name into the group (hard
    /// for assigned, override for resource and requested).
    ///
    /// A device chosen from the group's candidates matches every name of the group, so
    /// the merge cannot fail and only leaves every name equal to the device's: it is
    /// recorded as a pin and materialised when the names are next read. A framework
    /// assignment (`checked`) may conflict with the group and is merged at once.
    fn assign(&mut self, i: u32, device: u32, checked: bool) -> Result<()> {
        let root = self.find(i);
        if self.members[root as usize].pinned == device {
            return Ok(());
        }
        if checked {
            let parsed = self.set.devices()[device as usize].parsed().clone();
            let index = self.names_of(root);
            let mut names = self.names[index as usize].clone();
            let group_device = names.assigned.to_string();
            let merged = names.assigned.merge(&parsed, MergeMode::Hard).is_ok()
                && names.resource.merge(&parsed, MergeMode::Override).is_ok()
                && names.requested.merge(&parsed, MergeMode::Override).is_ok();
            if !merged {
                let node = self.graph.node(NodeId(i));
                return Err(Error::AssignedConflict {
                    node: node.name.clone(),
                    device: parsed.to_string(),
                    group_device,
                });
            }
            self.members[root as usize].names = self.add_names(names);
        }
        let m = &mut self.members[root as usize];
        m.pinned = device;
        m.pinned_merged = checked;
        m.possible = NONE;
        Ok(())
    }

    /// The request (as a string id) of a node, or of the implicit source/sink node.
    fn requested(&self, j: Option<u32>) -> u32 {
        j.map_or(EMPTY, |j| self.graph.interned().request_ids[j as usize])
    }

    /// TF's `MatchIdentityOperation`: an identity with one in-edge and one out-edge
    /// (implicit source/sink edges count) whose input and output request the same
    /// device string.
    fn match_identity(&self, i: u32) -> bool {
        if !self.ops[i as usize].is_identity
            || self.assigned[i as usize].is_some()
            || self.requested(Some(i)) != EMPTY
        {
            return false;
        }
        let (ins, outs) = (self.in_edges(i), self.out_edges(i));
        if ins.len() > 1 || outs.len() > 1 {
            return false;
        }
        self.requested(ins.first().copied()) == self.requested(outs.first().copied())
    }

    fn run(&mut self) -> Result<Placement> {
        let n = self.graph.len();
        let mut placed: Vec<u32> = vec![NONE; n];
        let mut allowed: Vec<u32> = vec![NONE; n];
        let mut log = Vec::new();
        let mut second = Vec::new();
        let logging = self.options.log_device_placement;
        for i in 0..n as u32 {
            if let Some(d) = self.assigned[i as usize] {
                let root = self.find(i) as usize;
                if allowed[root] == NONE {
                    allowed[root] = self.add_candidates(vec![d]);
                }
                self.assign(i, d, true)?;
                placed[i as usize] = d;
                if logging {
                    let candidates = vec![d as usize];
                    log.push(LogEntry {
                        node: NodeId(i),
                        device: d as usize,
                        reason: Reason::PreAssigned,
                        candidates,
                    });
                }
                continue;
            }
            if self.ops[i as usize].is_generator() {
                second.push(i);
                continue;
            }
            let list = self.devices_for(i)?;
            let root = self.find(i) as usize;
            if allowed[root] == NONE {
                allowed[root] = list;
            }
            let op = self.ops[i as usize];
            let identity = !op.is_metadata && self.match_identity(i);
            let devices = &self.candidates[list as usize];
            let mut choice = (devices[0], Reason::FirstCandidate);
            if (op.is_metadata || identity)
                && let Some(&src) = self.in_edges(i).first()
                && placed[src as usize] != NONE
                && devices.contains(&placed[src as usize])
            {
                let reason =
                    if identity { Reason::IdentityFollowsInput } else { Reason::FollowsInput };
                choice = (placed[src as usize], reason);
            }
            let (d, reason) = choice;
            if logging {
                let candidates = devices.iter().map(|&d| d as usize).collect();
                log.push(LogEntry { node: NodeId(i), device: d as usize, reason, candidates });
            }
            self.assign(i, d, false)?;
            placed[i as usize] = d;
        }
        for i in second {
            let list = self.devices_for(i)?;
            let root = self.find(i) as usize;
            if allowed[root] == NONE {
                allowed[root] = list;
            }
            let devices = &self.candidates[list as usize];
            let outs = self.out_edges(i);
            let mut choice = (devices[0], Reason::FirstCandidate);
            if let Some(&first) = outs.first() {
                let target = placed[first as usize];
                if target != NONE
                    && outs.iter().all(|&o| placed[o as usize] == target)
                    && devices.contains(&target)
                {
                    choice = (target, Reason::FollowsConsumers);
                }
            }
            let (d, reason) = choice;
            if logging {
                let candidates = devices.iter().map(|&d| d as usize).collect();
                log.push(LogEntry { node: NodeId(i), device: d as usize, reason, candidates });
            }
            self.assign(i, d, false)?;
            placed[i as usize] = d;
        }
        let groups = (0..n as u32).map(|i| self.find(i)).collect();
        let lists = std::mem::take(&mut self.candidates);
        let devices = placed.into_iter().map(|d| d as usize).collect();
        Ok(Placement { devices, groups, allowed, lists, log })
    }
}

/// `[0, c0, c0+c1, ...]`: the start of each node's slice in a flat edge list.
fn prefix_sums(counts: &[u32]) -> Vec<u32> {
    let mut start = Vec::with_capacity(counts.len() + 1);
    let mut acc = 0u32;
    start.push(0);
    for c in counts {
        acc += c;
        start.push(acc);
    }
    start
}
