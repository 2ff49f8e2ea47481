//! TF's base-API behaviours (the `tf_probe` results in the reference) and the façade's
//! own features.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use meshwork_strategy::{
    Aggregation, Arg, Error, Format, Layout, MetricEvent, MetricSpec, PerReplica, ReduceOp,
    Remainder, Strategy, Synchronization, Tensor, VariableOptions,
};

use crate::{as_f64, f32s, f64s};

fn scalar(x: f32) -> Tensor {
    Tensor::F32(ndarray::arr0(x).into_dyn())
}

#[test]
fn mean_over_an_axis_weighs_replicas_by_their_rows() {
    // Replica r holds r + 1 rows of the value r: 20 / 10 rows = 2.0 (an unweighted
    // mean of the replicas' means would say 1.5).
    let s = Strategy::data_parallel(4).unwrap();
    let values = PerReplica::new((0..4).map(|r| f32s(&[r + 1], vec![r as f32; r + 1])).collect());
    assert_eq!(s.reduce(ReduceOp::Mean, &values, Some(0)).unwrap(), scalar(2.0));
    assert_eq!(s.reduce(ReduceOp::Sum, &values, Some(0)).unwrap(), scalar(20.0));
    // The gather keeps every replica's rows, in replica order.
    let all = s.gather(&values, 0).unwrap();
    assert_eq!(all.shape(), &[10]);
    assert_eq!(as_f64(&all), vec![0.0, 1.0, 1.0, 2.0, 2.0, 2.0, 3.0, 3.0, 3.0, 3.0]);
    // Without an axis, element-wise.
    let same = PerReplica::new((0..4).map(|r| f32s(&[2], vec![r as f32, 1.0])).collect());
    assert_eq!(s.reduce(ReduceOp::Mean, &same, None).unwrap(), f32s(&[2], vec![1.5, 1.0]));
    assert_eq!(
        s.reduce(ReduceOp::Sum, &values, Some(1)).unwrap_err().to_string(),
        "`axis` = 1 out of range for `value` with rank 1"
    );
    assert!(matches!(
        s.gather(&PerReplica::new(vec![scalar(1.0); 4]), 0),
        Err(Error::GatherScalar)
    ));
}

#[test]
fn sum_aggregation_gives_every_replica_the_sum_and_none_refuses_to_diverge() {
    let s = Strategy::data_parallel(4).unwrap();
    let opts = |aggregation| VariableOptions { aggregation, ..Default::default() };
    let sum = s.create_variable("sum", scalar(0.0), opts(Aggregation::Sum)).unwrap();
    let none = s.create_variable("none", scalar(0.0), opts(Aggregation::None)).unwrap();
    let mean = s.create_variable("mean", scalar(0.0), opts(Aggregation::Mean)).unwrap();
    let first =
        s.create_variable("first", scalar(0.0), opts(Aggregation::OnlyFirstReplica)).unwrap();
    let (a, b, c) = (sum.clone(), mean.clone(), first.clone());
    s.run(
        move |ctx, _| {
            let r = scalar(ctx.replica_id_in_sync_group() as f32 + 10.0);
            ctx.assign_add(&a, scalar(ctx.replica_id_in_sync_group() as f32))?;
            ctx.assign_add(&b, r.clone())?;
            ctx.assign(&c, r)?;
            // The update is visible at once, on every replica alike.
            Ok(vec![ctx.read(&a)?])
        },
        &[],
    )
    .unwrap();
    let copies = |v| s.local_variable_values(v).unwrap().into_values();
    assert_eq!(copies(&sum), vec![scalar(6.0); 4]);
    assert_eq!(copies(&mean), vec![scalar(11.5); 4]);
    assert_eq!(copies(&first), vec![scalar(10.0); 4]);
    // TF lets `none` diverge to [0, 1, 2, 3]; meshwork refuses and changes nothing.
    let n = none.clone();
    let s2 = sum.clone();
    let err = s
        .run(
            move |ctx, _| {
                ctx.assign_add(&s2, scalar(1.0))?;
                ctx.assign_add(&n, scalar(ctx.replica_id_in_sync_group() as f32))?;
                Ok(vec![])
            },
            &[],
        )
        .unwrap_err();
    assert!(
        matches!(&err, Error::DivergingUpdate { variable, replica: 1, .. } if variable == "none"),
        "{err}"
    );
    assert_eq!(copies(&none), vec![scalar(0.0); 4]);
    assert_eq!(copies(&sum), vec![scalar(6.0); 4], "an aborted run keeps no update");
    // The same update on every replica is fine.
    let n = none.clone();
    s.run(move |ctx, _| ctx.assign_add(&n, scalar(2.0)).map(|()| vec![]), &[]).unwrap();
    assert_eq!(copies(&none), vec![scalar(2.0); 4]);
}

