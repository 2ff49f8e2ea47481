//! SPMD partitioning against one device: every program of the JAX oracle
//! (`program/testdata/cases.jsonl`), with its inputs (and cotangents) given random
//! layouts on random meshes of 1–8 devices where the dims divide, is partitioned
//! together with its gradient (`vjp`) and run on the mesh's devices; every output and
//! gradient equals the one-device run to a relative 1e-12 (and JAX's within the
//! oracle's 1e-9).

use meshwork_program::{Tensor, Value, fast};
use meshwork_strategy::Strategy;
use meshwork_strategy::partition::{megatron_spec, partition};
use meshwork_strategy::sharding::Mesh;
use meshwork_strategy::sharding::spmd::Layout;
use serde_json::Value as Json;

use crate::oracle::{OracleCase, Rng, close, random_mesh};

/// One case on one random mesh: outputs and gradients against one device and JAX.
fn check(strategy: &Strategy, index: usize, case: &Json) -> Result<(usize, usize), String> {
    let oracle = OracleCase::new(case)?;
    let (back, feed) = (&oracle.back, &oracle.feed);
    let (mesh, layouts) = random_mesh(index, feed);
    let outputs = vec![None; back.results().len()];
    let p = partition(back, &mesh, &layouts, &outputs).map_err(|e| format!("partition: {e}"))?;
    let got = strategy.run_partitioned(&p, feed).map_err(|e| format!("run on {mesh}: {e}\n{p}"))?;
    oracle.check(case, &got, &|| format!("on {mesh}\n{p}"))?;
    let tiled = p.inputs().iter().filter(|l| !l.is_replicated()).count();
    Ok((tiled, p.collectives().len()))
}

#[test]
fn every_oracle_case_partitioned_on_a_random_mesh_matches_one_device() {
    let strategy = Strategy::data_parallel(8).unwrap();
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../program/testdata/cases.jsonl");
    let text = std::fs::read_to_string(path).unwrap();
    let mut failed = Vec::new();
    let (mut sharded, mut communicating) = (0, 0);
    for (i, line) in text.lines().enumerate() {
        let case: Json = serde_json::from_str(line).unwrap();
        match check(&strategy, i, &case) {
            Ok((tiled, collectives)) => {
                sharded += usize::from(tiled > 0);
                communicating += usize::from(collectives > 0);
            }
            Err(e) => failed.push(format!("{}: {e}", case["id"])),
        }
    }
    let shown: Vec<&String> = failed.iter().take(5).collect();
    assert!(
        failed.is_empty(),
        "{} of 1500 failed:\n{}",
        failed.len(),
        shown.iter().map(|s| s.as_str()).collect::<Vec<_>>().join("\n\n")
    );
    // Most cases really are sharded, and most need collectives.
    assert!(sharded > 1000, "only {sharded} cases had a sharded input");
    assert!(communicating > 700, "only {communicating} cases communicated");
}

