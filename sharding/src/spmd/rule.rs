//! How an op's operands and result relate dim by dim: XLA's sharding rules in
//! einsum form, over *factors* (the labels of an einsum, split further where a
//! reshape splits or merges dims).

use crate::{Error, Result};

/// What sharding a factor does to an op.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FactorKind {
    /// The factor reaches the result: sharding it shards the result alike.
    Pass,
    /// The op sums over it (a contracted dim of `dot_general`, a summed axis):
    /// sharding it leaves the result a partial sum pending over those axes.
    Sum,
    /// The op needs the factor whole on every device (a softmax axis, a sliced or
    /// padded dim, a gathered table axis).
    Whole,
}

/// Whether pending sums may flow through an op unreduced.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Linear {
    /// No: every pending operand is reduced first.
    No,
    /// The op is linear in each marked operand on its own (`mul` in either, `div` in
    /// its numerator, `dot_general` in either): one marked operand may be pending if
    /// no other operand is, and the result is pending over the same axes.
    Each(Vec<bool>),
    /// The op is linear in the marked operands jointly (`add`, `sub`, `concat`; a
    /// `scatter_add`'s operand and updates): the result is pending over axes on which
    /// every marked operand that is not a known zero is pending. Unmarked operands are
    /// never pending.
    Joint(Vec<bool>),
}

/// An op's sharding rule: a list of factors (each with a size and a kind), and for
/// each operand dim and result dim the factors it is made of, major first.
///
/// A dim made of factors `[f, g]` is indexed `i = i_f * size(g) + i_g`; tiling the dim
/// into blocks over mesh axes tiles its major factors first (so a `[B, T, D]` →
/// `[B, T, H, D/H]` reshape carries a tiling of `D` onto `H`). A size-1 dim has no
/// factors. Einsum `bij,bjk->bik` is `dot_general`'s rule: `b` and `i`, `k` pass,
/// `j` is summed.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct OpRule {
    sizes: Vec<usize>,
    kinds: Vec<FactorKind>,
    operands: Vec<Vec<Vec<usize>>>,
    result: Vec<Vec<usize>>,
    linear: Linear,
}

fn rule_error(problem: &'static str) -> Error {
    Error::BadRule { problem }
}

impl OpRule {
    /// A rule from its factors (`(size, kind)`), each operand's dims and the result's
    /// dims as factor indices. Refused ([`Error::BadRule`]) when a factor index is out
    /// of range or repeats within one operand or the result, when a `Sum` factor is in
    /// the result. (A factor no dim names is inert: elementwise rules leave one for a
    /// dim of size 1.)
    pub fn new(
        factors: &[(usize, FactorKind)],
        operands: Vec<Vec<Vec<usize>>>,
        result: Vec<Vec<usize>>,
    ) -> Result<OpRule> {
        let n = factors.len();
        let check = |dims: &[Vec<usize>]| -> Result<()> {
            let mut seen = vec![false; n];
            for &f in dims.iter().flatten() {
                if f >= n {
                    return Err(rule_error("a dim names a factor the rule does not have"));
                }
                if std::mem::replace(&mut seen[f], true) {
                    return Err(rule_error("a factor appears twice in one value"));
                }
            }
            Ok(())
        };
        for o in &operands {
            check(o)?;
        }
        check(&result)?;
        for (f, &(_, kind)) in factors.iter().enumerate() {
            let in_result = result.iter().flatten().any(|&g| g == f);
            if kind == FactorKind::Sum && in_result {
                return Err(rule_error("a summed factor cannot be in the result"));
            }
        }
        Ok(OpRule {
            sizes: factors.iter().map(|f| f.0).collect(),
            kinds: factors.iter().map(|f| f.1).collect(),
            operands,
            result,
            linear: Linear::No,
        })
    }

