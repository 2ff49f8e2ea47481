//! Per-device buffer pools: the memory a training loop's collectives give back, kept
//! for the next collective that needs a buffer of the same dtype and length.
//!
//! A large result in fresh memory costs more than the collective itself: every page is
//! faulted in and zeroed by the kernel (an 8 × 64 MiB all-gather writes 4 GiB of fresh
//! pages, about six times the copy). Like PyTorch's caching allocator and XLA's
//! buffer donation, each device keeps what it was given back — inputs a collective
//! consumed (held last by it), and tensors a program or the host
//! [recycles](crate::ReplicaContext::recycle) — and the plain collectives write their
//! results into a kept buffer of the right dtype and length when there is one. In an
//! FSDP step the cycle closes by itself: a reduce-scatter consumes a full-size gradient
//! buffer and the next all-gather of that size writes into it.
//!
//! A pool holds at most its capacity in bytes (oldest buffers go first, freed off the
//! caller's path by the reaper) and only buffers of at least its smallest size (small
//! ones are cheap to allocate). A consumed input is kept only if a collective on the
//! device recently asked for a buffer of its dtype and length (one of the last
//! [`WANTS`] kinds asked for): a loop of reduce-scatters, whose results are smaller
//! than their inputs, keeps nothing, while an all-to-all's input is next step's
//! result buffer. A buffer recycled on purpose is kept whatever its kind. A buffer's
//! old contents are never read: a collective overwrites every element of the buffer
//! it takes.

use std::collections::VecDeque;

use meshwork_types::DType;

use crate::sync::{Mutex, MutexGuard};
use crate::tensor::TensorOps;
use meshwork_types::Tensor;

/// Bytes per element of a tensor dtype.
fn width(dtype: DType) -> usize {
    match dtype {
        DType::F64 | DType::I64 => 8,
        _ => 4,
    }
}

/// Bytes a tensor's elements take.
pub(crate) fn bytes(t: &Tensor) -> usize {
    t.len() * width(t.dtype())
}

/// What a pool may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    /// The most bytes kept at once.
    pub(crate) capacity: usize,
    /// Buffers smaller than this are not kept.
    pub(crate) smallest: usize,
}

impl Limits {
    /// 1 GiB per device of buffers of 1 MiB or more.
    pub(crate) const DEFAULT: Limits = Limits { capacity: 1 << 30, smallest: 1 << 20 };
}

/// How many kinds (dtype, length) of recent requests a pool remembers.
pub(crate) const WANTS: usize = 16;

/// One device's kept buffers, oldest first.
pub(crate) struct Pool {
    state: Mutex<State>,
}

struct State {
    limits: Limits,
    buffers: VecDeque<Tensor>,
    bytes: usize,
    /// The kinds of the last requests, least recent first, each once.
    wants: VecDeque<(DType, usize)>,
    /// Requests of a size the pool keeps that it had no buffer for.
    misses: usize,
}

