//! What a replica's function sees: its replica and logical device, the collectives
//! over replicas and over logical devices, its variables, and the metrics stream.

use std::cell::RefCell;

use meshwork_executor::{ReplicaContext, ReplicaGroups, Tensor};
use meshwork_types::{DType, DeviceId, ReduceOp};
use ndarray::Axis;

use crate::assignment::DeviceAssignment;
use crate::values::PerReplica;
use crate::variable::{Aggregation, Synchronization, Variable, check_spec};
use crate::{Error, Result, ops};

/// What every replica of one run shares: the layout and the variables' metadata.
pub(crate) struct RunInfo {
    pub(crate) assignment: DeviceAssignment,
    /// Same logical device, every replica: `[[l, L + l, 2L + l, ...] for l]`.
    pub(crate) across_replicas: ReplicaGroups,
    /// One replica's logical devices: `[[rL, ..., rL + L - 1] for r]`.
    pub(crate) across_logical: ReplicaGroups,
    pub(crate) vars: Vec<VarMeta>,
}

/// A variable as a run sees it.
pub(crate) struct VarMeta {
    pub(crate) name: String,
    pub(crate) sync: Synchronization,
    pub(crate) aggregation: Aggregation,
    pub(crate) dtype: DType,
    /// Per logical device: the shape of the shard it holds, if any.
    pub(crate) shard_shapes: Vec<Option<Vec<usize>>>,
}

impl RunInfo {
    pub(crate) fn new(assignment: DeviceAssignment, vars: Vec<VarMeta>) -> Result<RunInfo> {
        let (r, l) = (assignment.num_replicas(), assignment.num_logical_devices());
        let n = r * l;
        let across_replicas =
            ReplicaGroups::new((0..l).map(|k| (k..n).step_by(l).collect()).collect(), n)?;
        let across_logical =
            ReplicaGroups::new((0..r).map(|q| (q * l..(q + 1) * l).collect()).collect(), n)?;
        Ok(RunInfo { assignment, across_replicas, across_logical, vars })
    }
}

/// One replica's (and logical device's) view of a [`Strategy::run`](crate::Strategy::run):
/// `tf.distribute`'s replica context.
///
/// The function runs once per replica and logical device (SPMD): with one logical
/// device per replica that is once per replica; with model parallelism each logical
/// device runs it on its own shards and combines partial results with the `*_logical`
/// collectives.
pub struct StrategyContext<'a> {
    pub(crate) inner: &'a ReplicaContext,
    pub(crate) run: &'a RunInfo,
    pub(crate) replica: usize,
    pub(crate) logical: usize,
    pub(crate) step: usize,
    /// This device's working copy of every variable (an empty placeholder where it
    /// holds none); committed when the whole run succeeds.
    pub(crate) vars: RefCell<Vec<Tensor>>,
}

