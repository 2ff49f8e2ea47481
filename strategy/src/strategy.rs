//! The strategy: replicas on an executor runtime, the host side of reductions, and the
//! variables.

use std::cell::RefCell;
use std::sync::{Arc, Mutex, MutexGuard};

use meshwork_executor::{ReplicaError, Runtime, Tensor};
use meshwork_types::ReduceOp;

use crate::assignment::DeviceAssignment;
use crate::backend::{Backend, Interpreter};
use crate::context::{RunInfo, StrategyContext, VarMeta};
use crate::values::{Arg, PerReplica};
use crate::variable::{Aggregation, Layout, Synchronization, VarState, Variable, VariableOptions};
use crate::{Error, Result, ops};

/// A function run on every replica: its context and its arguments in, its outputs out.
pub type ReplicaFn = dyn Fn(&StrategyContext<'_>, &[Tensor]) -> Result<Vec<Tensor>> + Send + Sync;

/// `tf.distribute.TPUStrategy` for meshwork: replicas (each with its logical devices)
/// on an executor runtime, mirrored variables, and the host-side reductions.
///
/// A run is all or nothing: variable updates made during [`run`](Self::run) are kept
/// only if every replica succeeds (and, under aggregation NONE, agrees).
pub struct Strategy {
    runtime: Runtime,
    /// What runs partitioned and placed programs on the devices.
    backend: Arc<dyn Backend>,
    assignment: DeviceAssignment,
    vars: Mutex<Vec<VarState>>,
    /// The logical device variables are created on (`experimental_logical_device`).
    scope: Mutex<Vec<usize>>,
    metrics: Option<Arc<crate::metrics::Streams>>,
    /// The executor replicas (`replica * L + logical`) this process runs.
    local: std::ops::Range<usize>,
}

/// Marks a replica error the strategy keeps typed beside the executor's report.
#[derive(Debug)]
struct Stashed;

impl std::fmt::Display for Stashed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the replica's function failed")
    }
}

impl std::error::Error for Stashed {}

