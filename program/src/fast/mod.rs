//! The fast interpreter: a program compiled once into a plan of fused elementwise
//! groups and GEMM-backed kernels, run many times.
//!
//! - **Matrix products** (`dot_general`, and `conv2d` and its gradients through
//!   im2col) go through the [`gemm`](https://docs.rs/gemm) crate, reading transposed
//!   operands in place through strides. Chosen by measurement on this project's 2-core
//!   AVX2 machines (f32, n³, GFLOP/s, medians): `gemm` with 2 threads 140–183 at 256,
//!   183 at 512, 160–179 at 1024; `matrixmultiply` with its threads 76–125, 160, 159;
//!   JAX's `jnp.dot` in the same sitting 68–91, 90–177, 172. OpenBLAS (a system
//!   library, through ndarray's `blas` feature) was not needed to reach JAX.
//! - **Elementwise chains** (unary, binary, comparisons, selects, bool→float converts
//!   and broadcasts; chains that meet are merged, so Adam's update is one group) are
//!   fused into groups that make one pass over memory in L1-sized
//!   chunks, reading contiguous and broadcast operands in place (the next chunk
//!   prefetched), uniform operands of binary ops as scalars, and writing the last
//!   member straight into its output; only values read outside a group are written.
//!   Outputs of at least [`Options::stream_bytes`] go to memory with streaming stores,
//!   which skip reading each line before overwriting it (a 5-op chain over 16 Mi f32
//!   runs at about 1.2× the time of a plain copy of the same bytes), and so do
//!   outputs of at least 1 MiB that are only the program's results.
//! - **Constants**: integer and bool values that read no parameter (an attention
//!   mask's iotas and comparison) are computed once, when the program is compiled.
//! - **Profile**: with [`Options::profile`] (on when `MESHWORK_PROFILE` is set) every
//!   step is timed by its kind — op and shapes, or fused group — and the table printed
//!   when the executable is dropped ([`Executable::profile`] reads it), with each
//!   product's floating-point rate and the products' share of the time: how near a
//!   program runs to the machine's multiply-add peak.
//! - **Buffers** are freed after their last use into a pool (for each size class, as
//!   many as a run draws from it at once; in all, at least the plan's peak or
//!   [`Options::pool_bytes`]) the next allocations (of this run and later runs) take
//!   from; [`Executable::run_owned`] also frees the
//!   inputs it is given (JAX's donation), and a `reshape` of a dying value takes its
//!   buffer.
//! - **Threads**: at most [`Options::threads`] per run, for GEMMs and large fused
//!   groups, on rayon's shared pool; [`Options::for_devices`] splits the machine's
//!   cores among D devices so they do not oversubscribe it.
//!
//! Floats compute natively in their dtype (the reference computes in f64 and rounds),
//! so f32 results differ from the reference's by rounding; f64 results agree to about
//! 1e-12 relative. Integer and bool ops that are not layout copies run the reference's
//! loops over the same buffers.

mod attention;
mod float;
mod fused;
mod kernels;
mod loss;

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use meshwork_types::DType;

use self::float::Float;
pub use self::float::{exp_f32, tanh_f32};
use self::kernels::{Alloc, Conv};
use crate::env::{Env, communicate};
use crate::op::{Op, Unary};
use crate::program::{Program, Value};
use crate::tensor::{shaped, supported};
use crate::{Result, reference};
use meshwork_types::{Tensor, TensorSpec};

/// How a program is compiled and run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    /// Threads one run may use (GEMMs and large elementwise groups). At least 1.
    pub threads: usize,
    /// Fuse elementwise chains (off: each instruction runs alone, for comparisons).
    pub fusion: bool,
    /// Bytes of freed buffers kept for reuse between runs, at least (a program whose
    /// values hold more at once keeps up to that much: a training step of a large
    /// model reuses its own buffers every step instead of faulting in fresh pages).
    pub pool_bytes: usize,
    /// A fused group whose outputs are at least this many bytes each writes them with
    /// streaming stores past the caches (where the CPU has AVX): an output that large
    /// would not stay in cache, and skipping the read of each line before it is
    /// overwritten saves a third of the memory traffic. Default 32 MiB, a server's L3
    /// share; `usize::MAX` turns it off. (Outputs of at least 1 MiB that only the
    /// caller reads, the program's results, stream too.)
    pub stream_bytes: usize,
    /// Time every step of every run by its kind ([`Executable::profile`]), and print
    /// the table to stderr when the executable is dropped. Default: whether the
    /// environment sets `MESHWORK_PROFILE` (so any command's programs can be profiled
    /// without rebuilding it).
    pub profile: bool,
}

impl Default for Options {
    fn default() -> Options {
        Options::for_devices(1)
    }
}

impl Options {
    /// The machine's cores shared by `devices` devices running at once: each run gets
    /// `max(1, cores / devices)` threads.
    pub fn for_devices(devices: usize) -> Options {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        Options {
            threads: (cores / devices.max(1)).max(1),
            fusion: true,
            pool_bytes: 1 << 30,
            stream_bytes: 32 << 20,
            profile: std::env::var_os("MESHWORK_PROFILE").is_some(),
        }
    }

    /// With `threads` threads per run.
    pub fn threads(mut self, threads: usize) -> Options {
        self.threads = threads.max(1);
        self
    }
}

/// An input of [`Executable::run_inputs`].
#[derive(Debug)]
pub enum Input<'a> {
    /// Taken: its buffer is reused once the program no longer reads it.
    Owned(Tensor),
    /// Only read.
    Borrowed(&'a Tensor),
}

/// One step of the plan.
#[derive(Debug, Clone)]
enum Step {
    /// An instruction (its index) run by its own kernel.
    Instr(usize),
    /// A fused group (its index).
    Fused(usize),
}

/// Freed buffers by dtype and length.
///
/// A buffer is kept only while its size class has fewer pooled buffers than one run
/// has drawn from the pool at once at most (its demand: buffers of the class
/// allocated less those given back, results included, or the parameters of that
/// class a run is given), so the pool never holds more than a run can use — buffers
/// of sizes the program never makes (a training loop's fed batches, say) are freed,
/// and a class a run allocates often but draws few of at a time does not crowd out
/// the others (a training step's new weights and moments, which outlive the run).
#[derive(Debug, Default)]
struct Pool {
    free: HashMap<(DType, usize), Vec<Tensor>>,
    demand: HashMap<(DType, usize), usize>,
    /// Σ demand × a buffer's bytes over the classes: what the pool may hold (the
    /// classes' peaks come at different times of a run, so this may pass the plan's
    /// peak).
    demand_bytes: usize,
    bytes: usize,
    /// Bytes allocated fresh (not taken from the pool), over all runs.
    fresh: u64,
}

