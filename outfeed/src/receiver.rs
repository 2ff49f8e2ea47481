//! The host side: one listener thread per source, callback workers, a byte budget, and
//! a shutdown that delivers everything received.

use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use meshwork_types::TensorSpec;

use crate::Tensor;
use crate::frame::{RawFrame, SHUTDOWN};
use crate::sync::{self, AtomicBool, AtomicUsize, Condvar, JoinHandle, Mutex, MutexGuard};
use crate::tensor::decode_payload;
use crate::transport::{InProcess, Source, Stop};
use crate::{Error, Registry};

/// What a callback may return as an error.
pub type CallbackError = Box<dyn std::error::Error + Send + Sync>;

/// The user's callback: one call per frame, in each source's order.
pub type Callback = dyn Fn(&Delivery) -> Result<(), CallbackError> + Send + Sync;

/// Called with every error as it happens (the errors are also in the shutdown report).
pub type ErrorCallback = dyn Fn(&Error) + Send + Sync;

/// One frame delivered to a callback.
#[derive(Debug, Clone)]
pub struct Delivery {
    /// The source (device) it came from: its index in the receiver's source list.
    pub source: usize,
    /// The consumer id.
    pub consumer: u32,
    /// The consumer's registered name.
    pub name: Arc<str>,
    specs: Arc<[TensorSpec]>,
    payload: Vec<u8>,
}

impl Delivery {
    /// The tensors, decoded per the consumer's spec.
    pub fn tensors(&self) -> Vec<Tensor> {
        decode_payload(&self.specs, &self.payload)
    }

    /// The specs of the tensors.
    pub fn specs(&self) -> &[TensorSpec] {
        &self.specs
    }

    /// The raw payload (tensors back to back, little-endian).
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }
}

/// Receiver settings.
#[derive(Debug, Clone)]
pub struct Config {
    /// Payload bytes that may wait for callbacks before listeners block (the seed's
    /// `max_callback_queue_size_bytes`). The queue never holds more than this plus one
    /// frame.
    pub budget: usize,
    /// Callback worker threads. Each source is served by one worker, so its frames are
    /// delivered in order.
    pub workers: usize,
    /// The longest payload accepted; longer frames are refused before allocation.
    pub max_payload: u32,
    /// Stop every source at the first error (otherwise only the failing source stops,
    /// and only when it cannot be resynchronised).
    pub stop_on_error: bool,
}

impl Default for Config {
    /// 4 MiB budget, 2 workers, 256 MiB frames, keep serving after errors.
    fn default() -> Config {
        Config { budget: 4 << 20, workers: 2, max_payload: 256 << 20, stop_on_error: false }
    }
}

/// Counters of a run.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Metrics {
    /// (frames, payload bytes) delivered per (source, consumer).
    pub delivered: Delivered,
    /// The most payload bytes ever queued for callbacks at once.
    pub queue_high_water: usize,
    /// Time each source's listener spent blocked on the byte budget, in source order
    /// (zero for an in-process channel, which has no listener: its worker reads it).
    pub blocked: Vec<Duration>,
}

/// What `shutdown()` returns: every error seen, and the counters.
#[derive(Debug, Default)]
pub struct Report {
    /// Errors in the order they happened.
    pub errors: Vec<Error>,
    /// Counters.
    pub metrics: Metrics,
}

/// The byte budget. `queued` is atomic so the common case (room left) takes no lock; a
/// listener that finds the budget full waits on `freed` under `wait_lock`, and a worker
/// that frees room below the limit takes that lock before notifying, so no wake-up is
/// lost.
struct Budget {
    limit: usize,
    queued: AtomicUsize,
    high_water: AtomicUsize,
    wait_lock: Mutex<()>,
    freed: Condvar,
}

impl Budget {
    /// Waits while the queue is at or over the limit, then adds `len`; returns the time
    /// spent waiting.
    fn acquire(&self, len: usize) -> Duration {
        let mut waited = Duration::ZERO;
        while !self.try_acquire(len) {
            let start = Instant::now();
            let mut guard = lock(&self.wait_lock);
            while self.queued.load(Ordering::Acquire) >= self.limit {
                guard = self.freed.wait(guard).unwrap_or_else(|e| e.into_inner());
            }
            drop(guard);
            waited += start.elapsed();
        }
        waited
    }

