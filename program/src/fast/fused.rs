//! Elementwise fusion: chains of elementwise instructions (with their broadcasts,
//! comparisons, selects and bool→float conversions) run as one pass over memory.
//!
//! A group iterates one shape. It loads each outside value once per element (through
//! broadcast strides, so a bias of `[N]` added to `[B, N]` is read in place), runs a
//! small register program over chunks that stay in L1, and writes only the members that
//! something outside the group reads. A member's result never touches memory otherwise.

use meshwork_types::DType;

use super::float::Float;
use crate::op::{Binary, Compare, Op, Unary};
use crate::program::{Program, Value};
use meshwork_types::Tensor;

/// Elements per chunk: the registers of a chunk stay in L1.
const CHUNK: usize = 512;
/// Elements per chunk of a group whose outputs stream to memory: it is bound by memory,
/// and longer chunks fetch the next one (see [`prefetch`]) further ahead.
const STREAM_CHUNK: usize = 2048;
/// Outputs of at least this many bytes that are only results of the program stream past
/// the caches (a core's L2).
const RESULT_STREAM_BYTES: usize = 1 << 20;
/// Below this many elements a group runs on one thread.
const PARALLEL_MIN: usize = 1 << 15;

/// One instruction of a group's register program (operands are registers).
#[derive(Debug, Clone)]
pub(crate) enum Code {
    Unary(Unary, usize),
    Binary(Binary, usize, usize),
    Compare(Compare, usize, usize),
    Select(usize, usize, usize),
    Mov(usize),
}

/// An outside value a group reads.
#[derive(Debug, Clone)]
pub(crate) struct Load {
    pub value: Value,
    /// Its element stride along each (collapsed) dim of the group.
    pub strides: Vec<usize>,
    /// A bool value, read as 0/1.
    pub bool: bool,
}

/// A fused group of instructions.
#[derive(Debug, Clone)]
pub(crate) struct Group {
    /// The computing type (f32 or f64).
    pub dtype: DType,
    /// The result shape of every member.
    pub dims: Vec<usize>,
    /// The group's iteration dims after merging dims every load walks alike.
    pub collapsed: Vec<usize>,
    /// Register `k < loads.len()` holds load `k`.
    pub loads: Vec<Load>,
    /// `code[k]` defines register `loads.len() + k`; `slot[r]` is where register `r`
    /// lives.
    pub code: Vec<Code>,
    pub slot: Vec<usize>,
    pub slots: usize,
    /// Members written out: (register, value, bool).
    pub outputs: Vec<(usize, Value, bool)>,
    /// `direct[k]`: the output code `k` computes straight into (a float output no
    /// member reads).
    pub direct: Vec<Option<usize>>,
    /// The instructions (indices into the program's instructions).
    pub members: Vec<usize>,
    /// Every output is a result of the program that no other step reads (nothing in
    /// this run reads it again).
    pub results_only: bool,
    /// Some member is an exponential or a tanh (`exp`, `logistic`, `tanh`, `gelu`):
    /// the group is bound by computing, not memory, and runs at the widest vectors.
    pub transcendental: bool,
}

/// The float dtype a fusible instruction computes in, or `None` if it is not fusible.
fn fusible(program: &Program, i: usize) -> Option<DType> {
    let instr = &program.instrs()[i];
    let spec_of = |v: Value| program.spec(v).expect("a defined value");
    let out = instr.spec.dtype;
    // Groups compute in f32 or f64; half precision runs instruction by instruction.
    let wide = |d: DType| matches!(d, DType::F32 | DType::F64);
    match &instr.op {
        Op::Unary(_) | Op::Binary(_) | Op::Select | Op::BroadcastTo { .. } if wide(out) => {
            Some(out)
        }
        Op::Compare(_) if wide(spec_of(instr.args[0]).dtype) => Some(spec_of(instr.args[0]).dtype),
        Op::Convert { dtype } if wide(*dtype) => {
            let from = spec_of(instr.args[0]).dtype;
            (from == *dtype || from == DType::Bool).then_some(*dtype)
        }
        _ => None,
    }
}

