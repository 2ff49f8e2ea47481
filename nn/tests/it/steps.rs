//! Training steps: each optimizer's update against its formula, clipping to a global
//! norm, what a step holds and where its updates are placed.

use meshwork_nn::{Optimizer, TrainStep, softmax_cross_entropy};
use meshwork_program::{Builder, Program, Tensor, Value, fast, grad, reference};
use meshwork_types::{DType, TensorSpec};

fn spec(text: &str) -> TensorSpec {
    text.parse().unwrap()
}

/// Each optimizer's step program against the formula written out in plain Rust (the
/// loss `Σ p³/3 + Σ p` has gradient `p² + 1`, so the trajectories differ by optimizer),
/// three steps with a learning rate that changes per step.
#[test]
fn optimizer_steps_follow_their_formulas() {
    let opts = [
        Optimizer::Sgd,
        Optimizer::Momentum { momentum: 0.9 },
        Optimizer::adam(),
        Optimizer::adamw(0.01),
        Optimizer::AdamW { beta1: 0.8, beta2: 0.99, eps: 1e-6, weight_decay: 0.3, decay_1d: false },
    ];
    for opt in opts {
        let mut b = Builder::new();
        let p = b.param("p", spec("f64[3]")).unwrap();
        let p3 = b.mul(p, p).unwrap();
        let p3 = b.mul(p3, p).unwrap();
        let c = b.constant(3.0, DType::F64).unwrap();
        let cube = b.div(p3, c).unwrap();
        let y = b.add(cube, p).unwrap();
        let loss = b.reduce_sum(y, &[0], false).unwrap();
        let prog = b.finish(&[loss]).unwrap();
        let step = TrainStep::new(&prog, loss, &[p], opt).unwrap();
        let names: Vec<&str> = step.program.params().iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names[0], "p");
        assert_eq!(names[names.len() - 2..], ["optimizer.lr", "optimizer.step"]);
        let mut params = Tensor::f64(&[3], vec![0.5, -1.0, 2.0]).unwrap();
        let mut state = step.init_state().unwrap();
        // The model: plain loops over the formulas of the module docs.
        let mut want = vec![0.5f64, -1.0, 2.0];
        let (mut m, mut v) = (vec![0.0f64; 3], vec![0.0f64; 3]);
        for s in 0..3 {
            let lr = 0.1 / (s + 1) as f64;
            let mut inputs = vec![params];
            inputs.append(&mut state);
            inputs.extend(step.scalars(lr, s).unwrap());
            let mut out = fast::evaluate(&step.program, &inputs).unwrap();
            let t = (s + 1) as f64;
            for k in 0..3 {
                let g = want[k] * want[k] + 1.0;
                match opt {
                    Optimizer::Sgd => want[k] -= lr * g,
                    Optimizer::Momentum { momentum } => {
                        m[k] = momentum * m[k] + g;
                        want[k] -= lr * m[k];
                    }
                    Optimizer::Adam { beta1, beta2, eps }
                    | Optimizer::AdamW { beta1, beta2, eps, .. } => {
                        m[k] = beta1 * m[k] + (1.0 - beta1) * g;
                        v[k] = beta2 * v[k] + (1.0 - beta2) * g * g;
                        let mut u = (m[k] / (1.0 - beta1.powf(t)))
                            / ((v[k] / (1.0 - beta2.powf(t))).sqrt() + eps);
                        // `p` is 1-D: it decays only when 1-D parameters do.
                        if let Optimizer::AdamW { weight_decay, decay_1d: true, .. } = opt {
                            u += weight_decay * want[k];
                        }
                        want[k] -= lr * u;
                    }
                }
            }
            state = out.split_off(2);
            params = out.pop().unwrap();
            for (k, (g, w)) in params.to_f64().iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-12 * (1.0 + w.abs()),
                    "{opt:?} step {s} [{k}]: {g} vs {w}"
                );
            }
        }
    }
}

/// Cross-entropy refuses labels whose shape is not the logits' without the class axis
/// (broadcasting would hide the mistake).
#[test]
fn cross_entropy_checks_the_labels_shape() {
    let mut b = Builder::new();
    let logits = b.param("logits", spec("f64[4,3]")).unwrap();
    for (name, bad) in [("a", "i64[1]"), ("b", "i64[4,1]"), ("c", "i64[3]")] {
        let labels = b.param(name, spec(bad)).unwrap();
        assert!(softmax_cross_entropy(&mut b, logits, labels).is_err(), "{bad}");
    }
    let labels = b.param("ok", spec("i64[4]")).unwrap();
    let loss = softmax_cross_entropy(&mut b, logits, labels).unwrap();
    assert_eq!(b.spec(loss).unwrap().to_string(), "f64[]");
}

