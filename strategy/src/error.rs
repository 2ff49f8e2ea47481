//! The façade's error type: its siblings' errors, wrapped, and its own checks (with
//! `tf.distribute`'s wording where TensorFlow has a message for the same mistake).

use meshwork_types::DType;

/// Everything that can go wrong in the façade: a sibling crate's error, or one of the
/// strategy's own checks.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A vocabulary value was invalid.
    #[error(transparent)]
    Types(#[from] meshwork_types::Error),
    /// Placement failed.
    #[error(transparent)]
    Placer(#[from] meshwork_placer::Error),
    /// A sharding could not be built or applied (including the logical-device checks,
    /// in the seed's wording).
    #[error(transparent)]
    Sharding(#[from] meshwork_sharding::Error),
    /// An outfeed stream failed.
    #[error(transparent)]
    Outfeed(#[from] meshwork_outfeed::Error),
    /// A replicated program failed.
    #[error(transparent)]
    Executor(#[from] meshwork_executor::Error),
    /// A program error.
    #[error(transparent)]
    Program(#[from] meshwork_program::Error),
    /// A compiled program's device state cannot serve the call.
    #[error("compiled program: {problem}")]
    Compiled {
        /// What is wrong.
        problem: String,
    },
    /// A program the partitioner cannot partition or place, or a compiled or placed
    /// program cannot run, as asked.
    #[error(transparent)]
    Partition(Box<meshwork_partition::Error>),

    /// A topology that holds no devices, or hosts that do not divide it.
    #[error("topology {shape:?} with {devices_per_host} devices per host is not a valid mesh")]
    Topology {
        /// The mesh shape.
        shape: Vec<usize>,
        /// Devices per host.
        devices_per_host: usize,
    },
    /// A device assignment that the topology cannot hold.
    #[error(
        "device assignment of computation shape {computation_shape:?} on topology {topology:?}: {problem}"
    )]
    Assignment {
        /// The topology's shape.
        topology: Vec<usize>,
        /// The computation shape asked for.
        computation_shape: Vec<usize>,
        /// What does not fit.
        problem: String,
    },
    /// `experimental_logical_device` with an id past the logical devices (seed wording).
    #[error(
        "`logical_device_id` not in range (was {id}, but there are only {logical_devices} logical devices per replica)."
    )]
    LogicalDeviceScope {
        /// The id given.
        id: usize,
        /// Logical devices per replica.
        logical_devices: usize,
    },
    /// Nothing to work on.
    #[error("{what}: no values")]
    Empty {
        /// What was empty.
        what: &'static str,
    },
    /// Values that must share a dtype do not.
    #[error("{what}: dtype {actual} where {expected} was expected")]
    DTypeMismatch {
        /// What was combined.
        what: &'static str,
        /// The first value's dtype.
        expected: DType,
        /// The differing dtype.
        actual: DType,
    },
    /// Values that must share a shape (except along `axis`) do not.
    #[error("{what}: shape {actual:?} where {expected:?} was expected{}", axis.map(|a| format!(" (except along axis {a})")).unwrap_or_default())]
    ShapeMismatch {
        /// What was combined.
        what: &'static str,
        /// The expected shape.
        expected: Vec<usize>,
        /// The shape found.
        actual: Vec<usize>,
        /// The axis along which shapes may differ.
        axis: Option<usize>,
    },
    /// `reduce` or `gather` along an axis the value does not have (TF's wording).
    #[error("`axis` = {axis} out of range for `value` with rank {rank}")]
    AxisOutOfRange {
        /// The axis.
        axis: usize,
        /// The value's rank.
        rank: usize,
    },
    /// `gather` of scalars.
    #[error("gather needs values of rank > 0 to concatenate, got a scalar")]
    GatherScalar,
    /// A per-replica value with the wrong number of replicas.
    #[error("{what}: {actual} per-replica values for {expected} replicas")]
    PerReplicaCount {
        /// What was given.
        what: &'static str,
        /// Replicas in sync.
        expected: usize,
        /// Values given.
        actual: usize,
    },
    /// A global batch that does not split evenly over the replicas (TF's wording).
    #[error(
        "The `global_batch_size` {global_batch_size} is not divisible by `num_replicas_in_sync` {num_replicas} "
    )]
    BatchNotDivisible {
        /// The global batch size.
        global_batch_size: usize,
        /// Replicas in sync.
        num_replicas: usize,
    },
    /// The tensors of one batch have different numbers of rows.
    #[error("batch {batch}: input {input} has {actual} rows, input 0 has {expected}")]
    BatchRows {
        /// The batch's index.
        batch: usize,
        /// The input.
        input: usize,
        /// Rows of input 0.
        expected: usize,
        /// Rows of this input.
        actual: usize,
    },
    /// `VariableSynchronization::None` (TF's wording).
    #[error(
        "`NONE` variable synchronization mode is not supported with tf.distribute strategy. Please change the `synchronization` for variable: {variable}"
    )]
    SyncNone {
        /// The variable.
        variable: String,
    },
    /// A MEAN-aggregated variable of a non-float dtype (TF's wording).
    #[error(
        "creating distributed tf.Variable with aggregation=MEAN and a non-floating dtype is not supported, please use a different aggregation or dtype (variable {variable}, dtype {dtype})"
    )]
    MeanNonFloat {
        /// The variable.
        variable: String,
        /// Its dtype.
        dtype: DType,
    },
    /// An update under aggregation NONE that would leave the replicas' copies different.
    /// TensorFlow lets the copies silently diverge; meshwork refuses and changes nothing.
    #[error(
        "variable {variable}: replica {replica} wrote a different value than replica 0 (logical device {logical}) under aggregation NONE, so the mirrored copies would diverge; aggregate the update (SUM, MEAN, ONLY_FIRST_REPLICA) or update it in cross-replica context"
    )]
    DivergingUpdate {
        /// The variable.
        variable: String,
        /// The first replica whose copy differs.
        replica: usize,
        /// The logical device (shard) that differs.
        logical: usize,
    },
    /// Cross-replica `assign_add` on a SUM sync-on-read variable (TF's wording).
    #[error(
        "SyncOnReadVariable does not support `assign_add` in cross-replica context when aggregation is set to `tf.VariableAggregation.SUM`. (variable {variable})"
    )]
    SyncOnReadAssignAdd {
        /// The variable.
        variable: String,
    },
    /// A cross-replica read of a sync-on-read variable that has no aggregation.
    #[error(
        "variable {variable} is synchronised on read with aggregation NONE: its replicas' copies have no cross-replica value; read it per replica"
    )]
    ReadNone {
        /// The variable.
        variable: String,
    },
    /// A variable handle this strategy does not hold, or a name used twice.
    #[error("variable {variable}: {problem}")]
    Variable {
        /// The variable.
        variable: String,
        /// What is wrong.
        problem: String,
    },
    /// A value of the wrong shape or dtype for a variable.
    #[error("variable {variable}: got {actual}, the variable (or its shard) is {expected}")]
    VariableValue {
        /// The variable.
        variable: String,
        /// Its spec (`f32[4,8]`).
        expected: String,
        /// The value's spec.
        actual: String,
    },
    /// The metrics stream failed.
    #[error("metrics: {problem}")]
    Metrics {
        /// What went wrong.
        problem: String,
    },
    /// A checkpoint could not be written or read, or its directory used.
    #[error(transparent)]
    Checkpoint(#[from] meshwork_checkpoint::Error),
    /// XLA through a PJRT plugin: loading, lowering, compiling or running.
    #[error(transparent)]
    Xla(#[from] meshwork_xla::Error),
}

/// `Result` with the façade's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The partitioner's error about `value` in `op`, as the façade's.
pub(crate) fn partition_error(
    value: impl Into<String>,
    op: &'static str,
    problem: impl Into<String>,
) -> Error {
    meshwork_partition::Error::Partition { value: value.into(), op, problem: problem.into() }.into()
}

/// A sibling's error the partitioner passed on is that sibling's error here too (a
/// placement the placer refused is [`Error::Placer`] whoever asked for it); the
/// partitioner's own are [`Error::Partition`].
impl From<meshwork_partition::Error> for Error {
    fn from(e: meshwork_partition::Error) -> Error {
        use meshwork_partition::Error as P;
        match e {
            P::Types(e) => Error::Types(e),
            P::Program(e) => Error::Program(e),
            P::Sharding(e) => Error::Sharding(e),
            P::Placer(e) => Error::Placer(e),
            other => Error::Partition(Box::new(other)),
        }
    }
}
