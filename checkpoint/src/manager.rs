//! A directory of rolling checkpoints that meshwork owns, in the layout users know
//! from TensorFlow's and Orbax's checkpoint managers:
//!
//! ```text
//! DIR/
//!   meshwork-checkpoints.json   the marker: this directory is meshwork's
//!   .lock                       held (advisory flock) by the run writing here
//!   latest                      "step-00000120": the newest complete step
//!   step-00000080/  step-00000100/  step-00000120/     one checkpoint each
//! ```
//!
//! - [`CheckpointManager::open`] creates `DIR` if absent and accepts it if it is empty
//!   or already marked as meshwork's; a file, a symbolic link, a device or a non-empty
//!   directory without the marker is refused and left untouched. It then takes the
//!   lock (a second run on the same directory gets [`Error::Directory`] at once)
//!   and removes the temporary entries a killed run left (only names meshwork makes).
//! - [`CheckpointManager::save`] writes a step into `.partial-step-…` (index last),
//!   renames it to `step-NNNNNNNN`, then updates `latest` atomically (a temporary
//!   file, fsync, rename), then deletes the oldest steps beyond `keep` — only
//!   `step-*` directories holding a meshwork index. It never replaces a step that
//!   exists. A crash at any instant leaves every complete step intact and no
//!   incomplete one under a `step-*` name.
//! - [`find_checkpoint`] turns what a user passes to resume — a managed directory, a
//!   `step-…` directory inside one, or a plain checkpoint directory — into the
//!   checkpoint to restore: the newest complete step of a managed directory.
//!
//! Nothing outside meshwork's own entries in `DIR` is ever renamed or deleted.

use std::fs::{self, File};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::format::{
    CheckpointEntry, Ops, WrittenPart, check, is_checkpoint, make_dir, merge, remove_written,
    sync_dir, write, write_index, write_shards,
};
use crate::{Error, Result};

/// The marker file that makes a directory meshwork's.
pub const MARKER: &str = "meshwork-checkpoints.json";
const MARKER_FORMAT: &str = "meshwork-checkpoint-directory";
const LOCK: &str = ".lock";
const LATEST: &str = "latest";
/// Prefixes of the temporary entries a save makes (removed at the next open).
const PARTIAL: &str = ".partial-";
const TMP: &str = ".tmp-";
/// The prefix of a damaged step set aside.
const DAMAGED: &str = ".damaged-";

/// The name of step `step`'s directory: `step-00000120`.
pub fn step_name(step: usize) -> String {
    format!("step-{step:08}")
}

/// Whether the step directory `dir`'s index is damaged beyond doubt: missing, or a
/// regular file that is not JSON. (One that cannot be read now — permissions, a
/// full file table — or that a newer meshwork wrote is not damage: left alone.)
fn damaged_index(dir: &Path) -> bool {
    let index = dir.join("index.json");
    match fs::symlink_metadata(&index) {
        Err(e) => e.kind() == std::io::ErrorKind::NotFound,
        Ok(m) if m.is_file() && m.len() <= 256 << 20 => {
            fs::read(&index).is_ok_and(|b| serde_json::from_slice::<Value>(&b).is_err())
        }
        Ok(_) => false,
    }
}

/// The step of a `step-NNNNNNNN` name.
fn parse_step(name: &str) -> Option<usize> {
    let digits = name.strip_prefix("step-")?;
    (digits.len() >= 8 && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse().ok())
        .flatten()
}

fn refuse(path: &Path, problem: impl Into<String>) -> Error {
    Error::Directory { path: path.to_path_buf(), problem: problem.into() }
}

use meshwork_io::files::kind;

/// Whether `dir` carries meshwork's marker.
fn is_marked(dir: &Path) -> bool {
    let path = dir.join(MARKER);
    match fs::symlink_metadata(&path) {
        Ok(m) if m.is_file() && m.len() < 4096 => fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
            .is_some_and(|v| v.get("format").and_then(Value::as_str) == Some(MARKER_FORMAT)),
        _ => false,
    }
}

/// A checkpoint directory meshwork owns, open for saving (see the module docs). Holds
/// the directory's lock until dropped — or, [joined](Self::join) by another process
/// of a job whose process 0 holds it, writes that process's parts of a step.
#[derive(Debug)]
pub struct CheckpointManager {
    root: PathBuf,
    keep: usize,
    /// The lock (`None`: a process that joined the lock holder's saves), released
    /// when the manager is dropped.
    lock: Option<File>,
    /// Test hook: file-system operations the next save may make before it stops as a
    /// crash would.
    crash_after: Option<usize>,
    /// The damaged steps `open` set aside.
    set_aside: Vec<PathBuf>,
}

