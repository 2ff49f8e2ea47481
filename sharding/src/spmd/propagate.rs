//! XLA's sharding propagation over a graph of ops described by [`OpRule`]s.

use crate::spmd::layout::Layout;
use crate::spmd::rule::{FactorKind, Linear, OpRule};
use crate::{Error, Mesh, Result};

/// One op of a [`Graph`]: its rule, its operand values and the value it defines.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    /// How its operands' and result's dims relate.
    pub rule: OpRule,
    /// The operand values (indices into the graph's values).
    pub operands: Vec<usize>,
    /// The value it defines.
    pub result: usize,
}

/// What propagation runs over: values (by shape) and the ops between them, in an
/// evaluation order. A value no node defines is an input.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Graph {
    /// Each value's global shape.
    pub shapes: Vec<Vec<usize>>,
    /// Values known to be all zeros (a zero is a partial sum over any axes at no
    /// cost, which lets a `scatter_add` into zeros sum sharded updates).
    pub zeros: Vec<bool>,
    /// The ops, operands before users.
    pub nodes: Vec<Node>,
}

/// What propagation decided: every value's layout and, for every node, which mesh
/// axes shard each of its rule's factors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Propagation {
    /// Per value: annotated values keep their annotation; a node's result is what its
    /// factors give it (with the pending sums it produces); an input nothing
    /// constrains is replicated.
    pub layouts: Vec<Layout>,
    /// Per node, per factor: the mesh axes sharding it (major first).
    pub factors: Vec<Vec<Vec<usize>>>,
}

/// How many forward+backward rounds run at most. A round that changes a value makes it
/// more tiled or changes only its pending axes; the cap bounds the second kind, and
/// the final sweep gives every op a consistent layout whether or not the rounds
/// settled (the cap costs quality, never correctness).
const MAX_ROUNDS: usize = 64;

