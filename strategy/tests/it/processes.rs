//! A strategy whose replicas live in several processes (here threads joined by the
//! executor's loopback interconnect; under MPI, processes): each process runs its
//! hosts' input pipelines and its replicas, and the result is the one-process result.

use std::sync::Arc;

use meshwork_strategy::executor::{LoopbackInterconnect, Runtime};
use meshwork_strategy::{
    Aggregation, Arg, DeviceAssignment, PerReplica, ReduceOp, Remainder, Strategy, Tensor,
    Topology, VariableOptions,
};
use ndarray::{Array2, Ix2};

use crate::{as_f64, f64s};

const REPLICAS: usize = 4;
const PROCESSES: usize = 2;

/// 4 replicas, 2 per host; `process` of `links` runs replicas `2p, 2p + 1`.
fn strategy(link: Option<Arc<dyn meshwork_strategy::executor::Interconnect>>) -> Strategy {
    let topology = Topology::new(vec![REPLICAS], REPLICAS / PROCESSES).unwrap();
    let s = Strategy::new(DeviceAssignment::build(&topology, &[1], None).unwrap()).unwrap();
    match link {
        None => s,
        Some(link) => s
            .with_runtime(Runtime::new(REPLICAS / PROCESSES).unwrap().with_interconnect(link))
            .unwrap(),
    }
}

fn mat(t: &Tensor) -> Array2<f64> {
    match t {
        Tensor::F64(a) => a.clone().into_dimensionality::<Ix2>().unwrap(),
        other => panic!("{other:?}"),
    }
}

/// Global batch `b`: 8 rows of (x [8, 3], y [8, 1]).
fn batch(b: usize) -> Vec<Tensor> {
    let x: Vec<f64> = (0..24).map(|i| ((i * 7 + b * 13) % 11) as f64 / 5.0 - 1.0).collect();
    let y: Vec<f64> = (0..8).map(|i| ((i * 3 + b) % 5) as f64 / 2.0).collect();
    vec![f64s(&[8, 3], x), f64s(&[8, 1], y)]
}

/// Four steps of least squares; the data from per-host pipelines when `per_host`.
fn train(s: &Strategy, per_host: bool) -> Vec<f64> {
    let w = s
        .create_variable("w", f64s(&[3, 1], vec![0.1, -0.2, 0.3]), VariableOptions::default())
        .unwrap();
    let batches: Vec<_> = if per_host {
        s.distribute_datasets_from_function(
            &|ctx| {
                let (h, n) = (ctx.input_pipeline_id, ctx.num_input_pipelines);
                Box::new((0..4).map(move |b| {
                    let rows = 8 / n;
                    batch(b)
                        .into_iter()
                        .map(|t| match t {
                            Tensor::F64(a) => Tensor::F64(
                                a.slice_axis(
                                    ndarray::Axis(0),
                                    ndarray::Slice::from(h * rows..(h + 1) * rows),
                                )
                                .to_owned(),
                            ),
                            other => other,
                        })
                        .collect()
                }))
            },
            Remainder::Drop,
        )
        .collect::<Result<_, _>>()
        .unwrap()
    } else {
        s.distribute_dataset((0..4).map(batch), Remainder::Drop).collect::<Result<_, _>>().unwrap()
    };
    for b in batches {
        let v = w.clone();
        s.run(
            move |ctx, a| {
                let (x, y, w) = (mat(&a[0]), mat(&a[1]), mat(&ctx.read(&v)?));
                let g = ctx.all_reduce(
                    ReduceOp::Sum,
                    Tensor::F64(x.t().dot(&(x.dot(&w) - &y)).into_dyn()),
                )?;
                ctx.assign(&v, Tensor::F64((w - mat(&g) * 0.05).into_dyn()))?;
                Ok(vec![])
            },
            &b.args,
        )
        .unwrap();
    }
    as_f64(&s.read_variable(&w).unwrap())
}

