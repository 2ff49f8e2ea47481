//! The interpreter back end: each device's program on the fast interpreter, on the
//! executor's device threads — collectives over the executor's replica groups
//! ([`MeshCollectives`]), transfers through its point-to-point mailbox
//! ([`ReplicaChannels`]), `emit` through the strategy's outfeed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use meshwork_executor::{ReplicaContext, ReplicaGroups};
use meshwork_partition::placed::Part;
use meshwork_partition::spmd::Partitioned;
use meshwork_program::{Channels, Collectives, HostSink, Program};
use meshwork_types::{DType, ReduceOp, Tensor, TensorSpec};

use super::{Backend, PlacedExecutable, SpmdExecutable};
use crate::Result;

mod dataflow;
mod placed;
mod spmd;
#[cfg(test)]
mod tests;

/// meshwork's own back end: the fast interpreter on the executor's devices. Each
/// device gets an equal share of the machine's cores (`cores / devices` threads).
/// Clones share its count of the programs it prepared.
#[derive(Debug, Clone, Default)]
pub struct Interpreter {
    compiles: Arc<std::sync::atomic::AtomicU64>,
}

impl Interpreter {
    /// A back end that has prepared nothing yet.
    pub fn new() -> Interpreter {
        Interpreter::default()
    }

    fn compiled_one(&self) {
        self.compiles.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Compiles a per-device program written by hand (as `shard_map`'s body: its
    /// collectives over replica groups of positions), position `r` on the strategy's
    /// device `placement[r]`; otherwise as [`Backend::compile_spmd`].
    pub fn compile_per_device(
        &self,
        program: &Program,
        placement: &[usize],
        resident: &[bool],
        carry: &[(usize, usize)],
    ) -> Box<dyn SpmdExecutable> {
        self.compiled_one();
        Box::new(spmd::Devices::compile(program, 0, placement, resident, carry))
    }
}

impl Backend for Interpreter {
    fn name(&self) -> &'static str {
        "interpreter"
    }

    fn compile_spmd(
        &self,
        part: &Partitioned,
        placement: &[usize],
        resident: &[bool],
        carry: &[(usize, usize)],
    ) -> Result<Box<dyn SpmdExecutable>> {
        self.compiled_one();
        Ok(Box::new(spmd::Devices::compile(part.program(), 0, placement, resident, carry)))
    }

    fn compile_spmd_local(
        &self,
        part: &Partitioned,
        local: std::ops::Range<usize>,
        placement: &[usize],
        resident: &[bool],
        carry: &[(usize, usize)],
    ) -> Result<Box<dyn SpmdExecutable>> {
        self.compiled_one();
        Ok(Box::new(spmd::Devices::compile(
            part.program(),
            local.start,
            placement,
            resident,
            carry,
        )))
    }

    fn compile_placed(
        &self,
        parts: &[Part],
        placement: &[usize],
        devices: usize,
    ) -> Result<Box<dyn PlacedExecutable>> {
        self.compiled_one();
        Ok(Box::new(placed::Parts::compile(parts, placement, devices)?))
    }

    fn compiles(&self) -> u64 {
        self.compiles.load(std::sync::atomic::Ordering::Relaxed)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

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
    /// Counts each collective's result, where the run is counted.
    counter: Option<&'a crate::backend::TrafficCounter>,
    groups: Mutex<HashMap<Vec<Vec<usize>>, ReplicaGroups>>,
    /// The executor's error when a collective failed because a peer had.
    peer: Mutex<Option<meshwork_executor::Error>>,
}

impl<'a> MeshCollectives<'a> {
    pub(crate) fn new(ctx: &'a ReplicaContext) -> MeshCollectives<'a> {
        MeshCollectives { ctx, counter: None, groups: Mutex::default(), peer: Mutex::default() }
    }

    /// Collectives whose results `counter` counts.
    pub(crate) fn counted(
        ctx: &'a ReplicaContext,
        counter: &'a crate::backend::TrafficCounter,
    ) -> MeshCollectives<'a> {
        MeshCollectives { counter: Some(counter), ..MeshCollectives::new(ctx) }
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
        if let Some(c) = self.counter {
            c.moved(out.byte_size() as u64);
        }
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
    /// Counts what it streams to the host.
    pub(crate) counter: Option<&'a crate::backend::TrafficCounter>,
}

impl HostSink for FirstReplicaHost<'_> {
    fn emit(&self, consumer: u32, values: &[Tensor]) -> meshwork_program::Result<()> {
        if self.ctx.replica_id() != 0 {
            return Ok(());
        }
        if let Some(c) = self.counter {
            c.returned(crate::backend::bytes_of(values));
        }
        let mut tensors = Vec::with_capacity(values.len() + 1);
        tensors.push(Tensor::I64(ndarray::arr0(self.step as i64).into_dyn()));
        tensors.extend(values.iter().cloned());
        self.ctx.emit(consumer, &tensors).map_err(comm)
    }
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

/// The program crate's channels over an executor replica (peers are replicas).
pub(crate) struct ReplicaChannels<'a> {
    pub(crate) ctx: &'a ReplicaContext,
    /// The executor's error when a transfer failed because a peer had.
    pub(crate) peer: Mutex<Option<meshwork_executor::Error>>,
    /// Counts what it sends, where the run is counted.
    pub(crate) counter: Option<&'a crate::backend::TrafficCounter>,
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
    pub(crate) fn failure(&self, e: meshwork_program::Error) -> ReplicaError {
        match lock(&self.peer).take() {
            Some(peer) => ReplicaError::Peer(peer),
            None => ReplicaError::Program(e),
        }
    }
}

impl Channels for ReplicaChannels<'_> {
    fn send(&self, channel: u32, peer: usize, x: Tensor) -> meshwork_program::Result<()> {
        if let Some(c) = self.counter {
            c.moved(x.byte_size() as u64);
        }
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
