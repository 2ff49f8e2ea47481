//! The SPMD partitioner: a program for one device, annotated with layouts over a
//! mesh, rewritten into the program every device of the mesh runs.

use std::collections::HashMap;
use std::fmt;

use meshwork_program::{Builder, Op, Program, Reduction, Value};
use meshwork_sharding::Mesh;
use meshwork_sharding::spmd::{
    FactorKind, Graph, Layout, Node, Operand, Step, node_layouts, propagate, transition,
};
use meshwork_types::{ReduceOp, Shape, TensorSpec};

use super::rules::rule;
use crate::{Error, Result};

/// One collective the partitioner inserted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Collective {
    /// The op (`all_reduce`, `all_gather`, `reduce_scatter`, `all_to_all`).
    pub op: &'static str,
    /// The value it moves (its name in the original program, or `%k`).
    pub value: String,
    /// The mesh axes it runs over.
    pub axes: Vec<String>,
    /// The bytes it moves per run over all devices
    /// ([`Step::bytes`](meshwork_sharding::spmd::Step::bytes)).
    pub bytes: u64,
    /// Which launch carries it: the index, among the per-device program's
    /// communicating instructions in order, of the one that runs it (all-reduces of
    /// one step may share a launch, [`Program::combine_all_reduces`]).
    pub launch: usize,
}

/// How [`partition_with`] partitions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionOptions {
    /// All-reduces of one reduction and replica groups whose operands are independent
    /// are combined into launches of at most this many bytes per device
    /// ([`Program::combine_all_reduces`]; XLA's all-reduce combiner); 0 combines
    /// none. Default 32 MiB.
    pub combine_bytes: usize,
    /// Layouts some instructions' values are held in (value number, layout), as
    /// JAX's `with_sharding_constraint` ([`Shardings::constraints`](super::Shardings::constraints)).
    pub constraints: Vec<(usize, Layout)>,
}

impl Default for PartitionOptions {
    fn default() -> PartitionOptions {
        PartitionOptions { combine_bytes: 32 << 20, constraints: Vec::new() }
    }
}

/// A program partitioned over a mesh: the program each device runs (local shapes,
/// collectives over replica groups of mesh positions: replica `r` is
/// `mesh.devices()[r]`), and the layouts of its parameters and results.
#[derive(Debug, Clone)]
pub struct Partitioned {
    mesh: Mesh,
    program: Program,
    global: Program,
    inputs: Vec<Layout>,
    outputs: Vec<Layout>,
    collectives: Vec<Collective>,
}

impl Partitioned {
    /// The mesh.
    pub fn mesh(&self) -> &Mesh {
        &self.mesh
    }

    /// The program every device runs.
    pub fn program(&self) -> &Program {
        &self.program
    }

    /// The program it was partitioned from.
    pub fn global(&self) -> &Program {
        &self.global
    }

    /// The layout of each parameter (what each device is fed).
    pub fn inputs(&self) -> &[Layout] {
        &self.inputs
    }

    /// The layout of each result (what each device returns; never pending).
    pub fn outputs(&self) -> &[Layout] {
        &self.outputs
    }

    /// The collectives inserted, in program order.
    pub fn collectives(&self) -> &[Collective] {
        &self.collectives
    }

    /// The bytes one run moves between devices.
    pub fn bytes_moved(&self) -> u64 {
        self.collectives.iter().map(|c| c.bytes).sum()
    }

    /// The collective launches of one run (communicating instructions of the
    /// per-device program, `emit` aside); combined all-reduces count once.
    pub fn launches(&self) -> usize {
        self.program
            .instrs()
            .iter()
            .filter(|i| i.op.communicates() && !matches!(i.op, Op::Emit { .. }))
            .count()
    }
}

impl fmt::Display for Partitioned {
    /// The per-device program's text, after a header of `#` lines: the mesh, each
    /// parameter's and result's layout.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "# mesh {}", self.mesh)?;
        for (p, l) in self.global.params().iter().zip(&self.inputs) {
            writeln!(f, "# param {} {} {}", p.name, p.spec, l.display(&self.mesh))?;
        }
        for (k, (r, l)) in self.global.results().iter().zip(&self.outputs).enumerate() {
            let spec = self.global.spec(*r).expect("a result");
            writeln!(f, "# result {k} {spec} {}", l.display(&self.mesh))?;
        }
        write!(f, "{}", self.program)
    }
}

