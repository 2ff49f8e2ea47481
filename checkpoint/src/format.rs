//! The checkpoint format: every variable's distinct shards in safetensors files (one
//! per device position), and a JSON index with each variable's dtype, shape, sharding
//! and shard regions, CRC32C checksums of every file and tensor, and optional run
//! metadata. The index is written last, so a directory without it is not a checkpoint;
//! reading verifies sizes, checksums, dtypes and shapes before any value is returned,
//! and assembles each variable whole — whatever sharding and how many devices saved it.
//!
//! Writing never replaces or deletes anything it did not create: a checkpoint goes into
//! a new (or empty) directory. Rolling checkpoints of a training run, each written aside
//! and renamed into place, live in a [`CheckpointManager`](crate::CheckpointManager)'s
//! directory.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use meshwork_sharding::{HloSharding, Mode, Sharding};
use meshwork_types::{DType, DeviceId, Element, Shape, Tensor, TensorSpec};
use ndarray::{ArrayD, IxDyn, Slice};
use safetensors::tensor::TensorView;
use serde_json::{Value, json};

use crate::{Error, Result};

const FORMAT: &str = "meshwork-checkpoint";
/// Most device positions a checkpoint has (device ids are 32-bit).
const MAX_POSITIONS: usize = 1 << 24;
const VERSION: u64 = 1;
const INDEX: &str = "index.json";

fn io(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::File { path: path.to_path_buf(), problem: e.to_string() }
}

fn corrupt(path: &Path, problem: impl Into<String>) -> Error {
    Error::File { path: path.to_path_buf(), problem: problem.into() }
}

/// A dtype's safetensors name: every dtype of a host tensor has one.
fn st_dtype(d: DType) -> safetensors::Dtype {
    use safetensors::Dtype as S;
    match d {
        DType::Bool => S::BOOL,
        DType::U8 => S::U8,
        DType::U16 => S::U16,
        DType::U32 => S::U32,
        DType::U64 => S::U64,
        DType::I8 => S::I8,
        DType::I16 => S::I16,
        DType::I32 => S::I32,
        DType::I64 => S::I64,
        DType::F16 => S::F16,
        DType::BF16 => S::BF16,
        DType::F32 => S::F32,
        DType::F64 => S::F64,
    }
}

/// `dtype[shape]` for messages.
fn spec(dtype: DType, shape: &[usize]) -> String {
    Shape::new(shape)
        .map(|s| TensorSpec::new(dtype, s).to_string())
        .unwrap_or_else(|_| format!("{dtype}{shape:?}"))
}

