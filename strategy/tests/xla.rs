//! The strategy on the XLA back end (a PJRT plugin named by `MESHWORK_PJRT_PLUGIN`;
//! `test = false`, built and run by `cargo xtask xla-test` and CI, where a missing
//! plugin fails): compiled training steps give the interpreter's losses and
//! weights, several steps per call, emits through the outfeed, checkpoints between the
//! two back ends, meshes, and placed programs with device-to-device transfers.

use std::sync::{Arc, Mutex};

use meshwork_program::{Builder, Program, Value};
use meshwork_strategy::backend::Xla;
use meshwork_strategy::nn::Optimizer;
use meshwork_strategy::partition::Shardings;
use meshwork_strategy::sharding::Mesh;
use meshwork_strategy::spmd::CompiledTrainStep;
use meshwork_strategy::{MetricEvent, MetricSpec, Strategy, Tensor};

fn xla() -> Arc<Xla> {
    let path = meshwork_xla::find::plugin_path(None)
        .expect("set MESHWORK_PJRT_PLUGIN to a PJRT plugin (cargo xtask xla-test does)");
    let plugin = meshwork_xla::find::load(&path).unwrap_or_else(|e| panic!("{e}"));
    Arc::new(Xla::new(&plugin).unwrap())
}

/// A two-layer MLP with softmax cross-entropy that also emits its loss (consumer 7).
fn mlp() -> (Program, Value, Vec<Value>) {
    use meshwork_strategy::nn;
    let mut b = Builder::new();
    let x = b.param("x", "f64[8,6]".parse().unwrap()).unwrap();
    let labels = b.param("labels", "i32[8]".parse().unwrap()).unwrap();
    let h = nn::linear(&mut b, x, 8, "w1", Some("b1")).unwrap();
    let h = b.tanh(h).unwrap();
    let z = nn::linear(&mut b, h, 3, "w2", None).unwrap();
    let loss = nn::softmax_cross_entropy(&mut b, z, labels).unwrap();
    let tok = b.emit(&[loss], 7).unwrap();
    let program = b.finish(&[loss, tok]).unwrap();
    let weights = (2..5).map(|k| Value(k as u32)).collect();
    (program, loss, weights)
}

fn batch(s: usize) -> Vec<Tensor> {
    let x: Vec<f64> = (0..48).map(|i| ((i * 3 + s * 5) as f64 * 0.21).sin()).collect();
    let labels: Vec<i32> = (0..8).map(|i| ((i + s) % 3) as i32).collect();
    vec![Tensor::f64(&[8, 6], x).unwrap(), Tensor::i32(&[8], labels).unwrap()]
}

fn init(step: &CompiledTrainStep<'_>, program: &Program) {
    for (k, p) in program.params().iter().enumerate().skip(2) {
        let n = p.spec.shape.num_elements();
        let v: Vec<f64> = (0..n).map(|i| ((i + 13 * k) as f64 * 0.7).cos() * 0.5).collect();
        step.set(&p.name, &Tensor::f64(p.spec.shape.dims(), v).unwrap()).unwrap();
    }
}

/// The MLP on a `data x model` mesh: the batch over `data`, `w1`/`b1` by columns and
/// `w2` by rows over `model`.
fn mlp_shardings(d: usize, m: usize) -> Shardings {
    Shardings::new(Mesh::iota(&[("data", d), ("model", m)]).unwrap())
        .with("x", "P('data')")
        .unwrap()
        .with("labels", "P('data')")
        .unwrap()
        .with("w1", "P(None, 'model')")
        .unwrap()
        .with("b1", "P('model')")
        .unwrap()
        .with("w2", "P('model', None)")
        .unwrap()
}

fn one_device() -> Shardings {
    Shardings::new(Mesh::iota(&[("data", 1)]).unwrap())
}

fn metrics() -> (Arc<Mutex<Vec<MetricEvent>>>, Strategy) {
    metrics_on(1)
}

