//! [`Op::Attention`] and its gradients fused on the CPU, for f32 and f64.
//!
//! The definition ([`attention_primitives`]) computes every score `[Tq, Tk]` of every
//! head, masks the keys after each query to `-1e9`, softmaxes and multiplies by the
//! values: six products of a head's whole `[T, T]` (two forward, four backward) and
//! five passes of element-wise work over scores in memory. Here each head runs on one
//! thread, its queries [`QUERY_BLOCK`] at a time: a block's scores are computed only
//! against the keys its last query sees (under a causal mask, a block of 64 queries at
//! T 256 skips on average 3/8 of the keys), scaled, masked and softmaxed while they are
//! in cache, then multiplied out. The backward pass recomputes a block's
//! probabilities (one product) and computes every gradient asked for from them at
//! once ([`gradients`]): five products in all, against the definition's four plus the
//! forward's saved scores.
//!
//! A masked score is `exp(-1e9 − max)` in the definition, exactly 0 in f32 and f64, so
//! skipping it changes no sum: for finite operands the results differ from the
//! definition's only in the order products and sums are rounded (and the backward
//! pass multiplies by `1/scale` where the definition divides). Non-finite operands
//! differ where the definition multiplies a masked key's 0 by them: a NaN or infinite
//! value of a key reaches only the queries that see it here (every query there), and
//! a row whose visible scores are all `-inf` is NaN here (uniform over the masked keys
//! there).
//!
//! [`attention_primitives`]: crate::composite::attention_primitives
//! [`Op::Attention`]: crate::Op::Attention

use meshwork_types::Tensor;

use super::float::Float;
use super::kernels::{Alloc, Mat, gemm_into, softmax_rows};
use crate::Result;
use crate::op::AttentionSpec;

/// Queries a block holds: its scores `[64, ≤Tk]` stay in a core's L2.
const QUERY_BLOCK: usize = 64;

/// The shapes of an attention: `q [B, H, Tq, D]`, `k [B, H, Tk, D]`, `v [B, H, Tk,
/// Dv]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Heads {
    /// `B · H`.
    pub heads: usize,
    pub tq: usize,
    pub tk: usize,
    pub d: usize,
    pub dv: usize,
}

impl Heads {
    /// The shapes of operands `q`, `k`, `v` if the fused kernel computes their
    /// attention: rank 4, one `[B, H]`, keys and values of one length, and under a
    /// causal mask no more queries than keys (else the first queries see no key, which
    /// the definition softmaxes over every key: left to it).
    pub(crate) fn of(q: &[usize], k: &[usize], v: &[usize], spec: &AttentionSpec) -> Option<Heads> {
        let four = q.len() == 4 && k.len() == 4 && v.len() == 4;
        if !four || q[..2] != k[..2] || q[..2] != v[..2] || k[2] != v[2] || q[3] != k[3] {
            return None;
        }
        if spec.causal && q[2] > k[2] {
            return None;
        }
        Some(Heads { heads: q[0] * q[1], tq: q[2], tk: k[2], d: q[3], dv: v[3] })
    }

    /// Keys query `i` sees.
    fn visible(&self, spec: &AttentionSpec, i: usize) -> usize {
        if spec.causal { i + (self.tk - self.tq) + 1 } else { self.tk }
    }
}

/// Scales the scores `s[..n]` as the definition does.
#[inline(always)]
fn scale<T: Float>(s: &mut [T], spec: &AttentionSpec) {
    let c = T::from_f64(spec.scale);
    if spec.divide {
        s.iter_mut().for_each(|x| *x = *x / c);
    } else {
        s.iter_mut().for_each(|x| *x = *x * c);
    }
}

/// The probabilities of queries `r0..r1` of one head against its first `n` keys (the
/// last query's visible ones) into `p` (`[r1 − r0, n]`, row-major), each row's masked
/// keys 0; `s` is scratch of the same size.
#[allow(clippy::too_many_arguments)]
fn probabilities<T: Float>(
    h: &Heads,
    spec: &AttentionSpec,
    q: &[T],
    k: &[T],
    (r0, r1, n): (usize, usize, usize),
    s: &mut [T],
    p: &mut [T],
) {
    let rows = r1 - r0;
    let (s, p) = (&mut s[..rows * n], &mut p[..rows * n]);
    gemm_into(
        rows,
        n,
        h.d,
        Mat { data: &q[r0 * h.d..], batch: 0, row: h.d, col: 1 },
        Mat { data: k, batch: 0, row: 1, col: h.d },
        s,
        n,
        false,
    );
    for (i, (srow, prow)) in (r0..r1).zip(s.chunks_mut(n).zip(p.chunks_mut(n))) {
        let vis = h.visible(spec, i).min(n);
        if vis > 0 {
            scale(&mut srow[..vis], spec);
            softmax_rows(&srow[..vis], &mut prow[..vis], vis, false);
        }
        prow[vis..].fill(T::ZERO);
    }
}