/// The name of value `v` of `program`: a parameter's, an instruction's, or `%v`.
fn value_name(program: &Program, v: usize) -> String {
    let np = program.params().len();
    if v < np {
        return program.params()[v].name.clone();
    }
    program.instrs()[v - np].name.clone().unwrap_or_else(|| format!("%{v}"))
}

/// Whether a value is all zeros by construction (a zero constant, broadcast or
/// converted).
fn zeros_of(program: &Program) -> Vec<bool> {
    let np = program.params().len();
    let mut z = vec![false; program.num_values()];
    for (i, instr) in program.instrs().iter().enumerate() {
        z[np + i] = match &instr.op {
            Op::Constant { value, .. } => *value == 0.0,
            Op::BroadcastTo { .. } | Op::Convert { .. } | Op::Reshape { .. } => {
                z[instr.args[0].index()]
            }
            _ => false,
        };
    }
    z
}

/// Partitions `program` over `mesh`: `inputs[k]` is parameter `k`'s layout (`None`
/// leaves it to propagation, which replicates what nothing constrains) and
/// `outputs[k]` result `k`'s (`None`: what propagation gives it, pending sums
/// reduced).
///
/// Propagation ([`propagate`](meshwork_sharding::spmd::propagate)) gives every value a
/// layout and every op its factors' mesh axes; each op then runs on local shapes, with
/// its operands moved to what it needs by the cheapest collectives
/// ([`transition`](meshwork_sharding::spmd::transition)): a `dot_general` contracting
/// a sharded dim leaves a pending sum, all-reduced where a use needs it whole, or
/// reduce-scattered when the use is sharded.
///
/// Independent all-reduces over the same groups are then combined into one launch
/// ([`PartitionOptions::combine_bytes`]; a training step's gradient all-reduces over
/// `data` become one).
///
/// Refused: a program that already communicates (collectives, send/recv:
/// [`Error::Partition`]), a layout whose tiles do not divide a value's dim
/// ([`Error::Indivisible`], naming the value), a layout of the wrong rank.
pub fn partition(
    program: &Program,
    mesh: &Mesh,
    inputs: &[Option<Layout>],
    outputs: &[Option<Layout>],
) -> Result<Partitioned> {
    partition_with(program, mesh, inputs, outputs, &PartitionOptions::default())
}

