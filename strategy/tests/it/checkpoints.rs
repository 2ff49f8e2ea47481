//! Sharded checkpoints: restore onto other meshes and layouts, refuse damaged ones.

use std::path::{Path, PathBuf};

use meshwork_strategy::{
    DeviceAssignment, Error, Layout, Strategy, Tensor, Topology, VariableOptions,
};
use ndarray::{ArrayD, IxDyn};
use proptest::prelude::*;
use proptest::strategy::Strategy as _;

/// A strategy of `replicas` x `logical` devices with three variables (f32 [4,8],
/// f64 [8], i64 [2,4]) laid out by `layouts`, filled from `seed`.
fn strategy(
    replicas: usize,
    logical: usize,
    layouts: [Layout; 3],
    seed: u64,
) -> (Strategy, Vec<Tensor>) {
    let topology = Topology::new(vec![replicas * logical], logical).unwrap();
    let s = Strategy::new(DeviceAssignment::build(&topology, &[logical], None).unwrap()).unwrap();
    let f = |i: usize| ((i as u64).wrapping_mul(seed | 1) % 1000) as f64;
    let values = vec![
        Tensor::F32(ArrayD::from_shape_fn(IxDyn(&[4, 8]), |ix| f(ix[0] * 8 + ix[1]) as f32 * 0.5)),
        Tensor::F64(ArrayD::from_shape_fn(IxDyn(&[8]), |ix| f(ix[0] + 100) * 0.25)),
        Tensor::I64(ArrayD::from_shape_fn(IxDyn(&[2, 4]), |ix| f(ix[0] * 4 + ix[1] + 200) as i64)),
    ];
    for ((name, value), layout) in ["w", "b", "step"].iter().zip(&values).zip(layouts) {
        s.create_variable(name, value.clone(), VariableOptions { layout, ..Default::default() })
            .unwrap();
    }
    (s, values)
}

fn layouts(logical: usize) -> impl proptest::strategy::Strategy<Value = [Layout; 3]> {
    let w = prop::sample::select(match logical {
        1 => vec![Layout::Replicated, Layout::Split(vec![1, 1])],
        2 => vec![
            Layout::Replicated,
            Layout::Split(vec![2, 1]),
            Layout::Split(vec![1, 2]),
            Layout::OnDevice(1),
        ],
        _ => vec![
            Layout::Replicated,
            Layout::Split(vec![4, 1]),
            Layout::Split(vec![2, 2]),
            Layout::Split(vec![1, 4]),
        ],
    });
    let b = prop::sample::select(vec![
        Layout::Replicated,
        Layout::Split(vec![logical]),
        Layout::OnDevice(logical - 1),
    ]);
    let step = prop::sample::select(vec![Layout::Replicated, Layout::OnDevice(0)]);
    (w, b, step).prop_map(|(w, b, s)| [w, b, s])
}

fn mesh() -> impl proptest::strategy::Strategy<Value = (usize, usize, [Layout; 3])> {
    (1usize..=3, prop::sample::select(vec![1usize, 2, 4]))
        .prop_flat_map(|(r, l)| (Just(r), Just(l), layouts(l)))
}

