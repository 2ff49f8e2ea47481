//! Running partitioned programs on a strategy's devices: the program crate's
//! communication traits over the executor's collectives, and moving tensors between
//! their global form and their per-device layouts.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use meshwork_executor::{ReplicaContext, ReplicaGroups};
use meshwork_program::fast::{Executable, Options};
use meshwork_program::{Collectives, Env, HostSink};
use meshwork_sharding::spmd::Layout;
use meshwork_sharding::{Mesh, Mode, assemble, shard};
use meshwork_types::{Element, ReduceOp, Shape, Tensor, TensorSpec, each_tensor, with_element};
use ndarray::ArrayD;

use crate::{Error, Result, partition_error};
use meshwork_partition::spmd::Partitioned;

fn comm(e: impl std::fmt::Display) -> meshwork_program::Error {
    meshwork_program::Error::Communication { at: "collective".into(), problem: e.to_string() }
}

/// A bool tensor as i32 (collectives carry numbers), with whether it was one.
pub(crate) fn numeric(t: Tensor) -> (Tensor, bool) {
    match t {
        Tensor::Bool(a) => (Tensor::I32(a.mapv(i32::from)), true),
        t => (t, false),
    }
}

/// An i32 result back as the bool tensor it was made from.
pub(crate) fn boolean(t: Tensor) -> Tensor {
    match t {
        Tensor::I32(a) => Tensor::Bool(a.mapv(|x| x != 0)),
        t => t,
    }
}

/// The program crate's collectives over an executor replica (replica ids are mesh
/// positions); replica groups are validated once per distinct list.
pub(crate) struct MeshCollectives<'a> {
    pub(crate) ctx: &'a ReplicaContext,
    groups: Mutex<HashMap<Vec<Vec<usize>>, ReplicaGroups>>,
    /// The executor's error when a collective failed because a peer had.
    peer: Mutex<Option<meshwork_executor::Error>>,
}

impl<'a> MeshCollectives<'a> {
    pub(crate) fn new(ctx: &'a ReplicaContext) -> MeshCollectives<'a> {
        MeshCollectives { ctx, groups: Mutex::default(), peer: Mutex::default() }
    }

    /// This replica's failure: the executor's `PeerFailed` when a collective failed
    /// because another replica had (so the run reports that replica's error, not this
    /// one's consequence), else `e`.
    pub(crate) fn failure(&self, e: meshwork_program::Error) -> ReplicaError {
        match self.peer.lock().unwrap_or_else(PoisonError::into_inner).take() {
            Some(peer) => ReplicaError::Peer(peer),
            None => ReplicaError::Program(e),
        }
    }

    fn groups(&self, groups: &[Vec<usize>]) -> meshwork_program::Result<ReplicaGroups> {
        let mut cache = self.groups.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(g) = cache.get(groups) {
            return Ok(g.clone());
        }
        let g = self.ctx.groups(groups.to_vec()).map_err(comm)?;
        cache.insert(groups.to_vec(), g.clone());
        Ok(g)
    }

    fn run(
        &self,
        x: Tensor,
        f: impl FnOnce(Tensor) -> meshwork_executor::Result<Tensor>,
    ) -> meshwork_program::Result<Tensor> {
        let (x, as_bool) = numeric(x);
        let out = f(x).map_err(|e| {
            if matches!(e, meshwork_executor::Error::PeerFailed { .. }) {
                *self.peer.lock().unwrap_or_else(PoisonError::into_inner) = Some(e.clone());
            }
            comm(e)
        })?;
        Ok(if as_bool { boolean(out) } else { out })
    }
}

impl Collectives for MeshCollectives<'_> {
    fn replica_id(&self) -> usize {
        self.ctx.replica_id()
    }
    fn all_reduce(
        &self,
        x: Tensor,
        op: ReduceOp,
        groups: &[Vec<usize>],
    ) -> meshwork_program::Result<Tensor> {
        let g = self.groups(groups)?;
        self.run(x, |t| self.ctx.all_reduce_in(&g, op, t))
    }
    fn all_gather(
        &self,
        x: Tensor,
        axis: usize,
        groups: &[Vec<usize>],
    ) -> meshwork_program::Result<Tensor> {
        let g = self.groups(groups)?;
        self.run(x, |t| self.ctx.all_gather_in(&g, axis, t))
    }
    fn reduce_scatter(
        &self,
        x: Tensor,
        op: ReduceOp,
        axis: usize,
        groups: &[Vec<usize>],
    ) -> meshwork_program::Result<Tensor> {
        let g = self.groups(groups)?;
        self.run(x, |t| self.ctx.reduce_scatter_in(&g, op, axis, t))
    }
    fn all_to_all(
        &self,
        x: Tensor,
        split_axis: usize,
        concat_axis: usize,
        groups: &[Vec<usize>],
    ) -> meshwork_program::Result<Tensor> {
        let g = self.groups(groups)?;
        self.run(x, |t| self.ctx.all_to_all_in(&g, split_axis, concat_axis, t))
    }
    fn collective_permute(
        &self,
        x: Tensor,
        pairs: &[(usize, usize)],
    ) -> meshwork_program::Result<Tensor> {
        self.run(x, |t| self.ctx.collective_permute(pairs, t))
    }
}