impl Pool {
    /// Keeps `d` for a later allocation of its class, if the class's demand and the
    /// byte limit (`limit`, or the demands' bytes, the larger) allow; whether it did.
    fn put(&mut self, d: Tensor, limit: usize) -> bool {
        let size = d.byte_size();
        let class = (d.dtype(), d.len());
        let demand = self.demand.get(&class).copied().unwrap_or(0);
        let pooled = self.free.get(&class).map_or(0, Vec::len);
        // A buffer a kernel could not write as slices (another layout) is not kept.
        let usable = d.is_standard_layout() && supported(d.dtype());
        let limit = limit.max(self.demand_bytes);
        if d.is_empty() || !usable || pooled >= demand || self.bytes.saturating_add(size) > limit {
            return false;
        }
        self.bytes += size;
        self.free.entry(class).or_default().push(d);
        true
    }

    /// A run draws `count` buffers of `class` from the pool at once.
    fn demanded(&mut self, class: (DType, usize), count: usize) {
        let d = self.demand.entry(class).or_insert(0);
        if count > *d {
            let more = (count - *d).saturating_mul(class.1.saturating_mul(class.0.size_in_bytes()));
            self.demand_bytes = self.demand_bytes.saturating_add(more);
            *d = count;
        }
    }

    fn take(&mut self, dtype: DType, len: usize) -> Option<Tensor> {
        let d = self.free.get_mut(&(dtype, len))?.pop()?;
        self.bytes -= len * dtype.size_in_bytes();
        Some(d)
    }
}

/// A program compiled for the fast interpreter. Cheap to run many times; `Sync`, so
/// the devices of a mesh may share one.
#[derive(Debug)]
pub struct Executable {
    program: Program,
    steps: Vec<Step>,
    groups: Vec<fused::Group>,
    /// Values dead after each step (never a result).
    frees: Vec<Vec<Value>>,
    options: Options,
    pool: Mutex<Pool>,
    /// Whether the program receives (a run of it may wait for a peer).
    receives: bool,
    /// Bytes the pool keeps at least: [`Options::pool_bytes`] or the plan's peak, the
    /// larger (and up to what its classes' demands add up to).
    pool_limit: usize,
    /// Time per kind of step, with [`Options::profile`].
    profile: Option<Mutex<Profile>>,
    /// Attention gradients computed together: the first of a set of
    /// `attention_grad`s of one attention and cotangent (instruction index) → the
    /// later ones (instruction, `wrt`), whose results it computes at once (one
    /// recomputation of the probabilities for all three).
    attention_siblings: HashMap<usize, Vec<(usize, usize)>>,
    /// Cross-entropy gradients written over their dying logits, over every run.
    losses_in_place: std::sync::atomic::AtomicUsize,
}

impl Executable {
    /// How many `attention_grad`s run with an earlier sibling's step (for tests).
    #[cfg(test)]
    pub(crate) fn grouped_attention_grads(&self) -> usize {
        self.attention_siblings.values().map(Vec::len).sum()
    }

    /// How many cross-entropy gradients its runs wrote over their logits (for tests).
    #[cfg(test)]
    pub(crate) fn losses_in_place(&self) -> usize {
        self.losses_in_place.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// Seconds and counts per kind of step (an op and its operands' and result's shapes,
/// or a fused group's members), kept with [`Options::profile`]: where a program's time
/// goes, by kernel.
#[derive(Debug, Default)]
struct Profile {
    /// Per kind: steps run, their seconds, and one step's floating-point operations.
    by_kind: HashMap<String, (usize, f64, f64)>,
}

/// One kind of step of a profiled executable ([`Executable::profile`]).
#[derive(Debug, Clone, PartialEq)]
pub struct ProfileRow {
    /// The op and its shapes (`dot_general f32[1,256,1536] <- [1, 256, 576] [1536, 576]`),
    /// or a fused group's shape, loads, outputs and members (`fused [1536, 576] …`).
    pub kind: String,
    /// Steps of this kind run, over every run so far.
    pub count: usize,
    /// Their seconds in all.
    pub seconds: f64,
    /// Their floating-point operations in all, for products (`dot_general`: two per
    /// multiply-add, `2 · result elements · contracted length` a step); 0 for every
    /// other kind.
    pub flops: f64,
}

impl Drop for Executable {
    fn drop(&mut self) {
        let Some(profile) = self.profile.take() else { return };
        let profile = profile.into_inner().unwrap_or_else(|e| e.into_inner());
        let total: f64 = profile.by_kind.values().map(|v| v.1).sum();
        let rate = |flops: f64, secs: f64| {
            if flops > 0.0 && secs > 0.0 {
                format!("  {:.1} GFLOP/s", flops / secs / 1e9)
            } else {
                String::new()
            }
        };
        // Programs that took no time worth reading (an initializer, a test's) say
        // nothing.
        if total < 0.05 {
            return;
        }
        let mut by_op: HashMap<&str, (usize, f64)> = HashMap::new();
        let (mut product_secs, mut product_flops) = (0.0, 0.0);
        for (kind, (count, secs, flops)) in &profile.by_kind {
            let op = kind.split(' ').next().unwrap_or_default();
            let entry = by_op.entry(op).or_default();
            entry.0 += count;
            entry.1 += secs;
            if *flops > 0.0 {
                product_secs += secs;
                product_flops += flops * *count as f64;
            }
        }
        let mut ops: Vec<_> = by_op.into_iter().collect();
        ops.sort_by(|a, b| b.1.1.total_cmp(&a.1.1));
        let mut text = format!(
            "MESHWORK_PROFILE: {} steps, {:.3} s in all; by op:\n",
            self.steps.len(),
            total
        );
        for (op, (count, secs)) in &ops {
            text +=
                &format!("{:>9.3} s {:>5.1}% {:>6}x  {op}\n", secs, 100.0 * secs / total, count);
        }
        if product_flops > 0.0 {
            text += &format!(
                "products: {:.1} GFLOP in {:.3} s ({:.1}% of the time){}; the rest {:.3} s\n",
                product_flops / 1e9,
                product_secs,
                100.0 * product_secs / total,
                rate(product_flops, product_secs),
                total - product_secs
            );
        }
        text += "the kinds taking the most:\n";
        let mut rows: Vec<_> = profile.by_kind.into_iter().collect();
        rows.sort_by(|a, b| b.1.1.total_cmp(&a.1.1));
        for (kind, (count, secs, flops)) in rows.iter().take(60) {
            text += &format!(
                "{:>9.3} s {:>5.1}% {:>6}x  {kind}{}\n",
                secs,
                100.0 * secs / total,
                count,
                rate(flops * *count as f64, *secs)
            );
        }
        #[allow(clippy::print_stderr)]
        {
            eprint!("{text}");
        }
    }
}

/// What a value holds during a run.
enum Slot<'a> {
    Empty,
    Borrowed(&'a Tensor),
    Owned(Tensor),
}

impl<'a> Slot<'a> {
    /// An input's slot: read in place when in standard layout, else copied into it.
    fn borrowed(t: &'a Tensor) -> Slot<'a> {
        if t.is_standard_layout() {
            Slot::Borrowed(t)
        } else {
            Slot::Owned(t.clone().into_standard_layout())
        }
    }

    /// An input's slot, taken.
    fn owned(t: Tensor) -> Slot<'a> {
        Slot::Owned(t.into_standard_layout())
    }
}

impl Slot<'_> {
    fn data(&self) -> &Tensor {
        match self {
            Slot::Borrowed(d) => d,
            Slot::Owned(d) => d,
            Slot::Empty => unreachable!("the plan reads a value after freeing it"),
        }
    }
}

struct Ctx<'p> {
    pool: &'p Mutex<Pool>,
    threads: usize,
    /// This run's net draw on the pool by size class: buffers allocated, less those
    /// the pool took back (results and what the pool refuses stay counted); its
    /// largest value is the class's demand.
    live: HashMap<(DType, usize), usize>,
}