#[test]
fn sync_on_read_variables_keep_copies_and_aggregate_when_read() {
    let s = Strategy::data_parallel(4).unwrap();
    let on_read = |aggregation| VariableOptions {
        synchronization: Synchronization::OnRead,
        aggregation,
        ..Default::default()
    };
    let sum = s.create_variable("sum", scalar(0.0), on_read(Aggregation::Sum)).unwrap();
    let first =
        s.create_variable("first", scalar(0.0), on_read(Aggregation::OnlyFirstReplica)).unwrap();
    let (a, b) = (sum.clone(), first.clone());
    s.run(
        move |ctx, _| {
            let r = scalar(ctx.replica_id_in_sync_group() as f32 + 1.0);
            ctx.assign_add(&a, r.clone())?;
            ctx.assign_add(&b, r)?;
            Ok(vec![])
        },
        &[],
    )
    .unwrap();
    assert_eq!(s.read_variable(&sum).unwrap(), scalar(10.0));
    assert_eq!(s.read_variable(&first).unwrap(), scalar(1.0));
    // A cross-replica assign of a SUM variable spreads the value so the sum holds.
    s.assign_variable(&sum, &scalar(8.0)).unwrap();
    assert_eq!(s.local_variable_values(&sum).unwrap().into_values(), vec![scalar(2.0); 4]);
    assert_eq!(s.read_variable(&sum).unwrap(), scalar(8.0));
    assert!(matches!(
        s.assign_add_variable(&sum, &scalar(1.0)),
        Err(Error::SyncOnReadAssignAdd { .. })
    ));
    let none = s.create_variable("none", scalar(0.0), on_read(Aggregation::None)).unwrap();
    assert!(matches!(s.read_variable(&none), Err(Error::ReadNone { .. })));
}

#[test]
fn a_failing_replica_fails_the_run_with_its_error_and_changes_nothing() {
    let s = Strategy::data_parallel(4).unwrap();
    let opts = VariableOptions { aggregation: Aggregation::Sum, ..Default::default() };
    let v = s.create_variable("v", scalar(0.0), opts).unwrap();
    for failing in 0..4 {
        let w = v.clone();
        let err = s
            .run(
                move |ctx, _| {
                    ctx.assign_add(&w, scalar(1.0))?;
                    if ctx.replica_id_in_sync_group() == failing {
                        return Err(Error::Empty { what: "a deliberate failure" });
                    }
                    ctx.assign_add(&w, scalar(1.0))?;
                    Ok(vec![])
                },
                &[],
            )
            .unwrap_err();
        assert!(
            matches!(err, Error::Empty { what: "a deliberate failure" }),
            "replica {failing}: {err}"
        );
        assert_eq!(s.read_variable(&v).unwrap(), scalar(0.0));
    }
    // Still usable.
    let w = v.clone();
    s.run(move |ctx, _| ctx.assign_add(&w, scalar(1.0)).map(|()| vec![]), &[]).unwrap();
    assert_eq!(s.read_variable(&v).unwrap(), scalar(4.0));
}

#[test]
fn merge_call_sees_every_replicas_value_and_all_get_its_result() {
    let s = Strategy::data_parallel(3).unwrap();
    let out = s
        .run(
            |ctx, _| {
                let mine = scalar(ctx.replica_id_in_sync_group() as f32 * 2.0);
                Ok(vec![ctx.merge_call(mine, &|values| {
                    Ok(scalar(
                        values.values().iter().map(|v| as_f64(v)[0] as f32).fold(0.0, f32::max),
                    ))
                })?])
            },
            &[],
        )
        .unwrap();
    assert_eq!(out.into_values(), vec![vec![scalar(4.0)]; 3]);
}