/// `emit` of an SPMD program: its operands are replicated, so replica 0 alone
/// streams them to the strategy's metrics (the others' copies are the same), tagged
/// with the step, as [`StrategyContext::emit`](crate::StrategyContext::emit) tags them.
pub(crate) struct FirstReplicaHost<'a> {
    pub(crate) ctx: &'a ReplicaContext,
    pub(crate) step: u64,
}

impl HostSink for FirstReplicaHost<'_> {
    fn emit(&self, consumer: u32, values: &[Tensor]) -> meshwork_program::Result<()> {
        if self.ctx.replica_id() != 0 {
            return Ok(());
        }
        let mut tensors = Vec::with_capacity(values.len() + 1);
        tensors.push(Tensor::I64(ndarray::arr0(self.step as i64).into_dyn()));
        tensors.extend(values.iter().cloned());
        self.ctx.emit(consumer, &tensors).map_err(comm)
    }
}

/// Splits global `t` into each mesh position's part under `layout` (never pending).
pub(crate) fn split(mesh: &Mesh, layout: &Layout, t: &Tensor) -> Result<Vec<Tensor>> {
    fn parts<T: Element>(a: &ArrayD<T>, s: &meshwork_sharding::Sharding) -> Result<Vec<Tensor>> {
        Ok(shard(&a.view(), s, Mode::Strict)?.into_iter().map(|p| T::wrap(p.data)).collect())
    }
    let sharding = layout.to_named(mesh)?.to_sharding(t.shape().len())?;
    each_tensor!(t, a => parts(a, &sharding))
}

/// How a fed parameter is split, worked out once: its layout as a sharding over the
/// mesh positions and each position's part's shape.
#[derive(Debug, Clone)]
pub(crate) struct FeedPlan {
    sharding: meshwork_sharding::Sharding,
    local: Vec<usize>,
}

impl FeedPlan {
    /// The plan for a value of global `shape` laid out by `layout` over `mesh`.
    pub(crate) fn new(mesh: &Mesh, layout: &Layout, shape: &[usize]) -> Result<FeedPlan> {
        let sharding = layout.to_named(mesh)?.to_sharding(shape.len())?;
        let local = layout.local_shape(mesh, shape)?;
        Ok(FeedPlan { sharding, local })
    }
}

