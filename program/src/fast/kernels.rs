//! The fast interpreter's kernels: layout copies for every dtype, and the float
//! kernels (GEMM-backed `dot_general` and convolutions, reductions, softmax, gathers
//! and scatters).
//!
//! The `unsafe` blocks are the calls into `gemm` (in [`gemm`] and [`gemm_into`]),
//! which takes raw pointers and strides, with their bounds checked just before each;
//! the pointer to each thread's block of columns of one product (`Out`, sent between
//! threads, each writing only its own columns); and the calls of functions compiled for
//! a CPU feature detected just before.

#![allow(unsafe_code)]

use meshwork_types::DType;

use super::float::Float;
use crate::op::{Padding, Reduction};
use crate::reference::pad_before;
pub(crate) use crate::reference::{split, strides};
use crate::tensor::{elems, elems_mut};
use crate::{Error, Result};
use meshwork_types::Tensor;

/// Hands out buffers (from the executable's pool or fresh).
pub(crate) trait Alloc {
    /// A buffer of `len` elements of `dtype`, contents unspecified.
    fn alloc(&mut self, dtype: DType, len: usize) -> Result<Tensor>;
    /// The thread budget.
    fn threads(&self) -> usize;
}

fn runtime(at: &str, problem: String) -> Error {
    Error::Runtime { at: at.to_string(), problem }
}

/// `out[i] = src[offset + Σ_d i_d · strides_d]` for every index `i` of `dims`, row-major.
pub(crate) fn gather<T: Copy>(
    src: &[T],
    offset: usize,
    strides: &[usize],
    dims: &[usize],
    out: &mut [T],
) {
    if dims.is_empty() {
        out[0] = src[offset];
        return;
    }
    if dims.contains(&0) {
        return;
    }
    let r = dims.len();
    let (inner, s) = (dims[r - 1], strides[r - 1]);
    let mut idx = vec![0usize; r - 1];
    let mut pos = 0usize;
    loop {
        let base = offset + idx.iter().zip(strides).map(|(i, s)| i * s).sum::<usize>();
        let dst = &mut out[pos..pos + inner];
        match s {
            1 => dst.copy_from_slice(&src[base..base + inner]),
            0 => dst.fill(src[base]),
            _ => dst.iter_mut().enumerate().for_each(|(e, o)| *o = src[base + e * s]),
        }
        pos += inner;
        let mut k = r - 1;
        loop {
            if k == 0 {
                return;
            }
            k -= 1;
            idx[k] += 1;
            if idx[k] < dims[k] {
                break;
            }
            idx[k] = 0;
        }
    }
}

/// Applies `$body` (an expression over `$v: &[T]` writing `$out: &mut [T]`, a fresh
/// buffer of `$len` elements of the same dtype) for the dtype of `$data`.
macro_rules! per_dtype {
    ($alloc:expr, $data:expr, $len:expr, |$v:ident, $out:ident| $body:expr) => {{
        let len = $len;
        macro_rules! go {
            ($t:ty) => {{
                let $v: &[$t] = elems($data);
                let mut d = $alloc.alloc(<$t as meshwork_types::Element>::DTYPE, len)?;
                let $out: &mut [$t] = elems_mut(&mut d);
                $body;
                d
            }};
        }
        match $data.dtype() {
            DType::F32 => go!(f32),
            DType::F64 => go!(f64),
            DType::I32 => go!(i32),
            DType::I64 => go!(i64),
            DType::Bool => go!(bool),
            other => unreachable!("programs do not compute in {other} (checked when built)"),
        }
    }};
}

/// `x` converted to the float dtype `to` in a pooled buffer, element by element over the
/// threads: half precision widened (exact), f32 and f64 either way (rounded to nearest),
/// f32 narrowed to half precision (rounded to nearest even). `None` for any other pair,
/// which the reference converts.
pub(crate) fn convert(a: &mut dyn Alloc, x: &Tensor, to: DType) -> Result<Option<Tensor>> {
    use meshwork_types::{bf16, f16};
    use rayon::prelude::*;
    fn map<S: meshwork_types::Element + Copy + Sync, D: meshwork_types::Element + Copy + Send>(
        x: &Tensor,
        out: &mut Tensor,
        f: impl Fn(S) -> D + Sync,
    ) {
        let (src, dst) = (elems::<S>(x), elems_mut::<D>(out));
        const CHUNK: usize = 1 << 16;
        dst.par_chunks_mut(CHUNK).zip(src.par_chunks(CHUNK)).for_each(|(d, s)| {
            for (d, &s) in d.iter_mut().zip(s) {
                *d = f(s);
            }
        });
    }
    let from = x.dtype();
    let known = matches!(
        (from, to),
        (DType::BF16 | DType::F16, DType::F32 | DType::F64)
            | (DType::F32, DType::F64 | DType::BF16 | DType::F16)
            | (DType::F64, DType::F32)
    );
    if !known || !x.is_standard_layout() {
        return Ok(None);
    }
    let mut out = a.alloc(to, x.len())?;
    match (from, to) {
        (DType::BF16, DType::F32) => map(x, &mut out, |v: bf16| f32::from(v)),
        (DType::BF16, _) => map(x, &mut out, |v: bf16| f64::from(v)),
        (DType::F16, DType::F32) => map(x, &mut out, |v: f16| f32::from(v)),
        (DType::F16, _) => map(x, &mut out, |v: f16| f64::from(v)),
        (DType::F32, DType::F64) => map(x, &mut out, |v: f32| f64::from(v)),
        (DType::F32, DType::BF16) => map(x, &mut out, bf16::from_f32),
        (DType::F32, _) => map(x, &mut out, f16::from_f32),
        _ => map(x, &mut out, |v: f64| v as f32),
    }
    Ok(Some(out))
}

