//! Several processes (one runtime each, joined by the loopback interconnect) against
//! one process with as many devices: the same program gives the same results, and a
//! failure in one process ends the run in every process with an error naming it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use meshwork_executor::{Error, LoopbackInterconnect, ReplicaFn, Runtime, Tensor};
use meshwork_types::{DType, ReduceOp};
use ndarray::{ArrayD, IxDyn};
use proptest::prelude::*;

/// `t`'s dtype and shape, every element a value no collective here computes.
fn garbage(t: &Tensor) -> Tensor {
    match t {
        Tensor::F32(a) => Tensor::F32(a.mapv(|_| -7777.25)),
        Tensor::F64(a) => Tensor::F64(a.mapv(|_| -7777.25)),
        Tensor::I32(a) => Tensor::I32(a.mapv(|_| -7777)),
        Tensor::I64(a) => Tensor::I64(a.mapv(|_| -7777)),
        other => panic!("unexpected {other:?}"),
    }
}

/// Runs `program` on `processes` runtimes of `devices` devices each, one thread per
/// process; returns each process's result. Each runtime's pools keep buffers of any
/// size, and a run that succeeds is run again after its outputs went back to the
/// pools filled with garbage: the second run's collectives write into those buffers
/// and into the inputs the first consumed, and must give the same outputs.
fn run_processes(
    processes: usize,
    devices: usize,
    timeout: Duration,
    program: Arc<ReplicaFn>,
    inputs: &[Vec<Tensor>],
) -> Vec<Result<Vec<Vec<Tensor>>, Error>> {
    let links = LoopbackInterconnect::group(processes);
    std::thread::scope(|s| {
        let handles: Vec<_> = links
            .into_iter()
            .enumerate()
            .map(|(p, link)| {
                let program = program.clone();
                let mine = inputs[p * devices..(p + 1) * devices].to_vec();
                s.spawn(move || {
                    let rt = Runtime::new(devices)?
                        .with_timeout(timeout)
                        .with_interconnect(link)
                        .with_pool(1 << 24, 0);
                    assert_eq!(rt.first_replica(), p * devices);
                    let first = rt.run(program.clone(), mine.clone())?;
                    for (device, outputs) in first.iter().enumerate() {
                        for o in outputs {
                            rt.recycle(device, garbage(o))?;
                        }
                    }
                    let second = rt.run(program, mine).expect("the second run");
                    assert_eq!(first, second, "process {p}: outputs in pooled buffers differ");
                    Ok(first)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a process thread panicked")).collect()
    })
}

fn run_one(devices: usize, program: Arc<ReplicaFn>, inputs: &[Vec<Tensor>]) -> Vec<Vec<Tensor>> {
    Runtime::new(devices).unwrap().run(program, inputs.to_vec()).unwrap()
}

/// The collectives under test, each a step of the program.
#[derive(Debug, Clone)]
enum Step {
    AllReduce(ReduceOp),
    AllReduceInGroups(ReduceOp, usize),
    AllGather(usize),
    ReduceScatter(ReduceOp),
    /// Along axis 1 of the transposed input (pieces that are not contiguous).
    ReduceScatterT(ReduceOp),
    AllToAll(usize),
    /// Split along axis 1 of the transposed input.
    AllToAllT(usize),
    /// Over strided groups, along the given axis.
    AllGatherInGroups(usize, usize),
    /// Over strided groups, along axis 0 (or, if the flag is set, along axis 1 of the
    /// transposed input: pieces that are not contiguous).
    ReduceScatterInGroups(ReduceOp, usize, bool),
    /// Over strided groups, split along axis 0 and concatenated along axis 1 (or, if
    /// the flag is set, split along axis 1 of the transposed input and concatenated
    /// along axis 0).
    AllToAllInGroups(usize, bool),
    /// Over strided groups in reverse rank order, along the given axis, into a buffer
    /// of garbage.
    GatherIntoReversed(usize, usize),
    /// Over strided groups in reverse rank order, split and concatenated along axis 0,
    /// into a buffer of garbage.
    AllToAllIntoReversed(usize),
    /// A fused all-reduce over strided groups with the given bucket size, of the input,
    /// its transpose and the input again: each result must be bit for bit the unfused
    /// all-reduce's (checked in the program); the step's output is the first.
    Fused(ReduceOp, usize, usize),
    Broadcast(usize),
    Permute(usize),
    Barrier,
}

fn step() -> impl Strategy<Value = Step> {
    let op = prop::sample::select(ReduceOp::ALL.to_vec());
    prop_oneof![
        op.clone().prop_map(Step::AllReduce),
        (op.clone(), 1usize..4).prop_map(|(o, g)| Step::AllReduceInGroups(o, g)),
        (0usize..2).prop_map(Step::AllGather),
        op.clone().prop_map(Step::ReduceScatter),
        op.clone().prop_map(Step::ReduceScatterT),
        (0usize..2).prop_map(Step::AllToAll),
        (0usize..2).prop_map(Step::AllToAllT),
        (1usize..4, 0usize..2).prop_map(|(g, axis)| Step::AllGatherInGroups(g, axis)),
        (op.clone(), 1usize..4, any::<bool>())
            .prop_map(|(o, g, t)| Step::ReduceScatterInGroups(o, g, t)),
        (1usize..4, any::<bool>()).prop_map(|(g, t)| Step::AllToAllInGroups(g, t)),
        (1usize..4, 0usize..2).prop_map(|(g, axis)| Step::GatherIntoReversed(g, axis)),
        (1usize..4).prop_map(Step::AllToAllIntoReversed),
        (op, 1usize..4, prop_oneof![Just(1usize), 8usize..600])
            .prop_map(|(o, g, b)| Step::Fused(o, g, b)),
        (0usize..64).prop_map(Step::Broadcast),
        (1usize..64).prop_map(Step::Permute),
        Just(Step::Barrier),
    ]
}

/// At most `g` strided groups of `n` replicas (`k, k + g, ...`; the most that divide
/// `n`), so that groups straddle processes.
fn strided(n: usize, g: usize) -> Vec<Vec<usize>> {
    let g = (1..=g).rev().find(|g| n.is_multiple_of(*g)).unwrap_or(1);
    (0..g).map(|k| (k..n).step_by(g).collect()).collect()
}

/// `groups`, each in reverse rank order.
fn reversed(groups: Vec<Vec<usize>>) -> Vec<Vec<usize>> {
    groups.into_iter().map(|g| g.into_iter().rev().collect()).collect()
}

/// A program that applies `steps` to its input, keeping every intermediate result.
fn program(steps: Vec<Step>) -> Arc<ReplicaFn> {
    Arc::new(move |ctx, inputs| {
        let n = ctx.num_replicas();
        let x = inputs[0].clone();
        let mut out = Vec::new();
        for s in &steps {
            let y = match *s {
                Step::AllReduce(op) => ctx.all_reduce(op, x.clone())?,
                Step::AllReduceInGroups(op, g) => {
                    ctx.all_reduce_in(&ctx.groups(strided(n, g))?, op, x.clone())?
                }
                Step::AllGather(axis) => ctx.all_gather(axis, x.clone())?,
                Step::ReduceScatter(op) => ctx.reduce_scatter(op, 0, x.clone())?,
                Step::ReduceScatterT(op) => ctx.reduce_scatter(op, 1, transposed(&x))?,
                Step::AllToAll(concat) => ctx.all_to_all(0, concat, x.clone())?,
                Step::AllToAllT(concat) => ctx.all_to_all(1, concat, transposed(&x))?,
                Step::AllGatherInGroups(g, axis) => {
                    ctx.all_gather_in(&ctx.groups(strided(n, g))?, axis, x.clone())?
                }
                Step::ReduceScatterInGroups(op, g, false) => {
                    ctx.reduce_scatter_in(&ctx.groups(strided(n, g))?, op, 0, x.clone())?
                }
                Step::ReduceScatterInGroups(op, g, true) => {
                    ctx.reduce_scatter_in(&ctx.groups(strided(n, g))?, op, 1, transposed(&x))?
                }
                Step::AllToAllInGroups(g, false) => {
                    ctx.all_to_all_in(&ctx.groups(strided(n, g))?, 0, 1, x.clone())?
                }
                Step::AllToAllInGroups(g, true) => {
                    ctx.all_to_all_in(&ctx.groups(strided(n, g))?, 1, 0, transposed(&x))?
                }
                Step::GatherIntoReversed(g, axis) => {
                    let groups = reversed(strided(n, g));
                    let mut shape = x.shape().to_vec();
                    shape[axis] *= groups[0].len();
                    let out = garbage(&Tensor::zeros(x.dtype(), &shape)?);
                    ctx.all_gather_into(&ctx.groups(groups)?, axis, x.clone(), out)?
                }
                Step::AllToAllIntoReversed(g) => {
                    let groups = ctx.groups(reversed(strided(n, g)))?;
                    ctx.all_to_all_into(&groups, 0, 0, x.clone(), garbage(&x))?
                }
                Step::Fused(op, g, bucket) => {
                    let groups = ctx.groups(strided(n, g))?;
                    let ts = vec![x.clone(), transposed(&x), x.clone()];
                    let fused = ctx.all_reduce_fused(&groups, op, ts.clone(), bucket)?;
                    for (f, t) in fused.iter().zip(ts) {
                        let single = ctx.all_reduce_in(&groups, op, t)?;
                        if bits(f) != bits(&single) {
                            return Err(format!("fused {f:?}, unfused {single:?}").into());
                        }
                    }
                    fused.into_iter().next().expect("three results")
                }
                Step::Broadcast(root) => ctx.broadcast(root % n, x.clone())?,
                Step::Permute(shift) => {
                    let pairs: Vec<_> = (0..n).map(|r| (r, (r + shift) % n)).collect();
                    ctx.collective_permute(&pairs, x.clone())?
                }
                Step::Barrier => {
                    ctx.barrier()?;
                    x.clone()
                }
            };
            out.push(y);
        }
        Ok(out)
    })
}

/// The 2-D `x` with its axes swapped (a strided view made owned, not standard layout).
fn transposed(x: &Tensor) -> Tensor {
    match x {
        Tensor::F32(a) => Tensor::F32(a.clone().reversed_axes()),
        Tensor::F64(a) => Tensor::F64(a.clone().reversed_axes()),
        Tensor::I32(a) => Tensor::I32(a.clone().reversed_axes()),
        Tensor::I64(a) => Tensor::I64(a.clone().reversed_axes()),
        other => panic!("{other:?}"),
    }
}

/// Integer-valued data in every dtype, so sums are exact in any order.
fn tensor(dtype: usize, shape: &[usize], data: &[i64]) -> Tensor {
    let s = IxDyn(shape);
    match dtype {
        0 => Tensor::F32(
            ArrayD::from_shape_vec(s, data.iter().map(|&x| x as f32).collect()).unwrap(),
        ),
        1 => Tensor::F64(
            ArrayD::from_shape_vec(s, data.iter().map(|&x| x as f64).collect()).unwrap(),
        ),
        2 => Tensor::I32(
            ArrayD::from_shape_vec(s, data.iter().map(|&x| x as i32).collect()).unwrap(),
        ),
        _ => Tensor::I64(ArrayD::from_shape_vec(s, data.to_vec()).unwrap()),
    }
}

type Case = (usize, usize, usize, Vec<usize>, Vec<Vec<i64>>);

/// Processes, devices per process, dtype, shape (rows divisible by the replica count)
/// and each replica's data.
fn case() -> impl Strategy<Value = Case> {
    (1usize..=4, 1usize..=3, 0usize..4, 1usize..3, 1usize..4).prop_flat_map(
        |(p, d, dtype, k, cols)| {
            let n = p * d;
            let shape = vec![n * k, cols];
            let data =
                prop::collection::vec(prop::collection::vec(-1000i64..1000, n * k * cols), n);
            (Just(p), Just(d), Just(dtype), Just(shape), data)
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 160, ..ProptestConfig::default() })]

    #[test]
    fn many_processes_compute_what_one_process_computes(
        (p, d, dtype, shape, data) in case(),
        steps in prop::collection::vec(step(), 1..5),
    ) {
        let inputs: Vec<Vec<Tensor>> = data.iter().map(|x| vec![tensor(dtype, &shape, x)]).collect();
        let program = program(steps);
        let want = run_one(p * d, program.clone(), &inputs);
        let got = run_processes(p, d, Duration::from_secs(20), program, &inputs);
        for (proc, result) in got.into_iter().enumerate() {
            let result = result.unwrap();
            prop_assert_eq!(&result[..], &want[proc * d..(proc + 1) * d]);
        }
    }
}

/// A random float: any sign, a full mantissa and exponents over a wide range, and
/// now and then a signed zero, so sums round and their order shows in the bits.
fn float() -> impl Strategy<Value = f64> {
    prop_oneof![
        10 => (any::<bool>(), 1.0f64..2.0, -30i32..30)
            .prop_map(|(neg, m, e)| if neg { -m } else { m } * 2f64.powi(e)),
        1 => prop::sample::select(vec![0.0, -0.0]),
    ]
}

/// Processes, devices per process, f32 or f64, shape (rows divisible by the replica
/// count) and each replica's random floats.
fn float_case() -> impl Strategy<Value = (usize, usize, bool, Vec<usize>, Vec<Vec<f64>>)> {
    (1usize..=4, 1usize..=3, any::<bool>(), 1usize..3, 1usize..4).prop_flat_map(
        |(p, d, f64s, k, cols)| {
            let n = p * d;
            let data = prop::collection::vec(prop::collection::vec(float(), n * k * cols), n);
            (Just(p), Just(d), Just(f64s), Just(vec![n * k, cols]), data)
        },
    )
}

fn floats(f64s: bool, shape: &[usize], data: &[f64]) -> Tensor {
    let s = IxDyn(shape);
    if f64s {
        Tensor::F64(ArrayD::from_shape_vec(s, data.to_vec()).unwrap())
    } else {
        Tensor::F32(ArrayD::from_shape_vec(s, data.iter().map(|&x| x as f32).collect()).unwrap())
    }
}

/// The documented order of a sum or mean over the replicas `members` (a group, in
/// rank order) of processes with `d` devices each: every process folds its members in
/// rank order, the processes' folds are added in process order, a mean divides by the
/// member count. Written over plain vectors, independently of the executor's folds.
fn documented_group_sum(inputs: &[Tensor], members: &[usize], d: usize, mean: bool) -> Tensor {
    fn go<T: Copy + std::ops::Add<Output = T> + std::ops::Div<Output = T>>(
        xs: &[Vec<T>],
        members: &[usize],
        d: usize,
        n: T,
        mean: bool,
    ) -> Vec<T> {
        let mut processes: Vec<usize> = members.iter().map(|&y| y / d).collect();
        processes.sort_unstable();
        processes.dedup();
        (0..xs[0].len())
            .map(|i| {
                let local = |q: usize| {
                    let mut here = members.iter().filter(|&&y| y / d == q).map(|&y| xs[y][i]);
                    let first = here.next().expect("a member on q");
                    here.fold(first, |acc, x| acc + x)
                };
                let total =
                    processes[1..].iter().fold(local(processes[0]), |acc, &q| acc + local(q));
                if mean { total / n } else { total }
            })
            .collect()
    }
    let shape = inputs[0].shape().to_vec();
    let m = members.len();
    match &inputs[0] {
        Tensor::F32(_) => {
            let xs: Vec<Vec<f32>> = inputs
                .iter()
                .map(|t| match t {
                    Tensor::F32(a) => a.iter().copied().collect(),
                    _ => unreachable!(),
                })
                .collect();
            let v = go(&xs, members, d, m as f32, mean);
            Tensor::F32(ArrayD::from_shape_vec(IxDyn(&shape), v).unwrap())
        }
        _ => {
            let xs: Vec<Vec<f64>> = inputs
                .iter()
                .map(|t| match t {
                    Tensor::F64(a) => a.iter().copied().collect(),
                    _ => unreachable!(),
                })
                .collect();
            let v = go(&xs, members, d, m as f64, mean);
            Tensor::F64(ArrayD::from_shape_vec(IxDyn(&shape), v).unwrap())
        }
    }
}

/// The documented order of a sum or mean over all replicas of `p` processes with `d`
/// devices each: the group of every replica (every process folds its replicas in rank
/// order, the processes' folds are added in process order, a mean divides by the
/// replica count).
fn documented_sum(inputs: &[Tensor], p: usize, d: usize, mean: bool) -> Tensor {
    documented_group_sum(inputs, &(0..p * d).collect::<Vec<_>>(), d, mean)
}

/// Rows `rows` of a 2-D float tensor.
fn rows_of(t: &Tensor, rows: std::ops::Range<usize>) -> Tensor {
    let s = ndarray::Slice::from(rows);
    match t {
        Tensor::F32(a) => Tensor::F32(a.slice_axis(ndarray::Axis(0), s).to_owned()),
        Tensor::F64(a) => Tensor::F64(a.slice_axis(ndarray::Axis(0), s).to_owned()),
        _ => unreachable!(),
    }
}

/// Bit patterns (and the shape), so that -0.0 and 0.0 differ and NaNs compare.
fn bits(t: &Tensor) -> (Vec<usize>, Vec<u64>) {
    let values = match t {
        Tensor::F32(a) => a.iter().map(|x| u64::from(x.to_bits())).collect(),
        Tensor::F64(a) => a.iter().map(|x| x.to_bits()).collect(),
        Tensor::I32(a) => a.iter().map(|&x| x as u64).collect(),
        Tensor::I64(a) => a.iter().map(|&x| x as u64).collect(),
        other => panic!("unexpected {other:?}"),
    };
    (t.shape().to_vec(), values)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 160, ..ProptestConfig::default() })]

    /// Random floats through random collectives across processes: a sum or mean over
    /// all replicas equals the documented order bit for bit (and one process's run
    /// where the two orders coincide: one process, or one device per process); every
    /// other collective equals one process's run bit for bit.
    #[test]
    fn random_floats_across_processes_follow_the_documented_order(
        (p, d, f64s, shape, data) in float_case(),
        steps in prop::collection::vec(step(), 1..5),
    ) {
        let inputs: Vec<Vec<Tensor>> = data.iter().map(|x| vec![floats(f64s, &shape, x)]).collect();
        let program = program(steps.clone());
        let one = run_one(p * d, program.clone(), &inputs);
        let got = run_processes(p, d, Duration::from_secs(20), program, &inputs);
        let all: Vec<Tensor> = inputs.iter().map(|i| i[0].clone()).collect();
        for (proc, result) in got.into_iter().enumerate() {
            let result = result.unwrap();
            for (k, outputs) in result.iter().enumerate() {
                let r = proc * d + k;
                for (s, (out, step)) in outputs.iter().zip(&steps).enumerate() {
                    let n = p * d;
                    let group = |g: usize| {
                        strided(n, g).into_iter().find(|m| m.contains(&r)).expect("r's group")
                    };
                    let want = match step {
                        Step::AllReduce(op @ (ReduceOp::Sum | ReduceOp::Mean)) => {
                            let model = documented_sum(&all, p, d, *op == ReduceOp::Mean);
                            if p == 1 || d == 1 {
                                prop_assert_eq!(bits(&model), bits(&one[r][s]), "orders coincide");
                            }
                            model
                        }
                        // Within a group: its members on each process folded first, then
                        // those folds in process order (one group of all replicas is the
                        // all-replica order).
                        Step::AllReduceInGroups(op @ (ReduceOp::Sum | ReduceOp::Mean), g)
                        | Step::Fused(op @ (ReduceOp::Sum | ReduceOp::Mean), g, _) => {
                            let model = documented_group_sum(&all, &group(*g), d, *op == ReduceOp::Mean);
                            if p == 1 || d == 1 {
                                prop_assert_eq!(bits(&model), bits(&one[r][s]), "orders coincide");
                            }
                            model
                        }
                        // A reduce-scatter within a group: member k's rows of the group's
                        // documented sum.
                        Step::ReduceScatterInGroups(op @ (ReduceOp::Sum | ReduceOp::Mean), g, t) => {
                            let members = group(*g);
                            let model = documented_group_sum(&all, &members, d, *op == ReduceOp::Mean);
                            let rows = shape[0] / members.len();
                            let k = members.iter().position(|&y| y == r).expect("a member");
                            let mut model = rows_of(&model, k * rows..(k + 1) * rows);
                            if *t {
                                model = transposed(&model);
                            }
                            if p == 1 || d == 1 {
                                prop_assert_eq!(bits(&model), bits(&one[r][s]), "orders coincide");
                            }
                            model
                        }
                        // A reduce-scatter over all replicas: replica r's rows of the
                        // documented sum.
                        Step::ReduceScatter(op @ (ReduceOp::Sum | ReduceOp::Mean))
                        | Step::ReduceScatterT(op @ (ReduceOp::Sum | ReduceOp::Mean)) => {
                            let model = documented_sum(&all, p, d, *op == ReduceOp::Mean);
                            let rows = shape[0] / n;
                            let mut model = rows_of(&model, r * rows..(r + 1) * rows);
                            if matches!(step, Step::ReduceScatterT(_)) {
                                model = transposed(&model);
                            }
                            if p == 1 || d == 1 {
                                prop_assert_eq!(bits(&model), bits(&one[r][s]), "orders coincide");
                            }
                            model
                        }
                        _ => one[r][s].clone(),
                    };
                    prop_assert_eq!(bits(out), bits(&want), "replica {} step {} {:?}", r, s, step);
                }
            }
        }
    }
}

