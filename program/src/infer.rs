//! Shape and dtype inference: the spec of an op's result from its operands' specs and
//! its attributes, or what does not fit (in words, for the caller's typed error).

use meshwork_types::{DType, Shape, TensorSpec};

use crate::op::{Op, Padding, Reduction, Unary};

/// The dtypes programs compute in: f64, f32, bf16 and f16 (the half-precision ones
/// computed in f32 and rounded as each value is stored), i32, i64 and bool.
pub(crate) fn supported(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::F32 | DType::F64 | DType::BF16 | DType::F16 | DType::I32 | DType::I64 | DType::Bool
    )
}

type Infer = Result<TensorSpec, String>;

fn spec(dtype: DType, dims: &[usize]) -> Infer {
    let shape = Shape::new(dims).map_err(|e| e.to_string())?;
    strides_fit(dims)?;
    Ok(TensorSpec::new(dtype, shape))
}

/// The interpreters index with row-major strides, which multiply every dim but the
/// first: a shape with no elements may still not have strides that fit (`[0, 2^32,
/// 2^32]`). Such shapes are refused, as is any whose non-zero dims multiply past
/// `isize::MAX` (ndarray, the interpreters' storage, refuses those even when empty:
/// `[2, 0, 2^62]`).
pub(crate) fn strides_fit(dims: &[usize]) -> Result<(), String> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d.max(1)))
        .filter(|&n| isize::try_from(n).is_ok())
        .map(|_| ())
        .ok_or_else(|| format!("the strides of shape {dims:?} overflow"))
}

fn arity(args: &[&TensorSpec], want: usize) -> Result<(), String> {
    if args.len() == want {
        Ok(())
    } else {
        Err(format!("takes {want} operand{}, got {}", if want == 1 { "" } else { "s" }, args.len()))
    }
}

fn axis_in(axis: usize, rank: usize, what: &str) -> Result<(), String> {
    if axis < rank { Ok(()) } else { Err(format!("{what} {axis} is past rank {rank}")) }
}

fn float(dtype: DType, what: &str) -> Result<(), String> {
    if dtype.is_float() {
        Ok(())
    } else {
        Err(format!("{what} needs a float operand, not {dtype}"))
    }
}

fn numeric(dtype: DType, what: &str) -> Result<(), String> {
    if dtype == DType::Bool { Err(format!("{what} needs a number, not bool")) } else { Ok(()) }
}

fn integer(dtype: DType, what: &str) -> Result<(), String> {
    if dtype.is_integer() { Ok(()) } else { Err(format!("{what} must be integers, not {dtype}")) }
}

/// NumPy broadcasting of several shapes: ranks extended on the left with 1s, then each
/// dim equal or 1.
pub(crate) fn broadcast(shapes: &[&[usize]]) -> Result<Vec<usize>, String> {
    let rank = shapes.iter().map(|s| s.len()).max().unwrap_or(0);
    let mut out = vec![1usize; rank];
    for s in shapes {
        let pad = rank - s.len();
        for (k, &d) in s.iter().enumerate() {
            let o = &mut out[pad + k];
            if *o == 1 {
                *o = d;
            } else if d != 1 && d != *o {
                let all: Vec<String> = shapes.iter().map(|s| format!("{s:?}")).collect();
                return Err(format!("shapes {} do not broadcast", all.join(" and ")));
            }
        }
    }
    Ok(out)
}

/// Checks a list of distinct dims below `rank`.
fn dims_in(dims: &[usize], rank: usize, what: &str) -> Result<(), String> {
    let mut seen = vec![false; rank];
    for &d in dims {
        if d >= rank {
            return Err(format!("{what} {dims:?} has dim {d} past rank {rank}"));
        }
        if std::mem::replace(&mut seen[d], true) {
            return Err(format!("{what} {dims:?} repeats dim {d}"));
        }
    }
    Ok(())
}

fn same_size_groups(groups: &[Vec<usize>]) -> Result<usize, String> {
    let n = groups.first().map_or(0, Vec::len);
    if n == 0 || groups.iter().any(|g| g.len() != n) {
        return Err(format!("replica groups {groups:?} must be non-empty and of one size"));
    }
    distinct_groups(groups)?;
    Ok(n)
}

