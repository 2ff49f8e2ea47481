//! The partitioner's error type.

/// What a pass could not do with a program: a sibling crate's error (a program that
/// does not build, a sharding or placement that cannot be), or one of its own checks.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A vocabulary value was invalid.
    #[error(transparent)]
    Types(#[from] meshwork_types::Error),
    /// A program error (an instruction the rewritten program could not build).
    #[error(transparent)]
    Program(#[from] meshwork_program::Error),
    /// A sharding could not be built or applied.
    #[error(transparent)]
    Sharding(#[from] meshwork_sharding::Error),
    /// Placement failed (TensorFlow's rules, or the cost-aware pass).
    #[error(transparent)]
    Placer(#[from] meshwork_placer::Error),
    /// A dim of a program value does not split over the mesh axes its layout tiles it by.
    #[error("{value}: dim {dim} of size {size} does not split into {tiles} tiles over the mesh")]
    Indivisible {
        /// The value (its name, or `%k`).
        value: String,
        /// The dim.
        dim: usize,
        /// Its size.
        size: usize,
        /// The tiles the layout cuts it into.
        tiles: usize,
    },
    /// A program the partitioner cannot partition, or a compiled program cannot run,
    /// as asked.
    #[error("cannot partition {value} ({op}): {problem}")]
    Partition {
        /// The value (its name, or `%k`; empty for the program as a whole).
        value: String,
        /// The op or step concerned.
        op: &'static str,
        /// What is wrong.
        problem: String,
    },
    /// A program that cannot be placed or run as asked.
    #[error("placed program: {value}: {problem}")]
    Placed {
        /// The value, parameter or call concerned (empty for the program as a whole).
        value: String,
        /// What is wrong.
        problem: String,
    },
}

/// `Result` with the partitioner's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