    /// Adds `len` if the queue is under the limit now; says whether it did.
    fn try_acquire(&self, len: usize) -> bool {
        let mut current = self.queued.load(Ordering::Acquire);
        while current < self.limit {
            // Add only if the queue is still under the limit at this instant: it then
            // holds less than `limit` before and at most `limit - 1 + len` after, so it
            // never exceeds the budget plus one frame, however many listeners race.
            match self.queued.compare_exchange_weak(
                current,
                current + len,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    self.high_water.fetch_max(current + len, Ordering::Relaxed);
                    return true;
                }
                Err(now) => current = now,
            }
        }
        false
    }

    /// Removes `len`, waking waiting listeners if that makes room.
    fn release(&self, len: usize) {
        let before = self.queued.fetch_sub(len, Ordering::AcqRel);
        if before >= self.limit && before - len < self.limit {
            let _guard = lock(&self.wait_lock);
            self.freed.notify_all();
        }
    }
}

/// A registered consumer as the receiver uses it: shared name and specs (cloned into
/// every delivery without allocating) and the payload length (`usize::MAX` if the spec's
/// size overflows, which a registry built by `register` never has).
struct Entry {
    name: Arc<str>,
    specs: Arc<[TensorSpec]>,
    len: usize,
}

struct Shared {
    consumers: BTreeMap<u32, Entry>,
    callback: Arc<Callback>,
    on_error: Option<Arc<ErrorCallback>>,
    budget: Budget,
    errors: Mutex<Vec<Error>>,
    stopping: AtomicBool,
    stoppers: Vec<Arc<dyn Stop>>,
    stop_on_error: bool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panicking callback never holds these locks; recover the data regardless.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    fn report(&self, error: Error) {
        if let Some(cb) = &self.on_error {
            cb(&error);
        }
        lock(&self.errors).push(error);
        if self.stop_on_error {
            self.stop_all();
        }
    }

    fn stop_all(&self) {
        if !self.stopping.swap(true, Ordering::SeqCst) {
            for s in &self.stoppers {
                s.stop();
            }
        }
    }
}

/// (frames, payload bytes) delivered per (source, consumer).
type Delivered = BTreeMap<(usize, u32), (u64, u64)>;

/// A worker's counts, with the (source, consumer) it counted last kept aside, so a run
/// of frames of one consumer costs no map lookup per frame.
#[derive(Default)]
struct Tally {
    counts: Delivered,
    last: Option<((usize, u32), (u64, u64))>,
}

impl Tally {
    fn add(&mut self, key: (usize, u32), bytes: u64) {
        match &mut self.last {
            Some((k, (frames, total))) if *k == key => {
                *frames += 1;
                *total += bytes;
            }
            _ => {
                self.flush();
                self.last = Some((key, (1, bytes)));
            }
        }
    }

    fn flush(&mut self) {
        if let Some((key, (frames, bytes))) = self.last.take() {
            let entry = self.counts.entry(key).or_default();
            entry.0 += frames;
            entry.1 += bytes;
        }
    }

    fn into_counts(mut self) -> Delivered {
        self.flush();
        self.counts
    }
}

/// Frames of one source, in its order, handed to its worker at once.
struct Job {
    deliveries: Vec<Delivery>,
}

/// The most frames a listener hands over at once.
const BURST: usize = 64;

/// Receives frames from every source and delivers them to the callback.
pub struct Receiver {
    shared: Arc<Shared>,
    sources: usize,
    /// The listeners, with their sources' indices.
    listeners: Vec<(usize, JoinHandle<Duration>)>,
    workers: Vec<JoinHandle<Delivered>>,
    report: Option<Report>,
}

