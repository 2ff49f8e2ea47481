//! The MPI test (`cargo xtask mpi-test`): run under `mpirun -np 2`, each process with
//! 2 devices. Every collective over the 4 replicas must give what one process with 4
//! devices gives (each process computes that reference itself), and a replica failing
//! in one process must end the run in both with an error naming it. The program runs
//! again with MPI messages of at most 5 elements (the same bits), with message caps
//! that differ between the processes (both fail at the agreement), and with 1 device
//! per process over groups in reverse order (the paths that receive straight into the
//! result); then the job's key-value store carries each process's values to the
//! other. Exits non-zero, naming the first difference, otherwise.
//!
//! With an argument it checks that a dying process cannot hang the job instead:
//! `panic` — process 1 panics outside any replica while process 0 waits in a
//! collective, and the panic hook must abort the job; `absent` — process 1 never runs
//! the program, and process 0's handshake must abort the job after its timeout. Both
//! must end the job (non-zero) within seconds; `cargo xtask mpi-test` times them.
//!
//! ```text
//! mpirun -np 2 target/debug/examples/mpi_check [panic|absent]
//! ```

#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::process::ExitCode;
use std::sync::Arc;

use meshwork_executor::mpi::Mpi;
use meshwork_executor::{Error, ReplicaFn, Runtime, Tensor};
use meshwork_types::ReduceOp;
use ndarray::{ArrayD, IxDyn};

const DEVICES: usize = 2;
const PROCESSES: usize = 2;

fn main() -> ExitCode {
    let result = match std::env::args().nth(1).as_deref() {
        None => check(),
        Some(mode @ ("panic" | "absent")) => die(mode),
        Some(other) => Err(format!("unknown mode {other}; want panic or absent")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("mpi_check: {message}");
            ExitCode::FAILURE
        }
    }
}

/// A float with a full random mantissa, a random sign and an exponent in 2^-8..2^8
/// (SplitMix64 of `seed`), so sums round and their order shows in the bits.
fn random_float(seed: u64) -> f64 {
    let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    let mantissa = 1.0 + (z >> 11) as f64 / (1u64 << 53) as f64;
    let exponent = (z % 17) as i32 - 8;
    let sign = if z & (1 << 10) == 0 { 1.0 } else { -1.0 };
    sign * mantissa * 2f64.powi(exponent)
}

/// Replica `r`'s input: f32, f64, i32 and i64 tensors of shape [4, 3]; the floats
/// random (see [`random_float`]), the integers small.
fn input(r: usize) -> Vec<Tensor> {
    let n = 4 * 3;
    let v = |k: usize| ((r * 31 + k * 17) % 23) as i64 - 11;
    let x = |k: usize| random_float((r * 1000 + k) as u64);
    let s = IxDyn(&[4, 3]);
    vec![
        Tensor::F32(
            ArrayD::from_shape_vec(s.clone(), (0..n).map(|k| x(k) as f32).collect()).unwrap(),
        ),
        Tensor::F64(ArrayD::from_shape_vec(s.clone(), (0..n).map(x).collect()).unwrap()),
        Tensor::I32(
            ArrayD::from_shape_vec(s.clone(), (0..n).map(|k| v(k) as i32).collect()).unwrap(),
        ),
        Tensor::I64(ArrayD::from_shape_vec(s, (0..n).map(v).collect()).unwrap()),
    ]
}

/// The documented order of a sum or mean over all replicas across processes: each
/// process folds its own replicas in rank order, then the processes' folds are added
/// in process order (and a mean divides that by the replica count).
fn documented_all_reduce(inputs: &[Tensor], op: ReduceOp) -> Tensor {
    fn go<T>(xs: Vec<&ArrayD<T>>, mean: bool) -> ArrayD<T>
    where
        T: Clone + std::ops::Add<Output = T> + std::ops::Div<Output = T> + From<u8>,
    {
        let n = xs.len();
        let local = |q: usize| {
            (1..DEVICES).fold(xs[q * DEVICES].clone(), |acc, k| acc + xs[q * DEVICES + k])
        };
        let total = (1..PROCESSES).fold(local(0), |acc, q| acc + local(q));
        if mean { total.mapv(|v| v / T::from(n as u8)) } else { total }
    }
    let mean = op == ReduceOp::Mean;
    match &inputs[0] {
        Tensor::F32(_) => Tensor::F32(go(
            inputs
                .iter()
                .map(|t| if let Tensor::F32(a) = t { a } else { unreachable!() })
                .collect(),
            mean,
        )),
        Tensor::F64(_) => Tensor::F64(go(
            inputs
                .iter()
                .map(|t| if let Tensor::F64(a) = t { a } else { unreachable!() })
                .collect(),
            mean,
        )),
        _ => unreachable!("floats only"),
    }
}

