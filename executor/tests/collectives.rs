//! Collectives against a sequential model, and what happens when replicas fail.

use std::sync::Arc;
use std::time::Duration;

use meshwork_executor::{Error, ReplicaFn, ReplicaGroups, Runtime, Tensor};
use meshwork_types::{DType, ReduceOp};
use ndarray::{ArrayD, Axis, IxDyn};
use proptest::prelude::*;

fn t(shape: &[usize], data: Vec<i64>) -> Tensor {
    Tensor::I64(ArrayD::from_shape_vec(IxDyn(shape), data).unwrap())
}

fn arr(t: &Tensor) -> ArrayD<i64> {
    match t {
        Tensor::I64(a) => a.clone(),
        other => panic!("expected i64, got {other:?}"),
    }
}

/// `replicas` tensors of one shape (rows divisible by the replica count), random data.
fn inputs() -> impl Strategy<Value = (usize, Vec<usize>, Vec<Vec<i64>>)> {
    (1usize..=16, 1usize..3, 1usize..4).prop_flat_map(|(n, k, cols)| {
        let shape = vec![n * k, cols];
        let len = n * k * cols;
        (Just(n), Just(shape), prop::collection::vec(prop::collection::vec(-1000i64..1000, len), n))
    })
}

/// Runs `program` twice on a runtime whose pools keep buffers of any size: the first
/// run writes into fresh memory, then its results go back to the pools filled with
/// garbage, and the second run's plain collectives write into those buffers and into
/// the inputs the first run consumed. Both runs must agree; returns the first's.
fn run(n: usize, shape: &[usize], data: &[Vec<i64>], program: Arc<ReplicaFn>) -> Vec<ArrayD<i64>> {
    let rt = Runtime::new(n).unwrap().with_pool(1 << 24, 0);
    let ins: Vec<Vec<Tensor>> = data.iter().map(|d| vec![t(shape, d.clone())]).collect();
    let first = rt.run(program.clone(), ins.clone()).unwrap();
    for (device, out) in first.iter().enumerate() {
        rt.recycle(device, Tensor::I64(arr(&out[0]).as_standard_layout().mapv(|_| -7777))).unwrap();
    }
    let second = rt.run(program, ins).unwrap();
    assert_eq!(first, second, "results written into pooled buffers differ from fresh ones");
    first.into_iter().map(|o| arr(&o[0])).collect()
}

fn model_reduce(arrays: &[ArrayD<i64>], op: ReduceOp) -> ArrayD<i64> {
    let mut acc = arrays[0].clone();
    for a in &arrays[1..] {
        acc.zip_mut_with(a, |x, &y| {
            *x = match op {
                ReduceOp::Sum | ReduceOp::Mean => *x + y,
                ReduceOp::Min => (*x).min(y),
                ReduceOp::Max => (*x).max(y),
            }
        });
    }
    if op == ReduceOp::Mean {
        acc.mapv_inplace(|x| x / arrays.len() as i64);
    }
    acc
}

