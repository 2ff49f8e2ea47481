//! Stopping a run from outside: SIGINT and SIGTERM set a flag the trainer reads after
//! each host call (it saves, writes its outputs and returns a report that says it
//! stopped); a second SIGINT or SIGTERM exits at once with status 130.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use crate::{Error, Result};

/// Installs the SIGINT and SIGTERM handlers and returns the flag they set, for
/// [`Trainer::run`](crate::Trainer::run). Call it once, in a binary: the handlers are
/// the process's.
pub fn stop_on_signals() -> Result<Arc<AtomicBool>> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let stop = Arc::new(AtomicBool::new(false));
    let install = || -> std::io::Result<()> {
        for signal in [SIGINT, SIGTERM] {
            // Registered first, so that it sees the flag before the second handler
            // sets it: the second signal exits, the first only asks.
            signal_hook::flag::register_conditional_shutdown(signal, 130, stop.clone())?;
            signal_hook::flag::register(signal, stop.clone())?;
        }
        Ok(())
    };
    install().map_err(|e| Error::failed(format!("cannot install the signal handlers: {e}")))?;
    Ok(stop)
}