impl Receiver {
    /// Starts `config.workers` callback workers and a listener per source, except
    /// for in-process [`channel`](crate::channel())s, which the workers read
    /// themselves. Source `i` is served by worker `i % workers`.
    pub fn start(
        registry: Registry,
        sources: Vec<Box<dyn Source>>,
        callback: Arc<Callback>,
        on_error: Option<Arc<ErrorCallback>>,
        config: Config,
    ) -> Receiver {
        let stoppers = sources.iter().map(|s| s.stopper()).collect();
        let consumers = registry
            .consumers()
            .map(|(id, c)| {
                let len = c.payload_len().unwrap_or(usize::MAX);
                (id, Entry { name: c.name.as_str().into(), specs: c.specs.clone().into(), len })
            })
            .collect();
        let shared = Arc::new(Shared {
            consumers,
            callback,
            on_error,
            budget: Budget {
                // "Less than the budget" must be reachable: an empty queue admits a frame
                // even under a budget of 0, so listeners always make progress.
                limit: config.budget.max(1),
                queued: AtomicUsize::new(0),
                high_water: AtomicUsize::new(0),
                wait_lock: Mutex::new(()),
                freed: Condvar::new(),
            },
            errors: Mutex::new(Vec::new()),
            stopping: AtomicBool::new(false),
            stoppers,
            stop_on_error: config.stop_on_error,
        });
        let count = sources.len();
        let workers = config.workers.max(1).min(count.max(1));
        let max_payload = config.max_payload;
        // In-process channels go to their workers; every other source gets a listener.
        let mut direct: Vec<Vec<Direct>> = (0..workers).map(|_| Vec::new()).collect();
        let mut listened = Vec::new();
        for (index, source) in sources.into_iter().enumerate() {
            match in_process(&*source) {
                Some(reader) => direct[index % workers].push(Direct { index, reader }),
                None => listened.push((index, source)),
            }
        }
        let mut queues = Vec::new();
        let mut worker_handles = Vec::new();
        for (w, direct) in direct.into_iter().enumerate() {
            let (tx, rx) = sync::unbounded::<Job>();
            queues.push(tx);
            let shared = shared.clone();
            let handle = sync::spawn(format!("outfeed-callback-{w}"), move || {
                worker(&shared, &rx, direct, max_payload)
            });
            worker_handles.push(handle);
        }
        let listeners = listened
            .into_iter()
            .map(|(index, source)| {
                let shared = shared.clone();
                let queue = queues[index % workers].clone();
                let handle = sync::spawn(format!("outfeed-listener-{index}"), move || {
                    listen(&shared, index, source, &queue, max_payload)
                });
                (index, handle)
            })
            .collect();
        drop(queues);
        Receiver { shared, sources: count, listeners, workers: worker_handles, report: None }
    }

    /// Stops every source (each gets the shutdown marker, or is closed), waits until
    /// every frame received before is delivered, and returns the errors and counters.
    /// Calling it again returns an empty report.
    pub fn shutdown(&mut self) -> Report {
        if let Some(report) = self.report.take() {
            return report;
        }
        if self.listeners.is_empty() && self.workers.is_empty() {
            return Report::default();
        }
        self.shared.stop_all();
        self.finish()
    }

    /// Waits until every source has ended by itself (shutdown markers or end of
    /// stream), then returns like [`shutdown`](Self::shutdown).
    pub fn join(&mut self) -> Report {
        self.finish()
    }

    fn finish(&mut self) -> Report {
        let mut blocked = vec![Duration::ZERO; self.sources];
        for (index, l) in self.listeners.drain(..) {
            blocked[index] = l.join().unwrap_or_default();
        }
        let mut delivered = Delivered::new();
        for w in self.workers.drain(..) {
            // Each source is served by one worker: the maps are disjoint.
            delivered.extend(w.join().unwrap_or_default());
        }
        let queue_high_water = self.shared.budget.high_water.load(Ordering::Relaxed);
        let metrics = Metrics { delivered, queue_high_water, blocked };
        Report { errors: std::mem::take(&mut *lock(&self.shared.errors)), metrics }
    }
}

impl Drop for Receiver {
    /// Shuts down (delivering everything received) if `shutdown` was not called.
    fn drop(&mut self) {
        if !self.listeners.is_empty() || !self.workers.is_empty() {
            let _ = self.shutdown();
        }
    }
}