/// Propagates shardings from `annotations` (one per value, `None` where the user left
/// the choice to meshwork) to every value of `graph`, as XLA's
/// `sharding_propagation.cc` does:
///
/// * rounds of a forward pass (operands → results, in order) then a backward pass
///   (results → operands, in reverse) until nothing changes;
/// * annotated values never change;
/// * a value changes only to a strictly more tiled layout (more tiles), or — same
///   dims — to the pending axes its op now gives it, so the preference is "more tiled
///   first"; rounds stop when nothing changes (at most 64, then a final forward sweep
///   makes every result what its op gives);
/// * within an op, each factor takes the most tiled candidate among the operands'
///   and result's layouts, operands first, then the result (XLA prefers operands
///   over users); two factors wanting one mesh axis go to the more tiled factor
///   first (then the lower factor);
/// * a sharded summed factor makes the result pending over its axes; pending sums
///   flow unreduced through linear ops ([`Linear`]).
///
/// Deviations from XLA, on purpose: no aggressiveness levels or priorities (one
/// level, all ops), no partial (sub-axis) tiling of a factor by part of a mesh axis,
/// and pending sums pass through elementwise linear ops (XLA reduces before most
/// of them). A layout that does not divide a value's shape is left to the caller
/// (the partitioner reports it with the value's name).
pub fn propagate(
    mesh: &Mesh,
    graph: &Graph,
    annotations: &[Option<Layout>],
) -> Result<Propagation> {
    let n = graph.shapes.len();
    let bad = |node: usize, problem: &'static str| Error::BadGraph { node, problem };
    if annotations.len() != n {
        return Err(Error::BadGraph { node: usize::MAX, problem: "one annotation per value" });
    }
    for (v, a) in annotations.iter().enumerate() {
        if let Some(l) = a {
            if l.rank() != graph.shapes[v].len() {
                return Err(Error::RankMismatch {
                    sharding_rank: l.rank(),
                    shape_rank: graph.shapes[v].len(),
                });
            }
            // Every axis a dim or the pending sum names (a scalar's too) is the mesh's.
            if let Some(&axis) =
                l.dims().iter().flatten().chain(l.partial()).find(|&&x| x >= mesh.shape().len())
            {
                return Err(Error::LayoutAxis { axis, axes: mesh.shape().len() });
            }
        }
    }
    let mut definer = vec![usize::MAX; n];
    for (k, node) in graph.nodes.iter().enumerate() {
        if node.result < n && definer[node.result] == usize::MAX {
            definer[node.result] = k;
        }
    }
    let mut defined = vec![false; n];
    for (k, node) in graph.nodes.iter().enumerate() {
        let readable = |o: usize| o < n && (definer[o] == usize::MAX || definer[o] < k);
        if node.result >= n || !node.operands.iter().all(|&o| readable(o)) {
            return Err(bad(
                k,
                "a node reads or defines a value the graph does not have, or reads a value before it is defined",
            ));
        }
        if std::mem::replace(&mut defined[node.result], true) {
            return Err(bad(k, "a value is defined twice"));
        }
        let rule = &node.rule;
        if rule.operands().len() != node.operands.len() {
            return Err(bad(k, "the rule has a different number of operands"));
        }
        let fits = |dims: &[Vec<usize>], shape: &[usize]| {
            dims.len() == shape.len()
                && dims.iter().zip(shape).all(|(fs, &s)| {
                    fs.iter().map(|&f| rule.size(f)).product::<usize>() == s
                        || (s <= 1 && fs.is_empty())
                })
        };
        if !node.operands.iter().zip(rule.operands()).all(|(&o, d)| fits(d, &graph.shapes[o]))
            || !fits(rule.result(), &graph.shapes[node.result])
        {
            return Err(bad(k, "the rule's dims do not match the values' shapes"));
        }
    }
    let mut uses = vec![0usize; n];
    for node in &graph.nodes {
        for &o in &node.operands {
            uses[o] += 1;
        }
    }
    let facts = Facts { zeros: &graph.zeros, uses };
    let zero = &facts;
    let fixed: Vec<bool> = annotations.iter().map(Option::is_some).collect();
    let mut cur: Vec<Option<Layout>> = annotations.to_vec();
    for _ in 0..MAX_ROUNDS {
        let mut changed = false;
        for node in &graph.nodes {
            let f = choose(mesh, node, &cur, zero);
            let natural = result_layout(mesh, node, &f, &cur, zero);
            let r = node.result;
            if fixed[r] {
                continue;
            }
            let update = match &cur[r] {
                None => true,
                Some(old) => {
                    natural.tile_count(mesh) > old.tile_count(mesh)
                        || (natural.dims() == old.dims() && natural.partial() != old.partial())
                }
            };
            if update {
                cur[r] = Some(natural);
                changed = true;
            }
        }
        for node in graph.nodes.iter().rev() {
            let f = choose(mesh, node, &cur, zero);
            for (k, &o) in node.operands.iter().enumerate() {
                if fixed[o] {
                    continue;
                }
                let dims = project_out(&node.rule.operands()[k], &f);
                let keep = cur[o].as_ref().map(|l| l.partial().to_vec()).unwrap_or_default();
                if dims.iter().flatten().any(|a| keep.contains(a)) {
                    continue;
                }
                let cand = Layout::from_parts(dims, keep);
                let better = match &cur[o] {
                    None => !cand.is_replicated(),
                    Some(old) => cand.tile_count(mesh) > old.tile_count(mesh),
                };
                if better {
                    cur[o] = Some(cand);
                    changed = true;
                }
            }
        }
        if !changed {
            break;
        }
    }
    // Final: inputs nothing constrained are replicated, then one forward sweep fixes
    // every node's factors and its result's layout.
    for (v, l) in cur.iter_mut().enumerate() {
        if l.is_none() && !defined[v] {
            *l = Some(Layout::replicated(graph.shapes[v].len()));
        }
    }
    let mut factors = Vec::with_capacity(graph.nodes.len());
    for node in &graph.nodes {
        let f = choose(mesh, node, &cur, zero);
        if !fixed[node.result] {
            cur[node.result] = Some(result_layout(mesh, node, &f, &cur, zero));
        }
        factors.push(f);
    }
    let layouts = cur
        .into_iter()
        .enumerate()
        .map(|(v, l)| l.unwrap_or_else(|| Layout::replicated(graph.shapes[v].len())))
        .collect();
    Ok(Propagation { layouts, factors })
}

