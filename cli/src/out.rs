//! How a command ends, and writing to people: standard output that may be closed by
//! its reader, standard error that may be gone.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};

/// Set in every process of an MPI job but the first: the job speaks through process
/// 0 (its progress, summary and errors), the others write nothing.
static SILENT: AtomicBool = AtomicBool::new(false);

/// Makes this process write nothing to standard output or error from now on.
pub(crate) fn silence() {
    SILENT.store(true, Ordering::SeqCst);
}

/// How a command ends when it does not simply succeed.
#[derive(Debug)]
pub(crate) enum Exit {
    /// Bad input (or output that cannot be written): one line, status 2.
    Usage(String),
    /// The job ran and failed (a loss that is not finite, a failed check): one line,
    /// status 1.
    Failed(String),
    /// Stopped by SIGINT or SIGTERM after saving what it could: status 130.
    Interrupted,
    /// Standard output was closed by its reader (`meshwork ... | head`): end quietly,
    /// status 0, as `ls | head` does.
    Closed,
}

/// Writes to standard output and flushes: a reader that went away is [`Exit::Closed`],
/// any other failure (a full disk) a one-line [`Exit::Usage`] — never a panic.
pub(crate) fn out(text: std::fmt::Arguments<'_>) -> Result<(), Exit> {
    if SILENT.load(Ordering::SeqCst) {
        return Ok(());
    }
    let mut stdout = std::io::stdout().lock();
    stdout.write_fmt(text).and_then(|()| stdout.flush()).map_err(|e| {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            Exit::Closed
        } else {
            Exit::Usage(format!("cannot write to standard output: {e}"))
        }
    })
}

/// A line on standard error; if standard error itself cannot be written there is no
/// one left to tell, so the failure is ignored (the exit status still says it).
pub(crate) fn note(text: std::fmt::Arguments<'_>) {
    if SILENT.load(Ordering::SeqCst) {
        return;
    }
    let mut stderr = std::io::stderr().lock();
    let _ = stderr.write_fmt(text).and_then(|()| stderr.write_all(b"\n"));
}

/// A line on standard output through [`out`], returning from the function on failure.
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::out::out(format_args!("{}\n", format_args!($($arg)*)))?
    };
}
pub(crate) use outln;
