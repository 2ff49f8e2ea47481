//! The in-process all-reduce and reduce-scatter at the memory-traffic bound: members
//! of a group lend each other their buffers for one round. In an all-reduce rank `k`
//! folds region `k` of every buffer in rank order and writes the result into region
//! `k` of every buffer. In a reduce-scatter the members lend their output buffers and
//! share the work chunk by chunk — whichever members are running claim the next chunk
//! of some piece and fold it from every input (read-only, shared) into that piece's
//! buffer — so the fold does not wait for a member the OS has not scheduled yet (its
//! return does: every member waits for every share to end). Either way each
//! input element is read once and each output element written once, with no staging
//! buffers.
//!
//! This is the one place the executor shares mutable memory between threads (its other
//! `unsafe` is a zeroed allocation in `tensor.rs` and, under the `mpi` feature, `Send`
//! for the MPI communicator). Soundness rests on three facts:
//! 1. **Disjoint regions.** Rank `k` touches only elements `region(k)` of each buffer
//!    (all-reduce), or only the chunks it claimed with an atomic `fetch_add`, each
//!    claimed by exactly one member (reduce-scatter); the regions, or the chunks of a
//!    piece, partition the buffer, so no element is accessed by two threads during the
//!    round.
//! 2. **Buffers outlive every access.** A member lends its buffer (a pointer taken
//!    from a `&mut` it then leaves untouched), and does not use, move or drop
//!    the buffer until the round's [`Countdown`](crate::hub::Countdown) reaches zero,
//!    i.e. every member (itself included) has finished its share. The countdown
//!    cannot be poisoned and never times out, and a member counts itself done *and
//!    waits for zero* in a drop guard, so even a member whose own share panics unwinds
//!    (and frees its buffer) only after every peer is done with it; a failure
//!    elsewhere can neither free a buffer early nor hang. A member whose share panicked
//!    is recorded in the countdown, and every other member returns an error naming it
//!    instead of a buffer half written.
//! 3. **Equal buffers.** The rendezvous publishes loans only when every member
//!    offered the same dtype and shape (they are part of the signature it checks),
//!    and publishes them to all members or to none.
#![allow(unsafe_code)]

use std::ops::Range;

use meshwork_types::{DType, ReduceOp};
use ndarray::ArrayD;

use crate::hub::Round;
use crate::tensor::Element;
use meshwork_types::Tensor;

/// A buffer lent for one round: where its elements start, and how many there are.
#[derive(Clone, Copy)]
pub(crate) struct Lent {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a loan is only an address until `fold_region` or `fold_chunk` uses it, under
// the rules of the module docs (disjoint regions or claimed chunks, buffers that
// outlive the round's countdown).
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
        macro_rules! go {
            ($v:ident, $a:ident) => {
                lend($a)
            };
        }
        crate::tensor::numeric!(t, a => go)
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
    share(round, rank, inject, |panic_mid_fold| {
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
    })
}

/// Runs `work` (given whether to panic half-way) as rank `rank`'s share of `round`,
/// then waits for every member's share; `Err(k)` if rank `k`'s share panicked. A panic
/// in `work` resumes only after every member is done (fact 2 of the module docs).
fn share(round: &Round, rank: usize, inject: Inject, work: impl FnOnce(bool)) -> Result<(), usize> {
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
    work(panic_mid_fold);
    share.folded = true;
    drop(share);
    match round.working.failed() {
        Some(k) => Err(k),
        None => Ok(()),
    }
}

/// Bytes of output per unit of a reduce-scatter's shared work: large enough that
/// claiming a unit costs nothing beside folding it (the unit reads `n` times as
/// much), small enough that the members running at any moment share the work evenly.
pub(crate) const SCATTER_CHUNK_BYTES: usize = 256 << 10;

