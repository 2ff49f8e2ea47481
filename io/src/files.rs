//! The rules for a user's files, in one place.
//!
//! - Inputs are opened non-blocking and refused unless they are regular files, so a
//!   named pipe or a device never makes a run wait; they are read within a byte limit,
//!   even one that grows while it is read.
//! - Outputs are written whole or not at all: a synced temporary file beside the
//!   target, renamed over it ([`write_atomic`]) or linked to a name nothing holds
//!   ([`write_new`]), then the directory synced — an error of that sync is reported,
//!   since durability is the point.
//! - Temporary names carry the process id and a per-process nonce, so a later process
//!   that gets the same id never meets a name it did not make; [`remove_stale_temps`]
//!   removes what a killed process left.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::{Error, Result};

/// What is at a path, in words, for a refusal (`a named pipe`, `a directory`).
pub fn kind(meta: &std::fs::Metadata) -> &'static str {
    let t = meta.file_type();
    if t.is_symlink() {
        "a symbolic link"
    } else if t.is_file() {
        "a regular file"
    } else if t.is_dir() {
        "a directory"
    } else if t.is_block_device() || t.is_char_device() {
        "a device"
    } else if t.is_fifo() {
        "a named pipe"
    } else if t.is_socket() {
        "a socket"
    } else {
        "something else"
    }
}

/// Opens the regular file `path` for reading, and its size; `what` names it in an
/// error (`--init`, `GRAPH.json`). The open never waits (a named pipe with no writer
/// would block an ordinary open for ever): it is non-blocking, and what it opened is
/// refused unless it is a regular file.
pub fn open_regular(what: &str, path: &Path) -> Result<(File, u64)> {
    open_regular_io(path)
        .map_err(|e| Error::new(format!("{what}: cannot read {}: {e}", path.display())))
}

/// [`open_regular`] with the error as `std::io::Error` (`InvalidInput`, saying what
/// the path is, for anything but a regular file).
pub fn open_regular_io(path: &Path) -> std::io::Result<(File, u64)> {
    let file = OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("it is {}, not a regular file", kind(&meta)),
        ));
    }
    Ok((file, meta.len()))
}

/// The bytes of the regular file `path`, named `what` in an error, at most `limit` of
/// them: a device, FIFO or directory is refused, and so is a file that holds more,
/// even one that grows while it is read.
pub fn read_input(what: &str, path: &Path, limit: u64) -> Result<Vec<u8>> {
    let (file, len) = open_regular(what, path)?;
    let shown = path.display();
    let too_big = |n: u64| {
        Error::new(format!("{what} {shown}: {n} bytes or more, over the {limit}-byte limit"))
    };
    if len > limit {
        return Err(too_big(len));
    }
    let mut bytes = Vec::new();
    bytes
        .try_reserve_exact(usize::try_from(len).unwrap_or(usize::MAX))
        .map_err(|_| too_big(len))?;
    file.take(limit.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(|e| Error::new(format!("{what}: cannot read {shown}: {e}")))?;
    if bytes.len() as u64 > limit {
        return Err(too_big(bytes.len() as u64));
    }
    Ok(bytes)
}

/// The directory a file path names its file in (`.` for a bare name).
pub fn parent_of(path: &Path) -> &Path {
    path.parent().filter(|q| !q.as_os_str().is_empty()).unwrap_or(Path::new("."))
}

/// The mark every temporary name meshwork makes carries.
pub const TEMP_MARK: &str = ".meshwork-tmp-";

/// This process's nonce: its temporary names differ from those of an earlier process
/// that had the same id.
fn nonce() -> u64 {
    static NONCE: OnceLock<u64> = OnceLock::new();
    *NONCE.get_or_init(|| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        // Mixed so that two processes started in the same nanosecond still differ.
        t ^ (u64::from(std::process::id())).rotate_left(32)
    })
}

/// A fresh temporary name beside `path` that only this call makes:
/// `.{name}.meshwork-tmp-{pid}-{nonce}-{count}`.
pub fn temp_beside(path: &Path) -> PathBuf {
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let count = COUNT.fetch_add(1, Ordering::Relaxed);
    path.with_file_name(format!(
        ".{name}{TEMP_MARK}{}-{:016x}-{count}",
        std::process::id(),
        nonce()
    ))
}