/// A decoder block (loss: the mean square of its output, so the backward pass reads
/// the forward's result) on a 2×2 `data × model` mesh, Megatron-style: the forward
/// pass has exactly two all-reduces over `model`, forward + backward four, and the
/// weight gradients one all-reduce each over `data`, all in one launch; the
/// partitioned gradients equal one device's, combined or not.
#[test]
fn megatron_decoder_block_two_all_reduces_each_way() {
    use meshwork_nn as nn;
    use meshwork_program::Builder;
    let mut b = Builder::new();
    let x = b.param("x", "f64[4,8,16]".parse().unwrap()).unwrap();
    let y = b.scope("layers.0", |b| nn::decoder_block(b, x, 4, 32)).unwrap();
    let sq = b.square(y).unwrap();
    let loss = b.reduce_mean(sq, &[0, 1, 2], false).unwrap();
    let program = b.finish(&[loss]).unwrap();
    let mesh = Mesh::iota(&[("data", 2), ("model", 2)]).unwrap();
    let inputs: Vec<Option<Layout>> = program
        .params()
        .iter()
        .map(|q| {
            let rank = q.spec.shape.rank();
            let spec = if q.name == "x" {
                "P('data')".parse().unwrap()
            } else {
                megatron_spec(&q.name, rank)
            };
            Some(Layout::from_spec(&mesh, &spec, rank).unwrap())
        })
        .collect();
    let on = |c: &&meshwork_strategy::partition::spmd::Collective, axis: &str| {
        c.axes == [axis.to_string()]
    };
    let forward = partition(&program, &mesh, &inputs, &[None]).unwrap();
    let model: Vec<_> = forward.collectives().iter().filter(|c| on(c, "model")).collect();
    assert_eq!(model.len(), 2, "{:?}", forward.collectives());
    assert!(model.iter().all(|c| c.op == "all_reduce"));

    let wrt: Vec<Value> = (0..program.params().len()).map(|k| Value(k as u32)).collect();
    let grads = meshwork_program::grad(&program, loss, &wrt).unwrap();
    let mut outputs = vec![None];
    outputs.extend(inputs.iter().cloned());
    let back = partition(&grads, &mesh, &inputs, &outputs).unwrap();
    let model: Vec<_> = back.collectives().iter().filter(|c| on(c, "model")).collect();
    assert_eq!(model.len(), 4, "{:?}", back.collectives());
    // Every weight gradient is reduced over data once, and so is the loss (x keeps
    // its gradient split over data).
    let data: Vec<_> = back.collectives().iter().filter(|c| on(c, "data")).collect();
    let weights = program.params().len() - 1;
    assert_eq!(data.len(), weights + 1, "{:?}", data);
    // ... and all of them travel in one launch (the all-reduce combiner); the model
    // axis keeps its four (each reads the one before).
    let launches = |axis: &str| {
        let mut l: Vec<usize> =
            back.collectives().iter().filter(|c| on(c, axis)).map(|c| c.launch).collect();
        l.sort_unstable();
        l.dedup();
        l.len()
    };
    assert_eq!((launches("data"), launches("model")), (1, 4), "{back}");
    assert_eq!(back.launches(), 5);
    let apart = meshwork_strategy::partition::partition_with(
        &grads,
        &mesh,
        &inputs,
        &outputs,
        &meshwork_strategy::partition::spmd::PartitionOptions {
            combine_bytes: 0,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(apart.launches(), weights + 1 + 4);

    let strategy = Strategy::data_parallel(4).unwrap();
    let mut seed = Rng(5);
    let feed: Vec<Tensor> = program
        .params()
        .iter()
        .map(|q| {
            let d = q.spec.shape.dims();
            let n = q.spec.shape.num_elements();
            Tensor::f64(d, (0..n).map(|_| seed.below(2001) as f64 / 1000.0 - 1.0).collect())
                .unwrap()
        })
        .collect();
    let got = strategy.run_partitioned(&back, &feed).unwrap();
    let want = fast::evaluate(&grads, &feed).unwrap();
    for (k, (g, w)) in got.iter().zip(&want).enumerate() {
        close(g, w, 1e-12).unwrap_or_else(|e| panic!("result {k}: {e}"));
    }
    // Combined or not, the same bits.
    let uncombined = strategy.run_partitioned(&apart, &feed).unwrap();
    assert_eq!(got, uncombined);
}

#[path = "../../../nn/tests/it/files.rs"]
pub(crate) mod files;

/// The JAX reference transformer's training step (`nn/testdata`)
/// compiled on `strategy` over a `data × model` mesh (rows over data, Megatron's
/// specs over model), its weights set to the reference's initial values; with
/// `expected.json`.
fn reference_step(
    strategy: &Strategy,
    data: usize,
    model: usize,
    optimizer: meshwork_nn::Optimizer,
) -> (meshwork_strategy::spmd::CompiledTrainStep<'_>, Json) {
    use meshwork_strategy::partition::Shardings;
    let (expected, program, loss, _) = files::reference_model();
    let weights: Vec<Value> = (1..program.params().len()).map(|k| Value(k as u32)).collect();
    let mesh = Mesh::iota(&[("data", data), ("model", model)]).unwrap();
    let mut shardings = Shardings::new(mesh).with("rows", "P('data')").unwrap();
    for p in &program.params()[1..] {
        shardings = shardings.with_spec(&p.name, megatron_spec(&p.name, p.spec.shape.rank()));
    }
    let step =
        strategy.compile_train_step(&program, loss, &weights, optimizer, &shardings).unwrap();
    let init = files::safetensors(&files::testdata("init.safetensors"));
    for p in &program.params()[1..] {
        let (shape, values) = &init[&p.name];
        step.set(&p.name, &Tensor::f64(shape, values.clone()).unwrap()).unwrap();
    }
    (step, expected)
}

/// Steps `range` of the reference run (its batches: rows `(s·B + i) mod N`) on
/// `step`; their losses.
fn reference_steps(
    step: &mut meshwork_strategy::spmd::CompiledTrainStep<'_>,
    range: std::ops::Range<usize>,
    lr: f64,
) -> Vec<f64> {
    range.map(|s| step.step(&[reference_rows(s)], lr).unwrap()).collect()
}

/// Step `s`'s batch of the reference run: rows `(s·B + i) mod N` of `tokens.npy`.
pub(crate) fn reference_rows(s: usize) -> Tensor {
    let (_, _, _, batch) = files::reference_model();
    let (n, m, tokens) = files::npy_i32(&files::testdata("tokens.npy"));
    let mut rows = Vec::with_capacity(batch * m);
    for i in 0..batch {
        let r = (s * batch + i) % n;
        rows.extend_from_slice(&tokens[r * m..(r + 1) * m]);
    }
    Tensor::i32(&[batch, m], rows).unwrap()
}

/// Trains the JAX reference transformer 20 steps with the compiled, device-resident
/// training step on a `data × model` mesh; returns each step's loss and JAX's file.
fn train_on_mesh(
    data: usize,
    model: usize,
    optimizer: meshwork_nn::Optimizer,
    lr: f64,
) -> (Vec<f64>, Json) {
    let strategy = Strategy::data_parallel(data * model).unwrap();
    let (mut step, expected) = reference_step(&strategy, data, model, optimizer);
    let steps = expected["config"]["steps"].as_u64().unwrap() as usize;
    (reference_steps(&mut step, 0..steps, lr), expected)
}

fn assert_losses(mesh: &str, got: &[f64], want: &Json) {
    let want: Vec<f64> = want.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    assert_eq!(got.len(), want.len());
    for (s, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!((g - w).abs() <= 1e-9 * w.abs(), "mesh {mesh} step {s}: loss {g}, JAX {w}");
    }
}

/// JAX's reference run reproduced at every step on every mesh, with SGD and Adam.
#[test]
fn the_reference_transformer_trains_as_jax_on_every_mesh() {
    for (data, model) in [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4)] {
        let (sgd, expected) = train_on_mesh(data, model, meshwork_nn::Optimizer::Sgd, 0.1);
        assert_losses(&format!("{data}x{model}"), &sgd, &expected["losses_sgd"]);
        let (adam, expected) = train_on_mesh(data, model, meshwork_nn::Optimizer::adam(), 0.01);
        assert_losses(&format!("{data}x{model}"), &adam, &expected["losses_adam"]);
    }
}

/// Several steps per host call (`run_steps`) are JAX's steps too, on a 2x2 mesh with
/// Adam (its step count advancing within the call), whatever the calls' sizes.
#[test]
fn several_steps_per_host_call_are_the_same_steps() {
    let strategy = Strategy::data_parallel(4).unwrap();
    let (mut step, expected) = reference_step(&strategy, 2, 2, meshwork_nn::Optimizer::adam());
    let want: Vec<f64> =
        expected["losses_adam"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    let batches = |r: std::ops::Range<usize>| -> Vec<Vec<Tensor>> {
        r.map(|s| vec![reference_rows(s)]).collect()
    };
    let mut got = step.run_steps(&batches(0..3), &[0.01; 3]).unwrap();
    assert_eq!(step.steps(), 3);
    got.extend(step.run_steps(&batches(3..7), &[0.01; 4]).unwrap());
    for s in 7..20 {
        got.extend(step.run_steps(&batches(s..s + 1), &[0.01]).unwrap());
    }
    for (s, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!((g - w).abs() <= 1e-9 * w.abs(), "step {s}: {g} vs JAX {w}");
    }
    assert!(step.run_steps(&batches(0..2), &[0.01]).is_err(), "a rate per batch");
}

/// Ten steps on one mesh, a sharded checkpoint, ten more on another mesh restored
/// from it: JAX's twenty losses at every step (SGD and Adam, whose moments and step
/// count travel in the checkpoint), each position's file holding only its regions.
#[test]
fn compiled_state_saved_on_one_mesh_restores_onto_another() {
    use meshwork_nn::Optimizer;
    type Mesh2 = (usize, usize);
    let cases: [(Mesh2, Mesh2, Optimizer, f64, &str); 3] = [
        ((2, 2), (1, 4), Optimizer::adam(), 0.01, "losses_adam"),
        ((1, 4), (4, 1), Optimizer::adam(), 0.01, "losses_adam"),
        ((2, 1), (1, 2), Optimizer::Sgd, 0.1, "losses_sgd"),
    ];
    for ((d0, m0), (d1, m1), optimizer, lr, key) in cases {
        let tmp_dir = tempfile::tempdir().unwrap();
        let dir = tmp_dir.path().to_path_buf();
        let first = Strategy::data_parallel(d0 * m0).unwrap();
        let (mut step, expected) = reference_step(&first, d0, m0, optimizer);
        let mut losses = reference_steps(&mut step, 0..10, lr);
        step.save_checkpoint(&dir).unwrap();
        for r in 0..d0 * m0 {
            assert!(dir.join(format!("shard-{r}.safetensors")).is_file());
        }
        let second = Strategy::data_parallel(d1 * m1).unwrap();
        let (mut resumed, _) = reference_step(&second, d1, m1, optimizer);
        resumed.restore_checkpoint(&dir).unwrap();
        assert_eq!(resumed.steps(), 10);
        // The restored weights are the saved ones, bit for bit, on the other mesh.
        for name in ["layers.0.attn.wq", "layers.1.mlp.w2", "embed"] {
            assert_eq!(resumed.get(name).unwrap(), step.get(name).unwrap(), "{name}");
        }
        losses.extend(reference_steps(&mut resumed, 10..20, lr));
        assert_losses(&format!("{d0}x{m0} then {d1}x{m1}"), &losses, &expected[key]);
    }
}

/// Resident state moves through the seed's state machine: onto another mesh it is
/// unsharded and sharded anew (and training goes on as JAX's), into a program of the
/// same layout nothing moves; its default format is the whole values.
#[test]
fn resident_state_moves_through_the_reshard_state_machine() {
    let adam = meshwork_nn::Optimizer::adam();
    let two = Strategy::data_parallel(2).unwrap();
    let (mut step, expected) = reference_step(&two, 2, 1, adam);
    let mut losses = reference_steps(&mut step, 0..10, 0.01);
    let mut state = step.state().unwrap();
    assert_eq!(state.step(), Some(10));
    let key = step.compiled().format_key();
    assert_eq!(state.format_key("embed").unwrap(), Some(key.as_str()));

    // Same mesh and layouts: the same key, nothing moves, the parts are the state's.
    let (mut same, _) = reference_step(&two, 2, 1, adam);
    assert_eq!(same.compiled().format_key(), key);
    assert!(!same.put_state(&mut state.clone()).unwrap());
    for name in state.names() {
        assert_eq!(same.get(name).unwrap(), state.value(name).unwrap(), "{name}");
    }

    // Another mesh: moved, and training goes on as JAX's.
    let (mut other, _) = reference_step(&two, 1, 2, adam);
    assert_ne!(other.compiled().format_key(), key);
    assert!(other.put_state(&mut state).unwrap());
    assert_eq!(state.format_key("embed").unwrap(), Some(other.compiled().format_key().as_str()));
    losses.extend(reference_steps(&mut other, 10..20, 0.01));
    assert_losses("2x1 then 1x2", &losses, &expected["losses_adam"]);
    // Putting it again where it already is: nothing moves.
    assert!(!other.put_state(&mut state).unwrap());

    // The default format: whole values, the same as the program's.
    let mut whole = step.state().unwrap();
    assert!(whole.to_default().unwrap());
    assert!(!whole.to_default().unwrap());
    assert_eq!(whole.format_key("layers.0.mlp.w1").unwrap(), None);
    assert_eq!(whole.value("layers.0.mlp.w1").unwrap(), step.get("layers.0.mlp.w1").unwrap());
}

/// A checkpoint or state that does not fit is refused and changes nothing: a missing
/// parameter, another shape, no step count; a compiled program's checkpoint restores
/// into a strategy's variables of the same names.
#[test]
fn what_does_not_fit_is_refused_and_changes_nothing() {
    use meshwork_strategy::VariableOptions;
    let adam = meshwork_nn::Optimizer::adam();
    let strategy = Strategy::data_parallel(2).unwrap();
    let (mut step, _) = reference_step(&strategy, 1, 2, adam);
    reference_steps(&mut step, 0..2, 0.01);
    let before = step.get("layers.1.attn.wo").unwrap();

    // A SGD step's checkpoint has no Adam moments.
    let tmp_dir = tempfile::tempdir().unwrap();
    let dir = tmp_dir.path().to_path_buf();
    let (sgd, _) = reference_step(&strategy, 1, 2, meshwork_nn::Optimizer::Sgd);
    sgd.save_checkpoint(&dir).unwrap();
    let err = step.restore_checkpoint(&dir).unwrap_err();
    assert!(err.to_string().contains("not in the checkpoint"), "{err}");
    assert_eq!(step.get("layers.1.attn.wo").unwrap(), before);
    assert_eq!(step.steps(), 2);
    // A state without a step count or with a parameter missing.
    let mut plain = step.compiled().state().unwrap();
    assert!(step.put_state(&mut plain).unwrap_err().to_string().contains("no step count"));
    let mut partial = sgd.state().unwrap();
    let err = step.put_state(&mut partial).unwrap_err();
    assert!(err.to_string().contains("holds no parameter optimizer."), "{err}");
    assert_eq!(step.get("layers.1.attn.wo").unwrap(), before);
    // Into a non-empty directory: refused, nothing there touched.
    let err = step.save_checkpoint(&dir).unwrap_err();
    assert!(err.to_string().contains("not an empty directory"), "{err}");

    // The compiled checkpoint restores into a strategy's variables by name.
    let host = Strategy::data_parallel(2).unwrap();
    let zeros = |shape: &[usize]| Tensor::F64(ndarray::ArrayD::zeros(ndarray::IxDyn(shape)));
    let want = sgd.get("layers.1.attn.wo").unwrap();
    let wo = host
        .create_variable("layers.1.attn.wo", zeros(want.shape()), VariableOptions::default())
        .unwrap();
    host.restore_checkpoint(&dir).unwrap();
    let got = host.read_variable(&wo).unwrap();
    assert_eq!(got.shape(), want.shape());
    let got: Vec<f64> = match got {
        Tensor::F64(a) => a.iter().copied().collect(),
        other => panic!("{other:?}"),
    };
    assert_eq!(got, want.to_f64());
}

/// A checkpoint manager keeps a compiled step's checkpoints as a strategy's: each
/// step renamed into place, the newest `keep`, the latest restorable on another mesh;
/// a step that exists is refused.
#[test]
fn a_checkpoint_manager_keeps_compiled_steps() {
    use meshwork_strategy::checkpoint::CheckpointManager;
    let adam = meshwork_nn::Optimizer::adam();
    let tmp_root = tempfile::tempdir().unwrap();
    let root = tmp_root.path().to_path_buf();
    let strategy = Strategy::data_parallel(2).unwrap();
    let (mut step, expected) = reference_step(&strategy, 2, 1, adam);
    let mut manager = CheckpointManager::open(&root, 1).unwrap();
    let mut losses = Vec::new();
    for (range, at) in [(0..3, 3), (3..7, 7)] {
        losses.extend(reference_steps(&mut step, range, 0.01));
        let meta = serde_json::json!({ "at": at });
        step.save_to(&mut manager, at, &meta).unwrap();
    }
    assert_eq!(manager.steps().unwrap(), vec![7]);
    let err = step.save_to(&mut manager, 7, &serde_json::json!({})).unwrap_err();
    assert!(err.to_string().contains("already exists"), "{err}");
    assert_eq!(manager.steps().unwrap(), vec![7]);
    let (_, latest) = manager.latest().unwrap().unwrap();
    let other = Strategy::data_parallel(4).unwrap();
    let (mut resumed, _) = reference_step(&other, 2, 2, adam);
    resumed.restore_checkpoint(&latest).unwrap();
    assert_eq!(
        meshwork_strategy::checkpoint::checkpoint_metadata(&latest).unwrap(),
        Some(serde_json::json!({ "at": 7 }))
    );
    losses.extend(reference_steps(&mut resumed, 7..20, 0.01));
    assert_losses("2x1 then 2x2", &losses, &expected["losses_adam"]);
    drop(manager);
}

/// The main job's MLP written with the `nn` layers (`linear`, `relu`,
/// `softmax_cross_entropy`) and trained by `compile_train_step` (SGD) on every mesh:
/// each step's loss equals the hand-written MLP of `examples/common/mlp.rs` (its own forward and
/// backward, closures over the strategy) on one device, within 1e-12 relative in f64.
#[test]
fn the_nn_mlp_trains_as_the_hand_written_one_on_every_mesh() {
    use crate::mlp::{self, Dataset, Params, TrainConfig};
    use meshwork_nn as nn;
    use meshwork_nn::Optimizer;
    use meshwork_program::Builder;
    let (features, hidden, classes, batch, rows, steps, lr) = (12, 16, 4, 8, 40, 12, 0.5);
    let data = Dataset::synthetic(3, rows, features, classes);
    let init = Params::init(3, features, hidden, classes);
    let config = TrainConfig { data: 1, model: 1, steps, batch, lr, ..TrainConfig::default() };
    let want = mlp::train(&config, &data, &init, &mut |_| std::ops::ControlFlow::Continue(()))
        .unwrap()
        .losses;

    let mut b = Builder::new();
    let x = b.param("x", format!("f64[{batch},{features}]").parse().unwrap()).unwrap();
    let labels = b.param("labels", format!("i32[{batch}]").parse().unwrap()).unwrap();
    let h = nn::linear(&mut b, x, hidden, "w1", Some("b1")).unwrap();
    let h = b.relu(h).unwrap();
    let z = nn::linear(&mut b, h, classes, "w2", Some("b2")).unwrap();
    let loss = nn::softmax_cross_entropy(&mut b, z, labels).unwrap();
    let program = b.finish(&[loss]).unwrap();
    let weights: Vec<Value> = (2..6).map(|k| Value(k as u32)).collect();
    let tensor =
        |a: &ndarray::ArrayD<f64>| Tensor::f64(a.shape(), a.iter().copied().collect()).unwrap();
    for (d, m) in [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4)] {
        let mesh = Mesh::iota(&[("data", d), ("model", m)]).unwrap();
        let shardings = mlp_shardings(mesh);
        let strategy = Strategy::data_parallel(d * m).unwrap();
        let mut step = strategy
            .compile_train_step(&program, loss, &weights, Optimizer::Sgd, &shardings)
            .unwrap();
        step.set("w1", &tensor(&init.w1.clone().into_dyn())).unwrap();
        step.set("b1", &tensor(&init.b1.clone().into_dyn())).unwrap();
        step.set("w2", &tensor(&init.w2.clone().into_dyn())).unwrap();
        step.set("b2", &tensor(&init.b2.clone().into_dyn())).unwrap();
        // Gradients over data in one launch; forward logits summed over model.
        let part = step.compiled().partitioned();
        let data_launches: std::collections::BTreeSet<usize> = part
            .collectives()
            .iter()
            .filter(|c| c.axes == ["data".to_string()])
            .map(|c| c.launch)
            .collect();
        assert!(d == 1 || data_launches.len() == 1, "{d}x{m}: {part}");
        for (s, want) in want.iter().enumerate() {
            let rows: Vec<usize> = (0..batch).map(|i| (s * batch + i) % rows).collect();
            let xs: Vec<f64> = rows.iter().flat_map(|&r| data.x.row(r).to_vec()).collect();
            let ls: Vec<i32> = rows.iter().map(|&r| data.labels[r] as i32).collect();
            let got = step
                .step(
                    &[
                        Tensor::f64(&[batch, features], xs).unwrap(),
                        Tensor::i32(&[batch], ls).unwrap(),
                    ],
                    lr,
                )
                .unwrap();
            assert!(
                (got - want).abs() <= 1e-12 * want.abs(),
                "{d}x{m} step {s}: {got} vs the hand-written {want}"
            );
        }
    }
}

/// A `dot_general` contracting a sharded dim makes a pending sum; where its use wants
/// it sharded, the partitioner reduce-scatters it instead of all-reducing (half the
/// bytes), and the result equals one device's. A weight sharded over `data` as ZeRO
/// keeps it gets its gradient reduce-scattered the same way in a training step.
#[test]
fn a_pending_sum_wanted_sharded_is_reduce_scattered() {
    use meshwork_nn::Optimizer;
    use meshwork_program::Builder;
    use meshwork_strategy::partition::Shardings;
    let mesh = Mesh::iota(&[("model", 2)]).unwrap();
    let mut b = Builder::new();
    let x = b.param("x", "f64[4,6]".parse().unwrap()).unwrap();
    let w = b.param("w", "f64[6,8]".parse().unwrap()).unwrap();
    let z = b.matmul(x, w).unwrap();
    let program = b.finish(&[z]).unwrap();
    let layout =
        |spec: &str, rank| Some(Layout::from_spec(&mesh, &spec.parse().unwrap(), rank).unwrap());
    let inputs = [layout("P(None, 'model')", 2), layout("P('model')", 2)];
    let p = partition(&program, &mesh, &inputs, &[layout("P(None, 'model')", 2)]).unwrap();
    let ops: Vec<&str> = p.collectives().iter().map(|c| c.op).collect();
    assert_eq!(ops, ["reduce_scatter"], "{p}");
    let replicated = partition(&program, &mesh, &inputs, &[None]).unwrap();
    let ops: Vec<&str> = replicated.collectives().iter().map(|c| c.op).collect();
    assert_eq!(ops, ["all_reduce"], "{replicated}");
    assert_eq!(2 * p.bytes_moved(), replicated.bytes_moved());
    let strategy = Strategy::data_parallel(2).unwrap();
    let mut seed = Rng(11);
    let mut random = |d: &[usize]| {
        let n = d.iter().product();
        Tensor::f64(d, (0..n).map(|_| seed.below(2001) as f64 / 1000.0 - 1.0).collect()).unwrap()
    };
    let feed = [random(&[4, 6]), random(&[6, 8])];
    let want = fast::evaluate(&program, &feed).unwrap();
    for q in [&p, &replicated] {
        close(&strategy.run_partitioned(q, &feed).unwrap()[0], &want[0], 1e-12).unwrap();
    }

    // ZeRO: the weight (and its momentum) sharded over data, the batch too.
    let mesh = Mesh::iota(&[("data", 2)]).unwrap();
    let mut b = Builder::new();
    let x = b.param("x", "f64[4,6]".parse().unwrap()).unwrap();
    let w = b.param("w", "f64[6,8]".parse().unwrap()).unwrap();
    let z = b.matmul(x, w).unwrap();
    let t = b.tanh(z).unwrap();
    let loss = b.reduce_mean(t, &[0, 1], false).unwrap();
    let program = b.finish(&[loss]).unwrap();
    let shardings =
        Shardings::new(mesh).with("x", "P('data')").unwrap().with("w", "P('data')").unwrap();
    let momentum = Optimizer::Momentum { momentum: 0.9 };
    let mut step = strategy.compile_train_step(&program, loss, &[w], momentum, &shardings).unwrap();
    let part = step.compiled().partitioned();
    let scattered: Vec<_> =
        part.collectives().iter().filter(|c| c.op == "reduce_scatter").collect();
    // The gradient is reduce-scattered onto w's rows; only the scalar loss is
    // all-reduced. (The forward pass may reduce-scatter too: moving x to columns and
    // scattering the partial product is cheaper here than gathering w.)
    assert!(!scattered.is_empty(), "{part}");
    assert!(!part.collectives().iter().any(|c| c.op == "all_reduce" && c.bytes > 16), "{part}");
    // Against one device running the same training step.
    let one = Strategy::data_parallel(1).unwrap();
    let single = Shardings::new(Mesh::iota(&[("data", 1)]).unwrap());
    let mut reference = one.compile_train_step(&program, loss, &[w], momentum, &single).unwrap();
    let w0 = random(&[6, 8]);
    step.set("w", &w0).unwrap();
    reference.set("w", &w0).unwrap();
    for _ in 0..3 {
        let batch = [random(&[4, 6])];
        let got = step.step(&batch, 0.5).unwrap();
        let want = reference.step(&batch, 0.5).unwrap();
        assert!((got - want).abs() <= 1e-12 * want.abs(), "{got} vs {want}");
    }
    close(&step.get("w").unwrap(), &reference.get("w").unwrap(), 1e-12).unwrap();
}

/// A model whose step fails on the device holding a zero divisor: `x` f64[8,6] and
/// `d` i64[8] split over `data`, `w` f64[6,4] over `model`; the loss is
/// `mean(tanh(x w)) + 0 · mean(iota / d)`, so an integer division by zero in the rows
/// of one `data` replica fails that device's step (the interpreters refuse it).
fn divisor_step(
    strategy: &Strategy,
    data: usize,
    model: usize,
) -> meshwork_strategy::spmd::CompiledTrainStep<'_> {
    use meshwork_program::Builder;
    use meshwork_strategy::partition::Shardings;
    let mut b = Builder::new();
    let x = b.param("x", "f64[8,6]".parse().unwrap()).unwrap();
    let d = b.param("d", "i64[8]".parse().unwrap()).unwrap();
    let w = b.param("w", "f64[6,4]".parse().unwrap()).unwrap();
    let z = b.matmul(x, w).unwrap();
    let t = b.tanh(z).unwrap();
    let fit = b.reduce_mean(t, &[0, 1], false).unwrap();
    let k = b.iota(meshwork_types::DType::I64, &[8], 0).unwrap();
    let q = b.div(k, d).unwrap();
    let qf = b.convert(q, meshwork_types::DType::F64).unwrap();
    let m = b.reduce_mean(qf, &[0], false).unwrap();
    let zero = b.scalar_like(m, 0.0).unwrap();
    let m0 = b.mul(m, zero).unwrap();
    let loss = b.add(fit, m0).unwrap();
    let program = b.finish(&[loss]).unwrap();
    let mesh = Mesh::iota(&[("data", data), ("model", model)]).unwrap();
    let shardings = Shardings::new(mesh)
        .with("x", "P('data')")
        .unwrap()
        .with("d", "P('data')")
        .unwrap()
        .with("w", "P(None, 'model')")
        .unwrap();
    let step = strategy
        .compile_train_step(&program, loss, &[w], meshwork_nn::Optimizer::adam(), &shardings)
        .unwrap();
    let w0: Vec<f64> = (0..24).map(|i| (f64::from(i) * 0.37).sin()).collect();
    step.set("w", &Tensor::f64(&[6, 4], w0).unwrap()).unwrap();
    step
}

