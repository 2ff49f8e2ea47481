//! Sharded checkpoints: every variable's distinct shards in safetensors files (one per
//! logical device), and a JSON index with the mesh, each variable's sharding and shard
//! regions, CRC32C checksums of every file and optional run metadata. The index is
//! written last, so a directory without it is not a checkpoint; restoring verifies
//! sizes, checksums, dtypes and shapes before any variable changes, then lays the
//! values out in the strategy's current sharding — which may differ from the saved one.
//!
//! Writing never replaces or deletes anything it did not create: a checkpoint goes into
//! a new (or empty) directory. Rolling checkpoints of a training run, each written aside
//! and renamed into place, live in a [`CheckpointManager`](crate::CheckpointManager)'s
//! directory.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use meshwork_executor::Tensor;
use meshwork_sharding::{HloSharding, Mode};
use meshwork_types::DType;
use ndarray::{ArrayD, IxDyn, Slice};
use safetensors::tensor::TensorView;
use serde_json::{Value, json};

use crate::strategy::Strategy;
use crate::variable::{Aggregation, Synchronization, VarState, logical_sharding};
use crate::{Error, Result, ops};

const FORMAT: &str = "meshwork-checkpoint";
const VERSION: u64 = 1;
const INDEX: &str = "index.json";

fn io(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Checkpoint { path: path.to_path_buf(), problem: e.to_string() }
}

fn corrupt(path: &Path, problem: impl Into<String>) -> Error {
    Error::Checkpoint { path: path.to_path_buf(), problem: problem.into() }
}

fn st_dtype(d: DType) -> safetensors::Dtype {
    match d {
        DType::F32 => safetensors::Dtype::F32,
        DType::F64 => safetensors::Dtype::F64,
        DType::I32 => safetensors::Dtype::I32,
        _ => safetensors::Dtype::I64,
    }
}

/// The file-system operations of a save, counted so a test can stop the save after
/// any one of them as a crash would (nothing cleaned up).
pub(crate) struct Ops {
    /// Operations still allowed before the simulated crash (`None`: no crash).
    pub(crate) left: Option<usize>,
    /// Set once the simulated crash happened.
    pub(crate) crashed: bool,
}

impl Ops {
    /// No simulated crash.
    pub(crate) fn real() -> Ops {
        Ops { left: None, crashed: false }
    }

    /// One operation (`what`, on `path`) is done; fails as a crash would once the
    /// allowance is used up.
    pub(crate) fn did(&mut self, what: &str, path: &Path) -> Result<()> {
        match &mut self.left {
            Some(0) => {
                self.crashed = true;
                Err(io(path, format!("simulated crash after {what}")))
            }
            Some(n) => {
                *n -= 1;
                Ok(())
            }
            None => Ok(()),
        }
    }
}

/// Writes `bytes` to a new file `path` and syncs it; once the file is created (by this
/// call: `create_new`), its path goes into `written`.
fn write_synced(
    path: &Path,
    bytes: &[u8],
    ops: &mut Ops,
    written: &mut Vec<PathBuf>,
) -> Result<()> {
    let mut f =
        fs::OpenOptions::new().write(true).create_new(true).open(path).map_err(|e| io(path, e))?;
    written.push(path.to_path_buf());
    ops.did("create", path)?;
    f.write_all(bytes).map_err(|e| io(path, e))?;
    ops.did("write", path)?;
    f.sync_all().map_err(|e| io(path, e))?;
    ops.did("fsync", path)
}

/// Syncs a directory, making the entries created or renamed in it durable (where the
/// platform supports directory fsync).
pub(crate) fn sync_dir(path: &Path) {
    if let Ok(d) = File::open(path) {
        let _ = d.sync_all();
    }
}

