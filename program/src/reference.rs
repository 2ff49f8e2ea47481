//! The reference interpreter: naive loops, written to be obviously right rather than
//! fast — the oracle the fast interpreter and the property tests are checked against.
//!
//! Float ops compute in f64 and round the result to the value's dtype; integer ops
//! compute in i64 with wrapping arithmetic and wrap to the value's dtype. `take` and
//! `scatter_add` clamp an index outside the axis into it, as XLA's `gather` does (the
//! meaning the XLA back end gives them; `scatter_add` stays `take`'s transpose);
//! `one_hot` of an index outside `0..depth` is a row of zeros, as in JAX.

use meshwork_types::{DType, Tensor, bf16, f16};

use crate::env::{Env, communicate};
use crate::op::{Binary, Compare, Op, Padding, Reduction, Unary};
use crate::program::{Program, Value};
use crate::{Error, Result};

/// Elements in a computing type.
#[derive(Debug, Clone)]
enum Buf {
    F(Vec<f64>),
    I(Vec<i64>),
    B(Vec<bool>),
}

impl Buf {
    fn pick(&self, map: &[usize]) -> Buf {
        match self {
            Buf::F(v) => Buf::F(map.iter().map(|&k| v[k]).collect()),
            Buf::I(v) => Buf::I(map.iter().map(|&k| v[k]).collect()),
            Buf::B(v) => Buf::B(map.iter().map(|&k| v[k]).collect()),
        }
    }

    fn len(&self) -> usize {
        match self {
            Buf::F(v) => v.len(),
            Buf::I(v) => v.len(),
            Buf::B(v) => v.len(),
        }
    }
}

/// A value being computed: its dims, dtype and elements.
#[derive(Debug, Clone)]
struct Val {
    dims: Vec<usize>,
    dtype: DType,
    buf: Buf,
}

impl Val {
    fn new(dims: Vec<usize>, dtype: DType, buf: Buf) -> Val {
        // Round to the dtype as the value is made.
        let buf = match (dtype, buf) {
            (DType::F32, Buf::F(v)) => Buf::F(v.into_iter().map(|x| f64::from(x as f32)).collect()),
            // Half precision as computed in f32 and rounded on store.
            (DType::BF16, Buf::F(v)) => {
                Buf::F(v.into_iter().map(|x| f64::from(bf16::from_f32(x as f32))).collect())
            }
            (DType::F16, Buf::F(v)) => {
                Buf::F(v.into_iter().map(|x| f64::from(f16::from_f32(x as f32))).collect())
            }
            (DType::I32, Buf::I(v)) => Buf::I(v.into_iter().map(|x| i64::from(x as i32)).collect()),
            (_, b) => b,
        };
        Val { dims, dtype, buf }
    }

    fn floats(&self) -> &[f64] {
        match &self.buf {
            Buf::F(v) => v,
            _ => unreachable!("inference checked the dtype"),
        }
    }

    fn ints(&self) -> &[i64] {
        match &self.buf {
            Buf::I(v) => v,
            _ => unreachable!("inference checked the dtype"),
        }
    }

    fn bools(&self) -> &[bool] {
        match &self.buf {
            Buf::B(v) => v,
            _ => unreachable!("inference checked the dtype"),
        }
    }
}

fn from_tensor(t: &Tensor) -> Val {
    from_data(t.shape(), t)
}

/// A value of `dims` from a tensor of its elements (any shape and layout: they are
/// read in row-major order).
fn from_data(dims: &[usize], data: &Tensor) -> Val {
    let buf = match data {
        Tensor::F32(a) => Buf::F(a.iter().map(|&x| f64::from(x)).collect()),
        Tensor::F64(a) => Buf::F(a.iter().copied().collect()),
        Tensor::BF16(a) => Buf::F(a.iter().map(|&x| f64::from(x)).collect()),
        Tensor::F16(a) => Buf::F(a.iter().map(|&x| f64::from(x)).collect()),
        Tensor::I32(a) => Buf::I(a.iter().map(|&x| i64::from(x)).collect()),
        Tensor::I64(a) => Buf::I(a.iter().copied().collect()),
        Tensor::Bool(a) => Buf::B(a.iter().copied().collect()),
        other => unreachable!("programs do not compute in {} (checked at entry)", other.dtype()),
    };
    Val { dims: dims.to_vec(), dtype: data.dtype(), buf }
}