/// [`partition`] with `options`.
pub fn partition_with(
    program: &Program,
    mesh: &Mesh,
    inputs: &[Option<Layout>],
    outputs: &[Option<Layout>],
    options: &PartitionOptions,
) -> Result<Partitioned> {
    let np = program.params().len();
    let nv = program.num_values();
    if inputs.len() != np || outputs.len() != program.results().len() {
        return Err(Error::Partition {
            value: String::new(),
            op: "partition",
            problem: format!(
                "{} input and {} output layouts for a program of {np} parameters and {} results",
                inputs.len(),
                outputs.len(),
                program.results().len()
            ),
        });
    }
    let spec = |v: usize| program.spec(Value(v as u32)).expect("a value of the program");
    let shapes: Vec<Vec<usize>> = (0..nv).map(|v| spec(v).shape.dims().to_vec()).collect();
    let mut nodes = Vec::with_capacity(program.instrs().len());
    for (i, instr) in program.instrs().iter().enumerate() {
        let v = np + i;
        if instr.op.communicates() && !matches!(instr.op, Op::Emit { .. }) {
            return Err(Error::Partition {
                value: value_name(program, v),
                op: instr.op.name(),
                problem: "the program already communicates; partition a program written for \
                          one device"
                    .into(),
            });
        }
        let args: Vec<&[usize]> = instr.args.iter().map(|a| shapes[a.index()].as_slice()).collect();
        let r = rule(&instr.op, &args, &shapes[v]).map_err(|e| Error::Partition {
            value: value_name(program, v),
            op: instr.op.name(),
            problem: e.to_string(),
        })?;
        nodes.push(Node {
            rule: r,
            operands: instr.args.iter().map(|a| a.index()).collect(),
            result: v,
        });
    }
    let zeros = zeros_of(program);
    let graph = Graph { shapes: shapes.clone(), zeros: zeros.clone(), nodes };
    let mut ann: Vec<Option<Layout>> = vec![None; nv];
    for (k, l) in inputs.iter().enumerate() {
        ann[k] = l.clone();
    }
    for (v, l) in &options.constraints {
        if *v < np || *v >= nv {
            return Err(Error::Partition {
                value: format!("%{v}"),
                op: "constraint",
                problem: "a layout constraint names an instruction of the program".into(),
            });
        }
        ann[*v] = Some(l.clone());
    }
    for (r, l) in program.results().iter().zip(outputs) {
        if let (Some(l), None) = (l, &ann[r.index()]) {
            ann[r.index()] = Some(l.clone());
        }
    }
    for (v, l) in ann.iter().enumerate() {
        if let Some(l) = l {
            check_layout(program, mesh, v, l, &shapes[v])?;
        }
    }
    // Parameters are fed and results returned whole on each device: neither can be a
    // pending sum.
    let pending = inputs.iter().enumerate().map(|(k, l)| (k, l, "parameter"));
    let results = program.results().iter().zip(outputs).map(|(r, l)| (r.index(), l, "result"));
    for (v, l, what) in pending.chain(results) {
        if l.as_ref().is_some_and(|l| !l.partial().is_empty()) {
            return Err(Error::Partition {
                value: value_name(program, v),
                op: "layout",
                problem: format!(
                    "a {what} cannot be a pending sum (unreduced); give it a layout of whole values"
                ),
            });
        }
    }
    let prop = propagate(mesh, &graph, &ann)?;
    for (v, l) in prop.layouts.iter().enumerate() {
        check_layout(program, mesh, v, l, &shapes[v])?;
    }

    let mut uses = vec![0usize; nv];
    for node in &graph.nodes {
        for &o in &node.operands {
            uses[o] += 1;
        }
    }
    let mut e = Emitter {
        program,
        mesh,
        b: Builder::new(),
        cur: vec![None; nv],
        cache: HashMap::new(),
        zeros,
        collectives: Vec::new(),
    };
    for (k, p) in program.params().iter().enumerate() {
        let l = prop.layouts[k].clone();
        let local = local_spec(program, mesh, k, &l)?;
        let pv = e.b.param(&p.name, local)?;
        e.cur[k] = Some((pv, l));
    }
    for (i, instr) in program.instrs().iter().enumerate() {
        let v = np + i;
        let node = &graph.nodes[i];
        let factors = &prop.factors[i];
        let have: Vec<Layout> = instr
            .args
            .iter()
            .map(|a| e.cur[a.index()].as_ref().expect("defined").1.clone())
            .collect();
        let operands: Vec<Operand<'_>> = instr
            .args
            .iter()
            .zip(&have)
            .map(|(a, layout)| Operand {
                layout,
                zero: e.zeros[a.index()],
                shared: uses[a.index()] > 1,
            })
            .collect();
        let (need, natural) = node_layouts(node, factors, &operands);
        let mut args = Vec::with_capacity(instr.args.len());
        for (a, want) in instr.args.iter().zip(&need) {
            args.push(e.get(a.index(), want)?);
        }
        let out = e.emit_op(v, node, factors, &args, &natural)?;
        let want = &prop.layouts[v];
        e.cur[v] = Some((out, natural.clone()));
        if natural != *want {
            let moved = e.get(v, want)?;
            e.cur[v] = Some((moved, want.clone()));
        }
    }
    let mut results = Vec::new();
    let mut out_layouts = Vec::new();
    for (r, l) in program.results().iter().zip(outputs) {
        let want = l.clone().unwrap_or_else(|| prop.layouts[r.index()].without_partial());
        check_layout(program, mesh, r.index(), &want, &shapes[r.index()])?;
        results.push(e.get(r.index(), &want)?);
        out_layouts.push(want);
    }
    let mut collectives = std::mem::take(&mut e.collectives);
    let local = e.b.finish(&results)?;
    let (local, trace) = local.combine_all_reduces_traced(options.combine_bytes);
    // Each collective's launch: its instruction's carrier, counted among the
    // communicating instructions.
    let lnp = local.params().len();
    let mut launch_index = vec![usize::MAX; local.num_values()];
    let mut k = 0;
    for (i, instr) in local.instrs().iter().enumerate() {
        if instr.op.communicates() && !matches!(instr.op, Op::Emit { .. }) {
            launch_index[lnp + i] = k;
            k += 1;
        }
    }
    for c in &mut collectives {
        c.launch = launch_index[trace[c.launch].index()];
    }
    Ok(Partitioned {
        mesh: mesh.clone(),
        program: local,
        global: program.clone(),
        inputs: prop.layouts[..np].to_vec(),
        outputs: out_layouts,
        collectives,
    })
}

