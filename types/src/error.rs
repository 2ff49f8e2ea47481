//! The error type of the vocabulary crate.

use crate::{DType, Shape};

/// Why a text could not be read as a [`Shape`](crate::Shape).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ShapeSyntax {
    /// The text does not start with `[` and end with `]`.
    MissingBrackets,
    /// The dimension at this index (0-based) is not a non-negative integer.
    BadDim {
        /// Index of the offending dimension.
        index: usize,
    },
}

impl std::fmt::Display for ShapeSyntax {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ShapeSyntax::MissingBrackets => f.write_str("expected `[d0,d1,...]`"),
            ShapeSyntax::BadDim { index } => {
                write!(f, "dimension {index} is not a non-negative integer")
            }
        }
    }
}

/// Everything that can go wrong when building or parsing a vocabulary type.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A dtype name that is not one of [`DType::ALL`]'s names or aliases.
    #[error(
        "unknown dtype `{name}` (expected one of bool, u8, u16, u32, u64, i8, i16, i32, i64, f16, bf16, f32, f64)"
    )]
    UnknownDType {
        /// The name as given.
        name: String,
    },
    /// A device id that is not a non-negative 32-bit integer.
    #[error("invalid device id `{input}`: expected a non-negative integer below 2^32")]
    InvalidDeviceId {
        /// The text as given.
        input: String,
    },
    /// A shape text that does not parse.
    #[error("invalid shape `{input}`: {reason}")]
    InvalidShape {
        /// The text as given.
        input: String,
        /// What was wrong with it.
        reason: ShapeSyntax,
    },
    /// A tensor-spec text that is not `<dtype>[d0,...]`.
    #[error("invalid tensor spec `{input}`: expected `<dtype>[d0,d1,...]`, e.g. `f32[8,128]`")]
    InvalidTensorSpec {
        /// The text as given.
        input: String,
    },
    /// A reduce-op name that is not sum, mean, min or max.
    #[error("unknown reduce op `{name}` (expected sum, mean, min or max)")]
    UnknownReduceOp {
        /// The name as given.
        name: String,
    },
    /// The product of the dimensions does not fit in a `usize`.
    #[error("shape {dims:?} has more elements than fit in a usize")]
    ElementCountOverflow {
        /// The dimensions whose product overflowed.
        dims: Vec<usize>,
    },
    /// The byte size of a tensor does not fit in a `usize`.
    #[error("a {dtype} tensor of shape {shape} has more bytes than fit in a usize")]
    ByteSizeOverflow {
        /// The shape of the tensor.
        shape: Shape,
        /// Its element type.
        dtype: DType,
    },
    /// A tensor's values are not as many as its shape's elements.
    #[error("a tensor of shape {dims:?} given {elements} elements")]
    TensorSize {
        /// The dims asked for.
        dims: Vec<usize>,
        /// The number of elements given.
        elements: usize,
    },
    /// A tensor's bytes are not as many as its spec needs.
    #[error("a tensor {spec} given {bytes} bytes")]
    TensorBytes {
        /// The tensor's dtype and shape.
        spec: crate::TensorSpec,
        /// The bytes given.
        bytes: usize,
    },
    /// The allocator has no room for a tensor.
    #[error("no memory for a tensor of {bytes} bytes")]
    OutOfMemory {
        /// The bytes asked for.
        bytes: usize,
    },
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
