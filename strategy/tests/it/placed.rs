//! Placed programs against one device: every program of the JAX oracle
//! (`program/testdata/cases.jsonl`) with its gradient (`vjp`), given random device
//! requests over 1–4 devices and random colocations, placed by TensorFlow's rules,
//! split with send/recv pairs and run on the strategy's devices, equals the
//! one-device run; TensorFlow's resource-edge and soft-placement rules decide where
//! variables' updates and kernel-less ops go.

use meshwork_nn::Pipeline;
use meshwork_program::{Builder, Catalogue, Kernels, Program, Tensor, Value};
use meshwork_strategy::Strategy;
use meshwork_strategy::placed::{PlaceOptions, Placed};
use meshwork_types::DType;
use serde_json::Value as Json;

use crate::oracle::{OracleCase, Rng};

/// `p` with random requests: each value on one of `devices` devices (or none, or a
/// partial spec), and one instruction in four colocated with an earlier value.
fn with_random_requests(p: &Program, rng: &mut Rng, devices: usize) -> Program {
    let mut b = Builder::from_program(p).unwrap();
    let np = p.params().len();
    for v in 0..p.num_values() {
        let spec = match rng.below(devices + 2) {
            d if d < devices => format!("/device:CPU:{d}"),
            d if d == devices => String::new(),
            _ => "/device:CPU:*".to_string(),
        };
        b.set_device(Value(v as u32), &spec).unwrap();
        if v >= np && rng.below(4) == 0 {
            b.colocate(Value(v as u32), Value(rng.below(v) as u32)).unwrap();
        }
    }
    b.finish(p.results()).unwrap()
}

/// One case on 1–4 random devices: outputs and gradients against one device and JAX.
/// Even cases put the random requests on the forward program and differentiate it
/// (autodiff places the backward beside the forward, summing cotangents per device);
/// odd cases put them on the vector-Jacobian program itself (any split of it).
fn check(strategy: &Strategy, index: usize, case: &Json) -> Result<(usize, usize), String> {
    let oracle = OracleCase::new(case)?;
    let mut rng = Rng(index as u64 * 7919 + 5);
    let devices = 1 + rng.below(4);
    let requested = if index.is_multiple_of(2) {
        oracle.vjp_of(&with_random_requests(&oracle.program, &mut rng, devices))?
    } else {
        with_random_requests(&oracle.back, &mut rng, devices)
    };
    let options = PlaceOptions {
        devices: Some(
            (0..devices)
                .map(|d| format!("/job:localhost/replica:0/task:0/device:CPU:{d}"))
                .collect(),
        ),
        ..PlaceOptions::default()
    };
    let placed = strategy.place(&requested, &[], &options).map_err(|e| format!("place: {e}"))?;
    let got = placed.step(&oracle.feed).map_err(|e| format!("run on {devices}: {e}\n{placed}"))?;
    oracle.check(case, &got, &|| format!("on {devices} devices\n{placed}"))?;
    Ok((placed.parts().count(), placed.transfers().len()))
}

#[test]
fn every_oracle_case_placed_on_random_devices_matches_one_device() {
    let strategy = Strategy::data_parallel(4).unwrap();
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../program/testdata/cases.jsonl");
    let text = std::fs::read_to_string(path).unwrap();
    let mut failed = Vec::new();
    let (mut split, mut transfers) = (0, 0);
    for (i, line) in text.lines().enumerate() {
        let case: Json = serde_json::from_str(line).unwrap();
        match check(&strategy, i, &case) {
            Ok((parts, t)) => {
                split += usize::from(parts > 1);
                transfers += t;
            }
            Err(e) => failed.push(format!("{}: {e}", case["id"])),
        }
    }
    let shown: Vec<&String> = failed.iter().take(3).collect();
    assert!(
        failed.is_empty(),
        "{} of 1500 failed:\n{}",
        failed.len(),
        shown.iter().map(|s| s.as_str()).collect::<Vec<_>>().join("\n\n")
    );
    // Most programs really run split, with values crossing devices.
    assert!(split > 650 && transfers > 1000, "{split} cases split, {transfers} transfers");
}

