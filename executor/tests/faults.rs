//! A random replica fails at a random collective: the run always ends, promptly, with
//! that replica's error, and the devices are free for the next run.

use std::sync::Arc;
use std::time::{Duration, Instant};

use meshwork_executor::{Error, Program, Runtime, Tensor};
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
    let case = (2usize..=8, 0usize..8, 0usize..5, any::<bool>());
    runner
        .run(&case, |(n, failing, at, panics)| {
            let failing = failing % n;
            let program: Arc<Program> = Arc::new(move |ctx, i| {
                let mut t = i[0].clone();
                for step in 0..5 {
                    if ctx.replica_id() == failing && step == at {
                        if panics {
                            panic!("injected panic at step {step}");
                        }
                        return Err(format!("injected error at step {step}").into());
                    }
                    t = match step % 3 {
                        0 => ctx.all_reduce(ReduceOp::Sum, t)?,
                        1 => ctx.broadcast(0, t)?,
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
    let ok: Arc<Program> =
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
