//! Across processes: the transport trait, the agreement protocol every cross-process
//! collective starts with, and an in-memory transport for tests.

use std::hash::{Hash, Hasher};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use meshwork_types::ReduceOp;

use crate::hub::{Gathered, Hub, Offer, ReplicaGroups};
use crate::tensor::TensorOps;
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

    /// Sends elements `send[p]` of `from` to each process `p`, and receives what
    /// process `p` sends here into elements `recv[p]` of `into` (empty ranges send or
    /// receive nothing; the lengths must match pairwise). `from` and `into` have one
    /// dtype and are standard layout.
    fn all_to_all_into(
        &self,
        from: &Tensor,
        send: &[Range<usize>],
        into: &mut Tensor,
        recv: &[Range<usize>],
    ) -> Result<()>;

    /// On entry, elements `chunks[process()]` of `buf` hold this process's part; on
    /// return every `chunks[p]` holds process `p`'s part (the chunks are disjoint and
    /// the same on every process).
    fn all_gather_in_place(&self, buf: &mut Tensor, chunks: &[Range<usize>]) -> Result<()>;

    /// This link's settings that every process must share, as a number (for MPI, the
    /// message cap): every step's agreement compares it, so processes set differently
    /// all fail alike at their next collective instead of exchanging messages they
    /// split differently. The default, 0, is a link without such settings.
    fn settings(&self) -> i64 {
        0
    }

    /// The payload bytes this process has sent to other processes so far (the
    /// exchanges' and gathers' data; not the handshakes' few words): what a run's
    /// traffic between processes is measured by. The default, 0, is a link that does
    /// not count.
    fn bytes_sent(&self) -> u64 {
        0
    }
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
    /// Exchange plans by key (see [`plan`](Self::plan)), the runtime's.
    plans: Arc<Plans>,
}

/// Exchange plans by key (see [`Net::plan`]): a runtime's, kept from run to run.
pub(crate) type Plans = Mutex<rustc_hash::FxHashMap<String, Arc<Plan>>>;

/// How many exchange plans a runtime keeps: a training step repeats a few dozen to a
/// few hundred collective signatures (one per parameter at most); past this many the
/// plans are dropped and made again as needed.
const PLANS_KEPT: usize = 1024;

impl Net {
    /// `plans` keeps the plans this run makes for later runs: the runtime's, whose
    /// runs all have the same processes and `local` replicas each.
    pub(crate) fn new(
        link: Arc<dyn Interconnect>,
        local: usize,
        timeout: Duration,
        plans: Arc<Plans>,
    ) -> Net {
        Net { link, local, timeout, broken: AtomicBool::new(false), plans }
    }

    /// The first global replica id of this process.
    pub(crate) fn base(&self) -> usize {
        self.link.process() * self.local
    }

    /// Replicas across all processes.
    pub(crate) fn replicas(&self) -> usize {
        self.link.processes() * self.local
    }

