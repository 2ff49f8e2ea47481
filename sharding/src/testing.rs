//! proptest strategies for meshes, partition specs, shardings and arrays (feature
//! `proptest`).

use meshwork_types::DeviceId;
use proptest::prelude::*;

use crate::{
    DimSpec, HloSharding, Mesh, NamedSharding, PartitionSpec, SubgroupType, TileAssignment,
};

const AXIS_NAMES: [&str; 4] = ["a", "b", "c", "d"];

/// Meshes of 1–3 axes named `a`, `b`, `c` with sizes 1–4 (at most 16 devices), over a
/// random permutation of device ids `0..n`.
pub fn mesh() -> impl Strategy<Value = Mesh> {
    proptest::collection::vec(1..=4usize, 1..=3)
        .prop_filter("at most 16 devices", |sizes| sizes.iter().product::<usize>() <= 16)
        .prop_flat_map(|sizes| {
            let n = sizes.iter().product::<usize>() as u32;
            (Just(sizes), Just((0..n).map(DeviceId).collect::<Vec<_>>()).prop_shuffle())
        })
        .prop_map(|(sizes, devices)| {
            let axes: Vec<(&str, usize)> = AXIS_NAMES.iter().copied().zip(sizes).collect();
            Mesh::new(&axes, devices).expect("valid mesh")
        })
}

/// A valid partition spec for `mesh` and a tensor of `rank`: every mesh axis is used
/// at most once, on some dim, in a random order.
pub fn spec(mesh: &Mesh, rank: usize) -> impl Strategy<Value = PartitionSpec> + use<> {
    let names = mesh.axis_names().to_vec();
    let slots = names.len();
    // For each axis: which dim it shards (rank = unused), then a shuffle for order.
    (
        proptest::collection::vec(0..=rank, slots),
        Just((0..slots).collect::<Vec<_>>()).prop_shuffle(),
    )
        .prop_map(move |(dim_of, order)| {
            let mut dims = vec![Vec::new(); rank];
            for axis in order {
                if dim_of[axis] < rank {
                    dims[dim_of[axis]].push(names[axis].clone());
                }
            }
            PartitionSpec::new(dims.into_iter().map(DimSpec::Axes).collect())
        })
}

/// A named sharding over [`mesh`] with a [`spec`] for `rank`.
pub fn named_sharding(rank: usize) -> impl Strategy<Value = NamedSharding> {
    mesh().prop_flat_map(move |mesh| {
        spec(&mesh, rank)
            .prop_map(move |spec| NamedSharding::new(mesh.clone(), spec).expect("valid spec"))
    })
}

/// Tiled shardings with explicit or iota tile assignments of rank 1–4 over at most 16
/// devices, with random subgroup types on the trailing dims.
pub fn hlo_sharding() -> impl Strategy<Value = HloSharding> {
    let dims = proptest::collection::vec(1..=4usize, 1..=4)
        .prop_filter("at most 16 devices", |d| d.iter().product::<usize>() <= 16);
    let types = proptest::sample::select(vec![
        SubgroupType::Manual,
        SubgroupType::Unreduced,
        SubgroupType::Replicated,
    ]);
    (dims, any::<bool>(), proptest::collection::vec(types, 0..=2)).prop_flat_map(
        |(dims, iota, types)| {
            let n: usize = dims.iter().product();
            let types_len = types.len().min(dims.len());
            let tiles = if iota {
                factorization(n)
                    .prop_flat_map(move |reshape| {
                        let len = reshape.len();
                        (Just(reshape), Just((0..len).collect::<Vec<_>>()).prop_shuffle())
                    })
                    .prop_map({
                        let dims = dims.clone();
                        move |(reshape, perm)| {
                            TileAssignment::iota(dims.clone(), &reshape, &perm).expect("valid iota")
                        }
                    })
                    .boxed()
            } else {
                Just((0..n).collect::<Vec<_>>())
                    .prop_shuffle()
                    .prop_map({
                        let dims = dims.clone();
                        move |devices| {
                            TileAssignment::explicit(dims.clone(), devices).expect("a permutation")
                        }
                    })
                    .boxed()
            };
            tiles.prop_map(move |t| {
                HloSharding::subgroup(t, &types[..types_len]).expect("types fit")
            })
        },
    )
}

/// Ordered factorisations of `n` into factors ≥ 1 (size-1 factors included, as in
/// non-canonical iota text).
fn factorization(n: usize) -> impl Strategy<Value = Vec<usize>> {
    let divisors: Vec<usize> = (1..=n).filter(|d| n.is_multiple_of(*d)).collect();
    proptest::collection::vec(proptest::sample::select(divisors), 0..=3).prop_map(move |picks| {
        let mut rest = n;
        let mut out = Vec::new();
        for p in picks {
            if rest.is_multiple_of(p) {
                out.push(p);
                rest /= p;
            }
        }
        out.push(rest);
        out
    })
}

/// A shape of `rank` whose dims are multiples of `tiles` (so strict mode accepts it),
/// each at most `tiles[i] * 3`, possibly 0.
pub fn divisible_shape(tiles: Vec<usize>) -> impl Strategy<Value = Vec<usize>> {
    tiles.into_iter().map(|k| (0..=3usize).prop_map(move |m| m * k)).collect::<Vec<_>>()
}

/// Any shape of `rank` with dims 0–9 (0–3 above rank 3, to keep arrays small).
pub fn any_shape(rank: usize) -> impl Strategy<Value = Vec<usize>> {
    let max: usize = if rank > 3 { 4 } else { 10 };
    proptest::collection::vec(0..max, rank)
}