impl CheckpointManager {
    /// Opens `root` for saving checkpoints, keeping the newest `keep` (at least 1):
    /// creates it if absent (its parent must exist), accepts an empty directory or one
    /// marked as meshwork's, refuses anything else; takes its lock; removes temporary
    /// entries a killed run left.
    pub fn open(root: impl AsRef<Path>, keep: usize) -> Result<CheckpointManager> {
        let root = root.as_ref();
        if keep == 0 {
            return Err(refuse(root, "keeping 0 checkpoints would delete every one saved"));
        }
        match fs::symlink_metadata(root) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                fs::create_dir(root).map_err(|e| refuse(root, format!("cannot create it: {e}")))?;
            }
            Err(e) => return Err(refuse(root, format!("cannot look at it: {e}"))),
            Ok(meta) if !meta.is_dir() => {
                return Err(refuse(
                    root,
                    format!(
                        "is {}, not a directory; meshwork writes checkpoints only into a new, \
                         empty or meshwork checkpoint directory",
                        kind(&meta)
                    ),
                ));
            }
            Ok(_) => {
                if !is_marked(root) {
                    // Empty but for the marker a killed open was writing.
                    // (Older versions named it `.tmp-<marker>-<pid>`.)
                    let marker_tmps = [
                        format!("{TMP}{MARKER}-"),
                        format!(".{MARKER}{}", meshwork_io::files::TEMP_MARK),
                    ];
                    let mut entries = fs::read_dir(root)
                        .map_err(|e| refuse(root, format!("cannot list it: {e}")))?
                        .filter(|e| {
                            e.as_ref().map_or(true, |e| {
                                let name = e.file_name().to_string_lossy().into_owned();
                                !marker_tmps.iter().any(|t| name.starts_with(t))
                            })
                        });
                    if let Some(first) = entries.next() {
                        let first = first.map_err(|e| refuse(root, e.to_string()))?;
                        return Err(refuse(
                            root,
                            format!(
                                "is not empty (it holds {:?}) and is not a meshwork checkpoint \
                                 directory (no {MARKER}); give a new or empty directory",
                                first.file_name()
                            ),
                        ));
                    }
                }
            }
        }
        if !is_marked(root) {
            let marker = json!({ "format": MARKER_FORMAT, "version": 1 });
            let text = serde_json::to_vec_pretty(&marker).expect("a small JSON value");
            write_replace(root, MARKER, &text, &mut Ops::real())?;
        }
        let lock_path = root.join(LOCK);
        // Never waits on a FIFO or follows a link put in the lock file's place.
        if let Ok(meta) = fs::symlink_metadata(&lock_path)
            && !meta.is_file()
        {
            return Err(refuse(
                root,
                format!("its lock file {LOCK} is {}, not a regular file", kind(&meta)),
            ));
        }
        let lock = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW)
            .open(&lock_path)
            .map_err(|e| refuse(root, format!("cannot create its lock file: {e}")))?;
        let lock_meta =
            lock.metadata().map_err(|e| refuse(root, format!("cannot read its lock file: {e}")))?;
        if !lock_meta.is_file() {
            return Err(refuse(
                root,
                format!("its lock file {LOCK} is {}, not a regular file", kind(&lock_meta)),
            ));
        }
        match lock.try_lock() {
            Ok(()) => {}
            Err(fs::TryLockError::WouldBlock) => {
                return Err(refuse(
                    root,
                    "another meshwork run is writing checkpoints here (its lock is held); \
                     wait for it or give another directory",
                ));
            }
            Err(fs::TryLockError::Error(e)) => {
                return Err(refuse(root, format!("cannot lock it: {e}")));
            }
        }
        let mut manager = CheckpointManager {
            root: root.to_path_buf(),
            keep,
            lock: Some(lock),
            crash_after: None,
            set_aside: Vec::new(),
        };
        manager.remove_stale()?;
        manager.set_aside_damaged()?;
        Ok(manager)
    }

    /// The damaged steps [`open`](Self::open) set aside: each `step-NNNNNNNN` directory
    /// whose index is missing or not JSON (a step is renamed into place complete, so
    /// only damage makes one), now under the name in
    /// the list, `.damaged-step-NNNNNNNN-…`, which meshwork never reads, writes or
    /// removes. Left there, such a step would stop a run from saving that step again.
    pub fn set_aside(&self) -> &[PathBuf] {
        &self.set_aside
    }

    /// Renames each damaged step out of the `step-*` names (see [`set_aside`]).
    ///
    /// [`set_aside`]: Self::set_aside
    fn set_aside_damaged(&mut self) -> Result<()> {
        let entries = fs::read_dir(&self.root).map_err(|e| refuse(&self.root, e.to_string()))?;
        for entry in entries.flatten() {
            let Some(name) = entry.file_name().to_str().map(str::to_owned) else { continue };
            if parse_step(&name).is_none() {
                continue;
            }
            let path = entry.path();
            let is_dir = fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir());
            if !is_dir || is_checkpoint(&path) || !damaged_index(&path) {
                continue;
            }
            let mut aside = self.root.join(format!("{DAMAGED}{name}-{}", std::process::id()));
            let mut k = 0;
            while fs::symlink_metadata(&aside).is_ok() {
                k += 1;
                aside = self.root.join(format!("{DAMAGED}{name}-{}-{k}", std::process::id()));
            }
            fs::rename(&path, &aside)
                .map_err(|e| refuse(&path, format!("a damaged step; cannot set it aside: {e}")))?;
            self.set_aside.push(aside);
        }
        if !self.set_aside.is_empty() {
            sync_dir(&self.root)?;
        }
        Ok(())
    }

    /// The directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Joins the saves of `root`, which another process of the same job has
    /// [opened](Self::open) (and holds locked): this process writes its own parts of
    /// each step ([`write_part`](Self::write_part)); the lock holder commits them.
    /// Refuses a directory that is not marked as meshwork's; takes no lock, removes
    /// nothing and never commits, prunes or moves `latest`.
    pub fn join(root: impl AsRef<Path>) -> Result<CheckpointManager> {
        let root = root.as_ref();
        let meta = fs::symlink_metadata(root)
            .map_err(|e| refuse(root, format!("cannot look at it: {e}")))?;
        if !meta.is_dir() || !is_marked(root) {
            return Err(refuse(
                root,
                format!(
                    "is not a meshwork checkpoint directory here (no {MARKER}); every process \
                     of the job must see the directory process 0 made (a shared file system)"
                ),
            ));
        }
        Ok(CheckpointManager {
            root: root.to_path_buf(),
            keep: usize::MAX,
            lock: None,
            crash_after: None,
            set_aside: Vec::new(),
        })
    }

    /// Writes this process's part of step `step` of a checkpoint over `devices`
    /// positions, of which it holds `positions`: each position's file (its shards of
    /// `entries`, each at its region) into a directory of its own beside the steps,
    /// synced — durable when this returns. Nothing is visible as a step until the lock
    /// holder [commits](Self::commit_parts) every process's part; a failure removes
    /// what this call wrote.
    pub fn write_part(
        &mut self,
        step: usize,
        rank: usize,
        positions: std::ops::Range<usize>,
        devices: usize,
        entries: Vec<CheckpointEntry>,
    ) -> Result<WrittenPart> {
        let name = step_name(step);
        if fs::symlink_metadata(self.root.join(&name)).is_ok() {
            return Err(refuse(
                &self.root,
                format!("{name} already exists; meshwork does not overwrite a saved step"),
            ));
        }
        if positions.is_empty() || positions.end > devices {
            return Err(refuse(&self.root, format!("positions {positions:?} of {devices}")));
        }
        let dir = self.root.join(format!("{PARTIAL}{name}-r{rank}-{}", std::process::id()));
        if fs::symlink_metadata(&dir).is_ok() {
            // This process's own name: a stale part of an earlier, killed run.
            fs::remove_dir_all(&dir).map_err(|e| refuse(&dir, e.to_string()))?;
        }
        let mut ops = Ops { left: self.crash_after.take(), crashed: false };
        let created = make_dir(&dir).map_err(|e| save_error(&self.root, step, e))?;
        let mut written = Vec::new();
        let part = write_shards(&dir, positions, devices, entries, &mut ops, &mut written);
        if part.is_err() && !ops.crashed {
            remove_written(&written, created.then_some(dir.as_path()));
        }
        part.and_then(|p| sync_dir(&self.root).map(|()| p))
            .map_err(|e| save_error(&self.root, step, e))
    }

    /// Removes a part this process wrote for a step that will not be committed.
    pub fn abandon(&self, part: &WrittenPart) {
        let dir = self.root.join(&part.dir);
        if part.dir.starts_with(PARTIAL) {
            let _ = fs::remove_dir_all(dir);
        }
    }

    /// Commits step `step` from every process's part (`(rank, part)`, each durable):
    /// the parts' files moved into this process's part's directory, the index
    /// (`metadata` in it; each file with the rank that wrote it) written last, the
    /// directory renamed to `step-NNNNNNNN`, `latest` moved and the oldest steps
    /// beyond `keep` removed — as [`save`](Self::save) does. Only the lock holder
    /// commits. If the parts do not make a whole checkpoint (a position's file or a
    /// region missing or twice), nothing becomes a step.
    pub fn commit_parts(
        &mut self,
        step: usize,
        metadata: &Value,
        devices: usize,
        mut parts: Vec<(usize, WrittenPart)>,
    ) -> Result<PathBuf> {
        if self.lock.is_none() {
            return Err(refuse(&self.root, "only the process holding the lock commits a step"));
        }
        parts.sort_by_key(|(rank, _)| *rank);
        let own = parts
            .first()
            .map(|(_, p)| self.root.join(&p.dir))
            .ok_or_else(|| refuse(&self.root, "no part to commit"))?;
        let root = self.root.clone();
        let mut parts = Some(parts);
        self.save_into(step, &own, &mut |aside, ops| {
            let parts = parts.take().expect("a step is committed once");
            let (variables, files) = merge(aside, devices, parts.clone())?;
            for (_, part) in &parts {
                let from = root.join(&part.dir);
                if from == aside {
                    continue;
                }
                for (_, f) in &part.files {
                    let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
                    fs::rename(from.join(name), aside.join(name))
                        .map_err(|e| refuse(&from.join(name), format!("cannot move it: {e}")))?;
                    ops.did("rename", &aside.join(name))?;
                }
                let _ = fs::remove_dir(&from);
            }
            sync_dir(aside)?;
            let mut written = Vec::new();
            write_index(aside, devices, variables, files, Some(metadata), ops, &mut written)
        })
    }

    /// Removes what killed saves left: `.partial-step-…` directories and the
    /// `.tmp-latest-…` / `.tmp-meshwork-checkpoints.json-…` files — names only meshwork
    /// makes here (anything else stays), and the lock says no save is running.
    fn remove_stale(&self) -> Result<()> {
        let partial = format!("{PARTIAL}step-");
        let temps = [format!("{TMP}{LATEST}-"), format!("{TMP}{MARKER}-")];
        let entries = fs::read_dir(&self.root).map_err(|e| refuse(&self.root, e.to_string()))?;
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            let path = entry.path();
            let Ok(meta) = fs::symlink_metadata(&path) else { continue };
            if name.starts_with(&partial) && meta.is_dir() {
                fs::remove_dir_all(&path).map_err(|e| {
                    refuse(&path, format!("cannot remove a stale partial save: {e}"))
                })?;
            } else if temps.iter().any(|t| name.starts_with(t)) && meta.is_file() {
                fs::remove_file(&path).map_err(|e| {
                    refuse(&path, format!("cannot remove a stale temporary file: {e}"))
                })?;
            }
        }
        // Today's temporary names (`.latest.meshwork-tmp-<pid>-<nonce>-<n>`): those of
        // processes that no longer run.
        for name in [LATEST, MARKER] {
            meshwork_io::files::remove_stale_temps(&self.root.join(name))
                .map_err(|e| refuse(&self.root, format!("cannot list it: {e}")))?;
        }
        Ok(())
    }

    /// The complete steps saved here, oldest first.
    pub fn steps(&self) -> Result<Vec<usize>> {
        complete_steps(&self.root)
    }

    /// The newest complete step and its directory.
    pub fn latest(&self) -> Result<Option<(usize, PathBuf)>> {
        Ok(self.steps()?.last().map(|&s| (s, self.root.join(step_name(s)))))
    }

    /// Saves `entries` — the shards of a checkpoint over `devices` positions, checked
    /// as [`write_checkpoint`](crate::write_checkpoint) checks them — with `metadata`
    /// in the index as step `step`: written aside, renamed to `step-NNNNNNNN`,
    /// `latest` updated, then the oldest steps beyond `keep` deleted. Refuses a step
    /// that already exists. A save that fails (a full disk) is [`Error::Save`], naming
    /// the directory and the step, and leaves nothing under the step's name.
    pub fn save(
        &mut self,
        step: usize,
        metadata: &Value,
        devices: usize,
        entries: Vec<CheckpointEntry>,
    ) -> Result<PathBuf> {
        check(&self.root, devices, &entries)?;
        let mut entries = Some(entries);
        self.save_step(step, &mut |aside, ops| {
            let entries = entries.take().expect("a step is written once");
            write(aside, devices, entries, Some(metadata), ops)
        })
    }

    fn save_step(
        &mut self,
        step: usize,
        write: &mut dyn FnMut(&Path, &mut Ops) -> Result<()>,
    ) -> Result<PathBuf> {
        let name = step_name(step);
        let aside = self.root.join(format!("{PARTIAL}{name}-{}", std::process::id()));
        if fs::symlink_metadata(&aside).is_ok() {
            fs::remove_dir_all(&aside).map_err(|e| refuse(&aside, e.to_string()))?;
        }
        self.save_into(step, &aside, write)
    }

    /// A save of step `step` written by `write` into `aside`, then made the step.
    fn save_into(
        &mut self,
        step: usize,
        aside: &Path,
        write: &mut dyn FnMut(&Path, &mut Ops) -> Result<()>,
    ) -> Result<PathBuf> {
        let mut ops = Ops { left: self.crash_after.take(), crashed: false };
        let name = step_name(step);
        let target = self.root.join(&name);
        if fs::symlink_metadata(&target).is_ok() {
            return Err(refuse(
                &self.root,
                format!("{name} already exists; meshwork does not overwrite a saved step"),
            ));
        }
        self.write_step(write, step, aside, &target, &mut ops)
            .map_err(|e| save_error(&self.root, step, e))?;
        Ok(target)
    }

    /// The writing part of [`save`](Self::save).
    fn write_step(
        &self,
        write: &mut dyn FnMut(&Path, &mut Ops) -> Result<()>,
        step: usize,
        aside: &Path,
        target: &Path,
        ops: &mut Ops,
    ) -> Result<()> {
        write(aside, ops)?;
        // A directory rename is atomic: `step-…` appears complete or not at all.
        fs::rename(aside, target).map_err(|e| refuse(target, e.to_string()))?;
        ops.did("rename", target)?;
        sync_dir(&self.root)?;
        ops.did("fsync", &self.root)?;
        let name = step_name(step);
        write_replace(&self.root, LATEST, format!("{name}\n").as_bytes(), ops)?;
        let steps = self.steps()?;
        let old = steps.len().saturating_sub(self.keep);
        for &s in steps[..old].iter().filter(|&&s| s != step) {
            // Rename out of the `step-*` names first, so a crash mid-delete leaves a
            // stale partial (removed at the next open), never a damaged step. A step
            // another run is reading (its shared lock: `pin_checkpoint`) is left for a
            // later save to prune.
            let dir = self.root.join(step_name(s));
            let Ok(held) = File::open(&dir) else { continue };
            // (A file system without locks prunes as before.)
            if let Err(fs::TryLockError::WouldBlock) = held.try_lock() {
                continue;
            }
            let doomed =
                self.root.join(format!("{PARTIAL}{}-{}-old", step_name(s), std::process::id()));
            fs::rename(&dir, &doomed).map_err(|e| refuse(&dir, e.to_string()))?;
            ops.did("rename", &doomed)?;
            fs::remove_dir_all(&doomed).map_err(|e| refuse(&doomed, e.to_string()))?;
            ops.did("remove", &doomed)?;
        }
        sync_dir(&self.root)
    }

    /// Test hook: the next [`save`](Self::save) stops after `ops` file-system
    /// operations, leaving everything as a crash (`kill -9`) at that instant would —
    /// no clean-up — and returns an error saying so.
    #[doc(hidden)]
    pub fn crash_after(&mut self, ops: usize) {
        self.crash_after = Some(ops);
    }
}