/// Groups the program's fusible instructions. A group runs where its last member
/// stands; an instruction joins the open groups of its shape and computing type its
/// operands are members of (merging them into one), and a group closes as soon as an
/// instruction outside it reads one of its members, so running it late never starves a
/// reader.
pub(crate) fn plan(program: &Program) -> Vec<Group> {
    let np = program.params().len();
    let n = program.num_values();
    let mut group_of: Vec<Option<usize>> = vec![None; n];
    let mut open: Vec<bool> = Vec::new();
    let mut members: Vec<(DType, Vec<usize>, Vec<usize>)> = Vec::new();
    for (i, instr) in program.instrs().iter().enumerate() {
        let dims = instr.spec.shape.dims().to_vec();
        let mine = fusible(program, i).map(|t| {
            let mut gs: Vec<usize> = instr
                .args
                .iter()
                .filter_map(|a| group_of[a.index()])
                .filter(|&g| open[g])
                .collect();
            gs.sort_unstable();
            gs.dedup();
            // Groups of another shape or type are operands read as loads (a scalar
            // such as Adam's bias correction, broadcast), which close below.
            gs.retain(|g| members[*g].0 == t && members[*g].1 == dims);
            if !gs.is_empty() {
                // Every open group it reads is merged into the first (none of their
                // members has been read outside them yet, so the merged group may run
                // where its last member stands): Adam's `m` and `v` chains and the
                // update that reads both make one pass, not several.
                let g = gs[0];
                for &other in &gs[1..] {
                    let moved = std::mem::take(&mut members[other].2);
                    for &m in &moved {
                        group_of[np + m] = Some(g);
                    }
                    members[g].2.extend(moved);
                    open[other] = false;
                }
                members[g].2.push(i);
                members[g].2.sort_unstable();
                g
            } else {
                members.push((t, dims.clone(), vec![i]));
                open.push(true);
                members.len() - 1
            }
        });
        for a in &instr.args {
            if let Some(g) = group_of[a.index()]
                && Some(g) != mine
            {
                open[g] = false;
            }
        }
        group_of[np + i] = mine;
    }
    // Who reads each value from outside its group (`read_outside`), or returns it.
    let mut escapes = vec![false; n];
    let mut read_outside = vec![false; n];
    for r in program.results() {
        escapes[r.index()] = true;
    }
    for (i, instr) in program.instrs().iter().enumerate() {
        for a in &instr.args {
            if group_of[a.index()].is_some() && group_of[a.index()] != group_of[np + i] {
                escapes[a.index()] = true;
                read_outside[a.index()] = true;
            }
        }
    }
    members
        .into_iter()
        .filter(|(_, _, members)| !members.is_empty())
        .map(|(dtype, dims, members)| {
            build(program, dtype, dims, members, (&escapes, &read_outside))
        })
        .collect()
}

fn build(
    program: &Program,
    dtype: DType,
    dims: Vec<usize>,
    members: Vec<usize>,
    (escapes, read_outside): (&[bool], &[bool]),
) -> Group {
    let np = program.params().len();
    let member_values: Vec<Value> = members.iter().map(|&i| Value((np + i) as u32)).collect();
    let mut loads: Vec<Load> = Vec::new();
    // Loads first (registers 0..L), then one register per member.
    for &i in &members {
        for &a in &program.instrs()[i].args {
            if !member_values.contains(&a) && !loads.iter().any(|l| l.value == a) {
                let spec = program.spec(a).expect("a defined value");
                loads.push(Load {
                    value: a,
                    strides: broadcast_strides(spec.shape.dims(), &dims),
                    bool: spec.dtype == DType::Bool,
                });
            }
        }
    }
    let reg = |v: Value| -> usize {
        loads.iter().position(|l| l.value == v).unwrap_or_else(|| {
            loads.len() + member_values.iter().position(|&m| m == v).expect("a member")
        })
    };
    let code: Vec<Code> = members
        .iter()
        .map(|&i| {
            let instr = &program.instrs()[i];
            let a = |k: usize| reg(instr.args[k]);
            match &instr.op {
                Op::Unary(Unary::StopGradient | Unary::Barrier) => Code::Mov(a(0)),
                Op::Unary(u) => Code::Unary(*u, a(0)),
                Op::Binary(b) => Code::Binary(*b, a(0), a(1)),
                Op::Compare(c) => Code::Compare(*c, a(0), a(1)),
                Op::Select => Code::Select(a(0), a(1), a(2)),
                Op::Convert { .. } | Op::BroadcastTo { .. } => Code::Mov(a(0)),
                other => unreachable!("{} is not fusible", other.name()),
            }
        })
        .collect();
    let outputs: Vec<(usize, Value, bool)> = member_values
        .iter()
        .enumerate()
        .filter(|(_, v)| escapes[v.index()])
        .map(|(k, &v)| {
            (loads.len() + k, v, program.spec(v).expect("a member").dtype == DType::Bool)
        })
        .collect();
    let (slot, slots) = allocate(loads.len(), &code, &outputs);
    let read: Vec<usize> = code.iter().flat_map(operands).collect();
    let direct = (0..code.len())
        .map(|k| {
            let reg = loads.len() + k;
            outputs.iter().position(|&(r, _, b)| r == reg && !b).filter(|_| !read.contains(&reg))
        })
        .collect();
    let (collapsed, loads) = collapse(&dims, loads);
    let results = program.results();
    let results_only = !outputs.is_empty()
        && outputs.iter().all(|(_, v, _)| results.contains(v) && !read_outside[v.index()]);
    let transcendental = code.iter().any(|c| {
        matches!(c, Code::Unary(Unary::Exp | Unary::Logistic | Unary::Tanh | Unary::Gelu, _))
    });
    Group {
        dtype,
        dims,
        collapsed,
        loads,
        code,
        slot,
        slots,
        outputs,
        direct,
        members,
        results_only,
        transcendental,
    }
}