/// `x` with `axis` as many times longer as the groups have members (all-gather,
/// shard_pad).
fn grown(x: &TensorSpec, axis: usize, groups: &[Vec<usize>], overflow: &str) -> Infer {
    let n = same_size_groups(groups)?;
    axis_in(axis, x.shape.rank(), "axis")?;
    let mut dims = x.shape.dims().to_vec();
    dims[axis] = dims[axis].checked_mul(n).ok_or(overflow)?;
    spec(x.dtype, &dims)
}

/// `x` with `axis` split into one part per group member (reduce-scatter, shard_slice).
fn split(x: &TensorSpec, axis: usize, groups: &[Vec<usize>]) -> Infer {
    let n = same_size_groups(groups)?;
    axis_in(axis, x.shape.rank(), "axis")?;
    let mut dims = x.shape.dims().to_vec();
    if !dims[axis].is_multiple_of(n) {
        return Err(format!("dim {axis} of size {} does not split over {n}", dims[axis]));
    }
    dims[axis] /= n;
    spec(x.dtype, &dims)
}

fn distinct_groups(groups: &[Vec<usize>]) -> Result<(), String> {
    let mut all: Vec<usize> = groups.iter().flatten().copied().collect();
    let n = all.len();
    all.sort_unstable();
    all.dedup();
    if groups.is_empty() || groups.iter().any(Vec::is_empty) || all.len() != n {
        return Err(format!("replica groups {groups:?} must be non-empty, each replica in one"));
    }
    Ok(())
}

