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
//!    cannot be poisoned and never times out, and a member counts itself done even
//!    when it unwinds, so a failure elsewhere can neither free a buffer early nor hang.
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

/// Counts this member done when dropped, on return or on unwind alike.
struct Done<'a>(&'a Round);

impl Drop for Done<'_> {
    fn drop(&mut self) {
        self.0.working.done();
    }
}

/// Rank `rank`'s share of the all-reduce over the buffers of `dtype` lent in `round`,
/// then the wait for everyone's share. On return the member's own buffer holds the
/// full result.
pub(crate) fn all_reduce(round: &Round, rank: usize, dtype: DType, op: ReduceOp) {
    let lent: Vec<Lent> =
        round.lent.iter().map(|l| l.expect("every member of a direct round lends")).collect();
    let n = lent.len();
    let len = lent[0].len;
    let region = rank * len / n..(rank + 1) * len / n;
    {
        let _done = Done(round);
        // SAFETY: facts 1–3 of the module docs: this rank alone touches `region` of
        // each buffer, every buffer lives until the countdown this guard feeds reaches
        // zero, and all buffers hold `len` elements of `dtype`.
        unsafe {
            match dtype {
                DType::F32 => fold_region::<f32>(&lent, region, op),
                DType::F64 => fold_region::<f64>(&lent, region, op),
                DType::I32 => fold_region::<i32>(&lent, region, op),
                DType::I64 => fold_region::<i64>(&lent, region, op),
                other => unreachable!("tensors of {other} do not exist"),
            }
        }
    }
    round.working.wait();
}

/// Folds `region` of every lent buffer in order and writes the result into `region` of
/// every buffer, block by block so a block's inputs and result stay in cache.
///
/// # Safety
/// Every loan must be a live, exclusive-to-this-round buffer of at least
/// `region.end` elements of `T`, and no other thread may access `region` of any of
/// them until this returns.
unsafe fn fold_region<T: Element>(lent: &[Lent], region: Range<usize>, op: ReduceOp) {
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
                    acc.iter_mut().zip(src.iter()).for_each(|(a, &x)| *a = *a + x)
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
        for l in lent {
            block(l).copy_from_slice(&acc);
        }
    }
}

#[cfg(test)]
mod tests {
    //! Small enough for Miri (`cargo +nightly miri test -p meshwork-executor --lib
    //! direct`), which checks the loans for data races and dangling accesses.

    use std::sync::Arc;
    use std::time::Duration;

    use meshwork_types::{DType, ReduceOp};
    use ndarray::{ArrayD, IxDyn};

    use super::{Lent, all_reduce};
    use crate::hub::{Hub, Offer, ReplicaGroups};
    use crate::tensor::Tensor;

    /// Three members lend buffers of 7 elements (regions of 2, 2 and 3); every member
    /// ends with the rank-order sum, and a member that returns right after its share
    /// (as a failing one would) still cannot free its buffer under the others.
    #[test]
    fn members_fold_each_others_regions() {
        let n = 3;
        let hub = Arc::new(Hub::new(n, Duration::from_secs(60)));
        let threads: Vec<_> = (0..n)
            .map(|r| {
                let hub = hub.clone();
                std::thread::spawn(move || {
                    let v: Vec<f32> = (0..7).map(|i| (r * 10 + i) as f32 * 0.5).collect();
                    let mut t = Tensor::F32(ArrayD::from_shape_vec(IxDyn(&[7]), v).unwrap());
                    let offer = Offer {
                        op: "all_reduce",
                        signature: "f32[7]".into(),
                        tensor: Arc::new(Tensor::I32(ArrayD::zeros(IxDyn(&[0])))),
                        lent: Some(Lent::of(&mut t)),
                    };
                    let round = hub.exchange(&ReplicaGroups::all(n), r, offer).unwrap();
                    all_reduce(&round, r, DType::F32, ReduceOp::Sum);
                    drop(round);
                    t
                })
            })
            .collect();
        let want: Vec<f32> =
            (0..7).map(|i| (0..n).fold(0.0f32, |acc, r| acc + (r * 10 + i) as f32 * 0.5)).collect();
        for t in threads {
            match t.join().unwrap() {
                Tensor::F32(a) => assert_eq!(a.iter().copied().collect::<Vec<_>>(), want),
                other => panic!("{other:?}"),
            }
        }
    }
}