#[test]
fn datasets_split_batches_by_rows_and_serve_or_drop_the_ragged_end() {
    let s = Strategy::data_parallel(4).unwrap();
    let batch = |rows: usize, from: usize| {
        vec![f64s(&[rows, 1], (from..from + rows).map(|x| x as f64).collect())]
    };
    let batches = vec![batch(8, 0), batch(8, 8), batch(6, 16)];
    let dropped: Vec<_> =
        s.distribute_dataset(batches.clone(), Remainder::Drop).collect::<Result<_, _>>().unwrap();
    assert_eq!(dropped.len(), 2);
    let served: Vec<_> =
        s.distribute_dataset(batches, Remainder::Ragged).collect::<Result<_, _>>().unwrap();
    assert_eq!(served.len(), 3);
    assert_eq!(served[0].rows, vec![2; 4]);
    assert_eq!(served[2].rows, vec![2, 2, 1, 1]);
    let Arg::PerReplica(p) = &served[2].args[0] else { panic!("per replica") };
    assert_eq!(as_f64(&p.values()[2]), vec![20.0]);
    // The ragged batch's MEAN over rows is the batch mean.
    let mean = s.reduce(ReduceOp::Mean, p, Some(0)).unwrap();
    assert_eq!(as_f64(&mean), vec![18.5]);
}

#[test]
fn per_host_pipelines_feed_their_hosts_replicas() {
    // 4 replicas on 2 hosts: each host's pipeline makes batches for its 2 replicas.
    let topology = meshwork_strategy::Topology::new(vec![4], 2).unwrap();
    let da = meshwork_strategy::DeviceAssignment::build(&topology, &[1], None).unwrap();
    let s = Strategy::new(da).unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    let data = s.distribute_datasets_from_function(
        &move |ctx| {
            log.lock().unwrap().push(*ctx);
            let per_replica = ctx.get_per_replica_batch_size(8).unwrap();
            let id = ctx.input_pipeline_id as f64;
            Box::new((0..2).map(move |_| vec![f64s(&[2 * per_replica], vec![id; 2 * per_replica])]))
        },
        Remainder::Drop,
    );
    let batches: Vec<_> = data.collect::<Result<_, _>>().unwrap();
    assert_eq!(batches.len(), 2);
    let Arg::PerReplica(p) = &batches[0].args[0] else { panic!() };
    let hosts: Vec<f64> = p.values().iter().map(|t| as_f64(t)[0]).collect();
    assert_eq!(hosts, vec![0.0, 0.0, 1.0, 1.0]);
    assert_eq!(batches[0].rows, vec![2; 4]);
    let contexts = seen.lock().unwrap();
    assert_eq!(contexts.len(), 2);
    assert!(contexts.iter().all(|c| c.num_input_pipelines == 2 && c.num_replicas_in_sync == 4));
}

#[test]
fn run_steps_loops_on_the_devices_and_returns_the_last_step() {
    let s = Strategy::data_parallel(2).unwrap();
    let opts = VariableOptions { aggregation: Aggregation::Sum, ..Default::default() };
    let v = s.create_variable("count", scalar(0.0), opts).unwrap();
    let steps: Vec<Vec<Arg>> = (0..3).map(|k| vec![Arg::Shared(scalar(k as f32))]).collect();
    let w = v.clone();
    let f = move |ctx: &meshwork_strategy::StrategyContext<'_>, args: &[Tensor]| {
        ctx.assign_add(&w, scalar(1.0))?;
        Ok(vec![args[0].clone(), scalar(ctx.step() as f32), ctx.read(&w)?])
    };
    let last = s.run_steps(f.clone(), &steps).unwrap();
    assert_eq!(last.values()[1], vec![scalar(2.0), scalar(2.0), scalar(6.0)]);
    assert_eq!(s.read_variable(&v).unwrap(), scalar(6.0));
    let reduced = s.run_steps_reduced(f, &steps, ReduceOp::Sum).unwrap();
    assert_eq!(reduced, vec![scalar(4.0), scalar(4.0), scalar(24.0)]);
}