fn arrays(shape: &[usize], data: &[Vec<i64>]) -> Vec<ArrayD<i64>> {
    data.iter().map(|d| arr(&t(shape, d.clone()))).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn all_reduce_matches_sequential_fold((n, shape, data) in inputs(), op in prop::sample::select(ReduceOp::ALL.to_vec())) {
        let out = run(n, &shape, &data, Arc::new(move |ctx, i| Ok(vec![ctx.all_reduce(op, i[0].clone())?])));
        let want = model_reduce(&arrays(&shape, &data), op);
        for o in out { prop_assert_eq!(o, want.clone()); }
    }

    #[test]
    fn all_gather_concatenates_in_replica_order((n, shape, data) in inputs(), axis in 0usize..2) {
        let out = run(n, &shape, &data, Arc::new(move |ctx, i| Ok(vec![ctx.all_gather(axis, i[0].clone())?])));
        let a = arrays(&shape, &data);
        let views: Vec<_> = a.iter().map(|x| x.view()).collect();
        let want = ndarray::concatenate(Axis(axis), &views).unwrap();
        for o in out { prop_assert_eq!(o, want.clone()); }
    }

    #[test]
    fn reduce_scatter_is_a_slice_of_all_reduce((n, shape, data) in inputs()) {
        let out = run(n, &shape, &data, Arc::new(|ctx, i| Ok(vec![ctx.reduce_scatter(ReduceOp::Sum, 0, i[0].clone())?])));
        let sum = model_reduce(&arrays(&shape, &data), ReduceOp::Sum);
        let rows = shape[0] / n;
        for (r, o) in out.into_iter().enumerate() {
            let want = sum.slice_axis(Axis(0), ndarray::Slice::from(r * rows..(r + 1) * rows)).to_owned();
            prop_assert_eq!(o, want);
        }
        // The same along axis 1 of the transposed (non-standard layout) inputs.
        let rt = Runtime::new(n).unwrap();
        let ins = data.iter().map(|d| vec![Tensor::I64(arr(&t(&shape, d.clone())).reversed_axes())]).collect();
        let scatter: Arc<ReplicaFn> = Arc::new(|ctx, i| Ok(vec![ctx.reduce_scatter(ReduceOp::Sum, 1, i[0].clone())?]));
        for (r, o) in rt.run(scatter, ins).unwrap().into_iter().enumerate() {
            let want = sum.slice_axis(Axis(0), ndarray::Slice::from(r * rows..(r + 1) * rows)).reversed_axes();
            prop_assert_eq!(arr(&o[0]), want);
        }
    }

    #[test]
    fn all_to_all_transposes_pieces((n, shape, data) in inputs(), concat in 0usize..2) {
        let out = run(n, &shape, &data, Arc::new(move |ctx, i| Ok(vec![ctx.all_to_all(0, concat, i[0].clone())?])));
        let a = arrays(&shape, &data);
        let rows = shape[0] / n;
        for (r, o) in out.into_iter().enumerate() {
            let pieces: Vec<_> = a.iter().map(|x| x.slice_axis(Axis(0), ndarray::Slice::from(r * rows..(r + 1) * rows))).collect();
            prop_assert_eq!(o, ndarray::concatenate(Axis(concat), &pieces).unwrap());
        }
    }

    #[test]
    fn gathers_into_reused_buffers_equal_fresh_ones((n, shape, data) in inputs(), axis in 0usize..2, concat in 0usize..2) {
        // Each replica gathers twice, the second time into its first result (and an
        // all-to-all into a buffer of garbage): both equal the fresh results.
        let program: Arc<ReplicaFn> = Arc::new(move |ctx, i| {
            let all = ctx.groups(vec![(0..ctx.num_replicas()).collect()])?;
            let fresh = ctx.all_gather(axis, i[0].clone())?;
            let again = ctx.all_gather_into(&all, axis, i[0].clone(), fresh.clone())?;
            let a2a = ctx.all_to_all(0, concat, i[0].clone())?;
            let garbage = match &a2a {
                Tensor::I64(a) => Tensor::I64(a.mapv(|_| -7)),
                other => other.clone(),
            };
            let a2a_into = ctx.all_to_all_into(&all, 0, concat, i[0].clone(), garbage)?;
            Ok(vec![fresh, again, a2a, a2a_into])
        });
        let rt = Runtime::new(n).unwrap();
        let ins = data.iter().map(|d| vec![t(&shape, d.clone())]).collect();
        for out in rt.run(program, ins).unwrap() {
            prop_assert_eq!(&out[0], &out[1]);
            prop_assert_eq!(&out[2], &out[3]);
        }
    }

    #[test]
    fn broadcast_and_permute_move_whole_tensors((n, shape, data) in inputs(), root in 0usize..16, shift in 1usize..16) {
        let root = root % n;
        let out = run(n, &shape, &data, Arc::new(move |ctx, i| Ok(vec![ctx.broadcast(root, i[0].clone())?])));
        let a = arrays(&shape, &data);
        for o in out { prop_assert_eq!(o, a[root].clone()); }
        // A ring shift, missing the pair into replica 0 so one target gets zeros.
        let pairs: Vec<(usize, usize)> = (0..n).map(|s| (s, (s + shift) % n)).filter(|&(_, d)| d != 0).collect();
        let p = pairs.clone();
        let out = run(n, &shape, &data, Arc::new(move |ctx, i| Ok(vec![ctx.collective_permute(&p, i[0].clone())?])));
        for (r, o) in out.into_iter().enumerate() {
            let want = match pairs.iter().find(|&&(_, d)| d == r) {
                Some(&(s, _)) => a[s].clone(),
                None => ArrayD::zeros(IxDyn(&shape)),
            };
            prop_assert_eq!(o, want);
        }
    }

    #[test]
    fn grouped_all_reduce_reduces_within_each_group((n, shape, data) in inputs()) {
        // Even and odd replicas form two groups.
        let groups: Vec<Vec<usize>> = [0, 1].iter().map(|&p| (0..n).filter(|r| r % 2 == p).collect::<Vec<_>>()).filter(|g| !g.is_empty()).collect();
        let g = groups.clone();
        let out = run(n, &shape, &data, Arc::new(move |ctx, i| {
            let groups = ctx.groups(g.clone())?;
            Ok(vec![ctx.all_reduce_in(&groups, ReduceOp::Sum, i[0].clone())?])
        }));
        let a = arrays(&shape, &data);
        for (r, o) in out.into_iter().enumerate() {
            let members: Vec<_> = groups.iter().find(|g| g.contains(&r)).unwrap().iter().map(|&m| a[m].clone()).collect();
            prop_assert_eq!(o, model_reduce(&members, ReduceOp::Sum));
        }
    }
}