/// Groups whose rank order interleaves the processes (2 processes × 2 devices): `[0, 2,
/// 1]` and `[3]`, of unequal sizes, where a reduce-scatter moves whole tensors, and
/// `[0, 3, 1, 2]`, one group of all replicas in another order, which takes the grouped
/// hierarchical path. Integers equal one process's run; floats whose sums round follow
/// the documented order bit for bit (each process's members in rank order — replicas 0
/// and 1 first — then the processes), not the rank order, along axis 0 and along the
/// strided axis 1; all-to-alls equal one process's run.
#[test]
fn groups_across_processes_fold_in_the_documented_order() {
    let (p, d) = (2, 2);
    for groups in [vec![vec![0, 2, 1], vec![3]], vec![vec![0, 3, 1, 2]]] {
        let program = |axis: usize| -> Arc<ReplicaFn> {
            let groups = groups.clone();
            Arc::new(move |ctx, i| {
                let g = ctx.groups(groups.clone())?;
                let x = if axis == 0 { i[0].clone() } else { transposed(&i[0]) };
                Ok(vec![
                    ctx.reduce_scatter_in(&g, ReduceOp::Sum, axis, x.clone())?,
                    ctx.all_to_all_in(&g, axis, 1 - axis, x.clone())?,
                    ctx.all_reduce_in(&g, ReduceOp::Mean, x)?,
                ])
            })
        };
        // Integers: any order gives the same sums.
        let ints: Vec<Vec<Tensor>> = (0..4)
            .map(|r| {
                let v: Vec<i64> = (0..24).map(|e| (r * 100 + e) as i64 - 300).collect();
                vec![tensor(3, &[12, 2], &v)]
            })
            .collect();
        for axis in [0, 1] {
            let one = run_one(p * d, program(axis), &ints);
            let got = run_processes(p, d, Duration::from_secs(20), program(axis), &ints);
            for (q, result) in got.into_iter().enumerate() {
                let want = one[q * d..(q + 1) * d].to_vec();
                assert_eq!(result.unwrap(), want, "{groups:?} axis {axis}");
            }
        }
        let floats: Vec<Vec<Tensor>> = (0..4)
            .map(|r| {
                let v: Vec<f32> = (0..24)
                    .map(|e| ((r * 7919 + e * 104_729) % 1000) as f32 * 0.1 + 1e-3)
                    .collect();
                vec![Tensor::F32(ArrayD::from_shape_vec(IxDyn(&[12, 2]), v).unwrap())]
            })
            .collect();
        let all: Vec<Tensor> = floats.iter().map(|i| i[0].clone()).collect();
        for axis in [0, 1] {
            let got = run_processes(p, d, Duration::from_secs(20), program(axis), &floats);
            for (q, result) in got.into_iter().enumerate() {
                for (k, outputs) in result.unwrap().iter().enumerate() {
                    let r = q * d + k;
                    let members = groups.iter().find(|g| g.contains(&r)).unwrap();
                    let rank = members.iter().position(|&y| y == r).unwrap();
                    let rows = 12 / members.len();
                    let sum = documented_group_sum(&all, members, d, false);
                    let mut piece = rows_of(&sum, rank * rows..(rank + 1) * rows);
                    let mut mean = documented_group_sum(&all, members, d, true);
                    if axis == 1 {
                        piece = transposed(&piece);
                        mean = transposed(&mean);
                    }
                    let at = format!("{groups:?}, replica {r}, axis {axis}");
                    assert_eq!(bits(&outputs[0]), bits(&piece), "{at}: reduce-scatter");
                    assert_eq!(bits(&outputs[2]), bits(&mean), "{at}: all-reduce");
                }
            }
        }
    }
}

