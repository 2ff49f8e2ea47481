//! The outfeed crate's error type.

/// Everything that can go wrong while framing, sending or receiving a stream.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A vocabulary value (dtype, shape, device id) in the input was invalid.
    #[error(transparent)]
    Types(#[from] meshwork_types::Error),
}

/// `Result` with the outfeed crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
