//! The rendezvous' locks (and the counter a shared round's work is claimed with):
//! std's normally; shuttle's under `--cfg shuttle`, so the model check (`cargo xtask
//! model`) controls every interleaving of the replicas.

#[cfg(not(shuttle))]
pub(crate) use std::sync::{Condvar, Mutex, MutexGuard, atomic::AtomicUsize};

#[cfg(shuttle)]
pub(crate) use shuttle::sync::{Condvar, Mutex, MutexGuard, atomic::AtomicUsize};
