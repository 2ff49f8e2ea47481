//! A run's steps on a strategy: a training step compiled over a mesh (SPMD) or placed
//! as a pipeline, behind one [`Steps`] trait, and the held-out evaluation.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use meshwork_checkpoint::CheckpointManager;
use meshwork_nn::{Optimizer, StepOptions, TrainStep};
use meshwork_partition::spmd::Shardings;
use meshwork_program::{Program, Value};
use meshwork_sharding::{Mesh, PartitionSpec};
use meshwork_strategy::Strategy;
use meshwork_strategy::backend::Traffic;
use meshwork_strategy::placed::{PlaceOptions, Placed};
use meshwork_strategy::spmd::{Compiled, CompiledTrainStep};
use meshwork_types::{DType, Tensor};

use crate::init::cast;
use crate::model::{Layout, Net, Savers};
use crate::{Error, Result};

/// A training run's steps, whatever runs them.
/// Each weight's and optimizer slot's name with the (device, bytes) holding it.
pub(crate) type Held = Vec<(String, Vec<(usize, u64)>)>;

pub(crate) trait Steps {
    /// Steps `first..first + feeds.len()` at learning rates `lrs`, in one host call
    /// where the run can (a compiled step), one by one otherwise; their losses.
    fn steps(&mut self, feeds: &[Vec<Tensor>], lrs: &[f64], first: usize) -> Result<Vec<f64>>;
    /// The gradients' global norm of each step the last [`steps`](Self::steps) call
    /// took, where the step computes it (asked by the recipe); else none.
    fn grad_norms(&self) -> Vec<Option<f64>> {
        Vec::new()
    }
    /// Weight `name`'s current value.
    fn weight(&self, name: &str) -> Result<Tensor>;
    /// Weight `name`'s current value in the process that writes outputs, `None` in
    /// the others (across processes, gathered to that one only).
    fn weight_first(&self, name: &str) -> Result<Option<Tensor>> {
        self.weight(name).map(Some)
    }
    /// Sets weight (or optimizer state) `name`.
    fn set(&mut self, name: &str, value: Tensor) -> Result<()>;
    /// Saves the weights, optimizer state and `steps` as step `steps` of `manager`,
    /// `meta` in its index.
    fn save(
        &mut self,
        manager: &mut CheckpointManager,
        meta: &serde_json::Value,
        steps: usize,
    ) -> meshwork_strategy::Result<PathBuf>;
    /// Restores a checkpoint of this trainer (saved by any layout); its step count.
    fn restore(&mut self, dir: &Path) -> meshwork_strategy::Result<usize>;
    /// Sets the step count (of a checkpoint restored by weights alone).
    fn set_steps(&mut self, steps: usize);
    /// Each weight's and optimizer slot's name with the (device, bytes) it is held in
    /// between steps, as the back end reports them.
    fn held(&self) -> Result<Held>;
    /// What its steps moved so far, as the back end counted it.
    fn traffic(&self) -> Traffic;
    /// The most bytes one device's step holds at once by the fast interpreter's plan
    /// of its per-device program (inputs, and each value until its last read); `None`
    /// for a pipeline.
    fn peak_bytes(&self) -> Option<u64> {
        None
    }
    /// The fewest payload bytes process 0 of `processes` (each running its equal,
    /// consecutive share of the mesh's positions) must send the others in one step,
    /// by the partitioner's collectives: each group's members in a process combined
    /// there first, then the bandwidth-optimal exchange between the processes the
    /// group spans. `None` for a pipeline.
    fn cross_process_minimum(&self, _processes: usize) -> Option<u64> {
        None
    }
    /// The partitioner's collectives of one step (kind over axes → count, bytes);
    /// empty for a pipeline.
    fn collectives(&self) -> std::collections::BTreeMap<String, (usize, u64)> {
        std::collections::BTreeMap::new()
    }
}

fn failed(e: impl std::fmt::Display) -> Error {
    Error::failed(e)
}

/// A step's failure: a device out of memory is the user's to fix (exit 2, naming the
/// flags that shrink a step); anything else fails the run.
fn step_failed(e: meshwork_strategy::Error) -> Error {
    match &e {
        meshwork_strategy::Error::Xla(x) if x.is_out_of_memory() => Error::usage(format!(
            "the device ran out of memory ({e}); lower --batch or --steps-per-run, or use a smaller model"
        )),
        _ => Error::failed(e),
    }
}