#[test]
fn metrics_reach_the_host_tagged_with_step_and_replica() {
    let seen: Arc<Mutex<Vec<MetricEvent>>> = Arc::default();
    let log = seen.clone();
    let spec = MetricSpec { id: 7, name: "loss".into(), specs: vec!["f32[]".parse().unwrap()] };
    let s = Strategy::data_parallel(3)
        .unwrap()
        .with_metrics(&[spec], Arc::new(move |e: &MetricEvent| log.lock().unwrap().push(e.clone())))
        .unwrap();
    let steps: Vec<Vec<Arg>> = (0..4).map(|_| vec![]).collect();
    s.run_steps(
        |ctx, _| {
            let value = scalar((ctx.step() * 10 + ctx.replica_id_in_sync_group()) as f32);
            ctx.emit(7, ctx.step() as u64, &[value])?;
            Ok(vec![])
        },
        &steps,
    )
    .unwrap();
    s.flush_metrics(Duration::from_secs(10)).unwrap();
    let mut got: Vec<(u64, usize, f64)> = seen
        .lock()
        .unwrap()
        .iter()
        .map(|e| (e.step, e.replica, as_f64(&e.tensors[0])[0]))
        .collect();
    got.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let want: Vec<(u64, usize, f64)> = (0..4u64)
        .flat_map(|st| (0..3).map(move |r| (st, r, (st * 10) as f64 + r as f64)))
        .collect();
    assert_eq!(got, want);
    assert!(seen.lock().unwrap().iter().all(|e| e.name == "loss" && e.consumer == 7));
}

#[test]
fn resharding_follows_the_seeds_state_machine() {
    let topology = meshwork_strategy::Topology::new(vec![4], 4).unwrap();
    let s =
        Strategy::new(meshwork_strategy::DeviceAssignment::build(&topology, &[4], None).unwrap())
            .unwrap();
    let value = f32s(&[4, 4], (0..16).map(|x| x as f32).collect());
    let v = s.create_variable("w", value.clone(), VariableOptions::default()).unwrap();
    let vars = [v.clone()];
    let rows = Format::Sharded { key: "rows".into(), layout: Layout::Split(vec![4, 1]) };
    let cols = Format::Sharded { key: "cols".into(), layout: Layout::Split(vec![1, 4]) };
    // Default to default: nothing to do.
    assert!(!s.reshard_variables(&vars, &Format::Default).unwrap());
    assert!(s.reshard_variables(&vars, &rows).unwrap());
    assert_eq!(s.variable_format(&v).unwrap().as_deref(), Some("rows"));
    // The same key again: a no-op, even with another layout under it.
    assert!(
        !s.reshard_variables(
            &vars,
            &Format::Sharded { key: "rows".into(), layout: Layout::Split(vec![1, 4]) }
        )
        .unwrap()
    );
    // Each logical device holds its row block.
    let w = v.clone();
    let out =
        s.run(move |ctx, _| Ok(vec![ctx.all_gather_logical(ctx.read(&w)?, 0)?]), &[]).unwrap();
    assert_eq!(out.values()[0][0], value);
    assert!(s.reshard_variables(&vars, &cols).unwrap());
    let w = v.clone();
    let out = s.run(move |ctx, _| Ok(vec![ctx.read(&w)?]), &[]).unwrap();
    assert_eq!(as_f64(&out.values()[0][0]), vec![0.0, 4.0, 8.0, 12.0]);
    assert_eq!(s.read_variable(&v).unwrap(), value);
    // A layout that cannot hold the variable: refused, the state and data unchanged.
    let bad = Format::Sharded { key: "bad".into(), layout: Layout::Split(vec![3, 1]) };
    assert!(s.reshard_variables(&vars, &bad).is_err());
    assert_eq!(s.variable_format(&v).unwrap().as_deref(), Some("cols"));
    assert!(s.reshard_variables(&vars, &Format::Default).unwrap());
    assert_eq!(s.variable_format(&v).unwrap(), None);
    assert_eq!(s.read_variable(&v).unwrap(), value);
}