/// Rank `rank`'s share of a reduce-scatter over `round`, whose tensors are the members'
/// inputs (one dtype and shape, standard layout) and whose loans are the members'
/// output buffers (each piece `k` of `n` along `axis`, in rank order): the members
/// claim chunks of `chunk` output elements (`c` is chunk `c / n` of piece `c % n`) until
/// none is left, and fold each from every input in rank order into its owner's buffer.
/// Whichever members are running do the work, so a member the OS has not scheduled
/// yet holds up no fold (only everyone's return, which waits for every share); each
/// input element is still read once and each output element
/// written once. Then it waits for every member's share. On return (`Ok`) the member's
/// own buffer holds its piece.
///
/// `Err(k)`: rank `k`'s share panicked, so part of some buffer holds no result; all
/// members but `k` (which unwinds) get this.
pub(crate) fn reduce_scatter(
    round: &Round,
    rank: usize,
    op: ReduceOp,
    axis: usize,
    chunk: usize,
) -> Result<(), usize> {
    scatter_share(round, rank, op, axis, chunk, Inject::Nothing)
}

#[cfg(test)]
pub(crate) fn reduce_scatter_injected(
    round: &Round,
    rank: usize,
    op: ReduceOp,
    axis: usize,
    chunk: usize,
    inject: Inject,
) -> Result<(), usize> {
    scatter_share(round, rank, op, axis, chunk, inject)
}

fn scatter_share(
    round: &Round,
    rank: usize,
    op: ReduceOp,
    axis: usize,
    chunk: usize,
    inject: Inject,
) -> Result<(), usize> {
    share(round, rank, inject, |panic_mid_fold| {
        let outs: Vec<Lent> =
            round.lent.iter().map(|l| l.expect("every member of a direct round lends")).collect();
        let n = outs.len();
        let piece = outs[0].len;
        let chunk = chunk.max(1);
        let units = n * piece.div_ceil(chunk);
        let shape = round[0].shape();
        loop {
            let c = round.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if c >= units {
                break;
            }
            let (k, j) = (c % n, c / n);
            let range = j * chunk..((j + 1) * chunk).min(piece);
            let segments = crate::tensor::piece_segments(shape, axis, n, k, range.clone());
            // SAFETY: facts 1–3 of the module docs, with chunks for regions: chunk `c` is
            // claimed by exactly one member (an atomic `fetch_add`), the chunks of piece `k`
            // partition `0..piece` of buffer `k` and nothing else touches the loans during
            // the round; every loan lives until the countdown `share` feeds reaches zero;
            // and every loan holds `piece` elements of the inputs' dtype (equal shapes
            // and dtypes are part of the checked signature).
            unsafe { fold_chunk(&round[..], outs[k], range, segments, op, panic_mid_fold) };
        }
    })
}

