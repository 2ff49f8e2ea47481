//! LoRA's dropout against its definition computed here: a model of two linear layers
//! under an adapter with `lora_dropout` 0.3, its loss program run on both
//! interpreters, and the same loss computed on the host from the masks
//! `meshwork_program::random` draws (JAX's draws: the program crate's `random`
//! tests) by the keys folded here.

use std::sync::Arc;

use meshwork_nn::{
    Build, DROPOUT_KEYS, Input, LinearLayer, LoraConfig, LoraModel, Model, Parallel,
};
use meshwork_program::random::{fold_in, key, uniform};
use meshwork_program::{Builder, Result, Value, fast, reference};
use meshwork_types::{DType, Shape, Tensor, TensorSpec};
use serde_json::Value as Json;

/// `T` positions of `IN` inputs through `l0` (`IN → H`) and `l1` (`H → OUT`);
/// the loss `Σ y ⊙ g` for a fed `g`.
#[derive(Debug)]
struct TwoLinears;

const T: usize = 5;
const IN: usize = 6;
const H: usize = 4;
const OUT: usize = 3;

impl TwoLinears {
    fn layer(
        b: &mut Builder,
        build: &Build<'_>,
        name: &str,
        x: Value,
        out: usize,
    ) -> Result<Value> {
        b.scope(name, |b| {
            let d = b.spec(x)?.shape.dims().to_vec();
            let spec = TensorSpec::new(build.dtype, Shape::new(&[out, d[2]])?);
            let w = b.param("weight", spec)?;
            let y = b.dot_general(x, w, &[2], &[1], &[], &[])?;
            match build.adapter {
                Some(a) => Ok(a.linear(b, &b.scope_name(), x, y)?.unwrap_or(y)),
                None => Ok(y),
            }
        })
    }
}

impl Model for TwoLinears {
    fn family(&self) -> &'static str {
        "two-linears"
    }
    fn describe(&self) -> String {
        "two linear layers".into()
    }
    fn meta(&self) -> Json {
        Json::Null
    }
    fn inputs(&self) -> Vec<Input> {
        vec![
            Input { name: "x", dtype: None, dims: vec![T, IN] },
            Input { name: "g", dtype: None, dims: vec![T, OUT] },
        ]
    }
    fn parameters(&self) -> Vec<(String, Vec<usize>)> {
        vec![("l0.weight".into(), vec![H, IN]), ("l1.weight".into(), vec![OUT, H])]
    }
    fn loss(&self, b: &mut Builder, inputs: &[Value], build: &Build<'_>) -> Result<Value> {
        let h = Self::layer(b, build, "l0", inputs[0], H)?;
        let y = Self::layer(b, build, "l1", h, OUT)?;
        let yg = b.mul(y, inputs[1])?;
        b.reduce_sum(yg, &[0, 1, 2], false)
    }
    fn evaluate(
        &self,
        b: &mut Builder,
        inputs: &[Value],
        build: &Build<'_>,
    ) -> Result<(Value, Value)> {
        let loss = self.loss(b, inputs, build)?;
        Ok((loss, loss))
    }
    fn check_mesh(&self, _: usize, _: usize) -> std::result::Result<(), String> {
        Ok(())
    }
    fn split(&self, _: &str, _: usize) -> Option<usize> {
        None
    }
    fn init(&self, _: &str, dims: &[usize], _: &mut dyn FnMut() -> f64) -> Vec<f64> {
        vec![0.0; dims.iter().product()]
    }
    fn activations_per_row(&self, _: bool) -> f64 {
        0.0
    }
    fn per_row(&self) -> (usize, &'static str) {
        (T, "positions")
    }
    fn classifies(&self) -> bool {
        false
    }
    fn linears(&self) -> Vec<LinearLayer> {
        let layer = |name: &str, inputs, outputs| LinearLayer {
            name: name.into(),
            inputs,
            outputs,
            parallel: Parallel::Replicated,
            conv1d: false,
        };
        vec![layer("l0", IN, H), layer("l1", H, OUT)]
    }
}