/// [`Op::ThreefryUniform`](crate::Op::ThreefryUniform) of `i32` keys and counters in
/// standard layout, threaded; `None` for other layouts (the reference computes those).
pub(crate) fn threefry_uniform(
    a: &mut dyn Alloc,
    k1: &Tensor,
    k2: &Tensor,
    x: &Tensor,
) -> Result<Option<Tensor>> {
    use rayon::prelude::*;
    if ![k1, k2, x].iter().all(|t| t.is_standard_layout() && t.dtype() == DType::I32) {
        return Ok(None);
    }
    let mut out = a.alloc(DType::F32, x.len())?;
    let (k1, k2, x) = (elems::<i32>(k1), elems::<i32>(k2), elems::<i32>(x));
    const CHUNK: usize = 1 << 14;
    elems_mut::<f32>(&mut out)
        .par_chunks_mut(CHUNK)
        .zip(k1.par_chunks(CHUNK).zip(k2.par_chunks(CHUNK)).zip(x.par_chunks(CHUNK)))
        .for_each(|(d, ((k1, k2), x))| threefry_chunk(k1, k2, x, d));
    Ok(Some(out))
}

/// [`threefry_uniform`]'s elements of one chunk, compiled for AVX-512 or AVX2 where the
/// CPU has them (16 lanes of Threefry's rounds at once).
fn threefry_chunk(k1: &[i32], k2: &[i32], x: &[i32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F was detected just above; the function is safe code
            // compiled for it.
            #[allow(unsafe_code)]
            unsafe {
                threefry_chunk_avx512(k1, k2, x, out)
            };
            return;
        }
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 was detected just above; as above.
            #[allow(unsafe_code)]
            unsafe {
                threefry_chunk_avx2(k1, k2, x, out)
            };
            return;
        }
    }
    threefry_chunk_any(k1, k2, x, out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(unsafe_code)]