/// Batch `s` of the divisor model: `x` from a sine, divisors 1..=8 (or a zero in row
/// `zero`).
fn divisor_batch(s: usize, zero: Option<usize>) -> Vec<Tensor> {
    let x: Vec<f64> = (0..48).map(|i| ((i + 7 * s) as f64 * 0.11).cos()).collect();
    let mut d: Vec<i64> = (1..=8).collect();
    if let Some(r) = zero {
        d[r] = 0;
    }
    vec![Tensor::f64(&[8, 6], x).unwrap(), Tensor::i64(&[8], d).unwrap()]
}

/// A step that fails on one device (a zero divisor in the rows only the second `data`
/// replica holds) returns that device's error, leaves every device's weights and
/// optimizer state as they were, and training goes on as on one device that never saw
/// the failed step.
#[test]
fn a_failed_step_leaves_the_resident_state_as_it_was() {
    let strategy = Strategy::data_parallel(4).unwrap();
    let mut step = divisor_step(&strategy, 2, 2);
    let one = Strategy::data_parallel(1).unwrap();
    let mut reference = divisor_step(&one, 1, 1);
    for s in 0..3 {
        let (got, want) = (
            step.step(&divisor_batch(s, None), 0.01).unwrap(),
            reference.step(&divisor_batch(s, None), 0.01).unwrap(),
        );
        assert!((got - want).abs() <= 1e-12 * want.abs(), "step {s}: {got} vs {want}");
    }
    let before = step.state().unwrap();
    let err = step.step(&divisor_batch(3, Some(6)), 0.01).unwrap_err();
    assert!(err.to_string().contains("division by zero"), "{err}");
    assert_eq!(step.steps(), 3);
    assert_eq!(step.state().unwrap(), before);
    for s in 3..6 {
        let (got, want) = (
            step.step(&divisor_batch(s, None), 0.01).unwrap(),
            reference.step(&divisor_batch(s, None), 0.01).unwrap(),
        );
        assert!((got - want).abs() <= 1e-12 * want.abs(), "step {s}: {got} vs {want}");
    }
}

