use super::*;

fn iota_text(dims: &[usize], reshape: &[usize], perm: &[usize]) -> String {
    TileAssignment::iota(dims.to_vec(), reshape, perm).unwrap().to_string()
}

#[test]
fn iota_forms_are_canonicalised_like_xla() {
    // Examples from XLA's CanonicalizeIotaDims comment.
    assert_eq!(iota_text(&[60], &[3, 4, 5], &[0, 1, 2]), "[60]<=[60]");
    assert_eq!(iota_text(&[60], &[3, 4, 5], &[2, 1, 0]), "[60]<=[3,4,5]T(2,1,0)");
    assert_eq!(iota_text(&[60], &[3, 4, 5], &[1, 2, 0]), "[60]<=[3,20]T(1,0)");
    assert_eq!(iota_text(&[60], &[3, 4, 5], &[1, 0, 2]), "[60]<=[3,4,5]T(1,0,2)");
    assert_eq!(iota_text(&[60], &[3, 4, 5], &[2, 0, 1]), "[60]<=[12,5]T(1,0)");
    assert_eq!(iota_text(&[60], &[1, 3, 1, 4, 1, 5], &[4, 3, 2, 5, 1, 0]), "[60]<=[3,20]T(1,0)");
    // From the sharding notes: <=[2,2,2]T(2,0,1) prints as <=[4,2]T(1,0).
    assert_eq!(iota_text(&[8], &[2, 2, 2], &[2, 0, 1]), "[8]<=[4,2]T(1,0)");
    assert_eq!(iota_text(&[1, 1], &[1, 1, 1], &[2, 0, 1]), "[1,1]<=[1]");
}

#[test]
fn detect_finds_only_iotas() {
    assert_eq!(Iota::detect(&[0, 2, 1, 3]).unwrap().to_string(), "<=[2,2]T(1,0)");
    assert_eq!(Iota::detect(&[0, 1, 2, 3]).unwrap().to_string(), "<=[4]");
    // Not iotas: not starting at 0, uneven runs, strides that are no mixed radix.
    assert_eq!(Iota::detect(&[1, 0]), None);
    assert_eq!(Iota::detect(&[0, 1, 3, 2]), None);
    assert_eq!(Iota::detect(&[0, 2, 4, 1, 3, 5]).unwrap().to_string(), "<=[3,2]T(1,0)");
    assert_eq!(Iota::detect(&[0, 3, 1, 4, 2, 5]).unwrap().to_string(), "<=[2,3]T(1,0)");
    assert_eq!(Iota::detect(&[0, 1, 3, 2, 4, 5]), None);
}

#[test]
fn bad_assignments_are_errors() {
    assert_eq!(
        TileAssignment::explicit(vec![2, 2], vec![0, 1, 2]),
        Err(Error::TileCount { dims: vec![2, 2], expected: 4, actual: 3 })
    );
    assert_eq!(
        TileAssignment::explicit(vec![3], vec![0, 1, 1]),
        Err(Error::NotAPermutation { devices: vec![0, 1, 1] })
    );
    assert_eq!(
        TileAssignment::explicit(vec![2], vec![0, 2]),
        Err(Error::NotAPermutation { devices: vec![0, 2] })
    );
    assert_eq!(TileAssignment::identity(vec![2, 0]), Err(Error::BadTileDims { dims: vec![2, 0] }));
    assert_eq!(TileAssignment::identity(vec![]), Err(Error::BadTileDims { dims: vec![] }));
    assert_eq!(
        TileAssignment::identity(vec![usize::MAX, 2]),
        Err(Error::BadTileDims { dims: vec![usize::MAX, 2] })
    );
    // Assignments are materialised: their size is bounded before any allocation.
    assert_eq!(
        TileAssignment::identity(vec![MAX_TILES + 1]),
        Err(Error::BadTileDims { dims: vec![MAX_TILES + 1] })
    );
    assert_eq!(
        TileAssignment::iota(vec![2], &[1 << 40, 1 << 40], &[0, 1]),
        Err(Error::BadTileDims { dims: vec![1 << 40, 1 << 40] })
    );
    assert_eq!(
        TileAssignment::iota(vec![4], &[2, 2], &[0, 0]),
        Err(Error::BadTranspose { perm: vec![0, 0], rank: 2 })
    );
    assert_eq!(
        TileAssignment::iota(vec![4], &[2, 3], &[0, 1]),
        Err(Error::TileCount { dims: vec![4], expected: 4, actual: 6 })
    );
}
