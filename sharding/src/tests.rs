//! Properties of the whole crate: data roundtrips, coverage, text stability, and
//! lowering against a direct model of JAX's rules.

use std::ops::Range;

use ndarray::{ArrayD, IxDyn};
use proptest::prelude::*;

use crate::testing::{any_shape, divisible_shape, hlo_sharding, named_sharding};
use crate::{
    HloSharding, Mode, NamedSharding, Sharding, TileAssignment, assemble, shard, shard_into,
};

fn iota_array(shape: &[usize]) -> ArrayD<i32> {
    let n: usize = shape.iter().product();
    ArrayD::from_shape_vec(IxDyn(shape), (0..n as i32).collect()).unwrap()
}

/// Named sharding of rank 0–6 plus a shape its strict mode accepts.
fn strict_case() -> impl Strategy<Value = (NamedSharding, Vec<usize>)> {
    (0..=6usize).prop_flat_map(named_sharding).prop_flat_map(|named| {
        let rank = named.spec().dims().len();
        let tiles = match named.to_hlo(rank).unwrap() {
            HloSharding::Tiled(t) => t.data_dims().to_vec(),
            _ => vec![1; rank],
        };
        (Just(named), divisible_shape(tiles))
    })
}

/// Named sharding of rank 0–6 plus any shape of that rank.
fn uneven_case() -> impl Strategy<Value = (NamedSharding, Vec<usize>)> {
    (0..=6usize).prop_flat_map(named_sharding).prop_flat_map(|named| {
        let rank = named.spec().dims().len();
        (Just(named), any_shape(rank))
    })
}

fn roundtrip_as<T>(global: &ArrayD<T>, sharding: &Sharding) -> Result<(), TestCaseError>
where
    T: Copy + Default + Send + Sync + PartialEq + std::fmt::Debug,
{
    let shards = shard(&global.view(), sharding, Mode::Uneven)?;
    let views: Vec<_> = shards.iter().map(|s| s.data.view()).collect();
    prop_assert_eq!(&assemble(&views, sharding, global.shape(), Mode::Uneven)?, global);
    Ok(())
}

fn holders(sharding: &Sharding, shape: &[usize], mode: Mode) -> ArrayD<usize> {
    let mut count = ArrayD::<usize>::zeros(IxDyn(shape));
    for entry in sharding.index_map(shape, mode).unwrap() {
        let slices: Vec<ndarray::SliceInfoElem> =
            entry.ranges.iter().map(|r| (r.start..r.end).into()).collect();
        count.slice_mut(slices.as_slice()).mapv_inplace(|c| c + 1);
    }
    count
}