/// A zeroed 1-D buffer: an error, not an abort, when the allocator has no room for
/// it (its size comes from the program's shapes, which come from input).
fn fresh(dtype: DType, len: usize) -> Result<Tensor> {
    Ok(Tensor::zeros(dtype, &[len])?)
}

impl Alloc for Ctx<'_> {
    fn alloc(&mut self, dtype: DType, len: usize) -> Result<Tensor> {
        let live = self.live.entry((dtype, len)).or_insert(0);
        *live += 1;
        let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        pool.demanded((dtype, len), *live);
        match pool.take(dtype, len) {
            Some(t) => Ok(t),
            None => {
                let t = fresh(dtype, len)?;
                pool.fresh = pool.fresh.saturating_add(t.byte_size() as u64);
                Ok(t)
            }
        }
    }

    fn threads(&self) -> usize {
        self.threads
    }
}

impl Executable {
    /// Compiles `program`: fuses its elementwise chains and plans when each buffer dies.
    pub fn compile(program: &Program, options: Options) -> Executable {
        let program = &without_barriers(program);
        let (folded, skip) = fold_constants(program);
        let program = &folded;
        let groups = if options.fusion { fused::plan(program) } else { Vec::new() };
        let mut group_of = vec![None; program.instrs().len()];
        let mut last_member = vec![None; program.instrs().len()];
        for (g, group) in groups.iter().enumerate() {
            for &i in &group.members {
                group_of[i] = Some(g);
            }
            last_member[*group.members.last().expect("a group has a member")] = Some(g);
        }
        let mut steps = Vec::new();
        for i in (0..program.instrs().len()).filter(|&i| !skip[i]) {
            match (group_of[i], last_member[i]) {
                (None, _) => steps.push(Step::Instr(i)),
                (Some(_), Some(g)) => steps.push(Step::Fused(g)),
                (Some(_), None) => {}
            }
        }
        // Liveness: the last step reading each value.
        let mut last_read: Vec<Option<usize>> = vec![None; program.num_values()];
        for (s, step) in steps.iter().enumerate() {
            let reads: Vec<Value> = match step {
                Step::Instr(i) => program.instrs()[*i].args.clone(),
                Step::Fused(g) => groups[*g].loads.iter().map(|l| l.value).collect(),
            };
            for v in reads {
                last_read[v.index()] = Some(s);
            }
        }
        let mut frees = vec![Vec::new(); steps.len()];
        let results: Vec<Value> = program.results().to_vec();
        for (v, last) in last_read.iter().enumerate() {
            let value = Value(v as u32);
            if let Some(s) = last
                && !results.contains(&value)
            {
                frees[*s].push(value);
            }
        }
        // A run's inputs are part of its demand: their buffers may come back to it.
        let mut pool = Pool::default();
        for p in program.params() {
            let class = (p.spec.dtype, p.spec.shape.num_elements());
            let count = pool.demand.get(&class).copied().unwrap_or(0) + 1;
            pool.demanded(class, count);
        }
        let attention_siblings = attention_siblings(program, &steps);
        let mut exe = Executable {
            attention_siblings,
            losses_in_place: Default::default(),
            receives: program.instrs().iter().any(|i| matches!(i.op, Op::Recv { .. })),
            program: program.clone(),
            steps,
            groups,
            frees,
            options,
            pool: Mutex::new(pool),
            pool_limit: options.pool_bytes,
            profile: options.profile.then(|| Mutex::new(Profile::default())),
        };
        let peak = usize::try_from(exe.peak_bytes()).unwrap_or(usize::MAX);
        exe.pool_limit = options.pool_bytes.max(peak);
        exe
    }

    /// A step's floating-point operations if it is a product (`dot_general`: two per
    /// multiply-add), else 0.
    fn flops(&self, step: &Step) -> f64 {
        let p = &self.program;
        let Step::Instr(i) = step else { return 0.0 };
        let instr = &p.instrs()[*i];
        let Op::DotGeneral { lhs_contract, .. } = &instr.op else { return 0.0 };
        let lhs = p.spec(instr.args[0]).expect("defined");
        let contracted: f64 = lhs_contract.iter().map(|&d| lhs.shape.dims()[d] as f64).product();
        2.0 * instr.spec.shape.dims().iter().map(|&d| d as f64).product::<f64>() * contracted
    }

    /// The kind a step is profiled as: its op and result shape, or a fused group's.
    fn kind(&self, step: &Step) -> String {
        let p = &self.program;
        match step {
            Step::Instr(i) => {
                let instr = &p.instrs()[*i];
                let args: Vec<String> = instr
                    .args
                    .iter()
                    .map(|a| format!("{:?}", p.spec(*a).expect("defined").shape.dims()))
                    .collect();
                format!("{} {} <- {}", instr.op.name(), instr.spec, args.join(" "))
            }
            Step::Fused(g) => {
                let group = &self.groups[*g];
                let ops: Vec<&str> =
                    group.members.iter().map(|&i| p.instrs()[i].op.name()).collect();
                format!(
                    "fused {:?} {} loads {} outs: {}",
                    group.dims,
                    group.loads.len(),
                    group.outputs.len(),
                    ops.join(",")
                )
            }
        }
    }

