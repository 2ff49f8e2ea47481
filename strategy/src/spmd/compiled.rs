//! Compiled SPMD programs whose state stays on the devices across steps.

use std::sync::{Mutex, PoisonError};

use meshwork_nn::{Optimizer, TrainStep};
use meshwork_partition::spmd::{PartitionOptions, Partitioned, Shardings, partition_with};
use meshwork_program::{Program, Tensor, Value};
use meshwork_types::TensorSpec;

use super::layout::{FeedPlan, join, split, split_with};
use crate::backend::SpmdExecutable;
use crate::{Error, Result, Strategy, partition_error};

/// A partitioned program compiled onto a strategy's devices, with some parameters
/// resident: each device keeps its part of them between steps, a step moves only the
/// other parameters in and the results that do not replace a parameter out.
///
/// Built by [`Strategy::compile`]. A step reads the resident parts in place (never
/// copied) and keeps its carried results aside until every device has finished; only
/// then do they replace the parameters (the old buffers go back to the devices' pools
/// for the next step to write into). So a step that fails — a bad index in a batch, a
/// failing peer — returns its error and leaves the resident state as it was, on every
/// device. Calls are serialised: one step, read or write of the state at a time. The
/// strategy's [`Backend`](crate::backend::Backend) compiles and runs the per-device
/// program.
pub struct Compiled<'s> {
    pub(super) strategy: &'s Strategy,
    part: Partitioned,
    /// The per-device program on the strategy's back end, with the resident parts.
    pub(super) exe: Box<dyn SpmdExecutable>,
    /// `(result, parameter)`: the result replaces the parameter after each step.
    carry: Vec<(usize, usize)>,
    resident: Vec<bool>,
    /// Resident parameters no result replaces (a frozen base): set once, read by
    /// every step, not part of the state a checkpoint holds.
    frozen: Vec<bool>,
    /// How each fed (non-resident) parameter is split, in parameter order.
    feeds: Vec<(usize, FeedPlan)>,
    /// Held through a step and through every read or write of the resident state.
    pub(super) busy: Mutex<()>,
    /// Steps run.
    runs: std::sync::atomic::AtomicU64,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Strategy {
    /// Partitions `program` over `shardings`' mesh and compiles it onto this
    /// strategy's devices (mesh position `r` on device `mesh.devices()[r]`). Each
    /// `(result, parameter)` of `carry` makes the parameter resident: after every
    /// step the result replaces it on the devices (the result gets the parameter's
    /// layout), as a training step's updated weights replace its weights.
    ///
    /// In a strategy spread over processes (an executor with an MPI interconnect),
    /// process `p` of `d` devices runs positions `p * d..(p + 1) * d`, which must be
    /// the positions on its devices. Every process then makes every call — compile,
    /// `set`, each step, `get`, checkpoints — in the same order with the same global
    /// values (the whole batch, the whole weights): each keeps its positions' parts,
    /// and a step's results and `get` are gathered from all processes (an
    /// all-gather of every result part each host call). What the program `emit`s
    /// streams from position 0 only, so in process 0. A checkpoint is written by
    /// process 0 and read by every process, so restoring needs a directory all of
    /// them see. Of the back ends, the interpreter and XLA (its collectives then on
    /// the host, through the executor) run such meshes.
    pub fn compile(
        &self,
        program: &Program,
        shardings: &Shardings,
        carry: &[(usize, &str)],
    ) -> Result<Compiled<'_>> {
        self.compile_frozen(program, shardings, carry, &[])
    }

    /// [`compile`](Self::compile) with the parameters named `frozen` resident too but
    /// never replaced: set once ([`Compiled::set`]), read in place by every step, and
    /// left out of the state ([`Compiled::state`], checkpoints) — a frozen base under
    /// a LoRA adapter.
    pub fn compile_frozen(
        &self,
        program: &Program,
        shardings: &Shardings,
        carry: &[(usize, &str)],
        frozen: &[&str],
    ) -> Result<Compiled<'_>> {
        let mesh = shardings.mesh();
        // Checked before partitioning.
        self.mesh_placement(mesh)?;
        let inputs = shardings.layouts(program)?;
        let np = program.params().len();
        let mut pairs = Vec::with_capacity(carry.len());
        for &(r, name) in carry {
            let p = program.params().iter().position(|p| p.name == name).ok_or_else(|| {
                partition_error(
                    name.to_string(),
                    "compile",
                    "carried into a parameter the program does not have",
                )
            })?;
            let spec = program.spec(*program.results().get(r).ok_or_else(|| {
                partition_error(
                    name.to_string(),
                    "compile",
                    format!("carried from result {r}; the program has {}", program.results().len()),
                )
            })?);
            if spec != Some(&program.params()[p].spec) {
                return Err(partition_error(
                    name.to_string(),
                    "compile",
                    format!("result {r} is not of the parameter's spec"),
                ));
            }
            if let Some(&(r0, p0)) = pairs.iter().find(|&&(r0, p0)| r0 == r || p0 == p) {
                return Err(partition_error(
                    name.to_string(),
                    "compile",
                    if r0 == r {
                        format!("result {r} is carried twice (into two parameters)")
                    } else {
                        format!("carried from results {r0} and {r} (p{p0})")
                    },
                ));
            }
            pairs.push((r, p));
        }
        // Propagate once to learn the carried parameters' layouts, then pin the
        // carried results to them.
        let options = PartitionOptions {
            constraints: shardings.constraints(program)?,
            ..PartitionOptions::default()
        };
        let first =
            partition_with(program, mesh, &inputs, &vec![None; program.results().len()], &options)?;
        let mut fixed = inputs.clone();
        for (k, l) in first.inputs().iter().enumerate() {
            fixed[k] = Some(l.clone());
        }
        let mut outputs = vec![None; program.results().len()];
        for &(r, p) in &pairs {
            outputs[r] = Some(first.inputs()[p].clone());
        }
        let part = partition_with(program, mesh, &fixed, &outputs, &options)?;
        let mut resident = vec![false; np];
        for &(_, p) in &pairs {
            resident[p] = true;
        }
        let mut held = vec![false; np];
        for &name in frozen {
            let p = program.params().iter().position(|p| p.name == name).ok_or_else(|| {
                partition_error(name.to_string(), "compile", "frozen, but not a parameter")
            })?;
            if resident[p] {
                return Err(partition_error(name.to_string(), "compile", "frozen and carried"));
            }
            resident[p] = true;
            held[p] = true;
        }
        let exe = self.compile_on_mesh(&part, &resident, &pairs)?;
        let feeds = (0..np)
            .filter(|&k| !resident[k])
            .map(|k| {
                let shape = program.params()[k].spec.shape.dims();
                Ok((k, FeedPlan::new(mesh, &part.inputs()[k], shape)?))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Compiled {
            strategy: self,
            part,
            exe,
            carry: pairs,
            resident,
            frozen: held,
            feeds,
            busy: Mutex::new(()),
            runs: std::sync::atomic::AtomicU64::new(0),
        })
    }
}