fn check_layout(
    program: &Program,
    mesh: &Mesh,
    v: usize,
    l: &Layout,
    shape: &[usize],
) -> Result<()> {
    if l.rank() != shape.len() {
        return Err(Error::Partition {
            value: value_name(program, v),
            op: "layout",
            problem: format!("a rank-{} layout for a rank-{} value", l.rank(), shape.len()),
        });
    }
    if l.dims().iter().flatten().chain(l.partial()).any(|&a| a >= mesh.shape().len()) {
        return Err(Error::Partition {
            value: value_name(program, v),
            op: "layout",
            problem: format!("a layout over another mesh than {mesh}"),
        });
    }
    let tiles = l.tiles(mesh);
    for (dim, (&size, &t)) in shape.iter().zip(&tiles).enumerate() {
        if size % t != 0 {
            return Err(Error::Indivisible { value: value_name(program, v), dim, size, tiles: t });
        }
    }
    Ok(())
}

fn local_spec(program: &Program, mesh: &Mesh, v: usize, l: &Layout) -> Result<TensorSpec> {
    let s = program.spec(Value(v as u32)).expect("a value");
    let dims = l.local_shape(mesh, s.shape.dims())?;
    Ok(TensorSpec::new(s.dtype, Shape::new(&dims)?))
}

struct Emitter<'a> {
    program: &'a Program,
    mesh: &'a Mesh,
    b: Builder,
    /// Per original value: its value in the new program and its layout there.
    cur: Vec<Option<(Value, Layout)>>,
    /// Values already moved to another layout.
    cache: HashMap<(usize, Layout), Value>,
    zeros: Vec<bool>,
    collectives: Vec<Collective>,
}

