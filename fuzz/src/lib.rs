//! What the fuzz targets share: an input split into the files of a folder, and a
//! scratch folder per process to write them into (the readers under test take paths,
//! as a user's files are).

use std::path::PathBuf;

/// What separates the files in one input (bytes no JSON file holds).
pub const SEP: &[u8] = b"\xffMESHWORK-FUZZ\xff";

/// `data` cut at each [`SEP`] into at most `n` parts (the last takes the rest);
/// missing parts are empty.
pub fn parts(data: &[u8], n: usize) -> Vec<&[u8]> {
    let mut out = Vec::with_capacity(n);
    let mut rest = data;
    while out.len() + 1 < n {
        match rest.windows(SEP.len()).position(|w| w == SEP) {
            Some(at) => {
                out.push(&rest[..at]);
                rest = &rest[at + SEP.len()..];
            }
            None => break,
        }
    }
    out.push(rest);
    while out.len() < n {
        out.push(&[]);
    }
    out
}

/// An empty scratch folder of this process, named `name` (emptied on each call).
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("meshwork-fuzz-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a scratch folder");
    dir
}

/// Writes the non-empty `files` (name, bytes) into `dir`.
pub fn write_files(dir: &std::path::Path, files: &[(&str, &[u8])]) {
    for (name, bytes) in files {
        if !bytes.is_empty() {
            std::fs::write(dir.join(name), bytes).expect("a scratch file");
        }
    }
}