unsafe fn threefry_chunk_avx512(k1: &[i32], k2: &[i32], x: &[i32], out: &mut [f32]) {
    threefry_chunk_any(k1, k2, x, out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[allow(unsafe_code)]
unsafe fn threefry_chunk_avx2(k1: &[i32], k2: &[i32], x: &[i32], out: &mut [f32]) {
    threefry_chunk_any(k1, k2, x, out);
}

/// [`crate::random::uniform`] over lanes of 16: each step of the block cipher on
/// every lane in turn, so the loops vectorize; the tail one at a time.
#[inline(always)]
fn threefry_chunk_any(k1: &[i32], k2: &[i32], x: &[i32], out: &mut [f32]) {
    const L: usize = 16;
    let full = out.len() / L * L;
    for (((o, a), b), c) in out[..full]
        .chunks_exact_mut(L)
        .zip(k1[..full].chunks_exact(L))
        .zip(k2[..full].chunks_exact(L))
        .zip(x[..full].chunks_exact(L))
    {
        let o: &mut [f32; L] = o.try_into().expect("L lanes");
        let (a, b, c): (&[i32; L], &[i32; L], &[i32; L]) = (
            a.try_into().expect("L lanes"),
            b.try_into().expect("L lanes"),
            c.try_into().expect("L lanes"),
        );
        threefry_lanes(a, b, c, o);
    }
    for e in full..out.len() {
        out[e] = crate::random::uniform([k1[e] as u32, k2[e] as u32], x[e] as u32);
    }
}

/// Sixteen lanes of [`crate::random::uniform`].
#[inline(always)]
fn threefry_lanes(k1: &[i32; 16], k2: &[i32; 16], x: &[i32; 16], out: &mut [f32; 16]) {
    // The i32 values are the bits of JAX's uint32 words; the counters' high words 0.
    let key = [k1.map(|k| k as u32), k2.map(|k| k as u32)];
    let [y1, y2] = crate::random::threefry_lanes(key, [[0; 16], x.map(|c| c as u32)]);
    for l in 0..16 {
        out[l] = crate::random::unit_float(y1[l] ^ y2[l]);
    }
}

/// A strided view copied out (transpose, broadcast, slice), any dtype.
pub(crate) fn view(
    a: &mut dyn Alloc,
    x: &Tensor,
    offset: usize,
    strides: &[usize],
    dims: &[usize],
) -> Result<Tensor> {
    let len = dims.iter().product();
    Ok(per_dtype!(a, x, len, |v, out| gather(v, offset, strides, dims, out)))
}

/// `x` of `xdims` padded with zeros: `low[d]` before, `interior[d]` between
/// neighbours along each dim (what `high` adds is the rest of `dims`), any dtype.
pub(crate) fn pad(
    a: &mut dyn Alloc,
    (xdims, x): (&[usize], &Tensor),
    low: &[usize],
    interior: &[usize],
    dims: &[usize],
) -> Result<Tensor> {
    fn go<T: Copy + Default>(
        v: &[T],
        xdims: &[usize],
        low: &[usize],
        interior: &[usize],
        dims: &[usize],
        out: &mut [T],
    ) {
        out.fill(T::default());
        if xdims.contains(&0) {
            return;
        }
        if xdims.is_empty() {
            out[0] = v[0];
            return;
        }
        let r = xdims.len();
        let os = strides(dims);
        // Where input element `i` lands: Σ_d (low_d + i_d (interior_d + 1)) · os_d.
        let step: Vec<usize> = (0..r).map(|d| (interior[d] + 1) * os[d]).collect();
        let start: usize = (0..r).map(|d| low[d] * os[d]).sum();
        let inner = xdims[r - 1];
        let mut idx = vec![0usize; r - 1];
        let mut pos = 0usize;
        loop {
            let base = start + idx.iter().zip(&step).map(|(i, s)| i * s).sum::<usize>();
            let src = &v[pos..pos + inner];
            match step[r - 1] {
                1 => out[base..base + inner].copy_from_slice(src),
                s => src.iter().enumerate().for_each(|(e, &x)| out[base + e * s] = x),
            }
            pos += inner;
            let mut k = r - 1;
            loop {
                if k == 0 {
                    return;
                }
                k -= 1;
                idx[k] += 1;
                if idx[k] < xdims[k] {
                    break;
                }
                idx[k] = 0;
            }
        }
    }
    let len = dims.iter().product();
    Ok(per_dtype!(a, x, len, |v, out| go(v, xdims, low, interior, dims, out)))
}

/// Concatenation along `axis` of operands of `dims`, any dtype.
pub(crate) fn concat(
    a: &mut dyn Alloc,
    args: &[(&[usize], &Tensor)],
    axis: usize,
    dims: &[usize],
) -> Result<Tensor> {
    fn go<T: Copy>(parts: &[(usize, &[T])], outer: usize, out: &mut [T]) {
        let mut pos = 0usize;
        for o in 0..outer {
            for &(block, v) in parts {
                out[pos..pos + block].copy_from_slice(&v[o * block..(o + 1) * block]);
                pos += block;
            }
        }
    }
    let outer: usize = dims[..axis].iter().product();
    let inner: usize = dims[axis + 1..].iter().product();
    let len = dims.iter().product();
    fn typed<T: meshwork_types::Element>(
        args: &[(&[usize], &Tensor)],
        axis: usize,
        inner: usize,
        outer: usize,
        d: &mut Tensor,
    ) {
        let parts: Vec<(usize, &[T])> =
            args.iter().map(|(dims, data)| (dims[axis] * inner, elems::<T>(data))).collect();
        go(&parts, outer, elems_mut::<T>(d))
    }
    let mut d = a.alloc(args[0].1.dtype(), len)?;
    match d.dtype() {
        DType::F32 => typed::<f32>(args, axis, inner, outer, &mut d),
        DType::F64 => typed::<f64>(args, axis, inner, outer, &mut d),
        DType::I32 => typed::<i32>(args, axis, inner, outer, &mut d),
        DType::I64 => typed::<i64>(args, axis, inner, outer, &mut d),
        DType::Bool => typed::<bool>(args, axis, inner, outer, &mut d),
        other => unreachable!("programs do not compute in {other} (checked when built)"),
    }
    Ok(d)
}

/// Integer indices as i64.
pub(crate) fn indices(d: &Tensor) -> Vec<i64> {
    match d.dtype() {
        DType::I32 => elems::<i32>(d).iter().map(|&x| i64::from(x)).collect(),
        DType::I64 => elems::<i64>(d).to_vec(),
        other => unreachable!("inference checked integer indices, not {other}"),
    }
}

/// Rows of `indices` along an axis of `n`, each clamped into `0..n` (XLA's `gather`;
/// see the reference interpreter). An empty axis has no row to clamp to: an error.
fn rows(idx: &Tensor, n: usize, axis: usize, what: &str, at: &str) -> Result<Vec<usize>> {
    let idx = indices(idx);
    if n == 0 && !idx.is_empty() {
        return Err(runtime(at, format!("indices into the {what}'s axis {axis}, which is empty")));
    }
    Ok(idx.into_iter().map(|i| i.clamp(0, n as i64 - 1) as usize).collect())
}

/// `take(table, indices, axis)`, any table dtype; an index outside the axis is
/// clamped into it.
pub(crate) fn take(
    a: &mut dyn Alloc,
    table: (&[usize], &Tensor),
    idx: &Tensor,
    axis: usize,
    at: &str,
) -> Result<Tensor> {
    let (td, tv) = table;
    let (before, n, after) = split(td, axis);
    let rows = rows(idx, n, axis, "table", at)?;
    let len = before * rows.len() * after;
    Ok(per_dtype!(a, tv, len, |v, out| {
        let mut pos = 0usize;
        for b in 0..before {
            for &r in &rows {
                let src = (b * n + r) * after;
                out[pos..pos + after].copy_from_slice(&v[src..src + after]);
                pos += after;
            }
        }
    }))
}

/// `scatter_add(operand, indices, updates, axis)` of floats.
pub(crate) fn scatter_add<T: Float>(
    a: &mut dyn Alloc,
    x: (&[usize], &[T]),
    idx: &Tensor,
    upd: &[T],
    axis: usize,
    at: &str,
) -> Result<Tensor> {
    let (xd, xv) = x;
    let (_, n, _) = split(xd, axis);
    // The indices checked before the buffer is made.
    rows(idx, n, axis, "operand", at)?;
    let mut d = a.alloc(T::DTYPE, xv.len())?;
    let out = T::slice_mut(&mut d);
    out.copy_from_slice(xv);
    scatter_add_into(out, xd, idx, upd, axis, at)?;
    Ok(d)
}

/// `out` (an operand of `xd` dims) with `upd` added at `idx` along `axis`, in place:
/// the scatter of a buffer no later step reads.
pub(crate) fn scatter_add_into<T: Float>(
    out: &mut [T],
    xd: &[usize],
    idx: &Tensor,
    upd: &[T],
    axis: usize,
    at: &str,
) -> Result<()> {
    let (before, n, after) = split(xd, axis);
    let rows = rows(idx, n, axis, "operand", at)?;
    let mut pos = 0usize;
    for b in 0..before {
        for &r in &rows {
            let dst = (b * n + r) * after;
            for (o, &u) in out[dst..dst + after].iter_mut().zip(&upd[pos..pos + after]) {
                *o += u;
            }
            pos += after;
        }
    }
    Ok(())
}

/// One-hot rows of `depth` of type `T`; indices outside `0..depth` give zeros.
pub(crate) fn one_hot<T: Float>(a: &mut dyn Alloc, idx: &Tensor, depth: usize) -> Result<Tensor> {
    let idx = indices(idx);
    let mut d = a.alloc(T::DTYPE, idx.len() * depth)?;
    let out = T::slice_mut(&mut d);
    out.fill(T::ZERO);
    for (k, &i) in idx.iter().enumerate() {
        if let Some(c) = usize::try_from(i).ok().filter(|&c| c < depth) {
            out[k * depth + c] = T::ONE;
        }
    }
    Ok(d)
}

/// A sum of a contiguous run, eight lanes at a time (vectorizes; pairs rounding
/// errors as a tree would).
fn sum<T: Float>(v: &[T]) -> T {
    let mut lanes = [T::ZERO; 8];
    let mut chunks = v.chunks_exact(8);
    for c in &mut chunks {
        for (l, &x) in lanes.iter_mut().zip(c) {
            *l += x;
        }
    }
    let mut s = T::ZERO;
    for &x in chunks.remainder() {
        s += x;
    }
    let l = lanes;
    ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7])) + s
}

