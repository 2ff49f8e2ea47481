//! Placement, TensorFlow's way: a program's device requests
//! ([`Builder::device`](meshwork_program::Builder::device),
//! [`colocate_with`](meshwork_program::Builder::colocate_with)) become a placer
//! [`Graph`]: a fed parameter is a `Placeholder`; a parameter the program updates
//! (carried) is a resource variable — a `VarHandleOp`, the `ReadVariableOp` its
//! readers read, and an `AssignVariableOp` per update, requested where the update's
//! instruction is, so TensorFlow's resource-edge rule puts reads and updates with the
//! variable; each instruction is a node of op type `op:dtype` whose kernels the
//! program crate's [`Catalogue`] lists. [`meshwork_placer::place`] decides (soft
//! placement, colocation groups, TF's errors), then [`split`] makes one program per
//! device with a `send`/`recv` pair for every value that crosses devices (one transfer
//! per value and destination device, as TensorFlow's partitioner deduplicates).
//! [`place_program`] does all of it; a back end runs the [`Part`]s.

use std::collections::HashMap;
use std::fmt;

use meshwork_placer::{
    ArgKind, CostPlacement, DeviceSet, Explanation, Graph, Kernel, Node, NodeId, OpDef, OpRegistry,
    Placement, PlacerOptions, Registry,
};
use meshwork_program::{Builder, Catalogue, Program, Value};
use meshwork_types::{DType, TensorSpec};

use crate::{Error, Result};

mod cost;

use cost::NodeWork;

pub use cost::{DeviceRates, ProgramCost, Rates, Work, spec_bytes, work};

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
            let bytes = spec_bytes(&p.spec);
            let handle = graph.add_node(Node::new(&p.name, "VarHandleOp").on(&p.device))?;
            works.push(NodeWork { memory: bytes, ..NodeWork::default() });
            let read = graph.add_node(Node::new(&format!("{}/read", p.name), "ReadVariableOp"))?;
            works.push(NodeWork { output: bytes, ..NodeWork::default() });
            graph.add_edge(&p.name, 0, &format!("{}/read", p.name), 0)?;
            value_node.push(read);
            place_node.push(handle);
        } else {
            let id = graph.add_node(Node::new(&p.name, "Placeholder").on(&p.device))?;
            let bytes = spec_bytes(&p.spec);
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
        let bytes = spec_bytes(&instr.spec);
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
    /// The device index (into [`PlacedProgram::devices`]) that computes it.
    pub from: usize,
    /// The device index that reads it.
    pub to: usize,
}

/// Where each input of a device's program comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The step's feed `k` (a fed parameter's position among the feeds).
    Feed(usize),
    /// The resident value of variable parameter `k`.
    Variable(usize),
}

/// Where each result of a device's program goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sink {
    /// The step's result `k`.
    Result(usize),
    /// The next value of variable parameter `k`.
    Update(usize),
    /// Nothing (a program must return something).
    Token,
}

/// One device's part of a placed program: what a back end runs on that device.
#[derive(Debug, Clone)]
pub struct Part {
    /// The device (index into [`PlacedProgram::devices`]) that runs it.
    pub device: usize,
    /// Its program: the instructions placed there, a `recv` before the first use of
    /// each value computed elsewhere, a `send` after each value another device reads.
    pub program: Program,
    /// Where each of its parameters comes from.
    pub sources: Vec<Source>,
    /// Where each of its results goes.
    pub sinks: Vec<Sink>,
}

/// A program placed on devices by TensorFlow's rules (or by cost among the devices
/// they allow) and split into one program per device: what the placer decided, and
/// the parts a back end runs.
#[derive(Debug, Clone)]
pub struct PlacedProgram {
    program: Program,
    graph: ProgramGraph,
    devices: DeviceSet,
    options: PlacerOptions,
    placement: Placement,
    estimate: Option<CostPlacement>,
    device_of: Vec<usize>,
    parts: Vec<Part>,
    transfers: Vec<Transfer>,
    feeds: Vec<usize>,
    variables: Vec<bool>,
}

