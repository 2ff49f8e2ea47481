//! Model check of the rendezvous under shuttle's schedulers
//! (`RUSTFLAGS="--cfg shuttle" cargo test -p meshwork-executor --lib ::model::`): the real
//! hub, with shuttle's locks and condition variables, and replicas as shuttle threads.
//! Shuttle's condition variables never time out, so these schedules check rounds,
//! results, poisoning and signature checks, not the timeout path.

use std::sync::Arc;

use ndarray::{ArrayD, IxDyn};

use super::{Hub, Offer, ReplicaGroups};
use meshwork_types::ReduceOp;

use crate::tensor::TensorOps;
use crate::{Error, Tensor};

const REPLICAS: usize = 3;
const ROUNDS: usize = 3;

fn tensor(replica: usize, round: usize) -> Tensor {
    Tensor::I64(ArrayD::from_elem(IxDyn(&[1]), (10 * round + replica) as i64))
}

fn offer(replica: usize, round: usize, signature: &str) -> Offer {
    Offer::new("op", signature.into(), Arc::new(tensor(replica, round)))
}

/// Three replicas meet for three rounds, alternating plain exchanges and exchanges
/// whose completer builds the result. Every replica leaves every round with every
/// member's tensor of that round, in rank order; the completer runs once per round;
/// the hub keeps no result once every member has read it; nothing deadlocks.
fn rounds() {
    let hub = Arc::new(Hub::new(REPLICAS, std::time::Duration::from_secs(3600)));
    let finishes = Arc::new(shuttle::sync::Mutex::new(0usize));
    let replicas: Vec<_> = (0..REPLICAS)
        .map(|r| {
            let (hub, finishes) = (hub.clone(), finishes.clone());
            shuttle::thread::spawn(move || {
                let all = ReplicaGroups::all(REPLICAS);
                for round in 0..ROUNDS {
                    let got = if round % 2 == 0 {
                        hub.exchange(&all, r, offer(r, round, "")).unwrap()
                    } else {
                        hub.exchange_then(&all, r, offer(r, round, ""), |tensors| {
                            *finishes.lock().unwrap() += 1;
                            Ok(tensors)
                        })
                        .unwrap()
                    };
                    let want: Vec<Tensor> = (0..REPLICAS).map(|m| tensor(m, round)).collect();
                    assert_eq!(got.iter().map(|t| (**t).clone()).collect::<Vec<_>>(), want);
                }
            })
        })
        .collect();
    for h in replicas {
        h.join().unwrap();
    }
    assert_eq!(*finishes.lock().unwrap(), ROUNDS / 2, "one completer per round");
    let sets = super::lock(&hub.sets);
    for group in sets.values().flat_map(|set| &set.groups) {
        let st = super::lock(&group.state);
        assert!(st.done.is_none() && st.unread == 0, "the hub kept a read result");
        assert_eq!(st.round, ROUNDS as u64);
    }
}

/// Replica 2 fails (poisons the hub) at an arbitrary point instead of joining the
/// second round; the other two must leave that round with an error naming it, never
/// hang, and a round that did complete must have given everyone the same tensors.
fn poison() {
    let hub = Arc::new(Hub::new(REPLICAS, std::time::Duration::from_secs(3600)));
    let replicas: Vec<_> = (0..REPLICAS)
        .map(|r| {
            let hub = hub.clone();
            shuttle::thread::spawn(move || {
                let all = ReplicaGroups::all(REPLICAS);
                let first = hub.exchange(&all, r, offer(r, 0, ""));
                if r == 2 {
                    hub.poison(2);
                    return first.map(|_| ());
                }
                let first = first?;
                assert_eq!(first.len(), REPLICAS);
                hub.exchange(&all, r, offer(r, 1, "")).map(|_| ())
            })
        })
        .collect();
    let results: Vec<_> = replicas.into_iter().map(|h| h.join().unwrap()).collect();
    for (r, result) in results.iter().enumerate().take(2) {
        match result {
            Err(Error::PeerFailed { failed: 2, replica, .. }) => assert_eq!(*replica, r),
            other => panic!("replica {r}: {other:?}"),
        }
    }
}

