//! Files in and out: inputs read whole within a byte limit (regular files only, opened
//! so that a FIFO or a device never makes the run wait), and outputs written whole or
//! not at all (a temporary file beside the target, synced, renamed into place, and the
//! directory synced, so a crash leaves the old file or the new one).

use std::fs::{File, OpenOptions};
use std::path::Path;

use crate::{Error, Result};

pub(crate) use meshwork_io::files::kind;

/// Opens the regular file `path` for reading, and its size; `what` names it in an
/// error (see [`meshwork_io::files::open_regular`]).
pub fn open_regular(what: &str, path: &Path) -> Result<(File, u64)> {
    Ok(meshwork_io::files::open_regular(what, path)?)
}

/// The bytes of the regular file `path`, named `what` in an error, at most `limit` of
/// them (see [`meshwork_io::files::read_input`]).
pub fn read_input(what: &str, path: &Path, limit: u64) -> Result<Vec<u8>> {
    Ok(meshwork_io::files::read_input(what, path, limit)?)
}

/// The bytes of the regular file `path` given by `--flag`, at most `limit` bytes of
/// a format's own fixed cap (a JSON file's): [`read_input`] naming the flag, the cap
/// its own (not `--max-memory`'s).
pub(crate) fn read_capped(flag: &str, path: &Path, limit: u64) -> Result<Vec<u8>> {
    read_input(&format!("--{flag}"), path, limit)
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
    // What a killed run left beside it (a losses list's temporary) goes first.
    let _ = meshwork_io::files::remove_stale_temps(path);
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
    let bytes = read_capped(flag, path, 1 << 28)?;
    serde_json::from_slice(&bytes)
        .map_err(|e| Error::flag(flag, format!("{} is not a losses list: {e}", path.display())))
}

use meshwork_io::files::{parent_of, temp_beside};
pub use meshwork_io::files::{write_atomic, write_new};

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