/// A replica's outputs of its logical device 0.
fn first_logical(mut per_logical: Vec<Vec<Tensor>>) -> Vec<Tensor> {
    per_logical.swap_remove(0)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Refuses, on every replica alike, a run after which a NONE-aggregated sync-on-write
/// variable's copies differ across replicas: the copies a device and its counterparts
/// on the other replicas hold are compared bit for bit (exactly: a hash could collide
/// and let a diverging update through; in one process in place, without copies), and
/// all get the same verdict.
fn check_mirrored(ctx: &StrategyContext<'_>) -> Result<()> {
    let watched: Vec<usize> = (0..ctx.run.vars.len())
        .filter(|&id| {
            let m = &ctx.run.vars[id];
            m.sync == Synchronization::OnWrite && m.aggregation == Aggregation::None
        })
        .collect();
    let replicas = ctx.num_replicas_in_sync();
    if watched.is_empty() || replicas == 1 {
        return Ok(());
    }
    for id in watched {
        // Lend the copy to the comparison and take it back after (no copy of it).
        let placeholder = Tensor::I32(ndarray::ArrayD::zeros(ndarray::IxDyn(&[0])));
        let copy = Arc::new(std::mem::replace(&mut ctx.vars.borrow_mut()[id], placeholder));
        let verdict = ctx.inner.first_difference_in(&ctx.run.across_replicas, copy.clone());
        ctx.vars.borrow_mut()[id] =
            Arc::try_unwrap(copy).unwrap_or_else(|shared| (*shared).clone());
        if let Some(r) = verdict? {
            return Err(Error::DivergingUpdate {
                variable: ctx.run.vars[id].name.clone(),
                replica: r,
                logical: ctx.logical,
            });
        }
    }
    Ok(())
}

impl Strategy {
    /// A strategy over `assignment`, with one executor device per device of its
    /// topology: replica `r`'s logical device `l` runs on the executor device (thread
    /// `meshwork-cpu:N`) that [`DeviceAssignment::device`] names.
    pub fn new(assignment: DeviceAssignment) -> Result<Strategy> {
        let devices = assignment.num_replicas() * assignment.num_logical_devices();
        Ok(Strategy {
            runtime: Runtime::new(assignment.num_devices().max(devices))?,
            backend: Arc::new(Interpreter::new()),
            assignment,
            vars: Mutex::new(Vec::new()),
            scope: Mutex::new(Vec::new()),
            metrics: None,
            local: 0..devices,
        })
    }

    /// `replicas` replicas of one logical device each.
    pub fn data_parallel(replicas: usize) -> Result<Strategy> {
        Strategy::new(DeviceAssignment::default_for(replicas)?)
    }

    /// Replaces the executor runtime (for a timeout, an outfeed sink, or an
    /// interconnect to other processes). It must run one replica per replica and
    /// logical device — across all its processes, each holding whole replicas. In one
    /// process, a runtime with a device per device of the topology runs each logical
    /// device on the device the assignment names, as [`Strategy::new`] does; a smaller
    /// one (or one spanning processes) runs executor replica `r * L + l` on its device
    /// `r * L + l`.
    ///
    /// With several processes every process builds the same strategy and makes the
    /// same calls (SPMD): `run`, `reduce`, `gather` and the datasets then work on this
    /// process's replicas ([`local_replicas`](Self::local_replicas)), and per-replica
    /// values hold only theirs; a checkpoint is written by process 0 alone.
    ///
    /// Call it before [`with_metrics`](Self::with_metrics), which attaches to the
    /// runtime in place.
    pub fn with_runtime(mut self, runtime: Runtime) -> Result<Strategy> {
        if self.metrics.is_some() {
            return Err(Error::Metrics {
                problem: "with_runtime after with_metrics would lose the metrics stream; \
                          call with_runtime first"
                    .into(),
            });
        }
        let logical = self.assignment.num_logical_devices();
        let want = self.assignment.num_replicas() * logical;
        if runtime.replicas() != want || !runtime.devices().is_multiple_of(logical) {
            return Err(meshwork_executor::Error::ReplicaCount {
                replicas: want,
                devices: runtime.replicas(),
            }
            .into());
        }
        let first = runtime.first_replica();
        self.local = first..first + runtime.devices();
        self.runtime = runtime;
        Ok(self)
    }

    /// The replicas this process runs (all of them in a one-process strategy).
    pub fn local_replicas(&self) -> std::ops::Range<usize> {
        let l = self.num_logical_devices();
        self.local.start / l..self.local.end / l
    }

    /// Whether other processes run some of the replicas.
    pub fn is_multi_process(&self) -> bool {
        self.local.len() != self.num_replicas_in_sync() * self.num_logical_devices()
    }

    /// Streams what replicas [`emit`](StrategyContext::emit) to `callback`, through
    /// the outfeed crate (one stream per device, records tagged with step and replica),
    /// for the consumers in `consumers`.
    pub fn with_metrics(
        self,
        consumers: &[crate::MetricSpec],
        callback: Arc<crate::MetricCallback>,
    ) -> Result<Strategy> {
        let streams = Arc::new(crate::metrics::Streams::start(
            self.local.clone(),
            self.num_logical_devices(),
            consumers,
            callback,
        )?);
        let sink = Arc::new(crate::metrics::Sink(streams.clone()));
        Ok(Strategy { runtime: self.runtime.with_sink(sink), metrics: Some(streams), ..self })
    }

    /// Waits (up to `timeout`) until every metrics record emitted so far has reached
    /// the callback.
    pub fn flush_metrics(&self, timeout: std::time::Duration) -> Result<()> {
        match &self.metrics {
            Some(m) => m.flush(timeout),
            None => Ok(()),
        }
    }

    /// Whether records of `specs` emitted to `consumer` have somewhere to go: a
    /// metrics stream ([`with_metrics`](Self::with_metrics)) whose consumer takes them.
    pub(crate) fn takes_metrics(
        &self,
        consumer: u32,
        specs: &[meshwork_types::TensorSpec],
    ) -> Result<()> {
        match &self.metrics {
            Some(m) => m.takes(consumer, specs),
            None => Err(Error::Metrics {
                problem: "a program emits, and the strategy streams no metrics (with_metrics)"
                    .into(),
            }),
        }
    }

    /// Streams `values`, emitted by a program a back end ran on executor replica
    /// `replica` at step `step`, to the metrics callback (what
    /// [`StrategyContext::emit`] does on the interpreter's devices).
    pub(crate) fn host_emit(
        &self,
        replica: usize,
        consumer: u32,
        step: u64,
        values: Vec<Tensor>,
    ) -> Result<()> {
        use meshwork_executor::OutfeedSink;
        let streams = self.metrics.clone().ok_or_else(|| Error::Metrics {
            problem: "a program emits, and the strategy streams no metrics".into(),
        })?;
        let mut tensors = Vec::with_capacity(values.len() + 1);
        tensors.push(Tensor::I64(ndarray::arr0(step as i64).into_dyn()));
        tensors.extend(values);
        crate::metrics::Sink(streams)
            .emit(replica, consumer, &tensors)
            .map_err(|e| Error::Metrics { problem: format!("consumer {consumer}: {e}") })
    }

    /// The executor runtime the strategy runs on: its devices, their buffer pools,
    /// its timeout and interconnect.
    pub fn runtime(&self) -> &Runtime {
        &self.runtime
    }

    /// Runs partitioned and placed programs ([`compile`](Self::compile),
    /// [`place`](Self::place)) on `backend` instead of the [`Interpreter`].
    pub fn with_backend(self, backend: Arc<dyn Backend>) -> Strategy {
        Strategy { backend, ..self }
    }

    /// What runs partitioned and placed programs on the devices.
    pub fn backend(&self) -> &dyn Backend {
        &*self.backend
    }

    /// The device assignment.
    pub fn assignment(&self) -> &DeviceAssignment {
        &self.assignment
    }

    /// Replicas in sync.
    pub fn num_replicas_in_sync(&self) -> usize {
        self.assignment.num_replicas()
    }

    /// Logical devices per replica.
    pub fn num_logical_devices(&self) -> usize {
        self.assignment.num_logical_devices()
    }

    /// Runs `f` with variables created on logical device `id`
    /// (`extended.experimental_logical_device`; the seed's range check and wording).
    pub fn logical_device_scope<T>(&self, id: usize, f: impl FnOnce(&Strategy) -> T) -> Result<T> {
        let logical = self.num_logical_devices();
        if id >= logical {
            return Err(Error::LogicalDeviceScope { id, logical_devices: logical });
        }
        lock(&self.scope).push(id);
        let out = f(self);
        lock(&self.scope).pop();
        Ok(out)
    }

    /// Creates a variable from `initial` (computed once, by the caller, and copied to
    /// every replica), laid out as `options` say.
    pub fn create_variable(
        &self,
        name: &str,
        initial: Tensor,
        options: VariableOptions,
    ) -> Result<Variable> {
        let mut options = options;
        if options.layout == Layout::Replicated
            && let Some(&id) = lock(&self.scope).last()
        {
            options.layout = Layout::OnDevice(id);
        }
        let mut vars = lock(&self.vars);
        if vars.iter().any(|v| v.name == name) {
            return Err(Error::Variable {
                variable: name.into(),
                problem: "a variable of this name exists".into(),
            });
        }
        let state = VarState::new(
            name,
            &options,
            initial,
            self.num_replicas_in_sync(),
            self.num_logical_devices(),
        )?;
        vars.push(state);
        Ok(Variable { id: vars.len() - 1, name: name.into() })
    }

    pub(crate) fn with_var<T>(
        &self,
        v: &Variable,
        f: impl FnOnce(&mut VarState) -> Result<T>,
    ) -> Result<T> {
        let mut vars = lock(&self.vars);
        let state =
            vars.get_mut(v.id).filter(|s| s.name == v.name).ok_or_else(|| Error::Variable {
                variable: v.name.clone(),
                problem: "not a variable of this strategy".into(),
            })?;
        f(state)
    }

    /// The variables, in creation order.
    pub fn variables(&self) -> Vec<Variable> {
        lock(&self.vars)
            .iter()
            .enumerate()
            .map(|(id, v)| Variable { id, name: v.name.clone() })
            .collect()
    }

    pub(crate) fn states(&self) -> MutexGuard<'_, Vec<VarState>> {
        lock(&self.vars)
    }

    /// The variable's value in cross-replica context: the whole (assembled) value of a
    /// sync-on-write variable; for sync-on-read, its replicas' copies aggregated (SUM,
    /// MEAN) or replica 0's (ONLY_FIRST_REPLICA).
    pub fn read_variable(&self, v: &Variable) -> Result<Tensor> {
        let multi = self.is_multi_process();
        self.with_var(v, |s| {
            if multi && s.sync == Synchronization::OnRead {
                return Err(Error::Variable {
                    variable: s.name.clone(),
                    problem:
                        "is synchronised on read and other processes hold some of its copies; \
                              aggregate it inside a run (all_reduce) instead"
                            .into(),
                });
            }
            s.read()
        })
    }

    /// Every replica's whole copy of `v`.
    pub fn local_variable_values(&self, v: &Variable) -> Result<PerReplica<Tensor>> {
        let local = self.local_replicas();
        self.with_var(v, |s| {
            local.map(|r| s.value_of(r)).collect::<Result<Vec<_>>>().map(PerReplica::new)
        })
    }

    /// Assigns `value` in cross-replica context: every copy becomes `value`, except a
    /// SUM sync-on-read variable, whose copies become `value / replicas` so that its
    /// read (the sum) is `value`.
    pub fn assign_variable(&self, v: &Variable, value: &Tensor) -> Result<()> {
        let n = self.num_replicas_in_sync();
        self.with_var(v, |s| {
            if s.sync == Synchronization::OnRead && s.aggregation == Aggregation::Sum {
                s.check(value)?;
                s.set_all(&ops::divide(value, n as f64)?)
            } else {
                s.set_all(value)
            }
        })
    }

    /// Adds `delta` in cross-replica context (refused for SUM sync-on-read variables,
    /// as in TF).
    pub fn assign_add_variable(&self, v: &Variable, delta: &Tensor) -> Result<()> {
        self.with_var(v, |s| {
            if s.sync == Synchronization::OnRead && s.aggregation == Aggregation::Sum {
                return Err(Error::SyncOnReadAssignAdd { variable: s.name.clone() });
            }
            let value = ops::add(&s.read()?, delta)?;
            s.set_all(&value)
        })
    }

    /// The seed's `TPUReshardVariables`: moves `vars` to `format`. Nothing happens when
    /// the variables are in the default format and `format` is the default, or when
    /// they are already in a format with `format`'s key; otherwise each variable is
    /// unsharded from its current (non-default) format, then sharded into the new
    /// (non-default) one, through the sharding crate's plans, and only then is its
    /// format recorded. All or nothing: if any variable cannot move, none does.
    /// Returns whether anything moved.
    pub fn reshard_variables(&self, vars: &[Variable], format: &crate::Format) -> Result<bool> {
        let key = match format {
            crate::Format::Default => None,
            crate::Format::Sharded { key, .. } if key.is_empty() => {
                return Err(Error::Variable {
                    variable: vars.first().map(|v| v.name.clone()).unwrap_or_default(),
                    problem: "a format key must not be empty".into(),
                });
            }
            crate::Format::Sharded { key, .. } => Some(key.clone()),
        };
        let logical = self.num_logical_devices();
        let mut all = lock(&self.vars);
        let mut moved = Vec::new();
        for v in vars {
            let s = all.get(v.id).filter(|s| s.name == v.name).ok_or_else(|| Error::Variable {
                variable: v.name.clone(),
                problem: "not a variable of this strategy".into(),
            })?;
            if s.format == key {
                continue;
            }
            let mut next = s.clone();
            if next.format.is_some() {
                next.relayout(crate::variable::layout_sharding(
                    &Layout::Replicated,
                    &next.shape,
                    logical,
                )?)?;
            }
            if let crate::Format::Sharded { layout, .. } = format {
                next.relayout(crate::variable::layout_sharding(layout, &next.shape, logical)?)?;
            }
            next.format = key.clone();
            moved.push((v.id, next));
        }
        let changed = !moved.is_empty();
        for (id, next) in moved {
            all[id] = next;
        }
        Ok(changed)
    }

    /// The format key of `v`'s current layout (`None` for the default).
    pub fn variable_format(&self, v: &Variable) -> Result<Option<String>> {
        self.with_var(v, |s| Ok(s.format.clone()))
    }

    /// Runs `f` once per replica (and logical device), each with its replica's
    /// arguments; returns every replica's outputs (those of its logical device 0).
    ///
    /// If any replica fails, `run` returns that replica's error and no variable
    /// changes; the strategy stays usable.
    pub fn run(
        &self,
        f: impl Fn(&StrategyContext<'_>, &[Tensor]) -> Result<Vec<Tensor>> + Send + Sync + 'static,
        args: &[Arg],
    ) -> Result<PerReplica<Vec<Tensor>>> {
        self.run_logical(f, args).map(|all| all.map(first_logical))
    }

    /// [`run`](Self::run), returning the outputs of every logical device of every
    /// replica (`values()[r][l]`). `run` returns each replica's logical device 0
    /// outputs: TF's rule, where a model-parallel replica's outputs are its
    /// computation's, which the function gathers or reduces onto every logical device
    /// (as `all_reduce_logical` and `all_gather_logical` do) — this shows them all.
    pub fn run_logical(
        &self,
        f: impl Fn(&StrategyContext<'_>, &[Tensor]) -> Result<Vec<Tensor>> + Send + Sync + 'static,
        args: &[Arg],
    ) -> Result<PerReplica<Vec<Vec<Tensor>>>> {
        let f: Arc<ReplicaFn> = Arc::new(f);
        let steps = vec![args.to_vec()];
        self.run_inner(f, &steps).map(|mut last| last.pop().expect("one step"))
    }

    /// `steps_per_run`: runs `f` for `steps.len()` steps in one host call, step `s`
    /// with arguments `steps[s]` ([`StrategyContext::step`] tells which), and returns
    /// the last step's outputs per replica.
    pub fn run_steps(
        &self,
        f: impl Fn(&StrategyContext<'_>, &[Tensor]) -> Result<Vec<Tensor>> + Send + Sync + 'static,
        steps: &[Vec<Arg>],
    ) -> Result<PerReplica<Vec<Tensor>>> {
        if steps.is_empty() {
            return Err(Error::Empty { what: "run_steps" });
        }
        let f: Arc<ReplicaFn> = Arc::new(f);
        self.run_inner(f, steps).map(|mut last| last.pop().expect("one step").map(first_logical))
    }

    /// [`run_steps`](Self::run_steps), with the last step's outputs reduced across
    /// replicas by `op` (`None` along no axis).
    pub fn run_steps_reduced(
        &self,
        f: impl Fn(&StrategyContext<'_>, &[Tensor]) -> Result<Vec<Tensor>> + Send + Sync + 'static,
        steps: &[Vec<Arg>],
        op: ReduceOp,
    ) -> Result<Vec<Tensor>> {
        let last = self.run_steps(f, steps)?;
        let outputs = last.values().first().map_or(0, Vec::len);
        (0..outputs)
            .map(|k| {
                let values = PerReplica::new(last.values().iter().map(|o| o[k].clone()).collect());
                self.reduce(op, &values, None)
            })
            .collect()
    }

    fn run_inner(
        &self,
        f: Arc<ReplicaFn>,
        steps: &[Vec<Arg>],
    ) -> Result<Vec<PerReplica<Vec<Vec<Tensor>>>>> {
        let logical = self.num_logical_devices();
        let local = self.local_replicas();
        for args in steps {
            for a in args {
                if let Arg::PerReplica(p) = a
                    && p.len() != local.len()
                {
                    return Err(Error::PerReplicaCount {
                        what: "run argument",
                        expected: local.len(),
                        actual: p.len(),
                    });
                }
            }
        }
        // The variables' working copies, per local device.
        let (metas, copies): (Vec<VarMeta>, Vec<Vec<Tensor>>) = {
            let vars = lock(&self.vars);
            let metas = vars
                .iter()
                .map(|s| VarMeta {
                    name: s.name.clone(),
                    sync: s.sync,
                    aggregation: s.aggregation,
                    dtype: s.dtype,
                    shard_shapes: (0..logical)
                        .map(|l| s.shard_of(l).map(|k| s.values[0][k].shape().to_vec()))
                        .collect(),
                })
                .collect();
            let copies = self
                .local
                .clone()
                .map(|e| {
                    let (r, l) = (e / logical, e % logical);
                    vars.iter()
                        .map(|s| match s.shard_of(l) {
                            Some(k) => s.values[r][k].clone(),
                            None => Tensor::I32(ndarray::ArrayD::zeros(ndarray::IxDyn(&[0]))),
                        })
                        .collect()
                })
                .collect();
            (metas, copies)
        };
        let nvars = metas.len();
        let info = Arc::new(RunInfo::new(self.assignment.clone(), metas)?);
        let per_step: Vec<usize> = steps.iter().map(Vec::len).collect();
        let inputs: Vec<Vec<Tensor>> = copies
            .into_iter()
            .zip(self.local.clone())
            .map(|(vars, e)| {
                let k = e / logical - local.start;
                let mut input: Vec<Tensor> = steps
                    .iter()
                    .flat_map(|args| args.iter().map(|a| a.for_replica(k).clone()))
                    .collect();
                input.extend(vars);
                input
            })
            .collect();
        let stash: Arc<Mutex<Vec<(usize, Error)>>> = Arc::default();
        let program: Arc<meshwork_executor::ReplicaFn> = {
            let (info, stash) = (info.clone(), stash.clone());
            Arc::new(move |ectx, inputs| {
                let e = ectx.replica_id();
                let (r, l) = (e / logical, e % logical);
                let total_args: usize = per_step.iter().sum();
                let (args, vars) = inputs.split_at(total_args);
                let mut ctx = StrategyContext {
                    inner: ectx,
                    run: &info,
                    replica: r,
                    logical: l,
                    step: 0,
                    vars: RefCell::new(vars.to_vec()),
                };
                let fail = |err: Error| -> ReplicaError {
                    match err {
                        Error::Executor(err) => Box::new(err),
                        err => {
                            lock(&stash).push((e, err));
                            Box::new(Stashed)
                        }
                    }
                };
                let mut outputs = Vec::new();
                let mut at = 0;
                for (s, &n) in per_step.iter().enumerate() {
                    ctx.step = s;
                    outputs.push(f(&ctx, &args[at..at + n]).map_err(fail)?);
                    at += n;
                }
                check_mirrored(&ctx).map_err(fail)?;
                // Outputs of every step, then the variables, then each step's count.
                let counts: Vec<i64> = outputs.iter().map(|o| o.len() as i64).collect();
                let mut flat: Vec<Tensor> = outputs.into_iter().flatten().collect();
                flat.extend(ctx.vars.into_inner());
                flat.push(Tensor::I64(ndarray::Array1::from(counts).into_dyn()));
                Ok(flat)
            })
        };
        // Each replica's logical device on the device the assignment names; a runtime
        // given by `with_runtime` (or one spanning processes) runs executor replica
        // `r * L + l` on its device `r * L + l` of this process.
        let placement: Vec<usize> = if !self.is_multi_process()
            && self.runtime.devices() >= self.assignment.num_devices()
        {
            self.local
                .clone()
                .map(|e| self.assignment.device(e / logical, e % logical).0 as usize)
                .collect()
        } else {
            (0..self.local.len()).collect()
        };
        let outputs = match self.runtime.run_on(program, inputs, &placement) {
            Ok(o) => o,
            Err(err) => {
                let failed = match &err {
                    meshwork_executor::Error::ReplicaFailed { replica, .. } => Some(*replica),
                    _ => None,
                };
                let mut stash = lock(&stash);
                if let Some(i) = stash.iter().position(|(e, _)| Some(*e) == failed) {
                    return Err(stash.swap_remove(i).1);
                }
                stash.sort_by_key(|(e, _)| *e);
                if let Some((_, first)) = stash.drain(..).next() {
                    return Err(first);
                }
                return Err(err.into());
            }
        };
        // Split each device's outputs into steps, variables.
        let mut steps_out: Vec<Vec<Vec<Vec<Tensor>>>> = vec![Vec::new(); steps.len()];
        let mut new_vars: Vec<Vec<Tensor>> = Vec::with_capacity(outputs.len());
        for (e, mut out) in self.local.clone().zip(outputs) {
            let counts: Vec<usize> = match out.pop() {
                Some(Tensor::I64(c)) => c.iter().map(|&x| x as usize).collect(),
                _ => unreachable!("the program ends its outputs with the step counts"),
            };
            let vars = out.split_off(out.len() - nvars);
            new_vars.push(vars);
            let mut rest = out.into_iter();
            for (s, &n) in counts.iter().enumerate() {
                if e % logical == 0 {
                    steps_out[s].push(Vec::with_capacity(logical));
                }
                let replica = steps_out[s].last_mut().expect("logical device 0 comes first");
                replica.push(rest.by_ref().take(n).collect());
            }
        }
        self.commit(new_vars);
        Ok(steps_out.into_iter().map(PerReplica::new).collect())
    }

    /// Keeps a successful run's variable copies (the program has checked that the
    /// mirrored ones agree across replicas). A sync-on-write variable's copy is the same
    /// on every replica, so it is kept for the replicas of other processes too.
    fn commit(&self, new_vars: Vec<Vec<Tensor>>) {
        let (replicas, logical) = (self.num_replicas_in_sync(), self.num_logical_devices());
        let mut vars = lock(&self.vars);
        for (e, copies) in self.local.clone().zip(new_vars) {
            let (r, l) = (e / logical, e % logical);
            for (s, copy) in vars.iter_mut().zip(copies) {
                if let Some(k) = s.shard_of(l) {
                    if s.sync == Synchronization::OnWrite && r == self.local.start / logical {
                        for q in (0..replicas).filter(|q| {
                            !(self.local.start / logical..self.local.end / logical).contains(q)
                        }) {
                            s.values[q][k] = copy.clone();
                        }
                    }
                    s.values[r][k] = copy;
                }
            }
        }
    }

    /// Reduces a per-replica value in cross-replica context. With `axis`, each
    /// replica's value is first reduced along it, and MEAN divides the sum by the
    /// total count along the axis (so replicas with different row counts weigh by
    /// their rows, as TF does); without, values combine element-wise.
    pub fn reduce(
        &self,
        op: ReduceOp,
        value: &PerReplica<Tensor>,
        axis: Option<usize>,
    ) -> Result<Tensor> {
        if self.is_multi_process() {
            return self.reduce_across(op, value, axis);
        }
        let values = value.values();
        if values.is_empty() {
            return Err(Error::Empty { what: "reduce" });
        }
        let Some(axis) = axis else {
            let refs: Vec<&Tensor> = values.iter().collect();
            return fold(op, &refs, values.len());
        };
        if let Some(v) = values.iter().find(|v| axis >= v.shape().len()) {
            return Err(Error::AxisOutOfRange { axis, rank: v.shape().len() });
        }
        match op {
            ReduceOp::Sum | ReduceOp::Mean => {
                let sums: Vec<Tensor> = values.iter().map(|v| ops::sum_axis(v, axis)).collect();
                let refs: Vec<&Tensor> = sums.iter().collect();
                let total = fold(ReduceOp::Sum, &refs, 1)?;
                let count: usize = values.iter().map(|v| v.shape()[axis]).sum();
                if op == ReduceOp::Mean { ops::divide(&total, count as f64) } else { Ok(total) }
            }
            ReduceOp::Min | ReduceOp::Max => extreme(op, &self.gather(value, axis)?, axis),
        }
    }

    /// Distributes an iterator of global batches (each a list of tensors with the batch
    /// along axis 0): every batch is split by rows over the replicas. The first
    /// batch's size must divide by the replicas (TF's error otherwise); a smaller final
    /// batch is dropped or served ragged, as `remainder` says.
    pub fn distribute_dataset<I: IntoIterator<Item = Vec<Tensor>>>(
        &self,
        batches: I,
        remainder: crate::Remainder,
    ) -> crate::DistributedDataset<I::IntoIter> {
        crate::DistributedDataset::new(
            batches.into_iter(),
            self.num_replicas_in_sync(),
            self.local_replicas(),
            remainder,
        )
    }

    /// One input pipeline per host: `f` is called once per host with its
    /// [`InputContext`](crate::InputContext) and returns that host's batches, which are
    /// split over the host's replicas.
    pub fn distribute_datasets_from_function(
        &self,
        f: &crate::dataset::PipelineFn,
        remainder: crate::Remainder,
    ) -> crate::PerHostDataset {
        let hosts = self.assignment.replicas_by_host();
        let local = self.local_replicas();
        let pipelines = hosts
            .iter()
            .enumerate()
            .filter(|(_, (_, replicas))| replicas.iter().any(|r| local.contains(r)))
            .map(|(id, (_, replicas))| {
                let ctx = crate::InputContext {
                    num_input_pipelines: hosts.len(),
                    input_pipeline_id: id,
                    num_replicas_in_sync: self.num_replicas_in_sync(),
                };
                (replicas.clone(), f(&ctx))
            })
            .collect();
        crate::PerHostDataset::new(pipelines, self.num_replicas_in_sync(), local, remainder)
    }

    /// Concatenates a per-replica value along `axis` in replica order (shapes may
    /// differ only along `axis`).
    pub fn gather(&self, value: &PerReplica<Tensor>, axis: usize) -> Result<Tensor> {
        if self.is_multi_process() {
            // Every process's replicas gather together (shapes must then agree).
            let out = self.run(
                move |ctx, a| {
                    if a[0].shape().is_empty() {
                        return Err(Error::GatherScalar);
                    }
                    if axis >= a[0].shape().len() {
                        return Err(Error::AxisOutOfRange { axis, rank: a[0].shape().len() });
                    }
                    Ok(vec![ctx.all_gather(a[0].clone(), axis)?])
                },
                &[Arg::PerReplica(value.clone())],
            )?;
            return Ok(out.values()[0][0].clone());
        }
        let refs: Vec<&Tensor> = value.values().iter().collect();
        let first = refs.first().ok_or(Error::Empty { what: "gather" })?;
        if first.shape().is_empty() {
            return Err(Error::GatherScalar);
        }
        ops::concat("gather", &refs, axis)
    }
}

impl Strategy {
    /// `reduce` when other processes hold some replicas: the replicas reduce together.
    fn reduce_across(
        &self,
        op: ReduceOp,
        value: &PerReplica<Tensor>,
        axis: Option<usize>,
    ) -> Result<Tensor> {
        let out = self.run(
            move |ctx, a| {
                let t = a[0].clone();
                let Some(axis) = axis else {
                    return Ok(vec![ctx.all_reduce(op, t)?]);
                };
                if axis >= t.shape().len() {
                    return Err(Error::AxisOutOfRange { axis, rank: t.shape().len() });
                }
                match op {
                    ReduceOp::Sum | ReduceOp::Mean => {
                        let rows = t.shape()[axis] as f64;
                        let total = ctx.all_reduce(ReduceOp::Sum, ops::sum_axis(&t, axis))?;
                        if op == ReduceOp::Sum {
                            return Ok(vec![total]);
                        }
                        let count = ctx.all_reduce(
                            ReduceOp::Sum,
                            Tensor::F64(ndarray::arr0(rows).into_dyn()),
                        )?;
                        let Tensor::F64(count) = count else { unreachable!("an f64 sum") };
                        Ok(vec![ops::divide(&total, count.iter().next().copied().unwrap_or(1.0))?])
                    }
                    ReduceOp::Min | ReduceOp::Max => {
                        let local = extreme(op, &t, axis)?;
                        Ok(vec![ctx.all_reduce(op, local)?])
                    }
                }
            },
            &[Arg::PerReplica(value.clone())],
        )?;
        Ok(out.values()[0][0].clone())
    }

    /// Whether every process says `ok` (each says its own; one collective, so every
    /// process gets the same answer): how a step that can fail in one process alone
    /// (a write, an upload) ends alike everywhere.
    pub(crate) fn all_agree(&self, ok: bool) -> Result<bool> {
        let failed = Tensor::I32(ndarray::arr0(i32::from(!ok)).into_dyn());
        let out =
            self.run(move |ctx, _| Ok(vec![ctx.all_reduce(ReduceOp::Max, failed.clone())?]), &[])?;
        let any_failed = out.values().first().and_then(|o| o.first()).map(|t| t.to_f64());
        Ok(any_failed.is_some_and(|v| v.iter().all(|&x| x == 0.0)))
    }

    /// Every process's `mine`, in process order: one collective (two gathers: the
    /// lengths, then the bytes padded to the longest), so every process gets the same
    /// lists. For what processes must tell each other between steps (the parts of a
    /// checkpoint each wrote, a failure's message); not for tensors.
    pub(crate) fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let runtime = self.runtime();
        let processes = (runtime.replicas() / runtime.devices().max(1)).max(1);
        let bytes: Vec<i32> = mine.iter().map(|&b| i32::from(b)).collect();
        let out = self.run(
            move |ctx, _| {
                let len = Tensor::I64(ndarray::arr1(&[bytes.len() as i64]).into_dyn());
                let lens = ctx.all_gather(len, 0)?;
                let longest = lens.to_f64().iter().fold(0.0f64, |m, &x| m.max(x)) as usize;
                let mut padded = bytes.clone();
                padded.resize(longest, 0);
                let row = ndarray::Array2::from_shape_vec((1, longest), padded)
                    .map_err(|e| Error::Compiled { problem: e.to_string() })?;
                let all = ctx.all_gather(Tensor::I32(row.into_dyn()), 0)?;
                Ok(vec![lens, all])
            },
            &[],
        )?;
        let got = out.values().first().cloned().unwrap_or_default();
        let (Some(Tensor::I64(lens)), Some(Tensor::I32(all))) = (got.first(), got.get(1)) else {
            return Err(Error::Compiled { problem: "a gather of bytes returned nothing".into() });
        };
        let rows = lens.len();
        let per = (rows / processes).max(1);
        let all = all.view().into_shape_with_order((rows, all.len() / rows.max(1)));
        let all = all.map_err(|e| Error::Compiled { problem: e.to_string() })?;
        Ok((0..processes)
            .map(|q| {
                let row = q * per;
                let n = lens.iter().nth(row).and_then(|&n| usize::try_from(n).ok()).unwrap_or(0);
                all.row(row).iter().take(n).map(|&b| b as u8).collect()
            })
            .collect())
    }

    /// Waits until every process reaches this point.
    pub(crate) fn sync(&self) -> Result<()> {
        self.run(
            |ctx, _| {
                Ok(vec![ctx.all_reduce(ReduceOp::Sum, Tensor::I32(ndarray::arr0(0).into_dyn()))?])
            },
            &[],
        )
        .map(|_| ())
    }
}

/// The minimum or maximum of `t` along `axis` (which must not be empty).
fn extreme(op: ReduceOp, t: &Tensor, axis: usize) -> Result<Tensor> {
    if t.shape()[axis] == 0 {
        return Err(Error::Empty { what: "a minimum or maximum over an empty axis" });
    }
    Ok(ops::map!(t, a => if op == ReduceOp::Min {
        a.map_axis(ndarray::Axis(axis), |l| l.iter().copied().fold(l[0], |m, x| if x < m { x } else { m }))
    } else {
        a.map_axis(ndarray::Axis(axis), |l| l.iter().copied().fold(l[0], |m, x| if x > m { x } else { m }))
    }))
}

/// Folds `values` element-wise in order; MEAN divides by `n`.
fn fold(op: ReduceOp, values: &[&Tensor], n: usize) -> Result<Tensor> {
    let mut acc = values[0].clone();
    for v in &values[1..] {
        acc = match op {
            ReduceOp::Sum | ReduceOp::Mean => ops::add(&acc, v)?,
            ReduceOp::Min | ReduceOp::Max => {
                if acc.shape() != v.shape() {
                    return Err(Error::ShapeMismatch {
                        what: "reduce",
                        expected: acc.shape().to_vec(),
                        actual: v.shape().to_vec(),
                        axis: None,
                    });
                }
                let min = op == ReduceOp::Min;
                ops::zip!(&acc, *v, a, b => ndarray::Zip::from(a).and(b).map_collect(|&x, &y| if (y < x) == min && y != x { y } else { x }), Error::DTypeMismatch { what: "reduce", expected: acc.dtype(), actual: v.dtype() })?
            }
        };
    }
    if op == ReduceOp::Mean { ops::divide(&acc, n as f64) } else { Ok(acc) }
}