/// The factor axes one value's layout implies under the rule's `dims` for it: each
/// dim's axes go to its factors major first, a factor taking axes while their sizes
/// divide what is left of it; a factor needed whole, or an axis that does not
/// divide, ends the dim.
pub(crate) fn project_in(
    mesh: &Mesh,
    rule: &OpRule,
    dims: &[Vec<usize>],
    layout: &Layout,
) -> Vec<Vec<usize>> {
    let mut out = vec![Vec::new(); rule.num_factors()];
    for (fs, axes) in dims.iter().zip(layout.dims()) {
        let mut k = 0;
        let mut left = fs.first().map_or(1, |&f| rule.size(f));
        'axes: for &a in axes {
            let s = mesh.shape()[a];
            loop {
                if k >= fs.len() {
                    break 'axes;
                }
                if left == 1 {
                    k += 1;
                    left = fs.get(k).map_or(1, |&f| rule.size(f));
                    continue;
                }
                if rule.kind(fs[k]) == FactorKind::Whole || left % s != 0 {
                    break 'axes;
                }
                out[fs[k]].push(a);
                left /= s;
                break;
            }
        }
    }
    out
}

/// A value's dims from factor axes: each dim's factors' axes, major first.
pub(crate) fn project_out(dims: &[Vec<usize>], factors: &[Vec<usize>]) -> Vec<Vec<usize>> {
    dims.iter().map(|fs| fs.iter().flat_map(|&f| factors[f].iter().copied()).collect()).collect()
}

/// The pending axes that flow through `node` unreduced, given its operands' layouts.
///
/// A pending operand used more than once (`shared`) never passes: it is reduced once,
/// where it is made, rather than in every branch it would flow into (Megatron's
/// conjugate `g` operator: one all-reduce of a column-parallel layer's input
/// gradient, not one per op of the layer norm behind it).
pub(crate) fn passing(
    rule: &OpRule,
    partials: &[&[usize]],
    zero: &[bool],
    shared: &[bool],
) -> Vec<usize> {
    match rule.linear() {
        Linear::No => Vec::new(),
        Linear::Each(mask) => {
            let pending: Vec<usize> =
                (0..partials.len()).filter(|&k| !partials[k].is_empty()).collect();
            match pending[..] {
                [k] if mask[k] && !shared[k] => partials[k].to_vec(),
                _ => Vec::new(),
            }
        }
        Linear::Joint(mask) => {
            let mut common: Option<&[usize]> = None;
            for (k, p) in partials.iter().enumerate() {
                if zero[k] || !mask[k] {
                    continue;
                }
                if shared[k] && !p.is_empty() {
                    return Vec::new();
                }
                match common {
                    None => common = Some(p),
                    Some(c) if c == *p => {}
                    Some(_) => return Vec::new(),
                }
            }
            common.map(<[usize]>::to_vec).unwrap_or_default()
        }
    }
}

/// Chooses the mesh axes of every factor of `node` from the current layouts.
pub(crate) fn choose(
    mesh: &Mesh,
    node: &Node,
    cur: &[Option<Layout>],
    zero: &Facts<'_>,
) -> Vec<Vec<usize>> {
    let rule = &node.rule;
    let nf = rule.num_factors();
    // Candidates: operands first, then the result.
    let mut best: Vec<Vec<usize>> = vec![Vec::new(); nf];
    let mut best_tiles = vec![1usize; nf];
    let result_dims = rule.result().to_vec();
    let sources = node
        .operands
        .iter()
        .zip(rule.operands())
        .chain(std::iter::once((&node.result, &result_dims)));
    for (&v, dims) in sources {
        let Some(layout) = &cur[v] else { continue };
        for (f, axes) in project_in(mesh, rule, dims, layout).into_iter().enumerate() {
            let t: usize = axes.iter().map(|&a| mesh.shape()[a]).product();
            if t > best_tiles[f] {
                best_tiles[f] = t;
                best[f] = axes;
            }
        }
    }
    // Pending sums that pass through keep their axes.
    let partials: Vec<&[usize]> =
        node.operands.iter().map(|&o| cur[o].as_ref().map_or(&[][..], |l| l.partial())).collect();
    let zeros: Vec<bool> = node.operands.iter().map(|&o| zero.zero(o)).collect();
    let shared: Vec<bool> = node.operands.iter().map(|&o| zero.shared(o)).collect();
    let mut taken = vec![false; mesh.shape().len()];
    for a in passing(rule, &partials, &zeros, &shared) {
        taken[a] = true;
    }
    // More tiled factors first; ties by factor order.
    let mut order: Vec<usize> = (0..nf).collect();
    order.sort_by_key(|&f| std::cmp::Reverse(best_tiles[f]));
    let mut out = vec![Vec::new(); nf];
    for f in order {
        for &a in &best[f] {
            if taken[a] {
                break;
            }
            taken[a] = true;
            out[f].push(a);
        }
    }
    // A summed factor can be sharded only if every operand without it is zero.
    for (f, axes) in out.iter_mut().enumerate() {
        if rule.kind(f) == FactorKind::Sum && !axes.is_empty() {
            let missing = node
                .operands
                .iter()
                .zip(rule.operands())
                .any(|(&o, dims)| !dims.iter().flatten().any(|&g| g == f) && !zero.zero(o));
            if missing {
                axes.clear();
            }
        }
    }
    // Within a dim, a factor may be tiled only below factors that are fully tiled.
    loop {
        let mut cleared = false;
        for dims in rule.operands().iter().chain(std::iter::once(&result_dims)) {
            for fs in dims {
                let mut full = true;
                for &f in fs {
                    if !full && !out[f].is_empty() {
                        out[f].clear();
                        cleared = true;
                    }
                    let t: usize = out[f].iter().map(|&a| mesh.shape()[a]).product();
                    full &= t == rule.size(f);
                }
            }
        }
        if !cleared {
            break;
        }
    }
    out
}

