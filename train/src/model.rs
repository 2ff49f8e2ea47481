//! The model a run trains — any family of `meshwork-nn` behind its [`Model`] seam — as
//! one [`Net`]: its loss program on a mesh or in a pipeline, its evaluation, its initial
//! weights, its shardings, the memory savers and what it holds in memory. Nothing here
//! asks which model it is.

use std::collections::HashMap;
use std::sync::Arc;

use meshwork_nn::{Blocking, Build, Model, Pipeline};
use meshwork_program::{Builder, Program, Value};
use meshwork_sharding::{DimSpec, PartitionSpec};
use meshwork_types::{DType, Tensor};

use crate::rng::SplitMix;
use crate::{Error, Result};
/// How a run's steps are spread over the devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// SPMD on a `data x model` mesh.
    Mesh {
        /// Data-parallel replicas.
        data: usize,
        /// Model-parallel devices per replica.
        model: usize,
    },
    /// `replicas` replicas of a pipeline of `stages` stages, each replica's rows cut
    /// into `micro` micro-batches.
    Pipeline {
        /// Data-parallel replicas.
        replicas: usize,
        /// Stages per replica.
        stages: usize,
        /// Micro-batches per replica and step.
        micro: usize,
    },
}

impl Layout {
    /// The devices it takes.
    pub fn devices(&self) -> usize {
        match *self {
            Layout::Mesh { data, model } => data * model,
            Layout::Pipeline { replicas, stages, .. } => replicas * stages,
        }
    }

    /// `mesh 2x2`, `2 x 3-stage pipeline, 4 micro-batches`.
    pub fn describe(&self) -> String {
        match *self {
            Layout::Mesh { data, model } => format!("mesh {data}x{model}"),
            Layout::Pipeline { replicas, stages, micro } => {
                format!("{replicas} x {stages}-stage pipeline, {micro} micro-batches")
            }
        }
    }
}

/// The memory savers of a run (`--grad-accum`, `--remat`, `--fsdp`): how its steps
/// compute, never what (the losses are the same without them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Savers {
    /// Micro-batches each step's batch is split into, their gradients accumulated.
    pub(crate) micro: usize,
    /// Each block's activations recomputed in the backward pass.
    pub(crate) remat: bool,
    /// Weights, gradients and optimizer state split over the data axis.
    pub(crate) fsdp: bool,
}

impl Default for Savers {
    fn default() -> Savers {
        Savers { micro: 1, remat: false, fsdp: false }
    }
}

/// The instruction ranges of a loss program that a training step may recompute.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Regions {
    /// Each transformer block (`--remat`).
    pub(crate) blocks: Vec<std::ops::Range<usize>>,
    /// GPT-2's attention query blocks and loss chunks ([`Blocking`]), and each convert
    /// of a `--base-dtype` base with its reader: always recomputed, so that they are
    /// held one at a time in the backward pass too.
    pub(crate) pieces: Vec<std::ops::Range<usize>>,
}

impl Regions {
    /// The regions to recompute: the pieces, and the blocks with `remat`.
    pub(crate) fn recomputed(self, remat: bool) -> Vec<std::ops::Range<usize>> {
        let mut out = self.pieces;
        if remat {
            out.extend(self.blocks);
        }
        out
    }
}

/// A training step as one device of a compiled back end runs it: what
/// [`Net::device_estimate`] sizes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DeviceStep {
    /// The global batch.
    pub(crate) batch: usize,
    /// The weights' dtype.
    pub(crate) dtype: DType,
    /// `--precision`.
    pub(crate) precision: Option<DType>,
    /// The mesh.
    pub(crate) layout: Layout,
    /// `--grad-accum`, `--remat`, `--fsdp`.
    pub(crate) savers: Savers,
    /// The optimizer (its slots).
    pub(crate) optimizer: meshwork_nn::Optimizer,
    /// Attention as one fused op (no `[T, T]` scores held).
    pub(crate) fused_attention: bool,
}

/// A run's estimated bytes ([`Net::memory_estimate`]), by what holds them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Estimate {
    /// Weights with their gradients, optimizer state and working copies, on every
    /// device (and the one-device check's).
    pub(crate) weights: f64,
    /// A step's activations (and the check's).
    pub(crate) activations: f64,
    /// A host call's batches, read and fed.
    pub(crate) feeds: f64,
}

