//! GPT-2 against Hugging Face `transformers` (`testdata/gpt2`, made in f64 by
//! `transformers` 5.24: `FORMAT.md` there): the model read from `save_pretrained`'s
//! `model.safetensors` gives the initial logits within 1e-9, and 10 steps of
//! `torch.optim.AdamW` (lr 3e-3, weight decay 0.1 on every parameter) give
//! `losses_adamw` within 1e-9 at every step, on meshes 1x1, 2x1, 1x2, 2x2 and 4x1
//! (the batch over `data`, Megatron's split of the blocks over `model`).

use std::collections::HashMap;

use meshwork_nn::{Gpt2, Optimizer};
use meshwork_program::{Builder, Value};
use meshwork_strategy::Strategy;
use meshwork_strategy::partition::{Shardings, megatron_spec};
use meshwork_strategy::sharding::Mesh;
use meshwork_types::{DType, Tensor};

use crate::testdata;

/// The oracle's model: its sizes from `config.json`, its weights by name.
fn oracle_model() -> (Gpt2, HashMap<String, Tensor>) {
    let text = std::fs::read_to_string(testdata("gpt2/model/config.json")).unwrap();
    let c: serde_json::Value = serde_json::from_str(&text).unwrap();
    let n = |k: &str| c[k].as_u64().unwrap() as usize;
    let gpt = Gpt2 {
        vocab: n("vocab_size"),
        positions: n("n_positions"),
        dim: n("n_embd"),
        layers: n("n_layer"),
        heads: n("n_head"),
        inner: c["n_inner"].as_u64().map_or(4 * n("n_embd"), |v| v as usize),
        eps: c["layer_norm_epsilon"].as_f64().unwrap(),
    };
    let weights =
        meshwork_train::read_init(&testdata("gpt2/model/model.safetensors"), 1 << 30).unwrap();
    (gpt, weights)
}

/// The oracle's token rows `[N, 17]`.
fn rows() -> ndarray::Array2<i32> {
    let a = meshwork_train::npy::read("tokens", &testdata("gpt2/tokens.npy"), 1 << 30).unwrap();
    a.mapv(|x| x as i32).into_dimensionality().unwrap()
}

fn expected(key: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(testdata("gpt2/expected.json")).unwrap();
    serde_json::from_str::<serde_json::Value>(&text).unwrap()[key].clone()
}

/// `got` within `rel` of `want`, relative to `want`'s largest magnitude.
fn assert_close(got: &[f64], want: &[f64], rel: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    let scale = want.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    let worst = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    assert!(worst <= rel * scale, "{what}: off by {worst:e} (scale {scale})");
}

#[test]
fn the_initial_logits_are_transformers_within_1e_9() {
    let (gpt, weights) = oracle_model();
    let rows = rows();
    let mut b = Builder::new();
    let ids = b.param("ids", "i32[4,16]".parse().unwrap()).unwrap();
    let logits = gpt.logits(&mut b, ids, DType::F64).unwrap();
    let program = b.finish(&[logits]).unwrap();
    // Every parameter the model makes is in the checkpoint, of its shape.
    let names: Vec<(String, Vec<usize>)> = program.params()[1..]
        .iter()
        .map(|p| (p.name.clone(), p.spec.shape.dims().to_vec()))
        .collect();
    assert_eq!(names, gpt.parameters());
    let first: Vec<i32> = rows.slice(ndarray::s![0..4, 0..16]).iter().copied().collect();
    let mut inputs = vec![Tensor::i32(&[4, 16], first).unwrap()];
    for (name, shape) in &names {
        let w = &weights[name];
        assert_eq!(w.shape(), &shape[..], "{name}");
        inputs.push(w.clone());
    }
    let got = meshwork_program::fast::Executable::compile(&program, Default::default())
        .run(&inputs, &meshwork_program::Env::local())
        .unwrap();
    let want = meshwork_train::npy::read("logits", &testdata("gpt2/logits.npy"), 1 << 30).unwrap();
    assert_eq!(got[0].shape(), want.shape());
    assert_close(&got[0].to_f64(), &want.iter().copied().collect::<Vec<_>>(), 1e-9, "logits");
}

/// 10 AdamW steps of batch 4 (step `s` on rows `(4s + i) mod N`) on `mesh`, the
/// rows split over its `data` axis, the weights by Megatron's specs over `model`.
fn adamw_losses(mesh: Mesh) -> Vec<f64> {
    let (gpt, weights) = oracle_model();
    let rows = rows();
    let mut b = Builder::new();
    let batch = b.param("rows", "i32[4,17]".parse().unwrap()).unwrap();
    let loss = gpt.loss(&mut b, batch, DType::F64).unwrap();
    let program = b.finish(&[loss]).unwrap();
    let trained: Vec<Value> = (1..program.params().len()).map(|k| Value(k as u32)).collect();
    let adamw = Optimizer::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1 };
    let mut shardings = Shardings::new(mesh).with("rows", "P('data')").unwrap();
    for (name, shape) in gpt.parameters() {
        shardings = shardings.with_spec(&name, megatron_spec(&name, shape.len()));
    }
    let strategy = Strategy::data_parallel(shardings.mesh().size()).unwrap();
    let mut step =
        strategy.compile_train_step(&program, loss, &trained, adamw, &shardings).unwrap();
    for (name, _) in gpt.parameters() {
        step.set(&name, &weights[&name]).unwrap();
    }
    let n = rows.nrows();
    (0..10)
        .map(|s| {
            let picked: Vec<i32> =
                (0..4).flat_map(|i| rows.row((4 * s + i) % n).to_vec()).collect();
            step.step(&[Tensor::i32(&[4, 17], picked).unwrap()], 3e-3).unwrap()
        })
        .collect()
}

#[test]
fn adamw_reproduces_transformers_losses_on_meshes() {
    let want: Vec<f64> =
        expected("losses_adamw").as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    for (d, m) in [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1)] {
        let mesh = Mesh::iota(&[("data", d), ("model", m)]).unwrap();
        let got = adamw_losses(mesh);
        for (s, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((g - w).abs() <= 1e-9 * w.abs(), "{d}x{m}, step {s}: {g} vs {w}");
        }
    }
}
