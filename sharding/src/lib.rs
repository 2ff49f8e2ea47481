//! meshwork's sharding: XLA/JAX tile-assignment shardings and the data movement they
//! imply.
//!
//! Meshes, partition specs and `NamedSharding` lowered to XLA's `HloSharding` exactly as
//! JAX lowers them; XLA's text form parsed and printed byte for byte; index maps per
//! device; `ndarray` tensors split into shards, assembled back, and resharded with a
//! plan that moves the fewest bytes; the variable-reshard state machine.
//!
//! It is **not** a compiler: it does not propagate shardings through a graph or partition
//! programs, and it does not run collectives (that is `meshwork-executor`).
//!
//! The mesh, sharding and data APIs arrive with the sharding issue; so far the crate
//! holds its error type:
//!
//! ```
//! use meshwork_sharding::Error;
//! use meshwork_types::Shape;
//!
//! let err: Error = Shape::new(&[usize::MAX, 2]).unwrap_err().into();
//! assert!(err.to_string().contains("more elements than fit"));
//! ```

mod error;

pub use error::{Error, Result};
