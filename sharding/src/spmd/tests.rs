//! Layouts, rules, propagation and transitions: unit cases and properties against
//! independent models (a host simulation of the collectives, XLA's index maps, a
//! brute-force search for the cheapest sequence of collectives).

use std::collections::{BinaryHeap, HashMap};

use ndarray::{ArrayD, Axis, IxDyn, Slice};
use proptest::prelude::*;

use super::*;
use crate::{Error, Mesh, Mode};

fn mesh(axes: &[(&str, usize)]) -> Mesh {
    Mesh::iota(axes).unwrap()
}

fn lay(m: &Mesh, dims: &[&[usize]], partial: &[usize]) -> Layout {
    Layout::new(m, dims.iter().map(|d| d.to_vec()).collect(), partial.to_vec()).unwrap()
}

// ---- layouts ---------------------------------------------------------------------

#[test]
fn layout_lowers_like_named_sharding_and_reads_back() {
    let m = mesh(&[("data", 2), ("model", 4)]);
    let l = lay(&m, &[&[1], &[], &[0]], &[]);
    assert_eq!(l.display(&m).to_string(), "P('model', None, 'data')");
    let hlo = l.to_hlo(&m).unwrap();
    assert_eq!(hlo.to_string(), "{devices=[4,1,2]<=[2,4]T(1,0)}");
    assert_eq!(Layout::from_hlo(&m, &hlo, 3).unwrap(), l);
    assert_eq!(l.local_shape(&m, &[8, 3, 6]).unwrap(), [2, 3, 3]);
    // Position 5 is (data 1, model 1): block 1 of dim 0 (model), block 1 of dim 2.
    assert_eq!(l.region(&m, &[8, 3, 6], 5).unwrap(), [2..4, 0..3, 3..6]);
    assert_eq!(l.block(&m, 5, 2).unwrap(), 1);
    let out = |what, index, count| Error::OutOfRange { what, index, count };
    assert_eq!(l.region(&m, &[8, 3, 6], 8), Err(out("mesh position", 8, 8)));
    assert_eq!(l.block(&m, 9, 0), Err(out("mesh position", 9, 8)));
    assert_eq!(l.block(&m, 1, 3), Err(out("dim", 3, 3)));
    assert_eq!(
        l.local_shape(&m, &[6, 3, 6]),
        Err(Error::Indivisible { dim: 0, size: 6, shards: 4 })
    );
    let p = lay(&m, &[&[0], &[]], &[1]);
    assert_eq!(p.display(&m).to_string(), "P('data', unreduced={'model'})");
    assert_eq!(Layout::from_hlo(&m, &p.to_hlo(&m).unwrap(), 2).unwrap(), p);
    // Size-1 axes shard nothing and are dropped; an axis twice is refused.
    let m1 = mesh(&[("a", 1), ("b", 2)]);
    assert_eq!(lay(&m1, &[&[0, 1]], &[]).dims(), [vec![1]]);
    assert!(Layout::new(&m1, vec![vec![1], vec![1]], vec![]).is_err());
    assert!(Layout::new(&m1, vec![vec![2]], vec![]).is_err());
}

/// Reading a layout back searches only the dims the sharding tiles: a rank-64 value
/// on a 6-axis mesh is answered at once, and a sharding of another rank is refused.
#[test]
fn layouts_of_high_rank_read_back_at_once() {
    let m = mesh(&[("a", 2), ("b", 2), ("c", 2), ("d", 2), ("e", 2), ("f", 2)]);
    let mut dims = vec![Vec::new(); 64];
    dims[0] = vec![0, 3];
    dims[63] = vec![5];
    let l = Layout::new(&m, dims, vec![1]).unwrap();
    let hlo = l.to_hlo(&m).unwrap();
    assert_eq!(Layout::from_hlo(&m, &hlo, 64).unwrap(), l);
    assert!(matches!(Layout::from_hlo(&m, &hlo, 3), Err(Error::NotOnMesh { .. })));
}

