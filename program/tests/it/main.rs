//! The program crate through its public API, against the JAX oracle.

mod oracle;
mod props;
mod random;
