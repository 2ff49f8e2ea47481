use super::*;
use crate::Error;

/// Parses `input` and prints it back (or the error).
fn check(input: &str, expected: &str) {
    let actual = match input.parse::<HloSharding>() {
        Ok(h) => h.to_string(),
        Err(e) => format!("error: {e}"),
    };
    assert_eq!(actual, expected, "input: {input}");
}

#[test]
fn canonical_forms() {
    check("{replicated}", "{replicated}");
    check("{ maximal  device=3 }", "{maximal device=3}");
    check("{devices=[2,2]<=[4]}", "{devices=[2,2]<=[4]}");
    // Iota canonicalisation.
    check("{devices=[16]<=[8,1,2,1,1]T(2,3,4,0,1)}", "{devices=[16]<=[8,2]T(1,0)}");
    // PartialTile sorts each replication group of an explicit list.
    check(
        "{devices=[2,2]3,1,0,2 last_tile_dim_replicate}",
        "{devices=[2,2]1,3,0,2 last_tile_dim_replicate}",
    );
    // A lone replicated subgroup becomes last_tile_dim_replicate; trivial ones vanish.
    check(
        "{devices=[2,2]<=[4] last_tile_dims={replicated}}",
        "{devices=[2,2]<=[4] last_tile_dim_replicate}",
    );
    check("{devices=[2,1]<=[2] last_tile_dim_replicate}", "{devices=[2]<=[2]}");
    check("{devices=[1,4]<=[4] last_tile_dim_replicate}", "{replicated}");
    // Subgroups sort manual, unreduced, replicated.
    check(
        "{devices=[2,2,2]<=[8] last_tile_dims={replicated, unreduced}}",
        "{devices=[2,2,2]<=[2,2,2]T(0,2,1) last_tile_dims={unreduced, replicated}}",
    );
    check("{devices=[1,5]<=[5,1,1]T(1,2,0) last_tile_dims={manual}}", "{manual}");
    // Tuples, with XLA's index comments every fifth leaf.
    check(
        "{{replicated}, {devices=[2]<=[2]}, {maximal device=0}}",
        "{{replicated}, {devices=[2]<=[2]}, {maximal device=0}}",
    );
    check(
        "{{manual},{manual},{manual},{manual},{manual},{manual}}",
        "{{manual}, {manual}, {manual}, {manual}, {manual}, /*index=5*/{manual}}",
    );
    check("{}", "{}");
}

#[test]
fn parse_errors_give_the_position() {
    // XLA requires T(...) after a multi-dim reshape.
    check(
        "{devices=[2,2]<=[2,2]}",
        "error: cannot parse `{devices=[2,2]<=[2,2]}` at byte 21: expected T(",
    );
    check(
        "{devices=[2,2]0,1,2}",
        "error: cannot parse `{devices=[2,2]0,1,2}` at byte 9: expected tile dims whose product equals the number of devices",
    );
    check(
        "{devices=[2]0,0}",
        "error: cannot parse `{devices=[2]0,0}` at byte 9: expected a device list that is a permutation of 0..n",
    );
    check(
        "{tiled}",
        "error: cannot parse `{tiled}` at byte 1: expected `replicated`, `manual`, `unreduced`, `maximal` or `devices=`",
    );
    check("{replicated", "error: cannot parse `{replicated` at byte 11: expected }");
    check(
        "{replicated} x",
        "error: cannot parse `{replicated} x` at byte 13: expected end of input",
    );
    check(
        "{devices=[2]<=[2] last_tile_dims={sideways}}",
        "error: cannot parse `{devices=[2]<=[2] last_tile_dims={sideways}}` at byte 34: expected `manual`, `unreduced` or `replicated`",
    );
    check(
        "{devices=[2]0,1 last_tile_dims={manual, manual}}",
        "error: cannot parse `{devices=[2]0,1 last_tile_dims={manual, manual}}` at byte 9: expected no more subgroup types than tile dims",
    );
    check(
        "{devices=[99999999999999999999]0}",
        "error: cannot parse `{devices=[99999999999999999999]0}` at byte 10: expected an integer that fits in a usize",
    );
}

#[test]
fn leaves_and_replicas() {
    let tuple: HloSharding =
        "{{replicated}, {devices=[2,2]<=[4] last_tile_dim_replicate}}".parse().unwrap();
    assert_eq!(tuple.leaves().len(), 2);
    assert_eq!(tuple.leaf(2), Err(Error::NoSuchLeaf { index: 2, leaves: 2 }));
    let HloSharding::Tiled(tiled) = tuple.leaf(1).unwrap() else { panic!("tiled leaf") };
    assert_eq!((tiled.data_dims(), tiled.num_replicas()), (&[2][..], 2));
    assert!(!tuple.is_replicated());
}
