//! The placer's error type.

/// Everything that can go wrong while reading a graph or placing it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A vocabulary value (dtype, shape, device id) in the input was invalid.
    #[error(transparent)]
    Types(#[from] meshwork_types::Error),
}

/// `Result` with the placer's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