/// `hlo` over device positions `0..devices`.
pub(crate) fn positions(hlo: HloSharding, devices: usize) -> Result<Sharding> {
    Ok(Sharding::new(hlo, (0..devices as u32).map(DeviceId).collect())?)
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

/// Syncs a directory, making the entries created or renamed in it durable (a file
/// system that cannot sync directories is no error; any other failure is).
pub(crate) fn sync_dir(path: &Path) -> Result<()> {
    meshwork_io::files::sync_dir(path).map_err(|e| io(path, format!("cannot sync it: {e}")))
}

/// The metadata a checkpoint was saved with, `None` if it has none. Reads only the
/// index; [`read_checkpoint`] verifies the rest.
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

/// The bytes of the regular file `path`, at most `max` of them; `Ok(None)` when it
/// holds more. Opened without waiting (a FIFO with no writer would block an ordinary
/// open for ever) and refused unless it is a regular file.
fn read_regular(path: &Path, max: u64) -> std::io::Result<Option<Vec<u8>>> {
    use std::io::Read;
    let (file, len) = meshwork_io::files::open_regular_io(path)?;
    if len > max {
        return Ok(None);
    }
    let mut bytes = Vec::new();
    file.take(max + 1).read_to_end(&mut bytes)?;
    Ok((bytes.len() as u64 <= max).then_some(bytes))
}

fn read_index(index_path: &Path) -> Result<Value> {
    // An index is a few kilobytes per variable; refuse to read a huge file into memory.
    const MAX_INDEX: u64 = 256 << 20;
    let text = read_regular(index_path, MAX_INDEX)
        .map_err(|e| {
            corrupt(index_path, format!("cannot read the index ({e}): not a complete checkpoint"))
        })?
        .ok_or_else(|| {
            corrupt(
                index_path,
                format!("the index is over {MAX_INDEX} bytes: not a checkpoint index"),
            )
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
pub fn is_checkpoint(dir: impl AsRef<Path>) -> bool {
    let dir = dir.as_ref();
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

/// One variable of a sharded checkpoint as its writer holds it: its sharding over
/// device positions `0..n` and the shard of each distinct region (replica 0 of it),
/// with the position whose file holds it.
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

/// The distinct regions a checkpoint holds of a value of `shape` under `sharding`, in
/// index-map order: its even split, or, where a dim does not divide, XLA's padded
/// layout with the empty trailing regions left out.
fn saved_regions(sharding: &Sharding, shape: &[usize]) -> Result<Vec<Vec<std::ops::Range<usize>>>> {
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
    check(dir, devices, &entries)?;
    write(dir, devices, entries, metadata, &mut Ops::real())
}

/// Checks `entries` as a reader will, before anything is written: every non-empty
/// region of every variable's sharding over `devices` positions given once, in
/// index-map order, of the variable's dtype.
pub(crate) fn check(dir: &Path, devices: usize, entries: &[CheckpointEntry]) -> Result<()> {
    if devices == 0 || devices > MAX_POSITIONS {
        return Err(corrupt(dir, format!("{devices} device positions (1 to {MAX_POSITIONS})")));
    }
    for e in entries {
        let bad = |problem: String| corrupt(dir, format!("variable {}: {problem}", e.name));
        let sharding = positions(e.hlo.clone(), devices).map_err(|x| bad(x.to_string()))?;
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
    Ok(())
}

/// Reads the variables `wanted` (`(name, dtype, shape)`) whole from the checkpoint in
/// `dir`, saved on any number of devices: sizes, checksums, dtypes and shapes are all
/// verified before a value is returned.
pub fn read_checkpoint(
    dir: impl AsRef<Path>,
    wanted: &[(String, DType, Vec<usize>)],
) -> Result<Vec<Tensor>> {
    read(dir.as_ref(), wanted)
}

/// Writes a checkpoint of `entries` (over `devices` positions, one shard file each)
/// into `dir`: created, or an existing empty directory; the index last.
pub(crate) fn write(
    dir: &Path,
    devices: usize,
    entries: Vec<CheckpointEntry>,
    metadata: Option<&Value>,
    ops: &mut Ops,
) -> Result<()> {
    let created = make_dir(dir)?;
    ops.did("mkdir", dir)?;
    let mut written: Vec<PathBuf> = Vec::new();
    let result = (|| {
        let part = write_shards(dir, 0..devices, devices, entries, ops, &mut written)?;
        let (variables, files) = merge(dir, devices, vec![(0, part)])?;
        write_index(dir, devices, variables, files, metadata, ops, &mut written)
    })();
    if let Err(e) = result {
        if !ops.crashed {
            remove_written(&written, created.then_some(dir));
        }
        return Err(e);
    }
    Ok(())
}

/// Creates `dir` (its missing parents too), or accepts an existing empty directory;
/// whether it was created. Anything else is not ours to write in.
pub(crate) fn make_dir(dir: &Path) -> Result<bool> {
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        fs::create_dir_all(parent).map_err(|e| io(parent, e))?;
    }
    match fs::create_dir(dir) {
        Ok(()) => Ok(true),
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
            Ok(false)
        }
        Err(e) => Err(io(dir, e)),
    }
}

/// Removes the files a failed save wrote (and `dir`, when the save created it):
/// nothing else.
pub(crate) fn remove_written(written: &[PathBuf], dir: Option<&Path>) {
    for f in written.iter().rev() {
        let _ = fs::remove_file(f);
    }
    if let Some(dir) = dir {
        let _ = fs::remove_dir(dir);
    }
}

/// What one writer of a checkpoint wrote: the shard files of its device positions
/// (each file's name, size and checksum) and, for every variable, the header and the
/// shards it wrote by their index among the variable's regions. A checkpoint written
/// by several processes is each one's part, merged into one index by the process
/// that commits it ([`CheckpointManager::commit_parts`](crate::CheckpointManager::commit_parts)).
#[derive(Debug, Clone, PartialEq)]
pub struct WrittenPart {
    /// The directory the files were written into (a name in the checkpoint
    /// directory, for a managed part).
    pub(crate) dir: String,
    /// `{name, bytes, crc32c}` of each file, by device position.
    pub(crate) files: Vec<(usize, Value)>,
    /// Per variable: its header (`name`, `dtype`, `shape`, `sharding`) and its shards
    /// written here, `(region index, {file, tensor, ranges, crc32c})`.
    pub(crate) variables: Vec<(Value, Vec<(usize, Value)>)>,
}

impl WrittenPart {
    /// The part as bytes, to send to the process that commits the checkpoint.
    pub fn to_bytes(&self) -> Vec<u8> {
        let variables: Vec<Value> = self
            .variables
            .iter()
            .map(|(header, shards)| {
                json!({
                    "header": header,
                    "shards": shards.iter().map(|(k, s)| json!([k, s])).collect::<Vec<_>>(),
                })
            })
            .collect();
        let files: Vec<Value> = self.files.iter().map(|(d, f)| json!([d, f])).collect();
        serde_json::to_vec(&json!({ "dir": self.dir, "files": files, "variables": variables }))
            .unwrap_or_default()
    }

    /// A part from [`to_bytes`](Self::to_bytes)' bytes (sent by process `from`, for
    /// messages); every count in it is checked when the parts are merged.
    pub fn from_bytes(bytes: &[u8], from: &Path) -> Result<WrittenPart> {
        let bad = |what: &str| corrupt(from, format!("a written part {what}"));
        let v: Value =
            serde_json::from_slice(bytes).map_err(|e| bad(&format!("is not JSON: {e}")))?;
        let dir = v.get("dir").and_then(Value::as_str).ok_or_else(|| bad("names no directory"))?;
        let pair = |x: &Value| -> Result<(usize, Value)> {
            let k = x.get(0).and_then(Value::as_u64).and_then(|k| usize::try_from(k).ok());
            match (k, x.get(1)) {
                (Some(k), Some(v)) => Ok((k, v.clone())),
                _ => Err(bad("holds a malformed entry")),
            }
        };
        let files = v
            .get("files")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("lists no files"))?
            .iter()
            .map(pair)
            .collect::<Result<Vec<_>>>()?;
        let variables = v
            .get("variables")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("lists no variables"))?
            .iter()
            .map(|x| {
                let header = x.get("header").cloned().ok_or_else(|| bad("has no header"))?;
                let shards = x
                    .get("shards")
                    .and_then(Value::as_array)
                    .ok_or_else(|| bad("has no shards"))?
                    .iter()
                    .map(pair)
                    .collect::<Result<Vec<_>>>()?;
                Ok((header, shards))
            })
            .collect::<Result<Vec<_>>>()?;
        if dir.is_empty() || dir.contains(['/', '\\']) || dir.contains("..") {
            return Err(bad(&format!("names directory {dir:?}, which leaves the checkpoint")));
        }
        Ok(WrittenPart { dir: dir.to_string(), files, variables })
    }
}

/// Writes the files of device positions `positions` (of `devices`) into `dir`: each
/// position's shards of `entries` (which must hold only shards of those positions,
/// each at its region's index) in `shard-<position>.safetensors`, synced. The files
/// created go into `written`.
pub(crate) fn write_shards(
    dir: &Path,
    positions: std::ops::Range<usize>,
    devices: usize,
    entries: Vec<CheckpointEntry>,
    ops: &mut Ops,
    written: &mut Vec<PathBuf>,
) -> Result<WrittenPart> {
    let mut files: Vec<Vec<Saved>> = vec![Vec::new(); positions.len()];
    let mut variables = Vec::with_capacity(entries.len());
    for entry in entries {
        let bad = |problem: String| corrupt(dir, format!("variable {}: {problem}", entry.name));
        let sharding = positions_sharding(&entry, devices).map_err(|x| bad(x.to_string()))?;
        let regions = saved_regions(&sharding, &entry.shape)?;
        let mut listed = Vec::with_capacity(entry.shards.len());
        for (device, ranges, shard) in &entry.shards {
            if !positions.contains(device) {
                return Err(bad(format!(
                    "a shard on device {device}; this writer holds {positions:?}"
                )));
            }
            let k = regions.iter().position(|r| r == ranges).ok_or_else(|| {
                bad(format!("a shard covers {ranges:?}, not a region of its sharding"))
            })?;
            let extent: Vec<usize> = ranges.iter().map(|r| r.len()).collect();
            if shard.dtype() != entry.dtype || shard.shape() != extent.as_slice() {
                return Err(bad(format!(
                    "a shard of {} {:?} for a region {extent:?} of {}",
                    shard.dtype(),
                    shard.shape(),
                    entry.dtype
                )));
            }
            let tensor = format!("{}/{k}", entry.name);
            let bytes = shard.to_le_bytes();
            listed.push((
                k,
                json!({
                    "file": format!("shard-{device}.safetensors"),
                    "tensor": tensor,
                    "ranges": ranges.iter().map(|r| [r.start, r.end]).collect::<Vec<_>>(),
                    "crc32c": crc32c::crc32c(&bytes),
                }),
            ));
            files[device - positions.start].push(Saved {
                name: tensor,
                dtype: entry.dtype,
                shape: shard.shape().to_vec(),
                bytes,
            });
        }
        let header = json!({
            "name": entry.name,
            "dtype": entry.dtype.to_string(),
            "shape": entry.shape,
            "sharding": entry.hlo.to_string(),
        });
        variables.push((header, listed));
    }
    let mut listed = Vec::with_capacity(files.len());
    for (i, tensors) in files.iter().enumerate() {
        let device = positions.start + i;
        let views = tensors
            .iter()
            .map(|t| {
                TensorView::new(st_dtype(t.dtype), t.shape.clone(), &t.bytes)
                    .map(|v| (t.name.clone(), v))
            })
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| io(dir, e))?;
        let bytes = safetensors::serialize(views, None).map_err(|e| io(dir, e))?;
        let file = format!("shard-{device}.safetensors");
        write_synced(&dir.join(&file), &bytes, ops, written)?;
        listed.push((
            device,
            json!({ "name": file, "bytes": bytes.len(), "crc32c": crc32c::crc32c(&bytes) }),
        ));
    }
    sync_dir(dir)?;
    ops.did("fsync", dir)?;
    let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    Ok(WrittenPart { dir: name, files: listed, variables })
}

/// An entry's sharding over positions `0..devices`.
fn positions_sharding(e: &CheckpointEntry, devices: usize) -> Result<Sharding> {
    positions(e.hlo.clone(), devices)
}

/// The index's `variables` and `files` from every writer's part (`(rank, part)`):
/// every position's file exactly once, every variable's regions each written once
/// and by the same header in every part. The files name the rank that wrote them
/// when there is more than one writer.
pub(crate) fn merge(
    dir: &Path,
    devices: usize,
    parts: Vec<(usize, WrittenPart)>,
) -> Result<(Vec<Value>, Vec<Value>)> {
    let many = parts.len() > 1;
    let mut files: Vec<Option<Value>> = vec![None; devices];
    let first = parts.first().ok_or_else(|| corrupt(dir, "no writer wrote any part"))?;
    let count = first.1.variables.len();
    let mut shards: Vec<Vec<Option<Value>>> = Vec::with_capacity(count);
    let mut headers = Vec::with_capacity(count);
    for (header, _) in &first.1.variables {
        let name = header.get("name").and_then(Value::as_str).unwrap_or("?");
        let shape: Vec<usize> = header
            .get("shape")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .map(|d| usize_of(d, dir))
            .collect::<Result<_>>()?;
        let hlo: HloSharding = header
            .get("sharding")
            .and_then(Value::as_str)
            .and_then(|h| h.parse().ok())
            .ok_or_else(|| corrupt(dir, format!("variable {name}: bad sharding")))?;
        let regions = saved_regions(&positions(hlo, devices)?, &shape)?;
        shards.push(vec![None; regions.len()]);
        headers.push(header.clone());
    }
    for (rank, part) in parts {
        if part.variables.len() != count {
            return Err(corrupt(
                dir,
                format!("rank {rank} wrote {} variables, rank 0 {count}", part.variables.len()),
            ));
        }
        for (device, mut file) in part.files {
            let slot = files.get_mut(device).ok_or_else(|| {
                corrupt(dir, format!("rank {rank} wrote a file of position {device} of {devices}"))
            })?;
            if slot.is_some() {
                return Err(corrupt(dir, format!("position {device}'s file was written twice")));
            }
            if many {
                file["rank"] = rank.into();
            }
            *slot = Some(file);
        }
        for (v, (header, listed)) in part.variables.into_iter().enumerate() {
            if header != headers[v] {
                return Err(corrupt(
                    dir,
                    format!(
                        "rank {rank} wrote variable {header} where rank 0 wrote {}",
                        headers[v]
                    ),
                ));
            }
            for (k, s) in listed {
                let slot = shards[v].get_mut(k).filter(|s| s.is_none()).ok_or_else(|| {
                    corrupt(
                        dir,
                        format!(
                            "rank {rank} wrote region {k} of {header} again or past its regions"
                        ),
                    )
                })?;
                *slot = Some(s);
            }
        }
    }
    let files = files
        .into_iter()
        .enumerate()
        .map(|(d, f)| f.ok_or_else(|| corrupt(dir, format!("no writer wrote position {d}'s file"))))
        .collect::<Result<Vec<_>>>()?;
    let variables = headers
        .into_iter()
        .zip(shards)
        .map(|(mut header, listed)| {
            let listed = listed
                .into_iter()
                .enumerate()
                .map(|(k, s)| {
                    s.ok_or_else(|| corrupt(dir, format!("no writer wrote region {k} of {header}")))
                })
                .collect::<Result<Vec<_>>>()?;
            header["shards"] = Value::Array(listed);
            Ok(header)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((variables, files))
}

/// Writes the index of a checkpoint of `devices` positions into `dir`, last, synced.
pub(crate) fn write_index(
    dir: &Path,
    devices: usize,
    variables: Vec<Value>,
    files: Vec<Value>,
    metadata: Option<&Value>,
    ops: &mut Ops,
    written: &mut Vec<PathBuf>,
) -> Result<()> {
    let mut index = json!({
        "format": FORMAT,
        "version": VERSION,
        "logical_devices": devices,
        "variables": variables,
        "files": files,
    });
    if let Some(m) = metadata {
        index["metadata"] = m.clone();
    }
    let text = serde_json::to_vec_pretty(&index).map_err(|e| io(dir, e))?;
    // The index goes last: a directory without it is not a checkpoint.
    write_synced(&dir.join(INDEX), &text, ops, written)?;
    sync_dir(dir)?;
    ops.did("fsync", dir)
}

fn field<'a>(v: &'a Value, key: &str, path: &Path) -> Result<&'a Value> {
    v.get(key).ok_or_else(|| corrupt(path, format!("the index has no `{key}`")))
}

fn usize_of(v: &Value, path: &Path) -> Result<usize> {
    v.as_u64()
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| corrupt(path, format!("{v} is not a count")))
}