/// `w` requested on device 1, its update on device 0: TensorFlow's resource-edge rule
/// places the update (`AssignVariableOp`) with the variable, and the variable stays
/// there across steps.
#[test]
fn a_variables_update_requested_elsewhere_is_placed_with_it() {
    let strategy = Strategy::data_parallel(2).unwrap();
    let mut b = Builder::new();
    let w = b.device("/device:CPU:1", |b| b.param("w", "f64[3]".parse()?)).unwrap();
    let x = b.param("x", "f64[3]".parse().unwrap()).unwrap();
    let y = b.device("/device:CPU:0", |b| b.mul(w, x)).unwrap();
    let new_w = b.device("/device:CPU:0", |b| b.sub(w, y)).unwrap();
    let s = b.reduce_sum(y, &[0], false).unwrap();
    let p = b.finish(&[s, new_w]).unwrap();
    let placed = strategy.place(&p, &[(1, 0)], &PlaceOptions::default()).unwrap();
    let cpu = |i: usize| format!("/job:localhost/replica:0/task:0/device:CPU:{i}");
    assert_eq!(placed.device(w).unwrap(), cpu(1));
    assert_eq!(placed.device(y).unwrap(), cpu(0));
    let assign = placed.plan().graph().graph.id("w/assign").unwrap();
    let read = placed.plan().graph().graph.id("w/read").unwrap();
    let on = |n| placed.devices().devices()[placed.plan().placement().device(n)].name().to_string();
    assert_eq!(on(assign), cpu(1), "the update goes with its variable");
    assert_eq!(on(read), cpu(1));
    let why = placed.explain(w).unwrap().to_string();
    assert!(why.contains("w/assign") && why.contains("w/read"), "{why}");
    let dot = placed.to_dot();
    assert!(dot.starts_with("digraph"), "{dot}");
    assert!(dot.contains("\"w\" -> \"w/assign\""), "the resource edge is drawn: {dot}");
    // w crosses to device 0 once (for `mul` and `sub`), its new value comes back.
    assert_eq!(placed.transfers().len(), 2, "{placed}");

    let t = |v: Vec<f64>| Tensor::f64(&[3], v).unwrap();
    assert!(placed.step(&[t(vec![1.0; 3])]).is_err(), "w has no value yet");
    placed.set("w", t(vec![1.0, 2.0, 3.0])).unwrap();
    let mut want = vec![1.0, 2.0, 3.0];
    let x = vec![0.5, -1.0, 2.0];
    for _ in 0..3 {
        let out = placed.step(&[t(x.clone())]).unwrap();
        let ys: Vec<f64> = want.iter().zip(&x).map(|(a, b)| a * b).collect();
        assert_eq!(out[0].to_f64(), vec![ys.iter().sum::<f64>()]);
        want = want.iter().zip(&ys).map(|(a, b)| a - b).collect();
        assert_eq!(placed.get("w").unwrap().to_f64(), want);
    }
}