impl Compiled<'_> {
    /// The `(result, parameter)` pairs whose result becomes the parameter's next value
    /// (what a back end donates step to step).
    pub fn carry_pairs(&self) -> Vec<(usize, usize)> {
        self.carry.clone()
    }

    /// The partitioned program.
    pub fn partitioned(&self) -> &Partitioned {
        &self.part
    }

    pub(super) fn param(&self, name: &str) -> Result<usize> {
        self.part.global().params().iter().position(|p| p.name == name).ok_or_else(|| {
            partition_error(
                name.to_string(),
                "compiled",
                "the program has no parameter of this name",
            )
        })
    }

    /// Places resident parameter `name` on the devices (split by its layout).
    pub fn set(&self, name: &str, value: &Tensor) -> Result<()> {
        let k = self.param(name)?;
        let parts = self.split_resident(k, value)?;
        self.install(vec![(k, parts)])?;
        Ok(())
    }

    /// Places resident parameter `name` from the parts `read` gives: it is asked once
    /// for each distinct region the mesh positions hold (its `[start, stop)` per dim
    /// of the global value; positions holding the same region share one read), so a
    /// caller reading from a file reads only what the devices hold, never the whole
    /// value at once (Orbax's and `jax.make_array_from_callback`'s way). Each part must
    /// be of the parameter's dtype and the region's shape. Across processes each
    /// process is asked only for its own positions' regions.
    pub fn set_with(
        &self,
        name: &str,
        read: &mut dyn FnMut(&[std::ops::Range<usize>]) -> Result<Tensor>,
    ) -> Result<()> {
        let k = self.param(name)?;
        let p = &self.part.global().params()[k];
        if !self.resident[k] {
            self.resident_only(&p.name)?;
        }
        let dims = p.spec.shape.dims();
        let layout = &self.part.inputs()[k];
        let sharding = layout.to_named(self.part.mesh())?.to_sharding(dims.len())?;
        let regions = sharding.index_map(dims, meshwork_sharding::Mode::Strict)?;
        let mut parts: Vec<Tensor> = Vec::with_capacity(regions.len());
        // Another process's positions: their process reads their parts.
        let local = self.exe.local();
        for (r, region) in regions.iter().enumerate() {
            if !local.contains(&r) {
                parts.push(Tensor::zeros(p.spec.dtype, &[0])?);
                continue;
            }
            let earlier = regions[..r]
                .iter()
                .enumerate()
                .position(|(q, x)| local.contains(&q) && x.ranges == region.ranges);
            let part = match earlier {
                Some(q) => parts[q].clone(),
                None => read(&region.ranges)?,
            };
            let want: Vec<usize> = region.ranges.iter().map(|x| x.end - x.start).collect();
            if part.dtype() != p.spec.dtype || part.shape() != want.as_slice() {
                return Err(partition_error(
                    p.name.clone(),
                    "set_with",
                    format!(
                        "the part of {:?} read as {}{:?}; want {}{want:?}",
                        region.ranges,
                        part.dtype(),
                        part.shape(),
                        p.spec.dtype
                    ),
                ));
            }
            parts.push(part);
        }
        self.install(vec![(k, parts)])?;
        Ok(())
    }

    /// Resident parameter `k`'s value split into each device's part, after checking
    /// its spec.
    pub(super) fn split_resident(&self, k: usize, value: &Tensor) -> Result<Vec<Tensor>> {
        let p = &self.part.global().params()[k];
        if value.spec() != p.spec {
            return Err(partition_error(
                p.name.clone(),
                "set",
                format!("given {}, the parameter is {}", value.spec(), p.spec),
            ));
        }
        if !self.resident[k] {
            self.resident_only(&p.name)?;
        }
        split(self.part.mesh(), &self.part.inputs()[k], value)
    }

    /// Puts each resident parameter's parts (one per mesh position) on the devices.
    /// All or none: a part the back end cannot put (out of device memory) leaves
    /// every parameter as it was.
    pub(super) fn install(&self, parts: Vec<(usize, Vec<Tensor>)>) -> Result<()> {
        let _busy = lock(&self.busy);
        let all = parts
            .into_iter()
            .flat_map(|(k, parts)| parts.into_iter().enumerate().map(move |(r, t)| (r, k, t)))
            .collect();
        let put = self.exe.put_all(all);
        if self.strategy.is_multi_process() {
            // An upload can fail in one process alone (out of device memory): every
            // process learns it, so none steps on with parts another lacks.
            let everywhere = self.strategy.all_agree(put.is_ok())?;
            put?;
            if !everywhere {
                return Err(Error::Compiled {
                    problem: "another process failed to put its parts on its devices".into(),
                });
            }
            return Ok(());
        }
        put
    }

    /// The parameters kept on the devices that steps replace — the state, what a
    /// checkpoint holds — by index (the frozen ones left out).
    pub(super) fn resident_params(&self) -> Vec<usize> {
        (0..self.resident.len()).filter(|&k| self.resident[k] && !self.frozen[k]).collect()
    }

    /// Copies of every resident parameter's parts, by mesh position, taken at one
    /// instant (no step between them).
    pub(super) fn snapshot(&self) -> Result<Vec<(usize, Vec<Tensor>)>> {
        let _busy = lock(&self.busy);
        self.resident_params().into_iter().map(|k| Ok((k, self.parts_of(k)?))).collect()
    }

    /// Copies of resident parameter `k`'s parts, by mesh position (the caller holds
    /// `busy`).
    fn parts_of(&self, k: usize) -> Result<Vec<Tensor>> {
        let name = &self.part.global().params()[k].name;
        self.exe
            .fetch_every(self.strategy, k)?
            .into_iter()
            .map(|p| {
                p.ok_or_else(|| Error::Compiled {
                    problem: format!("resident parameter {name} was never set"),
                })
            })
            .collect()
    }

    fn resident_only(&self, name: &str) -> Result<()> {
        Err(partition_error(
            name.to_string(),
            "compiled",
            "not a resident parameter (no result is carried into it)",
        ))
    }

    /// Resident parameter `name`, assembled from the devices.
    pub fn get(&self, name: &str) -> Result<Tensor> {
        let k = self.param(name)?;
        if !self.resident[k] {
            self.resident_only(name)?;
        }
        let parts = {
            let _busy = lock(&self.busy);
            self.parts_of(k)?
        };
        let shape = self.part.global().params()[k].spec.shape.dims().to_vec();
        join(self.part.mesh(), &self.part.inputs()[k], &shape, &parts)
    }

    /// Resident parameter `name`, assembled in the process that runs mesh position 0
    /// alone (`None` in the others): across processes the parts are sent to that
    /// process only, for what one process writes (an export); in one process,
    /// [`get`](Self::get). Every process calls it.
    pub fn get_first(&self, name: &str) -> Result<Option<Tensor>> {
        if !self.strategy.is_multi_process() {
            return self.get(name).map(Some);
        }
        let k = self.param(name)?;
        if !self.resident[k] {
            self.resident_only(name)?;
        }
        let parts = {
            let _busy = lock(&self.busy);
            self.exe.fetch_to_first(self.strategy, k)?
        };
        let Some(parts) = parts else { return Ok(None) };
        let parts = parts
            .into_iter()
            .map(|p| {
                p.ok_or_else(|| Error::Compiled {
                    problem: format!("resident parameter {name} was never set"),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let shape = self.part.global().params()[k].spec.shape.dims().to_vec();
        join(self.part.mesh(), &self.part.inputs()[k], &shape, &parts).map(Some)
    }

    /// The bytes each mesh position holds of resident parameter `name` between steps,
    /// as its back end reports them (a device buffer's size on XLA).
    pub fn held_bytes(&self, name: &str) -> Result<Vec<u64>> {
        let k = self.param(name)?;
        if !self.resident[k] {
            self.resident_only(name)?;
        }
        let _busy = lock(&self.busy);
        (0..self.part.mesh().size())
            .map(|r| {
                self.exe.held_bytes(r, k)?.ok_or_else(|| Error::Compiled {
                    problem: format!(
                        "resident parameter {name} is not on the devices (never set, or lost \
                         in a failed step)"
                    ),
                })
            })
            .collect()
    }

    /// What its steps moved so far, as its back end counted it.
    pub fn traffic(&self) -> crate::backend::Traffic {
        self.exe.traffic()
    }

    /// The names of the resident parameters (the frozen ones too), in parameter
    /// order.
    pub fn resident(&self) -> Vec<String> {
        let params = self.part.global().params();
        (0..params.len()).filter(|&k| self.resident[k]).map(|k| params[k].name.clone()).collect()
    }

    /// The steps run so far (successful ones).
    pub fn steps(&self) -> u64 {
        self.runs.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// One step: `feeds` are the non-resident parameters in parameter order (split by
    /// their layouts); returns the results not carried into a parameter, assembled.
    /// What the program `emit`s streams to the strategy's metrics
    /// ([`Strategy::with_metrics`](crate::Strategy::with_metrics)) from mesh position 0,
    /// tagged with the step's number ([`steps`](Self::steps) before it).
    /// A failed step does not count; what it emitted before failing is not taken
    /// back (its records carry the number the next step will use).
    pub fn step(&self, feeds: &[Tensor]) -> Result<Vec<Tensor>> {
        self.step_tagged(feeds, None)
    }

    /// [`step`](Self::step), its emits tagged `tag` (default: the steps run so far,
    /// read under the step lock).
    pub(super) fn step_tagged(&self, feeds: &[Tensor], tag: Option<u64>) -> Result<Vec<Tensor>> {
        let mut out = self.steps_tagged(&[feeds], tag)?;
        Ok(out.pop().expect("one step's results"))
    }

    /// Several steps in one host call: step `i` is fed `feeds[i]`, the carried results
    /// of a step are the next one's parameters on the devices, and they replace the
    /// resident state only when every step finished on every device (a failure in any
    /// leaves the state as before the call). Emits are tagged `tag + i`.
    pub(super) fn steps_tagged(
        &self,
        feeds: &[&[Tensor]],
        tag: Option<u64>,
    ) -> Result<Vec<Vec<Tensor>>> {
        let _busy = lock(&self.busy);
        let tag = tag.unwrap_or_else(|| self.steps());
        let global = self.part.global();
        let fed = &self.feeds;
        if let Some(bad) = feeds.iter().find(|f| f.len() != fed.len()) {
            return Err(partition_error(
                String::new(),
                "step",
                format!("{} feeds for {} non-resident parameters", bad.len(), fed.len()),
            ));
        }
        if feeds.is_empty() {
            return Ok(Vec::new());
        }
        // Every device's resident parts must all be there, before any feed is split.
        for r in 0..self.part.mesh().size() {
            let unset =
                (0..self.resident.len()).find(|&k| self.resident[k] && !self.exe.is_set(r, k));
            if let Some(k) = unset {
                return Err(Error::Compiled {
                    problem: format!(
                        "resident parameter {} was never set",
                        global.params()[k].name
                    ),
                });
            }
        }
        let mesh = self.part.mesh();
        for step in feeds {
            for (t, (k, _)) in step.iter().zip(fed) {
                let p = &global.params()[*k];
                if t.spec() != p.spec {
                    return Err(partition_error(
                        p.name.clone(),
                        "step",
                        format!("fed {}, the parameter is {}", t.spec(), p.spec),
                    ));
                }
            }
        }
        let mut per: Vec<Vec<Vec<Tensor>>> = vec![Vec::with_capacity(feeds.len()); mesh.size()];
        for step in feeds {
            let mut parts_of: Vec<Vec<Tensor>> = vec![Vec::with_capacity(fed.len()); mesh.size()];
            for (t, (_, plan)) in step.iter().zip(fed) {
                let take = |r: usize, spec: &TensorSpec| self.exe.buffer(r, spec);
                let parts = split_with(plan, t, take)?;
                for (r, part) in parts.into_iter().enumerate() {
                    parts_of[r].push(part);
                }
            }
            for (r, p) in parts_of.into_iter().enumerate() {
                per[r].push(p);
            }
        }
        let nres = global.results().len();
        let run = self.exe.run(self.strategy, per, tag);
        // The results are assembled first (reading each device's outputs): if that
        // fails, nothing is committed.
        let assembled = run.and_then(|mut outs| {
            let kept: Vec<usize> =
                (0..nres).filter(|r| !self.carry.iter().any(|(c, _)| c == r)).collect();
            let mut all = Vec::with_capacity(feeds.len());
            for step in 0..feeds.len() {
                let mut results = Vec::with_capacity(kept.len());
                for (i, &r) in kept.iter().enumerate().rev() {
                    let parts: Vec<Tensor> = outs.iter_mut().map(|o| o[step].remove(i)).collect();
                    let v = global.results()[r];
                    let shape = global.spec(v).expect("a result").shape.dims().to_vec();
                    results.push(join(mesh, &self.part.outputs()[r], &shape, &parts)?);
                }
                results.reverse();
                all.push(results);
            }
            Ok(all)
        });
        // All devices or none: the carried results replace the parameters only now.
        self.exe.commit(assembled.is_ok());
        let results = assembled?;
        self.runs.fetch_add(feeds.len() as u64, std::sync::atomic::Ordering::SeqCst);
        Ok(results)
    }
}

/// A training step (forward, backward and the optimizer's update as one partitioned
/// program) whose weights and optimizer state stay on the devices.
pub struct CompiledTrainStep<'s> {
    pub(super) compiled: Compiled<'s>,
    step: TrainStep,
    pub(super) steps: usize,
}

impl Strategy {
    /// Compiles the training step of `loss` (a float scalar of `program`) over the
    /// weights `trained` (parameters of `program`) with `optimizer`, partitioned by
    /// `shardings` (given for the model program's parameters: each weight's optimizer
    /// state is laid out like the weight). The other parameters (the batch) are fed
    /// each step.
    pub fn compile_train_step(
        &self,
        program: &Program,
        loss: Value,
        trained: &[Value],
        optimizer: Optimizer,
        shardings: &Shardings,
    ) -> Result<CompiledTrainStep<'_>> {
        self.compile_train_step_clipped(program, loss, trained, optimizer, None, shardings)
    }

    /// [`compile_train_step`](Self::compile_train_step) with the gradients clipped to
    /// global norm `max_norm` first ([`TrainStep::clipped`]).
    pub fn compile_train_step_clipped(
        &self,
        program: &Program,
        loss: Value,
        trained: &[Value],
        optimizer: Optimizer,
        max_norm: Option<f64>,
        shardings: &Shardings,
    ) -> Result<CompiledTrainStep<'_>> {
        let step = TrainStep::clipped(program, loss, trained, optimizer, max_norm)?;
        self.compile_step(step, shardings)
    }

    /// Compiles a training step already built ([`TrainStep::with_options`]: gradient
    /// accumulation, rematerialization), partitioned by `shardings`, given for the
    /// step program's fed parameters (each micro-batch's) and its trained ones: each
    /// weight's optimizer state is laid out like the weight.
    pub fn compile_step(
        &self,
        step: TrainStep,
        shardings: &Shardings,
    ) -> Result<CompiledTrainStep<'_>> {
        self.compile_step_with(step, shardings, true)
    }

    /// [`compile_step`](Self::compile_step) without setting the optimizer state (its
    /// zeros would be as large as the weights): for a back end that compiles without
    /// running (`XlaTarget`), or a caller that sets every state itself before the
    /// first step (an unset one is an error then, never a silent zero).
    pub fn compile_step_unset(
        &self,
        step: TrainStep,
        shardings: &Shardings,
    ) -> Result<CompiledTrainStep<'_>> {
        self.compile_step_with(step, shardings, false)
    }

    fn compile_step_with(
        &self,
        step: TrainStep,
        shardings: &Shardings,
        init_state: bool,
    ) -> Result<CompiledTrainStep<'_>> {
        let optimizer = step.optimizer;
        let trained = &step.trained;
        let program = &step.program;
        let mut s = shardings.clone();
        for &w in trained {
            let name = &program.params()[w.index()].name;
            if let Some(spec) = shardings.spec(name) {
                for st in optimizer.state_names() {
                    s = s.with_spec(&format!("optimizer.{st}.{name}"), spec.clone());
                }
            }
        }
        let names: Vec<String> = step.program.params().iter().map(|p| p.name.clone()).collect();
        let states = step.state_len();
        let first_state = names.len() - 2 - states;
        let mut carry: Vec<(usize, &str)> = Vec::new();
        for (k, &w) in trained.iter().enumerate() {
            carry.push((1 + k, names[w.index()].as_str()));
        }
        for j in 0..states {
            carry.push((1 + trained.len() + j, names[first_state + j].as_str()));
        }
        let frozen: Vec<&str> = step.frozen.iter().map(|f| names[f.index()].as_str()).collect();
        let compiled = self.compile_frozen(&step.program, &s, &carry, &frozen)?;
        if init_state {
            for (t, j) in step.init_state()?.iter().zip(first_state..) {
                compiled.set(&names[j], t)?;
            }
        }
        Ok(CompiledTrainStep { compiled, step, steps: 0 })
    }
}