/// Reads the variables `wanted` (name, dtype, shape) from the checkpoint in `dir`,
/// each assembled whole, after verifying every file's size and checksum, every
/// shard's checksum and region, and each variable's dtype and shape. Nothing is read
/// into a caller's state until all of it checks out.
fn read(dir: &Path, wanted: &[(String, DType, Vec<usize>)]) -> Result<Vec<Tensor>> {
    let index_path = dir.join(INDEX);
    let index = read_index(&index_path)?;
    let saved_logical = usize_of(field(&index, "logical_devices", &index_path)?, &index_path)?;
    let listed = field(&index, "files", &index_path)?.as_array().map_or(0, Vec::len);
    // One shard file per position: the count sizes nothing before it is checked.
    if saved_logical == 0 || saved_logical > MAX_POSITIONS || saved_logical != listed {
        return Err(corrupt(
            &index_path,
            format!("{saved_logical} device positions and {listed} shard files"),
        ));
    }
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
        let bytes = read_regular(&path, want as u64)
            .map_err(|e| io(&path, e))?
            .ok_or_else(|| corrupt(&path, format!("more bytes than the {want} the index says")))?;
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
    let parsed: std::collections::HashMap<&str, (meshwork_io::safetensors::Header, &[u8])> =
        contents
            .iter()
            .map(|(n, b)| {
                meshwork_io::safetensors::parse(b)
                    .map(|h| (n.as_str(), (h, b.as_slice())))
                    .map_err(|e| corrupt(&dir.join(n), e))
            })
            .collect::<Result<_>>()?;
    let saved = field(&index, "variables", &index_path)?.as_array().cloned().unwrap_or_default();
    // Build every variable's global value before changing any.
    let mut values = Vec::new();
    for (name, want_dtype, want_shape) in wanted {
        let Listed { dtype, shape, regions, shards } = saved_variable(
            dir,
            &index_path,
            &saved,
            saved_logical,
            (name, *want_dtype, want_shape),
        )?;
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
            let (header, bytes) = parsed.get(file).ok_or_else(|| {
                corrupt(&index_path, format!("variable {}: unknown file {file}", name))
            })?;
            let entry = header
                .get(tensor)
                .ok_or_else(|| corrupt(&dir.join(file), format!("no tensor {tensor}")))?;
            if entry.dtype != st_dtype(dtype) {
                return Err(corrupt(
                    &dir.join(file),
                    format!("tensor {tensor} is {:?}, the index says {dtype}", entry.dtype),
                ));
            }
            // Inside the file: the header check bounded every entry by its size.
            let view = &bytes[entry.start as usize..(entry.start + entry.bytes) as usize];
            if Some(u64::from(crc32c::crc32c(view)))
                != field(shard, "crc32c", &index_path)?.as_u64()
            {
                return Err(corrupt(
                    &dir.join(file),
                    format!("tensor {tensor}: checksum mismatch"),
                ));
            }
            let extent: Vec<usize> = ranges.iter().map(|r| r.len()).collect();
            let data = Tensor::from_le_bytes(dtype, &extent, view).map_err(|_| {
                corrupt(
                    &dir.join(file),
                    format!("tensor {tensor}: {} bytes for {extent:?}", view.len()),
                )
            })?;
            place(&mut global, &data, &ranges);
        }
        values.push(global);
    }
    Ok(values)
}

