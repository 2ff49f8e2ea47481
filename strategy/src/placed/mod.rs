//! Placed programs: TensorFlow's placer assigns a program's instructions to devices,
//! and the program runs split across them.
//!
//! A program's device requests ([`Builder::device`](meshwork_program::Builder::device),
//! [`colocate_with`](meshwork_program::Builder::colocate_with)) become a placer
//! [`Graph`]: a fed parameter is a `Placeholder`; a parameter the program updates
//! (carried) is a resource variable — a `VarHandleOp`, the `ReadVariableOp` its
//! readers read, and an `AssignVariableOp` per update, requested where the update's
//! instruction is, so TensorFlow's resource-edge rule puts reads and updates with the
//! variable; each instruction is a node of op type `op:dtype` whose kernels the
//! program crate's [`Catalogue`] lists. [`meshwork_placer::place`] decides (soft
//! placement, colocation groups, TF's errors), then the program is split into one
//! program per device with a `send`/`recv` pair for every value that crosses devices
//! (one transfer per value and destination device, as TensorFlow's partitioner
//! deduplicates), and the pieces run concurrently on the executor's devices as a
//! dataflow: each device's part is cut into segments by the last transfer they wait
//! for, and a device runs the first segment (in program order) whose inputs are
//! there, taking transfers
//! as they arrive — no barrier between layers, no instruction held up behind a
//! transfer it does not need — and a failure on any
//! device ends the run on all of them with that device's error.
//!
//! Variables stay on their devices across steps: a step moves only its feeds in,
//! the values that cross devices between them, and its results out.
//!
//! A `recv` waits at most the executor runtime's timeout (60 s by default; a longer
//! one through [`Strategy::with_runtime`] and
//! [`Runtime::with_timeout`](meshwork_executor::Runtime::with_timeout)), then the
//! step fails with the executor's `Timeout` everywhere — a pipeline whose first stage
//! waits out a long backward needs the longer one.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use meshwork_executor::ReplicaContext;
use meshwork_placer::{
    ArgKind, CostPlacement, DeviceSet, Explanation, Graph, Kernel, Node, NodeId, OpDef, OpRegistry,
    Placement, PlacerOptions, Registry,
};
use meshwork_program::fast::{Input, Options};
use meshwork_program::{Builder, Catalogue, Channels, Env, Program, Tensor, Value};
use meshwork_types::{DType, TensorSpec};

use crate::spmd::run::{ReplicaError, boolean, numeric, run_replicas};
use crate::{Error, Result, Strategy};

mod cost;
mod dataflow;

use cost::NodeWork;
use dataflow::Segments;

pub use cost::{DeviceRates, ProgramCost, Rates, Work, work};

/// How a program is placed.
#[derive(Debug, Clone)]
pub struct PlaceOptions {
    /// The device names, one per executor device used (device `i` of the strategy's
    /// runtime runs the `i`-th); `None` names every device of the strategy
    /// `/job:localhost/replica:0/task:0/device:CPU:i`. Other device types (a `TPU`
    /// whose kernels the catalogue restricts, say) run on the same CPU threads here.
    pub devices: Option<Vec<String>>,
    /// Which device types run which instructions.
    pub catalogue: Catalogue,
    /// TensorFlow's `allow_soft_placement`; on by default, as in TensorFlow 2's
    /// functions.
    pub allow_soft_placement: bool,
}

impl Default for PlaceOptions {
    fn default() -> PlaceOptions {
        PlaceOptions { devices: None, catalogue: Catalogue::cpu(), allow_soft_placement: true }
    }
}

/// A program as the placer's graph: its nodes, the registry of their op types (from
/// the catalogue) and which node carries each value.
#[derive(Debug, Clone)]
pub struct ProgramGraph {
    /// The graph.
    pub graph: Graph,
    /// The op types of its nodes.
    pub registry: Registry,
    /// Per program value, the node placing it (a variable's handle).
    place_node: Vec<NodeId>,
    /// Per node, what it costs.
    works: Vec<NodeWork>,
}

impl ProgramGraph {
    /// The node that places value `v` (a variable's `VarHandleOp`, otherwise the node
    /// computing it).
    pub fn node(&self, v: Value) -> Option<NodeId> {
        self.place_node.get(v.index()).copied()
    }
}

