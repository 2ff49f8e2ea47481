//! A run spread over the processes of a job (an MPI job's ranks, or test threads
//! joined by a loopback link): one mesh over every process's devices, each process
//! running its own positions.
//!
//! What the processes must decide alike goes through here, over the job's link and
//! a one-device runtime of its own:
//! - whether a run goes ahead ([`Processes::agree`]): each process's outcome, and
//!   where any failed, the failure every process then reports — the first failure
//!   that is the process's own (a missing file on one node), not one that came from
//!   seeing a peer fail;
//! - whether to stop after this host call (the same agreement): a signal reaches the
//!   processes at different instants, so each says whether it saw one and all stop
//!   after the same step.
//!
//! An agreement that meets another process still at a step (its collectives) fails
//! there alike in both — the executor's handshake compares every process's next
//! collective — and is tried again: the other process fails its step the same way and
//! comes to the agreement. A process that never comes ends the job at the
//! executor's timeout (over MPI: the job is aborted), never a hang.

use std::sync::Arc;
use std::time::{Duration, Instant};

use meshwork_strategy::Tensor;
use meshwork_strategy::executor::{Error as ExecutorError, Interconnect, Runtime};

use crate::{Error, Result};

/// The processes a run spans, and this one's place among them.
#[derive(Clone)]
pub struct Processes {
    inner: Arc<Inner>,
}

struct Inner {
    link: Arc<dyn Interconnect>,
    /// One device joined to the link: the agreements' runs.
    runtime: Runtime,
}

impl std::fmt::Debug for Processes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Processes({} of {})", self.process(), self.count())
    }
}

impl PartialEq for Processes {
    fn eq(&self, other: &Processes) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

/// How long an agreement keeps trying while other processes finish what they were
/// doing (their current step fails at the agreement's first try).
const AGREE_FOR: Duration = Duration::from_secs(600);

/// An error's code on the wire.
fn code(e: &Error) -> i64 {
    match e {
        Error::Usage(_) => 2,
        Error::Failed(_) => 1,
    }
}

/// Whether a failure came from another process's: a collective a peer failed or
/// left (the executor's words for it), which the peer's own error explains.
fn secondary(message: &str) -> bool {
    message.contains("failed, so replica")
        || message.contains(" is at ")
        || message.contains("another process failed")
        || message.contains("whose run ended without sending")
}

impl Processes {
    /// The job `link` joins this process to (every process makes its own, in the
    /// same order relative to its other collectives).
    pub fn new(link: Arc<dyn Interconnect>) -> Result<Processes> {
        let runtime = Runtime::new(1)
            .map_err(|e| Error::failed(format!("processes: {e}")))?
            .with_interconnect(link.clone());
        Ok(Processes { inner: Arc::new(Inner { link, runtime }) })
    }

    /// This process, `0..count()`.
    pub fn process(&self) -> usize {
        self.inner.link.process()
    }

    /// How many processes the job has.
    pub fn count(&self) -> usize {
        self.inner.link.processes()
    }

    /// Whether this is the process that reports (writes the run's outputs, prints).
    pub fn leads(&self) -> bool {
        self.process() == 0
    }

    /// The payload bytes this process has sent to the others so far (its link's
    /// count).
    pub fn bytes_sent(&self) -> u64 {
        self.inner.link.bytes_sent()
    }

    /// The job's link, for the runtime that runs the mesh.
    pub(crate) fn link(&self) -> Arc<dyn Interconnect> {
        self.inner.link.clone()
    }

    /// Every process's `row` (the same length everywhere), in process order: one run
    /// of the agreements' runtime, tried again while it meets another process still
    /// at a step.
    fn gather(&self, row: Vec<i64>, what: &str) -> Result<Vec<Vec<i64>>> {
        let width = row.len();
        let start = Instant::now();
        loop {
            let t = Tensor::I64(
                ndarray::Array2::from_shape_vec((1, width), row.clone())
                    .map_err(|e| Error::failed(e.to_string()))?
                    .into_dyn(),
            );
            let program: Arc<meshwork_strategy::executor::ReplicaFn> =
                Arc::new(|ctx, mut input| Ok(vec![ctx.all_gather(0, input.remove(0))?]));
            match self.inner.runtime.run(program, vec![vec![t]]) {
                Ok(mut out) => {
                    let all = out.pop().and_then(|mut o| o.pop());
                    let Some(Tensor::I64(all)) = all else {
                        return Err(Error::failed(format!("{what}: the gather returned nothing")));
                    };
                    let flat: Vec<i64> = all.iter().copied().collect();
                    return Ok(flat.chunks(width.max(1)).map(<[i64]>::to_vec).collect());
                }
                Err(
                    ExecutorError::Mismatch { .. }
                    | ExecutorError::PeerFailed { .. }
                    | ExecutorError::NotSent { .. },
                ) if start.elapsed() < AGREE_FOR => {
                    // Another process was still at a step: it fails there alike and
                    // comes here next.
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => {
                    return Err(Error::failed(format!(
                        "{what}: the processes did not agree within {AGREE_FOR:?}: {e}"
                    )));
                }
            }
        }
    }

    /// The outcome every process reports, and whether any asked to stop: `mine` where
    /// every process succeeded, else the failure of the first process whose failure is
    /// its own (the first failure otherwise), as that process's kind of error (bad
    /// input or a failed run), its message prefixed with the process that saw it.
    ///
    /// Every point where the processes meet between steps is this one agreement, so
    /// any two pair up: a process that failed and one that is about to stop learn the
    /// same thing. Once it returns a failure, no process agrees again.
    pub fn agree<T>(&self, mine: Result<T>, stop: bool) -> Result<(T, bool)> {
        let status = match &mine {
            Ok(_) => vec![0, 0, i64::from(stop)],
            Err(e) => vec![code(e), i64::from(!secondary(&e.to_string())), i64::from(stop)],
        };
        let all = self.gather(status, "the outcome")?;
        let stop = all.iter().any(|r| r[2] != 0);
        let Some(q) = all
            .iter()
            .position(|r| r[0] != 0 && r[1] == 1)
            .or_else(|| all.iter().position(|r| r[0] != 0))
        else {
            return mine.map(|t| (t, stop));
        };
        // The chosen process's message, as bytes one per element.
        let text = match &mine {
            Err(e) if self.process() == q => e.to_string().into_bytes(),
            _ => Vec::new(),
        };
        let lens = self.gather(vec![text.len() as i64, 0, 0, 0], "a failure's length")?;
        let longest = lens.iter().map(|r| r[0]).max().unwrap_or(0).max(0) as usize;
        let mut row: Vec<i64> = text.iter().map(|&b| i64::from(b)).collect();
        row.resize(longest + 5, 0);
        let rows = self.gather(row, "a failure's message")?;
        let n = usize::try_from(lens[q][0]).unwrap_or(0);
        let message: Vec<u8> = rows[q].iter().take(n).map(|&b| b as u8).collect();
        let message = String::from_utf8_lossy(&message);
        let message =
            if self.count() > 1 { format!("process {q}: {message}") } else { message.into() };
        Err(match all[q][0] {
            2 => Error::Usage(message),
            _ => Error::Failed(message),
        })
    }
}