proptest! {
    #[test]
    fn prop_shard_assemble_roundtrip_strict((named, shape) in strict_case()) {
        let sharding = named.to_sharding(shape.len())?;
        let global = iota_array(&shape);
        let shards = shard(&global.view(), &sharding, Mode::Strict)?;
        let views: Vec<_> = shards.iter().map(|s| s.data.view()).collect();
        prop_assert_eq!(&assemble(&views, &sharding, &shape, Mode::Strict)?, &global);
        // Every shard has the strict shard shape.
        let shard_shape = sharding.shard_shape(&shape, Mode::Strict)?;
        for s in &shards {
            prop_assert_eq!(s.data.shape(), shard_shape.as_slice());
        }
        // Into caller buffers: the same data.
        let mut buffers: Vec<ArrayD<i32>> = shards.iter().map(|s| ArrayD::from_elem(s.data.raw_dim(), -1)).collect();
        let mut views: Vec<_> = buffers.iter_mut().map(|b| b.view_mut()).collect();
        shard_into(&global.view(), &sharding, Mode::Strict, &mut views)?;
        for (s, b) in shards.iter().zip(&buffers) {
            prop_assert_eq!(&s.data, b);
        }
    }

    #[test]
    fn prop_shard_assemble_roundtrip_uneven((named, shape) in uneven_case()) {
        let sharding = named.to_sharding(shape.len())?;
        let global = iota_array(&shape);
        let shards = shard(&global.view(), &sharding, Mode::Uneven)?;
        let views: Vec<_> = shards.iter().map(|s| s.data.view()).collect();
        prop_assert_eq!(&assemble(&views, &sharding, &shape, Mode::Uneven)?, &global);
        // Other element types take the same paths.
        roundtrip_as(&global.mapv(f64::from), &sharding)?;
        roundtrip_as(&global.mapv(|v| v as u8), &sharding)?;
        roundtrip_as(&global.mapv(|v| v % 3 == 0), &sharding)?;
        // Every shard fits in the padded shard shape.
        let padded = sharding.shard_shape(&shape, Mode::Uneven)?;
        for s in &shards {
            prop_assert!(s.data.shape().iter().zip(&padded).all(|(a, p)| a <= p));
        }
    }

    /// Every element is held by exactly as many devices as the sharding replicates
    /// over, and replica ids number each region's holders 0, 1, ….
    #[test]
    fn prop_every_element_held_num_replicas((named, shape) in uneven_case()) {
        let sharding = named.to_sharding(shape.len())?;
        let replicas = match sharding.hlo() {
            HloSharding::Replicated => sharding.device_assignment().len(),
            HloSharding::Tiled(t) => t.num_replicas(),
            other => return Err(TestCaseError::fail(format!("unexpected {other}"))),
        };
        let count = holders(&sharding, &shape, Mode::Uneven);
        prop_assert!(count.iter().all(|&c| c == replicas), "{count:?} vs {replicas}");
        let map = sharding.index_map(&shape, Mode::Uneven)?;
        for entry in &map {
            let earlier = map.iter().take_while(|e| e.device != entry.device).filter(|e| e.ranges == entry.ranges).count();
            prop_assert_eq!(entry.replica_id, earlier);
        }
    }

    #[test]
    fn prop_print_parse_print_is_stable(hlo in hlo_sharding()) {
        let text = hlo.to_string();
        let back: HloSharding = text.parse()?;
        prop_assert_eq!(&back, &hlo);
        prop_assert_eq!(back.to_string(), text);
    }

    /// An iota assignment equals the explicit list of the same devices; only the text
    /// differs.
    #[test]
    fn prop_iota_equals_explicit(hlo in hlo_sharding()) {
        if let HloSharding::Tiled(t) = &hlo {
            let tiles = t.tiles();
            let explicit = TileAssignment::explicit(tiles.dims().to_vec(), tiles.devices().to_vec())?;
            prop_assert_eq!(&explicit, tiles);
            prop_assert!(explicit.iota_form().is_none());
            if let Some(iota) = tiles.iota_form() {
                let again = TileAssignment::iota(tiles.dims().to_vec(), iota.reshape_dims(), iota.transpose_perm())?;
                prop_assert_eq!(again.devices(), tiles.devices());
                prop_assert_eq!(again.iota_form(), Some(iota));
            }
        }
    }

    /// Lowering agrees with a direct reading of JAX's rule: the device at mesh
    /// coordinates `c` holds, along dim `d` sharded over axes `a1..ak` (major first),
    /// tile `Σ c[ai] · Π_{j>i} size(aj)`.
    #[test]
    fn prop_lowering_matches_model((named, shape) in strict_case()) {
        let sharding = named.to_sharding(shape.len())?;
        let mesh = named.mesh();
        let map = sharding.index_map(&shape, Mode::Strict)?;
        prop_assert_eq!(map.len(), mesh.size());
        for (flat, entry) in map.iter().enumerate() {
            prop_assert_eq!(entry.device, mesh.devices()[flat]);
            let mut coords = vec![0; mesh.shape().len()];
            let mut rest = flat;
            for i in (0..coords.len()).rev() {
                coords[i] = rest % mesh.shape()[i];
                rest /= mesh.shape()[i];
            }
            let expected: Vec<Range<usize>> = shape.iter().enumerate().map(|(d, &size)| {
                let axes = named.spec().dims().get(d).map(|s| s.axes()).unwrap_or(&[]);
                let (mut tile, mut count) = (0, 1);
                for name in axes {
                    let a = mesh.axis_index(name).unwrap();
                    tile = tile * mesh.shape()[a] + coords[a];
                    count *= mesh.shape()[a];
                }
                let len = size / count;
                tile * len..(tile + 1) * len
            }).collect();
            prop_assert_eq!(&entry.ranges, &expected, "device {}", entry.device);
        }
    }
}