/// The value a checkpoint keeps of a variable: the synchronised value of a
/// sync-on-write variable, the aggregated read of a sync-on-read one (replica 0's copy
/// when it has no aggregation).
fn saved_value(s: &VarState) -> Result<Tensor> {
    if s.sync == Synchronization::OnRead && s.aggregation == Aggregation::None {
        s.value_of(0)
    } else {
        s.read()
    }
}

impl Strategy {
    /// Saves every variable as a new checkpoint in `dir`: created if absent, or an
    /// existing empty directory. Anything else at `dir` is refused and left alone —
    /// this never replaces or deletes what it did not write. The index is written last,
    /// so a save cut short leaves no directory that restores. For rolling checkpoints
    /// of a training run use a [`CheckpointManager`](crate::CheckpointManager).
    ///
    /// With several processes every process calls it: process 0 writes (every
    /// process holds the same sync-on-write values) and all return once it has.
    pub fn save_checkpoint(&self, dir: impl AsRef<Path>) -> Result<()> {
        self.save_checkpoint_with(dir.as_ref(), None, &mut Ops::real())
    }

    /// [`save_checkpoint`](Self::save_checkpoint) with `metadata` (any JSON: a run's
    /// configuration, say) kept in the index, where
    /// [`checkpoint_metadata`](crate::checkpoint_metadata) reads it back.
    pub fn save_checkpoint_with_metadata(
        &self,
        dir: impl AsRef<Path>,
        metadata: &Value,
    ) -> Result<()> {
        self.save_checkpoint_with(dir.as_ref(), Some(metadata), &mut Ops::real())
    }

    pub(crate) fn save_checkpoint_with(
        &self,
        dir: &Path,
        metadata: Option<&Value>,
        ops: &mut Ops,
    ) -> Result<()> {
        if !self.is_multi_process() {
            return save(self, dir, metadata, ops);
        }
        if let Some(s) = self.states().iter().find(|s| s.sync == Synchronization::OnRead) {
            return Err(Error::Variable {
                variable: s.name.clone(),
                problem: "is synchronised on read, and other processes hold some of its copies: \
                          a multi-process checkpoint cannot save it"
                    .into(),
            });
        }
        let written =
            if self.local_replicas().start == 0 { save(self, dir, metadata, ops) } else { Ok(()) };
        self.sync()?;
        written
    }

    /// Restores every variable of this strategy from `dir`, resharding each onto the
    /// strategy's current layout. Refuses (changing nothing) a missing index, a file
    /// whose size or checksum differs from the index, or a variable that is missing or
    /// has another dtype or shape.
    pub fn restore_checkpoint(&self, dir: impl AsRef<Path>) -> Result<()> {
        restore(self, dir.as_ref())
    }
}

/// The metadata a checkpoint was saved with
/// ([`Strategy::save_checkpoint_with_metadata`]), `None` if it has none. Reads only the
/// index; [`Strategy::restore_checkpoint`] verifies the rest.
pub fn checkpoint_metadata(dir: impl AsRef<Path>) -> Result<Option<Value>> {
    let index_path = dir.as_ref().join(INDEX);
    let index = read_index(&index_path)?;
    Ok(index.get("metadata").cloned())
}

/// The variables a checkpoint holds: name, dtype and shape of each, from its index
/// (what a caller checks a model against before restoring).
pub fn checkpoint_variables(dir: impl AsRef<Path>) -> Result<Vec<(String, DType, Vec<usize>)>> {
    let index_path = dir.as_ref().join(INDEX);
    let index = read_index(&index_path)?;
    let mut out = Vec::new();
    for v in field(&index, "variables", &index_path)?.as_array().into_iter().flatten() {
        let name = field(v, "name", &index_path)?
            .as_str()
            .ok_or_else(|| corrupt(&index_path, "a variable without a name"))?;
        let dtype: DType = field(v, "dtype", &index_path)?
            .as_str()
            .and_then(|d| d.parse().ok())
            .ok_or_else(|| corrupt(&index_path, format!("variable {name}: bad dtype")))?;
        let shape = field(v, "shape", &index_path)?
            .as_array()
            .into_iter()
            .flatten()
            .map(|d| usize_of(d, &index_path))
            .collect::<Result<Vec<_>>>()?;
        out.push((name.to_string(), dtype, shape));
    }
    Ok(out)
}

