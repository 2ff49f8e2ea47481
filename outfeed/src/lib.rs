//! meshwork's outfeed: framed, typed streams of tensors from devices to host callbacks.
//!
//! Each payload travels behind the header `[271828, consumer_id]`; consumer ids map to
//! registered payload specs, id 0 is reserved for shutdown; one listener per device, a
//! callback stage, a byte budget that holds listeners back while callbacks catch up, and
//! a shutdown that delivers every frame received before it. Bad frames, unknown ids and
//! failing callbacks are reported as errors, never aborts or hangs.
//!
//! It is **not** an RPC system or a general message bus: data flows one way, device to
//! host, in frames whose shapes the host registered beforehand. It does not run
//! programs (that is `meshwork-executor`, which emits through a sink trait it owns).
//!
//! The wire format, registry, sender and receiver arrive with the outfeed issue; so far
//! the crate holds its error type:
//!
//! ```
//! use meshwork_outfeed::Error;
//! use meshwork_types::DType;
//!
//! let err: Error = "f31".parse::<DType>().unwrap_err().into();
//! assert!(err.to_string().contains("unknown dtype"));
//! ```

mod error;

pub use error::{Error, Result};