#[test]
fn a_clipped_step_scales_the_gradients_to_the_global_norm() {
    let mut b = Builder::new();
    let x = b.param("x", spec("f64[4,3]")).unwrap();
    let w = b.param("w", spec("f64[3,2]")).unwrap();
    let c = b.param("c", spec("f64[2]")).unwrap();
    let h = b.matmul(x, w).unwrap();
    let h = b.add(h, c).unwrap();
    let t = b.tanh(h).unwrap();
    let loss = b.reduce_sum(t, &[0, 1], false).unwrap();
    let p = b.finish(&[loss]).unwrap();
    let xs = Tensor::f64(&[4, 3], (0..12).map(|i| (i as f64 - 5.0) * 0.3).collect()).unwrap();
    let ws = Tensor::f64(&[3, 2], vec![0.1, -0.2, 0.3, 0.05, -0.4, 0.2]).unwrap();
    let cs = Tensor::f64(&[2], vec![0.01, -0.02]).unwrap();
    // The gradients, and their global norm, by the unclipped gradient program.
    let g = grad(&p, loss, &[w, c]).unwrap();
    let grads = reference::evaluate(&g, &[xs.clone(), ws.clone(), cs.clone()]).unwrap();
    let norm = grads[1..].iter().flat_map(|t| t.to_f64()).map(|v| v * v).sum::<f64>().sqrt();
    let lr = 0.5;
    for max_norm in [0.25 * norm, 4.0 * norm] {
        let step = TrainStep::clipped(&p, loss, &[w, c], Optimizer::Sgd, Some(max_norm)).unwrap();
        let [lr_t, step_t] = step.scalars(lr, 0).unwrap();
        let inputs = vec![xs.clone(), ws.clone(), cs.clone(), lr_t, step_t];
        let out = reference::evaluate(&step.program, &inputs).unwrap();
        let factor = (max_norm / (norm + 1e-6)).min(1.0);
        for (k, before) in [&ws, &cs].into_iter().enumerate() {
            let want: Vec<f64> = before
                .to_f64()
                .iter()
                .zip(grads[1 + k].to_f64())
                .map(|(p, g)| p - lr * g * factor)
                .collect();
            for (got, want) in out[1 + k].to_f64().iter().zip(&want) {
                assert!((got - want).abs() < 1e-12, "max_norm {max_norm}: {got} vs {want}");
            }
        }
    }
    assert!(TrainStep::clipped(&p, loss, &[w], Optimizer::Sgd, Some(0.0)).is_err());
}

/// A training step computes no gradient nobody asked for: one product forward and one
/// for the weight's gradient, none for the input's.
#[test]
fn a_training_step_holds_only_the_products_it_needs() {
    let mut b = Builder::new();
    let x = b.param("x", spec("f64[8,5]")).unwrap();
    let w = b.param("w", spec("f64[5,3]")).unwrap();
    let h = b.matmul(x, w).unwrap();
    let h = b.tanh(h).unwrap();
    let s = b.reduce_sum(h, &[0, 1], false).unwrap();
    let p = b.finish(&[s]).unwrap();
    let step = TrainStep::new(&p, s, &[w], Optimizer::Sgd).unwrap();
    let names: Vec<_> = step.program.instrs().iter().map(|i| i.op.name()).collect();
    assert_eq!(names.iter().filter(|n| **n == "dot_general").count(), 2, "{}", step.program);
}

/// An optimizer's slots live on their parameter's device and its update is colocated
/// with the parameter, as TensorFlow's optimizers place them.
#[test]
fn updates_and_slots_are_placed_beside_their_parameter() {
    let mut b = Builder::new();
    let w = b.device("/device:CPU:1", |b| b.param("w", spec("f64[3,2]"))).unwrap();
    let x = b.param("x", spec("f64[4,3]")).unwrap();
    let h = b.device("/device:CPU:2", |b| b.matmul(x, w)).unwrap();
    let t = b.tanh(h).unwrap();
    let loss = b.reduce_sum(t, &[0, 1], false).unwrap();
    let p = b.finish(&[loss]).unwrap();
    let step = TrainStep::new(&p, loss, &[w], Optimizer::adam()).unwrap();
    let sp = &step.program;
    let m = sp.params().iter().find(|q| q.name == "optimizer.m.w").unwrap();
    assert_eq!(m.device, "/device:CPU:1", "slots live with their parameter");
    let new_w = sp.instr(sp.results()[1]).unwrap();
    assert_eq!((new_w.device.as_str(), new_w.colocate.clone()), ("/device:CPU:1", vec![Value(0)]));
    let text = sp.to_string();
    assert_eq!(text.parse::<Program>().unwrap().to_string(), text);
}