impl Estimate {
    /// All of it.
    pub(crate) fn total(&self) -> f64 {
        self.weights + self.activations + self.feeds
    }
}

/// The model a run trains, and the dtype its frozen weights are held in (a LoRA
/// run's base under `--base-dtype`; `None`: the run's dtype).
#[derive(Clone)]
pub struct Net(Arc<dyn Model>, Option<DType>);

impl std::fmt::Debug for Net {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0.describe())
    }
}

impl Net {
    /// The run's model.
    pub fn new(model: impl Model + 'static) -> Net {
        Net(Arc::new(model), None)
    }

    /// The net with its frozen weights held in `base` (`--base-dtype`; `None`: in the
    /// run's dtype, as they were).
    pub(crate) fn with_base_dtype(self, base: Option<DType>) -> Net {
        Net(self.0, base)
    }

    /// The dtype its frozen weights are held in, where it is not the run's.
    pub(crate) fn base_dtype(&self) -> Option<DType> {
        self.1
    }

    /// The dtype weight `name` is held in by a run in `dtype`: `--base-dtype`'s for a
    /// frozen weight, else `dtype`.
    pub(crate) fn weight_dtype(&self, name: &str, dtype: DType) -> DType {
        match self.1 {
            Some(base) if !self.0.trains(name) => base,
            _ => dtype,
        }
    }

    /// The model.
    pub fn model(&self) -> &dyn Model {
        self.0.as_ref()
    }

    /// The model, shared (what an adapter wraps).
    pub(crate) fn shared(&self) -> Arc<dyn Model> {
        Arc::clone(&self.0)
    }

