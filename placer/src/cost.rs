//! Cost-aware placement: among the devices TF's constraints allow each colocation
//! group, choose by an estimated schedule — memory-capped list scheduling in the manner
//! of Baechi's m-ETF (earliest finish time with per-device memory caps, colocation
//! groups placed as units).

use std::collections::HashMap;

use crate::{
    Device, DeviceSet, Edge, Error, Graph, NodeId, OpRegistry, PlacerOptions, Result, place,
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

/// Places `graph` as TF would constrain it, then chooses devices by cost: nodes in
/// order of upward rank (longest remaining path, HEFT's priority), each colocation group
/// on the allowed device that finishes its first member earliest among those with
/// memory left for the whole group. Never breaks a constraint (only allowed devices,
/// one device per group) or a memory cap (an error if no allowed device has room);
/// falls back to TF's choice when that is estimated faster and fits.
pub fn place_with_cost(
    graph: &Graph,
    devices: &DeviceSet,
    registry: &dyn OpRegistry,
    options: PlacerOptions,
    model: &dyn CostModel,
) -> Result<CostPlacement> {
    let tf = place(graph, devices, registry, options)?;
    let n = graph.len();
    let all = devices.devices();
    let (preds, succs) = adjacency(graph);
    let order = topological(n, &preds, &succs);
    let groups = tf.groups();
    let mut group_memory = vec![0u64; n];
    for i in 0..n {
        group_memory[groups[i] as usize] += model.memory(graph, NodeId(i as u32));
    }
    // Upward rank with mean compute over the allowed devices and device-free transfer
    // estimates (one hop between distinct devices).
    let mut rank = vec![0f64; n];
    let hop =
        |bytes: u64| if all.len() > 1 { model.transfer(bytes, &all[0], &all[1]) } else { 0.0 };
    for &v in order.iter().rev() {
        let id = NodeId(v);
        let allowed = tf.allowed(id);
        let mean = allowed.iter().map(|&d| model.compute(graph, id, &all[d as usize])).sum::<f64>()
            / allowed.len() as f64;
        let out = model.output_bytes(graph, id);
        let tail =
            succs[v as usize].iter().map(|&s| hop(out) + rank[s as usize]).fold(0.0, f64::max);
        rank[v as usize] = mean + tail;
    }
    let mut position = vec![0usize; n];
    for (k, &v) in order.iter().enumerate() {
        position[v as usize] = k;
    }
    let mut priority: Vec<u32> = (0..n as u32).collect();
    priority.sort_by(|&a, &b| {
        rank[b as usize]
            .total_cmp(&rank[a as usize])
            .then(position[a as usize].cmp(&position[b as usize]))
    });

    let mut chosen = vec![usize::MAX; n];
    let mut group_device = vec![usize::MAX; n];
    let mut memory = vec![0u64; all.len()];
    let mut schedule = Schedule::new(n, all.len());
    for &v in &priority {
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
                let finish = schedule.finish_on(graph, model, all, &preds, &chosen, v, d);
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
        schedule.commit(graph, model, all, &preds, &chosen, v, device);
        chosen[v as usize] = device;
    }
    let makespan = schedule.makespan();

    // TF's choice under the same model and order.
    let tf_devices: Vec<usize> = tf.devices().to_vec();
    let mut tf_memory = vec![0u64; all.len()];
    for i in 0..n {
        tf_memory[tf_devices[i]] += model.memory(graph, NodeId(i as u32));
    }
    let tf_fits = tf_memory.iter().zip(all).all(|(&m, d)| m <= model.capacity(d));
    let mut tf_schedule = Schedule::new(n, all.len());
    let mut placed = vec![usize::MAX; n];
    for &v in &priority {
        tf_schedule.commit(graph, model, all, &preds, &placed, v, tf_devices[v as usize]);
        placed[v as usize] = tf_devices[v as usize];
    }
    let tf_makespan = tf_fits.then(|| tf_schedule.makespan());
    if let Some(t) = tf_makespan
        && t <= makespan
    {
        return Ok(CostPlacement {
            devices: tf_devices,
            makespan: t,
            tf_makespan,
            memory: tf_memory,
        });
    }
    Ok(CostPlacement { devices: chosen, makespan, tf_makespan, memory })
}

/// Data predecessors (with the bytes they send) and successors of every node.
fn adjacency(graph: &Graph) -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
    let mut preds = vec![Vec::new(); graph.len()];
    let mut succs = vec![Vec::new(); graph.len()];
    for (src, dst, edge) in graph.edges() {
        if matches!(edge, Edge::Data { .. } | Edge::Control) {
            preds[dst.index()].push(src.0);
            succs[src.index()].push(dst.0);
        }
    }
    (preds, succs)
}

fn topological(n: usize, preds: &[Vec<u32>], succs: &[Vec<u32>]) -> Vec<u32> {
    let mut indegree: Vec<usize> = preds.iter().map(Vec::len).collect();
    let mut ready: Vec<u32> = (0..n as u32).rev().filter(|&i| indegree[i as usize] == 0).collect();
    let mut order = Vec::with_capacity(n);
    while let Some(v) = ready.pop() {
        order.push(v);
        for &s in succs[v as usize].iter().rev() {
            indegree[s as usize] -= 1;
            if indegree[s as usize] == 0 {
                ready.push(s);
            }
        }
    }
    order
}

/// A simple list schedule: each device runs one node at a time, in commit order.
struct Schedule {
    finish: Vec<f64>,
    device_free: Vec<f64>,
}

impl Schedule {
    fn new(nodes: usize, devices: usize) -> Schedule {
        Schedule { finish: vec![0.0; nodes], device_free: vec![0.0; devices] }
    }

    /// When `v` would finish on device `d`.
    #[allow(clippy::too_many_arguments)]
    fn finish_on(
        &self,
        graph: &Graph,
        model: &dyn CostModel,
        all: &[Device],
        preds: &[Vec<u32>],
        placed: &[usize],
        v: u32,
        d: usize,
    ) -> f64 {
        let mut start = self.device_free[d];
        for &p in &preds[v as usize] {
            let from = placed[p as usize];
            let arrival = self.finish[p as usize]
                + if from == usize::MAX {
                    0.0
                } else {
                    model.transfer(model.output_bytes(graph, NodeId(p)), &all[from], &all[d])
                };
            start = start.max(arrival);
        }
        start + model.compute(graph, NodeId(v), &all[d])
    }

    #[allow(clippy::too_many_arguments)]
    fn commit(
        &mut self,
        graph: &Graph,
        model: &dyn CostModel,
        all: &[Device],
        preds: &[Vec<u32>],
        placed: &[usize],
        v: u32,
        d: usize,
    ) {
        let finish = self.finish_on(graph, model, all, preds, placed, v, d);
        self.finish[v as usize] = finish;
        self.device_free[d] = finish;
    }

    fn makespan(&self) -> f64 {
        self.finish.iter().copied().fold(0.0, f64::max)
    }
}
