//! [`Op::CrossEntropy`] and its gradient fused on the CPU, for f32 and f64.
//!
//! The definition ([`cross_entropy_primitives`]) is a log-softmax over the logits, a
//! one-hot matrix of the labels, their product and a sum over the classes; its
//! gradient an exponential of the log-softmax, the one-hot matrix again and two
//! element-wise passes. At a language model's vocabulary (49,152 classes by 1,024
//! positions, 200 MB of f32 logits) each of those is a pass over memory. Here each
//! row is read from memory once: its maximum, then (from cache) the sum of its
//! exponentials and the label's log-probability. The gradient reads a row once and
//! writes it once, over the logits where nothing reads them after
//! ([`cross_entropy_grad_in_place`]); its exponentials and their scaling run while
//! the row is in cache. The row loops run at AVX-512's width where the CPU has it:
//! the exponentials bound them.
//!
//! The results follow the definition's formulas: the loss `−((x[label] − max) − ln s)`
//! with `s = Σ exp(x − max)`, the gradient `hot·t − exp(x − max)·(Σhot·t / s)` with `t
//! = −dloss`. For finite logits they differ from the definition's only in rounding (the
//! order of the sums, and the gradient dividing by `s` where the definition subtracts
//! `ln s`). A row with a non-finite logit has the definition's NaN loss (`0 · ±inf`
//! there), a non-finite cotangent the definition's NaN gradient row; otherwise a
//! label outside `0..C` has a loss and gradient of 0.
//!
//! [`cross_entropy_primitives`]: crate::composite::cross_entropy_primitives
//! [`Op::CrossEntropy`]: crate::Op::CrossEntropy

use meshwork_types::Tensor;

use super::float::Float;
use super::kernels::{Alloc, simd_dispatch};
use crate::Result;

/// Lanes of the row sweeps: 16 f32s fill an AVX-512 register.
const LANES: usize = 16;
/// Below this many logits the rows run on one thread.
const PARALLEL_MIN: usize = 1 << 15;

/// A row's maximum, NaN ignored (as the reference's `f64::max`).
#[inline(always)]
fn row_max<T: Float>(row: &[T]) -> T {
    let mut ms = [T::NEG_INFINITY; LANES];
    let mut chunks = row.chunks_exact(LANES);
    for c in &mut chunks {
        for (m, &e) in ms.iter_mut().zip(c) {
            *m = if e > *m { e } else { *m };
        }
    }
    let fmax = |m: T, x: T| if m.is_nan() || x > m { x } else { m };
    chunks.remainder().iter().fold(ms.into_iter().fold(T::NEG_INFINITY, fmax), |m, &e| fmax(m, e))
}

/// A sum over lanes, combined in lane order, then the remainder (summed apart).
#[inline(always)]
fn lanes_sum<T: Float>(lanes: [T; LANES], rest: T) -> T {
    lanes.into_iter().fold(T::ZERO, |s, e| s + e) + rest
}

/// A row's maximum, `ln Σ exp(x − max)`, and 0 if every `x − max` is finite, NaN
/// otherwise.
#[inline(always)]
fn row_stats<T: Float>(row: &[T]) -> (T, T, T) {
    let m = row_max(row);
    // Σ exp(x − m) in lanes, and Σ (x − m)·0: NaN exactly when some x − m is not
    // finite (where the definition's product with the one-hot row is NaN).
    let (mut ss, mut zs) = ([T::ZERO; LANES], [T::ZERO; LANES]);
    let mut chunks = row.chunks_exact(LANES);
    for c in &mut chunks {
        for ((s, z), &e) in ss.iter_mut().zip(zs.iter_mut()).zip(c) {
            let d = e - m;
            *s += d.exp_many();
            *z += d * T::ZERO;
        }
    }
    let (mut s, mut z) = (T::ZERO, T::ZERO);
    for &e in chunks.remainder() {
        let d = e - m;
        s += d.exp_many();
        z += d * T::ZERO;
    }
    (m, lanes_sum(ss, s).ln(), lanes_sum(zs, z))
}

/// The label of a row as a class, `None` outside `0..classes`.
fn class(label: i64, classes: usize) -> Option<usize> {
    usize::try_from(label).ok().filter(|&c| c < classes)
}

/// The loss of each row of `classes` logits against its label.
#[inline(always)]
fn loss_rows_any<T: Float>(x: &[T], labels: &[i64], out: &mut [T], classes: usize) {
    for ((row, &label), o) in x.chunks_exact(classes).zip(labels).zip(out) {
        let (m, ln_s, nan) = row_stats(row);
        *o = match class(label, classes) {
            Some(c) => -((row[c] - m) - ln_s) + nan,
            None => T::ZERO + nan,
        };
    }
}

