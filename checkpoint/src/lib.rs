//! meshwork's sharded checkpoints: the format (safetensors shard files and a JSON
//! index) and the directory of rolling checkpoints a training run keeps.
//!
//! - A checkpoint holds each variable's distinct shards, one safetensors file per
//!   device position, and an index with every variable's dtype, shape, `HloSharding`
//!   and shard regions, CRC32C checksums of every file and tensor, and optional run
//!   metadata. [`write_checkpoint`] checks the shards against their sharding, writes
//!   into a new (or empty) directory and the index last; [`read_checkpoint`] verifies
//!   everything, then assembles each variable whole — whatever sharding and however
//!   many devices saved it, so a checkpoint restores onto any mesh.
//! - A [`CheckpointManager`] owns a directory laid out as TensorFlow's and Orbax's
//!   checkpoint managers lay theirs out (`step-NNNNNNNN/`, `latest`, a marker, a lock):
//!   each step is written aside and renamed into place, so a crash at any instant
//!   leaves every complete step intact; nothing meshwork did not create there is ever
//!   renamed or deleted. [`find_checkpoint`] turns what a user passes to resume into
//!   the checkpoint to read.
//!
//! It is **not** what decides a checkpoint's content: strategies, compiled programs and
//! bridges hand it their shards ([`CheckpointEntry`]) and take values back.
//!
//! ```
//! use meshwork_checkpoint::{CheckpointEntry, read_checkpoint, write_checkpoint};
//! use meshwork_sharding::HloSharding;
//! use meshwork_types::{DType, Tensor};
//!
//! // A [4] variable split over 2 positions: each writes its half.
//! let dir = std::env::temp_dir().join(format!("meshwork-doc-{}", std::process::id()));
//! let half = |v: f32| Tensor::f32(&[2], vec![v, v + 1.0]).unwrap();
//! let w = CheckpointEntry {
//!     name: "w".into(),
//!     dtype: DType::F32,
//!     shape: vec![4],
//!     hlo: "{devices=[2]0,1}".parse::<HloSharding>()?,
//!     shards: vec![(0, vec![0..2], half(0.0)), (1, vec![2..4], half(2.0))],
//! };
//! write_checkpoint(&dir, 2, vec![w], None)?;
//! let back = read_checkpoint(&dir, &[("w".into(), DType::F32, vec![4])])?;
//! assert_eq!(back[0], Tensor::f32(&[4], vec![0.0, 1.0, 2.0, 3.0])?);
//! # std::fs::remove_dir_all(&dir)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod error;
mod format;
mod manager;

pub use error::{Error, Result};
pub use format::{
    CheckpointEntry, WrittenPart, checkpoint_metadata, checkpoint_variables, is_checkpoint,
    read_checkpoint, read_checkpoint_parts, write_checkpoint,
};
pub use manager::{CheckpointManager, MARKER, Pinned, find_checkpoint, pin_checkpoint, step_name};