/// A save's failure to write (a full disk), as [`Error::Save`] naming the directory
/// and the step.
fn save_error(root: &Path, step: usize, e: Error) -> Error {
    match e {
        Error::File { problem, .. } | Error::Directory { problem, .. } => {
            Error::Save { path: root.to_path_buf(), step, problem }
        }
        other => other,
    }
}

/// Writes `bytes` to `dir/name` atomically: a temporary file, fsync, rename, fsync of
/// the directory.
fn write_replace(dir: &Path, name: &str, bytes: &[u8], ops: &mut Ops) -> Result<()> {
    let path = dir.join(name);
    // A name no other process makes (process id and nonce), created new, never opened
    // through a link.
    let tmp = meshwork_io::files::temp_beside(&path);
    let write = || -> std::io::Result<()> {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()
    };
    write().map_err(|e| refuse(&path, format!("cannot write it: {e}")))?;
    ops.did("write", &tmp)?;
    fs::rename(&tmp, &path).map_err(|e| refuse(&path, format!("cannot write it: {e}")))?;
    ops.did("rename", &path)?;
    sync_dir(dir)?;
    ops.did("fsync", dir)
}

/// The complete steps in `root`, oldest first.
fn complete_steps(root: &Path) -> Result<Vec<usize>> {
    let entries = fs::read_dir(root).map_err(|e| refuse(root, format!("cannot list it: {e}")))?;
    let mut steps: Vec<usize> = entries
        .flatten()
        .filter_map(|e| {
            let step = parse_step(e.file_name().to_str()?)?;
            let meta = fs::symlink_metadata(e.path()).ok()?;
            (meta.is_dir() && is_checkpoint(e.path())).then_some(step)
        })
        .collect();
    steps.sort_unstable();
    Ok(steps)
}

