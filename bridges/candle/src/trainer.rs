//! The trainer: a candle model and optimizer on every replica, data parallel (DDP) or
//! with parameters and optimizer state sharded (FSDP).

use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Optimizer, VarBuilder};
use meshwork_executor::{ReplicaContext, ReplicaError, ReplicaFn, Runtime, Tensor as ExecTensor};
use meshwork_sharding::{HloSharding, Mesh, Mode, NamedSharding, Sharding};
use meshwork_types::ReduceOp;
use ndarray::{ArrayD, ArrayViewD, IxDyn};

use crate::bucket::{self, Bucket, Kind};
use crate::optim::Stateful;
use crate::params::{self, Elem, Param, Recorder, Served};
use crate::{Error, Result};

/// The devices a trainer runs on: a meshwork runtime, one replica per device — in this
/// process, or across processes when the runtime has an interconnect (MPI).
#[derive(Clone)]
pub struct Devices {
    runtime: Arc<Runtime>,
}

impl Devices {
    /// `n` CPU devices in this process, each a worker thread. A collective waits at
    /// most the runtime's timeout (60 s) for a slow replica; for longer steps build the
    /// runtime yourself: `Devices::from_runtime(Runtime::new(n)?.with_timeout(..))`.
    pub fn cpu(n: usize) -> Result<Devices> {
        Ok(Devices { runtime: Arc::new(Runtime::new(n)?) })
    }

    /// The devices of `runtime`: with an interconnect (`meshwork_executor::mpi::Mpi`),
    /// every process's devices, replica ids running over all of them.
    pub fn from_runtime(runtime: Runtime) -> Devices {
        Devices { runtime: Arc::new(runtime) }
    }

    /// Replicas in a step: devices in every process.
    pub fn replicas(&self) -> usize {
        self.runtime.replicas()
    }

    /// The global id of this process's first replica.
    pub fn first_replica(&self) -> usize {
        self.runtime.first_replica()
    }

    /// This process's devices.
    pub fn local(&self) -> usize {
        self.runtime.devices()
    }

    /// Runs `program` once per local replica; returns local replica 0's outputs.
    fn run(&self, program: Arc<ReplicaFn>) -> Result<Vec<ExecTensor>> {
        let mut out = self.runtime.run(program, vec![Vec::new(); self.local()])?;
        Ok(out.swap_remove(0))
    }
}

/// How a trainer spreads the model over its replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parallel {
    /// PyTorch's DDP: every replica holds the whole model and optimizer; gradients are
    /// all-reduced (averaged) in buckets.
    Ddp,
    /// PyTorch's FSDP (ZeRO-3): every replica holds one shard of each parameter and of
    /// its optimizer state; a step all-gathers the parameters, runs the forward and
    /// backward, reduce-scatters the gradients, and steps each shard.
    Fsdp,
}

/// A trainer's settings.
#[derive(Debug, Clone)]
pub struct Config {
    /// DDP or FSDP.
    pub parallel: Parallel,
    /// The largest fused buffer of one collective, in bytes (DDP's `bucket_cap_mb`;
    /// default 25 MiB). A parameter larger than this travels alone.
    pub bucket_bytes: usize,
    /// The parameters' dtype (`F32` or `F64`; default `F32`).
    pub dtype: DType,
    /// FSDP: the dim each parameter is split along (default 0), by name. Shards may be
    /// uneven (XLA's padded layout: `⌈d/N⌉` rows each, the trailing ones short or
    /// empty).
    pub shard_dims: HashMap<String, usize>,
}

impl Config {
    /// DDP with the defaults.
    pub fn ddp() -> Config {
        Config {
            parallel: Parallel::Ddp,
            bucket_bytes: 25 << 20,
            dtype: DType::F32,
            shard_dims: HashMap::new(),
        }
    }

    /// FSDP with the defaults.
    pub fn fsdp() -> Config {
        Config { parallel: Parallel::Fsdp, ..Config::ddp() }
    }

    /// With parameters of `dtype`.
    pub fn with_dtype(mut self, dtype: DType) -> Config {
        self.dtype = dtype;
        self
    }

    /// With buckets of at most `bytes`.
    pub fn with_bucket_bytes(mut self, bytes: usize) -> Config {
        self.bucket_bytes = bytes;
        self
    }

    /// FSDP: parameter `name` split along `dim`.
    pub fn with_shard_dim(mut self, name: &str, dim: usize) -> Config {
        self.shard_dims.insert(name.to_string(), dim);
        self
    }
}

/// What [`Trainer::gathered`] takes from a replica: one tensor per parameter.
type Pick<M, O> = dyn Fn(&Replica<M, O>) -> Vec<Option<Tensor>> + Send + Sync;

