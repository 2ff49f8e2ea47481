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
    // A chain of 512x512 products (long enough to be running when `execute` returns).
    let mut b = Builder::new();
    let x = b.param("x", "f32[512,512]".parse().unwrap()).unwrap();
    let w = b.param("w", "f32[512,512]".parse().unwrap()).unwrap();
    let mut h = x;
    for _ in 0..8 {
        h = b.matmul(h, w).unwrap();
        h = b.push(Op::Unary(Unary::Tanh), &[h]).unwrap();
    }
    let p = b.finish(&[h]).unwrap();
    let values = |m: i32| (0..512 * 512).map(move |i| ((i % m) - m / 2) as f32 / (10 * m) as f32);
    let feed = [
        Tensor::f32(&[512, 512], values(97).collect()).unwrap(),
        Tensor::f32(&[512, 512], values(89).collect()).unwrap(),
    ];
    let session = Session::new(&plugin(), 1).unwrap();
    let want = session.run(&p, &feed).unwrap();
    let compiled = session.compile(&p, &Default::default()).unwrap();
    let device = session.client().device(0).unwrap();
    for donate in [false, true] {
        for _ in 0..5 {
            let xs: Vec<_> =
                feed.iter().map(|t| session.client().put(t, device).unwrap()).collect();
            let out = if donate {
                // Given to the execution: dropped as soon as it is enqueued.
                compiled.executable.execute(vec![xs.into_iter().map(Arg::Donated).collect()])
            } else {
                // Lent to it, and dropped by the caller right after the enqueue.
                let out = compiled.executable.execute(vec![xs.iter().map(Arg::Borrowed).collect()]);
                drop(xs);
                out
            };
            assert_eq!(out.unwrap()[0][0].to_host().unwrap(), want[0]);
        }
    }
}

#[test]
fn a_device_or_buffer_of_another_client_is_refused() {
    let one = Session::new(&plugin(), 1).unwrap();
    let other = Session::new(&plugin(), 1).unwrap();
    let t = Tensor::f64(&[2], vec![1.0, 2.0]).unwrap();
    let foreign = other.client().device(0).unwrap().clone();
    assert!(matches!(one.client().put(&t, &foreign), Err(Error::Arguments(_))));
    assert!(one.client().memory_stats(&foreign).is_none());
    let b = other.client().put(&t, &foreign).unwrap();
    let mut pb = Builder::new();
    let x = pb.param("x", "f64[2]".parse().unwrap()).unwrap();
    let p = pb.finish(&[x]).unwrap();
    let compiled = one.compile(&p, &Default::default()).unwrap();
    let refused = compiled.executable.execute(vec![vec![Arg::Borrowed(&b)]]);
    assert!(matches!(refused, Err(Error::Arguments(_))));
    // A buffer outlives the session that made it: it keeps its client.
    drop(other);
    assert_eq!(b.to_host().unwrap(), t);
}

#[test]
fn send_recv_and_emit_become_parameters_and_outputs_of_the_executable() {
    use meshwork_types::DType;
    let mut b = Builder::new();
    let x = b.param("x", "f64[3]".parse().unwrap()).unwrap();
    let r = b.recv(&"f64[2]".parse().unwrap(), 5, 1).unwrap();
    let two = b.constant(2.0, DType::F64).unwrap();
    let y = b.mul(x, two).unwrap();
    b.send(y, 6, 1).unwrap();
    b.emit(&[x, r], 3).unwrap();
    let z = b.reduce_sum(r, &[0], false).unwrap();
    let p = b.finish(&[z]).unwrap();
    let session = Session::new(&plugin(), 1).unwrap();
    let compiled = session.compile(&p, &Default::default()).unwrap();
    let lowered = &compiled.lowered;
    assert_eq!(lowered.recvs.len(), 1);
    assert_eq!((lowered.recvs[0].channel, lowered.recvs[0].peer), (5, 1));
    assert_eq!(lowered.sends.len(), 1);
    assert_eq!((lowered.sends[0].channel, lowered.sends[0].peer), (6, 1));
    assert_eq!(lowered.emits, [(3, 2)]);
    let device = session.client().device(0).unwrap();
    let xs =
        session.client().put(&Tensor::f64(&[3], vec![1.0, 2.0, 3.0]).unwrap(), device).unwrap();
    let rs = session.client().put(&Tensor::f64(&[2], vec![10.0, 20.0]).unwrap(), device).unwrap();
    let out =
        compiled.executable.execute(vec![vec![Arg::Borrowed(&xs), Arg::Borrowed(&rs)]]).unwrap();
    let host: Vec<Vec<f64>> = out[0].iter().map(|b| b.to_host().unwrap().to_f64()).collect();
    // The result, the emitted x and r, then the sent 2x.
    assert_eq!(host, [vec![30.0], vec![1.0, 2.0, 3.0], vec![10.0, 20.0], vec![2.0, 4.0, 6.0]]);
}