/// A training step compiled over a mesh, fed its batch in `.1` micro-batches.
struct Spmd<'s>(CompiledTrainStep<'s>, usize, Vec<Option<f64>>);

/// Each of `feeds` (tensors of `B` rows) cut into `micro` consecutive parts of `B /
/// micro` rows: the first part of every feed, then the second's, and so on (the
/// order of a step's micro-batch parameters).
fn micro_batches(feeds: &[Tensor], micro: usize) -> Result<Vec<Tensor>> {
    if micro <= 1 {
        return Ok(feeds.to_vec());
    }
    let parts = feeds
        .iter()
        .map(|t| {
            let rows = t.shape().first().copied().unwrap_or(0);
            if rows == 0 || rows % micro != 0 || t.is_empty() {
                return Err(Error::failed(format!(
                    "a feed of {rows} rows does not cut into {micro} micro-batches"
                )));
            }
            let bytes = t.to_le_bytes();
            let each = bytes.len() / micro;
            let mut dims = t.shape().to_vec();
            dims[0] = rows / micro;
            bytes
                .chunks(each.max(1))
                .take(micro)
                .map(|c| Tensor::from_le_bytes(t.dtype(), &dims, c).map_err(failed))
                .collect::<Result<Vec<_>>>()
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((0..micro).flat_map(|i| parts.iter().map(move |p| p[i].clone())).collect())
}

impl Steps for Spmd<'_> {
    fn steps(&mut self, feeds: &[Vec<Tensor>], lrs: &[f64], _: usize) -> Result<Vec<f64>> {
        let feeds = feeds.iter().map(|f| micro_batches(f, self.1)).collect::<Result<Vec<_>>>()?;
        let measured = self.0.run_steps_measured(&feeds, lrs).map_err(step_failed)?;
        let (losses, norms) = measured.into_iter().unzip();
        self.2 = norms;
        Ok(losses)
    }
    fn grad_norms(&self) -> Vec<Option<f64>> {
        self.2.clone()
    }
    fn weight(&self, name: &str) -> Result<Tensor> {
        self.0.get(name).map_err(failed)
    }
    fn weight_first(&self, name: &str) -> Result<Option<Tensor>> {
        self.0.get_first(name).map_err(failed)
    }
    fn set(&mut self, name: &str, value: Tensor) -> Result<()> {
        self.0.set(name, &value).map_err(step_failed)
    }
    fn save(
        &mut self,
        manager: &mut CheckpointManager,
        meta: &serde_json::Value,
        steps: usize,
    ) -> meshwork_strategy::Result<PathBuf> {
        self.0.set_steps(steps);
        self.0.save_to(manager, steps, meta)
    }
    fn restore(&mut self, dir: &Path) -> meshwork_strategy::Result<usize> {
        self.0.restore_checkpoint(dir)?;
        Ok(self.0.steps())
    }
    fn set_steps(&mut self, steps: usize) {
        self.0.set_steps(steps);
    }
    fn held(&self) -> Result<Held> {
        let compiled = self.0.compiled();
        compiled
            .resident()
            .into_iter()
            .map(|name| {
                // Mesh position r runs on the strategy's device r (an iota mesh).
                let bytes = compiled.held_bytes(&name).map_err(failed)?;
                Ok((name, bytes.into_iter().enumerate().collect()))
            })
            .collect()
    }
    fn traffic(&self) -> Traffic {
        self.0.compiled().traffic()
    }
    fn peak_bytes(&self) -> Option<u64> {
        use meshwork_program::fast::{Executable, Options};
        let program = self.0.compiled().partitioned().program();
        Some(Executable::compile(program, Options::default()).peak_bytes())
    }
    fn cross_process_minimum(&self, processes: usize) -> Option<u64> {
        let part = self.0.compiled().partitioned();
        let mesh = part.mesh();
        Some(part.collectives().iter().map(|c| cross_process_bytes(mesh, c, processes)).sum())
    }
    fn collectives(&self) -> std::collections::BTreeMap<String, (usize, u64)> {
        let mut kinds = std::collections::BTreeMap::new();
        for c in self.0.compiled().partitioned().collectives() {
            let e: &mut (usize, u64) =
                kinds.entry(format!("{} over {}", c.op, c.axes.join("+"))).or_default();
            e.0 += 1;
            e.1 += c.bytes;
        }
        kinds
    }
}

/// What process 0 must send the other processes for collective `c` (see
/// [`Steps::cross_process_minimum`]): per group with members there, the bytes the
/// bandwidth-optimal algorithm has it send between the `g` processes the group spans,
/// once its own `m` members' values are combined (an all-reduce, a reduce-scatter) or
/// put side by side (an all-gather, an all-to-all).
fn cross_process_bytes(
    mesh: &Mesh,
    c: &meshwork_partition::spmd::Collective,
    processes: usize,
) -> u64 {
    let n = mesh.size();
    let local = n / processes.max(1);
    let shape = mesh.shape();
    let axes: Vec<usize> =
        c.axes.iter().filter_map(|a| mesh.axis_names().iter().position(|x| x == a)).collect();
    let k: usize = axes.iter().map(|&a| shape[a]).product::<usize>().max(1);
    if k < 2 || local == 0 {
        return 0;
    }
    // Bytes per device, from the partitioner's total under the same algorithms.
    let (kk, nn) = (k as f64, n as f64);
    let s = c.bytes as f64
        / nn
        / match c.op {
            "all_gather" => kk - 1.0,
            "all_reduce" => 2.0 * (kk - 1.0) / kk,
            _ => (kk - 1.0) / kk,
        };
    // Each position's group: its coordinates off the collective's axes.
    let coords = |r: usize| {
        let mut rest = r;
        let mut at = vec![0; shape.len()];
        for d in (0..shape.len()).rev() {
            at[d] = rest % shape[d];
            rest /= shape[d];
        }
        at
    };
    let key = |r: usize| {
        let at = coords(r);
        (0..shape.len()).filter(|d| !axes.contains(d)).map(|d| at[d]).collect::<Vec<_>>()
    };
    let mut total = 0.0;
    let mut seen = std::collections::BTreeSet::new();
    for r in 0..local {
        let group = key(r);
        if !seen.insert(group.clone()) {
            continue;
        }
        let members: Vec<usize> = (0..n).filter(|&q| key(q) == group).collect();
        let spans: std::collections::BTreeSet<usize> = members.iter().map(|q| q / local).collect();
        let g = spans.len() as f64;
        let m = members.iter().filter(|&&q| q < local).count() as f64;
        if g < 2.0 {
            continue;
        }
        total += match c.op {
            "all_reduce" => 2.0 * (g - 1.0) / g * s,
            "reduce_scatter" => (g - 1.0) / g * s,
            "all_gather" => m * s * (g - 1.0),
            _ => m * (kk - m) / kk * s,
        };
    }
    total.round() as u64
}

/// A training step placed as a pipeline.
struct Pipelined<'s> {
    placed: Placed<'s>,
    step: TrainStep,
    /// The one-device loss program, which checkpoints are written and read through.
    host: (Program, Value, Vec<Value>, Optimizer, Option<f64>),
    /// Parameters fed each step.
    fed: usize,
    /// The steps taken.
    steps: usize,
    /// The gradients' norm of each step of the last call (when the step returns it).
    norms: Vec<Option<f64>>,
}