/// The gradient of one row `o` holding its logits, in place, against its label and
/// loss cotangent: the exponentials written over the logits with their sum, then
/// scaled (the row is in cache).
#[inline(always)]
fn grad_row<T: Float>(o: &mut [T], label: i64, g: T) {
    let m = row_max(o);
    o.iter_mut().for_each(|o| *o = (*o - m).exp_many());
    let mut ss = [T::ZERO; LANES];
    let mut chunks = o.chunks_exact(LANES);
    for c in &mut chunks {
        for (s, &e) in ss.iter_mut().zip(c) {
            *s += e;
        }
    }
    let s = lanes_sum(ss, chunks.remainder().iter().fold(T::ZERO, |s, &e| s + e));
    let t = -g;
    let hot = class(label, o.len());
    // Σ_c hot_c · t: t for a label in range, 0 outside; each probability's share. A
    // cotangent that is not finite makes every `0 · t` of the definition NaN, so the
    // whole row, whatever the label (`poison` is NaN then, else 0).
    let poison = T::ZERO * t;
    let total = if hot.is_some() { t } else { T::ZERO } + poison;
    let r = total / s;
    o.iter_mut().for_each(|o| *o = T::ZERO - *o * r);
    if let Some(c) = hot {
        o[c] += t;
    }
}

/// The gradients of rows of `classes` logits `x` into `out`.
#[inline(always)]
fn grad_rows_any<T: Float>(x: &[T], labels: &[i64], g: &[T], out: &mut [T], classes: usize) {
    let rows = x.chunks_exact(classes).zip(out.chunks_exact_mut(classes));
    for (((row, o), &label), &g) in rows.zip(labels).zip(g) {
        o.copy_from_slice(row);
        grad_row(o, label, g);
    }
}

/// The gradients of rows of `classes` logits written over them.
#[inline(always)]
fn grad_rows_in_place_any<T: Float>(x: &mut [T], labels: &[i64], g: &[T], classes: usize) {
    for ((o, &label), &g) in x.chunks_exact_mut(classes).zip(labels).zip(g) {
        grad_row(o, label, g);
    }
}

simd_dispatch!(loss_rows, loss_rows_avx512, loss_rows_avx2, loss_rows_any,
    (x: &[T], labels: &[i64], out: &mut [T], classes: usize));
simd_dispatch!(grad_rows, grad_rows_avx512, grad_rows_avx2, grad_rows_any,
    (x: &[T], labels: &[i64], g: &[T], out: &mut [T], classes: usize));
simd_dispatch!(grad_rows_in_place, grad_rows_in_place_avx512, grad_rows_in_place_avx2,
    grad_rows_in_place_any, (x: &mut [T], labels: &[i64], g: &[T], classes: usize));

/// `f` over runs of whole rows (`out` holds `per_out` elements a row), spread over
/// `threads` where there are `elements` of work enough.
fn by_rows<T: Float, F>(threads: usize, elements: usize, out: &mut [T], per_out: usize, f: F)
where
    F: Fn(std::ops::Range<usize>, &mut [T]) + Sync,
{
    let rows = out.len() / per_out.max(1);
    if threads <= 1 || elements < PARALLEL_MIN || rows < 2 {
        f(0..rows, out);
        return;
    }
    let per = rows.div_ceil(threads);
    rayon::scope(|s| {
        for (k, o) in out.chunks_mut(per * per_out).enumerate() {
            let f = &f;
            let start = k * per;
            s.spawn(move |_| f(start..start + o.len() / per_out, o));
        }
    });
}

/// [`Op::CrossEntropy`](crate::Op::CrossEntropy) of `logits` (rows of `classes`)
/// against one label each.
pub(crate) fn cross_entropy<T: Float>(
    a: &mut dyn Alloc,
    logits: &[T],
    labels: &[i64],
    classes: usize,
) -> Result<Tensor> {
    let mut d = a.alloc(T::DTYPE, labels.len())?;
    let out = T::slice_mut(&mut d);
    if classes == 0 {
        // A sum over no classes.
        out.fill(T::ZERO);
        return Ok(d);
    }
    by_rows(a.threads(), logits.len(), out, 1, |r, o| {
        loss_rows(&logits[r.start * classes..r.end * classes], &labels[r.clone()], o, classes)
    });
    Ok(d)
}

/// [`Op::CrossEntropyGrad`](crate::Op::CrossEntropyGrad) of `logits` (rows of
/// `classes`) against one label and one loss cotangent each.
pub(crate) fn cross_entropy_grad<T: Float>(
    a: &mut dyn Alloc,
    logits: &[T],
    labels: &[i64],
    dloss: &[T],
    classes: usize,
) -> Result<Tensor> {
    let mut d = a.alloc(T::DTYPE, logits.len())?;
    let out = T::slice_mut(&mut d);
    if classes == 0 {
        return Ok(d);
    }
    by_rows(a.threads(), logits.len(), out, classes, |r, o| {
        let x = &logits[r.start * classes..r.end * classes];
        grad_rows(x, &labels[r.clone()], &dloss[r], o, classes)
    });
    Ok(d)
}

/// [`cross_entropy_grad`] written over the `logits` (a buffer no later step reads).
pub(crate) fn cross_entropy_grad_in_place<T: Float>(
    threads: usize,
    logits: &mut [T],
    labels: &[i64],
    dloss: &[T],
    classes: usize,
) {
    if classes == 0 {
        return;
    }
    let elements = logits.len();
    by_rows(threads, elements, logits, classes, |r, o| {
        grad_rows_in_place(o, &labels[r.clone()], &dloss[r], classes)
    });
}