/// Element strides of a value of `from` dims read as broadcast (NumPy, right-aligned)
/// to `to` dims: 0 along broadcast dims.
pub(crate) fn broadcast_strides(from: &[usize], to: &[usize]) -> Vec<usize> {
    let lead = to.len() - from.len();
    let mut strides = vec![0usize; to.len()];
    let mut s = 1usize;
    for k in (0..from.len()).rev() {
        if from[k] != 1 {
            strides[lead + k] = s;
        }
        s *= from[k];
    }
    strides
}

/// Merges neighbouring dims that every load walks contiguously (or broadcasts along
/// both), dropping size-1 dims: `[B, N]` plus a bias of `[N]` stays two dims, `[B, N]`
/// plus `[B, N]` becomes one.
fn collapse(dims: &[usize], mut loads: Vec<Load>) -> (Vec<usize>, Vec<Load>) {
    let keep: Vec<usize> = (0..dims.len()).filter(|&d| dims[d] != 1).collect();
    let mut out: Vec<usize> = Vec::new();
    let mut strides: Vec<Vec<usize>> = vec![Vec::new(); loads.len()];
    for &d in &keep {
        let merge = !out.is_empty()
            && loads.iter().enumerate().all(|(k, l)| {
                let last = *strides[k].last().expect("a dim");
                last == l.strides[d] * dims[d]
            });
        if merge {
            *out.last_mut().expect("a dim") *= dims[d];
            for (k, l) in loads.iter().enumerate() {
                *strides[k].last_mut().expect("a dim") = l.strides[d];
            }
        } else {
            out.push(dims[d]);
            for (k, l) in loads.iter().enumerate() {
                strides[k].push(l.strides[d]);
            }
        }
    }
    if out.is_empty() {
        out.push(1);
        strides.iter_mut().for_each(|s| s.push(0));
    }
    for (l, s) in loads.iter_mut().zip(strides) {
        l.strides = s;
    }
    (out, loads)
}

/// Assigns registers to slots: a code result's slot is reused once its last reader
/// has run (a code's result never shares its operands' slots); loads keep theirs.
fn allocate(nloads: usize, code: &[Code], outputs: &[(usize, Value, bool)]) -> (Vec<usize>, usize) {
    let nregs = nloads + code.len();
    let mut last: Vec<Option<usize>> = vec![None; nregs];
    for (k, c) in code.iter().enumerate() {
        for r in operands(c) {
            last[r] = Some(k);
        }
    }
    for &(r, _, _) in outputs {
        last[r] = Some(usize::MAX);
    }
    let mut slot = vec![0usize; nregs];
    let mut freed = vec![false; nregs];
    let mut free: Vec<usize> = Vec::new();
    let mut slots = 0usize;
    let mut take = |free: &mut Vec<usize>| {
        free.pop().unwrap_or_else(|| {
            slots += 1;
            slots - 1
        })
    };
    for s in slot.iter_mut().take(nloads) {
        *s = take(&mut free);
    }
    for (k, c) in code.iter().enumerate() {
        let me = nloads + k;
        slot[me] = take(&mut free);
        // Load slots are never reused: a uniform load is filled once per run.
        for r in operands(c) {
            if r >= nloads && last[r] == Some(k) && !freed[r] {
                freed[r] = true;
                free.push(slot[r]);
            }
        }
        // A result nobody reads is dead at once.
        if last[me].is_none() {
            freed[me] = true;
            free.push(slot[me]);
        }
    }
    (slot, slots)
}