#[test]
fn axis_groups_vary_only_their_axes_in_order() {
    let m = mesh(&[("a", 2), ("b", 3)]);
    assert_eq!(axis_groups(&m, &[1]), [vec![0, 1, 2], vec![3, 4, 5]]);
    assert_eq!(axis_groups(&m, &[0]), [vec![0, 3], vec![1, 4], vec![2, 5]]);
    assert_eq!(axis_groups(&m, &[1, 0]), [vec![0, 3, 1, 4, 2, 5]]);
    assert_eq!(axis_groups(&m, &[]), (0..6).map(|d| vec![d]).collect::<Vec<_>>());
}

// ---- rules -----------------------------------------------------------------------

#[test]
fn rules_describe_ops_as_factors() {
    let r = OpRule::einsum("bij,bjk->bik", &[&[2, 3, 4], &[2, 4, 5]]).unwrap();
    assert_eq!(r.num_factors(), 4);
    assert_eq!(r.kind(2), FactorKind::Sum);
    assert_eq!(r.result(), [vec![0], vec![1], vec![3]]);
    let d = OpRule::dot_general(&[2, 3, 4], &[2, 4, 5], &[2], &[1], &[0], &[0]).unwrap();
    assert_eq!(d.result().len(), 3);
    assert_eq!(d.operands()[0][2], d.operands()[1][1]);
    // [B, T, D] -> [B, T, H, D/H]: D is (H, D/H).
    let s = OpRule::reshape(&[2, 3, 8], &[2, 3, 4, 2]).unwrap();
    assert_eq!(s.operands()[0][2].len(), 2);
    assert_eq!(s.result()[2], [s.operands()[0][2][0]]);
    // [4, 6] -> [6, 4]: only the common factor 2 of the leading dims is shardable.
    let b = OpRule::reshape(&[4, 6], &[6, 4]).unwrap();
    let f0 = b.operands()[0][0][0];
    assert_eq!((b.size(f0), b.kind(f0)), (2, FactorKind::Pass));
    assert!(b.operands()[0][1].iter().all(|&f| b.kind(f) == FactorKind::Whole));
    assert!(OpRule::reshape(&[4], &[5]).is_err());
    assert!(OpRule::einsum("ab,bc->ad", &[&[2, 3], &[3, 4]]).is_err());
    assert!(OpRule::einsum("ab,bc->ac", &[&[2, 3], &[4, 4]]).is_err());
    let e = OpRule::elementwise(&[&[3, 1], &[4]], &[3, 4]).unwrap();
    assert_eq!(e.operands()[0], [vec![0], vec![]]);
    assert_eq!(e.operands()[1], [vec![1]]);
    assert!(OpRule::elementwise(&[&[3, 2]], &[3, 4]).is_err());
    // A dot_general dim paired twice is refused.
    assert!(OpRule::dot_general(&[4, 4], &[4, 4], &[1, 1], &[0, 1], &[], &[]).is_err());
}

// ---- propagation ------------------------------------------------------------------

fn node(rule: OpRule, operands: &[usize], result: usize) -> Node {
    Node { rule, operands: operands.to_vec(), result }
}

