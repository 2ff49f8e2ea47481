//! Cost-aware placement: among the devices TF's constraints allow each colocation
//! group, choose by an estimated schedule — memory-capped list scheduling in the manner
//! of Baechi's m-ETF (earliest finish time with per-device memory caps, colocation
//! groups placed as units).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use crate::{
    Device, DeviceSet, Edge, Error, Graph, NodeId, OpRegistry, Placement, PlacerOptions, Result,
    place,
};

/// What the cost-aware pass needs to know: per-op time and memory, per-edge bytes,
/// per-link transfer time, per-device memory.
pub trait CostModel {
    /// Seconds `node` takes on `device`.
    fn compute(&self, graph: &Graph, node: NodeId, device: &Device) -> f64;
    /// Bytes `node` keeps resident on its device (weights, state, activations).
    fn memory(&self, graph: &Graph, node: NodeId) -> u64;
    /// Bytes `node` sends along each of its data out-edges.
    fn output_bytes(&self, graph: &Graph, node: NodeId) -> u64;
    /// Seconds to move `bytes` from `from` to `to`; zero on one device.
    fn transfer(&self, bytes: u64, from: &Device, to: &Device) -> f64;
    /// Bytes of memory `device` has for the graph.
    fn capacity(&self, device: &Device) -> u64;
}

/// Costs of one op type.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct OpCost {
    /// Seconds on a device of speed 1.
    pub compute: f64,
    /// Resident bytes.
    pub memory: u64,
    /// Bytes per data out-edge.
    pub output_bytes: u64,
}

/// A table-driven [`CostModel`]: costs per op type, a speed per device type, one link
/// bandwidth and latency between any two devices, a capacity per device.
#[derive(Debug, Clone)]
pub struct TableCostModel {
    /// Costs per op name; ops not listed cost `default_op`.
    pub ops: HashMap<String, OpCost>,
    /// Costs of unlisted ops.
    pub default_op: OpCost,
    /// Relative speed per device type (compute time is divided by it); default 1.
    pub speed: HashMap<String, f64>,
    /// Bytes per second between two devices.
    pub bandwidth: f64,
    /// Seconds of latency per transfer between two devices.
    pub latency: f64,
    /// Memory per device (by full name); devices not listed have `default_capacity`.
    pub capacity: HashMap<String, u64>,
    /// Memory of unlisted devices.
    pub default_capacity: u64,
}

impl Default for TableCostModel {
    /// Unit compute per op, no memory, 1 KiB per edge over 10 GB/s links with 5 µs
    /// latency, unlimited memory.
    fn default() -> Self {
        TableCostModel {
            ops: HashMap::new(),
            default_op: OpCost { compute: 1e-3, memory: 0, output_bytes: 1024 },
            speed: HashMap::new(),
            bandwidth: 10e9,
            latency: 5e-6,
            capacity: HashMap::new(),
            default_capacity: u64::MAX,
        }
    }
}

impl TableCostModel {
    fn op(&self, graph: &Graph, node: NodeId) -> OpCost {
        self.ops.get(&graph.node(node).op).copied().unwrap_or(self.default_op)
    }
}

impl CostModel for TableCostModel {
    fn compute(&self, graph: &Graph, node: NodeId, device: &Device) -> f64 {
        self.op(graph, node).compute / self.speed.get(device.device_type()).copied().unwrap_or(1.0)
    }

    fn memory(&self, graph: &Graph, node: NodeId) -> u64 {
        self.op(graph, node).memory
    }

    fn output_bytes(&self, graph: &Graph, node: NodeId) -> u64 {
        self.op(graph, node).output_bytes
    }

    fn transfer(&self, bytes: u64, from: &Device, to: &Device) -> f64 {
        if from.name() == to.name() { 0.0 } else { self.latency + bytes as f64 / self.bandwidth }
    }

    fn capacity(&self, device: &Device) -> u64 {
        self.capacity.get(device.name()).copied().unwrap_or(self.default_capacity)
    }
}