fn operands(c: &Code) -> Vec<usize> {
    match *c {
        Code::Unary(_, a) | Code::Mov(a) => vec![a],
        Code::Binary(_, a, b) | Code::Compare(_, a, b) => vec![a, b],
        Code::Select(p, t, f) => vec![p, t, f],
    }
}

/// Where a group's results go: one buffer per output, split into per-thread parts.
enum Out<'a, T> {
    Float(&'a mut [T]),
    Bool(&'a mut [bool]),
}

/// Runs `group` of computing type `T`: `inputs[k]` is load `k`'s data; returns the
/// outputs' data in `group.outputs` order. `alloc` hands out buffers.
pub(crate) fn run<T: Float>(
    group: &Group,
    inputs: &[&Tensor],
    options: &super::Options,
    alloc: &mut dyn FnMut(DType, usize) -> crate::Result<Tensor>,
) -> crate::Result<Vec<Tensor>> {
    let threads = options.threads;
    let total: usize = group.dims.iter().product();
    let mut outs: Vec<Tensor> = group
        .outputs
        .iter()
        .map(|&(_, _, b)| alloc(if b { DType::Bool } else { group.dtype }, total))
        .collect::<crate::Result<_>>()?;
    if total == 0 {
        return Ok(outs);
    }
    let parts = if total >= PARALLEL_MIN { threads.clamp(1, total / CHUNK + 1) } else { 1 };
    // Split every output into the same `parts` ranges.
    let bounds: Vec<usize> = (0..=parts).map(|p| total * p / parts).collect();
    let mut per_part: Vec<Vec<Out<'_, T>>> = (0..parts).map(|_| Vec::new()).collect();
    for d in outs.iter_mut() {
        match d {
            d if d.dtype() == DType::Bool => {
                let mut rest: &mut [bool] = crate::tensor::elems_mut(d);
                for (p, part) in per_part.iter_mut().enumerate() {
                    let (head, tail) = rest.split_at_mut(bounds[p + 1] - bounds[p]);
                    part.push(Out::Bool(head));
                    rest = tail;
                }
            }
            other => {
                let mut rest: &mut [T] = T::slice_mut(other);
                for (p, part) in per_part.iter_mut().enumerate() {
                    let (head, tail) = rest.split_at_mut(bounds[p + 1] - bounds[p]);
                    part.push(Out::Float(head));
                    rest = tail;
                }
            }
        }
    }
    // Outputs too large to stay in cache are written with streaming stores, which
    // skip reading each line before overwriting it.
    // So are outputs larger than a core's L2 that nothing in this run reads again (an
    // optimizer's new weights and moments: 17% faster for Adam's update of a 1536x576
    // weight on the 2-core AVX-512 VM).
    let bytes = total.saturating_mul(group.dtype.size_in_bytes());
    let stream =
        bytes >= options.stream_bytes || (group.results_only && bytes >= RESULT_STREAM_BYTES);
    if parts == 1 {
        let part = per_part.pop().expect("one part");
        dispatch(group, inputs, 0, total, part, stream);
    } else {
        rayon::scope(|s| {
            for (p, part) in per_part.into_iter().enumerate() {
                let (start, end) = (bounds[p], bounds[p + 1]);
                s.spawn(move |_| dispatch(group, inputs, start, end, part, stream));
            }
        });
    }
    Ok(outs)
}

/// Runs [`run_range`] compiled for AVX2 where the CPU has it (the default target is
/// x86-64 with SSE2 only, half the vector width), and a group bound by its
/// exponentials for AVX-512 where the CPU has that.
fn dispatch<T: Float>(
    group: &Group,
    inputs: &[&Tensor],
    start: usize,
    end: usize,
    outs: Vec<Out<'_, T>>,
    stream: bool,
) {
    #[cfg(target_arch = "x86_64")]
    if group.transcendental
        && std::is_x86_feature_detected!("avx512f")
        && std::is_x86_feature_detected!("avx2")
        && std::is_x86_feature_detected!("fma")
    {
        // SAFETY: `run_range_avx512` only needs the CPU to have AVX-512F, AVX2 and FMA,
        // checked just above; it is otherwise `run_range`.
        #[allow(unsafe_code)]
        unsafe {
            run_range_avx512(group, inputs, start, end, outs, stream)
        };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: `run_range_avx2` only needs the CPU to have AVX2 and FMA, which was
        // checked just above; it is otherwise `run_range`.
        #[allow(unsafe_code)]
        unsafe {
            run_range_avx2(group, inputs, start, end, outs, stream)
        };
        return;
    }
    run_range(group, inputs, start, end, outs, false);
}

/// [`run_range`] at AVX-512's width: for groups bound by their exponentials rather
/// than by memory (twice AVX2's rate on a Zen 4 core; memory-bound groups gain
/// nothing).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
#[allow(unsafe_code)]
unsafe fn run_range_avx512<T: Float>(
    group: &Group,
    inputs: &[&Tensor],
    start: usize,
    end: usize,
    outs: Vec<Out<'_, T>>,
    stream: bool,
) {
    run_range(group, inputs, start, end, outs, stream);
    if stream {
        // As `run_range_avx2`: fence the streaming stores.
        std::arch::x86_64::_mm_sfence();
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(unsafe_code)]
unsafe fn run_range_avx2<T: Float>(
    group: &Group,
    inputs: &[&Tensor],
    start: usize,
    end: usize,
    outs: Vec<Out<'_, T>>,
    stream: bool,
) {
    run_range(group, inputs, start, end, outs, stream);
    if stream {
        // Streaming stores are weakly ordered: fence them before this part reports
        // done to the thread that reads the output.
        std::arch::x86_64::_mm_sfence();
    }
}

/// Copies `src` into `dst` (of equal length) with streaming stores where the CPU has
/// AVX, else an ordinary copy. The caller fences before the data is read elsewhere.
fn stream_copy<T: Float>(dst: &mut [T], src: &[T]) {
    assert_eq!(dst.len(), src.len(), "stream_copy of unequal lengths");
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx") && 32 % size_of::<T>() == 0 {
        // SAFETY: AVX was detected just above; `stream_copy_avx` stays within the two
        // slices, which have the same length.
        #[allow(unsafe_code)]
        unsafe {
            stream_copy_avx(dst, src)
        };
        return;
    }
    dst.copy_from_slice(src);
}

/// [`stream_copy`] for a CPU with AVX: ordinary stores up to the first 32-byte
/// boundary of `dst`, 32-byte streaming stores, ordinary stores for the tail.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
#[allow(unsafe_code)]
unsafe fn stream_copy_avx<T: Float>(dst: &mut [T], src: &[T]) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256};
    let n = dst.len().min(src.len());
    let size = size_of::<T>();
    let lanes = 32 / size;
    // Elements before `dst` reaches a 32-byte boundary (T's alignment divides 32).
    let head = (dst.as_ptr().align_offset(32)).min(n);
    dst[..head].copy_from_slice(&src[..head]);
    let body = (n - head) / lanes * lanes;
    let mut k = head;
    while k < head + body {
        // SAFETY: `k + lanes <= n`, so both 32-byte blocks lie within the slices;
        // `dst + k` is 32-byte aligned (from `head`, in steps of 32 bytes), as
        // `_mm256_stream_si256` requires; the load is unaligned.
        unsafe {
            let v = _mm256_loadu_si256(src.as_ptr().add(k).cast::<__m256i>());
            _mm256_stream_si256(dst.as_mut_ptr().add(k).cast::<__m256i>(), v);
        }
        k += lanes;
    }
    dst[k..n].copy_from_slice(&src[k..n]);
}

