//! Moving a value from one layout to another with collectives.

use crate::spmd::layout::{Layout, axis_groups};
use crate::{Error, HloSharding, Mesh, Result};

/// One step of a [`Transition`]. Axes are mesh axes (major first); each collective
/// runs over the replica groups [`axis_groups`] gives for its axes, so member `k` of a
/// group holds block `k` of what the axes tile.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Step {
    /// Each device keeps its own block of `dim` along `axes` (appended below the
    /// dim's axes): local, nothing moves.
    Slice {
        /// The dim.
        dim: usize,
        /// The axes now tiling it further.
        axes: Vec<usize>,
    },
    /// All-gather of `dim` over `axes`, its minor-most axes, which stop tiling it.
    AllGather {
        /// The dim.
        dim: usize,
        /// The axes gathered.
        axes: Vec<usize>,
    },
    /// All-to-all over `axes`, the minor-most axes of dim `from`, which move below the
    /// axes of dim `to` (split `to`, concatenate `from`).
    AllToAll {
        /// The dim the axes leave.
        from: usize,
        /// The dim the axes join.
        to: usize,
        /// The axes moved.
        axes: Vec<usize>,
    },
    /// All-reduce (sum) of the pending sums over `axes`.
    AllReduce {
        /// The axes reduced.
        axes: Vec<usize>,
    },
    /// Reduce-scatter of the pending sums over `axes` into blocks of `dim` (the axes
    /// join it below its axes).
    ReduceScatter {
        /// The dim scattered.
        dim: usize,
        /// The axes reduced, then tiling the dim.
        axes: Vec<usize>,
    },
}

impl Step {
    /// The mesh axes the step runs over.
    pub fn axes(&self) -> &[usize] {
        match self {
            Step::Slice { axes, .. }
            | Step::AllGather { axes, .. }
            | Step::AllToAll { axes, .. }
            | Step::AllReduce { axes }
            | Step::ReduceScatter { axes, .. } => axes,
        }
    }

    /// Whether it moves data between devices.
    pub fn communicates(&self) -> bool {
        !matches!(self, Step::Slice { .. })
    }

    /// The replica groups (mesh positions) of the step's collective.
    pub fn groups(&self, mesh: &Mesh) -> Vec<Vec<usize>> {
        axis_groups(mesh, self.axes())
    }

    /// The layout after this step, from `layout` (unchecked: what the planner built).
    pub fn apply(&self, layout: &Layout) -> Layout {
        let mut l = layout.clone();
        let (dims, partial) = l.parts_mut();
        match self {
            Step::Slice { dim, axes } => dims[*dim].extend(axes),
            Step::AllGather { dim, axes } => {
                let keep = dims[*dim].len() - axes.len();
                dims[*dim].truncate(keep);
            }
            Step::AllToAll { from, to, axes } => {
                let keep = dims[*from].len() - axes.len();
                dims[*from].truncate(keep);
                dims[*to].extend(axes);
            }
            Step::AllReduce { axes } => partial.retain(|a| !axes.contains(a)),
            Step::ReduceScatter { dim, axes } => {
                partial.retain(|a| !axes.contains(a));
                dims[*dim].extend(axes);
            }
        }
        l
    }

    /// The bytes the step moves over all devices for a value of `shape` laid out by
    /// `before`, with `elem` bytes per element, under the bandwidth-optimal algorithms'
    /// costs (NCCL's bus-bandwidth factors): with `k` members in a group and `s` bytes
    /// per device, each device receives `(k-1)·s` for an all-gather, `(k-1)/k·s` for an
    /// all-to-all or a reduce-scatter, `2(k-1)/k·s` for an all-reduce, nothing for a
    /// slice.
    pub fn bytes(&self, mesh: &Mesh, shape: &[usize], elem: usize, before: &Layout) -> u64 {
        let local: u64 = before
            .tiles(mesh)
            .iter()
            .zip(shape)
            .map(|(&t, &s)| (s / t.max(1)) as u64)
            .product::<u64>()
            * elem as u64;
        let k: u64 = self.axes().iter().map(|&a| mesh.shape()[a] as u64).product();
        let per = match self {
            Step::Slice { .. } => 0,
            Step::AllGather { .. } => (k - 1) * local,
            Step::AllToAll { .. } | Step::ReduceScatter { .. } => (k - 1) * local / k,
            Step::AllReduce { .. } => 2 * (k - 1) * local / k,
        };
        per * mesh.size() as u64
    }
}

/// A plan that moves a value from one layout to another: the steps, the layout after
/// each, and the bytes they move.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transition {
    steps: Vec<Step>,
    layouts: Vec<Layout>,
    bytes: u64,
}

impl Transition {
    /// The steps, in order.
    pub fn steps(&self) -> &[Step] {
        &self.steps
    }

