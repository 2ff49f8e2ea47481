//! The JAX reference training run (`testdata/transformer/`, made by its
//! `gen_transformer_case.py`): the decoder-only transformer written with `nn`, trained
//! by one `TrainStep` program per optimizer, reproduces JAX's loss at every one of 20
//! steps to a relative 1e-9, for SGD and Adam — the builder, `nn`, autodiff, the
//! optimizers and the fast interpreter together against an independent oracle.

use std::collections::HashMap;

use meshwork_program::fast::{Executable, Options};
use meshwork_program::{Builder, Env, Optimizer, Tensor, TrainStep, Value, nn};
use meshwork_types::{DType, Shape, TensorSpec};
use serde_json::Value as Json;

fn testdata(name: &str) -> Vec<u8> {
    let path = format!("{}/testdata/transformer/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The f64 tensors of a safetensors file, by name.
fn safetensors(bytes: &[u8]) -> HashMap<String, (Vec<usize>, Vec<f64>)> {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Json = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    let mut out = HashMap::new();
    for (name, t) in header.as_object().unwrap() {
        if name == "__metadata__" {
            continue;
        }
        assert_eq!(t["dtype"], "F64");
        let shape: Vec<usize> =
            t["shape"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap() as usize).collect();
        let off: Vec<usize> = t["data_offsets"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap() as usize)
            .collect();
        let values = data[off[0]..off[1]]
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        out.insert(name.clone(), (shape, values));
    }
    out
}

/// An int32 `[N, M]` `.npy` file as rows.
fn npy_i32(bytes: &[u8]) -> (usize, usize, Vec<i32>) {
    let hlen = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let header = std::str::from_utf8(&bytes[10..10 + hlen]).unwrap();
    assert!(header.contains("'<i4'") && header.contains("'fortran_order': False"));
    let shape = header.split("'shape': (").nth(1).unwrap().split(')').next().unwrap();
    let dims: Vec<usize> = shape.split(',').filter_map(|d| d.trim().parse().ok()).collect();
    let data = bytes[10 + hlen..]
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    (dims[0], dims[1], data)
}

/// Trains 20 steps with `optimizer` at `lr`; returns each step's loss.
fn train(optimizer: Optimizer, lr: f64, steps: usize) -> (Vec<f64>, Json) {
    let expected: Json = serde_json::from_slice(&testdata("expected.json")).unwrap();
    let cfg = &expected["config"];
    let get = |k: &str| cfg[k].as_u64().unwrap() as usize;
    let model = nn::Transformer {
        vocab: get("vocab"),
        seq: get("seq"),
        dim: get("dim"),
        heads: get("heads"),
        layers: get("layers"),
        ffn: get("ffn"),
    };
    let batch = get("batch");
    let mut b = Builder::new();
    let rows = b
        .param("rows", TensorSpec::new(DType::I32, Shape::new(&[batch, model.seq + 1]).unwrap()))
        .unwrap();
    let loss = model.loss(&mut b, rows, DType::F64).unwrap();
    let program = b.finish(&[loss]).unwrap();
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
