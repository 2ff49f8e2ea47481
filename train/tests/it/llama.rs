//! The Llama family against Hugging Face `transformers` (`testdata/llama`: Llama with
//! grouped-query attention and llama3 rotary scaling, untied; `testdata/qwen3`: Qwen 3
//! with one key/value head, per-head q/k norms, tied), made in float64 by
//! `transformers` 5.24 (`FORMAT.md` there).
//!
//! One part of `transformers`' computation is not reproduced: PyTorch takes the rotary
//! tables' float32 `cos` and `sin` from Intel MKL, whose results differ from the
//! correctly rounded ones (meshwork's) in about 5% of entries, and whose algorithm is
//! not published. Downstream, `transformers`' float32 RMSNorm turns those last-place
//! differences into float32-sized ones (about 1e-7 in the logits). So each case is also
//! checked against `transformers` with correctly rounded tables (`gen_rope_cr.py`:
//! `logits_rope_cr.npy`, `rope_cr.json`), which meshwork gives to 1e-9 and better.

use meshwork_nn::Llama;
use meshwork_program::Builder;
use meshwork_types::{DType, Tensor};

use crate::testdata;

/// The oracle `case`'s model from its `config.json`, and its weights by name.
pub(crate) fn oracle_model(case: &str) -> (Llama, std::collections::HashMap<String, Tensor>) {
    let text = std::fs::read_to_string(testdata(&format!("{case}/model/config.json"))).unwrap();
    let config: serde_json::Value = serde_json::from_str(&text).unwrap();
    let model = Llama::from_config(&config).unwrap();
    let weights =
        meshwork_train::read_init(&testdata(&format!("{case}/model/model.safetensors")), 1 << 30)
            .unwrap();
    (model, weights)
}

/// The oracle's token rows.
pub(crate) fn rows(case: &str) -> ndarray::Array2<i32> {
    let a = meshwork_train::npy::read("tokens", &testdata(&format!("{case}/tokens.npy")), 1 << 30)
        .unwrap();
    a.mapv(|x| x as i32).into_dimensionality().unwrap()
}

/// The largest difference of `got` from `want`, relative to `want`'s largest magnitude.
fn relative(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max) / scale
}

#[test]
fn the_initial_logits_are_transformers() {
    for case in ["llama", "qwen3"] {
        let (model, weights) = oracle_model(case);
        let mut b = Builder::new();
        let ids = b.param("ids", "i32[4,16]".parse().unwrap()).unwrap();
        let logits = model.logits(&mut b, ids, DType::F64).unwrap();
        let program = b.finish(&[logits]).unwrap();
        let names: Vec<(String, Vec<usize>)> = program.params()[1..]
            .iter()
            .map(|p| (p.name.clone(), p.spec.shape.dims().to_vec()))
            .collect();
        assert_eq!(names, model.parameters(), "{case}");
        // Every tensor of the checkpoint is a parameter.
        assert_eq!(weights.len(), names.len(), "{case}");
        let r = rows(case);
        let first: Vec<i32> = r.slice(ndarray::s![0..4, 0..16]).iter().copied().collect();
        let mut inputs = vec![Tensor::i32(&[4, 16], first).unwrap()];
        for (name, shape) in &names {
            let w = &weights[name];
            assert_eq!(w.shape(), &shape[..], "{case} {name}");
            inputs.push(w.clone());
        }
        let got = meshwork_program::fast::evaluate(&program, &inputs).unwrap();
        for (file, tolerance) in [("logits_rope_cr.npy", 1e-9), ("logits.npy", 2e-7)] {
            let path = testdata(&format!("{case}/{file}"));
            let want = meshwork_train::npy::read("logits", &path, 1 << 30).unwrap();
            assert_eq!(got[0].shape(), want.shape());
            let rel = relative(&got[0].to_f64(), &want.iter().copied().collect::<Vec<_>>());
            assert!(rel <= tolerance, "{case}: logits off {file}'s by {rel:e}");
        }
    }
}