fn to_tensor(v: Val) -> Result<Tensor> {
    let dims = &v.dims;
    Ok(match (v.dtype, v.buf) {
        (DType::F32, Buf::F(x)) => Tensor::f32(dims, x.into_iter().map(|e| e as f32).collect()),
        (DType::F64, Buf::F(x)) => Tensor::f64(dims, x),
        (DType::BF16, Buf::F(x)) => {
            Tensor::from_vec(dims, x.into_iter().map(|e| bf16::from_f32(e as f32)).collect())
        }
        (DType::F16, Buf::F(x)) => {
            Tensor::from_vec(dims, x.into_iter().map(|e| f16::from_f32(e as f32)).collect())
        }
        (DType::I32, Buf::I(x)) => Tensor::i32(dims, x.into_iter().map(|e| e as i32).collect()),
        (DType::I64, Buf::I(x)) => Tensor::i64(dims, x),
        (DType::Bool, Buf::B(x)) => Tensor::bool(dims, x),
        (dtype, _) => unreachable!("a value of {dtype} in the wrong buffer"),
    }?)
}

/// The padding before the first element along one spatial dim of `size`, for a kernel
/// of `k` with stride `s` and `out` outputs: none for VALID; for SAME, half the total
/// (the smaller half, as XLA puts the odd one after). An empty output needs none.
pub(crate) fn pad_before(padding: Padding, size: usize, k: usize, s: usize, out: usize) -> usize {
    match padding {
        Padding::Valid => 0,
        Padding::Same => (out.saturating_sub(1) * s + k).saturating_sub(size) / 2,
    }
}

/// Row-major strides of `dims`.
pub(crate) fn strides(dims: &[usize]) -> Vec<usize> {
    let mut s = vec![1usize; dims.len()];
    for k in (0..dims.len().saturating_sub(1)).rev() {
        s[k] = s[k + 1] * dims[k + 1];
    }
    s
}

