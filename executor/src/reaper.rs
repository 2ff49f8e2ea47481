//! Freeing large buffers off a collective's critical path.
//!
//! A reduce-scatter ends with the inputs of every replica released: the replica that
//! drops the last reference frees all of them (8 replicas × 64 MiB is 512 MiB given
//! back to the kernel, tens of milliseconds) while its peers have long returned. The
//! reaper is one background thread that drops what it is handed, so the collective
//! returns as soon as its own work is done. Its queue holds two hand-offs: memory
//! waiting to be freed stays bounded, and a caller that gets ahead of the reaper frees
//! inline.

#[cfg(not(any(shuttle, miri)))]
mod imp {
    use std::sync::OnceLock;
    use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};

    type Garbage = Box<dyn Send>;

    fn queue() -> Option<&'static SyncSender<Garbage>> {
        static QUEUE: OnceLock<Option<SyncSender<Garbage>>> = OnceLock::new();
        QUEUE
            .get_or_init(|| {
                let (tx, rx) = sync_channel::<Garbage>(2);
                std::thread::Builder::new()
                    .name("meshwork-reaper".into())
                    .spawn(move || rx.into_iter().for_each(drop))
                    .ok()
                    .map(|_| tx)
            })
            .as_ref()
    }

    /// Drops `value` on the reaper thread (inline if the queue is full or the thread
    /// could not start).
    pub(crate) fn release<T: Send + 'static>(value: T) {
        match queue() {
            Some(q) => match q.try_send(Box::new(value)) {
                Ok(()) => {}
                Err(TrySendError::Full(v) | TrySendError::Disconnected(v)) => drop(v),
            },
            None => drop(value),
        }
    }
}

#[cfg(any(shuttle, miri))]
mod imp {
    /// Drops `value` inline (no background thread under the model checker or Miri).
    pub(crate) fn release<T: Send + 'static>(value: T) {
        drop(value);
    }
}

pub(crate) use imp::release;

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::Duration;

    /// Says when it is dropped.
    struct Signal(mpsc::Sender<()>);

    impl Drop for Signal {
        fn drop(&mut self) {
            let _ = self.0.send(());
        }
    }

    /// Whatever is handed over is dropped, each exactly once, soon, even when the
    /// queue is full (the caller then drops it).
    #[test]
    fn everything_released_is_dropped_once() {
        let (tx, rx) = mpsc::channel();
        for _ in 0..100 {
            super::release(Signal(tx.clone()));
        }
        drop(tx);
        let mut dropped = 0;
        while rx.recv_timeout(Duration::from_secs(10)).is_ok() {
            dropped += 1;
        }
        assert_eq!(dropped, 100);
    }
}
