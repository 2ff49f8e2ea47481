//! What runs the programs the partitioner makes on a strategy's devices: the
//! per-device program of an SPMD partition on every mesh position, or each part of a
//! placed program on its device, with state resident on the devices between steps.
//!
//! [`Compiled`](crate::spmd::Compiled) and [`Placed`](crate::placed::Placed) are the
//! façade's handles: they check what a caller gives them, split global tensors into
//! per-device parts and assemble results, and decide when a step's updates are kept.
//! A [`Backend`] does the rest — compiling the per-device programs for the devices,
//! holding the parts that stay there, running steps. [`Interpreter`] is meshwork's own:
//! the fast interpreter on the executor's devices, collectives and transfers through
//! the executor, `emit` through the strategy's outfeed. A strategy runs on the
//! interpreter unless given another ([`Strategy::with_backend`](crate::Strategy::with_backend)).

use std::fmt;

use meshwork_partition::placed::Part;
use meshwork_partition::spmd::Partitioned;
use meshwork_types::{Tensor, TensorSpec};

use crate::{Result, Strategy};

mod cut;
mod interpreter;
mod span;
mod xla;

pub use interpreter::Interpreter;
pub(crate) use span::Spanning;
#[cfg(feature = "mpi")]
pub use xla::MpiKeyValueStore;
pub use xla::{Xla, XlaTarget};

/// What an executable's steps moved: bytes, summed over the steps it ran and over its
/// devices. On XLA, the client's own counts of the bytes it uploaded, downloaded and
/// copied between devices during the steps, and the collectives' results as the
/// compiled program produces them (from its optimized HLO, each collective once per
/// execution); on the interpreter, the tensors handed to and returned by its devices,
/// each collective's result as the executor returned it, each transfer as sent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Traffic {
    /// From the host to the devices: what steps were fed (not `put`s of resident
    /// values).
    pub host_to_device: u64,
    /// From the devices to the host: what steps returned and emitted (not `fetch`es).
    pub device_to_host: u64,
    /// Between devices: each collective's result on each device (its bytes in the
    /// program XLA compiled, or as the executor's collectives return it), and each
    /// transfer of a placed program.
    pub between_devices: u64,
    /// Steps run.
    pub steps: u64,
}

/// Counts an executable's [`Traffic`] from any thread.
#[derive(Debug, Default)]
pub(crate) struct TrafficCounter([std::sync::atomic::AtomicU64; 4]);

impl TrafficCounter {
    fn add(&self, k: usize, bytes: u64) {
        self.0[k].fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
    }
    pub(crate) fn fed(&self, bytes: u64) {
        self.add(0, bytes);
    }
    pub(crate) fn returned(&self, bytes: u64) {
        self.add(1, bytes);
    }
    pub(crate) fn moved(&self, bytes: u64) {
        self.add(2, bytes);
    }
    pub(crate) fn stepped(&self, steps: u64) {
        self.add(3, steps);
    }
    pub(crate) fn get(&self) -> Traffic {
        let read = |k: usize| self.0[k].load(std::sync::atomic::Ordering::Relaxed);
        Traffic {
            host_to_device: read(0),
            device_to_host: read(1),
            between_devices: read(2),
            steps: read(3),
        }
    }
}

/// The bytes of `tensors`.
pub(crate) fn bytes_of<'a>(tensors: impl IntoIterator<Item = &'a Tensor>) -> u64 {
    tensors.into_iter().map(|t| t.byte_size() as u64).sum()
}

/// Which partitioner splits an SPMD program for its devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Partitioner {
    /// meshwork's (`partition`): the back end compiles the per-device program, whose
    /// collectives meshwork inserted.
    #[default]
    Meshwork,
    /// XLA's SPMD partitioner: the back end compiles the global program with its
    /// inputs' and outputs' shardings (`mhlo.sharding`), and XLA inserts the
    /// collectives (as `jax.jit` with `NamedSharding`s).
    Xla,
}

/// Compiles the programs of partitioned and placed programs for a strategy's devices.
pub trait Backend: Send + Sync + fmt::Debug {
    /// Its name, for reports (`interpreter`).
    fn name(&self) -> &'static str;

    /// What it runs on, for a run's headline (`XLA (cpu)`); its name by default.
    fn describe(&self) -> String {
        self.name().to_string()
    }

    /// Whether it runs [`Op::Attention`](meshwork_program::Op::Attention) as cuDNN's
    /// fused attention (XLA on NVIDIA GPUs, or compiling for them); the others run its
    /// definition.
    fn cudnn(&self) -> bool {
        false
    }

