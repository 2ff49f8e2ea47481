//! meshwork's executor: one program on many replicas, each on its own device, with the
//! collectives distributed training needs.
//!
//! Devices are worker threads with their own buffers; a program runs once per replica
//! (SPMD) with a context that knows its replica id and offers all-reduce, all-gather,
//! reduce-scatter, all-to-all, broadcast, collective-permute and barrier over replica
//! groups. A failing replica poisons its group, so peers get an error, never a hang.
//! Each device keeps a buffer pool (see [`Runtime::with_pool`]): the inputs its
//! collectives consumed and the tensors given back with [`ReplicaContext::recycle`]
//! become the next results' memory, so a training loop's collectives stop paying for
//! fresh pages.
//!
//! It is **not** a placer or a sharding library: it runs what it is given on the devices
//! it is told, and moves tensors only through collectives. It does not know the outfeed
//! wire format; programs stream data out through a sink trait this crate owns.
//!
//! Across processes, runtimes join through an [`Interconnect`]: replica ids run over
//! all processes, collectives over all replicas are hierarchical (in-process first,
//! then across processes, then back), and every cross-process step starts with a
//! handshake so a failure or a diverging program ends the run in every process with
//! the same error. The `mpi` feature provides the MPI interconnect (`mpi::Mpi`, over
//! rsmpi and Open MPI or MPICH); [`LoopbackInterconnect`] runs several "processes" in
//! one address space for tests.
//!
//! ```
//! use std::sync::Arc;
//! use meshwork_executor::{ReplicaFn, Runtime, Tensor};
//! use meshwork_types::ReduceOp;
//! use ndarray::arr1;
//!
//! let runtime = Runtime::new(4)?;
//! let program: Arc<ReplicaFn> = Arc::new(|ctx, inputs| {
//!     let sum = ctx.all_reduce(ReduceOp::Sum, inputs[0].clone())?;
//!     Ok(vec![sum])
//! });
//! let inputs = (0..4).map(|r| vec![Tensor::F32(arr1(&[r as f32, 1.0]).into_dyn())]).collect();
//! let out = runtime.run(program, inputs)?;
//! assert!(out.iter().all(|o| o[0] == Tensor::F32(arr1(&[6.0, 4.0]).into_dyn())));
//! # Ok::<(), meshwork_executor::Error>(())
//! ```

mod context;
mod direct;
mod error;
mod hub;
#[cfg(feature = "mpi")]
pub mod mpi;
mod net;
mod pool;
mod reaper;
mod runtime;
mod sink;
mod sync;
mod tensor;

pub use context::ReplicaContext;
pub use error::{Error, Result};
pub use hub::ReplicaGroups;
pub use meshwork_types::Tensor;
pub use net::{Interconnect, LoopbackInterconnect};
pub use runtime::{ReplicaError, ReplicaFn, Runtime};
pub use sink::OutfeedSink;