/// Every index of `dims`, row-major, passed to `f` as coordinates.
fn for_each_index(dims: &[usize], mut f: impl FnMut(&[usize])) {
    if dims.contains(&0) {
        return;
    }
    let mut idx = vec![0usize; dims.len()];
    loop {
        f(&idx);
        let mut k = dims.len();
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

/// For each element of `out` (broadcast from `input`, NumPy rules), the flat index it
/// reads in `input`.
fn broadcast_map(input: &[usize], out: &[usize]) -> Vec<usize> {
    let pad = out.len() - input.len();
    let s = strides(input);
    let mut map = Vec::with_capacity(out.iter().product());
    for_each_index(out, |idx| {
        let k = (0..input.len()).map(|d| if input[d] == 1 { 0 } else { idx[pad + d] * s[d] }).sum();
        map.push(k);
    });
    map
}

fn broadcast(v: &Val, out: &[usize]) -> Buf {
    v.buf.pick(&broadcast_map(&v.dims, out))
}

fn unary(u: Unary, x: &Val) -> Buf {
    match &x.buf {
        Buf::I(v) => Buf::I(
            v.iter()
                .map(|&a| match u {
                    Unary::Neg => a.wrapping_neg(),
                    Unary::Abs => a.wrapping_abs(),
                    Unary::Square => a.wrapping_mul(a),
                    Unary::Relu => a.max(0),
                    _ => a, // stop_gradient; float-only ops are refused by inference
                })
                .collect(),
        ),
        Buf::F(v) => Buf::F(
            v.iter()
                .map(|&a| match u {
                    Unary::Neg => -a,
                    Unary::Exp => a.exp(),
                    Unary::Log => a.ln(),
                    Unary::Tanh => a.tanh(),
                    Unary::Logistic => 1.0 / (1.0 + (-a).exp()),
                    Unary::Sqrt => a.sqrt(),
                    Unary::Rsqrt => 1.0 / a.sqrt(),
                    Unary::Abs => a.abs(),
                    Unary::Square => a * a,
                    // NaN stays NaN (jax.nn.relu is `maximum(x, 0)`).
                    Unary::Relu => {
                        if a > 0.0 || a.is_nan() {
                            a
                        } else {
                            0.0
                        }
                    }
                    Unary::Gelu => {
                        let c = (2.0 / std::f64::consts::PI).sqrt();
                        0.5 * a * (1.0 + (c * (a + 0.044715 * a * a * a)).tanh())
                    }
                    Unary::Sin => a.sin(),
                    Unary::Cos => a.cos(),
                    Unary::StopGradient | Unary::Barrier => a,
                })
                .collect(),
        ),
        Buf::B(v) => Buf::B(v.clone()),
    }
}

fn binary(op: Binary, a: &Buf, b: &Buf, at: &str) -> Result<Buf> {
    Ok(match (a, b) {
        (Buf::F(x), Buf::F(y)) => Buf::F(
            x.iter()
                .zip(y)
                .map(|(&p, &q)| match op {
                    Binary::Add => p + q,
                    Binary::Sub => p - q,
                    Binary::Mul => p * q,
                    Binary::Div => p / q,
                    // jnp.maximum/minimum propagate NaN.
                    Binary::Max => {
                        if p.is_nan() || q.is_nan() {
                            f64::NAN
                        } else {
                            p.max(q)
                        }
                    }
                    Binary::Min => {
                        if p.is_nan() || q.is_nan() {
                            f64::NAN
                        } else {
                            p.min(q)
                        }
                    }
                    Binary::Pow => p.powf(q),
                })
                .collect(),
        ),
        (Buf::I(x), Buf::I(y)) => {
            let mut out = Vec::with_capacity(x.len());
            for (&p, &q) in x.iter().zip(y) {
                out.push(match op {
                    Binary::Add => p.wrapping_add(q),
                    Binary::Sub => p.wrapping_sub(q),
                    Binary::Mul => p.wrapping_mul(q),
                    Binary::Div if q == 0 => return Err(runtime(at, "integer division by zero")),
                    // Floor division, as jnp.floor_divide on integers.
                    Binary::Div => {
                        p.wrapping_div(q)
                            - i64::from((p.wrapping_rem(q) != 0) && ((p < 0) != (q < 0)))
                    }
                    Binary::Max => p.max(q),
                    Binary::Min => p.min(q),
                    Binary::Pow if q < 0 => return Err(runtime(at, "a negative integer power")),
                    Binary::Pow => p.wrapping_pow(u32::try_from(q).unwrap_or(u32::MAX)),
                });
            }
            Buf::I(out)
        }
        _ => unreachable!("inference checked the dtypes"),
    })
}

fn compare(op: Compare, a: &Buf, b: &Buf) -> Buf {
    fn go<T: PartialOrd>(op: Compare, x: &[T], y: &[T]) -> Vec<bool> {
        x.iter()
            .zip(y)
            .map(|(p, q)| match op {
                Compare::Lt => p < q,
                Compare::Le => p <= q,
                Compare::Gt => p > q,
                Compare::Ge => p >= q,
                Compare::Eq => p == q,
                Compare::Ne => p != q,
            })
            .collect()
    }
    Buf::B(match (a, b) {
        (Buf::F(x), Buf::F(y)) => go(op, x, y),
        (Buf::I(x), Buf::I(y)) => go(op, x, y),
        (Buf::B(x), Buf::B(y)) => go(op, x, y),
        _ => unreachable!("inference checked the dtypes"),
    })
}

fn runtime(at: &str, problem: &str) -> Error {
    Error::Runtime { at: at.to_string(), problem: problem.to_string() }
}

/// Evaluates `program` on `inputs` (one per parameter, of its spec) and returns its
/// results. Collectives, `send`/`recv` and `emit` are errors here; see
/// [`evaluate_with`].
pub fn evaluate(program: &Program, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
    evaluate_with(program, inputs, &Env::local())
}

/// Refuses a result of `elements` the allocator has no room for, before it is
/// computed: its buffer (8 bytes an element) and an index map as large (the most an
/// instruction here holds beside its operands) are asked for, and given back.
fn room_for(elements: usize) -> Result<()> {
    let bytes = elements.saturating_mul(16);
    let mut probe: Vec<u8> = Vec::new();
    probe.try_reserve_exact(bytes).map_err(|_| meshwork_types::Error::OutOfMemory { bytes })?;
    Ok(())
}

/// [`evaluate`] with the collectives, channels and host sink of `env`.
pub fn evaluate_with(program: &Program, inputs: &[Tensor], env: &Env<'_>) -> Result<Vec<Tensor>> {
    check_inputs(program, inputs)?;
    let mut vals: Vec<Val> = Vec::with_capacity(program.num_values());
    vals.extend(inputs.iter().map(from_tensor));
    for (i, instr) in program.instrs().iter().enumerate() {
        let at = format!("%{} ({})", program.params().len() + i, instr.op.name());
        let dims = instr.spec.shape.dims().to_vec();
        let dtype = instr.spec.dtype;
        if instr.op.communicates() {
            let args = instr
                .args
                .iter()
                .map(|a| to_tensor(vals[a.index()].clone()))
                .collect::<Result<Vec<_>>>()?;
            vals.push(from_tensor(&communicate(env, &instr.op, args, &instr.spec, &at)?));
            continue;
        }
        let args: Vec<&Val> = instr.args.iter().map(|a| &vals[a.index()]).collect();
        room_for(dims.iter().product())?;
        let buf = step(&instr.op, &args, &dims, &at)?;
        debug_assert_eq!(buf.len(), dims.iter().product::<usize>());
        vals.push(Val::new(dims, dtype, buf));
    }
    let out = program
        .results()
        .iter()
        .map(|&Value(k)| to_tensor(vals[k as usize].clone()))
        .collect::<Result<Vec<_>>>()?;
    check_outputs(program, &out, "the reference interpreter")?;
    Ok(out)
}

/// Checks that every result is of its value's spec: an interpreter that made another
/// dtype or shape has a bug, reported as an error rather than handed on.
pub(crate) fn check_outputs(program: &Program, outputs: &[Tensor], who: &str) -> Result<()> {
    for (k, (&v, t)) in program.results().iter().zip(outputs).enumerate() {
        let want = program.spec(v).expect("a defined value");
        if t.spec() != *want {
            return Err(Error::Runtime {
                at: format!("result {k} ({v})"),
                problem: format!("{who} made {}, the program says {want}", t.spec()),
            });
        }
    }
    Ok(())
}

/// Checks one input per parameter, each of its parameter's spec.
pub(crate) fn check_inputs<T: std::borrow::Borrow<Tensor>>(
    program: &Program,
    inputs: &[T],
) -> Result<()> {
    if inputs.len() != program.params().len() {
        return Err(Error::Inputs {
            expected: program.params().len(),
            actual: inputs.len(),
            problem: "one input per parameter".into(),
        });
    }
    for (p, t) in program.params().iter().zip(inputs) {
        let t = t.borrow();
        if t.spec() != p.spec {
            return Err(Error::Inputs {
                expected: program.params().len(),
                actual: inputs.len(),
                problem: format!("parameter {:?} is {}, the input is {}", p.name, p.spec, t.spec()),
            });
        }
    }
    Ok(())
}

/// One instruction on host data, by the reference's loops: the fast interpreter's
/// path for the ops it has no kernel of its own for.
pub(crate) fn eval_op(
    op: &Op,
    args: &[(&[usize], &Tensor)],
    spec: &meshwork_types::TensorSpec,
    at: &str,
) -> Result<Tensor> {
    let vals: Vec<Val> = args.iter().map(|(d, data)| from_data(d, data)).collect();
    let refs: Vec<&Val> = vals.iter().collect();
    let dims = spec.shape.dims().to_vec();
    let buf = step(op, &refs, &dims, at)?;
    to_tensor(Val::new(dims, spec.dtype, buf))
}

/// One instruction: the elements of its result (of `dims`).
fn step(op: &Op, args: &[&Val], dims: &[usize], at: &str) -> Result<Buf> {
    Ok(match op {
        Op::Unary(u) => unary(*u, args[0]),
        Op::Binary(b) => binary(*b, &broadcast(args[0], dims), &broadcast(args[1], dims), at)?,
        Op::Compare(c) => compare(*c, &broadcast(args[0], dims), &broadcast(args[1], dims)),
        Op::Select => {
            let p = broadcast(args[0], dims);
            let (t, f) = (broadcast(args[1], dims), broadcast(args[2], dims));
            let Buf::B(p) = p else { unreachable!("a bool predicate") };
            match (t, f) {
                (Buf::F(t), Buf::F(f)) => Buf::F(
                    p.iter().enumerate().map(|(k, &c)| if c { t[k] } else { f[k] }).collect(),
                ),
                (Buf::I(t), Buf::I(f)) => Buf::I(
                    p.iter().enumerate().map(|(k, &c)| if c { t[k] } else { f[k] }).collect(),
                ),
                (Buf::B(t), Buf::B(f)) => Buf::B(
                    p.iter().enumerate().map(|(k, &c)| if c { t[k] } else { f[k] }).collect(),
                ),
                _ => unreachable!("inference checked the dtypes"),
            }
        }
        Op::Constant { value, dtype } => {
            if dtype.is_float() {
                Buf::F(vec![*value])
            } else {
                Buf::I(vec![*value as i64])
            }
        }
        Op::DotGeneral { lhs_contract, rhs_contract, lhs_batch, rhs_batch } => {
            let (a, b) = (args[0], args[1]);
            let (sa, sb) = (strides(&a.dims), strides(&b.dims));
            let lfree: Vec<usize> = (0..a.dims.len())
                .filter(|d| !lhs_contract.contains(d) && !lhs_batch.contains(d))
                .collect();
            let rfree: Vec<usize> = (0..b.dims.len())
                .filter(|d| !rhs_contract.contains(d) && !rhs_batch.contains(d))
                .collect();
            let cdims: Vec<usize> = lhs_contract.iter().map(|&d| a.dims[d]).collect();
            let nb = lhs_batch.len();
            let mut out_f = Vec::new();
            let mut out_i = Vec::new();
            let float = matches!(a.buf, Buf::F(_));
            for_each_index(dims, |o| {
                let (mut base_a, mut base_b) = (0usize, 0usize);
                for k in 0..nb {
                    base_a += o[k] * sa[lhs_batch[k]];
                    base_b += o[k] * sb[rhs_batch[k]];
                }
                for (k, &d) in lfree.iter().enumerate() {
                    base_a += o[nb + k] * sa[d];
                }
                for (k, &d) in rfree.iter().enumerate() {
                    base_b += o[nb + lfree.len() + k] * sb[d];
                }
                let (mut acc_f, mut acc_i) = (0.0f64, 0i64);
                let mut visit = |c: &[usize]| {
                    let (mut ia, mut ib) = (base_a, base_b);
                    for (k, &ck) in c.iter().enumerate() {
                        ia += ck * sa[lhs_contract[k]];
                        ib += ck * sb[rhs_contract[k]];
                    }
                    if float {
                        acc_f += a.floats()[ia] * b.floats()[ib];
                    } else {
                        acc_i = acc_i.wrapping_add(a.ints()[ia].wrapping_mul(b.ints()[ib]));
                    }
                };
                // No contracted dims: one product; an empty one: a sum of nothing.
                for_each_index(&cdims, &mut visit);
                if float {
                    out_f.push(acc_f);
                } else {
                    out_i.push(acc_i);
                }
            });
            if float { Buf::F(out_f) } else { Buf::I(out_i) }
        }
        Op::Reduce { kind, axes, keepdims: _ } => {
            let x = args[0];
            let kept: Vec<usize> = (0..x.dims.len()).filter(|d| !axes.contains(d)).collect();
            let kept_dims: Vec<usize> = kept.iter().map(|&d| x.dims[d]).collect();
            let ks = strides(&kept_dims);
            let n = kept_dims.iter().product::<usize>();
            let count: usize = axes.iter().map(|&d| x.dims[d]).product();
            let xs = strides(&x.dims);
            let out_of = |idx: &[usize]| {
                kept.iter().enumerate().map(|(k, &d)| idx[d] * ks[k]).sum::<usize>()
            };
            match &x.buf {
                Buf::F(v) => {
                    let init = if *kind == Reduction::Max { f64::NEG_INFINITY } else { 0.0 };
                    let mut out = vec![init; n];
                    for_each_index(&x.dims, |idx| {
                        let e = v[idx.iter().zip(&xs).map(|(i, s)| i * s).sum::<usize>()];
                        let o = &mut out[out_of(idx)];
                        *o = match kind {
                            Reduction::Max if e.is_nan() || o.is_nan() => f64::NAN,
                            Reduction::Max => o.max(e),
                            _ => *o + e,
                        };
                    });
                    if *kind == Reduction::Mean {
                        out.iter_mut().for_each(|o| *o /= count as f64);
                    }
                    Buf::F(out)
                }
                Buf::I(v) => {
                    let init = if *kind == Reduction::Max { i64::MIN } else { 0 };
                    let mut out = vec![init; n];
                    for_each_index(&x.dims, |idx| {
                        let e = v[idx.iter().zip(&xs).map(|(i, s)| i * s).sum::<usize>()];
                        let o = &mut out[out_of(idx)];
                        *o = if *kind == Reduction::Max { (*o).max(e) } else { o.wrapping_add(e) };
                    });
                    Buf::I(out)
                }
                Buf::B(_) => unreachable!("inference refuses bool reductions"),
            }
        }
        Op::Reshape { .. } => args[0].buf.clone(),
        Op::Transpose { perm } => {
            let x = args[0];
            let xs = strides(&x.dims);
            let mut map = Vec::with_capacity(dims.iter().product());
            for_each_index(dims, |o| {
                map.push(perm.iter().enumerate().map(|(k, &p)| o[k] * xs[p]).sum());
            });
            x.buf.pick(&map)
        }
        Op::BroadcastTo { .. } => broadcast(args[0], dims),
        Op::Slice { start, step, .. } => {
            let x = args[0];
            let xs = strides(&x.dims);
            let mut map = Vec::with_capacity(dims.iter().product());
            for_each_index(dims, |o| {
                map.push((0..o.len()).map(|k| (start[k] + o[k] * step[k]) * xs[k]).sum());
            });
            x.buf.pick(&map)
        }
        Op::Concat { axis } => {
            // Row-major: for each index before the axis, each operand's block in turn.
            let outer: usize = dims[..*axis].iter().product();
            let inner: usize = dims[axis + 1..].iter().product();
            let mut map: Vec<(usize, usize)> = Vec::with_capacity(dims.iter().product());
            for o in 0..outer {
                for (k, a) in args.iter().enumerate() {
                    let block = a.dims[*axis] * inner;
                    map.extend((0..block).map(|e| (k, o * block + e)));
                }
            }
            match &args[0].buf {
                Buf::F(_) => Buf::F(map.iter().map(|&(k, e)| args[k].floats()[e]).collect()),
                Buf::I(_) => Buf::I(map.iter().map(|&(k, e)| args[k].ints()[e]).collect()),
                Buf::B(_) => Buf::B(map.iter().map(|&(k, e)| args[k].bools()[e]).collect()),
            }
        }
        Op::Take { axis } => {
            let table = args[0];
            let map = take_map(&table.dims, *axis, args[1], dims).map_err(|()| {
                runtime(at, &format!("indices into the table's axis {axis}, which is empty"))
            })?;
            table.buf.pick(&map)
        }
        Op::OneHot { depth, .. } => {
            let idx = args[0].ints();
            let mut out = vec![0.0; idx.len() * depth];
            for (k, &i) in idx.iter().enumerate() {
                if let Some(c) = usize::try_from(i).ok().filter(|&c| c < *depth) {
                    out[k * depth + c] = 1.0;
                }
            }
            Buf::F(out)
        }
        Op::Softmax { axis } | Op::LogSoftmax { axis } => {
            let x = args[0];
            let v = x.floats();
            let (outer, n, inner) = split(&x.dims, *axis);
            let mut out = vec![0.0; v.len()];
            for o in 0..outer {
                for i in 0..inner {
                    let at = |k: usize| o * n * inner + k * inner + i;
                    let m = (0..n).map(|k| v[at(k)]).fold(f64::NEG_INFINITY, f64::max);
                    let sum: f64 = (0..n).map(|k| (v[at(k)] - m).exp()).sum();
                    for k in 0..n {
                        out[at(k)] = if matches!(op, Op::Softmax { .. }) {
                            (v[at(k)] - m).exp() / sum
                        } else {
                            v[at(k)] - m - sum.ln()
                        };
                    }
                }
            }
            Buf::F(out)
        }
        Op::Argmax { axis } => {
            let x = args[0];
            let (outer, n, inner) = split(&x.dims, *axis);
            let mut out = Vec::with_capacity(outer * inner);
            for o in 0..outer {
                for i in 0..inner {
                    let at = |k: usize| o * n * inner + k * inner + i;
                    let best = match &x.buf {
                        // The first maximum; a NaN counts as the maximum, as in JAX.
                        Buf::F(v) => (0..n).fold(0, |b, k| {
                            if v[at(b)].is_nan() || (!v[at(k)].is_nan() && v[at(k)] <= v[at(b)]) {
                                b
                            } else {
                                k
                            }
                        }),
                        Buf::I(v) => (0..n).fold(0, |b, k| if v[at(k)] > v[at(b)] { k } else { b }),
                        Buf::B(_) => unreachable!("inference refuses bool argmax"),
                    };
                    out.push(best as i64);
                }
            }
            Buf::I(out)
        }
        Op::Conv2d { strides: st, padding } => {
            let (x, w) = (args[0], args[1]);
            let (xv, wv) = (x.floats(), w.floats());
            let [n, h, wd, c] = [x.dims[0], x.dims[1], x.dims[2], x.dims[3]];
            let [kh, kw, _, o] = [w.dims[0], w.dims[1], w.dims[2], w.dims[3]];
            let (ho, wo) = (dims[1], dims[2]);
            let (ph, pw) =
                (pad_before(*padding, h, kh, st[0], ho), pad_before(*padding, wd, kw, st[1], wo));
            let mut out = vec![0.0; n * ho * wo * o];
            for b in 0..n {
                for i in 0..ho {
                    for j in 0..wo {
                        for f in 0..o {
                            let mut acc = 0.0;
                            for di in 0..kh {
                                for dj in 0..kw {
                                    let (y, xx) = (i * st[0] + di, j * st[1] + dj);
                                    if y < ph || xx < pw || y - ph >= h || xx - pw >= wd {
                                        continue;
                                    }
                                    let (y, xx) = (y - ph, xx - pw);
                                    for ch in 0..c {
                                        acc += xv[((b * h + y) * wd + xx) * c + ch]
                                            * wv[((di * kw + dj) * c + ch) * o + f];
                                    }
                                }
                            }
                            out[((b * ho + i) * wo + j) * o + f] = acc;
                        }
                    }
                }
            }
            Buf::F(out)
        }
        Op::Pad { low, interior, .. } => {
            let x = args[0];
            let os = strides(dims);
            let mut map = Vec::with_capacity(x.buf.len());
            for_each_index(&x.dims, |i| {
                map.push(
                    (0..i.len())
                        .map(|k| (low[k] + i[k] * (interior[k] + 1)) * os[k])
                        .sum::<usize>(),
                );
            });
            let n: usize = dims.iter().product();
            match &x.buf {
                Buf::F(v) => {
                    let mut out = vec![0.0; n];
                    map.iter().zip(v).for_each(|(&k, &e)| out[k] = e);
                    Buf::F(out)
                }
                Buf::I(v) => {
                    let mut out = vec![0; n];
                    map.iter().zip(v).for_each(|(&k, &e)| out[k] = e);
                    Buf::I(out)
                }
                Buf::B(v) => {
                    let mut out = vec![false; n];
                    map.iter().zip(v).for_each(|(&k, &e)| out[k] = e);
                    Buf::B(out)
                }
            }
        }
        Op::ScatterAdd { axis } => {
            let (x, upd) = (args[0], args[2]);
            // Where each update goes: where `take` would have read it from.
            let targets = take_map(&x.dims, *axis, args[1], &upd.dims).map_err(|()| {
                runtime(at, &format!("indices into the operand's axis {axis}, which is empty"))
            })?;
            match (&x.buf, &upd.buf) {
                (Buf::F(v), Buf::F(u)) => {
                    let mut out = v.clone();
                    targets.iter().zip(u).for_each(|(&k, &e)| out[k] += e);
                    Buf::F(out)
                }
                (Buf::I(v), Buf::I(u)) => {
                    let mut out = v.clone();
                    targets.iter().zip(u).for_each(|(&k, &e)| out[k] = out[k].wrapping_add(e));
                    Buf::I(out)
                }
                _ => unreachable!("inference checked the dtypes"),
            }
        }
        Op::Conv2dBackpropInput { strides: st, padding, input } => {
            let (g, w) = (args[0].floats(), args[1].floats());
            let mut dx = vec![0.0; input.iter().product()];
            conv_pairs(
                *input,
                args[1].dims.as_slice(),
                &args[0].dims,
                *st,
                *padding,
                |xi, wi, gi| {
                    dx[xi] += g[gi] * w[wi];
                },
            );
            Buf::F(dx)
        }
        Op::Conv2dBackpropFilter { strides: st, padding, filter } => {
            let (x, g) = (args[0].floats(), args[1].floats());
            let xd: [usize; 4] = args[0].dims.as_slice().try_into().expect("rank 4");
            let mut dw = vec![0.0; filter.iter().product()];
            conv_pairs(xd, filter, &args[1].dims, *st, *padding, |xi, wi, gi| {
                dw[wi] += x[xi] * g[gi];
            });
            Buf::F(dw)
        }
        Op::Convert { dtype } => {
            let x = args[0];
            match (&x.buf, dtype.is_float(), *dtype == DType::Bool) {
                (Buf::F(v), true, _) => Buf::F(v.clone()),
                // Truncated toward zero and saturated to the integer dtype's range, NaN
                // to 0, as XLA's convert (Rust's `as` from f64 does all three).
                (Buf::F(v), false, false) => {
                    let (lo, hi) = match dtype {
                        DType::I32 => (i64::from(i32::MIN), i64::from(i32::MAX)),
                        _ => (i64::MIN, i64::MAX),
                    };
                    Buf::I(v.iter().map(|&e| (e as i64).clamp(lo, hi)).collect())
                }
                (Buf::F(v), false, true) => Buf::B(v.iter().map(|&e| e != 0.0).collect()),
                (Buf::I(v), true, _) => Buf::F(v.iter().map(|&e| e as f64).collect()),
                (Buf::I(v), false, false) => Buf::I(v.clone()),
                (Buf::I(v), false, true) => Buf::B(v.iter().map(|&e| e != 0).collect()),
                (Buf::B(v), true, _) => Buf::F(v.iter().map(|&e| f64::from(u8::from(e))).collect()),
                (Buf::B(v), false, false) => Buf::I(v.iter().map(|&e| i64::from(e)).collect()),
                (Buf::B(v), false, true) => Buf::B(v.clone()),
            }
        }
        Op::Literal { value } => Buf::F(value.to_f64()),
        Op::ThreefryUniform => {
            let (k1, k2, x) = (args[0].ints(), args[1].ints(), args[2].ints());
            // The i32 values are the bits of JAX's uint32 words.
            Buf::F(
                (0..x.len())
                    .map(|e| {
                        let key = [k1[e] as u32, k2[e] as u32];
                        f64::from(crate::random::uniform(key, x[e] as u32))
                    })
                    .collect(),
            )
        }
        Op::Iota { dtype, axis, .. } => {
            let mut out = Vec::with_capacity(dims.iter().product());
            for_each_index(dims, |o| out.push(o[*axis]));
            if dtype.is_float() {
                Buf::F(out.into_iter().map(|e| e as f64).collect())
            } else {
                Buf::I(out.into_iter().map(|e| e as i64).collect())
            }
        }
        Op::Attention(_) | Op::AttentionGrad { .. } | Op::CrossEntropy | Op::CrossEntropyGrad => {
            // A composite: its definition, run by this interpreter.
            let specs: Vec<meshwork_types::TensorSpec> = args
                .iter()
                .map(|v| {
                    meshwork_types::Shape::new(&v.dims)
                        .map(|s| meshwork_types::TensorSpec::new(v.dtype, s))
                })
                .collect::<std::result::Result<_, _>>()?;
            let definition = crate::composite::definition(op, &specs)
                .expect("a composite op has a definition")?;
            let inputs = args.iter().map(|&v| to_tensor(v.clone())).collect::<Result<Vec<_>>>()?;
            let out = evaluate(&definition, &inputs)?;
            from_tensor(&out[0]).buf
        }
        other => {
            return Err(runtime(
                at,
                &format!(
                    "{} exchanges data with other devices or the host, which runs \
                     through the interpreter's Env",
                    other.name()
                ),
            ));
        }
    })
}

/// For each element of `take(table, idx, axis)` (of `out` dims), the flat index it
/// reads in a table of `table` dims, each index clamped into the axis; `Err` when
/// there are indices into an empty axis.
fn take_map(table: &[usize], axis: usize, idx: &Val, out: &[usize]) -> Result<Vec<usize>, ()> {
    let n = table[axis];
    if n == 0 && !idx.ints().is_empty() {
        return Err(());
    }
    let (ts, is) = (strides(table), strides(&idx.dims));
    let ni = idx.dims.len();
    let mut map = Vec::with_capacity(out.iter().product());
    for_each_index(out, |o| {
        let i = idx.ints()[(0..ni).map(|k| o[axis + k] * is[k]).sum::<usize>()];
        let row = i.clamp(0, n as i64 - 1) as usize;
        let before = (0..axis).map(|d| o[d] * ts[d]);
        let after = (axis + 1..table.len()).map(|d| o[d - 1 + ni] * ts[d]);
        map.push(row * ts[axis] + before.chain(after).sum::<usize>());
    });
    Ok(map)
}

/// `(product of dims before axis, dims[axis], product of dims after)`.
pub(crate) fn split(dims: &[usize], axis: usize) -> (usize, usize, usize) {
    (dims[..axis].iter().product(), dims[axis], dims[axis + 1..].iter().product())
}

/// Every (input, filter, output) flat-index triple a convolution of an NHWC input of
/// `x` dims with an HWIO filter of `w` dims into an output of `out` dims multiplies:
/// `out[o] += x[xi] * w[wi]` for each triple.
fn conv_pairs(
    x: [usize; 4],
    w: &[usize],
    out: &[usize],
    st: [usize; 2],
    padding: Padding,
    mut f: impl FnMut(usize, usize, usize),
) {
    let [n, h, wd, c] = x;
    let (kh, kw, o) = (w[0], w[1], w[3]);
    let (ho, wo) = (out[1], out[2]);
    let (ph, pw) = (pad_before(padding, h, kh, st[0], ho), pad_before(padding, wd, kw, st[1], wo));
    for b in 0..n {
        for i in 0..ho {
            for j in 0..wo {
                for di in 0..kh {
                    for dj in 0..kw {
                        let (y, xx) = (i * st[0] + di, j * st[1] + dj);
                        if y < ph || xx < pw || y - ph >= h || xx - pw >= wd {
                            continue;
                        }
                        let (y, xx) = (y - ph, xx - pw);
                        for ch in 0..c {
                            for fo in 0..o {
                                f(
                                    ((b * h + y) * wd + xx) * c + ch,
                                    ((di * kw + dj) * c + ch) * o + fo,
                                    ((b * ho + i) * wo + j) * o + fo,
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
