//! Processes over MPI (the `mpi` feature): one process per host holds that host's
//! devices, and runtimes in the processes of one MPI job run one program together.
//!
//! MPI itself has no timeouts and no error returns (its default handler aborts the
//! job), and a rank that dies without telling the others leaves them waiting forever.
//! So [`Mpi::init`] checks the world size the launcher promised, installs a panic hook
//! that aborts the whole job when a panic would end this process, and every
//! cross-process collective starts with a handshake that ends the job if the other
//! processes do not arrive within the runtime's timeout.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mpi::datatype::Equivalence;
use mpi::environment::Universe;
use mpi::point_to_point::{Destination, Source};
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::CommunicatorCollectives;
use mpi::{Rank, Threading};

use crate::net::Interconnect;
use crate::{Error, Result, Tensor};

/// Whether MPI is initialised and not yet finalised (the panic hook may abort then).
static LIVE: AtomicBool = AtomicBool::new(false);

/// An initialised MPI job: this process's place in it, and the [`Interconnect`] its
/// runtimes use. Dropping it finalises MPI, so keep it alive (on the thread that
/// created it) for as long as any runtime uses its interconnect.
pub struct Mpi {
    link: Arc<MpiLink>,
    store: Arc<KeyValue>,
    // Last: finalises MPI after everything above is gone.
    _universe: Universe,
}

impl Mpi {
    /// Initialises MPI for threads that call it one at a time, and checks that the job
    /// has `expected` processes — or, if `None`, as many as the launcher's environment
    /// says (`OMPI_COMM_WORLD_SIZE`, `PMI_SIZE`, `PMIX_SIZE`). A binary started by
    /// another MPI's launcher otherwise runs as separate one-process jobs without any
    /// error.
    pub fn init(expected: Option<usize>) -> Result<Mpi> {
        let fail = |message: String| Error::Mpi { message };
        let (universe, threading) = mpi::initialize_with_threading(Threading::Serialized)
            .ok_or_else(|| fail("MPI is already initialised in this process".into()))?;
        if !matches!(threading, Threading::Serialized | Threading::Multiple) {
            return Err(fail(format!(
                "the MPI library gives thread level {threading:?}; meshwork needs Serialized"
            )));
        }
        let world = universe.world();
        let (process, processes) = (world.rank() as usize, world.size() as usize);
        let (expected, source) = match expected {
            Some(n) => (Some(n), "the caller"),
            None => launcher_size(),
        };
        if let Some(expected) = expected
            && expected != processes
        {
            return Err(Error::WorldSize { expected, actual: processes, expected_by: source });
        }
        LIVE.store(true, Ordering::SeqCst);
        abort_on_panic();
        let link = MpiLink {
            world: World(world),
            process,
            processes,
            max_message: AtomicUsize::new(Mpi::DEFAULT_MAX_MESSAGE),
            sent: std::sync::atomic::AtomicU64::new(0),
        };
        // The store's own communicator, duplicated here where every process is.
        let store = KeyValue::new(World(link.world.0.duplicate()), process, processes);
        Ok(Mpi { link: Arc::new(link), store: Arc::new(store), _universe: universe })
    }

    /// The elements of one MPI message unless [`set_max_message`](Self::set_max_message)
    /// says otherwise: 2^30, a count MPI's `int` holds, of any dtype.
    pub const DEFAULT_MAX_MESSAGE: usize = 1 << 30;

    /// This process's rank.
    pub fn process(&self) -> usize {
        self.link.process
    }

    /// The number of processes in the job.
    pub fn processes(&self) -> usize {
        self.link.processes
    }

    /// The link for [`Runtime::with_interconnect`](crate::Runtime::with_interconnect).
    pub fn interconnect(&self) -> Arc<dyn Interconnect> {
        self.link.clone()
    }

    /// The job's key-value store (what a PJRT client spanning processes exchanges its
    /// topology and communicator ids through: JAX's distributed runtime over gRPC,
    /// here over MPI). Keep this `Mpi` alive while it is used: once MPI is finalised
    /// its calls fail.
    pub fn key_value_store(&self) -> Arc<KeyValue> {
        self.store.clone()
    }