/// The spec of `op`'s result for operands `args`, or the problem.
pub(crate) fn infer(op: &Op, args: &[&TensorSpec]) -> Infer {
    let name = op.name();
    match op {
        Op::Unary(u) => {
            arity(args, 1)?;
            let x = args[0];
            match u {
                Unary::Neg | Unary::Abs | Unary::Square | Unary::StopGradient | Unary::Barrier => {
                    numeric(x.dtype, name)?
                }
                Unary::Relu => numeric(x.dtype, name)?,
                _ => float(x.dtype, name)?,
            }
            Ok(x.clone())
        }
        Op::Binary(_) | Op::Compare(_) => {
            arity(args, 2)?;
            let (a, b) = (args[0], args[1]);
            if a.dtype != b.dtype {
                return Err(format!("operands have dtypes {} and {}", a.dtype, b.dtype));
            }
            numeric(a.dtype, name)?;
            let dims = broadcast(&[a.shape.dims(), b.shape.dims()])?;
            let dtype = if matches!(op, Op::Compare(_)) { DType::Bool } else { a.dtype };
            spec(dtype, &dims)
        }
        Op::Select => {
            arity(args, 3)?;
            let (p, t, f) = (args[0], args[1], args[2]);
            if p.dtype != DType::Bool {
                return Err(format!("the predicate is {}, not bool", p.dtype));
            }
            if t.dtype != f.dtype {
                return Err(format!("the two cases have dtypes {} and {}", t.dtype, f.dtype));
            }
            let dims = broadcast(&[p.shape.dims(), t.shape.dims(), f.shape.dims()])?;
            spec(t.dtype, &dims)
        }
        Op::ThreefryUniform => {
            arity(args, 3)?;
            if let Some(a) = args.iter().find(|a| a.dtype != DType::I32) {
                return Err(format!("keys and counters must be i32, not {}", a.dtype));
            }
            if args[1].shape != args[0].shape || args[2].shape != args[0].shape {
                return Err(format!(
                    "keys and counters have shapes {}, {} and {}: one shape",
                    args[0].shape, args[1].shape, args[2].shape
                ));
            }
            spec(DType::F32, args[0].shape.dims())
        }
        Op::Constant { value, dtype } => {
            arity(args, 0)?;
            numeric(*dtype, name)?;
            if dtype.is_integer() && (value.fract() != 0.0 || !value.is_finite()) {
                return Err(format!("{value} is not a whole number for an integer constant"));
            }
            // The range of the dtype (2^63 is the first f64 past i64's).
            let fits = match dtype {
                DType::I32 => (f64::from(i32::MIN)..=f64::from(i32::MAX)).contains(value),
                DType::I64 => (i64::MIN as f64..-(i64::MIN as f64)).contains(value),
                _ => true,
            };
            if !fits {
                return Err(format!("{value} does not fit in {dtype}"));
            }
            spec(*dtype, &[])
        }
        Op::DotGeneral { lhs_contract, rhs_contract, lhs_batch, rhs_batch } => {
            arity(args, 2)?;
            let (a, b) = (args[0], args[1]);
            if a.dtype != b.dtype {
                return Err(format!("operands have dtypes {} and {}", a.dtype, b.dtype));
            }
            numeric(a.dtype, name)?;
            let (ad, bd) = (a.shape.dims(), b.shape.dims());
            if lhs_contract.len() != rhs_contract.len() || lhs_batch.len() != rhs_batch.len() {
                return Err(format!(
                    "contracting dims {lhs_contract:?}/{rhs_contract:?} and batch dims \
                     {lhs_batch:?}/{rhs_batch:?} must pair up"
                ));
            }
            let lhs_used: Vec<usize> = lhs_batch.iter().chain(lhs_contract).copied().collect();
            let rhs_used: Vec<usize> = rhs_batch.iter().chain(rhs_contract).copied().collect();
            dims_in(&lhs_used, ad.len(), "lhs batch and contracting dims")?;
            dims_in(&rhs_used, bd.len(), "rhs batch and contracting dims")?;
            for (&l, &r) in lhs_used.iter().zip(&rhs_used) {
                if ad[l] != bd[r] {
                    return Err(format!(
                        "lhs dim {l} (size {}) pairs with rhs dim {r} (size {})",
                        ad[l], bd[r]
                    ));
                }
            }
            let mut dims: Vec<usize> = lhs_batch.iter().map(|&d| ad[d]).collect();
            dims.extend((0..ad.len()).filter(|d| !lhs_used.contains(d)).map(|d| ad[d]));
            dims.extend((0..bd.len()).filter(|d| !rhs_used.contains(d)).map(|d| bd[d]));
            spec(a.dtype, &dims)
        }
        Op::Reduce { kind, axes, keepdims } => {
            arity(args, 1)?;
            let x = args[0];
            match kind {
                Reduction::Mean => float(x.dtype, name)?,
                _ => numeric(x.dtype, name)?,
            }
            let d = x.shape.dims();
            dims_in(axes, d.len(), "axes")?;
            if axes.windows(2).any(|w| w[0] > w[1]) {
                return Err(format!("axes {axes:?} must be sorted"));
            }
            if *kind == Reduction::Max && axes.iter().any(|&a| d[a] == 0) {
                return Err(format!("the maximum over an empty axis of {:?} has no value", d));
            }
            let dims: Vec<usize> = (0..d.len())
                .filter_map(|k| {
                    if !axes.contains(&k) {
                        Some(d[k])
                    } else if *keepdims {
                        Some(1)
                    } else {
                        None
                    }
                })
                .collect();
            spec(x.dtype, &dims)
        }
        Op::Reshape { shape } => {
            arity(args, 1)?;
            let x = args[0];
            let target = Shape::new(shape).map_err(|e| e.to_string())?;
            if target.num_elements() != x.shape.num_elements() {
                return Err(format!(
                    "{} elements cannot take shape {shape:?} ({} elements)",
                    x.shape.num_elements(),
                    target.num_elements()
                ));
            }
            Ok(TensorSpec::new(x.dtype, target))
        }
        Op::Transpose { perm } => {
            arity(args, 1)?;
            let x = args[0];
            let d = x.shape.dims();
            if perm.len() != d.len() {
                return Err(format!("perm {perm:?} for rank {}", d.len()));
            }
            dims_in(perm, d.len(), "perm")?;
            let dims: Vec<usize> = perm.iter().map(|&p| d[p]).collect();
            spec(x.dtype, &dims)
        }
        Op::BroadcastTo { shape } => {
            arity(args, 1)?;
            let x = args[0];
            let d = x.shape.dims();
            let ok = d.len() <= shape.len()
                && d.iter().zip(&shape[shape.len() - d.len()..]).all(|(&a, &b)| a == b || a == 1);
            if !ok {
                return Err(format!("shape {d:?} does not broadcast to {shape:?}"));
            }
            spec(x.dtype, shape)
        }
        Op::Slice { start, stop, step } => {
            arity(args, 1)?;
            let x = args[0];
            let d = x.shape.dims();
            if start.len() != d.len() || stop.len() != d.len() || step.len() != d.len() {
                return Err(format!(
                    "start {start:?}, stop {stop:?} and step {step:?} need {} entries each",
                    d.len()
                ));
            }
            let mut dims = Vec::with_capacity(d.len());
            for k in 0..d.len() {
                if step[k] == 0 || start[k] > stop[k] || stop[k] > d[k] {
                    return Err(format!(
                        "dim {k} of size {}: start {}, stop {}, step {} (need start <= stop <= size, step >= 1)",
                        d[k], start[k], stop[k], step[k]
                    ));
                }
                dims.push((stop[k] - start[k]).div_ceil(step[k]));
            }
            spec(x.dtype, &dims)
        }
        Op::Concat { axis } => {
            let first = args.first().ok_or("takes at least one operand")?;
            let d = first.shape.dims();
            axis_in(*axis, d.len(), "axis")?;
            let mut total = 0usize;
            for a in args {
                let e = a.shape.dims();
                if a.dtype != first.dtype
                    || e.len() != d.len()
                    || (0..d.len()).any(|k| k != *axis && e[k] != d[k])
                {
                    return Err(format!("{a} does not concatenate with {first} along axis {axis}"));
                }
                total = total.checked_add(e[*axis]).ok_or("the concatenated dim overflows")?;
            }
            let mut dims = d.to_vec();
            dims[*axis] = total;
            spec(first.dtype, &dims)
        }
        Op::Take { axis } => {
            arity(args, 2)?;
            let (table, idx) = (args[0], args[1]);
            integer(idx.dtype, "take's indices")?;
            let d = table.shape.dims();
            axis_in(*axis, d.len(), "axis")?;
            let mut dims = d[..*axis].to_vec();
            dims.extend_from_slice(idx.shape.dims());
            dims.extend_from_slice(&d[axis + 1..]);
            spec(table.dtype, &dims)
        }
        Op::OneHot { depth, dtype } => {
            arity(args, 1)?;
            integer(args[0].dtype, "one_hot's indices")?;
            float(*dtype, name)?;
            let mut dims = args[0].shape.dims().to_vec();
            dims.push(*depth);
            spec(*dtype, &dims)
        }
        Op::Softmax { axis } | Op::LogSoftmax { axis } => {
            arity(args, 1)?;
            let x = args[0];
            float(x.dtype, name)?;
            axis_in(*axis, x.shape.rank(), "axis")?;
            Ok(x.clone())
        }
        Op::Attention(a) => {
            arity(args, 3)?;
            attention_dims(args, a.causal)?;
            let (q, v) = (args[0].shape.dims(), args[2].shape.dims());
            spec(args[0].dtype, &[q[0], q[1], q[2], v[3]])
        }
        Op::AttentionGrad { attention, wrt } => {
            arity(args, 4)?;
            attention_dims(&args[..3], attention.causal)?;
            let (q, v, g) = (args[0].shape.dims(), args[2].shape.dims(), args[3]);
            if g.dtype != args[0].dtype || g.shape.dims() != [q[0], q[1], q[2], v[3]] {
                return Err(format!(
                    "attention_grad's output cotangent is {g}, not the output's {}[{},{},{},{}]",
                    args[0].dtype, q[0], q[1], q[2], v[3]
                ));
            }
            match args.get(*wrt).filter(|_| *wrt < 3) {
                Some(x) => Ok((*x).clone()),
                None => Err(format!("attention_grad's wrt is {wrt}: 0, 1 or 2")),
            }
        }
        Op::CrossEntropy => {
            arity(args, 2)?;
            let positions = cross_entropy_dims(args[0], args[1])?;
            spec(args[0].dtype, positions)
        }
        Op::CrossEntropyGrad => {
            arity(args, 3)?;
            let positions = cross_entropy_dims(args[0], args[1])?;
            let g = args[2];
            if g.dtype != args[0].dtype || g.shape.dims() != positions {
                return Err(format!(
                    "cross_entropy_grad's loss cotangent is {g}, not the loss's {}{positions:?}",
                    args[0].dtype
                ));
            }
            Ok(args[0].clone())
        }
        Op::Argmax { axis } => {
            arity(args, 1)?;
            let x = args[0];
            numeric(x.dtype, name)?;
            let d = x.shape.dims();
            axis_in(*axis, d.len(), "axis")?;
            if d[*axis] == 0 {
                return Err(format!("argmax over an empty axis {axis} of {d:?}"));
            }
            let dims: Vec<usize> = (0..d.len()).filter(|&k| k != *axis).map(|k| d[k]).collect();
            spec(DType::I64, &dims)
        }
        Op::Conv2d { strides, padding } => {
            arity(args, 2)?;
            let (x, w) = (args[0], args[1]);
            if x.dtype != w.dtype {
                return Err(format!("operands have dtypes {} and {}", x.dtype, w.dtype));
            }
            float(x.dtype, name)?;
            let (xd, wd) = (x.shape.dims(), w.shape.dims());
            if xd.len() != 4 || wd.len() != 4 {
                return Err("x must be NHWC and w HWIO (rank 4 each)".into());
            }
            if xd[3] != wd[2] {
                return Err(format!("x has {} channels, w expects {}", xd[3], wd[2]));
            }
            if strides.contains(&0) {
                return Err(format!("strides {strides:?} must be at least 1"));
            }
            let out = |n: usize, k: usize, s: usize| match padding {
                Padding::Same => Ok(n.div_ceil(s)),
                Padding::Valid if n >= k => Ok((n - k) / s + 1),
                Padding::Valid => Err(format!("a VALID window of {k} does not fit in {n}")),
            };
            if wd[0] == 0 || wd[1] == 0 {
                return Err(format!("an empty window {wd:?}"));
            }
            let dims =
                [xd[0], out(xd[1], wd[0], strides[0])?, out(xd[2], wd[1], strides[1])?, wd[3]];
            spec(x.dtype, &dims)
        }
        Op::Pad { low, high, interior } => {
            arity(args, 1)?;
            let x = args[0];
            let d = x.shape.dims();
            if low.len() != d.len() || high.len() != d.len() || interior.len() != d.len() {
                return Err(format!(
                    "low {low:?}, high {high:?} and interior {interior:?} need {} entries each",
                    d.len()
                ));
            }
            let mut dims = Vec::with_capacity(d.len());
            for k in 0..d.len() {
                let inner = if d[k] == 0 {
                    Some(0)
                } else {
                    (d[k] - 1).checked_mul(interior[k]).and_then(|i| i.checked_add(d[k]))
                };
                let n = inner
                    .and_then(|n| n.checked_add(low[k]))
                    .and_then(|n| n.checked_add(high[k]))
                    .ok_or("the padded dim overflows")?;
                dims.push(n);
            }
            spec(x.dtype, &dims)
        }
        Op::ScatterAdd { axis } => {
            arity(args, 3)?;
            let (x, idx, upd) = (args[0], args[1], args[2]);
            numeric(x.dtype, name)?;
            integer(idx.dtype, "scatter_add's indices")?;
            let d = x.shape.dims();
            axis_in(*axis, d.len(), "axis")?;
            let mut want = d[..*axis].to_vec();
            want.extend_from_slice(idx.shape.dims());
            want.extend_from_slice(&d[axis + 1..]);
            if upd.dtype != x.dtype || upd.shape.dims() != want.as_slice() {
                return Err(format!("updates must be {}{want:?}, not {upd}", x.dtype));
            }
            Ok(x.clone())
        }
        Op::Conv2dBackpropInput { strides, padding, input } => {
            arity(args, 2)?;
            let x = spec(args[1].dtype, input)?;
            let out = infer(&Op::Conv2d { strides: *strides, padding: *padding }, &[&x, args[1]])?;
            if out != *args[0] {
                return Err(format!(
                    "a conv2d of {x} with {} gives {out}, not {}",
                    args[1], args[0]
                ));
            }
            Ok(x)
        }
        Op::Conv2dBackpropFilter { strides, padding, filter } => {
            arity(args, 2)?;
            let w = spec(args[0].dtype, filter)?;
            let out = infer(&Op::Conv2d { strides: *strides, padding: *padding }, &[args[0], &w])?;
            if out != *args[1] {
                return Err(format!(
                    "a conv2d of {} with {w} gives {out}, not {}",
                    args[0], args[1]
                ));
            }
            Ok(w)
        }
        Op::Convert { dtype } => {
            arity(args, 1)?;
            Ok(TensorSpec::new(*dtype, args[0].shape.clone()))
        }
        Op::Literal { value } => {
            arity(args, 0)?;
            if !value.dtype().is_float() {
                return Err(format!(
                    "a literal of {} (literals are of float dtypes)",
                    value.dtype()
                ));
            }
            spec(value.dtype(), value.shape())
        }
        Op::Iota { dtype, shape, axis } => {
            arity(args, 0)?;
            numeric(*dtype, name)?;
            axis_in(*axis, shape.len(), "axis")?;
            spec(*dtype, shape)
        }
        Op::AllReduce { groups, .. } => {
            arity(args, 1)?;
            numeric(args[0].dtype, name)?;
            distinct_groups(groups)?;
            Ok(args[0].clone())
        }
        Op::AllGather { axis, groups } => {
            arity(args, 1)?;
            grown(args[0], *axis, groups, "the gathered dim overflows")
        }
        Op::ReduceScatter { axis, groups, .. } => {
            arity(args, 1)?;
            numeric(args[0].dtype, name)?;
            split(args[0], *axis, groups)
        }
        Op::ShardSlice { axis, groups } => {
            arity(args, 1)?;
            split(args[0], *axis, groups)
        }
        Op::ShardPad { axis, groups } => {
            arity(args, 1)?;
            grown(args[0], *axis, groups, "the padded dim overflows")
        }
        Op::AllToAll { split_axis, concat_axis, groups } => {
            arity(args, 1)?;
            let n = same_size_groups(groups)?;
            let x = args[0];
            axis_in(*split_axis, x.shape.rank(), "split_axis")?;
            axis_in(*concat_axis, x.shape.rank(), "concat_axis")?;
            let mut dims = x.shape.dims().to_vec();
            if !dims[*split_axis].is_multiple_of(n) {
                return Err(format!(
                    "dim {split_axis} of size {} does not split over {n}",
                    dims[*split_axis]
                ));
            }
            dims[*split_axis] /= n;
            dims[*concat_axis] =
                dims[*concat_axis].checked_mul(n).ok_or("the concatenated dim overflows")?;
            spec(x.dtype, &dims)
        }
        Op::CollectivePermute { pairs } => {
            arity(args, 1)?;
            let (mut s, mut t): (Vec<usize>, Vec<usize>) = pairs.iter().copied().unzip();
            s.sort_unstable();
            t.sort_unstable();
            if s.windows(2).any(|w| w[0] == w[1]) || t.windows(2).any(|w| w[0] == w[1]) {
                return Err(format!("pairs {pairs:?} need distinct sources and targets"));
            }
            Ok(args[0].clone())
        }
        Op::Send { .. } => {
            arity(args, 1)?;
            spec(DType::Bool, &[])
        }
        Op::Recv { dtype, shape, .. } => {
            arity(args, 0)?;
            if !supported(*dtype) {
                return Err(format!("cannot receive {dtype}"));
            }
            spec(*dtype, shape)
        }
        Op::Emit { .. } => {
            if args.is_empty() {
                return Err("emits at least one operand".into());
            }
            spec(DType::Bool, &[])
        }
    }
}