/// A grouped all-reduce across processes whose length does not split among the
/// processes its groups span (7 elements, K = 2) moves the whole partials instead, in
/// the same documented order; and members whose shapes differ (though their element
/// counts agree) fail the run, on the chunked path as on every other.
#[test]
fn grouped_all_reduces_of_odd_lengths_and_of_mismatched_shapes() {
    let (p, d) = (2, 2);
    let members = vec![0, 3, 1, 2];
    let program: Arc<ReplicaFn> = Arc::new(|ctx, i| {
        let g = ctx.groups(vec![vec![0, 3, 1, 2]])?;
        Ok(vec![ctx.all_reduce_in(&g, ReduceOp::Sum, i[0].clone())?])
    });
    let floats: Vec<Vec<Tensor>> = (0..4)
        .map(|r| {
            let v: Vec<f32> =
                (0..7).map(|e| ((r * 7919 + e * 104_729) % 1000) as f32 * 0.1 + 1e-3).collect();
            vec![Tensor::F32(ArrayD::from_shape_vec(IxDyn(&[7]), v).unwrap())]
        })
        .collect();
    let all: Vec<Tensor> = floats.iter().map(|i| i[0].clone()).collect();
    let want = documented_group_sum(&all, &members, d, false);
    for result in run_processes(p, d, Duration::from_secs(20), program.clone(), &floats) {
        for out in result.unwrap() {
            assert_eq!(bits(&out[0]), bits(&want));
        }
    }
    // Replica 2 offers [3, 2] where the others offer [2, 3]: six elements each.
    let shaped: Vec<Vec<Tensor>> = (0..4)
        .map(|r| {
            let shape = if r == 2 { [3, 2] } else { [2, 3] };
            vec![Tensor::F32(ArrayD::from_elem(IxDyn(&shape), r as f32))]
        })
        .collect();
    for (q, result) in
        run_processes(p, d, Duration::from_secs(20), program, &shaped).into_iter().enumerate()
    {
        // Replica 2's process sees the mismatch; the other hears of its failure.
        assert!(
            matches!(
                result,
                Err(Error::Mismatch { .. }) | Err(Error::PeerFailed { failed: 2, .. })
            ),
            "process {q}: {result:?}"
        );
    }
}