/// [`split`] by `plan`, into buffers `take(position, spec)` hands out (a device's
/// pool: standard layout, of the part's spec), so a loop feeding the same shapes every
/// step writes into memory it already has.
pub(crate) fn split_with(
    plan: &FeedPlan,
    t: &Tensor,
    take: impl Fn(usize, &TensorSpec) -> meshwork_program::Result<Tensor>,
) -> Result<Vec<Tensor>> {
    let local = TensorSpec::new(t.dtype(), Shape::new(&plan.local)?);
    let n = plan.sharding.device_assignment().len();
    let mut bufs: Vec<Tensor> =
        (0..n).map(|r| take(r, &local)).collect::<meshwork_program::Result<_>>()?;
    fn fill<T: Element>(plan: &FeedPlan, global: &ArrayD<T>, bufs: &mut [Tensor]) -> Result<()> {
        let local = &plan.local;
        let mut outs = Vec::with_capacity(bufs.len());
        for b in bufs.iter_mut() {
            let (dtype, shape) = (b.dtype(), b.shape().to_vec());
            match T::unwrap_mut(b) {
                Some(o) if o.shape() == local.as_slice() => outs.push(o.view_mut()),
                _ => {
                    return Err(partition_error(
                        String::new(),
                        "split",
                        format!(
                            "a pooled buffer of {dtype}{shape:?} for a part of {}{local:?}",
                            T::DTYPE
                        ),
                    ));
                }
            }
        }
        // One part (one device, or every device a whole copy): a plain copy.
        if global.shape() == local.as_slice() {
            for o in &mut outs {
                o.assign(global);
            }
            return Ok(());
        }
        Ok(meshwork_sharding::shard_into(&global.view(), &plan.sharding, Mode::Strict, &mut outs)?)
    }
    each_tensor!(t, a => fill(plan, a, &mut bufs))?;
    Ok(bufs)
}

