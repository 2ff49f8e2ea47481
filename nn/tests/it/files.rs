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

/// The f64 tensors of a safetensors file, by name.
pub(crate) fn safetensors(bytes: &[u8]) -> HashMap<String, (Vec<usize>, Vec<f64>)> {
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
pub(crate) fn npy_i32(bytes: &[u8]) -> (usize, usize, Vec<i32>) {
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