/// Places `program` on `devices` devices (named by `options.devices`, or
/// `/job:localhost/replica:0/task:0/device:CPU:i`) by TensorFlow's rules and splits it
/// into one program per device. `carry` pairs (result index, parameter index): after
/// each step, that result becomes that parameter's value — those parameters are
/// resource variables, resident on their device; the other parameters are fed. With
/// `cost`, TensorFlow's rules decide which devices each colocation group may use, and
/// [`meshwork_placer::place_with_cost`] chooses among them by an estimated schedule
/// under `cost`'s memory caps.
pub fn place_program(
    program: &Program,
    carry: &[(usize, usize)],
    options: &PlaceOptions,
    devices: usize,
    cost: Option<&ProgramCost>,
) -> Result<PlacedProgram> {
    let np = program.params().len();
    let mut variables = vec![false; np];
    for &(r, p) in carry {
        let (Some(&v), Some(param)) = (program.results().get(r), program.params().get(p)) else {
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
    let names: Vec<String> = match &options.devices {
        Some(names) => names.clone(),
        None => (0..devices)
            .map(|i| format!("/job:localhost/replica:0/task:0/device:CPU:{i}"))
            .collect(),
    };
    if names.is_empty() || names.len() > devices {
        return Err(Error::Placed {
            value: String::new(),
            problem: format!("{} device names for {devices} devices", names.len()),
        });
    }
    let device_set = DeviceSet::new(&names)?;
    let graph = program_graph(program, &variables, carry, &options.catalogue)?;
    let placer_options = PlacerOptions {
        allow_soft_placement: options.allow_soft_placement,
        log_device_placement: false,
    };
    let tf = meshwork_placer::place(&graph.graph, &device_set, &graph, placer_options)?;
    let (placement, estimate) = match cost {
        None => (tf, None),
        Some(cost) => {
            let model = cost::NodeCosts { cost, graph: &graph };
            let chosen = meshwork_placer::place_with_cost(
                &graph.graph,
                &device_set,
                &graph,
                placer_options,
                &model,
            )?;
            (tf.with_devices(&graph.graph, chosen.devices.clone())?, Some(chosen))
        }
    };
    let device_of: Vec<usize> = graph.place_node.iter().map(|&n| placement.device(n)).collect();
    let feeds: Vec<usize> = (0..np).filter(|&k| !variables[k]).collect();
    let (parts, transfers) = split(program, &device_of, &variables, &feeds, carry)?;
    Ok(PlacedProgram {
        program: program.clone(),
        graph,
        devices: device_set,
        options: placer_options,
        placement,
        estimate,
        device_of,
        parts,
        transfers,
        feeds,
        variables,
    })
}

impl PlacedProgram {
    /// The program as it was given.
    pub fn program(&self) -> &Program {
        &self.program
    }

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

    /// The cost model's estimate, when placed with a cost: the chosen placement's
    /// estimated step time (`makespan`), TensorFlow's default placement's under the
    /// same model (`tf_makespan`, `None` where it exceeds a memory cap) and the bytes
    /// resident per device.
    pub fn estimate(&self) -> Option<&CostPlacement> {
        self.estimate.as_ref()
    }

    /// Every transfer a step makes (one per value and reading device).
    pub fn transfers(&self) -> &[Transfer] {
        &self.transfers
    }

    /// Bytes a step moves between devices.
    pub fn transfer_bytes(&self) -> u64 {
        self.transfers.iter().map(|t| spec_bytes(&t.spec)).sum()
    }

    /// Each device's part, in device order.
    pub fn parts(&self) -> &[Part] {
        &self.parts
    }

    /// The fed parameters' indices, in the order a step takes its feeds.
    pub fn feeds(&self) -> &[usize] {
        &self.feeds
    }

    /// Whether each parameter is a variable (carried, resident on its device).
    pub fn variables(&self) -> &[bool] {
        &self.variables
    }

    /// Why TensorFlow's rules put the node of value `v` (a variable's handle) where
    /// they did: its requests, colocation group and allowed devices. Placed with a
    /// cost, the node may run on another device the same rules allow
    /// ([`device`](Self::device), [`estimate`](Self::estimate)).
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
}

impl fmt::Display for PlacedProgram {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for part in &self.parts {
            writeln!(f, "# {}", self.devices.devices()[part.device].name())?;
            write!(f, "{}", part.program)?;
        }
        Ok(())
    }
}

/// Splits `program` by `device_of` (each value's device index) into one program per
/// device that holds a value, with a send/recv pair per (value, reading device): sends
/// right after the value is made, receives right before its first use. `variables`
/// marks the resident parameters, `feeds` lists the fed ones in order, `carry` pairs
/// (result, parameter) of the updates.
pub fn split(
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
