//! The in-process all-reduce at the memory-traffic bound: members of a group lend each
//! other their buffers for one round, rank `k` folds region `k` of every buffer in rank
//! order and writes the result into region `k` of every buffer. Each input element is
//! read once and each output element written once, with no staging buffers.
//!
//! This is the one place the executor shares mutable memory between threads, so it is
//! the one place with `unsafe`. Soundness rests on three facts:
//! 1. **Disjoint regions.** Rank `k` touches only elements `region(k)` of each buffer;
//!    the regions of a group's ranks partition `0..len`, so no element is accessed by
//!    two threads during the round.
//! 2. **Buffers outlive every access.** A member lends its buffer (a pointer taken
//!    from a `&mut` it then leaves untouched), and does not use, move or drop
//!    the buffer until the round's [`Countdown`](crate::hub::Countdown) reaches zero,
//!    i.e. every member (itself included) has finished its region. The countdown
//!    cannot be poisoned and never times out, and a member counts itself done *and
//!    waits for zero* in a drop guard, so even a member whose own fold panics unwinds
//!    (and frees its buffer) only after every peer is done with it; a failure
//!    elsewhere can neither free a buffer early nor hang. A member whose fold panicked
//!    is recorded in the countdown, and every other member returns an error naming it
//!    instead of a buffer with that member's region half written.
//! 3. **Equal buffers.** The rendezvous publishes loans only when every member
//!    offered the same dtype and length (they are part of the signature it checks),
//!    and publishes them to all members or to none.
#![allow(unsafe_code)]

use std::ops::Range;

use meshwork_types::{DType, ReduceOp};
use ndarray::ArrayD;

use crate::hub::Round;
use crate::tensor::{Element, Tensor};

/// A buffer lent for one round: where its elements start, and how many there are.
#[derive(Clone, Copy)]
pub(crate) struct Lent {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a loan is only an address until `fold_region` uses it, under the rules of
// the module docs (disjoint regions, buffers that outlive the round's countdown).
unsafe impl Send for Lent {}
// SAFETY: as for `Send`: shared loans are read only as addresses.
unsafe impl Sync for Lent {}

impl Lent {
    /// Lends `t`'s elements (standard layout). The caller must not touch `t` again
    /// until the round's countdown is zero.
    pub(crate) fn of(t: &mut Tensor) -> Lent {
        fn lend<T>(a: &mut ArrayD<T>) -> Lent {
            let s = a.as_slice_mut().expect("offered in standard layout");
            Lent { ptr: s.as_mut_ptr().cast(), len: s.len() }
        }
        match t {
            Tensor::F32(a) => lend(a),
            Tensor::F64(a) => lend(a),
            Tensor::I32(a) => lend(a),
            Tensor::I64(a) => lend(a),
        }
    }
}

/// This member's part of a round: dropped on return or on unwind alike, it counts the
/// member done and then waits until every member is done, so the caller's frame —
/// which owns the member's lent buffer — cannot be left (and the buffer freed) while a
/// peer may still read or write it.
struct Share<'a> {
    round: &'a Round,
    rank: usize,
    /// Set once the fold has returned; still false in a drop means it unwound.
    folded: bool,
}

impl Drop for Share<'_> {
    fn drop(&mut self) {
        self.round.working.done((!self.folded).then_some(self.rank));
        // Every member's share is a fold that cannot block: it returns or unwinds, and
        // either way its own `Share` counts it done, so this wait ends.
        self.round.working.wait();
    }
}

/// Rank `rank`'s share of the all-reduce over the buffers of `dtype` lent in `round`,
/// then the wait for everyone's share. On return the member's own buffer holds the
/// full result. If this rank's fold panics, the panic resumes only after every other
/// member has finished with this member's buffer (fact 2 of the module docs).
///
/// Integer sums wrap on overflow (two's complement, as XLA's integer `add`), in every
/// build profile, so an overflowing reduction gives every member the same result.
///
/// `Err(k)`: rank `k`'s fold panicked, so part of every buffer holds no result; all
/// members but `k` (which unwinds) get this.
pub(crate) fn all_reduce(
    round: &Round,
    rank: usize,
    dtype: DType,
    op: ReduceOp,
) -> Result<(), usize> {
    reduce_share(round, rank, dtype, op, Inject::Nothing)
}

