//! Helpers: a recording callback and tensors.

use std::sync::{Arc, Mutex};

use meshwork_outfeed::{Callback, Delivery, Tensor};
use ndarray::{ArrayD, IxDyn};

/// Every delivery as (source, consumer, tensors), in delivery order.
pub(crate) type Log = Arc<Mutex<Vec<(usize, u32, Vec<Tensor>)>>>;

pub(crate) fn recorder() -> (Log, Arc<Callback>) {
    let log: Log = Arc::default();
    let sink = log.clone();
    let cb = move |d: &Delivery| {
        sink.lock().unwrap().push((d.source, d.consumer, d.tensors()));
        Ok(())
    };
    (log, Arc::new(cb))
}

pub(crate) fn iota_u32(n: usize, start: u32) -> Tensor {
    Tensor::U32(ArrayD::from_shape_vec(IxDyn(&[n]), (start..start + n as u32).collect()).unwrap())
}

/// Runs `f` on its own thread; a hang fails the test after a minute instead of hanging
/// the suite.
pub(crate) fn within_a_minute<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done_tx.send(f());
    });
    done_rx.recv_timeout(std::time::Duration::from_secs(60)).expect("the receiver hung")
}