/// A call of several steps whose second step fails changes nothing: the weights, the
/// moments and the step count are as before it, and the run goes on as if it had not
/// been made.
#[test]
fn several_steps_per_host_call_fail_whole() {
    let strategy = Strategy::data_parallel(4).unwrap();
    let mut step = divisor_step(&strategy, 2, 2);
    let one = Strategy::data_parallel(1).unwrap();
    let mut reference = divisor_step(&one, 1, 1);
    let good = |r: std::ops::Range<usize>| -> Vec<Vec<Tensor>> {
        r.map(|s| divisor_batch(s, None)).collect()
    };
    let mut got = step.run_steps(&good(0..3), &[0.01; 3]).unwrap();
    let before = step.state().unwrap();
    let bad = vec![divisor_batch(3, None), divisor_batch(4, Some(5)), divisor_batch(5, None)];
    assert!(step.run_steps(&bad, &[0.01; 3]).is_err());
    assert_eq!(step.steps(), 3, "the failed call took no step");
    assert_eq!(step.state().unwrap(), before);
    got.extend(step.run_steps(&good(3..7), &[0.01; 4]).unwrap());
    let want = reference.run_steps(&good(0..7), &[0.01; 7]).unwrap();
    for (s, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!((g - w).abs() <= 1e-12 * w.abs(), "step {s}: {g} vs {w}");
    }
}