/// Floats whose sums round: over all replicas, the processes fold their own replicas
/// first and then each other's folds, in process order. Every replica gets the same
/// bits, and they equal that model.
#[test]
fn float_all_reduce_across_processes_is_a_fixed_fold_with_identical_bits() {
    let (p, d, len) = (3, 2, 1001);
    let inputs: Vec<Vec<Tensor>> = (0..p * d)
        .map(|r| {
            let v: Vec<f32> =
                (0..len).map(|i| ((r * 7919 + i * 104729) % 1000) as f32 * 0.1 + 1e-3).collect();
            vec![Tensor::F32(ArrayD::from_shape_vec(IxDyn(&[len]), v).unwrap())]
        })
        .collect();
    let program: Arc<ReplicaFn> =
        Arc::new(|ctx, i| Ok(vec![ctx.all_reduce(ReduceOp::Sum, i[0].clone())?]));
    let f = |t: &Tensor| match t {
        Tensor::F32(a) => a.iter().copied().collect::<Vec<f32>>(),
        _ => unreachable!(),
    };
    let model: Vec<f32> = (0..len)
        .map(|i| {
            let local = |q: usize| {
                (1..d).fold(f(&inputs[q * d][0])[i], |acc, k| acc + f(&inputs[q * d + k][0])[i])
            };
            (1..p).fold(local(0), |acc, q| acc + local(q))
        })
        .collect();
    for _ in 0..3 {
        for result in run_processes(p, d, Duration::from_secs(20), program.clone(), &inputs) {
            for out in result.unwrap() {
                let bits: Vec<u32> = f(&out[0]).iter().map(|x| x.to_bits()).collect();
                let want: Vec<u32> = model.iter().map(|x| x.to_bits()).collect();
                assert_eq!(bits, want);
            }
        }
    }
}

