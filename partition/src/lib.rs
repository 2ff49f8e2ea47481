//! meshwork's partitioner: the pure passes that turn one program into the programs
//! devices run — SPMD partitioning over a mesh (XLA's GSPMD), and placement by
//! TensorFlow's rules with the split into per-device programs — and the cost model's
//! work counts.
//!
//! - [`spmd`]: annotate some parameters with partition specs ([`Shardings`],
//!   [`megatron_spec`]); [`partition`] propagates layouts to every value (the sharding
//!   crate's GSPMD rules, each program op mapped onto an op rule), runs each op on local
//!   shapes and inserts the collectives the layouts need, then combines independent
//!   all-reduces into launches. The result, a [`Partitioned`] program, counts its
//!   collectives and the bytes they move.
//! - [`placed`]: the program as the placer's graph (resource variables, kernels from the
//!   program crate's catalogue), placed by TensorFlow's rules or by cost under memory
//!   caps ([`place_program`]), and split into one program per device with send/recv
//!   pairs ([`PlacedProgram`]).
//!
//! It is **not** what runs programs: the strategy crate runs the per-device programs on
//! its back ends (the interpreter on the executor's devices). Nothing here touches a
//! device, a thread or a file.
//!
//! ```
//! use meshwork_partition::{Shardings, partition};
//! use meshwork_program::Builder;
//! use meshwork_sharding::Mesh;
//!
//! // y = x·w with the batch over `data` and w's columns over `model`.
//! let mut b = Builder::new();
//! let x = b.param("x", "f32[8,4]".parse()?)?;
//! let w = b.param("w", "f32[4,6]".parse()?)?;
//! let y = b.matmul(x, w)?;
//! let loss = b.reduce_sum(y, &[0, 1], false)?;
//! let program = b.finish(&[loss])?;
//! let mesh = Mesh::iota(&[("data", 2), ("model", 2)])?;
//! let shardings = Shardings::new(mesh.clone()).with("x", "P('data')")?.with("w", "P(None, 'model')")?;
//! let part = partition(&program, &mesh, &shardings.layouts(&program)?, &[None])?;
//! // Each device multiplies a [4,4] block by a [4,3] block; the sum needs an all-reduce.
//! assert!(part.program().to_string().contains("f32[4,3] dot_general"));
//! assert_eq!(part.collectives().len(), 1);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod error;
pub mod placed;
pub mod spmd;

pub use error::{Error, Result};
pub use placed::{PlaceOptions, PlacedProgram, place_program};
pub use spmd::{Partitioned, Shardings, megatron_spec, partition, partition_with};