/// Computes elements `start..end` (row-major over the group's dims) into `outs`.
///
/// A chunk never crosses a row of the innermost (collapsed) dim, so a load walking it
/// with stride 1 is read in place; other loads are gathered into a chunk buffer (a
/// uniform one filled once). A member written out that no member reads is computed
/// straight into its output.
#[inline(always)]
fn run_range<T: Float>(
    group: &Group,
    inputs: &[&Tensor],
    start: usize,
    end: usize,
    mut outs: Vec<Out<'_, T>>,
    stream: bool,
) {
    let dims = &group.collapsed;
    let r = dims.len();
    let inner = dims[r - 1];
    let nl = group.loads.len();
    let chunk = if stream { STREAM_CHUNK } else { CHUNK };
    let mut regs: Vec<Vec<T>> = (0..group.slots).map(|_| vec![T::ZERO; chunk]).collect();
    // Loads of one element everywhere (scalars, constants) are filled once.
    let uniform: Vec<bool> =
        group.loads.iter().map(|l| l.strides.iter().all(|&s| s == 0)).collect();
    let in_place: Vec<bool> = group
        .loads
        .iter()
        .zip(&uniform)
        .map(|(l, &u)| !u && !l.bool && l.strides[r - 1] == 1)
        .collect();
    let floats: Vec<&[T]> = group
        .loads
        .iter()
        .zip(inputs)
        .map(|(l, src)| if l.bool { &[][..] } else { T::slice(src) })
        .collect();
    let mut lbuf: Vec<Vec<T>> =
        in_place.iter().map(|&p| if p { Vec::new() } else { vec![T::ZERO; chunk] }).collect();
    for (k, (load, src)) in group.loads.iter().zip(inputs).enumerate() {
        if uniform[k] {
            let v = if load.bool {
                let v: &[bool] = crate::tensor::elems(src);
                if v[0] { T::ONE } else { T::ZERO }
            } else {
                floats[k][0]
            };
            lbuf[k].fill(v);
        }
    }
    let uniform_value = |reg: usize| (reg < nl && uniform[reg]).then(|| lbuf[reg][0]);
    let resolved: Vec<Resolved<'_, T>> = group
        .code
        .iter()
        .map(|c| match *c {
            Code::Binary(op, a, b) => match (uniform_value(a), uniform_value(b)) {
                (None, Some(s)) => Resolved::Scalar(op, a, s, false),
                (Some(s), None) => Resolved::Scalar(op, b, s, true),
                _ => Resolved::Code(c),
            },
            _ => Resolved::Code(c),
        })
        .collect();
    // Outputs streamed past the caches are computed into a register first.
    let direct: Vec<Option<usize>> =
        group.direct.iter().map(|&d| if stream { None } else { d }).collect();
    let written: Vec<bool> = (0..group.outputs.len()).map(|o| direct.contains(&Some(o))).collect();
    let mut offs = vec![0usize; nl];
    let mut pos = start;
    while pos < end {
        let row = pos / inner;
        let j = pos % inner;
        let n = chunk.min(inner - j).min(end - pos);
        // Each load's first element of this chunk.
        for (k, (load, src)) in group.loads.iter().zip(inputs).enumerate() {
            if uniform[k] {
                continue;
            }
            let mut off = j * load.strides[r - 1];
            let mut rest = row;
            for d in (0..r - 1).rev() {
                off += (rest % dims[d]) * load.strides[d];
                rest /= dims[d];
            }
            offs[k] = off;
            if in_place[k] {
                prefetch(&floats[k][(off + n).min(floats[k].len())..], n);
                continue;
            }
            let s = load.strides[r - 1];
            let dst = &mut lbuf[k][..n];
            if load.bool {
                let v: &[bool] = crate::tensor::elems(src);
                for (e, o) in dst.iter_mut().enumerate() {
                    *o = if v[off + e * s] { T::ONE } else { T::ZERO };
                }
            } else {
                let v = floats[k];
                match s {
                    0 => dst.fill(v[off]),
                    _ => dst.iter_mut().enumerate().for_each(|(e, o)| *o = v[off + e * s]),
                }
            }
        }
        let off = pos - start;
        for (k, c) in resolved.iter().enumerate() {
            // The member's own slot, taken out while the others are read, unless it is
            // computed straight into its output.
            let d = group.slot[nl + k];
            let mut taken =
                if direct[k].is_none() { std::mem::take(&mut regs[d]) } else { Vec::new() };
            let chunk = Chunk {
                n,
                in_place: &in_place,
                floats: &floats,
                offs: &offs,
                lbuf: &lbuf,
                regs: &regs,
                slot: &group.slot,
            };
            let out = match direct[k] {
                Some(o) => {
                    let Out::Float(v) = &mut outs[o] else { unreachable!("a float output") };
                    &mut v[off..off + n]
                }
                None => &mut taken[..n],
            };
            eval(c, |reg| chunk.get(reg), out);
            if direct[k].is_none() {
                regs[d] = taken;
            }
        }
        for (o, (out, &(reg, _, _))) in outs.iter_mut().zip(&group.outputs).enumerate() {
            if written[o] {
                continue;
            }
            let src = &regs[group.slot[reg]][..n];
            match out {
                Out::Float(v) if stream => stream_copy(&mut v[off..off + n], src),
                Out::Float(v) => v[off..off + n].copy_from_slice(src),
                Out::Bool(v) => {
                    v[off..off + n].iter_mut().zip(src).for_each(|(b, &x)| *b = x != T::ZERO)
                }
            }
        }
        pos += n;
    }
}