/// The outcome of [`place_with_cost`].
#[derive(Debug, Clone, PartialEq)]
pub struct CostPlacement {
    /// The device (index into the device set) of every node.
    pub devices: Vec<usize>,
    /// The estimated makespan of this placement, in seconds.
    pub makespan: f64,
    /// The estimated makespan of TF's choice, or `None` if TF's choice exceeds a memory
    /// cap.
    pub tf_makespan: Option<f64>,
    /// Bytes resident per device.
    pub memory: Vec<u64>,
}

/// Places `graph` as TF would constrain it, then chooses devices by cost.
///
/// **Estimated makespan.** Every placement (the chosen one and TF's) is estimated by
/// one list schedule. Nodes are taken in *priority order*: repeatedly, of the nodes
/// whose predecessors have all been taken, the one with the highest upward rank (HEFT's
/// priority: a node's mean compute over its allowed devices plus the largest, over its
/// successors, of the successor's rank plus one transfer of the edge's bytes between
/// the first two devices of the set, none with one device), then the least depth (edges
/// on the longest path from a source), then the lowest node id. Each device runs its
/// nodes one at a time in that order; a node starts when its device is free and every
/// predecessor's output has arrived (the predecessor's finish plus
/// [`CostModel::transfer`] of its [`output_bytes`](CostModel::output_bytes) for a data
/// edge, of zero bytes for a control edge), and runs for [`CostModel::compute`] on its
/// device. The makespan is the latest finish.
///
/// **Choice.** Groups are placed greedily in priority order: each colocation group
/// (when its first member comes up) goes to the allowed device that finishes that
/// member earliest among those with memory left for the whole group. TF's choice is
/// returned instead whenever it fits every memory cap and either the greedy pass found
/// no device with room for some group or TF's choice is estimated no slower. The result
/// never breaks a constraint (only allowed devices, one device per group) or a memory
/// cap; it is [`Error::MemoryCapExceeded`] only when neither the greedy pass nor TF's
/// choice fits.
pub fn place_with_cost(
    graph: &Graph,
    devices: &DeviceSet,
    registry: &dyn OpRegistry,
    options: PlacerOptions,
    model: &dyn CostModel,
) -> Result<CostPlacement> {
    let tf = place(graph, devices, registry, options)?;
    let all = devices.devices();
    let preds = predecessors(graph, model);
    let priority = priority(graph, model, all, &tf, &preds);

    // TF's choice under the same model and order.
    let tf_devices: Vec<usize> = tf.devices().to_vec();
    let tf_memory = resident(graph, model, all.len(), &tf_devices);
    let tf_fits = tf_memory.iter().zip(all).all(|(&m, d)| m <= model.capacity(d));
    let tf_makespan = tf_fits.then(|| {
        let mut schedule = Schedule::new(graph.len(), all.len());
        for &v in &priority {
            schedule.commit(model, graph, all, &preds, &tf_devices, v, tf_devices[v as usize]);
        }
        schedule.makespan()
    });
    let tf_choice = |tf_makespan: f64| CostPlacement {
        devices: tf_devices.clone(),
        makespan: tf_makespan,
        tf_makespan: Some(tf_makespan),
        memory: tf_memory.clone(),
    };

    match greedy(graph, model, all, &tf, &preds, &priority) {
        Ok(greedy) => Ok(match tf_makespan {
            Some(t) if t <= greedy.makespan => tf_choice(t),
            _ => CostPlacement { tf_makespan, ..greedy },
        }),
        Err(error) => tf_makespan.map(tf_choice).ok_or(error),
    }
}

