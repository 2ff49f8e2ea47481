//! The shared vocabulary of meshwork: [`DeviceId`], [`DType`], [`Shape`], [`TensorSpec`],
//! [`ReduceOp`] and the host [`Tensor`].
//!
//! Every other meshwork crate speaks these types, so this crate stays small: plain data
//! with checked constructors, text forms that parse back to the same value, and one
//! host tensor type (an `ndarray` array of one of the dtypes) that the executor, the
//! program layer, the outfeed, checkpoints and the bridges all pass around without
//! conversions. It is **not** a tensor library (no arithmetic: that is the program
//! layer's), it knows nothing of graphs, meshes, threads or streams, and it depends on
//! no other meshwork crate. Serde
//! support (hand-written, no derive macros) is behind the `serde` feature; proptest
//! strategies for every type are behind the `proptest` feature, in the `testing` module.
//!
//! Sizes are checked, never wrapped: a [`Shape`] whose element count does not fit in a
//! `usize` cannot be built, and [`Shape::byte_size`] reports an overflow as an error.
//!
//! ```
//! use meshwork_types::{DType, Shape, TensorSpec};
//!
//! let spec: TensorSpec = "f32[8,128]".parse()?;
//! assert_eq!(spec.dtype, DType::F32);
//! assert_eq!(spec.shape.dims(), &[8, 128]);
//! assert_eq!(spec.byte_size()?, 8 * 128 * 4);
//! assert_eq!(spec.to_string(), "f32[8,128]");
//!
//! // Element counts that overflow are errors, not wrapped numbers.
//! assert!(Shape::new(&[usize::MAX, 2]).is_err());
//! # Ok::<(), meshwork_types::Error>(())
//! ```

mod device;
mod dtype;
mod error;
mod reduce;
#[cfg(feature = "serde")]
mod serde_impls;
mod shape;
mod tensor;
#[cfg(any(test, feature = "proptest"))]
pub mod testing;
#[cfg(test)]
mod tests;

pub use device::DeviceId;
pub use dtype::DType;
pub use error::{Error, Result, ShapeSyntax};
pub use reduce::ReduceOp;
pub use shape::{Shape, TensorSpec};
pub use tensor::{Element, Tensor, bf16, f16};