/// An f64 op requested on a device type without f64 kernels: soft placement moves it
/// to a device that has one; without soft placement it is refused with TensorFlow's
/// message.
#[test]
fn a_missing_kernel_is_soft_placed_or_refused_as_tensorflow_does() {
    let strategy = Strategy::data_parallel(2).unwrap();
    let catalogue =
        Catalogue::cpu().with(Kernels::new("TPU").only_dtypes(&[DType::F32, DType::I32]));
    let devices = vec![
        "/job:localhost/replica:0/task:0/device:CPU:0".to_string(),
        "/job:localhost/replica:0/task:0/device:TPU:0".to_string(),
    ];
    let mut b = Builder::new();
    let x = b.param("x", "f64[4]".parse().unwrap()).unwrap();
    let f = b.param("f", "f32[4]".parse().unwrap()).unwrap();
    let (y, g) = b
        .device("/device:TPU:0", |b| {
            let y = b.tanh(x)?;
            let g = b.tanh(f)?;
            Ok((y, g))
        })
        .unwrap();
    let p = b.finish(&[y, g]).unwrap();
    let soft = PlaceOptions {
        devices: Some(devices.clone()),
        catalogue: catalogue.clone(),
        ..PlaceOptions::default()
    };
    let placed = strategy.place(&p, &[], &soft).unwrap();
    assert_eq!(placed.device(y).unwrap(), devices[0], "no f64 kernel on TPU");
    assert_eq!(placed.device(g).unwrap(), devices[1]);
    let out = placed
        .step(&[
            Tensor::f64(&[4], vec![0.0, 1.0, -1.0, 2.0]).unwrap(),
            Tensor::f32(&[4], vec![1.0; 4]).unwrap(),
        ])
        .unwrap();
    assert_eq!(out[0].to_f64()[1], 1f64.tanh());

    let strict = PlaceOptions { allow_soft_placement: false, ..soft };
    let err = strategy.place(&p, &[], &strict).unwrap_err();
    let meshwork_strategy::Error::Placer(e) = &err else { panic!("{err}") };
    assert_eq!(e.node(), Some("%2"));
    let msg = e.to_string();
    assert!(
        msg.contains("Could not satisfy explicit device specification '/device:TPU:0' because no supported kernel for TPU devices is available"),
        "{msg}"
    );
}

/// A failing instruction on one device ends the step on every device with its error,
/// promptly, and the variables keep their values.
#[test]
fn a_failure_on_one_device_ends_the_step_everywhere_and_keeps_the_variables() {
    let strategy = Strategy::data_parallel(3).unwrap();
    let mut b = Builder::new();
    let w = b.device("/device:CPU:2", |b| b.param("w", "f64[4]".parse()?)).unwrap();
    let idx = b.device("/device:CPU:1", |b| b.param("idx", "i64[2]".parse()?)).unwrap();
    // Integer division of the indices by themselves: a zero index fails device 1.
    let one = b.device("/device:CPU:1", |b| b.div(idx, idx)).unwrap();
    let idx = b.device("/device:CPU:1", |b| b.mul(idx, one)).unwrap();
    let t = b.device("/device:CPU:1", |b| b.take(w, idx, 0)).unwrap();
    let s = b.device("/device:CPU:0", |b| b.reduce_sum(t, &[0], false)).unwrap();
    let two = b.device("/device:CPU:2", |b| b.scalar_like(w, 2.0)).unwrap();
    let nw = b.device("/device:CPU:2", |b| b.mul(w, two)).unwrap();
    let p = b.finish(&[s, nw]).unwrap();
    let placed = strategy.place(&p, &[(1, 0)], &PlaceOptions::default()).unwrap();
    placed.set("w", Tensor::f64(&[4], vec![1.0, 2.0, 3.0, 4.0]).unwrap()).unwrap();
    let ok = placed.step(&[Tensor::i64(&[2], vec![1, 3]).unwrap()]).unwrap();
    assert_eq!(ok[0].to_f64(), vec![6.0]);
    let start = std::time::Instant::now();
    let err = placed.step(&[Tensor::i64(&[2], vec![0, 3]).unwrap()]).unwrap_err();
    assert!(start.elapsed() < std::time::Duration::from_secs(10));
    let msg = err.to_string();
    assert!(msg.contains("division by zero"), "{msg}");
    assert!(
        !msg.contains("PeerFailed") && !msg.contains("failed, so replica"),
        "the root error: {msg}"
    );
    assert_eq!(
        placed.get("w").unwrap().to_f64(),
        vec![2.0, 4.0, 6.0, 8.0],
        "unchanged by the failed step"
    );
}