    /// The program.
    pub fn program(&self) -> &Program {
        &self.program
    }

    /// The options it was compiled with.
    pub fn options(&self) -> Options {
        self.options
    }

    /// Where its runs' time went, by kind of step, the slowest first; `None` unless
    /// compiled with [`Options::profile`].
    pub fn profile(&self) -> Option<Vec<ProfileRow>> {
        let profile = self.profile.as_ref()?.lock().unwrap_or_else(|e| e.into_inner());
        let mut rows: Vec<ProfileRow> = profile
            .by_kind
            .iter()
            .map(|(kind, &(count, seconds, flops))| ProfileRow {
                kind: kind.clone(),
                count,
                seconds,
                flops: flops * count as f64,
            })
            .collect();
        rows.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
        Some(rows)
    }

    /// The fused groups, each as its instructions' values (for inspection and tests).
    pub fn fused_groups(&self) -> Vec<Vec<Value>> {
        let np = self.program.params().len();
        self.groups
            .iter()
            .map(|g| g.members.iter().map(|&i| Value((np + i) as u32)).collect())
            .collect()
    }

    /// The most bytes its values hold at once during a run, by its plan: the inputs
    /// throughout, and what each step writes (an instruction's result, a fused
    /// group's written members) from that step until its last read (results to the
    /// end). What activation checkpointing and gradient accumulation lower.
    pub fn peak_bytes(&self) -> u64 {
        let np = self.program.params().len();
        let bytes = |v: Value| -> u64 {
            let spec = self.program.spec(v).expect("a value of the program");
            spec.byte_size().map_or(u64::MAX, |b| b as u64)
        };
        let mut live: u64 = self
            .program
            .params()
            .iter()
            .map(|p| p.spec.byte_size().map_or(u64::MAX, |b| b as u64))
            .fold(0, u64::saturating_add);
        let mut peak = live;
        for (s, step) in self.steps.iter().enumerate() {
            let written: Vec<Value> = match step {
                Step::Instr(i) => vec![Value((np + i) as u32)],
                Step::Fused(g) => self.groups[*g].outputs.iter().map(|&(_, v, _)| v).collect(),
            };
            live = written.into_iter().map(bytes).fold(live, u64::saturating_add);
            peak = peak.max(live);
            for &v in &self.frees[s] {
                if v.index() >= np {
                    live = live.saturating_sub(bytes(v));
                }
            }
        }
        peak
    }

    /// Runs the program on `inputs` (one per parameter, of its spec).
    pub fn run(&self, inputs: &[Tensor], env: &Env<'_>) -> Result<Vec<Tensor>> {
        reference::check_inputs(&self.program, inputs)?;
        let slots = inputs.iter().map(Slot::borrowed).collect();
        self.on_pool(slots, env)
    }

    /// Executes on a thread of the pool the parallel kernels use when the run may use
    /// several threads: the thread that runs the program's sequential parts is then
    /// one of those that share its parallel ones, instead of a further thread that
    /// competes with them for the cores (and with workers idling between them). A run
    /// given collectives, a host sink, or channels it may wait on (it receives, or its
    /// sends wait) stays on its own thread: it may wait for peers or for the host, and
    /// a pool thread waiting on something queued behind it would never finish.
    fn on_pool(&self, slots: Vec<Slot<'_>>, env: &Env<'_>) -> Result<Vec<Tensor>> {
        let waits_on_channels = env.channels.is_some_and(|c| self.receives || c.sends_wait());
        let alone = env.collectives.is_none() && !waits_on_channels && env.host.is_none();
        if self.options.threads > 1 && alone && rayon::current_thread_index().is_none() {
            return rayon::scope(|_| self.execute(slots, env));
        }
        self.execute(slots, env)
    }

    /// Runs the program on `inputs`, some taken ([`Input::Owned`]: their buffers are
    /// reused once the program no longer reads them) and some only read
    /// ([`Input::Borrowed`]: left as they were, whatever happens — what a caller keeps
    /// across a run that may fail).
    pub fn run_inputs(&self, inputs: Vec<Input<'_>>, env: &Env<'_>) -> Result<Vec<Tensor>> {
        let views: Vec<&Tensor> = inputs
            .iter()
            .map(|t| match t {
                Input::Owned(t) => t,
                Input::Borrowed(t) => *t,
            })
            .collect();
        reference::check_inputs(&self.program, &views)?;
        let slots = inputs
            .into_iter()
            .map(|t| match t {
                Input::Owned(t) => Slot::owned(t),
                Input::Borrowed(t) => Slot::borrowed(t),
            })
            .collect();
        self.on_pool(slots, env)
    }

    /// Runs the program on `inputs`, taking them: their buffers are reused once the
    /// program no longer reads them (JAX's `donate_argnums` for every input).
    pub fn run_owned(&self, inputs: Vec<Tensor>, env: &Env<'_>) -> Result<Vec<Tensor>> {
        reference::check_inputs(&self.program, &inputs)?;
        let slots = inputs.into_iter().map(Slot::owned).collect();
        self.on_pool(slots, env)
    }

    /// A tensor of `spec` from the pool (contents: whatever they were), or a fresh
    /// zeroed one, in standard layout: for filling an input of the next run, which
    /// [`run_owned`](Self::run_owned) gives back to the pool after its last use — so a
    /// loop that feeds a program this way reuses the same memory every step.
    ///
    /// A dtype programs do not compute in is refused; the size is the caller's to
    /// bound (a buffer as large as an input of the program it feeds).
    pub fn buffer(&self, spec: &TensorSpec) -> Result<Tensor> {
        let (dtype, len) = (spec.dtype, spec.shape.num_elements());
        if !supported(dtype) {
            return Err(crate::Error::UnsupportedDType { at: "buffer".into(), dtype });
        }
        let taken = self.pool.lock().unwrap_or_else(|e| e.into_inner()).take(dtype, len);
        let buffer = match taken {
            Some(t) => t,
            None => fresh(dtype, len)?,
        };
        Ok(shaped(buffer, spec.shape.dims()))
    }

