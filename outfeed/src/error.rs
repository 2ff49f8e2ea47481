//! The outfeed crate's error type.

use std::io;

use meshwork_types::TensorSpec;

/// Everything that can go wrong while framing, sending or receiving a stream. Receiver
/// errors carry the source (and the consumer, where known): they are reported as events
/// and collected by `shutdown()`, never aborts.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A vocabulary value (dtype, shape) was invalid.
    #[error(transparent)]
    Types(#[from] meshwork_types::Error),
    /// Consumer id 0 is the shutdown marker.
    #[error("Consumer ID cannot be a reserved value: 0 is the shutdown marker")]
    ReservedConsumerId,
    /// A consumer id registered again with another spec (the seed's error).
    #[error("consumer {consumer}: payload spec {new:?} does not match previous spec {previous:?}")]
    ConflictingSpec {
        /// The consumer id.
        consumer: u32,
        /// The spec registered first.
        previous: Vec<TensorSpec>,
        /// The spec given now.
        new: Vec<TensorSpec>,
    },
    /// A frame's first word is not 271828.
    #[error(
        "source {stream}: bad magic {magic:#x} (expected 271828); the stream is corrupt or not an outfeed stream"
    )]
    BadMagic {
        /// The stream (source index).
        stream: usize,
        /// The word read.
        magic: u32,
    },
    /// A frame of a wire-format version this reader does not know.
    #[error("source {stream}: frame version {version} is not supported (this reader knows 1)")]
    UnsupportedVersion {
        /// The stream (source index).
        stream: usize,
        /// The version read.
        version: u16,
    },
    /// A frame longer than the configured cap (checked before any allocation).
    #[error(
        "source {stream}: frame for consumer {consumer} is {len} bytes, over the {cap}-byte cap"
    )]
    FrameTooLong {
        /// The stream (source index).
        stream: usize,
        /// The consumer.
        consumer: u32,
        /// The payload length announced.
        len: u64,
        /// The cap.
        cap: u64,
    },
    /// The payload's CRC32C differs from the header's.
    #[error(
        "source {stream}: checksum mismatch on a frame for consumer {consumer} (header {expected:#010x}, payload {actual:#010x})"
    )]
    Checksum {
        /// The stream (source index).
        stream: usize,
        /// The consumer.
        consumer: u32,
        /// CRC in the header.
        expected: u32,
        /// CRC of the payload.
        actual: u32,
    },
    /// A consumer id nobody registered (the seed aborted here).
    #[error(
        "source {stream}: unknown consumer id {consumer}; perhaps the sender uses another registry"
    )]
    UnknownConsumer {
        /// The stream (source index).
        stream: usize,
        /// The consumer id.
        consumer: u32,
    },
    /// A payload whose size does not match the consumer's registered spec.
    #[error(
        "source {stream}: payload of {len} bytes for consumer {consumer}, whose spec needs {expected}"
    )]
    PayloadMismatch {
        /// The stream (source index).
        stream: usize,
        /// The consumer.
        consumer: u32,
        /// Bytes received.
        len: usize,
        /// Bytes the spec needs.
        expected: usize,
    },
    /// Tensors to send that do not match the consumer's spec.
    #[error("consumer {consumer}: tensor {index} is {actual}, the spec says {expected}")]
    TensorMismatch {
        /// The consumer.
        consumer: u32,
        /// Index of the tensor.
        index: usize,
        /// What was given.
        actual: String,
        /// What the spec says.
        expected: String,
    },
    /// A source ended inside a frame.
    #[error("source {stream}: the stream ended in the middle of a frame ({got} of {needed} bytes)")]
    Truncated {
        /// The stream (source index).
        stream: usize,
        /// Bytes of the frame read.
        got: usize,
        /// Bytes the frame needed.
        needed: usize,
    },
    /// An I/O error on a source or sink.
    #[error("source {stream}: {error}")]
    Io {
        /// The stream (source or sink) index.
        stream: usize,
        /// The error.
        error: io::Error,
    },
    /// A callback returned an error.
    #[error("source {stream}, consumer {consumer}: callback failed: {message}")]
    Callback {
        /// The stream (source index).
        stream: usize,
        /// The consumer.
        consumer: u32,
        /// What it said.
        message: String,
    },
    /// A callback panicked.
    #[error("source {stream}, consumer {consumer}: callback panicked: {message}")]
    CallbackPanicked {
        /// The stream (source index).
        stream: usize,
        /// The consumer.
        consumer: u32,
        /// The panic message.
        message: String,
    },
    /// The sink's receiver is gone.
    #[error("the receiving side of the outfeed is closed")]
    Closed,
}

/// `Result` with the outfeed crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