impl StrategyContext<'_> {
    /// This replica, `0..num_replicas_in_sync()`.
    pub fn replica_id_in_sync_group(&self) -> usize {
        self.replica
    }

    /// Replicas in sync.
    pub fn num_replicas_in_sync(&self) -> usize {
        self.run.assignment.num_replicas()
    }

    /// This logical device of the replica.
    pub fn logical_device(&self) -> usize {
        self.logical
    }

    /// Logical devices per replica.
    pub fn num_logical_devices(&self) -> usize {
        self.run.assignment.num_logical_devices()
    }

    /// The device the assignment names for this replica's logical device. A strategy
    /// made by [`Strategy::new`](crate::Strategy::new) runs it there (on the executor
    /// thread `meshwork-cpu:N` of that device); one given a runtime by
    /// [`Strategy::with_runtime`](crate::Strategy::with_runtime) with fewer devices than
    /// the topology, or spanning processes, runs executor replica `r * L + l` on its
    /// device `r * L + l` of the process instead.
    pub fn device(&self) -> DeviceId {
        self.run.assignment.device(self.replica, self.logical)
    }

    /// The step within a [`Strategy::run_steps`](crate::Strategy::run_steps) loop (0 in
    /// a single-step run).
    pub fn step(&self) -> usize {
        self.step
    }

    /// Reduces `t` over all replicas (each logical device with its counterparts);
    /// every replica gets the result, bit-identical, folded in replica order.
    pub fn all_reduce(&self, op: ReduceOp, t: Tensor) -> Result<Tensor> {
        Ok(self.inner.all_reduce_in(&self.run.across_replicas, op, t)?)
    }

    /// Concatenates every replica's `t` along `axis`, in replica order.
    pub fn all_gather(&self, t: Tensor, axis: usize) -> Result<Tensor> {
        Ok(self.inner.all_gather_in(&self.run.across_replicas, axis, t)?)
    }

    /// Reduces `t` over this replica's logical devices (model parallelism).
    pub fn all_reduce_logical(&self, op: ReduceOp, t: Tensor) -> Result<Tensor> {
        Ok(self.inner.all_reduce_in(&self.run.across_logical, op, t)?)
    }

    /// Concatenates `t` over this replica's logical devices along `axis`.
    pub fn all_gather_logical(&self, t: Tensor, axis: usize) -> Result<Tensor> {
        Ok(self.inner.all_gather_in(&self.run.across_logical, axis, t)?)
    }

    /// `merge_call`: every replica's `value` is gathered and `f` turns them (in
    /// replica order) into one value, as in cross-replica context. `f` runs on every
    /// replica with the same inputs, so it must be deterministic; every replica gets
    /// the same result.
    pub fn merge_call(
        &self,
        value: Tensor,
        f: &dyn Fn(&PerReplica<Tensor>) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let all = self.all_gather(ops::expand(&value), 0)?;
        let values = (0..self.num_replicas_in_sync())
            .map(|r| ops::map!(&all, a => a.index_axis(Axis(0), r).to_owned()))
            .collect();
        f(&PerReplica::new(values))
    }

    fn var(&self, v: &Variable) -> Result<(&VarMeta, Vec<usize>)> {
        let meta = self.run.vars.get(v.id).filter(|m| m.name == v.name).ok_or_else(|| {
            Error::Variable {
                variable: v.name.clone(),
                problem: "not a variable of this strategy".into(),
            }
        })?;
        let shape = meta.shard_shapes[self.logical].clone().ok_or_else(|| Error::Variable {
            variable: v.name.clone(),
            problem: format!("it does not live on logical device {}", self.logical),
        })?;
        Ok((meta, shape))
    }

    /// This device's copy of `v` (its shard, for a split variable).
    pub fn read(&self, v: &Variable) -> Result<Tensor> {
        self.var(v)?;
        Ok(self.vars.borrow()[v.id].clone())
    }

    /// Sets `v` (this device's shard) to `value`, aggregated across replicas as the
    /// variable says; see [`assign_add`](Self::assign_add).
    pub fn assign(&self, v: &Variable, value: Tensor) -> Result<()> {
        self.update(v, value, false)
    }

    /// Adds `delta` to `v` (this device's shard). A sync-on-write variable aggregates
    /// the replicas' deltas (SUM, MEAN, ONLY_FIRST_REPLICA) so every copy gets the same
    /// update; with aggregation NONE every replica must add the same delta, or the run
    /// fails with [`Error::DivergingUpdate`] and no variable changes. A sync-on-read
    /// variable updates this replica's copy only.
    pub fn assign_add(&self, v: &Variable, delta: Tensor) -> Result<()> {
        self.update(v, delta, true)
    }

    fn update(&self, v: &Variable, value: Tensor, add: bool) -> Result<()> {
        let (meta, shape) = self.var(v)?;
        check_spec(&meta.name, &value, meta.dtype, &shape)?;
        let value = if meta.sync == Synchronization::OnRead {
            value
        } else {
            match meta.aggregation {
                Aggregation::None => value,
                Aggregation::Sum => self.all_reduce(ReduceOp::Sum, value)?,
                Aggregation::Mean => self.all_reduce(ReduceOp::Mean, value)?,
                Aggregation::OnlyFirstReplica => {
                    let all = self.all_gather(ops::expand(&value), 0)?;
                    ops::map!(&all, a => a.index_axis(Axis(0), 0).to_owned())
                }
            }
        };
        let mut vars = self.vars.borrow_mut();
        vars[v.id] = if add { ops::add(&vars[v.id], &value)? } else { value };
        Ok(())
    }

    /// `experimental_split_to_logical_devices`: this logical device's piece of `t`
    /// split along each dim into `partition_dims[d]` pieces (the seed's checks, in
    /// its order and wording).
    pub fn split_to_logical_devices(&self, t: &Tensor, partition_dims: &[usize]) -> Result<Tensor> {
        let l = self.num_logical_devices();
        let hlo = meshwork_sharding::split_to_logical_devices(t.shape(), partition_dims, l)?;
        let sharding = crate::variable::logical_sharding(hlo, l)?;
        let mut shards = ops::shard(t, &sharding)?;
        Ok(if shards.len() == 1 { shards.remove(0) } else { shards.swap_remove(self.logical) })
    }

    /// `experimental_replicate_to_logical_devices`: every logical device holds `t`.
    pub fn replicate_to_logical_devices(&self, t: Tensor) -> Tensor {
        t
    }

    /// `experimental_assign_to_logical_device`: `t` on logical device `id` only, so
    /// `Some(t)` there and `None` elsewhere (the seed's range check and wording).
    pub fn assign_to_logical_device(&self, t: Tensor, id: usize) -> Result<Option<Tensor>> {
        meshwork_sharding::assign_to_logical_device(id, self.num_logical_devices())?;
        Ok((id == self.logical).then_some(t))
    }

    /// Streams `tensors` to the host's metrics callback under `consumer`, tagged with
    /// `step` and this replica (see [`Strategy::with_metrics`](crate::Strategy::with_metrics)).
    /// Only logical device 0 of each replica streams; the others' calls are no-ops.
    pub fn emit(&self, consumer: u32, step: u64, tensors: &[Tensor]) -> Result<()> {
        if self.logical != 0 {
            return Ok(());
        }
        let mut all = Vec::with_capacity(tensors.len() + 1);
        all.push(Tensor::I64(ndarray::arr0(step as i64).into_dyn()));
        all.extend_from_slice(tensors);
        Ok(self.inner.emit(consumer, &all)?)
    }
}