fn values(s: &Strategy) -> Vec<Tensor> {
    s.variables().iter().map(|v| s.read_variable(v).unwrap()).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    #[test]
    fn restore_onto_another_mesh_and_layout_gives_the_saved_values(
        (r1, l1, lay1) in mesh(),
        (r2, l2, lay2) in mesh(),
        seed in any::<u64>(),
    ) {
        let tmp_dir = tempfile::tempdir().unwrap();
        let dir = tmp_dir.path().to_path_buf();
        let (saved, want) = strategy(r1, l1, lay1, seed);
        saved.save_checkpoint(dir.join("ckpt")).unwrap();
        let (restored, _) = strategy(r2, l2, lay2, seed.wrapping_add(1));
        restored.restore_checkpoint(dir.join("ckpt")).unwrap();
        prop_assert_eq!(values(&restored), want);
    }

    #[test]
    fn a_checkpoint_cut_short_anywhere_is_refused_and_changes_nothing(
        (r, l, lay) in mesh(),
        file_pick in any::<prop::sample::Index>(),
        cut in any::<prop::sample::Index>(),
        seed in any::<u64>(),
    ) {
        let tmp_dir = tempfile::tempdir().unwrap();
        let dir = tmp_dir.path().to_path_buf();
        let ckpt = dir.join("ckpt");
        let (saved, _) = strategy(r, l, lay.clone(), seed);
        saved.save_checkpoint(&ckpt).unwrap();
        let mut files: Vec<PathBuf> = std::fs::read_dir(&ckpt).unwrap().map(|e| e.unwrap().path()).collect();
        files.sort();
        let victim = file_pick.get(&files).clone();
        let bytes = std::fs::read(&victim).unwrap();
        std::fs::write(&victim, &bytes[..cut.index(bytes.len())]).unwrap();
        let (target, before) = strategy(r, l, lay, seed.wrapping_add(7));
        let err = target.restore_checkpoint(&ckpt).unwrap_err();
        prop_assert!(matches!(err, Error::Checkpoint(_)), "{}", err);
        prop_assert_eq!(values(&target), before);
    }
}

fn corrupt_one_byte(path: &Path) {
    let mut bytes = std::fs::read(path).unwrap();
    let at = bytes.len() - 1;
    bytes[at] ^= 0x40;
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn damaged_or_mismatching_checkpoints_are_refused_with_what_is_wrong() {
    let tmp_dir = tempfile::tempdir().unwrap();
    let dir = tmp_dir.path().to_path_buf();
    let ckpt = dir.join("ckpt");
    let (s, _) =
        strategy(2, 2, [Layout::Split(vec![2, 1]), Layout::Replicated, Layout::Replicated], 3);
    s.save_checkpoint(&ckpt).unwrap();
    // Saving again over it is refused, and leaves it as it was: a checkpoint never
    // replaces anything.
    let before = std::fs::read(ckpt.join("index.json")).unwrap();
    let err = s.save_checkpoint(&ckpt).unwrap_err().to_string();
    assert!(err.contains("not an empty directory"), "{err}");
    assert_eq!(std::fs::read(ckpt.join("index.json")).unwrap(), before);
    let leftovers: Vec<_> =
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(leftovers, vec![std::ffi::OsString::from("ckpt")]);

    // A flipped byte in a shard file.
    let copy = dir.join("flipped");
    copy_dir(&ckpt, &copy);
    corrupt_one_byte(&copy.join("shard-0.safetensors"));
    let err = s.restore_checkpoint(&copy).unwrap_err().to_string();
    assert!(err.contains("checksum mismatch"), "{err}");

    // No index: not a complete checkpoint.
    let copy = dir.join("no-index");
    copy_dir(&ckpt, &copy);
    std::fs::remove_file(copy.join("index.json")).unwrap();
    let err = s.restore_checkpoint(&copy).unwrap_err().to_string();
    assert!(err.contains("not a complete checkpoint"), "{err}");

    // A strategy whose variable has another shape.
    let other = Strategy::data_parallel(1).unwrap();
    other
        .create_variable(
            "w",
            Tensor::F32(ArrayD::zeros(IxDyn(&[8, 4]))),
            VariableOptions::default(),
        )
        .unwrap();
    let err = other.restore_checkpoint(&ckpt).unwrap_err();
    assert!(
        matches!(&err, Error::Checkpoint(meshwork_strategy::checkpoint::Error::Mismatch { variable, .. }) if variable == "w"),
        "{err}"
    );
    assert!(err.to_string().contains("saved as f32[4,8], asked for as f32[8,4]"), "{err}");

    // A strategy with a variable the checkpoint lacks.
    let extra = Strategy::data_parallel(1).unwrap();
    extra
        .create_variable(
            "missing",
            Tensor::F32(ArrayD::zeros(IxDyn(&[1]))),
            VariableOptions::default(),
        )
        .unwrap();
    let err = extra.restore_checkpoint(&ckpt).unwrap_err().to_string();
    assert!(err.contains("variable missing: not in the checkpoint"), "{err}");
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}