/// A model builder: what `candle_nn` models are made with.
pub type Build<M> = dyn Fn(VarBuilder<'_>) -> candle_core::Result<M> + Send + Sync;

/// How an FSDP parameter is split.
struct ShardPlan {
    sharding: Sharding,
    /// Each replica's region, in replica order.
    regions: Vec<Vec<Range<usize>>>,
    /// The elements of the largest region: each replica's slot in a fused buffer.
    seg: usize,
}

impl ShardPlan {
    fn new(p: &Param, dim: usize, n: usize) -> Result<ShardPlan> {
        let rank = p.shape.len();
        let bad = |problem: String| Error::Shard {
            name: p.name.clone(),
            shape: p.shape.clone(),
            problem,
        };
        if dim >= rank {
            return Err(bad(format!(
                "no dim {dim} to shard along (FSDP shards a dim of every parameter; a scalar cannot be)"
            )));
        }
        let spec: Vec<&str> = (0..rank).map(|d| if d == dim { "'fsdp'" } else { "None" }).collect();
        let spec = format!("P({})", spec.join(", "));
        let named = NamedSharding::new(Mesh::iota(&[("fsdp", n)])?, spec.parse()?)?;
        let sharding = named.to_sharding(rank)?;
        let regions: Vec<Vec<Range<usize>>> =
            sharding.index_map(&p.shape, Mode::Uneven)?.into_iter().map(|e| e.ranges).collect();
        let seg = regions.iter().map(|r| elems(r)).max().unwrap_or(0);
        Ok(ShardPlan { sharding, regions, seg })
    }
}

fn elems(region: &[Range<usize>]) -> usize {
    region.iter().map(|r| r.len()).product()
}

fn extent(region: &[Range<usize>]) -> Vec<usize> {
    region.iter().map(|r| r.len()).collect()
}

/// What every replica shares.
struct Shared<M> {
    parallel: Parallel,
    params: Vec<Param>,
    /// FSDP: each parameter's split.
    plans: Vec<ShardPlan>,
    /// The gradient exchange's buckets (reverse parameter order).
    grads: Vec<Bucket>,
    /// FSDP: the parameter gather's buckets.
    gathers: Vec<Bucket>,
    build: Arc<Build<M>>,
    dtype: DType,
    replicas: usize,
    first: usize,
    /// FSDP units: each unit's parameters, gathered and reduce-scattered on their own.
    units: Option<UnitPlan>,
}

/// A model given as units run in sequence (see [`Trainer::units`]).
struct UnitPlan {
    build: Arc<UnitBuild>,
    /// Each unit's parameter indices.
    params: Vec<Range<usize>>,
    /// Each unit's gather buckets (forward order) and gradient buckets (reverse).
    gathers: Vec<Vec<Bucket>>,
    grads: Vec<Vec<Bucket>>,
}

/// Builds unit `k` of a sequence of units.
pub type UnitBuild = dyn Fn(usize, VarBuilder<'_>) -> candle_core::Result<Box<dyn candle_core::Module + Send>>
    + Send
    + Sync;

/// A sequence of units: what [`Trainer::units`] trains.
pub type Units = Vec<Box<dyn candle_core::Module + Send>>;

/// One replica's model (DDP), parameters (whole for DDP, its shards for FSDP) and
/// optimizer.
struct Replica<M, O> {
    model: Option<M>,
    vars: Vec<Var>,
    opt: O,
    /// Set once every replica has agreed to step the optimizer in the current step:
    /// a failure after it may leave replicas apart.
    committed: bool,
}

type Replicas<M, O> = Arc<Vec<Mutex<Option<Replica<M, O>>>>>;

fn boxed(e: impl Into<Error>) -> ReplicaError {
    Box::new(e.into())
}

/// A candle model and optimizer trained on meshwork's devices: every replica runs the
/// user's forward and backward on its slice of each batch, and the replicas exchange
/// gradients (DDP) or parameter and gradient shards (FSDP) through meshwork's
/// collectives. Replicas stay bit-identical (DDP) — every replica receives the same
/// reduced bytes and steps the same optimizer — and a failure on any replica (an error
/// or a panic in the user's code) ends the step on every replica with that error.
pub struct Trainer<M, O: Optimizer> {
    devices: Devices,
    shared: Arc<Shared<M>>,
    replicas: Replicas<M, O>,
    optimizer: O::Config,
    steps: usize,
    /// The step whose optimizer update failed on some replica after others made it.
    broken: Option<usize>,
}

impl<M, O> Trainer<M, O>
where
    M: Send + 'static,
    O: Optimizer + Send + 'static,
    O::Config: Clone + Send + Sync + 'static,
{
    /// A trainer of the model `build` makes (with `candle_nn`'s initializers: replica
    /// 0's values go to every replica), each replica with an optimizer made from
    /// `optimizer` over its parameters.
    pub fn new(
        devices: &Devices,
        config: Config,
        optimizer: O::Config,
        build: impl Fn(VarBuilder<'_>) -> candle_core::Result<M> + Send + Sync + 'static,
    ) -> Result<Trainer<M, O>> {
        Trainer::start(
            devices,
            config,
            optimizer,
            Arc::new(build),
            Source::Built(HashMap::new()),
            None,
        )
    }

    /// [`new`](Self::new) with the initial values `values` (by name; all of the
    /// model's parameters, none other).
    pub fn with_values(
        devices: &Devices,
        config: Config,
        optimizer: O::Config,
        values: HashMap<String, Tensor>,
        build: impl Fn(VarBuilder<'_>) -> candle_core::Result<M> + Send + Sync + 'static,
    ) -> Result<Trainer<M, O>> {
        Trainer::start(devices, config, optimizer, Arc::new(build), Source::Built(values), None)
    }

    /// [`new`](Self::new) with the initial values read from the safetensors file at
    /// `path`: under FSDP each replica reads only the bytes of its own shards (any
    /// dim, uneven — the general form of candle's `ShardedSafeTensors`); under DDP
    /// each process reads the whole file once.
    pub fn from_safetensors(
        devices: &Devices,
        config: Config,
        optimizer: O::Config,
        path: impl AsRef<Path>,
        build: impl Fn(VarBuilder<'_>) -> candle_core::Result<M> + Send + Sync + 'static,
    ) -> Result<Trainer<M, O>> {
        let file = crate::load::File::open(path.as_ref())?;
        Trainer::start(
            devices,
            config,
            optimizer,
            Arc::new(build),
            Source::File(Arc::new(file)),
            None,
        )
    }

    fn start(
        devices: &Devices,
        config: Config,
        optimizer: O::Config,
        build: Arc<Build<M>>,
        source: Source,
        units: Option<(Arc<UnitBuild>, Vec<Range<usize>>)>,
    ) -> Result<Trainer<M, O>> {
        if config.bucket_bytes == 0 {
            return Err(Error::Config { problem: "bucket_bytes must be at least 1".into() });
        }
        if !matches!(config.dtype, DType::F32 | DType::F64) {
            return Err(Error::DType { name: "Config::dtype".into(), dtype: config.dtype });
        }
        let n = devices.replicas();
        // The host's model: which parameters, in which order, and (unless a file
        // gives them) their initial values.
        let (preset, file) = match source {
            Source::Built(v) => (v, None),
            Source::File(f) => (HashMap::new(), Some(f)),
        };
        let given = !preset.is_empty();
        let recorder = Recorder::with_values(preset);
        let host =
            build(VarBuilder::from_backend(Box::new(recorder.clone()), config.dtype, Device::Cpu))?;
        let unused = recorder.unused();
        if given && !unused.is_empty() {
            return Err(Error::Builder {
                problem: format!(
                    "the model has no parameters named {unused:?} (given as initial values)"
                ),
            });
        }
        let missing = recorder.initialized();
        if given && !missing.is_empty() {
            return Err(Error::Builder {
                problem: format!("no initial values were given for {missing:?}"),
            });
        }
        let vars = recorder.vars();
        let params = vars
            .iter()
            .map(|(name, v)| {
                Ok(Param {
                    name: name.clone(),
                    shape: v.dims().to_vec(),
                    kind: params::kind_of(name, v.dtype())?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        if let Some(f) = &file {
            f.check(&params)?;
        }
        let mut plans = Vec::new();
        if config.parallel == Parallel::Fsdp {
            for p in &params {
                let dim = config.shard_dims.get(&p.name).copied().unwrap_or(0);
                plans.push(ShardPlan::new(p, dim, n)?);
            }
            if let Some(name) =
                config.shard_dims.keys().find(|k| !params.iter().any(|p| &p.name == *k))
            {
                return Err(Error::Config {
                    problem: format!("shard_dims names {name}, which the model does not have"),
                });
            }
        }
        let lens: Vec<(usize, Kind)> = match config.parallel {
            Parallel::Ddp => params.iter().map(|p| (p.len(), p.kind)).collect(),
            Parallel::Fsdp => params.iter().zip(&plans).map(|(p, s)| (s.seg, p.kind)).collect(),
        };
        let grads = bucket::plan(&lens, config.bucket_bytes);
        let gathers = if config.parallel == Parallel::Fsdp {
            // Forward order for the gather: the plan reverses, so reverse the input.
            let mut g = bucket::plan(&lens, config.bucket_bytes);
            g.reverse();
            g
        } else {
            Vec::new()
        };
        let units = match units {
            None => None,
            Some((build, ranges)) => {
                if config.parallel != Parallel::Fsdp {
                    return Err(Error::Config {
                        problem: "units are FSDP's: use Config::fsdp()".into(),
                    });
                }
                if ranges.last().map_or(0, |r| r.end) != params.len() {
                    return Err(Error::Builder {
                        problem: "the units asked for other parameters than the whole model".into(),
                    });
                }
                let mut gathers = Vec::new();
                let mut grads = Vec::new();
                for r in &ranges {
                    let plan = |b: Bucket| Bucket {
                        params: b.params.iter().map(|&k| k + r.start).collect(),
                        ..b
                    };
                    let mut g: Vec<Bucket> = bucket::plan(&lens[r.clone()], config.bucket_bytes)
                        .into_iter()
                        .map(plan)
                        .collect();
                    grads.push(g.clone());
                    g.reverse();
                    gathers.push(g);
                }
                Some(UnitPlan { build, params: ranges, gathers, grads })
            }
        };
        let shared = Arc::new(Shared {
            parallel: config.parallel,
            params,
            plans,
            grads,
            gathers,
            build,
            dtype: config.dtype,
            replicas: n,
            first: devices.first_replica(),
            units,
        });
        let replicas: Replicas<M, O> =
            Arc::new((0..devices.local()).map(|_| Mutex::new(None)).collect());
        // The host model's values (DDP from a file: the file's), which replica 0
        // broadcasts to every replica.
        let values: Arc<Vec<Tensor>> = Arc::new(match (&file, config.parallel) {
            (Some(f), Parallel::Ddp) => {
                let file = f.clone();
                let all = shared.params.iter().map(|p| {
                    let whole: Vec<Range<usize>> = p.shape.iter().map(|&d| 0..d).collect();
                    file.read_region(&p.name, &whole, p.kind.dtype())
                });
                all.collect::<Result<_>>()?
            }
            _ => vars.iter().map(|(_, v)| v.as_tensor().clone()).collect(),
        });
        drop(host);
        // DDP starts from the values above; FSDP from a file reads its shards.
        let file = file.filter(|_| config.parallel == Parallel::Fsdp);
        let program: Arc<ReplicaFn> = {
            let (shared, replicas, optimizer) =
                (shared.clone(), replicas.clone(), optimizer.clone());
            Arc::new(move |ctx: &ReplicaContext, _| {
                let r = ctx.replica_id();
                let replica = match &file {
                    Some(f) => init_from_file::<M, O>(&shared, f, r, &optimizer)?,
                    None => init_broadcast::<M, O>(ctx, &shared, &values, &optimizer)?,
                };
                *replicas[r - shared.first].lock().unwrap_or_else(PoisonError::into_inner) =
                    Some(replica);
                // A replica that failed to start fails its peers here, not at their
                // first step.
                ctx.barrier()?;
                Ok(Vec::new())
            })
        };
        devices.run(program)?;
        Ok(Trainer {
            devices: devices.clone(),
            shared,
            replicas,
            optimizer,
            steps: 0,
            broken: None,
        })
    }

    /// One training step on the global batch `batch` (every input's dim 0 is the
    /// batch, split evenly over the replicas in replica order; over MPI every process
    /// passes the same global batch): each replica computes `loss(model, its slice)`
    /// (a scalar, the mean over its rows, as candle's losses are), its gradients, the
    /// exchange, and its optimizer step. Returns the mean of the replicas' losses: the
    /// global batch's loss.
    pub fn step<F>(&mut self, batch: &[Tensor], loss: F) -> Result<f64>
    where
        F: Fn(&M, &[Tensor]) -> candle_core::Result<Tensor> + Send + Sync + 'static,
    {
        self.run_step(batch, move |ctx, shared, replica, batch| {
            train_step(ctx, shared, replica, batch, &loss)
        })
    }

    /// Runs `one` (a step on one replica) on every replica.
    fn run_step(
        &mut self,
        batch: &[Tensor],
        one: impl Fn(
            &ReplicaContext,
            &Shared<M>,
            &mut Replica<M, O>,
            &[Tensor],
        ) -> std::result::Result<f64, ReplicaError>
        + Send
        + Sync
        + 'static,
    ) -> Result<f64> {
        let n = self.shared.replicas;
        for (k, t) in batch.iter().enumerate() {
            let rows = t.dims().first().copied().unwrap_or(0);
            if rows == 0 || !rows.is_multiple_of(n) {
                return Err(Error::Batch { input: k, rows, replicas: n });
            }
        }
        if let Some(step) = self.broken {
            return Err(Error::Diverged { step });
        }
        let batch: Arc<Vec<Tensor>> = Arc::new(batch.to_vec());
        let (shared, replicas) = (self.shared.clone(), self.replicas.clone());
        let program: Arc<ReplicaFn> = Arc::new(move |ctx: &ReplicaContext, _| {
            let r = ctx.replica_id();
            let mut guard =
                replicas[r - shared.first].lock().unwrap_or_else(PoisonError::into_inner);
            let replica = guard.as_mut().ok_or_else(|| {
                boxed(Error::Config { problem: "a replica was never initialised".into() })
            })?;
            replica.committed = false;
            let value = one(ctx, &shared, replica, &batch)?;
            Ok(vec![ExecTensor::F64(ArrayD::from_elem(IxDyn(&[]), value))])
        });
        let out = match self.devices.run(program) {
            Ok(out) => out,
            Err(e) => {
                // Replicas commit together (every replica past the agreement, or
                // none): one that did means a failure in an optimizer step, after
                // which the replicas may differ.
                let committed = self.replicas.iter().any(|m| {
                    m.lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .as_ref()
                        .is_some_and(|r| r.committed)
                });
                if committed {
                    self.broken = Some(self.steps);
                }
                return Err(e);
            }
        };
        self.steps += 1;
        match out.first() {
            Some(ExecTensor::F64(a)) => Ok(a.iter().copied().next().unwrap_or(f64::NAN)),
            _ => Err(Error::Config { problem: "a step returned no loss".into() }),
        }
    }

    /// Steps made since the trainer was made or restored.
    pub fn steps(&self) -> usize {
        self.steps
    }

    /// DDP or FSDP.
    pub fn parallel(&self) -> Parallel {
        self.shared.parallel
    }

    /// The parameters' names, in the order the model's builder asked for them.
    pub fn names(&self) -> Vec<String> {
        self.shared.params.iter().map(|p| p.name.clone()).collect()
    }

    /// Every parameter's whole value (FSDP: gathered from the shards).
    pub fn parameters(&self) -> Result<Vec<(String, Tensor)>> {
        let whole = self.gathered(Arc::new(|r: &Replica<M, O>| {
            r.vars.iter().map(|v| Some(v.as_tensor().clone())).collect()
        }))?;
        Ok(self.shared.params.iter().map(|p| p.name.clone()).zip(whole).collect())
    }

    /// One tensor per parameter, `pick`ed from every replica as its shard (DDP: whole;
    /// `None` for an empty shard), gathered whole.
    fn gathered(&self, pick: Arc<Pick<M, O>>) -> Result<Vec<Tensor>> {
        let (shared, replicas) = (self.shared.clone(), self.replicas.clone());
        let program: Arc<ReplicaFn> = Arc::new(move |ctx: &ReplicaContext, _| {
            let r = ctx.replica_id();
            let guard = replicas[r - shared.first].lock().unwrap_or_else(PoisonError::into_inner);
            let replica = guard.as_ref().ok_or_else(|| {
                boxed(Error::Config { problem: "a replica was never initialised".into() })
            })?;
            let mine = pick(replica);
            let whole: Vec<Tensor> = match shared.parallel {
                Parallel::Ddp => mine
                    .into_iter()
                    .map(|t| t.ok_or("a DDP replica without a value"))
                    .collect::<std::result::Result<_, _>>()?,
                Parallel::Fsdp => {
                    let vars = mine
                        .into_iter()
                        .enumerate()
                        .map(|(k, t)| {
                            let region = &shared.plans[k].regions[r];
                            match t {
                                Some(t) => Var::from_tensor(&t),
                                None if elems(region) == 0 => Var::zeros(
                                    extent(region),
                                    shared.params[k].kind.dtype(),
                                    &Device::Cpu,
                                ),
                                None => candle_core::bail!(
                                    "no value for the shard of {} on replica {r}",
                                    shared.params[k].name
                                ),
                            }
                        })
                        .collect::<candle_core::Result<Vec<_>>>()
                        .map_err(boxed)?;
                    gather(ctx, &shared, &vars)?
                        .into_iter()
                        .map(|v| v.as_tensor().clone())
                        .collect()
                }
            };
            whole.iter().map(|t| params::to_exec(t).map_err(boxed)).collect()
        });
        let out = self.devices.run(program)?;
        self.shared
            .params
            .iter()
            .zip(out)
            .map(|(p, t)| Ok(params::from_exec(t, p.kind.dtype())?))
            .collect()
    }

    /// A hash of each local replica's parameters (whole under DDP, where every
    /// replica's must be equal; its own shards under FSDP): FNV-1a over the bytes.
    pub fn replica_hashes(&self) -> Result<Vec<u64>> {
        self.replicas
            .iter()
            .map(|m| {
                let guard = m.lock().unwrap_or_else(PoisonError::into_inner);
                let replica = guard.as_ref().ok_or_else(|| Error::Config {
                    problem: "a replica was never initialised".into(),
                })?;
                let mut h: u64 = 0xcbf2_9ce4_8422_2325;
                for v in &replica.vars {
                    let bytes: Vec<u8> = match v.dtype() {
                        DType::F64 => params::flat::<f64>(v.as_tensor())?
                            .iter()
                            .flat_map(|x| x.to_le_bytes())
                            .collect(),
                        _ => params::flat::<f32>(v.as_tensor())?
                            .iter()
                            .flat_map(|x| x.to_le_bytes())
                            .collect(),
                    };
                    for b in bytes {
                        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
                    }
                }
                Ok(h)
            })
            .collect()
    }

    /// The bytes of parameters each local replica keeps between steps (DDP: the whole
    /// model; FSDP: its shards). An optimizer's state is on top (Adam's: twice this).
    pub fn resident_parameter_bytes(&self) -> Vec<usize> {
        self.replicas
            .iter()
            .map(|m| {
                let guard = m.lock().unwrap_or_else(PoisonError::into_inner);
                guard.as_ref().map_or(0, |r| {
                    r.vars.iter().map(|v| v.elem_count() * v.dtype().size_in_bytes()).sum()
                })
            })
            .collect()
    }

    /// The bytes each replica hands to the gradient exchange per step: the fused
    /// buckets of the all-reduce (DDP) or reduce-scatter (FSDP; `replicas ×` its
    /// shards' slots), gradient values and one has-gradient flag per parameter.
    pub fn gradient_bytes_per_step(&self) -> usize {
        let per = |b: &Bucket| b.buffer_len() * b.kind.size();
        let buckets: usize = self.shared.grads.iter().map(per).sum();
        match self.shared.parallel {
            Parallel::Ddp => buckets,
            Parallel::Fsdp => buckets * self.shared.replicas,
        }
    }

    /// The model's parameter bytes.
    pub fn parameter_bytes(&self) -> usize {
        self.shared.params.iter().map(|p| p.len() * p.kind.size()).sum()
    }

    /// Saves the parameters as a meshwork sharded checkpoint in `dir` (a new or empty
    /// directory; anything else is refused untouched), `metadata` in its index (with
    /// the trainer's step count, layout and replicas under `meshwork_candle`): under
    /// FSDP each replica's shards as they are split, under DDP the whole values.
    /// [`restore`](Self::restore) reads it on any number of replicas, DDP or FSDP.
    /// Over several processes every process calls it and process 0 writes.
    pub fn save(&self, dir: impl AsRef<Path>, metadata: Option<&serde_json::Value>) -> Result<()> {
        self.save_inner(dir.as_ref(), metadata, Vec::new(), serde_json::Value::Null)
    }

    /// [`save`](Self::save) with `extra` variables (`(name, parameter, whole value)`,
    /// split as their parameter is) and `extra_meta` beside the trainer's metadata.
    fn save_inner(
        &self,
        dir: &Path,
        metadata: Option<&serde_json::Value>,
        extra: Vec<(String, usize, Tensor)>,
        extra_meta: serde_json::Value,
    ) -> Result<()> {
        if let Some(step) = self.broken {
            return Err(Error::Diverged { step });
        }
        let mut whole: Vec<(String, usize, Tensor)> =
            self.parameters()?.into_iter().enumerate().map(|(k, (name, t))| (name, k, t)).collect();
        whole.extend(extra);
        // The user's metadata, with the trainer's under its own key.
        let mut meta = match metadata {
            Some(serde_json::Value::Object(m)) => serde_json::Value::Object(m.clone()),
            Some(other) => serde_json::json!({ "user": other }),
            None => serde_json::json!({}),
        };
        meta[META] = serde_json::json!({
            "steps": self.steps,
            "parallel": format!("{:?}", self.shared.parallel),
            "replicas": self.shared.replicas,
            "optimizer": extra_meta,
        });
        let written = if self.devices.first_replica() == 0 {
            self.write(dir, &whole, Some(&meta))
        } else {
            Ok(())
        };
        // Every process returns once process 0 has written, with its outcome.
        let ok = written.is_ok();
        let program: Arc<ReplicaFn> = Arc::new(move |ctx: &ReplicaContext, _| {
            let flag = ExecTensor::F64(ArrayD::from_elem(IxDyn(&[]), if ok { 1.0 } else { 0.0 }));
            Ok(vec![ctx.broadcast(0, flag)?])
        });
        let status = self.devices.run(program)?;
        written?;
        match status.first() {
            Some(ExecTensor::F64(a)) if a.iter().all(|&x| x == 1.0) => Ok(()),
            _ => Err(Error::Config { problem: "process 0 could not write the checkpoint".into() }),
        }
    }

    /// Process 0's part of [`save`](Self::save): the checkpoint's files.
    fn write(
        &self,
        dir: &Path,
        whole: &[(String, usize, Tensor)],
        metadata: Option<&serde_json::Value>,
    ) -> Result<()> {
        let mut entries = Vec::with_capacity(whole.len());
        for (name, k, t) in whole {
            let (k, p) = (*k, &self.shared.params[*k]);
            let value = params::to_exec(t)?;
            let (hlo, shards) = match self.shared.parallel {
                Parallel::Ddp => {
                    let region: Vec<Range<usize>> = p.shape.iter().map(|&d| 0..d).collect();
                    (HloSharding::Replicated, vec![(0, region, value)])
                }
                Parallel::Fsdp => {
                    let plan = &self.shared.plans[k];
                    let mut shards = Vec::new();
                    for (q, region) in plan.regions.iter().enumerate() {
                        if elems(region) > 0 {
                            shards.push((q, region.clone(), slice_exec(&value, region)));
                        }
                    }
                    (plan.sharding.hlo().clone(), shards)
                }
            };
            entries.push(meshwork_checkpoint::CheckpointEntry {
                name: name.clone(),
                dtype: meshwork_types::DType::from(p.kind),
                shape: p.shape.clone(),
                hlo,
                shards,
            });
        }
        let devices = match self.shared.parallel {
            Parallel::Ddp => 1,
            Parallel::Fsdp => self.shared.replicas,
        };
        meshwork_checkpoint::write_checkpoint(dir, devices, entries, metadata)?;
        Ok(())
    }

    /// Restores the parameters and the step count from a checkpoint
    /// [`save`](Self::save) wrote (on any number of replicas, DDP or FSDP), verified
    /// before anything changes on any replica (over MPI: every process read it, or
    /// none changes), and starts every optimizer afresh: candle's optimizers keep
    /// their state (AdamW's moments) private, so a checkpoint holds the parameters
    /// and a resumed AdamW run starts its moments again.
    pub fn restore(&mut self, dir: impl AsRef<Path>) -> Result<()> {
        self.restore_inner(dir.as_ref(), &[], None)
    }

    /// [`restore`](Self::restore), with each parameter's optimizer state `slots`
    /// (saved as `optimizer/{slot}/{name}`) put back by `put` (`(optimizer, index of
    /// the variable in the optimizer, its slots, the updates made)`).
    fn restore_inner(
        &mut self,
        dir: &Path,
        slots: &[&str],
        put: Option<Arc<Put<O>>>,
    ) -> Result<()> {
        let mut wanted: Vec<(String, meshwork_types::DType, Vec<usize>)> = self
            .shared
            .params
            .iter()
            .map(|p| (p.name.clone(), meshwork_types::DType::from(p.kind), p.shape.clone()))
            .collect();
        for slot in slots {
            for p in &self.shared.params {
                wanted.push((
                    format!("optimizer/{slot}/{}", p.name),
                    meshwork_types::DType::from(p.kind),
                    p.shape.clone(),
                ));
            }
        }
        let kinds: Vec<DType> = wanted
            .iter()
            .map(|w| if w.1 == meshwork_types::DType::F64 { DType::F64 } else { DType::F32 })
            .collect();
        let read = (|| -> Result<(Vec<Tensor>, usize, usize)> {
            let values = meshwork_checkpoint::read_checkpoint(dir, &wanted)?
                .into_iter()
                .zip(&kinds)
                .map(|(t, &d)| params::from_exec(t, d))
                .collect::<candle_core::Result<_>>()?;
            let meta = meshwork_checkpoint::checkpoint_metadata(dir)?.unwrap_or_default();
            let count = |v: &serde_json::Value| v.as_u64().and_then(|s| usize::try_from(s).ok());
            let steps = count(&meta[META]["steps"]).unwrap_or(0);
            let updates = count(&meta[META]["optimizer"]["updates"]).unwrap_or(0);
            Ok((values, steps, updates))
        })();
        // Every process reads; all of them, or none, put the values.
        let ok = read.is_ok();
        let values: Arc<Vec<Tensor>> =
            Arc::new(read.as_ref().map(|(v, _, _)| v.clone()).unwrap_or_default());
        let updates = read.as_ref().map_or(0, |(_, _, u)| *u);
        let (shared, replicas, optimizer) =
            (self.shared.clone(), self.replicas.clone(), self.optimizer.clone());
        let program: Arc<ReplicaFn> = Arc::new(move |ctx: &ReplicaContext, _| {
            let r = ctx.replica_id();
            let flag = ExecTensor::F64(ArrayD::from_elem(IxDyn(&[]), if ok { 1.0 } else { 0.0 }));
            let mut guard =
                replicas[r - shared.first].lock().unwrap_or_else(PoisonError::into_inner);
            let replica = guard.as_mut().ok_or_else(|| {
                boxed(Error::Config { problem: "a replica was never initialised".into() })
            })?;
            replica.committed = false;
            match ctx.all_reduce(ReduceOp::Min, flag)? {
                ExecTensor::F64(a) if a.iter().all(|&x| x == 1.0) => {}
                _ => return Err("a process could not read the checkpoint".into()),
            }
            // From here a failure leaves replicas partly restored.
            replica.committed = true;
            // This replica's part of value `i` of parameter `k`.
            let part = |i: usize, k: usize| match shared.parallel {
                Parallel::Ddp => Ok(values[i].clone()),
                Parallel::Fsdp => region_of(&values[i], &shared.plans[k].regions[r]),
            };
            let count = shared.params.len().max(1);
            for (k, v) in replica.vars.iter().enumerate() {
                if v.elem_count() > 0 {
                    v.set(&part(k, k).map_err(boxed)?).map_err(boxed)?;
                }
            }
            replica.opt = O::new(stepped(&replica.vars), optimizer.clone()).map_err(boxed)?;
            if let Some(put) = &put {
                let mut j = 0;
                for (k, v) in replica.vars.iter().enumerate() {
                    if v.elem_count() == 0 {
                        continue;
                    }
                    let state = (1..=values.len() / count - 1)
                        .map(|s| part(s * count + k, k))
                        .collect::<candle_core::Result<Vec<_>>>()
                        .map_err(boxed)?;
                    put(&mut replica.opt, Some((j, &state)), updates).map_err(boxed)?;
                    j += 1;
                }
                put(&mut replica.opt, None, updates).map_err(boxed)?;
            }
            Ok(Vec::new())
        });
        let run = self.devices.run(program);
        let committed = self.replicas.iter().any(|m| {
            m.lock().unwrap_or_else(PoisonError::into_inner).as_ref().is_some_and(|r| r.committed)
        });
        let (_, steps, _) = read?;
        if let Err(e) = run {
            if committed {
                self.broken = Some(self.steps);
            }
            return Err(e);
        }
        self.steps = steps;
        self.broken = None;
        Ok(())
    }
}

/// How [`Trainer::restore_inner`] puts an optimizer's state back: variable `j`'s
/// slots (`Some((j, slots))`), or the update count (`None`).
type Put<O> =
    dyn Fn(&mut O, Option<(usize, &[Tensor])>, usize) -> candle_core::Result<()> + Send + Sync;

impl<M, O> Trainer<M, O>
where
    M: Send + 'static,
    O: Stateful + Send + 'static,
    O::Config: Clone + Send + Sync + 'static,
{
    /// [`save`](Self::save) with the optimizer's state: each parameter's slots
    /// (AdamW's moments, as `optimizer/m/{name}` and `optimizer/v/{name}`, split as
    /// the parameter is) and its update count, so that
    /// [`restore_with_optimizer`](Self::restore_with_optimizer) — on any number of
    /// replicas, DDP or FSDP — continues the run as if it had not stopped.
    pub fn save_with_optimizer(
        &self,
        dir: impl AsRef<Path>,
        metadata: Option<&serde_json::Value>,
    ) -> Result<()> {
        let mut extra = Vec::new();
        for (s, slot) in O::SLOTS.iter().enumerate() {
            let values = self.gathered(Arc::new(move |r: &Replica<M, O>| {
                let mut j = 0;
                r.vars
                    .iter()
                    .map(|v| {
                        if v.elem_count() == 0 {
                            // An empty shard (or parameter) has empty state.
                            return v.as_tensor().zeros_like().ok();
                        }
                        j += 1;
                        r.opt.slots(j - 1).get(s).cloned()
                    })
                    .collect()
            }))?;
            for (k, t) in values.into_iter().enumerate() {
                extra.push((format!("optimizer/{slot}/{}", self.shared.params[k].name), k, t));
            }
        }
        let updates = self.replicas.first().map_or(0, |m| {
            m.lock().unwrap_or_else(PoisonError::into_inner).as_ref().map_or(0, |r| r.opt.updates())
        });
        self.save_inner(dir.as_ref(), metadata, extra, serde_json::json!({ "updates": updates }))
    }

    /// [`restore`](Self::restore) with the optimizer's state a
    /// [`save_with_optimizer`](Self::save_with_optimizer) wrote.
    pub fn restore_with_optimizer(&mut self, dir: impl AsRef<Path>) -> Result<()> {
        let put: Arc<Put<O>> =
            Arc::new(|o: &mut O, slots: Option<(usize, &[Tensor])>, t: usize| match slots {
                Some((j, state)) => o.set_slots(j, state),
                None => {
                    o.set_updates(t);
                    Ok(())
                }
            });
        self.restore_inner(dir.as_ref(), O::SLOTS, Some(put))
    }
}

impl<O> Trainer<Units, O>
where
    O: Optimizer + Send + 'static,
    O::Config: Clone + Send + Sync + 'static,
{
    /// FSDP with the model as `count` units run in sequence (transformer blocks,
    /// layers): unit `k`, built by `build(k, vb)`, maps its input to the next unit's.
    /// [`step_units`](Self::step_units) gathers each unit's parameters just before its
    /// forward and again before its backward, which recomputes the unit's forward from
    /// its saved input (activation checkpointing), reduce-scatters the unit's
    /// gradients, and lets the gathered parameters go: a replica holds one unit whole
    /// at a time. Units own their parameters (none shared between units), and a unit's
    /// forward runs twice, so it must be deterministic (no dropout: the recomputation
    /// would draw another mask) and must not write buffers (BatchNorm in training
    /// mode).
    pub fn units<U>(
        devices: &Devices,
        config: Config,
        optimizer: O::Config,
        count: usize,
        build: impl Fn(usize, VarBuilder<'_>) -> candle_core::Result<U> + Send + Sync + 'static,
    ) -> Result<Trainer<Units, O>>
    where
        U: candle_core::Module + Send + 'static,
    {
        if count == 0 {
            return Err(Error::Config { problem: "a model of units needs at least one".into() });
        }
        let unit: Arc<UnitBuild> = Arc::new(move |k, vb| {
            Ok(Box::new(build(k, vb)?) as Box<dyn candle_core::Module + Send>)
        });
        // Which parameters each unit asks for: the units built once, in order.
        let recorder = Recorder::default();
        let mut ranges = Vec::with_capacity(count);
        for k in 0..count {
            let before = recorder.vars().len();
            let asked = recorder.asked();
            unit(
                k,
                VarBuilder::from_backend(Box::new(recorder.clone()), config.dtype, Device::Cpu),
            )?;
            if recorder.asked() - asked != recorder.vars().len() - before {
                return Err(Error::Builder {
                    problem: format!(
                        "unit {k} asked for a parameter an earlier unit has; units own their parameters"
                    ),
                });
            }
            ranges.push(before..recorder.vars().len());
        }
        let whole = unit.clone();
        let model = move |vb: VarBuilder<'_>| -> candle_core::Result<Units> {
            (0..count).map(|k| whole(k, vb.clone())).collect()
        };
        Trainer::start(
            devices,
            config,
            optimizer,
            Arc::new(model),
            Source::Built(HashMap::new()),
            Some((unit, ranges)),
        )
    }

    /// One training step of a model of units: `batch[0]` runs through the units, and
    /// `head(output, slice)` (no parameters of its own; a scalar, the mean over the
    /// slice's rows) gives each replica's loss from the last unit's output and its
    /// slice of the batch. Returns the global batch's loss.
    pub fn step_units<F>(&mut self, batch: &[Tensor], head: F) -> Result<f64>
    where
        F: Fn(&Tensor, &[Tensor]) -> candle_core::Result<Tensor> + Send + Sync + 'static,
    {
        let head = Arc::new(head);
        self.run_step(batch, move |ctx, shared, replica, batch| {
            unit_step(ctx, shared, replica, batch, &*head)
        })
    }
}

/// The key of the trainer's own metadata in a checkpoint's index: the steps made, DDP
/// or FSDP, the replicas.
const META: &str = "meshwork_candle";

/// Where the initial values come from.
enum Source {
    /// The model's builder (with preset values, possibly none).
    Built(HashMap<String, Tensor>),
    /// A safetensors file each replica reads its shards from.
    File(Arc<crate::load::File>),
}

impl From<Kind> for meshwork_types::DType {
    fn from(k: Kind) -> meshwork_types::DType {
        match k {
            Kind::F32 => meshwork_types::DType::F32,
            Kind::F64 => meshwork_types::DType::F64,
        }
    }
}

/// The part `region` of `t`.
fn region_of(t: &Tensor, region: &[Range<usize>]) -> candle_core::Result<Tensor> {
    let mut out = t.clone();
    for (d, r) in region.iter().enumerate() {
        out = out.narrow(d, r.start, r.len())?;
    }
    out.contiguous()?.copy()
}

/// The part `region` of an executor tensor.
fn slice_exec(t: &ExecTensor, region: &[Range<usize>]) -> ExecTensor {
    let info: Vec<ndarray::SliceInfoElem> =
        region.iter().map(|r| ndarray::SliceInfoElem::from(r.clone())).collect();
    match t {
        ExecTensor::F64(a) => ExecTensor::F64(a.slice(info.as_slice()).to_owned()),
        ExecTensor::F32(a) => ExecTensor::F32(a.slice(info.as_slice()).to_owned()),
        // The bridge's values are f32 or f64 (`params::to_exec`).
        other => other.clone(),
    }
}

/// A replica's start: the host's values broadcast from replica 0 (so every process
/// starts from the same values), kept whole (DDP) or cut to this replica's shards.
fn init_broadcast<M, O>(
    ctx: &ReplicaContext,
    shared: &Shared<M>,
    values: &[Tensor],
    optimizer: &O::Config,
) -> std::result::Result<Replica<M, O>, ReplicaError>
where
    O: Optimizer,
    O::Config: Clone,
{
    let r = ctx.replica_id();
    let lens: Vec<(usize, Kind)> = shared.params.iter().map(|p| (p.len(), p.kind)).collect();
    let mut whole: Vec<Option<Tensor>> = vec![None; values.len()];
    for b in bucket::plan(&lens, 25 << 20) {
        match b.kind {
            Kind::F32 => broadcast::<f32>(ctx, &b, shared, values, &mut whole)?,
            Kind::F64 => broadcast::<f64>(ctx, &b, shared, values, &mut whole)?,
        }
    }
    let mut vars = Vec::with_capacity(values.len());
    for (k, t) in whole.into_iter().enumerate() {
        let t = t.ok_or_else(|| {
            boxed(Error::Config { problem: "a parameter missed the broadcast".into() })
        })?;
        let t = match shared.parallel {
            Parallel::Ddp => t,
            Parallel::Fsdp => region_of(&t, &shared.plans[k].regions[r]).map_err(boxed)?,
        };
        vars.push(Var::from_tensor(&t).map_err(boxed)?);
    }
    finish(shared, vars, optimizer)
}

/// A replica's start from a safetensors file: only its own shards are read.
fn init_from_file<M, O>(
    shared: &Shared<M>,
    file: &crate::load::File,
    r: usize,
    optimizer: &O::Config,
) -> std::result::Result<Replica<M, O>, ReplicaError>
where
    O: Optimizer,
    O::Config: Clone,
{
    let mut vars = Vec::with_capacity(shared.params.len());
    for (p, plan) in shared.params.iter().zip(&shared.plans) {
        let t = file.read_region(&p.name, &plan.regions[r], p.kind.dtype()).map_err(boxed)?;
        vars.push(Var::from_tensor(&t).map_err(boxed)?);
    }
    finish(shared, vars, optimizer)
}

/// A replica of `vars`: DDP builds its model over them.
fn finish<M, O>(
    shared: &Shared<M>,
    vars: Vec<Var>,
    optimizer: &O::Config,
) -> std::result::Result<Replica<M, O>, ReplicaError>
where
    O: Optimizer,
    O::Config: Clone,
{
    let model = match shared.parallel {
        Parallel::Ddp => {
            let served: HashMap<String, Var> =
                shared.params.iter().map(|p| p.name.clone()).zip(vars.iter().cloned()).collect();
            let vb = VarBuilder::from_backend(Box::new(Served(served)), shared.dtype, Device::Cpu);
            Some((shared.build)(vb).map_err(boxed)?)
        }
        Parallel::Fsdp => None,
    };
    let opt = O::new(stepped(&vars), optimizer.clone()).map_err(boxed)?;
    Ok(Replica { model, vars, opt, committed: false })
}

/// The variables an optimizer steps: all but the empty shards of uneven splits (there
/// is nothing in them to step, and candle cannot `set` an empty variable).
fn stepped(vars: &[Var]) -> Vec<Var> {
    vars.iter().filter(|v| v.elem_count() > 0).cloned().collect()
}

fn broadcast<T: Elem>(
    ctx: &ReplicaContext,
    b: &Bucket,
    shared: &Shared<impl Sized>,
    values: &[Tensor],
    whole: &mut [Option<Tensor>],
) -> std::result::Result<(), ReplicaError> {
    let offsets = b.offsets();
    let mut buf = vec![T::default(); b.lens.iter().sum()];
    if ctx.replica_id() == 0 {
        for (j, &k) in b.params.iter().enumerate() {
            let v = params::flat::<T>(&values[k]).map_err(boxed)?;
            buf[offsets[j]..offsets[j] + v.len()].copy_from_slice(&v);
        }
    }
    let got = T::values(ctx.broadcast(0, T::exec(buf))?).ok_or("a broadcast changed dtype")?;
    for (j, &k) in b.params.iter().enumerate() {
        let p = &shared.params[k];
        let v = got[offsets[j]..offsets[j] + b.lens[j]].to_vec();
        whole[k] = Some(params::tensor(v, &p.shape).map_err(boxed)?);
    }
    Ok(())
}

/// One step on one replica; returns the global batch's loss.
fn train_step<M, O: Optimizer>(
    ctx: &ReplicaContext,
    shared: &Shared<M>,
    replica: &mut Replica<M, O>,
    batch: &[Tensor],
    loss: &(dyn Fn(&M, &[Tensor]) -> candle_core::Result<Tensor> + Send + Sync),
) -> std::result::Result<f64, ReplicaError> {
    let (n, r) = (shared.replicas, ctx.replica_id());
    let slices = slice_of(batch, n, r).map_err(boxed)?;
    // FSDP: the parameters gathered, the model built over them for this step.
    let mut gathered = Vec::new();
    let built;
    let model = match shared.parallel {
        Parallel::Ddp => replica.model.as_ref().ok_or("a DDP replica without its model")?,
        Parallel::Fsdp => {
            gathered = gather(ctx, shared, &replica.vars)?;
            let served: HashMap<String, Var> = shared
                .params
                .iter()
                .map(|p| p.name.clone())
                .zip(gathered.iter().cloned())
                .collect();
            let vb = VarBuilder::from_backend(Box::new(Served(served)), shared.dtype, Device::Cpu);
            built = (shared.build)(vb).map_err(boxed)?;
            &built
        }
    };
    let l = loss(model, &slices).map_err(boxed)?;
    // Every replica's loss before any gradient moves: a replica that failed in its
    // forward ends the step here, before any optimizer steps.
    let total = loss_sum(ctx, &l)?;
    let mut grads = l.backward().map_err(boxed)?;
    // Parameters no replica has a gradient for (buffers such as BatchNorm's running
    // statistics, or parameters this batch did not use).
    let mut without = Vec::new();
    for b in &shared.grads {
        without.extend(match (shared.parallel, b.kind) {
            (Parallel::Ddp, Kind::F32) => {
                all_reduce::<f32>(ctx, b, shared, &replica.vars, &mut grads)?
            }
            (Parallel::Ddp, Kind::F64) => {
                all_reduce::<f64>(ctx, b, shared, &replica.vars, &mut grads)?
            }
            (Parallel::Fsdp, kind) => {
                let source: Vec<Option<Tensor>> =
                    b.params.iter().map(|&k| grads.get(gathered[k].as_tensor()).cloned()).collect();
                match kind {
                    Kind::F32 => {
                        reduce_scatter::<f32>(ctx, b, shared, &source, &replica.vars, &mut grads)?
                    }
                    Kind::F64 => {
                        reduce_scatter::<f64>(ctx, b, shared, &source, &replica.vars, &mut grads)?
                    }
                }
            }
        });
    }
    // What the forward wrote into them is replica 0's on every replica (PyTorch's DDP
    // broadcasts its buffers from rank 0); under FSDP it goes back into the shards.
    without.sort_unstable();
    for k in without {
        let source = match shared.parallel {
            Parallel::Ddp => &replica.vars[k],
            Parallel::Fsdp => &gathered[k],
        };
        let value = match shared.params[k].kind {
            Kind::F32 => sync::<f32>(ctx, source.as_tensor(), &shared.params[k].shape)?,
            Kind::F64 => sync::<f64>(ctx, source.as_tensor(), &shared.params[k].shape)?,
        };
        let value = match shared.parallel {
            Parallel::Ddp => value,
            Parallel::Fsdp => region_of(&value, &shared.plans[k].regions[r]).map_err(boxed)?,
        };
        if replica.vars[k].elem_count() > 0 {
            replica.vars[k].set(&value).map_err(boxed)?;
        }
    }
    // Every replica has its gradients: agree before any optimizer steps, so a failure
    // anywhere up to here leaves every replica as it was.
    agree(ctx)?;
    replica.committed = true;
    replica.opt.step(&grads).map_err(boxed)?;
    Ok(total / n as f64)
}

/// A unit built over its gathered parameters, and the gathered variables (the other
/// units' `None`).
type Gathered = (Box<dyn candle_core::Module + Send>, Vec<Option<Var>>);

/// One step of a model of units on one replica: per unit, gather → forward → let go;
/// then per unit in reverse, gather → recompute → backward → reduce-scatter → let go.
fn unit_step<O: Optimizer>(
    ctx: &ReplicaContext,
    shared: &Shared<Units>,
    replica: &mut Replica<Units, O>,
    batch: &[Tensor],
    head: &(dyn Fn(&Tensor, &[Tensor]) -> candle_core::Result<Tensor> + Send + Sync),
) -> std::result::Result<f64, ReplicaError> {
    let plan = shared.units.as_ref().ok_or("a model of units without its units")?;
    let (n, r) = (shared.replicas, ctx.replica_id());
    let slices = slice_of(batch, n, r).map_err(boxed)?;
    // Unit k over its gathered parameters (and the gathered variables).
    let unit = |k: usize| -> std::result::Result<Gathered, ReplicaError> {
        let whole = gather_in(ctx, shared, &replica.vars, &plan.gathers[k])?;
        let served: HashMap<String, Var> = plan.params[k]
            .clone()
            .filter_map(|i| whole[i].clone().map(|v| (shared.params[i].name.clone(), v)))
            .collect();
        let vb = VarBuilder::from_backend(Box::new(Served(served)), shared.dtype, Device::Cpu);
        Ok(((plan.build)(k, vb).map_err(boxed)?, whole))
    };
    // Forward: each unit's input kept, its graph and parameters let go.
    let mut inputs = Vec::with_capacity(plan.params.len());
    let mut x = slices[0].detach();
    for k in 0..plan.params.len() {
        let (u, whole) = unit(k)?;
        let y = u.forward(&x).map_err(boxed)?.detach();
        drop((u, whole));
        inputs.push(std::mem::replace(&mut x, y));
    }
    let out = Var::from_tensor(&x).map_err(boxed)?;
    let l = head(out.as_tensor(), &slices).map_err(boxed)?;
    let total = loss_sum(ctx, &l)?;
    let mut grads = l.backward().map_err(boxed)?;
    // Gradients of variables carry their own graph in candle: detached, so a unit's
    // backward does not run through the unit after it (nor keep its weights).
    let mut upstream = grads.get(out.as_tensor()).map(Tensor::detach);
    // Backward: unit by unit in reverse, the forward recomputed from the saved input;
    // the unit's output gradient times its output, summed, back-propagates exactly
    // that gradient through the unit.
    for k in (0..plan.params.len()).rev() {
        let (u, whole) = unit(k)?;
        let input = Var::from_tensor(&inputs[k]).map_err(boxed)?;
        let y = u.forward(input.as_tensor()).map_err(boxed)?;
        let unit_grads = match &upstream {
            Some(dy) => {
                Some((y * dy).and_then(|p| p.sum_all()).and_then(|s| s.backward()).map_err(boxed)?)
            }
            None => None,
        };
        for b in &plan.grads[k] {
            let source: Vec<Option<Tensor>> = b
                .params
                .iter()
                .map(|&i| {
                    let v = whole[i].as_ref()?;
                    unit_grads.as_ref()?.get(v.as_tensor()).cloned()
                })
                .collect();
            // Buffers are not kept in a model of units (documented on `units`).
            let _without = match b.kind {
                Kind::F32 => {
                    reduce_scatter::<f32>(ctx, b, shared, &source, &replica.vars, &mut grads)?
                }
                Kind::F64 => {
                    reduce_scatter::<f64>(ctx, b, shared, &source, &replica.vars, &mut grads)?
                }
            };
        }
        upstream = unit_grads.as_ref().and_then(|g| g.get(input.as_tensor()).map(Tensor::detach));
    }
    agree(ctx)?;
    replica.committed = true;
    replica.opt.step(&grads).map_err(boxed)?;
    Ok(total / n as f64)
}

/// Replica `r`'s rows of every input of `batch` (split evenly over `n` replicas).
fn slice_of(batch: &[Tensor], n: usize, r: usize) -> candle_core::Result<Vec<Tensor>> {
    batch
        .iter()
        .map(|t| {
            let per = t.dim(0)? / n;
            t.narrow(0, r * per, per)
        })
        .collect()
}

/// The sum over the replicas of each one's loss `l` (a scalar).
fn loss_sum(ctx: &ReplicaContext, l: &Tensor) -> std::result::Result<f64, ReplicaError> {
    let value =
        l.to_dtype(DType::F64).and_then(|v| v.flatten_all()?.to_vec1::<f64>()).map_err(boxed)?;
    let [value] = value[..] else {
        return Err(boxed(Error::Config {
            problem: format!("the loss has {} elements; it must be a scalar", value.len()),
        }));
    };
    match ctx.all_reduce(ReduceOp::Sum, ExecTensor::F64(ArrayD::from_elem(IxDyn(&[]), value)))? {
        ExecTensor::F64(a) => Ok(a.iter().copied().next().unwrap_or(f64::NAN)),
        _ => Ok(f64::NAN),
    }
}

/// Every replica got here (a collective a failed replica never reaches).
fn agree(ctx: &ReplicaContext) -> std::result::Result<(), ReplicaError> {
    ctx.all_reduce(ReduceOp::Sum, ExecTensor::F64(ArrayD::from_elem(IxDyn(&[]), 1.0)))?;
    Ok(())
}

/// Replica 0's value of `t` (shape `shape`) on every replica.
fn sync<T: Elem>(
    ctx: &ReplicaContext,
    t: &Tensor,
    shape: &[usize],
) -> std::result::Result<Tensor, ReplicaError> {
    let values = params::flat::<T>(t).map_err(boxed)?;
    let got = T::values(ctx.broadcast(0, T::exec(values))?).ok_or("a broadcast changed dtype")?;
    params::tensor(got, shape).map_err(boxed)
}

/// DDP: a bucket of gradients summed over the replicas and averaged; a parameter no
/// replica has a gradient for gets none.
fn all_reduce<T: Elem>(
    ctx: &ReplicaContext,
    b: &Bucket,
    shared: &Shared<impl Sized>,
    vars: &[Var],
    grads: &mut GradStore,
) -> std::result::Result<Vec<usize>, ReplicaError> {
    let mut without = Vec::new();
    let offsets = b.offsets();
    let values: usize = b.lens.iter().sum();
    let mut buf = vec![T::default(); b.buffer_len()];
    for (j, &k) in b.params.iter().enumerate() {
        if let Some(g) = grads.get(vars[k].as_tensor()) {
            let v = params::flat::<T>(g).map_err(boxed)?;
            buf[offsets[j]..offsets[j] + v.len()].copy_from_slice(&v);
            buf[values + j] = T::from_f64(1.0);
        }
    }
    let sum = T::values(ctx.all_reduce(ReduceOp::Sum, T::exec(buf))?)
        .ok_or("an all-reduce changed dtype")?;
    let n = shared.replicas as f64;
    for (j, &k) in b.params.iter().enumerate() {
        let var = vars[k].as_tensor();
        if sum[values + j].to_f64() > 0.0 {
            let g: Vec<T> = sum[offsets[j]..offsets[j] + b.lens[j]]
                .iter()
                .map(|x| T::from_f64(x.to_f64() / n))
                .collect();
            grads.insert(var, params::tensor(g, &shared.params[k].shape).map_err(boxed)?);
        } else {
            grads.remove(var);
            without.push(k);
        }
    }
    Ok(without)
}

/// FSDP: the parameters of every bucket gathered from their shards, as variables a
/// model can be built over.
fn gather(
    ctx: &ReplicaContext,
    shared: &Shared<impl Sized>,
    shards: &[Var],
) -> std::result::Result<Vec<Var>, ReplicaError> {
    let whole = gather_in(ctx, shared, shards, &shared.gathers)?;
    whole.into_iter().map(|v| v.ok_or_else(|| "a parameter missed the gather".into())).collect()
}

/// The parameters of `buckets` gathered (the others `None`).
fn gather_in(
    ctx: &ReplicaContext,
    shared: &Shared<impl Sized>,
    shards: &[Var],
    buckets: &[Bucket],
) -> std::result::Result<Vec<Option<Var>>, ReplicaError> {
    let mut whole: Vec<Option<Var>> = vec![None; shards.len()];
    for b in buckets {
        match b.kind {
            Kind::F32 => gather_bucket::<f32>(ctx, b, shared, shards, &mut whole)?,
            Kind::F64 => gather_bucket::<f64>(ctx, b, shared, shards, &mut whole)?,
        }
    }
    Ok(whole)
}

fn gather_bucket<T: Elem>(
    ctx: &ReplicaContext,
    b: &Bucket,
    shared: &Shared<impl Sized>,
    shards: &[Var],
    whole: &mut [Option<Var>],
) -> std::result::Result<(), ReplicaError> {
    let offsets = b.offsets();
    let slot: usize = b.lens.iter().sum();
    let mut buf = vec![T::default(); slot];
    for (j, &k) in b.params.iter().enumerate() {
        let v = params::flat::<T>(shards[k].as_tensor()).map_err(boxed)?;
        buf[offsets[j]..offsets[j] + v.len()].copy_from_slice(&v);
    }
    let all = T::values(ctx.all_gather(0, T::exec(buf))?).ok_or("an all-gather changed dtype")?;
    for (j, &k) in b.params.iter().enumerate() {
        let (p, plan) = (&shared.params[k], &shared.plans[k]);
        let views = plan
            .regions
            .iter()
            .enumerate()
            .map(|(q, region)| {
                let at = q * slot + offsets[j];
                ArrayViewD::from_shape(IxDyn(&extent(region)), &all[at..at + elems(region)])
            })
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let full = meshwork_sharding::assemble(&views, &plan.sharding, &p.shape, Mode::Uneven)?;
        let values = params::into_vec(full);
        whole[k] = Some(
            Var::from_tensor(&params::tensor(values, &p.shape).map_err(boxed)?).map_err(boxed)?,
        );
    }
    Ok(())
}

/// FSDP: a bucket of whole gradients (`source`, one per parameter of the bucket, none
/// where this replica has none) reduce-scattered: each replica gets the sum of its
/// shards' gradients over the replicas, averaged, as its shard variables' in `grads`.
fn reduce_scatter<T: Elem>(
    ctx: &ReplicaContext,
    b: &Bucket,
    shared: &Shared<impl Sized>,
    source: &[Option<Tensor>],
    shards: &[Var],
    grads: &mut GradStore,
) -> std::result::Result<Vec<usize>, ReplicaError> {
    let mut without = Vec::new();
    let (n, r) = (shared.replicas, ctx.replica_id());
    let offsets = b.offsets();
    let values: usize = b.lens.iter().sum();
    let chunk = b.buffer_len();
    let mut buf = vec![T::default(); chunk * n];
    for (j, &k) in b.params.iter().enumerate() {
        let Some(g) = &source[j] else { continue };
        let (p, plan) = (&shared.params[k], &shared.plans[k]);
        let g = ArrayD::from_shape_vec(IxDyn(&p.shape), params::flat::<T>(g).map_err(boxed)?)?;
        for (q, part) in meshwork_sharding::shard(&g.view(), &plan.sharding, Mode::Uneven)?
            .into_iter()
            .enumerate()
        {
            let at = q * chunk + offsets[j];
            let data = part.data.as_slice().ok_or("a shard that is not contiguous")?;
            buf[at..at + data.len()].copy_from_slice(data);
            buf[q * chunk + values + j] = T::from_f64(1.0);
        }
    }
    let mine = T::values(ctx.reduce_scatter(ReduceOp::Sum, 0, T::exec(buf))?)
        .ok_or("a reduce-scatter changed dtype")?;
    for (j, &k) in b.params.iter().enumerate() {
        let shard = shards[k].as_tensor();
        let region = &shared.plans[k].regions[r];
        // The flag counts the replicas with a gradient: the same on every replica.
        let some = mine[values + j].to_f64() > 0.0;
        if some && elems(region) > 0 {
            let g: Vec<T> = mine[offsets[j]..offsets[j] + elems(region)]
                .iter()
                .map(|x| T::from_f64(x.to_f64() / n as f64))
                .collect();
            grads.insert(shard, params::tensor(g, &extent(region)).map_err(boxed)?);
        } else {
            grads.remove(shard);
        }
        if !some {
            without.push(k);
        }
    }
    Ok(without)
}
