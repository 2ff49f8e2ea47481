//! Each program op as the sharding crate's [`OpRule`]: which dims of its operands and
//! result are the same factor, which it sums over, which it needs whole.

use meshwork_program::{Binary, Op, Reduction, Unary};
use meshwork_sharding::Result;
use meshwork_sharding::spmd::{FactorKind, Linear, OpRule};

/// A rule built factor by factor.
#[derive(Default)]
struct Rule {
    factors: Vec<(usize, FactorKind)>,
}

impl Rule {
    fn factor(&mut self, size: usize, kind: FactorKind) -> Vec<usize> {
        if size == 1 {
            return Vec::new();
        }
        self.factors.push((size, kind));
        vec![self.factors.len() - 1]
    }
    fn whole(&mut self, size: usize) -> Vec<usize> {
        self.factor(size, FactorKind::Whole)
    }
    fn pass(&mut self, size: usize) -> Vec<usize> {
        self.factor(size, FactorKind::Pass)
    }
    fn build(self, operands: Vec<Vec<Vec<usize>>>, result: Vec<Vec<usize>>) -> Result<OpRule> {
        OpRule::new(&self.factors, operands, result)
    }
}

/// The same shape in and out, with the dims in `whole` needed whole (softmax, a
/// partial slice's dims): one factor per dim, shared where the sizes agree.
fn per_dim(input: &[usize], output: &[usize], whole: impl Fn(usize) -> bool) -> Result<OpRule> {
    let mut r = Rule::default();
    let mut i = Vec::new();
    let mut o = Vec::new();
    for d in 0..input.len() {
        if whole(d) || input[d] != output[d] {
            i.push(r.whole(input[d]));
            o.push(r.whole(output[d]));
        } else {
            let f = r.pass(input[d]);
            i.push(f.clone());
            o.push(f);
        }
    }
    r.build(vec![i], o)
}