/// Memory-capped earliest-finish list scheduling in `priority` order, each colocation
/// group placed as a unit when its first member comes up.
fn greedy(
    graph: &Graph,
    model: &dyn CostModel,
    all: &[Device],
    tf: &Placement,
    preds: &[Vec<(u32, u64)>],
    priority: &[u32],
) -> Result<CostPlacement> {
    let n = graph.len();
    let groups = tf.groups();
    let mut group_memory = vec![0u64; n];
    for (i, &root) in groups.iter().enumerate() {
        let root = root as usize;
        group_memory[root] =
            group_memory[root].saturating_add(model.memory(graph, NodeId(i as u32)));
    }
    let mut chosen = vec![usize::MAX; n];
    let mut group_device = vec![usize::MAX; n];
    let mut memory = vec![0u64; all.len()];
    let mut schedule = Schedule::new(n, all.len());
    for &v in priority {
        let id = NodeId(v);
        let root = groups[v as usize] as usize;
        let device = if group_device[root] != usize::MAX {
            group_device[root]
        } else {
            let need = group_memory[root];
            let mut best: Option<(f64, usize)> = None;
            for &d in tf.allowed(id) {
                let d = d as usize;
                if memory[d].checked_add(need).is_none_or(|m| m > model.capacity(&all[d])) {
                    continue;
                }
                let finish = schedule.finish_on(model, graph, all, preds, &chosen, v, d);
                if best.is_none_or(|(f, _)| finish < f) {
                    best = Some((finish, d));
                }
            }
            let (_, d) = best.ok_or_else(|| Error::MemoryCapExceeded {
                node: graph.node(id).name.clone(),
                group_bytes: need,
                devices: tf
                    .allowed(id)
                    .iter()
                    .map(|&d| all[d as usize].name().to_owned())
                    .collect(),
            })?;
            memory[d] += need;
            group_device[root] = d;
            d
        };
        schedule.commit(model, graph, all, preds, &chosen, v, device);
        chosen[v as usize] = device;
    }
    Ok(CostPlacement { devices: chosen, makespan: schedule.makespan(), tf_makespan: None, memory })
}

/// Bytes resident on each device under `placed`.
fn resident(graph: &Graph, model: &dyn CostModel, devices: usize, placed: &[usize]) -> Vec<u64> {
    let mut memory = vec![0u64; devices];
    for (i, &d) in placed.iter().enumerate() {
        memory[d] = memory[d].saturating_add(model.memory(graph, NodeId(i as u32)));
    }
    memory
}

/// Every node's predecessors along data and control edges, each with the bytes the
/// edge carries (the source's output bytes for data, none for control).
fn predecessors(graph: &Graph, model: &dyn CostModel) -> Vec<Vec<(u32, u64)>> {
    let mut preds = vec![Vec::new(); graph.len()];
    for (src, dst, edge) in graph.edges() {
        let bytes = match edge {
            Edge::Data { .. } => model.output_bytes(graph, src),
            Edge::Control => 0,
        };
        preds[dst.index()].push((src.0, bytes));
    }
    preds
}