    /// Bytes its runs have allocated fresh rather than taken from the pool, so far: a
    /// loop that gives its old state back ([`recycle`](Self::recycle)) stops adding to
    /// it after its first runs (fresh pages cost a page fault each, a tenth of a step
    /// on a VM).
    pub fn fresh_bytes(&self) -> u64 {
        self.pool.lock().unwrap_or_else(|e| e.into_inner()).fresh
    }

    /// Gives tensors (results of earlier runs no longer needed) back to the pool.
    pub fn recycle(&self, tensors: Vec<Tensor>) {
        let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        for t in tensors {
            pool.put(t, self.pool_limit);
        }
    }

    fn execute<'a>(&self, mut slots: Vec<Slot<'a>>, env: &Env<'_>) -> Result<Vec<Tensor>> {
        let p = &self.program;
        let np = p.params().len();
        slots.extend((0..p.instrs().len()).map(|_| Slot::Empty));
        let mut ctx = Ctx { pool: &self.pool, threads: self.options.threads, live: HashMap::new() };
        // Attention gradients computed with an earlier sibling, until their step.
        let mut pending: HashMap<usize, Tensor> = HashMap::new();
        for (s, step) in self.steps.iter().enumerate() {
            let started = self.profile.as_ref().map(|_| Instant::now());
            match step {
                Step::Instr(i) => {
                    let instr = &p.instrs()[*i];
                    let at = format!("%{} ({})", np + i, instr.op.name());
                    let half = |d: DType| matches!(d, DType::BF16 | DType::F16);
                    // (Converts, reshapes and barriers move half precision as it is.)
                    let moves = matches!(
                        instr.op,
                        Op::Convert { .. } | Op::Reshape { .. } | Op::Unary(Unary::Barrier)
                    );
                    let widened = !moves
                        && (half(instr.spec.dtype)
                            || instr.args.iter().any(|a| half(p.spec(*a).expect("defined").dtype)));
                    let out = if let Some(t) = pending.remove(i) {
                        t
                    } else if let (Some(later), Op::AttentionGrad { attention: a, wrt }) =
                        (self.attention_siblings.get(i), &instr.op)
                    {
                        // This gradient and its siblings', from one pass.
                        let dims = |k: usize| p.spec(instr.args[k]).expect("defined").shape.dims();
                        let h = attention::Heads::of(dims(0), dims(1), dims(2), a)
                            .expect("checked when the siblings were found");
                        let wanted: Vec<usize> =
                            std::iter::once(*wrt).chain(later.iter().map(|&(_, w)| w)).collect();
                        let data: Vec<&Tensor> =
                            instr.args.iter().map(|v| slots[v.index()].data()).collect();
                        let mut grads = match instr.spec.dtype {
                            DType::F32 => {
                                let x = [0, 1, 2, 3].map(|k| f32::slice(data[k]));
                                attention::gradients::<f32>(&mut ctx, h, a, x, &wanted)?
                            }
                            _ => {
                                let x = [0, 1, 2, 3].map(|k| f64::slice(data[k]));
                                attention::gradients::<f64>(&mut ctx, h, a, x, &wanted)?
                            }
                        };
                        let rest = grads.split_off(1);
                        for (&(j, _), t) in later.iter().zip(rest) {
                            pending.insert(j, t);
                        }
                        grads.pop().expect("this instruction's gradient")
                    } else if widened {
                        // Half precision: computed in f32, rounded as it is stored.
                        let args = instr
                            .args
                            .iter()
                            .map(|a| {
                                let t = self.tensor_of(a, slots[a.index()].data())?;
                                Ok(widen(t))
                            })
                            .collect::<Result<Vec<_>>>()?;
                        let dtype =
                            if half(instr.spec.dtype) { DType::F32 } else { instr.spec.dtype };
                        let spec = TensorSpec::new(dtype, instr.spec.shape.clone());
                        let out = if instr.op.communicates() {
                            communicate(env, &instr.op, args, &spec, &at)?
                        } else {
                            let views: Vec<(&[usize], &Tensor)> =
                                args.iter().map(|t| (t.shape(), t)).collect();
                            exec(&instr.op, &views, &spec, &at, &mut ctx)?
                        };
                        narrow(out.into_standard_layout(), instr.spec.dtype)
                    } else if instr.op.communicates() {
                        let args = instr
                            .args
                            .iter()
                            .map(|a| self.tensor_of(a, slots[a.index()].data()))
                            .collect::<Result<Vec<_>>>()?;
                        communicate(env, &instr.op, args, &instr.spec, &at)?.into_standard_layout()
                    } else if let Op::ScatterAdd { axis } = instr.op
                        && matches!(instr.spec.dtype, DType::F32 | DType::F64)
                        && self.frees[s].contains(&instr.args[0])
                        && !instr.args[1..].contains(&instr.args[0])
                        && matches!(slots[instr.args[0].index()], Slot::Owned(_))
                    {
                        // A scatter into a dying buffer (an embedding's zero gradient)
                        // adds in place instead of copying it.
                        let Slot::Owned(mut d) =
                            std::mem::replace(&mut slots[instr.args[0].index()], Slot::Empty)
                        else {
                            unreachable!("checked owned")
                        };
                        let xd = p.spec(instr.args[0]).expect("defined").shape.dims();
                        let (idx, upd) = (
                            slots[instr.args[1].index()].data(),
                            slots[instr.args[2].index()].data(),
                        );
                        let scattered = match instr.spec.dtype {
                            DType::F32 => kernels::scatter_add_into::<f32>(
                                f32::slice_mut(&mut d),
                                xd,
                                idx,
                                f32::slice(upd),
                                axis,
                                &at,
                            ),
                            _ => kernels::scatter_add_into::<f64>(
                                f64::slice_mut(&mut d),
                                xd,
                                idx,
                                f64::slice(upd),
                                axis,
                                &at,
                            ),
                        };
                        scattered?;
                        d
                    } else if matches!(instr.op, Op::CrossEntropyGrad)
                        && matches!(instr.spec.dtype, DType::F32 | DType::F64)
                        && self.frees[s].contains(&instr.args[0])
                        && !instr.args[1..].contains(&instr.args[0])
                        && matches!(slots[instr.args[0].index()], Slot::Owned(_))
                        && slots[instr.args[0].index()].data().dtype() == instr.spec.dtype
                        && slots[instr.args[2].index()].data().dtype() == instr.spec.dtype
                        && matches!(
                            slots[instr.args[1].index()].data().dtype(),
                            DType::I32 | DType::I64
                        )
                    {
                        // The gradient of dying logits (a loss's, read by nothing
                        // after it) is written over them.
                        let Slot::Owned(mut d) =
                            std::mem::replace(&mut slots[instr.args[0].index()], Slot::Empty)
                        else {
                            unreachable!("checked owned")
                        };
                        let classes = instr.spec.shape.dims().last().copied().unwrap_or(0);
                        let labels = kernels::indices(slots[instr.args[1].index()].data());
                        let g = slots[instr.args[2].index()].data();
                        let threads = self.options.threads;
                        self.losses_in_place.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        match instr.spec.dtype {
                            DType::F32 => loss::cross_entropy_grad_in_place::<f32>(
                                threads,
                                f32::slice_mut(&mut d),
                                &labels,
                                f32::slice(g),
                                classes,
                            ),
                            _ => loss::cross_entropy_grad_in_place::<f64>(
                                threads,
                                f64::slice_mut(&mut d),
                                &labels,
                                f64::slice(g),
                                classes,
                            ),
                        }
                        d
                    } else if matches!(instr.op, Op::Reshape { .. })
                        && self.frees[s].contains(&instr.args[0])
                        && matches!(slots[instr.args[0].index()], Slot::Owned(_))
                    {
                        // A reshape of a dying buffer takes it.
                        match std::mem::replace(&mut slots[instr.args[0].index()], Slot::Empty) {
                            Slot::Owned(d) => d,
                            _ => unreachable!("checked owned"),
                        }
                    } else {
                        let args: Vec<(&[usize], &Tensor)> = instr
                            .args
                            .iter()
                            .map(|a| {
                                let dims = p.spec(*a).expect("a defined value").shape.dims();
                                (dims, slots[a.index()].data())
                            })
                            .collect();
                        exec(&instr.op, &args, &instr.spec, &at, &mut ctx)?
                    };
                    slots[np + i] = Slot::Owned(out);
                }
                Step::Fused(g) => {
                    let group = &self.groups[*g];
                    let inputs: Vec<&Tensor> =
                        group.loads.iter().map(|l| slots[l.value.index()].data()).collect();
                    let mut alloc = |dtype: DType, len: usize| ctx.alloc(dtype, len);
                    let outs = match group.dtype {
                        DType::F32 => fused::run::<f32>(group, &inputs, &self.options, &mut alloc),
                        _ => fused::run::<f64>(group, &inputs, &self.options, &mut alloc),
                    }?;
                    for (d, &(_, v, _)) in outs.into_iter().zip(&group.outputs) {
                        slots[v.index()] = Slot::Owned(d);
                    }
                }
            }
            if let (Some(profile), Some(started)) = (&self.profile, started) {
                let secs = started.elapsed().as_secs_f64();
                let kind = self.kind(step);
                let flops = self.flops(step);
                let mut profile = profile.lock().unwrap_or_else(|e| e.into_inner());
                let entry = profile.by_kind.entry(kind).or_insert((0, 0.0, flops));
                entry.0 += 1;
                entry.1 += secs;
            }
            if !self.frees[s].is_empty() {
                let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
                for v in &self.frees[s] {
                    if let Slot::Owned(d) = std::mem::replace(&mut slots[v.index()], Slot::Empty) {
                        let class = (d.dtype(), d.len());
                        if pool.put(d, self.pool_limit)
                            && let Some(live) = ctx.live.get_mut(&class)
                        {
                            *live = live.saturating_sub(1);
                        }
                    }
                }
            }
        }
        let results = p.results();
        let mut out = Vec::with_capacity(results.len());
        for (k, r) in results.iter().enumerate() {
            let last = !results[k + 1..].contains(r);
            let data = if last {
                match std::mem::replace(&mut slots[r.index()], Slot::Empty) {
                    Slot::Owned(d) => d,
                    Slot::Borrowed(d) => d.clone(),
                    Slot::Empty => unreachable!("a result is never freed"),
                }
            } else {
                slots[r.index()].data().clone()
            };
            let spec = p.spec(*r).expect("a defined value");
            out.push(shaped(data, spec.shape.dims()));
        }
        reference::check_outputs(p, &out, "the fast interpreter")?;
        Ok(out)
    }

    fn tensor_of(&self, v: &Value, d: &Tensor) -> Result<Tensor> {
        let spec = self.program.spec(*v).expect("a defined value");
        Ok(shaped(d.clone(), spec.shape.dims()))
    }
}