impl Pipelined<'_> {
    /// A one-device training step to write or read checkpoints through (a pipeline's
    /// weights and state are whole tensors, as one device holds them).
    fn with_host<T>(
        &self,
        f: impl FnOnce(&mut CompiledTrainStep<'_>) -> meshwork_strategy::Result<T>,
    ) -> meshwork_strategy::Result<T> {
        let (program, loss, weights, optimizer, clip) = &self.host;
        let one = Strategy::data_parallel(1)?;
        let mesh = Mesh::iota(&[("data", 1), ("model", 1)])?;
        let mut host = one.compile_train_step_clipped(
            program,
            *loss,
            weights,
            *optimizer,
            *clip,
            &Shardings::new(mesh),
        )?;
        f(&mut host)
    }

    /// The weights' and optimizer state's names.
    fn state_names(&self) -> Vec<String> {
        let ps = self.step.program.params();
        ps[self.fed..ps.len() - 2].iter().map(|p| p.name.clone()).collect()
    }
}

impl Steps for Pipelined<'_> {
    fn steps(&mut self, feeds: &[Vec<Tensor>], lrs: &[f64], first: usize) -> Result<Vec<f64>> {
        let mut losses = Vec::with_capacity(feeds.len());
        let mut norms = Vec::with_capacity(feeds.len());
        for (i, (f, &lr)) in feeds.iter().zip(lrs).enumerate() {
            let [lr, count] = self.step.scalars(lr, first + i).map_err(failed)?;
            let mut all = f.to_vec();
            all.extend([lr, count]);
            let out = self.placed.step(&all).map_err(failed)?;
            losses.push(out[0].to_f64()[0]);
            norms.push(out.get(1).filter(|_| self.step.grad_norm).map(|t| t.to_f64()[0]));
            self.steps = first + i + 1;
        }
        self.norms = norms;
        Ok(losses)
    }
    fn grad_norms(&self) -> Vec<Option<f64>> {
        self.norms.clone()
    }
    fn weight(&self, name: &str) -> Result<Tensor> {
        self.placed.get(name).map_err(failed)
    }
    fn set(&mut self, name: &str, value: Tensor) -> Result<()> {
        self.placed.set(name, value).map_err(failed)
    }
    fn save(
        &mut self,
        manager: &mut CheckpointManager,
        meta: &serde_json::Value,
        steps: usize,
    ) -> meshwork_strategy::Result<PathBuf> {
        let names = self.state_names();
        self.with_host(|host| {
            for name in &names {
                host.set(name, &self.placed.get(name)?)?;
            }
            host.set_steps(steps);
            host.save_to(manager, steps, meta)
        })
    }
    fn restore(&mut self, dir: &Path) -> meshwork_strategy::Result<usize> {
        let names = self.state_names();
        let (values, steps) = self.with_host(|host| {
            host.restore_checkpoint(dir)?;
            let values =
                names.iter().map(|n| host.get(n)).collect::<meshwork_strategy::Result<Vec<_>>>()?;
            Ok((values, host.steps()))
        })?;
        for (name, t) in names.iter().zip(values) {
            self.placed.set(name, t)?;
        }
        self.steps = steps;
        Ok(steps)
    }
    fn set_steps(&mut self, steps: usize) {
        self.steps = steps;
    }
    fn held(&self) -> Result<Held> {
        self.state_names()
            .into_iter()
            .map(|name| {
                let at = self.placed.held_bytes(&name).map_err(failed)?;
                Ok((name, vec![at]))
            })
            .collect()
    }
    fn traffic(&self) -> Traffic {
        self.placed.traffic()
    }
}

