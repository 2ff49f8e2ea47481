//! Combining all-reduces (XLA's `AllReduceCombiner`): independent all-reduces of one
//! dtype, reduction and replica groups become one all-reduce of their concatenation,
//! so a step that reduces many small gradients launches one collective instead of one
//! per gradient.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use meshwork_types::{ReduceOp, Shape, TensorSpec};

use crate::op::Op;
use crate::program::{Instr, Program, Value};

/// An all-reduce's combining key: its reduction, replica groups and dtype.
type Key = (ReduceOp, Vec<Vec<usize>>, meshwork_types::DType);

/// A set of values as bits.
#[derive(Clone, Default)]
struct Bits(Vec<u64>);

impl Bits {
    fn set(&mut self, k: usize) {
        if self.0.len() <= k / 64 {
            self.0.resize(k / 64 + 1, 0);
        }
        self.0[k / 64] |= 1 << (k % 64);
    }
    fn union(&mut self, other: &Bits) {
        if self.0.len() < other.0.len() {
            self.0.resize(other.0.len(), 0);
        }
        for (a, b) in self.0.iter_mut().zip(&other.0) {
            *a |= b;
        }
    }
    fn get(&self, k: usize) -> bool {
        self.0.get(k / 64).is_some_and(|w| w & (1 << (k % 64)) != 0)
    }
    fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.0.len() * 64).filter(|&k| self.get(k))
    }
}

/// Whether combination `from` reaches any of `targets` (itself included) along `succ`.
fn reaches(succ: &[Bits], from: usize, targets: &Bits) -> bool {
    let mut seen = Bits::default();
    let mut stack = vec![from];
    seen.set(from);
    while let Some(g) = stack.pop() {
        if targets.get(g) {
            return true;
        }
        for n in succ[g].iter() {
            if !seen.get(n) {
                seen.set(n);
                stack.push(n);
            }
        }
    }
    false
}

impl Program {
    /// This program with its all-reduces combined, as XLA's `AllReduceCombiner` does:
    /// going through the program in order, each all-reduce joins the open combination
    /// of its dtype, reduction and replica groups unless its operand depends on one
    /// already in it or the combination would pass `max_bytes` (per device); a
    /// combination then runs as one all-reduce of its members' operands flattened and
    /// concatenated, placed where its last member was, and each member's result is
    /// sliced back out of it. Everything that read a member's result runs after the
    /// combination, and nothing else moves out of order.
    ///
    /// The results are bit for bit the uncombined program's: an all-reduce reduces
    /// each element on its own, in the same order, whatever else travels with it.
    pub fn combine_all_reduces(&self, max_bytes: usize) -> Program {
        self.combine_all_reduces_traced(max_bytes).0
    }

