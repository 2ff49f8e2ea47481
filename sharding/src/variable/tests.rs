use ndarray::IxDyn;
use proptest::prelude::*;

use super::*;
use crate::{Error, Mesh, NamedSharding};

fn formats() -> Vec<VariableFormat> {
    let mesh = Mesh::iota(&[("a", 2), ("b", 3)]).unwrap();
    let mut out = vec![VariableFormat::Default];
    for (key, spec) in
        [("ab", "P('a','b')"), ("ba", "P('b','a')"), ("rows", "P(('a','b'))"), ("rep", "P()")]
    {
        let sharding = NamedSharding::new(mesh.clone(), spec.parse().unwrap())
            .unwrap()
            .to_sharding(2)
            .unwrap();
        out.push(VariableFormat::Sharded { key: key.into(), sharding });
    }
    out
}

fn value() -> ArrayD<i32> {
    // 4x6 divides under P('a','b') (4/2, 6/3) but not under P('b','a') (4/3): in strict
    // mode that format fails after its unshard step has run.
    ArrayD::from_shape_vec(IxDyn(&[4, 6]), (0..24).collect()).unwrap()
}

#[test]
fn a_failure_in_the_middle_leaves_the_old_format_and_data() {
    let formats = formats();
    let mut var = ReshardableVariable::new(value(), Mode::Strict);
    assert_eq!(var.reshard(formats[1].clone()), Ok(true)); // ab: 4/2, 6/3
    let before = var.clone();
    // ba needs 4/3: unsharding succeeds, sharding fails.
    let err = var.reshard(formats[2].clone()).unwrap_err();
    assert_eq!(err, Error::Indivisible { dim: 0, size: 4, shards: 3 });
    assert_eq!(var, before);
    assert_eq!(var.value().unwrap(), value());
}

#[test]
fn same_key_and_default_to_default_are_no_ops() {
    let formats = formats();
    let mut var = ReshardableVariable::new(value(), Mode::Strict);
    assert_eq!(var.reshard(VariableFormat::Default), Ok(false));
    assert_eq!(var.reshard(formats[1].clone()), Ok(true));
    assert_eq!(var.reshard(formats[1].clone()), Ok(false));
    assert_eq!(var.shards().unwrap().len(), 6);
    assert_eq!(var.reshard(VariableFormat::Default), Ok(true));
    assert!(var.shards().is_none());
}

proptest! {
    /// Any sequence of reshards keeps the value; the format changes exactly on success.
    #[test]
    fn prop_reshard_sequences_keep_the_value(steps in proptest::collection::vec(0..5usize, 1..12), uneven in any::<bool>()) {
        let formats = formats();
        let mode = if uneven { Mode::Uneven } else { Mode::Strict };
        let mut var = ReshardableVariable::new(value(), mode);
        for step in steps {
            let before = var.format().clone();
            match var.reshard(formats[step].clone()) {
                Ok(changed) => {
                    prop_assert_eq!(var.format().key(), formats[step].key());
                    prop_assert_eq!(changed, before.key() != formats[step].key());
                }
                Err(_) => {
                    prop_assert!(!uneven, "uneven mode never fails here");
                    prop_assert_eq!(var.format(), &before);
                }
            }
            prop_assert_eq!(var.value()?, value());
        }
    }

    /// A variable made from any sharding's shards of a value (strict or uneven) reads
    /// back that value, equals the one resharded into that format, and moves to
    /// another format and back unchanged; one shard too few is refused.
    #[test]
    fn prop_variables_from_shards_roundtrip(
        (from, to, shape) in crate::testing::named_sharding(2).prop_flat_map(|a| {
            let rank2 = crate::testing::named_sharding(2);
            (Just(a), rank2, crate::testing::any_shape(2))
        }),
        uneven in any::<bool>(),
    ) {
        let mode = if uneven { Mode::Uneven } else { Mode::Strict };
        let n: usize = shape.iter().product();
        let value = ArrayD::from_shape_vec(IxDyn(&shape), (0..n as i64).collect()).unwrap();
        let (Ok(a), Ok(b)) = (from.to_sharding(2), to.to_sharding(2)) else {
            return Ok(());
        };
        if a.index_map(&shape, mode).is_err() || b.index_map(&shape, mode).is_err() {
            return Ok(());
        }
        let fa = VariableFormat::Sharded { key: "a".into(), sharding: a.clone() };
        let fb = VariableFormat::Sharded { key: "b".into(), sharding: b };
        let shards: Vec<ArrayD<i64>> =
            shard(&value.view(), &a, mode).unwrap().into_iter().map(|s| s.data).collect();
        let mut var =
            ReshardableVariable::from_shards(shape.clone(), shards.clone(), fa.clone(), mode)?;
        prop_assert_eq!(var.value()?, value.clone());
        let mut want = ReshardableVariable::new(value.clone(), mode);
        want.reshard(fa.clone())?;
        prop_assert_eq!(&var, &want);
        prop_assert!(var.reshard(fb)?);
        prop_assert!(var.reshard(fa)?);
        prop_assert_eq!(var.shards().unwrap(), &shards[..]);
        let fewer = shards[1..].to_vec();
        let fa = VariableFormat::Sharded { key: "a".into(), sharding: a };
        prop_assert!(ReshardableVariable::from_shards(shape, fewer, fa, mode).is_err());
    }
}

/// Shards made elsewhere (a device's parts) become a variable in their format (replicas
/// of a region are taken as given: nothing checks that they agree): it
/// reads back the value they tile and moves between formats like one resharded there;
/// a wrong count or shape is refused.
#[test]
fn a_variable_from_shards_equals_one_resharded_into_them() {
    let formats = formats();
    for f in &formats[1..] {
        let VariableFormat::Sharded { sharding, .. } = f else { unreachable!() };
        if sharding.index_map(&[4, 6], Mode::Strict).is_err() {
            continue;
        }
        let mut want = ReshardableVariable::new(value(), Mode::Strict);
        want.reshard(f.clone()).unwrap();
        let shards = want.shards().unwrap().to_vec();
        let got =
            ReshardableVariable::from_shards(vec![4, 6], shards.clone(), f.clone(), Mode::Strict)
                .unwrap();
        assert_eq!(got, want);
        assert_eq!(got.value().unwrap(), value());
        let err = ReshardableVariable::from_shards(
            vec![4, 6],
            shards[1..].to_vec(),
            f.clone(),
            Mode::Strict,
        )
        .unwrap_err();
        assert!(matches!(err, Error::ShardCount { .. }), "{err}");
        let mut bad = shards.clone();
        bad[0] = ArrayD::from_shape_vec(IxDyn(&[1]), vec![0]).unwrap();
        let err =
            ReshardableVariable::from_shards(vec![4, 6], bad, f.clone(), Mode::Strict).unwrap_err();
        assert!(matches!(err, Error::ShardShape { .. }), "{err}");
    }
    let whole = ReshardableVariable::from_shards(
        vec![4, 6],
        vec![value()],
        VariableFormat::Default,
        Mode::Strict,
    )
    .unwrap();
    assert_eq!(whole, ReshardableVariable::new(value(), Mode::Strict));
}