fn max<T: Float>(v: &[T]) -> T {
    v.iter().fold(T::NEG_INFINITY, |m, &x| m.max_nan(x))
}

/// A reduction over sorted `axes` of a float tensor of `dims`.
pub(crate) fn reduce<T: Float>(
    a: &mut dyn Alloc,
    x: &[T],
    dims: &[usize],
    axes: &[usize],
    kind: Reduction,
) -> Result<Tensor> {
    let r = dims.len();
    let count: usize = axes.iter().map(|&d| dims[d]).product();
    let kept: usize = (0..r).filter(|d| !axes.contains(d)).map(|d| dims[d]).product();
    let mut d = a.alloc(T::DTYPE, kept)?;
    let out = T::slice_mut(&mut d);
    let is_suffix = axes.iter().rev().enumerate().all(|(k, &ax)| ax == r - 1 - k);
    // Reduced axes that follow one another (a prefix, or a middle run such as the key
    // heads' group of grouped-query attention's gradient): slabs of the kept inner dims
    // added in place, `outer` times.
    let run = axes.first().filter(|&&a0| axes.iter().enumerate().all(|(k, &ax)| ax == a0 + k));
    if count == 0 {
        // A reduction of nothing: its identity (a mean of nothing is 0/0, NaN).
        out.fill(if kind == Reduction::Max { T::NEG_INFINITY } else { T::ZERO });
    } else if is_suffix {
        for (o, row) in out.iter_mut().zip(x.chunks(count)) {
            *o = if kind == Reduction::Max { max(row) } else { sum(row) };
        }
    } else if let Some(&a0) = run {
        out.fill(if kind == Reduction::Max { T::NEG_INFINITY } else { T::ZERO });
        let inner: usize = dims[a0 + axes.len()..].iter().product();
        let slab = count * inner;
        for (o, whole) in out.chunks_exact_mut(inner.max(1)).zip(x.chunks_exact(slab.max(1))) {
            for row in whole.chunks_exact(inner.max(1)) {
                if kind == Reduction::Max {
                    o.iter_mut().zip(row).for_each(|(o, &e)| *o = o.max_nan(e));
                } else {
                    o.iter_mut().zip(row).for_each(|(o, &e)| *o += e);
                }
            }
        }
    } else {
        // Reduced axes last, then rows.
        let order: Vec<usize> =
            (0..r).filter(|d| !axes.contains(d)).chain(axes.iter().copied()).collect();
        let xs = strides(dims);
        let pd: Vec<usize> = order.iter().map(|&d| dims[d]).collect();
        let ps: Vec<usize> = order.iter().map(|&d| xs[d]).collect();
        let mut t = vec![T::ZERO; x.len()];
        gather(x, 0, &ps, &pd, &mut t);
        for (o, row) in out.iter_mut().zip(t.chunks(count)) {
            *o = if kind == Reduction::Max { max(row) } else { sum(row) };
        }
    }
    if kind == Reduction::Mean {
        let c = T::from_usize(count);
        out.iter_mut().for_each(|o| *o = *o / c);
    }
    Ok(d)
}

/// The larger, ignoring NaN (the reference's `f64::max`).
fn fmax<T: Float>(m: T, x: T) -> T {
    if m.is_nan() || x > m { x } else { m }
}

/// Softmax or log-softmax along `axis`. Rows along the last axis are spread over the
/// run's threads when there are many elements.
pub(crate) fn softmax<T: Float>(
    a: &mut dyn Alloc,
    x: &[T],
    dims: &[usize],
    axis: usize,
    log: bool,
) -> Result<Tensor> {
    let mut d = a.alloc(T::DTYPE, x.len())?;
    let out = T::slice_mut(&mut d);
    let (_, n, inner) = split(dims, axis);
    if x.is_empty() || n == 0 {
        return Ok(d);
    }
    let threads = a.threads();
    if inner == 1 && threads > 1 && x.len() >= 1 << 15 {
        let rows = x.len() / n;
        let per = rows.div_ceil(threads) * n;
        rayon::scope(|s| {
            for (xs, os) in x.chunks(per).zip(out.chunks_mut(per)) {
                s.spawn(move |_| softmax_rows(xs, os, n, log));
            }
        });
        return Ok(d);
    }
    if inner == 1 {
        softmax_rows(x, out, n, log);
        return Ok(d);
    }
    softmax_strided(x, out, dims, axis, log);
    Ok(d)
}

