//! What the collectives do with host tensors (`meshwork_types::Tensor`): the
//! element-wise reductions, the copies between pieces and runs, and a zeroed
//! allocation that fails instead of aborting.

use meshwork_types::{DType, Element as _, ReduceOp, Tensor};
use ndarray::{ArrayD, Axis, IxDyn};

use crate::{Error, Result};

/// Runs `$go!(Variant, array)` on the array inside a tensor of one of the dtypes the
/// collectives carry (f32, f64, i32, i64; every public collective checks its input's
/// dtype first, so another one here is a broken invariant).
macro_rules! numeric {
    ($t:expr, $o:ident => $go:ident) => {
        match $t {
            Tensor::F32($o) => $go!(F32, $o),
            Tensor::F64($o) => $go!(F64, $o),
            Tensor::I32($o) => $go!(I32, $o),
            Tensor::I64($o) => $go!(I64, $o),
            other => unreachable!(
                "collectives carry f32, f64, i32 and i64 (checked at entry), not {}",
                other.dtype()
            ),
        }
    };
}
pub(crate) use numeric;

/// Runs `$go!(Variant, array)` on the array inside a tensor of any dtype.
macro_rules! every {
    ($t:expr, $o:ident => $go:ident) => {
        match $t {
            Tensor::Bool($o) => $go!(Bool, $o),
            Tensor::U8($o) => $go!(U8, $o),
            Tensor::U16($o) => $go!(U16, $o),
            Tensor::U32($o) => $go!(U32, $o),
            Tensor::U64($o) => $go!(U64, $o),
            Tensor::I8($o) => $go!(I8, $o),
            Tensor::I16($o) => $go!(I16, $o),
            Tensor::I32($o) => $go!(I32, $o),
            Tensor::I64($o) => $go!(I64, $o),
            Tensor::F16($o) => $go!(F16, $o),
            Tensor::BF16($o) => $go!(BF16, $o),
            Tensor::F32($o) => $go!(F32, $o),
            Tensor::F64($o) => $go!(F64, $o),
        }
    };
}
pub(crate) use every;

/// Applies `$body` to the array in a tensor of a collective's dtype, re-wrapping a
/// returned array.
macro_rules! map {
    ($t:expr, $a:ident => $body:expr) => {{
        macro_rules! go {
            ($v:ident, $x:ident) => {{
                let $a = $x;
                Tensor::$v($body)
            }};
        }
        numeric!($t, x => go)
    }};
}

/// Applies `$body` to the array in a tensor of a collective's dtype.
macro_rules! each {
    ($t:expr, $a:ident => $body:expr) => {{
        macro_rules! go {
            ($v:ident, $x:ident) => {{
                let $a = $x;
                $body
            }};
        }
        numeric!($t, x => go)
    }};
}

/// Whether collectives carry `dtype`: f32, f64, i32 and i64.
pub(crate) fn carried(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F64 | DType::I32 | DType::I64)
}

/// Element types with the four reductions.
pub(crate) trait Element: Copy + PartialOrd {
    /// The sum reductions use: IEEE addition for floats, two's-complement wrapping
    /// addition for integers (as XLA's integer `add`), so an overflowing integer
    /// all-reduce gives the same wrapped result on every replica in every build
    /// profile instead of a debug-build panic.
    fn add(a: Self, b: Self) -> Self;
    fn mean(sum: Self, n: usize) -> Self;
    fn min(a: Self, b: Self) -> Self {
        if b < a { b } else { a }
    }
    fn max(a: Self, b: Self) -> Self {
        if b > a { b } else { a }
    }
}

/// The mean is the sum divided by the count in the element type (integers truncate
/// toward zero).
macro_rules! float_element {
    ($($t:ty),*) => {$(
        impl Element for $t {
            fn add(a: $t, b: $t) -> $t {
                a + b
            }
            fn mean(sum: $t, n: usize) -> $t {
                sum / n as $t
            }
        }
    )*};
}

