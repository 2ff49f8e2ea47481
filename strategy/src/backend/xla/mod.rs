//! The XLA back end: each program lowered to StableHLO and compiled by XLA through a
//! PJRT plugin ([`meshwork_xla`]), its resident parameters kept on the device as PJRT
//! buffers between steps.
//!
//! - A step's carried results are the next step's parameters on the device: each is
//!   donated (`tf.aliasing_output`, as `jax.jit(donate_argnums=…)`), so XLA updates
//!   the parameters and optimizer slots in place. A run of several steps enqueues
//!   them all before reading any result back (asynchronous dispatch).
//! - A step moves only its fed parameters (the batch) in and its results (loss,
//!   metrics, what it `emit`s) out.
//! - Programs are compiled once per module text and device assignment (the session's
//!   cache).
//! - A mesh of N positions runs the partitioned per-device program compiled once with
//!   `num_replicas = N`, replica `r` on the client's device `placement[r]`: its
//!   collectives are XLA's over replica groups of positions.
//! - With its collectives on the host ([`Xla::with_host_collectives`], and always
//!   for a mesh spread over processes), the per-device program is cut at its
//!   collectives ([`hosted`]): segments on the devices, collectives through
//!   meshwork's executor.
//! - A placed program (a pipeline's stages) runs each part cut into segments
//!   ([`placed`]), one executable per segment on the part's device, its transfers
//!   PJRT device-to-device copies.
//!
//! Donation has JAX's cost: a step that fails on the device after its state was
//! donated leaves that state unset (the next step reports the parameter lost), where
//! the interpreter keeps the state from before the step. Everything that can fail on
//! the host — the feeds' uploads for every step of the call, a metrics stream for what
//! the program emits — is done or checked before anything is donated, so only a
//! failure of the device itself loses the state.

use std::sync::{Arc, Mutex, PoisonError};

use meshwork_partition::placed::Part;
use meshwork_partition::spmd::Partitioned;
use meshwork_sharding::Mesh;
use meshwork_sharding::spmd::Layout;
use meshwork_types::{Tensor, TensorSpec};
use meshwork_xla::lower::LowerOptions;
use meshwork_xla::session::Compiled;
use meshwork_xla::{Arg, Buffer, Plugin, Session};

use super::{Backend, Partitioner, PlacedExecutable, SpmdExecutable};
use crate::{Error, Result, Strategy};

mod hosted;
mod placed;
mod target;

pub use target::XlaTarget;

/// XLA on a PJRT plugin's devices: the strategy's device `d` is the client's device
/// `d`.
#[derive(Debug, Clone)]
pub struct Xla {
    session: Arc<Session>,
    partitioner: Partitioner,
    host_collectives: bool,
}

impl Xla {
    /// A back end on a new client of `plugin` with one device.
    pub fn new(plugin: &Plugin) -> Result<Xla> {
        Xla::with_devices(plugin, 1)
    }

    /// A back end on a new client of `plugin` asked for `devices` devices (a CPU
    /// plugin makes that many; a GPU plugin has one per GPU): an error when the client
    /// has fewer.
    pub fn with_devices(plugin: &Plugin, devices: usize) -> Result<Xla> {
        let session = Session::new(plugin, devices.max(1))?;
        let have = session.client().devices().len();
        if have < devices {
            return Err(Error::Compiled {
                problem: format!(
                    "the PJRT client ({}) has {have} devices, the strategy needs {devices}",
                    session.client().platform()
                ),
            });
        }
        Ok(Xla {
            session: Arc::new(session),
            partitioner: Partitioner::Meshwork,
            host_collectives: false,
        })
    }

    /// This back end with SPMD programs split by `partitioner`: meshwork's (the
    /// default) or XLA's own.
    pub fn with_partitioner(self, partitioner: Partitioner) -> Xla {
        Xla { partitioner, ..self }
    }

    /// This back end with the collectives of meshwork-partitioned SPMD programs run
    /// on the host by meshwork's executor, between executables of the segments
    /// around them, even in one process: what a mesh spread over processes always
    /// does (the pinned CPU plugin has no collectives across processes), here to
    /// compare against XLA's own collectives in one process.
    pub fn with_host_collectives(self) -> Xla {
        Xla { host_collectives: true, ..self }
    }

    /// The session: its client and its compiled programs.
    pub fn session(&self) -> &Session {
        &self.session
    }