/// The attention of `q`, `k`, `v` (row-major, of shapes `h`): `[B, H, Tq, Dv]`.
pub(crate) fn attention<T: Float>(
    a: &mut dyn Alloc,
    h: Heads,
    spec: &AttentionSpec,
    [q, k, v]: [&[T]; 3],
) -> Result<Tensor> {
    let mut out = a.alloc(T::DTYPE, h.heads * h.tq * h.dv)?;
    let o = T::slice_mut(&mut out);
    if o.is_empty() {
        return Ok(out);
    }
    let head = |j: usize, oh: &mut [T], scratch: &mut Vec<T>| {
        let (qh, kh, vh) = (
            &q[j * h.tq * h.d..][..h.tq * h.d],
            &k[j * h.tk * h.d..][..h.tk * h.d],
            &v[j * h.tk * h.dv..][..h.tk * h.dv],
        );
        let block = QUERY_BLOCK.min(h.tq);
        scratch.resize(2 * block * h.tk, T::ZERO);
        let (s, p) = scratch.split_at_mut(block * h.tk);
        for r0 in (0..h.tq).step_by(block) {
            let r1 = (r0 + block).min(h.tq);
            let n = h.visible(spec, r1 - 1).min(h.tk);
            probabilities(&h, spec, qh, kh, (r0, r1, n), s, p);
            gemm_into(
                r1 - r0,
                h.dv,
                n,
                Mat { data: p, batch: 0, row: n, col: 1 },
                Mat { data: vh, batch: 0, row: h.dv, col: 1 },
                &mut oh[r0 * h.dv..],
                h.dv,
                false,
            );
        }
    };
    over_heads(a.threads(), h.heads, &mut [(o, h.tq * h.dv)], |j, parts, scratch| {
        head(j, &mut *parts[0], scratch)
    });
    Ok(out)
}

/// The gradients of the attention of `q`, `k`, `v` with respect to the operands
/// `wanted` asks for (0 the queries, 1 the keys, 2 the values), given the cotangent
/// `dout` of its result: one buffer per wanted operand, in `wanted`'s order.
pub(crate) fn gradients<T: Float>(
    a: &mut dyn Alloc,
    h: Heads,
    spec: &AttentionSpec,
    [q, k, v, dout]: [&[T]; 4],
    wanted: &[usize],
) -> Result<Vec<Tensor>> {
    let sizes = [h.tq * h.d, h.tk * h.d, h.tk * h.dv];
    let mut outs: Vec<Tensor> =
        wanted.iter().map(|&w| a.alloc(T::DTYPE, h.heads * sizes[w])).collect::<Result<_>>()?;
    let want = |w: usize| wanted.iter().position(|&x| x == w);
    let (iq, ik, iv) = (want(0), want(1), want(2));
    let head = |j: usize, parts: &mut [&mut [T]], scratch: &mut Vec<T>| {
        let (qh, kh, vh, doh) = (
            &q[j * sizes[0]..][..sizes[0]],
            &k[j * sizes[1]..][..sizes[1]],
            &v[j * sizes[2]..][..sizes[2]],
            &dout[j * h.tq * h.dv..][..h.tq * h.dv],
        );
        for (w, part) in wanted.iter().zip(parts.iter_mut()) {
            if *w != 0 {
                // The keys' and values' gradients add up over the query blocks.
                part.fill(T::ZERO);
            }
        }
        let block = QUERY_BLOCK.min(h.tq);
        scratch.resize(2 * block * h.tk, T::ZERO);
        let (s, p) = scratch.split_at_mut(block * h.tk);
        let factor =
            if spec.divide { T::ONE / T::from_f64(spec.scale) } else { T::from_f64(spec.scale) };
        for r0 in (0..h.tq).step_by(block) {
            let r1 = (r0 + block).min(h.tq);
            let rows = r1 - r0;
            let n = h.visible(spec, r1 - 1).min(h.tk);
            probabilities(&h, spec, qh, kh, (r0, r1, n), s, p);
            let dob = &doh[r0 * h.dv..];
            if let Some(iv) = iv {
                // dV[..n] += Pᵀ · dO
                gemm_into(
                    n,
                    h.dv,
                    rows,
                    Mat { data: p, batch: 0, row: 1, col: n },
                    Mat { data: dob, batch: 0, row: h.dv, col: 1 },
                    &mut *parts[iv],
                    h.dv,
                    true,
                );
            }
            if iq.is_none() && ik.is_none() {
                continue;
            }
            // dP = dO · Vᵀ, into `s`; then the scores' gradient P ∘ (dP − Σ P ∘ dP),
            // times the scale's factor, in place.
            let ds = &mut s[..rows * n];
            gemm_into(
                rows,
                n,
                h.dv,
                Mat { data: dob, batch: 0, row: h.dv, col: 1 },
                Mat { data: vh, batch: 0, row: 1, col: h.dv },
                ds,
                n,
                false,
            );
            for (i, (drow, prow)) in (r0..r1).zip(ds.chunks_mut(n).zip(p.chunks(n))) {
                let vis = h.visible(spec, i).min(n);
                let dot = dot(&drow[..vis], &prow[..vis]);
                for (d, &pr) in drow[..vis].iter_mut().zip(&prow[..vis]) {
                    *d = pr * (*d - dot) * factor;
                }
                drow[vis..].fill(T::ZERO);
            }
            if let Some(iq) = iq {
                // dQ[r0..r1] = dS · K[..n]
                gemm_into(
                    rows,
                    h.d,
                    n,
                    Mat { data: ds, batch: 0, row: n, col: 1 },
                    Mat { data: kh, batch: 0, row: h.d, col: 1 },
                    &mut parts[iq][r0 * h.d..],
                    h.d,
                    false,
                );
            }
            if let Some(ik) = ik {
                // dK[..n] += dSᵀ · Q[r0..r1]
                gemm_into(
                    n,
                    h.d,
                    rows,
                    Mat { data: ds, batch: 0, row: 1, col: n },
                    Mat { data: &qh[r0 * h.d..], batch: 0, row: h.d, col: 1 },
                    &mut *parts[ik],
                    h.d,
                    true,
                );
            }
        }
    };
    let mut parts: Vec<(&mut [T], usize)> =
        outs.iter_mut().zip(wanted).map(|(t, &w)| (T::slice_mut(t), sizes[w])).collect();
    if h.heads > 0 && h.tq > 0 {
        over_heads(a.threads(), h.heads, &mut parts, head);
    } else {
        // No query: the keys' and values' gradients are zero.
        parts.iter_mut().for_each(|(p, _)| p.fill(T::ZERO));
    }
    Ok(outs)
}