macro_rules! int_element {
    ($($t:ty),*) => {$(
        impl Element for $t {
            fn add(a: $t, b: $t) -> $t {
                a.wrapping_add(b)
            }
            fn mean(sum: $t, n: usize) -> $t {
                // A replica count beyond the type's range divides to zero.
                <$t>::try_from(n).map_or(0, |n| sum.wrapping_div(n))
            }
        }
    )*};
}

float_element!(f32, f64);
int_element!(i32, i64);

/// Elements per block of a fold: a block's inputs and result stay in cache, so each
/// input element is read once and each result element written once (a pass per input
/// over the whole output would read and write it `inputs.len()` times).
const BLOCK: usize = 4096;

/// For each segment `(at, len)`: the next `len` elements of `out` are
/// `inputs[0][at..] ∘ inputs[1][at..] ∘ ...` in input order, then divided by the input
/// count for a mean. Every input is read once and `out` written once (block by block,
/// see [`FOLD_BLOCK_BYTES`]), so the fold costs no more memory traffic than reading its
/// inputs. The segments' lengths must add up to at most `out.len()`.
pub(crate) fn fold_segments<T: Element>(
    inputs: &[&[T]],
    segments: impl Iterator<Item = (usize, usize)>,
    op: ReduceOp,
    out: &mut [T],
) {
    match op {
        ReduceOp::Sum => segments_with(inputs, segments, out, T::add, None),
        ReduceOp::Mean => segments_with(inputs, segments, out, T::add, Some(inputs.len())),
        ReduceOp::Min => segments_with(inputs, segments, out, T::min, None),
        ReduceOp::Max => segments_with(inputs, segments, out, T::max, None),
    }
}

#[inline(always)]
fn segments_with<T: Element>(
    inputs: &[&[T]],
    segments: impl Iterator<Item = (usize, usize)>,
    mut out: &mut [T],
    f: impl Fn(T, T) -> T + Copy,
    mean_of: Option<usize>,
) {
    let (first, others) = inputs.split_first().expect("at least one input");
    let mut rest: Vec<&[T]> = Vec::with_capacity(others.len());
    for (at, len) in segments {
        let (this, tail) = std::mem::take(&mut out).split_at_mut(len);
        out = tail;
        rest.clear();
        rest.extend(others.iter().map(|i| &i[at..at + len]));
        blocks(&first[at..at + len], &rest, this, f, mean_of);
    }
}

/// The segments of the inputs that elements `range` of piece `k` of `n` equal pieces
/// along `axis` of a standard-layout `shape` come from, as `(at, len)` in the piece's
/// row-major order (for [`fold_segments`]).
pub(crate) fn piece_segments(
    shape: &[usize],
    axis: usize,
    n: usize,
    k: usize,
    range: std::ops::Range<usize>,
) -> impl Iterator<Item = (usize, usize)> {
    let (run, first, stride) = piece_runs(shape, axis, n, k);
    let rows = if range.is_empty() || run == 0 {
        0..0
    } else {
        range.start / run..range.end.div_ceil(run)
    };
    rows.map(move |o| {
        let lo = range.start.max(o * run);
        let hi = range.end.min((o + 1) * run);
        (first + o * stride + lo - o * run, hi - lo)
    })
}

/// Bytes of every input folded at once by [`fold_segments`]: one page. Each input is
/// read in bursts of a page, one or two inputs at a time (so DRAM rows stay open and a
/// prefetch stream or two run ahead, where streaming every input side by side thrashes
/// them), into a block of the result that stays in L1. From memory this is 10–20%
/// faster than folding all inputs side by side in registers; from cache it is as fast.
const FOLD_BLOCK_BYTES: usize = 4096;