/// `$vis fn $name`: `$any` (an `#[inline(always)]` function generic over [`Float`])
/// compiled for AVX-512 and for AVX2 as `$avx512` and `$avx2`, each run where the CPU
/// has it, else `$any` as compiled for the default target.
macro_rules! simd_dispatch {
    ($(#[$doc:meta])* $vis:vis $name:ident, $avx512:ident, $avx2:ident, $any:ident,
        ($($arg:ident: $ty:ty),*)) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx512f")]
        #[allow(unsafe_code)]
        unsafe fn $avx512<T: Float>($($arg: $ty),*) {
            $any($($arg),*);
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2")]
        #[allow(unsafe_code)]
        unsafe fn $avx2<T: Float>($($arg: $ty),*) {
            $any($($arg),*);
        }

        $(#[$doc])*
        $vis fn $name<T: Float>($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                if std::is_x86_feature_detected!("avx512f")
                    && std::is_x86_feature_detected!("avx2")
                    && std::is_x86_feature_detected!("fma")
                {
                    // SAFETY: AVX-512F (and the AVX2 and FMA it implies to the
                    // compiler) was detected just above; the function is safe code
                    // compiled for it.
                    #[allow(unsafe_code)]
                    unsafe {
                        $avx512($($arg),*)
                    };
                    return;
                }
                if std::is_x86_feature_detected!("avx2") {
                    // SAFETY: AVX2 was detected just above; the function is safe code
                    // compiled for it.
                    #[allow(unsafe_code)]
                    unsafe {
                        $avx2($($arg),*)
                    };
                    return;
                }
            }
            $any($($arg),*);
        }
    };
}
pub(crate) use simd_dispatch;

simd_dispatch!(
    /// Softmax of consecutive rows of `n`, compiled for AVX-512 or AVX2 where the CPU
    /// has it (its exponentials bound it, so the widest vectors pay).
    pub(crate) softmax_rows, softmax_rows_avx512, softmax_rows_avx2, softmax_rows_any,
    (x: &[T], out: &mut [T], n: usize, log: bool)
);

/// Lanes of the row reductions: independent accumulators, so the loops vectorize.
const LANES: usize = 8;

/// The rows: the maximum (NaN ignored, as [`fmax`]), the exponentials, their sum —
/// each over 8 lanes, combined in lane order — then the normalisation.
#[inline(always)]
fn softmax_rows_any<T: Float>(x: &[T], out: &mut [T], n: usize, log: bool) {
    for (row, o) in x.chunks(n).zip(out.chunks_mut(n)) {
        let mut ms = [T::NEG_INFINITY; LANES];
        let mut chunks = row.chunks_exact(LANES);
        for c in &mut chunks {
            for (m, &e) in ms.iter_mut().zip(c) {
                // A lane starts at -inf and only takes numbers, so this is `fmax`.
                *m = if e > *m { e } else { *m };
            }
        }
        let m = chunks
            .remainder()
            .iter()
            .fold(ms.into_iter().fold(T::NEG_INFINITY, fmax), |m, &e| fmax(m, e));
        o.iter_mut().zip(row).for_each(|(o, &e)| *o = (e - m).exp_many());
        let mut ss = [T::ZERO; LANES];
        let mut chunks = o.chunks_exact(LANES);
        for c in &mut chunks {
            for (s, &e) in ss.iter_mut().zip(c) {
                *s += e;
            }
        }
        let s = chunks
            .remainder()
            .iter()
            .fold(ss.into_iter().fold(T::ZERO, |s, e| s + e), |s, &e| s + e);
        if log {
            let s = s.ln();
            o.iter_mut().zip(row).for_each(|(o, &e)| *o = e - m - s);
        } else {
            let r = T::ONE / s;
            o.iter_mut().for_each(|o| *o = *o * r);
        }
    }
}

/// Softmax along an axis that is not the last.
fn softmax_strided<T: Float>(x: &[T], out: &mut [T], dims: &[usize], axis: usize, log: bool) {
    let (outer, n, inner) = split(dims, axis);
    for b in 0..outer {
        for i in 0..inner {
            let at = |k: usize| (b * n + k) * inner + i;
            let m = (0..n).fold(T::NEG_INFINITY, |m, k| fmax(m, x[at(k)]));
            let s = (0..n).fold(T::ZERO, |s, k| s + (x[at(k)] - m).exp_many());
            for k in 0..n {
                out[at(k)] =
                    if log { x[at(k)] - m - s.ln() } else { (x[at(k)] - m).exp_many() / s };
            }
        }
    }
}

/// A matrix operand of a batched product: element `(b, i, j)` at
/// `b·batch + i·row + j·col`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Mat<'a, T> {
    pub data: &'a [T],
    pub batch: usize,
    pub row: usize,
    pub col: usize,
}

impl<T> Mat<'_, T> {
    /// Whether every element of `batches` (≥ 1) products of `rows × cols` (each ≥ 1)
    /// lies inside the operand's buffer: the safety argument of the raw-pointer calls
    /// into `gemm`. Checked arithmetic: a sum that wrapped (release builds do not trap)
    /// could pass the bound and let the raw pointers reach outside.
    fn inside(&self, batches: usize, rows: usize, cols: usize) -> bool {
        let last = (|| {
            let b = (batches - 1).checked_mul(self.batch)?;
            let r = (rows - 1).checked_mul(self.row)?;
            let c = (cols - 1).checked_mul(self.col)?;
            b.checked_add(r)?.checked_add(c)
        })();
        last.is_some_and(|l| l < self.data.len())
    }
}