    /// [`combine_all_reduces`](Self::combine_all_reduces), with where each value went:
    /// entry `v` is the value of the combined program that computes value `v` of this
    /// one — for an all-reduce that was combined, the combination's launch (the
    /// all-reduce of the concatenation; its own result is a slice of that).
    pub fn combine_all_reduces_traced(&self, max_bytes: usize) -> (Program, Vec<Value>) {
        let np = self.params.len();
        let ni = self.instrs.len();
        // The nearest all-reduces each value depends on (by index among the
        // all-reduces): those reached without passing another all-reduce.
        let mut reduces: Vec<usize> = Vec::new();
        let mut near: Vec<Bits> = vec![Bits::default(); np + ni];
        for (i, instr) in self.instrs.iter().enumerate() {
            if matches!(instr.op, Op::AllReduce { .. }) {
                near[np + i].set(reduces.len());
                reduces.push(i);
            } else {
                let mut d = Bits::default();
                for a in &instr.args {
                    d.union(&near[a.index()]);
                }
                near[np + i] = d;
            }
        }
        // Greedy combinations in program order. The combinations form a graph (an
        // edge from one to another that reads its results, directly or through other
        // instructions); an all-reduce joins the open combination of its key only if
        // that keeps the graph acyclic, so the combined program has an order.
        let mut groups: Vec<Vec<usize>> = Vec::new();
        let mut group_of: Vec<usize> = Vec::with_capacity(reduces.len());
        let mut succ: Vec<Bits> = Vec::new();
        let mut open: HashMap<Key, (usize, usize)> = HashMap::new();
        for &i in &reduces {
            let instr = &self.instrs[i];
            let Op::AllReduce { op, groups: replicas } = &instr.op else { unreachable!() };
            let key = (*op, replicas.clone(), instr.spec.dtype);
            let bytes = instr.spec.shape.num_elements() * instr.spec.dtype.size_in_bytes();
            // The combinations this one reads from.
            let mut preds = Bits::default();
            for (k, &g) in group_of.iter().enumerate() {
                if near[instr.args[0].index()].get(k) {
                    preds.set(g);
                }
            }
            let g = match open.get_mut(&key) {
                Some((g, total))
                    if total.saturating_add(bytes) <= max_bytes && !reaches(&succ, *g, &preds) =>
                {
                    *total += bytes;
                    groups[*g].push(i);
                    *g
                }
                _ => {
                    open.insert(key, (groups.len(), bytes));
                    groups.push(vec![i]);
                    succ.push(Bits::default());
                    groups.len() - 1
                }
            };
            group_of.push(g);
            for p in preds.iter() {
                succ[p].set(g);
            }
        }
        groups.retain(|g| g.len() > 1);
        if groups.is_empty() {
            return (self.clone(), (0..np + ni).map(|v| Value(v as u32)).collect());
        }
        let mut group_of = vec![None; ni];
        for (g, members) in groups.iter().enumerate() {
            for &i in members {
                group_of[i] = Some(g);
            }
        }
        // The new order: instructions and combinations (node `ni + g`), each as soon
        // as its operands are there, earliest original position first; a combination
        // stands at its last member's position.
        let node_of = |i: usize| group_of[i].map_or(i, |g| ni + g);
        let nodes = ni + groups.len();
        let mut waiting = vec![0usize; nodes];
        let mut readers: Vec<Vec<usize>> = vec![Vec::new(); nodes];
        for (i, instr) in self.instrs.iter().enumerate() {
            let n = node_of(i);
            for a in &instr.args {
                if let Some(j) = a.index().checked_sub(np) {
                    let m = node_of(j);
                    if m != n {
                        waiting[n] += 1;
                        readers[m].push(n);
                    }
                }
            }
        }
        let position = |n: usize| if n < ni { n } else { *groups[n - ni].last().expect("members") };
        let mut ready: BinaryHeap<Reverse<(usize, usize)>> = (0..nodes)
            .filter(|&n| waiting[n] == 0 && (n >= ni || group_of[n].is_none()))
            .map(|n| Reverse((position(n), n)))
            .collect();
        let mut out =
            Program { params: self.params.clone(), instrs: Vec::new(), results: Vec::new() };
        let mut map: Vec<Option<Value>> = (0..np).map(|k| Some(Value(k as u32))).collect();
        map.resize(np + ni, None);
        let mut launch: Vec<Option<Value>> = vec![None; np + ni];
        let at = |map: &[Option<Value>], v: Value| map[v.index()].expect("defined before use");
        while let Some(Reverse((_, n))) = ready.pop() {
            if n < ni {
                let mut instr = self.instrs[n].clone();
                instr.args.iter_mut().for_each(|a| *a = at(&map, *a));
                // Colocation targets this order has not reached yet are dropped.
                instr.colocate = instr.colocate.iter().filter_map(|c| map[c.index()]).collect();
                map[np + n] = Some(out.push(instr));
            } else {
                let members = &groups[n - ni];
                let first = &self.instrs[members[0]];
                let dtype = first.spec.dtype;
                let flat = |out: &mut Program, v: Value, len: usize| {
                    out.push(Instr::new(
                        Op::Reshape { shape: vec![len] },
                        vec![v],
                        TensorSpec::new(dtype, vector(len)),
                    ))
                };
                let mut parts = Vec::with_capacity(members.len());
                let mut total = 0;
                for &i in members {
                    let len = self.instrs[i].spec.shape.num_elements();
                    let arg = at(&map, self.instrs[i].args[0]);
                    parts.push(flat(&mut out, arg, len));
                    total += len;
                }
                let cat = out.push(Instr::new(
                    Op::Concat { axis: 0 },
                    parts,
                    TensorSpec::new(dtype, vector(total)),
                ));
                let reduced = out.push(Instr::new(
                    first.op.clone(),
                    vec![cat],
                    TensorSpec::new(dtype, vector(total)),
                ));
                let mut start = 0;
                for &i in members {
                    launch[np + i] = Some(reduced);
                    let member = &self.instrs[i];
                    let len = member.spec.shape.num_elements();
                    let part = out.push(Instr::new(
                        Op::Slice { start: vec![start], stop: vec![start + len], step: vec![1] },
                        vec![reduced],
                        TensorSpec::new(dtype, vector(len)),
                    ));
                    start += len;
                    map[np + i] = Some(out.push(Instr {
                        name: member.name.clone(),
                        ..Instr::new(
                            Op::Reshape { shape: member.spec.shape.dims().to_vec() },
                            vec![part],
                            member.spec.clone(),
                        )
                    }));
                }
            }
            for &r in &readers[n] {
                waiting[r] -= 1;
                if waiting[r] == 0 {
                    ready.push(Reverse((position(r), r)));
                }
            }
        }
        // Each combination of g members took their g places and made 3g + 2.
        debug_assert_eq!(
            out.instrs.len(),
            ni + groups.iter().map(|g| 2 * g.len() + 2).sum::<usize>()
        );
        out.results = self.results.iter().map(|r| at(&map, *r)).collect();
        let trace =
            (0..np + ni).map(|v| launch[v].unwrap_or_else(|| at(&map, Value(v as u32)))).collect();
        (out, trace)
    }

    fn push(&mut self, instr: Instr) -> Value {
        self.instrs.push(instr);
        Value((self.params.len() + self.instrs.len() - 1) as u32)
    }
}

fn vector(len: usize) -> Shape {
    Shape::new(&[len]).expect("a length that fits its tensor's")
}

#[cfg(test)]
mod tests;
