//! The JAX reference training run (`testdata/transformer/`, made by its
//! `gen_transformer_case.py`): the decoder-only transformer written with `nn`, trained
//! by one `TrainStep` program per optimizer, reproduces JAX's loss at every one of 20
//! steps to a relative 1e-9, for SGD and Adam — the builder, `nn`, autodiff, the
//! optimizers and the fast interpreter together against an independent oracle.

use meshwork_nn::{Optimizer, TrainStep};
use meshwork_program::fast::{Executable, Options};
use meshwork_program::{Env, Tensor, Value};
use serde_json::Value as Json;

#[path = "files.rs"]
mod files;
use files::{npy_i32, reference_model, safetensors, testdata};

/// Trains 20 steps with `optimizer` at `lr`; returns each step's loss.
fn train(optimizer: Optimizer, lr: f64, steps: usize) -> (Vec<f64>, Json) {
    let (expected, program, loss, batch) = reference_model();
    let weights: Vec<Value> = (1..program.params().len()).map(|k| Value(k as u32)).collect();
    let step = TrainStep::new(&program, loss, &weights, optimizer).unwrap();
    let exe = Executable::compile(&step.program, Options::default());

    let init = safetensors(&testdata("init.safetensors"));
    assert_eq!(init.len(), weights.len(), "every initial tensor is a parameter of the model");
    let mut params: Vec<Tensor> = program.params()[1..]
        .iter()
        .map(|p| {
            let (shape, values) =
                init.get(&p.name).unwrap_or_else(|| panic!("no {} in init", p.name));
            assert_eq!(shape.as_slice(), p.spec.shape.dims(), "{}", p.name);
            Tensor::f64(shape, values.clone()).unwrap()
        })
        .collect();
    let mut state = step.init_state().unwrap();
    let (n, m, tokens) = npy_i32(&testdata("tokens.npy"));
    let mut losses = Vec::new();
    for s in 0..steps {
        let mut batch_rows = Vec::with_capacity(batch * m);
        for i in 0..batch {
            let r = (s * batch + i) % n;
            batch_rows.extend_from_slice(&tokens[r * m..(r + 1) * m]);
        }
        let mut inputs = vec![Tensor::i32(&[batch, m], batch_rows).unwrap()];
        inputs.append(&mut params);
        inputs.append(&mut state);
        inputs.extend(step.scalars(lr, s).unwrap());
        let mut out = exe.run_owned(inputs, &Env::local()).unwrap();
        losses.push(out[0].to_f64()[0]);
        state = out.split_off(1 + weights.len());
        params = out.split_off(1);
    }
    (losses, expected)
}

fn assert_losses(got: &[f64], want: &Json) {
    let want: Vec<f64> = want.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    assert_eq!(got.len(), want.len());
    for (s, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!((g - w).abs() <= 1e-9 * w.abs(), "step {s}: loss {g}, JAX {w}");
    }
}

#[test]
fn the_transformer_trains_as_jaxs_reference_run_with_sgd() {
    let (losses, expected) = train(Optimizer::Sgd, 0.1, 20);
    assert_losses(&losses, &expected["losses_sgd"]);
}

#[test]
fn the_transformer_trains_as_jaxs_reference_run_with_adam() {
    let (losses, expected) = train(Optimizer::adam(), 0.01, 20);
    assert_losses(&losses, &expected["losses_adam"]);
}