    /// The collectives of `part` as XLA compiled it for the client's first devices
    /// (one per position) with this back end's partitioner, read from the optimized
    /// HLO: meshwork's, as XLA kept or combined them, or those XLA's partitioner
    /// inserted.
    pub fn collectives(&self, part: &Partitioned) -> Result<Vec<meshwork_xla::hlo::CollectiveOp>> {
        let client = self.session.client();
        let ids = (0..part.mesh().size())
            .map(|d| client.device(d).map(|d| i64::from(d.id())))
            .collect::<meshwork_xla::Result<Vec<_>>>()?;
        let (compiled, _) = self.compile_part(part, &ids, &[])?;
        let (_, hlo) = compiled.executable.optimized_program()?;
        Ok(meshwork_xla::hlo::collectives(&hlo)?)
    }

    /// `part` lowered for this back end's partitioner and compiled with position `r`
    /// on the device whose id is `ids[r]`; with XLA's partitioner, the positions whose
    /// parts of each result must be zeros (see `XlaSpmd::zero`).
    fn compile_part(
        &self,
        part: &Partitioned,
        ids: &[i64],
        carry: &[(usize, usize)],
    ) -> Result<(Arc<Compiled>, Vec<Vec<bool>>)> {
        let (program, mut options, zero) = lowering(self.partitioner, part, ids.len(), carry)?;
        options.cudnn_attention = self.cudnn();
        Ok((self.session.compile_on(program, &options, ids)?, zero))
    }
}

/// What XLA compiles for `part` on `n` positions split by `partitioner`: meshwork's
/// per-device program as `n` replicas, or the global program with its layouts as
/// shardings over `n` partitions (and then the positions whose parts of each result
/// must be zeros, see `XlaSpmd::zero`).
pub(crate) fn lowering<'p>(
    partitioner: Partitioner,
    part: &'p Partitioned,
    n: usize,
    carry: &[(usize, usize)],
) -> Result<(&'p meshwork_program::Program, LowerOptions, Vec<Vec<bool>>)> {
    Ok(match partitioner {
        Partitioner::Meshwork => (
            part.program(),
            LowerOptions { replicas: n, donate: carry.to_vec(), ..LowerOptions::default() },
            Vec::new(),
        ),
        Partitioner::Xla => {
            let (params, results, zero) = xla_shardings(part, carry)?;
            let options = LowerOptions {
                partitions: n,
                donate: carry.to_vec(),
                param_shardings: params,
                result_shardings: results,
                ..LowerOptions::default()
            };
            (part.global(), options, zero)
        }
    })
}