/// What a run trains: the model, its batch, dtype, optimizer, clipping and weights.
pub(crate) struct Recipe<'a> {
    pub(crate) net: &'a Net,
    pub(crate) batch: usize,
    pub(crate) dtype: DType,
    pub(crate) optimizer: Optimizer,
    pub(crate) clip: Option<f64>,
    pub(crate) init: &'a HashMap<String, Tensor>,
    pub(crate) savers: Savers,
    /// `--precision`: the dtype products compute in (`None`: the weights').
    pub(crate) precision: Option<DType>,
    /// f16's dynamic loss scaling.
    pub(crate) loss_scale: Option<meshwork_nn::LossScale>,
    /// GPT-2's attention and loss in pieces.
    pub(crate) blocking: meshwork_nn::Blocking,
    /// `--init`'s Hugging Face weights, read part by part (else `init` holds them).
    pub(crate) shards: Option<&'a crate::hf::HfShards>,
    /// Whether a mesh's step returns its gradients' norm (for `--metrics-jsonl`).
    pub(crate) grad_norm: bool,
}

impl<'a> Recipe<'a> {
    /// What the plan `p` trains, from the initial weights `init`.
    pub(crate) fn of(p: &'a crate::plan::Plan, init: &'a HashMap<String, Tensor>) -> Recipe<'a> {
        Recipe {
            net: &p.net,
            batch: p.batch,
            dtype: p.dtype,
            optimizer: p.optimizer,
            clip: p.clip,
            init,
            savers: p.savers,
            precision: p.precision,
            loss_scale: p.loss_scale,
            blocking: p.blocking,
            shards: p.shards.as_ref(),
            // Every process alike: they run one program.
            grad_norm: p.metrics_jsonl.is_some(),
        }
    }
}