/// Folds `segments` of every input in order into elements `range` of the loan `out`.
///
/// # Safety
/// `out` must be a live, exclusive-to-this-round buffer of at least `range.end`
/// elements of the inputs' dtype, and no other thread may access `range` of it until
/// this returns.
unsafe fn fold_chunk(
    inputs: &[std::sync::Arc<Tensor>],
    out: Lent,
    range: Range<usize>,
    segments: impl Iterator<Item = (usize, usize)>,
    op: ReduceOp,
    panic_mid_fold: bool,
) {
    macro_rules! go {
        ($v:ident, $t:ty) => {{
            let slices: Vec<&[$t]> = inputs
                .iter()
                .map(|p| match &**p {
                    Tensor::$v(x) => x.as_slice().expect("offered in standard layout"),
                    _ => unreachable!("dtypes checked at the rendezvous"),
                })
                .collect();
            // SAFETY: in bounds and exclusive by the caller's contract.
            let out = unsafe {
                std::slice::from_raw_parts_mut(out.ptr.cast::<$t>().add(range.start), range.len())
            };
            crate::tensor::fold_segments(&slices, segments, op, out);
            // A share that fails after writing a chunk of some member's buffer.
            assert!(!panic_mid_fold, "injected: this rank's fold fails half-way");
        }};
    }
    match &*inputs[0] {
        Tensor::F32(_) => go!(F32, f32),
        Tensor::F64(_) => go!(F64, f64),
        Tensor::I32(_) => go!(I32, i32),
        Tensor::I64(_) => go!(I64, i64),
        other => unreachable!("reductions of {} are refused at entry", other.dtype()),
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

    use super::{Inject, Lent, all_reduce_injected, reduce_scatter_injected};
    use crate::Error;
    use crate::hub::{Hub, Offer, ReplicaGroups};
    use meshwork_types::Tensor;

    /// What a member left with: its buffer (its input for an all-reduce, its output
    /// for a reduce-scatter) and the collective's outcome, or the message of its panic.
    type Outcome = std::thread::Result<(Tensor, Result<(), Error>)>;

    /// Member `failing` panicked and every other member got `PeerFailed` naming it.
    fn only_the_failing_member_panicked(outcomes: Vec<Outcome>, failing: usize, op: &'static str) {
        let n = outcomes.len();
        for (r, outcome) in outcomes.into_iter().enumerate() {
            if r == failing {
                assert!(outcome.is_err(), "member {r} of {n} should have panicked");
            } else {
                let (_, result) = outcome.unwrap();
                assert_eq!(
                    result,
                    Err(Error::PeerFailed { failed: failing, replica: r, op }),
                    "member {r} of {n}, member {failing} failing"
                );
            }
        }
    }

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
                only_the_failing_member_panicked(outcomes, failing, "all_reduce");
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

    /// Runs one shared reduce-scatter of `inputs[r]` along `axis` on `n = inputs.len()`
    /// threads in chunks of `chunk` elements, each member lending an output buffer of
    /// garbage (-9). Member `panics` (if any) panics after folding the first chunk it
    /// claims (the others start late, so it claims one), member `odd` (if any) offers
    /// another signature, member `poisons` (if any) fails instead of arriving.
    fn run_scatter(
        inputs: Vec<Tensor>,
        op: ReduceOp,
        axis: usize,
        chunk: usize,
        (panics, odd, poisons): (Option<usize>, Option<usize>, Option<usize>),
    ) -> Vec<Outcome> {
        let n = inputs.len();
        let hub = Arc::new(Hub::new(n, Duration::from_secs(60)));
        let threads: Vec<_> = inputs
            .into_iter()
            .enumerate()
            .map(|(r, t)| {
                let hub = hub.clone();
                std::thread::spawn(move || {
                    let mut shape = t.shape().to_vec();
                    shape[axis] /= n;
                    let len = shape.iter().product();
                    let mut out = Tensor::from_f64(t.dtype(), &shape, &vec![-9.0; len]).unwrap();
                    assert_eq!(out.len(), len);
                    if poisons == Some(r) {
                        hub.poison(r);
                        return (out, Err(Error::ReplicaFailed { replica: r, message: "".into() }));
                    }
                    let signature = if odd == Some(r) { "other" } else { "same" };
                    let offer = Offer {
                        op: "reduce_scatter",
                        signature: format!("{signature} {:?}", t.shape()),
                        tensor: Arc::new(t),
                        lent: Some(Lent::of(&mut out)),
                    };
                    let result = hub.exchange(&ReplicaGroups::all(n), r, offer).and_then(|round| {
                        let inject = match panics {
                            Some(p) if p == r => Inject::PanicMidFold,
                            Some(_) => Inject::SlowFold(20),
                            None => Inject::Nothing,
                        };
                        reduce_scatter_injected(&round, r, op, axis, chunk, inject).map_err(|k| {
                            Error::PeerFailed { failed: k, replica: r, op: "reduce_scatter" }
                        })
                    });
                    // `out` is dropped here when the share above panicked: only after
                    // every peer is done with it.
                    (out, result)
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join()).collect()
    }

    /// Piece `k` of `n` along `axis` of each input, folded in order: the sequential model.
    fn model_piece(inputs: &[Tensor], axis: usize, k: usize, op: ReduceOp) -> Vec<f64> {
        let n = inputs.len();
        let pieces: Vec<Vec<f64>> = inputs
            .iter()
            .map(|t| {
                let a = ArrayD::from_shape_vec(IxDyn(t.shape()), t.to_f64()).unwrap();
                let w = a.shape()[axis] / n;
                a.slice_axis(ndarray::Axis(axis), ndarray::Slice::from(k * w..(k + 1) * w))
                    .iter()
                    .copied()
                    .collect()
            })
            .collect();
        (0..pieces[0].len())
            .map(|i| {
                let x = pieces.iter().map(|p| p[i]);
                match op {
                    ReduceOp::Sum => x.sum(),
                    ReduceOp::Mean => x.sum::<f64>() / n as f64,
                    ReduceOp::Min => x.fold(f64::INFINITY, f64::min),
                    ReduceOp::Max => x.fold(f64::NEG_INFINITY, f64::max),
                }
            })
            .collect()
    }

    fn values(t: &Tensor) -> Vec<f64> {
        t.to_f64()
    }

    /// Three members, pieces of two rows of a 3-wide run along axis 1 and along axis
    /// 0, chunks of 1 to 7 elements (chunks that end mid-run): every member's buffer
    /// holds its piece of the rank-order fold, whoever folded its chunks.
    #[test]
    fn members_share_a_reduce_scatters_chunks() {
        let n = 3;
        let input = |r: usize| {
            let v: Vec<f64> = (0..18).map(|i| (r * 100 + i) as f64 * 0.25).collect();
            Tensor::F64(ArrayD::from_shape_vec(IxDyn(&[2, 9]), v).unwrap())
        };
        let inputs: Vec<Tensor> = (0..n).map(input).collect();
        for (axis, chunk) in [(1, 1), (1, 4), (0, 7), (1, 7)] {
            if axis == 0 {
                // Two rows do not split three ways: use the transpose's shape instead.
                let t: Vec<Tensor> = inputs
                    .iter()
                    .map(|t| match t {
                        Tensor::F64(a) => {
                            Tensor::F64(a.t().as_standard_layout().into_owned().into_dyn())
                        }
                        _ => unreachable!(),
                    })
                    .collect();
                for (k, o) in run_scatter(t.clone(), ReduceOp::Sum, 0, chunk, (None, None, None))
                    .into_iter()
                    .enumerate()
                {
                    let (out, result) = o.unwrap();
                    result.unwrap();
                    assert_eq!(values(&out), model_piece(&t, 0, k, ReduceOp::Sum), "chunk {chunk}");
                }
                continue;
            }
            for (k, o) in
                run_scatter(inputs.clone(), ReduceOp::Max, axis, chunk, (None, None, None))
                    .into_iter()
                    .enumerate()
            {
                let (out, result) = o.unwrap();
                result.unwrap();
                assert_eq!(out.shape(), &[2, 3]);
                assert_eq!(
                    values(&out),
                    model_piece(&inputs, axis, k, ReduceOp::Max),
                    "chunk {chunk}"
                );
            }
        }
    }

    /// A member whose share panics after writing a chunk (of some member's buffer)
    /// unwinds and frees its own buffer only once the others are done with it — Miri
    /// reports a data race or a use after free otherwise — and every other member gets
    /// an error naming it. With 2 and 3 members, the failing one first, in the middle
    /// and last.
    #[test]
    fn a_member_panicking_mid_scatter_frees_its_buffer_only_after_the_others() {
        for n in [2, 3] {
            for failing in 0..n {
                let inputs = (0..n).map(|r| f32s(r, 12)).collect();
                let outcomes =
                    run_scatter(inputs, ReduceOp::Sum, 0, 1, (Some(failing), None, None));
                only_the_failing_member_panicked(outcomes, failing, "reduce_scatter");
            }
        }
    }

    /// A member that errors at the rendezvous or fails before it: no loans are
    /// published, every member gets an error and every output buffer is as it was lent.
    #[test]
    fn a_member_erroring_before_a_scatter_publishes_no_loans() {
        for n in [2, 3] {
            for (odd, poisons) in [(Some(n - 1), None), (None, Some(0)), (None, Some(n - 1))] {
                let inputs = (0..n).map(|r| f32s(r, 6)).collect();
                for (r, outcome) in run_scatter(inputs, ReduceOp::Sum, 0, 1, (None, odd, poisons))
                    .into_iter()
                    .enumerate()
                {
                    let (out, result) = outcome.unwrap();
                    assert!(result.is_err(), "member {r} of {n} ({odd:?}, {poisons:?})");
                    assert!(values(&out).iter().all(|&x| x == -9.0), "member {r}'s buffer changed");
                }
            }
        }
    }

    #[cfg(not(miri))]
    mod props {
        use super::*;
        use proptest::prelude::*;

        /// Members, a shape whose `axis` splits into them, chunk size, dtype, op and values.
        fn case() -> impl Strategy<Value = (Vec<Tensor>, usize, usize, ReduceOp)> {
            (
                1usize..=5,
                1usize..=3,
                1usize..=12,
                0usize..4,
                prop::sample::select(ReduceOp::ALL.to_vec()),
            )
                .prop_flat_map(|(n, rank, chunk, dtype, op)| {
                    (prop::collection::vec(1usize..=4, rank), 0..rank).prop_flat_map(
                        move |(mut shape, axis)| {
                            shape[axis] *= n;
                            let len: usize = shape.iter().product();
                            prop::collection::vec(prop::collection::vec(-50i32..50, len), n)
                                .prop_map(move |vals| {
                                    let inputs = vals
                                        .into_iter()
                                        .map(|v| {
                                            let d = IxDyn(&shape);
                                            match dtype {
                                                0 => Tensor::F32(
                                                    ArrayD::from_shape_vec(
                                                        d,
                                                        v.iter()
                                                            .map(|&x| x as f32 * 0.37)
                                                            .collect(),
                                                    )
                                                    .unwrap(),
                                                ),
                                                1 => Tensor::F64(
                                                    ArrayD::from_shape_vec(
                                                        d,
                                                        v.iter()
                                                            .map(|&x| f64::from(x) * 0.37)
                                                            .collect(),
                                                    )
                                                    .unwrap(),
                                                ),
                                                2 => Tensor::I32(
                                                    ArrayD::from_shape_vec(d, v).unwrap(),
                                                ),
                                                _ => Tensor::I64(
                                                    ArrayD::from_shape_vec(
                                                        d,
                                                        v.iter().map(|&x| i64::from(x)).collect(),
                                                    )
                                                    .unwrap(),
                                                ),
                                            }
                                        })
                                        .collect();
                                    (inputs, axis, chunk, op)
                                })
                        },
                    )
                })
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

            /// Whatever the chunking (chunks of 1 element up to more than a piece, ending
            /// mid-run or not), each member's buffer holds its piece of the rank-order
            /// fold — for integers exactly; for floats within the rounding of an order
            /// of the same adds (a model in f64).
            #[test]
            fn shared_chunks_give_every_piece((inputs, axis, chunk, op) in case()) {
                let n = inputs.len();
                let single = matches!(inputs[0], Tensor::F32(_));
                let int = matches!(inputs[0], Tensor::I32(_) | Tensor::I64(_));
                for (k, o) in run_scatter(inputs.clone(), op, axis, chunk, (None, None, None)).into_iter().enumerate() {
                    let (out, result) = o.unwrap();
                    prop_assert!(result.is_ok());
                    let want = model_piece(&inputs, axis, k, op);
                    let got = values(&out);
                    prop_assert_eq!(got.len(), want.len());
                    for (&g, &w) in got.iter().zip(&want) {
                        if single {
                            // The model adds in f64, the fold in f32.
                            prop_assert!((g - w).abs() <= 1e-4 * (1.0 + w.abs()), "{} vs {}", g, w);
                        } else if int && op == ReduceOp::Mean {
                            // An integer mean truncates the sum's quotient toward zero.
                            let sum = (w * n as f64).round() as i64;
                            prop_assert_eq!(g, (sum / n as i64) as f64);
                        } else {
                            // f64 in the model's order, or integers: exact.
                            prop_assert_eq!(g, w);
                        }
                    }
                }
            }
        }
    }
}