/// Megatron's MLP: x [B, D] over data, w1 [D, F] by columns and w2 [F, D] by rows
/// over model: h is sharded both ways, y is pending over model.
#[test]
fn propagation_megatron_mlp() {
    let m = mesh(&[("data", 2), ("model", 2)]);
    let (b, d, f) = (8, 4, 6);
    let g = Graph {
        shapes: vec![vec![b, d], vec![d, f], vec![f, d], vec![b, f], vec![b, f], vec![b, d]],
        zeros: vec![],
        nodes: vec![
            node(OpRule::einsum("bd,df->bf", &[&[b, d], &[d, f]]).unwrap(), &[0, 1], 3),
            node(OpRule::elementwise(&[&[b, f]], &[b, f]).unwrap(), &[3], 4),
            node(OpRule::einsum("bf,fd->bd", &[&[b, f], &[f, d]]).unwrap(), &[4, 2], 5),
        ],
    };
    let ann = vec![
        Some(lay(&m, &[&[0], &[]], &[])),
        Some(lay(&m, &[&[], &[1]], &[])),
        Some(lay(&m, &[&[1], &[]], &[])),
        None,
        None,
        None,
    ];
    let p = propagate(&m, &g, &ann).unwrap();
    assert_eq!(p.layouts[3], lay(&m, &[&[0], &[1]], &[]));
    assert_eq!(p.layouts[4], lay(&m, &[&[0], &[1]], &[]));
    assert_eq!(p.layouts[5], lay(&m, &[&[0], &[]], &[1]));
}

#[test]
fn propagation_goes_backward_through_reshapes_and_keeps_annotations() {
    let m = mesh(&[("x", 2)]);
    // a [8] -> reshape [2, 4] -> b; b annotated on dim 1, a is free.
    let g = Graph {
        shapes: vec![vec![8], vec![2, 4], vec![2, 4]],
        zeros: vec![],
        nodes: vec![
            node(OpRule::reshape(&[8], &[2, 4]).unwrap(), &[0], 1),
            node(OpRule::elementwise(&[&[2, 4]], &[2, 4]).unwrap(), &[1], 2),
        ],
    };
    let p = propagate(&m, &g, &[None, None, Some(lay(&m, &[&[], &[0]], &[]))]).unwrap();
    // Tiling dim 1 of [2, 4] is not a block tiling of [8] unless dim 0 is whole tiled:
    // the reshape's minor factor cannot be tiled below an untiled major one, so the
    // sharding stops at the reshape (b is sliced for its use).
    assert_eq!(p.layouts[1], Layout::replicated(2));
    assert_eq!(p.layouts[0], Layout::replicated(1));
    // Annotated on dim 0 instead, it reaches a as a block tiling.
    let p = propagate(&m, &g, &[None, None, Some(lay(&m, &[&[0], &[]], &[]))]).unwrap();
    assert_eq!(p.layouts[0], lay(&m, &[&[0]], &[]));
    // An annotation never changes.
    let ann = [Some(Layout::replicated(1)), None, Some(lay(&m, &[&[0], &[]], &[]))];
    let p = propagate(&m, &g, &ann).unwrap();
    assert_eq!(p.layouts[0], Layout::replicated(1));
    assert_eq!(p.layouts[2], lay(&m, &[&[0], &[]], &[]));
    // An annotation naming an axis the mesh lacks is refused, a scalar's pending sum
    // included, naming the axis.
    let big = mesh(&[("x", 2), ("y", 2)]);
    let g = Graph {
        shapes: vec![vec![], vec![]],
        zeros: vec![],
        nodes: vec![node(OpRule::elementwise(&[&[]], &[]).unwrap(), &[0], 1)],
    };
    let err = propagate(&m, &g, &[Some(lay(&big, &[], &[1])), None]).unwrap_err();
    assert_eq!(err, Error::LayoutAxis { axis: 1, axes: 1 });
}

#[test]
fn propagation_prefers_more_tiled_then_operands() {
    let m = mesh(&[("a", 2), ("b", 4)]);
    let add = OpRule::elementwise(&[&[8, 8], &[8, 8]], &[8, 8]).unwrap();
    let g =
        Graph { shapes: vec![vec![8, 8]; 3], zeros: vec![], nodes: vec![node(add, &[0, 1], 2)] };
    // Conflict on axis a: dim 1 is more tiled through lhs? No: both tile by 2; the
    // lower factor (dim 0) wins the tie.
    let p = propagate(
        &m,
        &g,
        &[Some(lay(&m, &[&[0], &[]], &[])), Some(lay(&m, &[&[], &[0]], &[])), None],
    )
    .unwrap();
    assert_eq!(p.layouts[2], lay(&m, &[&[0], &[]], &[]));
    // More tiled first: b (4) beats a (2) for dim 1 even though rhs comes second.
    let p = propagate(
        &m,
        &g,
        &[Some(lay(&m, &[&[0], &[]], &[])), Some(lay(&m, &[&[1], &[0]], &[])), None],
    )
    .unwrap();
    assert_eq!(p.layouts[2], lay(&m, &[&[1], &[0]], &[]));
}

