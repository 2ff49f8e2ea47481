//! The façade's error type: its siblings' errors, wrapped.

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
    /// A sharding could not be built or applied.
    #[error(transparent)]
    Sharding(#[from] meshwork_sharding::Error),
    /// An outfeed stream failed.
    #[error(transparent)]
    Outfeed(#[from] meshwork_outfeed::Error),
    /// A replicated program failed.
    #[error(transparent)]
    Executor(#[from] meshwork_executor::Error),
}

/// `Result` with the façade's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