    /// Its family's `--model` name, what its checkpoints record.
    pub fn name(&self) -> &'static str {
        self.0.family()
    }

    /// Parameters fed each step, before the weights.
    pub fn fed(&self) -> usize {
        self.0.inputs().len()
    }

    /// A batch's fed rows `data` with what else the loss is fed: a LoRA adapter's
    /// dropout keys ([`Lora::dropout_keys`](meshwork_nn::Lora::dropout_keys)) of step
    /// `step` of a run seeded `seed`, or, for an evaluation (`step` `None`), which
    /// drops nothing, zeros.
    pub(crate) fn with_keys(
        &self,
        mut data: Vec<Tensor>,
        seed: u64,
        step: Option<usize>,
    ) -> Result<Vec<Tensor>> {
        let Some(lora) = self.0.as_lora().filter(|l| l.dropout()) else { return Ok(data) };
        let rows = data.first().map_or(0, |t| t.shape().first().copied().unwrap_or(0));
        let layers = lora.lora().layers().len();
        let keys = match step {
            Some(s) => lora.lora().dropout_keys(seed, s as u64, rows),
            None => vec![0; rows * layers * 2],
        };
        data.push(Tensor::i32(&[rows, layers, 2], keys).map_err(Error::failed)?);
        Ok(data)
    }

    /// What a row counts for in throughput: its tokens, or one sample.
    pub fn per_row(&self) -> (usize, &'static str) {
        self.0.per_row()
    }

    /// Whether the accuracy of an evaluation counts classes (or next tokens).
    pub fn classifies(&self) -> bool {
        self.0.classifies()
    }

    /// A checkpoint's description of the model.
    pub(crate) fn meta(&self) -> serde_json::Value {
        self.0.meta()
    }

    /// One line for people.
    pub fn describe(&self) -> String {
        match self.1 {
            Some(base) => format!("{}, the frozen base held in {base}", self.0.describe()),
            None => self.0.describe(),
        }
    }

    /// The loss program of `batch` rows laid out by `layout` (device scopes for a
    /// pipeline), and its loss value: the fed parameters first, then the weights.
    pub(crate) fn loss_program(
        &self,
        batch: usize,
        dtype: DType,
        layout: Layout,
    ) -> Result<(Program, Value)> {
        self.loss_program_blocks(batch, dtype, layout, None, Blocking::default())
            .map(|(p, l, _)| (p, l))
    }

    /// [`loss_program`](Self::loss_program) with its products computed in `precision`
    /// (`--precision`: bf16 or f16, the weights and everything else in `dtype`) and a
    /// language model's attention and loss cut into pieces by `blocking`, and the
    /// regions a step recomputes in its backward pass.
    pub(crate) fn loss_program_blocks(
        &self,
        batch: usize,
        dtype: DType,
        layout: Layout,
        precision: Option<DType>,
        blocking: Blocking,
    ) -> Result<(Program, Value, Regions)> {
        let bad = |e: meshwork_program::Error| Error::usage(e.to_string());
        let model = self.model();
        if matches!(layout, Layout::Pipeline { .. }) && model.max_stages() < 2 {
            return Err(Error::usage(format!(
                "--stages: the {} trains on meshes, not in pipelines",
                model.describe()
            )));
        }
        let mut b = Builder::new();
        let feeds = model.feeds(&mut b, batch, dtype).map_err(bad)?;
        let build = Build { dtype, blocking, adapter: None };
        // --precision: products in bf16 or f16, everything else in the weights' dtype.
        let loss = b
            .matmuls_in(precision, |b| match layout {
                Layout::Mesh { .. } => model.loss(b, &feeds, &build),
                Layout::Pipeline { replicas, stages, micro } => {
                    let pipeline = Pipeline::cpus(replicas, stages, micro);
                    model.loss_pipelined(b, &feeds, dtype, &pipeline)
                }
            })
            .map_err(bad)?;
        let spans = b.scope_spans();
        let blocks =
            spans.iter().filter(|(n, _)| model.is_block(n)).map(|(_, r)| r.clone()).collect();
        // The attention's query blocks and the loss's chunks.
        let piece = |name: &str| name.contains(".q_block.") || name.starts_with("lm_head.chunk.");
        let pieces = spans.iter().filter(|(n, _)| piece(n)).map(|(_, r)| r.clone()).collect();
        let program = b.finish(&[loss]).map_err(bad)?;
        let (program, regions) = self.narrowed(program, Regions { blocks, pieces })?;
        let loss = program.results()[0];
        Ok((program, loss, regions))
    }

    /// The evaluation program of `batch` rows: the mean loss and accuracy (of the class,
    /// or of the next token), the fed parameters first, then the weights.
    pub(crate) fn eval_program(&self, batch: usize, dtype: DType) -> Result<Program> {
        let bad = |e: meshwork_program::Error| Error::usage(e.to_string());
        let mut b = Builder::new();
        let feeds = self.0.feeds(&mut b, batch, dtype).map_err(bad)?;
        let (loss, accuracy) = self.0.evaluate(&mut b, &feeds, &Build::new(dtype)).map_err(bad)?;
        let program = b.finish(&[loss, accuracy]).map_err(bad)?;
        Ok(self.narrowed(program, Regions::default())?.0)
    }

    /// `program` (and its `regions`, renumbered) with each frozen weight taken in
    /// [`base_dtype`](Self::base_dtype) and converted to the dtype the model reads it
    /// in just before each instruction that reads it, that convert and its reader a
    /// region the backward pass recomputes ([`Regions::pieces`]): the converted copy
    /// lives from its convert to its reader, in the forward pass and again in the
    /// backward one, so that a step holds the base once in the narrow dtype and one
    /// converted weight at a time. Unchanged without a base dtype. Converting up from
    /// bf16 is exact: the program computes what the run in its own dtype computes from
    /// the base rounded to bf16.
    fn narrowed(&self, program: Program, regions: Regions) -> Result<(Program, Regions)> {
        let Some(base) = self.1 else { return Ok((program, regions)) };
        let bad = |e: meshwork_program::Error| Error::failed(format!("--base-dtype: {e}"));
        // The weights (after the fed parameters) the model does not train.
        let fed = self.fed();
        let frozen: Vec<bool> = program
            .params()
            .iter()
            .enumerate()
            .map(|(k, p)| {
                k >= fed
                    && p.spec.dtype.is_float()
                    && p.spec.dtype != base
                    && !self.0.trains(&p.name)
            })
            .collect();
        if !frozen.contains(&true) {
            return Ok((program, regions));
        }
        let mut b = Builder::new();
        let mut map: Vec<Value> = Vec::with_capacity(program.num_values());
        for (p, &narrow) in program.params().iter().zip(&frozen) {
            let mut spec = p.spec.clone();
            if narrow {
                spec.dtype = base;
            }
            let v = b.param(&p.name, spec).map_err(bad)?;
            map.push(b.set_device(v, &p.device).map_err(bad)?);
        }
        // Where each old instruction's converts (then the instruction) begin.
        let mut starts = Vec::with_capacity(program.instrs().len() + 1);
        let mut pieces = Vec::new();
        for instr in program.instrs() {
            let start = b.instr_count();
            starts.push(start);
            // Each frozen weight it reads, converted for it alone.
            let mut args: Vec<Value> = instr.args.iter().map(|a| map[a.index()]).collect();
            let mut converted: Vec<(usize, Value)> = Vec::new();
            for (slot, a) in instr.args.iter().enumerate() {
                let k = a.index();
                if k >= frozen.len() || !frozen[k] {
                    continue;
                }
                let v = match converted.iter().find(|(j, _)| *j == k) {
                    Some(&(_, v)) => v,
                    None => {
                        let to = program.params()[k].spec.dtype;
                        let v = b.convert(map[k], to).map_err(bad)?;
                        converted.push((k, v));
                        v
                    }
                };
                args[slot] = v;
            }
            let with: Vec<Value> = instr.colocate.iter().map(|c| map[c.index()]).collect();
            map.push(b.push_copy(instr, &args, &with, instr.name.as_deref()).map_err(bad)?);
            if !converted.is_empty() {
                pieces.push(start..b.instr_count());
            }
        }
        starts.push(b.instr_count());
        let results: Vec<Value> = program.results().iter().map(|r| map[r.index()]).collect();
        let out = b.finish(&results).map_err(bad)?;
        let renumber = |rs: Vec<std::ops::Range<usize>>| -> Vec<std::ops::Range<usize>> {
            rs.into_iter().map(|r| starts[r.start]..starts[r.end]).collect()
        };
        let mut regions =
            Regions { blocks: renumber(regions.blocks), pieces: renumber(regions.pieces) };
        regions.pieces.extend(pieces);
        Ok((out, regions))
    }

    /// Weight `name`'s partition spec on a mesh of `model` devices along its model
    /// axis: the dim the model's Megatron split names over `model`, the rest whole.
    pub(crate) fn weight_spec(&self, name: &str, rank: usize, model: usize) -> PartitionSpec {
        match self.0.split(name, model) {
            Some(d) if d < rank => {
                let mut dims = vec![DimSpec::Replicated; rank];
                dims[d] = DimSpec::Axes(vec!["model".into()]);
                PartitionSpec::new(dims)
            }
            _ => PartitionSpec::replicated(),
        }
    }

    /// Weight `name` of `dims`'s layout under `--fsdp` on a `data x model` mesh: its
    /// [`weight_spec`](Self::weight_spec) (none when `model` is 1) with the data axis
    /// added on its largest dimension that the model axis does not split and that
    /// `data` divides (the first of equals); `None` when it has none, and it stays
    /// whole on every replica.
    pub(crate) fn fsdp_spec(
        &self,
        name: &str,
        dims: &[usize],
        (data, model): (usize, usize),
    ) -> Option<PartitionSpec> {
        let base = match model {
            1 => PartitionSpec::replicated(),
            _ => self.weight_spec(name, dims.len(), model),
        };
        let mut specs: Vec<DimSpec> = (0..dims.len())
            .map(|d| base.dims().get(d).cloned().unwrap_or(DimSpec::Replicated))
            .collect();
        if data < 2 {
            return None;
        }
        let pick = (0..dims.len())
            .filter(|&d| specs[d] == DimSpec::Replicated && dims[d].is_multiple_of(data))
            .max_by_key(|&d| (dims[d], std::cmp::Reverse(d)))?;
        specs[pick] = DimSpec::Axes(vec!["data".into()]);
        Some(PartitionSpec::new(specs))
    }

    /// Each weight's name and dims.
    pub(crate) fn weight_dims(&self) -> Vec<(String, Vec<usize>)> {
        self.0.parameters()
    }

    /// Its weights' element count.
    pub fn parameters(&self) -> f64 {
        self.0.parameter_count()
    }

    /// Bytes a run holds at once, roughly (in f64, so no size overflows): every
    /// device's weights with their gradients, optimizer state and working copies (a
    /// `1/D` part of each weight `--fsdp` splits over `D` replicas), a step's
    /// activations (of one micro-batch with `--grad-accum`, one block's at a time with
    /// `--remat`), a host call's batches (`steps_per_run` of `batch` rows, built at
    /// once and split per device), and the one-device check's copy of it all (which
    /// runs without the savers).
    pub(crate) fn memory_estimate(
        &self,
        batch: usize,
        steps_per_run: usize,
        dtype: DType,
        layout: Layout,
        check: bool,
        savers: Savers,
    ) -> Estimate {
        let size = dtype.size_in_bytes() as f64;
        let b = batch as f64;
        let devices = layout.devices() as f64;
        let checked = f64::from(u8::from(check));
        let whole = self.parameters();
        // A frozen weight (a base under an adapter) is held alone: a sixth of what a
        // trained one takes with its gradient, optimizer state and working copies (less
        // again in a narrower --base-dtype).
        let narrow = self.1.map_or(1.0, |b| b.size_in_bytes() as f64 / size);
        let share = |name: &str| if self.0.trains(name) { 1.0 } else { narrow / 6.0 };
        let count = |dims: &[usize]| dims.iter().map(|&d| d as f64).product::<f64>();
        // (Counted by name only when some weight is frozen: a model's parameter count
        // needs no list of its parameters, which a size no memory holds would make.)
        let weighted: f64 = match self.0.as_lora() {
            None => whole,
            Some(_) => self.weight_dims().iter().map(|(n, d)| share(n) * count(d)).sum(),
        };
        let (held, gathered) = match layout {
            Layout::Mesh { data, model } if savers.fsdp && data > 1 => {
                let held = self
                    .weight_dims()
                    .iter()
                    .map(|(name, dims)| {
                        let n = share(name) * count(dims);
                        match self.fsdp_spec(name, dims, (data, model)) {
                            Some(_) => n / data as f64,
                            None => n,
                        }
                    })
                    .sum();
                // --fsdp's whole copies: every weight gathered for the step, or (with
                // --remat, which gathers a block's weights again in its backward pass)
                // a block's weights and whole gradients at a time.
                let layers = self.0.layers().max(1) as f64;
                (held, if savers.remat { 2.0 * whole / layers } else { whole })
            }
            _ => (weighted, 0.0),
        };
        let weights = ((held * 6.0 + gathered + self.converted()) * devices
            + (weighted * 6.0 + self.converted()) * checked)
            * size;
        // The run's own (counted twice over a mesh without the check) and the check's.
        let own = (devices + checked).min(2.0) - checked;
        let micro = savers.micro.max(1) as f64;
        let activations = 2.0
            * size
            * (own * b / micro * self.0.activations_per_row(savers.remat)
                + checked * b * self.0.activations_per_row(false));
        // The host call's feeds: the global batches, then their parts on the devices
        // (the check's too), in f64 where they are read and in the dtype where fed.
        let calls = steps_per_run.max(1) as f64;
        let feeds = calls * b * self.0.row_elements() * (8.0 + size * (1.0 + checked));
        Estimate { weights, activations, feeds }
    }

    /// What one device of a mesh holds at its step's peak, for a compiled back end
    /// (XLA: each device its own memory, no one-device check, no host copies): its
    /// weights' parts (split over the model axis as [`weight_spec`](Self::weight_spec)
    /// says, over the data axis too with `--fsdp`) with their gradients and optimizer
    /// slots, `--fsdp`'s gathered copies, and its share of the step's activations
    /// (its rows of the batch, a micro-batch at a time; the model axis splits the
    /// heads and the MLP, taken as splitting them all), in `--precision`'s dtype.
    /// `feeds` is its batch part. Fused attention holds no `[T, T]` scores.
    pub(crate) fn device_estimate(&self, step: &DeviceStep) -> Estimate {
        let DeviceStep { batch, dtype, precision, layout, savers, optimizer, fused_attention } =
            *step;
        let size = dtype.size_in_bytes() as f64;
        // Activations are in the dtype products compute in (`--precision`).
        let act_size = precision.unwrap_or(dtype).size_in_bytes() as f64;
        let (data, model) = match layout {
            Layout::Mesh { data, model } => (data.max(1), model.max(1)),
            Layout::Pipeline { replicas, .. } => (replicas.max(1), 1),
        };
        // Trained weights, then frozen ones (held alone, no gradient or state).
        let (mut held, mut held_frozen) = (0.0, 0.0);
        let (mut gathered, mut gathered_frozen) = (0.0, 0.0);
        for (name, dims) in self.weight_dims() {
            let trains = self.0.trains(&name);
            let n: f64 = dims.iter().map(|&d| d as f64).product();
            let split = |spec: &PartitionSpec, axis: &str, by: usize| {
                let on = spec
                    .dims()
                    .iter()
                    .any(|d| matches!(d, DimSpec::Axes(a) if a.iter().any(|x| x == axis)));
                if on { by as f64 } else { 1.0 }
            };
            let base = self.weight_spec(&name, dims.len(), model);
            let whole = n / split(&base, "model", model);
            let (h, g) = match self
                .fsdp_spec(&name, &dims, (data, model))
                .filter(|_| savers.fsdp && data > 1)
            {
                Some(spec) => {
                    (n / (split(&spec, "model", model) * split(&spec, "data", data)), whole)
                }
                None => (whole, 0.0),
            };
            if trains {
                (held, gathered) = (held + h, gathered + g);
            } else {
                (held_frozen, gathered_frozen) = (held_frozen + h, gathered_frozen + g);
            }
        }
        if savers.remat && savers.fsdp {
            // A block's weights gathered (and again in its backward pass) at a time.
            let layers = self.0.layers().max(1) as f64;
            gathered = 2.0 * gathered / layers;
            gathered_frozen = 2.0 * gathered_frozen / layers;
        }
        // Weight, gradient and optimizer slots held; gathered copies and their
        // gradients before the reduce-scatter (a frozen weight's copy alone).
        let slots = 2.0 + optimizer.state_names().len() as f64;
        // A narrower --base-dtype holds the frozen weights (and gathers them) in it,
        // and one converted copy at a time in `dtype`.
        let narrow = self.1.map_or(1.0, |b| b.size_in_bytes() as f64 / size);
        let frozen = (held_frozen + gathered_frozen) * narrow + self.converted() / model as f64;
        let weights = (held * slots + 2.0 * gathered + frozen) * size;
        let rows = batch as f64 / data as f64 / savers.micro.max(1) as f64;
        let mut per_row = self.0.activations_per_row(savers.remat);
        if fused_attention {
            per_row -= self.0.attention_scores_per_row(savers.remat);
        }
        let activations = act_size * rows * per_row / model as f64;
        let feeds = rows * savers.micro.max(1) as f64 * self.0.row_elements() * size;
        Estimate { weights, activations, feeds }
    }

    /// Elements of the converted copy a step holds at once under a narrower
    /// `--base-dtype` (its largest frozen weight, converted just before each reader),
    /// else none.
    fn converted(&self) -> f64 {
        if self.1.is_none() {
            return 0.0;
        }
        let count = |dims: &[usize]| dims.iter().map(|&d| d as f64).product::<f64>();
        self.weight_dims()
            .iter()
            .filter(|(name, _)| !self.0.trains(name))
            .map(|(_, dims)| count(dims))
            .fold(0.0, f64::max)
    }

    /// Initial weights drawn from `seed`, each parameter as the model initialises it,
    /// from one stream in parameter order.
    pub(crate) fn random_init(&self, seed: u64) -> Result<HashMap<String, Tensor>> {
        let mut rng = SplitMix::new(seed ^ self.0.init_stream());
        let mut normal = || rng.normal();
        self.0
            .parameters()
            .into_iter()
            .map(|(name, dims)| {
                let values = self.0.init(&name, &dims, &mut normal);
                let t = Tensor::f64(&dims, values).map_err(Error::failed)?;
                Ok((name, t))
            })
            .collect()
    }
}