/// Reads, of each variable `wanted[v]` (name, dtype, shape), only the boxes
/// `regions[v]` (each `[start, end)` per dim): every saved shard overlapping a box is
/// read alone from its file (the file's header, then the shard's bytes), its checksum
/// verified, and its overlap copied in. For a process that holds some positions of a
/// mesh: it reads what its devices hold, not the whole checkpoint. The index is
/// checked as [`read_checkpoint`] checks it (every shard's region, the files' sizes),
/// but a file's own checksum covers bytes not read here, so it is not.
pub fn read_checkpoint_parts(
    dir: impl AsRef<Path>,
    wanted: &[(String, DType, Vec<usize>)],
    regions: &[Vec<Vec<std::ops::Range<usize>>>],
) -> Result<Vec<Vec<Tensor>>> {
    let dir = dir.as_ref();
    let index_path = dir.join(INDEX);
    let index = read_index(&index_path)?;
    let saved_logical = usize_of(field(&index, "logical_devices", &index_path)?, &index_path)?;
    if saved_logical == 0 || saved_logical > MAX_POSITIONS {
        return Err(corrupt(&index_path, format!("{saved_logical} device positions")));
    }
    // Each file's recorded size, checked against the disk before any is read.
    let mut sizes = std::collections::HashMap::new();
    for f in field(&index, "files", &index_path)?.as_array().into_iter().flatten() {
        let name = field(f, "name", &index_path)?
            .as_str()
            .ok_or_else(|| corrupt(&index_path, "a file without a name"))?;
        if name.is_empty() || name.contains(['/', '\\']) || name.contains("..") {
            return Err(corrupt(&index_path, format!("file name {name:?} leaves the checkpoint")));
        }
        let want = usize_of(field(f, "bytes", &index_path)?, &index_path)? as u64;
        let path = dir.join(name);
        let on_disk = fs::symlink_metadata(&path).map_err(|e| io(&path, e))?;
        if !on_disk.is_file() || on_disk.len() != want {
            return Err(corrupt(
                &path,
                format!("{} bytes, the index says {want}: cut short or changed", on_disk.len()),
            ));
        }
        sizes.insert(name.to_string(), want);
    }
    let saved = field(&index, "variables", &index_path)?.as_array().cloned().unwrap_or_default();
    let mut headers: std::collections::HashMap<String, (File, meshwork_io::safetensors::Header)> =
        Default::default();
    let mut out = Vec::with_capacity(wanted.len());
    for ((name, want_dtype, want_shape), boxes) in wanted.iter().zip(regions) {
        let Listed { dtype, shape, regions: saved_regions, shards } = saved_variable(
            dir,
            &index_path,
            &saved,
            saved_logical,
            (name, *want_dtype, want_shape),
        )?;
        let mut parts = Vec::with_capacity(boxes.len());
        for b in boxes {
            if b.len() != shape.len()
                || b.iter().zip(&shape).any(|(r, &d)| r.start > r.end || r.end > d)
            {
                return Err(corrupt(
                    dir,
                    format!("variable {name}: box {b:?} of a {shape:?} value"),
                ));
            }
            let extent: Vec<usize> = b.iter().map(|r| r.len()).collect();
            let mut part = Tensor::zeros(dtype, &extent)?;
            for (shard, region) in shards.iter().zip(&saved_regions) {
                let overlap: Vec<std::ops::Range<usize>> = region
                    .iter()
                    .zip(b)
                    .map(|(r, q)| r.start.max(q.start)..r.end.min(q.end))
                    .collect();
                if overlap.iter().any(|r| r.start >= r.end) && !overlap.is_empty() {
                    continue;
                }
                let file = field(shard, "file", &index_path)?.as_str().unwrap_or_default();
                let tensor = field(shard, "tensor", &index_path)?.as_str().unwrap_or_default();
                let Some(&size) = sizes.get(file) else {
                    return Err(corrupt(
                        &index_path,
                        format!("variable {name}: unknown file {file}"),
                    ));
                };
                let path = dir.join(file);
                if !headers.contains_key(file) {
                    let (f, len) =
                        meshwork_io::files::open_regular_io(&path).map_err(|e| io(&path, e))?;
                    if len != size {
                        return Err(corrupt(
                            &path,
                            format!("{len} bytes, the index says {size}: changed"),
                        ));
                    }
                    let header = meshwork_io::safetensors::read_header(&f, len)
                        .map_err(|e| corrupt(&path, e))?;
                    headers.insert(file.to_string(), (f, header));
                }
                let (f, header) = &headers[file];
                let entry = header
                    .get(tensor)
                    .ok_or_else(|| corrupt(&path, format!("no tensor {tensor}")))?;
                let region_extent: Vec<usize> = region.iter().map(|r| r.len()).collect();
                if entry.shape != region_extent || entry.dtype != st_dtype(dtype) {
                    return Err(corrupt(
                        &path,
                        format!(
                            "tensor {tensor}: {:?} of {:?}, the index says {region_extent:?} of {dtype}",
                            entry.shape, entry.dtype
                        ),
                    ));
                }
                let whole: Vec<std::ops::Range<usize>> =
                    region_extent.iter().map(|&d| 0..d).collect();
                let bytes = meshwork_io::safetensors::read_box_of(f, entry, &whole)
                    .map_err(|e| corrupt(&path, e))?;
                if Some(u64::from(crc32c::crc32c(&bytes)))
                    != field(shard, "crc32c", &index_path)?.as_u64()
                {
                    return Err(corrupt(&path, format!("tensor {tensor}: checksum mismatch")));
                }
                let data = Tensor::from_le_bytes(dtype, &region_extent, &bytes)
                    .map_err(|e| corrupt(&path, e.to_string()))?;
                copy_overlap(&mut part, b, &data, region, &overlap);
            }
            parts.push(part);
        }
        out.push(parts);
    }
    Ok(out)
}

