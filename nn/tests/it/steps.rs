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
