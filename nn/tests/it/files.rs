//! Reading the transformer reference run's files (`nn/testdata/`): the
//! safetensors initial weights and the `.npy` token rows. Shared with the strategy
//! crate's SPMD training tests.

use std::collections::HashMap;

use meshwork_nn as nn;
use meshwork_program::{Builder, Program, Value};
use meshwork_types::{DType, Shape, TensorSpec};
use serde_json::Value as Json;

pub(crate) fn testdata(name: &str) -> Vec<u8> {
    let path = format!("{}/../nn/testdata/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The f64 tensors of a safetensors file, by name (through meshwork's one reader).
pub(crate) fn safetensors(bytes: &[u8]) -> HashMap<String, (Vec<usize>, Vec<f64>)> {
    let header = meshwork_io::safetensors::parse(bytes).unwrap();
    let mut out = HashMap::new();
    for e in header.entries {
        assert_eq!(e.dtype, meshwork_io::safetensors::Dtype::F64);
        let values = bytes[e.start as usize..(e.start + e.bytes) as usize]
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        out.insert(e.name, (e.shape, values));
    }
    out
}

/// An int32 `[N, M]` `.npy` file as rows.
pub(crate) fn npy_i32(bytes: &[u8]) -> (usize, usize, Vec<i32>) {
    let a = meshwork_io::npy::from_bytes("tokens.npy", bytes, 1 << 30).unwrap();
    assert_eq!(a.ndim(), 2);
    (a.shape()[0], a.shape()[1], a.iter().map(|&v| v as i32).collect())
}

/// The reference run's `expected.json`, its model's loss program (parameter `rows`
/// `i32[batch, seq + 1]` first, then the weights, f64) with its loss value, and the
/// batch size.
/// The reference run's model and batch size, from `expected.json`'s config.
pub(crate) fn reference_transformer(expected: &Json) -> (nn::Transformer, usize) {
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
    (model, get("batch"))
}

pub(crate) fn reference_model() -> (Json, Program, Value, usize) {
    let expected: Json = serde_json::from_slice(&testdata("expected.json")).unwrap();
    let (model, batch) = reference_transformer(&expected);
    let mut b = Builder::new();
    let rows = b
        .param("rows", TensorSpec::new(DType::I32, Shape::new(&[batch, model.seq + 1]).unwrap()))
        .unwrap();
    let loss = model.loss(&mut b, rows, DType::F64).unwrap();
    let program = b.finish(&[loss]).unwrap();
    (expected, program, loss, batch)
}