/// `program` with its optimization barriers read through: each instruction that reads
/// a barrier's value reads the barrier's operand instead, and the barriers nothing
/// reads any more (all but results) are dropped. The interpreter runs instructions in
/// program order and never merges recomputed work with the forward pass's, so here a
/// barrier (`grad_remat`'s fence against a compiler's CSE) would only copy its operand.
fn without_barriers(program: &Program) -> Program {
    let barrier = |i: &crate::program::Instr| matches!(i.op, Op::Unary(Unary::Barrier));
    if !program.instrs().iter().any(barrier) {
        return program.clone();
    }
    let np = program.params().len();
    let mut read_as: Vec<Value> = (0..program.num_values()).map(|v| Value(v as u32)).collect();
    let mut out = program.clone();
    for (i, instr) in out.instrs.iter_mut().enumerate() {
        instr.args.iter_mut().for_each(|a| *a = read_as[a.index()]);
        instr.colocate.iter_mut().for_each(|c| *c = read_as[c.index()]);
        if barrier(instr) {
            read_as[np + i] = instr.args[0];
        }
    }
    out.without_dead_code()
}

/// Integer and bool values of at most this many bytes that depend on no parameter
/// are computed once, when a program is compiled.
const FOLD_BYTES: usize = 4 << 20;

