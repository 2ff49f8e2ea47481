//! The executor crate's error type.

use std::time::Duration;

use meshwork_types::DType;

/// Everything that can go wrong while running a program on replicas.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A vocabulary value (dtype, shape, device id) in the input was invalid.
    #[error(transparent)]
    Types(#[from] meshwork_types::Error),
    /// A dtype the collectives do not carry.
    #[error("{op} of a {dtype} tensor: collectives carry f32, f64, i32 and i64")]
    UnsupportedDType {
        /// The collective (or `buffer`).
        op: &'static str,
        /// The dtype.
        dtype: DType,
    },
    /// A runtime needs at least one device.
    #[error("a runtime needs at least one device")]
    NoDevices,
    /// More replicas than devices, or inputs for a different number of replicas.
    #[error("{replicas} replicas given for {devices} devices")]
    ReplicaCount {
        /// Replicas asked for.
        replicas: usize,
        /// Devices available.
        devices: usize,
    },
    /// A placement of replicas on devices that is not one distinct device of the
    /// runtime per replica.
    #[error("placement {placement:?} must give each replica a distinct device of 0..{devices}")]
    Placement {
        /// The placement.
        placement: Vec<usize>,
        /// Devices in the runtime.
        devices: usize,
    },
    /// A device index past the runtime's devices.
    #[error("device {device} is not one of the runtime's devices 0..{devices}")]
    NoSuchDevice {
        /// The device asked for.
        device: usize,
        /// Devices in the runtime.
        devices: usize,
    },
    /// Replica groups that do not cover every replica exactly once.
    #[error("replica groups {groups:?} must hold each of replicas 0..{replicas} exactly once")]
    BadGroups {
        /// The groups.
        groups: Vec<Vec<usize>>,
        /// The number of replicas.
        replicas: usize,
    },
    /// The replicas of a collective disagree on what they are doing (op, dtype, shape).
    #[error(
        "collective {op} in group {group:?}: replica {replica} passed {actual}, replica {first} passed {expected}"
    )]
    Mismatch {
        /// The collective.
        op: &'static str,
        /// The group's replicas.
        group: Vec<usize>,
        /// The first replica of the group.
        first: usize,
        /// What the first replica passed.
        expected: String,
        /// The replica that disagreed.
        replica: usize,
        /// What it passed.
        actual: String,
    },
    /// A collective's arguments that cannot work (an axis past the rank, a length that
    /// does not divide, a bad root or pair).
    #[error("collective {op} on replica {replica}: {problem}")]
    BadArgument {
        /// The collective.
        op: &'static str,
        /// The replica.
        replica: usize,
        /// What is wrong.
        problem: String,
    },
    /// Replicas that never reached a rendezvous within the timeout.
    #[error(
        "collective {op} timed out after {timeout:?} waiting for replicas {missing:?} of group {group:?}"
    )]
    Timeout {
        /// The collective.
        op: &'static str,
        /// The group's replicas.
        group: Vec<usize>,
        /// Replicas that never arrived.
        missing: Vec<usize>,
        /// The timeout.
        timeout: Duration,
    },
    /// A peer failed, so the collective cannot complete.
    #[error("replica {failed} failed, so replica {replica} cannot finish collective {op}")]
    PeerFailed {
        /// The replica that failed.
        failed: usize,
        /// The replica that was waiting.
        replica: usize,
        /// The collective it was in.
        op: &'static str,
    },
    /// A replica's run ended without sending what a peer waits to receive.
    #[error(
        "replica {to} waits for tag {tag} from replica {from}, whose run ended without sending it"
    )]
    NotSent {
        /// The replica that was to send.
        from: usize,
        /// The replica waiting.
        to: usize,
        /// The transfer's tag.
        tag: u64,
    },
    /// The program failed on a replica.
    #[error("replica {replica} failed: {message}")]
    ReplicaFailed {
        /// The replica.
        replica: usize,
        /// What it said.
        message: String,
    },
    /// The program panicked on a replica.
    #[error("replica {replica} panicked: {message}")]
    ReplicaPanicked {
        /// The replica.
        replica: usize,
        /// The panic message.
        message: String,
    },
    /// MPI could not be set up as meshwork needs it.
    #[error("MPI: {message}")]
    Mpi {
        /// What was wrong.
        message: String,
    },
    /// The MPI job has a different number of processes than expected: typically a
    /// binary linked against one MPI started by another MPI's launcher, which runs
    /// separate one-process jobs.
    #[error(
        "the MPI job has {actual} processes but {expected_by} expects {expected}; is the binary \
         started by the launcher of the MPI it is linked against?"
    )]
    WorldSize {
        /// Processes expected.
        expected: usize,
        /// Processes in the job.
        actual: usize,
        /// Who expected them: the caller or a launcher environment variable.
        expected_by: &'static str,
    },
    /// A tensor of this shape and dtype would hold more bytes than memory can address.
    #[error("a {dtype} tensor of shape {shape:?} is larger than memory can address")]
    TooLarge {
        /// The dtype asked for.
        dtype: DType,
        /// The shape asked for.
        shape: Vec<usize>,
    },
    /// The outfeed sink refused data.
    #[error("replica {replica}: outfeed sink failed: {message}")]
    Outfeed {
        /// The replica.
        replica: usize,
        /// What it said.
        message: String,
    },
}

/// `Result` with the executor crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