/// Deterministic values in about ±1.
fn values(n: usize, salt: f64) -> Vec<f64> {
    (0..n).map(|k| ((k as f64 + 1.0) * salt).sin()).collect()
}

/// `w` `[o, i]` times each of `x`'s rows of `i`.
fn matvec(w: &[f64], x: &[f64], o: usize, i: usize) -> Vec<f64> {
    x.chunks(i)
        .flat_map(|r| (0..o).map(move |j| (0..i).map(|k| w[j * i + k] * r[k]).sum::<f64>()))
        .collect()
}

#[test]
fn dropout_drops_each_rows_inputs_by_its_own_key_and_scales_the_rest() {
    // In f64, and in f32 (to f32's rounding: the host computes in f64).
    for (dtype, tolerance) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
        check(dtype, tolerance);
    }
}

fn check(dtype: DType, tolerance: f64) {
    let (p, rows, seed, step) = (0.3, 3, 11_u64, 4_u64);
    let mut config = LoraConfig::new(2, 4.0, &["l0", "l1"]);
    config.dropout = p;
    let model = LoraModel::new(Arc::new(TwoLinears), config, true).unwrap();
    let inputs = model.inputs();
    assert_eq!(inputs.last().unwrap().name, DROPOUT_KEYS);
    assert_eq!(inputs.last().unwrap().dims, [2, 2]);

    let mut b = Builder::new();
    let feeds = model.feeds(&mut b, rows, dtype).unwrap();
    let loss = model.loss(&mut b, &feeds, &Build::new(dtype)).unwrap();
    let program = b.finish(&[loss]).unwrap();
    let x = values(rows * T * IN, 0.7);
    let g = values(rows * T * OUT, 1.3);
    let keys = model.lora().dropout_keys(seed, step, rows);
    let of = |dims: &[usize], v: &[f64]| Tensor::from_f64(dtype, dims, v).unwrap();
    // The values as the program holds them.
    let x = of(&[rows, T, IN], &x).to_f64();
    let g = of(&[rows, T, OUT], &g).to_f64();
    let mut feed = vec![
        of(&[rows, T, IN], &x),
        of(&[rows, T, OUT], &g),
        Tensor::i32(&[rows, 2, 2], keys.clone()).unwrap(),
    ];
    let mut weights = std::collections::HashMap::new();
    for (k, param) in program.params()[3..].iter().enumerate() {
        let n = param.spec.shape.dims().iter().product();
        let t = of(param.spec.shape.dims(), &values(n, 0.31 + k as f64 * 0.17));
        weights.insert(param.name.clone(), t.to_f64());
        feed.push(t);
    }

    // The host's loss: row i's key for layer l folded from the seed by the step, the
    // row and the layer; an input kept where its uniform is below 1 − p in f32.
    let s = 4.0 / 2.0;
    let mut want = 0.0;
    let mut dropped = 0;
    for i in 0..rows {
        let row_key = fold_in(fold_in(fold_in(key(seed), step as u32), i as u32), 0);
        assert_eq!([keys[i * 4] as u32, keys[i * 4 + 1] as u32], row_key);
        let mut h = x[i * T * IN..(i + 1) * T * IN].to_vec();
        for (l, (n_in, n_out)) in [(IN, H), (H, OUT)].into_iter().enumerate() {
            let k = fold_in(fold_in(fold_in(key(seed), step as u32), i as u32), l as u32);
            let masked: Vec<f64> = h
                .iter()
                .enumerate()
                .map(|(e, &v)| {
                    if uniform(k, e as u32) < (1.0 - p) as f32 {
                        v / (1.0 - p)
                    } else {
                        dropped += 1;
                        0.0
                    }
                })
                .collect();
            let name = if l == 0 { "l0" } else { "l1" };
            let w = &weights[&format!("{name}.weight")];
            let a = &weights[&format!("{name}.lora_A.weight")];
            let bm = &weights[&format!("{name}.lora_B.weight")];
            let base = matvec(w, &h, n_out, n_in);
            let ba = matvec(bm, &matvec(a, &masked, 2, n_in), n_out, 2);
            h = base.iter().zip(&ba).map(|(y, d)| y + s * d).collect();
        }
        want += h.iter().zip(&g[i * T * OUT..(i + 1) * T * OUT]).map(|(y, g)| y * g).sum::<f64>();
    }
    // About 30% of the 3·5·(6 + 4) inputs dropped.
    assert!((30..60).contains(&dropped), "{dropped} of 150 dropped");
    for (name, got) in [
        ("reference", reference::evaluate(&program, &feed)),
        ("fast", fast::evaluate(&program, &feed)),
    ] {
        let got = got.unwrap()[0].to_f64()[0];
        let close = (got - want).abs() <= tolerance * want.abs().max(1.0);
        assert!(close, "{dtype} {name}: {got} vs {want}");
    }

    // Other keys drop other inputs; an evaluation reads no keys and drops nothing.
    feed[2] = Tensor::i32(&[rows, 2, 2], model.lora().dropout_keys(seed, step + 1, rows)).unwrap();
    let other = fast::evaluate(&program, &feed).unwrap()[0].to_f64()[0];
    assert!((other - want).abs() > 1e-3, "{other} vs {want}");
    let mut b = Builder::new();
    let feeds = model.feeds(&mut b, rows, dtype).unwrap();
    let (loss, _) = model.evaluate(&mut b, &feeds, &Build::new(dtype)).unwrap();
    let eval = b.finish(&[loss]).unwrap();
    let mut plain = LoraConfig::new(2, 4.0, &["l0", "l1"]);
    plain.dropout = 0.0;
    let plain = LoraModel::new(Arc::new(TwoLinears), plain, true).unwrap();
    let mut b = Builder::new();
    let feeds = plain.feeds(&mut b, rows, dtype).unwrap();
    let loss = plain.loss(&mut b, &feeds, &Build::new(dtype)).unwrap();
    let undropped = b.finish(&[loss]).unwrap();
    let mut without = feed.clone();
    without.remove(2);
    let a = fast::evaluate(&eval, &feed).unwrap()[0].to_f64()[0];
    let b = fast::evaluate(&undropped, &without).unwrap()[0].to_f64()[0];
    assert_eq!(a, b);
}