/// A replica that fails in one process, before or after a collective (a grouped
/// reduce-scatter across processes, an all-reduce, an all-gather): every process's
/// run ends promptly, and each names the failed replica.
#[test]
fn a_failure_in_one_process_ends_the_run_everywhere() {
    // 3 processes x 2 devices, groups of three that straddle them; 4 x 1, pairs across
    // processes (where a grouped all-gather and all-to-all receive straight into their
    // results).
    for (p, d) in [(3, 2), (4, 1)] {
        for failing in 0..p * d {
            for at in 0..3 {
                let program: Arc<ReplicaFn> = Arc::new(move |ctx, i| {
                    let mut x = i[0].clone();
                    let g = match d {
                        2 => ctx.groups(vec![vec![0, 2, 4], vec![1, 3, 5]])?,
                        _ => ctx.groups(vec![vec![0, 2], vec![1, 3]])?,
                    };
                    for step in 0..2 {
                        if ctx.replica_id() == failing && step == at {
                            return Err(format!("replica {failing} gives up at step {at}").into());
                        }
                        x = ctx.reduce_scatter_in(&g, ReduceOp::Sum, 0, x)?;
                        x = ctx.all_reduce(ReduceOp::Sum, x)?;
                        x = match d {
                            2 => ctx.all_gather(0, x)?,
                            _ => ctx.all_to_all_in(&g, 0, 0, ctx.all_gather_in(&g, 0, x)?)?,
                        };
                    }
                    if ctx.replica_id() == failing && at == 2 {
                        return Err("gives up at the end".into());
                    }
                    Ok(vec![x])
                });
                let inputs: Vec<Vec<Tensor>> = (0..p * d)
                    .map(|r| vec![Tensor::I64(ArrayD::from_elem(IxDyn(&[6]), r as i64))])
                    .collect();
                let start = Instant::now();
                let results = run_processes(p, d, Duration::from_secs(20), program, &inputs);
                assert!(start.elapsed() < Duration::from_secs(10), "took {:?}", start.elapsed());
                for (proc, result) in results.into_iter().enumerate() {
                    match result {
                        Err(Error::ReplicaFailed { replica, .. }) => {
                            assert_eq!(replica, failing, "process {proc}")
                        }
                        Err(Error::PeerFailed { failed, .. }) => {
                            assert_eq!(failed, failing, "process {proc}")
                        }
                        other => panic!("process {proc}: replica {failing} at {at}: {other:?}"),
                    }
                }
            }
        }
    }
}

/// Processes whose programs diverge (one does an extra collective) all get an error.
#[test]
fn diverging_processes_all_get_a_mismatch() {
    let program: Arc<ReplicaFn> = Arc::new(|ctx, i| {
        let x = ctx.all_reduce(ReduceOp::Sum, i[0].clone())?;
        if ctx.replica_id() >= 2 {
            return Ok(vec![ctx.all_gather(0, x)?]);
        }
        Ok(vec![x])
    });
    let inputs: Vec<Vec<Tensor>> =
        (0..4).map(|_| vec![Tensor::I32(ArrayD::zeros(IxDyn(&[3])))]).collect();
    for (proc, result) in
        run_processes(2, 2, Duration::from_secs(20), program, &inputs).into_iter().enumerate()
    {
        assert!(matches!(result, Err(Error::Mismatch { .. })), "process {proc}: {result:?}");
    }
}

