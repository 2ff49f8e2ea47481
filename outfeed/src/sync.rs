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
pub(crate) use crossbeam::channel::{Receiver, Sender, TryRecvError, unbounded};

#[cfg(shuttle)]
pub(crate) use shuttle::sync::mpsc::{Receiver, Sender, TryRecvError, channel as unbounded};

/// The bounded channel of an in-process link (`crate::channel`): crossbeam's normally;
/// under the model checker a queue behind shuttle's lock, with the part of crossbeam's
/// interface the link uses.
#[cfg(not(shuttle))]
pub(crate) use crossbeam::channel;

#[cfg(shuttle)]
pub(crate) mod channel {
    use std::collections::VecDeque;
    use std::sync::Arc;

    use shuttle::sync::{Condvar, Mutex, MutexGuard};

    struct State<T> {
        queue: VecDeque<T>,
        senders: usize,
        receivers: usize,
    }

    struct Chan<T> {
        state: Mutex<State<T>>,
        /// Notified on every change: a frame in or out, a side gone.
        changed: Condvar,
        cap: usize,
    }

    impl<T> Chan<T> {
        fn state(&self) -> MutexGuard<'_, State<T>> {
            self.state.lock().unwrap_or_else(|e| e.into_inner())
        }
    }

    pub(crate) struct Sender<T>(Arc<Chan<T>>);

    pub(crate) struct Receiver<T>(Arc<Chan<T>>);

    #[derive(Debug)]
    pub(crate) struct SendError<T>(pub(crate) T);

    #[derive(Debug)]
    pub(crate) struct RecvError;

    #[derive(Debug)]
    pub(crate) enum TrySendError<T> {
        Full(T),
        Disconnected(T),
    }

    #[derive(Debug)]
    pub(crate) enum TryRecvError {
        Empty,
        Disconnected,
    }

    pub(crate) fn bounded<T>(cap: usize) -> (Sender<T>, Receiver<T>) {
        let state = State { queue: VecDeque::new(), senders: 1, receivers: 1 };
        let chan = Arc::new(Chan { state: Mutex::new(state), changed: Condvar::new(), cap });
        (Sender(chan.clone()), Receiver(chan))
    }

    impl<T> Sender<T> {
        pub(crate) fn send(&self, t: T) -> Result<(), SendError<T>> {
            let mut state = self.0.state();
            loop {
                if state.receivers == 0 {
                    return Err(SendError(t));
                }
                if state.queue.len() < self.0.cap {
                    state.queue.push_back(t);
                    drop(state);
                    self.0.changed.notify_all();
                    return Ok(());
                }
                state = self.0.changed.wait(state).unwrap_or_else(|e| e.into_inner());
            }
        }

        pub(crate) fn try_send(&self, t: T) -> Result<(), TrySendError<T>> {
            let mut state = self.0.state();
            if state.receivers == 0 {
                return Err(TrySendError::Disconnected(t));
            }
            if state.queue.len() >= self.0.cap {
                return Err(TrySendError::Full(t));
            }
            state.queue.push_back(t);
            drop(state);
            self.0.changed.notify_all();
            Ok(())
        }
    }

    impl<T> Receiver<T> {
        pub(crate) fn try_recv(&self) -> Result<T, TryRecvError> {
            let mut state = self.0.state();
            match state.queue.pop_front() {
                Some(t) => {
                    drop(state);
                    self.0.changed.notify_all();
                    Ok(t)
                }
                None if state.senders == 0 => Err(TryRecvError::Disconnected),
                None => Err(TryRecvError::Empty),
            }
        }

        pub(crate) fn recv(&self) -> Result<T, RecvError> {
            let mut state = self.0.state();
            loop {
                if let Some(t) = state.queue.pop_front() {
                    drop(state);
                    self.0.changed.notify_all();
                    return Ok(t);
                }
                if state.senders == 0 {
                    return Err(RecvError);
                }
                state = self.0.changed.wait(state).unwrap_or_else(|e| e.into_inner());
            }
        }

        pub(crate) fn len(&self) -> usize {
            self.0.state().queue.len()
        }

        pub(crate) fn is_empty(&self) -> bool {
            self.len() == 0
        }
    }

    impl<T> Clone for Sender<T> {
        fn clone(&self) -> Self {
            self.0.state().senders += 1;
            Sender(self.0.clone())
        }
    }

    impl<T> Clone for Receiver<T> {
        fn clone(&self) -> Self {
            self.0.state().receivers += 1;
            Receiver(self.0.clone())
        }
    }

    impl<T> Drop for Sender<T> {
        fn drop(&mut self) {
            self.0.state().senders -= 1;
            self.0.changed.notify_all();
        }
    }

    impl<T> Drop for Receiver<T> {
        fn drop(&mut self) {
            self.0.state().receivers -= 1;
            self.0.changed.notify_all();
        }
    }

    impl<T> std::fmt::Debug for Sender<T> {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("Sender { .. }")
        }
    }

    impl<T> std::fmt::Debug for Receiver<T> {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("Receiver { .. }")
        }
    }
}

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
