//! Fused all-reduce of many small tensors against the unfused calls, bit for bit, and
//! against a sequential fold; mismatched tensor lists are typed errors.

use std::sync::Arc;

use meshwork_executor::{Error, ReplicaFn, Runtime, Tensor};
use meshwork_types::ReduceOp;
use ndarray::{ArrayD, IxDyn};
use proptest::prelude::*;

/// The bits of every element, for exact comparison of floats (`-0.0` and NaN
/// included).
fn bits(t: &Tensor) -> (Vec<usize>, Vec<u64>) {
    let shape = t.shape().to_vec();
    let v = match t {
        Tensor::F32(a) => a.iter().map(|x| u64::from(x.to_bits())).collect(),
        Tensor::F64(a) => a.iter().map(|x| x.to_bits()).collect(),
        Tensor::I32(a) => a.iter().map(|&x| x as u32 as u64).collect(),
        Tensor::I64(a) => a.iter().map(|&x| x as u64).collect(),
        other => panic!("{other:?}"),
    };
    (shape, v)
}

/// A pseudo-random value for (replica, tensor, element) from `seed`.
fn value(seed: u64, r: usize, i: usize, e: usize) -> f64 {
    let mut x = seed ^ ((r as u64) << 40) ^ ((i as u64) << 20) ^ e as u64;
    x = x.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    x ^= x >> 29;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 32;
    (x % 2_000_001) as f64 / 997.0 - 1000.0
}

/// Replica `r`'s tensors: `specs` are (dtype 0..4, shape).
fn tensors(specs: &[(usize, Vec<usize>)], seed: u64, r: usize) -> Vec<Tensor> {
    specs
        .iter()
        .enumerate()
        .map(|(i, (dtype, shape))| {
            let len: usize = shape.iter().product();
            let v: Vec<f64> = (0..len).map(|e| value(seed, r, i, e)).collect();
            let a = ArrayD::from_shape_vec(IxDyn(shape), v).unwrap();
            match dtype {
                0 => Tensor::F32(a.mapv(|x| x as f32)),
                1 => Tensor::F64(a),
                2 => Tensor::I32(a.mapv(|x| (x * 1e6) as i32)),
                _ => Tensor::I64(a.mapv(|x| (x * 1e15) as i64)),
            }
        })
        .collect()
}

fn spec() -> impl Strategy<Value = (usize, Vec<usize>)> {
    (0usize..4, prop::collection::vec(0usize..5, 0..3))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Any list of tensors of mixed dtypes and shapes (empty and scalar ones too), any
    /// bucket size (from everything alone to everything in one bucket per dtype), any
    /// reduction: the fused results are bit for bit the unfused ones, on every
    /// replica, and the integer sums equal a sequential fold.
    #[test]
    fn fused_all_reduce_is_bit_identical_to_unfused_calls(
        n in 1usize..6,
        specs in prop::collection::vec(spec(), 0..14),
        bucket in prop::sample::select(vec![0usize, 1, 8, 24, 64, 200, 1 << 20]),
        op in prop::sample::select(ReduceOp::ALL.to_vec()),
        seed in any::<u64>(),
    ) {
        let rt = Runtime::new(n).unwrap().with_pool(1 << 20, 0);
        let program: Arc<ReplicaFn> = Arc::new(move |ctx, i| {
            let all = ctx.groups(vec![(0..ctx.num_replicas()).collect()])?;
            let fused = ctx.all_reduce_fused(&all, op, i.clone(), bucket)?;
            let mut out = fused;
            for t in i {
                out.push(ctx.all_reduce(op, t)?);
            }
            Ok(out)
        });
        let inputs: Vec<Vec<Tensor>> = (0..n).map(|r| tensors(&specs, seed, r)).collect();
        let others: Vec<Vec<Tensor>> = (0..n).map(|r| tensors(&specs, !seed, r)).collect();
        let k = specs.len();
        // Three runs: the inputs, other values (whose sums the buckets then hold when
        // they go back to the pool), and the inputs again into those pooled buckets —
        // which must come out as the first run did.
        let mut first: Option<Vec<Vec<Tensor>>> = None;
        for run in 0..3 {
            let out = rt.run(program.clone(), if run == 1 { others.clone() } else { inputs.clone() }).unwrap();
            if run == 1 {
                continue;
            }
            if let Some(first) = &first {
                prop_assert_eq!(&out, first, "a run into pooled buckets of other sums");
            }
            first.get_or_insert_with(|| out.clone());
            for o in &out {
                prop_assert_eq!(o.len(), 2 * k);
                for j in 0..k {
                    prop_assert_eq!(bits(&o[j]), bits(&o[k + j]), "tensor {}", j);
                    prop_assert_eq!(bits(&o[j]), bits(&out[0][j]));
                }
            }
            for (j, t) in out[0][..k].iter().enumerate() {
                if let (Tensor::I64(got), ReduceOp::Sum) = (t, op) {
                    let mut want = ArrayD::<i64>::zeros(IxDyn(&specs[j].1));
                    for input in &inputs {
                        let Tensor::I64(x) = &input[j] else { unreachable!() };
                        want.zip_mut_with(x, |a, &b| *a = a.wrapping_add(b));
                    }
                    prop_assert_eq!(got, &want);
                }
            }
        }
    }
}

/// Replicas whose tensor lists differ (in a shape, or in how many there are) get a
/// typed mismatch, never a silently wrong reduction.
#[test]
fn fused_lists_that_differ_between_replicas_are_a_mismatch() {
    let rt = Runtime::new(2).unwrap();
    let f32s = |shape: &[usize]| Tensor::F32(ArrayD::zeros(IxDyn(shape)));
    for other in
        [vec![f32s(&[4]), f32s(&[2])], vec![f32s(&[6])], vec![f32s(&[2]), f32s(&[4]), f32s(&[0])]]
    {
        let other = Arc::new(other);
        let program: Arc<ReplicaFn> = Arc::new(move |ctx, _| {
            let all = ctx.groups(vec![vec![0, 1]])?;
            let mine =
                if ctx.replica_id() == 0 { vec![f32s(&[2]), f32s(&[4])] } else { (*other).clone() };
            Ok(ctx.all_reduce_fused(&all, ReduceOp::Sum, mine, 1 << 10)?)
        });
        match rt.run(program, vec![vec![], vec![]]).unwrap_err() {
            Error::Mismatch { op: "all_reduce", replica: 1, .. } => {}
            e => panic!("expected a mismatch naming replica 1, got {e}"),
        }
    }
}