/// `out[b] = lhs[b] · rhs[b]` for `b < batches`, lhs `m × k`, rhs `k × n`, out
/// row-major contiguous `batches × m × n`, through the `gemm` crate.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm<T: Float>(
    batches: usize,
    m: usize,
    n: usize,
    k: usize,
    lhs: Mat<'_, T>,
    rhs: Mat<'_, T>,
    out: &mut [T],
    threads: usize,
) {
    assert_eq!(
        batches.checked_mul(m).and_then(|bm| bm.checked_mul(n)),
        Some(out.len()),
        "the product's buffer"
    );
    if batches == 0 || m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        out.fill(T::ZERO);
        return;
    }
    assert!(lhs.inside(batches, m, k), "lhs strides outside its buffer");
    assert!(rhs.inside(batches, k, n), "rhs strides outside its buffer");
    // Threads: a batch of products splits over the batch (each product on one
    // thread); one product with many rows, at least as many as it has columns, splits
    // its rows (each part a product on one thread, each packing the whole right
    // operand); else one product splits its output's columns (each thread a product
    // on its own, packing its share of the right operand: a language model's head,
    // 340×576×49152, packs its 113 MB weight once, not once per thread) — a narrow
    // output (few columns) does not split well and stays on one thread.
    // Measured on 2 cores (f32, medians, GFLOP/s): 1024³ rows 151 / gemm's split 134;
    // 2048×256×1024 173 / 151; 512³ 191 / 176; 256×256×1024 138 / 137; 256×1024×16 one
    // thread 2.5× faster than two; 340×576×49152 (AVX-512 VM) rows 164–168 / gemm's
    // split 178–180. Columns split here rather than by `gemm`'s own threads
    // (`Parallelism::Rayon`), 2-core AVX-512 VM, medians of 25: `x·Wᵀ` 256×576×576
    // 159–203 / 113–173, 256×576×1536 124–141 / 94–101, `dY·W` 256×576×1536 198–206 /
    // 186–193, 256×576×49152 201–203 / 185–189, 256×49152×576 171–180 / 173.
    let work = m * n * k;
    let big = threads > 1 && work >= 64 * 64 * 64;
    let split_batches = big && batches >= threads;
    // Fewer products than threads: each product split as one alone would be. A right
    // operand walked along `k` (`x·Wᵀ`, a weight stored `[out, in]`) is slow to pack
    // whole on every thread: its product splits by columns where it has enough of
    // them (1024×576×1536 181–191 GFLOP/s against 168–173 by rows), else by rows.
    let wide = n >= 64 * threads;
    let rhs_along_k = rhs.row == 1 && rhs.col != 1;
    let split_rows =
        big && !split_batches && m >= 128 * threads && n <= m && !(rhs_along_k && wide);
    let split_cols = big && !split_batches && !split_rows && wide;
    // Product `b`'s rows `r0..r0 + rows` and columns `c0..c0 + cols` into the block
    // at `dst` (its element (r0, c0)), rows `n` apart.
    let one = |b: usize, (r0, rows): (usize, usize), (c0, cols): (usize, usize), dst: Out<T>| {
        let as_isize = |x: usize| isize::try_from(x).expect("a stride inside a buffer fits isize");
        // SAFETY: `dst` points at element (r0, c0) of product `b`'s rows×n row-major
        // output block (row stride n, column stride 1) of `out`, which is borrowed
        // exclusively for the whole call of `gemm` (this function); the block written,
        // rows `r0..r0 + rows` and columns `c0..c0 + cols` (c0 + cols <= n), is this
        // call's alone: the threads' blocks are disjoint rows or disjoint columns. The
        // lhs reads `b·batch + i·row + j·col` for r0 <= i < r0 + rows <= m, j < k and
        // the rhs `b·batch + i·row + j·col` for i < k, c0 <= j < c0 + cols <= n; the
        // largest of these was checked above to be inside each operand's slice
        // (b < batches), and the slices are borrowed (so live and unaliased by `out`)
        // for the call. With `read_dst` false, the block is written, never read, so
        // its prior contents (a pooled buffer) do not matter.
        unsafe {
            gemm::gemm(
                rows,
                cols,
                k,
                dst.0,
                1,
                as_isize(n),
                false,
                lhs.data.as_ptr().add(b * lhs.batch + r0 * lhs.row),
                as_isize(lhs.col),
                as_isize(lhs.row),
                rhs.data.as_ptr().add(b * rhs.batch + c0 * rhs.col),
                as_isize(rhs.col),
                as_isize(rhs.row),
                T::ZERO,
                T::ONE,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
    };
    let whole = |dst: &mut [T]| Out(dst.as_mut_ptr());
    if split_batches {
        // Contiguous runs of products, one run per thread.
        let per = batches.div_ceil(threads);
        rayon::scope(|s| {
            for (g, run) in out.chunks_mut(per * m * n).enumerate() {
                let one = &one;
                s.spawn(move |_| {
                    for (j, dst) in run.chunks_mut(m * n).enumerate() {
                        one(g * per + j, (0, m), (0, n), whole(dst));
                    }
                });
            }
        });
        return;
    }
    if split_rows {
        // Each product's rows in contiguous runs, one run per thread.
        let per = m.div_ceil(threads);
        for (b, product) in out.chunks_mut(m * n).enumerate() {
            rayon::scope(|s| {
                for (g, dst) in product.chunks_mut(per * n).enumerate() {
                    let one = &one;
                    s.spawn(move |_| one(b, (g * per, dst.len() / n), (0, n), whole(dst)));
                }
            });
        }
        return;
    }
    if split_cols {
        // Each product's columns in contiguous runs (multiples of 16: whole vectors),
        // one run per thread, writing through one pointer to the product's block.
        let per = n.div_ceil(threads).next_multiple_of(16);
        for (b, product) in out.chunks_mut(m * n).enumerate() {
            let base = whole(product);
            rayon::scope(|s| {
                for c0 in (0..n).step_by(per) {
                    let one = &one;
                    // SAFETY: `base` points at the start of the product's first row
                    // of `n` elements, and c0 < n.
                    #[allow(unsafe_code)]
                    let dst = unsafe { base.at(c0) };
                    s.spawn(move |_| one(b, (0, m), (c0, per.min(n - c0)), dst));
                }
            });
        }
        return;
    }
    for (b, dst) in out.chunks_mut(m * n).enumerate() {
        one(b, (0, m), (0, n), whole(dst));
    }
}

/// A pointer into a product's output, handed to the thread that writes its block.
#[derive(Clone, Copy)]
struct Out<T>(*mut T);

impl<T> Out<T> {
    /// The pointer `c0` elements on.
    ///
    /// # Safety
    ///
    /// `self` points into an allocation with at least `c0` more elements after it.
    unsafe fn at(self, c0: usize) -> Out<T> {
        // SAFETY: as the caller promises.
        Out(unsafe { self.0.add(c0) })
    }
}
// SAFETY: an `Out` is only made from an exclusive borrow of the output and only
// written through for a block no other thread writes (see `gemm`).
unsafe impl<T: Send> Send for Out<T> {}
unsafe impl<T: Send> Sync for Out<T> {}

/// `dst = lhs · rhs`, or `dst += lhs · rhs` when `accumulate`, for one product on the
/// calling thread: lhs `m × k`, rhs `k × n` (their `batch` strides unused), `dst` an
/// `m × n` block of rows `dst_row` apart.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_into<T: Float>(
    m: usize,
    n: usize,
    k: usize,
    lhs: Mat<'_, T>,
    rhs: Mat<'_, T>,
    dst: &mut [T],
    dst_row: usize,
    accumulate: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(n <= dst_row || m == 1, "a row of the product overlaps the next");
    let end = (m - 1).checked_mul(dst_row).and_then(|r| r.checked_add(n));
    assert!(end.is_some_and(|e| e <= dst.len()), "the product's block outside its buffer");
    if k == 0 {
        if !accumulate {
            for r in 0..m {
                dst[r * dst_row..r * dst_row + n].fill(T::ZERO);
            }
        }
        return;
    }
    assert!(lhs.inside(1, m, k), "lhs strides outside its buffer");
    assert!(rhs.inside(1, k, n), "rhs strides outside its buffer");
    let as_isize = |x: usize| isize::try_from(x).expect("a stride inside a buffer fits isize");
    // SAFETY: `dst` holds the m×n block at row stride `dst_row` ≥ n (column stride 1),
    // checked above to end inside it, and is borrowed exclusively; the operands'
    // largest offsets were checked to be inside their slices, which are borrowed (live,
    // unaliased by `dst`) for the call. With `read_dst` false `dst` is only written.
    #[allow(unsafe_code)]
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            as_isize(dst_row),
            accumulate,
            lhs.data.as_ptr(),
            as_isize(lhs.col),
            as_isize(lhs.row),
            rhs.data.as_ptr(),
            as_isize(rhs.col),
            as_isize(rhs.row),
            T::ONE,
            T::ONE,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// The stride that walks `group` (dims of `dims` with `strides`, in order) as one
/// merged dim, if it can: each dim's stride is the next one's times its size (size-1
/// dims skipped).
fn merged(dims: &[usize], strides: &[usize], group: &[usize]) -> Option<usize> {
    let g: Vec<usize> = group.iter().copied().filter(|&d| dims[d] != 1).collect();
    if g.is_empty() {
        return Some(0);
    }
    for w in g.windows(2) {
        if strides[w[0]] != strides[w[1]] * dims[w[1]] {
            return None;
        }
    }
    Some(strides[*g.last().expect("not empty")])
}

/// An operand of `dot_general` as three merged dims (batch, then the two the product
/// walks), copied into that order when its layout does not allow walking them in
/// place. Returns the (possibly copied) data and the three strides.
fn as_matrix<'a, T: Float>(
    x: &'a [T],
    dims: &[usize],
    groups: [&[usize]; 3],
    copy: &'a mut Vec<T>,
) -> Mat<'a, T> {
    let s = strides(dims);
    let found: Option<Vec<usize>> = groups.iter().map(|g| merged(dims, &s, g)).collect();
    if let Some(st) = found {
        return Mat { data: x, batch: st[0], row: st[1], col: st[2] };
    }
    let order: Vec<usize> = groups.iter().flat_map(|g| g.iter().copied()).collect();
    let pd: Vec<usize> = order.iter().map(|&d| dims[d]).collect();
    let ps: Vec<usize> = order.iter().map(|&d| s[d]).collect();
    copy.resize(x.len(), T::ZERO);
    gather(x, 0, &ps, &pd, copy);
    let size = |g: &[usize]| g.iter().map(|&d| dims[d]).product::<usize>();
    let (r, c) = (size(groups[1]), size(groups[2]));
    Mat { data: copy, batch: r * c, row: c, col: 1 }
}