    /// Caps the elements of one MPI message (at most `i32::MAX`, MPI's count; at
    /// least 1): longer runs go as several messages in order. Every process must set
    /// the same cap, between runs: each collective's agreement compares them, and
    /// processes whose caps differ all fail there with [`Error::Mismatch`]. The
    /// default, [`Mpi::DEFAULT_MAX_MESSAGE`], lets exchanges of any size through; a
    /// small cap tests the splitting.
    pub fn set_max_message(&self, elements: usize) {
        let cap = elements.clamp(1, MAX_MESSAGE_LIMIT);
        self.link.max_message.store(cap, Ordering::SeqCst);
    }

    /// Ends the whole MPI job (every process) with `code`.
    /// It does not wait for a collective in flight on another thread: ending the job
    /// is what ends that collective.
    pub fn abort(&self, code: i32) -> ! {
        abort_serialized(&SERIAL, ABORT_WAIT, || SimpleCommunicator::world().abort(code))
    }
}

impl Drop for Mpi {
    fn drop(&mut self) {
        // Every value sent is received and every send completed before MPI is
        // finalised (MPI calls a send still in flight then erroneous).
        self.store.quiesce();
        LIVE.store(false, Ordering::SeqCst);
    }
}

/// The job size the launcher announced, and which variable said so.
fn launcher_size() -> (Option<usize>, &'static str) {
    for var in ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"] {
        if let Some(n) = std::env::var(var).ok().and_then(|v| v.parse().ok()) {
            return (Some(n), var);
        }
    }
    (None, "nothing")
}

/// A panic that would end this process ends the MPI job instead, so no other rank
/// waits forever for it. Panics inside a replica's program are caught by the runtime
/// and reported to every process through the handshake, so they do not abort.
fn abort_on_panic() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        previous(info);
        if LIVE.load(Ordering::SeqCst) && !crate::runtime::in_replica() {
            #[allow(clippy::print_stderr)] // the last word of a dying process
            {
                eprintln!("meshwork: a panic ends this process; aborting the MPI job");
            }
            abort_serialized(&SERIAL, ABORT_WAIT, || SimpleCommunicator::world().abort(101));
        }
    }));
}

/// The lock every MPI call of this process is made under (thread level Serialized).
static SERIAL: Mutex<()> = Mutex::new(());

thread_local! {
    /// How many [`Held`] guards of [`SERIAL`] this thread holds (0 or 1).
    static HOLDING: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// [`SERIAL`], held: MPI may be called until it drops.
struct Held<'a> {
    _guard: std::sync::MutexGuard<'a, ()>,
}

impl<'a> Held<'a> {
    fn take(lock: &'a Mutex<()>) -> Held<'a> {
        let guard = lock.lock().unwrap_or_else(|e| e.into_inner());
        HOLDING.set(HOLDING.get() + 1);
        Held { _guard: guard }
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        HOLDING.set(HOLDING.get() - 1);
    }
}

/// How long an abort waits for a call in flight on another thread to return.
const ABORT_WAIT: Duration = Duration::from_secs(5);

/// Calls `abort` (which ends the process: an `MPI_Abort`) the way every MPI call is
/// made, under `lock`: at once when this thread holds it already (a panic inside an
/// MPI call of its own), else once another thread's call in flight returns — or,
/// when that call does not return within `wait` (a collective whose peers are gone),
/// regardless: ending the job is then the only way to end that call, and a job that
/// never ends is worse than an abort that overlaps it.
fn abort_serialized(lock: &Mutex<()>, wait: Duration, abort: impl FnOnce()) -> ! {
    let deadline = Instant::now() + wait;
    let _held = loop {
        if HOLDING.get() > 0 {
            break None;
        }
        match lock.try_lock() {
            Ok(guard) => break Some(guard),
            Err(std::sync::TryLockError::Poisoned(p)) => break Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(std::sync::TryLockError::WouldBlock) => break None,
        }
    };
    abort();
    unreachable!("MPI_Abort returned")
}

/// A communicator (the world, or the key-value store's duplicate of it), used by one
/// thread at a time.
struct World(SimpleCommunicator);

// SAFETY: under Open MPI a communicator handle is a raw pointer, so rsmpi's
// communicator is not `Send`. MPI is initialised at thread level Serialized (or
// Multiple): any thread may call it as long as calls do not overlap, and every use of
// such a handle holds `SERIAL` (`MpiLink::world`, and `KeyValue`'s calls) — as do the aborts
// (`abort_serialized`), the only MPI calls made without this handle, with one
// exception: when another thread's call has not returned within `ABORT_WAIT` (its
// peers are gone), the abort goes ahead beside it, since ending the job is then the
// only way to end that call.
#[allow(unsafe_code)]
unsafe impl Send for World {}
// SAFETY: as for `Send`: the handle is only used under `SERIAL`.
#[allow(unsafe_code)]
unsafe impl Sync for World {}

/// The world, with `SERIAL` held.
struct WorldGuard<'a> {
    world: &'a World,
    _held: Held<'static>,
}

