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