#[inline(always)]
fn blocks<T: Element>(
    first: &[T],
    rest: &[&[T]],
    out: &mut [T],
    f: impl Fn(T, T) -> T + Copy,
    mean_of: Option<usize>,
) {
    let block = (FOLD_BLOCK_BYTES / size_of::<T>()).max(1);
    let len = out.len();
    for start in (0..len).step_by(block) {
        let end = (start + block).min(len);
        let o = &mut out[start..end];
        o.copy_from_slice(&first[start..end]);
        // Two inputs per pass, in input order: ((o ∘ x) ∘ y), as one by one.
        let mut pairs = rest.chunks_exact(2);
        for pair in &mut pairs {
            let (x, y) = (&pair[0][start..end], &pair[1][start..end]);
            for ((a, &x), &y) in o.iter_mut().zip(x).zip(y) {
                *a = f(f(*a, x), y);
            }
        }
        if let [x] = pairs.remainder() {
            for (a, &x) in o.iter_mut().zip(&x[start..end]) {
                *a = f(*a, x);
            }
        }
        if let Some(n) = mean_of {
            o.iter_mut().for_each(|a| *a = T::mean(*a, n));
        }
    }
}

/// Where piece `k` of `n` along `axis` of a standard-layout `shape` lies: runs of
/// `run` contiguous elements (as many as the dims before `axis` hold), the first at
/// `first` and each next `stride` after the one before.
fn piece_runs(shape: &[usize], axis: usize, n: usize, k: usize) -> (usize, usize, usize) {
    let inner: usize = shape[axis + 1..].iter().product();
    let run = shape[axis] / n * inner;
    (run, k * run, shape[axis] * inner)
}

/// `own[i] = src_0[i] ∘ src_1[i] ∘ ...` over `sources` sources in order, where source
/// `me` is `own` itself and the others are `others`' consecutive runs of `own.len()`. Works in
/// blocks that stay in cache, so each source is read once and `own` written once.
fn fold_into<T: Element>(own: &mut [T], others: &[T], me: usize, sources: usize, op: ReduceOp) {
    let len = own.len();
    let mut acc: Vec<T> = Vec::with_capacity(BLOCK.min(len));
    for start in (0..len).step_by(BLOCK) {
        let end = (start + BLOCK).min(len);
        acc.clear();
        for q in 0..sources {
            let block: &[T] = if q == me {
                &own[start..end]
            } else {
                let k = if q < me { q } else { q - 1 };
                &others[k * len + start..k * len + end]
            };
            if q == 0 {
                acc.extend_from_slice(block);
                continue;
            }
            match op {
                ReduceOp::Sum | ReduceOp::Mean => {
                    acc.iter_mut().zip(block).for_each(|(a, &x)| *a = T::add(*a, x))
                }
                ReduceOp::Min => acc.iter_mut().zip(block).for_each(|(a, &x)| *a = T::min(*a, x)),
                ReduceOp::Max => acc.iter_mut().zip(block).for_each(|(a, &x)| *a = T::max(*a, x)),
            }
        }
        own[start..end].copy_from_slice(&acc);
    }
}

/// The executor's own work on tensors: the fast zeroed allocation, and the copies and
/// folds its collectives are made of.
pub(crate) trait TensorOps: Sized {
    /// The same data in standard (row-major, contiguous) layout.
    fn standard(self) -> Tensor;

    /// Whether executor tensors hold `dtype` ([`Error::UnsupportedDType`]) and a tensor
    /// of `shape` fits in memory's address range ([`Error::TooLarge`]).
    fn check_size(dtype: DType, shape: &[usize]) -> Result<()>;

    /// A zero-filled tensor of a dtype and shape: [`Error::TooLarge`] if its bytes
    /// would overflow an `isize` (checked before anything is allocated) or the
    /// allocator has no room for them (where `ArrayD::zeros` would abort the process).
    /// The zeros come from the allocator's zeroed memory, so large tensors start as
    /// untouched pages rather than a pass of writes.
    fn zeroed(dtype: DType, shape: &[usize]) -> Result<Tensor>;

    /// [`zeros`](Self::zeros) for a buffer a cross-process step needs after the
    /// processes agreed on it: the others are already in the data exchange, so an error
    /// here could not reach them; a size past the address space is still
    /// [`Error::TooLarge`] (checked before the agreement by every caller's own shape),
    /// but an allocator with no room ends the process, as Rust's out-of-memory does
    /// (and with it the MPI job), instead of leaving the others waiting.
    fn zeroed_in_step(dtype: DType, shape: &[usize]) -> Result<Tensor>;