#[test]
fn whole_factors_stay_whole_and_sums_need_every_operand() {
    let m = mesh(&[("x", 2)]);
    // softmax over dim 1: the rule needs dim 1 whole.
    let soft = OpRule::elementwise(&[&[4, 6]], &[4, 6]).unwrap().with_whole(0, 1);
    let g = Graph { shapes: vec![vec![4, 6]; 2], zeros: vec![], nodes: vec![node(soft, &[0], 1)] };
    let p = propagate(&m, &g, &[Some(lay(&m, &[&[], &[0]], &[])), None]).unwrap();
    assert_eq!(p.layouts[1], Layout::replicated(2));
    // scatter_add(operand [V, D], indices [B], updates [B, D]): summing sharded B is
    // allowed only into zeros.
    let rule = OpRule::new(
        &[(5, FactorKind::Whole), (3, FactorKind::Pass), (4, FactorKind::Sum)],
        vec![vec![vec![0], vec![1]], vec![vec![2]], vec![vec![2], vec![1]]],
        vec![vec![0], vec![1]],
    )
    .unwrap()
    .with_linear(Linear::Joint(vec![true, false, true]));
    let shapes = vec![vec![5, 3], vec![4], vec![4, 3], vec![5, 3]];
    let ann = [None, Some(lay(&m, &[&[0]], &[])), Some(lay(&m, &[&[0], &[]], &[])), None];
    let g = Graph {
        shapes: shapes.clone(),
        zeros: vec![],
        nodes: vec![node(rule.clone(), &[0, 1, 2], 3)],
    };
    assert_eq!(propagate(&m, &g, &ann).unwrap().layouts[3], Layout::replicated(2));
    let g = Graph {
        shapes,
        zeros: vec![true, false, false, false],
        nodes: vec![node(rule, &[0, 1, 2], 3)],
    };
    assert_eq!(propagate(&m, &g, &ann).unwrap().layouts[3], lay(&m, &[&[], &[]], &[0]));
}

#[test]
fn pending_sums_flow_through_linear_ops_only() {
    let m = mesh(&[("x", 2)]);
    let dot = OpRule::einsum("ij,jk->ik", &[&[2, 4], &[4, 3]]).unwrap();
    let neg =
        OpRule::elementwise(&[&[2, 3]], &[2, 3]).unwrap().with_linear(Linear::Each(vec![true]));
    let exp = OpRule::elementwise(&[&[2, 3]], &[2, 3]).unwrap();
    let g = Graph {
        shapes: vec![vec![2, 4], vec![4, 3], vec![2, 3], vec![2, 3], vec![2, 3]],
        zeros: vec![],
        nodes: vec![node(dot, &[0, 1], 2), node(neg, &[2], 3), node(exp, &[3], 4)],
    };
    let ann =
        [Some(lay(&m, &[&[], &[0]], &[])), Some(lay(&m, &[&[0], &[]], &[])), None, None, None];
    let p = propagate(&m, &g, &ann).unwrap();
    assert_eq!(p.layouts[2].partial(), [0]);
    assert_eq!(p.layouts[3].partial(), [0]);
    assert!(p.layouts[4].partial().is_empty());
}

// ---- transitions: fixed cases ----------------------------------------------------------