/// The training step of `recipe` over the mesh `layout` compiled on `strategy`, with
/// its weights' names (trained, then frozen) and the micro-batches it takes; its optimizer state set
/// to its initial value when `init_state` (else unset: a step compiled to plan, not
/// run). Its weights are the caller's to set.
pub(crate) fn mesh_step<'s>(
    strategy: &'s Strategy,
    layout: Layout,
    recipe: &Recipe<'_>,
    init_state: bool,
) -> Result<(CompiledTrainStep<'s>, Vec<String>, usize)> {
    let Layout::Mesh { data, model } = layout else {
        return Err(Error::usage(format!("{} is not a mesh", layout.describe())));
    };
    let Recipe {
        net,
        batch,
        dtype,
        optimizer,
        clip,
        savers,
        precision,
        loss_scale,
        blocking,
        grad_norm,
        ..
    } = *recipe;
    let fed = net.fed();
    // A micro-batch's loss, and its blocks for --remat.
    let micro = savers.micro.max(1);
    let (program, loss, blocks) =
        net.loss_program_blocks(batch / micro, dtype, layout, precision, blocking)?;
    // --fsdp: each split weight's layout, and whole copies read by the model.
    let split: Vec<(usize, PartitionSpec)> = match savers.fsdp {
        false => Vec::new(),
        true => program.params()[fed..]
            .iter()
            .enumerate()
            .filter_map(|(k, p)| {
                let dims = p.spec.shape.dims();
                net.fsdp_spec(&p.name, dims, (data, model)).map(|s| (fed + k, s))
            })
            .collect(),
    };
    let whole: Vec<usize> = split.iter().map(|(k, _)| *k).collect();
    let recomputed = blocks.recomputed(savers.remat);
    let (program, loss, recomputed) = gathered(&program, loss, &recomputed, &whole)?;
    // The weights the model trains; the rest (a frozen base under an adapter) held.
    let (weights, frozen): (Vec<Value>, Vec<Value>) = (fed..program.params().len())
        .map(|k| Value(k as u32))
        .partition(|v| net.model().trains(&program.params()[v.index()].name));
    let options = StepOptions {
        max_norm: clip,
        micro_batches: micro,
        remat: recomputed,
        loss_scale,
        frozen,
        grad_norm,
    };
    let step =
        TrainStep::with_options(&program, loss, &weights, optimizer, &options).map_err(failed)?;
    let mesh = Mesh::iota(&[("data", data), ("model", model)]).map_err(failed)?;
    let mut shardings = Shardings::new(mesh);
    let params = step.program.params();
    for p in &params[..fed * micro] {
        shardings = shardings.with(&p.name, "P('data')").map_err(failed)?;
    }
    for &w in step.trained.iter().chain(&step.frozen) {
        let p = &params[w.index()];
        let rank = p.spec.shape.rank();
        let base = net.weight_spec(&p.name, rank, model);
        match split.iter().find(|(k, _)| program.params()[*k].name == p.name) {
            Some((_, spec)) => {
                // Held split; read whole (over the data axis) where the model
                // reads it, in every micro-batch.
                shardings = shardings.with_spec(&p.name, spec.clone());
                for i in 0..micro {
                    let read = match micro {
                        1 => gathered_name(&p.name),
                        _ => format!("micro.{i}.{}", gathered_name(&p.name)),
                    };
                    // And its copy gathered again in the backward pass.
                    let again = format!("{read}.remat");
                    if step.program.value_named(&again).is_some() {
                        shardings = shardings.with_spec(&again, base.clone());
                    }
                    shardings = shardings.with_spec(&read, base.clone());
                }
            }
            None => shardings = shardings.with_spec(&p.name, base),
        }
    }
    let names: Vec<String> =
        step.trained.iter().chain(&step.frozen).map(|w| params[w.index()].name.clone()).collect();
    let step = if init_state {
        strategy.compile_step(step, &shardings)
    } else {
        strategy.compile_step_unset(step, &shardings)
    };
    Ok((step.map_err(step_failed)?, names, micro))
}