/// Copies `overlap` (global coordinates) of `data` (which holds `region`) into `part`
/// (which holds `target`).
fn copy_overlap(
    part: &mut Tensor,
    target: &[std::ops::Range<usize>],
    data: &Tensor,
    region: &[std::ops::Range<usize>],
    overlap: &[std::ops::Range<usize>],
) {
    fn go<T: Element>(
        p: &mut Tensor,
        d: &ArrayD<T>,
        target: &[std::ops::Range<usize>],
        region: &[std::ops::Range<usize>],
        overlap: &[std::ops::Range<usize>],
    ) {
        let p = T::unwrap_mut(p).expect("a part of the variable's dtype");
        let src = d.slice_each_axis(|ax| {
            let k = ax.axis.index();
            Slice::from(overlap[k].start - region[k].start..overlap[k].end - region[k].start)
        });
        let mut dst = p.slice_each_axis_mut(|ax| {
            let k = ax.axis.index();
            Slice::from(overlap[k].start - target[k].start..overlap[k].end - target[k].start)
        });
        dst.assign(&src);
    }
    meshwork_types::each_tensor!(data, d => go(part, d, target, region, overlap))
}

/// A variable as an index lists it, checked against what is wanted of it.
struct Listed {
    dtype: DType,
    shape: Vec<usize>,
    /// The regions its shards must cover, in order.
    regions: Vec<Vec<std::ops::Range<usize>>>,
    /// Its shards' index entries, one per region.
    shards: Vec<Value>,
}

