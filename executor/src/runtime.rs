//! Devices as worker threads, and running one program on many of them.

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam::channel::{Sender, unbounded};
use meshwork_types::DType;

use crate::context::ReplicaContext;
use crate::hub::Hub;
use crate::net::{Interconnect, Net, Plans};
use crate::pool::{Limits, Pool};
use crate::sink::OutfeedSink;
use crate::tensor::TensorOps;
use crate::{Error, Result, Tensor};

/// The error a program may return: any error, converted back to [`Error`] when it is one.
pub type ReplicaError = Box<dyn std::error::Error + Send + Sync>;

/// A program run once per replica: its context and its inputs in, its outputs out.
pub type ReplicaFn = dyn Fn(&ReplicaContext, Vec<Tensor>) -> std::result::Result<Vec<Tensor>, ReplicaError>
    + Send
    + Sync;

type Job = Box<dyn FnOnce() + Send>;

/// A set of devices, each a long-lived worker thread, that runs SPMD programs.
///
/// A runtime is reusable: a failed run leaves the devices ready for the next one.
pub struct Runtime {
    devices: Vec<Sender<Job>>,
    /// Held while a run queues its replicas, so two runs from two threads queue in the
    /// same order on every device and never wait on each other's collectives.
    enqueue: Mutex<()>,
    threads: Vec<JoinHandle<()>>,
    timeout: Duration,
    sink: Option<Arc<dyn OutfeedSink>>,
    link: Option<Arc<dyn Interconnect>>,
    /// The cross-process exchange plans of this runtime's runs (see `Net::plan`):
    /// kept from run to run, as a training loop repeats its steps.
    plans: Arc<Plans>,
    /// Per device: the buffers its collectives may write into (see
    /// [`with_pool`](Self::with_pool)).
    pools: Vec<Arc<Pool>>,
}

impl Runtime {
    /// The default time a replica waits for its peers at a collective.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

    /// Starts `devices` device threads (`cpu:0`, `cpu:1`, ...).
    pub fn new(devices: usize) -> Result<Runtime> {
        if devices == 0 {
            return Err(Error::NoDevices);
        }
        let mut senders = Vec::with_capacity(devices);
        let mut threads = Vec::with_capacity(devices);
        for d in 0..devices {
            let (tx, rx) = unbounded::<Job>();
            let thread = std::thread::Builder::new()
                .name(format!("meshwork-cpu:{d}"))
                .spawn(move || rx.iter().for_each(|job| job()))
                .map_err(|e| Error::ReplicaFailed {
                    replica: d,
                    message: format!("cannot start device thread: {e}"),
                })?;
            senders.push(tx);
            threads.push(thread);
        }
        Ok(Runtime {
            devices: senders,
            enqueue: Mutex::new(()),
            threads,
            timeout: Runtime::DEFAULT_TIMEOUT,
            sink: None,
            link: None,
            plans: Arc::default(),
            pools: (0..devices).map(|_| Arc::new(Pool::new(Limits::DEFAULT))).collect(),
        })
    }

    /// Sets each device's buffer pool to keep at most `capacity` bytes, of buffers of
    /// at least `smallest` bytes (default: 1 GiB of buffers of 1 MiB or more;
    /// `capacity` 0 turns pooling off).
    ///
    /// A device keeps the inputs its collectives consumed and the tensors
    /// [recycled](Self::recycle) to it, and its plain collectives (all-gather,
    /// reduce-scatter, all-to-all, broadcast, collective-permute) write their results
    /// into a kept buffer of the result's dtype and element count rather than fresh
    /// memory, whose pages the kernel must fault in and zero (for an 8 × 64 MiB
    /// all-gather, most of its time). Like a caching allocator, the pool holds on to
    /// that memory until it is evicted (oldest first, to stay within `capacity`) or
    /// [released](Self::release_pools).
    pub fn with_pool(self, capacity: usize, smallest: usize) -> Runtime {
        for pool in &self.pools {
            pool.set_limits(Limits { capacity, smallest });
        }
        self
    }

    /// Gives `t`'s memory to device `device`'s pool (see
    /// [`ReplicaContext::recycle`]): what a host loop does with a run's outputs once
    /// it is done with them.
    pub fn recycle(&self, device: usize, t: Tensor) -> Result<()> {
        let pool = self
            .pools
            .get(device)
            .ok_or(Error::NoSuchDevice { device, devices: self.devices.len() })?;
        pool.put(t);
        Ok(())
    }