/// Compiles (or places) the training step of `recipe` laid out by `layout` on
/// `strategy`, its weights set from the recipe's.
pub(crate) fn start<'s>(
    strategy: &'s Strategy,
    layout: Layout,
    recipe: &Recipe<'_>,
) -> Result<Box<dyn Steps + 's>> {
    let Recipe { net, batch, dtype, optimizer, clip, init, precision, blocking, shards, .. } =
        *recipe;
    let fed = net.fed();
    // Each weight in the dtype the step holds it in (a frozen base's --base-dtype).
    let weight = |name: &str| -> Result<Tensor> {
        let t = init.get(name).ok_or_else(|| Error::flag("init", format!("has no {name}")))?;
        cast(t, net.weight_dtype(name, dtype))
    };
    match layout {
        Layout::Mesh { .. } => {
            let (step, names, micro) = mesh_step(strategy, layout, recipe, true)?;
            for name in &names {
                match shards.filter(|_| !init.contains_key(name)) {
                    // Each device's part read alone from the checkpoint's files.
                    Some(shards) => {
                        // A part that cannot be read is the checkpoint's fault (its
                        // own error); anything else the run's.
                        let mut unread = None;
                        let mut read = |ranges: &[std::ops::Range<usize>]| {
                            shards.read(name, ranges, net.weight_dtype(name, dtype)).map_err(|e| {
                                let problem = e.to_string();
                                unread = Some(e);
                                meshwork_strategy::Error::Compiled { problem }
                            })
                        };
                        let placed = step.set_with(name, &mut read);
                        if let Some(e) = unread {
                            return Err(e);
                        }
                        placed.map_err(step_failed)?;
                    }
                    None => step.set(name, &weight(name)?).map_err(step_failed)?,
                }
            }
            Ok(Box::new(Spmd(step, micro, Vec::new())))
        }
        Layout::Pipeline { .. } => {
            let (program, loss, _) =
                net.loss_program_blocks(batch, dtype, layout, precision, blocking)?;
            let weights: Vec<Value> =
                (fed..program.params().len()).map(|k| Value(k as u32)).collect();
            let options =
                StepOptions { max_norm: clip, grad_norm: recipe.grad_norm, ..Default::default() };
            let step = TrainStep::with_options(&program, loss, &weights, optimizer, &options)
                .map_err(failed)?;
            let sp = &step.program;
            // Every result but the loss (and the gradients' norm) carried.
            let carried = sp.results().len() - usize::from(step.grad_norm);
            let carry: Vec<(usize, usize)> = (1..carried).map(|r| (r, r - 1 + fed)).collect();
            let placed = strategy.place(sp, &carry, &PlaceOptions::default()).map_err(failed)?;
            for p in &program.params()[fed..] {
                placed.set(&p.name, weight(&p.name)?).map_err(failed)?;
            }
            let first_state = fed + weights.len();
            for (k, t) in step.init_state().map_err(failed)?.into_iter().enumerate() {
                placed.set(&sp.params()[first_state + k].name, t).map_err(failed)?;
            }
            let (host_program, host_loss) =
                net.loss_program(batch, dtype, Layout::Mesh { data: 1, model: 1 })?;
            let host = (host_program, host_loss, weights.clone(), optimizer, clip);
            Ok(Box::new(Pipelined { placed, step, host, fed, steps: 0, norms: Vec::new() }))
        }
    }
}

/// The name of weight `name`'s whole copy under `--fsdp`.
fn gathered_name(name: &str) -> String {
    format!("fsdp.whole.{name}")
}

