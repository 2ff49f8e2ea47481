//! XLA for meshwork, through PJRT plugins.
//!
//! What it is: a runtime over the PJRT C API ([`Plugin`], [`Client`], [`Buffer`],
//! [`Executable`]) that loads a plugin (`xla_cpu_pjrt.so`, the CUDA plugin of
//! `jax-cuda13-pjrt`) at run time with `dlopen`, and a lowering of meshwork's
//! programs to StableHLO text ([`lower`]) that XLA compiles. Its bindings are a
//! hand-declared subset of PJRT API 0.81's header; nothing is generated at build time
//! and building needs no plugin, header or Python.
//!
//! It also compiles for NVIDIA GPUs that are not here ([`target`]): the CUDA plugin's
//! deviceless compile, with XLA's memory per device.
//!
//! What it is not: a back end of the strategy by itself (the strategy's `Xla` back
//! end drives this crate), nor a partitioner (meshwork's partitioner makes the
//! per-device programs; XLA compiles them).
//!
//! ```no_run
//! use meshwork_program::{Builder, Op, Unary};
//! use meshwork_types::Tensor;
//! use meshwork_xla::{Session, find};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mut b = Builder::new();
//! let x = b.param("x", "f32[2]".parse()?)?;
//! let y = b.push(Op::Unary(Unary::Tanh), &[x])?;
//! let program = b.finish(&[y])?;
//!
//! // `--pjrt-plugin PATH` or MESHWORK_PJRT_PLUGIN names the plugin.
//! let plugin = find::load(&find::plugin_path(None)?)?;
//! let session = Session::new(&plugin, 1)?;
//! let out = session.run(&program, &[Tensor::f32(&[2], vec![0.0, 1.0])?])?;
//! assert_eq!(out[0].shape(), &[2]);
//! # Ok(())
//! # }
//! ```

mod error;
pub mod find;
pub mod hlo;
pub mod lower;
mod options;
mod pjrt;
pub mod session;
pub mod target;

pub use error::{Error, Result};
pub use options::CompileOptions;
pub use pjrt::{
    Arg, Buffer, Client, Code, CompiledMemory, Device, Executable, KeyValueStore, MAJOR, MIN_MINOR,
    MemoryStats, NamedValueOf, Plugin, Topology, Transfers, Unloaded,
};
pub use session::Session;
