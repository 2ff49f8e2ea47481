//! The checkpoint directory: crash safety of a managed save, and refusing what is not
//! meshwork's.

use std::path::{Path, PathBuf};

use meshwork_checkpoint::{CheckpointManager, Error, find_checkpoint, read_checkpoint};
use meshwork_sharding::HloSharding;
use meshwork_types::{DType, Tensor};

use crate::{entry, snapshot, value};

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

/// Saves `value` (as `w` split over 2 positions) as step `step` of `m`.
fn save(m: &mut CheckpointManager, step: usize, value: &Tensor) -> Result<PathBuf, Error> {
    let split: HloSharding = "{devices=[2,1]0,1}".parse().unwrap();
    m.save(step, &serde_json::json!({ "step": step }), 2, vec![entry("w", value, &split, 2)])
}

fn read_w(dir: &Path) -> Tensor {
    read_checkpoint(dir, &[("w".into(), DType::F64, vec![4, 6])]).unwrap().remove(0)
}

/// A crash (no clean-up, as `kill -9`) after every single file-system operation of a
/// save — creating the partial directory, creating, writing and syncing each shard
/// file and the index, the rename into `step-…`, the `latest` pointer's write, rename
/// and sync, and each pruned step's rename and removal — always leaves a directory
/// that the next run opens (removing the debris) and from which resume reads a
/// complete checkpoint: the old step with the old values before the new step's rename,
/// the new step with the new values after it.
#[test]
fn a_crash_after_any_file_operation_of_a_save_leaves_a_complete_checkpoint_to_resume() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base");
    let (old, new) = (value(3), value(11));
    {
        let mut m = CheckpointManager::open(&base, 1).unwrap();
        save(&mut m, 5, &old).unwrap();
    }
    let mut crashes = 0;
    for k in 0.. {
        let work = dir.path().join(format!("work-{k}"));
        copy_tree(&base, &work);
        let result = {
            let mut m = CheckpointManager::open(&work, 1).unwrap();
            m.crash_after(k);
            save(&mut m, 10, &new)
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
        match step {
            Some(5) => assert_eq!(read_w(&ckpt), old, "crash after {k} operations"),
            Some(10) => assert_eq!(read_w(&ckpt), new, "crash after {k} operations"),
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
    // 2 positions: the partial directory (1), 2 shard files and the index (create,
    // write, sync: 9), the directory's sync (1), the rename and its sync (2), the
    // pointer (write, rename, sync: 3), one pruned step (rename, remove: 2).
    assert_eq!(crashes, 18, "crash points");
}

/// The checkpoint directory is meshwork's or refused: a regular file, a symbolic link,
/// a device, a non-empty directory without the marker are refused and left exactly
/// as they were; an absent path is created, an empty directory is taken; a second
/// manager on a locked directory is refused; older steps are pruned but a user's file
/// in the directory is never touched; an existing step is never overwritten.
#[test]
fn the_checkpoint_directory_is_meshworks_or_refused_untouched() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let v = value(1);
    let file = dir.join("notes.txt");
    std::fs::write(&file, "x").unwrap();
    let foreign = dir.join("proj");
    std::fs::create_dir(&foreign).unwrap();
    std::fs::write(foreign.join("notes.txt"), "mine").unwrap();
    let link = dir.join("link");
    std::os::unix::fs::symlink(&foreign, &link).unwrap();
    let before = snapshot(dir);
    for (path, says) in [
        (file.clone(), "a regular file"),
        (link.clone(), "a symbolic link"),
        (foreign.clone(), "is not empty"),
        (PathBuf::from("/dev/null"), "a device"),
        (dir.join("no/such/parent"), "cannot create it"),
    ] {
        let err = CheckpointManager::open(&path, 3).unwrap_err();
        assert!(matches!(err, Error::Directory { .. }), "{err}");
        assert!(err.to_string().contains(says), "{path:?}: {err}");
    }
    assert_eq!(snapshot(dir), before, "a refused directory was changed");
    {
        use std::os::unix::fs::FileTypeExt;
        assert!(std::fs::symlink_metadata("/dev/null").unwrap().file_type().is_char_device());
    }

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
        save(&mut m, step, &v).unwrap();
    }
    assert_eq!(m.steps().unwrap(), vec![2, 3]);
    assert_eq!(std::fs::read_to_string(made.join("README")).unwrap(), "mine");
    assert_eq!(std::fs::read_to_string(made.join("latest")).unwrap(), "step-00000003\n");
    let err = save(&mut m, 3, &v).unwrap_err().to_string();
    assert!(err.contains("already exists"), "{err}");
    // Entries a reader could not read are refused before anything is written.
    let split: HloSharding = "{devices=[2,1]0,1}".parse().unwrap();
    let mut bad = entry("w", &v, &split, 2);
    bad.shards.pop();
    assert!(m.save(4, &serde_json::json!({}), 2, vec![bad]).is_err());
    assert_eq!(m.steps().unwrap(), vec![2, 3]);
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
}

/// What is put in the place of the directory's own files — a FIFO or a link as its lock
/// file, a link as a temporary name — is refused, never waited on or written through.
#[test]
fn a_fifo_or_link_in_place_of_the_lock_file_is_refused_without_waiting() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("ck");
    drop(CheckpointManager::open(&root, 3).unwrap());
    std::fs::remove_file(root.join(".lock")).unwrap();
    let made = std::process::Command::new("mkfifo").arg(root.join(".lock")).status().unwrap();
    assert!(made.success());
    let (tx, rx) = std::sync::mpsc::channel();
    let at = root.clone();
    std::thread::spawn(move || {
        let _ = tx.send(CheckpointManager::open(&at, 3).map(|_| ()).map_err(|e| e.to_string()));
    });
    let got = rx.recv_timeout(std::time::Duration::from_secs(10)).expect("refused, not waiting");
    let e = got.unwrap_err();
    assert!(e.contains("lock file") && e.contains("a named pipe"), "{e}");
    // A link as the lock file: not followed (the file it names stays as it was).
    std::fs::remove_file(root.join(".lock")).unwrap();
    let theirs = tmp.path().join("theirs.txt");
    std::fs::write(&theirs, "a user's file").unwrap();
    std::os::unix::fs::symlink(&theirs, root.join(".lock")).unwrap();
    assert!(CheckpointManager::open(&root, 3).is_err());
    assert_eq!(std::fs::read_to_string(&theirs).unwrap(), "a user's file");
}