    /// The most bytes its first device has held at once, where the device keeps count
    /// (a GPU's allocator does); `None` elsewhere.
    fn device_peak_bytes(&self) -> Option<u64> {
        None
    }

    /// Which partitioner splits its SPMD programs.
    fn partitioner(&self) -> Partitioner {
        Partitioner::Meshwork
    }

    /// How many programs it compiled so far (XLA: compilations its session made,
    /// cache hits not counted; the interpreter: programs it prepared).
    fn compiles(&self) -> u64;

    /// Compiles `part` for the positions of its mesh, position `r` on the strategy's
    /// device `placement[r]`: its per-device program (every position runs it, its
    /// collectives over replica groups of positions) — or, for a back end with a
    /// partitioner of its own ([`Partitioner::Xla`]), its global program with the
    /// same input and output layouts, split by that partitioner; either way position
    /// `r` takes and gives its parts as the layouts say. Parameter `k` is resident
    /// when `resident[k]` (kept on the devices between steps, [`SpmdExecutable::put`]),
    /// fed otherwise; each `(result, parameter)` of `carry` makes that result the
    /// parameter's next value.
    fn compile_spmd(
        &self,
        part: &Partitioned,
        placement: &[usize],
        resident: &[bool],
        carry: &[(usize, usize)],
    ) -> Result<Box<dyn SpmdExecutable>>;

    /// Compiles `part` for a mesh spread over processes, of which this one runs the
    /// positions `local`, position `local.start + i` on this process's device
    /// `placement[i]`: an executable whose positions are this process's (`0..` in
    /// its methods), its collectives among all the mesh's positions across the
    /// processes (through the strategy's executor and its interconnect). Every
    /// process compiles the same program and runs its steps in the same order.
    /// Otherwise as [`compile_spmd`](Self::compile_spmd); a back end that cannot says
    /// so (the default).
    fn compile_spmd_local(
        &self,
        part: &Partitioned,
        local: std::ops::Range<usize>,
        placement: &[usize],
        resident: &[bool],
        carry: &[(usize, usize)],
    ) -> Result<Box<dyn SpmdExecutable>> {
        let _ = (part, local, placement, resident, carry);
        Err(crate::Error::Compiled {
            problem: format!("the {} back end runs SPMD programs in one process", self.name()),
        })
    }

    /// Compiles each part of a placed program, part `p` on the strategy's device
    /// `placement[p]`, of a strategy of `devices` devices (whose share of the machine
    /// each device gets, used by the placement or not).
    fn compile_placed(
        &self,
        parts: &[Part],
        placement: &[usize],
        devices: usize,
    ) -> Result<Box<dyn PlacedExecutable>>;
}

/// Where each result of `part` goes: `Some(slot)` for the variable (among its
/// `Source::Variable`s) that a `Sink::Update` replaces, `None` otherwise; an error for
/// an update of a variable the part does not hold (a partitioner bug).
pub(crate) fn placed_sinks(part: &Part) -> Result<Vec<Option<usize>>> {
    use meshwork_partition::placed::{Sink, Source};
    part.sinks
        .iter()
        .map(|s| match *s {
            Sink::Update(k) => part
                .sources
                .iter()
                .filter(|s| matches!(s, Source::Variable(_)))
                .position(|s| *s == Source::Variable(k))
                .map(Some)
                .ok_or_else(|| crate::Error::Compiled {
                    problem: format!(
                        "a part on device {} updates variable {k}, which it does not hold",
                        part.device
                    ),
                }),
            Sink::Result(_) | Sink::Token => Ok(None),
        })
        .collect()
}

/// An SPMD program compiled onto the devices of a mesh, with its resident parameters'
/// parts on them.
pub trait SpmdExecutable: Send + Sync {
    /// How many mesh positions it runs.
    fn positions(&self) -> usize;

    /// The positions this process runs: all of them, unless the mesh spreads over
    /// processes.
    fn local(&self) -> std::ops::Range<usize> {
        0..self.positions()
    }

    /// A tensor of `spec` on position `r`, to fill with a feed's part (contents
    /// unspecified; from the device's pool where it has one).
    fn buffer(&self, r: usize, spec: &TensorSpec) -> Result<Tensor>;

    /// Makes `part` position `r`'s part of resident parameter `param` (a copy to the
    /// device, which may fail: out of device memory).
    fn put(&self, r: usize, param: usize, part: Tensor) -> Result<()>;