impl Emitter<'_> {
    /// Original value `v` in layout `want`, moving it if needed (once per layout).
    fn get(&mut self, v: usize, want: &Layout) -> Result<Value> {
        let (have_v, have) = self.cur[v].clone().expect("defined before use");
        if have == *want {
            return Ok(have_v);
        }
        if let Some(&x) = self.cache.get(&(v, want.clone())) {
            return Ok(x);
        }
        let spec = self.program.spec(Value(v as u32)).expect("a value").clone();
        let out = if self.zeros[v] {
            // A zero is any layout: make it here.
            let local = want.local_shape(self.mesh, spec.shape.dims())?;
            let z = self.b.constant(0.0, spec.dtype)?;
            self.b.broadcast_to(z, &local)?
        } else {
            let t =
                transition(self.mesh, spec.shape.dims(), spec.dtype.size_in_bytes(), &have, want)
                    .map_err(|e| Error::Partition {
                    value: value_name(self.program, v),
                    op: "transition",
                    problem: e.to_string(),
                })?;
            let mut x = have_v;
            let mut before = have.clone();
            for (step, after) in t.steps().iter().zip(t.layouts()) {
                x = self.step(x, step)?;
                if step.communicates() {
                    self.collectives.push(Collective {
                        // The instruction (parameters were all added first, so the
                        // builder's values are the finished program's), until
                        // `partition` turns it into its launch.
                        launch: x.index(),
                        op: step_name(step),
                        value: value_name(self.program, v),
                        axes: step
                            .axes()
                            .iter()
                            .map(|&a| self.mesh.axis_names()[a].clone())
                            .collect(),
                        bytes: step.bytes(
                            self.mesh,
                            spec.shape.dims(),
                            spec.dtype.size_in_bytes(),
                            &before,
                        ),
                    });
                }
                before = after.clone();
            }
            x
        };
        self.cache.insert((v, want.clone()), out);
        Ok(out)
    }

    fn step(&mut self, x: Value, step: &Step) -> Result<Value> {
        let groups = step.groups(self.mesh);
        Ok(match step {
            Step::Slice { dim, .. } => self.b.shard_slice(x, *dim, &groups)?,
            Step::AllGather { dim, .. } => self.b.all_gather(x, *dim, &groups)?,
            Step::AllToAll { from, to, .. } => self.b.all_to_all(x, *to, *from, &groups)?,
            Step::AllReduce { .. } => self.b.all_reduce(x, ReduceOp::Sum, &groups)?,
            Step::ReduceScatter { dim, .. } => {
                self.b.reduce_scatter(x, ReduceOp::Sum, *dim, &groups)?
            }
        })
    }

    /// Instruction `v` on local operands `args`, making `natural`.
    fn emit_op(
        &mut self,
        v: usize,
        node: &Node,
        factors: &[Vec<usize>],
        args: &[Value],
        natural: &Layout,
    ) -> Result<Value> {
        let np = self.program.params().len();
        let instr = &self.program.instrs()[v - np];
        let gspec = &instr.spec;
        let local = natural.local_shape(self.mesh, gspec.shape.dims())?;
        let local_of =
            |b: &Builder, a: Value| -> Result<Vec<usize>> { Ok(b.spec(a)?.shape.dims().to_vec()) };
        let op = match &instr.op {
            Op::Reshape { .. } => Op::Reshape { shape: local.clone() },
            Op::BroadcastTo { .. } => Op::BroadcastTo { shape: local.clone() },
            Op::Iota { dtype, axis, .. } => {
                Op::Iota { dtype: *dtype, shape: local.clone(), axis: *axis }
            }
            Op::Slice { start, stop, step } => {
                let x = local_of(&self.b, args[0])?;
                let global =
                    self.program.spec(instr.args[0]).expect("a value").shape.dims().to_vec();
                let mut s = (start.clone(), stop.clone(), step.clone());
                for d in 0..x.len() {
                    if x[d] != global[d] {
                        s.0[d] = 0;
                        s.1[d] = x[d];
                        s.2[d] = 1;
                    }
                }
                Op::Slice { start: s.0, stop: s.1, step: s.2 }
            }
            Op::Conv2dBackpropInput { strides, padding, .. } => Op::Conv2dBackpropInput {
                strides: *strides,
                padding: *padding,
                input: local.clone().try_into().expect("rank 4"),
            },
            Op::Conv2dBackpropFilter { strides, padding, .. } => Op::Conv2dBackpropFilter {
                strides: *strides,
                padding: *padding,
                filter: local.clone().try_into().expect("rank 4"),
            },
            other => other.clone(),
        };
        let mut out = self.b.push(op, args)?;
        // A mean over a sharded axis: each device's mean of its part, scaled by the
        // number of parts, sums to the mean.
        if let Op::Reduce { kind: Reduction::Mean, .. } = &instr.op {
            let parts: usize = (0..node.rule.num_factors())
                .filter(|&f| node.rule.kind(f) == FactorKind::Sum)
                .flat_map(|f| factors[f].iter().map(|&a| self.mesh.shape()[a]))
                .product();
            if parts > 1 {
                let c = self.b.constant(1.0 / parts as f64, gspec.dtype)?;
                out = self.b.mul(out, c)?;
            }
        }
        let got = self.b.spec(out)?.clone();
        if got.shape.dims() != local.as_slice() || got.dtype != gspec.dtype {
            return Err(Error::Partition {
                value: value_name(self.program, v),
                op: instr.op.name(),
                problem: format!(
                    "the local op makes {got}, the layout {} wants {:?} (a partitioner bug)",
                    natural.display(self.mesh),
                    local
                ),
            });
        }
        if let Some(name) = &instr.name {
            out = self.b.name(out, name)?;
        }
        Ok(out)
    }
}

fn step_name(step: &Step) -> &'static str {
    match step {
        Step::Slice { .. } => "shard_slice",
        Step::AllGather { .. } => "all_gather",
        Step::AllToAll { .. } => "all_to_all",
        Step::AllReduce { .. } => "all_reduce",
        Step::ReduceScatter { .. } => "reduce_scatter",
    }
}
