//! The trainer's error type.

/// How a run ends when it does not finish.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Bad input: a setting, file or checkpoint that cannot be used, found before the
    /// first step, in one line naming the setting (by its command-line flag,
    /// `--batch`) and what is wrong with it. No step ran and nothing of the user's was
    /// changed (the one thing a refusal may leave is a checkpoint directory the run
    /// had just made and marked as meshwork's).
    #[error("{0}")]
    Usage(String),
    /// The run started and failed: a loss that is not a finite number, a one-device
    /// check that failed, a checkpoint that could not be saved. The losses so far were
    /// written where asked. (A run stopped on request is not an error: its
    /// [`Report`](crate::Report) says it stopped.)
    #[error("{0}")]
    Failed(String),
}

impl Error {
    /// A usage error naming `--flag`: `--flag: problem`.
    pub(crate) fn flag(flag: &str, problem: impl std::fmt::Display) -> Error {
        Error::Usage(format!("--{flag}: {problem}"))
    }

    /// A usage error in the caller's words.
    pub(crate) fn usage(message: impl Into<String>) -> Error {
        Error::Usage(message.into())
    }

    /// A failed run, in the caller's words.
    pub(crate) fn failed(message: impl std::fmt::Display) -> Error {
        Error::Failed(message.to_string())
    }
}

impl From<meshwork_io::Error> for Error {
    /// A file that cannot be used: a usage error in the file reader's words (which
    /// name the input as the caller named it).
    fn from(e: meshwork_io::Error) -> Error {
        Error::Usage(e.0)
    }
}

/// `Result` with the trainer's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
