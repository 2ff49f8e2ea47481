//! The MLP job as a library: losses are bit-reproducible on any number of data
//! replicas, a stop request ends the run after the current host call.

use std::ops::ControlFlow;

use crate::mlp::{self, Dataset, Params, TrainConfig};
use meshwork_strategy::types::DType;

/// With 3 and 4 data replicas every run gives the same loss bits: the global loss adds
/// the replicas' sums in replica order, whatever order their metric streams arrive in
/// (the unit test in `examples/common/mlp.rs` shows the order itself with sums that tell orders apart).
#[test]
fn losses_are_bit_identical_run_after_run_with_several_data_replicas() {
    let data = Dataset::synthetic(5, 96, 6, 4);
    let init = Params::init(5, 6, 12, 4);
    for replicas in [3, 4] {
        let config = TrainConfig {
            data: replicas,
            model: 1,
            steps: 25,
            batch: 24,
            lr: 0.3,
            dtype: DType::F32,
            ..TrainConfig::default()
        };
        let bits = |_: usize| -> Vec<u64> {
            let report =
                mlp::train(&config, &data, &init, &mut |_| ControlFlow::Continue(())).unwrap();
            report.losses.iter().map(|l| l.to_bits()).collect()
        };
        let first = bits(0);
        for run in 1..8 {
            assert_eq!(bits(run), first, "{replicas} replicas, run {run}");
        }
    }
}

/// A stop request from the progress callback ends the run after that host call; the
/// report says so and holds the losses of the steps made.
#[test]
fn a_stop_request_ends_the_run_after_the_current_host_call() {
    let data = Dataset::synthetic(1, 64, 4, 3);
    let init = Params::init(1, 4, 8, 3);
    let config = TrainConfig {
        data: 2,
        model: 2,
        steps: 100,
        batch: 16,
        steps_per_run: 3,
        ..TrainConfig::default()
    };
    let report = mlp::train(&config, &data, &init, &mut |p| {
        if p.done >= 7 { ControlFlow::Break(()) } else { ControlFlow::Continue(()) }
    })
    .unwrap();
    assert!(report.stopped);
    assert_eq!(report.losses.len(), 9);
}