    /// The rule of an einsum over one-letter labels, `"bij,bjk->bik"`, with the
    /// operands' `shapes`: labels missing from the result are summed. Refused when
    /// the spec does not parse, a label's sizes disagree, a result label is in no
    /// operand, or a rank differs from the spec.
    pub fn einsum(spec: &str, shapes: &[&[usize]]) -> Result<OpRule> {
        let (ins, out) = spec.split_once("->").ok_or(rule_error("an einsum needs `->`"))?;
        let ins: Vec<&str> = ins.split(',').collect();
        if ins.len() != shapes.len() {
            return Err(rule_error("an einsum names one label string per operand"));
        }
        let mut labels: Vec<char> = Vec::new();
        let mut sizes: Vec<usize> = Vec::new();
        let mut operands = Vec::new();
        for (s, shape) in ins.iter().zip(shapes) {
            let s = s.trim();
            if s.chars().count() != shape.len() {
                return Err(rule_error("an operand's rank differs from its einsum labels"));
            }
            let mut dims = Vec::new();
            for (c, &size) in s.chars().zip(shape.iter()) {
                if !c.is_ascii_alphabetic() {
                    return Err(rule_error("einsum labels are ASCII letters"));
                }
                let f = match labels.iter().position(|&l| l == c) {
                    Some(f) if sizes[f] != size => {
                        return Err(rule_error("an einsum label has two sizes"));
                    }
                    Some(f) => f,
                    None => {
                        labels.push(c);
                        sizes.push(size);
                        labels.len() - 1
                    }
                };
                dims.push(if size == 1 { Vec::new() } else { vec![f] });
            }
            operands.push(dims);
        }
        let mut result = Vec::new();
        for c in out.trim().chars() {
            let f = labels
                .iter()
                .position(|&l| l == c)
                .ok_or(rule_error("a result label is in no operand"))?;
            result.push(if sizes[f] == 1 { Vec::new() } else { vec![f] });
        }
        let factors: Vec<(usize, FactorKind)> = (0..labels.len())
            .map(|f| {
                let kept = out.contains(labels[f]);
                (sizes[f], if kept { FactorKind::Pass } else { FactorKind::Sum })
            })
            .collect();
        OpRule::new(&factors, operands, result)
    }

    /// An elementwise op over `operands` with NumPy broadcasting to `result`: an
    /// operand dim of size 1 under a larger result dim has no factor. Not linear.
    pub fn elementwise(operands: &[&[usize]], result: &[usize]) -> Result<OpRule> {
        let r = result.len();
        let factors: Vec<(usize, FactorKind)> =
            result.iter().map(|&s| (s, FactorKind::Pass)).collect();
        let dims_of = |shape: &[usize]| -> Result<Vec<Vec<usize>>> {
            if shape.len() > r {
                return Err(rule_error("an operand has a higher rank than the result"));
            }
            shape
                .iter()
                .enumerate()
                .map(|(k, &s)| {
                    let d = k + r - shape.len();
                    if s == result[d] && s != 1 {
                        Ok(vec![d])
                    } else if s == 1 {
                        Ok(Vec::new())
                    } else {
                        Err(rule_error("an operand dim neither matches nor broadcasts"))
                    }
                })
                .collect()
        };
        let operands = operands.iter().map(|s| dims_of(s)).collect::<Result<_>>()?;
        let result = dims_of(result)?;
        OpRule::new(&factors, operands, result)
    }