fn read_index(index_path: &Path) -> Result<Value> {
    // An index is a few kilobytes per variable; refuse to read a huge file into memory.
    const MAX_INDEX: u64 = 256 << 20;
    let len = fs::metadata(index_path)
        .map_err(|e| {
            corrupt(index_path, format!("cannot read the index ({e}): not a complete checkpoint"))
        })?
        .len();
    if len > MAX_INDEX {
        return Err(corrupt(
            index_path,
            format!("the index is {len} bytes: not a checkpoint index"),
        ));
    }
    let text = fs::read(index_path).map_err(|e| {
        corrupt(index_path, format!("cannot read the index ({e}): not a complete checkpoint"))
    })?;
    let index: Value =
        serde_json::from_slice(&text).map_err(|e| corrupt(index_path, format!("bad JSON: {e}")))?;
    if field(&index, "format", index_path)?.as_str() != Some(FORMAT) {
        return Err(corrupt(index_path, "not a meshwork checkpoint index"));
    }
    if field(&index, "version", index_path)?.as_u64() != Some(VERSION) {
        return Err(corrupt(
            index_path,
            format!("unsupported version (this build reads {VERSION})"),
        ));
    }
    Ok(index)
}

/// Whether `dir` holds a meshwork checkpoint index (a complete checkpoint, unless its
/// files were damaged since).
pub(crate) fn is_checkpoint(dir: &Path) -> bool {
    read_index(&dir.join(INDEX)).is_ok()
}