/// A strategy of `devices` devices streaming the loss (consumer 7) to a list.
fn metrics_on(devices: usize) -> (Arc<Mutex<Vec<MetricEvent>>>, Strategy) {
    let events: Arc<Mutex<Vec<MetricEvent>>> = Arc::default();
    let seen = events.clone();
    let spec = MetricSpec { id: 7, name: "loss".into(), specs: vec!["f64[]".parse().unwrap()] };
    let strategy = Strategy::data_parallel(devices)
        .unwrap()
        .with_metrics(
            &[spec],
            Arc::new(move |e: &MetricEvent| seen.lock().unwrap().push(e.clone())),
        )
        .unwrap();
    (events, strategy)
}

#[test]
fn a_training_step_on_xla_gives_the_interpreters_losses_weights_and_emits() {
    let (program, loss, weights) = mlp();
    let (events, strategy) = metrics();
    let strategy = strategy.with_backend(xla());
    assert_eq!(strategy.backend().name(), "xla");
    let (_, interp) = metrics();
    let mut losses = Vec::new();
    for optimizer in [Optimizer::Sgd, Optimizer::adam()] {
        let mut on_xla = strategy
            .compile_train_step(&program, loss, &weights, optimizer, &one_device())
            .unwrap();
        let mut reference =
            interp.compile_train_step(&program, loss, &weights, optimizer, &one_device()).unwrap();
        init(&on_xla, &program);
        init(&reference, &program);
        // One step per call, then several per call (enqueued before any is read).
        let mut got: Vec<f64> = (0..3).map(|s| on_xla.step(&batch(s), 0.1).unwrap()).collect();
        let batches: Vec<Vec<Tensor>> = (3..7).map(batch).collect();
        got.extend(on_xla.run_steps(&batches, &[0.1; 4]).unwrap());
        let want: Vec<f64> = (0..7).map(|s| reference.step(&batch(s), 0.1).unwrap()).collect();
        for (s, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((g - w).abs() <= 1e-12 * w.abs(), "{optimizer:?} step {s}: {g} vs {w}");
        }
        for name in ["w1", "b1", "w2"] {
            let (g, w) =
                (on_xla.get(name).unwrap().to_f64(), reference.get(name).unwrap().to_f64());
            for (a, b) in g.iter().zip(&w) {
                assert!((a - b).abs() <= 1e-12 * (1.0 + b.abs()), "{name}: {a} vs {b}");
            }
        }
        assert_eq!(on_xla.steps(), 7);
        losses.extend(got);
    }
    strategy.flush_metrics(std::time::Duration::from_secs(10)).unwrap();
    let events = events.lock().unwrap();
    assert_eq!(events.len(), 14, "one loss record per step");
    // Each emitted loss is its step's, tagged with the step's number.
    for (k, (e, loss)) in events.iter().zip(&losses).enumerate() {
        assert_eq!(e.step, (k % 7) as u64);
        assert_eq!(e.tensors[0].to_f64(), [*loss]);
    }
}

