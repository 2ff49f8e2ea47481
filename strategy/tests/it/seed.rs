//! The seed's (TPUStrategy's) validation rules, with its wording.

use meshwork_strategy::{
    DeviceAssignment, Layout, Remainder, Strategy, Synchronization, Tensor, Topology,
    VariableOptions,
};

use crate::f32s;

fn two_logical() -> Strategy {
    let topology = Topology::new(vec![2, 2], 4).unwrap();
    Strategy::new(DeviceAssignment::build(&topology, &[1, 2], None).unwrap()).unwrap()
}

/// Runs `f` on a 1-replica, 2-logical-device strategy and returns the error message
/// of logical device 0.
fn run_error(
    f: impl Fn(&meshwork_strategy::StrategyContext<'_>) -> meshwork_strategy::Result<Vec<Tensor>>
    + Send
    + Sync
    + 'static,
) -> String {
    let topology = Topology::new(vec![2], 2).unwrap();
    let s = Strategy::new(DeviceAssignment::build(&topology, &[2], None).unwrap()).unwrap();
    s.run(move |ctx, _| f(ctx), &[]).unwrap_err().to_string()
}

#[test]
fn split_to_logical_devices_checks_rank_then_divisibility_then_count_in_the_seeds_words() {
    let t = f32s(&[10, 4], vec![0.0; 40]);
    let t2 = t.clone();
    assert_eq!(
        run_error(move |ctx| Ok(vec![ctx.split_to_logical_devices(&t2, &[2])?])),
        "Length of `partition_dimensions` (1) must be equal to the rank of `x` (2)."
    );
    // Rank is checked before divisibility, divisibility before the count.
    let t2 = t.clone();
    assert_eq!(
        run_error(move |ctx| Ok(vec![ctx.split_to_logical_devices(&t2, &[4, 1])?])),
        "Tensor shape at dimension 0 (10) must be divisible by corresponding value specified by `partition_dimensions` (4)."
    );
    let t2 = t.clone();
    assert_eq!(
        run_error(move |ctx| Ok(vec![ctx.split_to_logical_devices(&t2, &[1, 4])?])),
        "Number of logical devices (2) does not match the number of partition splits specified (4)."
    );
    let t2 = t.clone();
    assert_eq!(
        run_error(move |ctx| Ok(vec![ctx.split_to_logical_devices(&t2, &[5, 1])?])),
        "Number of logical devices (2) does not match the number of partition splits specified (5)."
    );
}

#[test]
fn assign_to_logical_device_checks_the_id_in_the_seeds_words() {
    assert_eq!(
        run_error(|ctx| Ok(ctx
            .assign_to_logical_device(f32s(&[1], vec![1.0]), 2)?
            .into_iter()
            .collect())),
        "`logical_core_id` to assign must be lower then total number of logical devices per replica. \
         Received logical device id 2 but there are only total of 2 logical devices in replica."
    );
}

#[test]
fn the_logical_device_scope_checks_only_the_upper_bound_in_the_seeds_words() {
    let s = two_logical();
    let err = s.logical_device_scope(2, |_| ()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "`logical_device_id` not in range (was 2, but there are only 2 logical devices per replica)."
    );
    // Inside a valid scope, a default-layout variable lives on that logical device only.
    let v = s
        .logical_device_scope(1, |s| {
            s.create_variable("v", f32s(&[2], vec![1.0, 2.0]), VariableOptions::default())
        })
        .unwrap()
        .unwrap();
    let v2 = v.clone();
    let out = s
        .run(
            move |ctx, _| {
                Ok(vec![Tensor::I32(ndarray::arr0(i32::from(ctx.read(&v2).is_ok())).into_dyn())])
            },
            &[],
        )
        .unwrap();
    // Outputs come from logical device 0, which does not hold it.
    assert_eq!(out.values()[0][0], Tensor::I32(ndarray::arr0(0).into_dyn()));
    assert_eq!(s.read_variable(&v).unwrap(), f32s(&[2], vec![1.0, 2.0]));
}

#[test]
fn variables_split_at_creation_use_the_seeds_checks() {
    let s = two_logical();
    let bad = VariableOptions { layout: Layout::Split(vec![3, 1]), ..Default::default() };
    let err = s.create_variable("w", f32s(&[4, 2], vec![0.0; 8]), bad).unwrap_err();
    assert_eq!(
        err.to_string(),
        "Tensor shape at dimension 0 (4) must be divisible by corresponding value specified by `partition_dimensions` (3)."
    );
}

#[test]
fn a_global_batch_that_does_not_divide_over_the_replicas_is_refused_in_tfs_words() {
    let s = Strategy::data_parallel(4).unwrap();
    let batches = vec![vec![f32s(&[10, 1], vec![0.0; 10])]];
    let err = s.distribute_dataset(batches, Remainder::Drop).next().unwrap().unwrap_err();
    assert_eq!(
        err.to_string(),
        "The `global_batch_size` 10 is not divisible by `num_replicas_in_sync` 4 "
    );
    let ctx = meshwork_strategy::InputContext {
        num_input_pipelines: 1,
        input_pipeline_id: 0,
        num_replicas_in_sync: 4,
    };
    assert_eq!(ctx.get_per_replica_batch_size(64).unwrap(), 16);
    assert_eq!(
        ctx.get_per_replica_batch_size(10).unwrap_err().to_string(),
        "The `global_batch_size` 10 is not divisible by `num_replicas_in_sync` 4 "
    );
}

#[test]
fn variable_creation_refuses_sync_none_and_integer_means_in_tfs_words() {
    let s = Strategy::data_parallel(2).unwrap();
    let none = VariableOptions { synchronization: Synchronization::None, ..Default::default() };
    assert_eq!(
        s.create_variable("v", f32s(&[1], vec![0.0]), none).unwrap_err().to_string(),
        "`NONE` variable synchronization mode is not supported with tf.distribute strategy. Please change the `synchronization` for variable: v"
    );
    let mean =
        VariableOptions { aggregation: meshwork_strategy::Aggregation::Mean, ..Default::default() };
    let err =
        s.create_variable("n", Tensor::I32(ndarray::arr1(&[1]).into_dyn()), mean).unwrap_err();
    assert!(err.to_string().starts_with(
        "creating distributed tf.Variable with aggregation=MEAN and a non-floating dtype is not supported"
    ));
}

#[test]
fn device_assignments_build_blocks_of_the_topology() {
    // A 2x4 topology, 2 devices per host, computation shape 1x2: 4 replicas of 2
    // logical devices, replica r on devices 2r and 2r+1.
    let topology = Topology::new(vec![2, 4], 2).unwrap();
    let da = DeviceAssignment::build(&topology, &[1, 2], None).unwrap();
    assert_eq!((da.num_replicas(), da.num_logical_devices()), (4, 2));
    let devices: Vec<(u32, u32)> = (0..4).map(|r| (da.device(r, 0).0, da.device(r, 1).0)).collect();
    assert_eq!(devices, vec![(0, 1), (2, 3), (4, 5), (6, 7)]);
    assert_eq!(da.num_hosts(), 4);
    assert_eq!(da.replicas_per_host(), 1);
    // Column blocks: computation shape 2x1 gives replica r devices r and 4 + r.
    let da = DeviceAssignment::build(&topology, &[2, 1], Some(3)).unwrap();
    let devices: Vec<(u32, u32)> = (0..3).map(|r| (da.device(r, 0).0, da.device(r, 1).0)).collect();
    assert_eq!(devices, vec![(0, 4), (1, 5), (2, 6)]);
    assert!(DeviceAssignment::build(&topology, &[3, 1], None).is_err());
    assert!(DeviceAssignment::build(&topology, &[1, 2], Some(5)).is_err());
    assert!(DeviceAssignment::build(&topology, &[1], None).is_err());
    assert!(Topology::new(vec![2, 3], 4).is_err());
    let default = DeviceAssignment::default_for(3).unwrap();
    assert_eq!(
        (default.num_replicas(), default.num_logical_devices(), default.num_hosts()),
        (3, 1, 1)
    );
}
