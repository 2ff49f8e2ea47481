//! meshwork's outfeed: framed, typed streams of tensors from devices to host callbacks.
//!
//! A device [`Sender`] encodes registered tensors into frames (wire format v1, see
//! [`frame`]) and writes them to a [`Sink`]; the host [`Receiver`] runs one listener per
//! [`Source`] and a pool of callback workers. Each source's frames are delivered in
//! order; listeners block while the bytes waiting for callbacks reach the budget (the
//! queue never exceeds the budget plus one frame); `shutdown()` (also on drop) stops
//! every source and delivers every frame received before it. Unknown consumer ids, bad
//! magic, checksum and spec mismatches, oversized frames, truncated streams and failing
//! or panicking callbacks are errors reported with their source and consumer — never
//! aborts or hangs. Transports: in-memory channels, any byte stream (TCP, Unix sockets),
//! and files (record a run, replay it).
//!
//! It is **not** an RPC system or a general message bus: data flows one way, device to
//! host, in frames whose shapes the host registered beforehand. It does not run programs
//! (that is `meshwork-executor`, which emits through a sink trait of its own).
//!
//! ```
//! use std::sync::{Arc, Mutex};
//! use meshwork_outfeed::{Config, Receiver, Registry, Sender, Tensor, channel};
//! use ndarray::{ArrayD, IxDyn};
//!
//! let mut registry = Registry::new();
//! registry.register(5, "loss", vec!["f32[2]".parse()?])?;
//! let (sink, source) = channel(16);
//! let seen = Arc::new(Mutex::new(Vec::new()));
//! let log = seen.clone();
//! let mut receiver = Receiver::start(
//!     registry.clone(),
//!     vec![Box::new(source)],
//!     Arc::new(move |d: &meshwork_outfeed::Delivery| {
//!         log.lock().unwrap().push((d.source, d.consumer, d.tensors()));
//!         Ok(())
//!     }),
//!     None,
//!     Config::default(),
//! );
//! let mut device = Sender::new(registry, sink);
//! let loss = ArrayD::from_shape_vec(IxDyn(&[2]), vec![0.5f32, 0.25]).unwrap();
//! device.send(5, &[Tensor::F32(loss.clone())])?;
//! let report = receiver.shutdown();
//! assert!(report.errors.is_empty());
//! assert_eq!(*seen.lock().unwrap(), vec![(0, 5, vec![Tensor::F32(loss)])]);
//! # Ok::<(), meshwork_outfeed::Error>(())
//! ```

mod error;
pub mod frame;
mod receiver;
mod registry;
mod sender;
mod sync;
mod tensor;
mod transport;

pub use error::{Error, Result};
pub use meshwork_types::Tensor;
pub use receiver::{
    Callback, CallbackError, Config, Delivery, ErrorCallback, Metrics, Receiver, Report,
};
pub use registry::{Consumer, Registry};
pub use sender::Sender;
pub use tensor::{decode_payload, encode_payload};
pub use transport::{
    ChannelSink, ChannelSource, Recording, STREAM_BUFFER, Sink, Source, Stop, StreamSink,
    StreamSource, TcpSources, channel,
};