impl Backend for Xla {
    fn name(&self) -> &'static str {
        "xla"
    }

    fn describe(&self) -> String {
        format!("XLA ({})", self.session.client().platform())
    }

    fn cudnn(&self) -> bool {
        matches!(self.session.client().platform(), "cuda" | "gpu")
    }

    fn device_peak_bytes(&self) -> Option<u64> {
        let client = self.session.client();
        let stats = client.memory_stats(client.device(0).ok()?)?;
        stats.peak_bytes_in_use.and_then(|b| u64::try_from(b).ok())
    }

    fn partitioner(&self) -> Partitioner {
        self.partitioner
    }

    fn compiles(&self) -> u64 {
        self.session.compiles() as u64
    }

    fn compile_spmd(
        &self,
        part: &Partitioned,
        placement: &[usize],
        resident: &[bool],
        carry: &[(usize, usize)],
    ) -> Result<Box<dyn SpmdExecutable>> {
        if self.host_collectives {
            return self.compile_spmd_local(part, 0..placement.len(), placement, resident, carry);
        }
        let client = self.session.client();
        let devices: Vec<meshwork_xla::Device> = placement
            .iter()
            .map(|&d| client.device(d).cloned())
            .collect::<meshwork_xla::Result<_>>()?;
        let ids: Vec<i64> = devices.iter().map(|d| i64::from(d.id())).collect();
        let (compiled, zero) = self.compile_part(part, &ids, carry)?;
        let n = placement.len();
        let program = match self.partitioner {
            Partitioner::Meshwork => part.program(),
            Partitioner::Xla => part.global(),
        };
        let lowered = &compiled.lowered;
        if !lowered.sends.is_empty() || !lowered.recvs.is_empty() {
            return Err(Error::Compiled {
                problem: "an SPMD program that sends or receives: on XLA, transfers between \
                          devices run in placed programs (Strategy::place)"
                    .into(),
            });
        }
        // What each emit streams: the outputs after the results, in emit order.
        let mut at = program.results().len();
        let emits = lowered
            .emits
            .iter()
            .map(|&(consumer, n)| {
                let specs = lowered.outputs[at..at + n].to_vec();
                at += n;
                (consumer, specs)
            })
            .collect();
        let np = program.params().len();
        // What the compiled program's collectives produce on each device per step, where
        // the plugin gives the optimized program (not counted where it does not).
        let collective_bytes = compiled
            .executable
            .optimized_program()
            .ok()
            .and_then(|(_, hlo)| meshwork_xla::hlo::collectives(&hlo).ok())
            .map_or(0, |ops| ops.iter().map(|c| c.bytes).sum());
        Ok(Box::new(XlaSpmd {
            collective_bytes,
            traffic: super::TrafficCounter::default(),
            session: Arc::clone(&self.session),
            compiled,
            carry: carry.to_vec(),
            results: program.results().len(),
            resident: resident.to_vec(),
            devices,
            state: Mutex::new(State {
                params: (0..n).map(|_| (0..np).map(|_| None).collect()).collect(),
                staged: (0..n).map(|_| Vec::new()).collect(),
            }),
            pool: Mutex::new(Vec::new()),
            emits,
            zero,
        }))
    }

    fn compile_spmd_local(
        &self,
        part: &Partitioned,
        local: std::ops::Range<usize>,
        placement: &[usize],
        resident: &[bool],
        carry: &[(usize, usize)],
    ) -> Result<Box<dyn SpmdExecutable>> {
        if self.partitioner == Partitioner::Xla {
            return Err(Error::Compiled {
                problem: "XLA's partitioner compiles its collectives into the program, which \
                          runs them only among one client's devices: with collectives on the \
                          host or across processes, use meshwork's partitioner"
                    .into(),
            });
        }
        Ok(Box::new(hosted::XlaHosted::compile(
            &self.session,
            part.program(),
            local.start,
            placement,
            resident,
            carry,
        )?))
    }

    fn compile_placed(
        &self,
        parts: &[Part],
        placement: &[usize],
        _devices: usize,
    ) -> Result<Box<dyn PlacedExecutable>> {
        Ok(Box::new(placed::XlaPlaced::compile(&self.session, parts, placement)?))
    }
}

/// The MPI job's key-value store ([`meshwork_executor::mpi::KeyValue`]) as the store a
/// PJRT client spanning processes reaches through its callbacks
/// ([`Plugin::client_with_store`](meshwork_xla::Plugin::client_with_store)): what
/// JAX's distributed runtime serves over gRPC, here over meshwork's MPI link.
#[cfg(feature = "mpi")]
#[derive(Clone)]
pub struct MpiKeyValueStore(pub Arc<meshwork_executor::mpi::KeyValue>);

#[cfg(feature = "mpi")]
impl meshwork_xla::KeyValueStore for MpiKeyValueStore {
    fn get(
        &self,
        key: &[u8],
        timeout: Option<std::time::Duration>,
    ) -> std::result::Result<Option<Vec<u8>>, String> {
        self.0.get(key, timeout)
    }
    fn try_get(&self, key: &[u8]) -> std::result::Result<Option<Vec<u8>>, String> {
        self.0.try_get(key)
    }
    fn put(&self, key: &[u8], value: &[u8]) -> std::result::Result<(), String> {
        self.0.put(key, value)
    }
}

/// Each position's resident parameters and a run's staged results.
struct State {
    /// `params[r][k]`: position `r`'s part of parameter `k`.
    params: Vec<Vec<Option<Buffer>>>,
    /// The last run's carried results by position, `(parameter, buffer)`, until
    /// committed.
    staged: Vec<Vec<(usize, Buffer)>>,
}