/// `Σ a_i b_i` over 8 lanes, so it vectorizes.
#[inline(always)]
fn dot<T: Float>(a: &[T], b: &[T]) -> T {
    let mut acc = [T::ZERO; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let tail = ra.iter().zip(rb).fold(T::ZERO, |s, (&x, &y)| s + x * y);
    acc.into_iter().fold(T::ZERO, |s, x| s + x) + tail
}

/// Runs `head(j, parts of head j, scratch)` for every head `j < heads`, the heads
/// split in contiguous runs over `threads` threads; `outs` are the buffers split by
/// head, each with its per-head length; `scratch` is the thread's own.
fn over_heads<T: Float>(
    threads: usize,
    heads: usize,
    outs: &mut [(&mut [T], usize)],
    head: impl Fn(usize, &mut [&mut [T]], &mut Vec<T>) + Sync,
) {
    let threads = threads.clamp(1, heads.max(1));
    let per = heads.div_ceil(threads);
    // Each output's heads, split into the threads' runs (thread `t` takes heads
    // `t·per..(t + 1)·per`, the last fewer).
    let lens: Vec<usize> = outs.iter().map(|(_, l)| *l).collect();
    let mut runs: Vec<Vec<&mut [T]>> = (0..threads).map(|_| Vec::new()).collect();
    for (buf, len) in outs.iter_mut() {
        let mut rest: &mut [T] = buf;
        for (t, run) in runs.iter_mut().enumerate() {
            let count = per.min(heads.saturating_sub(t * per));
            let (mine, tail) = std::mem::take(&mut rest).split_at_mut(count * *len);
            run.push(mine);
            rest = tail;
        }
    }
    let run = |t: usize, mut bufs: Vec<&mut [T]>| {
        // Each thread's scratch (a block's scores and probabilities), reused by its
        // heads.
        let mut scratch = Vec::new();
        for j in t * per..((t + 1) * per).min(heads) {
            let local = j - t * per;
            let mut parts: Vec<&mut [T]> = bufs
                .iter_mut()
                .zip(&lens)
                .map(|(b, &len)| &mut b[local * len..(local + 1) * len])
                .collect();
            head(j, &mut parts, &mut scratch);
        }
    };
    if threads == 1 {
        run(0, runs.pop().unwrap_or_default());
        return;
    }
    rayon::scope(|s| {
        for (t, bufs) in runs.into_iter().enumerate() {
            let run = &run;
            s.spawn(move |_| run(t, bufs));
        }
    });
}