    /// A tensor of `dtype` and `shape` for the host to fill and pass to a replica on
    /// device `device`: a buffer that device's pool keeps, if it has one of that dtype
    /// and element count, otherwise zeros. A kept buffer's elements are stale (whatever
    /// it last held): fill every one. Asking also marks the kind as wanted, so when a
    /// collective consumes the input its memory goes back to the pool instead of being
    /// freed: a host loop that feeds every step's inputs this way, and
    /// [recycles](Self::recycle) the outputs, allocates and frees nothing once warm.
    pub fn buffer(&self, device: usize, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        let pool = self
            .pools
            .get(device)
            .ok_or(Error::NoSuchDevice { device, devices: self.devices.len() })?;
        pooled_or_zeros(pool, dtype, shape)
    }

    /// The bytes each device's pool keeps now, in device order.
    pub fn pooled_bytes(&self) -> Vec<usize> {
        self.pools.iter().map(|p| p.bytes()).collect()
    }

    /// How many buffers of at least the pool's smallest size each device's pool was
    /// asked for and did not have, since the runtime started, in device order: each
    /// such request was met with fresh memory. A warm training loop whose pools are
    /// large enough stops adding to these.
    pub fn pool_misses(&self) -> Vec<usize> {
        self.pools.iter().map(|p| p.misses()).collect()
    }

    /// Lets go of every buffer the pools keep.
    pub fn release_pools(&self) {
        self.pools.iter().for_each(|p| p.clear());
    }

    /// Sets how long a replica waits for its peers at a collective before the
    /// collective fails with [`Error::Timeout`].
    pub fn with_timeout(mut self, timeout: Duration) -> Runtime {
        self.timeout = timeout;
        self
    }

    /// Attaches the sink that [`ReplicaContext::emit`] streams to.
    pub fn with_sink(mut self, sink: Arc<dyn OutfeedSink>) -> Runtime {
        self.sink = Some(sink);
        self
    }

    /// Joins this runtime to the same program's runtimes in other processes: a run
    /// then spans every device of every process, as replicas
    /// `process * devices .. (process + 1) * devices` here, and collectives over all
    /// replicas are hierarchical (in this process first, then across processes, then
    /// back). Every process must run the same sequence of collectives (SPMD) with the
    /// same number of devices.
    pub fn with_interconnect(mut self, link: Arc<dyn Interconnect>) -> Runtime {
        self.link = Some(link);
        self.plans = Arc::default();
        self
    }

    /// How many replicas a run spans: this runtime's devices in every process.
    pub fn replicas(&self) -> usize {
        self.devices.len() * self.link.as_ref().map_or(1, |l| l.processes())
    }

    /// The global id of this process's first replica.
    pub fn first_replica(&self) -> usize {
        self.devices.len() * self.link.as_ref().map_or(0, |l| l.process())
    }

    /// The number of devices.
    pub fn devices(&self) -> usize {
        self.devices.len()
    }

    /// Runs `program` on `inputs.len()` replicas, replica `r` on device `r` with
    /// `inputs[r]`, and returns every replica's outputs in replica order.
    ///
    /// With an [interconnect](Self::with_interconnect), `inputs` are this process's
    /// replicas (one per device) and so are the outputs; every process calls `run`.
    ///
    /// If any replica fails (an error, a panic, a collective that cannot complete),
    /// its peers are released with [`Error::PeerFailed`] rather than left waiting, and
    /// the run returns the first failure's own error (the lowest replica among those
    /// that did not merely see a peer fail).
    pub fn run(
        &self,
        program: Arc<ReplicaFn>,
        inputs: Vec<Vec<Tensor>>,
    ) -> Result<Vec<Vec<Tensor>>> {
        let placement: Vec<usize> = (0..inputs.len()).collect();
        self.run_on(program, inputs, &placement)
    }