/// AdamW's decay without 1-D parameters (nanoGPT's choice): with a zero gradient the
/// update is the decay alone, so a matrix shrinks by `lr λ` and a bias stays; with
/// every parameter decaying (the default, `torch.optim.AdamW`'s) both shrink.
#[test]
fn adamw_exempts_1d_parameters_from_decay_when_asked() {
    let mut b = Builder::new();
    let w = b.param("w", spec("f64[2,2]")).unwrap();
    let c = b.param("c", spec("f64[2]")).unwrap();
    let zero = b.constant(0.0, DType::F64).unwrap();
    let sw = b.reduce_sum(w, &[0, 1], false).unwrap();
    let sc = b.reduce_sum(c, &[0], false).unwrap();
    let s = b.add(sw, sc).unwrap();
    let loss = b.mul(s, zero).unwrap();
    let p = b.finish(&[loss]).unwrap();
    let ws = Tensor::f64(&[2, 2], vec![1.0, -2.0, 3.0, 4.0]).unwrap();
    let cs = Tensor::f64(&[2], vec![0.5, -0.5]).unwrap();
    for decay_1d in [false, true] {
        let opt =
            Optimizer::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.5, decay_1d };
        let step = TrainStep::new(&p, loss, &[w, c], opt).unwrap();
        let mut inputs = vec![ws.clone(), cs.clone()];
        inputs.extend(step.init_state().unwrap());
        inputs.extend(step.scalars(0.1, 0).unwrap());
        let out = fast::evaluate(&step.program, &inputs).unwrap();
        let shrink =
            |t: &Tensor| t.to_f64().iter().map(|x| x - 0.1 * (0.5 * x)).collect::<Vec<_>>();
        assert_eq!(out[1].to_f64(), shrink(&ws), "decay_1d {decay_1d}: the matrix decays");
        let bias = if decay_1d { shrink(&cs) } else { cs.to_f64() };
        assert_eq!(out[2].to_f64(), bias, "decay_1d {decay_1d}: the bias");
    }
}

/// A two-layer model of `rows` rows: `x [rows, 3] → tanh(x·W1 + b) · W2`, a mean
/// squared loss against `y [rows, 2]`; its program and weights.
fn small_model(rows: usize) -> (Program, Value, Vec<Value>) {
    let mut b = Builder::new();
    let x = b.param("x", spec(&format!("f64[{rows},3]"))).unwrap();
    let y = b.param("y", spec(&format!("f64[{rows},2]"))).unwrap();
    let w1 = b.param("w1", spec("f64[3,4]")).unwrap();
    let b1 = b.param("b1", spec("f64[4]")).unwrap();
    let w2 = b.param("w2", spec("f64[4,2]")).unwrap();
    let h = b.matmul(x, w1).unwrap();
    let h = b.add(h, b1).unwrap();
    let h = b.tanh(h).unwrap();
    let z = b.matmul(h, w2).unwrap();
    let d = b.sub(z, y).unwrap();
    let d2 = b.mul(d, d).unwrap();
    let loss = b.reduce_mean(d2, &[0, 1], false).unwrap();
    let p = b.finish(&[loss]).unwrap();
    (p, loss, vec![w1, b1, w2])
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 32, ..Default::default() })]

    /// Gradient accumulation is the whole batch's step: N micro-batches of a mean loss
    /// give the loss and the updated weights (Adam, clipped) of one step on all their
    /// rows, within 1e-12 — the simple model being the plain step.
    #[test]
    fn prop_accumulated_micro_batches_step_as_the_whole_batch(
        micro in 2usize..5,
        values in proptest::collection::vec(-2.0f64..2.0, 8 * 5 + 3 * 4 + 4 + 4 * 2),
    ) {
        use meshwork_nn::StepOptions;
        let rows = 2 * micro;
        let (whole, loss, wrt) = small_model(rows);
        let plain = TrainStep::clipped(&whole, loss, &wrt, Optimizer::adam(), Some(0.5)).unwrap();
        let (one, l1, w1) = small_model(rows / micro);
        let options = StepOptions { max_norm: Some(0.5), micro_batches: micro, ..StepOptions::default() };
        let acc = TrainStep::with_options(&one, l1, &w1, Optimizer::adam(), &options).unwrap();
        let mut it = values.iter().copied();
        let mut take = |n: usize| -> Vec<f64> { (0..n).map(|_| it.next().unwrap()).collect() };
        let x = take(rows * 3);
        let y = take(rows * 2);
        let weights = [
            Tensor::f64(&[3, 4], take(12)).unwrap(),
            Tensor::f64(&[4], take(4)).unwrap(),
            Tensor::f64(&[4, 2], take(8)).unwrap(),
        ];
        let scalars = plain.scalars(0.05, 3).unwrap();
        let mut feed = vec![Tensor::f64(&[rows, 3], x.clone()).unwrap(), Tensor::f64(&[rows, 2], y.clone()).unwrap()];
        feed.extend(weights.iter().cloned());
        feed.extend(plain.init_state().unwrap());
        feed.extend(scalars.iter().cloned());
        let want = fast::evaluate(&plain.program, &feed).unwrap();
        let per = rows / micro;
        let mut feed = Vec::new();
        for i in 0..micro {
            feed.push(Tensor::f64(&[per, 3], x[i * per * 3..(i + 1) * per * 3].to_vec()).unwrap());
            feed.push(Tensor::f64(&[per, 2], y[i * per * 2..(i + 1) * per * 2].to_vec()).unwrap());
        }
        feed.extend(weights.iter().cloned());
        feed.extend(acc.init_state().unwrap());
        feed.extend(scalars.iter().cloned());
        let got = fast::evaluate(&acc.program, &feed).unwrap();
        proptest::prop_assert_eq!(got.len(), want.len());
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            for (a, b) in g.to_f64().iter().zip(w.to_f64()) {
                proptest::prop_assert!((a - b).abs() <= 1e-12 * (1.0 + b.abs()), "result {}: {} vs {}", k, a, b);
            }
        }
    }
}

