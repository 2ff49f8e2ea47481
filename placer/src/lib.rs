//! meshwork's placer: assigns every op of a dataflow graph to a device.
//!
//! It makes the decisions TensorFlow 2.21's placer makes — device-name specs and their
//! merges, colocation groups built from `loc:@` lists and ref/resource edges, kernel
//! support per device type, soft placement — and reports the same failures as typed
//! errors that name the nodes and the chain of constraints. On top of that it can choose
//! by cost among the devices the constraints allow.
//!
//! It is **not** an executor: it never runs an op, and it knows nothing of the executor's
//! kernels except through the op registry trait it owns. It does not shard tensors (that
//! is `meshwork-sharding`).
//!
//! The graph, registry and placement API arrive with the placer issue; so far the crate
//! holds its error type:
//!
//! ```
//! use meshwork_placer::Error;
//! use meshwork_types::Shape;
//!
//! let err: Error = "[2,x]".parse::<Shape>().unwrap_err().into();
//! assert!(err.to_string().contains("dimension 1"));
//! ```

mod error;

pub use error::{Error, Result};