/// A program compiled by XLA for the positions of a mesh.
struct XlaSpmd {
    session: Arc<Session>,
    compiled: Arc<Compiled>,
    /// Each position's device.
    devices: Vec<meshwork_xla::Device>,
    carry: Vec<(usize, usize)>,
    results: usize,
    resident: Vec<bool>,
    state: Mutex<State>,
    /// Host tensors a step's feeds were split into, kept after their upload for the
    /// next step's feeds: no fresh pages to fault in and zero each step.
    pool: Mutex<Vec<Tensor>>,
    /// Each `emit`: its consumer and what it streams.
    emits: Vec<(u32, Vec<TensorSpec>)>,
    /// The bytes its collectives produce on each device per step (from the HLO XLA
    /// compiled; 0 where the plugin does not give it).
    collective_bytes: u64,
    /// What its runs moved.
    traffic: super::TrafficCounter,
    /// Per result not carried (XLA's partitioner only), the positions whose part is
    /// zeros: a result meshwork's layout leaves a pending sum over some axes is whole
    /// on every device from XLA, so only the first position along those axes gives
    /// it, and the parts still sum to the value.
    zero: Vec<Vec<bool>>,
}

/// The most host tensors [`XlaSpmd::pool`] keeps.
const POOL: usize = 64;

impl XlaSpmd {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Position `r`'s device, or an error for a position the mesh does not have.
    fn device(&self, r: usize) -> Result<&meshwork_xla::Device> {
        self.devices.get(r).ok_or_else(|| Error::Compiled {
            problem: format!("position {r} of a mesh of {}", self.devices.len()),
        })
    }
}

impl SpmdExecutable for XlaSpmd {
    fn positions(&self) -> usize {
        self.devices.len()
    }

    fn buffer(&self, _r: usize, spec: &TensorSpec) -> Result<Tensor> {
        let mut pool = self.pool.lock().unwrap_or_else(PoisonError::into_inner);
        match pool.iter().position(|t| t.dtype() == spec.dtype && t.shape() == spec.shape.dims()) {
            Some(k) => Ok(pool.swap_remove(k)),
            None => Ok(Tensor::zeros(spec.dtype, spec.shape.dims())?),
        }
    }

    fn put(&self, r: usize, param: usize, part: Tensor) -> Result<()> {
        let buffer = self.session.client().put(&part, self.device(r)?)?;
        self.state().params[r][param] = Some(buffer);
        Ok(())
    }

    fn put_all(&self, parts: Vec<(usize, usize, Tensor)>) -> Result<()> {
        // Every part uploaded first, then swapped in: a failed upload changes nothing.
        let mut uploaded = Vec::with_capacity(parts.len());
        for (r, param, part) in parts {
            uploaded.push((r, param, self.session.client().put(&part, self.device(r)?)?));
        }
        let mut state = self.state();
        for (r, param, buffer) in uploaded {
            state.params[r][param] = Some(buffer);
        }
        Ok(())
    }

    fn fetch(&self, r: usize, param: usize) -> Result<Option<Tensor>> {
        self.device(r)?;
        let state = self.state();
        Ok(match &state.params[r][param] {
            Some(b) => Some(b.to_host()?),
            None => None,
        })
    }

    fn is_set(&self, r: usize, param: usize) -> bool {
        self.state().params.get(r).is_some_and(|p| p[param].is_some())
    }

    fn held_bytes(&self, r: usize, param: usize) -> Result<Option<u64>> {
        self.device(r)?;
        let state = self.state();
        Ok(match &state.params[r][param] {
            Some(b) => Some(b.device_bytes()? as u64),
            None => None,
        })
    }

    fn traffic(&self) -> super::Traffic {
        self.traffic.get()
    }