    /// Writes `parts` (one dtype) end to end along `axis` into `out`, whose shape is
    /// theirs with `axis` summed.
    fn concat_into(parts: &[std::sync::Arc<Tensor>], axis: usize, out: &mut Tensor);

    /// Runs of row-major elements — `(tensor, offset)`, each as many elements as
    /// `piece` holds, read in place from a standard-layout tensor — taken as tensors of
    /// shape `piece` and written end to end along `axis` into `out` (of one dtype with
    /// them, its shape `piece`'s with `axis` times the number of runs). No copy is made
    /// on the way.
    fn concat_runs_into(runs: &[(&Tensor, usize)], piece: &[usize], axis: usize, out: &mut Tensor);

    /// [`concat_pieces`](Self::concat_pieces) into `out`.
    fn concat_pieces_into(
        parts: &[std::sync::Arc<Tensor>],
        split_axis: usize,
        k: usize,
        concat_axis: usize,
        out: &mut Tensor,
    );

    /// Folds `len` elements of each part, from its own offset (`(part, at)`: elements
    /// `at..at + len` of a standard-layout part; one dtype), in part order into `out`
    /// (1-D or any shape of `len` elements, standard layout), every element overwritten.
    fn fold_at_into(parts: &[(&Tensor, usize)], len: usize, op: ReduceOp, out: &mut Tensor);

    /// [`fold_at_into`](Self::fold_at_into) into elements `out_at..out_at + len` of
    /// `out`, the rest of it left as it is.
    fn fold_at_into_at(
        parts: &[(&Tensor, usize)],
        len: usize,
        op: ReduceOp,
        out: &mut Tensor,
        out_at: usize,
    );

    /// A 1-D tensor of `v`.
    fn flat<T: meshwork_types::Element>(v: Vec<T>) -> Tensor;

    /// The same elements in row-major order under `shape` (same element count).
    fn reshaped(self, shape: &[usize]) -> Tensor;

    /// The elements of `parts` (one dtype), each in row-major order, end to end in one
    /// 1-D tensor.
    fn flatten(parts: &[std::sync::Arc<Tensor>]) -> Tensor;

    /// The element runs `runs` (of standard-layout tensors of `dtype`) end to end in
    /// one 1-D tensor.
    fn gather_runs(dtype: DType, runs: &[(&Tensor, std::ops::Range<usize>)]) -> Tensor;

    /// Piece `k` of `n` equal pieces along `axis`, for every `k` in order, each in
    /// row-major order, end to end in one 1-D tensor (along axis 0: the elements as
    /// they are).
    fn pieces_flat(&self, axis: usize, n: usize) -> Tensor;

    /// Copies elements `range` of the standard-layout `src` (same dtype) to elements
    /// `at..` of this standard-layout tensor.
    fn copy_run(&mut self, at: usize, src: &Tensor, range: std::ops::Range<usize>);

    /// This 1-D tensor cut into `n` tensors of `shape`, in order.
    fn split_flat(&self, n: usize, shape: &[usize]) -> Vec<Tensor>;

    /// Elements `range` of this tensor's row-major order, as a new 1-D tensor.
    fn slice_flat(&self, range: std::ops::Range<usize>) -> Tensor;

    /// An empty 1-D tensor of `dtype` (a placeholder; tensors of other dtypes are
    /// never made, so any other is f32).
    fn empty(dtype: DType) -> Tensor;

    /// Overwrites this standard-layout tensor's elements, in row-major order, with
    /// elements `at..at + self.len()` of the standard-layout `src` (same dtype).
    fn read_flat(&mut self, at: usize, src: &Tensor);

    /// Overwrites elements `at..at + src.len()` of this standard-layout tensor with
    /// `src`'s elements in row-major order (same dtype).
    fn write_flat(&mut self, at: usize, src: &Tensor);

    /// Folds, in order, `n` equal chunks into elements `own` of this 1-D
    /// standard-layout tensor: chunk `me` is those elements themselves, the others are
    /// `others`' consecutive runs of `own.len()` (same dtype), in order.
    fn fold_in_place(
        &mut self,
        own: std::ops::Range<usize>,
        others: &Tensor,
        me: usize,
        n: usize,
        op: ReduceOp,
    );