#[test]
fn transitions_pick_the_cheap_collective() {
    let m = mesh(&[("a", 2), ("b", 2)]);
    let shape = [8, 8];
    let t = |from: Layout, to: Layout| transition(&m, &shape, 4, &from, &to).unwrap();
    // Moving a from dim 0 to dim 1 is one all-to-all, not gather + slice.
    let x = t(lay(&m, &[&[0], &[]], &[]), lay(&m, &[&[], &[0]], &[]));
    assert_eq!(x.steps(), [Step::AllToAll { from: 0, to: 1, axes: vec![0] }]);
    // 4 devices each receive half of their 32 elements of 4 bytes.
    assert_eq!(x.bytes(), 4 * 16 * 4);
    // A pending sum wanted as tiles is reduce-scattered.
    let x = t(lay(&m, &[&[], &[]], &[1]), lay(&m, &[&[1], &[]], &[]));
    assert_eq!(x.steps(), [Step::ReduceScatter { dim: 0, axes: vec![1] }]);
    // Slicing first makes the gather smaller.
    let x = t(lay(&m, &[&[0], &[]], &[]), lay(&m, &[&[], &[1]], &[]));
    assert_eq!(
        x.steps(),
        [Step::Slice { dim: 1, axes: vec![1] }, Step::AllGather { dim: 0, axes: vec![0] }]
    );
    assert!(t(lay(&m, &[&[0], &[1]], &[]), lay(&m, &[&[0], &[1]], &[])).steps().is_empty());
    assert!(matches!(
        transition(&m, &shape, 4, &Layout::replicated(2), &lay(&m, &[&[], &[]], &[0])),
        Err(Error::Transition { .. })
    ));
}

// ---- transitions: properties ----------------------------------------------------------

/// A mesh of 1–3 axes of sizes 1–3, at most 8 devices.
fn small_mesh() -> impl Strategy<Value = Mesh> {
    proptest::collection::vec(1..=3usize, 1..=3)
        .prop_filter("at most 8 devices", |s| s.iter().product::<usize>() <= 8)
        .prop_map(|sizes| {
            let names = ["a", "b", "c"];
            let axes: Vec<(&str, usize)> = names.iter().copied().zip(sizes).collect();
            Mesh::iota(&axes).unwrap()
        })
}

/// Per axis a slot (0 unused, 1 pending, 2 + d on dim d), shuffled order.
fn layout_of(m: &Mesh, rank: usize, slots: &[usize], order: &[usize], pending: bool) -> Layout {
    let mut dims = vec![Vec::new(); rank];
    let mut partial = Vec::new();
    for &a in order {
        match slots[a] % (rank + 2) {
            0 => {}
            1 if pending => partial.push(a),
            1 => {}
            s => dims[s - 2].push(a),
        }
    }
    Layout::new(m, dims, partial).unwrap()
}

fn lcm(a: usize, b: usize) -> usize {
    fn gcd(a: usize, b: usize) -> usize {
        if b == 0 { a } else { gcd(b, a % b) }
    }
    a / gcd(a, b) * b
}

/// The bytes a step moves over all devices, worked out here from the mesh and the
/// layout before it (not by `Step::bytes`): each device holds `local` bytes; among
/// `k` devices an all-gather receives `(k-1)·local`, an all-to-all or reduce-scatter
/// `(k-1)/k·local`, an all-reduce twice that, a slice nothing.
fn bytes_of(m: &Mesh, shape: &[usize], elem: u64, before: &Layout, step: &Step) -> u64 {
    let local: u64 = shape
        .iter()
        .enumerate()
        .map(|(d, &s)| {
            let t: usize = before.dims()[d].iter().map(|&a| m.shape()[a]).product();
            (s / t) as u64
        })
        .product::<u64>()
        * elem;
    let k: u64 = step.axes().iter().map(|&a| m.shape()[a] as u64).product();
    let per = match step {
        Step::Slice { .. } => 0,
        Step::AllGather { .. } => (k - 1) * local,
        Step::AllToAll { .. } | Step::ReduceScatter { .. } => (k - 1) * local / k,
        Step::AllReduce { .. } => 2 * (k - 1) * local / k,
    };
    per * m.size() as u64
}

