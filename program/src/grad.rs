//! Reverse-mode autodiff: a program's vector-Jacobian product as a new program, built
//! from a transpose rule per op. Where JAX defines the value at a tie or a kink, the
//! rules follow JAX: `max`/`min` split a tie's cotangent in halves, `reduce_max` shares
//! it equally among the maximal elements, `relu` and `abs` have derivative 0 at 0,
//! `pow`'s exponent derivative uses `log(1)` where the base is 0.

use meshwork_types::{ReduceOp, TensorSpec};

use crate::builder::Builder;
use crate::op::{Binary, Op, Reduction, Unary};
use crate::program::{Program, Value};
use crate::{Error, Result};

/// `vjp(program, wrt)`: a program taking the original parameters and then one
/// cotangent per float result (named `cotangent.K` for result `K`, of its spec), and
/// returning the original results and then, for each value of `wrt` (parameters of
/// float dtype), the gradient of `Σ_k sum(cotangent_k · result_k)` with respect to it.
/// Integer and bool results carry no cotangent. Instructions that reach no result are
/// removed ([`Program::without_dead_code`]).
pub fn vjp(program: &Program, wrt: &[Value]) -> Result<Program> {
    let mut t = Transposer::forward(program, wrt)?;
    let mut cotangents = Vec::new();
    for (k, &r) in program.results().iter().enumerate() {
        let spec = program.spec(r).expect("a result of the program").clone();
        if spec.dtype.is_float() {
            let c = t.b.param(&format!("cotangent.{k}"), spec)?;
            cotangents.push((t.map[r.index()], c));
        }
    }
    t.backward(program, &cotangents, wrt)
}

/// `grad(program, loss, wrt)`: a program taking the original parameters and returning
/// `loss` (a rank-0 float value of the program) and then its gradient with respect to
/// each value of `wrt`. Instructions that reach no result (the cotangents of
/// parameters not in `wrt`) are removed ([`Program::without_dead_code`]).
pub fn grad(program: &Program, loss: Value, wrt: &[Value]) -> Result<Program> {
    grad_remat(program, loss, wrt, &[])
}

/// [`grad`] with the activations of each region recomputed in the backward pass (JAX's
/// `jax.checkpoint`, PyTorch's activation checkpointing): `regions` are ranges of
/// `program`'s instruction indices (a transformer block each, say), which may nest
/// but not cross (an instruction belongs to the outermost region holding it). A value made in a
/// region and read only there (not a result, not an op that communicates) is not kept
/// for the backward pass: the instructions that make it are added again just before
/// the backward pass first needs it, from the values the region reads. What a region
/// hands on (its output) is kept, so recomputing a region never reaches past it.
/// Values and gradients are exactly [`grad`]'s; an interpreter that frees each value
/// after its last use ([`crate::fast`]) then holds one region's activations at a time
/// instead of every region's.
pub fn grad_remat(
    program: &Program,
    loss: Value,
    wrt: &[Value],
    regions: &[std::ops::Range<usize>],
) -> Result<Program> {
    let spec = program
        .spec(loss)
        .ok_or(Error::UndefinedValue { at: "grad's loss".into(), value: loss.0 })?
        .clone();
    if !spec.dtype.is_float() || spec.shape.rank() != 0 {
        return Err(Error::NoGradient {
            value: loss.0,
            problem: format!("the loss must be a float scalar, not {spec}"),
        });
    }
    let mut t = Transposer::forward(program, wrt)?;
    t.remat = Remat::new(program, regions)?;
    let l = t.map[loss.index()];
    // The seed is colocated with the loss (TensorFlow's default `grad_ys`).
    let outer = t.b.swap_request(t.b.device_of(l)?.to_string(), vec![l]);
    let one = t.b.constant(1.0, spec.dtype);
    t.b.swap_request(outer.0, outer.1);
    let one = one?;
    let mut out = t.backward_to(&[(l, one)], wrt)?;
    out.insert(0, l);
    Ok(t.b.finish(&out)?.without_dead_code())
}

/// A value's cotangent contributions summed per device request: (request, sum).
type Partials = Vec<(String, Value)>;

/// Builds the forward program into a builder, then the backward pass after it.
struct Transposer<'p> {
    program: &'p Program,
    b: Builder,
    /// Original value → the builder's copy.
    map: Vec<Value>,
    /// What the backward pass recomputes instead of keeping.
    remat: Remat,
}

/// Rematerialization: which original values the backward pass recomputes, and their
/// copies made so far.
#[derive(Default)]
struct Remat {
    /// Per original value: whether it is recomputed.
    recomputed: Vec<bool>,
    /// Per original value: its recomputed copy, once made.
    copy: Vec<Option<Value>>,
    /// Per kept value a recomputation reads: that value through an
    /// `optimization_barrier`, once made, so that a compiler cannot merge the
    /// recomputed work with the forward pass's (XLA's CSE would: the same ops of the
    /// same operands) and so keep what remat drops.
    barrier: std::collections::HashMap<usize, Value>,
}

