//! meshwork-candle: train any [candle](https://github.com/huggingface/candle) model on
//! meshwork's devices — data parallel (PyTorch's DDP) or with parameters and optimizer
//! state sharded over the replicas (PyTorch's FSDP, ZeRO-3) — in one process or across
//! processes over MPI, with sharded checkpoints.
//!
//! A [`Trainer`] holds one replica of the model and of a `candle_nn` optimizer per
//! device. A step splits the global batch over the replicas; each runs the user's
//! forward and backward on its slice, and the replicas exchange gradients through
//! meshwork's collectives in fused buckets (25 MiB by default, in reverse parameter
//! order, as DDP does). Under DDP the averaged gradients are all-reduced and every
//! replica steps identically (replicas stay bit-identical); under FSDP the parameters
//! are all-gathered before the forward, the gradients reduce-scattered, and each
//! replica steps only its shard, so parameters and optimizer state take about 1/N of
//! DDP's memory between steps. A failure on any replica — an error or a panic in the
//! user's code — ends the step on every replica with that error; nothing hangs.
//!
//! FSDP comes in two grains. With [`Trainer::new`] the whole model is one FSDP unit:
//! it is built over the gathered parameters for each step and dropped after it, so a
//! replica holds 1/N between steps and the whole model during one. With
//! [`Trainer::units`] the model is a sequence of units (layers, blocks): each unit's
//! parameters are gathered just before its forward and again before its backward,
//! which recomputes the unit from its saved input (activation checkpointing), and its
//! gradients are reduce-scattered right after — a replica holds one unit whole at a
//! time.
//!
//! It is **not** a candle backend or a model zoo: models are plain `candle_nn` models
//! built from a `VarBuilder`, on candle's CPU device; meshwork's devices are where
//! the replicas run, and their collectives are meshwork's (deterministic, and the same
//! over MPI). [`Trainer::save`] holds the parameters and the step count (candle's own
//! optimizers keep their state private); with [`optim::AdamW`] — candle's AdamW, bit
//! for bit, its state open — [`Trainer::save_with_optimizer`] holds the moments too,
//! split as their parameters are, and a restored run continues as if uninterrupted,
//! on any number of replicas.
//!
//! What a candle user adds — the five lines marked below:
//!
//! ```
//! use candle_core::{D, DType, Tensor};
//! use candle_nn::{AdamW, Linear, Module, ParamsAdamW, VarBuilder, linear, loss};
//! use meshwork_candle::{Config, Devices, Trainer};
//!
//! struct Mlp(Linear, Linear);
//! impl Mlp {
//!     fn new(vb: VarBuilder<'_>) -> candle_core::Result<Mlp> {
//!         Ok(Mlp(linear(4, 16, vb.pp("l1"))?, linear(16, 3, vb.pp("l2"))?))
//!     }
//!     fn loss(&self, b: &[Tensor]) -> candle_core::Result<Tensor> {
//!         let logits = self.1.forward(&self.0.forward(&b[0])?.relu()?)?;
//!         loss::cross_entropy(&logits, &b[1])
//!     }
//! }
//!
//! let x = Tensor::randn(0f32, 1.0, (32, 4), &candle_core::Device::Cpu)?;
//! let y = x.sum(D::Minus1)?.ge(0f32)?.to_dtype(DType::U32)?;
//! let devices = Devices::cpu(4)?;                                                   // 1
//! let adamw = ParamsAdamW { lr: 0.01, ..Default::default() };
//! let mut trainer = Trainer::<Mlp, AdamW>::new(&devices, Config::ddp(), adamw, Mlp::new)?; // 2
//! for _ in 0..5 {
//!     let loss = trainer.step(&[x.clone(), y.clone()], |m: &Mlp, b: &[Tensor]| m.loss(b))?; // 3
//!     assert!(loss.is_finite());
//! }
//! let dir = std::env::temp_dir().join(format!("meshwork-candle-doc-{}", std::process::id()));
//! trainer.save(&dir, None)?;                                                        // 4
//! trainer.restore(&dir)?;                                                           // 5
//! # std::fs::remove_dir_all(&dir).ok();
//! # Ok::<(), meshwork_candle::Error>(())
//! ```
//!
//! `Config::fsdp()` shards instead; [`Trainer::from_safetensors`] loads a checkpoint
//! with each replica reading only its shards; over MPI, build the [`Devices`] from a
//! runtime joined by `meshwork_executor::mpi::Mpi` (feature `mpi`).

mod bucket;
mod error;
mod load;
pub mod optim;
mod params;
mod trainer;

pub use error::{Error, Result};
pub use trainer::{Build, Config, Devices, Parallel, Trainer, UnitBuild, Units};