/// Every collective on every input; the outputs in a fixed order. A float sum or mean
/// over all replicas, and the sum reduce-scatter, follow [`documented_all_reduce`]'s order (not one process's plain
/// rank order, so the check compares it with that model); every other output equals
/// what one process computes, bit for bit.
fn program() -> Arc<ReplicaFn> {
    Arc::new(|ctx, inputs| {
        let n = ctx.num_replicas();
        let halves = ctx.groups(vec![vec![0, 2], vec![1, 3]])?;
        let mut out = Vec::new();
        for x in inputs {
            for op in ReduceOp::ALL {
                out.push(ctx.all_reduce(op, x.clone())?);
                out.push(ctx.all_reduce_in(&halves, op, x.clone())?);
            }
            out.push(ctx.all_gather(0, x.clone())?);
            out.push(ctx.all_gather(1, x.clone())?);
            out.push(ctx.all_gather_in(&halves, 1, x.clone())?);
            out.push(ctx.reduce_scatter(ReduceOp::Sum, 0, x.clone())?);
            out.push(ctx.all_to_all(0, 1, x.clone())?);
            out.push(ctx.broadcast(n - 1, x.clone())?);
            out.push(ctx.collective_permute(&[(0, 3), (3, 1), (1, 0)], x.clone())?);
            ctx.barrier()?;
        }
        Ok(out)
    })
}

/// Process 1 dies (`panic`) or stays away (`absent`) while process 0 waits for it
/// in a collective; returning at all is a failure of the check.
fn die(mode: &str) -> Result<(), String> {
    let mpi = Mpi::init(Some(PROCESSES)).map_err(|e| e.to_string())?;
    let runtime = Runtime::new(DEVICES)
        .map_err(|e| e.to_string())?
        .with_timeout(std::time::Duration::from_millis(500))
        .with_interconnect(mpi.interconnect());
    if mpi.process() == 1 {
        if mode == "panic" {
            panic!("process 1 dies outside any replica");
        }
        std::thread::sleep(std::time::Duration::from_secs(60));
        return Err("process 1 slept for a minute and the job was not ended".into());
    }
    let inputs = (0..DEVICES).map(input).collect();
    let result = runtime.run(program(), inputs);
    Err(format!("process 0's run returned {result:?} instead of the job being ended"))
}

/// A tensor's values as bit patterns (floats by their bits, so `-0.0` differs from
/// `0.0` and the comparison is bit for bit).
fn bits(t: &Tensor) -> Vec<u64> {
    match t {
        Tensor::F32(a) => a.iter().map(|x| u64::from(x.to_bits())).collect(),
        Tensor::F64(a) => a.iter().map(|x| x.to_bits()).collect(),
        Tensor::I32(a) => a.iter().map(|&x| x as u64).collect(),
        Tensor::I64(a) => a.iter().map(|&x| x as u64).collect(),
        other => vec![u64::MAX; other.len()],
    }
}