impl std::ops::Deref for WorldGuard<'_> {
    type Target = World;
    fn deref(&self) -> &World {
        self.world
    }
}

struct MpiLink {
    world: World,
    process: usize,
    processes: usize,
    /// Elements per MPI message (see [`Mpi::set_max_message`]).
    max_message: AtomicUsize,
    /// Payload bytes sent to other processes ([`Interconnect::bytes_sent`]).
    sent: std::sync::atomic::AtomicU64,
}

/// A key-value store shared by the processes of an MPI job, on a communicator of its
/// own: a `put` keeps the value and sends it to every other process (non-blocking, so
/// two processes putting large values at once do not wait on each other); a `get`
/// takes what has arrived and waits, polling, until its key has or its time is up.
/// Every process ends with every value, so no process serves the others. Values are
/// kept for the job's life (a client's handful of topology and id exchanges); two
/// puts of one key with different values leave each process the one that reached it
/// last (a client puts each key once). Its calls take MPI's one lock, so a `get`
/// waits while another thread's collective holds it (a handshake polls without
/// letting go, up to its timeout).
pub struct KeyValue {
    /// Freed only while MPI is up (see `drop`).
    comm: std::mem::ManuallyDrop<World>,
    process: usize,
    processes: usize,
    values: Mutex<std::collections::HashMap<Vec<u8>, Vec<u8>>>,
    /// Sends not known complete, each with its buffer (freed once it is).
    sends: Mutex<Vec<Sending>>,
    /// Entries sent to each process, and received from each.
    counts: Mutex<(Vec<u64>, Vec<u64>)>,
}

/// A send in flight and the buffer it reads.
struct Sending {
    request: mpi::request::Request<'static, [u8], mpi::request::StaticScope>,
    buffer: *mut [u8],
}

// SAFETY: a request and its buffer are only touched under `SERIAL` (the request) or
// once complete (the buffer); the buffer is this struct's alone.
#[allow(unsafe_code)]
unsafe impl Send for Sending {}

/// The tag of the store's messages on its own communicator.
const KV_TAG: i32 = 7;

impl KeyValue {
    fn new(comm: World, process: usize, processes: usize) -> KeyValue {
        KeyValue {
            comm: std::mem::ManuallyDrop::new(comm),
            process,
            processes,
            values: Mutex::default(),
            sends: Mutex::default(),
            counts: Mutex::new((vec![0; processes], vec![0; processes])),
        }
    }

    fn counts(&self) -> std::sync::MutexGuard<'_, (Vec<u64>, Vec<u64>)> {
        self.counts.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Takes in one entry (the caller holds `SERIAL`): `wait` for one, or only if
    /// one has arrived. Returns whether it took one.
    fn receive(&self, wait: bool) -> std::result::Result<bool, String> {
        use mpi::point_to_point::MatchedReceiveVec;
        let probed = if wait {
            Some(self.comm.0.any_process().matched_probe_with_tag(KV_TAG))
        } else {
            self.comm.0.any_process().immediate_matched_probe_with_tag(KV_TAG)
        };
        let Some(probed) = probed else { return Ok(false) };
        let (bytes, status) = probed.matched_receive_vec::<u8>();
        let from = status.source_rank() as usize;
        if let Some(n) = self.counts().1.get_mut(from) {
            *n += 1;
        }
        let (key, value) = split_entry(&bytes).ok_or_else(|| {
            format!("process {}: a malformed entry from process {from}", self.process)
        })?;
        self.values().insert(key.to_vec(), value.to_vec());
        Ok(true)
    }