/// What a model program `emit`s leaves a compiled step through the strategy's outfeed:
/// one record per step from mesh position 0, tagged with the step count, equal to the
/// loss the step returns.
#[test]
fn emitted_metrics_stream_through_the_outfeed_each_step() {
    use meshwork_nn as nn;
    use meshwork_nn::Optimizer;
    use meshwork_program::Builder;
    use meshwork_strategy::{MetricEvent, MetricSpec};
    use std::sync::{Arc, Mutex};
    let mut b = Builder::new();
    let x = b.param("x", "f64[8,6]".parse().unwrap()).unwrap();
    let labels = b.param("labels", "i32[8]".parse().unwrap()).unwrap();
    let h = nn::linear(&mut b, x, 8, "w1", Some("b1")).unwrap();
    let h = b.relu(h).unwrap();
    let z = nn::linear(&mut b, h, 3, "w2", None).unwrap();
    let loss = nn::softmax_cross_entropy(&mut b, z, labels).unwrap();
    let tok = b.emit(&[loss], 7).unwrap();
    let program = b.finish(&[loss, tok]).unwrap();
    let weights: Vec<Value> = (2..5).map(|k| Value(k as u32)).collect();
    let events: Arc<Mutex<Vec<MetricEvent>>> = Arc::default();
    let seen = events.clone();
    let spec = MetricSpec { id: 7, name: "loss".into(), specs: vec!["f64[]".parse().unwrap()] };
    let strategy = Strategy::data_parallel(4)
        .unwrap()
        .with_metrics(
            &[spec],
            Arc::new(move |e: &MetricEvent| seen.lock().unwrap().push(e.clone())),
        )
        .unwrap();
    let mesh = Mesh::iota(&[("data", 2), ("model", 2)]).unwrap();
    let shardings = mlp_shardings(mesh);
    let mut step =
        strategy.compile_train_step(&program, loss, &weights, Optimizer::Sgd, &shardings).unwrap();
    let mut seed = Rng(3);
    let mut random = |d: &[usize]| {
        let n = d.iter().product();
        Tensor::f64(d, (0..n).map(|_| seed.below(2001) as f64 / 1000.0 - 1.0).collect()).unwrap()
    };
    for (name, dims) in [("w1", [6, 8]), ("w2", [8, 3])] {
        step.set(name, &random(&dims)).unwrap();
    }
    step.set("b1", &random(&[8])).unwrap();
    let mut losses = Vec::new();
    for s in 0..5 {
        let labels = Tensor::i32(&[8], (0..8).map(|i| (i + s) % 3).collect()).unwrap();
        losses.push(step.step(&[random(&[8, 6]), labels], 0.1).unwrap());
    }
    strategy.flush_metrics(std::time::Duration::from_secs(10)).unwrap();
    let events = events.lock().unwrap();
    assert_eq!(events.len(), 5, "{events:?}");
    for (s, (e, loss)) in events.iter().zip(&losses).enumerate() {
        assert_eq!((e.step, e.replica, e.consumer), (s as u64, 0, 7));
        match &e.tensors[..] {
            [Tensor::F64(t)] => assert_eq!(t.iter().next(), Some(loss)),
            other => panic!("{other:?}"),
        }
    }
}