    /// Same dtype, shape and element bits (floats compared as bit patterns).
    fn same_bits(&self, other: &Tensor) -> bool;

    /// Every element divided by `n`, as the mean of `n` values whose sum this is.
    fn mean_of(self, n: usize) -> Tensor;
}

impl TensorOps for Tensor {
    fn standard(self) -> Tensor {
        map!(self, a => if a.is_standard_layout() { a } else { a.as_standard_layout().into_owned() })
    }

    fn check_size(dtype: DType, shape: &[usize]) -> Result<()> {
        let width: usize = match dtype {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            other => return Err(Error::UnsupportedDType { op: "buffer", dtype: other }),
        };
        let bytes = shape.iter().try_fold(width, |acc, &d| acc.checked_mul(d));
        match bytes {
            Some(b) if b <= isize::MAX as usize => Ok(()),
            _ => Err(Error::TooLarge { dtype, shape: shape.to_vec() }),
        }
    }

    fn zeroed(dtype: DType, shape: &[usize]) -> Result<Tensor> {
        Tensor::check_size(dtype, shape)?;
        let too_large = || Error::TooLarge { dtype, shape: shape.to_vec() };
        let len: usize = shape.iter().product();
        fn array<T>(shape: &[usize], v: Vec<T>) -> ArrayD<T> {
            ArrayD::from_shape_vec(IxDyn(shape), v).expect("as many elements as the shape")
        }
        Ok(match dtype {
            DType::F32 => Tensor::F32(array(shape, zeroed::vec(len).ok_or_else(too_large)?)),
            DType::F64 => Tensor::F64(array(shape, zeroed::vec(len).ok_or_else(too_large)?)),
            DType::I32 => Tensor::I32(array(shape, zeroed::vec(len).ok_or_else(too_large)?)),
            DType::I64 => Tensor::I64(array(shape, zeroed::vec(len).ok_or_else(too_large)?)),
            other => return Err(Error::UnsupportedDType { op: "buffer", dtype: other }),
        })
    }

    fn zeroed_in_step(dtype: DType, shape: &[usize]) -> Result<Tensor> {
        match Tensor::zeroed(dtype, shape) {
            Err(Error::TooLarge { .. }) if Tensor::check_size(dtype, shape).is_ok() => {
                let bytes = shape.iter().product::<usize>() * dtype.size_in_bytes();
                let layout = std::alloc::Layout::from_size_align(bytes, 8)
                    .unwrap_or(std::alloc::Layout::new::<u64>());
                std::alloc::handle_alloc_error(layout)
            }
            other => other,
        }
    }

    fn concat_into(parts: &[std::sync::Arc<Tensor>], axis: usize, out: &mut Tensor) {
        macro_rules! go {
            ($v:ident, $o:ident) => {{
                let mut at = 0;
                for p in parts {
                    let Tensor::$v(a) = &**p else { unreachable!("one dtype") };
                    let len = a.shape()[axis];
                    let mut dst = $o.slice_axis_mut(Axis(axis), ndarray::Slice::from(at..at + len));
                    match (dst.as_slice_mut(), a.as_slice()) {
                        (Some(d), Some(s)) => d.copy_from_slice(s),
                        _ => dst.assign(a),
                    }
                    at += len;
                }
            }};
        }
        numeric!(out, o => go)
    }

    fn concat_runs_into(runs: &[(&Tensor, usize)], piece: &[usize], axis: usize, out: &mut Tensor) {
        let len: usize = piece.iter().product();
        let width = piece[axis];
        macro_rules! go {
            ($v:ident, $o:ident) => {{
                for (k, &(t, at)) in runs.iter().enumerate() {
                    let Tensor::$v(a) = t else { unreachable!("one dtype") };
                    let src = &a.as_slice().expect("standard layout")[at..at + len];
                    let view = ndarray::ArrayView::from_shape(IxDyn(piece), src)
                        .expect("the run holds the piece's elements");
                    let slice = ndarray::Slice::from(k * width..(k + 1) * width);
                    let mut dst = $o.slice_axis_mut(Axis(axis), slice);
                    match dst.as_slice_mut() {
                        Some(d) => d.copy_from_slice(src),
                        None => dst.assign(&view),
                    }
                }
            }};
        }
        numeric!(out, o => go)
    }