    /// Before MPI is finalised, with every process (it is collective): each learns
    /// how many entries the others sent it, takes them all in, and waits for its own
    /// sends, so that none is left in flight.
    fn quiesce(&self) {
        if !LIVE.load(Ordering::SeqCst) || self.processes < 2 {
            return;
        }
        let _held = Held::take(&SERIAL);
        let sent = self.counts().0.clone();
        let mut expected = vec![0u64; self.processes];
        self.comm.0.all_to_all_into(&sent[..], &mut expected[..]);
        loop {
            let received = self.counts().1.clone();
            if received.iter().zip(&expected).all(|(r, e)| r >= e) {
                break;
            }
            // A malformed entry is dropped here: the store is closing.
            let _ = self.receive(true);
        }
        let sends = std::mem::take(
            &mut *self.sends.lock().unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        for Sending { request, buffer } in sends {
            request.wait();
            // SAFETY: as in `reap`: leaked in `put`, its send now complete.
            #[allow(unsafe_code)]
            drop(unsafe { Box::from_raw(buffer) });
        }
    }

    fn live(&self) -> std::result::Result<(), String> {
        if LIVE.load(Ordering::SeqCst) {
            Ok(())
        } else {
            Err("MPI is finalised: the key-value store is gone with it".into())
        }
    }

    fn values(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<Vec<u8>, Vec<u8>>> {
        self.values.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Frees the buffers of the sends that completed (the caller holds `SERIAL`).
    fn reap(&self) {
        let mut sends = self.sends.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let pending = std::mem::take(&mut *sends);
        for Sending { request, buffer } in pending {
            match request.test() {
                // SAFETY: the buffer came from `Box::leak` in `put`, and its send is
                // complete: nothing reads it any more.
                #[allow(unsafe_code)]
                Ok(_) => drop(unsafe { Box::from_raw(buffer) }),
                Err(request) => sends.push(Sending { request, buffer }),
            }
        }
    }

    /// Takes in every value that has arrived.
    fn drain(&self) -> std::result::Result<(), String> {
        self.live()?;
        let _held = Held::take(&SERIAL);
        self.reap();
        while self.receive(false)? {}
        Ok(())
    }

    /// Puts `value` under `key` for every process.
    pub fn put(&self, key: &[u8], value: &[u8]) -> std::result::Result<(), String> {
        self.live()?;
        self.values().insert(key.to_vec(), value.to_vec());
        let mut entry = Vec::with_capacity(8 + key.len() + value.len());
        entry.extend_from_slice(&(key.len() as u64).to_le_bytes());
        entry.extend_from_slice(key);
        entry.extend_from_slice(value);
        let _held = Held::take(&SERIAL);
        self.reap();
        let mut sends = self.sends.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut counts = self.counts();
        for peer in (0..self.processes).filter(|&p| p != self.process) {
            counts.0[peer] += 1;
            let buffer: &'static mut [u8] = Box::leak(entry.clone().into_boxed_slice());
            let raw: *mut [u8] = buffer;
            // SAFETY: `raw` is the leaked buffer, which lives until `reap` or `drop`
            // frees it after the send completes; the send only reads it.
            #[allow(unsafe_code)]
            let shared: &'static [u8] = unsafe { &*raw };
            let request = self.comm.0.process_at_rank(peer as Rank).immediate_send_with_tag(
                mpi::request::StaticScope,
                shared,
                KV_TAG,
            );
            sends.push(Sending { request, buffer: raw });
        }
        Ok(())
    }

    /// The value under `key` if some process has put it (and it has arrived).
    pub fn try_get(&self, key: &[u8]) -> std::result::Result<Option<Vec<u8>>, String> {
        self.drain()?;
        Ok(self.values().get(key).cloned())
    }

    /// The value some process put under `key`, waiting at most `timeout` for it
    /// (`None`: without a limit); `Ok(None)` when none came in time.
    pub fn get(
        &self,
        key: &[u8],
        timeout: Option<Duration>,
    ) -> std::result::Result<Option<Vec<u8>>, String> {
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        loop {
            if let Some(v) = self.try_get(key)? {
                return Ok(Some(v));
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// An entry's key and value: its first 8 bytes are the key's length.
fn split_entry(bytes: &[u8]) -> Option<(&[u8], &[u8])> {
    let len = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
    let len = usize::try_from(len).ok()?;
    let rest = &bytes[8..];
    (len <= rest.len()).then(|| rest.split_at(len))
}

impl Drop for KeyValue {
    fn drop(&mut self) {
        let sends = std::mem::take(
            &mut *self.sends.lock().unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        if !LIVE.load(Ordering::SeqCst) {
            // MPI is gone (`Mpi` quiesced the store first, so nothing should be in
            // flight): nothing may call it now, so the communicator and any request
            // left are forgotten rather than freed.
            std::mem::forget(sends);
            return;
        }
        let _held = Held::take(&SERIAL);
        for Sending { request, buffer } in sends {
            request.wait();
            // SAFETY: as in `reap`: leaked in `put`, its send now complete.
            #[allow(unsafe_code)]
            drop(unsafe { Box::from_raw(buffer) });
        }
        // SAFETY: dropped once, here, while MPI is up.
        #[allow(unsafe_code)]
        unsafe {
            std::mem::ManuallyDrop::drop(&mut self.comm);
        }
    }
}

/// The largest count MPI's `int` holds.
const MAX_MESSAGE_LIMIT: usize = i32::MAX as usize;

impl MpiLink {
    /// The world communicator, with every MPI call of this process held off.
    fn world(&self) -> WorldGuard<'_> {
        WorldGuard { world: &self.world, _held: Held::take(&SERIAL) }
    }

    fn max_message(&self) -> usize {
        self.max_message.load(Ordering::SeqCst)
    }
}

/// Each process's range straight to it, point to point: a process exchanges messages
/// only with the processes it sends to or receives from (both sides know which: the
/// ranges match pairwise), so processes with nothing to exchange — the other groups of
/// a grouped collective — do not wait for each other, as they would in an
/// `MPI_Alltoallv` over the world. Its own range is a copy. A range longer than `max`
/// elements goes as several messages in order (MPI keeps the order of messages between
/// two processes with one tag, and both sides split a range alike), so no count
/// exceeds MPI's `int`.
fn all_to_all_typed<T: Equivalence + Copy>(
    world: &SimpleCommunicator,
    me: usize,
    max: usize,
    from: &[T],
    send: &[Range<usize>],
    into: &mut [T],
    recv: &[Range<usize>],
) {
    into[recv[me].clone()].copy_from_slice(&from[send[me].clone()]);
    // The receive ranges are disjoint: one mutable slice of `into` per sender.
    let mut senders: Vec<usize> =
        (0..recv.len()).filter(|&q| q != me && !recv[q].is_empty()).collect();
    senders.sort_by_key(|&q| recv[q].start);
    let mut slices: Vec<(usize, &mut [T])> = Vec::with_capacity(senders.len());
    let (mut rest, mut at) = (into, 0);
    for q in senders {
        let r = recv[q].clone();
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(r.start - at);
        let (mine, tail) = tail.split_at_mut(r.len());
        slices.push((q, mine));
        (rest, at) = (tail, r.end);
    }
    mpi::request::scope(|scope| {
        let mut requests = Vec::new();
        for (q, buf) in slices {
            let source = world.process_at_rank(q as Rank);
            for piece in buf.chunks_mut(max) {
                requests.push(source.immediate_receive_into_with_tag(scope, piece, TAG));
            }
        }
        let mut sends = Vec::new();
        for (q, r) in send.iter().enumerate().filter(|(q, r)| *q != me && !r.is_empty()) {
            let target = world.process_at_rank(q as Rank);
            for piece in from[r.clone()].chunks(max) {
                sends.push(target.immediate_send_with_tag(scope, piece, TAG));
            }
        }
        for request in requests {
            request.wait();
        }
        for request in sends {
            request.wait();
        }
    });
}

/// In `p - 1` rounds, process `p` sends its chunk to `p + k` and receives `p - k`'s
/// chunk (mod the process count) straight into place, each in messages of at most
/// `max` elements (see [`all_to_all_typed`]).
fn all_gather_in_place_typed<T: Equivalence>(
    world: &SimpleCommunicator,
    max: usize,
    buf: &mut [T],
    chunks: &[Range<usize>],
    me: usize,
) {
    let n = chunks.len();
    for k in 1..n {
        let (to, from) = ((me + k) % n, (me + n - k) % n);
        let (mine, theirs) = disjoint(buf, chunks[me].clone(), chunks[from].clone());
        let (to, from) = (world.process_at_rank(to as Rank), world.process_at_rank(from as Rank));
        mpi::request::scope(|scope| {
            let receives: Vec<_> = theirs
                .chunks_mut(max)
                .map(|piece| from.immediate_receive_into_with_tag(scope, piece, TAG))
                .collect();
            let sends: Vec<_> = mine
                .chunks(max)
                .map(|piece| to.immediate_send_with_tag(scope, piece, TAG))
                .collect();
            receives.into_iter().chain(sends).for_each(|request| {
                request.wait();
            });
        });
    }
}

/// How long a handshake polls without sleeping before it sleeps between polls.
const POLL_EAGERLY: Duration = Duration::from_millis(1);

/// Point-to-point messages of meshwork on the world communicator carry this tag.
const TAG: mpi::Tag = 0x6d77;

/// `buf[a]` to read and `buf[b]` to write, for disjoint `a` and `b`.
fn disjoint<T>(buf: &mut [T], a: Range<usize>, b: Range<usize>) -> (&[T], &mut [T]) {
    if a.end <= b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.len()])
    } else {
        let (lo, hi) = buf.split_at_mut(a.start);
        (&hi[..a.len()], &mut lo[b])
    }
}

/// Applies `$body` to the elements of two standard-layout tensors of one dtype, as
/// slices `$a` and `$b` (the second mutable).
macro_rules! typed2 {
    ($x:expr, $y:expr, $a:ident, $b:ident => $body:expr) => {
        match ($x, $y) {
            (Tensor::F32(x), Tensor::F32(y)) => {
                let ($a, $b) =
                    (x.as_slice().expect("standard"), y.as_slice_mut().expect("standard"));
                $body
            }
            (Tensor::F64(x), Tensor::F64(y)) => {
                let ($a, $b) =
                    (x.as_slice().expect("standard"), y.as_slice_mut().expect("standard"));
                $body
            }
            (Tensor::I32(x), Tensor::I32(y)) => {
                let ($a, $b) =
                    (x.as_slice().expect("standard"), y.as_slice_mut().expect("standard"));
                $body
            }
            (Tensor::I64(x), Tensor::I64(y)) => {
                let ($a, $b) =
                    (x.as_slice().expect("standard"), y.as_slice_mut().expect("standard"));
                $body
            }
            (x, y) => Err(Error::Mpi {
                message: format!("all_to_all from {} into {}", x.dtype(), y.dtype()),
            }),
        }
    };
}

impl MpiLink {
    /// Counts `elements` of `dtype` sent to other processes.
    fn count(&self, elements: usize, dtype: meshwork_types::DType) {
        let bytes = (elements as u64).saturating_mul(dtype.size_in_bytes() as u64);
        self.sent.fetch_add(bytes, Ordering::Relaxed);
    }
}

impl Interconnect for MpiLink {
    fn process(&self) -> usize {
        self.process
    }

    fn processes(&self) -> usize {
        self.processes
    }

    fn handshake(&self, header: &[i64], timeout: Duration) -> Result<Vec<i64>> {
        let world = self.world();
        let mut all = vec![0i64; header.len() * self.processes];
        let start = Instant::now();
        let deadline = start + timeout;
        mpi::request::scope(|scope| {
            let mut request = world.0.immediate_all_gather_into(scope, header, &mut all[..]);
            loop {
                match request.test() {
                    Ok(_) => return,
                    Err(pending) if Instant::now() < deadline => {
                        request = pending;
                        // Peers usually arrive within microseconds: poll (MPI progresses
                        // the exchange only inside its calls), yielding the core to
                        // whoever needs it, for a millisecond; then sleep between polls
                        // so a long wait costs no core.
                        if start.elapsed() < POLL_EAGERLY {
                            std::thread::yield_now();
                        } else {
                            std::thread::sleep(Duration::from_micros(200));
                        }
                    }
                    // A collective request cannot be cancelled, and waiting longer
                    // could be forever: end the job.
                    Err(_) => {
                        #[allow(clippy::print_stderr)] // the last word of a dying process
                        {
                            eprintln!(
                                "meshwork: process {} waited {timeout:?} for the other \
                                 processes at a collective; aborting the MPI job",
                                self.process
                            );
                        }
                        world.0.abort(124);
                    }
                }
            }
        });
        Ok(all)
    }

    fn all_to_all_into(
        &self,
        from: &Tensor,
        send: &[Range<usize>],
        into: &mut Tensor,
        recv: &[Range<usize>],
    ) -> Result<()> {
        let world = self.world();
        let (me, max) = (self.process, self.max_message());
        let out: usize =
            send.iter().enumerate().filter(|(p, _)| *p != me).map(|(_, r)| r.len()).sum();
        self.count(out, from.dtype());
        typed2!(from, into, f, i => {
            all_to_all_typed(&world.0, me, max, f, send, i, recv);
            Ok(())
        })
    }

    fn bytes_sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    fn settings(&self) -> i64 {
        self.max_message() as i64
    }

    fn all_gather_in_place(&self, buf: &mut Tensor, chunks: &[Range<usize>]) -> Result<()> {
        let world = self.world();
        let (me, max) = (self.process, self.max_message());
        let own = chunks.get(me).map_or(0, Range::len);
        self.count(own * chunks.len().saturating_sub(1), buf.dtype());
        match buf {
            Tensor::F32(a) => all_gather_in_place_typed(&world.0, max, slice(a)?, chunks, me),
            Tensor::F64(a) => all_gather_in_place_typed(&world.0, max, slice(a)?, chunks, me),
            Tensor::I32(a) => all_gather_in_place_typed(&world.0, max, slice(a)?, chunks, me),
            Tensor::I64(a) => all_gather_in_place_typed(&world.0, max, slice(a)?, chunks, me),
            other => {
                return Err(Error::Mpi {
                    message: format!("an all-gather of {} (collectives refuse it)", other.dtype()),
                });
            }
        }
        Ok(())
    }
}

fn slice<T>(a: &mut ndarray::ArrayD<T>) -> Result<&mut [T]> {
    a.as_slice_mut().ok_or_else(|| Error::Mpi { message: "a tensor not in standard layout".into() })
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use super::{Held, abort_serialized};

    /// Runs `abort_serialized` on a thread of its own with an "abort" that records
    /// whether the lock's other holder was still inside its call, then ends the thread
    /// (as `MPI_Abort` ends the process).
    fn aborts_during_call(
        lock: &'static Mutex<()>,
        wait: Duration,
        hold: Duration,
    ) -> (bool, Duration) {
        let inside = Arc::new(AtomicBool::new(false));
        let holder = {
            let inside = inside.clone();
            std::thread::spawn(move || {
                let _held = Held::take(lock);
                inside.store(true, Ordering::SeqCst);
                std::thread::sleep(hold);
                inside.store(false, Ordering::SeqCst);
            })
        };
        while !inside.load(Ordering::SeqCst) {
            std::thread::yield_now();
        }
        let start = Instant::now();
        let seen = inside.clone();
        let aborter = std::thread::spawn(move || {
            let saw = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                abort_serialized(lock, wait, || {
                    std::panic::panic_any((seen.load(Ordering::SeqCst), start.elapsed()));
                })
            }));
            *saw.unwrap_err().downcast::<(bool, Duration)>().unwrap()
        });
        let seen = aborter.join().unwrap();
        holder.join().unwrap();
        seen
    }

    /// An abort from another thread waits for the MPI call in flight to return (thread
    /// level Serialized allows no overlap); one that would wait for ever goes ahead
    /// after its bound; one from the thread inside the call (a panic there) goes ahead
    /// at once.
    #[test]
    fn an_abort_is_serialized_with_the_calls_in_flight() {
        static A: Mutex<()> = Mutex::new(());
        let (during, took) =
            aborts_during_call(&A, Duration::from_secs(10), Duration::from_millis(100));
        assert!(!during, "aborted while another thread was inside an MPI call");
        assert!(took >= Duration::from_millis(50), "{took:?}");
        static B: Mutex<()> = Mutex::new(());
        let (during, took) =
            aborts_during_call(&B, Duration::from_millis(50), Duration::from_millis(400));
        assert!(during && took < Duration::from_millis(350), "bounded: {took:?}");
        static C: Mutex<()> = Mutex::new(());
        let _held = Held::take(&C);
        let start = Instant::now();
        let went = std::panic::catch_unwind(|| {
            abort_serialized(&C, Duration::from_secs(10), || panic!("aborted"))
        });
        assert!(went.is_err() && start.elapsed() < Duration::from_secs(1));
    }
}