/// Two shardings of the same shape over meshes of the same devices (shuffled).
fn reshard_case() -> impl Strategy<Value = (Sharding, Sharding, Vec<usize>)> {
    (0..=3usize)
        .prop_flat_map(|rank| (named_sharding(rank), any_shape(rank), any::<bool>()))
        .prop_flat_map(|(a, shape, same_mesh)| {
            let rank = shape.len();
            let mesh = a.mesh().clone();
            let b = if same_mesh {
                crate::testing::spec(&mesh, rank)
                    .prop_map(move |spec| NamedSharding::new(mesh.clone(), spec).unwrap())
                    .boxed()
            } else {
                named_sharding(rank).boxed()
            };
            (Just(a), b, Just(shape))
        })
        .prop_map(|(a, b, shape)| {
            let rank = shape.len();
            (a.to_sharding(rank).unwrap(), b.to_sharding(rank).unwrap(), shape)
        })
}

proptest! {
    /// reshard(A→B) of A's shards equals B's shards of the same array, and moves
    /// exactly the brute-force minimum: every destination element its device did not
    /// already hold.
    #[test]
    fn prop_reshard_equals_shard_of_assembled((from, to, shape) in reshard_case()) {
        let global = iota_array(&shape);
        let src = shard(&global.view(), &from, Mode::Uneven)?;
        let src_views: Vec<_> = src.iter().map(|s| s.data.view()).collect();
        let plan = crate::ReshardPlan::new(&from, &to, &shape, Mode::Uneven)?;
        let moved = plan.apply(&src_views)?;
        let expected = shard(&global.view(), &to, Mode::Uneven)?;
        prop_assert_eq!(moved.len(), expected.len());
        for (m, e) in moved.iter().zip(&expected) {
            prop_assert_eq!(m, &e.data);
        }
        // Brute force: count destination elements not already on their device.
        let mut minimum = 0;
        for target in plan.target_index() {
            let held = src.iter().find(|s| s.device == target.device).map(|s| &s.ranges);
            let ext: Vec<usize> = target.ranges.iter().map(|r| r.len()).collect();
            crate::tile::for_each_index(&ext, |idx| {
                let inside = held.is_some_and(|h| {
                    idx.iter().zip(&target.ranges).zip(h).all(|((i, t), h)| h.contains(&(t.start + i)))
                });
                minimum += usize::from(!inside);
            });
        }
        prop_assert_eq!(plan.elements_moved(), minimum);
        prop_assert_eq!(plan.bytes_moved(4), minimum * 4);
        prop_assert!(plan.elements_moved() <= plan.total_elements());
    }
}

#[test]
fn resharding_to_the_same_sharding_moves_nothing() {
    let mesh = crate::Mesh::iota(&[("a", 2), ("b", 4)]).unwrap();
    let ab = NamedSharding::new(mesh.clone(), "P('a','b')".parse().unwrap())
        .unwrap()
        .to_sharding(2)
        .unwrap();
    let ba =
        NamedSharding::new(mesh, "P('b','a')".parse().unwrap()).unwrap().to_sharding(2).unwrap();
    let same = crate::ReshardPlan::new(&ab, &ab, &[8, 8], Mode::Strict).unwrap();
    assert_eq!(same.elements_moved(), 0);
    assert!(same.transfers().iter().all(|t| t.is_local()));
    let swap = crate::ReshardPlan::new(&ab, &ba, &[8, 8], Mode::Strict).unwrap();
    // Device (i, j) holds rows 4i.., cols 2j.. before and rows 2j.., cols 4i.. after:
    // devices 0, 1, 6 and 7 keep a 2x2 block each, the other 48 elements move.
    assert_eq!(swap.total_elements(), 64);
    assert_eq!(swap.elements_moved(), 48);
}

