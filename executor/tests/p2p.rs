//! Point-to-point transfers (`send`/`recv`): every tensor sent is received once,
//! unchanged, by the replica and tag it was sent to; a failing or finished peer never
//! leaves a receiver waiting.

use std::sync::Arc;
use std::time::{Duration, Instant};

use meshwork_executor::{Error, ReplicaFn, Runtime, Tensor};
use ndarray::{ArrayD, IxDyn};
use proptest::prelude::*;

fn scalar(x: f64) -> Tensor {
    Tensor::F64(ArrayD::from_elem(IxDyn(&[2]), x))
}

fn value(t: &Tensor) -> f64 {
    match t {
        Tensor::F64(a) => a[[0]],
        other => panic!("{other:?}"),
    }
}

/// A transfer's payload: who sent it to whom under which tag.
fn payload(from: usize, to: usize, tag: u64) -> f64 {
    (from * 1000 + to * 100) as f64 + tag as f64
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Random transfers among 2–5 replicas, sent in one random order and received in
    /// another: each arrives exactly once, with its payload (conservation: nothing
    /// lost, nothing duplicated, nothing crossed).
    #[test]
    fn prop_every_transfer_arrives_once_unchanged(
        n in 2usize..=5,
        raw in proptest::collection::vec((0usize..5, 0usize..5, 0u64..4), 0..24),
        order in any::<u64>(),
    ) {
        let mut transfers: Vec<(usize, usize, u64)> = raw
            .into_iter()
            .map(|(f, t, tag)| (f % n, t % n, tag))
            .filter(|(f, t, _)| f != t)
            .collect();
        transfers.sort_unstable();
        transfers.dedup();
        let transfers = Arc::new(transfers);
        let rt = Runtime::new(n).unwrap().with_timeout(Duration::from_secs(20));
        let t = transfers.clone();
        let program: Arc<ReplicaFn> = Arc::new(move |ctx, _| {
            let me = ctx.replica_id();
            // A replica-specific order of its sends and of its receipts.
            let mut out: Vec<_> = t.iter().filter(|x| x.0 == me).copied().collect();
            let mut inc: Vec<_> = t.iter().filter(|x| x.1 == me).copied().collect();
            let key = |x: &(usize, usize, u64)| (x.0 * 31 + x.1 * 7 + x.2 as usize) as u64 ^ order;
            out.sort_by_key(key);
            inc.sort_by_key(|x| std::cmp::Reverse(key(x)));
            for (f, to, tag) in out {
                ctx.send(to, tag, scalar(payload(f, to, tag)))?;
            }
            let mut got = Vec::new();
            let check = |x: &Tensor, (f, to, tag): (usize, usize, u64)| {
                Tensor::F64(ArrayD::from_elem(IxDyn(&[1]), value(x) - payload(f, to, tag)))
            };
            if order % 2 == 0 {
                for x in inc {
                    got.push(check(&ctx.recv(x.0, x.2)?, x));
                }
            } else {
                // Whichever arrives first: take what is there, then wait for one.
                while !inc.is_empty() {
                    let wanted: Vec<(usize, u64)> = inc.iter().map(|x| (x.0, x.2)).collect();
                    let (i, x) = match ctx.try_recv_any(&wanted)? {
                        Some(hit) => hit,
                        None => ctx.recv_any(&wanted)?,
                    };
                    got.push(check(&x, inc.swap_remove(i)));
                }
            }
            Ok(got)
        });
        let outs = rt.run(program, vec![Vec::new(); n]).unwrap();
        let received: usize = outs.iter().map(Vec::len).sum();
        prop_assert_eq!(received, transfers.len());
        for o in outs.iter().flatten() {
            prop_assert_eq!(value(o), 0.0);
        }
    }
}

#[test]
fn a_receiver_is_released_when_its_sender_fails_or_ends_without_sending() {
    // Quiet the expected panic; other panics (a failing assertion) still print.
    let fallback = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let expected =
            info.payload().downcast_ref::<&str>().is_some_and(|m| m.contains("forward panicked"));
        if !expected {
            fallback(info);
        }
    }));
    let timeout = Duration::from_secs(30);
    let rt = Runtime::new(3).unwrap().with_timeout(timeout);
    for how in ["error", "panic", "ends"] {
        let program: Arc<ReplicaFn> = Arc::new(move |ctx, _| {
            match ctx.replica_id() {
                // Replica 0 waits on replica 2, which waits on replica 1.
                0 => {
                    ctx.recv_any(&[(1, 9), (2, 7)])?;
                }
                2 => {
                    let x = ctx.recv(1, 3)?;
                    ctx.send(0, 7, x)?;
                }
                _ => match how {
                    "error" => return Err("the user's forward failed".into()),
                    "panic" => panic!("the user's forward panicked"),
                    _ => {}
                },
            }
            Ok(Vec::new())
        });
        let start = Instant::now();
        let err = rt.run(program, vec![Vec::new(); 3]).unwrap_err();
        assert!(start.elapsed() < timeout / 3, "{how}: took {:?}", start.elapsed());
        match how {
            "error" => assert!(
                matches!(&err, Error::ReplicaFailed { replica: 1, message } if message.contains("forward failed")),
                "{err}"
            ),
            "panic" => assert!(matches!(&err, Error::ReplicaPanicked { replica: 1, .. }), "{err}"),
            _ => assert!(
                matches!(
                    err,
                    Error::NotSent { from: 1, to: 2, tag: 3 }
                        | Error::NotSent { from: 1, to: 0, tag: 9 }
                ),
                "{err}"
            ),
        }
    }
    // The devices are free for the next run.
    let program: Arc<ReplicaFn> = Arc::new(|ctx, _| {
        if ctx.replica_id() == 0 {
            ctx.send(1, 0, scalar(4.0))?;
            Ok(Vec::new())
        } else {
            Ok(vec![ctx.recv(0, 0)?])
        }
    });
    let out = rt.run(program, vec![Vec::new(); 2]).unwrap();
    assert_eq!(value(&out[1][0]), 4.0);
}

#[test]
fn a_tag_sent_twice_before_its_receipt_or_to_oneself_is_refused() {
    let rt = Runtime::new(2).unwrap();
    let program: Arc<ReplicaFn> = Arc::new(|ctx, _| {
        if ctx.replica_id() == 0 {
            ctx.send(1, 5, scalar(1.0))?;
            ctx.send(1, 5, scalar(2.0))?;
        }
        Ok(Vec::new())
    });
    let err = rt.run(program, vec![Vec::new(); 2]).unwrap_err();
    assert!(
        matches!(&err, Error::BadArgument { op: "send", replica: 0, problem } if problem.contains("tag 5")),
        "{err}"
    );
    let program: Arc<ReplicaFn> = Arc::new(|ctx, _| {
        ctx.recv(ctx.replica_id(), 0)?;
        Ok(Vec::new())
    });
    let err = rt.run(program, vec![Vec::new(); 2]).unwrap_err();
    assert!(matches!(&err, Error::BadArgument { op: "recv", .. }), "{err}");
    for wanted in [vec![], vec![(1, 0), (0, 1)]] {
        let w = wanted.clone();
        let program: Arc<ReplicaFn> = Arc::new(move |ctx, _| {
            if ctx.replica_id() == 0 {
                ctx.recv_any(&w)?;
            }
            Ok(Vec::new())
        });
        let err = rt.run(program, vec![Vec::new(); 2]).unwrap_err();
        assert!(matches!(&err, Error::BadArgument { op: "recv", .. }), "{wanted:?}: {err}");
    }
}
