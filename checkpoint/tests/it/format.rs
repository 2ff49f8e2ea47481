//! The format: what is written reads back, what is damaged is refused.

use meshwork_checkpoint::{
    CheckpointEntry, Error, checkpoint_metadata, checkpoint_variables, read_checkpoint,
    read_checkpoint_parts, write_checkpoint,
};
use meshwork_sharding::{HloSharding, Mesh, Mode, NamedSharding};
use meshwork_types::{DType, Tensor};
use ndarray::{ArrayD, IxDyn};
use proptest::prelude::*;

use crate::{entry, value};

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// A value saved under any sharding of its dims over 1–8 positions reads back
    /// whole, bit for bit (an oracle independent of the format: the value itself).
    #[test]
    fn prop_any_sharding_reads_back_whole(
        named in meshwork_sharding::testing::named_sharding(2),
        seed in any::<u64>(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let devices = named.mesh().size();
        let Ok(sharding) = named.to_sharding(2) else { return Ok(()) };
        let hlo = sharding.hlo().clone();
        let v = value(seed);
        // Shardings whose tiles do not divide [4, 6] are not this test's.
        if sharding.index_map(&[4, 6], Mode::Strict).is_err() {
            return Ok(());
        }
        let ckpt = dir.path().join("c");
        write_checkpoint(&ckpt, devices, vec![entry("w", &v, &hlo, devices)], None)?;
        let back = read_checkpoint(&ckpt, &[("w".into(), DType::F64, vec![4, 6])])?;
        prop_assert_eq!(&back[0], &v);
        prop_assert_eq!(checkpoint_variables(&ckpt)?, vec![("w".to_string(), DType::F64, vec![4, 6])]);
    }

    /// Any box of a value saved under any sharding reads back as that box of the
    /// value, reading only the shards it overlaps (the oracle: the value, sliced).
    #[test]
    fn prop_any_box_reads_back_as_the_values_slice(
        named in meshwork_sharding::testing::named_sharding(2),
        seed in any::<u64>(),
        rows in (0usize..4).prop_flat_map(|a| (Just(a), a + 1..=4)),
        cols in (0usize..6).prop_flat_map(|a| (Just(a), a + 1..=6)),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let devices = named.mesh().size();
        let Ok(sharding) = named.to_sharding(2) else { return Ok(()) };
        if sharding.index_map(&[4, 6], Mode::Strict).is_err() {
            return Ok(());
        }
        let v = value(seed);
        let ckpt = dir.path().join("c");
        write_checkpoint(&ckpt, devices, vec![entry("w", &v, sharding.hlo(), devices)], None)?;
        let b = vec![rows.0..rows.1, cols.0..cols.1];
        let got = read_checkpoint_parts(
            &ckpt,
            &[("w".into(), DType::F64, vec![4, 6])],
            &[vec![b.clone(), vec![0..4, 0..6]]],
        )?;
        let whole = v.as_array::<f64>().unwrap();
        let want = whole.slice(ndarray::s![rows.0..rows.1, cols.0..cols.1]).to_owned().into_dyn();
        prop_assert_eq!(&got[0][0], &Tensor::F64(want));
        prop_assert_eq!(&got[0][1], &v);
    }
}

/// A box read alone still checks what it reads: a damaged shard's checksum, a file
/// cut short, a box outside the value, a variable of another shape.
#[test]
fn a_box_read_alone_refuses_damage() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("c");
    let split: HloSharding = "{devices=[2,1]0,1}".parse().unwrap();
    let v = value(9);
    write_checkpoint(&ckpt, 2, vec![entry("w", &v, &split, 2)], None).unwrap();
    let want = [("w".to_string(), DType::F64, vec![4, 6])];
    // Rows 0..2 live in shard-0; damaging shard-1 does not stop reading them.
    let file = ckpt.join("shard-1.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&file, &bytes).unwrap();
    let top = read_checkpoint_parts(&ckpt, &want, &[vec![vec![0..2, 0..6]]]).unwrap();
    assert_eq!(top[0][0].shape(), &[2, 6]);
    let e = read_checkpoint_parts(&ckpt, &want, &[vec![vec![1..3, 0..6]]]).unwrap_err();
    assert!(e.to_string().contains("checksum mismatch"), "{e}");
    // A box past the value, another shape, then a file cut short (refused before any
    // read: every file's size is checked first).
    let e = read_checkpoint_parts(&ckpt, &want, &[vec![vec![0..5, 0..6]]]).unwrap_err();
    assert!(e.to_string().contains("box"), "{e}");
    let other = [("w".to_string(), DType::F64, vec![6, 4])];
    assert!(matches!(read_checkpoint_parts(&ckpt, &other, &[vec![]]), Err(Error::Mismatch { .. })));
    bytes.pop();
    std::fs::write(&file, &bytes).unwrap();
    let e = read_checkpoint_parts(&ckpt, &want, &[vec![vec![0..2, 0..6]]]).unwrap_err();
    assert!(e.to_string().contains("cut short"), "{e}");
}

