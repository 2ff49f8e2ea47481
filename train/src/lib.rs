//! meshwork's training loop as a library: the MLP, the CNN and the reference
//! transformer trained on a `data x model` mesh (SPMD) or in a pipeline, with the
//! checks a user of `meshwork train` gets — each run's losses compared step by step
//! with the same steps on one device.
//!
//! - [`Config`] holds every setting of a run (each `None` where the model's default
//!   applies); [`Trainer::new`] checks them all — alone, together, against the data,
//!   `--init`'s weights and a resumed checkpoint, and the estimated memory against
//!   `max_memory` — before anything is written, and refuses in one line naming the
//!   setting by its flag.
//! - [`Trainer::run`] trains: host calls of `steps_per_run` steps, learning-rate
//!   schedules ([`learning_rate`]), clipping, held-out evaluation, checkpoints
//!   (resumed on any mesh, including the main job's older checkpoints), the one-device
//!   check, and the losses, metrics and plot files, written whole or not at all. It
//!   tells an [`Observer`] as it goes and returns a [`Report`]; a stop flag
//!   ([`stop_on_signals`]) ends it after the current host call, saved.
//! - The data readers ([`data`], over [`meshwork_io`]'s formats) size every allocation a file controls before
//!   making it, and never wait on a FIFO; [`rng::SplitMix`] is the one random stream
//!   (the main job's built-in data and initial weights).
//! - [`inspect`] prints the transformer's partitioned training step.
//! - [`hf`] reads and writes Hugging Face GPT-2 checkpoint folders; [`generate`]
//!   samples from one with a key-value cache; [`tokenize`] encodes text through a
//!   Hugging Face tokenizer in chunks, its rows cached.
//!
//! It is **not** a command line (that is `meshwork-cli`, which parses flags into a
//! [`Config`] and draws progress), and it runs programs only through
//! [`meshwork_strategy::Strategy`].
//!
//! ```
//! use std::sync::atomic::AtomicBool;
//! use meshwork_train::{CheckOutcome, Config, ModelKind, Quiet, Trainer};
//!
//! // The main job, shortened: the MLP on a 2x2 mesh, checked against one device.
//! let mut config = Config::new(ModelKind::Mlp);
//! config.steps = Some(5);
//! let report = Trainer::new(&config)?.run(&mut Quiet, &AtomicBool::new(false))?;
//! assert_eq!(report.losses.len(), 5);
//! assert!(matches!(report.check, CheckOutcome::Checked { .. }));
//! assert!(report.losses[4] < report.losses[0]);
//! # Ok::<(), meshwork_train::Error>(())
//! ```

mod backend;
pub mod chat;
mod config;
pub mod data;
mod error;
mod family;
pub mod files;
pub mod generate;
pub mod hf;
mod init;
mod inspect;
mod lora;
mod model;
mod observe;
mod plan;
mod processes;
mod report;
mod resume;
pub mod rng;
mod steps;
mod stop;
mod target;
pub mod tokenize;
mod trainer;

pub use config::{
    AttentionKind, BackendKind, Check, Config, CustomBackend, DEFAULT_MAX_MEMORY, Data,
    LoraSettings, ModelKind, OptimizerKind, OptimizerSettings, Partitioner, Schedule,
};
pub use error::{Error, Result};
pub use init::read_init;
pub use inspect::{inspect, inspect_json};
/// The MPI handle [`join_mpi`] returns (feature `mpi`).
#[cfg(feature = "mpi")]
pub use meshwork_strategy::executor::mpi::Mpi;
pub use model::{Layout, Net};
pub use observe::{Observer, Quiet, Start, Step};
pub use plan::{MAX_DEVICES, MAX_STEPS};
pub use processes::Processes;
#[cfg(feature = "mpi")]
pub use processes::join_mpi;
pub use report::{
    CheckOutcome, Curves, Report, loss_text, number_text, sparkline, steps_text, svg,
};
pub use stop::stop_on_signals;
pub use target::{MEMORY_FRACTION, inspect_target, target_devices};
pub use trainer::{Evaluation, Trainer, evaluate, export, initial_weights, learning_rate};