    /// XLA's `dot_general` over `lhs` and `rhs` (contracted and batch dims paired by
    /// position): result batch dims, then the lhs's free dims, then the rhs's; the
    /// contracted factors are summed. Linear in each operand.
    pub fn dot_general(
        lhs: &[usize],
        rhs: &[usize],
        lhs_contract: &[usize],
        rhs_contract: &[usize],
        lhs_batch: &[usize],
        rhs_batch: &[usize],
    ) -> Result<OpRule> {
        if lhs_contract.len() != rhs_contract.len() || lhs_batch.len() != rhs_batch.len() {
            return Err(rule_error("dot_general's dim lists pair up by position"));
        }
        let mut factors = Vec::new();
        let mut l = vec![usize::MAX; lhs.len()];
        let mut r = vec![usize::MAX; rhs.len()];
        let mut result = Vec::new();
        let mut pair = |a: usize, b: usize, kind, factors: &mut Vec<(usize, FactorKind)>| {
            if a >= lhs.len() || b >= rhs.len() || lhs[a] != rhs[b] {
                return Err(rule_error("paired dot_general dims differ in size"));
            }
            if l[a] != usize::MAX || r[b] != usize::MAX {
                return Err(rule_error("a dot_general dim is paired twice"));
            }
            factors.push((lhs[a], kind));
            l[a] = factors.len() - 1;
            r[b] = factors.len() - 1;
            Ok(factors.len() - 1)
        };
        for (&a, &b) in lhs_batch.iter().zip(rhs_batch) {
            result.push(pair(a, b, FactorKind::Pass, &mut factors)?);
        }
        for (&a, &b) in lhs_contract.iter().zip(rhs_contract) {
            pair(a, b, FactorKind::Sum, &mut factors)?;
        }
        for (dims, shape) in [(&mut l, lhs), (&mut r, rhs)] {
            for (d, &s) in shape.iter().enumerate() {
                if dims[d] == usize::MAX {
                    factors.push((s, FactorKind::Pass));
                    dims[d] = factors.len() - 1;
                    result.push(factors.len() - 1);
                }
            }
        }
        let dims = |fs: &[usize]| -> Vec<Vec<usize>> {
            fs.iter().map(|&f| if factors[f].0 == 1 { Vec::new() } else { vec![f] }).collect()
        };
        let (lo, ro, re) = (dims(&l), dims(&r), dims(&result));
        Ok(OpRule::new(&factors, vec![lo, ro], re)?.with_linear(Linear::Each(vec![true, true])))
    }

    /// A reduction of `shape` over `axes`: the reduced factors are summed if `sum`,
    /// else needed whole (a max, an argmax); with `keepdims` they stay as size-1 dims.
    pub fn reduce(shape: &[usize], axes: &[usize], keepdims: bool, sum: bool) -> Result<OpRule> {
        let kind = |d: usize| {
            if !axes.contains(&d) {
                FactorKind::Pass
            } else if sum {
                FactorKind::Sum
            } else {
                FactorKind::Whole
            }
        };
        let factors: Vec<(usize, FactorKind)> =
            shape.iter().enumerate().map(|(d, &s)| (s, kind(d))).collect();
        let one = |d: usize| if shape[d] == 1 { Vec::new() } else { vec![d] };
        let operand = (0..shape.len()).map(one).collect();
        let result = (0..shape.len())
            .filter_map(|d| match (axes.contains(&d), keepdims) {
                (false, _) => Some(one(d)),
                (true, true) => Some(Vec::new()),
                (true, false) => None,
            })
            .collect();
        let linear = if sum { Linear::Each(vec![true]) } else { Linear::No };
        Ok(OpRule::new(&factors, vec![operand], result)?.with_linear(linear))
    }

    /// Output dim `i` is input dim `perm[i]`. Linear.
    pub fn transpose(shape: &[usize], perm: &[usize]) -> Result<OpRule> {
        let mut seen = vec![false; shape.len()];
        if perm.len() != shape.len()
            || perm.iter().any(|&p| p >= shape.len() || std::mem::replace(&mut seen[p], true))
        {
            return Err(rule_error("a transpose needs a permutation of the dims"));
        }
        let factors: Vec<(usize, FactorKind)> =
            shape.iter().map(|&s| (s, FactorKind::Pass)).collect();
        let one = |d: usize| if shape[d] == 1 { Vec::new() } else { vec![d] };
        let operand = (0..shape.len()).map(one).collect();
        let result = perm.iter().map(|&p| one(p)).collect();
        Ok(OpRule::new(&factors, vec![operand], result)?.with_linear(Linear::Each(vec![true])))
    }

