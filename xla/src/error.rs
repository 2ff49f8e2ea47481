//! The errors of loading plugins, lowering programs and running them.

use std::path::PathBuf;

use crate::pjrt::Code;

/// What went wrong, with where.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No plugin was named or found.
    #[error(
        "no PJRT plugin: pass --pjrt-plugin PATH or set MESHWORK_PJRT_PLUGIN \
         (for CPUs: `pip install xla-cpu-pjrt`; for NVIDIA GPUs: `pip install \"jax[cuda13]\"`)"
    )]
    NoPlugin,
    /// The file could not be loaded as a PJRT plugin.
    #[error("{}: not a PJRT plugin: {reason}", path.display())]
    NotAPlugin {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The plugin speaks another PJRT API version.
    #[error(
        "{}: the plugin speaks PJRT API {major}.{minor}; meshwork needs {}.{} or a newer \
         minor version", path.display(), crate::pjrt::MAJOR, crate::pjrt::MIN_MINOR
    )]
    Version {
        /// The plugin.
        path: PathBuf,
        /// Its major version.
        major: i32,
        /// Its minor version.
        minor: i32,
    },
    /// The plugin's function table lacks a function meshwork calls.
    #[error("{}: the plugin has no {function}", path.display())]
    Missing {
        /// The plugin.
        path: PathBuf,
        /// The function.
        function: &'static str,
    },
    /// A PJRT call returned an error.
    #[error("{call}: {message}")]
    Plugin {
        /// The C API function.
        call: &'static str,
        /// PJRT's error code.
        code: Code,
        /// The plugin's message.
        message: String,
    },
    /// A device index beyond the client's devices.
    #[error("device {index} asked of a client with {count} devices")]
    NoDevice {
        /// The index asked.
        index: usize,
        /// The devices there are.
        count: usize,
    },
    /// Arguments of an execution that do not fit it.
    #[error("execute: {0}")]
    Arguments(String),
    /// A device array that does not convert to a host tensor.
    #[error("to host: {0}")]
    Host(String),
    /// A GPU target (`--target`) or its config that cannot be compiled for.
    #[error("{0}")]
    Target(String),
    /// An instruction that does not lower to StableHLO.
    #[error("lowering {at}: {problem}")]
    Lower {
        /// The instruction (`%7 = take`).
        at: String,
        /// Why.
        problem: String,
    },
}

impl Error {
    /// The same error, saying which operation it ended (`during` a compile, …).
    pub(crate) fn during(self, what: &'static str) -> Error {
        match self {
            Error::Plugin { code, message, .. } => Error::Plugin { call: what, code, message },
            other => other,
        }
    }

    /// Whether the device ran out of memory (`RESOURCE_EXHAUSTED`).
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, Error::Plugin { code: Code::ResourceExhausted, .. })
    }
}

/// The crate's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;