/// Arrays above the parallel threshold take the multi-threaded copy paths: the same
/// results as the small arrays of the properties above.
#[test]
fn large_arrays_roundtrip_through_the_parallel_paths() {
    let shape = [1030, 2050]; // 8.05 MiB of i32, uneven over every mesh below
    let global = iota_array(&shape);
    let mesh = crate::Mesh::new(
        &[("a", 2), ("b", 4)],
        [3, 1, 0, 2, 7, 5, 6, 4].map(meshwork_types::DeviceId).to_vec(),
    )
    .unwrap();
    let specs = ["P('a','b')", "P('b','a')", "P(('a','b'), None)", "P(None, 'b')", "P()"];
    let shardings: Vec<Sharding> = specs
        .iter()
        .map(|s| {
            NamedSharding::new(mesh.clone(), s.parse().unwrap()).unwrap().to_sharding(2).unwrap()
        })
        .collect();
    for (from, spec) in shardings.iter().zip(specs) {
        let shards = shard(&global.view(), from, Mode::Uneven).unwrap();
        let mut buffers: Vec<ArrayD<i32>> =
            shards.iter().map(|s| ArrayD::from_elem(s.data.raw_dim(), -1)).collect();
        let mut views: Vec<_> = buffers.iter_mut().map(|b| b.view_mut()).collect();
        shard_into(&global.view(), from, Mode::Uneven, &mut views).unwrap();
        for (s, b) in shards.iter().zip(&buffers) {
            assert_eq!(&s.data, b, "{spec}");
        }
        let views: Vec<_> = buffers.iter().map(|b| b.view()).collect();
        assert_eq!(assemble(&views, from, &shape, Mode::Uneven).unwrap(), global, "{spec}");
        for to in &shardings {
            let plan = crate::ReshardPlan::new(from, to, &shape, Mode::Uneven).unwrap();
            let moved = plan.apply(&views).unwrap();
            let expected = shard(&global.view(), to, Mode::Uneven).unwrap();
            assert!(moved.iter().zip(&expected).all(|(m, e)| *m == e.data), "{spec}");
        }
    }
}

#[test]
fn visualize_draws_1d_and_refuses_rank_3() {
    let mesh = crate::Mesh::new(
        &[("a", 2)],
        vec![meshwork_types::DeviceId(5), meshwork_types::DeviceId(2)],
    )
    .unwrap();
    let sharding =
        NamedSharding::new(mesh, "P('a')".parse().unwrap()).unwrap().to_sharding(1).unwrap();
    let picture = crate::visualize(&sharding, &[5], Mode::Uneven).unwrap();
    assert_eq!(
        picture,
        "┌────────────┬────────────┐\n│ [0:3]      │ [3:5]      │\n│ devices 5  │ devices 2  │\n└────────────┴────────────┘\n"
    );
    assert_eq!(
        crate::visualize(&sharding, &[2, 2, 2], Mode::Uneven),
        Err(crate::Error::RankMismatch { sharding_rank: 2, shape_rank: 3 })
    );
}