/// Failures and delays the tests inject into a rank's share.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Inject {
    /// The real thing.
    Nothing,
    /// The fold panics half-way, after writing part of this rank's region.
    #[cfg(test)]
    PanicMidFold,
    /// The fold starts only after this many milliseconds (so a failing peer is done
    /// long before).
    #[cfg(test)]
    SlowFold(u64),
}

/// [`all_reduce`] with a failure or delay injected: the paths the tests check under
/// Miri and shuttle.
#[cfg(test)]
pub(crate) fn all_reduce_injected(
    round: &Round,
    rank: usize,
    dtype: DType,
    op: ReduceOp,
    inject: Inject,
) -> Result<(), usize> {
    reduce_share(round, rank, dtype, op, inject)
}

fn reduce_share(
    round: &Round,
    rank: usize,
    dtype: DType,
    op: ReduceOp,
    inject: Inject,
) -> Result<(), usize> {
    let mut share = Share { round, rank, folded: false };
    #[cfg(test)]
    if let Inject::SlowFold(ms) = inject {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
    #[cfg(test)]
    let panic_mid_fold = inject == Inject::PanicMidFold;
    #[cfg(not(test))]
    let panic_mid_fold = {
        let Inject::Nothing = inject;
        false
    };
    let lent: Vec<Lent> =
        round.lent.iter().map(|l| l.expect("every member of a direct round lends")).collect();
    let n = lent.len();
    let len = lent[0].len;
    let region = rank * len / n..(rank + 1) * len / n;
    // SAFETY: facts 1–3 of the module docs: this rank alone touches `region` of each
    // buffer, every buffer lives until the countdown `share` feeds reaches zero (its
    // drop waits for that, on unwind too), and all buffers hold `len` elements of
    // `dtype`.
    unsafe {
        match dtype {
            DType::F32 => fold_region::<f32>(&lent, region, op, panic_mid_fold),
            DType::F64 => fold_region::<f64>(&lent, region, op, panic_mid_fold),
            DType::I32 => fold_region::<i32>(&lent, region, op, panic_mid_fold),
            DType::I64 => fold_region::<i64>(&lent, region, op, panic_mid_fold),
            other => unreachable!("tensors of {other} do not exist"),
        }
    }
    share.folded = true;
    drop(share);
    match round.working.failed() {
        Some(k) => Err(k),
        None => Ok(()),
    }
}

/// Folds `region` of every lent buffer in order and writes the result into `region` of
/// every buffer, block by block so a block's inputs and result stay in cache.
///
/// # Safety
/// Every loan must be a live, exclusive-to-this-round buffer of at least
/// `region.end` elements of `T`, and no other thread may access `region` of any of
/// them until this returns.
unsafe fn fold_region<T: Element>(
    lent: &[Lent],
    region: Range<usize>,
    op: ReduceOp,
    panic_mid_fold: bool,
) {
    const BLOCK: usize = 4096;
    let mut acc: Vec<T> = Vec::with_capacity(BLOCK.min(region.len()));
    for start in region.clone().step_by(BLOCK) {
        let end = (start + BLOCK).min(region.end);
        // SAFETY: in bounds by the caller's contract; the slices cover only `region`,
        // which no other thread touches, and each lives only within this block.
        let block = |l: &Lent| unsafe {
            std::slice::from_raw_parts_mut(l.ptr.cast::<T>().add(start), end - start)
        };
        acc.clear();
        acc.extend_from_slice(block(&lent[0]));
        for l in &lent[1..] {
            let src = block(l);
            match op {
                ReduceOp::Sum | ReduceOp::Mean => {
                    acc.iter_mut().zip(src.iter()).for_each(|(a, &x)| *a = T::add(*a, x))
                }
                ReduceOp::Min => {
                    acc.iter_mut().zip(src.iter()).for_each(|(a, &x)| *a = T::min(*a, x))
                }
                ReduceOp::Max => {
                    acc.iter_mut().zip(src.iter()).for_each(|(a, &x)| *a = T::max(*a, x))
                }
            }
        }
        if op == ReduceOp::Mean {
            acc.iter_mut().for_each(|a| *a = T::mean(*a, lent.len()));
        }
        for (k, l) in lent.iter().enumerate() {
            if panic_mid_fold && k == 1 {
                panic!("injected: this rank's fold fails half-way");
            }
            block(l).copy_from_slice(&acc);
        }
    }
}

#[cfg(test)]
mod tests {
    //! Small enough for Miri (`cargo xtask miri`: `cargo +nightly miri test -p
    //! meshwork-executor --lib direct` over several seeds), which checks the loans for
    //! data races and dangling accesses — on the failure paths (a member whose fold
    //! panics, a member that errors at the rendezvous or fails before it) as well as
    //! the happy path.

    use std::sync::Arc;
    use std::time::Duration;

    use meshwork_types::ReduceOp;
    use ndarray::{ArrayD, IxDyn};

    use super::{Inject, Lent, all_reduce_injected};
    use crate::Error;
    use crate::hub::{Hub, Offer, ReplicaGroups};
    use crate::tensor::Tensor;

    /// What a member left with: its buffer and the all-reduce's outcome, or the
    /// message of its panic.
    type Outcome = std::thread::Result<(Tensor, Result<(), Error>)>;

    /// Runs one direct all-reduce of `inputs[r]` on `n = inputs.len()` threads. Member
    /// `panics` (if any) panics mid-fold, member `odd` (if any) offers another
    /// signature, member `poisons` (if any) fails instead of arriving.
    fn run(
        inputs: Vec<Tensor>,
        op: ReduceOp,
        panics: Option<usize>,
        odd: Option<usize>,
        poisons: Option<usize>,
    ) -> Vec<Outcome> {
        let n = inputs.len();
        let hub = Arc::new(Hub::new(n, Duration::from_secs(60)));
        let threads: Vec<_> = inputs
            .into_iter()
            .enumerate()
            .map(|(r, mut t)| {
                let hub = hub.clone();
                std::thread::spawn(move || {
                    if poisons == Some(r) {
                        hub.poison(r);
                        return (t, Err(Error::ReplicaFailed { replica: r, message: "".into() }));
                    }
                    let dtype = t.dtype();
                    let signature = if odd == Some(r) { "other" } else { "same" };
                    let offer = Offer {
                        op: "all_reduce",
                        signature: format!("{signature} {:?}", t.shape()),
                        tensor: Arc::new(Tensor::I32(ArrayD::zeros(IxDyn(&[0])))),
                        lent: Some(Lent::of(&mut t)),
                    };
                    let result = hub.exchange(&ReplicaGroups::all(n), r, offer).and_then(|round| {
                        // A failing member fails at once; the others start their folds
                        // late, when its unwinding is long over — unless its `Share`
                        // holds it back.
                        let inject = match panics {
                            Some(p) if p == r => Inject::PanicMidFold,
                            Some(_) => Inject::SlowFold(20),
                            None => Inject::Nothing,
                        };
                        all_reduce_injected(&round, r, dtype, op, inject).map_err(|k| {
                            Error::PeerFailed { failed: k, replica: r, op: "all_reduce" }
                        })
                    });
                    // `t` is dropped here when the fold above panicked: only after
                    // every peer is done with it.
                    (t, result)
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join()).collect()
    }

    fn f32s(r: usize, len: usize) -> Tensor {
        let v: Vec<f32> = (0..len).map(|i| (r * 10 + i) as f32 * 0.5).collect();
        Tensor::F32(ArrayD::from_shape_vec(IxDyn(&[len]), v).unwrap())
    }

    /// Three members lend buffers of 7 elements (regions of 2, 2 and 3); every member
    /// ends with the rank-order sum.
    #[test]
    fn members_fold_each_others_regions() {
        let n = 3;
        let want: Vec<f32> =
            (0..7).map(|i| (0..n).fold(0.0f32, |acc, r| acc + (r * 10 + i) as f32 * 0.5)).collect();
        for outcome in run((0..n).map(|r| f32s(r, 7)).collect(), ReduceOp::Sum, None, None, None) {
            let (t, result) = outcome.unwrap();
            result.unwrap();
            match t {
                Tensor::F32(a) => assert_eq!(a.iter().copied().collect::<Vec<_>>(), want),
                other => panic!("{other:?}"),
            }
        }
    }

    /// A member whose fold panics half-way (after writing part of its region) unwinds
    /// and frees its buffer only once the others are done with it — Miri reports a
    /// data race and a use after free otherwise — and every other member gets an error
    /// naming it rather than a half-reduced buffer. With 2 and 3 members, the failing
    /// one first, in the middle and last.
    #[test]
    fn a_member_panicking_mid_fold_frees_its_buffer_only_after_the_others() {
        for n in [2, 3] {
            for failing in 0..n {
                let outcomes = run(
                    (0..n).map(|r| f32s(r, 48)).collect(),
                    ReduceOp::Sum,
                    Some(failing),
                    None,
                    None,
                );
                for (r, outcome) in outcomes.into_iter().enumerate() {
                    if r == failing {
                        assert!(outcome.is_err(), "member {r} of {n} should have panicked");
                    } else {
                        let (_, result) = outcome.unwrap();
                        assert_eq!(
                            result,
                            Err(Error::PeerFailed {
                                failed: failing,
                                replica: r,
                                op: "all_reduce"
                            }),
                            "member {r} of {n}, member {failing} failing"
                        );
                    }
                }
            }
        }
    }

    /// A member that errors at the rendezvous (another signature) or fails before it
    /// (poisoning the hub): no loans are published, every member gets an error, and
    /// every buffer is left as it was lent. With 2 and 3 members.
    #[test]
    fn a_member_erroring_at_the_rendezvous_publishes_no_loans() {
        for n in [2, 3] {
            for (odd, poisons) in [(Some(n - 1), None), (None, Some(0)), (None, Some(n - 1))] {
                let outcomes =
                    run((0..n).map(|r| f32s(r, 5)).collect(), ReduceOp::Sum, None, odd, poisons);
                for (r, outcome) in outcomes.into_iter().enumerate() {
                    let (t, result) = outcome.unwrap();
                    assert!(result.is_err(), "member {r} of {n} ({odd:?}, {poisons:?})");
                    assert_eq!(t, f32s(r, 5), "member {r}'s buffer changed");
                    if let Some(bad) = odd {
                        assert!(
                            matches!(result, Err(Error::Mismatch { replica, .. }) if replica == bad),
                            "{result:?}"
                        );
                    }
                }
            }
        }
    }

    /// An integer sum that overflows wraps (as XLA's integer add does) on every member,
    /// in debug and release builds alike: no panic, the same result everywhere.
    #[test]
    fn integer_overflow_wraps_on_every_member() {
        let a = |v: Vec<i32>| Tensor::I32(ArrayD::from_shape_vec(IxDyn(&[v.len()]), v).unwrap());
        let b = |v: Vec<i64>| Tensor::I64(ArrayD::from_shape_vec(IxDyn(&[v.len()]), v).unwrap());
        let cases = [
            (vec![a(vec![i32::MAX, 1]), a(vec![1, 2])], a(vec![i32::MIN, 3]), ReduceOp::Sum),
            (
                vec![a(vec![i32::MAX, -7]), a(vec![i32::MAX, 0]), a(vec![2, 1])],
                a(vec![0, -6]),
                ReduceOp::Sum,
            ),
            (vec![b(vec![i64::MIN, 4]), b(vec![-1, 4])], b(vec![i64::MAX / 2, 4]), ReduceOp::Mean),
        ];
        for (inputs, want, op) in cases {
            for outcome in run(inputs, op, None, None, None) {
                let (t, result) = outcome.unwrap();
                result.unwrap();
                assert_eq!(t, want);
            }
        }
    }
}
