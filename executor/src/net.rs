//! Across processes: the transport trait, the agreement protocol every cross-process
//! collective starts with, and an in-memory transport for tests.

use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use meshwork_types::ReduceOp;

use crate::hub::{Gathered, Hub, Offer, ReplicaGroups};
use crate::{Error, Result, Tensor};

/// How the processes of a multi-process run move data between them.
///
/// Every method is collective: every process calls it, in the same order, and it
/// returns once every process has taken part. Tensors passed in and returned are 1-D
/// and of one dtype across processes. Implementations: [`LoopbackInterconnect`] (in
/// one address space, for tests) and, with the `mpi` feature, `mpi::Mpi`.
pub trait Interconnect: Send + Sync {
    /// This process, `0..processes()`.
    fn process(&self) -> usize;

    /// How many processes take part.
    fn processes(&self) -> usize;

    /// Every process's `header` (the same length everywhere), concatenated in process
    /// order. Waits at most about `timeout` for the others: this is where a process
    /// that never comes is noticed, so an implementation that cannot return an error
    /// then must end the job rather than wait forever.
    fn handshake(&self, header: &[i64], timeout: Duration) -> Result<Vec<i64>>;

    /// Every process's `mine` concatenated in process order; `counts[p]` is process
    /// `p`'s length.
    fn all_gather(&self, mine: &Tensor, counts: &[usize]) -> Result<Tensor>;

    /// Sends the `p`-th run of `send_counts[p]` consecutive elements of `send` to
    /// process `p`, and returns what every process sent here (`recv_counts[p]`
    /// elements from process `p`) concatenated in process order.
    fn all_to_all(
        &self,
        send: &Tensor,
        send_counts: &[usize],
        recv_counts: &[usize],
    ) -> Result<Tensor>;
}

const STEP: i64 = 1;
const END: i64 = 2;
const FAILED: i64 = 3;

/// One run's link to the other processes: every cross-process step starts with a
/// handshake in which each process says what it is about to do (a collective and its
/// signature, the end of its run, or a failure), so that every process reaches the
/// same decision — go on, or stop with the same error — and none is left waiting.
pub(crate) struct Net {
    link: Arc<dyn Interconnect>,
    local: usize,
    timeout: Duration,
    /// A handshake of this run failed: the processes stopped talking for this run.
    broken: AtomicBool,
}

impl Net {
    pub(crate) fn new(link: Arc<dyn Interconnect>, local: usize, timeout: Duration) -> Net {
        Net { link, local, timeout, broken: AtomicBool::new(false) }
    }

    /// The first global replica id of this process.
    pub(crate) fn base(&self) -> usize {
        self.link.process() * self.local
    }

    /// Replicas across all processes.
    pub(crate) fn replicas(&self) -> usize {
        self.link.processes() * self.local
    }

    /// Agrees with every process on the next collective `op` with `signature`, as seen
    /// by `replica`; fails, everywhere alike, if a process failed or disagrees.
    pub(crate) fn step(&self, op: &'static str, signature: &str, replica: usize) -> Result<()> {
        let mut h = rustc_hash::FxHasher::default();
        (op, signature).hash(&mut h);
        self.agree(op, [STEP, h.finish() as i64], replica)
    }

    /// Ends this process's run: tells the others it finished, or that `failed` (a
    /// global replica id) failed. Does nothing if the run already stopped at a
    /// handshake.
    pub(crate) fn finish(&self, failed: Option<usize>) -> Result<()> {
        if self.broken.load(Ordering::SeqCst) {
            return Ok(());
        }
        let header = match failed {
            Some(r) => [FAILED, r as i64],
            None => [END, 0],
        };
        self.agree("end of run", header, self.base())
    }

    fn agree(&self, op: &'static str, header: [i64; 2], replica: usize) -> Result<()> {
        let all = self.link.handshake(&header, self.timeout).inspect_err(|_| self.stop())?;
        let rows: Vec<&[i64]> = all.chunks(header.len()).collect();
        if let Some(row) = rows.iter().find(|row| row[0] == FAILED) {
            self.stop();
            return Err(Error::PeerFailed { failed: row[1] as usize, replica, op });
        }
        if let Some(p) = rows.iter().position(|row| **row != header) {
            self.stop();
            let what = |row: &[i64]| match row[0] {
                STEP => format!("a collective with signature hash {:016x}", row[1]),
                _ => "the end of its run".to_string(),
            };
            let first = |p: usize| p * self.local;
            return Err(Error::Mismatch {
                op,
                group: (0..self.replicas()).collect(),
                first: first(0),
                expected: format!("process 0 is at {}", what(rows[0])),
                replica: first(p),
                actual: format!("process {p} is at {}", what(rows[p])),
            });
        }
        Ok(())
    }