/// The JAX reference transformer with its decoder blocks spread over the stages of
/// `pipeline` by device scopes (as layer-wise model parallelism is written in
/// TensorFlow) — one replica and one micro-batch: `loss_on`; otherwise
/// `loss_pipelined` — trained 20 steps by a placed training step. Returns the losses,
/// JAX's file and the placed step.
fn train_placed<'s>(
    strategy: &'s Strategy,
    pipeline: &Pipeline,
    optimizer: meshwork_nn::Optimizer,
    lr: f64,
) -> (Vec<f64>, Json, Placed<'s>) {
    use crate::spmd::files;
    use meshwork_nn::TrainStep;
    use meshwork_types::{Shape, TensorSpec};
    let (expected, _, _, _) = files::reference_model();
    let (model, batch) = files::reference_transformer(&expected);
    let stages = pipeline.replicas[0].len();
    let mut b = Builder::new();
    let rows = b
        .param("rows", TensorSpec::new(DType::I32, Shape::new(&[batch, model.seq + 1]).unwrap()))
        .unwrap();
    let loss = if pipeline.replicas.len() == 1 && pipeline.micro_batches == 1 {
        let devices: Vec<&str> = pipeline.replicas[0].iter().map(String::as_str).collect();
        model.loss_on(&mut b, rows, DType::F64, &devices).unwrap()
    } else {
        model.loss_pipelined(&mut b, rows, DType::F64, pipeline).unwrap()
    };
    let program = b.finish(&[loss]).unwrap();
    let weights: Vec<Value> = (1..program.params().len()).map(|k| Value(k as u32)).collect();
    let step = TrainStep::new(&program, loss, &weights, optimizer).unwrap();
    // Results: the loss, the new weights, the new optimizer state; inputs: rows, the
    // weights, the state, lr, step.
    let sp = &step.program;
    let state = step.init_state().unwrap();
    let carry: Vec<(usize, usize)> = (1..sp.results().len()).map(|r| (r, r)).collect();
    let placed = strategy.place(sp, &carry, &PlaceOptions::default()).unwrap();
    // Every block's weights, its forward, backward and update are on its stage (of
    // replica 0, whose stages are devices 0..K).
    for (i, p) in sp.params().iter().enumerate() {
        if let Some(rest) =
            p.name.strip_prefix("layers.").or_else(|| p.name.split_once(".layers.").map(|x| x.1))
        {
            let layer: usize = rest.split('.').next().unwrap().parse().unwrap();
            let want = format!(
                "/job:localhost/replica:0/task:0/device:CPU:{}",
                layer * stages / model.layers
            );
            assert_eq!(placed.device(Value(i as u32)).unwrap(), want, "{}", p.name);
        }
    }
    let init = files::safetensors(&files::testdata("init.safetensors"));
    for p in &program.params()[1..] {
        let (shape, values) = &init[&p.name];
        placed.set(&p.name, Tensor::f64(shape, values.clone()).unwrap()).unwrap();
    }
    let first_state = 1 + weights.len();
    for (k, t) in state.into_iter().enumerate() {
        placed.set(&sp.params()[first_state + k].name, t).unwrap();
    }
    let mut losses = Vec::new();
    for s in 0..20 {
        let [lr_t, step_t] = step.scalars(lr, s).unwrap();
        let out = placed.step(&[crate::spmd::reference_rows(s), lr_t, step_t]).unwrap();
        losses.push(out[0].to_f64()[0]);
    }
    (losses, expected, placed)
}

/// JAX's SGD and Adam losses at every step within relative 1e-9; returns the placed
/// SGD step's bytes moved and its stage-0 part.
fn trains_as_jax(pipeline: &Pipeline) -> (u64, Program) {
    let devices = pipeline.replicas.len() * pipeline.replicas[0].len();
    let strategy = Strategy::data_parallel(devices).unwrap();
    let mut sgd = None;
    for (optimizer, lr, key) in [
        (meshwork_nn::Optimizer::Sgd, 0.1, "losses_sgd"),
        (meshwork_nn::Optimizer::adam(), 0.01, "losses_adam"),
    ] {
        let (got, expected, placed) = train_placed(&strategy, pipeline, optimizer, lr);
        let want: Vec<f64> =
            expected[key].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
        assert_eq!(got.len(), want.len());
        for (s, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-9 * w.abs(),
                "{pipeline:?}, {key} step {s}: {g} vs JAX {w}"
            );
        }
        let stage0 = placed.parts().find(|(d, _)| *d == 0).unwrap().1.clone();
        sgd.get_or_insert((placed.transfer_bytes(), stage0));
    }
    sgd.unwrap()
}