/// Runs `f` in each of the processes, on its own thread.
fn in_processes<T: Send>(f: impl Fn(usize, Strategy) -> T + Sync) -> Vec<T> {
    let links = LoopbackInterconnect::group(PROCESSES);
    std::thread::scope(|scope| {
        let handles: Vec<_> = links
            .into_iter()
            .enumerate()
            .map(|(p, link)| {
                let f = &f;
                scope.spawn(move || f(p, strategy(Some(link))))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn per_host_pipelines_in_two_processes_train_like_one_process() {
    let want = train(&strategy(None), false);
    for (p, got) in in_processes(|_, s| {
        assert!(s.is_multi_process());
        train(&s, true)
    })
    .into_iter()
    .enumerate()
    {
        for (a, b) in got.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-12 * b.abs(), "process {p}: {got:?} vs {want:?}");
        }
    }
}

#[test]
fn reductions_gathers_and_refusals_span_the_processes() {
    let results = in_processes(|p, s| {
        assert_eq!(s.local_replicas(), 2 * p..2 * p + 2);
        // Replica r holds r + 1 rows of the value r: MEAN over rows 2.0 in every process.
        let mine = PerReplica::new(
            s.local_replicas().map(|r| f64s(&[r + 1], vec![r as f64; r + 1])).collect(),
        );
        let mean = s.reduce(ReduceOp::Mean, &mine, Some(0)).unwrap();
        let equal =
            PerReplica::new(s.local_replicas().map(|r| f64s(&[2], vec![r as f64, 1.0])).collect());
        let sum = s.reduce(ReduceOp::Sum, &equal, None).unwrap();
        let gathered = s.gather(&equal, 0).unwrap();
        // A NONE-aggregated update that differs in the other process is refused everywhere.
        let sum_var = s
            .create_variable(
                "sum",
                f64s(&[1], vec![0.0]),
                VariableOptions { aggregation: Aggregation::Sum, ..Default::default() },
            )
            .unwrap();
        let none =
            s.create_variable("none", f64s(&[1], vec![0.0]), VariableOptions::default()).unwrap();
        let (a, b) = (sum_var.clone(), none.clone());
        let diverged = s.run(
            move |ctx, _| {
                ctx.assign_add(&a, f64s(&[1], vec![1.0]))?;
                let bump = if ctx.replica_id_in_sync_group() == 3 { 2.0 } else { 1.0 };
                ctx.assign_add(&b, f64s(&[1], vec![bump]))?;
                Ok(vec![])
            },
            &[],
        );
        let a = sum_var.clone();
        s.run(move |ctx, _| ctx.assign_add(&a, f64s(&[1], vec![1.0])).map(|()| vec![]), &[])
            .unwrap();
        (
            mean,
            sum,
            gathered,
            diverged.err().map(|e| e.to_string()),
            s.read_variable(&sum_var).unwrap(),
        )
    });
    for (p, (mean, sum, gathered, diverged, total)) in results.into_iter().enumerate() {
        assert_eq!(as_f64(&mean), vec![2.0], "process {p}");
        assert_eq!(as_f64(&sum), vec![6.0, 4.0], "process {p}");
        assert_eq!(as_f64(&gathered), vec![0.0, 1.0, 1.0, 1.0, 2.0, 1.0, 3.0, 1.0], "process {p}");
        let diverged = diverged.unwrap_or_default();
        assert!(diverged.contains("variable none: replica 3"), "process {p}: {diverged}");
        assert_eq!(
            as_f64(&total),
            vec![4.0],
            "process {p}: only the second run's SUM update stays"
        );
    }
}

#[test]
fn a_checkpoint_saved_by_process_zero_restores_in_every_process() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let ckpt = dir.join("ckpt");
    let values = in_processes(|_, s| {
        let w = s
            .create_variable("w", f64s(&[4], vec![1.0, 2.0, 3.0, 4.0]), VariableOptions::default())
            .unwrap();
        s.save_checkpoint(&ckpt).unwrap();
        s.assign_variable(&w, &f64s(&[4], vec![0.0; 4])).unwrap();
        s.restore_checkpoint(&ckpt).unwrap();
        s.read_variable(&w).unwrap()
    });
    for v in values {
        assert_eq!(as_f64(&v), vec![1.0, 2.0, 3.0, 4.0]);
    }
    // A per-replica argument must hold this process's replicas only.
    let err = in_processes(|_, s| {
        s.run(
            |_, _| Ok(vec![]),
            &[Arg::PerReplica(PerReplica::new(vec![f64s(&[1], vec![0.0]); 4]))],
        )
        .unwrap_err()
        .to_string()
    });
    assert!(err.iter().all(|e| e.contains("4 per-replica values for 2 replicas")), "{err:?}");
}

#[test]
fn each_process_streams_its_replicas_metrics() {
    use std::sync::Mutex;
    use std::time::Duration;

    use meshwork_strategy::{MetricEvent, MetricSpec};
    let seen = in_processes(|_, s| {
        let log: Arc<Mutex<Vec<(u64, usize)>>> = Arc::default();
        let sink = log.clone();
        let spec = MetricSpec { id: 3, name: "loss".into(), specs: vec!["f64[]".parse().unwrap()] };
        let s = s
            .with_metrics(
                &[spec],
                Arc::new(move |e: &MetricEvent| sink.lock().unwrap().push((e.step, e.replica))),
            )
            .unwrap();
        s.run(
            |ctx, _| {
                let r = ctx.replica_id_in_sync_group() as f64;
                ctx.emit(3, 9, &[Tensor::F64(ndarray::arr0(r).into_dyn())])?;
                Ok(vec![])
            },
            &[],
        )
        .unwrap();
        s.flush_metrics(Duration::from_secs(10)).unwrap();
        let mut got = log.lock().unwrap().clone();
        got.sort();
        got
    });
    assert_eq!(seen, vec![vec![(9, 0), (9, 1)], vec![(9, 2), (9, 3)]]);
    // Attaching a runtime after the metrics would lose them: refused.
    let s = strategy(None).with_metrics(&[], Arc::new(|_: &MetricEvent| {})).unwrap();
    assert!(s.with_runtime(Runtime::new(REPLICAS).unwrap()).is_err());
}