impl OpRegistry for ProgramGraph {
    fn op(&self, name: &str) -> Option<&OpDef> {
        self.registry.op(name)
    }
}

/// The name of value `v`'s node: a parameter's name, an instruction's name, or `%N`.
fn node_name(program: &Program, v: Value) -> String {
    match program.instr(v) {
        None => program.params()[v.index()].name.clone(),
        Some(i) => i.name.clone().unwrap_or_else(|| v.to_string()),
    }
}

/// Builds the placer's graph of `program`, whose parameters `variables` are resource
/// variables (the others are fed), updated by `updates` (result index, parameter).
pub fn program_graph(
    program: &Program,
    variables: &[bool],
    updates: &[(usize, usize)],
    catalogue: &Catalogue,
) -> Result<ProgramGraph> {
    let np = program.params().len();
    let refuse = |value: String, problem: String| Err(Error::Placed { value, problem });
    if variables.len() != np {
        return refuse(
            String::new(),
            format!("{} variable flags for {np} parameters", variables.len()),
        );
    }
    for &(r, p) in updates {
        if r >= program.results().len() || p >= np || !variables[p] {
            return refuse(
                format!("update ({r}, {p})"),
                format!(
                    "updates pair a result (of {}) with a variable parameter (of {np})",
                    program.results().len()
                ),
            );
        }
    }
    let all_types: Vec<&str> = catalogue.device_types().collect();
    let mut registry = Registry::new();
    let any_device =
        |inputs: &[ArgKind], outputs: &[ArgKind]| OpDef::new(inputs, outputs, &all_types);
    registry
        .insert("Placeholder", any_device(&[], &[ArgKind::Value]))
        .insert("VarHandleOp", any_device(&[], &[ArgKind::Resource]))
        .insert("ReadVariableOp", any_device(&[ArgKind::Resource], &[ArgKind::Value]))
        .insert("AssignVariableOp", any_device(&[ArgKind::Resource, ArgKind::Value], &[]));
    let mut graph = Graph::new();
    let mut value_node = Vec::with_capacity(program.num_values());
    let mut place_node = Vec::with_capacity(program.num_values());
    let mut works = Vec::with_capacity(program.num_values() + np + updates.len());
    for (k, p) in program.params().iter().enumerate() {
        if variables[k] {
            let bytes = cost::spec_bytes(&p.spec);
            let handle = graph.add_node(Node::new(&p.name, "VarHandleOp").on(&p.device))?;
            works.push(NodeWork { memory: bytes, ..NodeWork::default() });
            let read = graph.add_node(Node::new(&format!("{}/read", p.name), "ReadVariableOp"))?;
            works.push(NodeWork { output: bytes, ..NodeWork::default() });
            graph.add_edge(&p.name, 0, &format!("{}/read", p.name), 0)?;
            value_node.push(read);
            place_node.push(handle);
        } else {
            let id = graph.add_node(Node::new(&p.name, "Placeholder").on(&p.device))?;
            let bytes = cost::spec_bytes(&p.spec);
            works.push(NodeWork { memory: bytes, output: bytes, ..NodeWork::default() });
            value_node.push(id);
            place_node.push(id);
        }
    }
    let mut widths: HashMap<String, usize> = HashMap::new();
    for (i, instr) in program.instrs().iter().enumerate() {
        let v = Value((np + i) as u32);
        if instr.op.communicates() {
            return Err(Error::Placed {
                value: node_name(program, v),
                problem: format!(
                    "{} communicates on its own; a placed program's transfers are the placer's",
                    instr.op.name()
                ),
            });
        }
        let dtype = Catalogue::kernel_dtype(program, instr);
        let op_type = format!("{}:{dtype}", instr.op.name());
        let width = widths.entry(op_type.clone()).or_default();
        *width = (*width).max(instr.args.len());
        if registry.op(&op_type).is_none() {
            registry.insert(&op_type, kernel_def(catalogue, instr, dtype, 0));
        }
        let name = node_name(program, v);
        let colocation: Vec<String> =
            instr.colocate.iter().map(|c| node_name(program, *c)).collect();
        let node = Node { colocation, ..Node::new(&name, &op_type).on(&instr.device) };
        let id = graph.add_node(node)?;
        let bytes = cost::spec_bytes(&instr.spec);
        works.push(NodeWork { work: work(program, instr), memory: bytes, output: bytes });
        for (k, a) in instr.args.iter().enumerate() {
            let src = graph.node(value_node[a.index()]).name.clone();
            graph.add_edge(&src, 0, &name, k)?;
        }
        value_node.push(id);
        place_node.push(id);
    }
    for (op_type, width) in widths {
        if let Some(def) = registry.op(&op_type).cloned() {
            registry.insert(&op_type, OpDef { inputs: vec![ArgKind::Value; width], ..def });
        }
    }
    for &(r, p) in updates {
        let var = &program.params()[p].name;
        let value = program.results()[r];
        let device = program.instr(value).map_or("", |i| i.device.as_str());
        let assign = format!("{var}/assign");
        graph.add_node(Node::new(&assign, "AssignVariableOp").on(device))?;
        works.push(NodeWork::default());
        graph.add_edge(var, 0, &assign, 0)?;
        let src = graph.node(value_node[value.index()]).name.clone();
        graph.add_edge(&src, 0, &assign, 1)?;
    }
    debug_assert_eq!(works.len(), graph.len());
    Ok(ProgramGraph { graph, registry, place_node, works })
}