#[test]
fn a_checkpoint_saved_from_xla_restores_on_the_interpreter_and_back() {
    let (program, loss, weights) = mlp();
    let (_, strategy) = metrics();
    let strategy = strategy.with_backend(xla());
    let (_, interp) = metrics();
    let adam = Optimizer::adam();
    let mut on_xla =
        strategy.compile_train_step(&program, loss, &weights, adam, &one_device()).unwrap();
    init(&on_xla, &program);
    for s in 0..3 {
        on_xla.step(&batch(s), 0.05).unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let saved = dir.path().join("from-xla");
    on_xla.save_checkpoint(&saved).unwrap();
    let mut on_interp =
        interp.compile_train_step(&program, loss, &weights, adam, &one_device()).unwrap();
    on_interp.restore_checkpoint(&saved).unwrap();
    assert_eq!(on_interp.steps(), 3);
    // Both continue alike, and the interpreter's checkpoint restores onto XLA.
    let (a, b) = (on_xla.step(&batch(3), 0.05).unwrap(), on_interp.step(&batch(3), 0.05).unwrap());
    assert!((a - b).abs() <= 1e-12 * b.abs(), "{a} vs {b}");
    let back = dir.path().join("from-interp");
    on_interp.save_checkpoint(&back).unwrap();
    let mut again =
        strategy.compile_train_step(&program, loss, &weights, adam, &one_device()).unwrap();
    again.restore_checkpoint(&back).unwrap();
    let (c, d) = (again.step(&batch(4), 0.05).unwrap(), on_interp.step(&batch(4), 0.05).unwrap());
    assert!((c - d).abs() <= 1e-12 * d.abs(), "{c} vs {d}");
}

/// A training step on a `data x model` mesh of XLA devices (meshwork's partitioner,
/// XLA's collectives over the positions) gives the interpreter's losses and weights on
/// the same mesh, with every parameter and optimizer slot resident on its device.
#[test]
fn a_training_step_on_an_xla_mesh_gives_the_interpreters() {
    let (program, loss, weights) = mlp();
    let plugin = meshwork_xla::find::load(&meshwork_xla::find::plugin_path(None).unwrap()).unwrap();
    // XLA's collectives in the executable, and meshwork's on the host between
    // executables of the segments around them (what a mesh over processes runs).
    for hosted in [false, true] {
        let xla = Xla::with_devices(&plugin, 4).unwrap();
        let xla = if hosted { xla.with_host_collectives() } else { xla };
        let (events, s) = metrics_on(4);
        let on_xla = s.with_backend(Arc::new(xla));
        let (_, interp) = metrics_on(4);
        let shardings = mlp_shardings(2, 2);
        let adam = Optimizer::adam();
        let mut a = on_xla.compile_train_step(&program, loss, &weights, adam, &shardings).unwrap();
        let mut b = interp.compile_train_step(&program, loss, &weights, adam, &shardings).unwrap();
        init(&a, &program);
        init(&b, &program);
        let mut got: Vec<f64> = (0..3).map(|s| a.step(&batch(s), 0.05).unwrap()).collect();
        got.extend(a.run_steps(&(3..6).map(batch).collect::<Vec<_>>(), &[0.05; 3]).unwrap());
        let want: Vec<f64> = (0..6).map(|s| b.step(&batch(s), 0.05).unwrap()).collect();
        for (s, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((g - w).abs() <= 1e-12 * w.abs(), "hosted {hosted}, step {s}: {g} vs {w}");
        }
        for name in ["w1", "b1", "w2", "optimizer.m.w1"] {
            let (g, w) = (a.get(name).unwrap().to_f64(), b.get(name).unwrap().to_f64());
            assert_eq!(g.len(), w.len());
            for (x, y) in g.iter().zip(&w) {
                assert!((x - y).abs() <= 1e-12 * (1.0 + y.abs()), "{name}: {x} vs {y}");
            }
        }
        // Every parameter part held on its device, a quarter or half of the whole.
        assert_eq!(a.compiled().held_bytes("w1").unwrap(), vec![6 * 4 * 8; 4]);
        on_xla.flush_metrics(std::time::Duration::from_secs(10)).unwrap();
        let events = events.lock().unwrap();
        let emitted: Vec<f64> = events.iter().map(|e| e.tensors[0].to_f64()[0]).collect();
        assert_eq!(emitted, got, "hosted {hosted}: one loss record per step, from position 0");
    }
}

/// Every collective of the program IR, lowered to StableHLO and run by XLA on 4 CPU
/// devices (`num_replicas = 4`), gives what the executor's collectives give the
/// interpreter running the same program on 4 devices.
#[test]
fn collectives_on_xla_devices_agree_with_the_executors() {
    use meshwork_strategy::ReduceOp;
    use meshwork_strategy::backend::Interpreter;
    use meshwork_xla::{Arg, Session, lower::LowerOptions};
    let mut b = Builder::new();
    let x = b.param("x", "f64[4,2]".parse().unwrap()).unwrap();
    let all = [vec![0, 1, 2, 3]];
    let pairs = [vec![0, 1], vec![2, 3]];
    let outs = vec![
        b.all_reduce(x, ReduceOp::Sum, &all).unwrap(),
        b.all_reduce(x, ReduceOp::Max, &[vec![0, 2], vec![1, 3]]).unwrap(),
        b.all_reduce(x, ReduceOp::Min, &pairs).unwrap(),
        b.all_reduce(x, ReduceOp::Mean, &pairs).unwrap(),
        // Groups of different sizes: each replica divides by its own group's.
        b.all_reduce(x, ReduceOp::Mean, &[vec![0, 1, 2], vec![3]]).unwrap(),
        b.all_gather(x, 1, &pairs).unwrap(),
        b.reduce_scatter(x, ReduceOp::Sum, 0, &all).unwrap(),
        b.reduce_scatter(x, ReduceOp::Mean, 1, &[vec![1, 0], vec![3, 2]]).unwrap(),
        b.all_to_all(x, 0, 1, &all).unwrap(),
        b.collective_permute(x, &[(0, 1), (1, 2), (2, 3)]).unwrap(),
        b.shard_slice(x, 0, &pairs).unwrap(),
        b.shard_pad(x, 1, &[vec![1, 0], vec![3, 2]]).unwrap(),
    ];
    let program = b.finish(&outs).unwrap();
    let inputs: Vec<Tensor> = (0..4)
        .map(|r| {
            Tensor::f64(&[4, 2], (0..8).map(|i| ((i * 7 + r * 3) % 11) as f64 - 4.5).collect())
                .unwrap()
        })
        .collect();
    // The interpreter on 4 executor devices.
    let strategy = Strategy::data_parallel(4).unwrap();
    let interp = Interpreter::new().compile_per_device(&program, &[0, 1, 2, 3], &[false], &[]);
    let want =
        interp.run(&strategy, inputs.iter().map(|t| vec![vec![t.clone()]]).collect(), 0).unwrap();
    // XLA on 4 CPU devices of one client.
    let path = meshwork_xla::find::plugin_path(None).expect("MESHWORK_PJRT_PLUGIN");
    let session = Session::new(&meshwork_xla::find::load(&path).unwrap(), 4).unwrap();
    let compiled =
        session.compile(&program, &LowerOptions { replicas: 4, ..Default::default() }).unwrap();
    let client = session.client();
    let buffers: Vec<_> = inputs
        .iter()
        .enumerate()
        .map(|(r, t)| client.put(t, client.device(r).unwrap()).unwrap())
        .collect();
    let got = compiled
        .executable
        .execute(buffers.iter().map(|b| vec![Arg::Borrowed(b)]).collect())
        .unwrap();
    for r in 0..4 {
        assert_eq!(got[r].len(), want[r][0].len(), "replica {r}: every output");
        for (k, (g, w)) in got[r].iter().zip(&want[r][0]).enumerate() {
            let g = g.to_host().unwrap();
            assert_eq!(g.spec(), w.spec(), "replica {r} output {k}");
            for (a, b) in g.to_f64().iter().zip(w.to_f64()) {
                assert!(
                    (a - b).abs() <= 1e-12 * (1.0 + b.abs()),
                    "replica {r} output {k}: {a} vs {b}"
                );
            }
        }
    }
}

/// What can fail on the host fails before the device state is donated: a program that
/// emits on a strategy without metrics, or to a consumer that is not registered, leaves
/// the weights where they were and takes no step.
#[test]
fn a_step_refused_on_the_host_leaves_the_device_state_as_it_was() {
    let (program, loss, weights) = mlp();
    let other = MetricSpec { id: 8, name: "other".into(), specs: vec!["f64[]".parse().unwrap()] };
    let strategies = [
        Strategy::data_parallel(1).unwrap().with_backend(xla()),
        Strategy::data_parallel(1)
            .unwrap()
            .with_metrics(&[other], Arc::new(|_: &MetricEvent| {}))
            .unwrap()
            .with_backend(xla()),
    ];
    for strategy in &strategies {
        let mut step = strategy
            .compile_train_step(&program, loss, &weights, Optimizer::adam(), &one_device())
            .unwrap();
        init(&step, &program);
        let before = step.get("w1").unwrap();
        let err = step.step(&batch(0), 0.1).unwrap_err();
        assert!(err.to_string().contains("metrics"), "{err}");
        assert_eq!(step.get("w1").unwrap(), before);
        assert_eq!(step.steps(), 0);
    }
}

/// A run saved from XLA devices on one mesh restores onto another mesh of XLA devices
/// and onto the interpreter, and the reverse, through the sharded checkpoints: each
/// continues the run the saving one would have made.
#[test]
fn checkpoints_move_between_xla_meshes_and_the_interpreter() {
    let (program, loss, weights) = mlp();
    let plugin = meshwork_xla::find::load(&meshwork_xla::find::plugin_path(None).unwrap()).unwrap();
    let mesh = |d: usize, m: usize| {
        let mut s = Shardings::new(Mesh::iota(&[("data", d), ("model", m)]).unwrap())
            .with("x", "P('data')")
            .unwrap()
            .with("labels", "P('data')")
            .unwrap();
        if m > 1 {
            s = s.with("w1", "P(None, 'model')").unwrap().with("w2", "P('model', None)").unwrap();
        }
        s
    };
    let on_xla = |n: usize| {
        let (_, s) = metrics_on(n);
        s.with_backend(Arc::new(Xla::with_devices(&plugin, n).unwrap()))
    };
    let adam = Optimizer::adam();
    // The uninterrupted run, on the interpreter on one device.
    let (_, one) = metrics_on(1);
    let mut whole = one.compile_train_step(&program, loss, &weights, adam, &mesh(1, 1)).unwrap();
    init(&whole, &program);
    let want: Vec<f64> = (0..9).map(|s| whole.step(&batch(s), 0.05).unwrap()).collect();
    let dir = tempfile::tempdir().unwrap();
    // Steps 0..3 on XLA 2x2, saved.
    let xla4 = on_xla(4);
    let mut a = xla4.compile_train_step(&program, loss, &weights, adam, &mesh(2, 2)).unwrap();
    init(&a, &program);
    let mut got: Vec<f64> = (0..3).map(|s| a.step(&batch(s), 0.05).unwrap()).collect();
    a.save_checkpoint(dir.path().join("a")).unwrap();
    // Steps 3..6 on the interpreter 1x2, restored from it and saved.
    let (_, two) = metrics_on(2);
    let mut b = two.compile_train_step(&program, loss, &weights, adam, &mesh(1, 2)).unwrap();
    b.restore_checkpoint(dir.path().join("a")).unwrap();
    got.extend((3..6).map(|s| b.step(&batch(s), 0.05).unwrap()));
    b.save_checkpoint(dir.path().join("b")).unwrap();
    // Steps 6..9 on XLA 4x1, restored from the interpreter's.
    let mut c = xla4.compile_train_step(&program, loss, &weights, adam, &mesh(4, 1)).unwrap();
    c.restore_checkpoint(dir.path().join("b")).unwrap();
    assert_eq!(c.steps(), 6);
    got.extend((6..9).map(|s| c.step(&batch(s), 0.05).unwrap()));
    for (s, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!((g - w).abs() <= 1e-12 * w.abs(), "step {s}: {g} vs {w}");
    }
}

/// A program placed on 3 XLA devices, its variable `w` on device 2, a feed on device
/// 1, the compute on device 0 — transfers both ways within a step — gives the
/// interpreter's results and variables step after step, and a step moves only its
/// feed in and its results out through the host: the values crossing devices go
/// device to device.
#[test]
fn a_placed_program_on_xla_devices_gives_the_interpreters_without_host_round_trips() {
    use meshwork_strategy::placed::PlaceOptions;
    let mut b = Builder::new();
    let w = b.device("/device:CPU:2", |b| b.param("w", "f64[4]".parse()?)).unwrap();
    let x = b.device("/device:CPU:1", |b| b.param("x", "f64[4]".parse()?)).unwrap();
    let x2 = b.device("/device:CPU:1", |b| b.mul(x, x)).unwrap();
    let y = b.device("/device:CPU:0", |b| b.mul(w, x2)).unwrap();
    let t = b.device("/device:CPU:0", |b| b.tanh(y)).unwrap();
    let s = b.device("/device:CPU:0", |b| b.reduce_sum(t, &[0], false)).unwrap();
    let g = b.device("/device:CPU:1", |b| b.mul(t, x)).unwrap();
    let new_w = b.device("/device:CPU:2", |b| b.sub(w, g)).unwrap();
    let p = b.finish(&[s, new_w]).unwrap();

    let plugin = meshwork_xla::find::load(&meshwork_xla::find::plugin_path(None).unwrap()).unwrap();
    let backend = Arc::new(Xla::with_devices(&plugin, 3).unwrap());
    let on_xla = Strategy::data_parallel(3).unwrap().with_backend(backend.clone());
    let interp = Strategy::data_parallel(3).unwrap();
    let a = on_xla.place(&p, &[(1, 0)], &PlaceOptions::default()).unwrap();
    let b = interp.place(&p, &[(1, 0)], &PlaceOptions::default()).unwrap();
    assert_eq!(a.plan().parts().len(), 3, "{a}");
    let w0 = Tensor::f64(&[4], vec![0.5, -1.0, 0.25, 2.0]).unwrap();
    a.set("w", w0.clone()).unwrap();
    b.set("w", w0).unwrap();
    let client = backend.session().client();
    for step in 0..4 {
        let x: Vec<f64> = (0..4).map(|i| ((i + 3 * step) as f64 * 0.7).sin()).collect();
        let feed = [Tensor::f64(&[4], x).unwrap()];
        let before = client.transfers();
        let got = a.step(&feed).unwrap();
        let moved = client.transfers() - before;
        let want = b.step(&feed).unwrap();
        assert!((got[0].to_f64()[0] - want[0].to_f64()[0]).abs() <= 1e-12, "step {step}");
        assert_eq!(moved.host_to_device, 32, "only the feed goes in: {moved:?}");
        assert_eq!(moved.device_to_host, 8, "only the result comes out: {moved:?}");
        // Every value crossing devices once, device to device: the plan's bytes.
        assert_eq!(moved.device_to_device, a.transfer_bytes(), "{moved:?}");
        assert!(moved.device_to_device > 0);
        let (gw, ww) = (a.get("w").unwrap().to_f64(), b.get("w").unwrap().to_f64());
        for (u, v) in gw.iter().zip(&ww) {
            assert!((u - v).abs() <= 1e-12 * (1.0 + v.abs()), "step {step}: w {gw:?} vs {ww:?}");
        }
    }
}

/// The seed's variable-reshard state machine over device buffers: resident state
/// taken from XLA devices on a 2x1 mesh moves onto a 1x2 mesh (unsharded and sharded
/// anew) and onto 2x2 with XLA's partitioner, stays put on the same mesh, and the
/// steps after it are the uninterrupted interpreter run's.
#[test]
fn resident_state_reshards_between_xla_meshes_and_partitioners() {
    use meshwork_strategy::backend::Partitioner;
    let (program, loss, weights) = mlp();
    let plugin = meshwork_xla::find::load(&meshwork_xla::find::plugin_path(None).unwrap()).unwrap();
    let on = |p: Partitioner| {
        let (_, s) = metrics_on(4);
        s.with_backend(Arc::new(Xla::with_devices(&plugin, 4).unwrap().with_partitioner(p)))
    };
    let shardings = mlp_shardings;
    let adam = Optimizer::adam();
    let (_, interp) = metrics_on(4);
    let mut whole =
        interp.compile_train_step(&program, loss, &weights, adam, &one_device()).unwrap();
    init(&whole, &program);
    let want: Vec<f64> = (0..9).map(|s| whole.step(&batch(s), 0.05).unwrap()).collect();

    let (a, b, c) = (on(Partitioner::Meshwork), on(Partitioner::Meshwork), on(Partitioner::Xla));
    let mut first = a.compile_train_step(&program, loss, &weights, adam, &shardings(2, 1)).unwrap();
    init(&first, &program);
    let mut got: Vec<f64> = (0..3).map(|s| first.step(&batch(s), 0.05).unwrap()).collect();
    let mut state = first.state().unwrap();
    // The same mesh and layouts: nothing moves.
    let mut same = a.compile_train_step(&program, loss, &weights, adam, &shardings(2, 1)).unwrap();
    assert!(!same.put_state(&mut state.clone()).unwrap());
    // Onto 1x2: moved, and training goes on.
    let mut second =
        b.compile_train_step(&program, loss, &weights, adam, &shardings(1, 2)).unwrap();
    assert!(second.put_state(&mut state).unwrap());
    got.extend((3..6).map(|s| second.step(&batch(s), 0.05).unwrap()));
    // Onto 2x2 split by XLA's partitioner.
    let mut state = second.state().unwrap();
    let mut third = c.compile_train_step(&program, loss, &weights, adam, &shardings(2, 2)).unwrap();
    assert!(third.put_state(&mut state).unwrap());
    got.extend((6..9).map(|s| third.step(&batch(s), 0.05).unwrap()));
    for (s, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!((g - w).abs() <= 1e-12 * w.abs(), "step {s}: {g} vs {w}");
    }
}

/// Two processes (threads joined by the executor's loopback interconnect), each a
/// PJRT client of 2 CPU devices, run the four positions of a 2x2 mesh: XLA computes
/// the segments between collectives, meshwork's executor runs the collectives across
/// the processes, and every process gets the losses, weights and optimizer state the
/// interpreter gets on 4 devices of one process. (`cargo xtask mpi-test` runs the
/// same over MPI: `examples/mpi_xla.rs`.)
#[test]
fn a_mesh_over_two_processes_of_xla_devices_trains_like_one_process() {
    use meshwork_strategy::executor::{LoopbackInterconnect, Runtime};
    use meshwork_strategy::{DeviceAssignment, Topology};
    let (program, loss, weights) = mlp();
    let plugin = meshwork_xla::find::load(&meshwork_xla::find::plugin_path(None).unwrap()).unwrap();
    let adam = Optimizer::adam();
    let run = |s: &Strategy| {
        let mut step =
            s.compile_train_step(&program, loss, &weights, adam, &mlp_shardings(2, 2)).unwrap();
        init(&step, &program);
        let mut losses: Vec<f64> = (0..2).map(|i| step.step(&batch(i), 0.05).unwrap()).collect();
        losses.extend(step.run_steps(&(2..5).map(batch).collect::<Vec<_>>(), &[0.05; 3]).unwrap());
        let state: Vec<Vec<f64>> = ["w1", "b1", "w2", "optimizer.v.w2"]
            .iter()
            .map(|n| step.get(n).unwrap().to_f64())
            .collect();
        (losses, state)
    };
    let (want_losses, want_state) = run(&metrics_on(4).1);
    let links = LoopbackInterconnect::group(2);
    let got: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = links
            .into_iter()
            .map(|link| {
                let (run, plugin) = (&run, &plugin);
                scope.spawn(move || {
                    let topology = Topology::new(vec![4], 2).unwrap();
                    let events: Arc<Mutex<Vec<MetricEvent>>> = Arc::default();
                    let seen = events.clone();
                    let spec = MetricSpec {
                        id: 7,
                        name: "loss".into(),
                        specs: vec!["f64[]".parse().unwrap()],
                    };
                    let s = Strategy::new(DeviceAssignment::build(&topology, &[1], None).unwrap())
                        .unwrap()
                        .with_runtime(Runtime::new(2).unwrap().with_interconnect(link))
                        .unwrap()
                        .with_metrics(
                            &[spec],
                            Arc::new(move |e: &MetricEvent| seen.lock().unwrap().push(e.clone())),
                        )
                        .unwrap()
                        .with_backend(Arc::new(Xla::with_devices(plugin, 2).unwrap()));
                    assert!(s.is_multi_process());
                    let out = run(&s);
                    s.flush_metrics(std::time::Duration::from_secs(10)).unwrap();
                    let emitted: Vec<f64> =
                        events.lock().unwrap().iter().map(|e| e.tensors[0].to_f64()[0]).collect();
                    (out, emitted)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (p, ((losses, state), emitted)) in got.into_iter().enumerate() {
        // What the program emits streams from position 0, in process 0.
        assert_eq!(emitted, if p == 0 { losses.clone() } else { Vec::new() }, "process {p}");
        for (s, (g, w)) in losses.iter().zip(&want_losses).enumerate() {
            assert!((g - w).abs() <= 1e-12 * w.abs(), "process {p}, step {s}: {g} vs {w}");
        }
        for (g, w) in state.iter().zip(&want_state) {
            assert_eq!(g.len(), w.len());
            for (x, y) in g.iter().zip(w) {
                assert!((x - y).abs() <= 1e-12 * (1.0 + y.abs()), "process {p}: {x} vs {y}");
            }
        }
    }
}