/// A device assignment that is not `r * L + l`: a 2x4 topology cut into 2x1 blocks, so
/// replica `r`'s logical device `l` is device `4l + r`. Each runs on that device's
/// thread, `device()` says so, `run_logical` returns every logical device's outputs and
/// `run` the first's.
#[test]
fn each_logical_device_runs_on_the_device_its_assignment_names() {
    use meshwork_strategy::{DeviceAssignment, Topology};
    let topology = Topology::new(vec![2, 4], 8).unwrap();
    let assignment = DeviceAssignment::build(&topology, &[2, 1], None).unwrap();
    assert_eq!(assignment.num_replicas(), 4);
    assert_eq!(assignment.device(1, 1).0, 5);
    let s = Strategy::new(assignment.clone()).unwrap();
    let f = |ctx: &meshwork_strategy::StrategyContext<'_>, _: &[Tensor]| {
        let thread = std::thread::current().name().unwrap_or_default().to_string();
        let device = ctx.device().0;
        assert_eq!(thread, format!("meshwork-cpu:{device}"));
        let me = Tensor::I64(ndarray::arr1(&[i64::from(device)]).into_dyn());
        // Model-parallel: the replica's logical devices sum their device ids.
        Ok(vec![me, ctx.all_reduce_logical(ReduceOp::Sum, ctx_id(ctx))?])
    };
    fn ctx_id(ctx: &meshwork_strategy::StrategyContext<'_>) -> Tensor {
        Tensor::I64(ndarray::arr1(&[i64::from(ctx.device().0)]).into_dyn())
    }
    let all = s.run_logical(f, &[]).unwrap();
    for (r, per_logical) in all.values().iter().enumerate() {
        assert_eq!(per_logical.len(), 2);
        for (l, out) in per_logical.iter().enumerate() {
            let want = i64::from(assignment.device(r, l).0);
            assert_eq!(
                out[0],
                Tensor::I64(ndarray::arr1(&[want]).into_dyn()),
                "replica {r} logical {l}"
            );
            assert_eq!(out[1], Tensor::I64(ndarray::arr1(&[(r + 4 + r) as i64]).into_dyn()));
        }
    }
    let first = s.run(f, &[]).unwrap();
    for (r, out) in first.values().iter().enumerate() {
        assert_eq!(out[0], Tensor::I64(ndarray::arr1(&[r as i64]).into_dyn()));
    }
}

/// MEAN over an axis of integer values with no rows anywhere is a typed error, not a
/// division by zero; over floats it is NaN, as IEEE says.
#[test]
fn an_integer_mean_over_zero_rows_is_an_error() {
    let s = Strategy::data_parallel(2).unwrap();
    let ints = PerReplica::new(
        (0..2).map(|_| Tensor::I32(ndarray::ArrayD::zeros(ndarray::IxDyn(&[0, 3])))).collect(),
    );
    let err = s.reduce(ReduceOp::Mean, &ints, Some(0)).unwrap_err();
    assert!(matches!(err, Error::Empty { .. }), "{err}");
    let floats = PerReplica::new((0..2).map(|_| f32s(&[0, 3], vec![])).collect());
    let mean = s.reduce(ReduceOp::Mean, &floats, Some(0)).unwrap();
    assert!(as_f64(&mean).iter().all(|v| v.is_nan()));
}

/// Two copies of a NONE-aggregated variable whose bits differ but whose 64-bit FxHash
/// values collide — `[a, b]` and `[a + 1, b - K]` in f64 bits, for FxHash's multiplier
/// `K` — are still refused as diverging: the guard compares the copies themselves.
/// (With the hashes it used to compare, this update went through.)
#[test]
fn a_diverging_update_is_refused_even_when_hashes_would_collide() {
    const K: u64 = 0xf135_7aea_2e62_a9c5;
    let (a, b) = (1.5f64.to_bits(), 2.5f64.to_bits());
    let mine = [f64::from_bits(a), f64::from_bits(b)];
    let theirs = [f64::from_bits(a + 1), f64::from_bits(b.wrapping_sub(K))];
    let s = Strategy::data_parallel(2).unwrap();
    let v = s.create_variable("w", f64s(&[2], vec![0.0, 0.0]), VariableOptions::default()).unwrap();
    let w = v.clone();
    let err = s
        .run(
            move |ctx, _| {
                let value = if ctx.replica_id_in_sync_group() == 0 { mine } else { theirs };
                ctx.assign(&w, f64s(&[2], value.to_vec()))?;
                Ok(vec![])
            },
            &[],
        )
        .unwrap_err();
    assert!(matches!(&err, Error::DivergingUpdate { replica: 1, .. }), "{err}");
    assert_eq!(s.read_variable(&v).unwrap(), f64s(&[2], vec![0.0, 0.0]), "nothing committed");
}