    fn concat_pieces_into(
        parts: &[std::sync::Arc<Tensor>],
        split_axis: usize,
        k: usize,
        concat_axis: usize,
        out: &mut Tensor,
    ) {
        let n = parts.len();
        let len = parts[0].shape()[split_axis] / n;
        let range = ndarray::Slice::from(k * len..(k + 1) * len);
        macro_rules! go {
            ($v:ident, $o:ident) => {{
                let mut at = 0;
                for p in parts {
                    let Tensor::$v(a) = &**p else { unreachable!("one dtype") };
                    let piece = a.slice_axis(Axis(split_axis), range);
                    let width = piece.shape()[concat_axis];
                    let mut dst =
                        $o.slice_axis_mut(Axis(concat_axis), ndarray::Slice::from(at..at + width));
                    match (dst.as_slice_mut(), piece.as_slice()) {
                        (Some(d), Some(s)) => d.copy_from_slice(s),
                        _ => dst.assign(&piece),
                    }
                    at += width;
                }
            }};
        }
        numeric!(out, o => go)
    }

    fn fold_at_into(parts: &[(&Tensor, usize)], len: usize, op: ReduceOp, out: &mut Tensor) {
        Tensor::fold_at_into_at(parts, len, op, out, 0);
    }

    fn fold_at_into_at(
        parts: &[(&Tensor, usize)],
        len: usize,
        op: ReduceOp,
        out: &mut Tensor,
        out_at: usize,
    ) {
        macro_rules! go {
            ($v:ident, $o:ident) => {{
                let slices: Vec<&[_]> = parts
                    .iter()
                    .map(|(p, at)| match p {
                        Tensor::$v(x) => &x.as_slice().expect("standard layout")[*at..*at + len],
                        _ => unreachable!("one dtype"),
                    })
                    .collect();
                let out = &mut $o.as_slice_mut().expect("standard layout")[out_at..out_at + len];
                fold_segments(&slices, std::iter::once((0, len)), op, out)
            }};
        }
        numeric!(out, o => go)
    }

    fn flat<T: meshwork_types::Element>(v: Vec<T>) -> Tensor {
        T::wrap(ndarray::Array1::from(v).into_dyn())
    }

    fn reshaped(self, shape: &[usize]) -> Tensor {
        map!(self, a => a.into_shape_with_order(IxDyn(shape)).expect("same element count"))
    }

    fn flatten(parts: &[std::sync::Arc<Tensor>]) -> Tensor {
        macro_rules! flat {
            ($v:ident) => {{
                let mut out = Vec::with_capacity(parts.iter().map(|p| p.len()).sum());
                for p in parts {
                    let Tensor::$v(a) = &**p else { unreachable!("one dtype") };
                    match a.as_slice() {
                        Some(s) => out.extend_from_slice(s),
                        None => out.extend(a.iter().copied()),
                    }
                }
                Tensor::$v(ndarray::Array1::from(out).into_dyn())
            }};
        }
        macro_rules! go {
            ($v:ident, $x:ident) => {{
                let _ = $x;
                flat!($v)
            }};
        }
        numeric!(&*parts[0], x => go)
    }

    fn gather_runs(dtype: DType, runs: &[(&Tensor, std::ops::Range<usize>)]) -> Tensor {
        macro_rules! go {
            ($v:ident) => {{
                let mut out = Vec::with_capacity(runs.iter().map(|(_, r)| r.len()).sum());
                for (t, r) in runs {
                    let Tensor::$v(a) = t else { unreachable!("one dtype") };
                    out.extend_from_slice(&a.as_slice().expect("standard layout")[r.clone()]);
                }
                Tensor::$v(ndarray::Array1::from(out).into_dyn())
            }};
        }
        match dtype {
            DType::F64 => go!(F64),
            DType::I32 => go!(I32),
            DType::I64 => go!(I64),
            DType::F32 => go!(F32),
            other => unreachable!("collectives carry f32, f64, i32 and i64, not {other}"),
        }
    }