/// A listener: reads frames, validates them, waits for budget, queues them in order.
///
/// With nothing in hand it waits for a frame; with frames in hand it takes only those
/// ready now, and hands the burst to its worker when none is ready, when it holds
/// [`BURST`] frames, or before it waits for budget (the frames in hand count against
/// the budget, and only the worker frees it).
fn listen(
    shared: &Shared,
    index: usize,
    mut source: Box<dyn Source>,
    queue: &sync::Sender<Job>,
    max_payload: u32,
) -> Duration {
    let mut blocked = Duration::ZERO;
    let checksummed = source.checksummed();
    let consumers = own(&shared.consumers);
    let mut burst: Vec<Delivery> = Vec::new();
    // Hands the burst over; false if the worker is gone.
    let hand_over = |burst: &mut Vec<Delivery>| {
        burst.is_empty() || queue.send(Job { deliveries: std::mem::take(burst) }).is_ok()
    };
    loop {
        let next = if burst.is_empty() {
            source.next_frame(index, max_payload)
        } else {
            source.ready_frame(index, max_payload)
        };
        let frame = match next {
            Ok(Some(frame)) => frame,
            // None ready: hand over what is in hand, then wait.
            Ok(None) if !burst.is_empty() => {
                if !hand_over(&mut burst) {
                    return blocked;
                }
                continue;
            }
            Ok(None) => break,
            Err(e) => {
                // A stream that lost its place cannot be read further; what came
                // before the error is delivered.
                hand_over(&mut burst);
                shared.report(e);
                return blocked;
            }
        };
        if frame.header.consumer == SHUTDOWN {
            break;
        }
        let delivery = match validate(&consumers, index, frame, checksummed) {
            Ok(d) => d,
            Err(e) => {
                shared.report(e);
                continue;
            }
        };
        let len = delivery.payload.len();
        if !shared.budget.try_acquire(len) {
            if !hand_over(&mut burst) {
                return blocked;
            }
            blocked += shared.budget.acquire(len);
        }
        burst.push(delivery);
        if burst.len() >= BURST && !hand_over(&mut burst) {
            return blocked;
        }
    }
    hand_over(&mut burst);
    blocked
}

/// A copy of the consumers with names and specs of this thread's own: every delivery
/// holds a reference to them, and counting references on shared ones from several
/// threads at once would bounce their counters between cores, frame after frame.
fn own(consumers: &BTreeMap<u32, Entry>) -> BTreeMap<u32, Entry> {
    consumers
        .iter()
        .map(|(&id, e)| {
            let entry =
                Entry { name: Arc::from(&*e.name), specs: Arc::from(&e.specs[..]), len: e.len };
            (id, entry)
        })
        .collect()
}

/// A frame's consumer, checksum (when its source carries them) and length checked.
/// `consumers` is the thread's own copy of the registry's entries (see [`own`]).
fn validate(
    consumers: &BTreeMap<u32, Entry>,
    index: usize,
    frame: RawFrame,
    checksummed: bool,
) -> Result<Delivery, Error> {
    let consumer = frame.header.consumer;
    let entry = check(consumers, index, &frame, checksummed)?;
    let (name, specs) = (entry.name.clone(), entry.specs.clone());
    Ok(Delivery { source: index, consumer, name, specs, payload: frame.payload })
}

/// [`validate`] without building the delivery: the frame's entry.
fn check<'a>(
    consumers: &'a BTreeMap<u32, Entry>,
    index: usize,
    frame: &RawFrame,
    checksummed: bool,
) -> Result<&'a Entry, Error> {
    let consumer = frame.header.consumer;
    let entry =
        consumers.get(&consumer).ok_or(Error::UnknownConsumer { stream: index, consumer })?;
    if checksummed {
        frame.verify(index)?;
    }
    let (len, expected) = (frame.payload.len(), entry.len);
    if len != expected {
        return Err(Error::PayloadMismatch { stream: index, consumer, len, expected });
    }
    Ok(entry)
}

/// An in-process channel a worker reads itself: source `index`.
struct Direct {
    index: usize,
    reader: InProcess,
}

/// A source's in-process channel, if it is one.
fn in_process(source: &dyn Source) -> Option<InProcess> {
    source.in_process()
}