impl Pool {
    pub(crate) fn new(limits: Limits) -> Pool {
        let state =
            State { limits, buffers: VecDeque::new(), bytes: 0, wants: VecDeque::new(), misses: 0 };
        Pool { state: Mutex::new(state) }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Changes the limits, letting go of what no longer fits.
    pub(crate) fn set_limits(&self, limits: Limits) {
        let mut st = self.lock();
        st.limits = limits;
        let evicted = st.fit(limits.capacity);
        drop(st);
        release(evicted);
    }

    /// Keeps `t`'s buffer if it is standard layout and within the limits; evicts the
    /// oldest buffers to make room. What is not kept is freed (see [`release`]).
    pub(crate) fn put(&self, t: Tensor) {
        let mut garbage = Vec::new();
        self.keep(t, false, &mut garbage);
        release(garbage);
    }

    /// [`put`](Self::put) for an input a collective consumed: kept only if a buffer of
    /// its kind was asked for recently. What is not kept (`t`, or older buffers it
    /// evicts) goes into `garbage`, for the caller to free in one hand-off with the
    /// rest of a round's.
    pub(crate) fn put_consumed(&self, t: Tensor, garbage: &mut Vec<Tensor>) {
        self.keep(t, true, garbage);
    }

    fn keep(&self, t: Tensor, only_wanted: bool, garbage: &mut Vec<Tensor>) {
        // A slice of a larger owned array holds the whole allocation: counting its
        // elements would understate what the pool keeps.
        let t = match exact(t) {
            Ok(t) => t,
            Err(whole) => {
                garbage.push(whole);
                return;
            }
        };
        let size = bytes(&t);
        let mut st = self.lock();
        let unwanted = only_wanted && !st.wants.contains(&(t.dtype(), t.len()));
        if unwanted
            || size < st.limits.smallest
            || size > st.limits.capacity
            || size == 0
            || !standard(&t)
        {
            drop(st);
            garbage.push(t);
            return;
        }
        let room = st.limits.capacity - size;
        garbage.extend(st.fit(room));
        st.bytes += size;
        st.buffers.push_back(t);
    }

    /// A kept buffer of `dtype` with as many elements as `shape`, reshaped to it (the
    /// most recently kept of those that match); its elements are stale.
    pub(crate) fn take(&self, dtype: DType, shape: &[usize]) -> Option<Tensor> {
        let len: usize = shape.iter().product();
        let mut st = self.lock();
        if let Some(k) = st.wants.iter().position(|&w| w == (dtype, len)) {
            st.wants.remove(k);
        } else if st.wants.len() == WANTS {
            st.wants.pop_front();
        }
        st.wants.push_back((dtype, len));
        let Some(at) = st.buffers.iter().rposition(|b| b.dtype() == dtype && b.len() == len) else {
            let size = len * width(dtype);
            if size > 0 && size >= st.limits.smallest && size <= st.limits.capacity {
                st.misses += 1;
            }
            return None;
        };
        let t = st.buffers.remove(at).expect("found");
        st.bytes -= bytes(&t);
        drop(st);
        Some(t.reshaped(shape))
    }

    /// A kept buffer of `dtype` with `len` elements, if the pool has one, without
    /// counting a request: for moving a spare between pools, which asks for no memory.
    pub(crate) fn take_spare(&self, dtype: DType, len: usize) -> Option<Tensor> {
        let mut st = self.lock();
        let at = st.buffers.iter().rposition(|b| b.dtype() == dtype && b.len() == len)?;
        let t = st.buffers.remove(at).expect("found");
        st.bytes -= bytes(&t);
        Some(t)
    }

    /// Bytes kept now.
    pub(crate) fn bytes(&self) -> usize {
        self.lock().bytes
    }

    /// Requests of a size this pool keeps that it had no buffer for, so far.
    pub(crate) fn misses(&self) -> usize {
        self.lock().misses
    }

    /// Lets go of every kept buffer (freed, see [`release`]).
    pub(crate) fn clear(&self) {
        let evicted = self.lock().fit(0);
        release(evicted);
    }
}

impl State {
    /// Evicts the oldest buffers until at most `room` bytes are kept; returns them.
    fn fit(&mut self, room: usize) -> Vec<Tensor> {
        let mut evicted = Vec::new();
        while self.bytes > room {
            let t = self.buffers.pop_front().expect("bytes are held by buffers");
            self.bytes -= bytes(&t);
            evicted.push(t);
        }
        evicted
    }
}

/// Frees `garbage` on the reaper, in one hand-off (none if it is empty: the reaper's
/// queue is short, and a caller that finds it full frees inline) — or here if it holds
/// less than [`REAP_FROM`] bytes, which frees faster than waking the reaper would.
pub(crate) fn release(garbage: Vec<Tensor>) {
    // Sized by allocation: a slice of a larger array frees all of it.
    let garbage: Vec<Tensor> =
        garbage.into_iter().map(|t| exact(t).unwrap_or_else(|w| w)).collect();
    if garbage.iter().map(bytes).sum::<usize>() >= REAP_FROM {
        crate::reaper::release(garbage);
    }
}

/// The least garbage worth the reaper: freeing less costs less than a thread's wake-up
/// (a small collective's consumed inputs would otherwise wake it every call).
pub(crate) const REAP_FROM: usize = 1 << 20;

/// `t` itself if its allocation holds just its elements (in standard layout from the
/// start), else its whole allocation as a 1-D tensor, to be freed.
fn exact(t: Tensor) -> Result<Tensor, Tensor> {
    macro_rules! go {
        ($v:ident, $a:ident) => {{
            let shape = $a.shape().to_vec();
            let (len, standard) = ($a.len(), $a.is_standard_layout());
            let (vec, offset) = $a.into_raw_vec_and_offset();
            if standard && vec.len() == len && offset.unwrap_or(0) == 0 {
                Ok(Tensor::$v(
                    ndarray::ArrayD::from_shape_vec(ndarray::IxDyn(&shape), vec)
                        .expect("the elements of the shape"),
                ))
            } else {
                Err(Tensor::$v(ndarray::Array1::from(vec).into_dyn()))
            }
        }};
    }
    crate::tensor::every!(t, a => go)
}

fn standard(t: &Tensor) -> bool {
    t.is_standard_layout()
}

// Under `--cfg shuttle` the pool's lock is shuttle's, usable only inside a model run.
#[cfg(all(test, not(shuttle)))]
mod tests {
    use meshwork_types::DType;
    use ndarray::{ArrayD, IxDyn};
    use proptest::prelude::*;