fn case() -> impl Strategy<Value = (Mesh, Vec<usize>, Layout, Layout)> {
    (small_mesh(), 1..=3usize).prop_flat_map(|(m, rank)| {
        let n = m.shape().len();
        let perm = Just((0..n).collect::<Vec<_>>()).prop_shuffle();
        (
            Just(m),
            proptest::collection::vec(1..=3usize, rank),
            proptest::collection::vec(0..rank + 2, n),
            perm.clone(),
            proptest::collection::vec(0..rank + 2, n),
            perm,
        )
            .prop_map(move |(m, mult, s1, o1, s2, o2)| {
                let from = layout_of(&m, rank, &s1, &o1, true);
                let mut to = layout_of(&m, rank, &s2, &o2, true);
                let keep: Vec<usize> =
                    to.partial().iter().copied().filter(|a| from.partial().contains(a)).collect();
                to = Layout::new(&m, to.dims().to_vec(), keep).unwrap();
                // Each dim a multiple of what both ends tile it by, and no more: other
                // layouts on the way may not divide it, which the plans must avoid.
                let (tf, tt) = (from.tiles(&m), to.tiles(&m));
                let shape: Vec<usize> = (0..rank).map(|d| mult[d] * lcm(tf[d], tt[d])).collect();
                (m, shape, from, to)
            })
    })
}

/// Each device's region of a value laid out by `l`, from XLA's index map of the
/// layout's `HloSharding` (not from the layout's own arithmetic).
fn regions(m: &Mesh, l: &Layout, shape: &[usize]) -> Vec<Vec<std::ops::Range<usize>>> {
    let sharding = l.without_partial().to_named(m).unwrap().to_sharding(shape.len()).unwrap();
    let map = sharding.index_map(shape, Mode::Strict).unwrap();
    m.devices()
        .iter()
        .map(|id| map.iter().find(|s| s.device == *id).unwrap().ranges.clone())
        .collect()
}

fn cut(x: &ArrayD<f64>, r: &[std::ops::Range<usize>]) -> ArrayD<f64> {
    let mut v = x.view();
    for (d, r) in r.iter().enumerate() {
        v.slice_axis_inplace(Axis(d), Slice::from(r.clone()));
    }
    v.to_owned()
}

/// The devices laid out by `l` for global `x`: pending groups hold random integer
/// parts that sum to the block.
fn lay_out(m: &Mesh, l: &Layout, x: &ArrayD<f64>, seed: u64) -> Vec<ArrayD<f64>> {
    let regs = regions(m, l, x.shape());
    let mut out: Vec<ArrayD<f64>> = regs.iter().map(|r| cut(x, r)).collect();
    let mut s = seed;
    for group in axis_groups(m, l.partial()) {
        let mut sum = ArrayD::<f64>::zeros(out[group[0]].raw_dim());
        for &d in &group[1..] {
            out[d].mapv_inplace(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) % 17) as f64 - 8.0
            });
            sum += &out[d];
        }
        out[group[0]] -= &sum;
    }
    out
}

