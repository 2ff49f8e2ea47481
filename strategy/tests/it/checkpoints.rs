//! Sharded checkpoints: restore onto other meshes and layouts, refuse damaged ones.

use std::path::{Path, PathBuf};

use meshwork_strategy::{
    CheckpointManager, DeviceAssignment, Error, Layout, Strategy, Tensor, Topology,
    VariableOptions, find_checkpoint,
};
use ndarray::{ArrayD, IxDyn};
use proptest::prelude::*;
use proptest::strategy::Strategy as _;

fn temp_dir(tag: &str) -> PathBuf {
    let stamp =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    let dir =
        std::env::temp_dir().join(format!("meshwork-ckpt-{tag}-{}-{stamp}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

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
        let dir = temp_dir("mesh");
        let (saved, want) = strategy(r1, l1, lay1, seed);
        saved.save_checkpoint(dir.join("ckpt")).unwrap();
        let (restored, _) = strategy(r2, l2, lay2, seed.wrapping_add(1));
        restored.restore_checkpoint(dir.join("ckpt")).unwrap();
        prop_assert_eq!(values(&restored), want);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_checkpoint_cut_short_anywhere_is_refused_and_changes_nothing(
        (r, l, lay) in mesh(),
        file_pick in any::<prop::sample::Index>(),
        cut in any::<prop::sample::Index>(),
        seed in any::<u64>(),
    ) {
        let dir = temp_dir("cut");
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
        prop_assert!(matches!(err, Error::Checkpoint { .. }), "{}", err);
        prop_assert_eq!(values(&target), before);
        std::fs::remove_dir_all(&dir).unwrap();
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
    let dir = temp_dir("bad");
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
    assert!(matches!(&err, Error::CheckpointMismatch { variable, .. } if variable == "w"), "{err}");
    assert!(err.to_string().contains("saved as f32[4,8], the strategy has f32[8,4]"), "{err}");

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
    std::fs::remove_dir_all(&dir).unwrap();
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// Every entry of `dir`, recursively, with its bytes (directories as `None`).
fn snapshot(dir: &Path) -> Vec<(PathBuf, Option<Vec<u8>>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                out.push((p.clone(), None));
                stack.push(p);
            } else {
                out.push((p.clone(), Some(std::fs::read(&p).unwrap())));
            }
        }
    }
    out.sort();
    out
}

/// Copies `from` to `to` recursively.
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let target = to.join(e.file_name());
        if e.path().is_dir() {
            copy_tree(&e.path(), &target);
        } else {
            std::fs::copy(e.path(), target).unwrap();
        }
    }
}

/// A crash (no clean-up, as `kill -9`) after every single file-system operation of a
/// save — creating the partial directory, creating, writing and syncing each shard
/// file and the index, the rename into `step-…`, the `latest` pointer's write, rename
/// and sync, and each pruned step's rename and removal — always leaves a directory
/// that the next run opens (removing the debris) and from which resume restores a
/// complete checkpoint: the old step with the old values before the new step's rename,
/// the new step with the new values after it.
#[test]
fn a_crash_after_any_file_operation_of_a_save_leaves_a_complete_checkpoint_to_resume() {
    let dir = temp_dir("crash");
    let base = dir.join("base");
    let (s, old) =
        strategy(2, 2, [Layout::Split(vec![2, 1]), Layout::Split(vec![2]), Layout::Replicated], 3);
    {
        let mut m = CheckpointManager::open(&base, 1).unwrap();
        m.save(&s, 5, &serde_json::json!({ "step": 5 })).unwrap();
    }
    // New values for the next save.
    let (fresh, new) =
        strategy(2, 2, [Layout::Split(vec![2, 1]), Layout::Split(vec![2]), Layout::Replicated], 11);
    let mut crashes = 0;
    for k in 0.. {
        let work = dir.join(format!("work-{k}"));
        copy_tree(&base, &work);
        let result = {
            let mut m = CheckpointManager::open(&work, 1).unwrap();
            m.crash_after(k);
            m.save(&fresh, 10, &serde_json::json!({ "step": 10 }))
        };
        // The next run: opening cleans up, resume finds a complete checkpoint.
        let m = CheckpointManager::open(&work, 1).unwrap();
        let debris: Vec<_> = std::fs::read_dir(&work)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(".partial-") || n.starts_with(".tmp-"))
            .collect();
        assert!(debris.is_empty(), "crash after {k} operations left {debris:?}");
        let (ckpt, step) = find_checkpoint(&work).unwrap();
        let (target, _) =
            strategy(1, 2, [Layout::Replicated, Layout::Replicated, Layout::OnDevice(1)], 99);
        target.restore_checkpoint(&ckpt).unwrap();
        match step {
            Some(5) => assert_eq!(values(&target), old, "crash after {k} operations"),
            Some(10) => assert_eq!(values(&target), new, "crash after {k} operations"),
            other => panic!("crash after {k} operations: resume found step {other:?}"),
        }
        assert_eq!(m.latest().unwrap().map(|(s, _)| Some(s)), Some(step));
        match result {
            Ok(_) => {
                assert_eq!(step, Some(10));
                // keep = 1: the old step is gone, and nothing else is there.
                assert_eq!(m.steps().unwrap(), vec![10]);
                break;
            }
            Err(e) => {
                assert!(e.to_string().contains("simulated crash"), "{e}");
                crashes += 1;
            }
        }
    }
    // 2 logical devices: the partial directory (1), 2 shard files and the index
    // (create, write, sync: 9), the directory's sync (1), the rename and its sync (2),
    // the pointer (write, rename, sync: 3), one pruned step (rename, remove: 2).
    assert_eq!(crashes, 18, "crash points");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The checkpoint directory is meshwork's or refused: a regular file, a symbolic link,
