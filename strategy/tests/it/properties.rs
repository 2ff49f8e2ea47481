//! Properties: data parallelism equals one replica on the whole batch, and splitting
//! over logical devices loses nothing.

use meshwork_strategy::{
    Arg, DeviceAssignment, PerReplica, ReduceOp, Strategy, Tensor, Topology, VariableOptions,
};
use ndarray::{Array2, ArrayD, Ix2, IxDyn};
use proptest::prelude::*;

use crate::{as_f64, f64s};

fn mat(t: &Tensor) -> Array2<f64> {
    match t {
        Tensor::F64(a) => a.clone().into_dimensionality::<Ix2>().unwrap(),
        other => panic!("{other:?}"),
    }
}

/// Runs `steps` steps of least-squares gradient descent on `replicas` replicas of
/// `logical` logical devices, each replica on its rows of the batch and each logical
/// device on its block of the weights (split by rows, model parallel); returns the
/// weights after every step.
fn train(
    replicas: usize,
    logical: usize,
    x: &Array2<f64>,
    y: &Array2<f64>,
    steps: usize,
) -> Vec<Vec<f64>> {
    let topology = Topology::new(vec![replicas * logical], logical).unwrap();
    let s = Strategy::new(DeviceAssignment::build(&topology, &[logical], None).unwrap()).unwrap();
    let d = x.ncols();
    let split = VariableOptions {
        layout: meshwork_strategy::Layout::Split(vec![logical, 1]),
        ..Default::default()
    };
    let init: Vec<f64> = (0..d).map(|i| 0.1 * (i as f64 + 1.0)).collect();
    let w = s.create_variable("w", f64s(&[d, 1], init), split).unwrap();
    let batch = vec![Tensor::F64(x.clone().into_dyn()), Tensor::F64(y.clone().into_dyn())];
    let data = s
        .distribute_dataset(vec![batch], meshwork_strategy::Remainder::Drop)
        .next()
        .unwrap()
        .unwrap();
    let n = Tensor::F64(ndarray::arr0(x.nrows() as f64).into_dyn());
    let mut args = data.args.clone();
    args.push(Arg::Shared(n));
    let mut out = Vec::new();
    for _ in 0..steps {
        let v = w.clone();
        s.run(
            move |ctx, a| {
                let (x, y, n) = (mat(&a[0]), mat(&a[1]), as_f64(&a[2])[0]);
                // This logical device's columns of x meet its rows of w.
                let x = mat(&ctx.split_to_logical_devices(
                    &Tensor::F64(x.into_dyn()),
                    &[1, ctx.num_logical_devices()],
                )?);
                let w = mat(&ctx.read(&v)?);
                let partial = Tensor::F64(x.dot(&w).into_dyn());
                let prediction = mat(&ctx.all_reduce_logical(ReduceOp::Sum, partial)?);
                let residual = prediction - &y;
                let local = x.t().dot(&residual).into_dyn();
                let grad = ctx.all_reduce(ReduceOp::Sum, Tensor::F64(local))?;
                let update = mat(&grad) * (0.1 / n);
                ctx.assign(&v, Tensor::F64((w - update).into_dyn()))?;
                Ok(vec![])
            },
            &args,
        )
        .unwrap();
        out.push(as_f64(&s.read_variable(&w).unwrap()));
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn a_step_on_any_mesh_equals_one_device_on_the_whole_batch(
        replicas in 1usize..=4,
        logical in prop::sample::select(vec![1usize, 2, 4]),
        rows_each in 1usize..4,
        blocks in 1usize..3,
        seed in any::<u64>(),
    ) {
        let rows = replicas * rows_each;
        let d = logical * blocks;
        let mut state = seed | 1;
        let mut next = || { state ^= state << 13; state ^= state >> 7; state ^= state << 17; (state % 2001) as f64 / 1000.0 - 1.0 };
        let x = Array2::from_shape_fn((rows, d), |_| next());
        let y = Array2::from_shape_fn((rows, 1), |_| next());
        let many = train(replicas, logical, &x, &y, 3);
        let one = train(1, 1, &x, &y, 3);
        for (a, b) in many.iter().flatten().zip(one.iter().flatten()) {
            prop_assert!((a - b).abs() <= 1e-12 * b.abs().max(1e-300), "{a} vs {b}");
        }
    }

    #[test]
    fn splitting_over_logical_devices_then_gathering_is_the_identity(
        split in prop::sample::select(vec![vec![1usize, 1], vec![2, 1], vec![1, 2], vec![2, 2], vec![4, 1], vec![1, 4]]),
        k in 1usize..3,
        seed in any::<i64>(),
    ) {
        let logical: usize = split.iter().product();
        let shape = vec![split[0] * k * 2, split[1] * k];
        let n: usize = shape.iter().product();
        let t = Tensor::I64(ArrayD::from_shape_vec(IxDyn(&shape), (0..n as i64).map(|i| i.wrapping_mul(seed)).collect()).unwrap());
        let topology = Topology::new(vec![logical], logical).unwrap();
        let s = Strategy::new(DeviceAssignment::build(&topology, &[logical], None).unwrap()).unwrap();
        let (t2, dims) = (t.clone(), split.clone());
        let out = s.run(move |ctx, _| {
            let mine = ctx.split_to_logical_devices(&t2, &dims)?;
            let expanded = match &mine { Tensor::I64(a) => Tensor::I64(a.clone().insert_axis(ndarray::Axis(0))), _ => unreachable!() };
            Ok(vec![ctx.all_gather_logical(expanded, 0)?])
        }, &[]).unwrap();
        let Tensor::I64(stacked) = &out.values()[0][0] else { panic!() };
        let hlo = meshwork_sharding::split_to_logical_devices(&shape, &split, logical).unwrap();
        let sharding = meshwork_sharding::Sharding::new(hlo, (0..logical as u32).map(meshwork_types::DeviceId).collect()).unwrap();
        let views: Vec<_> = stacked.outer_iter().collect();
        let back = meshwork_sharding::assemble(&views, &sharding, &shape, meshwork_sharding::Mode::Strict).unwrap();
        prop_assert_eq!(Tensor::I64(back), t);
    }

    #[test]
    fn sum_reductions_over_an_axis_equal_the_sum_of_the_gathered_value(
        rows in prop::collection::vec(0usize..4, 1..5),
        seed in any::<u32>(),
    ) {
        prop_assume!(rows.iter().sum::<usize>() > 0);
        let s = Strategy::data_parallel(rows.len()).unwrap();
        let values = PerReplica::new(rows.iter().enumerate().map(|(r, &n)| {
            f64s(&[n, 2], (0..2 * n).map(|i| ((i as u32 ^ seed).wrapping_add(r as u32) % 97) as f64).collect())
        }).collect());
        let all = as_f64(&s.gather(&values, 0).unwrap());
        let total: f64 = all.iter().sum();
        let sum = as_f64(&s.reduce(ReduceOp::Sum, &values, Some(0)).unwrap());
        prop_assert_eq!(sum.iter().sum::<f64>(), total);
        let mean = as_f64(&s.reduce(ReduceOp::Mean, &values, Some(0)).unwrap());
        let count = rows.iter().sum::<usize>() as f64;
        prop_assert!((mean.iter().sum::<f64>() - total / count).abs() < 1e-9);
    }
}
