//! The transposes of the collectives, checked across real replicas: for each
//! collective `C` (linear in its operand), the gradient program `vjp` computes `Cᵀ`,
//! so `Σ_r ⟨C(x)_r, y_r⟩ = Σ_r ⟨x_r, Cᵀ(y)_r⟩` for random `x` and `y` on every replica
//! — the adjoint identity, an oracle that does not depend on the rules under test.

use std::sync::{Arc, Mutex, PoisonError};

use meshwork_program::fast::{Executable, Options};
use meshwork_program::{Builder, Env, Program, Tensor, Value, vjp};
use meshwork_types::ReduceOp;

use super::{MeshCollectives, run_replicas};
use crate::Strategy;

/// A deterministic stream in [-1, 1).
fn noise(seed: &mut u64, n: usize) -> Vec<f64> {
    (0..n)
        .map(|_| {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            (*seed >> 11) as f64 / (1u64 << 52) as f64 - 1.0
        })
        .collect()
}

/// Runs `program` once on each of `n` replicas with the executor's collectives;
/// `inputs[r]` are replica r's.
fn run(strategy: &Strategy, program: &Program, inputs: Vec<Vec<Tensor>>) -> Vec<Vec<Tensor>> {
    let n = inputs.len();
    let exe = Arc::new(Executable::compile(program, Options::default().threads(1)));
    let slots: Arc<Vec<Mutex<Vec<Tensor>>>> =
        Arc::new(inputs.into_iter().map(Mutex::new).collect());
    let s = slots.clone();
    run_replicas(
        strategy.runtime(),
        &(0..n).collect::<Vec<_>>(),
        Arc::new(move |ctx| {
            let r = ctx.replica_id();
            let mut slot = s[r].lock().unwrap_or_else(PoisonError::into_inner);
            let coll = MeshCollectives::new(ctx);
            let out = exe
                .run(&slot, &Env::local().with_collectives(&coll))
                .map_err(|e| coll.failure(e))?;
            *slot = out;
            Ok(())
        }),
    )
    .unwrap();
    slots.iter().map(|m| std::mem::take(&mut *m.lock().unwrap())).collect()
}

fn dot(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.spec(), b.spec());
    a.to_f64().iter().zip(b.to_f64()).map(|(x, y)| x * y).sum()
}

#[test]
fn collectives_transpose_to_their_adjoints_across_replicas() {
    let strategy = Strategy::data_parallel(4).unwrap();
    let pairs = [vec![0, 1], vec![2, 3]];
    let all = [vec![0, 1, 2, 3]];
    type Make = Box<dyn Fn(&mut Builder, Value) -> Value>;
    let cases: Vec<(&str, Make)> = vec![
        ("all_reduce sum", Box::new(move |b, x| b.all_reduce(x, ReduceOp::Sum, &pairs).unwrap())),
        ("all_reduce mean", Box::new(move |b, x| b.all_reduce(x, ReduceOp::Mean, &all).unwrap())),
        ("all_gather 0", Box::new(|b, x| b.all_gather(x, 0, &[vec![0, 1], vec![2, 3]]).unwrap())),
        ("all_gather 1", Box::new(|b, x| b.all_gather(x, 1, &[vec![0, 1, 2, 3]]).unwrap())),
        (
            "reduce_scatter 0",
            Box::new(|b, x| {
                b.reduce_scatter(x, ReduceOp::Sum, 0, &[vec![0, 1], vec![2, 3]]).unwrap()
            }),
        ),
        (
            "reduce_scatter 1, groups out of order",
            Box::new(|b, x| {
                b.reduce_scatter(x, ReduceOp::Sum, 1, &[vec![3, 0], vec![2, 1]]).unwrap()
            }),
        ),
        ("all_to_all", Box::new(|b, x| b.all_to_all(x, 0, 1, &[vec![0, 1], vec![2, 3]]).unwrap())),
        (
            "collective_permute ring",
            Box::new(|b, x| b.collective_permute(x, &[(0, 1), (1, 2), (2, 3), (3, 0)]).unwrap()),
        ),
        (
            "collective_permute partial",
            Box::new(|b, x| b.collective_permute(x, &[(0, 2)]).unwrap()),
        ),
    ];
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    for (name, make) in cases {
        let mut b = Builder::new();
        let x = b.param("x", "f64[4,6]".parse().unwrap()).unwrap();
        let y = make(&mut b, x);
        let forward = b.finish(&[y]).unwrap();
        let back = vjp(&forward, &[x]).unwrap();
        let out_spec = forward.spec(y).unwrap().clone();
        let inputs: Vec<Vec<Tensor>> = (0..4)
            .map(|_| {
                let xs = Tensor::f64(&[4, 6], noise(&mut seed, 24)).unwrap();
                let n = out_spec.shape.num_elements();
                let ys = Tensor::f64(out_spec.shape.dims(), noise(&mut seed, n)).unwrap();
                vec![xs, ys]
            })
            .collect();
        let out = run(&strategy, &back, inputs.clone());
        let lhs: f64 = out.iter().zip(&inputs).map(|(o, i)| dot(&o[0], &i[1])).sum();
        let rhs: f64 = out.iter().zip(&inputs).map(|(o, i)| dot(&i[0], &o[1])).sum();
        assert!(
            (lhs - rhs).abs() <= 1e-12 * (1.0 + lhs.abs()),
            "{name}: ⟨Cx, y⟩ = {lhs}, ⟨x, Cᵀy⟩ = {rhs}\n{back}"
        );
    }
}
