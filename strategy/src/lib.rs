//! meshwork's façade: the distribution API users program against, in the manner of
//! `tf.distribute.TPUStrategy`, and what runs programs on the devices.
//!
//! It is the only crate that sees all five siblings (placer, sharding, outfeed,
//! executor, program): it re-exports them and writes the adapters where they meet (the
//! executor's outfeed sink onto the outfeed crate, sharding's layouts onto the
//! executor's replicas, and [`spmd`]: tensor programs partitioned over a mesh by
//! sharding propagation and run on the executor's devices with their state resident).
//!
//! It is **not** where semantics live: sharding rules, placement rules, wire formats,
//! collective algorithms, ops and their gradients belong to the sibling crates, the
//! partitioner and the placed-program split to `meshwork-partition`, the checkpoint
//! format to `meshwork-checkpoint`, and this crate only composes them. Nor is it the
//! training loop (`meshwork-train`) or the command line (`meshwork-cli`). A replica's function for [`Strategy::run`] is plain
//! Rust over `ndarray` tensors; a [`program`] is partitioned for you by [`spmd`].
//!
//! - [`DeviceAssignment`] places replicas and their logical devices on a [`Topology`];
//!   [`Strategy`] runs a function once per replica (and logical device) on an executor
//!   runtime, with a [`StrategyContext`] that offers the replica's id, collectives over
//!   replicas and over logical devices, `merge_call`, variable reads and aggregated
//!   updates, the logical-device helpers (the seed's checks and wording), and a metrics
//!   stream to the host through the outfeed crate.
//! - Host side: `reduce` (MEAN over an axis weighs replicas by their rows), `gather`,
//!   datasets split over replicas or built per host, `run_steps` loops, the seed's
//!   variable-reshard state machine, and sharded checkpoints (safetensors files and a
//!   JSON index) that restore onto another mesh.
//! - A run is all or nothing: a failing replica, or replicas whose updates would make
//!   mirrored copies diverge, leave every variable as it was.
//! - [`spmd`]: `jit` with `NamedSharding`, in Rust — annotate a program's parameters
//!   with partition specs, and [`Strategy::compile_train_step`] partitions forward,
//!   backward and the optimizer's update over the mesh (collectives inserted, gradient
//!   all-reduces combined), keeps weights and optimizer state on the devices, and
//!   saves them as sharded checkpoints that restore onto any mesh.
//! - [`placed`]: TensorFlow's way — `tf.device` scopes and `colocate_with` in the
//!   program, [`Strategy::place`] places its instructions by TensorFlow's rules
//!   (resource variables, soft placement, the kernel catalogue), splits it per device
//!   with send/recv pairs and runs the pieces concurrently, variables resident;
//!   micro-batched pipelines (`nn::Transformer::loss_pipelined`) train this way, and
//!   [`Strategy::place_with_cost`] places a program without device scopes by a cost
//!   model counted from it, under memory caps.
//! - [`backend`]: what runs a partitioned or placed program on the devices is one
//!   seam, [`backend::Backend`]; the interpreter on the executor's CPU devices is its
//!   implementation, and another back end sits beside it
//!   ([`Strategy::with_backend`]).
//!
//! ```
//! use meshwork_strategy::{Aggregation, Arg, PerReplica, ReduceOp, Strategy, Tensor, VariableOptions};
//! use ndarray::arr1;
//!
//! let strategy = Strategy::data_parallel(4)?;
//! let sum = VariableOptions { aggregation: Aggregation::Sum, ..Default::default() };
//! let total = strategy.create_variable("total", Tensor::F32(arr1(&[0.0]).into_dyn()), sum)?;
//! let t = total.clone();
//! let shards = PerReplica::new((0..4).map(|r| Tensor::F32(arr1(&[r as f32]).into_dyn())).collect());
//! let out = strategy.run(
//!     move |ctx, args| {
//!         ctx.assign_add(&t, args[0].clone())?;
//!         Ok(vec![ctx.all_reduce(ReduceOp::Sum, args[0].clone())?])
//!     },
//!     &[Arg::PerReplica(shards)],
//! )?;
//! assert_eq!(out.values()[3][0], Tensor::F32(arr1(&[6.0]).into_dyn()));
//! assert_eq!(strategy.read_variable(&total)?, Tensor::F32(arr1(&[6.0]).into_dyn()));
//! # Ok::<(), meshwork_strategy::Error>(())
//! ```

mod assignment;
pub mod backend;
mod checkpoints;
mod context;
mod dataset;
mod error;
mod metrics;
mod ops;
pub mod placed;
pub mod spmd;
mod strategy;
mod values;
mod variable;

pub use assignment::{DeviceAssignment, Topology};
pub use context::StrategyContext;
pub use dataset::{
    DistributedBatch, DistributedDataset, InputContext, PerHostDataset, Pipeline, PipelineFn,
    Remainder,
};
pub(crate) use error::partition_error;
pub use error::{Error, Result};
pub use meshwork_checkpoint as checkpoint;
pub use meshwork_executor as executor;
pub use meshwork_executor::Tensor;
pub use meshwork_nn as nn;
pub use meshwork_outfeed as outfeed;
pub use meshwork_partition as partition;
pub use meshwork_placer as placer;
pub use meshwork_program as program;
pub use meshwork_sharding as sharding;
pub use meshwork_types as types;
pub use meshwork_types::ReduceOp;
pub use metrics::{MetricCallback, MetricEvent, MetricSpec};
pub use strategy::{ReplicaFn, Strategy};
pub use values::{Arg, PerReplica};
pub use variable::{Aggregation, Format, Layout, Synchronization, Variable, VariableOptions};