/// A dropout outside [0, 1) is refused; a loss given the base's inputs without the
/// keys, or keys of another shape, is a typed error.
#[test]
fn bad_dropouts_and_keys_are_typed_errors() {
    for bad in [1.0, -0.1, f64::NAN] {
        let mut config = LoraConfig::new(2, 4.0, &["l0"]);
        config.dropout = bad;
        let e = LoraModel::new(Arc::new(TwoLinears), config, true).unwrap_err();
        assert!(e.contains("lora_dropout") && e.contains("below 1"), "{bad}: {e}");
    }
    let mut config = LoraConfig::new(2, 4.0, &["l0", "l1"]);
    config.dropout = 0.5;
    let model = LoraModel::new(Arc::new(TwoLinears), config, true).unwrap();
    let mut b = Builder::new();
    let feeds = model.feeds(&mut b, 2, DType::F32).unwrap();
    let build = Build::new(DType::F32);
    let e = model.loss(&mut b, &feeds[..2], &build).unwrap_err().to_string();
    assert!(e.contains("2 inputs given") && e.contains("takes 3"), "{e}");
    let e = model.evaluate(&mut b, &feeds[..2], &build).unwrap_err().to_string();
    assert!(e.contains("2 inputs given"), "{e}");
    let wrong = b.param("wrong_keys", "i32[2,3,2]".parse().unwrap()).unwrap();
    let e = model.loss(&mut b, &[feeds[0], feeds[1], wrong], &build).unwrap_err().to_string();
    assert!(e.contains("i32 [rows, 2, 2]"), "{e}");
}