/// The pools at work: a recycled buffer of the result's size is what the next plain
/// collective writes into (it leaves the pool); a consumed input goes back to its
/// device's pool only when a collective there asked for a buffer of its size (an
/// all-to-all's input is the next all-to-all's result buffer, an all-gather's is not);
/// small buffers and a full pool keep nothing more; an unknown device is a typed
/// error; releasing empties every pool.
#[test]
fn plain_collectives_write_into_pooled_buffers_and_give_their_inputs_back() {
    let n = 4;
    let len = 1 << 16; // 256 KiB of f32 per input, 1 MiB per all-gather result
    let rt = Runtime::new(n).unwrap().with_pool(8 << 20, 1 << 18);
    let gather: Arc<ReplicaFn> = Arc::new(|ctx, i| Ok(vec![ctx.all_gather(0, i[0].clone())?]));
    let input = |r: usize| vec![Tensor::F32(ArrayD::from_elem(IxDyn(&[len]), r as f32))];
    let want: Vec<f32> = (0..n).flat_map(|r| std::iter::repeat_n(r as f32, len)).collect();
    let check = |out: &[Vec<Tensor>], want: &[f32]| {
        for o in out {
            match &o[0] {
                Tensor::F32(a) => assert_eq!(a.as_slice().unwrap(), want),
                other => panic!("{other:?}"),
            }
        }
    };
    // No buffers yet: the result is fresh, and nothing asked for the inputs' size.
    let out = rt.run(gather.clone(), (0..n).map(input).collect()).unwrap();
    check(&out, &want);
    assert_eq!(rt.pooled_bytes(), vec![0; n]);
    // The results, recycled with garbage in them, are taken by the next all-gather.
    for (d, o) in out.into_iter().enumerate() {
        let [o] = <[Tensor; 1]>::try_from(o).unwrap();
        let Tensor::F32(a) = o else { unreachable!() };
        rt.recycle(d, Tensor::F32(a.mapv_into(|_| f32::NAN))).unwrap();
    }
    assert_eq!(rt.pooled_bytes(), vec![n * len * 4; n]);
    let out = rt.run(gather, (0..n).map(input).collect()).unwrap();
    check(&out, &want);
    assert_eq!(rt.pooled_bytes(), vec![0; n]);
    // An all-to-all asks for a buffer of its input's size: the first run's inputs are
    // kept, and the second run takes them (and leaves its own).
    let a2a: Arc<ReplicaFn> = Arc::new(|ctx, i| Ok(vec![ctx.all_to_all(0, 0, i[0].clone())?]));
    let piece = len / n;
    for _ in 0..2 {
        let out = rt.run(a2a.clone(), (0..n).map(input).collect()).unwrap();
        assert_eq!(rt.pooled_bytes(), vec![len * 4; n]);
        for o in &out {
            let want: Vec<f32> =
                (0..n).flat_map(|s| std::iter::repeat_n(s as f32, piece)).collect();
            check(std::slice::from_ref(o), &want);
        }
    }
    // Too small to keep; too big for the pool; an unknown device.
    rt.recycle(0, Tensor::F32(ArrayD::zeros(IxDyn(&[16])))).unwrap();
    rt.recycle(1, Tensor::F32(ArrayD::zeros(IxDyn(&[4 << 20])))).unwrap();
    assert_eq!(rt.pooled_bytes(), vec![len * 4; n]);
    assert_eq!(
        rt.recycle(n, Tensor::F32(ArrayD::zeros(IxDyn(&[1])))),
        Err(Error::NoSuchDevice { device: n, devices: n })
    );
    rt.release_pools();
    assert_eq!(rt.pooled_bytes(), vec![0; n]);
}

#[test]
fn inputs_from_runtime_buffers_go_back_to_the_pools_so_a_warm_loop_allocates_nothing() {
    let (n, len) = (4, 1 << 16);
    let rt = Runtime::new(n).unwrap().with_pool(8 << 20, 1 << 18);
    let scatter: Arc<ReplicaFn> =
        Arc::new(|ctx, i| Ok(vec![ctx.reduce_scatter(ReduceOp::Sum, 0, i[0].clone())?]));
    // Each step: inputs from the pools, filled; the results recycled.
    let step = |k: usize| {
        let ins: Vec<Vec<Tensor>> = (0..n)
            .map(|r| {
                let mut x = rt.buffer(r, DType::F32, &[len]).unwrap();
                assert_eq!(x.shape(), &[len]);
                let Tensor::F32(a) = &mut x else { panic!("{x:?}") };
                a.fill((r + k) as f32);
                vec![x]
            })
            .collect();
        let out = rt.run(scatter.clone(), ins).unwrap();
        let want = (0..n).map(|r| (r + k) as f32).sum::<f32>();
        for (d, o) in out.into_iter().enumerate() {
            let [o] = <[Tensor; 1]>::try_from(o).unwrap();
            match &o {
                Tensor::F32(a) => assert!(a.iter().all(|&v| v == want), "step {k}: {a:?}"),
                other => panic!("{other:?}"),
            }
            rt.recycle(d, o).unwrap();
        }
    };
    step(0);
    // The inputs (asked for by `buffer`) came back when the reduce-scatter consumed
    // them (the 64 KiB results are below the pool's smallest size, 256 KiB), and each
    // step takes them again: no fresh input memory once warm.
    assert_eq!(rt.pooled_bytes(), vec![len * 4; n]);
    for k in 1..4 {
        step(k);
        assert_eq!(rt.pooled_bytes(), vec![len * 4; n], "step {k}");
    }
    // Bad requests are typed errors: an unknown device, an unsupported dtype, a size
    // past the address range (checked before allocating).
    assert_eq!(
        rt.buffer(n, DType::F32, &[1]).unwrap_err(),
        Error::NoSuchDevice { device: n, devices: n }
    );
    assert_eq!(
        rt.buffer(0, DType::F64, &[usize::MAX / 4, 4]).unwrap_err(),
        Error::TooLarge { dtype: DType::F64, shape: vec![usize::MAX / 4, 4] }
    );
    assert!(matches!(
        rt.buffer(0, DType::Bool, &[2]),
        Err(Error::UnsupportedDType { dtype: DType::Bool, op: "buffer" })
    ));
    assert!(matches!(
        Tensor::zeros(DType::I32, &[1 << 62, 2]),
        Err(meshwork_types::Error::ByteSizeOverflow { dtype: DType::I32, .. })
    ));
    // With nothing kept of a kind, a buffer is zeros.
    let Tensor::I64(z) = rt.buffer(1, DType::I64, &[3, 2]).unwrap() else { panic!() };
    assert!(z.iter().all(|&v| v == 0) && z.shape() == [3, 2]);
}