#[test]
fn the_loopback_links_number_their_processes() {
    let links = LoopbackInterconnect::group(3);
    let ids: Vec<(usize, usize)> = links.iter().map(|l| (l.process(), l.processes())).collect();
    assert_eq!(ids, vec![(0, 3), (1, 3), (2, 3)]);
    let err = Runtime::new(2)
        .unwrap()
        .with_interconnect(links[0].clone())
        .run(Arc::new(|_, _| Ok(vec![])), vec![vec![]]);
    assert!(matches!(err, Err(Error::ReplicaCount { replicas: 1, devices: 2 })), "{err:?}");
}

/// Tensors longer than the reduction's segment, split unevenly over 3 processes: every
/// reduction equals one process's (integer-valued data, so exact in any order).
#[test]
fn long_all_reduces_cross_segments_and_uneven_chunks() {
    let (p, d, len) = (3, 1, 2 * 65536 + 7);
    let inputs: Vec<Vec<Tensor>> = (0..p * d)
        .map(|r| {
            let v: Vec<f32> =
                (0..len).map(|i| ((r * 7919 + i * 31) % 2001) as f32 - 1000.0).collect();
            vec![Tensor::F32(ArrayD::from_shape_vec(IxDyn(&[len]), v).unwrap())]
        })
        .collect();
    let program: Arc<ReplicaFn> = Arc::new(|ctx, i| {
        ReduceOp::ALL
            .iter()
            .map(|&op| ctx.all_reduce(op, i[0].clone()).map_err(Into::into))
            .collect()
    });
    let want = run_one(p * d, program.clone(), &inputs);
    for (proc, result) in
        run_processes(p, d, Duration::from_secs(20), program, &inputs).into_iter().enumerate()
    {
        assert_eq!(result.unwrap(), want[proc * d..(proc + 1) * d], "process {proc}");
    }
}

/// Float sums that round, of a few elements (chunks of one or none), of a few thousand
/// and long enough to cross the reduction's segments: all follow the documented order
/// bit for bit (each process's replicas in rank order, then the processes in order).
#[test]
fn float_all_reduces_short_and_long_follow_the_documented_order() {
    for (p, d, len) in [(3, 2, 5), (3, 2, 2000), (3, 1, 2 * 65536 + 7), (2, 2, 70_000)] {
        let inputs: Vec<Vec<Tensor>> = (0..p * d)
            .map(|r| {
                let v: Vec<f32> = (0..len)
                    .map(|i| {
                        let z = ((r * 7919 + i * 104_729) % 100_003) as f32;
                        (z * 1.618_034).sin() * 10f32.powi((i % 9) as i32 - 4)
                    })
                    .collect();
                vec![Tensor::F32(ArrayD::from_shape_vec(IxDyn(&[len]), v).unwrap())]
            })
            .collect();
        let program: Arc<ReplicaFn> = Arc::new(|ctx, i| {
            Ok(vec![
                ctx.all_reduce(ReduceOp::Sum, i[0].clone())?,
                ctx.all_reduce(ReduceOp::Mean, i[0].clone())?,
            ])
        });
        let all: Vec<Tensor> = inputs.iter().map(|i| i[0].clone()).collect();
        let want = [documented_sum(&all, p, d, false), documented_sum(&all, p, d, true)];
        // With one replica per process the orders coincide; otherwise the data must
        // tell them apart.
        let one = run_one(p * d, program.clone(), &inputs);
        assert!(
            d == 1 || (0..p * d).any(|r| bits(&one[r][0]) != bits(&want[0])),
            "{len} elements: the data must tell the orders apart"
        );
        for (proc, result) in run_processes(p, d, Duration::from_secs(20), program.clone(), &inputs)
            .into_iter()
            .enumerate()
        {
            for (k, outputs) in result.unwrap().iter().enumerate() {
                for (s, w) in want.iter().enumerate() {
                    assert!(
                        bits(&outputs[s]) == bits(w),
                        "{p} processes x {d}, {len} elements: replica {} output {s}",
                        proc * d + k
                    );
                }
            }
        }
    }
}

/// An interconnect that counts the elements this process receives, and whose settings
/// (see `Interconnect::settings`) are those of its cell if it has one.
struct Counting {
    inner: Arc<dyn meshwork_executor::Interconnect>,
    received: std::sync::atomic::AtomicUsize,
    settings: Option<Arc<std::sync::atomic::AtomicI64>>,
}

impl meshwork_executor::Interconnect for Counting {
    fn process(&self) -> usize {
        self.inner.process()
    }
    fn processes(&self) -> usize {
        self.inner.processes()
    }
    fn handshake(&self, header: &[i64], timeout: Duration) -> Result<Vec<i64>, Error> {
        self.inner.handshake(header, timeout)
    }
    fn all_to_all_into(
        &self,
        from: &Tensor,
        send: &[std::ops::Range<usize>],
        into: &mut Tensor,
        recv: &[std::ops::Range<usize>],
    ) -> Result<(), Error> {
        let me = self.process();
        let n: usize =
            recv.iter().enumerate().filter(|(q, _)| *q != me).map(|(_, r)| r.len()).sum();
        self.received.fetch_add(n, std::sync::atomic::Ordering::SeqCst);
        self.inner.all_to_all_into(from, send, into, recv)
    }
    fn all_gather_in_place(
        &self,
        buf: &mut Tensor,
        chunks: &[std::ops::Range<usize>],
    ) -> Result<(), Error> {
        let me = self.process();
        let n: usize =
            chunks.iter().enumerate().filter(|(q, _)| *q != me).map(|(_, r)| r.len()).sum();
        self.received.fetch_add(n, std::sync::atomic::Ordering::SeqCst);
        self.inner.all_gather_in_place(buf, chunks)
    }
    fn settings(&self) -> i64 {
        match &self.settings {
            Some(cell) => cell.load(std::sync::atomic::Ordering::SeqCst),
            None => self.inner.settings(),
        }
    }
}