/// Runs the steps on host copies: the collectives as their definitions say.
fn simulate(m: &Mesh, steps: &[Step], mut devs: Vec<ArrayD<f64>>) -> Vec<ArrayD<f64>> {
    for step in steps {
        let groups = step.groups(m);
        let mut next = devs.clone();
        for g in &groups {
            let k = g.len();
            match step {
                Step::Slice { dim, .. } => {
                    for (i, &d) in g.iter().enumerate() {
                        let len = devs[d].shape()[*dim] / k;
                        next[d] = devs[d]
                            .slice_axis(Axis(*dim), Slice::from(i * len..(i + 1) * len))
                            .to_owned();
                    }
                }
                Step::AllGather { dim, .. } => {
                    let views: Vec<_> = g.iter().map(|&d| devs[d].view()).collect();
                    let all = ndarray::concatenate(Axis(*dim), &views).unwrap();
                    g.iter().for_each(|&d| next[d] = all.clone());
                }
                Step::AllToAll { from, to, .. } => {
                    for (j, &dj) in g.iter().enumerate() {
                        let pieces: Vec<ArrayD<f64>> = g
                            .iter()
                            .map(|&di| {
                                let len = devs[di].shape()[*to] / k;
                                devs[di]
                                    .slice_axis(Axis(*to), Slice::from(j * len..(j + 1) * len))
                                    .to_owned()
                            })
                            .collect();
                        let views: Vec<_> = pieces.iter().map(|p| p.view()).collect();
                        next[dj] = ndarray::concatenate(Axis(*from), &views).unwrap();
                    }
                }
                Step::AllReduce { .. } => {
                    let mut sum = devs[g[0]].clone();
                    g[1..].iter().for_each(|&d| sum += &devs[d]);
                    g.iter().for_each(|&d| next[d] = sum.clone());
                }
                Step::ReduceScatter { dim, .. } => {
                    let mut sum = devs[g[0]].clone();
                    g[1..].iter().for_each(|&d| sum += &devs[d]);
                    for (i, &d) in g.iter().enumerate() {
                        let len = sum.shape()[*dim] / k;
                        next[d] = sum
                            .slice_axis(Axis(*dim), Slice::from(i * len..(i + 1) * len))
                            .to_owned();
                    }
                }
            }
        }
        devs = next;
    }
    devs
}