    /// The layout after each step.
    pub fn layouts(&self) -> &[Layout] {
        &self.layouts
    }

    /// The bytes moved over all devices ([`Step::bytes`]).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Whether nothing moves between devices.
    pub fn is_local(&self) -> bool {
        self.steps.iter().all(|s| !s.communicates())
    }
}

fn is_prefix(a: &[usize], b: &[usize]) -> bool {
    a.len() <= b.len() && b[..a.len()] == *a
}

/// The collectives that move a value of global `shape` (`elem` bytes per element)
/// from layout `from` to layout `to` over `mesh`, moving the fewest bytes
/// ([`Step::bytes`]) and, among those, taking the fewest steps.
///
/// The plan is a shortest-path search over layouts (every slice, all-gather,
/// all-to-all, all-reduce and reduce-scatter over every run of axes that leaves a
/// valid layout), exact for meshes of up to 5 axes larger than 1; beyond that, or if
/// the search grows past 50 000 layouts, a greedy plan ([`greedy`]) is used.
///
/// A pending sum cannot be created (`to` pending over an axis `from` is not pending
/// over): [`Error::Transition`]. Tiles that do not divide the shape:
/// [`Error::Indivisible`].
pub fn transition(
    mesh: &Mesh,
    shape: &[usize],
    elem: usize,
    from: &Layout,
    to: &Layout,
) -> Result<Transition> {
    check(mesh, shape, from, to)?;
    let big = mesh.shape().iter().filter(|&&s| s > 1).count() > 5;
    if !big && let Some(t) = search(mesh, shape, elem, from, to, 50_000) {
        return Ok(t);
    }
    greedy(mesh, shape, elem, from, to)
}

fn check(mesh: &Mesh, shape: &[usize], from: &Layout, to: &Layout) -> Result<()> {
    if from.rank() != shape.len() || to.rank() != shape.len() {
        return Err(Error::RankMismatch {
            sharding_rank: from.rank().max(to.rank()),
            shape_rank: shape.len(),
        });
    }
    from.local_shape(mesh, shape)?;
    to.local_shape(mesh, shape)?;
    if to.partial().iter().any(|a| !from.partial().contains(a)) {
        return Err(Error::Transition {
            from: from.display(mesh).to_string(),
            to: to.display(mesh).to_string(),
            problem: "a value that is not a pending sum cannot become one",
        });
    }
    Ok(())
}

/// Every step that leaves a valid layout (one whose tiles divide `shape`).
fn moves(mesh: &Mesh, shape: &[usize], c: &Layout) -> Vec<Step> {
    let rank = shape.len();
    let mut out = Vec::new();
    let Ok(local) = c.local_shape(mesh, shape) else { return out };
    let size = |axes: &[usize]| axes.iter().map(|&a| mesh.shape()[a]).product::<usize>();
    let free: Vec<usize> =
        (0..mesh.shape().len()).filter(|&a| mesh.shape()[a] > 1 && !c.uses(a)).collect();
    for d in 0..rank {
        for &x in &free {
            if local[d] % mesh.shape()[x] == 0 {
                out.push(Step::Slice { dim: d, axes: vec![x] });
            }
        }
        let have = &c.dims()[d];
        for start in 0..have.len() {
            let run = &have[start..];
            out.push(Step::AllGather { dim: d, axes: run.to_vec() });
            for e in (0..rank).filter(|&e| e != d) {
                if local[e] % size(run) == 0 {
                    out.push(Step::AllToAll { from: d, to: e, axes: run.to_vec() });
                }
            }
        }
    }
    // Every ordered run of pending axes, reduced, or scattered onto a dim.
    let p = c.partial();
    let mut runs: Vec<Vec<usize>> = vec![Vec::new()];
    let mut k = 0;
    while k < runs.len() {
        let r = runs[k].clone();
        for &a in p {
            if !r.contains(&a) {
                let mut r2 = r.clone();
                r2.push(a);
                runs.push(r2);
            }
        }
        k += 1;
    }
    for r in runs.into_iter().skip(1) {
        if r.windows(2).all(|w| w[0] < w[1]) {
            out.push(Step::AllReduce { axes: r.clone() });
        }
        for (d, &l) in local.iter().enumerate() {
            if l % size(&r) == 0 {
                out.push(Step::ReduceScatter { dim: d, axes: r.clone() });
            }
        }
    }
    out
}

/// A layout reached, its best (bytes, steps), and the step that reached it from where.
type SearchNode = (Layout, (u64, usize), Option<(usize, Step)>);