/// Dynamic loss scaling follows GradScaler's rule, step by step against a plain
/// re-simulation: the scale doubles after `growth_interval` finite steps, halves on a
/// step whose scaled gradients overflow (made so by a target of 1e308 in f64: its
/// cotangent times the scale passes f64's range), and such a step leaves the weights
/// and the optimizer state exactly as they were.
#[test]
fn the_loss_scale_grows_after_good_steps_and_backs_off_on_overflow() {
    use meshwork_nn::{LOSS_SCALE, LOSS_SCALE_GOOD, LossScale, StepOptions};
    let (p, loss, wrt) = small_model(2);
    let ls = LossScale { init: 8.0, growth_interval: 2, growth: 2.0, backoff: 0.5 };
    let options = StepOptions { loss_scale: Some(ls), ..StepOptions::default() };
    let step = TrainStep::with_options(&p, loss, &wrt, Optimizer::adam(), &options).unwrap();
    let names: Vec<&str> = step.program.params().iter().map(|p| p.name.as_str()).collect();
    let n = names.len();
    assert_eq!(names[n - 4..], [LOSS_SCALE, LOSS_SCALE_GOOD, "optimizer.lr", "optimizer.step"]);
    assert_eq!(step.state_len(), 3 * 2 + 2);
    let mut weights = vec![
        Tensor::f64(&[3, 4], (0..12).map(|k| 0.1 * k as f64 - 0.5).collect()).unwrap(),
        Tensor::f64(&[4], vec![0.1; 4]).unwrap(),
        Tensor::f64(&[4, 2], (0..8).map(|k| 0.2 - 0.05 * k as f64).collect()).unwrap(),
    ];
    let mut state = step.init_state().unwrap();
    assert_eq!(state[6].to_f64(), [8.0]);
    let (mut scale, mut good) = (8.0, 0.0);
    // Steps 0, 1 finite (the scale doubles after the second), 2 overflows, 3 finite.
    for (s, huge) in [false, false, true, false].into_iter().enumerate() {
        let y0 = if huge { 1e308 } else { 0.3 };
        let mut feed = vec![
            Tensor::f64(&[2, 3], vec![0.5, -0.3, 0.2, 0.1, 0.7, -0.6]).unwrap(),
            Tensor::f64(&[2, 2], vec![y0, -0.2, 0.5, 0.1]).unwrap(),
        ];
        feed.extend(weights.iter().cloned());
        feed.extend(state.iter().cloned());
        feed.extend(step.scalars(0.01, s).unwrap());
        let out = fast::evaluate(&step.program, &feed).unwrap();
        let (new_w, new_s) = (out[1..4].to_vec(), out[4..].to_vec());
        // The plain rule.
        if huge {
            scale *= 0.5;
            good = 0.0;
            assert_eq!(
                new_w.iter().map(Tensor::to_f64).collect::<Vec<_>>(),
                weights.iter().map(Tensor::to_f64).collect::<Vec<_>>(),
                "step {s}"
            );
            assert_eq!(
                new_s[..6].iter().map(Tensor::to_f64).collect::<Vec<_>>(),
                state[..6].iter().map(Tensor::to_f64).collect::<Vec<_>>()
            );
        } else {
            good += 1.0;
            if good >= 2.0 {
                scale *= 2.0;
                good = 0.0;
            }
            assert!(out[0].to_f64()[0].is_finite(), "step {s}");
            assert_ne!(new_w[0].to_f64(), weights[0].to_f64(), "step {s} updates");
        }
        assert_eq!((new_s[6].to_f64()[0], new_s[7].to_f64()[0]), (scale, good), "step {s}");
        weights = new_w;
        state = new_s;
    }
    assert_eq!(scale, 8.0);
}
