//! meshwork's façade: the distribution API users program against, in the manner of
//! `tf.distribute.TPUStrategy`, and the `meshwork` command line.
//!
//! It is the only crate that sees all four siblings (placer, sharding, outfeed,
//! executor): it re-exports them and writes the small adapters where two of them meet
//! (the executor's outfeed sink onto the outfeed crate, the executor's kernels onto the
//! placer's op registry).
//!
//! It is **not** where semantics live: sharding rules, placement rules, wire formats and
//! collective algorithms belong to the sibling crates, and this crate only composes them.
//!
//! The strategy API and the training CLI arrive with the strategy and CLI issues; so far
//! the crate re-exports its siblings and wraps their errors:
//!
//! ```
//! use meshwork_strategy::{Error, sharding};
//! use meshwork_types::Shape;
//!
//! let inner: sharding::Error = Shape::new(&[usize::MAX, 2]).unwrap_err().into();
//! let err: Error = inner.into();
//! assert!(matches!(err, Error::Sharding(_)));
//! ```

mod error;

pub use error::{Error, Result};
pub use meshwork_executor as executor;
pub use meshwork_outfeed as outfeed;
pub use meshwork_placer as placer;
pub use meshwork_sharding as sharding;
pub use meshwork_types as types;