/// Shards a caller holds (uneven ones in XLA's padded layout, the empty trailing
/// region left out) write and read back whole; a shard off its sharding's region,
/// device or dtype is refused before anything is written.
#[test]
fn shards_a_caller_holds_write_and_read_back_and_bad_ones_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let whole = ArrayD::from_shape_vec(IxDyn(&[5, 3]), (0..15).map(f64::from).collect()).unwrap();
    let named =
        NamedSharding::new(Mesh::iota(&[("x", 4)]).unwrap(), "P('x')".parse().unwrap()).unwrap();
    let sharding = named.to_sharding(2).unwrap();
    let regions: Vec<_> = sharding
        .index_map(&[5, 3], Mode::Uneven)
        .unwrap()
        .into_iter()
        .map(|i| i.ranges)
        .filter(|r| r.iter().all(|x| !x.is_empty()))
        .collect();
    assert_eq!(regions.len(), 3, "rows 2, 2, 1 and an empty fourth");
    let shards: Vec<_> = regions
        .iter()
        .enumerate()
        .map(|(d, r)| {
            let part = whole.slice(ndarray::s![r[0].clone(), r[1].clone()]).to_owned().into_dyn();
            (d, r.clone(), Tensor::F64(part))
        })
        .collect();
    let entry = |shards: Vec<(usize, Vec<std::ops::Range<usize>>, Tensor)>| CheckpointEntry {
        name: "w".into(),
        dtype: DType::F64,
        shape: vec![5, 3],
        hlo: sharding.hlo().clone(),
        shards,
    };
    let meta = serde_json::json!({"run": "test"});
    write_checkpoint(dir.join("ok"), 4, vec![entry(shards.clone())], Some(&meta)).unwrap();
    let back = read_checkpoint(dir.join("ok"), &[("w".into(), DType::F64, vec![5, 3])]).unwrap();
    assert_eq!(back, vec![Tensor::F64(whole.clone())]);
    assert_eq!(checkpoint_metadata(dir.join("ok")).unwrap(), Some(meta));
    let mut off_device = shards.clone();
    off_device[2].0 = 4;
    let mut off_region = shards.clone();
    off_region[1].1 = vec![1..3, 0..3];
    let mut off_dtype = shards.clone();
    off_dtype[0].2 = Tensor::F32(ArrayD::zeros(IxDyn(&[2, 3])));
    for (k, bad) in
        [off_device, off_region, off_dtype, shards[..2].to_vec()].into_iter().enumerate()
    {
        let at = dir.join(format!("bad{k}"));
        assert!(write_checkpoint(&at, 4, vec![entry(bad)], None).is_err(), "case {k}");
        assert!(!at.exists(), "case {k}: nothing written");
    }
}

/// What a reader asks for that the checkpoint does not hold, or holds as another
/// dtype or shape, is a typed error naming the variable; a flipped byte or a missing
/// index is refused; saving over a checkpoint is refused and changes nothing.
#[test]
fn damaged_or_mismatching_checkpoints_are_refused_with_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("c");
    let split: HloSharding = "{devices=[2,1]0,1}".parse().unwrap();
    write_checkpoint(&ckpt, 2, vec![entry("w", &value(3), &split, 2)], None).unwrap();
    let before = std::fs::read(ckpt.join("index.json")).unwrap();
    let again = write_checkpoint(&ckpt, 2, vec![entry("w", &value(4), &split, 2)], None);
    assert!(again.unwrap_err().to_string().contains("not an empty directory"));
    assert_eq!(std::fs::read(ckpt.join("index.json")).unwrap(), before);

    let err = read_checkpoint(&ckpt, &[("w".into(), DType::F32, vec![4, 6])]).unwrap_err();
    assert!(matches!(&err, Error::Mismatch { variable, .. } if variable == "w"), "{err}");
    assert!(err.to_string().contains("saved as f64[4,6], asked for as f32[4,6]"), "{err}");
    let err = read_checkpoint(&ckpt, &[("v".into(), DType::F64, vec![4, 6])]).unwrap_err();
    assert!(matches!(&err, Error::Missing { variable, .. } if variable == "v"), "{err}");

    let flipped = dir.path().join("flipped");
    std::fs::create_dir(&flipped).unwrap();
    for e in std::fs::read_dir(&ckpt).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), flipped.join(e.file_name())).unwrap();
    }
    let shard = flipped.join("shard-1.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&shard, bytes).unwrap();
    let err = read_checkpoint(&flipped, &[("w".into(), DType::F64, vec![4, 6])]).unwrap_err();
    assert!(err.to_string().contains("checksum mismatch"), "{err}");
    std::fs::remove_file(flipped.join("index.json")).unwrap();
    let err = read_checkpoint(&flipped, &[("w".into(), DType::F64, vec![4, 6])]).unwrap_err();
    assert!(err.to_string().contains("not a complete checkpoint"), "{err}");
}

/// An index's count of device positions sizes nothing before it is checked: a count
/// past 32 bits (which an `as u32` would have truncated to a small, valid-looking one),
/// or one that is not its number of shard files, is refused.
#[test]
fn an_index_whose_device_count_is_not_its_files_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("c");
    let split: HloSharding = "{devices=[2,1]0,1}".parse().unwrap();
    write_checkpoint(&ckpt, 2, vec![entry("w", &value(3), &split, 2)], None).unwrap();
    let index_path = ckpt.join("index.json");
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&index_path).unwrap()).unwrap();
    for devices in [(1u64 << 32) + 2, 4_000_000_000, 3, 0] {
        let mut bad = index.clone();
        bad["logical_devices"] = devices.into();
        std::fs::write(&index_path, serde_json::to_vec(&bad).unwrap()).unwrap();
        let err = read_checkpoint(&ckpt, &[("w".into(), DType::F64, vec![4, 6])]).unwrap_err();
        assert!(err.to_string().contains("device positions"), "{devices}: {err}");
    }
}