/// A shard on its way to a file.
#[derive(Clone)]
struct Saved {
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

/// One variable on its way into a checkpoint: its sharding over device positions
/// `0..n` and the shard of each distinct region (replica 0 of it), with the position
/// whose file holds it.
/// One variable of a sharded checkpoint as its writer holds it: for writers that keep
/// their own shards (a training step compiled by [`spmd`](crate::spmd), a bridge to
/// another library) rather than a strategy's variables.
#[derive(Debug, Clone)]
pub struct CheckpointEntry {
    /// The variable's name.
    pub name: String,
    /// Its dtype.
    pub dtype: DType,
    /// Its global shape.
    pub shape: Vec<usize>,
    /// Its sharding over the writer's devices.
    pub hlo: HloSharding,
    /// The distinct shards, each once: `(device, region, data)`, the data shaped like
    /// its region.
    pub shards: Vec<(usize, Vec<std::ops::Range<usize>>, Tensor)>,
}

pub(crate) type Entry = CheckpointEntry;

/// The distinct regions a checkpoint holds of a value of `shape` under `sharding`, in
/// index-map order: its even split, or, where a dim does not divide, XLA's padded
/// layout with the empty trailing regions left out.
fn saved_regions(
    sharding: &meshwork_sharding::Sharding,
    shape: &[usize],
) -> Result<Vec<Vec<std::ops::Range<usize>>>> {
    let index = match sharding.index_map(shape, Mode::Strict) {
        Err(meshwork_sharding::Error::Indivisible { .. }) => {
            sharding.index_map(shape, Mode::Uneven)?
        }
        other => other?,
    };
    Ok(index
        .into_iter()
        .filter(|i| i.replica_id == 0 && i.ranges.iter().all(|r| !r.is_empty()))
        .map(|i| i.ranges)
        .collect())
}

/// Writes `entries` as a sharded checkpoint of `devices` devices in `dir` (a new or
/// empty directory; anything else is refused untouched), `metadata` in its index:
/// device `d` writes its regions to `shard-d.safetensors`, the index last. Every
/// non-empty region of every variable's sharding must be given exactly once, in
/// index-map order (where a dim does not divide, the regions of XLA's padded layout);
/// a strategy, a compiled step or [`read_checkpoint`] on any number of devices reads
/// it back.
pub fn write_checkpoint(
    dir: impl AsRef<Path>,
    devices: usize,
    entries: Vec<CheckpointEntry>,
    metadata: Option<&Value>,
) -> Result<()> {
    let dir = dir.as_ref();
    // Everything checked before the directory is made: what a reader will check.
    for e in &entries {
        let bad = |problem: String| corrupt(dir, format!("variable {}: {problem}", e.name));
        let sharding = logical_sharding(e.hlo.clone(), devices).map_err(|x| bad(x.to_string()))?;
        let regions = saved_regions(&sharding, &e.shape)?;
        if e.shards.len() != regions.len() {
            return Err(bad(format!(
                "{} shards for the {} regions of its sharding",
                e.shards.len(),
                regions.len()
            )));
        }
        for ((device, ranges, data), region) in e.shards.iter().zip(&regions) {
            if *device >= devices {
                return Err(bad(format!("a shard on device {device} of {devices}")));
            }
            if ranges != region {
                return Err(bad(format!(
                    "a shard covers {ranges:?}, the sharding's region is {region:?}"
                )));
            }
            let extent: Vec<usize> = ranges.iter().map(|r| r.len()).collect();
            if data.dtype() != e.dtype || data.shape() != extent.as_slice() {
                return Err(bad(format!(
                    "a shard of {} {:?} for a region {extent:?} of {}",
                    data.dtype(),
                    data.shape(),
                    e.dtype
                )));
            }
        }
    }
    write(dir, devices, 1, entries.into_iter().map(Ok), metadata, &mut Ops::real())
}

/// Reads the variables `wanted` (`(name, dtype, shape)`) whole from the checkpoint in
/// `dir`, saved on any number of devices: sizes, checksums, dtypes and shapes are all
/// verified before a value is returned.
pub fn read_checkpoint(
    dir: impl AsRef<Path>,
    wanted: &[(String, DType, Vec<usize>)],
) -> Result<Vec<Tensor>> {
    read(dir.as_ref(), wanted, "the reader")
}

fn save(strategy: &Strategy, dir: &Path, metadata: Option<&Value>, ops: &mut Ops) -> Result<()> {
    let logical = strategy.num_logical_devices();
    let states = strategy.states();
    let entries = states.iter().map(|s| {
        let value = saved_value(s)?;
        let shards = ops::shard(&value, &s.sharding)?;
        Ok(Entry {
            name: s.name.clone(),
            dtype: s.dtype,
            shape: s.shape.clone(),
            hlo: s.sharding.hlo().clone(),
            shards: s
                .index
                .iter()
                .zip(shards)
                .filter(|(index, _)| index.replica_id == 0)
                .map(|(index, shard)| (index.device.0 as usize, index.ranges.clone(), shard))
                .collect(),
        })
    });
    write(dir, logical, strategy.num_replicas_in_sync(), entries, metadata, ops)
}

/// Writes a checkpoint of `entries` (over `devices` positions, one shard file each)
/// into `dir`: created, or an existing empty directory; the index last.
pub(crate) fn write(
    dir: &Path,
    devices: usize,
    replicas: usize,
    entries: impl Iterator<Item = Result<Entry>>,
    metadata: Option<&Value>,
    ops: &mut Ops,
) -> Result<()> {
    // A new directory (its missing parents made too), or an existing empty one;
    // anything else is not ours to write in.
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        fs::create_dir_all(parent).map_err(|e| io(parent, e))?;
    }
    let created = match fs::create_dir(dir) {
        Ok(()) => true,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let meta = fs::symlink_metadata(dir).map_err(|e| io(dir, e))?;
            let empty =
                meta.is_dir() && fs::read_dir(dir).map_err(|e| io(dir, e))?.next().is_none();
            if !empty {
                return Err(io(
                    dir,
                    "already exists and is not an empty directory; a checkpoint is saved \
                     into a new directory and never replaces anything",
                ));
            }
            false
        }
        Err(e) => return Err(io(dir, e)),
    };
    ops.did("mkdir", dir)?;
    let tmp = dir;
    let mut written: Vec<PathBuf> = Vec::new();
    let result = (|| {
        // Per device position: its tensors.
        let mut files: Vec<Vec<Saved>> = vec![Vec::new(); devices];
        let mut variables = Vec::new();
        for entry in entries {
            let entry = entry?;
            let mut listed = Vec::new();
            for (k, (device, ranges, shard)) in entry.shards.iter().enumerate() {
                let tensor = format!("{}/{k}", entry.name);
                let bytes = ops::to_le_bytes(shard);
                listed.push(json!({
                    "file": format!("shard-{device}.safetensors"),
                    "tensor": tensor,
                    "ranges": ranges.iter().map(|r| [r.start, r.end]).collect::<Vec<_>>(),
                    "crc32c": crc32c::crc32c(&bytes),
                }));
                files[*device].push(Saved {
                    name: tensor,
                    dtype: entry.dtype,
                    shape: shard.shape().to_vec(),
                    bytes,
                });
            }
            variables.push(json!({
                "name": entry.name,
                "dtype": entry.dtype.to_string(),
                "shape": entry.shape,
                "sharding": entry.hlo.to_string(),
                "shards": listed,
            }));
        }
        let mut listed = Vec::new();
        for (device, tensors) in files.iter().enumerate() {
            let views = tensors
                .iter()
                .map(|t| {
                    TensorView::new(st_dtype(t.dtype), t.shape.clone(), &t.bytes)
                        .map(|v| (t.name.clone(), v))
                })
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(|e| io(tmp, e))?;
            let bytes = safetensors::serialize(views, None).map_err(|e| io(tmp, e))?;
            let file = format!("shard-{device}.safetensors");
            write_synced(&tmp.join(&file), &bytes, ops, &mut written)?;
            listed.push(
                json!({ "name": file, "bytes": bytes.len(), "crc32c": crc32c::crc32c(&bytes) }),
            );
        }
        let index = json!({
            "format": FORMAT,
            "version": VERSION,
            "replicas": replicas,
            "logical_devices": devices,
            "variables": variables,
            "files": listed,
        });
        let mut index = index;
        if let Some(m) = metadata {
            index["metadata"] = m.clone();
        }
        let text = serde_json::to_vec_pretty(&index).map_err(|e| io(tmp, e))?;
        // The index goes last: a directory without it is not a checkpoint.
        write_synced(&tmp.join(INDEX), &text, ops, &mut written)?;
        sync_dir(tmp);
        ops.did("fsync", tmp)
    })();
    if let Err(e) = result {
        if !ops.crashed {
            // Remove what this save wrote, and nothing else.
            for f in written.iter().rev() {
                let _ = fs::remove_file(f);
            }
            if created {
                let _ = fs::remove_dir(dir);
            }
        }
        return Err(e);
    }
    Ok(())
}