    /// Makes each `(r, param, part)` of `parts` position `r`'s part of resident
    /// parameter `param`, all or none: a part that cannot be put leaves every resident
    /// part as it was. The default puts one at a time, which is all or none for a back
    /// end whose `put` cannot fail (the interpreter's); one whose can (XLA's, out of
    /// device memory) puts every part first and then swaps them in, holding old and
    /// new at once for that moment.
    fn put_all(&self, parts: Vec<(usize, usize, Tensor)>) -> Result<()> {
        for (r, param, part) in parts {
            self.put(r, param, part)?;
        }
        Ok(())
    }

    /// A copy of position `r`'s part of resident parameter `param`, if it has one (a
    /// copy from the device, which may fail).
    fn fetch(&self, r: usize, param: usize) -> Result<Option<Tensor>>;

    /// Copies of every position's part of resident parameter `param` (`None` where
    /// unset). Across processes this is a collective: every process calls it, at the
    /// same point among its steps. The default fetches each position's.
    fn fetch_every(&self, strategy: &Strategy, param: usize) -> Result<Vec<Option<Tensor>>> {
        let _ = strategy;
        (0..self.positions()).map(|r| self.fetch(r, param)).collect()
    }

    /// Copies of every position's part of resident parameter `param`, in the process
    /// that runs position 0 (`None` in the others): a gather to one process, not to
    /// all. Across processes every process calls it, as [`fetch_every`](Self::fetch_every).
    fn fetch_to_first(
        &self,
        strategy: &Strategy,
        param: usize,
    ) -> Result<Option<Vec<Option<Tensor>>>> {
        self.fetch_every(strategy, param).map(Some)
    }

    /// Whether position `r` holds a part of resident parameter `param`.
    fn is_set(&self, r: usize, param: usize) -> bool;

    /// The bytes position `r`'s part of resident parameter `param` takes where it is
    /// held (the device buffer's size), if set.
    fn held_bytes(&self, r: usize, param: usize) -> Result<Option<u64>>;

    /// What its runs moved so far.
    fn traffic(&self) -> Traffic;

    /// Runs `feeds[r].len()` steps (the same count on every position): `feeds[r][i]`
    /// is position `r`'s parts of step `i`'s fed parameters, in parameter order. Step
    /// `i + 1` reads step `i`'s carried results in place of the parameters they carry
    /// into; the last step's carried results are staged, not kept, until
    /// [`commit`](Self::commit). Returns each position's results of each step that are
    /// not carried, in result order. What the program `emit`s streams to `strategy`'s
    /// metrics from position 0, tagged `tag + i`.
    fn run(
        &self,
        strategy: &Strategy,
        feeds: Vec<Vec<Vec<Tensor>>>,
        tag: u64,
    ) -> Result<Vec<Vec<Vec<Tensor>>>>;

    /// Keeps the staged carried results of the last [`run`](Self::run) as the resident
    /// parameters' parts (`keep`), or drops them.
    fn commit(&self, keep: bool);
}

/// A placed program's parts compiled onto their devices, with its variables there.
pub trait PlacedExecutable: Send + Sync {
    /// Makes `value` variable `slot` of part `part` (its `Source::Variable`s, in
    /// order): a copy to the device, which may fail (out of device memory).
    fn put(&self, part: usize, slot: usize, value: Tensor) -> Result<()>;

    /// A copy of variable `slot` of part `part`, if set (a copy from the device,
    /// which may fail).
    fn fetch(&self, part: usize, slot: usize) -> Result<Option<Tensor>>;

    /// Whether variable `slot` of part `part` is set.
    fn is_set(&self, part: usize, slot: usize) -> bool;

    /// The bytes variable `slot` of part `part` takes on its device, if set.
    fn held_bytes(&self, part: usize, slot: usize) -> Result<Option<u64>>;

    /// What its steps moved so far.
    fn traffic(&self) -> Traffic;

    /// Runs one step: `feeds[p]` are part `p`'s fed inputs (its `Source::Feed`s, in
    /// order); its variables are read where they are, and its `Sink::Update`s become
    /// their next values on the device — only if every device finished the step; a
    /// step that fails anywhere leaves them as they were. Returns each part's
    /// `Sink::Result` values, in its sinks' order. A failure on any device ends the
    /// step on all of them with that device's error.
    fn run(&self, strategy: &Strategy, feeds: Vec<Vec<Tensor>>) -> Result<Vec<Vec<Tensor>>>;
}