/// Dijkstra over layouts by (bytes, steps); `None` past `budget` layouts.
fn search(
    mesh: &Mesh,
    shape: &[usize],
    elem: usize,
    from: &Layout,
    to: &Layout,
    budget: usize,
) -> Option<Transition> {
    use std::cmp::Reverse;
    use std::collections::{BinaryHeap, HashMap};
    let mut ids: HashMap<Layout, usize> = HashMap::new();
    // Per layout: best (bytes, steps), and how it was reached.
    let mut nodes: Vec<SearchNode> = Vec::new();
    ids.insert(from.clone(), 0);
    nodes.push((from.clone(), (0, 0), None));
    let mut heap = BinaryHeap::new();
    heap.push(Reverse(((0u64, 0usize), 0usize)));
    while let Some(Reverse((cost, i))) = heap.pop() {
        if cost > nodes[i].1 {
            continue;
        }
        let c = nodes[i].0.clone();
        if c == *to {
            let mut steps = Vec::new();
            let mut layouts = Vec::new();
            let mut at = i;
            while let Some((prev, step)) = nodes[at].2.clone() {
                layouts.push(nodes[at].0.clone());
                steps.push(step);
                at = prev;
            }
            steps.reverse();
            layouts.reverse();
            return Some(Transition { steps, layouts, bytes: cost.0 });
        }
        // A pending axes the target keeps must stay pending.
        for step in moves(mesh, shape, &c) {
            if matches!(step, Step::AllReduce { .. } | Step::ReduceScatter { .. })
                && step.axes().iter().any(|a| to.partial().contains(a))
            {
                continue;
            }
            let next = step.apply(&c);
            let nc = (cost.0 + step.bytes(mesh, shape, elem, &c), cost.1 + 1);
            let j = match ids.get(&next) {
                Some(&j) => j,
                None => {
                    if nodes.len() >= budget {
                        return None;
                    }
                    ids.insert(next.clone(), nodes.len());
                    nodes.push((next, (u64::MAX, usize::MAX), None));
                    nodes.len() - 1
                }
            };
            if nc < nodes[j].1 {
                nodes[j].1 = nc;
                nodes[j].2 = Some((i, step));
                heap.push(Reverse((nc, j)));
            }
        }
    }
    None
}