/// Asks the CPU to bring the first `n` elements of `v` into cache (the next chunk of
/// a load read in place, so its memory traffic overlaps this chunk's arithmetic).
#[inline(always)]
fn prefetch<T>(v: &[T], n: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        let n = n.min(v.len());
        let line = 64 / size_of::<T>().max(1);
        let mut k = 0;
        while k < n {
            // SAFETY: a prefetch is a hint that never faults, and the pointer is within
            // `v` (`k < v.len()`).
            #[allow(unsafe_code)]
            unsafe {
                _mm_prefetch::<_MM_HINT_T0>(v.as_ptr().add(k).cast::<i8>())
            };
            k += line;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (v, n);
}

/// Where a chunk's registers are: loads read in place or from their chunk buffer,
/// members in their slots.
struct Chunk<'a, T> {
    n: usize,
    in_place: &'a [bool],
    floats: &'a [&'a [T]],
    offs: &'a [usize],
    lbuf: &'a [Vec<T>],
    regs: &'a [Vec<T>],
    slot: &'a [usize],
}

impl<'a, T> Chunk<'a, T> {
    #[inline(always)]
    fn get(&self, reg: usize) -> &'a [T] {
        let n = self.n;
        match self.in_place.get(reg) {
            Some(true) => &self.floats[reg][self.offs[reg]..self.offs[reg] + n],
            Some(false) => &self.lbuf[reg][..n],
            None => &self.regs[self.slot[reg]][..n],
        }
    }
}

