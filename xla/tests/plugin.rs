//! The runtime and the lowering against a real plugin (`MESHWORK_PJRT_PLUGIN`; in CI
//! the pinned `xla-cpu-pjrt` wheel's, which `cargo xtask ci` installs). A missing
//! plugin fails these tests: it is never a skip.

use meshwork_program::{Builder, Op, Program, Unary, reference};
use meshwork_types::Tensor;
use meshwork_xla::{Arg, Error, Plugin, Session, find};

fn plugin() -> Plugin {
    let path = find::plugin_path(None).expect("set MESHWORK_PJRT_PLUGIN to a PJRT plugin");
    find::load(&path).unwrap_or_else(|e| panic!("{e}"))
}

fn mlp() -> Program {
    let mut b = Builder::new();
    let x = b.param("x", "f64[4,3]".parse().unwrap()).unwrap();
    let w = b.param("w", "f64[3,2]".parse().unwrap()).unwrap();
    let z = b.matmul(x, w).unwrap();
    let h = b.push(Op::Unary(Unary::Tanh), &[z]).unwrap();
    b.finish(&[h]).unwrap()
}

fn inputs() -> Vec<Tensor> {
    vec![
        Tensor::f64(&[4, 3], (0..12).map(|i| f64::from(i) / 7.0 - 0.5).collect()).unwrap(),
        Tensor::f64(&[3, 2], (0..6).map(|i| f64::from(i) / 3.0 - 1.0).collect()).unwrap(),
    ]
}

#[test]
fn a_program_runs_through_xla_as_through_the_reference_interpreter() {
    let session = Session::new(&plugin(), 1).unwrap();
    let got = session.run(&mlp(), &inputs()).unwrap();
    let want = reference::evaluate(&mlp(), &inputs()).unwrap();
    assert_eq!(got[0].shape(), want[0].shape());
    for (a, b) in got[0].to_f64().iter().zip(want[0].to_f64()) {
        assert!((a - b).abs() <= 1e-12 * (1.0 + b.abs()), "{a} vs {b}");
    }
    // Compiled once: the second run hits the cache.
    session.run(&mlp(), &inputs()).unwrap();
    assert_eq!(session.compiles(), 1);
}

#[test]
fn the_cpu_plugin_gives_as_many_devices_as_asked() {
    let session = Session::new(&plugin(), 3).unwrap();
    assert_eq!(session.client().devices().len(), 3);
    assert_eq!(session.client().platform(), "cpu");
}

#[test]
fn a_program_xla_refuses_is_a_typed_error_with_its_message() {
    let session = Session::new(&plugin(), 1).unwrap();
    let err =
        session.client().compile("mlir", b"module { this is not stablehlo }", &[]).unwrap_err();
    match err {
        Error::Plugin { message, .. } => assert!(!message.is_empty()),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_client_dropped_before_its_buffers_and_executables_leaves_them_usable() {
    let session = Session::new(&plugin(), 1).unwrap();
    let compiled = session.compile(&mlp(), &Default::default()).unwrap();
    let device = session.client().device(0).unwrap().clone();
    let xs: Vec<_> = inputs().iter().map(|t| session.client().put(t, &device).unwrap()).collect();
    drop(session);
    let out = compiled.executable.execute(vec![xs.iter().map(Arg::Borrowed).collect()]).unwrap();
    assert_eq!(out[0][0].to_host().unwrap().shape(), &[4, 2]);
}

#[test]
fn buffers_dropped_while_an_execution_reads_them_do_not_change_its_result() {
    let session = Session::new(&plugin(), 1).unwrap();
    let compiled = session.compile(&mlp(), &Default::default()).unwrap();
    let device = session.client().device(0).unwrap();
    let want = session.run(&mlp(), &inputs()).unwrap();
    for _ in 0..20 {
        let xs: Vec<_> =
            inputs().iter().map(|t| session.client().put(t, device).unwrap()).collect();
        // Given to the execution: dropped as soon as it is enqueued.
        let out =
            compiled.executable.execute(vec![xs.into_iter().map(Arg::Donated).collect()]).unwrap();
        assert_eq!(out[0][0].to_host().unwrap(), want[0]);
    }
}