/// Processes whose links' settings differ (for MPI, the message cap) all fail at the
/// first collective's agreement with a mismatch that names them, instead of exchanging;
/// once the settings agree again, the same runtimes run.
#[test]
fn links_set_differently_fail_alike_at_the_agreement() {
    let p = 3;
    let cells: Vec<Arc<std::sync::atomic::AtomicI64>> =
        (0..p).map(|q| Arc::new(std::sync::atomic::AtomicI64::new(5 + (q == 2) as i64))).collect();
    let links = LoopbackInterconnect::group(p);
    let program: Arc<ReplicaFn> =
        Arc::new(|ctx, i| Ok(vec![ctx.all_reduce(ReduceOp::Sum, i[0].clone())?]));
    type Runs = (Result<Vec<Vec<Tensor>>, Error>, Vec<Vec<Tensor>>);
    let results: Vec<Runs> = std::thread::scope(|s| {
        let handles: Vec<_> = links
            .into_iter()
            .zip(&cells)
            .map(|(inner, cell)| {
                let (program, settings) = (program.clone(), cell.clone());
                s.spawn(move || {
                    let q = inner.process();
                    let cell = Some(settings.clone());
                    let link = Arc::new(Counting { inner, received: 0.into(), settings: cell });
                    let rt = Runtime::new(1).unwrap().with_interconnect(link);
                    let input =
                        || vec![vec![Tensor::I64(ArrayD::from_elem(IxDyn(&[4]), q as i64))]];
                    let first = rt.run(program.clone(), input());
                    // Each process agrees again before its next run's first handshake.
                    settings.store(5, std::sync::atomic::Ordering::SeqCst);
                    (first, rt.run(program, input()).expect("agreeing settings run"))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a process thread")).collect()
    });
    for (q, (first, second)) in results.into_iter().enumerate() {
        match first {
            // Every process names the same pair: process 0, and process 2, the first
            // that disagrees with it.
            Err(Error::Mismatch { expected, actual, first, replica, .. }) => {
                assert!(
                    expected.starts_with("process 0 is at link settings 5"),
                    "process {q}: {expected}"
                );
                assert!(
                    actual.starts_with("process 2 is at link settings 6"),
                    "process {q}: {actual}"
                );
                assert_eq!((first, replica), (0, 2), "process {q}");
            }
            other => panic!("process {q}: settings 5, 5, 6 gave {other:?}"),
        }
        assert_eq!(second, vec![vec![Tensor::I64(ArrayD::from_elem(IxDyn(&[4]), 3))]]);
    }
}

/// Across processes only the bytes other processes need move: with 3 processes of 2
/// devices and tensors of L elements, each process receives (P-1)·L/P elements for a
/// reduce-scatter (its own replicas' pieces of the others' partial sums), (P-1)·d·L/P
/// for an all-to-all (the pieces for its replicas), L for a broadcast from another
/// process's replica and none from its own, nothing for a barrier; for a grouped
/// all-reduce nothing within processes and across them 2·(K-1)/K·L per group (K the
/// processes it spans: a reduce-scatter of the processes' partials, then an
/// all-gather), for a grouped reduce-scatter only its members' pieces of the other
/// processes' partials, for a grouped all-to-all only its members' pieces of the other
/// members' tensors — where gathering every tensor everywhere would move (P-1)·d·L each
/// time. The results are checked against one process elsewhere; here, the counts.
#[test]
fn across_processes_only_the_needed_elements_move() {
    let (p, d, len) = (3usize, 2usize, 600usize);
    type Make = fn(usize) -> Arc<ReplicaFn>;
    let cases: Vec<(&str, Make, Vec<usize>)> = vec![
        (
            "reduce_scatter",
            |_| Arc::new(|ctx, i| Ok(vec![ctx.reduce_scatter(ReduceOp::Sum, 0, i[0].clone())?])),
            vec![(p - 1) * len / p; p],
        ),
        (
            "all_to_all",
            |_| Arc::new(|ctx, i| Ok(vec![ctx.all_to_all(0, 0, i[0].clone())?])),
            vec![(p - 1) * d * len / p; p],
        ),
        (
            "all_to_all into a given buffer",
            |_| {
                Arc::new(|ctx, i| {
                    let all = ctx.groups(vec![(0..ctx.num_replicas()).collect()])?;
                    let out = garbage(&i[0]);
                    Ok(vec![ctx.all_to_all_into(&all, 0, 0, i[0].clone(), out)?])
                })
            },
            vec![(p - 1) * d * len / p; p],
        ),
        (
            "all_gather into a given buffer over pairs across processes 0 and 1",
            |_| {
                Arc::new(|ctx, i| {
                    let g = ctx.groups(vec![vec![0, 2], vec![1, 3], vec![4], vec![5]])?;
                    let mut shape = i[0].shape().to_vec();
                    shape[0] *= if ctx.replica_id() < 4 { 2 } else { 1 };
                    let out = Tensor::zeros(i[0].dtype(), &shape)?;
                    Ok(vec![ctx.all_gather_into(&g, 0, i[0].clone(), out)?])
                })
            },
            vec![d * len, d * len, 0],
        ),
        (
            "broadcast from replica 3",
            |_| Arc::new(|ctx, i| Ok(vec![ctx.broadcast(3, i[0].clone())?])),
            vec![len, 0, len],
        ),
        (
            "barrier",
            |_| Arc::new(|ctx, _| ctx.barrier().map(|()| vec![]).map_err(Into::into)),
            vec![0; p],
        ),
        (
            "all_reduce within each process's pairs",
            |_| {
                Arc::new(|ctx, i| {
                    let g = ctx.groups(vec![vec![0, 1], vec![2, 3], vec![4, 5]])?;
                    Ok(vec![ctx.all_reduce_in(&g, ReduceOp::Sum, i[0].clone())?])
                })
            },
            vec![0; p],
        ),
        (
            "all_gather over pairs across processes 0 and 1",
            |_| {
                Arc::new(|ctx, i| {
                    let g = ctx.groups(vec![vec![0, 2], vec![1, 3], vec![4], vec![5]])?;
                    Ok(vec![ctx.all_gather_in(&g, 0, i[0].clone())?])
                })
            },
            vec![d * len, d * len, 0],
        ),
        // Groups of three that straddle processes: [0, 1 | 2] and [3 | 4, 5] (K = 2:
        // half of each group's total folded here, the other half gathered).
        (
            "grouped all_reduce over two processes per group: a half each way",
            |_| {
                Arc::new(|ctx, i| {
                    let g = ctx.groups(vec![vec![0, 1, 2], vec![3, 4, 5]])?;
                    Ok(vec![ctx.all_reduce_in(&g, ReduceOp::Sum, i[0].clone())?])
                })
            },
            vec![len, 2 * len, len],
        ),
        // Groups that span all three processes, one member on each: each process
        // folds a third of each group's total and gathers the other two thirds.
        (
            "grouped all_reduce over three processes: a reduce-scatter, then an all-gather",
            |_| {
                Arc::new(|ctx, i| {
                    let g = ctx.groups(vec![vec![0, 2, 4], vec![1, 3, 5]])?;
                    Ok(vec![ctx.all_reduce_in(&g, ReduceOp::Sum, i[0].clone())?])
                })
            },
            vec![2 * (2 * len / 3 + 2 * len / 3); p],
        ),
        (
            "grouped reduce_scatter: its members' pieces of the other processes' partials",
            |_| {
                Arc::new(|ctx, i| {
                    let g = ctx.groups(vec![vec![0, 1, 2], vec![3, 4, 5]])?;
                    Ok(vec![ctx.reduce_scatter_in(&g, ReduceOp::Sum, 0, i[0].clone())?])
                })
            },
            vec![2 * len / 3; p],
        ),
        (
            "grouped all_to_all: its members' pieces of the other processes' members",
            |_| {
                Arc::new(|ctx, i| {
                    let g = ctx.groups(vec![vec![0, 1, 2], vec![3, 4, 5]])?;
                    Ok(vec![ctx.all_to_all_in(&g, 0, 0, i[0].clone())?])
                })
            },
            vec![2 * len / 3, 4 * len / 3, 2 * len / 3],
        ),
    ];
    for (name, make, want) in cases {
        let links = LoopbackInterconnect::group(p);
        let counters: Vec<Arc<Counting>> = links
            .into_iter()
            .map(|inner| Arc::new(Counting { inner, received: 0.into(), settings: None }))
            .collect();
        std::thread::scope(|s| {
            for (q, link) in counters.iter().enumerate() {
                let link = link.clone() as Arc<dyn meshwork_executor::Interconnect>;
                let program = make(q);
                s.spawn(move || {
                    let rt = Runtime::new(d).unwrap().with_interconnect(link);
                    let inputs = (0..d)
                        .map(|k| {
                            vec![Tensor::F32(ArrayD::from_elem(IxDyn(&[len]), (q * d + k) as f32))]
                        })
                        .collect();
                    rt.run(program, inputs).unwrap();
                });
            }
        });
        let got: Vec<usize> =
            counters.iter().map(|c| c.received.load(std::sync::atomic::Ordering::SeqCst)).collect();
        assert_eq!(got, want, "{name}");
    }
}

/// A training loop across processes (2 × 2 devices) whose inputs come from the pools
/// and whose results go back to them every step: once warm, the device pools meet every
/// request for a buffer, whichever local replica runs a cross-process step and
/// whichever reads its result last (replica 0 of each process arrives late, so it runs
/// the step). Before, a shared result whose readers overlapped was copied by all of
/// them and then freed, not given back, so its pool handed out fresh pages every step.
/// The all-reduce in groups `[1, 0, 3, 2]` takes the two-exchange grouped path, whose
/// partials and totals come from the pool of local replica 1 of process 0 (its group's
/// first member there; before, it freed its partials every step), and the reduce-scatter
/// in groups `[0, 1, 3, 2]` the one-exchange path, whose partial on each process comes
/// from its group's first member's pool (before, a partial went back to the pool of the
/// last local replica whose entry held it: device 1's on process 0).
#[test]
fn pools_stay_balanced_across_processes_whichever_replica_reads_last() {
    let (p, d, shape) = (2usize, 2usize, [256usize, 1024usize]);
    let program: Arc<ReplicaFn> = Arc::new(|ctx, i| {
        if ctx.replica_id() % 2 == 0 {
            std::thread::sleep(Duration::from_millis(5));
        }
        let [a, b, c, e, f] = <[Tensor; 5]>::try_from(i).expect("five inputs");
        let reordered = ctx.groups(vec![vec![1, 0, 3, 2]])?;
        Ok(vec![
            ctx.all_gather(0, a)?,
            ctx.all_to_all(0, 1, b)?,
            ctx.all_reduce(ReduceOp::Sum, c)?,
            ctx.all_reduce_in(&reordered, ReduceOp::Sum, e)?,
            ctx.reduce_scatter_in(&ctx.groups(vec![vec![0, 1, 3, 2]])?, ReduceOp::Sum, 0, f)?,
        ])
    });
    let links = LoopbackInterconnect::group(p);
    let misses: Vec<Vec<Vec<usize>>> = std::thread::scope(|s| {
        let handles: Vec<_> = links
            .into_iter()
            .map(|link| {
                let program = program.clone();
                s.spawn(move || {
                    let rt = Runtime::new(d).unwrap().with_interconnect(link);
                    let mut misses = Vec::new();
                    for _ in 0..24 {
                        let inputs = (0..d)
                            .map(|k| (0..5).map(|_| rt.buffer(k, DType::F32, &shape)).collect())
                            .collect::<Result<Vec<Vec<Tensor>>, Error>>()
                            .unwrap();
                        let outputs = rt.run(program.clone(), inputs).unwrap();
                        for (k, outs) in outputs.into_iter().enumerate() {
                            for o in outs {
                                rt.recycle(k, o).unwrap();
                            }
                        }
                        misses.push(rt.pool_misses());
                    }
                    misses
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a process thread")).collect()
    });
    // An interleaving of the replicas not seen before can need one more buffer in
    // circulation, once; the fault was a miss every step.
    for (proc, steps) in misses.iter().enumerate() {
        for device in 0..d {
            assert!(
                steps[23][device] - steps[6][device] <= 2,
                "process {proc}, device {device}: pool misses after each step: {steps:?}"
            );
        }
    }
}

/// Point-to-point transfers stay within one process: across processes a receive is
/// refused at once, naming the replica by its id across the processes (so no hub of a
/// process numbered from other than 0 ever waits in one).
#[test]
fn a_receive_across_processes_is_refused_naming_the_replica() {
    let program: Arc<ReplicaFn> = Arc::new(move |ctx, i| {
        if ctx.replica_id() == 3 {
            ctx.recv(2, 7)?;
        }
        Ok(i)
    });
    let inputs: Vec<Vec<Tensor>> =
        (0..4).map(|r| vec![Tensor::I64(ArrayD::from_elem(IxDyn(&[1]), r as i64))]).collect();
    let results = run_processes(2, 2, Duration::from_secs(20), program, &inputs);
    match &results[1] {
        Err(Error::BadArgument { op: "recv", replica: 3, problem }) => {
            assert!(problem.contains("within one process"), "{problem}")
        }
        other => panic!("{other:?}"),
    }
}