/// Variable `name` of the index's `saved` variables (of a checkpoint of
/// `saved_logical` positions in `dir`): of the dtype and shape wanted, its shards one
/// per region of its saved sharding — its even split, or, where a dim does not divide,
/// XLA's padded layout with the empty trailing regions left out (as a writer of uneven
/// shards saves them).
fn saved_variable(
    dir: &Path,
    index_path: &Path,
    saved: &[Value],
    saved_logical: usize,
    (name, want_dtype, want_shape): (&String, DType, &[usize]),
) -> Result<Listed> {
    let entry = saved
        .iter()
        .find(|v| v.get("name").and_then(Value::as_str) == Some(name.as_str()))
        .ok_or_else(|| Error::Missing { path: dir.to_path_buf(), variable: name.clone() })?;
    let dtype: DType = field(entry, "dtype", index_path)?
        .as_str()
        .and_then(|d| d.parse().ok())
        .ok_or_else(|| corrupt(index_path, format!("variable {name}: bad dtype")))?;
    let shape: Vec<usize> = field(entry, "shape", index_path)?
        .as_array()
        .into_iter()
        .flatten()
        .map(|d| usize_of(d, index_path))
        .collect::<Result<_>>()?;
    if dtype != want_dtype || shape != want_shape {
        return Err(Error::Mismatch {
            path: dir.to_path_buf(),
            variable: name.clone(),
            saved: spec(dtype, &shape),
            wanted: spec(want_dtype, want_shape),
        });
    }
    let hlo: HloSharding = field(entry, "sharding", index_path)?
        .as_str()
        .and_then(|h| h.parse().ok())
        .ok_or_else(|| corrupt(index_path, format!("variable {name}: bad sharding")))?;
    let regions = saved_regions(&positions(hlo, saved_logical)?, &shape)?;
    let shards = field(entry, "shards", index_path)?.as_array().cloned().unwrap_or_default();
    if shards.len() != regions.len() {
        return Err(corrupt(
            index_path,
            format!("variable {name}: {} shards for {} regions", shards.len(), regions.len()),
        ));
    }
    Ok(Listed { dtype, shape, regions, shards })
}

/// Copies `shard` (of `global`'s dtype, as both were made from the index's) into
/// `global` at `ranges`.
fn place(global: &mut Tensor, shard: &Tensor, ranges: &[std::ops::Range<usize>]) {
    fn go<T: Element>(g: &mut Tensor, s: &ArrayD<T>, ranges: &[std::ops::Range<usize>]) {
        let g = T::unwrap_mut(g).expect("a shard of the variable's dtype");
        let mut view = g.slice_each_axis_mut(|ax| Slice::from(ranges[ax.axis.index()].clone()));
        let shape = view.shape().to_vec();
        view.assign(&s.view().into_shape_with_order(IxDyn(&shape)).expect("same extent"));
    }
    meshwork_types::each_tensor!(shard, s => go(global, s, ranges))
}