    fn run(
        &self,
        strategy: &Strategy,
        feeds: Vec<Vec<Vec<Tensor>>>,
        tag: u64,
    ) -> Result<Vec<Vec<Vec<Tensor>>>> {
        let n = self.devices.len();
        if feeds.len() != n {
            return Err(Error::Compiled {
                problem: format!("feeds for {} positions of a mesh of {n}", feeds.len()),
            });
        }
        let steps = feeds.first().map_or(0, Vec::len);
        // Every emit's consumer must take what it emits: checked now, as a failure to
        // stream after the state is donated would lose the state.
        for (consumer, specs) in &self.emits {
            strategy.takes_metrics(*consumer, specs)?;
        }
        let client = self.session.client();
        let moved_before = client.transfers();
        let want = self.resident.iter().filter(|&&r| !r).count();
        // Every step's feeds on every device before anything is donated:
        // `uploaded[i][r]` is step `i`'s feeds on position `r`.
        let mut uploaded: Vec<Vec<Vec<Buffer>>> =
            (0..steps).map(|_| Vec::with_capacity(n)).collect();
        for (r, position) in feeds.iter().enumerate() {
            if position.len() != steps {
                return Err(Error::Compiled {
                    problem: "positions fed different numbers of steps (a partitioner bug)".into(),
                });
            }
            let device = self.device(r)?;
            for (i, step_feed) in position.iter().enumerate() {
                if step_feed.len() != want {
                    return Err(Error::Compiled {
                        problem: format!(
                            "{} feeds for {want} fed parameters (a partitioner bug)",
                            step_feed.len()
                        ),
                    });
                }
                uploaded[i].push(
                    step_feed
                        .iter()
                        .map(|t| client.put(t, device))
                        .collect::<meshwork_xla::Result<_>>()?,
                );
            }
        }
        {
            // Uploaded: the host copies go back to the pool for the next call's feeds.
            let mut pool = self.pool.lock().unwrap_or_else(PoisonError::into_inner);
            for t in feeds.into_iter().flatten().flatten() {
                if pool.len() < POOL {
                    pool.push(t);
                }
            }
        }
        let mut state = self.state();
        let np = self.resident.len();
        for r in 0..n {
            if let Some(p) = (0..np).find(|&p| self.resident[p] && state.params[r][p].is_none()) {
                return Err(unset(p));
            }
        }
        let carried_into: Vec<bool> =
            (0..np).map(|p| self.carry.iter().any(|&(_, q)| q == p)).collect();
        // The carried results so far, by position and parameter: the next step's
        // inputs.
        let mut carried: Vec<Vec<Option<Buffer>>> =
            (0..n).map(|_| (0..np).map(|_| None).collect()).collect();
        // `pending[i][r]`: step `i`'s outputs on position `r` that are not carried.
        let mut pending: Vec<Vec<Vec<Buffer>>> = Vec::with_capacity(steps);
        for step_feed in uploaded {
            // What each position's step owns (fed, carried, or a resident parameter
            // the step replaces, donated to it); then what it only reads.
            let mut owned: Vec<Vec<Option<Buffer>>> = Vec::with_capacity(n);
            for (r, feed) in step_feed.into_iter().enumerate() {
                let mut feed = feed.into_iter();
                let mut mine = Vec::with_capacity(np);
                for p in 0..np {
                    mine.push(match (self.resident[p], carried[r][p].take()) {
                        (false, _) => feed.next(),
                        (true, Some(b)) => Some(b),
                        (true, None) if carried_into[p] => {
                            Some(state.params[r][p].take().ok_or_else(|| unset(p))?)
                        }
                        (true, None) => None,
                    });
                }
                owned.push(mine);
            }
            let mut args: Vec<Vec<Arg<'_>>> = Vec::with_capacity(n);
            for (r, mine) in owned.into_iter().enumerate() {
                let mut list = Vec::with_capacity(np);
                for (p, b) in mine.into_iter().enumerate() {
                    list.push(match b {
                        Some(b) => Arg::Donated(b),
                        None => Arg::Borrowed(state.params[r][p].as_ref().ok_or_else(|| unset(p))?),
                    });
                }
                args.push(list);
            }
            let outs = self.compiled.executable.execute(args)?;
            let mut step_out = Vec::with_capacity(n);
            for (r, outs) in outs.into_iter().enumerate() {
                let mut outs: Vec<Option<Buffer>> = outs.into_iter().map(Some).collect();
                for &(k, p) in &self.carry {
                    carried[r][p] = outs.get_mut(k).and_then(Option::take);
                }
                step_out.push(outs.into_iter().flatten().collect());
            }
            pending.push(step_out);
        }
        state.staged = carried
            .into_iter()
            .map(|c| c.into_iter().enumerate().filter_map(|(p, b)| Some((p, b?))).collect())
            .collect();
        drop(state);
        // Every step is enqueued; now the results come back, in order.
        let kept = self.results - self.carry.len();
        let mut results: Vec<Vec<Vec<Tensor>>> =
            (0..n).map(|_| Vec::with_capacity(steps)).collect();
        for (i, step_out) in pending.into_iter().enumerate() {
            for (r, outs) in step_out.into_iter().enumerate() {
                let mut host =
                    outs.iter().map(Buffer::to_host).collect::<meshwork_xla::Result<Vec<_>>>()?;
                let emitted = host.split_off(kept.min(host.len()));
                for (j, t) in host.iter_mut().enumerate() {
                    if self.zero.get(j).is_some_and(|z| z[r]) {
                        *t = Tensor::zeros(t.dtype(), t.shape())?;
                    }
                }
                // What the program emits streams from position 0, as on the interpreter.
                if r == 0 {
                    let mut rest = emitted.into_iter();
                    for (consumer, specs) in &self.emits {
                        let values: Vec<Tensor> = rest.by_ref().take(specs.len()).collect();
                        strategy.host_emit(0, *consumer, tag + i as u64, values)?;
                    }
                }
                results[r].push(host);
            }
        }
        // What the client moved for this run (its counts), and what the compiled
        // program's collectives produce on each device each step.
        count(&self.traffic, client.transfers() - moved_before);
        self.traffic.moved(self.collective_bytes * (n * steps) as u64);
        self.traffic.stepped(steps as u64);
        Ok(results)
    }