/// A greedy plan (for meshes too large to search), in this order of preference at
/// each point:
///
/// 1. local slices (free, and they shrink what later steps move);
/// 2. reduce-scatters of pending sums onto a dim that wants the axis next;
/// 3. all-to-alls of an axis one dim has and another wants next;
/// 4. an all-reduce of the pending sums nothing wants scattered — or, when exchanges
///    are still to come, a reduce-scatter onto a dim that is already laid out, so
///    the exchanges move a fraction of the data, and an all-gather at the end;
/// 5. an all-gather of a dim's unwanted minor axes.
///
/// Moves the same values as [`transition`]; it is not always the cheapest.
pub fn greedy(
    mesh: &Mesh,
    shape: &[usize],
    elem: usize,
    from: &Layout,
    to: &Layout,
) -> Result<Transition> {
    check(mesh, shape, from, to)?;
    let fail = |problem: &'static str| Error::Transition {
        from: from.display(mesh).to_string(),
        to: to.display(mesh).to_string(),
        problem,
    };
    let t = to;
    let mut c = from.clone();
    let mut steps = Vec::new();
    let mut layouts = Vec::new();
    let mut bytes = 0u64;
    let mut push = |c: &mut Layout, step: Step| {
        bytes += step.bytes(mesh, shape, elem, c);
        *c = step.apply(c);
        layouts.push(c.clone());
        steps.push(step);
    };
    let rank = shape.len();
    for _ in 0..4 * (mesh.shape().len() + 1) * (rank + 1) {
        if c == *t {
            break;
        }
        let mut progressed = false;
        // 1. Local slices.
        for d in 0..rank {
            let mut axes = Vec::new();
            let mut probe = c.clone();
            while is_prefix(&probe.dims()[d], &t.dims()[d])
                && probe.dims()[d].len() < t.dims()[d].len()
            {
                let x = t.dims()[d][probe.dims()[d].len()];
                if probe.uses(x) {
                    break;
                }
                probe.parts_mut().0[d].push(x);
                axes.push(x);
            }
            if !axes.is_empty() {
                push(&mut c, Step::Slice { dim: d, axes });
                progressed = true;
            }
        }
        // 2. Reduce-scatters.
        for d in 0..rank {
            let mut axes = Vec::new();
            let mut probe = c.clone();
            while is_prefix(&probe.dims()[d], &t.dims()[d])
                && probe.dims()[d].len() < t.dims()[d].len()
            {
                let x = t.dims()[d][probe.dims()[d].len()];
                if !probe.partial().contains(&x) || t.partial().contains(&x) {
                    break;
                }
                let (dims, partial) = probe.parts_mut();
                partial.retain(|&a| a != x);
                dims[d].push(x);
                axes.push(x);
            }
            if !axes.is_empty() {
                push(&mut c, Step::ReduceScatter { dim: d, axes });
                progressed = true;
            }
        }
        if progressed {
            continue;
        }
        // With exchanges still to come, pending sums nothing wants are reduce-scattered
        // onto a dim already laid out, and gathered back at the end: the same bytes as
        // an all-reduce, and the exchanges between move a k-th of the data.
        let extra: Vec<usize> =
            c.partial().iter().copied().filter(|a| !t.partial().contains(a)).collect();
        if !extra.is_empty() && (0..rank).any(|d| !is_prefix(&c.dims()[d], &t.dims()[d])) {
            let k: usize = extra.iter().map(|&a| mesh.shape()[a]).product();
            let local = c.local_shape(mesh, shape)?;
            if let Some(d) = (0..rank).find(|&d| c.dims()[d] == t.dims()[d] && local[d] % k == 0) {
                push(&mut c, Step::ReduceScatter { dim: d, axes: extra });
                continue;
            }
        }
        // 3. All-to-alls: the longest unwanted minor run of one dim that another dim
        // wants next, moved in one exchange.
        for d in 0..rank {
            if is_prefix(&c.dims()[d], &t.dims()[d]) {
                continue;
            }
            let have = c.dims()[d].clone();
            let keep =
                (0..have.len()).rev().find(|&k| is_prefix(&have[..k], &t.dims()[d])).unwrap_or(0);
            // A run another dim wants whole, else the longest run whose head another
            // dim wants next (what it does not want is gathered there later: cheaper
            // than gathering it here first).
            let wants = |e: usize, run: &[usize], whole: bool| {
                let next = &t.dims()[e][c.dims()[e].len().min(t.dims()[e].len())..];
                e != d
                    && is_prefix(&c.dims()[e], &t.dims()[e])
                    && if whole { next.starts_with(run) } else { next.first() == run.first() }
            };
            // ... and only one whose result still divides the shape (a run that lands
            // on a dim too small for it is gathered instead).
            let divides = |e: usize, run: &[usize]| {
                let step = Step::AllToAll { from: d, to: e, axes: run.to_vec() };
                step.apply(&c).local_shape(mesh, shape).is_ok()
            };
            let found = [true, false].into_iter().find_map(|whole| {
                (keep..have.len()).find_map(|start| {
                    let run = &have[start..];
                    (0..rank)
                        .find(|&e| wants(e, run, whole) && divides(e, run))
                        .map(|e| (e, run.to_vec()))
                })
            });
            if let Some((e, axes)) = found {
                push(&mut c, Step::AllToAll { from: d, to: e, axes });
                progressed = true;
            }
        }
        if progressed {
            continue;
        }
        // 4. All-reduce what stays pending nowhere.
        let extra: Vec<usize> =
            c.partial().iter().copied().filter(|a| !t.partial().contains(a)).collect();
        if !extra.is_empty() {
            push(&mut c, Step::AllReduce { axes: extra });
            continue;
        }
        // 5. All-gather one dim's unwanted minor axes.
        // Prefer a dim whose unwanted axes no other dim wants: gathering it may let
        // the others move by all-to-all.
        let unwanted = |d: usize| {
            let axes = &c.dims()[d];
            let keep =
                (0..axes.len()).rev().find(|&k| is_prefix(&axes[..k], &t.dims()[d])).unwrap_or(0);
            (keep, axes[keep..].to_vec())
        };
        let blocked: Vec<usize> =
            (0..rank).filter(|&d| !is_prefix(&c.dims()[d], &t.dims()[d])).collect();
        let wanted_elsewhere = |d: usize| {
            let (_, run) = unwanted(d);
            run.iter().any(|a| (0..rank).any(|e| e != d && t.dims()[e].contains(a)))
        };
        let pick =
            blocked.iter().copied().find(|&d| !wanted_elsewhere(d)).or(blocked.first().copied());
        if let Some(d) = pick {
            let axes = &c.dims()[d];
            let keep = unwanted(d).0;
            let popped = axes[keep..].to_vec();
            push(&mut c, Step::AllGather { dim: d, axes: popped });
            continue;
        }
        break;
    }
    if c != *t {
        return Err(fail("the planner found no sequence of collectives (a bug: please report)"));
    }
    Ok(Transition { steps, layouts, bytes })
}

/// [`transition`] between two XLA shardings of the same devices, read as layouts
/// over `mesh` ([`Layout::from_hlo`]).
pub fn transition_hlo(
    mesh: &Mesh,
    shape: &[usize],
    elem: usize,
    from: &HloSharding,
    to: &HloSharding,
) -> Result<Transition> {
    let a = Layout::from_hlo(mesh, from, shape.len())?;
    let b = Layout::from_hlo(mesh, to, shape.len())?;
    transition(mesh, shape, elem, &a, &b)
}
