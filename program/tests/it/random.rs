//! `threefry_uniform` and `meshwork_program::random` against JAX
//! (`testdata/threefry.json`, written by `testdata/gen_threefry.py` with jax 0.10.2):
//! Threefry-2x32's known answers, keys made and folded, and the float32 uniforms and
//! Bernoulli masks `jax.random` draws, through both interpreters.

use meshwork_program::random::{fold_in, key, threefry2x32};
use meshwork_program::{Builder, Program, fast, reference};
use meshwork_types::{DType, Tensor};
use proptest::prelude::*;

fn oracle() -> serde_json::Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/threefry.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn u32s(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

#[test]
fn threefry_gives_jaxs_known_answers() {
    let o = oracle();
    let kat = o["kat"].as_array().unwrap();
    assert!(kat.len() >= 3);
    for case in kat {
        let (k, c, out) = (u32s(&case["key"]), u32s(&case["counter"]), u32s(&case["out"]));
        assert_eq!(threefry2x32([k[0], k[1]], [c[0], c[1]]).to_vec(), out, "{case}");
    }
}

/// The draw of `shape` under a key fed as two i32 scalars: the uniforms and
/// `uniform < keep` (JAX's `bernoulli`).
fn draw(shape: &[usize], keep: f32) -> Program {
    let mut b = Builder::new();
    let k1 = b.param("k1", "i32[]".parse().unwrap()).unwrap();
    let k2 = b.param("k2", "i32[]".parse().unwrap()).unwrap();
    let n = shape.iter().product();
    let x = b.iota(DType::I32, &[n], 0).unwrap();
    let x = b.reshape(x, shape).unwrap();
    let k1 = b.broadcast_to(k1, shape).unwrap();
    let k2 = b.broadcast_to(k2, shape).unwrap();
    let u = b.threefry_uniform(k1, k2, x).unwrap();
    let p = b.constant(f64::from(keep), DType::F32).unwrap();
    let kept = b.lt(u, p).unwrap();
    b.finish(&[u, kept]).unwrap()
}

#[test]
fn uniforms_and_masks_are_jaxs_in_both_interpreters() {
    let o = oracle();
    let cases = o["cases"].as_array().unwrap();
    assert!(cases.len() >= 5);
    for case in cases {
        let mut k = key(case["seed"].as_u64().unwrap());
        for f in u32s(&case["folds"]) {
            k = fold_in(k, f);
        }
        assert_eq!(k.to_vec(), u32s(&case["key"]), "{case}");
        let shape: Vec<usize> = case["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap() as usize)
            .collect();
        let keep = case["keep"].as_f64().unwrap() as f32;
        let program = draw(&shape, keep);
        let feeds = [
            Tensor::i32(&[], vec![k[0] as i32]).unwrap(),
            Tensor::i32(&[], vec![k[1] as i32]).unwrap(),
        ];
        let want: Vec<f32> = u32s(&case["uniform_bits"]).into_iter().map(f32::from_bits).collect();
        let mask: Vec<f64> = case["mask"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| f64::from(u8::from(m.as_bool().unwrap())))
            .collect();
        for (name, out) in [
            ("reference", reference::evaluate(&program, &feeds)),
            ("fast", fast::evaluate(&program, &feeds)),
        ] {
            let out = out.unwrap();
            assert_eq!(out[0].dtype(), DType::F32);
            let got: Vec<f32> = out[0].to_f64().into_iter().map(|u| u as f32).collect();
            assert_eq!(got, want, "{name}: {case}");
            assert_eq!(out[1].to_f64(), mask, "{name}: {case}");
        }
    }
}

#[test]
fn sixteen_thousand_draws_are_uniform() {
    // 2¹⁴ draws under one key: each tenth of [0, 1) holds its share within 5 σ.
    let n = 1 << 14;
    let out = fast::evaluate(
        &draw(&[n], 0.5),
        &[Tensor::i32(&[], vec![7]).unwrap(), Tensor::i32(&[], vec![-3]).unwrap()],
    )
    .unwrap();
    let u = out[0].to_f64();
    assert!(u.iter().all(|&v| (0.0..1.0).contains(&v)));
    let sigma = (n as f64 * 0.1 * 0.9).sqrt();
    for d in 0..10 {
        let lo = d as f64 / 10.0;
        let count = u.iter().filter(|&&v| v >= lo && v < lo + 0.1).count() as f64;
        assert!((count - n as f64 / 10.0).abs() < 5.0 * sigma, "tenth {d}: {count}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    /// The fast interpreter's threaded kernel draws the reference's bits, for counters
    /// fed and read through a transpose (which the fast interpreter copies out).
    #[test]
    fn the_fast_kernel_draws_the_references_bits(
        rows in 1usize..40, cols in 1usize..70, k1 in any::<i32>(), k2 in any::<i32>(),
        start in any::<i32>(), transposed in any::<bool>(),
    ) {
        let mut b = Builder::new();
        let x = b.param("x", format!("i32[{rows},{cols}]").parse().unwrap()).unwrap();
        let k1v = b.constant(f64::from(k1), DType::I32).unwrap();
        let k2v = b.constant(f64::from(k2), DType::I32).unwrap();
        let x = if transposed { b.transpose(x, &[1, 0]).unwrap() } else { x };
        let dims = b.spec(x).unwrap().shape.dims().to_vec();
        let k1v = b.broadcast_to(k1v, &dims).unwrap();
        let k2v = b.broadcast_to(k2v, &dims).unwrap();
        let u = b.threefry_uniform(k1v, k2v, x).unwrap();
        let p = b.finish(&[u]).unwrap();
        let xs = (0..rows * cols).map(|e| start.wrapping_add(e as i32 * 7919)).collect();
        let feed = [Tensor::i32(&[rows, cols], xs).unwrap()];
        let want = reference::evaluate(&p, &feed).unwrap()[0].to_f64();
        let got = fast::evaluate(&p, &feed).unwrap()[0].to_f64();
        prop_assert_eq!(got, want);
    }
}