fn kernel_def(
    catalogue: &Catalogue,
    instr: &meshwork_program::Instr,
    dtype: DType,
    width: usize,
) -> OpDef {
    OpDef {
        inputs: vec![ArgKind::Value; width],
        outputs: vec![ArgKind::Value],
        kernels: catalogue
            .kernels(&instr.op, dtype)
            .into_iter()
            .map(|(t, priority)| Kernel { device_type: t.to_string(), priority })
            .collect(),
        ..OpDef::default()
    }
}

/// A transfer of one value to one device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transfer {
    /// The value.
    pub value: Value,
    /// Its spec.
    pub spec: TensorSpec,
    /// The device index (into [`Placed::devices`]) that computes it.
    pub from: usize,
    /// The device index that reads it.
    pub to: usize,
}

/// Where each input of a device's program comes from.
#[derive(Debug, Clone, Copy)]
enum Source {
    /// The step's feed `k` (a fed parameter's position among the feeds).
    Feed(usize),
    /// The resident value of variable parameter `k`.
    Variable(usize),
}

/// Where each result of a device's program goes.
#[derive(Debug, Clone, Copy)]
enum Sink {
    /// The step's result `k`.
    Result(usize),
    /// The next value of variable parameter `k`.
    Update(usize),
    /// Nothing (a program must return something).
    Token,
}

/// One device's part of a placed program.
struct Part {
    /// The executor device that runs it.
    device: usize,
    program: Program,
    /// Its inputs (moved into [`Placed::sources`] once placed).
    sources: Vec<Source>,
    sinks: Vec<Sink>,
}

/// A program placed on a strategy's devices and split into one program per device.
/// Variables (the carried parameters) stay on their devices between steps.
pub struct Placed<'s> {
    strategy: &'s Strategy,
    program: Program,
    graph: ProgramGraph,
    devices: DeviceSet,
    options: PlacerOptions,
    placement: Placement,
    /// The cost-aware pass's choice, when it placed the program.
    estimate: Option<CostPlacement>,
    /// Per program value, its device index.
    device_of: Vec<usize>,
    parts: Vec<Part>,
    transfers: Vec<Transfer>,
    /// Parameter indices fed each step, in order.
    feeds: Vec<usize>,
    /// Per part, the resident values of its variables (in its sources' order), on
    /// the part's device.
    resident: Arc<Vec<Mutex<Vec<Option<Tensor>>>>>,
    /// Per parameter: the (part, slot) of its resident value if it is a variable.
    slot: Vec<Option<(usize, usize)>>,
    /// Held while a step runs: one step of a placed program at a time.
    busy: Mutex<()>,
    /// Each part cut into segments, shared with the device threads.
    exes: Arc<Vec<Segments>>,
    /// Each part's inputs, shared with the device threads.
    sources: Arc<Vec<Vec<Source>>>,
    /// The executor device of each part.
    executors: Vec<usize>,
}