impl Remat {
    fn new(program: &Program, regions: &[std::ops::Range<usize>]) -> Result<Remat> {
        let (params, n) = (program.params().len(), program.instrs().len());
        let mut region = vec![None; n];
        for range in regions {
            if range.start > range.end || range.end > n {
                return Err(Error::Type {
                    op: "grad_remat",
                    at: format!("region {}..{}", range.start, range.end),
                    operands: Vec::new(),
                    problem: format!("not a range of the program's {n} instructions"),
                });
            }
        }
        // Regions nest (a block's attention pieces inside the block) but do not
        // cross; an instruction belongs to the outermost region holding it.
        for (a, ra) in regions.iter().enumerate() {
            for rb in &regions[a + 1..] {
                let overlap = ra.start < rb.end && rb.start < ra.end;
                let nested = (ra.start <= rb.start && rb.end <= ra.end)
                    || (rb.start <= ra.start && ra.end <= rb.end);
                if overlap && !nested {
                    return Err(Error::Type {
                        op: "grad_remat",
                        at: format!("region {}..{}", rb.start, rb.end),
                        operands: Vec::new(),
                        problem: format!("it crosses region {}..{}", ra.start, ra.end),
                    });
                }
            }
        }
        // A nested region adds nothing: its outermost region recomputes it (lazily,
        // as the backward pass reaches each value), and what it hands on to the rest
        // of that region is recomputed too rather than kept.
        let mut order: Vec<usize> = (0..regions.len()).collect();
        order.sort_by_key(|&r| regions[r].len());
        for r in order {
            for slot in &mut region[regions[r].clone()] {
                *slot = Some(r);
            }
        }
        // Candidates: made in a region by an op that neither communicates nor is a result.
        let mut recomputed: Vec<bool> = (0..params + n)
            .map(|v| {
                v >= params
                    && region[v - params].is_some()
                    && !program.instrs()[v - params].op.communicates()
                    && !program.results().contains(&Value(v as u32))
            })
            .collect();
        // A value read outside its region is what the region hands on: kept.
        for (i, instr) in program.instrs().iter().enumerate() {
            for a in &instr.args {
                let k = a.index();
                if k >= params && region[k - params] != region[i] {
                    recomputed[k] = false;
                }
            }
        }
        Ok(Remat { copy: vec![None; recomputed.len()], recomputed, barrier: Default::default() })
    }
}