#[test]
fn bad_meshes_and_specs_are_typed_errors() {
    use crate::{Error, Mesh, PartitionSpec};
    use meshwork_types::DeviceId;
    let d = |ids: &[u32]| ids.iter().copied().map(DeviceId).collect::<Vec<_>>();
    assert_eq!(
        Mesh::new(&[("a", 2), ("a", 2)], d(&[0, 1, 2, 3])),
        Err(Error::DuplicateMeshAxis { name: "a".into() })
    );
    assert_eq!(
        Mesh::new(&[("a", 2)], d(&[1, 1])),
        Err(Error::DuplicateDevice { device: DeviceId(1) })
    );
    assert_eq!(
        Mesh::new(&[("a", 2), ("b", 2)], d(&[0, 1, 2])),
        Err(Error::MeshDeviceCount { shape: vec![2, 2], expected: 4, actual: 3 })
    );
    assert_eq!(Mesh::new(&[("a", 0)], d(&[])), Err(Error::EmptyMeshAxis { name: "a".into() }));

    let mesh = Mesh::iota(&[("a", 2), ("b", 2)]).unwrap();
    let named =
        |spec: &str| NamedSharding::new(mesh.clone(), spec.parse::<PartitionSpec>().unwrap());
    assert_eq!(named("P('a', ('b','a'))"), Err(Error::DuplicateSpecAxis { axis: "a".into() }));
    assert_eq!(
        named("P('x')"),
        Err(Error::UnknownSpecAxis { axis: "x".into(), mesh_axes: vec!["a".into(), "b".into()] })
    );
    assert_eq!(
        named("P('a', unreduced={'b'})"),
        Err(Error::UnreducedAxisType { axis: "b".into(), axis_type: crate::AxisType::Auto })
    );
    assert_eq!(
        named("P(None, None, 'a')").unwrap().to_hlo(2),
        Err(Error::SpecLongerThanRank { entry: 2, rank: 2 })
    );
    // Placing data refuses what JAX's device_put refuses, though the HLO lowers.
    assert!(named("P('a', None, None)").unwrap().to_hlo(2).is_ok());
    assert_eq!(
        named("P('a', None, None)").unwrap().to_sharding(2),
        Err(Error::SpecTooLong { entries: 3, rank: 2 })
    );
    assert_eq!(
        named("P(None, UNCONSTRAINED, None)").unwrap().to_sharding(2),
        Err(Error::UnconstrainedEntry { entry: 1 })
    );
    let sharding = named("P('a','b')").unwrap().to_sharding(2).unwrap();
    assert_eq!(
        sharding.shard_shape(&[4], Mode::Strict),
        Err(Error::RankMismatch { sharding_rank: 2, shape_rank: 1 })
    );
    assert_eq!(
        sharding.shard_shape(&[4, 3], Mode::Strict),
        Err(Error::Indivisible { dim: 1, size: 3, shards: 2 })
    );
    assert_eq!(sharding.shard_shape(&[4, 3], Mode::Uneven), Ok(vec![2, 2]));
    // Shapes whose element count overflows are refused before any arithmetic.
    let huge = [usize::MAX, 2];
    let overflow =
        Error::Types(meshwork_types::Error::ElementCountOverflow { dims: huge.to_vec() });
    assert_eq!(sharding.shard_shape(&huge, Mode::Uneven), Err(overflow.clone()));
    assert_eq!(sharding.index_map(&huge, Mode::Uneven), Err(overflow.clone()));
    assert_eq!(crate::ReshardPlan::new(&sharding, &sharding, &huge, Mode::Uneven), Err(overflow));
    // Binding an HLO sharding to too few devices, or a maximal one past the end.
    assert_eq!(
        Sharding::new(sharding.hlo().clone(), d(&[0, 1])),
        Err(Error::DeviceCountMismatch { sharding_devices: 4, assignment_devices: 2 })
    );
    assert_eq!(
        Sharding::new(HloSharding::Maximal { device: 2 }, d(&[0, 1])),
        Err(Error::MaximalOutOfRange { device: 2, assignment_devices: 2 })
    );
}

#[test]
fn partition_spec_text_roundtrips_and_reports_positions() {
    use crate::{Error, PartitionSpec};
    let spec: PartitionSpec =
        "PartitionSpec(\"data\", ('x', 'y'), None, P.UNCONSTRAINED, ('z',), (), unreduced={'u'})"
            .parse()
            .unwrap();
    assert_eq!(
        spec.to_string(),
        "P('data', ('x','y'), None, UNCONSTRAINED, 'z', None, unreduced={'u'})"
    );
    assert_eq!(spec.to_string().parse::<PartitionSpec>().unwrap(), spec);
    assert_eq!("P()".parse::<PartitionSpec>().unwrap(), PartitionSpec::replicated());
    assert_eq!(
        "P('a', b)".parse::<PartitionSpec>(),
        Err(Error::Parse {
            input: "P('a', b)".into(),
            position: 7,
            expected: "a quoted axis name, `None`, `UNCONSTRAINED` or a tuple"
        })
    );
    assert_eq!(
        "P('a'".parse::<PartitionSpec>(),
        Err(Error::Parse { input: "P('a'".into(), position: 5, expected: "," })
    );
}

/// Text built from the grammar's own tokens, so that random strings get deep into the
/// parsers rather than failing at the first byte.
fn token_soup(tokens: &'static [&'static str]) -> impl Strategy<Value = String> {
    proptest::collection::vec(proptest::sample::select(tokens), 0..24)
        .prop_map(|parts| parts.concat())
}