/// Replica count, dtype, a 3-D shape whose `axis` divides by the count, and each
/// replica's values (random floats, so the order of a fold shows in its bits).
type ScatterCase = (usize, DType, Vec<usize>, usize, Vec<Vec<f64>>);

fn scatter_case() -> impl Strategy<Value = ScatterCase> {
    // Runs short and long: the fold works a page of each input at a time, so pieces of
    // more than a page of elements cross block boundaries.
    let c = prop_oneof![1usize..40, 1000usize..1300];
    (1usize..=8, 0usize..3, 1usize..4, 1usize..4, c).prop_flat_map(|(n, axis, a, b, c)| {
        let mut shape = vec![a, b, c];
        shape[axis] *= n;
        let len = shape.iter().product::<usize>();
        let dtype = prop::sample::select(vec![DType::F32, DType::F64, DType::I32, DType::I64]);
        let values = prop::collection::vec(prop::collection::vec(-1e3f64..1e3, len), n);
        (Just(n), dtype, Just(shape), Just(axis), values)
    })
}

fn typed_floats(dtype: DType, shape: &[usize], v: &[f64]) -> Tensor {
    let a = ArrayD::from_shape_vec(IxDyn(shape), v.to_vec()).unwrap();
    match dtype {
        DType::F32 => Tensor::F32(a.mapv(|x| x as f32)),
        DType::F64 => Tensor::F64(a),
        DType::I32 => Tensor::I32(a.mapv(|x| x as i32)),
        _ => Tensor::I64(a.mapv(|x| x as i64)),
    }
}

/// Piece `r` of every part along `axis`, folded left in part order in the element
/// type by ndarray's own element-wise ops (a mean divides the sum by the count).
fn model_piece(parts: &[Tensor], axis: usize, r: usize, op: ReduceOp) -> Tensor {
    macro_rules! go {
        ($v:ident, $t:ty, $add:expr, $div:expr) => {{
            let views: Vec<_> = parts
                .iter()
                .map(|p| {
                    let Tensor::$v(a) = p else { unreachable!() };
                    let len = a.shape()[axis] / parts.len();
                    a.slice_axis(Axis(axis), ndarray::Slice::from(r * len..(r + 1) * len))
                })
                .collect();
            let mut acc = views[0].to_owned();
            for v in &views[1..] {
                acc.zip_mut_with(v, |x: &mut $t, &y: &$t| {
                    *x = match op {
                        ReduceOp::Sum | ReduceOp::Mean => $add(*x, y),
                        ReduceOp::Min => {
                            if y < *x {
                                y
                            } else {
                                *x
                            }
                        }
                        ReduceOp::Max => {
                            if y > *x {
                                y
                            } else {
                                *x
                            }
                        }
                    }
                });
            }
            if op == ReduceOp::Mean {
                acc.mapv_inplace(|x| $div(x, parts.len()));
            }
            Tensor::$v(acc)
        }};
    }
    match &parts[0] {
        Tensor::F32(_) => go!(F32, f32, |x: f32, y| x + y, |x: f32, n| x / n as f32),
        Tensor::F64(_) => go!(F64, f64, |x: f64, y| x + y, |x: f64, n| x / n as f64),
        Tensor::I32(_) => go!(I32, i32, i32::wrapping_add, |x: i32, n| x / n as i32),
        _ => go!(I64, i64, i64::wrapping_add, |x: i64, n| x / n as i64),
    }
}