    fn pieces_flat(&self, axis: usize, n: usize) -> Tensor {
        let len = self.shape()[axis] / n;
        each!(self, a => {
            let mut out = Vec::with_capacity(a.len());
            for k in 0..n {
                let piece = a.slice_axis(Axis(axis), ndarray::Slice::from(k * len..(k + 1) * len));
                match piece.as_slice() {
                    Some(s) => out.extend_from_slice(s),
                    None => out.extend(piece.iter().copied()),
                }
            }
            Tensor::flat(out)
        })
    }

    fn copy_run(&mut self, at: usize, src: &Tensor, range: std::ops::Range<usize>) {
        macro_rules! go {
            ($v:ident, $a:ident) => {{
                let Tensor::$v(src) = src else { unreachable!("one dtype") };
                let src = &src.as_slice().expect("standard layout")[range];
                $a.as_slice_mut().expect("standard layout")[at..at + src.len()]
                    .copy_from_slice(src);
            }};
        }
        numeric!(self, a => go)
    }

    fn split_flat(&self, n: usize, shape: &[usize]) -> Vec<Tensor> {
        let len: usize = shape.iter().product();
        (0..n).map(|k| self.slice_flat(k * len..(k + 1) * len).reshaped(shape)).collect()
    }

    fn slice_flat(&self, range: std::ops::Range<usize>) -> Tensor {
        each!(self, a => {
            let v = match a.as_slice() {
                Some(s) => s[range].to_vec(),
                None => a.iter().skip(range.start).take(range.len()).copied().collect(),
            };
            Tensor::flat(v)
        })
    }

    fn empty(dtype: DType) -> Tensor {
        meshwork_types::with_element!(dtype, T => T::wrap(ArrayD::from_elem(IxDyn(&[0]), T::default())))
    }

    fn read_flat(&mut self, at: usize, src: &Tensor) {
        macro_rules! go {
            ($v:ident, $a:ident) => {{
                let Tensor::$v(src) = src else { unreachable!("one dtype") };
                let dst = $a.as_slice_mut().expect("standard layout");
                let n = dst.len();
                dst.copy_from_slice(&src.as_slice().expect("standard layout")[at..at + n]);
            }};
        }
        numeric!(self, a => go)
    }

    fn write_flat(&mut self, at: usize, src: &Tensor) {
        macro_rules! go {
            ($v:ident, $a:ident) => {{
                let Tensor::$v(src) = src else { unreachable!("one dtype") };
                let dst = &mut $a.as_slice_mut().expect("standard layout")[at..at + src.len()];
                match src.as_slice() {
                    Some(s) => dst.copy_from_slice(s),
                    None => dst.iter_mut().zip(src.iter()).for_each(|(d, &s)| *d = s),
                }
            }};
        }
        numeric!(self, a => go)
    }

    fn fold_in_place(
        &mut self,
        own: std::ops::Range<usize>,
        others: &Tensor,
        me: usize,
        n: usize,
        op: ReduceOp,
    ) {
        macro_rules! go {
            ($v:ident, $a:ident) => {{
                let Tensor::$v(o) = others else { unreachable!("one dtype") };
                let o = o.as_slice().expect("built 1-D");
                let dst = &mut $a.as_slice_mut().expect("standard layout")[own.clone()];
                fold_into(dst, o, me, n, op)
            }};
        }
        numeric!(self, a => go)
    }