impl fmt::Debug for Placed<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Placed")
            .field("devices", &self.devices.devices().len())
            .field("parts", &self.parts.len())
            .field("transfers", &self.transfers.len())
            .finish()
    }
}

impl Strategy {
    /// Places `program` on this strategy's devices by TensorFlow's rules and splits it
    /// into one program per device. `carry` pairs (result index, parameter index):
    /// after each step, that result becomes that parameter's value — those
    /// parameters are resource variables, resident on their device (set them with
    /// [`Placed::set`] before the first step); the other parameters are fed.
    pub fn place(
        &self,
        program: &Program,
        carry: &[(usize, usize)],
        options: &PlaceOptions,
    ) -> Result<Placed<'_>> {
        self.place_by(program, carry, options, None)
    }

    /// [`place`](Self::place), then devices chosen by cost: TensorFlow's rules decide
    /// which devices each colocation group may use (requests, kernels, resource
    /// edges), and [`meshwork_placer::place_with_cost`] chooses among them by an
    /// estimated schedule under `cost`'s memory caps — so a program without device
    /// scopes spreads over the devices where that is estimated faster, or where one
    /// device's memory would not hold it. The estimate, and TensorFlow's default
    /// placement's under the same model, are [`Placed::estimate`].
    pub fn place_with_cost(
        &self,
        program: &Program,
        carry: &[(usize, usize)],
        options: &PlaceOptions,
        cost: &ProgramCost,
    ) -> Result<Placed<'_>> {
        self.place_by(program, carry, options, Some(cost))
    }

    fn place_by(
        &self,
        program: &Program,
        carry: &[(usize, usize)],
        options: &PlaceOptions,
        cost: Option<&ProgramCost>,
    ) -> Result<Placed<'_>> {
        let np = program.params().len();
        let mut variables = vec![false; np];
        for &(r, p) in carry {
            let (Some(&v), Some(param)) = (program.results().get(r), program.params().get(p))
            else {
                return Err(Error::Placed {
                    value: format!("carry ({r}, {p})"),
                    problem: format!(
                        "the program has {} results and {np} parameters",
                        program.results().len()
                    ),
                });
            };
            if program.spec(v) != Some(&param.spec) {
                return Err(Error::Placed {
                    value: param.name.clone(),
                    problem: format!(
                        "result {r} is {}, the parameter is {}",
                        program.spec(v).expect("a result"),
                        param.spec
                    ),
                });
            }
            if std::mem::replace(&mut variables[p], true) {
                return Err(Error::Placed {
                    value: param.name.clone(),
                    problem: "carried into twice".into(),
                });
            }
        }
        if self.is_multi_process() {
            return Err(Error::Placed {
                value: String::new(),
                problem: "placed programs run on the devices of one process".into(),
            });
        }
        let runtime_devices = self.runtime().devices();
        let names: Vec<String> = match &options.devices {
            Some(names) => names.clone(),
            None => (0..runtime_devices)
                .map(|i| format!("/job:localhost/replica:0/task:0/device:CPU:{i}"))
                .collect(),
        };
        if names.is_empty() || names.len() > runtime_devices {
            return Err(Error::Placed {
                value: String::new(),
                problem: format!(
                    "{} device names for a strategy of {runtime_devices} devices",
                    names.len()
                ),
            });
        }
        let devices = DeviceSet::new(&names)?;
        let graph = program_graph(program, &variables, carry, &options.catalogue)?;
        let placer_options = PlacerOptions {
            allow_soft_placement: options.allow_soft_placement,
            log_device_placement: false,
        };
        let tf = meshwork_placer::place(&graph.graph, &devices, &graph, placer_options)?;
        let (placement, estimate) = match cost {
            None => (tf, None),
            Some(cost) => {
                let model = cost::NodeCosts { cost, graph: &graph };
                let chosen = meshwork_placer::place_with_cost(
                    &graph.graph,
                    &devices,
                    &graph,
                    placer_options,
                    &model,
                )?;
                (tf.with_devices(&graph.graph, chosen.devices.clone())?, Some(chosen))
            }
        };
        let device_of: Vec<usize> = graph.place_node.iter().map(|&n| placement.device(n)).collect();
        let feeds: Vec<usize> = (0..np).filter(|&k| !variables[k]).collect();
        let (mut parts, transfers) = split(program, &device_of, &variables, &feeds, carry)?;
        let mut slot = vec![None; np];
        let mut resident = Vec::with_capacity(parts.len());
        for (r, part) in parts.iter().enumerate() {
            let mut held = Vec::new();
            for s in &part.sources {
                if let Source::Variable(k) = *s {
                    slot[k] = Some((r, held.len()));
                    held.push(None);
                }
            }
            resident.push(Mutex::new(held));
        }
        // A device is a fixed share of the machine's cores, used or not: a placement
        // that leaves devices idle does not get their cores.
        let options = Options::for_devices(runtime_devices);
        let exes = Arc::new(
            parts.iter().map(|p| Segments::new(&p.program, options)).collect::<Result<Vec<_>>>()?,
        );
        Ok(Placed {
            strategy: self,
            program: program.clone(),
            graph,
            devices,
            options: placer_options,
            placement,
            estimate,
            device_of,
            transfers,
            feeds,
            resident: Arc::new(resident),
            slot,
            busy: Mutex::new(()),
            exes,
            executors: parts.iter().map(|p| p.device).collect(),
            sources: Arc::new(parts.iter_mut().map(|p| std::mem::take(&mut p.sources)).collect()),
            parts,
        })
    }
}

