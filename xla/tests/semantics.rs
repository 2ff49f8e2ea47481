//! Where the program layer leaves a meaning to the back end (an index outside `take`'s
//! axis, float → int `convert` of NaN and out-of-range values, NaN in `max`), XLA's
//! holds and both interpreters agree with it: each case runs through XLA and both
//! interpreters and must give the same bits. And `threefry_uniform`, lowered to
//! XLA's integer ops, draws the interpreters' bits (which are JAX's: the program
//! crate's `random` tests).

use meshwork_program::{Binary, Builder, Op, Program, Reduction, fast, reference};
use meshwork_types::{DType, Tensor};
use meshwork_xla::{Session, find};

fn session() -> Session {
    let path = find::plugin_path(None).expect("set MESHWORK_PJRT_PLUGIN to a PJRT plugin");
    Session::new(&find::load(&path).unwrap_or_else(|e| panic!("{e}")), 1).unwrap()
}

/// XLA's outputs, and both interpreters', element by element (NaN equal to NaN).
fn agree(session: &Session, program: &Program, inputs: &[Tensor]) {
    let xla = session.run(program, inputs).unwrap_or_else(|e| panic!("xla: {e}"));
    for (name, run) in [
        ("reference", reference::evaluate as fn(&Program, &[Tensor]) -> _),
        ("fast", fast::evaluate),
    ] {
        let got = run(program, inputs).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(got.len(), xla.len(), "{name}: every output");
        for (g, x) in got.iter().zip(&xla) {
            assert_eq!(g.spec(), x.spec());
            let same = g
                .to_f64()
                .iter()
                .zip(x.to_f64())
                .all(|(a, b)| a == &b || (a.is_nan() && b.is_nan()));
            assert!(same, "{name} interpreter {:?} vs XLA {:?}", g.to_f64(), x.to_f64());
        }
    }
}

#[test]
fn take_and_scatter_add_clamp_an_index_outside_the_axis() {
    let session = session();
    let mut b = Builder::new();
    let table = b.param("t", "f64[4,2]".parse().unwrap()).unwrap();
    let idx = b.param("i", "i64[5]".parse().unwrap()).unwrap();
    let upd = b.param("u", "f64[5,2]".parse().unwrap()).unwrap();
    let taken = b.take(table, idx, 0).unwrap();
    let scattered = b.push(Op::ScatterAdd { axis: 0 }, &[table, idx, upd]).unwrap();
    let p = b.finish(&[taken, scattered]).unwrap();
    let t = Tensor::f64(&[4, 2], (0..8).map(f64::from).collect()).unwrap();
    let i = Tensor::i64(&[5], vec![-3, 0, 3, 4, 99]).unwrap();
    let u = Tensor::f64(&[5, 2], (0..10).map(|k| f64::from(k) * 10.0).collect()).unwrap();
    agree(&session, &p, &[t, i, u]);
}

#[test]
fn float_to_int_convert_truncates_saturates_and_maps_nan_to_zero() {
    let session = session();
    for dtype in [DType::I32, DType::I64, DType::Bool] {
        let mut b = Builder::new();
        let x = b.param("x", "f64[8]".parse().unwrap()).unwrap();
        let y = b.convert(x, dtype).unwrap();
        let p = b.finish(&[y]).unwrap();
        let v = vec![f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 3e10, -3e10, 2.7, -2.7, 0.0];
        agree(&session, &p, &[Tensor::f64(&[8], v).unwrap()]);
    }
}

#[test]
fn max_min_and_reduce_max_propagate_nan() {
    let session = session();
    let mut b = Builder::new();
    let x = b.param("x", "f64[2,3]".parse().unwrap()).unwrap();
    let y = b.param("y", "f64[2,3]".parse().unwrap()).unwrap();
    let mx = b.push(Op::Binary(Binary::Max), &[x, y]).unwrap();
    let mn = b.push(Op::Binary(Binary::Min), &[x, y]).unwrap();
    let r =
        b.push(Op::Reduce { kind: Reduction::Max, axes: vec![1], keepdims: false }, &[x]).unwrap();
    let a = b.argmax(x, 1).unwrap();
    let p = b.finish(&[mx, mn, r, a]).unwrap();
    let xs = Tensor::f64(&[2, 3], vec![1.0, f64::NAN, 3.0, 5.0, 4.0, 5.0]).unwrap();
    let ys = Tensor::f64(&[2, 3], vec![f64::NAN, 0.0, 4.0, 1.0, 9.0, -1.0]).unwrap();
    agree(&session, &p, &[xs, ys]);
}

#[test]
fn threefry_uniform_draws_the_interpreters_bits() {
    let session = session();
    let mut b = Builder::new();
    let k1 = b.param("k1", "i32[3,70]".parse().unwrap()).unwrap();
    let k2 = b.param("k2", "i32[3,70]".parse().unwrap()).unwrap();
    let x = b.param("x", "i32[3,70]".parse().unwrap()).unwrap();
    let u = b.threefry_uniform(k1, k2, x).unwrap();
    let p = b.finish(&[u]).unwrap();
    let n = 210;
    let ints = |f: &dyn Fn(i32) -> i32| Tensor::i32(&[3, 70], (0..n).map(f).collect()).unwrap();
    let k1 = ints(&|e| e.wrapping_mul(-1_640_531_527));
    let k2 = ints(&|e| i32::MAX - e / 3);
    let x = ints(&|e| if e % 2 == 0 { e } else { i32::MIN + e });
    agree(&session, &p, &[k1, k2, x]);
}
