//! A random replica fails at a random collective: the run always ends, promptly, with
//! that replica's error, and the devices are free for the next run.

use std::sync::Arc;
use std::time::{Duration, Instant};

use meshwork_executor::{Error, ReplicaFn, ReplicaGroups, Runtime, Tensor};
use meshwork_types::ReduceOp;
use ndarray::{ArrayD, IxDyn};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

#[test]
fn a_random_failure_at_a_random_collective_always_ends_the_run_with_its_error() {
    // Panics are expected here by the hundred; keep the log readable.
    std::panic::set_hook(Box::new(|_| {}));
    let timeout = Duration::from_secs(20);
    let rt = Runtime::new(8).unwrap().with_timeout(timeout);
    let mut runner = TestRunner::new(Config { cases: 240, ..Config::default() });
    let case = (2usize..=8, 0usize..8, 0usize..7, any::<bool>());
    runner
        .run(&case, |(n, failing, at, panics)| {
            let failing = failing % n;
            let program: Arc<ReplicaFn> = Arc::new(move |ctx, i| {
                let mut t = i[0].clone();
                let all = ReplicaGroups::all(ctx.num_replicas());
                for step in 0..7 {
                    if ctx.replica_id() == failing && step == at {
                        if panics {
                            panic!("injected panic at step {step}");
                        }
                        return Err(format!("injected error at step {step}").into());
                    }
                    t = match step % 5 {
                        0 => ctx.all_reduce(ReduceOp::Sum, t)?,
                        1 => ctx.broadcast(0, t)?,
                        // Three tensors of 32 bytes in buckets of 64: two rendezvous.
                        3 => {
                            let many = vec![t.clone(), t.clone(), t];
                            let mut out = ctx.all_reduce_fused(&all, ReduceOp::Max, many, 64)?;
                            out.pop().expect("three results")
                        }
                        // A reduce-scatter (shared chunks) of the tensor repeated once
                        // per replica, back to the tensor's shape; then an all-gather and
                        // a reduce-scatter of it.
                        4 => {
                            let n = ctx.num_replicas();
                            let Tensor::F64(a) = &t else { unreachable!("f64 inputs") };
                            let views = vec![a.view(); n];
                            let tiled = ndarray::concatenate(ndarray::Axis(0), &views).unwrap();
                            let t = ctx.reduce_scatter(ReduceOp::Max, 0, Tensor::F64(tiled))?;
                            let all = ctx.all_gather(0, t)?;
                            ctx.reduce_scatter(ReduceOp::Max, 0, all)?
                        }
                        _ => {
                            ctx.barrier()?;
                            t
                        }
                    };
                }
                Ok(vec![t])
            });
            let inputs = (0..n).map(|_| vec![Tensor::F64(ArrayD::ones(IxDyn(&[4])))]).collect();
            let start = Instant::now();
            let err = rt.run(program, inputs).unwrap_err();
            prop_assert!(
                start.elapsed() < timeout,
                "a peer waited for the timeout instead of being released"
            );
            let message =
                format!("injected {} at step {at}", if panics { "panic" } else { "error" });
            let want = if panics {
                Error::ReplicaPanicked { replica: failing, message }
            } else {
                Error::ReplicaFailed { replica: failing, message }
            };
            prop_assert_eq!(err, want);
            Ok(())
        })
        .unwrap();
    // Every device thread is free: a full-width run still completes.
    let ok: Arc<ReplicaFn> =
        Arc::new(|ctx, i| Ok(vec![ctx.all_reduce(ReduceOp::Max, i[0].clone())?]));
    let inputs = (0..8).map(|r| vec![Tensor::I32(ArrayD::from_elem(IxDyn(&[1]), r))]).collect();
    assert!(
        rt.run(ok, inputs)
            .unwrap()
            .iter()
            .all(|o| o[0] == Tensor::I32(ArrayD::from_elem(IxDyn(&[1]), 7)))
    );
    drop(rt); // joins every device thread: a blocked one would hang here
}

/// Replicas that call one collective with different replica groups (or where one never
/// comes) get `Mismatch` at once, not after the timeout. Cases (4 replicas), each a
/// deadlock the rendezvous must see:
/// - replica 0 with `[[0, 1], [2, 3]]`, the others with one group of all four;
/// - replicas 0, 1 with `[[0, 1], [2, 3]]` (they complete), 2 and 3 with
///   `[[0, 2], [1, 3]]`, and 0 and 1 end their runs without coming;
/// - the same groups everywhere but replica 3 skips the collective and ends its run;
/// - two rounds with the same groups, then replica 1 alone uses other groups.
#[test]
fn replicas_calling_a_collective_with_different_groups_get_mismatch_at_once() {
    let timeout = Duration::from_secs(30);
    let rt = Runtime::new(4).unwrap().with_timeout(timeout);
    let g = |groups: Vec<Vec<usize>>| ReplicaGroups::new(groups, 4).unwrap();
    type Choose = fn(usize, usize) -> Option<Vec<Vec<usize>>>;
    let cases: [(&str, usize, Choose); 4] = [
        ("one replica with pairs", 1, |r, _| {
            Some(if r == 0 { vec![vec![0, 1], vec![2, 3]] } else { vec![vec![0, 1, 2, 3]] })
        }),
        ("pairs vs crossed pairs", 1, |r, _| {
            Some(if r < 2 { vec![vec![0, 1], vec![2, 3]] } else { vec![vec![0, 2], vec![1, 3]] })
        }),
        ("one replica skips", 1, |r, _| (r != 3).then(|| vec![vec![0, 1, 2, 3]])),
        ("diverging in round 3", 3, |r, round| {
            Some(if r == 1 && round == 2 {
                vec![vec![0, 2], vec![1, 3]]
            } else {
                vec![vec![0, 1], vec![2, 3]]
            })
        }),
    ];
    for (name, rounds, choose) in cases {
        let program: Arc<ReplicaFn> = Arc::new(move |ctx, i| {
            let mut t = i[0].clone();
            for round in 0..rounds {
                if let Some(groups) = choose(ctx.replica_id(), round) {
                    t = ctx.all_reduce_in(&g(groups), ReduceOp::Sum, t)?;
                }
            }
            Ok(vec![t])
        });
        let inputs = (0..4).map(|_| vec![Tensor::F32(ArrayD::ones(IxDyn(&[3])))]).collect();
        let start = Instant::now();
        let err = rt.run(program, inputs).unwrap_err();
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{name}: took {:?} (the timeout is {timeout:?})",
            start.elapsed()
        );
        assert!(matches!(err, Error::Mismatch { .. }), "{name}: {err}");
    }
    // The runtime is usable afterwards, and pairs that agree complete.
    let program: Arc<ReplicaFn> = Arc::new(move |ctx, i| {
        Ok(vec![ctx.all_reduce_in(
            &g(vec![vec![0, 1], vec![2, 3]]),
            ReduceOp::Sum,
            i[0].clone(),
        )?])
    });
    let inputs = (0..4).map(|_| vec![Tensor::F32(ArrayD::ones(IxDyn(&[3])))]).collect();
    let out = rt.run(program, inputs).unwrap();
    assert!(out.iter().all(|o| o[0] == Tensor::F32(ArrayD::from_elem(IxDyn(&[3]), 2.0))));
}