/// What a compiled program cannot do is a typed error that says what and where: a
/// spec for no parameter, a carry of another spec, feeds of the wrong count or spec, a
/// resident parameter never set.
#[test]
fn what_cannot_be_compiled_is_a_typed_error() {
    use meshwork_program::Builder;
    use meshwork_strategy::partition::Shardings;
    let mesh = Mesh::iota(&[("data", 2), ("model", 2)]).unwrap();
    let mut b = Builder::new();
    let x = b.param("x", "f64[5,4]".parse().unwrap()).unwrap();
    let w = b.param("w", "f64[4,6]".parse().unwrap()).unwrap();
    let z = b.matmul(x, w).unwrap();
    let z = b.name(z, "z").unwrap();
    let r = b.reshape(z, &[3, 10]).unwrap();
    let program = b.finish(&[r]).unwrap();
    let strategy = Strategy::data_parallel(4).unwrap();
    let unknown = Shardings::new(mesh.clone()).with("y", "P('data')").unwrap();
    let err = strategy.compile(&program, &unknown, &[]).err().unwrap();
    assert!(err.to_string().contains("no parameter or named value of this name"), "{err}");
    let shardings = Shardings::new(mesh.clone());
    let err = strategy.compile(&program, &shardings, &[(0, "w")]).err().unwrap();
    assert!(err.to_string().contains("result 0 is not of the parameter's spec"), "{err}");
    let err = strategy.compile(&program, &shardings, &[(3, "w")]).err().unwrap();
    assert!(err.to_string().contains("carried from result 3; the program has 1"), "{err}");
    let mut b = Builder::new();
    let a = b.param("a", "f64[4]".parse().unwrap()).unwrap();
    let c = b.param("c", "f64[4]".parse().unwrap()).unwrap();
    let s = b.add(a, c).unwrap();
    let twice = b.finish(&[s, a]).unwrap();
    let err = strategy.compile(&twice, &shardings, &[(0, "a"), (0, "c")]).err().unwrap();
    assert!(err.to_string().contains("result 0 is carried twice"), "{err}");
    let err = strategy.compile(&twice, &shardings, &[(0, "a"), (1, "a")]).err().unwrap();
    assert!(err.to_string().contains("carried from results 0 and 1"), "{err}");

    // A program whose result carries into w: feeds and resident state checked.
    let mut b = Builder::new();
    let x = b.param("x", "f64[4,6]".parse().unwrap()).unwrap();
    let w = b.param("w", "f64[4,6]".parse().unwrap()).unwrap();
    let y = b.add(x, w).unwrap();
    let s = b.reduce_sum(y, &[0, 1], false).unwrap();
    let program = b.finish(&[s, y]).unwrap();
    let compiled = strategy.compile(&program, &shardings, &[(1, "w")]).unwrap();
    let feed = Tensor::f64(&[4, 6], vec![1.0; 24]).unwrap();
    let err = compiled.step(std::slice::from_ref(&feed)).unwrap_err();
    assert!(err.to_string().contains("resident parameter w was never set"), "{err}");
    compiled.set("w", &feed).unwrap();
    let err = compiled.step(&[]).unwrap_err();
    assert!(err.to_string().contains("0 feeds for 1 non-resident parameters"), "{err}");
    let wrong = Tensor::f64(&[6, 4], vec![1.0; 24]).unwrap();
    let err = compiled.step(std::slice::from_ref(&wrong)).unwrap_err();
    assert!(err.to_string().contains("fed f64[6,4], the parameter is f64[4,6]"), "{err}");
    let err = compiled.set("w", &wrong).unwrap_err();
    assert!(err.to_string().contains("given f64[6,4], the parameter is f64[4,6]"), "{err}");
    let err = compiled.set("x", &feed).unwrap_err();
    assert!(err.to_string().contains("not a resident parameter"), "{err}");
    // None of it changed anything: two steps add x twice.
    assert_eq!(compiled.step(std::slice::from_ref(&feed)).unwrap()[0].to_f64(), [48.0]);
    assert_eq!(compiled.step(std::slice::from_ref(&feed)).unwrap()[0].to_f64(), [72.0]);
    assert_eq!(compiled.steps(), 2);
}