impl<'p> Transposer<'p> {
    fn forward(program: &'p Program, wrt: &[Value]) -> Result<Transposer<'p>> {
        for &w in wrt {
            let Some(spec) = program.spec(w) else {
                return Err(Error::UndefinedValue {
                    at: "the values to differentiate".into(),
                    value: w.0,
                });
            };
            if w.index() >= program.params().len() {
                return Err(Error::NoGradient {
                    value: w.0,
                    problem: "gradients are taken with respect to parameters".into(),
                });
            }
            if !spec.dtype.is_float() {
                return Err(Error::NoGradient {
                    value: w.0,
                    problem: format!(
                        "{spec} is not a float: integer and bool values have no gradient"
                    ),
                });
            }
        }
        let mut b = Builder::new();
        let mut map = Vec::with_capacity(program.num_values());
        for p in program.params() {
            let v = b.param(&p.name, p.spec.clone())?;
            b.set_device(v, &p.device)?;
            map.push(v);
        }
        for instr in program.instrs() {
            let args: Vec<Value> = instr.args.iter().map(|a| map[a.index()]).collect();
            let with: Vec<Value> = instr.colocate.iter().map(|c| map[c.index()]).collect();
            map.push(b.push_copy(instr, &args, &with, instr.name.as_deref())?);
        }
        Ok(Transposer { program, b, map, remat: Remat::default() })
    }

    fn backward(
        mut self,
        program: &Program,
        seeds: &[(Value, Value)],
        wrt: &[Value],
    ) -> Result<Program> {
        let grads = self.backward_to(seeds, wrt)?;
        let mut out: Vec<Value> = program.results().iter().map(|r| self.map[r.index()]).collect();
        out.extend(grads);
        Ok(self.b.finish(&out)?.without_dead_code())
    }

    /// Runs the backward pass from `seeds` (builder value, its cotangent) and returns
    /// the gradient of each `wrt` (zeros where nothing flows).
    fn backward_to(&mut self, seeds: &[(Value, Value)], wrt: &[Value]) -> Result<Vec<Value>> {
        let n = self.program.num_values();
        let params = self.program.params().len();
        // Each original value's cotangent so far: one partial sum per device request
        // its contributions were made under.
        let mut adj: Vec<Partials> = vec![Vec::new(); n];
        let index_of = |map: &[Value], v: Value| map.iter().position(|&m| m == v);
        for &(v, c) in seeds {
            let k = index_of(&self.map, v).expect("a seed is a program value");
            self.accumulate(&mut adj, k, c, self.map[k])?;
        }
        for i in (0..self.program.instrs().len()).rev() {
            let k = params + i;
            let Some(g) = self.total(&mut adj, k)? else { continue };
            let instr = &self.program.instrs()[i];
            let args =
                instr.args.iter().map(|a| self.saved(a.index())).collect::<Result<Vec<_>>>()?;
            let y = self.saved(k)?;
            // As TensorFlow's gradients (`colocate_gradients_with_ops`), what the rule
            // adds is colocated with the instruction it differentiates, on its device.
            let outer = self.b.swap_request(instr.device.clone(), vec![y]);
            let result = self.transpose_into(&mut adj, instr, &args, y, g, k);
            self.b.swap_request(outer.0, outer.1);
            result?;
        }
        let mut out = Vec::with_capacity(wrt.len());
        for &w in wrt {
            let g = match self.total(&mut adj, w.index())? {
                Some(g) => g,
                None => self.zeros_like(self.map[w.index()])?,
            };
            out.push(g);
        }
        Ok(out)
    }

    /// Original value `k` as the backward pass reads it: the forward pass's, or a copy
    /// recomputed (once) from what its region keeps.
    fn saved(&mut self, k: usize) -> Result<Value> {
        if !self.remat.recomputed.get(k).copied().unwrap_or(false) {
            return Ok(self.map[k]);
        }
        if let Some(c) = self.remat.copy[k] {
            return Ok(c);
        }
        // Depth-first over the operands still to recompute (no recursion: a region
        // may be long).
        let params = self.program.params().len();
        let mut stack = vec![k];
        while let Some(&v) = stack.last() {
            let instr = &self.program.instrs()[v - params];
            let pending: Vec<usize> = instr
                .args
                .iter()
                .map(|a| a.index())
                .filter(|&a| self.remat.recomputed[a] && self.remat.copy[a].is_none())
                .collect();
            if !pending.is_empty() {
                stack.extend(pending);
                continue;
            }
            stack.pop();
            if self.remat.copy[v].is_some() {
                continue;
            }
            // Kept inputs of the recomputation pass through a barrier (float ones:
            // integers and masks are cheap to keep and have no gradient).
            let mut args: Vec<Value> = Vec::with_capacity(instr.args.len());
            for a in &instr.args {
                let arg = match self.remat.copy[a.index()] {
                    Some(c) => c,
                    None => {
                        let kept = self.map[a.index()];
                        let float = self.b.spec(kept)?.dtype.is_float();
                        match self.remat.barrier.get(&a.index()) {
                            Some(&b) => b,
                            None if float => {
                                let b = self.b.optimization_barrier(kept)?;
                                self.remat.barrier.insert(a.index(), b);
                                b
                            }
                            None => kept,
                        }
                    }
                };
                args.push(arg);
            }
            let copied = |a: &Value| self.remat.copy[a.index()].unwrap_or(self.map[a.index()]);
            let with: Vec<Value> = instr.colocate.iter().map(copied).collect();
            // A named value's copy is named after it (`x.remat`), so what names the
            // value (a layout constraint) can name the copy too.
            let name = instr.name.as_ref().map(|n| format!("{n}.remat"));
            let c = self.b.push_copy(instr, &args, &with, name.as_deref())?;
            self.remat.copy[v] = Some(c);
        }
        Ok(self.remat.copy[k].expect("recomputed above"))
    }

    /// Adds instruction `k`'s transpose (its cotangent `g`) and accumulates what flows
    /// to its float operands.
    fn transpose_into(
        &mut self,
        adj: &mut [Partials],
        instr: &crate::program::Instr,
        args: &[Value],
        y: Value,
        g: Value,
        k: usize,
    ) -> Result<()> {
        let contributions = self.rule(&instr.op, args, y, g, k)?;
        for (a, c) in instr.args.iter().zip(contributions) {
            if let Some(c) = c
                && self.program.spec(*a).is_some_and(|s| s.dtype.is_float())
            {
                self.accumulate(adj, a.index(), c, y)?;
            }
        }
        Ok(())
    }

    /// Adds contribution `c`, made beside forward value `at`, to value `k`'s partial
    /// sum on `at`'s device request (colocated with `at`) — the sum is taken where the
    /// contributions are, so a value read on other devices gets one cotangent back
    /// from each, not one per reader.
    fn accumulate(&mut self, adj: &mut [Partials], k: usize, c: Value, at: Value) -> Result<()> {
        let device = self.b.device_of(at)?.to_string();
        match adj[k].iter_mut().find(|(d, _)| *d == device) {
            Some((_, prev)) => {
                let outer = self.b.swap_request(device, vec![at]);
                let sum = self.b.add(*prev, c);
                self.b.swap_request(outer.0, outer.1);
                *prev = sum?;
            }
            None => adj[k].push((device, c)),
        }
        Ok(())
    }

    /// Value `k`'s whole cotangent: its one partial sum, or the partial sums added
    /// in order colocated with the value (TensorFlow aggregates a value's gradients
    /// beside the op that produced it).
    fn total(&mut self, adj: &mut [Partials], k: usize) -> Result<Option<Value>> {
        let mut partials = std::mem::take(&mut adj[k]).into_iter().map(|(_, c)| c);
        let Some(first) = partials.next() else { return Ok(None) };
        let y = self.map[k];
        let device = self.b.device_of(y)?.to_string();
        let outer = self.b.swap_request(device, vec![y]);
        let mut sum = Ok(first);
        for c in partials {
            sum = sum.and_then(|s| self.b.add(s, c));
        }
        self.b.swap_request(outer.0, outer.1);
        sum.map(Some)
    }

    fn spec(&self, v: Value) -> Result<TensorSpec> {
        Ok(self.b.spec(v)?.clone())
    }

    fn zeros_like(&mut self, v: Value) -> Result<Value> {
        let s = self.spec(v)?;
        let z = self.b.constant(0.0, s.dtype)?;
        self.b.broadcast_to(z, s.shape.dims())
    }

    /// `c` (of the broadcast result's shape) summed back to `operand`'s shape: NumPy
    /// broadcasting's transpose.
    fn unbroadcast(&mut self, c: Value, operand: Value) -> Result<Value> {
        let want = self.spec(operand)?.shape.dims().to_vec();
        let have = self.spec(c)?.shape.dims().to_vec();
        if want == have {
            return Ok(c);
        }
        let pad = have.len() - want.len();
        let axes: Vec<isize> = (0..have.len())
            .filter(|&d| d < pad || (want[d - pad] == 1 && have[d] != 1))
            .map(|d| d as isize)
            .collect();
        let summed = if axes.is_empty() { c } else { self.b.reduce_sum(c, &axes, true)? };
        self.b.reshape(summed, &want)
    }

    /// The cotangent contributions of one instruction to its operands (`None`: none).
    fn rule(
        &mut self,
        op: &Op,
        x: &[Value],
        y: Value,
        g: Value,
        k: usize,
    ) -> Result<Vec<Option<Value>>> {
        let b = &mut self.b;
        Ok(match op {
            Op::Unary(u) => {
                let a = x[0];
                let d = match u {
                    Unary::StopGradient => return Ok(vec![None]),
                    Unary::Barrier => return Ok(vec![Some(g)]),
                    Unary::Neg => return Ok(vec![Some(b.neg(g)?)]),
                    Unary::Exp => b.mul(g, y)?,
                    Unary::Log => b.div(g, a)?,
                    Unary::Tanh => {
                        let yy = b.mul(y, y)?;
                        let one = b.scalar_like(y, 1.0)?;
                        let d = b.sub(one, yy)?;
                        b.mul(g, d)?
                    }
                    Unary::Logistic => {
                        let one = b.scalar_like(y, 1.0)?;
                        let m = b.sub(one, y)?;
                        let d = b.mul(y, m)?;
                        b.mul(g, d)?
                    }
                    Unary::Sqrt => {
                        let half = b.scalar_like(y, 0.5)?;
                        let d = b.div(half, y)?;
                        b.mul(g, d)?
                    }
                    Unary::Rsqrt => {
                        let c = b.scalar_like(y, -0.5)?;
                        let q = b.div(y, a)?;
                        let d = b.mul(c, q)?;
                        b.mul(g, d)?
                    }
                    Unary::Abs => {
                        // sign(x), with sign(0) = 0.
                        let zero = b.scalar_like(a, 0.0)?;
                        let pos = b.gt(a, zero)?;
                        let neg = b.lt(a, zero)?;
                        let dtype = b.spec(a)?.dtype;
                        let p = b.convert(pos, dtype)?;
                        let n = b.convert(neg, dtype)?;
                        let s = b.sub(p, n)?;
                        b.mul(g, s)?
                    }
                    Unary::Square => {
                        let two = b.scalar_like(a, 2.0)?;
                        let d = b.mul(two, a)?;
                        b.mul(g, d)?
                    }
                    Unary::Relu => {
                        let zero = b.scalar_like(a, 0.0)?;
                        let pos = b.gt(a, zero)?;
                        let dtype = b.spec(a)?.dtype;
                        let m = b.convert(pos, dtype)?;
                        b.mul(g, m)?
                    }
                    Unary::Gelu => {
                        // d/dx 0.5 x (1 + t), t = tanh(c (x + 0.044715 x³)).
                        let c = (2.0 / std::f64::consts::PI).sqrt();
                        let x2 = b.mul(a, a)?;
                        let x3 = b.mul(x2, a)?;
                        let k1 = b.scalar_like(a, 0.044715)?;
                        let inner0 = b.mul(k1, x3)?;
                        let inner1 = b.add(a, inner0)?;
                        let cc = b.scalar_like(a, c)?;
                        let inner = b.mul(cc, inner1)?;
                        let t = b.tanh(inner)?;
                        let one = b.scalar_like(a, 1.0)?;
                        let half = b.scalar_like(a, 0.5)?;
                        let opt = b.add(one, t)?;
                        let first = b.mul(half, opt)?;
                        let tt = b.mul(t, t)?;
                        let sech2 = b.sub(one, tt)?;
                        let k3 = b.scalar_like(a, 3.0 * 0.044715)?;
                        let k3x2 = b.mul(k3, x2)?;
                        let dinner0 = b.add(one, k3x2)?;
                        let dinner = b.mul(cc, dinner0)?;
                        let hx = b.mul(half, a)?;
                        let s = b.mul(hx, sech2)?;
                        let second = b.mul(s, dinner)?;
                        let d = b.add(first, second)?;
                        b.mul(g, d)?
                    }
                    Unary::Sin => {
                        let c = b.cos(a)?;
                        b.mul(g, c)?
                    }
                    Unary::Cos => {
                        let s = b.sin(a)?;
                        let m = b.mul(g, s)?;
                        b.neg(m)?
                    }
                };
                vec![Some(d)]
            }
            Op::Binary(op) => {
                let (p, q) = (x[0], x[1]);
                let (dp, dq) = match op {
                    Binary::Add => (g, g),
                    Binary::Sub => (g, b.neg(g)?),
                    Binary::Mul => (b.mul(g, q)?, b.mul(g, p)?),
                    Binary::Div => {
                        let dp = b.div(g, q)?;
                        let qq = b.mul(q, q)?;
                        let r = b.div(p, qq)?;
                        let m = b.mul(g, r)?;
                        (dp, b.neg(m)?)
                    }
                    Binary::Max | Binary::Min => {
                        // 1 where this operand wins, 1/2 at a tie, 0 where it loses.
                        let (win_p, win_q) = if *op == Binary::Max {
                            (b.gt(p, q)?, b.gt(q, p)?)
                        } else {
                            (b.lt(p, q)?, b.lt(q, p)?)
                        };
                        let tie = b.eq(p, q)?;
                        let dtype = b.spec(p)?.dtype;
                        let (wp, wq, t) = (
                            b.convert(win_p, dtype)?,
                            b.convert(win_q, dtype)?,
                            b.convert(tie, dtype)?,
                        );
                        let half = b.scalar_like(p, 0.5)?;
                        let ht = b.mul(half, t)?;
                        let mp = b.add(wp, ht)?;
                        let mq = b.add(wq, ht)?;
                        (b.mul(g, mp)?, b.mul(g, mq)?)
                    }
                    Binary::Pow => {
                        // d/dp = q p^(q-1) (0 where q = 0); d/dq = y log(p), log(1) at p = 0.
                        let zero = b.scalar_like(p, 0.0)?;
                        let one = b.scalar_like(p, 1.0)?;
                        let qm1 = b.sub(q, one)?;
                        let pw = b.pow(p, qm1)?;
                        let qpw = b.mul(q, pw)?;
                        let q0 = b.eq(q, zero)?;
                        let dims = b.spec(qpw)?.shape.dims().to_vec();
                        let zq = b.broadcast_to(zero, &dims)?;
                        let dpdx = b.select(q0, zq, qpw)?;
                        let p0 = b.eq(p, zero)?;
                        let safe = b.select(p0, one, p)?;
                        let lg = b.log(safe)?;
                        let dqdx = b.mul(y, lg)?;
                        (b.mul(g, dpdx)?, b.mul(g, dqdx)?)
                    }
                };
                let dp = self.unbroadcast(dp, p)?;
                let dq = self.unbroadcast(dq, q)?;
                vec![Some(dp), Some(dq)]
            }
            Op::Compare(_) => vec![None, None],
            // Integer keys and counters.
            Op::ThreefryUniform => vec![None, None, None],
            Op::Select => {
                let (pred, t, f) = (x[0], x[1], x[2]);
                let zero = b.scalar_like(g, 0.0)?;
                let dt = b.select(pred, g, zero)?;
                let df = b.select(pred, zero, g)?;
                let dt = self.unbroadcast(dt, t)?;
                let df = self.unbroadcast(df, f)?;
                vec![None, Some(dt), Some(df)]
            }
            Op::DotGeneral { lhs_contract, rhs_contract, lhs_batch, rhs_batch } => {
                let (l, r) = (x[0], x[1]);
                let lr = b.spec(l)?.shape.rank();
                let rr = b.spec(r)?.shape.rank();
                let nb = lhs_batch.len();
                let lfree: Vec<usize> = (0..lr)
                    .filter(|d| !lhs_contract.contains(d) && !lhs_batch.contains(d))
                    .collect();
                let rfree: Vec<usize> = (0..rr)
                    .filter(|d| !rhs_contract.contains(d) && !rhs_batch.contains(d))
                    .collect();
                let (nl, nr, nc) = (lfree.len(), rfree.len(), lhs_contract.len());
                let gb: Vec<usize> = (0..nb).collect();
                let (g_lfree, g_rfree): (Vec<usize>, Vec<usize>) =
                    ((nb..nb + nl).collect(), (nb + nl..nb + nl + nr).collect());
                let mut rc_sorted: Vec<usize> = rhs_contract.clone();
                rc_sorted.sort_unstable();
                let mut lc_sorted: Vec<usize> = lhs_contract.clone();
                lc_sorted.sort_unstable();
                // Where each dim of an operand lands in a product of the cotangent with
                // the other operand: batch dims first, then the product's two free
                // groups, `first` (`nf` dims) before `second`. `free` are the operand's
                // free dims; its contracted dim `i` pairs with the other operand's
                // `other_contract[i]`, which lands in that operand's sorted order.
                let place = |rank: usize,
                             batch: &[usize],
                             free: &[usize],
                             contract: &[usize],
                             other_contract: &[usize],
                             other_sorted: &[usize],
                             free_first: bool| {
                    let (free_at, contract_at) =
                        if free_first { (nb, nb + free.len()) } else { (nb + nc, nb) };
                    (0..rank)
                        .map(|d| {
                            if let Some(i) = batch.iter().position(|&e| e == d) {
                                i
                            } else if let Some(j) = free.iter().position(|&e| e == d) {
                                free_at + j
                            } else {
                                let i = contract.iter().position(|&e| e == d).expect("contracted");
                                let o = other_contract[i];
                                contract_at
                                    + other_sorted.iter().position(|&e| e == o).expect("sorted")
                            }
                        })
                        .collect::<Vec<usize>>()
                };
                let identity = |p: &[usize]| p.iter().enumerate().all(|(k, &d)| k == d);
                // d lhs: g's rhs-free dims contracted with rhs's free dims, batch with
                // batch, as `g · rhs` (lhs free dims first) or `rhs · g` (the
                // contracted dims first), whichever needs no transpose.
                let perm =
                    place(lr, lhs_batch, &lfree, lhs_contract, rhs_contract, &rc_sorted, true);
                let dl = if identity(&perm) {
                    b.dot_general(g, r, &g_rfree, &rfree, &gb, rhs_batch)?
                } else {
                    let swapped =
                        place(lr, lhs_batch, &lfree, lhs_contract, rhs_contract, &rc_sorted, false);
                    if identity(&swapped) {
                        b.dot_general(r, g, &rfree, &g_rfree, rhs_batch, &gb)?
                    } else {
                        let dl = b.dot_general(g, r, &g_rfree, &rfree, &gb, rhs_batch)?;
                        b.transpose(dl, &perm)?
                    }
                };
                // d rhs: g's lhs-free dims contracted with lhs's free dims.
                let perm =
                    place(rr, rhs_batch, &rfree, rhs_contract, lhs_contract, &lc_sorted, true);
                let dr = if identity(&perm) {
                    b.dot_general(g, l, &g_lfree, &lfree, &gb, lhs_batch)?
                } else {
                    let swapped =
                        place(rr, rhs_batch, &rfree, rhs_contract, lhs_contract, &lc_sorted, false);
                    if identity(&swapped) {
                        b.dot_general(l, g, &lfree, &g_lfree, lhs_batch, &gb)?
                    } else {
                        let dr = b.dot_general(g, l, &g_lfree, &lfree, &gb, lhs_batch)?;
                        b.transpose(dr, &perm)?
                    }
                };
                vec![Some(dl), Some(dr)]
            }
            Op::Reduce { kind, axes, keepdims } => {
                let a = x[0];
                let shape = b.spec(a)?.shape.dims().to_vec();
                let kept: Vec<usize> = shape
                    .iter()
                    .enumerate()
                    .map(|(d, &n)| if axes.contains(&d) { 1 } else { n })
                    .collect();
                let gk = if *keepdims { g } else { b.reshape(g, &kept)? };
                let gb = b.broadcast_to(gk, &shape)?;
                let d = match kind {
                    Reduction::Sum => gb,
                    Reduction::Mean => {
                        let count: usize = axes.iter().map(|&d| shape[d]).product();
                        let c = b.scalar_like(a, count as f64)?;
                        b.div(gb, c)?
                    }
                    Reduction::Max => {
                        let yk = if *keepdims { y } else { b.reshape(y, &kept)? };
                        let yb = b.broadcast_to(yk, &shape)?;
                        let at = b.eq(a, yb)?;
                        let dtype = b.spec(a)?.dtype;
                        let ind = b.convert(at, dtype)?;
                        let axes_i: Vec<isize> = axes.iter().map(|&d| d as isize).collect();
                        let cnt = b.reduce_sum(ind, &axes_i, true)?;
                        let cb = b.broadcast_to(cnt, &shape)?;
                        let share = b.div(ind, cb)?;
                        b.mul(gb, share)?
                    }
                };
                vec![Some(d)]
            }
            Op::Reshape { .. } => {
                let shape = b.spec(x[0])?.shape.dims().to_vec();
                vec![Some(b.reshape(g, &shape)?)]
            }
            Op::Transpose { perm } => {
                let mut inv = vec![0usize; perm.len()];
                for (i, &p) in perm.iter().enumerate() {
                    inv[p] = i;
                }
                vec![Some(b.transpose(g, &inv)?)]
            }
            Op::BroadcastTo { .. } => vec![Some(self.unbroadcast(g, x[0])?)],
            Op::Concat { axis } => {
                let mut out = Vec::with_capacity(x.len());
                let mut at = 0usize;
                let gdims = b.spec(g)?.shape.dims().to_vec();
                for &a in x {
                    let n = b.spec(a)?.shape.dims()[*axis];
                    let start: Vec<usize> =
                        (0..gdims.len()).map(|d| if d == *axis { at } else { 0 }).collect();
                    let stop: Vec<usize> = (0..gdims.len())
                        .map(|d| if d == *axis { at + n } else { gdims[d] })
                        .collect();
                    let step = vec![1usize; gdims.len()];
                    out.push(Some(b.slice(g, &start, &stop, &step)?));
                    at += n;
                }
                out
            }
            Op::Softmax { axis } => {
                // y (g - Σ g y).
                let gy = b.mul(g, y)?;
                let s = b.reduce_sum(gy, &[*axis as isize], true)?;
                let d = b.sub(g, s)?;
                vec![Some(b.mul(y, d)?)]
            }
            Op::LogSoftmax { axis } => {
                // g - softmax(x) Σ g.
                let s = b.reduce_sum(g, &[*axis as isize], true)?;
                let p = b.exp(y)?;
                let ps = b.mul(p, s)?;
                vec![Some(b.sub(g, ps)?)]
            }
            Op::Convert { .. } => {
                let from = b.spec(x[0])?.dtype;
                if from.is_float() { vec![Some(b.convert(g, from)?)] } else { vec![None] }
            }
            Op::Attention(a) => {
                let args = [x[0], x[1], x[2], g];
                (0..3)
                    .map(|wrt| b.push(Op::AttentionGrad { attention: *a, wrt }, &args).map(Some))
                    .collect::<Result<Vec<_>>>()?
            }
            Op::CrossEntropy => {
                vec![Some(b.push(Op::CrossEntropyGrad, &[x[0], x[1], g])?), None]
            }
            Op::Argmax { .. } | Op::OneHot { .. } => vec![None; x.len()],
            Op::Take { .. } if !b.spec(x[0])?.dtype.is_float() => vec![None, None],
            Op::Take { axis } => {
                // Scatter-add into zeros of the table's shape (repeats accumulate).
                let (table, idx) = (x[0], x[1]);
                let s = b.spec(table)?;
                let (dtype, dims) = (s.dtype, s.shape.dims().to_vec());
                let zero = b.constant(0.0, dtype)?;
                let zeros = b.broadcast_to(zero, &dims)?;
                vec![Some(b.push(Op::ScatterAdd { axis: *axis }, &[zeros, idx, g])?), None]
            }
            Op::ScatterAdd { axis } => {
                let taken = b.take(g, x[1], *axis as isize)?;
                vec![Some(g), None, Some(taken)]
            }
            Op::Slice { start, step, .. } => {
                let dims = b.spec(x[0])?.shape.dims().to_vec();
                let out = b.spec(g)?.shape.dims().to_vec();
                let (mut low, mut high, mut interior) = (Vec::new(), Vec::new(), Vec::new());
                for k in 0..dims.len() {
                    if out[k] == 0 {
                        low.push(dims[k]);
                        high.push(0);
                        interior.push(0);
                    } else {
                        let last = start[k] + (out[k] - 1) * step[k];
                        low.push(start[k]);
                        high.push(dims[k] - last - 1);
                        interior.push(step[k] - 1);
                    }
                }
                vec![Some(b.push(Op::Pad { low, high, interior }, &[g])?)]
            }
            Op::Pad { low, interior, .. } => {
                let dims = b.spec(x[0])?.shape.dims().to_vec();
                let start = low.clone();
                let step: Vec<usize> = interior.iter().map(|i| i + 1).collect();
                let stop: Vec<usize> = (0..dims.len())
                    .map(|k| {
                        if dims[k] == 0 { start[k] } else { start[k] + (dims[k] - 1) * step[k] + 1 }
                    })
                    .collect();
                vec![Some(b.slice(g, &start, &stop, &step)?)]
            }
            Op::Conv2d { strides, padding } => {
                let (xi, w) = (x[0], x[1]);
                let input: [usize; 4] = b.spec(xi)?.shape.dims().try_into().expect("rank 4");
                let filter: [usize; 4] = b.spec(w)?.shape.dims().try_into().expect("rank 4");
                let dx = b.push(
                    Op::Conv2dBackpropInput { strides: *strides, padding: *padding, input },
                    &[g, w],
                )?;
                let dw = b.push(
                    Op::Conv2dBackpropFilter { strides: *strides, padding: *padding, filter },
                    &[xi, g],
                )?;
                vec![Some(dx), Some(dw)]
            }
            Op::Conv2dBackpropInput { strides, padding, .. } => {
                // Linear in both: <c, BI(g, w)> = <conv(c, w), g> = <BF(c, g), w>.
                let (gy, w) = (x[0], x[1]);
                let filter: [usize; 4] = b.spec(w)?.shape.dims().try_into().expect("rank 4");
                let dg = b.conv2d(g, w, *strides, *padding)?;
                let dw = b.push(
                    Op::Conv2dBackpropFilter { strides: *strides, padding: *padding, filter },
                    &[g, gy],
                )?;
                vec![Some(dg), Some(dw)]
            }
            Op::Conv2dBackpropFilter { strides, padding, .. } => {
                // <c, BF(x, g)> = <conv(x, c), g> = <BI(g, c), x>.
                let (xi, gy) = (x[0], x[1]);
                let input: [usize; 4] = b.spec(xi)?.shape.dims().try_into().expect("rank 4");
                let dx = b.push(
                    Op::Conv2dBackpropInput { strides: *strides, padding: *padding, input },
                    &[gy, g],
                )?;
                let dg = b.conv2d(xi, g, *strides, *padding)?;
                vec![Some(dx), Some(dg)]
            }
            // A sum or mean over the group is its own transpose.
            Op::AllReduce { op: op @ (ReduceOp::Sum | ReduceOp::Mean), groups } => {
                vec![Some(b.all_reduce(g, *op, groups)?)]
            }
            Op::AllGather { axis, groups } => {
                vec![Some(b.reduce_scatter(g, ReduceOp::Sum, *axis, groups)?)]
            }
            Op::ReduceScatter { op: op @ (ReduceOp::Sum | ReduceOp::Mean), axis, groups } => {
                let gathered = b.all_gather(g, *axis, groups)?;
                if *op == ReduceOp::Mean {
                    let n = groups.first().map_or(1, Vec::len);
                    let c = b.scalar_like(gathered, n as f64)?;
                    vec![Some(b.div(gathered, c)?)]
                } else {
                    vec![Some(gathered)]
                }
            }
            Op::AllToAll { split_axis, concat_axis, groups } => {
                vec![Some(b.all_to_all(g, *concat_axis, *split_axis, groups)?)]
            }
            Op::ShardSlice { axis, groups } => vec![Some(b.shard_pad(g, *axis, groups)?)],
            Op::ShardPad { axis, groups } => vec![Some(b.shard_slice(g, *axis, groups)?)],
            Op::CollectivePermute { pairs } => {
                let back: Vec<(usize, usize)> = pairs.iter().map(|&(s, t)| (t, s)).collect();
                vec![Some(b.collective_permute(g, &back)?)]
            }
            // Tokens carry no gradient, and what they sent gets none here (the partitioner
            // pairs a send's gradient with its recv's).
            Op::Send { .. } | Op::Emit { .. } => vec![None; x.len()],
            Op::Constant { .. } | Op::Literal { .. } | Op::Iota { .. } | Op::Recv { .. } => {
                Vec::new()
            }
            other => {
                return Err(Error::NoTransposeRule { op: other.name(), value: k as u32 });
            }
        })
    }
}