const HLO_TOKENS: &[&str] = &[
    "{",
    "}",
    "devices=",
    "[",
    "]",
    "<=",
    "T(",
    ")",
    ",",
    ", ",
    "0",
    "1",
    "2",
    "3",
    "4",
    "8",
    "16",
    " last_tile_dim_replicate",
    " last_tile_dims=",
    "manual",
    "replicated",
    "unreduced",
    "maximal",
    " device=",
    " ",
    "/*index=5*/",
    "99999999999999999999999",
];
const SPEC_TOKENS: &[&str] = &[
    "P(",
    "PartitionSpec(",
    ")",
    "(",
    ",",
    " ",
    "'a'",
    "\"b\"",
    "'",
    "None",
    "UNCONSTRAINED",
    "unreduced=",
    "{",
    "}",
];

fn check_parse<T>(text: &str) -> Result<(), TestCaseError>
where
    T: std::str::FromStr<Err = crate::Error> + std::fmt::Display + PartialEq + std::fmt::Debug,
{
    match text.parse::<T>() {
        Ok(value) => {
            let printed = value.to_string();
            let back: T =
                printed.parse().map_err(|e| TestCaseError::fail(format!("{printed}: {e}")))?;
            prop_assert_eq!(&back, &value);
            prop_assert_eq!(back.to_string(), printed);
        }
        Err(crate::Error::Parse { input, position, .. }) => {
            prop_assert_eq!(input, text);
            prop_assert!(position <= text.len());
        }
        Err(other) => prop_assert!(false, "a parser returned a non-parse error: {other}"),
    }
    Ok(())
}

proptest! {
    /// The text parsers never panic: every input either parses to a value whose text
    /// parses back to it, or is a parse error at a position inside the input.
    #[test]
    fn prop_parsers_never_panic(hlo in token_soup(HLO_TOKENS), spec in token_soup(SPEC_TOKENS), noise in ".{0,40}") {
        check_parse::<HloSharding>(&hlo)?;
        check_parse::<HloSharding>(&noise)?;
        check_parse::<crate::PartitionSpec>(&spec)?;
        check_parse::<crate::PartitionSpec>(&noise)?;
    }
}

#[test]
fn bad_buffers_are_typed_errors() {
    use crate::{Error, Mesh, assemble_into};
    use meshwork_types::DeviceId;
    let mesh = Mesh::iota(&[("a", 2)]).unwrap();
    let sharding =
        NamedSharding::new(mesh, "P('a')".parse().unwrap()).unwrap().to_sharding(2).unwrap();
    let global = iota_array(&[4, 2]);
    let mut one = ArrayD::<i32>::zeros(IxDyn(&[2, 2]));
    let mut two = ArrayD::<i32>::zeros(IxDyn(&[2, 2]));
    assert_eq!(
        shard_into(&global.view(), &sharding, Mode::Strict, &mut [one.view_mut()]),
        Err(Error::ShardCount { expected: 2, actual: 1 })
    );
    let mut wrong = ArrayD::<i32>::zeros(IxDyn(&[2, 3]));
    assert_eq!(
        shard_into(
            &global.view(),
            &sharding,
            Mode::Strict,
            &mut [one.view_mut(), wrong.view_mut()]
        ),
        Err(Error::ShardShape { device: DeviceId(1), expected: vec![2, 2], actual: vec![2, 3] })
    );
    // A transposed view has the right shape but is not row-major.
    let transposed = two.view_mut().reversed_axes();
    assert_eq!(
        shard_into(&global.view(), &sharding, Mode::Strict, &mut [one.view_mut(), transposed]),
        Err(Error::NotContiguous { device: DeviceId(1) })
    );
    let mut out = ArrayD::<i32>::zeros(IxDyn(&[2, 4]));
    let shards = [one.view(), two.view()];
    assert_eq!(
        assemble_into(&shards, &sharding, Mode::Strict, &mut out.view_mut().reversed_axes()),
        Err(Error::OutputNotContiguous)
    );
    assert_eq!(
        assemble(&shards[..1], &sharding, &[4, 2], Mode::Strict),
        Err(Error::ShardCount { expected: 2, actual: 1 })
    );
}