/// The rule of `op` over operands of shapes `args` making a result of shape `out`.
pub(crate) fn rule(op: &Op, args: &[&[usize]], out: &[usize]) -> Result<OpRule> {
    let linear1 = Linear::Each(vec![true]);
    Ok(match op {
        Op::Unary(u) => {
            let r = OpRule::elementwise(args, out)?;
            match u {
                Unary::Neg | Unary::StopGradient | Unary::Barrier => r.with_linear(linear1),
                _ => r,
            }
        }
        Op::Binary(b) => {
            let r = OpRule::elementwise(args, out)?;
            match b {
                Binary::Add | Binary::Sub => r.with_linear(Linear::Joint(vec![true, true])),
                Binary::Mul => r.with_linear(Linear::Each(vec![true, true])),
                Binary::Div => r.with_linear(Linear::Each(vec![true, false])),
                _ => r,
            }
        }
        Op::Compare(_) | Op::Select | Op::ThreefryUniform => OpRule::elementwise(args, out)?,
        Op::Convert { .. } => OpRule::elementwise(args, out)?,
        Op::Constant { .. } | Op::Literal { .. } => OpRule::opaque(&[], out),
        Op::DotGeneral { lhs_contract, rhs_contract, lhs_batch, rhs_batch } => {
            OpRule::dot_general(args[0], args[1], lhs_contract, rhs_contract, lhs_batch, rhs_batch)?
        }
        Op::Reduce { kind, axes, keepdims } => {
            OpRule::reduce(args[0], axes, *keepdims, *kind != Reduction::Max)?
        }
        Op::Reshape { .. } => OpRule::reshape(args[0], out)?,
        Op::Transpose { perm } => OpRule::transpose(args[0], perm)?,
        Op::BroadcastTo { .. } => OpRule::broadcast(args[0], out)?,
        Op::Slice { start, stop, step } => {
            let x = args[0];
            per_dim(x, out, |d| !(start[d] == 0 && stop[d] == x[d] && step[d] == 1))?
                .with_linear(linear1)
        }
        Op::Pad { low, high, interior } => {
            per_dim(args[0], out, |d| low[d] + high[d] + interior[d] > 0)?.with_linear(linear1)
        }
        Op::Softmax { axis } | Op::LogSoftmax { axis } => per_dim(args[0], out, |d| d == *axis)?,
        Op::Attention(_) | Op::AttentionGrad { .. } => {
            // q [B,H,Tq,D], k [B,H,Tk,D], v [B,H,Tk,Dv] (and dout [B,H,Tq,Dv]): split
            // by batch and heads, each head's attention whole.
            let (q, k, v) = (args[0], args[1], args[2]);
            let mut r = Rule::default();
            let (b, h) = (r.pass(q[0]), r.pass(q[1]));
            let (tq, tk) = (r.whole(q[2]), r.whole(k[2]));
            let (d, dv) = (r.whole(q[3]), r.whole(v[3]));
            let qf = vec![b.clone(), h.clone(), tq.clone(), d.clone()];
            let kf = vec![b.clone(), h.clone(), tk.clone(), d];
            let vf = vec![b.clone(), h.clone(), tk, dv.clone()];
            let of = vec![b, h, tq, dv];
            match op {
                Op::AttentionGrad { wrt, .. } => {
                    let result = [&qf, &kf, &vf][(*wrt).min(2)].clone();
                    r.build(vec![qf, kf, vf, of], result)?
                }
                _ => r.build(vec![qf, kf, vf], of)?,
            }
        }
        Op::CrossEntropy | Op::CrossEntropyGrad => {
            // logits [..., C], labels [...] (and the loss's cotangent [...]): split by
            // positions, each row's classes whole.
            let Some((&classes, dims)) = args[0].split_last() else {
                // Inference refuses logits without a class axis.
                return Ok(OpRule::opaque(args, out));
            };
            let mut r = Rule::default();
            let positions: Vec<Vec<usize>> = dims.iter().map(|&s| r.pass(s)).collect();
            let mut logits = positions.clone();
            logits.push(r.whole(classes));
            match op {
                Op::CrossEntropyGrad => {
                    r.build(vec![logits.clone(), positions.clone(), positions], logits)?
                }
                _ => r.build(vec![logits, positions.clone()], positions)?,
            }
        }
        Op::Argmax { axis } => {
            let mut r = Rule::default();
            let x = args[0];
            let mut i = Vec::new();
            let mut o = Vec::new();
            for (d, &s) in x.iter().enumerate() {
                if d == *axis {
                    i.push(r.whole(s));
                } else {
                    let f = r.pass(s);
                    i.push(f.clone());
                    o.push(f);
                }
            }
            r.build(vec![i], o)?
        }
        Op::Concat { axis } => {
            let mut r = Rule::default();
            let shared: Vec<Vec<usize>> = out
                .iter()
                .enumerate()
                .map(|(d, &s)| if d == *axis { Vec::new() } else { r.pass(s) })
                .collect();
            let operands = args
                .iter()
                .map(|a| {
                    let mut dims = shared.clone();
                    dims[*axis] = r.whole(a[*axis]);
                    dims
                })
                .collect();
            let mut result = shared;
            result[*axis] = r.whole(out[*axis]);
            r.build(operands, result)?.with_linear(Linear::Joint(vec![true; args.len()]))
        }
        Op::Take { axis } => {
            // table [before, A, after], indices [I..] -> [before, I.., after].
            let (table, idx) = (args[0], args[1]);
            let mut r = Rule::default();
            let mut t = Vec::new();
            let mut o = Vec::new();
            for &s in &table[..*axis] {
                let f = r.pass(s);
                t.push(f.clone());
                o.push(f);
            }
            t.push(r.whole(table[*axis]));
            let ii: Vec<Vec<usize>> = idx.iter().map(|&s| r.pass(s)).collect();
            o.extend(ii.iter().cloned());
            for &s in &table[*axis + 1..] {
                let f = r.pass(s);
                t.push(f.clone());
                o.push(f);
            }
            r.build(vec![t, ii], o)?.with_linear(Linear::Each(vec![true, false]))
        }
        Op::ScatterAdd { axis } => {
            // operand [before, A, after], indices [I..], updates [before, I.., after].
            let (x, idx) = (args[0], args[1]);
            let mut r = Rule::default();
            let before: Vec<Vec<usize>> = x[..*axis].iter().map(|&s| r.pass(s)).collect();
            let a = r.whole(x[*axis]);
            let after: Vec<Vec<usize>> = x[*axis + 1..].iter().map(|&s| r.pass(s)).collect();
            let ii: Vec<Vec<usize>> = idx.iter().map(|&s| r.factor(s, FactorKind::Sum)).collect();
            let mut operand = before.clone();
            operand.push(a);
            operand.extend(after.iter().cloned());
            let mut updates = before;
            updates.extend(ii.iter().cloned());
            updates.extend(after);
            let result = operand.clone();
            r.build(vec![operand, ii, updates], result)?
                .with_linear(Linear::Joint(vec![true, false, true]))
        }
        Op::OneHot { .. } => {
            let mut r = Rule::default();
            let ii: Vec<Vec<usize>> = args[0].iter().map(|&s| r.pass(s)).collect();
            let mut o = ii.clone();
            o.push(r.whole(out[out.len() - 1]));
            r.build(vec![ii], o)?
        }
        Op::Iota { axis, .. } => {
            let mut r = Rule::default();
            let o = out
                .iter()
                .enumerate()
                .map(|(d, &s)| if d == *axis { r.whole(s) } else { r.pass(s) })
                .collect();
            r.build(Vec::new(), o)?
        }
        Op::Conv2d { .. } => {
            // x [N,H,W,C], w [KH,KW,C,O] -> [N,OH,OW,O]; C summed.
            let (x, w) = (args[0], args[1]);
            let mut r = Rule::default();
            let (n, c, o) = (r.pass(x[0]), r.factor(x[3], FactorKind::Sum), r.pass(w[3]));
            let xs = vec![n.clone(), r.whole(x[1]), r.whole(x[2]), c.clone()];
            let ws = vec![r.whole(w[0]), r.whole(w[1]), c, o.clone()];
            let ys = vec![n, r.whole(out[1]), r.whole(out[2]), o];
            r.build(vec![xs, ws], ys)?.with_linear(Linear::Each(vec![true, true]))
        }
        Op::Conv2dBackpropInput { .. } => {
            // g [N,OH,OW,O], w [KH,KW,C,O] -> [N,H,W,C]; O summed.
            let (g, w) = (args[0], args[1]);
            let mut r = Rule::default();
            let (n, o, c) = (r.pass(g[0]), r.factor(g[3], FactorKind::Sum), r.pass(w[2]));
            let gs = vec![n.clone(), r.whole(g[1]), r.whole(g[2]), o.clone()];
            let ws = vec![r.whole(w[0]), r.whole(w[1]), c.clone(), o];
            let ys = vec![n, r.whole(out[1]), r.whole(out[2]), c];
            r.build(vec![gs, ws], ys)?.with_linear(Linear::Each(vec![true, true]))
        }
        Op::Conv2dBackpropFilter { .. } => {
            // x [N,H,W,C], g [N,OH,OW,O] -> [KH,KW,C,O]; N summed.
            let (x, g) = (args[0], args[1]);
            let mut r = Rule::default();
            let (n, c, o) = (r.factor(x[0], FactorKind::Sum), r.pass(x[3]), r.pass(g[3]));
            let xs = vec![n.clone(), r.whole(x[1]), r.whole(x[2]), c.clone()];
            let gs = vec![n, r.whole(g[1]), r.whole(g[2]), o.clone()];
            let ys = vec![r.whole(out[0]), r.whole(out[1]), c, o];
            r.build(vec![xs, gs], ys)?.with_linear(Linear::Each(vec![true, true]))
        }
        // What the partitioner refuses before asking (communication) and `emit`, whose
        // operands the host reads whole.
        _ => OpRule::opaque(args, out),
    })
}