fn check() -> Result<(), String> {
    let mpi = Mpi::init(Some(PROCESSES)).map_err(|e| e.to_string())?;
    let (p, e) = (mpi.process(), |e: Error| e.to_string());
    let runtime = Runtime::new(DEVICES).map_err(e)?.with_interconnect(mpi.interconnect());
    let first = runtime.first_replica();
    let inputs = (first..first + DEVICES).map(input).collect();
    let got = runtime.run(program(), inputs).map_err(e)?;

    let reference = Runtime::new(PROCESSES * DEVICES).map_err(e)?;
    let mut want =
        reference.run(program(), (0..PROCESSES * DEVICES).map(input).collect()).map_err(e)?;
    // Outputs 0, 2 (sum, mean over all replicas) and 11 (sum reduce-scatter) of the f32
    // and f64 inputs (0 and 1): the documented cross-process order instead of one
    // process's rank order.
    let per_input = want[0].len() / 4;
    let mut reordered = 0;
    for x in 0..2 {
        let all: Vec<Tensor> = (0..PROCESSES * DEVICES).map(|r| input(r)[x].clone()).collect();
        for (k, op) in [(0, ReduceOp::Sum), (2, ReduceOp::Mean)] {
            let model = documented_all_reduce(&all, op);
            for w in want.iter_mut() {
                if w[x * per_input + k] != model {
                    reordered += 1;
                }
                w[x * per_input + k] = model.clone();
            }
        }
        // Output 11, the sum reduce-scatter along axis 0: replica r's row of the
        // documented all-reduce (its order across processes is the all-reduce's).
        let model = documented_all_reduce(&all, ReduceOp::Sum);
        for (r, w) in want.iter_mut().enumerate() {
            let row = match &model {
                Tensor::F32(a) => {
                    Tensor::F32(a.slice_axis(ndarray::Axis(0), (r..r + 1).into()).to_owned())
                }
                Tensor::F64(a) => {
                    Tensor::F64(a.slice_axis(ndarray::Axis(0), (r..r + 1).into()).to_owned())
                }
                _ => unreachable!("floats only"),
            };
            if w[x * per_input + 11] != row {
                reordered += 1;
            }
            w[x * per_input + 11] = row;
        }
    }
    if reordered == 0 {
        return Err(
            "the random floats sum alike in every order: the check cannot tell orders apart".into(),
        );
    }
    for (k, outputs) in got.iter().enumerate() {
        let r = first + k;
        for (i, (g, w)) in outputs.iter().zip(&want[r]).enumerate() {
            if bits(g) != bits(w) {
                return Err(format!("replica {r}, output {i}: got {g:?}, one process gives {w:?}"));
            }
        }
        if outputs.len() != want[r].len() {
            return Err(format!("replica {r}: {} outputs, want {}", outputs.len(), want[r].len()));
        }
    }
    println!(
        "process {p}: {} outputs of replicas {first}..{} equal 4 local devices",
        got.len() * got[0].len(),
        first + DEVICES
    );

    // Replica 3 (in process 1) fails after one collective: both processes must end
    // the run with an error naming it, and the runtime must stay usable.
    let failing: Arc<ReplicaFn> = Arc::new(|ctx, i| {
        let x = ctx.all_reduce(ReduceOp::Sum, i[0].clone())?;
        if ctx.replica_id() == 3 {
            return Err("replica 3 gives up".into());
        }
        Ok(vec![ctx.all_gather(0, x)?])
    });
    let inputs = (first..first + DEVICES).map(input).collect();
    match runtime.run(failing, inputs) {
        Err(Error::ReplicaFailed { replica: 3, .. }) | Err(Error::PeerFailed { failed: 3, .. }) => {
        }
        other => return Err(format!("process {p}: a failing replica 3 gave {other:?}")),
    }
    let inputs = (first..first + DEVICES).map(input).collect();
    let again = runtime.run(program(), inputs).map_err(e)?;
    if again != got {
        return Err(format!("process {p}: a run after a failed one differs"));
    }
    println!(
        "process {p}: a failure in process 1 ended the run in process {p} with an error naming replica 3"
    );

    // Messages of at most 5 elements: every exchange of more goes in several, in order,
    // and the results must not change.
    mpi.set_max_message(5);
    let inputs = (first..first + DEVICES).map(input).collect();
    let split = runtime.run(program(), inputs).map_err(e)?;
    let same = |a: &[Vec<Tensor>]| a.iter().flatten().map(bits).collect::<Vec<_>>();
    if same(&split) != same(&got) {
        return Err(format!("process {p}: messages of at most 5 elements change the results"));
    }
    println!("process {p}: messages of at most 5 elements give the same bits");

    // Caps that differ between the processes: every process fails at the first
    // collective's agreement, naming the settings, and the next run (caps alike again)
    // works.
    mpi.set_max_message(5 + p);
    let inputs = (first..first + DEVICES).map(input).collect();
    match runtime.run(program(), inputs) {
        Err(Error::Mismatch { expected, actual, .. })
            if expected.contains("message cap") && actual.contains("message cap") => {}
        other => return Err(format!("process {p}: caps 5 and 6 gave {other:?}")),
    }
    mpi.set_max_message(Mpi::DEFAULT_MAX_MESSAGE);
    let inputs = (first..first + DEVICES).map(input).collect();
    let after = runtime.run(program(), inputs).map_err(e)?;
    if same(&after) != same(&got) {
        return Err(format!("process {p}: a run after a mismatch of caps differs"));
    }
    println!("process {p}: caps that differ between processes fail alike, then runs go on");
    one_device_per_process(&mpi)?;
    key_value_store(&mpi)
}