/// A checkpoint step held for reading: a shared lock on its directory, which a
/// [`CheckpointManager`] pruning old steps respects (it skips a step someone reads,
/// pruning it at a later save). Dropping it releases the step.
#[derive(Debug)]
pub struct Pinned {
    /// The checkpoint's directory.
    pub dir: PathBuf,
    /// Its step, when its name says it.
    pub step: Option<usize>,
    lock: File,
}

// A lock is released when its holder is dropped, not when the last copy of its
// descriptor closes: a process forked meanwhile (to exec another program) holds a
// copy until it execs, and would keep the lock held past the drop.
impl Drop for Pinned {
    fn drop(&mut self) {
        let _ = self.lock.unlock();
    }
}

impl Drop for CheckpointManager {
    fn drop(&mut self) {
        if let Some(lock) = &self.lock {
            let _ = lock.unlock();
        }
    }
}

/// [`find_checkpoint`], the step found held against pruning ([`Pinned`]). A step that
/// another run's save prunes between being found and being locked is found again:
/// the newest step then is taken.
pub fn pin_checkpoint(path: impl AsRef<Path>) -> Result<Pinned> {
    use std::os::unix::fs::MetadataExt;
    let path = path.as_ref();
    let mut last = None;
    for _ in 0..8 {
        let (dir, step) = find_checkpoint(path)?;
        let Ok(lock) = File::open(&dir) else {
            last = Some(dir);
            continue;
        };
        // A file system without locks (ENOLCK) reads unpinned, as before.
        if let Err(fs::TryLockError::WouldBlock) = lock.try_lock_shared() {
            // Being pruned right now.
            last = Some(dir);
            std::thread::sleep(std::time::Duration::from_millis(20));
            continue;
        }
        // Still at its name, and still complete: not pruned before the lock took.
        let same = match (lock.metadata(), fs::metadata(&dir)) {
            (Ok(a), Ok(b)) => a.ino() == b.ino() && a.dev() == b.dev(),
            _ => false,
        };
        if same && is_checkpoint(&dir) {
            return Ok(Pinned { dir, step, lock });
        }
        last = Some(dir);
    }
    let shown = last.unwrap_or_else(|| path.to_path_buf());
    Err(refuse(
        &shown,
        "keeps vanishing as it is read (another run is pruning it); not a complete checkpoint",
    ))
}

/// The checkpoint to restore for a user's `path`: a meshwork checkpoint directory gives
/// its newest complete step; a step directory or any directory holding a checkpoint
/// index is taken as it is. Returns the checkpoint's directory and its step when the
/// name says it.
pub fn find_checkpoint(path: impl AsRef<Path>) -> Result<(PathBuf, Option<usize>)> {
    let path = path.as_ref();
    let meta = fs::metadata(path).map_err(|e| refuse(path, format!("cannot open it: {e}")))?;
    if !meta.is_dir() {
        return Err(refuse(path, format!("is {}, not a checkpoint directory", kind(&meta))));
    }
    if is_marked(path) {
        let steps = complete_steps(path)?;
        return match steps.last() {
            Some(&s) => Ok((path.join(step_name(s)), Some(s))),
            None => Err(refuse(path, "holds no complete checkpoint yet")),
        };
    }
    if is_checkpoint(path) {
        let step = path.file_name().and_then(|n| n.to_str()).and_then(parse_step);
        return Ok((path.to_path_buf(), step));
    }
    Err(refuse(
        path,
        format!(
            "is neither a meshwork checkpoint directory (no {MARKER}) nor a checkpoint (no index.json)"
        ),
    ))
}