/// Splits `program` by `device_of` into one program per device that holds a value,
/// with a send/recv pair per (value, reading device).
fn split(
    program: &Program,
    device_of: &[usize],
    variables: &[bool],
    feeds: &[usize],
    carry: &[(usize, usize)],
) -> Result<(Vec<Part>, Vec<Transfer>)> {
    let np = program.params().len();
    let mut used: Vec<usize> = device_of.to_vec();
    used.sort_unstable();
    used.dedup();
    // The executor replica of each device index.
    let replica: HashMap<usize, usize> = used.iter().enumerate().map(|(r, &d)| (d, r)).collect();
    // Who reads each value where: (value, device) pairs, in order of first need.
    let mut needs: Vec<Vec<usize>> = vec![Vec::new(); program.num_values()];
    let mut need = |v: Value, d: usize| {
        if device_of[v.index()] != d && !needs[v.index()].contains(&d) {
            needs[v.index()].push(d);
        }
    };
    for (i, instr) in program.instrs().iter().enumerate() {
        for a in &instr.args {
            need(*a, device_of[np + i]);
        }
    }
    for &(r, p) in carry {
        need(program.results()[r], device_of[p]);
    }
    let mut channel: HashMap<(usize, usize), u32> = HashMap::new();
    let mut transfers = Vec::new();
    for (v, ds) in needs.iter().enumerate() {
        for &d in ds {
            channel.insert((v, d), transfers.len() as u32);
            transfers.push(Transfer {
                value: Value(v as u32),
                spec: program.spec(Value(v as u32)).expect("a value").clone(),
                from: device_of[v],
                to: d,
            });
        }
    }
    let mut builders: Vec<Builder> = used.iter().map(|_| Builder::new()).collect();
    let mut sources: Vec<Vec<Source>> = vec![Vec::new(); used.len()];
    // Per (device replica, value): the value there.
    let mut local: Vec<HashMap<usize, Value>> = vec![HashMap::new(); used.len()];
    let send_all = |b: &mut Builder, v: usize, x: Value, needs: &[Vec<usize>]| -> Result<()> {
        for &d in &needs[v] {
            b.send(x, channel[&(v, d)], replica[&d])?;
        }
        Ok(())
    };
    let feed_index: HashMap<usize, usize> =
        feeds.iter().enumerate().map(|(f, &k)| (k, f)).collect();
    for (k, p) in program.params().iter().enumerate() {
        let r = replica[&device_of[k]];
        let b = &mut builders[r];
        let x = b.param(&p.name, p.spec.clone())?;
        local[r].insert(k, x);
        sources[r].push(if variables[k] {
            Source::Variable(k)
        } else {
            Source::Feed(feed_index[&k])
        });
        send_all(b, k, x, &needs)?;
    }
    // The value `v` on replica `r`: local, or received (once) from its device.
    let fetch =
        |b: &mut Builder, local: &mut HashMap<usize, Value>, v: Value, d: usize| -> Result<Value> {
            if let Some(&x) = local.get(&v.index()) {
                return Ok(x);
            }
            let spec = program.spec(v).expect("a value");
            let x = b.recv(spec, channel[&(v.index(), d)], replica[&device_of[v.index()]])?;
            local.insert(v.index(), x);
            Ok(x)
        };
    for (i, instr) in program.instrs().iter().enumerate() {
        let v = np + i;
        let d = device_of[v];
        let r = replica[&d];
        let b = &mut builders[r];
        let mut args = Vec::with_capacity(instr.args.len());
        for a in &instr.args {
            args.push(fetch(b, &mut local[r], *a, d)?);
        }
        let x = b.push(instr.op.clone(), &args)?;
        local[r].insert(v, x);
        send_all(b, v, x, &needs)?;
    }
    let mut sinks: Vec<Vec<Sink>> = vec![Vec::new(); used.len()];
    let mut outs: Vec<Vec<Value>> = vec![Vec::new(); used.len()];
    for (k, res) in program.results().iter().enumerate() {
        let r = replica[&device_of[res.index()]];
        outs[r].push(local[r][&res.index()]);
        sinks[r].push(Sink::Result(k));
    }
    for &(res, p) in carry {
        let d = device_of[p];
        let r = replica[&d];
        let x = fetch(&mut builders[r], &mut local[r], program.results()[res], d)?;
        outs[r].push(x);
        sinks[r].push(Sink::Update(p));
    }
    let mut parts = Vec::with_capacity(used.len());
    for (r, mut b) in builders.into_iter().enumerate() {
        if outs[r].is_empty() {
            outs[r].push(b.constant(0.0, DType::I32)?);
            sinks[r].push(Sink::Token);
        }
        let part = b.finish(&outs[r])?;
        parts.push(Part {
            device: used[r],
            program: part,
            sources: std::mem::take(&mut sources[r]),
            sinks: std::mem::take(&mut sinks[r]),
        });
    }
    Ok((parts, transfers))
}