/// The job's key-value store: each process puts a small value and a 4 MB one at once
/// (too large for MPI's eager sends: blocking sends would wait on each other) and
/// reads the other's; a key no process put is `None` to `try_get`, and to `get` once
/// its timeout has passed.
fn key_value_store(mpi: &Mpi) -> Result<(), String> {
    let (p, store) = (mpi.process(), mpi.key_value_store());
    let big = |q: usize| (0..4 << 20).map(|i| (i * 7 + q) as u8).collect::<Vec<u8>>();
    store.put(format!("small/{p}").as_bytes(), format!("from {p}").as_bytes())?;
    store.put(format!("big/{p}").as_bytes(), &big(p))?;
    let q = 1 - p;
    let timeout = Some(std::time::Duration::from_secs(30));
    let small = store.get(format!("small/{q}").as_bytes(), timeout)?;
    if small.as_deref() != Some(format!("from {q}").as_bytes()) {
        return Err(format!("process {p}: small/{q} is {small:?}"));
    }
    // Without a limit: it has come by now, or comes.
    if store.get(format!("big/{q}").as_bytes(), None)? != Some(big(q)) {
        return Err(format!("process {p}: big/{q} arrived changed"));
    }
    let own = store.get(format!("small/{p}").as_bytes(), timeout)?;
    if own.as_deref() != Some(format!("from {p}").as_bytes()) {
        return Err(format!("process {p}: its own small/{p} is not kept"));
    }
    if store.try_get(b"absent")?.is_some() {
        return Err(format!("process {p}: a value under a key no process put"));
    }
    let start = std::time::Instant::now();
    match store.get(b"absent", Some(std::time::Duration::from_millis(50))) {
        Ok(None) if start.elapsed() >= std::time::Duration::from_millis(50) => {}
        other => return Err(format!("process {p}: get of an absent key gave {other:?}")),
    }
    println!("process {p}: the key-value store carries both processes' values, 4 MB ones at once");
    Ok(())
}

/// With one device per process, grouped collectives over the replicas in reverse order
/// (`[[1, 0]]`: not "all replicas", so the grouped paths, and for an all-gather or
/// all-to-all along axis 0 the one that receives straight into the result) must give
/// what one process with 2 devices gives, bit for bit, with whole messages and with
/// messages of at most 5 elements.
fn one_device_per_process(mpi: &Mpi) -> Result<(), String> {
    let (p, e) = (mpi.process(), |e: Error| e.to_string());
    let program: Arc<ReplicaFn> = Arc::new(|ctx, inputs| {
        let reversed = ctx.groups(vec![vec![1, 0]])?;
        let mut out = Vec::new();
        for x in inputs {
            out.push(ctx.all_gather_in(&reversed, 0, x.clone())?);
            out.push(ctx.all_gather_in(&reversed, 1, x.clone())?);
            out.push(ctx.all_to_all_in(&reversed, 0, 0, x.clone())?);
            out.push(ctx.all_to_all_in(&reversed, 0, 1, x.clone())?);
            out.push(ctx.reduce_scatter_in(&reversed, ReduceOp::Sum, 0, x.clone())?);
            out.push(ctx.all_reduce_in(&reversed, ReduceOp::Sum, x)?);
        }
        Ok(out)
    });
    let runtime = Runtime::new(1).map_err(e)?.with_interconnect(mpi.interconnect());
    let want =
        Runtime::new(PROCESSES).map_err(e)?.run(program.clone(), (0..2).map(input).collect());
    let want = want.map_err(e)?.swap_remove(p);
    for cap in [Mpi::DEFAULT_MAX_MESSAGE, 5] {
        mpi.set_max_message(cap);
        let got = runtime.run(program.clone(), vec![input(p)]).map_err(e)?.swap_remove(0);
        mpi.set_max_message(Mpi::DEFAULT_MAX_MESSAGE);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            if bits(g) != bits(w) || g.shape() != w.shape() {
                return Err(format!(
                    "1 device per process, cap {cap}, output {i}: got {g:?}, want {w:?}"
                ));
            }
        }
    }
    println!(
        "process {p}: with 1 device per process, grouped collectives in reverse order equal one process's"
    );
    Ok(())
}
