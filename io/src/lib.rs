//! meshwork's file formats, one home each, and the rules for a user's files.
//!
//! - [`files`]: inputs opened without ever blocking (a FIFO or device is refused, not
//!   waited on) and read within a byte limit; outputs written whole or not at all
//!   (atomic replace, or write-new that never replaces), directories synced with
//!   their errors reported, and temporary names no two processes share.
//! - [`npy`]: NumPy's `.npy`, N-dimensional, read (whole or by rows) and written.
//! - [`safetensors`]: one header reader for every safetensors file meshwork reads
//!   (checkpoints, `--init`, Hugging Face folders, the candle bridge), on top of the
//!   `safetensors` crate's validation (contiguous, non-overlapping, in-bounds data),
//!   with duplicate names refused too; and reads of any box of a tensor.
//! - [`elf`]: the pre-check of a shared object before `dlopen` (a truncated plugin
//!   would otherwise crash the process with SIGBUS).
//!
//! It is **not** a tensor library (values come out as bytes or `f64` arrays) and knows
//! nothing of flags or runs: every error is one line naming the input as the caller
//! named it (`what`: `--data-x`, a path).
//!
//! ```
//! let dir = tempfile::tempdir().unwrap();
//! let path = dir.path().join("x.npy");
//! let a = ndarray::ArrayD::from_shape_vec(vec![2, 3], vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
//!     .unwrap();
//! meshwork_io::npy::write_f64(&path, &a).unwrap();
//! assert_eq!(meshwork_io::npy::read("--data-x", &path, 1 << 20)?, a);
//! // A FIFO, a directory or a file over the limit is refused in one line.
//! let e = meshwork_io::files::read_input("--data-x", dir.path(), 1 << 20).unwrap_err();
//! assert!(e.to_string().contains("a directory"));
//! # Ok::<(), meshwork_io::Error>(())
//! ```

pub mod elf;
pub mod files;
pub mod npy;
pub mod safetensors;

/// What is wrong with a file, in one line that names it as the caller named it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Error(pub String);

impl Error {
    /// An error in these words.
    pub(crate) fn new(message: impl Into<String>) -> Error {
        Error(message.into())
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