/// Cross-entropy's float `logits` `[..., C]` and integer `labels` `[...]` checked; the
/// positions' dims (the logits' without the class axis).
fn cross_entropy_dims<'a>(
    logits: &'a TensorSpec,
    labels: &TensorSpec,
) -> Result<&'a [usize], String> {
    float(logits.dtype, "cross_entropy's logits")?;
    integer(labels.dtype, "cross_entropy's labels")?;
    let d = logits.shape.dims();
    let Some((_, positions)) = d.split_last() else {
        return Err("cross_entropy's logits need a class axis".into());
    };
    if labels.shape.dims() != positions {
        return Err(format!(
            "cross_entropy's labels are {labels}, not the logits' shape without the class axis {positions:?}"
        ));
    }
    Ok(positions)
}

/// Checks attention's `q [B,H,Tq,D]`, `k [B,H,Tk,D]`, `v [B,H,Tk,Dv]`: one float dtype,
/// rank 4, the batch and heads shared, keys and values of one length, at least one key
/// (causal: at least as many as queries).
fn attention_dims(args: &[&TensorSpec], causal: bool) -> Result<(), String> {
    let (q, k, v) = (args[0], args[1], args[2]);
    float(q.dtype, "attention")?;
    if k.dtype != q.dtype || v.dtype != q.dtype {
        return Err(format!("attention's operands differ in dtype: {q}, {k}, {v}"));
    }
    let (qd, kd, vd) = (q.shape.dims(), k.shape.dims(), v.shape.dims());
    if qd.len() != 4 || kd.len() != 4 || vd.len() != 4 {
        return Err(format!("attention takes [B,H,T,D] heads, not {q}, {k}, {v}"));
    }
    if qd[..2] != kd[..2] || qd[..2] != vd[..2] || qd[3] != kd[3] || kd[2] != vd[2] {
        return Err(format!(
            "attention's heads do not agree: q {q}, k {k}, v {v} (q [B,H,Tq,D], k [B,H,Tk,D], v [B,H,Tk,Dv])"
        ));
    }
    if kd[2] == 0 {
        return Err("attention over no keys".into());
    }
    if causal && qd[2] > kd[2] {
        return Err(format!("causal attention of {} queries over {} keys (fewer)", qd[2], kd[2]));
    }
    Ok(())
}
