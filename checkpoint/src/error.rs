//! The checkpoint crate's error type.

use std::path::PathBuf;

/// What can go wrong writing or reading a checkpoint, or using a checkpoint directory.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A vocabulary value was invalid (a dtype or shape in an index).
    #[error(transparent)]
    Types(#[from] meshwork_types::Error),
    /// A sharding in an index, or of an entry, could not be built or applied.
    #[error(transparent)]
    Sharding(#[from] meshwork_sharding::Error),
    /// A checkpoint file or directory that cannot be written or read, or is
    /// incomplete or corrupt.
    #[error("checkpoint {}: {problem}", path.display())]
    File {
        /// The file or directory.
        path: PathBuf,
        /// What is wrong.
        problem: String,
    },
    /// A checkpoint directory meshwork will not use (a file, a symbolic link, a device,
    /// a non-empty directory that is not meshwork's, one another run holds), or a
    /// managed save it refuses (a step that exists).
    #[error("checkpoint directory {}: {problem}", path.display())]
    Directory {
        /// The directory (or the entry in it).
        path: PathBuf,
        /// What is wrong.
        problem: String,
    },
    /// A checkpoint manager could not save a step (a full disk, a file-size limit):
    /// nothing of the step is left under its `step-…` name.
    #[error("checkpoint directory {}: cannot save step {step}: {problem}", path.display())]
    Save {
        /// The checkpoint directory.
        path: PathBuf,
        /// The step.
        step: usize,
        /// What failed (the operating system's words).
        problem: String,
    },
    /// A variable asked for that the checkpoint does not hold.
    #[error("checkpoint {}: variable {variable}: not in the checkpoint", path.display())]
    Missing {
        /// The checkpoint directory.
        path: PathBuf,
        /// The variable.
        variable: String,
    },
    /// A variable saved with another dtype or shape than the one asked for.
    #[error("checkpoint {}: variable {variable}: saved as {saved}, asked for as {wanted}", path.display())]
    Mismatch {
        /// The checkpoint directory.
        path: PathBuf,
        /// The variable.
        variable: String,
        /// Its saved dtype and shape (`f32[4,8]`).
        saved: String,
        /// The dtype and shape asked for.
        wanted: String,
    },
}

/// `Result` with the checkpoint crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