/// The activations stage 0 sends forward and the cotangents it receives back, in its
/// program's order: `true` for a send.
fn boundary_traffic(stage0: &Program, activation: &[usize]) -> Vec<bool> {
    use meshwork_program::Op;
    let dims = |v: Value| stage0.spec(v).unwrap().shape.dims().to_vec();
    stage0
        .instrs()
        .iter()
        .filter_map(|i| match &i.op {
            Op::Send { .. } if dims(i.args[0]) == activation => Some(true),
            Op::Recv { shape, .. } if shape == activation => Some(false),
            _ => None,
        })
        .collect()
}

#[test]
fn the_reference_transformer_trains_as_jax_with_its_blocks_on_2_and_3_devices() {
    for stages in [2, 3] {
        let (_, stage0) = trains_as_jax(&Pipeline::cpus(1, stages, 1));
        assert_eq!(boundary_traffic(&stage0, &[8, 16, 32]), [true, false], "{stage0}");
    }
}

#[test]
fn the_reference_transformer_trains_as_jax_in_4_micro_batches_on_2_and_3_stages() {
    for stages in [2, 3] {
        let (whole, _) = trains_as_jax(&Pipeline::cpus(1, stages, 1));
        let (bytes, stage0) = trains_as_jax(&Pipeline::cpus(1, stages, 4));
        assert_eq!(bytes, whole, "micro-batches cut the activations, they add no bytes");
        // GPipe's schedule on the first stage: the four micro-batches' activations go
        // forward before any cotangent comes back, then the four cotangents.
        let traffic = boundary_traffic(&stage0, &[2, 16, 32]);
        assert_eq!(traffic, [true, true, true, true, false, false, false, false], "{stage0}");
    }
}

#[test]
fn the_reference_transformer_trains_as_jax_on_2_replicas_of_2_stages() {
    let (one, _) = trains_as_jax(&Pipeline::cpus(1, 2, 1));
    let (bytes, _) = trains_as_jax(&Pipeline::cpus(2, 2, 2));
    // Replica 1 reads every weight once and sends its gradient back once: twice the
    // weights' bytes beyond the activations (two pipelines of half the batch move
    // what one of the whole batch does), its rows and a few scalars.
    let init = crate::spmd::files::safetensors(&crate::spmd::files::testdata("init.safetensors"));
    let weights: u64 = init.values().map(|(_, v)| 8 * v.len() as u64).sum();
    let rows = 8 * 17 * 4;
    let extra = bytes - one;
    assert!(
        (2 * weights..=2 * weights + rows + 64).contains(&extra),
        "{bytes} bytes: {extra} beyond one pipeline's, the weights are {weights}"
    );
}

/// Fixed rates, so that estimates do not depend on this machine's load.
fn fixed_cost() -> meshwork_strategy::placed::ProgramCost {
    use meshwork_strategy::partition::placed::{DeviceRates, ProgramCost, Rates};
    let single = Rates { matmul_flops: 2e10, elements: 1e9, transcendentals: 2e8, overhead: 2e-6 };
    let double = Rates { matmul_flops: 1e10, ..single };
    ProgramCost::uniform(DeviceRates { single, double }, 1e10, 1e-5)
}

