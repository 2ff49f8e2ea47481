//! The checkpoint directory: crash safety of a managed save, and refusing what is not
//! meshwork's.

use std::path::{Path, PathBuf};

use meshwork_checkpoint::{
    CheckpointManager, Error, find_checkpoint, pin_checkpoint, read_checkpoint,
};
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
    // 2 positions: the partial directory (1), 2 shard files (create, write, sync: 6),
    // the directory's sync once they are written (1), the index (3), the directory's
    // sync (1), the rename and its sync (2), the pointer (write, rename, sync: 3), one
    // pruned step (rename, remove: 2).
    assert_eq!(crashes, 19, "crash points");
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

/// A step written by several processes: each writes the files of its positions (a
/// manager [joined](CheckpointManager::join) to the lock holder's), the lock holder
/// commits the parts into one step whose index names each file's writer, and the
/// values read back whole. Parts that do not make a whole checkpoint (a region
/// missing, a position written twice) commit nothing, and the next open removes them.
#[test]
fn a_step_written_in_parts_by_several_processes_commits_once() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("ckpt");
    let mut lead = CheckpointManager::open(&root, 2).unwrap();
    let mut other = CheckpointManager::join(&root).unwrap();
    let v = value(5);
    // Rows split over 4 positions, columns whole: process q holds positions 2q, 2q+1.
    let split: HloSharding = "{devices=[4,1]0,1,2,3}".parse().unwrap();
    let whole = entry("w", &v, &split, 4);
    let mine = |q: usize| {
        let mut e = whole.clone();
        e.shards.retain(|(d, _, _)| d / 2 == q);
        e
    };
    let a = lead.write_part(7, 0, 0..2, 4, vec![mine(0)]).unwrap();
    let b = other.write_part(7, 1, 2..4, 4, vec![mine(1)]).unwrap();
    // Nothing is a step until the commit.
    assert_eq!(lead.steps().unwrap(), Vec::<usize>::new());
    // Sent as bytes, as the processes exchange them.
    let b = meshwork_checkpoint::WrittenPart::from_bytes(&b.to_bytes(), &root).unwrap();
    let step =
        lead.commit_parts(7, &serde_json::json!({ "by": 2 }), 4, vec![(1, b), (0, a)]).unwrap();
    assert_eq!(read_w(&step), v);
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(step.join("index.json")).unwrap()).unwrap();
    let ranks: Vec<u64> =
        index["files"].as_array().unwrap().iter().map(|f| f["rank"].as_u64().unwrap()).collect();
    assert_eq!(ranks, [0, 0, 1, 1]);
    let names: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".partial"))
        .collect();
    assert!(names.is_empty(), "parts left: {names:?}");

    // Process 1 writes only one of its positions: no step 8, nothing left after reopen.
    let a = lead.write_part(8, 0, 0..2, 4, vec![mine(0)]).unwrap();
    let mut half = mine(1);
    half.shards.truncate(1);
    let short = other.write_part(8, 1, 2..3, 4, vec![half]).unwrap();
    let e = lead.commit_parts(8, &serde_json::json!({}), 4, vec![(0, a), (1, short)]).unwrap_err();
    assert!(e.to_string().contains("no writer wrote"), "{e}");
    assert_eq!(lead.steps().unwrap(), vec![7]);
    // Only the lock holder commits; a joined manager refuses.
    let c = other.write_part(9, 1, 2..4, 4, vec![mine(1)]).unwrap();
    assert!(other.commit_parts(9, &serde_json::json!({}), 4, vec![(1, c)]).is_err());
    drop(lead);
    let _reopened = CheckpointManager::open(&root, 2).unwrap();
    let left: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".partial"))
        .collect();
    assert!(left.is_empty(), "debris after reopening: {left:?}");
    // A directory without the marker cannot be joined.
    let plain = dir.path().join("plain");
    std::fs::create_dir(&plain).unwrap();
    assert!(CheckpointManager::join(&plain).is_err());
}

/// A newest step whose index is damaged would wedge the directory: a run resumes from
/// the step before it, trains, then cannot save over the damaged name. Opening the
/// directory sets it aside under a name meshwork owns (never reading, writing or
/// removing it again), so the step saves.
#[test]
fn a_damaged_step_is_set_aside_when_the_directory_opens() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("ck");
    let mut m = CheckpointManager::open(&root, 3).unwrap();
    save(&mut m, 1, &value(1)).unwrap();
    save(&mut m, 2, &value(2)).unwrap();
    drop(m);
    std::fs::write(root.join("step-00000002/index.json"), b"{ damaged").unwrap();
    assert_eq!(find_checkpoint(&root).unwrap().1, Some(1));
    let mut m = CheckpointManager::open(&root, 3).unwrap();
    assert_eq!(m.set_aside().len(), 1);
    let aside = m.set_aside()[0].clone();
    assert!(aside.file_name().unwrap().to_string_lossy().starts_with(".damaged-step-00000002"));
    assert_eq!(std::fs::read(aside.join("index.json")).unwrap(), b"{ damaged");
    save(&mut m, 2, &value(3)).unwrap();
    assert_eq!(m.steps().unwrap(), vec![1, 2]);
    assert_eq!(read_w(&root.join("step-00000002")), value(3));
    drop(m);
    // Set aside once: the next open leaves it where it is.
    let m = CheckpointManager::open(&root, 3).unwrap();
    assert!(m.set_aside().is_empty());
    assert!(aside.is_dir());
}

/// A step another run is reading (pinned) is not pruned under it: the save that would
/// prune it leaves it for a later one. And a reader racing a run that saves and prunes
/// every step always gets a complete step, never "not a complete checkpoint".
#[test]
fn a_step_being_read_is_not_pruned_under_its_reader() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("ck");
    let mut m = CheckpointManager::open(&root, 1).unwrap();
    save(&mut m, 1, &value(1)).unwrap();
    let pinned = pin_checkpoint(&root).unwrap();
    assert_eq!(pinned.step, Some(1));
    save(&mut m, 2, &value(2)).unwrap();
    assert_eq!(m.steps().unwrap(), vec![1, 2], "the pinned step was pruned");
    assert_eq!(read_w(&pinned.dir), value(1));
    drop(pinned);
    save(&mut m, 3, &value(3)).unwrap();
    assert_eq!(m.steps().unwrap(), vec![3]);
    // A saver pruning as it goes, and a reader.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let saver = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut step = 4;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                save(&mut m, step, &value(step as u64)).unwrap();
                step += 1;
            }
        })
    };
    for _ in 0..200 {
        let pinned = pin_checkpoint(&root).unwrap();
        let step = pinned.step.unwrap();
        assert_eq!(read_w(&pinned.dir), value(step as u64));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    saver.join().unwrap();
}