/// Assembles a global tensor of `shape` from each mesh position's part under `layout`
/// (never pending).
pub(crate) fn join(
    mesh: &Mesh,
    layout: &Layout,
    shape: &[usize],
    parts: &[Tensor],
) -> Result<Tensor> {
    if layout.is_replicated() || mesh.size() == 1 {
        return Ok(parts[0].clone());
    }
    let sharding = layout.to_named(mesh)?.to_sharding(shape.len())?;
    fn glue<T: Element>(
        parts: &[Tensor],
        sharding: &meshwork_sharding::Sharding,
        shape: &[usize],
    ) -> Result<Tensor> {
        let views = parts
            .iter()
            .map(|p| {
                p.as_array::<T>().map(|a| a.view()).ok_or(Error::DTypeMismatch {
                    what: "a value's parts",
                    expected: T::DTYPE,
                    actual: p.dtype(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(T::wrap(assemble(&views, sharding, shape, Mode::Strict)?))
    }
    with_element!(parts[0].dtype(), T => glue::<T>(parts, &sharding, shape))
}

/// How a replica's part of a run failed.
pub(crate) enum ReplicaError {
    /// Its program failed.
    Program(meshwork_program::Error),
    /// The executor's error: a collective or transfer that failed (because another
    /// replica had, or timed out, or was never sent); the executor reports the
    /// replica that failed first.
    Peer(meshwork_executor::Error),
}

impl From<meshwork_program::Error> for ReplicaError {
    fn from(e: meshwork_program::Error) -> ReplicaError {
        ReplicaError::Program(e)
    }
}

/// What one replica does in a run.
pub(crate) type ReplicaStep =
    dyn Fn(&ReplicaContext) -> std::result::Result<(), ReplicaError> + Send + Sync;

/// Runs `f` for every replica of a one-process executor run of `n` replicas on the
/// devices `placement` names, keeping each replica's typed error so the run returns
/// the root failure's own error.
pub(crate) fn run_replicas(
    runtime: &meshwork_executor::Runtime,
    placement: &[usize],
    f: Arc<ReplicaStep>,
) -> Result<()> {
    let stash: Arc<Mutex<Vec<(usize, meshwork_program::Error)>>> = Arc::default();
    let s = stash.clone();
    let program: Arc<meshwork_executor::ReplicaFn> =
        Arc::new(move |ctx: &ReplicaContext, _| match f(ctx) {
            Ok(()) => Ok(Vec::new()),
            // The executor reports the replica that failed first, not the peers
            // that failed because of it.
            Err(ReplicaError::Peer(e)) => Err(e.into()),
            Err(ReplicaError::Program(e)) => {
                let msg = e.to_string();
                s.lock().unwrap_or_else(PoisonError::into_inner).push((ctx.replica_id(), e));
                Err(msg.into())
            }
        });
    let n = placement.len();
    match runtime.run_on(program, vec![Vec::new(); n], placement) {
        Ok(_) => Ok(()),
        Err(err) => {
            let failed = match &err {
                meshwork_executor::Error::ReplicaFailed { replica, .. } => Some(*replica),
                _ => None,
            };
            let mut stash = stash.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(i) = stash.iter().position(|(r, _)| Some(*r) == failed) {
                return Err(stash.swap_remove(i).1.into());
            }
            Err(err.into())
        }
    }
}

impl crate::Strategy {
    /// The executor devices that run mesh positions `0..mesh.size()` (mesh position `r`
    /// on device `mesh.devices()[r]`), or an error if the strategy lacks them or spans
    /// processes (SPMD programs run in one process here).
    pub(crate) fn mesh_placement(&self, mesh: &Mesh) -> Result<Vec<usize>> {
        let devices = self.runtime().devices();
        if self.is_multi_process() {
            return Err(partition_error(
                String::new(),
                "run",
                "SPMD programs run on the devices of one process",
            ));
        }
        mesh.devices()
            .iter()
            .map(|d| {
                let d = d.0 as usize;
                if d < devices {
                    Ok(d)
                } else {
                    Err(partition_error(
                        String::new(),
                        "run",
                        format!("mesh {mesh} names device {d}; the strategy has {devices}"),
                    ))
                }
            })
            .collect()
    }

    /// Runs a partitioned program once on the mesh's devices: `inputs` are the global
    /// parameters (split by their layouts), the results come back assembled. Each call
    /// moves every input in and every output out; [`compile`](crate::Strategy::compile)
    /// keeps state on the devices instead.
    pub fn run_partitioned(&self, p: &Partitioned, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        let mesh = p.mesh();
        let placement = self.mesh_placement(mesh)?;
        check_inputs(p.global(), inputs)?;
        let n = mesh.size();
        let mut per: Vec<Vec<Tensor>> = vec![Vec::with_capacity(inputs.len()); n];
        for (t, l) in inputs.iter().zip(p.inputs()) {
            for (r, part) in split(mesh, l, t)?.into_iter().enumerate() {
                per[r].push(part);
            }
        }
        let options = Options::for_devices(n);
        let slots: Arc<Vec<Mutex<Vec<Tensor>>>> =
            Arc::new(per.into_iter().map(Mutex::new).collect());
        let exe = Arc::new(Executable::compile(p.program(), options));
        let s = slots.clone();
        run_replicas(
            self.runtime(),
            &placement,
            Arc::new(move |ctx| {
                let r = ctx.replica_id();
                let inputs =
                    std::mem::take(&mut *s[r].lock().unwrap_or_else(PoisonError::into_inner));
                let coll = MeshCollectives::new(ctx);
                let host = FirstReplicaHost { ctx, step: 0 };
                let env = Env::local().with_collectives(&coll).with_host(&host);
                let out = exe.run_owned(inputs, &env).map_err(|e| coll.failure(e))?;
                *s[r].lock().unwrap_or_else(PoisonError::into_inner) = out;
                Ok(())
            }),
        )?;
        let mut outs: Vec<Vec<Tensor>> = slots
            .iter()
            .map(|m| std::mem::take(&mut *m.lock().unwrap_or_else(PoisonError::into_inner)))
            .collect();
        let global = p.global();
        let mut results = Vec::with_capacity(global.results().len());
        for (k, (v, l)) in global.results().iter().zip(p.outputs()).enumerate() {
            let parts: Vec<Tensor> =
                outs.iter_mut().map(|o| std::mem::replace(&mut o[k], placeholder())).collect();
            let shape = global.spec(*v).expect("a result").shape.dims().to_vec();
            results.push(join(mesh, l, &shape, &parts)?);
        }
        Ok(results)
    }
}

fn placeholder() -> Tensor {
    Tensor::bool(&[], vec![false]).expect("a scalar")
}

/// Checks that `inputs` are the program's parameters, by spec.
pub(crate) fn check_inputs(program: &meshwork_program::Program, inputs: &[Tensor]) -> Result<()> {
    if inputs.len() != program.params().len() {
        return Err(partition_error(
            String::new(),
            "run",
            format!("{} inputs for {} parameters", inputs.len(), program.params().len()),
        ));
    }
    for (t, p) in inputs.iter().zip(program.params()) {
        if t.spec() != p.spec {
            return Err(partition_error(
                p.name.clone(),
                "run",
                format!("fed {}, the parameter is {}", t.spec(), p.spec),
            ));
        }
    }
    Ok(())
}
