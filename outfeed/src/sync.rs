//! The receiver's threads, locks and channels: std and crossbeam normally; shuttle's
//! under `--cfg shuttle`, so the model check controls every interleaving.

#[cfg(not(shuttle))]
pub(crate) use std::sync::{
    Condvar, Mutex, MutexGuard,
    atomic::{AtomicBool, AtomicUsize},
};
#[cfg(not(shuttle))]
pub(crate) use std::thread::JoinHandle;

#[cfg(shuttle)]
pub(crate) use shuttle::sync::{
    Condvar, Mutex, MutexGuard,
    atomic::{AtomicBool, AtomicUsize},
};
#[cfg(shuttle)]
pub(crate) use shuttle::thread::JoinHandle;

/// An unbounded multi-producer channel.
#[cfg(not(shuttle))]
pub(crate) use crossbeam::channel::{Receiver, Sender, unbounded};

#[cfg(shuttle)]
pub(crate) use shuttle::sync::mpsc::{Receiver, Sender, channel as unbounded};

/// Spawns a named thread (shuttle threads have no names).
pub(crate) fn spawn<T: Send + 'static>(
    name: String,
    f: impl FnOnce() -> T + Send + 'static,
) -> JoinHandle<T> {
    #[cfg(not(shuttle))]
    {
        std::thread::Builder::new().name(name).spawn(f).expect("spawn an outfeed thread")
    }
    #[cfg(shuttle)]
    {
        let _ = name;
        shuttle::thread::spawn(f)
    }
}
