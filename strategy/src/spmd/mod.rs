//! SPMD programs: a program written for one device, partitioned over a mesh as XLA's
//! SPMD partitioner (GSPMD) does for JAX's `jit` with `NamedSharding`, and run with
//! its state resident on the devices.
//!
//! The sharding crate owns the semantics (layouts, propagation, transitions); this
//! module maps each program op onto one of its op rules, rewrites programs
//! ([`partition`](meshwork_partition::spmd::partition)) and runs them on a strategy's
//! devices:
//! [`Strategy::run_partitioned`](crate::Strategy::run_partitioned) for one run,
//! [`Strategy::compile`](crate::Strategy::compile) and
//! [`Strategy::compile_train_step`](crate::Strategy::compile_train_step) for steps whose
//! parameters and optimizer state stay on the devices.
//!
//! ```
//! use meshwork_strategy::Strategy;
//! use meshwork_strategy::nn::Optimizer;
//! use meshwork_strategy::program::{Builder, Tensor};
//! use meshwork_strategy::sharding::Mesh;
//! use meshwork_strategy::spmd::Shardings;
//!
//! // A program for one device: a linear layer and a squared loss.
//! let mut b = Builder::new();
//! let x = b.param("x", "f64[8,4]".parse()?)?;
//! let w = b.param("w", "f64[4,6]".parse()?)?;
//! let z = b.matmul(x, w)?;
//! let sq = b.square(z)?;
//! let loss = b.reduce_mean(sq, &[0, 1], false)?;
//! let program = b.finish(&[loss])?;
//!
//! // The batch over `data`, the weight's columns over `model`.
//! let mesh = Mesh::iota(&[("data", 2), ("model", 2)])?;
//! let shardings = Shardings::new(mesh).with("x", "P('data')")?.with("w", "P(None, 'model')")?;
//! let strategy = Strategy::data_parallel(4)?;
//! let mut step = strategy.compile_train_step(&program, loss, &[w], Optimizer::Sgd, &shardings)?;
//! step.set("w", &Tensor::f64(&[4, 6], vec![0.5; 24])?)?;
//! let batch = [Tensor::f64(&[8, 4], (0..32).map(|k| k as f64 / 32.0).collect())?];
//! let first = step.step(&batch, 0.01)?;
//! let second = step.step(&batch, 0.01)?;
//! assert!(second < first);
//! // The per-device program, with its collectives.
//! assert!(step.compiled().partitioned().to_string().contains("all_reduce"));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod compiled;
mod layout;
mod state;

pub use compiled::{Compiled, CompiledTrainStep};
pub use meshwork_partition::spmd::{Shardings, megatron_spec};
pub use state::{ResidentState, STEP_VARIABLE};