    /// [`run`](Self::run), with replica `r` on device `placement[r]` (distinct devices
    /// of this runtime): what a device assignment that is not the identity needs. The
    /// replica's [`ReplicaContext::device`] names that device; replica ids, groups and
    /// outputs stay in replica order. With an interconnect, `placement` maps this
    /// process's replicas onto its devices.
    pub fn run_on(
        &self,
        program: Arc<ReplicaFn>,
        inputs: Vec<Vec<Tensor>>,
        placement: &[usize],
    ) -> Result<Vec<Vec<Tensor>>> {
        let replicas = inputs.len();
        let devices = self.devices.len();
        if replicas == 0 || replicas > devices || (self.link.is_some() && replicas != devices) {
            return Err(Error::ReplicaCount { replicas, devices });
        }
        let mut taken = vec![false; devices];
        if placement.len() != replicas
            || placement.iter().any(|&d| d >= devices || std::mem::replace(&mut taken[d], true))
        {
            return Err(Error::Placement { placement: placement.to_vec(), devices });
        }
        // Processes that wait on each other also wait out each other's local timeouts.
        let net = self
            .link
            .clone()
            .map(|link| Arc::new(Net::new(link, replicas, self.timeout * 2, self.plans.clone())));
        let base = net.as_ref().map_or(0, |n| n.base());
        let pools: Vec<Arc<Pool>> = placement.iter().map(|&d| self.pools[d].clone()).collect();
        let hub = Arc::new(Hub::new(replicas, self.timeout).with_base(base).with_pools(pools));
        let (done_tx, done_rx) = unbounded::<(usize, Result<Vec<Tensor>>)>();
        let queuing = self.enqueue.lock().unwrap_or_else(PoisonError::into_inner);
        for (r, input) in inputs.into_iter().enumerate() {
            let device = placement[r];
            let (job_hub, program, done, sink, net) =
                (hub.clone(), program.clone(), done_tx.clone(), self.sink.clone(), net.clone());
            let pool = self.pools[device].clone();
            let job: Job = Box::new(move || {
                let hub = job_hub;
                let ctx = ReplicaContext::new(r, device, hub.clone(), sink, net, pool);
                let id = ctx.replica_id();
                IN_REPLICA.set(true);
                let result = catch_unwind(AssertUnwindSafe(|| program(&ctx, input)));
                IN_REPLICA.set(false);
                let result = match result {
                    Ok(Ok(out)) => Ok(out),
                    Ok(Err(e)) => Err(match e.downcast::<Error>() {
                        Ok(e) => *e,
                        Err(e) => Error::ReplicaFailed { replica: id, message: e.to_string() },
                    }),
                    Err(panic) => {
                        Err(Error::ReplicaPanicked { replica: id, message: panic_message(&*panic) })
                    }
                };
                drop(ctx);
                if result.is_err() {
                    hub.poison(r);
                } else {
                    // Peers still waiting for this replica in a collective fail now.
                    hub.end(r);
                }
                // The receiver lives until every replica has reported.
                let _ = done.send((r, result));
            });
            if self.devices[device].send(job).is_err() {
                hub.poison(r);
                let _ = done_tx.send((
                    r,
                    Err(Error::ReplicaFailed {
                        replica: base + r,
                        message: "device thread is gone".into(),
                    }),
                ));
            }
        }
        drop(queuing);
        drop(done_tx);
        let mut outputs: Vec<Option<Vec<Tensor>>> = vec![None; replicas];
        let mut errors: Vec<(usize, Error)> = Vec::new();
        for (r, result) in done_rx.iter() {
            match result {
                Ok(out) => outputs[r] = Some(out),
                Err(e) => errors.push((r, e)),
            }
        }
        errors.sort_by_key(|(r, e)| (matches!(e, Error::PeerFailed { .. }), *r));
        if let Some(net) = &net {
            // Tell the other processes how this one ended, so none waits for it.
            let failed = errors.first().map(|(r, e)| match e {
                Error::PeerFailed { failed, .. } => *failed,
                _ => base + r,
            });
            let ended = net.finish(failed);
            if errors.is_empty() {
                ended?;
            }
        }
        if !errors.is_empty() {
            return Err(errors.swap_remove(0).1);
        }
        Ok(outputs.into_iter().map(|o| o.expect("every replica reported")).collect())
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.devices.clear();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// A buffer of `pool`'s of `dtype` and `shape` (stale), or zeros; the dtype and the
/// shape's size are checked first.
pub(crate) fn pooled_or_zeros(pool: &Pool, dtype: DType, shape: &[usize]) -> Result<Tensor> {
    Tensor::check_size(dtype, shape)?;
    match pool.take(dtype, shape) {
        Some(t) => Ok(t),
        None => Tensor::zeroed(dtype, shape),
    }
}

thread_local! {
    static IN_REPLICA: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this thread is running a replica's program, whose panics the runtime
/// catches and reports (so a panic hook need not end the process).
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) fn in_replica() -> bool {
    IN_REPLICA.get()
}

fn panic_message(panic: &(dyn Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".into())
}