/// XLA's partitioner splits a program whose arguments and results carry
/// `mhlo.sharding`: `x` split by rows over 2 partitions, `w` replicated, the result
/// split as `x` — each device computes its rows, with no collective; with the result
/// replicated instead, XLA gathers it, and its optimized HLO says so.
#[test]
fn xlas_partitioner_splits_a_program_by_its_shardings() {
    use meshwork_xla::lower::LowerOptions;
    let session = Session::new(&plugin(), 2).unwrap();
    let client = session.client();
    let ids: Vec<i64> = client.devices()[..2].iter().map(|d| i64::from(d.id())).collect();
    let (x, w) = (inputs()[0].clone(), inputs()[1].clone());
    let want = reference::evaluate(&mlp(), &inputs()).unwrap()[0].to_f64();
    let rows = |t: &Tensor, r: std::ops::Range<usize>| {
        Tensor::f64(&[2, 3], t.to_f64()[r.start * 3..r.end * 3].to_vec()).unwrap()
    };
    for (out, gathers) in [("{devices=[2,1]<=[2]}", false), ("{replicated}", true)] {
        let options = LowerOptions {
            partitions: 2,
            param_shardings: vec!["{devices=[2,1]<=[2]}".into(), "{replicated}".into()],
            result_shardings: vec![out.into()],
            ..LowerOptions::default()
        };
        let compiled = session.compile_on(&mlp(), &options, &ids).unwrap();
        let (_, hlo) = compiled.executable.optimized_program().unwrap();
        let ops = meshwork_xla::hlo::collectives(&hlo).unwrap();
        let expected_ops = if gathers {
            vec![meshwork_xla::hlo::CollectiveOp { kind: "all-gather".into(), bytes: 64 }]
        } else {
            Vec::new()
        };
        assert_eq!(ops, expected_ops, "{out}");
        let args: Vec<Vec<meshwork_xla::Buffer>> = (0..2)
            .map(|p| {
                let d = &client.devices()[p];
                vec![
                    client.put(&rows(&x, 2 * p..2 * p + 2), d).unwrap(),
                    client.put(&w, d).unwrap(),
                ]
            })
            .collect();
        let outs = compiled
            .executable
            .execute(args.iter().map(|a| a.iter().map(Arg::Borrowed).collect()).collect())
            .unwrap();
        for (p, o) in outs.iter().enumerate() {
            let got = o[0].to_host().unwrap().to_f64();
            let mine = if gathers { &want[..] } else { &want[4 * p..4 * p + 4] };
            assert_eq!(got.len(), mine.len(), "{out}");
            for (a, b) in got.iter().zip(mine) {
                assert!((a - b).abs() <= 1e-12 * (1.0 + b.abs()), "{out} {p}: {a} vs {b}");
            }
        }
    }
}