/// XLA's `dot_general` of float operands.
#[allow(clippy::too_many_arguments)]
pub(crate) fn dot_general<T: Float>(
    a: &mut dyn Alloc,
    lhs: (&[usize], &[T]),
    rhs: (&[usize], &[T]),
    lhs_contract: &[usize],
    rhs_contract: &[usize],
    lhs_batch: &[usize],
    rhs_batch: &[usize],
) -> Result<Tensor> {
    let (ld, lv) = lhs;
    let (rd, rv) = rhs;
    let lfree: Vec<usize> =
        (0..ld.len()).filter(|d| !lhs_contract.contains(d) && !lhs_batch.contains(d)).collect();
    let rfree: Vec<usize> =
        (0..rd.len()).filter(|d| !rhs_contract.contains(d) && !rhs_batch.contains(d)).collect();
    let size = |dims: &[usize], g: &[usize]| g.iter().map(|&d| dims[d]).product::<usize>();
    let (b, m, k, n) =
        (size(ld, lhs_batch), size(ld, &lfree), size(ld, lhs_contract), size(rd, &rfree));
    let (mut lc, mut rc) = (Vec::new(), Vec::new());
    let l = as_matrix(lv, ld, [lhs_batch, &lfree, lhs_contract], &mut lc);
    let r = as_matrix(rv, rd, [rhs_batch, rhs_contract, &rfree], &mut rc);
    let threads = a.threads();
    let mut d = a.alloc(T::DTYPE, b * m * n)?;
    gemm(b, m, n, k, l, r, T::slice_mut(&mut d), threads);
    Ok(d)
}

/// Input padding before the first row and column of a convolution (TF's SAME split,
/// the smaller half before).
fn conv_pads(
    x: [usize; 4],
    kh: usize,
    kw: usize,
    ho: usize,
    wo: usize,
    st: [usize; 2],
    padding: Padding,
) -> (usize, usize) {
    (pad_before(padding, x[1], kh, st[0], ho), pad_before(padding, x[2], kw, st[1], wo))
}

/// The geometry of one convolution: input NHWC, filter HWIO, output NHWC.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Conv {
    pub x: [usize; 4],
    pub w: [usize; 4],
    pub out: [usize; 4],
    pub strides: [usize; 2],
    pub padding: Padding,
}

impl Conv {
    /// Rows (`N·Ho·Wo`) and columns (`KH·KW·C`) of the patch matrix, its size checked.
    fn patches(&self, at: &str) -> Result<(usize, usize)> {
        let rows = self.out[0] * self.out[1] * self.out[2];
        let cols = self.w[0] * self.w[1] * self.w[2];
        rows.checked_mul(cols)
            .ok_or_else(|| runtime(at, format!("the patch matrix of {rows} x {cols} overflows")))?;
        Ok((rows, cols))
    }

    /// For each patch-matrix element, `f(row·cols + col, input index)` where it is not
    /// padding.
    fn walk(&self, mut f: impl FnMut(usize, usize)) {
        let [n, h, wd, c] = self.x;
        let [kh, kw, _, _] = self.w;
        let [_, ho, wo, _] = self.out;
        let (ph, pw) = conv_pads(self.x, kh, kw, ho, wo, self.strides, self.padding);
        let cols = kh * kw * c;
        for b in 0..n {
            for i in 0..ho {
                for j in 0..wo {
                    let row = ((b * ho + i) * wo + j) * cols;
                    for di in 0..kh {
                        let y = i * self.strides[0] + di;
                        if y < ph || y - ph >= h {
                            continue;
                        }
                        for dj in 0..kw {
                            let xx = j * self.strides[1] + dj;
                            if xx < pw || xx - pw >= wd {
                                continue;
                            }
                            let src = ((b * h + y - ph) * wd + xx - pw) * c;
                            let dst = row + (di * kw + dj) * c;
                            for ch in 0..c {
                                f(dst + ch, src + ch);
                            }
                        }
                    }
                }
            }
        }
    }