    fn stop(&self) {
        self.broken.store(true, Ordering::SeqCst);
    }

    /// Every process's `local` tensors (all of one dtype and shape), as one list in
    /// global replica order.
    pub(crate) fn gather_all(&self, local: &[Arc<Tensor>]) -> Result<Gathered> {
        let shape = local[0].shape().to_vec();
        let mine = Tensor::flatten(local);
        let counts = vec![mine.len(); self.link.processes()];
        let all = self.link.all_gather(&mine, &counts)?;
        Ok(Arc::new(all.split_flat(self.replicas(), &shape).into_iter().map(Arc::new).collect()))
    }

    /// Reduces each process's 1-D `partial` (a fold of its local replicas) across the
    /// processes: process `p` folds the `p`-th chunk of every partial in process order,
    /// then the chunks are gathered. Every process gets the same bits.
    pub(crate) fn reduce(&self, partial: Tensor, op: ReduceOp) -> Result<Tensor> {
        let (p, n, len) = (self.link.process(), self.link.processes(), partial.len());
        let counts: Vec<usize> = (0..n).map(|q| (q + 1) * len / n - q * len / n).collect();
        let chunks = self.link.all_to_all(&partial, &counts, &vec![counts[p]; n])?;
        drop(partial);
        let fold = if op == ReduceOp::Mean { ReduceOp::Sum } else { op };
        let mine = chunks.fold_chunks(n, fold);
        self.link.all_gather(&mine, &counts)
    }
}

/// Several "processes" in one address space, joined by shared memory: for testing a
/// multi-process program (one [`Runtime`](crate::Runtime) per process, each on its
/// own thread) without MPI.
pub struct LoopbackInterconnect {
    process: usize,
    hub: Arc<Hub>,
}

impl LoopbackInterconnect {
    /// The links of `processes` processes, one per process in process order.
    pub fn group(processes: usize) -> Vec<Arc<dyn Interconnect>> {
        let hub = Arc::new(Hub::new(processes.max(1), crate::Runtime::DEFAULT_TIMEOUT));
        (0..processes)
            .map(|process| {
                Arc::new(LoopbackInterconnect { process, hub: hub.clone() })
                    as Arc<dyn Interconnect>
            })
            .collect()
    }

    fn exchange(&self, op: &'static str, t: Tensor) -> Result<Gathered> {
        let all = ReplicaGroups::all(self.hub.replicas());
        let offer = Offer { op, signature: String::new(), tensor: Arc::new(t) };
        self.hub.exchange(&all, self.process, offer)
    }
}

impl Interconnect for LoopbackInterconnect {
    fn process(&self) -> usize {
        self.process
    }

    fn processes(&self) -> usize {
        self.hub.replicas()
    }

    fn handshake(&self, header: &[i64], _timeout: Duration) -> Result<Vec<i64>> {
        let t = Tensor::I64(ndarray::Array1::from(header.to_vec()).into_dyn());
        let all = self.exchange("handshake", t)?;
        Ok(all
            .iter()
            .flat_map(|t| match &**t {
                Tensor::I64(a) => a.iter().copied().collect::<Vec<_>>(),
                _ => unreachable!("handshakes carry i64"),
            })
            .collect())
    }

    fn all_gather(&self, mine: &Tensor, _counts: &[usize]) -> Result<Tensor> {
        let all = self.exchange("all_gather", mine.clone())?;
        Ok(Tensor::flatten(&all))
    }

    fn all_to_all(
        &self,
        send: &Tensor,
        send_counts: &[usize],
        _recv_counts: &[usize],
    ) -> Result<Tensor> {
        // Each process also needs where its run starts in every sender's buffer.
        let offsets: Vec<i64> = send_counts
            .iter()
            .scan(0, |at, &c| {
                *at += c;
                Some((*at - c) as i64)
            })
            .collect();
        let starts = self.handshake(&offsets, Duration::ZERO)?;
        let all = self.exchange("all_to_all", send.clone())?;
        let n = self.processes();
        let runs: Vec<Tensor> = (0..n)
            .map(|q| {
                let start = starts[q * n + self.process] as usize;
                let end = if self.process + 1 < n {
                    starts[q * n + self.process + 1] as usize
                } else {
                    all[q].len()
                };
                all[q].slice_flat(start..end)
            })
            .collect();
        let runs: Vec<Arc<Tensor>> = runs.into_iter().map(Arc::new).collect();
        Ok(Tensor::flatten(&runs))
    }
}