    fn commit(&self, keep: bool) {
        let mut state = self.state();
        let staged = std::mem::take(&mut state.staged);
        if keep {
            for (r, staged) in staged.into_iter().enumerate() {
                for (p, b) in staged {
                    state.params[r][p] = Some(b);
                }
            }
        }
        state.staged = (0..self.devices.len()).map(|_| Vec::new()).collect();
    }
}

/// Adds what a client moved during a run to `traffic`.
fn count(traffic: &super::TrafficCounter, moved: meshwork_xla::Transfers) {
    traffic.fed(moved.host_to_device);
    traffic.returned(moved.device_to_host);
    traffic.moved(moved.device_to_device);
}

fn unset(p: usize) -> Error {
    Error::Compiled {
        problem: format!(
            "resident parameter {p} is not on the device (never set, or lost in a failed step)"
        ),
    }
}

/// Each parameter's and result's `HloSharding` text, and per result not carried the
/// positions whose part is zeros.
type XlaShardings = (Vec<String>, Vec<String>, Vec<Vec<bool>>);

/// XLA's shardings of `part`'s global program: each parameter's and result's layout as
/// an `HloSharding` over the mesh's positions (partition `r` is position `r`), a
/// pending sum written as replication; and per result not carried, the positions
/// whose part must be zeros for the parts to sum to the value (see `XlaSpmd::zero`).
/// A layout that does not divide its value is refused: XLA pads such shards, where
/// meshwork's parts are uneven.
fn xla_shardings(part: &Partitioned, carry: &[(usize, usize)]) -> Result<XlaShardings> {
    let mesh = part.mesh();
    let axes: Vec<(&str, usize)> =
        mesh.axis_names().iter().map(String::as_str).zip(mesh.shape().iter().copied()).collect();
    let positions = Mesh::iota(&axes)?;
    let global = part.global();
    let hlo = |l: &Layout, shape: &[usize], what: &str| -> Result<String> {
        let tiles = l.tiles(mesh);
        if let Some(d) = (0..shape.len()).find(|&d| !shape[d].is_multiple_of(tiles[d].max(1))) {
            return Err(Error::Compiled {
                problem: format!(
                    "{what}: dim {d} of {shape:?} is split {} ways unevenly, which XLA's \
                     partitioner pads (use --partitioner meshwork, or sizes that divide)",
                    tiles[d]
                ),
            });
        }
        Ok(l.without_partial().to_hlo(&positions)?.to_string())
    };
    let params = global
        .params()
        .iter()
        .zip(part.inputs())
        .map(|(p, l)| hlo(l, p.spec.shape.dims(), &format!("parameter {}", p.name)))
        .collect::<Result<Vec<_>>>()?;
    let mut results = Vec::with_capacity(global.results().len());
    let mut zero = Vec::new();
    for (k, (v, l)) in global.results().iter().zip(part.outputs()).enumerate() {
        let shape = global.spec(*v).map(|s| s.shape.dims().to_vec()).unwrap_or_default();
        results.push(hlo(l, &shape, &format!("result {k}"))?);
        if carry.iter().any(|&(r, _)| r == k) {
            continue;
        }
        // Position r's coordinate along each axis, row-major.
        let coordinate = |r: usize, a: usize| {
            let stride: usize = mesh.shape()[a + 1..].iter().product();
            (r / stride) % mesh.shape()[a]
        };
        zero.push(
            (0..mesh.size()).map(|r| l.partial().iter().any(|&a| coordinate(r, a) != 0)).collect(),
        );
    }
    Ok((params, results, zero))
}