/// `program` with its integer and bool instructions computed from integers and bools
/// alone, depending on no parameter (an attention mask's iotas and comparison, say:
/// every layer's, every run), computed once by the reference and held as literals,
/// when they hold at most [`FOLD_BYTES`]; and, by instruction, whether nothing reads
/// it any more (an operand of folded instructions only), so it need not run. Floats
/// are not folded: the fast interpreter computes them natively, the reference in f64.
fn fold_constants(program: &Program) -> (Program, Vec<bool>) {
    let np = program.params().len();
    let mut known: Vec<Option<Tensor>> = vec![None; program.num_values()];
    let mut folded = program.clone();
    let mut changed = vec![false; program.instrs().len()];
    for (i, instr) in program.instrs().iter().enumerate() {
        let pure = matches!(
            instr.op,
            Op::Iota { .. }
                | Op::Constant { .. }
                | Op::Literal { .. }
                | Op::Compare(_)
                | Op::Binary(_)
                | Op::Unary(_)
                | Op::Select
                | Op::Convert { .. }
                | Op::BroadcastTo { .. }
                | Op::Reshape { .. }
                | Op::Transpose { .. }
                | Op::Slice { .. }
        );
        // Only integers and bools computed from integers and bools: exact in either
        // interpreter, and never members of a fused group (which computes floats), so
        // an instruction left unread here is never one a group needs.
        let exact = instr.spec.dtype.is_integer() || instr.spec.dtype == DType::Bool;
        let small = instr.spec.byte_size().is_ok_and(|b| b <= FOLD_BYTES);
        if !pure || !exact || !small || !instr.args.iter().all(|a| known[a.index()].is_some()) {
            continue;
        }
        let args: Vec<(&[usize], &Tensor)> = instr
            .args
            .iter()
            .map(|a| {
                let dims = program.spec(*a).expect("a defined value").shape.dims();
                (dims, known[a.index()].as_ref().expect("known"))
            })
            .collect();
        let Ok(value) = reference::eval_op(&instr.op, &args, &instr.spec, "folding") else {
            continue;
        };
        // Scalars and literals cost nothing to run: only what computes is replaced.
        if !matches!(instr.op, Op::Constant { .. } | Op::Literal { .. }) {
            folded.instrs[i].op = Op::Literal { value: std::sync::Arc::new(value.clone()) };
            folded.instrs[i].args.clear();
            changed[i] = true;
        }
        known[np + i] = Some(value);
    }
    // What still reads each value: the kept instructions and the results.
    let mut read = vec![false; program.num_values()];
    for r in folded.results() {
        read[r.index()] = true;
    }
    let mut skip = vec![false; program.instrs().len()];
    for (i, instr) in folded.instrs().iter().enumerate().rev() {
        // Computable here and read by nothing that runs: an operand of folded
        // instructions only (or dead).
        if known[np + i].is_some() && !read[np + i] {
            skip[i] = true;
            continue;
        }
        for a in &instr.args {
            read[a.index()] = true;
        }
    }
    (folded, skip)
}

/// `t` in f32 when it is half precision (exactly), else itself.
fn widen(t: Tensor) -> Tensor {
    match t {
        Tensor::BF16(a) => Tensor::F32(a.mapv(f32::from)),
        Tensor::F16(a) => Tensor::F32(a.mapv(f32::from)),
        other => other,
    }
}

/// `t` (f32) rounded to `dtype` when that is half precision (round to nearest even),
/// else itself.
fn narrow(t: Tensor, dtype: DType) -> Tensor {
    match (t, dtype) {
        (Tensor::F32(a), DType::BF16) => Tensor::BF16(a.mapv(meshwork_types::bf16::from_f32)),
        (Tensor::F32(a), DType::F16) => Tensor::F16(a.mapv(meshwork_types::f16::from_f32)),
        (other, _) => other,
    }
}

/// Runs `program` once with the fast interpreter (compiled with default options, no
/// communication).
pub fn evaluate(program: &Program, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
    Executable::compile(program, Options::default()).run(inputs, &Env::local())
}

/// The `attention_grad`s among `steps` that the fused kernel computes together: for
/// each set of two or more of one attention spec and operands (f32 or f64, of shapes
/// the kernel takes), its first instruction → the others with their `wrt`.
fn attention_siblings(program: &Program, steps: &[Step]) -> HashMap<usize, Vec<(usize, usize)>> {
    // (first instruction, its `wrt`, the later ones with theirs).
    type Set = (usize, usize, Vec<(usize, usize)>);
    let mut sets: Vec<Set> = Vec::new();
    for step in steps {
        let Step::Instr(i) = *step else { continue };
        let instr = &program.instrs()[i];
        let Op::AttentionGrad { attention: a, wrt } = &instr.op else { continue };
        let dims = |k: usize| program.spec(instr.args[k]).expect("defined").shape.dims().to_vec();
        let float = matches!(instr.spec.dtype, DType::F32 | DType::F64)
            && instr
                .args
                .iter()
                .all(|v| program.spec(*v).expect("defined").dtype == instr.spec.dtype);
        if !float || attention::Heads::of(&dims(0), &dims(1), &dims(2), a).is_none() {
            continue;
        }
        let same = |j: usize| {
            let other = &program.instrs()[j];
            other.args == instr.args
                && matches!(&other.op, Op::AttentionGrad { attention: b, .. } if b == a)
        };
        match sets.iter_mut().find(|(first, _, _)| same(*first)) {
            // A second gradient of an operand already asked for runs on its own.
            Some((_, w, later)) if *w != *wrt && later.iter().all(|(_, x)| x != wrt) => {
                later.push((i, *wrt))
            }
            Some(_) => {}
            None => sets.push((i, *wrt, Vec::new())),
        }
    }
    sets.into_iter()
        .filter(|(_, _, later)| !later.is_empty())
        .map(|(first, _, later)| (first, later))
        .collect()
}

/// A composite op (attention, its gradients) by its definition, run by this
/// interpreter. Its operands are of the result's dtype (half precision is held
/// widened here).
fn composite(op: &Op, args: &[(&[usize], &Tensor)], spec: &TensorSpec) -> Result<Tensor> {
    let inputs: Vec<Tensor> =
        args.iter().map(|(d, t)| narrow(shaped((*t).clone(), d), spec.dtype)).collect();
    let specs: Vec<TensorSpec> = inputs.iter().map(Tensor::spec).collect();
    let definition =
        crate::composite::definition(op, &specs).expect("a composite op has a definition")?;
    let out = evaluate(&definition, &inputs)?;
    Ok(widen(out.into_iter().next().expect("a definition returns one value")))
}