/// The priority order (see [`place_with_cost`]). `graph` is acyclic ([`place`] checked
/// it).
fn priority(
    graph: &Graph,
    model: &dyn CostModel,
    all: &[Device],
    tf: &Placement,
    preds: &[Vec<(u32, u64)>],
) -> Vec<u32> {
    let n = graph.len();
    let mut succs: Vec<Vec<(u32, u64)>> = vec![Vec::new(); n];
    for (v, list) in preds.iter().enumerate() {
        for &(p, bytes) in list {
            succs[p as usize].push((v as u32, bytes));
        }
    }
    // Kahn's algorithm; depth is the longest path from a source.
    let mut indegree: Vec<usize> = preds.iter().map(Vec::len).collect();
    let mut ready: Vec<u32> = (0..n as u32).filter(|&i| indegree[i as usize] == 0).collect();
    let mut order = Vec::with_capacity(n);
    let mut depth = vec![0u32; n];
    while let Some(v) = ready.pop() {
        order.push(v);
        for &(s, _) in &succs[v as usize] {
            depth[s as usize] = depth[s as usize].max(depth[v as usize] + 1);
            indegree[s as usize] -= 1;
            if indegree[s as usize] == 0 {
                ready.push(s);
            }
        }
    }
    debug_assert_eq!(order.len(), n, "place rejects cycles");
    let hop =
        |bytes: u64| if all.len() > 1 { model.transfer(bytes, &all[0], &all[1]) } else { 0.0 };
    let mut rank = vec![0f64; n];
    for &v in order.iter().rev() {
        let id = NodeId(v);
        let allowed = tf.allowed(id);
        let mean = allowed.iter().map(|&d| model.compute(graph, id, &all[d as usize])).sum::<f64>()
            / allowed.len() as f64;
        let tail = succs[v as usize]
            .iter()
            .map(|&(s, bytes)| hop(bytes) + rank[s as usize])
            .fold(0.0, f64::max);
        rank[v as usize] = mean + tail;
    }
    // Highest rank first, then least depth, then lowest id, among the nodes whose
    // predecessors are all taken (with ranks that never grow along an edge, as
    // non-negative costs give, this is simply the sorted order).
    let mut indegree: Vec<usize> = preds.iter().map(Vec::len).collect();
    let mut ready: BinaryHeap<Ready> = (0..n as u32)
        .filter(|&i| indegree[i as usize] == 0)
        .map(|i| Ready { rank: rank[i as usize], depth: depth[i as usize], node: i })
        .collect();
    let mut priority = Vec::with_capacity(n);
    while let Some(Ready { node: v, .. }) = ready.pop() {
        priority.push(v);
        for &(s, _) in &succs[v as usize] {
            indegree[s as usize] -= 1;
            if indegree[s as usize] == 0 {
                ready.push(Ready { rank: rank[s as usize], depth: depth[s as usize], node: s });
            }
        }
    }
    priority
}

/// A node ready to be taken, ordered so that the max-heap pops the highest rank, then
/// the least depth, then the lowest id.
struct Ready {
    rank: f64,
    depth: u32,
    node: u32,
}

impl Ord for Ready {
    fn cmp(&self, other: &Ready) -> Ordering {
        self.rank
            .total_cmp(&other.rank)
            .then(other.depth.cmp(&self.depth))
            .then(other.node.cmp(&self.node))
    }
}

impl PartialOrd for Ready {
    fn partial_cmp(&self, other: &Ready) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Ready {
    fn eq(&self, other: &Ready) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Ready {}

/// A list schedule: each device runs one node at a time, in commit order; nodes are
/// committed after their predecessors.
struct Schedule {
    finish: Vec<f64>,
    device_free: Vec<f64>,
}

impl Schedule {
    fn new(nodes: usize, devices: usize) -> Schedule {
        Schedule { finish: vec![0.0; nodes], device_free: vec![0.0; devices] }
    }

    /// When `v` would finish on device `d`, its predecessors being on `placed`.
    #[allow(clippy::too_many_arguments)]
    fn finish_on(
        &self,
        model: &dyn CostModel,
        graph: &Graph,
        all: &[Device],
        preds: &[Vec<(u32, u64)>],
        placed: &[usize],
        v: u32,
        d: usize,
    ) -> f64 {
        let mut start = self.device_free[d];
        for &(p, bytes) in &preds[v as usize] {
            let from = placed[p as usize];
            let arrival = self.finish[p as usize] + model.transfer(bytes, &all[from], &all[d]);
            start = start.max(arrival);
        }
        start + model.compute(graph, NodeId(v), &all[d])
    }

    /// Runs `v` on device `d`.
    #[allow(clippy::too_many_arguments)]
    fn commit(
        &mut self,
        model: &dyn CostModel,
        graph: &Graph,
        all: &[Device],
        preds: &[Vec<(u32, u64)>],
        placed: &[usize],
        v: u32,
        d: usize,
    ) {
        let finish = self.finish_on(model, graph, all, preds, placed, v, d);
        self.finish[v as usize] = finish;
        self.device_free[d] = finish;
    }

    fn makespan(&self) -> f64 {
        self.finish.iter().copied().fold(0.0, f64::max)
    }
}
