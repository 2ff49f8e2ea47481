//! Files in and out: inputs read whole within a byte limit (regular files only, opened
//! so that a FIFO or a device never makes the run wait), and outputs written whole or
//! not at all (a temporary file beside the target, synced, renamed into place, and the
//! directory synced, so a crash leaves the old file or the new one).

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// What is at a path, in words, for a refusal.
pub(crate) fn kind(meta: &std::fs::Metadata) -> &'static str {
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
        "not a regular file"
    }
}

/// Opens the regular file `path` for reading, and its size; `what` names it in an
/// error (`--init`, `GRAPH.json`). The open never waits (a named pipe with no writer
/// would block an ordinary open for ever): it is non-blocking, and what it opened is
/// refused unless it is a regular file.
pub fn open_regular(what: &str, path: &Path) -> Result<(File, u64)> {
    let shown = path.display();
    let cannot =
        |e: &dyn std::fmt::Display| Error::usage(format!("{what}: cannot read {shown}: {e}"));
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| cannot(&e))?;
    let meta = file.metadata().map_err(|e| cannot(&e))?;
    if !meta.is_file() {
        return Err(cannot(&format!("it is {}, not a regular file", kind(&meta))));
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
        Error::usage(format!("{what} {shown}: {n} bytes or more, over the {limit}-byte limit"))
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
        .map_err(|e| Error::usage(format!("{what}: cannot read {shown}: {e}")))?;
    if bytes.len() as u64 > limit {
        return Err(too_big(bytes.len() as u64));
    }
    Ok(bytes)
}

/// The bytes of the regular file `path` given by `--flag`, at most `limit` of them
/// (`--max-memory`): [`read_input`] naming the flag.
pub fn read_file(flag: &str, path: &Path, limit: u64) -> Result<Vec<u8>> {
    read_input(&format!("--{flag}"), path, limit).map_err(|e| match e {
        Error::Usage(m) if m.ends_with("-byte limit") => {
            Error::Usage(format!("{m} (--max-memory)"))
        }
        other => other,
    })
}

/// How an output file may be made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Output {
    /// A new file: nothing may be at the path.
    New,
    /// A file that may replace one meshwork wrote there before (a losses list).
    Losses,
}

/// Checks, before any work, that the output `path` of `--flag` can be written: it
/// names a file in a directory that exists and takes a new file; what is at the path
/// is a file meshwork may replace (`Output::Losses`: a losses list) or nothing
/// (`Output::New`). Nothing at the path is touched.
pub(crate) fn check_output(flag: &str, path: &Path, output: Output) -> Result<()> {
    let text = path.to_string_lossy();
    if text.is_empty() || text.ends_with('/') || path.file_name().is_none() {
        return Err(Error::flag(flag, format!("{text:?} names no file")));
    }
    let parent = parent_of(path);
    if !parent.is_dir() {
        return Err(Error::flag(flag, format!("directory {} does not exist", parent.display())));
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if !m.is_file() => {
            return Err(Error::flag(
                flag,
                format!(
                    "{} exists and is not a regular file; meshwork replaces only regular files",
                    path.display()
                ),
            ));
        }
        Ok(_) if output == Output::New => {
            return Err(Error::flag(
                flag,
                format!("{} exists; meshwork writes only new files here", path.display()),
            ));
        }
        // An existing file is replaced only when it is what meshwork writes there: a
        // losses list (a JSON list of numbers) from an earlier run.
        Ok(_) => {
            if read_losses(flag, path).is_err() {
                return Err(Error::flag(
                    flag,
                    format!(
                        "{} exists and is not a losses list meshwork wrote; meshwork replaces only its own files",
                        path.display()
                    ),
                ));
            }
        }
        Err(_) => {}
    }
    let probe = temp_beside(path);
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)
        .map_err(|e| Error::flag(flag, format!("cannot write in {}: {e}", parent.display())))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// A losses list meshwork wrote at `path` (a JSON list of numbers or `null`s for the
/// steps whose loss was not finite), read within 256 MiB.
pub(crate) fn read_losses(flag: &str, path: &Path) -> Result<Vec<Option<f64>>> {
    let bytes = read_file(flag, path, 1 << 28)?;
    serde_json::from_slice(&bytes)
        .map_err(|e| Error::flag(flag, format!("{} is not a losses list: {e}", path.display())))
}

/// The directory a file path names its file in (`.` for a bare name).
fn parent_of(path: &Path) -> &Path {
    path.parent().filter(|q| !q.as_os_str().is_empty()).unwrap_or(Path::new("."))
}

/// A temporary name beside `path` that meshwork alone makes.
pub(crate) fn temp_beside(path: &Path) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    path.with_file_name(format!(".{name}.meshwork-tmp-{}", std::process::id()))
}

/// Makes the entries just created or renamed in `dir` durable (where the platform
/// supports syncing a directory).
fn sync_dir(dir: &Path, log: &mut Vec<&'static str>) {
    if let Ok(d) = File::open(dir)
        && d.sync_all().is_ok()
    {
        log.push("sync directory");
    }
}

/// Writes `bytes` to a temporary file beside `path`, synced; returns its name. The
/// temporary file is removed if this fails. Each file-system operation is named in
/// `log` as it is made.
fn write_temp(path: &Path, bytes: &[u8], log: &mut Vec<&'static str>) -> std::io::Result<PathBuf> {
    let tmp = temp_beside(path);
    // Created new (never a file already there), so only what this call made is removed.
    let mut f = OpenOptions::new().write(true).create_new(true).open(&tmp)?;
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
pub(crate) fn write_atomic_logged(
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
    sync_dir(parent_of(path), log);
    Ok(())
}

/// Writes `bytes` as the new file `path` whole or not at all: a synced temporary file
/// beside it, linked to `path` (which fails if anything is there: nothing is ever
/// replaced), then the directory synced.
pub fn write_new(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    write_new_logged(path, bytes, &mut Vec::new())
}

/// [`write_new`], naming each file-system operation in `log`.
pub(crate) fn write_new_logged(
    path: &Path,
    bytes: &[u8],
    log: &mut Vec<&'static str>,
) -> std::io::Result<()> {
    let tmp = write_temp(path, bytes, log)?;
    let linked = std::fs::hard_link(&tmp, path);
    let _ = std::fs::remove_file(&tmp);
    linked?;
    log.push("link");
    sync_dir(parent_of(path), log);
    Ok(())
}

/// Opens `path` as a new file (never one that exists: meshwork does not overwrite
/// what it did not create), for output written as the run goes.
pub(crate) fn create_new(flag: &str, path: &Path) -> Result<File> {
    OpenOptions::new().write(true).create_new(true).open(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::AlreadyExists {
            Error::flag(
                flag,
                format!("{} exists; meshwork writes only new files here", path.display()),
            )
        } else {
            Error::flag(flag, format!("cannot create {}: {e}", path.display()))
        }
    })
}

#[cfg(test)]
mod tests;