/// The reference transformer's compiled training step, Megatron over `model`: every
/// collective over `model` is an all-reduce, two per decoder block each way (4 per
/// block in all, nothing for the embeddings, final norm or unembedding); over `data`,
/// one launch per step carries every gradient and the loss.
#[test]
fn the_reference_transformer_step_has_megatrons_collectives() {
    let (expected, _, _, _) = files::reference_model();
    let layers = expected["config"]["layers"].as_u64().unwrap() as usize;
    for (d, m) in [(1, 2), (2, 2), (2, 1)] {
        let strategy = Strategy::data_parallel(d * m).unwrap();
        let (step, _) = reference_step(&strategy, d, m, meshwork_nn::Optimizer::adam());
        let part = step.compiled().partitioned();
        let on = |axis: &str| -> Vec<&meshwork_strategy::partition::spmd::Collective> {
            part.collectives().iter().filter(|c| c.axes == [axis.to_string()]).collect()
        };
        let model = on("model");
        assert!(model.iter().all(|c| c.op == "all_reduce"), "{d}x{m}: {model:?}");
        assert_eq!(model.len(), if m > 1 { 4 * layers } else { 0 }, "{d}x{m}: {model:?}");
        let data: std::collections::BTreeSet<usize> = on("data").iter().map(|c| c.launch).collect();
        assert_eq!(data.len(), usize::from(d > 1), "{d}x{m}");
        assert!(on("data").iter().all(|c| c.op == "all_reduce"));
        // Nothing else moves: every collective is over one of the two axes.
        assert_eq!(model.len() + on("data").len(), part.collectives().len());
        assert_eq!(part.launches(), model.len() + data.len());
    }
}

/// A strategy's checkpoint (its variables split over logical devices) restores into a
/// compiled program's resident parameters of the same names, on another layout.
#[test]
fn a_strategy_checkpoint_restores_into_a_compiled_program() {
    use meshwork_program::Builder;
    use meshwork_strategy::partition::Shardings;
    use meshwork_strategy::{DeviceAssignment, Topology, VariableOptions};
    let value: Vec<f64> = (0..24).map(|k| k as f64 * 0.25 - 3.0).collect();
    let topology = Topology::new(vec![4], 4).unwrap();
    let assignment = DeviceAssignment::build(&topology, &[2], None).unwrap();
    let host = Strategy::new(assignment).unwrap();
    let options = VariableOptions {
        layout: meshwork_strategy::Layout::Split(vec![2, 1]),
        ..VariableOptions::default()
    };
    let w = ndarray::ArrayD::from_shape_vec(ndarray::IxDyn(&[4, 6]), value.clone()).unwrap();
    host.create_variable("w", Tensor::F64(w), options).unwrap();
    let tmp_dir = tempfile::tempdir().unwrap();
    let dir = tmp_dir.path().to_path_buf();
    host.save_checkpoint(&dir).unwrap();

    let mut b = Builder::new();
    let x = b.param("x", "f64[4,6]".parse().unwrap()).unwrap();
    let wv = b.param("w", "f64[4,6]".parse().unwrap()).unwrap();
    let y = b.add(x, wv).unwrap();
    let program = b.finish(&[y]).unwrap();
    let mesh = Mesh::iota(&[("data", 2), ("model", 2)]).unwrap();
    let shardings = Shardings::new(mesh).with("w", "P(('model', 'data'))").unwrap();
    let strategy = Strategy::data_parallel(4).unwrap();
    let compiled = strategy.compile(&program, &shardings, &[(0, "w")]).unwrap();
    compiled.restore_checkpoint(&dir).unwrap();
    assert_eq!(compiled.get("w").unwrap().to_f64(), value);
}