/// A callback worker: delivers, in order, the jobs its listeners queue (freeing their
/// budget) and the frames of the in-process channels it reads itself, a burst at a
/// time from whichever is ready; reports failures.
fn worker(
    shared: &Shared,
    queue: &sync::Receiver<Job>,
    mut direct: Vec<Direct>,
    max_payload: u32,
) -> Delivered {
    let mut delivered = Tally::default();
    let queued = |deliveries: Vec<Delivery>, delivered: &mut Tally| {
        for d in deliveries {
            let len = d.payload.len();
            deliver(shared, delivered, &d);
            shared.budget.release(len);
        }
    };
    if direct.is_empty() {
        for job in queue.iter() {
            queued(job.deliveries, &mut delivered);
        }
        return delivered.into_counts();
    }
    {
        use crate::sync::TryRecvError;
        use crate::transport::Ready;
        let consumers = own(&shared.consumers);
        // Up to a burst of one channel's frames: how many were taken, and whether the
        // channel has ended.
        let burst =
            |d: &mut Direct, delivered: &mut Tally, slot: &mut Option<Delivery>| -> (usize, bool) {
                let Direct { index, reader } = d;
                let index = *index;
                for taken in 0..BURST {
                    let frame = match reader.try_next() {
                        Ready::Frame(frame) => frame,
                        Ready::Empty => return (taken, false),
                        Ready::Ended => return (taken, true),
                    };
                    if frame.header.len > max_payload {
                        // As a listener would: the error ends the source.
                        let (consumer, len) = (frame.header.consumer, frame.header.len);
                        let (len, cap) = (u64::from(len), u64::from(max_payload));
                        shared.report(Error::FrameTooLong { stream: index, consumer, len, cap });
                        return (taken, true);
                    }
                    if frame.header.consumer == SHUTDOWN {
                        return (taken, true);
                    }
                    let entry = match check(&consumers, index, &frame, false) {
                        Ok(entry) => entry,
                        Err(e) => {
                            shared.report(e);
                            continue;
                        }
                    };
                    // One delivery serves a run of frames of one source and consumer: each
                    // frame's payload moves into it for the callback and is freed after, so
                    // a frame costs no reference counting of the consumer's name and specs.
                    let consumer = frame.header.consumer;
                    let reuse =
                        matches!(slot, Some(d) if d.source == index && d.consumer == consumer);
                    if !reuse {
                        let (name, specs) = (entry.name.clone(), entry.specs.clone());
                        *slot = Some(Delivery {
                            source: index,
                            consumer,
                            name,
                            specs,
                            payload: Vec::new(),
                        });
                    }
                    let d = slot.as_mut().expect("set above");
                    d.payload = frame.payload;
                    deliver(shared, delivered, d);
                    drop(std::mem::take(&mut d.payload));
                }
                (BURST, false)
            };
        let mut slot: Option<Delivery> = None;
        let mut queue_open = true;
        while queue_open || !direct.is_empty() {
            // Whatever is ready, without blocking: a burst of each channel in turn, then
            // the queue — no select to build while frames keep coming.
            let mut progress = false;
            let mut i = 0;
            while i < direct.len() {
                let (taken, ended) = burst(&mut direct[i], &mut delivered, &mut slot);
                progress |= taken > 0 || ended;
                if ended {
                    direct.swap_remove(i);
                } else {
                    i += 1;
                }
            }
            if queue_open {
                match queue.try_recv() {
                    Ok(job) => {
                        queued(job.deliveries, &mut delivered);
                        progress = true;
                    }
                    Err(TryRecvError::Empty) => {}
                    Err(TryRecvError::Disconnected) => {
                        queue_open = false;
                        progress = true;
                    }
                }
            }
            if progress {
                continue;
            }
            // Nothing was ready: wait until something is.
            #[cfg(not(shuttle))]
            {
                let mut select = crossbeam::channel::Select::new();
                for d in &direct {
                    select.recv(&d.reader.rx);
                }
                if queue_open {
                    select.recv(queue);
                }
                select.ready();
            }
            // The model checker's channels cannot be selected on: let the others run.
            #[cfg(shuttle)]
            shuttle::thread::yield_now();
        }
    }
    delivered.into_counts()
}

/// Calls the callback with `delivery`, counting it or reporting its failure.
fn deliver(shared: &Shared, delivered: &mut Tally, delivery: &Delivery) {
    let (source, consumer, len) = (delivery.source, delivery.consumer, delivery.payload.len());
    match catch_unwind(AssertUnwindSafe(|| (shared.callback)(delivery))) {
        Ok(Ok(())) => {
            delivered.add((source, consumer), len as u64);
        }
        Ok(Err(e)) => {
            shared.report(Error::Callback { stream: source, consumer, message: e.to_string() })
        }
        Err(panic) => {
            let message = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "non-string panic payload".to_owned());
            shared.report(Error::CallbackPanicked { stream: source, consumer, message });
        }
    }
}

#[cfg(all(test, shuttle))]
mod model;
