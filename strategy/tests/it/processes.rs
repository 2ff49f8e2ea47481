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

/// A two-layer MLP's training step (f64, Adam) on a 2x2 `data × model` mesh: the batch
/// over `data`, `w1` by columns and `w2` by rows over `model`.
fn mlp_step(s: &Strategy) -> meshwork_strategy::spmd::CompiledTrainStep<'_> {
    use meshwork_strategy::nn::{self, Optimizer};
    use meshwork_strategy::partition::Shardings;
    use meshwork_strategy::program::{Builder, Value};
    use meshwork_strategy::sharding::Mesh;
    let mut b = Builder::new();
    let x = b.param("x", "f64[8,6]".parse().unwrap()).unwrap();
    let labels = b.param("labels", "i32[8]".parse().unwrap()).unwrap();
    let h = nn::linear(&mut b, x, 8, "w1", Some("b1")).unwrap();
    let h = b.tanh(h).unwrap();
    let z = nn::linear(&mut b, h, 3, "w2", None).unwrap();
    let loss = nn::softmax_cross_entropy(&mut b, z, labels).unwrap();
    let program = b.finish(&[loss]).unwrap();
    let weights: Vec<Value> = (2..5).map(|k| Value(k as u32)).collect();
    let shardings = Shardings::new(Mesh::iota(&[("data", 2), ("model", 2)]).unwrap())
        .with("x", "P('data')")
        .unwrap()
        .with("labels", "P('data')")
        .unwrap()
        .with("w1", "P(None, 'model')")
        .unwrap()
        .with("b1", "P('model')")
        .unwrap()
        .with("w2", "P('model', None)")
        .unwrap();
    let step = s.compile_train_step(&program, loss, &weights, Optimizer::adam(), &shardings);
    let step = step.unwrap();
    for (k, p) in program.params().iter().enumerate().skip(2) {
        let n = p.spec.shape.num_elements();
        let v: Vec<f64> = (0..n).map(|i| ((i + 13 * k) as f64 * 0.7).cos() * 0.5).collect();
        step.set(&p.name, &f64s(p.spec.shape.dims(), v)).unwrap();
    }
    step
}

fn mlp_batch(s: usize) -> Vec<Tensor> {
    let x: Vec<f64> = (0..48).map(|i| ((i * 3 + s * 5) as f64 * 0.21).sin()).collect();
    let labels: Vec<i32> = (0..8).map(|i| ((i + s) % 3) as i32).collect();
    vec![f64s(&[8, 6], x), Tensor::i32(&[8], labels).unwrap()]
}

/// Losses of 5 steps (2 one at a time, 3 in one call) and the weights after, the
/// trained step saved into `save` when given.
fn mlp_run(s: &Strategy, save: Option<&std::path::Path>) -> (Vec<f64>, Vec<Vec<f64>>) {
    let mut step = mlp_step(s);
    let mut losses: Vec<f64> = (0..2).map(|i| step.step(&mlp_batch(i), 0.05).unwrap()).collect();
    losses.extend(step.run_steps(&(2..5).map(mlp_batch).collect::<Vec<_>>(), &[0.05; 3]).unwrap());
    let weights = ["w1", "b1", "w2", "optimizer.m.w1"]
        .iter()
        .map(|n| as_f64(&step.get(n).unwrap()))
        .collect();
    if let Some(dir) = save {
        step.save_checkpoint(dir).unwrap();
    }
    (losses, weights)
}

/// A compiled training step over a mesh spread across two processes (each running
/// its two positions; results and `get` gathered from both) trains exactly as on
/// four devices of one process, and its checkpoint — gathered, written by process 0 —
/// restores in one process.
#[test]
fn a_compiled_step_over_two_processes_trains_like_one_process() {
    let want = mlp_run(&strategy(None), None);
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("spread");
    let got = in_processes(|_, s| {
        let run = mlp_run(&s, Some(&ckpt));
        // A position of the other process is not this one's to read alone.
        let err = mlp_step(&s).compiled().held_bytes("w1").unwrap_err().to_string();
        assert!(err.contains("runs in another process"), "{err}");
        run
    });
    for (p, (losses, weights)) in got.into_iter().enumerate() {
        assert_eq!(losses, want.0, "process {p}");
        assert_eq!(weights, want.1, "process {p}");
    }
    // The trained weights, from the checkpoint, on one process's fresh step.
    let one = strategy(None);
    let mut restored = mlp_step(&one);
    restored.restore_checkpoint(&ckpt).unwrap();
    for (n, w) in ["w1", "b1", "w2", "optimizer.m.w1"].iter().zip(&want.1) {
        assert_eq!(as_f64(&restored.get(n).unwrap()), *w, "{n}");
    }
    assert_eq!(restored.steps(), 5);
}

/// Across processes a mesh must put each process's positions on its own devices, all
/// of them: anything else is a typed error naming the positions, in every process.
#[test]
fn a_mesh_across_processes_must_match_their_devices() {
    use meshwork_strategy::partition::Shardings;
    use meshwork_strategy::program::Builder;
    use meshwork_strategy::sharding::Mesh;
    use meshwork_strategy::types::DeviceId;
    let mut b = Builder::new();
    let x = b.param("x", "f64[4]".parse().unwrap()).unwrap();
    let y = b.add(x, x).unwrap();
    let program = b.finish(&[y]).unwrap();
    let errors = in_processes(|_, s| {
        let swapped = Mesh::new(&[("data", 4)], [2, 3, 0, 1].map(DeviceId).to_vec()).unwrap();
        let two = Mesh::iota(&[("data", 2)]).unwrap();
        // Wrong only in process 1's positions: process 0 must refuse it too.
        let beyond = Mesh::new(&[("data", 4)], [0, 1, 2, 7].map(DeviceId).to_vec()).unwrap();
        // Swapped within process 1: each process still runs its own devices.
        let within = Mesh::new(&[("data", 4)], [0, 1, 3, 2].map(DeviceId).to_vec()).unwrap();
        [swapped, two, beyond, within].map(|m| {
            s.compile(&program, &Shardings::new(m).with("x", "P('data')").unwrap(), &[])
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default()
        })
    });
    for [swapped, two, beyond, within] in errors {
        assert!(swapped.contains("puts position 0 on device 2"), "{swapped}");
        assert!(two.contains("uses every device of every process (4)"), "{two}");
        assert!(beyond.contains("puts position 3 on device 7"), "{beyond}");
        assert_eq!(within, "", "a mesh within each process's devices compiles");
    }
}