fn float_bits(t: &Tensor) -> Vec<u64> {
    match t {
        Tensor::F32(a) => a.iter().map(|x| u64::from(x.to_bits())).collect(),
        Tensor::F64(a) => a.iter().map(|x| x.to_bits()).collect(),
        Tensor::I32(a) => a.iter().map(|&x| x as u64).collect(),
        Tensor::I64(a) => a.iter().map(|&x| x as u64).collect(),
        other => panic!("unexpected {other:?}"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// Every op, dtype and axis, with runs long and short (the fold works a page of
    /// each input at a time, two inputs per pass, then the odd one), fresh and into
    /// pooled buffers holding garbage: each replica's piece equals the sequential fold
    /// bit for bit.
    #[test]
    fn reduce_scatter_of_every_op_dtype_and_axis_is_the_sequential_fold_bit_for_bit(
        (n, dtype, shape, axis, values) in scatter_case(),
        op in prop::sample::select(ReduceOp::ALL.to_vec()),
    ) {
        let parts: Vec<Tensor> = values.iter().map(|v| typed_floats(dtype, &shape, v)).collect();
        let rt = Runtime::new(n).unwrap().with_pool(1 << 24, 0);
        let program: Arc<ReplicaFn> =
            Arc::new(move |ctx, i| Ok(vec![ctx.reduce_scatter(op, axis, i[0].clone())?]));
        let first = rt.run(program.clone(), parts.iter().map(|p| vec![p.clone()]).collect()).unwrap();
        for (d, o) in first.iter().enumerate() {
            let garbage = typed_floats(dtype, o[0].shape(), &vec![-4.5; o[0].len()]);
            rt.recycle(d, garbage).unwrap();
        }
        let second = rt.run(program, parts.iter().map(|p| vec![p.clone()]).collect()).unwrap();
        for r in 0..n {
            let want = model_piece(&parts, axis, r, op);
            prop_assert_eq!(first[r][0].shape(), want.shape());
            prop_assert_eq!(float_bits(&first[r][0]), float_bits(&want), "replica {} fresh", r);
            prop_assert_eq!(float_bits(&second[r][0]), float_bits(&want), "replica {} pooled", r);
        }
    }
}

#[test]
fn float_reductions_are_bit_identical_on_every_replica_and_run() {
    let rt = Runtime::new(4).unwrap();
    let program: Arc<ReplicaFn> =
        Arc::new(|ctx, i| Ok(vec![ctx.all_reduce(ReduceOp::Mean, i[0].clone())?]));
    let ins = || {
        (0..4)
            .map(|r| {
                vec![Tensor::F32(ArrayD::from_shape_fn(IxDyn(&[64]), |i| {
                    (i[0] as f32 + 0.1) / (r as f32 + 3.0)
                }))]
            })
            .collect()
    };
    let first = rt.run(program.clone(), ins()).unwrap();
    assert!(first.iter().all(|o| o == &first[0]));
    for _ in 0..5 {
        assert_eq!(rt.run(program.clone(), ins()).unwrap(), first);
    }
}

fn ones(n: usize) -> Vec<Vec<Tensor>> {
    (0..n).map(|_| vec![t(&[2], vec![1, 1])]).collect()
}

#[test]
fn a_failing_replica_releases_its_peers_and_the_runtime_stays_usable() {
    let rt = Runtime::new(3).unwrap();
    let program: Arc<ReplicaFn> = Arc::new(|ctx, i| {
        if ctx.replica_id() == 1 {
            return Err("out of memory".into());
        }
        Ok(vec![ctx.all_reduce(ReduceOp::Sum, i[0].clone())?])
    });
    let err = rt.run(program, ones(3)).unwrap_err();
    assert_eq!(err, Error::ReplicaFailed { replica: 1, message: "out of memory".into() });
    let ok: Arc<ReplicaFn> =
        Arc::new(|ctx, i| Ok(vec![ctx.all_reduce(ReduceOp::Sum, i[0].clone())?]));
    assert_eq!(rt.run(ok, ones(3)).unwrap()[2][0], t(&[2], vec![3, 3]));
}

#[test]
fn a_panicking_replica_is_reported_not_propagated() {
    let rt = Runtime::new(2).unwrap();
    let program: Arc<ReplicaFn> = Arc::new(|ctx, i| {
        ctx.barrier()?;
        if ctx.replica_id() == 0 {
            panic!("kernel bug");
        }
        Ok(vec![ctx.all_gather(0, i[0].clone())?])
    });
    let err = rt.run(program, ones(2)).unwrap_err();
    assert_eq!(err, Error::ReplicaPanicked { replica: 0, message: "kernel bug".into() });
}

#[test]
fn mismatched_shapes_fail_every_replica_with_both_sides_named() {
    let rt = Runtime::new(2).unwrap();
    let program: Arc<ReplicaFn> = Arc::new(|ctx, _| {
        let len = 2 + ctx.replica_id();
        Ok(vec![ctx.all_reduce(ReduceOp::Sum, t(&[len], vec![0; len]))?])
    });
    match rt.run(program, ones(2)).unwrap_err() {
        Error::Mismatch { op, group, first, replica, expected, actual } => {
            assert_eq!((op, group, first, replica), ("all_reduce", vec![0, 1], 0, 1));
            assert!(expected.contains("[2]") && actual.contains("[3]"), "{expected} / {actual}");
        }
        other => panic!("expected a mismatch, got {other}"),
    }
}

#[test]
fn a_replica_that_ends_its_run_without_a_collective_is_a_mismatch_naming_it() {
    let rt = Runtime::new(3).unwrap().with_timeout(Duration::from_secs(60));
    let program: Arc<ReplicaFn> = Arc::new(|ctx, i| {
        if ctx.replica_id() == 2 {
            return Ok(i);
        }
        Ok(vec![ctx.all_reduce(ReduceOp::Sum, i[0].clone())?])
    });
    let start = std::time::Instant::now();
    match rt.run(program, ones(3)).unwrap_err() {
        Error::Mismatch { op, group, replica, actual, .. } => {
            assert_eq!((op, group, replica), ("all_reduce", vec![0, 1, 2], 2));
            assert_eq!(actual, "the end of its run");
        }
        other => panic!("expected a mismatch, got {other}"),
    }
    assert!(start.elapsed() < Duration::from_secs(30), "waited for the timeout");
}

#[test]
fn a_replica_that_is_late_for_a_collective_times_out_naming_it() {
    let rt = Runtime::new(3).unwrap().with_timeout(Duration::from_millis(200));
    let program: Arc<ReplicaFn> = Arc::new(|ctx, i| {
        if ctx.replica_id() == 2 {
            std::thread::sleep(Duration::from_millis(600));
        }
        Ok(vec![ctx.all_reduce(ReduceOp::Sum, i[0].clone())?])
    });
    match rt.run(program, ones(3)).unwrap_err() {
        Error::Timeout { op, group, missing, .. } => {
            assert_eq!((op, group, missing), ("all_reduce", vec![0, 1, 2], vec![2]));
        }
        other => panic!("expected a timeout, got {other}"),
    }
}

#[test]
fn bad_arguments_are_typed_errors() {
    assert_eq!(Runtime::new(0).err(), Some(Error::NoDevices));
    let rt = Runtime::new(2).unwrap();
    let noop: Arc<ReplicaFn> = Arc::new(|_, i| Ok(i));
    assert_eq!(
        rt.run(noop.clone(), ones(3)).unwrap_err(),
        Error::ReplicaCount { replicas: 3, devices: 2 }
    );
    assert_eq!(rt.run(noop, vec![]).unwrap_err(), Error::ReplicaCount { replicas: 0, devices: 2 });
    let scatter: Arc<ReplicaFn> = Arc::new(|ctx, _| {
        Ok(vec![ctx.reduce_scatter(ReduceOp::Sum, 0, t(&[3], vec![1, 2, 3]))?])
    });
    assert!(matches!(
        rt.run(scatter, ones(2)).unwrap_err(),
        Error::BadArgument { op: "reduce_scatter", .. }
    ));
    let axis: Arc<ReplicaFn> = Arc::new(|ctx, i| Ok(vec![ctx.all_gather(1, i[0].clone())?]));
    assert!(matches!(
        rt.run(axis, ones(2)).unwrap_err(),
        Error::BadArgument { op: "all_gather", .. }
    ));
    let groups: Arc<ReplicaFn> = Arc::new(|ctx, _| {
        Ok(vec![ctx.groups(vec![vec![0], vec![0, 1]]).map(|_| t(&[0], vec![]))?])
    });
    assert!(matches!(rt.run(groups, ones(2)).unwrap_err(), Error::BadGroups { .. }));
    let perm: Arc<ReplicaFn> =
        Arc::new(|ctx, i| Ok(vec![ctx.collective_permute(&[(0, 1), (1, 1)], i[0].clone())?]));
    assert!(matches!(
        rt.run(perm, ones(2)).unwrap_err(),
        Error::BadArgument { op: "collective_permute", .. }
    ));
    // An output buffer of the wrong shape or dtype names both.
    let into: Arc<ReplicaFn> = Arc::new(|ctx, i| {
        let all = ctx.groups(vec![vec![0, 1]])?;
        Ok(vec![ctx.all_gather_into(&all, 0, i[0].clone(), t(&[3], vec![0, 0, 0]))?])
    });
    match rt.run(into, ones(2)).unwrap_err() {
        Error::BadArgument { op: "all_gather", problem, .. } => assert!(
            problem.contains("the output buffer is i64[3], the result is i64[4]"),
            "{problem}"
        ),
        other => panic!("{other:?}"),
    }
}

fn typed(dtype: DType, shape: &[usize], data: &[i64]) -> Tensor {
    let a = ArrayD::from_shape_vec(IxDyn(shape), data.to_vec()).unwrap();
    match dtype {
        DType::F32 => Tensor::F32(a.mapv(|x| x as f32)),
        DType::F64 => Tensor::F64(a.mapv(|x| x as f64)),
        DType::I32 => Tensor::I32(a.mapv(|x| x as i32)),
        _ => Tensor::I64(a),
    }
}

fn as_f64(t: &Tensor) -> ArrayD<f64> {
    match t {
        Tensor::F32(a) => a.mapv(f64::from),
        Tensor::F64(a) => a.clone(),
        Tensor::I32(a) => a.mapv(f64::from),
        Tensor::I64(a) => a.mapv(|x| x as f64),
        other => panic!("unexpected {other:?}"),
    }
}

/// The sequential fold in f64 (exact for these small integers), with each dtype's mean.
fn model_typed(dtype: DType, parts: &[ArrayD<f64>], op: ReduceOp) -> ArrayD<f64> {
    let mut acc = parts[0].clone();
    for p in &parts[1..] {
        acc.zip_mut_with(p, |x, &y| {
            *x = match op {
                ReduceOp::Sum | ReduceOp::Mean => *x + y,
                ReduceOp::Min => x.min(y),
                ReduceOp::Max => x.max(y),
            }
        });
    }
    let n = parts.len();
    if op == ReduceOp::Mean {
        acc.mapv_inplace(|s| match dtype {
            DType::F32 => f64::from(s as f32 / n as f32),
            DType::F64 => s / n as f64,
            _ => ((s as i64) / n as i64) as f64,
        });
    }
    acc
}

/// Replica count, groups, dtype, shape, per-replica data.
type GroupedCase = (usize, Vec<Vec<usize>>, DType, Vec<usize>, Vec<Vec<i64>>);

/// 1–16 replicas split into random equal groups, a dtype, a shape and data.
fn grouped() -> impl Strategy<Value = GroupedCase> {
    (1usize..=16, 1usize..=16, 1usize..4, 1usize..4).prop_flat_map(|(n, g, rows, cols)| {
        let divisors: Vec<usize> = (1..=n).filter(|d| n % d == 0).collect();
        let size = divisors[g % divisors.len()];
        let perm = Just((0..n).collect::<Vec<_>>()).prop_shuffle();
        let groups = perm.prop_map(move |p| p.chunks(size).map(|c| c.to_vec()).collect::<Vec<_>>());
        let dtype = prop::sample::select(vec![DType::F32, DType::F64, DType::I32, DType::I64]);
        let data = prop::collection::vec(prop::collection::vec(-1000i64..1000, rows * cols), n);
        (Just(n), groups, dtype, Just(vec![rows, cols]), data)
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn grouped_collectives_of_every_dtype_match_the_model(
        (n, groups, dtype, shape, data) in grouped(),
        op in prop::sample::select(ReduceOp::ALL.to_vec()),
    ) {
        let rt = Runtime::new(n).unwrap();
        let g = groups.clone();
        let program: Arc<ReplicaFn> = Arc::new(move |ctx, i| {
            let groups = ctx.groups(g.clone())?;
            let reduced = ctx.all_reduce_in(&groups, op, i[0].clone())?;
            let gathered = ctx.all_gather_in(&groups, 1, i[0].clone())?;
            Ok(vec![reduced, gathered])
        });
        let ins = data.iter().map(|d| vec![typed(dtype, &shape, d)]).collect();
        let out = rt.run(program, ins).unwrap();
        let first_of_group: Vec<&Vec<Tensor>> = groups.iter().map(|g| &out[g[0]]).collect();
        for (group, first) in groups.iter().zip(first_of_group) {
            let parts: Vec<ArrayD<f64>> = group.iter().map(|&m| as_f64(&typed(dtype, &shape, &data[m]))).collect();
            let views: Vec<_> = parts.iter().map(|p| p.view()).collect();
            let gathered = ndarray::concatenate(Axis(1), &views).unwrap();
            for &m in group {
                prop_assert_eq!(out[m][0].dtype(), dtype);
                // Bit-identical across the group, and equal to the model.
                prop_assert_eq!(&out[m], first);
                prop_assert_eq!(as_f64(&out[m][0]), model_typed(dtype, &parts, op));
                prop_assert_eq!(as_f64(&out[m][1]), gathered.clone());
            }
        }
    }
}

#[test]
fn emit_reaches_the_sink_in_each_replicas_order() {
    use meshwork_executor::{OutfeedSink, ReplicaError};
    use std::sync::Mutex;
    #[derive(Default)]
    struct Record(Mutex<Vec<(usize, u32, i64)>>);
    impl OutfeedSink for Record {
        fn emit(
            &self,
            replica: usize,
            consumer_id: u32,
            tensors: &[Tensor],
        ) -> Result<(), ReplicaError> {
            if consumer_id == 0 {
                return Err("consumer 0 is the shutdown marker".into());
            }
            self.0.lock().unwrap().push((replica, consumer_id, arr(&tensors[0])[[0]]));
            Ok(())
        }
    }
    let sink = Arc::new(Record::default());
    let rt = Runtime::new(3).unwrap().with_sink(sink.clone());
    let program: Arc<ReplicaFn> = Arc::new(|ctx, _| {
        for step in 0..4 {
            ctx.emit(7, &[t(&[1], vec![step * 10 + ctx.replica_id() as i64])])?;
        }
        assert_eq!(ctx.device().0 as usize, ctx.replica_id());
        Ok(vec![])
    });
    rt.run(program, vec![vec![]; 3]).unwrap();
    let got = sink.0.lock().unwrap().clone();
    for r in 0..3 {
        let mine: Vec<i64> = got.iter().filter(|e| e.0 == r && e.1 == 7).map(|e| e.2).collect();
        assert_eq!(mine, (0..4).map(|s| s * 10 + r as i64).collect::<Vec<_>>());
    }
    let bad: Arc<ReplicaFn> = Arc::new(|ctx, _| Ok(ctx.emit(0, &[]).map(|()| vec![])?));
    match rt.run(bad, vec![vec![]; 1]).unwrap_err() {
        Error::Outfeed { replica: 0, message } => {
            assert!(message.contains("shutdown marker"), "{message}")
        }
        other => panic!("expected an outfeed error, got {other}"),
    }
    let no_sink: Arc<ReplicaFn> = Arc::new(|ctx, _| Ok(ctx.emit(1, &[]).map(|()| vec![])?));
    assert!(matches!(
        Runtime::new(1).unwrap().run(no_sink, vec![vec![]]).unwrap_err(),
        Error::Outfeed { replica: 0, .. }
    ));
}

/// `run_on` puts replica `r` on device `placement[r]`: its context and its thread say
/// so, collectives still go by replica order, and a placement that reuses or invents a
/// device is refused.
#[test]
fn run_on_places_replicas_on_the_devices_named() {
    let rt = Runtime::new(4).unwrap();
    let program: Arc<ReplicaFn> = Arc::new(|ctx, i| {
        let thread = std::thread::current().name().unwrap_or_default().to_string();
        let want = format!("meshwork-cpu:{}", ctx.device().0);
        assert_eq!(thread, want, "replica {} runs on its device's thread", ctx.replica_id());
        let device = Tensor::I64(ArrayD::from_elem(IxDyn(&[1]), i64::from(ctx.device().0)));
        Ok(vec![device, ctx.all_gather(0, i[0].clone())?])
    });
    let placement = [3, 0, 2];
    let inputs = (0..3).map(|r| vec![t(&[1], vec![r as i64])]).collect();
    let out = rt.run_on(program.clone(), inputs, &placement).unwrap();
    for (r, o) in out.iter().enumerate() {
        assert_eq!(o[0], Tensor::I64(ArrayD::from_elem(IxDyn(&[1]), placement[r] as i64)));
        assert_eq!(o[1], t(&[3], vec![0, 1, 2]));
    }
    for bad in [&[0, 0, 1][..], &[0, 1, 4], &[0, 1]] {
        let inputs = (0..3).map(|r| vec![t(&[1], vec![r as i64])]).collect();
        assert!(matches!(rt.run_on(program.clone(), inputs, bad), Err(Error::Placement { .. })));
    }
}

/// `first_difference_in` compares a group's tensors bit for bit: the first differing
/// rank, or none; `-0.0` differs from `0.0`, a NaN equals its own bits; every member
/// gets the same verdict, and the caller's `Arc` is its only reference afterwards.
#[test]
fn first_difference_compares_bits_and_gives_every_member_one_verdict() {
    let rt = Runtime::new(4).unwrap();
    let f = |v: f32| Tensor::F32(ArrayD::from_elem(IxDyn(&[3]), v));
    let cases: Vec<(Vec<Tensor>, [Option<usize>; 2])> = vec![
        (vec![f(1.0), f(1.0), f(2.0), f(2.0)], [None, None]),
        (vec![f(1.0), f(1.5), f(2.0), f(2.0)], [Some(1), None]),
        (vec![f(0.0), f(0.0), f(0.0), f(-0.0)], [None, Some(1)]),
        (vec![f(f32::NAN), f(f32::NAN), f(1.0), f(1.0)], [None, None]),
    ];
    for (inputs, want) in cases {
        let program: Arc<ReplicaFn> = Arc::new(|ctx, i| {
            let groups = ReplicaGroups::new(vec![vec![0, 1], vec![2, 3]], 4).unwrap();
            let mine = Arc::new(i[0].clone());
            let verdict = ctx.first_difference_in(&groups, mine.clone())?;
            assert_eq!(Arc::strong_count(&mine), 1, "the tensor is the caller's again");
            Ok(vec![Tensor::I64(ArrayD::from_elem(IxDyn(&[1]), verdict.map_or(-1, |k| k as i64)))])
        });
        let out = rt.run(program, inputs.into_iter().map(|t| vec![t]).collect()).unwrap();
        for (r, o) in out.iter().enumerate() {
            let w = want[r / 2].map_or(-1, |k| k as i64);
            assert_eq!(o[0], Tensor::I64(ArrayD::from_elem(IxDyn(&[1]), w)), "replica {r}");
        }
    }
}