/// A portable executable, compiled once, runs on any device of its client: its
/// outputs are on the device it ran on (so they feed it there and nowhere else), and
/// the device of another client is refused before the plugin sees it.
#[test]
fn a_portable_executable_runs_on_the_device_it_is_given() {
    let session = Session::new(&plugin(), 2).unwrap();
    let compiled = session.compile_portable(&mlp()).unwrap();
    let client = session.client();
    let want = reference::evaluate(&mlp(), &inputs()).unwrap();
    let (d0, d1) = (client.device(0).unwrap(), client.device(1).unwrap());
    let on = |d| -> Vec<_> { inputs().iter().map(|t| client.put(t, d).unwrap()).collect() };
    for d in [d0, d1] {
        let args = on(d);
        let out =
            compiled.executable.execute_on(d, args.iter().map(Arg::Borrowed).collect()).unwrap();
        assert_eq!(out.len(), 1);
        for (a, b) in out[0].to_host().unwrap().to_f64().iter().zip(want[0].to_f64()) {
            assert!((a - b).abs() <= 1e-12 * (1.0 + b.abs()), "{a} vs {b}");
        }
    }
    // Compiled once for both devices (and found in the cache after).
    assert_eq!(session.compiles(), 1);
    assert_eq!(session.compile_portable(&mlp()).unwrap().lowered.text, compiled.lowered.text);
    assert_eq!(session.compiles(), 1);
    // Its output is on the device it ran on: it feeds a run there, not on the other.
    let x1 = on(d1);
    let mut prog = Builder::new();
    let h = prog.param("h", "f64[4,2]".parse().unwrap()).unwrap();
    let twice = prog.add(h, h).unwrap();
    let double = session.compile_portable(&prog.finish(&[twice]).unwrap()).unwrap();
    let out = compiled.executable.execute_on(d1, x1.iter().map(Arg::Borrowed).collect()).unwrap();
    let again = double.executable.execute_on(d1, vec![Arg::Borrowed(&out[0])]).unwrap();
    let once = out[0].to_host().unwrap().to_f64();
    let twice: Vec<f64> = once.iter().map(|x| 2.0 * x).collect();
    assert_eq!(again[0].to_host().unwrap().to_f64(), twice);
    let elsewhere = double.executable.execute_on(d0, vec![Arg::Borrowed(&out[0])]);
    assert!(matches!(elsewhere, Err(Error::Plugin { .. })), "{elsewhere:?}");
    // Arguments on another device than the one it runs on are refused.
    let args = on(d0);
    let refused = compiled.executable.execute_on(d1, args.iter().map(Arg::Borrowed).collect());
    assert!(matches!(refused, Err(Error::Plugin { .. })), "{refused:?}");
    let other = Session::new(&plugin(), 1).unwrap();
    let foreign = other.client().device(0).unwrap();
    let refused = compiled.executable.execute_on(foreign, args.iter().map(Arg::Borrowed).collect());
    assert!(matches!(refused, Err(Error::Arguments(_))), "{refused:?}");
}

/// Fused attention and its gradient lowered plainly (their definitions inlined) run on
/// XLA as on the reference interpreter; the cuDNN lowering is for GPUs only.
#[test]
fn attention_lowers_plainly_as_its_definition() {
    use meshwork_program::{AttentionSpec, Value};
    let mut b = Builder::new();
    let spec: meshwork_types::TensorSpec = "f64[2,3,5,4]".parse().unwrap();
    let q = b.param("q", spec.clone()).unwrap();
    let k = b.param("k", spec.clone()).unwrap();
    let v = b.param("v", spec).unwrap();
    let a = AttentionSpec { scale: 4f64.sqrt(), divide: true, causal: true };
    let out = b.attention(q, k, v, a).unwrap();
    let program = b.finish(&[out]).unwrap();
    let back = meshwork_program::vjp(&program, &[Value(0), Value(1), Value(2)]).unwrap();
    let inputs: Vec<Tensor> = (0..4)
        .map(|s| {
            let values = (0..120).map(|i| ((i * 37 + s * 11) % 23) as f64 / 7.0 - 1.5).collect();
            Tensor::f64(&[2, 3, 5, 4], values).unwrap()
        })
        .collect();
    let session = Session::new(&plugin(), 1).unwrap();
    let got = session.run(&back, &inputs).unwrap();
    let want = reference::evaluate(&back, &inputs).unwrap();
    assert_eq!(got.len(), 4);
    for (g, w) in got.iter().zip(&want) {
        for (a, b) in g.to_f64().iter().zip(w.to_f64()) {
            assert!((a - b).abs() <= 1e-12 * (1.0 + b.abs()), "{a} vs {b}");
        }
    }
}

/// A plugin that cannot compile for a GPU target (the CPU plugin) is a typed error
/// naming the CUDA plugin, never a crash.
#[test]
fn a_target_on_the_cpu_plugin_is_refused_by_name() {
    use meshwork_xla::target::{Target, TargetSession};
    match TargetSession::new(&plugin(), Target::parse("h100x8").unwrap()) {
        Err(Error::Target(m)) => {
            assert!(m.contains("needs the CUDA plugin") && m.contains("h100x8"), "{m}")
        }
        other => panic!("{other:?}"),
    }
}