    fn im2col<T: Float>(&self, x: &[T], at: &str) -> Result<Vec<T>> {
        let (rows, cols) = self.patches(at)?;
        let mut p = vec![T::ZERO; rows * cols];
        self.walk(|pi, xi| p[pi] = x[xi]);
        Ok(p)
    }

    /// `conv2d(x, w)`.
    pub(crate) fn forward<T: Float>(
        &self,
        a: &mut dyn Alloc,
        x: &[T],
        w: &[T],
        at: &str,
    ) -> Result<Tensor> {
        let (rows, cols) = self.patches(at)?;
        let p = self.im2col(x, at)?;
        let o = self.w[3];
        let threads = a.threads();
        let mut d = a.alloc(T::DTYPE, rows * o)?;
        let lhs = Mat { data: &p, batch: 0, row: cols, col: 1 };
        let rhs = Mat { data: w, batch: 0, row: o, col: 1 };
        gemm(1, rows, o, cols, lhs, rhs, T::slice_mut(&mut d), threads);
        Ok(d)
    }

    /// The gradient with respect to the input: `g · wᵀ` scattered back from patches.
    pub(crate) fn backprop_input<T: Float>(
        &self,
        a: &mut dyn Alloc,
        g: &[T],
        w: &[T],
        at: &str,
    ) -> Result<Tensor> {
        let (rows, cols) = self.patches(at)?;
        let o = self.w[3];
        let mut dp = vec![T::ZERO; rows * cols];
        let lhs = Mat { data: g, batch: 0, row: o, col: 1 };
        let rhs = Mat { data: w, batch: 0, row: 1, col: o };
        gemm(1, rows, cols, o, lhs, rhs, &mut dp, a.threads());
        let mut d = a.alloc(T::DTYPE, self.x.iter().product())?;
        let dx = T::slice_mut(&mut d);
        dx.fill(T::ZERO);
        self.walk(|pi, xi| dx[xi] += dp[pi]);
        Ok(d)
    }

    /// The gradient with respect to the filter: `patchesᵀ · g`.
    pub(crate) fn backprop_filter<T: Float>(
        &self,
        a: &mut dyn Alloc,
        x: &[T],
        g: &[T],
        at: &str,
    ) -> Result<Tensor> {
        let (rows, cols) = self.patches(at)?;
        let p = self.im2col(x, at)?;
        let o = self.w[3];
        let threads = a.threads();
        let mut d = a.alloc(T::DTYPE, cols * o)?;
        let lhs = Mat { data: &p, batch: 0, row: 1, col: cols };
        let rhs = Mat { data: g, batch: 0, row: o, col: 1 };
        gemm(1, cols, o, rows, lhs, rhs, T::slice_mut(&mut d), threads);
        Ok(d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every compiled variant of the Threefry kernel this CPU runs (portable, AVX2,
    /// AVX-512) draws `random::uniform`'s bits, at every length around its 16 lanes.
    #[test]
    fn every_threefry_variant_draws_uniforms_bits() {
        for n in 0..50usize {
            let k1: Vec<i32> = (0..n).map(|e| (e as i32).wrapping_mul(-1_640_531_527)).collect();
            let k2: Vec<i32> = (0..n).map(|e| i32::MAX - 3 * e as i32).collect();
            let x: Vec<i32> = (0..n).map(|e| e as i32 * 7 - 11).collect();
            let want: Vec<u32> = (0..n)
                .map(|e| crate::random::uniform([k1[e] as u32, k2[e] as u32], x[e] as u32))
                .map(f32::to_bits)
                .collect();
            let bits = |out: &[f32]| out.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            let mut out = vec![0f32; n];
            threefry_chunk_any(&k1, &k2, &x, &mut out);
            assert_eq!(bits(&out), want, "portable, {n}");
            #[cfg(target_arch = "x86_64")]
            {
                if std::is_x86_feature_detected!("avx2") {
                    // SAFETY: AVX2 detected just above.
                    #[allow(unsafe_code)]
                    unsafe {
                        threefry_chunk_avx2(&k1, &k2, &x, &mut out)
                    };
                    assert_eq!(bits(&out), want, "AVX2, {n}");
                }
                if std::is_x86_feature_detected!("avx512f") {
                    // SAFETY: AVX-512F detected just above.
                    #[allow(unsafe_code)]
                    unsafe {
                        threefry_chunk_avx512(&k1, &k2, &x, &mut out)
                    };
                    assert_eq!(bits(&out), want, "AVX-512, {n}");
                }
            }
        }
    }

    /// Strides whose reach overflows `usize` are refused before the raw-pointer call:
    /// computed unchecked, `2 · (2^63 + 1)` wraps to 2 and would pass the bound.
    #[test]
    fn strides_that_overflow_are_refused_not_wrapped() {
        let data = [1.0f64; 16];
        let ok = Mat { data: &data, batch: 4, row: 2, col: 1 };
        let mut out = [0.0f64; 8];
        gemm(2, 2, 2, 2, ok, ok, &mut out, 1);
        assert!(out.iter().all(|&x| x == 2.0));
        let wraps = Mat { data: &data, batch: (1usize << 63) + 1, row: 2, col: 1 };
        let refused = std::panic::catch_unwind(|| {
            let mut out = [0.0f64; 12];
            gemm(3, 2, 2, 2, wraps, ok, &mut out, 1);
        });
        // The bound's own refusal (not an overflow trap, which release builds lack).
        let why = refused.expect_err("an overflowing stride reached the raw-pointer call");
        let why = why.downcast_ref::<&str>().copied().unwrap_or_default();
        assert_eq!(why, "lhs strides outside its buffer");
    }
}