/// Four independent branches on one input and no device scopes: TensorFlow puts
/// everything on device 0; by cost, the branches spread over both devices, estimated
/// faster, with the results of the whole program on one device.
#[test]
fn a_program_without_device_scopes_spreads_by_cost() {
    let mut b = Builder::new();
    let x = b.param("x", "f32[32,128]".parse().unwrap()).unwrap();
    let mut outs = Vec::new();
    for i in 0..4 {
        let w = b.param(&format!("w{i}"), "f32[128,128]".parse().unwrap()).unwrap();
        let h = b.matmul(x, w).unwrap();
        let h = b.tanh(h).unwrap();
        let v = b.param(&format!("v{i}"), "f32[128,16]".parse().unwrap()).unwrap();
        outs.push(b.matmul(h, v).unwrap());
    }
    let mut y = outs[0];
    for &o in &outs[1..] {
        y = b.add(y, o).unwrap();
    }
    let p = b.finish(&[y]).unwrap();
    let strategy = Strategy::data_parallel(2).unwrap();
    let tf = strategy.place(&p, &[], &PlaceOptions::default()).unwrap();
    assert!(tf.estimate().is_none());
    assert!(tf.parts().count() == 1, "TF's default: all on device 0");
    let placed =
        strategy.place_with_cost(&p, &[], &PlaceOptions::default(), &fixed_cost()).unwrap();
    let estimate = placed.estimate().unwrap();
    let tf_estimate = estimate.tf_makespan.unwrap();
    assert!(estimate.makespan < 0.8 * tf_estimate, "{} vs TF's {tf_estimate}", estimate.makespan);
    let mut matmuls = [0, 0];
    for (d, part) in placed.parts() {
        matmuls[d] += part.instrs().iter().filter(|i| i.op.name() == "dot_general").count();
    }
    assert!(matmuls[0] > 0 && matmuls[1] > 0, "the branches on both devices:\n{placed}");
    let mut rng = Rng(11);
    let inputs: Vec<Tensor> = p
        .params()
        .iter()
        .map(|q| {
            let n = q.spec.shape.num_elements();
            Tensor::f32(q.spec.shape.dims(), (0..n).map(|_| rng.uniform() as f32 - 0.5).collect())
                .unwrap()
        })
        .collect();
    let want = meshwork_program::reference::evaluate(&p, &inputs).unwrap();
    let got = placed.step(&inputs).unwrap();
    for (g, w) in got[0].to_f64().iter().zip(want[0].to_f64()) {
        assert!((g - w).abs() <= 1e-4 * (1.0 + w.abs()), "{g} vs {w}");
    }
}