    use super::{Limits, Pool, bytes};
    use meshwork_types::Tensor;

    fn f32s(len: usize, tag: f32) -> Tensor {
        Tensor::F32(ArrayD::from_elem(IxDyn(&[len]), tag))
    }
    fn i64s(len: usize, tag: i64) -> Tensor {
        Tensor::I64(ArrayD::from_elem(IxDyn(&[len]), tag))
    }

    /// What the pool should hold: (dtype is f32, len, tag) oldest first.
    #[derive(Default)]
    struct Model {
        kept: Vec<(bool, usize, i64)>,
        /// Kinds asked for, every request in order.
        asked: Vec<(bool, usize)>,
    }

    impl Model {
        fn size(&(f, len, _): &(bool, usize, i64)) -> usize {
            len * if f { 4 } else { 8 }
        }
        fn bytes(&self) -> usize {
            self.kept.iter().map(Model::size).sum()
        }
        fn put(&mut self, b: (bool, usize, i64), limits: Limits, consumed: bool) {
            let size = Model::size(&b);
            if size == 0 || size < limits.smallest || size > limits.capacity {
                return;
            }
            // Among the last WANTS distinct kinds asked for?
            let mut recent: Vec<(bool, usize)> = Vec::new();
            for &k in self.asked.iter().rev() {
                if !recent.contains(&k) {
                    recent.push(k);
                }
            }
            recent.truncate(super::WANTS);
            if consumed && !recent.contains(&(b.0, b.1)) {
                return;
            }
            while self.bytes() + size > limits.capacity {
                self.kept.remove(0);
            }
            self.kept.push(b);
        }
        fn take(&mut self, f: bool, len: usize) -> Option<(bool, usize, i64)> {
            self.asked.push((f, len));
            let at = self.kept.iter().rposition(|&(g, l, _)| g == f && l == len)?;
            Some(self.kept.remove(at))
        }
    }

    #[derive(Debug, Clone)]
    enum Step {
        Put { f32: bool, len: usize, consumed: bool },
        Take { f32: bool, len: usize },
    }