    /// A reshape of `from` to `to` (same element count): walking both shapes from
    /// the major end, a dim that equals, divides or is divided by its counterpart
    /// shares factors with it; past the first pair that does neither, the remaining
    /// dims keep only their common leading factor shardable and are otherwise needed
    /// whole. Linear.
    pub fn reshape(from: &[usize], to: &[usize]) -> Result<OpRule> {
        let count = |s: &[usize]| s.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        if count(from) != count(to) || count(from).is_none() {
            return Err(rule_error("a reshape keeps the element count"));
        }
        let mut factors: Vec<(usize, FactorKind)> = Vec::new();
        let mut fdims: Vec<Vec<usize>> = vec![Vec::new(); from.len()];
        let mut tdims: Vec<Vec<usize>> = vec![Vec::new(); to.len()];
        if count(from) != Some(0) {
            let (mut rf, mut rt) = (from.to_vec(), to.to_vec());
            let (mut i, mut j) = (0, 0);
            let mut blocked = false;
            loop {
                while i < rf.len() && rf[i] == 1 {
                    i += 1;
                }
                while j < rt.len() && rt[j] == 1 {
                    j += 1;
                }
                if i == rf.len() || j == rt.len() {
                    break;
                }
                let (a, b) = (rf[i], rt[j]);
                let g = if a % b == 0 {
                    b
                } else if b % a == 0 {
                    a
                } else {
                    blocked = true;
                    gcd(a, b)
                };
                if g > 1 {
                    factors.push((g, FactorKind::Pass));
                    fdims[i].push(factors.len() - 1);
                    tdims[j].push(factors.len() - 1);
                    rf[i] /= g;
                    rt[j] /= g;
                }
                if blocked {
                    break;
                }
            }
            if blocked {
                // Everything left of both shapes is needed whole.
                for (dims, rest, k) in [(&mut fdims, &rf, i), (&mut tdims, &rt, j)] {
                    for d in k..rest.len() {
                        if rest[d] > 1 {
                            factors.push((rest[d], FactorKind::Whole));
                            dims[d].push(factors.len() - 1);
                        }
                    }
                }
            }
        }
        Ok(OpRule::new(&factors, vec![fdims], tdims)?.with_linear(Linear::Each(vec![true])))
    }

    /// NumPy broadcasting of `from` to `to`. Linear.
    pub fn broadcast(from: &[usize], to: &[usize]) -> Result<OpRule> {
        Ok(OpRule::elementwise(&[from], to)?.with_linear(Linear::Each(vec![true])))
    }

    /// An op that needs every dim of every operand and of the result whole (one
    /// factor per dim, none shared): the rule for anything without a better one.
    pub fn opaque(operands: &[&[usize]], result: &[usize]) -> OpRule {
        let mut factors = Vec::new();
        let mut dims = |shape: &[usize]| -> Vec<Vec<usize>> {
            shape
                .iter()
                .map(|&s| {
                    if s == 1 {
                        return Vec::new();
                    }
                    factors.push((s, FactorKind::Whole));
                    vec![factors.len() - 1]
                })
                .collect()
        };
        let operands = operands.iter().map(|s| dims(s)).collect();
        let result = dims(result);
        OpRule::new(&factors, operands, result).expect("fresh factors are distinct")
    }

    /// The same rule with this linearity.
    pub fn with_linear(mut self, linear: Linear) -> OpRule {
        if let Linear::Each(mask) | Linear::Joint(mask) = &linear
            && mask.len() != self.operands.len()
        {
            self.linear = Linear::No;
            return self;
        }
        self.linear = linear;
        self
    }

    /// The same rule with every factor of operand `operand`'s dim `dim` needed whole
    /// (`operand == operands().len()` means the result).
    pub fn with_whole(mut self, operand: usize, dim: usize) -> OpRule {
        let dims = if operand == self.operands.len() {
            self.result.get(dim)
        } else {
            self.operands.get(operand).and_then(|o| o.get(dim))
        };
        for f in dims.cloned().unwrap_or_default() {
            if self.kinds[f] == FactorKind::Pass {
                self.kinds[f] = FactorKind::Whole;
            }
        }
        self
    }

    /// The number of factors.
    pub fn num_factors(&self) -> usize {
        self.sizes.len()
    }

    /// Factor `f`'s size.
    pub fn size(&self, f: usize) -> usize {
        self.sizes[f]
    }

    /// Factor `f`'s kind.
    pub fn kind(&self, f: usize) -> FactorKind {
        self.kinds[f]
    }

    /// Each operand's dims as factors.
    pub fn operands(&self) -> &[Vec<Vec<usize>>] {
        &self.operands
    }

    /// The result's dims as factors.
    pub fn result(&self) -> &[Vec<usize>] {
        &self.result
    }

    /// Whether pending sums pass through.
    pub fn linear(&self) -> &Linear {
        &self.linear
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}