/// A training step whose memory one device cannot hold: by cost it is split under the
/// caps and trains as on one device; caps too small for any placement are refused.
#[test]
fn memory_caps_split_a_training_step_or_refuse_it() {
    use meshwork_nn::{Optimizer, TrainStep};
    let mut b = Builder::new();
    let x = b.param("x", "f64[8,32]".parse().unwrap()).unwrap();
    let mut h = x;
    for i in 0..4 {
        let w = b.param(&format!("w{i}"), "f64[32,32]".parse().unwrap()).unwrap();
        h = b.matmul(h, w).unwrap();
        h = b.tanh(h).unwrap();
    }
    let sq = b.mul(h, h).unwrap();
    let loss = b.reduce_mean(sq, &[0, 1], false).unwrap();
    let p = b.finish(&[loss]).unwrap();
    let weights: Vec<Value> = (1..5).map(|k| Value(k as u32)).collect();
    let step = TrainStep::new(&p, loss, &weights, Optimizer::Sgd).unwrap();
    let sp = &step.program;
    let carry: Vec<(usize, usize)> = (1..sp.results().len()).map(|r| (r, r)).collect();
    let strategy = Strategy::data_parallel(2).unwrap();
    let options = PlaceOptions::default();
    let free = strategy.place_with_cost(sp, &carry, &options, &fixed_cost()).unwrap();
    let total: u64 = free.estimate().unwrap().memory.iter().sum();
    let cap = total * 6 / 10;
    let placed =
        strategy.place_with_cost(sp, &carry, &options, &fixed_cost().with_capacity(cap)).unwrap();
    let estimate = placed.estimate().unwrap();
    assert!(estimate.memory.iter().all(|&m| m <= cap), "{:?} over {cap}", estimate.memory);
    // Recounted from the placement: every value's bytes on its device.
    let mut memory = vec![0u64; 2];
    for v in 0..sp.num_values() {
        let v = Value(v as u32);
        memory[placed.device_index(v).unwrap()] += sp.spec(v).unwrap().byte_size().unwrap() as u64;
    }
    assert_eq!(memory, estimate.memory);
    assert_eq!(estimate.tf_makespan, None, "TF's default (one device) does not fit");
    assert_eq!(placed.parts().count(), 2);
    // Trains as the whole step on one device (the reference interpreter).
    let mut rng = Rng(5);
    let mut random = |dims: &[usize]| {
        let n = dims.iter().product();
        Tensor::f64(dims, (0..n).map(|_| rng.uniform() - 0.5).collect()).unwrap()
    };
    let mut state: Vec<Tensor> = (0..4).map(|_| random(&[32, 32])).collect();
    for (k, t) in state.iter().enumerate() {
        placed.set(&format!("w{k}"), t.clone()).unwrap();
    }
    for s in 0..3 {
        let xs = random(&[8, 32]);
        let [lr, count] = step.scalars(0.5, s).unwrap();
        let mut inputs = vec![xs.clone()];
        inputs.extend(state.iter().cloned());
        inputs.extend([lr.clone(), count.clone()]);
        let want = meshwork_program::reference::evaluate(sp, &inputs).unwrap();
        let got = placed.step(&[xs, lr, count]).unwrap();
        assert!((got[0].to_f64()[0] - want[0].to_f64()[0]).abs() < 1e-12);
        state = want[1..].to_vec();
    }
    for (k, t) in state.iter().enumerate() {
        for (g, w) in placed.get(&format!("w{k}")).unwrap().to_f64().iter().zip(t.to_f64()) {
            assert!((g - w).abs() <= 1e-12, "w{k}: {g} vs {w}");
        }
    }
    // A cap below the largest colocation group (a weight with its update) fits nowhere.
    let err = strategy
        .place_with_cost(sp, &carry, &options, &fixed_cost().with_capacity(32 * 32 * 8))
        .unwrap_err();
    assert!(
        matches!(
            err,
            meshwork_strategy::Error::Placer(meshwork_placer::Error::MemoryCapExceeded { .. })
        ),
        "{err}"
    );
}

/// A carried result before a returned one on the same device (`[new_w, loss]` both
/// made on device 0, `new_w` into `w` on device 1): the step returns the loss alone,
/// and `w` takes `new_w` on its device.
#[test]
fn a_carried_result_before_a_returned_one_keeps_each_in_its_place() {
    let strategy = Strategy::data_parallel(2).unwrap();
    let mut b = Builder::new();
    let w = b.device("/device:CPU:1", |b| b.param("w", "f64[2]".parse()?)).unwrap();
    let x = b.param("x", "f64[2]".parse().unwrap()).unwrap();
    let y = b.device("/device:CPU:0", |b| b.mul(w, x)).unwrap();
    let new_w = b.device("/device:CPU:0", |b| b.sub(w, y)).unwrap();
    let loss = b.device("/device:CPU:0", |b| b.reduce_sum(y, &[0], false)).unwrap();
    let p = b.finish(&[new_w, loss]).unwrap();
    let placed = strategy.place(&p, &[(0, 0)], &PlaceOptions::default()).unwrap();
    placed.set("w", Tensor::f64(&[2], vec![1.0, 2.0]).unwrap()).unwrap();
    let out = placed.step(&[Tensor::f64(&[2], vec![0.5, 3.0]).unwrap()]).unwrap();
    assert_eq!(out.len(), 1, "only the loss comes back");
    assert_eq!(out[0].to_f64(), vec![6.5]);
    assert_eq!(placed.get("w").unwrap().to_f64(), vec![0.5, -4.0]);
}