    fn same_bits(&self, other: &Tensor) -> bool {
        /// Over contiguous slices where both have them (a dynamic-rank iterator is an
        /// order of magnitude slower), element by element otherwise.
        fn same<T: Copy, B: PartialEq>(
            a: &ArrayD<T>,
            b: &ArrayD<T>,
            bits: impl Fn(T) -> B,
        ) -> bool {
            match (a.as_slice(), b.as_slice()) {
                (Some(x), Some(y)) => x.iter().zip(y).all(|(&p, &q)| bits(p) == bits(q)),
                _ => a.iter().zip(b).all(|(&p, &q)| bits(p) == bits(q)),
            }
        }
        if self.shape() != other.shape() {
            return false;
        }
        match (self, other) {
            (Tensor::F32(a), Tensor::F32(b)) => same(a, b, f32::to_bits),
            (Tensor::F64(a), Tensor::F64(b)) => same(a, b, f64::to_bits),
            (Tensor::I32(a), Tensor::I32(b)) => same(a, b, |v| v),
            (Tensor::I64(a), Tensor::I64(b)) => same(a, b, |v| v),
            _ => false,
        }
    }

    fn mean_of(self, n: usize) -> Tensor {
        map!(self, a => a.mapv_into(|x| Element::mean(x, n)))
    }
}

/// Zero-filled vectors that fail instead of aborting when memory runs out.
mod zeroed {
    #![allow(unsafe_code)]

    /// Element types whose all-zero bytes are a value (zero).
    ///
    /// # Safety
    /// An implementor promises that every all-zero bit pattern of its size is a valid
    /// value of it; [`vec`] hands such memory out as initialised elements.
    pub(crate) unsafe trait ZeroBits: Copy {}
    // SAFETY: all-zero bits are 0.0 and 0 for these primitive numbers.
    unsafe impl ZeroBits for f32 {}
    // SAFETY: as above.
    unsafe impl ZeroBits for f64 {}
    // SAFETY: as above.
    unsafe impl ZeroBits for i32 {}
    // SAFETY: as above.
    unsafe impl ZeroBits for i64 {}

    /// `n` zeros, or `None` if the allocator cannot give their memory (or their size
    /// overflows). Large sizes come as fresh zeroed pages, written only when used.
    pub(crate) fn vec<T: ZeroBits>(n: usize) -> Option<Vec<T>> {
        let layout = std::alloc::Layout::array::<T>(n).ok()?;
        if layout.size() == 0 {
            return Some(Vec::new());
        }
        // SAFETY: the layout has a non-zero size (checked above).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<T>();
        if ptr.is_null() {
            return None;
        }
        // SAFETY: `ptr` comes from the global allocator with `Layout::array::<T>(n)`,
        // i.e. `T`'s alignment and a capacity of exactly `n` elements; its bytes are all
        // zero, which is a valid `T` (`ZeroBits`: f32, f64, i32, i64), so all `n`
        // elements are initialised.
        Some(unsafe { Vec::from_raw_parts(ptr, n, n) })
    }

    #[cfg(test)]
    mod tests {
        /// Under Miri (`cargo xtask miri`) this checks the allocation, the zeroes read
        /// back and the free through `Vec`'s drop; a size past the address space is
        /// `None`, not an abort.
        #[test]
        fn zeroed_vectors_are_zeros_and_huge_ones_are_refused() {
            for n in [0usize, 1, 7, 1000] {
                let v: Vec<f64> = super::vec(n).unwrap();
                assert_eq!(v.len(), n);
                assert!(v.iter().all(|&x| x.to_bits() == 0));
                let mut w: Vec<i32> = super::vec(n).unwrap();
                w.push(5);
                assert_eq!(w.iter().sum::<i32>(), 5);
            }
            // Sizes whose layout overflows are refused before the allocator is asked.
            assert!(super::vec::<i64>(usize::MAX / 4).is_none());
            assert!(super::vec::<f32>(usize::MAX).is_none());
        }

        /// A size whose layout is valid but which no allocator can give (2^63 - 4
        /// bytes, past any address space): the allocator's refusal is `None`, where
        /// `vec![0; n]` would abort the process. Not under Miri, which reports the
        /// request itself as resource exhaustion.
        #[test]
        #[cfg(not(miri))]
        fn an_allocation_no_allocator_can_give_is_refused() {
            assert!(super::vec::<f32>(isize::MAX as usize / 4).is_none());
        }
    }
}