/// Two compiled programs with collectives stepped at once from two threads on one
/// strategy's devices both finish with the right results (each run's replicas queue
/// together on the executor, so neither waits on the other's collectives).
#[test]
fn two_compiled_programs_step_at_once_on_one_strategy() {
    use meshwork_program::Builder;
    use meshwork_strategy::partition::Shardings;
    let mesh = Mesh::iota(&[("data", 4)]).unwrap();
    let strategy = Strategy::data_parallel(4).unwrap();
    let mut b = Builder::new();
    let x = b.param("x", "f64[4,3]".parse().unwrap()).unwrap();
    let w = b.param("w", "f64[3]".parse().unwrap()).unwrap();
    let y = b.mul(x, w).unwrap();
    let s = b.reduce_sum(y, &[0, 1], false).unwrap();
    let program = b.finish(&[s, w]).unwrap();
    let shardings = Shardings::new(mesh).with("x", "P('data')").unwrap();
    let first = strategy.compile(&program, &shardings, &[(1, "w")]).unwrap();
    let second = strategy.compile(&program, &shardings, &[(1, "w")]).unwrap();
    first.set("w", &Tensor::f64(&[3], vec![1.0, 2.0, 3.0]).unwrap()).unwrap();
    second.set("w", &Tensor::f64(&[3], vec![-1.0, 0.5, 2.0]).unwrap()).unwrap();
    let x = Tensor::f64(&[4, 3], vec![1.0; 12]).unwrap();
    std::thread::scope(|scope| {
        for (c, want) in [(&first, 24.0), (&second, 6.0)] {
            let x = &x;
            scope.spawn(move || {
                for _ in 0..300 {
                    assert_eq!(c.step(std::slice::from_ref(x)).unwrap()[0].to_f64(), [want]);
                }
            });
        }
    });
    assert_eq!((first.steps(), second.steps()), (300, 300));
}

/// The MLP's shardings: the batch over `data`, Megatron's column/row split over `model`.
fn mlp_shardings(mesh: Mesh) -> meshwork_strategy::partition::Shardings {
    meshwork_strategy::partition::Shardings::new(mesh)
        .with("x", "P('data')")
        .and_then(|s| s.with("labels", "P('data')"))
        .and_then(|s| s.with("w1", "P(None, 'model')"))
        .and_then(|s| s.with("b1", "P('model')"))
        .and_then(|s| s.with("w2", "P('model', None)"))
        .unwrap()
}

/// Fused attention and its gradient (`attention`, `attention_grad`) partitioned with
/// random layouts of its heads on random meshes (batch, heads, and the dims it needs
/// whole: positions and head dims, which the partitioner must gather) equal one
/// device's run to a relative 1e-12.
#[test]
fn fused_attention_and_its_gradient_partition_on_any_layout() {
    use meshwork_program::{AttentionSpec, Builder};
    let strategy = Strategy::data_parallel(8).unwrap();
    let spec: meshwork_strategy::types::TensorSpec = "f64[4,4,6,2]".parse().unwrap();
    let mut b = Builder::new();
    let q = b.param("q", spec.clone()).unwrap();
    let k = b.param("k", spec.clone()).unwrap();
    let v = b.param("v", spec.clone()).unwrap();
    let a = AttentionSpec { scale: 0.5, divide: false, causal: true };
    let out = b.attention(q, k, v, a).unwrap();
    let program = b.finish(&[out]).unwrap();
    let back = meshwork_program::vjp(&program, &[Value(0), Value(1), Value(2)]).unwrap();
    let mut rng = Rng(99);
    let mut sharded = 0;
    for i in 0..40 {
        let feed: Vec<Tensor> = (0..4)
            .map(|_| {
                let values = (0..4 * 4 * 6 * 2).map(|_| rng.uniform() * 4.0 - 2.0).collect();
                Tensor::f64(&[4, 4, 6, 2], values).unwrap()
            })
            .collect();
        let (mesh, layouts) = random_mesh(1000 + i, &feed);
        sharded += usize::from(layouts.iter().flatten().any(|l| !l.is_replicated()));
        let outputs = vec![None; back.results().len()];
        let p = partition(&back, &mesh, &layouts, &outputs).unwrap();
        let got = strategy.run_partitioned(&p, &feed).unwrap();
        let want = fast::evaluate(&back, &feed).unwrap();
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            close(g, w, 1e-12)
                .unwrap_or_else(|e| panic!("case {i}, result {k} on {mesh}: {e}\n{p}"));
        }
    }
    assert!(sharded > 30, "only {sharded} of 40 cases sharded an input");
}

/// The fused cross-entropy and its gradient (`cross_entropy`, `cross_entropy_grad`)
/// partitioned with random layouts of logits, labels (some outside the classes) and
/// the loss's cotangent on random meshes (positions split, the classes needed whole,
/// which the partitioner must gather) equal one device's run to a relative 1e-12.
#[test]
fn fused_cross_entropy_and_its_gradient_partition_on_any_layout() {
    use meshwork_program::Builder;
    let strategy = Strategy::data_parallel(8).unwrap();
    let mut b = Builder::new();
    let x = b.param("logits", "f64[4,6,8]".parse().unwrap()).unwrap();
    let y = b.param("labels", "i64[4,6]".parse().unwrap()).unwrap();
    let per = b.cross_entropy(x, y).unwrap();
    let program = b.finish(&[per]).unwrap();
    let back = meshwork_program::vjp(&program, &[Value(0)]).unwrap();
    let mut rng = Rng(7);
    let mut sharded = 0;
    for i in 0..40 {
        let logits = (0..4 * 6 * 8).map(|_| rng.uniform() * 8.0 - 4.0).collect();
        let labels: Vec<f64> = (0..24).map(|_| rng.below(10) as f64 - 1.0).collect();
        let cotangent = (0..24).map(|_| rng.uniform() * 2.0 - 1.0).collect();
        let feed = vec![
            Tensor::f64(&[4, 6, 8], logits).unwrap(),
            Tensor::from_f64(meshwork_strategy::types::DType::I64, &[4, 6], &labels).unwrap(),
            Tensor::f64(&[4, 6], cotangent).unwrap(),
        ];
        let (mesh, layouts) = random_mesh(2000 + i, &feed);
        sharded += usize::from(layouts.iter().flatten().any(|l| !l.is_replicated()));
        let outputs = vec![None; back.results().len()];
        let p = partition(&back, &mesh, &layouts, &outputs).unwrap();
        let got = strategy.run_partitioned(&p, &feed).unwrap();
        let want = fast::evaluate(&back, &feed).unwrap();
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            close(g, w, 1e-12)
                .unwrap_or_else(|e| panic!("case {i}, result {k} on {mesh}: {e}\n{p}"));
        }
    }
    assert!(sharded > 30, "only {sharded} of 40 cases sharded an input");
}