/// `program` with each parameter of `weights` read through an identity named
/// [`gathered_name`] placed just before its first reader (where `--fsdp` constrains
/// the weight whole, so the partitioner all-gathers it there and reduce-scatters its
/// gradient back), and the loss and regions renumbered to match. An identity belongs
/// to the region of its first reader: with `--remat`, a block's weights are gathered
/// again in its backward pass instead of being held whole from the forward one.
fn gathered(
    program: &Program,
    loss: Value,
    regions: &[std::ops::Range<usize>],
    weights: &[usize],
) -> Result<(Program, Value, Vec<std::ops::Range<usize>>)> {
    if weights.is_empty() {
        return Ok((program.clone(), loss, regions.to_vec()));
    }
    let bad = |e: meshwork_program::Error| Error::failed(format!("--fsdp: {e}"));
    let mut b = meshwork_program::Builder::new();
    let mut map: Vec<Value> = Vec::with_capacity(program.num_values());
    for p in program.params() {
        let v = b.param(&p.name, p.spec.clone()).map_err(bad)?;
        map.push(b.set_device(v, &p.device).map_err(bad)?);
    }
    let mut whole = vec![false; program.params().len()];
    // Where each old instruction's identities (then the instruction) begin.
    let mut starts = Vec::with_capacity(program.instrs().len() + 1);
    for instr in program.instrs() {
        starts.push(b.instr_count());
        for a in &instr.args {
            let k = a.index();
            if k < whole.len() && !whole[k] && weights.contains(&k) {
                whole[k] = true;
                let read = b.identity(map[k]).map_err(bad)?;
                map[k] = b.name(read, &gathered_name(&program.params()[k].name)).map_err(bad)?;
            }
        }
        let args: Vec<Value> = instr.args.iter().map(|a| map[a.index()]).collect();
        let with: Vec<Value> = instr.colocate.iter().map(|c| map[c.index()]).collect();
        map.push(b.push_copy(instr, &args, &with, instr.name.as_deref()).map_err(bad)?);
    }
    starts.push(b.instr_count());
    let results: Vec<Value> = program.results().iter().map(|r| map[r.index()]).collect();
    let out = b.finish(&results).map_err(bad)?;
    let at = program.results().iter().position(|&r| r == loss);
    let loss =
        out.results()[at.ok_or_else(|| Error::failed("--fsdp: the loss is not a result"))?];
    let regions = regions.iter().map(|r| starts[r.start]..starts[r.end]).collect();
    Ok((out, loss, regions))
}

/// An evaluation: the mean loss and accuracy (of the next token, or the class) of
/// `batch` rows at a time, compiled on a one-device strategy (so it runs on the
/// strategy's back end, as the steps do) and fed the run's current weights.
pub(crate) struct Eval<'s> {
    compiled: Compiled<'s>,
    /// The weights' names, in the evaluation program's parameter order.
    weights: Vec<String>,
    /// The rows' feeds, `batch` rows at a time.
    chunks: Vec<Vec<Tensor>>,
}

impl<'s> Eval<'s> {
    /// The evaluation of `chunks` (each the feeds of `batch` rows) on `one`, a
    /// strategy of one device.
    pub(crate) fn new(
        one: &'s Strategy,
        net: &Net,
        dtype: DType,
        batch: usize,
        chunks: Vec<Vec<Tensor>>,
    ) -> Result<Eval<'s>> {
        let program = net.eval_program(batch, dtype)?;
        let mesh = Mesh::iota(&[("data", 1), ("model", 1)]).map_err(failed)?;
        let compiled = one.compile(&program, &Shardings::new(mesh), &[]).map_err(failed)?;
        let weights = program.params()[net.fed()..].iter().map(|p| p.name.clone()).collect();
        Ok(Eval { compiled, weights, chunks })
    }

    /// Rows it evaluates.
    pub(crate) fn rows(&self) -> usize {
        self.chunks.iter().map(|c| c[0].shape()[0]).sum()
    }

    /// (loss, accuracy) over its rows with `steps`' current weights; across
    /// processes, in process 0 (NaN in the others, which report nothing).
    pub(crate) fn run(&self, steps: &dyn Steps) -> Result<(f64, f64)> {
        // Across processes the weights go to process 0 alone, which evaluates (every
        // process takes part in each weight's gather; the others evaluate nothing).
        let weights =
            self.weights.iter().map(|name| steps.weight_first(name)).collect::<Result<Vec<_>>>()?;
        let Some(weights) = weights.into_iter().collect::<Option<Vec<_>>>() else {
            return Ok((f64::NAN, f64::NAN));
        };
        let (mut loss, mut accuracy) = (0.0, 0.0);
        for chunk in &self.chunks {
            let mut feeds = chunk.clone();
            feeds.extend(weights.iter().cloned());
            let out = self
                .compiled
                .step(&feeds)
                .map_err(|e| Error::failed(format!("evaluation: {e}")))?;
            loss += out[0].to_f64()[0];
            accuracy += out[1].to_f64()[0];
        }
        let k = self.chunks.len().max(1) as f64;
        Ok((loss / k, accuracy / k))
    }
}