impl CompiledTrainStep<'_> {
    /// Places weight `name`'s initial value on the devices.
    pub fn set(&self, name: &str, value: &Tensor) -> Result<()> {
        self.compiled.set(name, value)
    }

    /// Places weight `name` from each device's part as `read` gives it
    /// ([`Compiled::set_with`]).
    pub fn set_with(
        &self,
        name: &str,
        read: &mut dyn FnMut(&[std::ops::Range<usize>]) -> Result<Tensor>,
    ) -> Result<()> {
        self.compiled.set_with(name, read)
    }

    /// Weight (or optimizer state) `name`, assembled from the devices.
    pub fn get(&self, name: &str) -> Result<Tensor> {
        self.compiled.get(name)
    }

    /// Weight `name` assembled in the process that runs mesh position 0 alone
    /// ([`Compiled::get_first`]).
    pub fn get_first(&self, name: &str) -> Result<Option<Tensor>> {
        self.compiled.get_first(name)
    }

    /// The compiled program (its partitioned form, its collectives).
    pub fn compiled(&self) -> &Compiled<'_> {
        &self.compiled
    }

    /// The steps taken.
    pub fn steps(&self) -> usize {
        self.steps
    }

    /// Sets the steps taken (the optimizer's step count, which Adam's bias correction
    /// reads), for weights and state set from another run of the same steps — a
    /// pipeline's, say — before [`save_checkpoint`](Self::save_checkpoint).
    pub fn set_steps(&mut self, steps: usize) {
        self.steps = steps;
    }

    /// Puts the optimizer's state back to its initial value (zeros) and the step count
    /// to 0, as at compile time; the weights stay as they are.
    pub fn reset_optimizer(&mut self) -> Result<()> {
        let names: Vec<String> =
            self.step.program.params().iter().map(|p| p.name.clone()).collect();
        let states = self.step.init_state()?;
        let first = names.len() - 2 - states.len();
        for (t, name) in states.iter().zip(&names[first..]) {
            self.compiled.set(name, t)?;
        }
        self.steps = 0;
        Ok(())
    }

    /// One step on `batch` (the model program's untrained parameters, in order) at
    /// learning rate `lr`; returns the loss before the update. What the model program
    /// `emit`s (its metrics: `b.emit(&[loss, accuracy], id)`) streams through the
    /// strategy's outfeed ([`Strategy::with_metrics`](crate::Strategy::with_metrics))
    /// from mesh position 0, tagged with the step count.
    pub fn step(&mut self, batch: &[Tensor], lr: f64) -> Result<f64> {
        let mut feeds = batch.to_vec();
        feeds.extend(self.step.scalars(lr, self.steps)?);
        let out = self.compiled.step_tagged(&feeds, Some(self.steps as u64))?;
        self.steps += 1;
        Ok(out[0].to_f64()[0])
    }

    /// Several steps in one host call (TPUStrategy's `steps_per_execution`): step `i`
    /// on `batches[i]` at learning rate `lrs[i]`; returns each step's loss. The state
    /// changes only if every step succeeds on every device.
    pub fn run_steps(&mut self, batches: &[Vec<Tensor>], lrs: &[f64]) -> Result<Vec<f64>> {
        Ok(self.run_steps_measured(batches, lrs)?.into_iter().map(|(loss, _)| loss).collect())
    }

    /// [`run_steps`](Self::run_steps), with each step's gradient norm beside its loss
    /// when the step computes it ([`TrainStep::grad_norm`]).
    pub fn run_steps_measured(
        &mut self,
        batches: &[Vec<Tensor>],
        lrs: &[f64],
    ) -> Result<Vec<(f64, Option<f64>)>> {
        if batches.len() != lrs.len() {
            return Err(Error::Compiled {
                problem: format!("{} batches with {} learning rates", batches.len(), lrs.len()),
            });
        }
        let mut feeds = Vec::with_capacity(batches.len());
        for (i, (batch, &lr)) in batches.iter().zip(lrs).enumerate() {
            let mut f = batch.clone();
            f.extend(self.step.scalars(lr, self.steps + i)?);
            feeds.push(f);
        }
        let refs: Vec<&[Tensor]> = feeds.iter().map(Vec::as_slice).collect();
        let outs = self.compiled.steps_tagged(&refs, Some(self.steps as u64))?;
        self.steps += batches.len();
        let scalar = |t: Option<&Tensor>| t.map(|t| t.to_f64()[0]);
        let norm = |o: &[Tensor]| scalar(o.last()).filter(|_| self.step.grad_norm && o.len() > 1);
        Ok(outs.iter().map(|o| (o[0].to_f64()[0], norm(o))).collect())
    }
}
