//! Inputs refused without waiting, outputs written whole with their directory synced,
//! temporary names never shared and cleaned after a kill.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use super::*;

/// A named pipe at `dir/name`, made by `mkfifo`.
pub(crate) fn fifo(dir: &Path, name: &str) -> PathBuf {
    let path = dir.join(name);
    let made = Command::new("mkfifo").arg(&path).status().expect("mkfifo runs");
    assert!(made.success(), "mkfifo {}", path.display());
    path
}

/// Runs `f` on another thread and fails the test, instead of hanging it, when `f`
/// does not return within 10 s.
pub(crate) fn within_10s<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(10)).expect("returned instead of waiting for a writer")
}

/// A named pipe with no writer is refused at once, naming the input and what it is:
/// an ordinary open would wait for a writer for ever.
#[test]
fn a_named_pipe_is_refused_without_waiting() {
    let dir = tempfile::tempdir().unwrap();
    let path = fifo(dir.path(), "pipe");
    let t = Instant::now();
    let err = within_10s(move || read_input("--text", &path, 1 << 20).unwrap_err());
    let text = err.to_string();
    assert!(text.starts_with("--text: cannot read"), "{text}");
    assert!(text.contains("a named pipe, not a regular file"), "{text}");
    assert!(t.elapsed() < Duration::from_secs(5));
}

/// A directory, a missing file and a file over the limit are refused, each saying
/// which; a file within it is read whole.
#[test]
fn inputs_are_read_whole_within_their_limit() {
    let dir = tempfile::tempdir().unwrap();
    let err = read_input("--init", dir.path(), 100).unwrap_err().to_string();
    assert!(err.contains("a directory, not a regular file"), "{err}");
    let missing = dir.path().join("missing");
    assert!(read_input("--init", &missing, 100).unwrap_err().0.starts_with("--init: cannot read"));
    let file = dir.path().join("f");
    std::fs::write(&file, [7u8; 64]).unwrap();
    assert_eq!(read_input("--init", &file, 64).unwrap(), vec![7u8; 64]);
    let err = read_input("--init", &file, 63).unwrap_err().to_string();
    assert!(err.contains("over the 63-byte limit"), "{err}");
}

/// Replacing a file: a synced temporary beside it, renamed over it, then the directory
/// synced, so that the rename itself survives a crash. Nothing temporary is left.
#[test]
fn an_atomic_write_syncs_the_file_then_the_directory_after_the_rename() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("losses.json");
    std::fs::write(&path, "[1.0]").unwrap();
    let mut log = Vec::new();
    write_atomic_logged(&path, b"[1.0,2.0]", &mut log).unwrap();
    assert_eq!(log, ["create temporary", "write", "sync temporary", "rename", "sync directory"]);
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "[1.0,2.0]");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}

/// A new output (the plot) is written whole beside its path and linked into place,
/// never in place; what is already at the path is never replaced, and no temporary is
/// left either way.
#[test]
fn a_new_file_is_written_whole_and_never_replaces_anything() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("plot.svg");
    let mut log = Vec::new();
    write_new_logged(&path, b"<svg/>", &mut log).unwrap();
    assert_eq!(log, ["create temporary", "write", "sync temporary", "link", "sync directory"]);
    assert_eq!(std::fs::read(&path).unwrap(), b"<svg/>");
    let err = write_new(&path, b"other").unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::AlreadyExists);
    assert_eq!(std::fs::read(&path).unwrap(), b"<svg/>");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}

/// What a killed process left beside an output is removed: an older version's bare-pid
/// name of this process's id, a name of this id with another nonce (an earlier
/// process that had the same id), a name of a process that is not running. A running
/// process's name, a directory at such a name and other files stay. Two temporary
/// names of one process never repeat.
#[test]
fn temporaries_a_kill_left_are_removed_and_never_reused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("losses.json");
    let me = std::process::id();
    let at = |tail: &str| dir.path().join(format!(".losses.json{TEMP_MARK}{tail}"));
    let stale = [at(&me.to_string()), at(&format!("{me}-0123456789abcdef-0")), at("4194999")];
    for p in &stale {
        std::fs::write(p, "left by a kill").unwrap();
    }
    // pid 1 is always running.
    let kept = [at("1-0000000000000000-0"), dir.path().join("notes.txt")];
    for p in &kept {
        std::fs::write(p, "keep").unwrap();
    }
    std::fs::create_dir(at("4194998")).unwrap();
    assert_eq!(remove_stale_temps(&path).unwrap(), 3);
    for p in &stale {
        assert!(!p.exists(), "{} was left", p.display());
    }
    for p in &kept {
        assert_eq!(std::fs::read_to_string(p).unwrap(), "keep");
    }
    assert!(at("4194998").is_dir());
    // A name just made is this process's own: never taken for stale.
    let fresh = temp_beside(&path);
    assert_ne!(fresh, temp_beside(&path));
    std::fs::write(&fresh, "in flight").unwrap();
    assert_eq!(remove_stale_temps(&path).unwrap(), 0);
    assert!(fresh.exists());
}