/// Two groups meet at the same time, and one member of the second group brings a
/// different signature: the first group completes, every member of the second gets
/// the same mismatch naming both sides.
fn groups_and_mismatch() {
    let hub = Arc::new(Hub::new(4, std::time::Duration::from_secs(3600)));
    let groups = ReplicaGroups::new(vec![vec![0, 1], vec![3, 2]], 4).unwrap();
    let replicas: Vec<_> = (0..4)
        .map(|r| {
            let (hub, groups) = (hub.clone(), groups.clone());
            shuttle::thread::spawn(move || {
                let signature = if r == 2 { "f32[2]" } else { "f32[1]" };
                hub.exchange(&groups, r, offer(r, 0, signature))
            })
        })
        .collect();
    let results: Vec<_> = replicas.into_iter().map(|h| h.join().unwrap()).collect();
    for r in 0..2 {
        let got = results[r].as_ref().unwrap();
        assert_eq!((*got[0]).clone(), tensor(0, 0));
        assert_eq!((*got[1]).clone(), tensor(1, 0));
    }
    for r in 2..4 {
        match &results[r] {
            Err(Error::Mismatch { first: 3, replica: 2, .. }) => {}
            other => panic!("replica {r}: {:?}", other.as_ref().map(|round| round.len())),
        }
    }
}

/// The direct all-reduce of replicas 0–2 (group `[0, 1, 2]`) while replica 3 fails
/// and poisons the hub, optionally with member `panics` panicking mid-fold. Every
/// schedule must end in one of the outcomes a collective allows: every member of the
/// group gets the full result, or every member gets the failure — replica 3's, or the
/// panicking member's (which itself unwinds, after the others are done with its
/// buffer).
fn direct_all_reduce(panics: Option<usize>) {
    let hub = Arc::new(Hub::new(4, std::time::Duration::from_secs(3600)));
    let groups = ReplicaGroups::new(vec![vec![0, 1, 2], vec![3]], 4).unwrap();
    let replicas: Vec<_> = (0..4)
        .map(|r| {
            let (hub, groups) = (hub.clone(), groups.clone());
            shuttle::thread::spawn(move || {
                if r == 3 {
                    hub.poison(3);
                    return None;
                }
                let mut t = Tensor::I64(ArrayD::from_elem(IxDyn(&[5]), 1 << (8 * r)));
                let offer = Offer {
                    op: "all_reduce",
                    signature: "i64[5]".into(),
                    tensor: Arc::new(Tensor::I32(ArrayD::zeros(IxDyn(&[0])))),
                    lent: Some(crate::direct::Lent::of(&mut t)),
                };
                let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let round = hub.exchange(&groups, r, offer)?;
                    let inject = if panics == Some(r) {
                        crate::direct::Inject::PanicMidFold
                    } else {
                        crate::direct::Inject::Nothing
                    };
                    let dtype = meshwork_types::DType::I64;
                    crate::direct::all_reduce_injected(&round, r, dtype, ReduceOp::Sum, inject)
                        .map_err(|k| Error::PeerFailed { failed: k, replica: r, op: "all_reduce" })
                }));
                Some(match outcome {
                    Ok(Ok(())) => Ok(t),
                    Ok(Err(e)) => Err(Some(e)),
                    Err(_panic) => Err(None),
                })
            })
        })
        .collect();
    let outcomes: Vec<_> = replicas.into_iter().filter_map(|h| h.join().unwrap()).collect();
    assert_eq!(outcomes.len(), 3);
    let want = Tensor::I64(ArrayD::from_elem(IxDyn(&[5]), 0x010101));
    assert!(
        one_outcome(&outcomes, panics, |_, t| *t == want, false),
        "members of one all-reduce disagree on its outcome: {outcomes:?}"
    );
}

/// Whether members 0–2 of a direct round left with one of the outcomes a collective
/// allows: every member its result (`ok`; with member `panics` set to panic, only if
/// `unfired_panic_ok` — a member that finds no work left never reaches its panic),
/// every member replica 3's failure, or member `panics` unwound and every other member
/// names it.
fn one_outcome(
    outcomes: &[std::result::Result<Tensor, Option<Error>>],
    panics: Option<usize>,
    ok: impl Fn(usize, &Tensor) -> bool,
    unfired_panic_ok: bool,
) -> bool {
    let all_ok = outcomes.iter().enumerate().all(|(r, o)| o.as_ref().is_ok_and(|t| ok(r, t)));
    let poisoned = outcomes.iter().enumerate().all(|(r, o)| {
        matches!(o, Err(Some(Error::PeerFailed { failed: 3, replica, .. })) if *replica == r)
    });
    let panicked = panics.is_some_and(|p| {
        outcomes.iter().enumerate().all(|(r, o)| match o {
            Err(None) => r == p,
            Err(Some(Error::PeerFailed { failed, replica, .. })) => *failed == p && *replica == r,
            _ => false,
        })
    });
    all_ok && (panics.is_none() || unfired_panic_ok) || poisoned || panicked
}