/// The fewest bytes any sequence of collectives needs (Dijkstra over layouts, every
/// step of every kind over every run of axes).
fn brute_force(m: &Mesh, shape: &[usize], from: &Layout, to: &Layout) -> u64 {
    let rank = shape.len();
    let axes: Vec<usize> = (0..m.shape().len()).filter(|&a| m.shape()[a] > 1).collect();
    let mut ids: HashMap<Layout, usize> = HashMap::new();
    let mut states: Vec<Layout> = Vec::new();
    let mut dist: Vec<u64> = Vec::new();
    let mut heap = BinaryHeap::new();
    ids.insert(from.clone(), 0);
    states.push(from.clone());
    dist.push(0);
    heap.push(std::cmp::Reverse((0u64, 0usize)));
    while let Some(std::cmp::Reverse((cost, i))) = heap.pop() {
        if cost > dist[i] {
            continue;
        }
        let c = states[i].clone();
        if c == *to {
            return cost;
        }
        let mut moves: Vec<Step> = Vec::new();
        let free: Vec<usize> = axes.iter().copied().filter(|&a| !c.uses(a)).collect();
        for d in 0..rank {
            for &x in &free {
                moves.push(Step::Slice { dim: d, axes: vec![x] });
            }
            let have = &c.dims()[d];
            for start in 0..have.len() {
                let run = have[start..].to_vec();
                moves.push(Step::AllGather { dim: d, axes: run.clone() });
                for e in (0..rank).filter(|&e| e != d) {
                    moves.push(Step::AllToAll { from: d, to: e, axes: run.clone() });
                }
            }
        }
        // Every ordered run of pending axes, reduced or scattered.
        let p = c.partial().to_vec();
        let mut runs: Vec<Vec<usize>> = vec![Vec::new()];
        for _ in 0..p.len() {
            let mut more = Vec::new();
            for r in &runs {
                for &a in &p {
                    if !r.contains(&a) {
                        let mut r2 = r.clone();
                        r2.push(a);
                        more.push(r2);
                    }
                }
            }
            runs.extend(more);
            runs.sort();
            runs.dedup();
        }
        for r in runs.into_iter().filter(|r| !r.is_empty()) {
            let mut sorted = r.clone();
            sorted.sort_unstable();
            moves.push(Step::AllReduce { axes: sorted });
            for d in 0..rank {
                moves.push(Step::ReduceScatter { dim: d, axes: r.clone() });
            }
        }
        for step in moves {
            let next = step.apply(&c);
            if next.local_shape(m, shape).is_err() {
                continue;
            }
            let nc = cost + bytes_of(m, shape, 4, &c, &step);
            let j = *ids.entry(next.clone()).or_insert_with(|| {
                states.push(next.clone());
                dist.push(u64::MAX);
                states.len() - 1
            });
            if nc < dist[j] {
                dist[j] = nc;
                heap.push(std::cmp::Reverse((nc, j)));
            }
        }
    }
    panic!("target unreachable");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Running a transition's collectives on a value laid out by `from` leaves every
    /// device with what `to` gives it: `shard_to(assemble_from(x))`.
    #[test]
    fn prop_transition_moves_values_exactly((m, shape, from, to) in case(), seed in any::<u64>()) {
        let n: usize = shape.iter().product();
        let x = ArrayD::from_shape_vec(IxDyn(&shape), (0..n).map(|i| i as f64).collect()).unwrap();
        let t = transition(&m, &shape, 4, &from, &to).unwrap();
        prop_assert_eq!(t.layouts().last().unwrap_or(&from), &to);
        // Every layout on the way divides the shape (each device holds a real block).
        for l in t.layouts() {
            prop_assert!(l.local_shape(&m, &shape).is_ok(), "{:?} on the way", l);
        }
        let bytes: u64 = t
            .steps()
            .iter()
            .zip(std::iter::once(&from).chain(t.layouts()))
            .map(|(step, before)| bytes_of(&m, &shape, 4, before, step))
            .sum();
        prop_assert_eq!(t.bytes(), bytes);
        let devs = simulate(&m, t.steps(), lay_out(&m, &from, &x, seed));
        let regs = regions(&m, &to, &shape);
        for group in axis_groups(&m, to.partial()) {
            let mut sum = devs[group[0]].clone();
            group[1..].iter().for_each(|&d| sum += &devs[d]);
            prop_assert_eq!(&sum, &cut(&x, &regs[group[0]]), "group {:?}", group);
        }
    }

    /// The greedy plan (for big meshes) moves values exactly too.
    #[test]
    fn prop_greedy_moves_values_exactly((m, shape, from, to) in case(), seed in any::<u64>()) {
        let n: usize = shape.iter().product();
        let x = ArrayD::from_shape_vec(IxDyn(&shape), (0..n).map(|i| i as f64).collect()).unwrap();
        let t = greedy(&m, &shape, 4, &from, &to).unwrap();
        prop_assert!(t.bytes() >= transition(&m, &shape, 4, &from, &to).unwrap().bytes());
        for l in t.layouts() {
            prop_assert!(l.local_shape(&m, &shape).is_ok(), "{:?} on the way", l);
        }
        let devs = simulate(&m, t.steps(), lay_out(&m, &from, &x, seed));
        let regs = regions(&m, &to, &shape);
        for group in axis_groups(&m, to.partial()) {
            let mut sum = devs[group[0]].clone();
            group[1..].iter().for_each(|&d| sum += &devs[d]);
            prop_assert_eq!(&sum, &cut(&x, &regs[group[0]]), "group {:?}", group);
        }
    }

    /// No sequence of collectives moves fewer bytes than the planner's.
    #[test]
    fn prop_transition_moves_the_fewest_bytes((m, shape, from, to) in case()) {
        let t = transition(&m, &shape, 4, &from, &to).unwrap();
        let best = brute_force(&m, &shape, &from, &to);
        prop_assert_eq!(t.bytes(), best, "steps {:?}", t.steps());
    }

    /// A layout's lowering reads back as the same sharding.
    #[test]
    fn prop_layouts_read_back_from_hlo((m, shape, from, _to) in case()) {
        let hlo = from.to_hlo(&m).unwrap();
        let back = Layout::from_hlo(&m, &hlo, shape.len()).unwrap();
        prop_assert_eq!(back.to_hlo(&m).unwrap(), hlo);
    }
}