/// Whether process `pid` is running (where `/proc` tells; elsewhere every process is
/// taken to be running, so nothing of another process is removed).
fn running(pid: u32) -> bool {
    let proc = Path::new("/proc");
    !proc.is_dir() || proc.join(pid.to_string()).exists()
}

/// Whether the temporary name `tail` (what follows the mark) was left by a process
/// that can no longer finish with it: one that is not running, or an earlier process
/// of this one's id (another nonce, or the bare-pid names of older versions).
fn stale(tail: &str) -> bool {
    let mut parts = tail.split('-');
    let Some(pid) = parts.next().and_then(|p| p.parse::<u32>().ok()) else {
        return false;
    };
    if pid != std::process::id() {
        return !running(pid);
    }
    match parts.next() {
        Some(n) => u64::from_str_radix(n, 16).ok() != Some(nonce()),
        None => true,
    }
}

/// Removes the temporary files beside `path` (`.{name}.meshwork-tmp-…`) that a killed
/// process left, and returns how many; names of running processes are left alone,
/// and so is anything that is not a regular file.
pub fn remove_stale_temps(path: &Path) -> std::io::Result<usize> {
    let Some(name) = path.file_name().map(|n| n.to_string_lossy().into_owned()) else {
        return Ok(0);
    };
    let prefix = format!(".{name}{TEMP_MARK}");
    let mut removed = 0;
    for entry in std::fs::read_dir(parent_of(path))?.flatten() {
        let entry_name = entry.file_name();
        let Some(tail) = entry_name.to_str().and_then(|n| n.strip_prefix(&prefix)) else {
            continue;
        };
        let regular = entry.file_type().is_ok_and(|t| t.is_file());
        if regular && stale(tail) && std::fs::remove_file(entry.path()).is_ok() {
            removed += 1;
        }
    }
    Ok(removed)
}

/// Makes the entries just created or renamed in `dir` durable. A file system that
/// cannot sync a directory (`EINVAL`) is no error; any other failure is.
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    let d = File::open(dir)?;
    match d.sync_all() {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(()),
        other => other,
    }
}

/// Writes `bytes` to a new temporary file beside `path`, synced; returns its name. The
/// temporary file is removed if this fails. Each file-system operation is named in
/// `log` as it is made.
fn write_temp(path: &Path, bytes: &[u8], log: &mut Vec<&'static str>) -> std::io::Result<PathBuf> {
    let tmp = temp_beside(path);
    // Created new (never a file already there, never through a link), so only what
    // this call made is removed.
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)?;
    log.push("create temporary");
    let result = (|| {
        f.write_all(bytes)?;
        log.push("write");
        f.sync_all()?;
        log.push("sync temporary");
        Ok(())
    })();
    match result {
        Ok(()) => Ok(tmp),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// Replaces `path` with `bytes` whole or not at all: a synced temporary file beside it,
/// renamed over it, then the directory synced — after a crash at any instant the path
/// holds the old contents or the new.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    write_atomic_logged(path, bytes, &mut Vec::new())
}

/// [`write_atomic`], naming each file-system operation in `log`.
pub fn write_atomic_logged(
    path: &Path,
    bytes: &[u8],
    log: &mut Vec<&'static str>,
) -> std::io::Result<()> {
    let tmp = write_temp(path, bytes, log)?;
    if let Err(e) = std::fs::rename(&tmp, path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    log.push("rename");
    sync_dir(parent_of(path))?;
    log.push("sync directory");
    Ok(())
}

/// Writes `bytes` as the new file `path` whole or not at all: a synced temporary file
/// beside it, linked to `path` (which fails if anything is there: nothing is ever
/// replaced), then the directory synced.
pub fn write_new(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    write_new_logged(path, bytes, &mut Vec::new())
}

/// [`write_new`], naming each file-system operation in `log`.
pub fn write_new_logged(
    path: &Path,
    bytes: &[u8],
    log: &mut Vec<&'static str>,
) -> std::io::Result<()> {
    let tmp = write_temp(path, bytes, log)?;
    let linked = std::fs::hard_link(&tmp, path);
    let _ = std::fs::remove_file(&tmp);
    linked?;
    log.push("link");
    sync_dir(parent_of(path))?;
    log.push("sync directory");
    Ok(())
}

#[cfg(test)]
mod tests;