/// The layout `node`'s result has under factor axes `f`: its dims' factors' axes,
/// pending over the sharded summed factors' axes and the pending sums that pass.
pub(crate) fn result_layout(
    mesh: &Mesh,
    node: &Node,
    f: &[Vec<usize>],
    cur: &[Option<Layout>],
    zero: &Facts<'_>,
) -> Layout {
    let _ = mesh;
    let rule = &node.rule;
    let dims = project_out(rule.result(), f);
    let partials: Vec<&[usize]> =
        node.operands.iter().map(|&o| cur[o].as_ref().map_or(&[][..], |l| l.partial())).collect();
    let zeros: Vec<bool> = node.operands.iter().map(|&o| zero.zero(o)).collect();
    let shared: Vec<bool> = node.operands.iter().map(|&o| zero.shared(o)).collect();
    let mut partial = passing(rule, &partials, &zeros, &shared);
    for (g, axes) in f.iter().enumerate() {
        if rule.kind(g) == FactorKind::Sum {
            partial.extend(axes);
        }
    }
    Layout::from_parts(dims, partial)
}

/// What the partitioner knows of one operand of a node.
#[derive(Debug, Clone, Copy)]
pub struct Operand<'a> {
    /// Its current layout.
    pub layout: &'a Layout,
    /// Whether it is all zeros by construction.
    pub zero: bool,
    /// Whether more than one use reads it (in the whole graph).
    pub shared: bool,
}

/// What `node` needs and makes under factor axes `factors` (a [`Propagation`]'s for
/// it), given its operands: the layout each operand must be moved to (pending only
/// where the pending sum flows through, and a known zero made pending alike), and the
/// result's layout.
pub fn node_layouts(
    node: &Node,
    factors: &[Vec<usize>],
    operands: &[Operand<'_>],
) -> (Vec<Layout>, Layout) {
    let rule = &node.rule;
    let partials: Vec<&[usize]> = operands.iter().map(|o| o.layout.partial()).collect();
    let zeros: Vec<bool> = operands.iter().map(|o| o.zero).collect();
    let shared: Vec<bool> = operands.iter().map(|o| o.shared).collect();
    let pass = passing(rule, &partials, &zeros, &shared);
    let carries = |k: usize| -> bool {
        !pass.is_empty()
            && match rule.linear() {
                Linear::No => false,
                Linear::Each(_) => partials[k] == pass.as_slice(),
                Linear::Joint(mask) => mask[k],
            }
    };
    let required = (0..operands.len())
        .map(|k| {
            let dims = project_out(&rule.operands()[k], factors);
            let partial = if carries(k) { pass.clone() } else { Vec::new() };
            Layout::from_parts(dims, partial)
        })
        .collect();
    let mut partial = pass;
    for (g, axes) in factors.iter().enumerate() {
        if rule.kind(g) == FactorKind::Sum {
            partial.extend(axes);
        }
    }
    (required, Layout::from_parts(project_out(rule.result(), factors), partial))
}

/// Facts about values that decide whether pending sums pass.
pub(crate) struct Facts<'a> {
    zeros: &'a [bool],
    uses: Vec<usize>,
}

impl Facts<'_> {
    fn zero(&self, v: usize) -> bool {
        self.zeros.get(v).copied().unwrap_or(false)
    }
    fn shared(&self, v: usize) -> bool {
        self.uses[v] > 1
    }
}
