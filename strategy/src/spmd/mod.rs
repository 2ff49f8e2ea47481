//! SPMD programs: a program written for one device, partitioned over a mesh as XLA's
//! SPMD partitioner (GSPMD) does for JAX's `jit` with `NamedSharding`, and run with
//! its state resident on the devices.
//!
//! The sharding crate owns the semantics (layouts, propagation, transitions); this
//! module maps program ops onto its rules ([`rules`]), rewrites programs
//! ([`partition`]) and runs them on a strategy's devices.

mod partition;
mod rules;
mod run;

pub use partition::{Collective, Partitioned, partition};