fn field<'a>(v: &'a Value, key: &str, path: &Path) -> Result<&'a Value> {
    v.get(key).ok_or_else(|| corrupt(path, format!("the index has no `{key}`")))
}

fn usize_of(v: &Value, path: &Path) -> Result<usize> {
    v.as_u64().map(|n| n as usize).ok_or_else(|| corrupt(path, format!("{v} is not a count")))
}

fn restore(strategy: &Strategy, dir: &Path) -> Result<()> {
    let wanted: Vec<(String, DType, Vec<usize>)> =
        strategy.states().iter().map(|s| (s.name.clone(), s.dtype, s.shape.clone())).collect();
    let values = read(dir, &wanted, "the strategy")?;
    let variables = strategy.variables();
    for (v, value) in variables.iter().zip(&values) {
        strategy.assign_variable(v, value)?;
    }
    Ok(())
}

/// Reads the variables `wanted` (name, dtype, shape) from the checkpoint in `dir`,
/// each assembled whole, after verifying every file's size and checksum, every
/// shard's checksum and region, and each variable's dtype and shape. Nothing is read
/// into a caller's state until all of it checks out.
/// A dtype or shape that differs is a mismatch saying what `holder` ("the strategy")
/// has.
pub(crate) fn read(
    dir: &Path,
    wanted: &[(String, DType, Vec<usize>)],
    holder: &str,
) -> Result<Vec<Tensor>> {
    let index_path = dir.join(INDEX);
    let index = read_index(&index_path)?;
    let saved_logical = usize_of(field(&index, "logical_devices", &index_path)?, &index_path)?;
    // Every file: present, of the recorded size and checksum.
    let mut contents = std::collections::HashMap::new();
    for f in field(&index, "files", &index_path)?.as_array().into_iter().flatten() {
        let name = field(f, "name", &index_path)?
            .as_str()
            .ok_or_else(|| corrupt(&index_path, "a file without a name"))?;
        if name.is_empty() || name.contains(['/', '\\']) || name.contains("..") {
            return Err(corrupt(&index_path, format!("file name {name:?} leaves the checkpoint")));
        }
        let path = dir.join(name);
        let want = usize_of(field(f, "bytes", &index_path)?, &index_path)?;
        // The size first, so a damaged index cannot make us read a huge file.
        let on_disk = fs::metadata(&path).map_err(|e| io(&path, e))?.len();
        if on_disk != want as u64 {
            return Err(corrupt(
                &path,
                format!("{on_disk} bytes, the index says {want}: cut short or changed"),
            ));
        }
        let bytes = fs::read(&path).map_err(|e| io(&path, e))?;
        if bytes.len() != want {
            return Err(corrupt(
                &path,
                format!("{} bytes, the index says {want}: cut short or changed", bytes.len()),
            ));
        }
        if Some(u64::from(crc32c::crc32c(&bytes))) != field(f, "crc32c", &index_path)?.as_u64() {
            return Err(corrupt(&path, "checksum mismatch"));
        }
        contents.insert(name.to_string(), bytes);
    }
    let parsed: std::collections::HashMap<&str, safetensors::SafeTensors<'_>> = contents
        .iter()
        .map(|(n, b)| {
            safetensors::SafeTensors::deserialize(b)
                .map(|st| (n.as_str(), st))
                .map_err(|e| corrupt(&dir.join(n), e.to_string()))
        })
        .collect::<Result<_>>()?;
    let saved = field(&index, "variables", &index_path)?.as_array().cloned().unwrap_or_default();
    let mismatch = |variable: &str, problem: String| Error::CheckpointMismatch {
        path: dir.to_path_buf(),
        variable: variable.into(),
        problem,
    };
    // Build every variable's global value before changing any.
    let mut values = Vec::new();
    for (name, want_dtype, want_shape) in wanted {
        let entry = saved
            .iter()
            .find(|v| v.get("name").and_then(Value::as_str) == Some(name.as_str()))
            .ok_or_else(|| mismatch(name, "not in the checkpoint".into()))?;
        let dtype: DType = field(entry, "dtype", &index_path)?
            .as_str()
            .and_then(|d| d.parse().ok())
            .ok_or_else(|| corrupt(&index_path, format!("variable {name}: bad dtype")))?;
        let shape: Vec<usize> = field(entry, "shape", &index_path)?
            .as_array()
            .into_iter()
            .flatten()
            .map(|d| usize_of(d, &index_path))
            .collect::<Result<_>>()?;
        if dtype != *want_dtype || shape != *want_shape {
            return Err(mismatch(
                name,
                format!(
                    "saved as {}, {holder} has {}",
                    crate::variable::spec(dtype, &shape),
                    crate::variable::spec(*want_dtype, want_shape)
                ),
            ));
        }
        let hlo: HloSharding = field(entry, "sharding", &index_path)?
            .as_str()
            .and_then(|h| h.parse().ok())
            .ok_or_else(|| corrupt(&index_path, format!("variable {name}: bad sharding")))?;
        // The saved regions must tile the value exactly as the saved sharding says: its
        // even split, or, where a dim does not divide, XLA's padded layout with the
        // empty trailing regions left out (as a writer of uneven shards saves them).
        let saved_sharding = logical_sharding(hlo, saved_logical)?;
        let regions = saved_regions(&saved_sharding, &shape)?;
        let shards = field(entry, "shards", &index_path)?.as_array().cloned().unwrap_or_default();
        if shards.len() != regions.len() {
            return Err(corrupt(
                &index_path,
                format!("variable {}: {} shards for {} regions", name, shards.len(), regions.len()),
            ));
        }
        let mut global = Tensor::zeros(dtype, &shape)?;
        for (shard, region) in shards.iter().zip(&regions) {
            let file = field(shard, "file", &index_path)?.as_str().unwrap_or_default();
            let tensor = field(shard, "tensor", &index_path)?.as_str().unwrap_or_default();
            let ranges: Vec<std::ops::Range<usize>> = field(shard, "ranges", &index_path)?
                .as_array()
                .into_iter()
                .flatten()
                .map(|r| Ok(usize_of(&r[0], &index_path)?..usize_of(&r[1], &index_path)?))
                .collect::<Result<_>>()?;
            if &ranges != region {
                return Err(corrupt(
                    &index_path,
                    format!(
                        "variable {}: shard {tensor} covers {ranges:?}, the sharding says {region:?}",
                        name
                    ),
                ));
            }
            let st = parsed.get(file).ok_or_else(|| {
                corrupt(&index_path, format!("variable {}: unknown file {file}", name))
            })?;
            let view = st.tensor(tensor).map_err(|e| corrupt(&dir.join(file), e.to_string()))?;
            if Some(u64::from(crc32c::crc32c(view.data())))
                != field(shard, "crc32c", &index_path)?.as_u64()
            {
                return Err(corrupt(
                    &dir.join(file),
                    format!("tensor {tensor}: checksum mismatch"),
                ));
            }
            let extent: Vec<usize> = ranges.iter().map(|r| r.len()).collect();
            let data = ops::from_le_bytes(dtype, &extent, view.data()).ok_or_else(|| {
                corrupt(
                    &dir.join(file),
                    format!("tensor {tensor}: {} bytes for {extent:?}", view.data().len()),
                )
            })?;
            place(&mut global, &data, &ranges);
        }
        values.push(global);
    }
    Ok(values)
}

/// Copies `shard` into `global` at `ranges`.
fn place(global: &mut Tensor, shard: &Tensor, ranges: &[std::ops::Range<usize>]) {
    fn go<T: Clone>(g: &mut ArrayD<T>, s: &ArrayD<T>, ranges: &[std::ops::Range<usize>]) {
        let mut view = g.slice_each_axis_mut(|ax| Slice::from(ranges[ax.axis.index()].clone()));
        let shape = view.shape().to_vec();
        view.assign(&s.view().into_shape_with_order(IxDyn(&shape)).expect("same extent"));
    }
    match (global, shard) {
        (Tensor::F32(g), Tensor::F32(s)) => go(g, s, ranges),
        (Tensor::F64(g), Tensor::F64(s)) => go(g, s, ranges),
        (Tensor::I32(g), Tensor::I32(s)) => go(g, s, ranges),
        (Tensor::I64(g), Tensor::I64(s)) => go(g, s, ranges),
        _ => unreachable!("one dtype"),
    }
}