    /// This process's chunk of a tensor of `len` elements in [`reduce`](Self::reduce)
    /// and [`reduce_scatter`](Self::reduce_scatter).
    pub(crate) fn chunk(&self, len: usize) -> Range<usize> {
        let (p, n) = (self.link.process(), self.link.processes());
        p * len / n..(p + 1) * len / n
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

    /// The handshake: `[kind, detail]` and the link's settings from every process.
    fn agree(&self, op: &'static str, [kind, detail]: [i64; 2], replica: usize) -> Result<()> {
        let header = [kind, detail, self.link.settings()];
        let all = self.link.handshake(&header, self.timeout).inspect_err(|_| self.stop())?;
        let rows: Vec<&[i64]> = all.chunks(header.len()).collect();
        if let Some(row) = rows.iter().find(|row| row[0] == FAILED) {
            self.stop();
            return Err(Error::PeerFailed { failed: row[1] as usize, replica, op });
        }
        // The first process that disagrees with process 0: every process names the same.
        if let Some(p) = rows.iter().position(|row| *row != rows[0]) {
            self.stop();
            let settings_differ = rows[p][..2] == rows[0][..2];
            let what = |row: &[i64]| match row[0] {
                _ if settings_differ => {
                    format!("link settings {} (for MPI, its message cap)", row[2])
                }
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
    pub(crate) fn gather_all(&self, local: &[Arc<Tensor>]) -> Result<Vec<Arc<Tensor>>> {
        let shape = local[0].shape().to_vec();
        let (p, n) = (self.link.process(), self.link.processes());
        let mine = Tensor::flatten(local);
        let len = mine.len();
        let mut all = Tensor::zeroed_in_step(mine.dtype(), &[len * n])?;
        all.write_flat(p * len, &mine);
        drop(mine);
        let chunks: Vec<Range<usize>> = (0..n).map(|q| q * len..(q + 1) * len).collect();
        self.link.all_gather_in_place(&mut all, &chunks)?;
        Ok(all.split_flat(self.replicas(), &shape).into_iter().map(Arc::new).collect())
    }

    /// What an exchange of items moves (see [`exchange`](Self::exchange)): the same on
    /// every process, computed from `wants` alone, so a caller can size its receive
    /// buffer before the processes agree on the step. Made once per `key` and kept
    /// (the local replicas of a step, and the steps after it, share it): `key` must
    /// determine `len`, `items` and `wants` — callers name their call site and the
    /// step's whole signature (collective, arguments, dtype, shape and groups). The
    /// plans outlive the run: its runtime's later runs share them.
    pub(crate) fn plan(
        &self,
        key: String,
        len: usize,
        items: usize,
        wants: &dyn Fn(usize, usize, usize) -> bool,
    ) -> Arc<Plan> {
        let plans = || self.plans.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(plan) = plans().get(&key) {
            debug_assert!(plan.item * plan.items == len && plan.items == items, "{key}");
            return plan.clone();
        }
        // Made outside the lock: the first replicas of a step may each make it.
        let plan = Arc::new(self.make_plan(len, items, wants));
        let mut plans = plans();
        if plans.len() >= PLANS_KEPT {
            plans.clear();
        }
        plans.insert(key, plan.clone());
        plan
    }

    fn make_plan(
        &self,
        len: usize,
        items: usize,
        wants: &dyn Fn(usize, usize, usize) -> bool,
    ) -> Plan {
        let (p, n, d) = (self.link.process(), self.link.processes(), self.local);
        let item = len / items;
        let needs = |q: usize, y: usize, k: usize| (q * d..(q + 1) * d).any(|x| wants(x, y, k));
        // What goes to each other process, in (replica, item) order, and what comes from
        // each, in the same order.
        let mut send = vec![Vec::new(); n];
        let mut recv = vec![Vec::new(); n];
        for q in (0..n).filter(|&q| q != p) {
            for j in 0..d {
                send[q].extend((0..items).filter(|&k| needs(q, p * d + j, k)).map(|k| (j, k)));
            }
            for y in q * d..(q + 1) * d {
                recv[q].extend((0..items).filter(|&k| needs(p, y, k)).map(|k| (y, k)));
            }
        }
        let recv_len = item * recv.iter().map(Vec::len).sum::<usize>();
        Plan { item, items, send, recv, recv_len, local: d }
    }

    /// Moves the items of `plan`: this process's `local` tensors (standard layout, one
    /// dtype, the plan's length) to the processes whose replicas need them, and theirs
    /// into `into` (at least `plan.recv_len()` elements, its old contents overwritten).
    /// Returns, for every global replica `y` and item `k` at `y * items + k`, where in
    /// `into` that item arrived (`None` for items of this process and items not
    /// needed here). With one local tensor whose items for each process are one run,
    /// they are sent straight from it; otherwise through one staging buffer. Only
    /// needed bytes cross processes.
    pub(crate) fn exchange_into(
        &self,
        plan: &Plan,
        local: &[Arc<Tensor>],
        into: &mut Tensor,
    ) -> Result<Vec<Option<usize>>> {
        let (p, n) = (self.link.process(), self.link.processes());
        let item = plan.item;
        let contiguous = |runs: &[(usize, usize)]| runs.windows(2).all(|w| w[1].1 == w[0].1 + 1);
        let direct = local.len() == 1 && plan.send.iter().all(|runs| contiguous(runs));
        let staged;
        let (from, send): (&Tensor, Vec<Range<usize>>) = if direct {
            let ranges = plan
                .send
                .iter()
                .map(|runs| match (runs.first(), runs.last()) {
                    (Some(&(_, a)), Some(&(_, b))) => a * item..(b + 1) * item,
                    _ => 0..0,
                })
                .collect();
            (&local[0], ranges)
        } else {
            let mut runs: Vec<(&Tensor, Range<usize>)> = Vec::new();
            let mut ranges = vec![0..0; n];
            let mut at = 0;
            for (q, range) in ranges.iter_mut().enumerate() {
                let start = at;
                for &(j, k) in &plan.send[q] {
                    runs.push((&*local[j], k * item..(k + 1) * item));
                    at += item;
                }
                *range = start..at;
            }
            staged = Tensor::gather_runs(local[0].dtype(), &runs);
            (&staged, ranges)
        };
        let mut recv = vec![0..0; n];
        let mut at = 0;
        for (q, range) in recv.iter_mut().enumerate() {
            *range = at..at + item * plan.recv[q].len();
            at = range.end;
        }
        debug_assert!(recv[p].is_empty(), "nothing comes from this process itself");
        self.link.all_to_all_into(from, &send, into, &recv)?;
        Ok(plan.offsets())
    }

    /// Moves what a plan's [`Straight`] ranges say, from this process's one replica's
    /// tensor `from` straight into its result `into`.
    pub(crate) fn exchange_straight(
        &self,
        from: &Tensor,
        into: &mut Tensor,
        ranges: &Straight,
    ) -> Result<()> {
        self.link.all_to_all_into(from, &ranges.send, into, &ranges.recv)
    }

    /// The items other processes need of this process's `local` tensors, and the items
    /// this process needs of theirs, moved in one exchange: each tensor (standard
    /// layout, all of one dtype and length) is `items` equal runs of its row-major
    /// elements, and `wants(x, y, k)` says whether global replica `x` needs item `k` of
    /// replica `y` (the same answer on every process). Returns, for every global replica
    /// `y` and item `k` at `y * items + k`, the item (in `item_shape`; a whole tensor of
    /// this process as it is) where a replica of this process needs it, else `None`.
    /// Only needed bytes cross processes.
    /// `key` names the exchange's plan (see [`plan`](Self::plan)).
    pub(crate) fn exchange(
        &self,
        key: String,
        local: &[Arc<Tensor>],
        items: usize,
        item_shape: &[usize],
        wants: &dyn Fn(usize, usize, usize) -> bool,
    ) -> Result<Vec<Option<Arc<Tensor>>>> {
        let (p, d) = (self.link.process(), self.local);
        let plan = self.plan(key, local[0].len(), items, wants);
        let item = plan.item;
        let mut into = Tensor::zeroed_in_step(local[0].dtype(), &[plan.recv_len])?;
        let offsets = self.exchange_into(&plan, local, &mut into)?;
        let mut out: Vec<Option<Arc<Tensor>>> = vec![None; offsets.len()];
        for (at, slot) in offsets.iter().zip(out.iter_mut()) {
            if let Some(at) = at {
                *slot = Some(Arc::new(into.slice_flat(*at..*at + item).reshaped(item_shape)));
            }
        }
        // This process's own items where its replicas need them.
        for (j, t) in local.iter().enumerate() {
            let y = p * d + j;
            for k in (0..items).filter(|&k| (p * d..(p + 1) * d).any(|x| wants(x, y, k))) {
                out[y * items + k] = Some(match items {
                    1 if t.shape() == item_shape => t.clone(),
                    1 => Arc::new((**t).clone().reshaped(item_shape)),
                    _ => Arc::new(t.slice_flat(k * item..(k + 1) * item).reshaped(item_shape)),
                });
            }
        }
        Ok(out)
    }

    /// Every replica's tensor (`local` are this process's, standard layout, one dtype
    /// and length), end to end in replica order in one 1-D tensor: this process's
    /// written in place, the others' received straight into theirs.
    /// `out` is the result's buffer (1-D, the inputs' dtype, every replica's elements;
    /// its old contents are overwritten).
    pub(crate) fn all_gather_flat(&self, local: &[Arc<Tensor>], mut out: Tensor) -> Result<Tensor> {
        let (p, n, d) = (self.link.process(), self.link.processes(), self.local);
        let len = local[0].len();
        for (j, t) in local.iter().enumerate() {
            out.copy_run((p * d + j) * len, t, 0..len);
        }
        let chunks: Vec<Range<usize>> = (0..n).map(|q| q * d * len..(q + 1) * d * len).collect();
        self.link.all_gather_in_place(&mut out, &chunks)?;
        Ok(out)
    }

    /// All-to-all of piece-major tensors: `local` are this process's replicas'
    /// tensors (one dtype, standard layout), each `replicas()` pieces of `piece`
    /// elements end to end. Returns, for each local replica `x`, piece `x` of every
    /// replica's tensor end to end in replica order (1-D), written over `outs[x]`
    /// (of that length). Each process receives only the pieces for its own replicas;
    /// with one device per process the pieces go from the input and into the result
    /// with no staging copy.
    pub(crate) fn all_to_all_pieces(
        &self,
        local: &[Arc<Tensor>],
        piece: usize,
        mut outs: Vec<Tensor>,
    ) -> Result<Vec<Tensor>> {
        let (p, n, d) = (self.link.process(), self.link.processes(), self.local);
        let dtype = local[0].dtype();
        // The pieces that stay in this process.
        for (x, out) in outs.iter_mut().enumerate() {
            for (j, t) in local.iter().enumerate() {
                let at = (p * d + x) * piece;
                out.copy_run((p * d + j) * piece, t, at..at + piece);
            }
        }
        if n == 1 {
            return Ok(outs);
        }
        if d == 1 {
            // Piece q of this replica goes to process q, and process q's piece lands at
            // q in the result.
            let ranges: Vec<Range<usize>> =
                (0..n).map(|q| if q == p { 0..0 } else { q * piece..(q + 1) * piece }).collect();
            self.link.all_to_all_into(&local[0], &ranges, &mut outs[0], &ranges)?;
            return Ok(outs);
        }
        // To process q: for each of its replicas x, piece x of each local replica.
        let mut runs: Vec<(&Tensor, Range<usize>)> = Vec::new();
        let mut send = vec![0..0; n];
        let mut at = 0;
        for (q, range) in send.iter_mut().enumerate() {
            let start = at;
            if q != p {
                for x in q * d..(q + 1) * d {
                    for t in local {
                        runs.push((t, x * piece..(x + 1) * piece));
                        at += piece;
                    }
                }
            }
            *range = start..at;
        }
        let from = Tensor::gather_runs(dtype, &runs);
        drop(runs);
        let block = d * d * piece;
        let recv: Vec<Range<usize>> = (0..n)
            .map(|q| match q.cmp(&p) {
                std::cmp::Ordering::Equal => 0..0,
                std::cmp::Ordering::Less => q * block..(q + 1) * block,
                std::cmp::Ordering::Greater => (q - 1) * block..q * block,
            })
            .collect();
        let mut staged = Tensor::zeroed_in_step(dtype, &[(n - 1) * block])?;
        self.link.all_to_all_into(&from, &send, &mut staged, &recv)?;
        drop(from);
        for q in (0..n).filter(|&q| q != p) {
            for (x, out) in outs.iter_mut().enumerate() {
                // From q: (x, y) for each of q's replicas y, x-major.
                let at = recv[q].start + x * d * piece;
                out.copy_run(q * d * piece, &staged, at..at + d * piece);
            }
        }
        Ok(outs)
    }

    /// Reduces each process's `partial` (a fold of its local replicas, standard
    /// layout) across the processes, in place: process `p` folds the `p`-th chunk of
    /// every partial in process order, segment by segment through a small buffer, then
    /// the chunks are gathered. Every process gets the same bits. A mean is folded as
    /// a sum (the caller divides).
    pub(crate) fn reduce(&self, partial: &mut Tensor, op: ReduceOp) -> Result<()> {
        let chunks = self.fold_chunks(partial, op)?;
        self.link.all_gather_in_place(partial, &chunks)
    }

    /// [`reduce`](Self::reduce) without the gather: returns this process's chunk of
    /// the reduction (chunk `p` of `processes()` equal chunks, 1-D), the only bytes a
    /// reduce-scatter needs here.
    /// The chunk is written over the buffer `out` gives for its length.
    pub(crate) fn reduce_scatter(
        &self,
        partial: &mut Tensor,
        op: ReduceOp,
        out: impl FnOnce(usize) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let chunks = self.fold_chunks(partial, op)?;
        let mine = chunks[self.link.process()].clone();
        let mut out = out(mine.len())?;
        out.copy_run(0, partial, mine);
        Ok(out)
    }

    /// Folds chunk `p` of every process's `partial` into this one's, in process order;
    /// returns the chunks.
    fn fold_chunks(&self, partial: &mut Tensor, op: ReduceOp) -> Result<Vec<Range<usize>>> {
        /// Elements per segment and sender: a segment's buffer stays in cache.
        const SEGMENT: usize = 1 << 16;
        let (p, n, len) = (self.link.process(), self.link.processes(), partial.len());
        let chunk = |q: usize| q * len / n..(q + 1) * len / n;
        let chunks: Vec<Range<usize>> = (0..n).map(chunk).collect();
        let fold = if op == ReduceOp::Mean { ReduceOp::Sum } else { op };
        let longest = chunks.iter().map(|c| c.len()).max().unwrap_or(0);
        let segment = |c: &Range<usize>, s: usize| {
            let start = (c.start + s * SEGMENT).min(c.end);
            start..(start + SEGMENT).min(c.end)
        };
        let mut others = Tensor::zeroed_in_step(partial.dtype(), &[SEGMENT.min(len) * (n - 1)])?;
        for s in 0..longest.div_ceil(SEGMENT) {
            let mine = segment(&chunks[p], s);
            let send: Vec<Range<usize>> =
                (0..n).map(|q| if q == p { 0..0 } else { segment(&chunks[q], s) }).collect();
            let recv: Vec<Range<usize>> = (0..n)
                .map(|q| match q.cmp(&p) {
                    std::cmp::Ordering::Equal => 0..0,
                    std::cmp::Ordering::Less => q * mine.len()..(q + 1) * mine.len(),
                    std::cmp::Ordering::Greater => (q - 1) * mine.len()..q * mine.len(),
                })
                .collect();
            self.link.all_to_all_into(partial, &send, &mut others, &recv)?;
            partial.fold_in_place(mine.clone(), &others, p, n, fold);
        }
        Ok(chunks)
    }
}

/// An exchange's moves (see [`Net::plan`]).
pub(crate) struct Plan {
    /// Elements per item.
    item: usize,
    /// Items per tensor.
    items: usize,
    /// For each process: the (local tensor, item) it gets from this one, in order.
    send: Vec<Vec<(usize, usize)>>,
    /// For each process: the (global replica, item) this one gets from it, in order.
    recv: Vec<Vec<(usize, usize)>>,
    recv_len: usize,
    /// Replicas per process.
    local: usize,
}

impl Plan {
    /// Elements the receive buffer needs.
    pub(crate) fn recv_len(&self) -> usize {
        self.recv_len
    }

    /// Where each item arrives in the receive buffer, as
    /// [`Net::exchange_into`] returns it.
    pub(crate) fn offsets(&self) -> Vec<Option<usize>> {
        let slots = self.recv.len() * self.local * self.items;
        let mut offsets = vec![None; slots];
        let mut at = 0;
        for runs in &self.recv {
            for &(y, k) in runs {
                offsets[y * self.items + k] = Some(at);
                at += self.item;
            }
        }
        offsets
    }

    /// With one replica per process, the exchange as ranges straight from that
    /// replica's tensor and into its result, where item `k` of replica `y` lands at
    /// element `at(y, k)` — if what goes to each process is one run of the tensor and
    /// what comes from each lands as one run of the result; else `None`.
    pub(crate) fn straight(&self, at: &dyn Fn(usize, usize) -> usize) -> Option<Straight> {
        if self.local != 1 {
            return None;
        }
        let item = self.item;
        let one_run = |starts: &[usize]| match starts {
            [] => Some(0..0),
            [first, ..] => starts
                .windows(2)
                .all(|w| w[1] == w[0] + item)
                .then(|| *first..first + item * starts.len()),
        };
        let send = self
            .send
            .iter()
            .map(|runs| one_run(&runs.iter().map(|&(_, k)| k * item).collect::<Vec<_>>()));
        let recv = self
            .recv
            .iter()
            .map(|runs| one_run(&runs.iter().map(|&(y, k)| at(y, k)).collect::<Vec<_>>()));
        Some(Straight { send: send.collect::<Option<_>>()?, recv: recv.collect::<Option<_>>()? })
    }
}

/// An exchange with one replica per process as element ranges, straight from that
/// replica's tensor and into its result (see [`Plan::straight`]).
pub(crate) struct Straight {
    send: Vec<Range<usize>>,
    recv: Vec<Range<usize>>,
}

/// Several "processes" in one address space, joined by shared memory: for testing a
/// multi-process program (one [`Runtime`](crate::Runtime) per process, each on its
/// own thread) without MPI.
pub struct LoopbackInterconnect {
    process: usize,
    hub: Arc<Hub>,
    /// Payload bytes sent to the others ([`Interconnect::bytes_sent`]).
    sent: std::sync::atomic::AtomicU64,
}

impl LoopbackInterconnect {
    /// The links of `processes` processes, one per process in process order.
    pub fn group(processes: usize) -> Vec<Arc<dyn Interconnect>> {
        let hub = Arc::new(Hub::new(processes.max(1), crate::Runtime::DEFAULT_TIMEOUT));
        (0..processes)
            .map(|process| {
                Arc::new(LoopbackInterconnect {
                    process,
                    hub: hub.clone(),
                    sent: std::sync::atomic::AtomicU64::new(0),
                }) as Arc<dyn Interconnect>
            })
            .collect()
    }

    fn exchange(&self, op: &'static str, t: Tensor) -> Result<Gathered> {
        let all = ReplicaGroups::all(self.hub.replicas());
        let offer = Offer::new(op, String::new(), Arc::new(t));
        self.hub.exchange(&all, self.process, offer)
    }
}

impl LoopbackInterconnect {
    /// Counts `elements` of `like`'s dtype sent to the other processes.
    fn count(&self, elements: usize, like: &Tensor) {
        let bytes = elements as u64 * like.dtype().size_in_bytes() as u64;
        self.sent.fetch_add(bytes, Ordering::Relaxed);
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

    fn all_to_all_into(
        &self,
        from: &Tensor,
        send: &[Range<usize>],
        into: &mut Tensor,
        recv: &[Range<usize>],
    ) -> Result<()> {
        // Each process also needs the ranges every sender picked for it.
        let ranges: Vec<i64> = send.iter().flat_map(|r| [r.start as i64, r.end as i64]).collect();
        let ranges = self.handshake(&ranges, Duration::ZERO)?;
        let out: usize =
            send.iter().enumerate().filter(|(q, _)| *q != self.process).map(|(_, r)| r.len()).sum();
        self.count(out, from);
        let all = self.exchange("all_to_all", from.clone())?;
        for (q, to) in recv.iter().enumerate() {
            let at = 2 * (q * self.processes() + self.process);
            let run = all[q].slice_flat(ranges[at] as usize..ranges[at + 1] as usize);
            if run.len() != to.len() {
                return Err(Error::BadArgument {
                    op: "all_to_all_into",
                    replica: self.process,
                    problem: format!("process {q} sends {} elements for {to:?}", run.len()),
                });
            }
            into.write_flat(to.start, &run);
        }
        Ok(())
    }

    fn bytes_sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    fn all_gather_in_place(&self, buf: &mut Tensor, chunks: &[Range<usize>]) -> Result<()> {
        self.count(chunks[self.process].len() * chunks.len().saturating_sub(1), buf);
        let all = self.exchange("all_gather", buf.slice_flat(chunks[self.process].clone()))?;
        for (q, c) in chunks.iter().enumerate() {
            buf.write_flat(c.start, &all[q]);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Moves = Vec<Vec<(usize, usize)>>;

    /// What `plan` has this process send, as (local tensor, item) for each process,
    /// and receive, as (global replica, item) from each.
    fn moves(plan: &Plan) -> (Moves, Moves) {
        (plan.send.clone(), plan.recv.clone())
    }

    #[test]
    fn plans_are_kept_by_key_across_runs_and_made_again_when_too_many() {
        let link = LoopbackInterconnect::group(2).swap_remove(1);
        let net = Net::new(link, 2, Duration::from_secs(1), Arc::default());
        // Only replica 1 (of process 0) needs one tensor: replica 2's (here, local 0).
        let one = |x: usize, y: usize, _: usize| x == 1 && y == 2;
        let all = |_: usize, _: usize, _: usize| true;
        let a = net.plan("one".into(), 8, 1, &one);
        assert_eq!(moves(&a), (vec![vec![(0, 0)], vec![]], vec![vec![], vec![]]));
        assert_eq!(a.recv_len(), 0);
        // The same key is the kept plan, whatever the closure; another key is its own.
        assert!(Arc::ptr_eq(&a, &net.plan("one".into(), 8, 1, &all)));
        let b = net.plan("all".into(), 8, 1, &all);
        assert_eq!(b.recv[0], vec![(0, 0), (1, 0)]);
        assert_eq!(b.recv_len(), 16);
        // Past the limit the kept plans go, and a key's plan is made again.
        for i in 0..PLANS_KEPT {
            net.plan(format!("filler {i}"), 8, 1, &all);
        }
        let again = net.plan("one".into(), 8, 1, &one);
        assert!(!Arc::ptr_eq(&a, &again));
        assert_eq!(moves(&again), moves(&a));
        // A later run of the same runtime (another `Net` on its plans) finds them.
        let link = LoopbackInterconnect::group(2).swap_remove(1);
        let later = Net::new(link, 2, Duration::from_secs(1), net.plans.clone());
        assert!(Arc::ptr_eq(&again, &later.plan("one".into(), 8, 1, &all)));
    }
}
