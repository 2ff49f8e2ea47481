//! Inputs refused without waiting, outputs written whole with their directory synced.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use super::*;

/// A named pipe at `dir/name`, made by `mkfifo`.
fn fifo(dir: &Path, name: &str) -> PathBuf {
    let path = dir.join(name);
    let made = Command::new("mkfifo").arg(&path).status().expect("mkfifo runs");
    assert!(made.success(), "mkfifo {}", path.display());
    path
}

/// Runs `f` on another thread and fails the test, instead of hanging it, when `f`
/// does not return within 10 s.
fn within_10s<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(10)).expect("returned instead of waiting for a writer")
}

/// A named pipe with no writer is refused at once, naming the flag and what it is:
/// an ordinary open would wait for a writer for ever.
#[test]
fn a_named_pipe_is_refused_without_waiting() {
    let dir = tempfile::tempdir().unwrap();
    let path = fifo(dir.path(), "pipe");
    let t = Instant::now();
    let err = within_10s(move || read_file("text", &path, 1 << 20).unwrap_err());
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
    let err = read_file("init", dir.path(), 100).unwrap_err().to_string();
    assert!(err.contains("a directory, not a regular file"), "{err}");
    let missing = dir.path().join("missing");
    assert!(
        read_file("init", &missing, 100)
            .unwrap_err()
            .to_string()
            .starts_with("--init: cannot read")
    );
    let file = dir.path().join("f");
    std::fs::write(&file, [7u8; 64]).unwrap();
    assert_eq!(read_file("init", &file, 64).unwrap(), vec![7u8; 64]);
    let err = read_file("init", &file, 63).unwrap_err().to_string();
    assert!(err.contains("over the 63-byte limit (--max-memory)"), "{err}");
}

/// The output checks: a missing directory, a path that names no file, something other
/// than a regular file, an existing file for a new output, and an existing file that
/// is not a losses list are refused, each untouched; a losses list may be replaced.
#[test]
fn outputs_are_checked_before_any_work_and_left_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let refused = |flag: &str, path: &Path, output: Output, says: &str| {
        let err = check_output(flag, path, output).unwrap_err().to_string();
        assert!(err.starts_with(&format!("--{flag}: ")) && err.contains(says), "{err}");
    };
    refused("plot", &d.join("no/such/dir/p.svg"), Output::New, "does not exist");
    refused("plot", Path::new(""), Output::New, "names no file");
    refused("plot", d, Output::New, "is not a regular file");
    let mine = d.join("mine.txt");
    std::fs::write(&mine, "a user's notes").unwrap();
    refused("plot", &mine, Output::New, "exists; meshwork writes only new files here");
    refused("losses-json", &mine, Output::Losses, "is not a losses list meshwork wrote");
    assert_eq!(std::fs::read_to_string(&mine).unwrap(), "a user's notes");
    let losses = d.join("losses.json");
    std::fs::write(&losses, "[1.5,null,0.5]").unwrap();
    check_output("losses-json", &losses, Output::Losses).unwrap();
    assert_eq!(read_losses("losses-json", &losses).unwrap(), vec![Some(1.5), None, Some(0.5)]);
    check_output("plot", &d.join("new.svg"), Output::New).unwrap();
    // Only what was there before: the probe file is gone.
    assert_eq!(std::fs::read_dir(d).unwrap().count(), 2);
}