    fn step() -> impl Strategy<Value = Step> {
        // Up to 40 kinds, more than a pool remembers.
        prop_oneof![
            (any::<bool>(), 0usize..20, any::<bool>()).prop_map(|(f32, k, consumed)| Step::Put {
                f32,
                len: k * 8,
                consumed
            }),
            (any::<bool>(), 0usize..20).prop_map(|(f32, k)| Step::Take { f32, len: k * 8 }),
        ]
    }

    proptest! {
        /// Against a model (a FIFO of buffers under a byte cap, taken most recent
        /// first by exact dtype and length; a consumed input kept only if its kind is
        /// among the last kinds asked for): every take returns the model's buffer
        /// (told apart by its contents), the bytes kept never pass the capacity, and
        /// nothing is kept twice or invented.
        #[test]
        fn the_pool_keeps_what_the_model_keeps(
            steps in prop::collection::vec(step(), 0..120),
            capacity in 0usize..1200,
            smallest in 0usize..64,
        ) {
            let limits = Limits { capacity, smallest };
            let pool = Pool::new(limits);
            let mut model = Model::default();
            for (i, s) in steps.into_iter().enumerate() {
                let tag = i as i64;
                match s {
                    Step::Put { f32, len, consumed } => {
                        let t = if f32 { f32s(len, tag as f32) } else { i64s(len, tag) };
                        if consumed { pool.put_consumed(t, &mut Vec::new()) } else { pool.put(t) }
                        model.put((f32, len, tag), limits, consumed);
                    }
                    Step::Take { f32, len } => {
                        let dtype = if f32 { DType::F32 } else { DType::I64 };
                        let got = pool.take(dtype, &[len]).map(|t| {
                            let tag = match &t {
                                Tensor::F32(a) => a.iter().next().map_or(-1, |&v| v as i64),
                                Tensor::I64(a) => a.iter().next().copied().unwrap_or(-1),
                                _ => unreachable!(),
                            };
                            (f32, t.len(), tag)
                        });
                        prop_assert_eq!(got, model.take(f32, len));
                    }
                }
                prop_assert_eq!(pool.bytes(), model.bytes());
                prop_assert!(pool.bytes() <= capacity);
            }
        }
    }

    /// A taken buffer comes back in the shape asked for; an unknown length gives none.
    #[test]
    fn take_reshapes_and_needs_an_exact_length() {
        let pool = Pool::new(Limits { capacity: 1 << 20, smallest: 0 });
        pool.put(f32s(12, 1.0));
        assert!(pool.take(DType::F32, &[5, 2]).is_none());
        assert!(pool.take(DType::I64, &[12]).is_none());
        let t = pool.take(DType::F32, &[3, 4]).unwrap();
        assert_eq!(t.shape(), &[3, 4]);
        assert_eq!(bytes(&t), 48);
        assert_eq!(pool.bytes(), 0);
        pool.put(t);
        pool.clear();
        assert_eq!(pool.bytes(), 0);
    }

    /// A slice of a larger owned array (standard layout, but holding the whole
    /// allocation it was cut from) is not kept, so the pool's count of bytes is what it
    /// holds; the same elements in an allocation of their own are.
    #[test]
    fn a_slice_of_a_larger_allocation_is_not_kept() {
        let pool = Pool::new(Limits { capacity: 1 << 20, smallest: 0 });
        let whole = ArrayD::from_elem(IxDyn(&[4, 8]), 1.0f32);
        for rows in [0..2, 2..4, 1..3] {
            let sliced = whole.clone().slice_move(ndarray::s![rows, ..]).into_dyn();
            assert!(sliced.is_standard_layout());
            pool.put(Tensor::F32(sliced));
            assert_eq!(pool.bytes(), 0);
            assert!(pool.take(DType::F32, &[16]).is_none());
        }
        pool.put(f32s(16, 2.0));
        assert_eq!(pool.bytes(), 64);
        assert_eq!(pool.take(DType::F32, &[2, 8]).map(|t| t.shape().to_vec()), Some(vec![2, 8]));
    }
}