/// One instruction by its kernel (or by the reference's loops where the fast
/// interpreter has none: integer arithmetic, `argmax`, `pad`, `iota`, conversions).
fn exec(
    op: &Op,
    args: &[(&[usize], &Tensor)],
    spec: &TensorSpec,
    at: &str,
    a: &mut Ctx<'_>,
) -> Result<Tensor> {
    let dims = spec.shape.dims();
    let float = spec.dtype.is_float();
    macro_rules! float_kernel {
        ($t:ident, $body:expr) => {
            match spec.dtype {
                DType::F32 => {
                    type $t = f32;
                    $body
                }
                _ => {
                    type $t = f64;
                    $body
                }
            }
        };
    }
    Ok(match op {
        Op::Constant { .. } => reference::eval_op(op, args, spec, at)?,
        Op::Literal { value } => widen(value.as_ref().clone()),
        // The interpreter reorders nothing: a barrier is its operand.
        Op::Reshape { .. } | Op::Unary(Unary::Barrier) => args[0].1.clone(),
        Op::Convert { dtype } => match kernels::convert(a, args[0].1, *dtype)? {
            Some(t) => t,
            None => reference::eval_op(op, args, spec, at)?,
        },
        Op::Transpose { perm } => {
            let xs = kernels::strides(args[0].0);
            let st: Vec<usize> = perm.iter().map(|&p| xs[p]).collect();
            kernels::view(a, args[0].1, 0, &st, dims)?
        }
        Op::BroadcastTo { .. } => {
            let st = fused::broadcast_strides(args[0].0, dims);
            kernels::view(a, args[0].1, 0, &st, dims)?
        }
        Op::Slice { start, step, .. } => {
            let xs = kernels::strides(args[0].0);
            let offset = start.iter().zip(&xs).map(|(s, x)| s * x).sum();
            let st: Vec<usize> = step.iter().zip(&xs).map(|(s, x)| s * x).collect();
            kernels::view(a, args[0].1, offset, &st, dims)?
        }
        Op::Concat { axis } => kernels::concat(a, args, *axis, dims)?,
        Op::Pad { low, interior, .. } => {
            kernels::pad(a, (args[0].0, args[0].1), low, interior, dims)?
        }
        Op::Take { axis } => kernels::take(a, (args[0].0, args[0].1), args[1].1, *axis, at)?,
        Op::DotGeneral { lhs_contract, rhs_contract, lhs_batch, rhs_batch } if float => {
            float_kernel!(T, {
                kernels::dot_general::<T>(
                    a,
                    (args[0].0, T::slice(args[0].1)),
                    (args[1].0, T::slice(args[1].1)),
                    lhs_contract,
                    rhs_contract,
                    lhs_batch,
                    rhs_batch,
                )?
            })
        }
        Op::Reduce { kind, axes, .. } if float => {
            float_kernel!(T, kernels::reduce::<T>(a, T::slice(args[0].1), args[0].0, axes, *kind)?)
        }
        Op::Softmax { axis } | Op::LogSoftmax { axis } => {
            let log = matches!(op, Op::LogSoftmax { .. });
            float_kernel!(T, kernels::softmax::<T>(a, T::slice(args[0].1), args[0].0, *axis, log)?)
        }
        Op::OneHot { depth, .. } => float_kernel!(T, kernels::one_hot::<T>(a, args[0].1, *depth)?),
        Op::ScatterAdd { axis } if float => float_kernel!(T, {
            kernels::scatter_add::<T>(
                a,
                (args[0].0, T::slice(args[0].1)),
                args[1].1,
                T::slice(args[2].1),
                *axis,
                at,
            )?
        }),
        Op::Conv2d { strides, padding } => {
            let conv = Conv {
                x: rank4(args[0].0),
                w: rank4(args[1].0),
                out: rank4(dims),
                strides: *strides,
                padding: *padding,
            };
            float_kernel!(T, conv.forward::<T>(a, T::slice(args[0].1), T::slice(args[1].1), at)?)
        }
        Op::Conv2dBackpropInput { strides, padding, input } => {
            let conv = Conv {
                x: *input,
                w: rank4(args[1].0),
                out: rank4(args[0].0),
                strides: *strides,
                padding: *padding,
            };
            float_kernel!(T, {
                conv.backprop_input::<T>(a, T::slice(args[0].1), T::slice(args[1].1), at)?
            })
        }
        Op::Conv2dBackpropFilter { strides, padding, filter } => {
            let conv = Conv {
                x: rank4(args[0].0),
                w: *filter,
                out: rank4(args[1].0),
                strides: *strides,
                padding: *padding,
            };
            float_kernel!(T, {
                conv.backprop_filter::<T>(a, T::slice(args[0].1), T::slice(args[1].1), at)?
            })
        }
        Op::Attention(spec_a)
            if matches!(spec.dtype, DType::F32 | DType::F64)
                && args.iter().all(|(_, t)| t.dtype() == spec.dtype) =>
        {
            match attention::Heads::of(args[0].0, args[1].0, args[2].0, spec_a) {
                Some(h) => float_kernel!(T, {
                    let [q, k, v] = [0, 1, 2].map(|i| T::slice(args[i].1));
                    attention::attention::<T>(a, h, spec_a, [q, k, v])?
                }),
                None => composite(op, args, spec)?,
            }
        }
        Op::AttentionGrad { attention: spec_a, wrt }
            if matches!(spec.dtype, DType::F32 | DType::F64)
                && args.iter().all(|(_, t)| t.dtype() == spec.dtype) =>
        {
            match attention::Heads::of(args[0].0, args[1].0, args[2].0, spec_a) {
                Some(h) => float_kernel!(T, {
                    let [q, k, v, dout] = [0, 1, 2, 3].map(|i| T::slice(args[i].1));
                    let mut grads =
                        attention::gradients::<T>(a, h, spec_a, [q, k, v, dout], &[*wrt])?;
                    grads.pop().expect("the gradient asked for")
                }),
                None => composite(op, args, spec)?,
            }
        }
        Op::Attention(_) | Op::AttentionGrad { .. } => composite(op, args, spec)?,
        Op::CrossEntropy | Op::CrossEntropyGrad
            if matches!(spec.dtype, DType::F32 | DType::F64)
                && args[0].1.dtype() == spec.dtype
                && args.get(2).is_none_or(|(_, g)| g.dtype() == spec.dtype)
                && matches!(args[1].1.dtype(), DType::I32 | DType::I64) =>
        {
            let classes = args[0].0.last().copied().unwrap_or(0);
            let labels = kernels::indices(args[1].1);
            float_kernel!(T, {
                let logits = T::slice(args[0].1);
                match args.get(2) {
                    None => loss::cross_entropy::<T>(a, logits, &labels, classes)?,
                    Some((_, g)) => {
                        loss::cross_entropy_grad::<T>(a, logits, &labels, T::slice(g), classes)?
                    }
                }
            })
        }
        Op::CrossEntropy | Op::CrossEntropyGrad => composite(op, args, spec)?,
        Op::ThreefryUniform => {
            match kernels::threefry_uniform(a, args[0].1, args[1].1, args[2].1)? {
                Some(t) => t,
                None => reference::eval_op(op, args, spec, at)?,
            }
        }
        _ => reference::eval_op(op, args, spec, at)?,
    })
}

fn rank4(d: &[usize]) -> [usize; 4] {
    d.try_into().expect("inference checked rank 4")
}
