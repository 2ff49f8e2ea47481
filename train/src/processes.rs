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
    /// The failure an agreement returned: every later agreement returns it without
    /// meeting the others (who returned it too, and will not agree again).
    settled: std::sync::Mutex<Option<Error>>,
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

/// How long an agreement waits for the other processes, and keeps trying while they
/// finish what they were doing (their current step fails at its first try): past it
/// (a process that died, under a launcher that did not end the job), the job ends.
const AGREE_FOR: Duration = Duration::from_secs(900);

/// Where in a run the processes agree: points that must pair up when every process
/// succeeded (a failed process comes to the outcome from anywhere).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Point {
    /// Unnamed (a library caller's).
    Any = 0,
    /// The run planned.
    Planned = 1,
    /// The token cache filled by process 0.
    Text = 2,
    /// The outputs opened by process 0.
    Opened = 3,
    /// The others joined the checkpoint directory.
    Joined = 4,
    /// Between host calls: stop or go on.
    Step = 5,
    /// The run's end.
    End = 6,
    /// Every process started its steps.
    Started = 7,
}

impl Point {
    fn name(k: i64) -> &'static str {
        match k {
            1 => "the plan",
            2 => "the token cache",
            3 => "the outputs",
            4 => "the checkpoint directory",
            5 => "a step",
            6 => "the end of the run",
            7 => "the start of the steps",
            _ => "an agreement",
        }
    }
}

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
        // Its collectives wait as long as an agreement may (a process doing what only
        // process 0 does: encoding the text, writing an export).
        let runtime = Runtime::new(1)
            .map_err(|e| Error::failed(format!("processes: {e}")))?
            .with_timeout(AGREE_FOR)
            .with_interconnect(link.clone());
        let settled = std::sync::Mutex::new(None);
        Ok(Processes { inner: Arc::new(Inner { link, runtime, settled }) })
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

    /// The slots of each batch (of `batch` rows, cut into `micro` consecutive
    /// micro-batches, each split over the data axis) that this process's positions
    /// train on, on a `data x model` mesh whose positions spread over the processes
    /// in order (data-major): their rows go to no other process's devices.
    pub(crate) fn slots(
        &self,
        (data, model): (usize, usize),
        batch: usize,
        micro: usize,
    ) -> Vec<usize> {
        let local = data * model / self.count().max(1);
        let first = self.process() * local;
        let (lo, hi) = (first / model.max(1), (first + local - 1) / model.max(1));
        let part = batch / micro.max(1);
        let per = part / data.max(1);
        (0..micro.max(1)).flat_map(|j| j * part + lo * per..j * part + (hi + 1) * per).collect()
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
    /// same thing. Once it returns a failure, no process agrees again: a later call
    /// returns that failure at once.
    pub fn agree<T>(&self, mine: Result<T>, stop: bool) -> Result<(T, bool)> {
        self.agree_at(Point::Any, 0, mine, stop)
    }

    /// [`agree`](Self::agree) at the point `at` of a run, with a digest of what this
    /// process planned: where every process succeeded but they stand at different
    /// points, or their digests differ, they did not plan the same run (their files
    /// differ between machines) — every process fails, saying so.
    pub(crate) fn agree_at<T>(
        &self,
        at: Point,
        digest: u64,
        mine: Result<T>,
        stop: bool,
    ) -> Result<(T, bool)> {
        let settled = self.inner.settled.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(e) = settled {
            return Err(e);
        }
        let agreed = self.agree_now(at, digest, mine, stop);
        if let Err(e) = &agreed {
            *self.inner.settled.lock().unwrap_or_else(|e| e.into_inner()) = Some(e.clone());
        }
        agreed
    }

    /// Process 0's `mine`, agreed by every process (the others' own outcomes count
    /// as in [`agree`](Self::agree); their values are not used).
    pub(crate) fn lead_says(&self, mine: Result<bool>) -> Result<bool> {
        let says = self.leads() && matches!(mine, Ok(true));
        self.agree_at(Point::Text, 0, mine.map(|_| ()), says).map(|((), said)| said)
    }

    fn agree_now<T>(
        &self,
        at: Point,
        digest: u64,
        mine: Result<T>,
        stop: bool,
    ) -> Result<(T, bool)> {
        let (point, digest) = (at as i64, digest as i64);
        let status = match &mine {
            Ok(_) => vec![0, 0, i64::from(stop), point, digest],
            Err(e) => {
                vec![code(e), i64::from(!secondary(&e.to_string())), i64::from(stop), point, digest]
            }
        };
        let all = self.gather(status, "the outcome")?;
        let stop = all.iter().any(|r| r[2] != 0);
        if all.iter().all(|r| r[0] == 0) {
            let apart = |k: usize| {
                all.iter().position(|r| r[k] != all[0][k] && r[k] != 0 && all[0][k] != 0)
            };
            if let Some(q) = apart(3).or_else(|| apart(4)) {
                let what = if all[q][3] != all[0][3] {
                    format!(
                        "process {q} is at {}, process 0 at {}",
                        Point::name(all[q][3]),
                        Point::name(all[0][3])
                    )
                } else {
                    format!("process {q} planned another run than process 0")
                };
                return Err(Error::Usage(format!(
                    "the processes do not run the same job ({what}): every process must see the same files and flags"
                )));
            }
        }
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

/// The MPI job this process is a rank of, joined (feature `mpi`): its processes, and
/// the MPI handle, which finalises MPI when dropped — keep it until the run is over.
/// `None` when the job has one process (a process started alone runs as without MPI).
/// Call it only in a process an MPI launcher started: MPI's initialisation is the
/// launcher's to answer.
#[cfg(feature = "mpi")]
pub fn join_mpi() -> Result<Option<(Processes, meshwork_strategy::executor::mpi::Mpi)>> {
    let mpi = meshwork_strategy::executor::mpi::Mpi::init(None)
        .map_err(|e| Error::usage(format!("cannot join the MPI job: {e}")))?;
    if mpi.processes() < 2 {
        return Ok(None);
    }
    let processes = Processes::new(mpi.interconnect())?;
    Ok(Some((processes, mpi)))
}

/// What one process of a spread run trains on, so that it reads only those rows of
/// its data: the batch slots its positions take (their rows go to no other process's
/// devices), the steps it runs, the row order, and the held-out rows (which every
/// process evaluates on).
#[derive(Debug, Clone)]
pub(crate) struct Share {
    pub(crate) processes: Processes,
    pub(crate) slots: Vec<usize>,
    pub(crate) batch: usize,
    pub(crate) steps: std::ops::Range<usize>,
    /// `--shuffle`'s seed.
    pub(crate) shuffle: Option<u64>,
    /// `--eval-fraction` when the run evaluates.
    pub(crate) held_out: Option<f64>,
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

impl Share {
    /// Of `n` rows, the ones this process reads: those its slots take over its steps
    /// (as the trainer orders them, [`Rows`](crate::trainer::Rows)), and, in process 0
    /// (which evaluates), the held-out rows. Unshuffled rows repeat every `rows / gcd(rows, B)` steps, so no more are
    /// looked at; shuffled ones, until every row is taken or as many examples as 16
    /// passes over the rows have been looked at (then all are read).
    pub(crate) fn wanted(&self, n: usize) -> Vec<bool> {
        let held = self.held_out.map_or(0, |f| ((f * n as f64).ceil() as usize).min(n));
        let rows = n - held;
        let mut want = vec![false; n];
        // The held-out rows: process 0 alone evaluates.
        if self.processes.leads() {
            want[rows..].iter_mut().for_each(|w| *w = true);
        }
        if rows == 0 || self.batch == 0 {
            return want;
        }
        let mut order = crate::trainer::Rows::order(rows, self.shuffle);
        let period = match self.shuffle {
            None => rows / gcd(rows, self.batch),
            Some(_) => usize::MAX,
        };
        let end = self.steps.end.min(self.steps.start.saturating_add(period));
        let budget = rows.saturating_mul(16);
        let (mut taken, mut looked) = (0, 0usize);
        for s in self.steps.start..end {
            for &i in &self.slots {
                let r = order.row(s * self.batch + i);
                if !want[r] {
                    want[r] = true;
                    taken += 1;
                }
                looked += 1;
            }
            if taken == rows {
                break;
            }
            if looked > budget {
                want.iter_mut().for_each(|w| *w = true);
                break;
            }
        }
        want
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn share(
        slots: Vec<usize>,
        batch: usize,
        steps: std::ops::Range<usize>,
        shuffle: Option<u64>,
        held: Option<f64>,
    ) -> Share {
        let link = meshwork_strategy::executor::LoopbackInterconnect::group(1).remove(0);
        Share {
            processes: Processes::new(link).unwrap(),
            slots,
            batch,
            steps,
            shuffle,
            held_out: held,
        }
    }

    proptest! {
        /// The rows a process reads are exactly those the trainer's order gives its
        /// slots over its steps (every step looked at, no shortcut), and the held-out
        /// rows — a re-simulation of the run as the oracle; past the look-ahead
        /// budget, a superset of them.
        #[test]
        fn prop_the_rows_read_are_the_rows_trained_on(
            n in 1usize..60,
            batch in 1usize..12,
            cut in 0usize..12,
            first in 0usize..10,
            len in 0usize..40,
            shuffle in proptest::option::of(any::<u64>()),
            held in proptest::option::of(0.05f64..0.5),
        ) {
            let cut = cut.min(batch);
            let (a, b) = if cut == 0 { (0, batch) } else { (cut, batch) };
            let s = share((a..b).collect(), batch, first..first + len, shuffle, held);
            let got = s.wanted(n);
            let held_rows = held.map_or(0, |f| ((f * n as f64).ceil() as usize).min(n));
            let rows = n - held_rows;
            let mut want = vec![false; n];
            want[rows..].iter_mut().for_each(|w| *w = true);
            if rows > 0 {
                let mut order = crate::trainer::Rows::order(rows, shuffle);
                for step in first..first + len {
                    for i in a..b {
                        want[order.row(step * batch + i)] = true;
                    }
                }
            }
            if len * (b - a) > 16 * rows {
                // Past the look-ahead budget every row may be read: never fewer.
                prop_assert!(got.iter().zip(&want).all(|(g, w)| *g || !*w));
            } else {
                prop_assert_eq!(got, want);
            }
        }
    }

    /// Two processes of a 2x1 mesh take disjoint halves of each batch; on a 2x2 mesh
    /// of 4 processes, each pair of a data row takes the same half.
    #[test]
    fn each_process_takes_its_data_positions_slots() {
        let links = meshwork_strategy::executor::LoopbackInterconnect::group(2);
        let p: Vec<Processes> = links.into_iter().map(|l| Processes::new(l).unwrap()).collect();
        let r = |a: usize, b: usize| (a..b).collect::<Vec<_>>();
        assert_eq!(p[0].slots((2, 1), 8, 1), r(0, 4));
        assert_eq!(p[1].slots((2, 1), 8, 1), r(4, 8));
        assert_eq!(p[0].slots((2, 2), 8, 1), r(0, 4));
        assert_eq!(p[1].slots((2, 2), 8, 1), r(4, 8));
        // 2 micro-batches of 4 rows, each split over the data axis.
        assert_eq!(p[0].slots((2, 1), 8, 2), [0, 1, 4, 5]);
        assert_eq!(p[1].slots((2, 1), 8, 2), [2, 3, 6, 7]);
        let links = meshwork_strategy::executor::LoopbackInterconnect::group(4);
        let p: Vec<Processes> = links.into_iter().map(|l| Processes::new(l).unwrap()).collect();
        let slots: Vec<_> = p.iter().map(|p| p.slots((2, 2), 8, 1)).collect();
        assert_eq!(slots, [r(0, 4), r(0, 4), r(4, 8), r(4, 8)]);
        // One process holding a whole data row and half the next (3x2 over 2).
        let links = meshwork_strategy::executor::LoopbackInterconnect::group(2);
        let p: Vec<Processes> = links.into_iter().map(|l| Processes::new(l).unwrap()).collect();
        assert_eq!(p[0].slots((3, 2), 6, 1), r(0, 4));
        assert_eq!(p[1].slots((3, 2), 6, 1), r(2, 6));
    }
}
