//! meshwork's executor: one program on many replicas, each on its own device, with the
//! collectives distributed training needs.
//!
//! Devices are worker threads with their own buffers; a program runs once per replica
//! (SPMD) with a context that knows its replica id and offers all-reduce, all-gather,
//! reduce-scatter, all-to-all, broadcast, collective-permute and barrier over replica
//! groups. A failing replica poisons its group, so peers get an error, never a hang.
//! Across machines the same API runs over MPI (feature `mpi`).
//!
//! It is **not** a placer or a sharding library: it runs what it is given on the devices
//! it is told, and moves tensors only through collectives. It does not know the outfeed
//! wire format; programs stream data out through a sink trait this crate owns.
//!
//! The runtime and collectives arrive with the executor issue; so far the crate holds
//! its error type:
//!
//! ```
//! use meshwork_executor::Error;
//! use meshwork_types::DeviceId;
//!
//! let err: Error = "-1".parse::<DeviceId>().unwrap_err().into();
//! assert!(err.to_string().contains("invalid device id"));
//! ```

mod error;

pub use error::{Error, Result};