/// a device, a non-empty directory without the marker are refused and left exactly
/// as they were; an absent path is created, an empty directory is taken; a second
/// manager on a locked directory is refused; older steps are pruned but a user's file
/// in the directory is never touched; an existing step is never overwritten.
#[test]
fn the_checkpoint_directory_is_meshworks_or_refused_untouched() {
    let dir = temp_dir("owned");
    let (s, _) = strategy(1, 1, [Layout::Replicated, Layout::Replicated, Layout::Replicated], 1);
    let file = dir.join("notes.txt");
    std::fs::write(&file, "x").unwrap();
    let foreign = dir.join("proj");
    std::fs::create_dir(&foreign).unwrap();
    std::fs::write(foreign.join("notes.txt"), "mine").unwrap();
    let link = dir.join("link");
    std::os::unix::fs::symlink(&foreign, &link).unwrap();
    let before = snapshot(&dir);
    for (path, says) in [
        (file.clone(), "a regular file"),
        (link.clone(), "a symbolic link"),
        (foreign.clone(), "is not empty"),
        (PathBuf::from("/dev/null"), "a device"),
        (dir.join("no/such/parent"), "cannot create it"),
    ] {
        let err = CheckpointManager::open(&path, 3).unwrap_err();
        assert!(matches!(err, Error::CheckpointDir { .. }), "{err}");
        assert!(err.to_string().contains(says), "{path:?}: {err}");
    }
    assert_eq!(snapshot(&dir), before, "a refused directory was changed");
    assert!(std::fs::symlink_metadata("/dev/null").unwrap().file_type().is_char_device_like());

    // A directory holding only the marker a killed open was writing is taken, and the
    // debris removed.
    let half = dir.join("half");
    std::fs::create_dir(&half).unwrap();
    std::fs::write(half.join(".tmp-meshwork-checkpoints.json-4242"), "{").unwrap();
    drop(CheckpointManager::open(&half, 2).unwrap());
    assert!(!half.join(".tmp-meshwork-checkpoints.json-4242").exists());
    // Absent: created. Empty: taken.
    let made = dir.join("made");
    let mut m = CheckpointManager::open(&made, 2).unwrap();
    let empty = dir.join("empty");
    std::fs::create_dir(&empty).unwrap();
    drop(CheckpointManager::open(&empty, 2).unwrap());
    // Locked while open.
    let err = CheckpointManager::open(&made, 2).unwrap_err().to_string();
    assert!(err.contains("another meshwork run"), "{err}");
    // A user's file inside survives pruning; steps are kept newest-first.
    std::fs::write(made.join("README"), "mine").unwrap();
    for step in [1, 2, 3] {
        m.save(&s, step, &serde_json::json!({})).unwrap();
    }
    assert_eq!(m.steps().unwrap(), vec![2, 3]);
    assert_eq!(std::fs::read_to_string(made.join("README")).unwrap(), "mine");
    assert_eq!(std::fs::read_to_string(made.join("latest")).unwrap(), "step-00000003\n");
    let err = m.save(&s, 3, &serde_json::json!({})).unwrap_err().to_string();
    assert!(err.contains("already exists"), "{err}");
    drop(m);
    // Reopened later: accepted as meshwork's, and resume finds the newest step; names
    // like meshwork's temporaries that meshwork did not make stay.
    std::fs::create_dir(made.join(".partial-mine")).unwrap();
    std::fs::write(made.join(".tmp-notes"), "mine").unwrap();
    let m = CheckpointManager::open(&made, 2).unwrap();
    assert!(made.join(".partial-mine").is_dir() && made.join(".tmp-notes").is_file());
    assert_eq!(find_checkpoint(&made).unwrap().1, Some(3));
    assert_eq!(find_checkpoint(made.join("step-00000002")).unwrap().1, Some(2));
    drop(m);
    std::fs::remove_dir_all(&dir).unwrap();
}

trait CharDeviceLike {
    fn is_char_device_like(&self) -> bool;
}

impl CharDeviceLike for std::fs::FileType {
    fn is_char_device_like(&self) -> bool {
        use std::os::unix::fs::FileTypeExt;
        self.is_char_device()
    }
}

/// `write_checkpoint` writes shards a caller holds (uneven ones in XLA's padded layout,
/// the empty trailing region left out) and `read_checkpoint` reads them back whole; a
/// shard off its sharding's region, device or dtype is refused before anything is
/// written.
#[test]
fn shards_a_caller_holds_write_and_read_back_and_bad_ones_are_refused() {
    use meshwork_strategy::sharding::{Mesh, Mode, NamedSharding};
    use meshwork_strategy::types::DType;
    use meshwork_strategy::{CheckpointEntry, read_checkpoint, write_checkpoint};

    let dir = temp_dir("entries");
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
    write_checkpoint(dir.join("ok"), 4, vec![entry(shards.clone())], None).unwrap();
    let back = read_checkpoint(dir.join("ok"), &[("w".into(), DType::F64, vec![5, 3])]).unwrap();
    assert_eq!(back, vec![Tensor::F64(whole.clone())]);
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
    let _ = std::fs::remove_dir_all(dir);
}