/// A register instruction as a run sees it: a binary op with a uniform operand reads
/// that operand as a scalar (`left`: the scalar is the first operand).
#[derive(Clone, Copy)]
enum Resolved<'c, T> {
    Code(&'c Code),
    Scalar(Binary, usize, T, bool),
}

/// One register instruction over a chunk.
#[inline(always)]
fn eval<'a, T: Float>(c: &Resolved<'_, T>, r: impl Fn(usize) -> &'a [T], out: &mut [T]) {
    macro_rules! map1 {
        ($a:expr, |$x:ident| $e:expr) => {
            for (o, &$x) in out.iter_mut().zip(r($a)) {
                *o = $e;
            }
        };
    }
    macro_rules! map2 {
        ($a:expr, $b:expr, |$x:ident, $y:ident| $e:expr) => {
            for ((o, &$x), &$y) in out.iter_mut().zip(r($a)).zip(r($b)) {
                *o = $e;
            }
        };
    }
    let bool_of = |b: bool| if b { T::ONE } else { T::ZERO };
    let c = match *c {
        Resolved::Code(c) => c,
        Resolved::Scalar(op, a, s, left) => {
            match (op, left) {
                (Binary::Add, _) => map1!(a, |x| x + s),
                (Binary::Mul, _) => map1!(a, |x| x * s),
                (Binary::Sub, false) => map1!(a, |x| x - s),
                (Binary::Sub, true) => map1!(a, |x| s - x),
                (Binary::Div, false) => map1!(a, |x| x / s),
                (Binary::Div, true) => map1!(a, |x| s / x),
                (Binary::Max, false) => map1!(a, |x| x.max_nan(s)),
                (Binary::Max, true) => map1!(a, |x| s.max_nan(x)),
                (Binary::Min, false) => map1!(a, |x| x.min_nan(s)),
                (Binary::Min, true) => map1!(a, |x| s.min_nan(x)),
                (Binary::Pow, false) => map1!(a, |x| x.powf(s)),
                (Binary::Pow, true) => map1!(a, |x| s.powf(x)),
            }
            return;
        }
    };
    match *c {
        Code::Mov(a) => out.copy_from_slice(r(a)),
        Code::Unary(u, a) => match u {
            Unary::Neg => map1!(a, |x| -x),
            Unary::Exp => map1!(a, |x| x.exp_many()),
            Unary::Log => map1!(a, |x| x.ln()),
            Unary::Tanh => map1!(a, |x| x.tanh_many()),
            Unary::Logistic => map1!(a, |x| T::ONE / (T::ONE + (-x).exp_many())),
            Unary::Sqrt => map1!(a, |x| x.sqrt()),
            Unary::Rsqrt => map1!(a, |x| T::ONE / x.sqrt()),
            Unary::Abs => map1!(a, |x| x.abs()),
            Unary::Square => map1!(a, |x| x * x),
            // One comparison, so it vectorizes: NaN <= 0 is false, so NaN stays NaN.
            Unary::Relu => map1!(a, |x| if x <= T::ZERO { T::ZERO } else { x }),
            Unary::Gelu => {
                let c = T::from_f64((2.0 / std::f64::consts::PI).sqrt());
                let (half, k) = (T::from_f64(0.5), T::from_f64(0.044715));
                map1!(a, |x| half * x * (T::ONE + (c * (x + k * x * x * x)).tanh_many()))
            }
            Unary::Sin => map1!(a, |x| x.sin()),
            Unary::Cos => map1!(a, |x| x.cos()),
            Unary::StopGradient | Unary::Barrier => out.copy_from_slice(r(a)),
        },
        Code::Binary(b, a1, a2) => match b {
            Binary::Add => map2!(a1, a2, |x, y| x + y),
            Binary::Sub => map2!(a1, a2, |x, y| x - y),
            Binary::Mul => map2!(a1, a2, |x, y| x * y),
            Binary::Div => map2!(a1, a2, |x, y| x / y),
            Binary::Max => map2!(a1, a2, |x, y| x.max_nan(y)),
            Binary::Min => map2!(a1, a2, |x, y| x.min_nan(y)),
            Binary::Pow => map2!(a1, a2, |x, y| x.powf(y)),
        },
        Code::Compare(cmp, a1, a2) => match cmp {
            Compare::Lt => map2!(a1, a2, |x, y| bool_of(x < y)),
            Compare::Le => map2!(a1, a2, |x, y| bool_of(x <= y)),
            Compare::Gt => map2!(a1, a2, |x, y| bool_of(x > y)),
            Compare::Ge => map2!(a1, a2, |x, y| bool_of(x >= y)),
            Compare::Eq => map2!(a1, a2, |x, y| bool_of(x == y)),
            Compare::Ne => map2!(a1, a2, |x, y| bool_of(x != y)),
        },
        Code::Select(p, t, f) => {
            for (((o, &c), &x), &y) in out.iter_mut().zip(r(p)).zip(r(t)).zip(r(f)) {
                *o = if c != T::ZERO { x } else { y };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    proptest! {
        /// Streaming copies write exactly `src` into `dst` at every alignment and
        /// length (head, 32-byte body, tail), and nothing beside it.
        #[test]
        fn prop_stream_copy_writes_exactly_its_range(len in 0usize..200, at in 0usize..9) {
            let src32: Vec<f32> = (0..len).map(|k| k as f32 + 0.5).collect();
            let mut buf32 = vec![-1f32; len + 16];
            super::stream_copy(&mut buf32[at..at + len], &src32);
            prop_assert!(buf32[..at].iter().chain(&buf32[at + len..]).all(|&x| x == -1.0));
            prop_assert_eq!(&buf32[at..at + len], &src32[..]);
            let src64: Vec<f64> = (0..len).map(|k| k as f64 - 0.25).collect();
            let mut buf64 = vec![-1f64; len + 16];
            super::stream_copy(&mut buf64[at..at + len], &src64);
            prop_assert!(buf64[..at].iter().chain(&buf64[at + len..]).all(|&x| x == -1.0));
            prop_assert_eq!(&buf64[at..at + len], &src64[..]);
        }
    }
}
