//! The bridge's error type.

/// Everything that can go wrong while training a candle model on meshwork's devices.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// candle failed on the host (building a model, converting a tensor).
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    /// A step failed on the devices: a replica's error or panic (the user's forward,
    /// backward or loss, the exchange), reported on every replica. Replicas agree
    /// before any optimizer steps, so such a failure leaves every replica's
    /// parameters and optimizer state as they were (buffers its forward wrote, such as
    /// BatchNorm statistics, are replica 0's again after the next step); a failure
    /// inside an optimizer's update is [`Error::Diverged`] from then on.
    #[error(transparent)]
    Devices(#[from] meshwork_executor::Error),
    /// A sharding (a dim that cannot be split, a bad mesh).
    #[error(transparent)]
    Sharding(#[from] meshwork_sharding::Error),
    /// A checkpoint could not be written or read.
    #[error(transparent)]
    Checkpoint(#[from] meshwork_checkpoint::Error),
    /// A replica failed in its optimizer update (or in a restore) after the others had
    /// made theirs, so the replicas may differ: the trainer refuses to step or save
    /// until a [`restore`](crate::Trainer::restore) succeeds.
    #[error(
        "step {step} failed in an optimizer update after other replicas had made theirs; the replicas may differ: restore a checkpoint"
    )]
    Diverged {
        /// The step (counted from 0 since the trainer was made or restored).
        step: usize,
    },
    /// A batch whose rows do not split evenly over the replicas.
    #[error("input {input} has {rows} rows, which do not split evenly over {replicas} replicas")]
    Batch {
        /// The input's position.
        input: usize,
        /// Its rows (dim 0).
        rows: usize,
        /// Replicas in the run.
        replicas: usize,
    },
    /// A parameter of a dtype the bridge does not exchange (it takes f32 and f64).
    #[error("parameter {name} is {dtype:?}; the bridge trains f32 and f64 parameters")]
    DType {
        /// The parameter.
        name: String,
        /// Its dtype.
        dtype: candle_core::DType,
    },
    /// A model whose builder asked for other parameters on another call (names,
    /// shapes or order): every replica must build the same model.
    #[error("the model's builder is not deterministic: {problem}")]
    Builder {
        /// What differed.
        problem: String,
    },
    /// A parameter that cannot be sharded as asked.
    #[error("parameter {name} of shape {shape:?}: {problem}")]
    Shard {
        /// The parameter.
        name: String,
        /// Its shape.
        shape: Vec<usize>,
        /// What is wrong.
        problem: String,
    },
    /// A safetensors file or a checkpoint that does not hold what the model needs.
    #[error("{path}: {problem}")]
    Load {
        /// The file or directory.
        path: String,
        /// What is wrong.
        problem: String,
    },
    /// Bad configuration (a zero bucket size, no replicas).
    #[error("{problem}")]
    Config {
        /// What is wrong.
        problem: String,
    },
}

/// The bridge's result type.
pub type Result<T> = std::result::Result<T, Error>;