/// The program crate's channels over an executor replica (peers are replicas).
struct ReplicaChannels<'a> {
    ctx: &'a ReplicaContext,
    /// The executor's error when a transfer failed because a peer had.
    peer: Mutex<Option<meshwork_executor::Error>>,
}

impl ReplicaChannels<'_> {
    fn comm(&self, op: &str, e: meshwork_executor::Error) -> meshwork_program::Error {
        if matches!(e, meshwork_executor::Error::PeerFailed { .. }) {
            *lock(&self.peer) = Some(e.clone());
        }
        meshwork_program::Error::Communication { at: op.to_string(), problem: e.to_string() }
    }

    /// This replica's failure: the executor's `PeerFailed` when a transfer failed
    /// because another replica had (so the run reports that replica's own error).
    fn failure(&self, e: meshwork_program::Error) -> ReplicaError {
        match lock(&self.peer).take() {
            Some(peer) => ReplicaError::Peer(peer),
            None => ReplicaError::Program(e),
        }
    }
}

impl Channels for ReplicaChannels<'_> {
    fn send(&self, channel: u32, peer: usize, x: Tensor) -> meshwork_program::Result<()> {
        self.ctx.send(peer, u64::from(channel), numeric(x).0).map_err(|e| self.comm("send", e))
    }

    fn recv(
        &self,
        channel: u32,
        peer: usize,
        spec: &TensorSpec,
    ) -> meshwork_program::Result<Tensor> {
        let t = self.ctx.recv(peer, u64::from(channel)).map_err(|e| self.comm("recv", e))?;
        Ok(if spec.dtype == DType::Bool { boolean(t) } else { t })
    }

    fn sends_wait(&self) -> bool {
        false // the executor's mailbox: a send leaves the tensor and returns
    }
}