#[test]
fn model_direct_all_reduce() {
    shuttle::check_random(|| direct_all_reduce(None), 1000);
    shuttle::check_pct(|| direct_all_reduce(None), 1000, 3);
}

#[test]
fn model_direct_all_reduce_with_a_panicking_member() {
    for p in 0..3 {
        shuttle::check_random(move || direct_all_reduce(Some(p)), 300);
        shuttle::check_pct(move || direct_all_reduce(Some(p)), 300, 3);
    }
}

#[test]
fn model_rounds() {
    shuttle::check_random(rounds, 1000);
    shuttle::check_pct(rounds, 1000, 3);
}

#[test]
fn model_poison() {
    shuttle::check_random(poison, 1000);
    shuttle::check_pct(poison, 1000, 3);
}

#[test]
fn model_groups_and_mismatch() {
    shuttle::check_random(groups_and_mismatch, 1000);
    shuttle::check_pct(groups_and_mismatch, 1000, 3);
}

/// The shared-chunk reduce-scatter of replicas 0–2 (group `[0, 1, 2]`, six chunks of
/// one element, claimed in any order) while replica 3 fails and poisons the hub,
/// optionally with member `panics` panicking after the first chunk it claims (if it
/// claims one). Every schedule must end with every member holding its piece, or every
/// member holding the failure.
fn direct_reduce_scatter(panics: Option<usize>) {
    let hub = Arc::new(Hub::new(4, std::time::Duration::from_secs(3600)));
    let groups = ReplicaGroups::new(vec![vec![0, 1, 2], vec![3]], 4).unwrap();
    let replicas: Vec<_> = (0..4)
        .map(|r| {
            let (hub, groups) = (hub.clone(), groups.clone());
            shuttle::thread::spawn(move || {
                if r == 3 {
                    hub.poison(3);
                    return None;
                }
                let input: Vec<i64> = (0..6).map(|i| (i + 1) << (8 * r)).collect();
                let mut out = Tensor::I64(ArrayD::from_elem(IxDyn(&[2]), -1));
                let offer = Offer {
                    op: "reduce_scatter",
                    signature: "i64[6]".into(),
                    tensor: Arc::new(Tensor::I64(
                        ArrayD::from_shape_vec(IxDyn(&[6]), input).unwrap(),
                    )),
                    lent: Some(crate::direct::Lent::of(&mut out)),
                };
                let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let round = hub.exchange(&groups, r, offer)?;
                    let inject = if panics == Some(r) {
                        crate::direct::Inject::PanicMidFold
                    } else {
                        crate::direct::Inject::Nothing
                    };
                    crate::direct::reduce_scatter_injected(&round, r, ReduceOp::Sum, 0, 1, inject)
                        .map_err(|k| Error::PeerFailed {
                            failed: k,
                            replica: r,
                            op: "reduce_scatter",
                        })
                }));
                Some(match outcome {
                    Ok(Ok(())) => Ok(out),
                    Ok(Err(e)) => Err(Some(e)),
                    Err(_panic) => Err(None),
                })
            })
        })
        .collect();
    let outcomes: Vec<_> = replicas.into_iter().filter_map(|h| h.join().unwrap()).collect();
    assert_eq!(outcomes.len(), 3);
    // Element i of every input is (i + 1) << (8 r): piece k sums to (2k + 1, 2k + 2) · 0x010101.
    let piece = |k: i64| {
        Tensor::I64(
            ArrayD::from_shape_vec(
                IxDyn(&[2]),
                vec![(2 * k + 1) * 0x010101, (2 * k + 2) * 0x010101],
            )
            .unwrap(),
        )
    };
    // A member set to panic that claimed no chunk (the others took them all) does not.
    assert!(
        one_outcome(&outcomes, panics, |r, t| *t == piece(r as i64), true),
        "members of one reduce-scatter disagree on its outcome: {outcomes:?}"
    );
}

#[test]
fn model_direct_reduce_scatter() {
    shuttle::check_random(|| direct_reduce_scatter(None), 1000);
    shuttle::check_pct(|| direct_reduce_scatter(None), 1000, 3);
}

#[test]
fn model_direct_reduce_scatter_with_a_panicking_member() {
    for p in 0..3 {
        shuttle::check_random(move || direct_reduce_scatter(Some(p)), 300);
        shuttle::check_pct(move || direct_reduce_scatter(Some(p)), 300, 3);
    }
}
