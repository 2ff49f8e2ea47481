//! The sharding crate's error type.

/// Everything that can go wrong while building a sharding or moving shards.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A vocabulary value (dtype, shape, device id) in the input was invalid.
    #[error(transparent)]
    Types(#[from] meshwork_types::Error),
}

/// `Result` with the sharding crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