impl Placed<'_> {
    /// The device names, in the order device indices count them.
    pub fn devices(&self) -> &DeviceSet {
        &self.devices
    }

    /// The device index value `v` is placed on.
    pub fn device_index(&self, v: Value) -> Option<usize> {
        self.device_of.get(v.index()).copied()
    }

    /// The name of the device value `v` is placed on.
    pub fn device(&self, v: Value) -> Option<&str> {
        self.device_index(v).map(|d| self.devices.devices()[d].name())
    }

    /// The placer's graph of the program.
    pub fn graph(&self) -> &ProgramGraph {
        &self.graph
    }

    /// The placement of the graph's nodes.
    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// The cost model's estimate, when [`Strategy::place_with_cost`] placed the
    /// program: the chosen placement's estimated step time (`makespan`), TensorFlow's
    /// default placement's under the same model (`tf_makespan`, `None` where it
    /// exceeds a memory cap) and the bytes resident per device.
    pub fn estimate(&self) -> Option<&CostPlacement> {
        self.estimate.as_ref()
    }

    /// Every transfer a step makes (one per value and reading device).
    pub fn transfers(&self) -> &[Transfer] {
        &self.transfers
    }

    /// Bytes a step moves between devices.
    pub fn transfer_bytes(&self) -> u64 {
        self.transfers.iter().map(|t| cost::spec_bytes(&t.spec)).sum()
    }

    /// Each device's program, with the device index it runs on.
    pub fn parts(&self) -> impl Iterator<Item = (usize, &Program)> {
        self.parts.iter().map(|p| (p.device, &p.program))
    }

    /// Why TensorFlow's rules put the node of value `v` (a variable's handle) where
    /// they did: its requests, colocation group and allowed devices. After
    /// [`Strategy::place_with_cost`] the node may run on another device the same
    /// rules allow ([`device`](Self::device), [`estimate`](Self::estimate)).
    pub fn explain(&self, v: Value) -> Result<Explanation> {
        let node = self.graph.node(v).ok_or(Error::Placed {
            value: v.to_string(),
            problem: "not a value of the program".into(),
        })?;
        let name = self.graph.graph.node(node).name.clone();
        Ok(meshwork_placer::explain(
            &self.graph.graph,
            &self.devices,
            &self.graph,
            self.options,
            &name,
        )?)
    }

    /// The placed graph in Graphviz's DOT language, one cluster per device.
    pub fn to_dot(&self) -> String {
        meshwork_placer::to_dot(&self.graph.graph, &self.devices, &self.placement)
    }

    /// The names of the variables (carried parameters).
    pub fn variables(&self) -> Vec<&str> {
        self.program
            .params()
            .iter()
            .zip(&self.slot)
            .filter(|(_, s)| s.is_some())
            .map(|(p, _)| p.name.as_str())
            .collect()
    }

    /// Variable `name`'s parameter index and (part, slot).
    fn variable(&self, name: &str) -> Result<(usize, usize, usize)> {
        self.program
            .params()
            .iter()
            .position(|p| p.name == name)
            .and_then(|k| self.slot[k].map(|(r, j)| (k, r, j)))
            .ok_or_else(|| Error::Placed {
                value: name.to_string(),
                problem: "not a variable of the placed program".into(),
            })
    }

    /// Sets variable `name` (kept on its device).
    pub fn set(&self, name: &str, value: Tensor) -> Result<()> {
        let (k, r, j) = self.variable(name)?;
        let spec = &self.program.params()[k].spec;
        if value.spec() != *spec {
            return Err(Error::Placed {
                value: name.to_string(),
                problem: format!("set to {}, the variable is {spec}", value.spec()),
            });
        }
        let _step = self.busy.lock().unwrap_or_else(PoisonError::into_inner);
        self.resident[r].lock().unwrap_or_else(PoisonError::into_inner)[j] = Some(value);
        Ok(())
    }

    /// Variable `name`'s current value.
    pub fn get(&self, name: &str) -> Result<Tensor> {
        let (_, r, j) = self.variable(name)?;
        let _step = self.busy.lock().unwrap_or_else(PoisonError::into_inner);
        self.resident[r].lock().unwrap_or_else(PoisonError::into_inner)[j].clone().ok_or_else(
            || Error::Placed { value: name.to_string(), problem: "has no value yet".into() },
        )
    }

    /// Runs one step: `feeds` are the fed parameters in order; returns the program's
    /// results. Carried results become the variables' values only if every device
    /// finished the step; a step that fails anywhere leaves them as they were.
    pub fn step(&self, feeds: &[Tensor]) -> Result<Vec<Tensor>> {
        if feeds.len() != self.feeds.len() {
            return Err(Error::Placed {
                value: String::new(),
                problem: format!("{} feeds for {} fed parameters", feeds.len(), self.feeds.len()),
            });
        }
        for (t, &k) in feeds.iter().zip(&self.feeds) {
            let p = &self.program.params()[k];
            if t.spec() != p.spec {
                return Err(Error::Placed {
                    value: p.name.clone(),
                    problem: format!("fed {}, the parameter is {}", t.spec(), p.spec),
                });
            }
        }
        let _step = self.busy.lock().unwrap_or_else(PoisonError::into_inner);
        for (k, p) in self.program.params().iter().enumerate() {
            if let Some((r, j)) = self.slot[k]
                && self.resident[r].lock().unwrap_or_else(PoisonError::into_inner)[j].is_none()
            {
                return Err(Error::Placed {
                    value: p.name.clone(),
                    problem: "has no value yet: set it before the first step".into(),
                });
            }
        }
        let n = self.parts.len();
        // Each device's feeds, moved to it; its variables are read in place there.
        let feeds_of: Vec<Vec<Tensor>> = self
            .sources
            .iter()
            .map(|sources| {
                sources
                    .iter()
                    .filter_map(|s| match *s {
                        Source::Feed(f) => Some(feeds[f].clone()),
                        Source::Variable(_) => None,
                    })
                    .collect()
            })
            .collect();
        let slots: Arc<Vec<Mutex<Vec<Tensor>>>> =
            Arc::new(feeds_of.into_iter().map(Mutex::new).collect());
        let outs: Arc<Vec<Mutex<Vec<Tensor>>>> =
            Arc::new((0..n).map(|_| Mutex::new(Vec::new())).collect());
        let (exes, resident, o) = (self.exes.clone(), self.resident.clone(), outs.clone());
        let sources = self.sources.clone();
        run_replicas(
            self.strategy.runtime(),
            &self.executors,
            Arc::new(move |ctx| {
                let r = ctx.replica_id();
                let mut fed = std::mem::take(&mut *lock(&slots[r])).into_iter();
                let held = lock(&resident[r]);
                let mut vars = held.iter();
                let mut inputs = Vec::with_capacity(sources[r].len());
                for s in &sources[r] {
                    inputs.push(match s {
                        Source::Feed(_) => Input::Owned(fed.next().expect("a feed per source")),
                        Source::Variable(_) => Input::Borrowed(
                            vars.next().and_then(Option::as_ref).expect("checked before the step"),
                        ),
                    });
                }
                let channels = ReplicaChannels { ctx, peer: Mutex::new(None) };
                let env = Env::local().with_channels(&channels);
                let out = exes[r].run(ctx, inputs, &env, &|e| channels.failure(e))?;
                *lock(&o[r]) = out;
                Ok(())
            }),
        )?;
        // Every device finished: results out, updates in.
        let mut results: Vec<Option<Tensor>> = vec![None; self.program.results().len()];
        for (r, (part, out)) in self.parts.iter().zip(outs.iter()).enumerate() {
            let out = std::mem::take(&mut *lock(out));
            for (sink, t) in part.sinks.iter().zip(out) {
                match *sink {
                    Sink::Result(k) => results[k] = Some(t),
                    Sink::Update(k) => {
                        let (vr, j) = self.slot[k].expect("an updated parameter is a variable");
                        debug_assert_eq!(vr, r);
                        lock(&self.resident[vr])[j] = Some(t);
                    }
                    Sink::Token => {}
                }
            }
        }
        Ok(results.into_iter().map(|t| t.expect("every result has a device")).collect())
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl fmt::Display for Placed<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for part in &self.parts {
            writeln!(f, "# {}", self.devices.devices()[part.device].name())?;
            write!(f, "{}", part.program)?;
        }
        Ok(())
    }
}
