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

/// Syncs a directory, making the entries created or renamed in it durable (where the
/// platform supports directory fsync).
pub(crate) fn sync_dir(path: &Path) {
    if let Ok(d) = File::open(path) {
        let _ = d.sync_all();
    }
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
    use std::os::unix::fs::OpenOptionsExt;
    let file = fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    if meta.len() > max {
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
            let mut listed = Vec::new();
            for (k, (device, ranges, shard)) in entry.shards.iter().enumerate() {
                let tensor = format!("{}/{k}", entry.name);
                let bytes = shard.to_le_bytes();
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
    let parsed: std::collections::HashMap<&str, safetensors::SafeTensors<'_>> = contents
        .iter()
        .map(|(n, b)| {
            safetensors::SafeTensors::deserialize(b)
                .map(|st| (n.as_str(), st))
                .map_err(|e| corrupt(&dir.join(n), e.to_string()))
        })
        .collect::<Result<_>>()?;
    let saved = field(&index, "variables", &index_path)?.as_array().cloned().unwrap_or_default();
    // Build every variable's global value before changing any.
    let mut values = Vec::new();
    for (name, want_dtype, want_shape) in wanted {
        let entry = saved
            .iter()
            .find(|v| v.get("name").and_then(Value::as_str) == Some(name.as_str()))
            .ok_or_else(|| Error::Missing { path: dir.to_path_buf(), variable: name.clone() })?;
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
            return Err(Error::Mismatch {
                path: dir.to_path_buf(),
                variable: name.clone(),
                saved: spec(dtype, &shape),
                wanted: spec(*want_dtype, want_shape),
            });
        }
        let hlo: HloSharding = field(entry, "sharding", &index_path)?
            .as_str()
            .and_then(|h| h.parse().ok())
            .ok_or_else(|| corrupt(&index_path, format!("variable {name}: bad sharding")))?;
        // The saved regions must tile the value exactly as the saved sharding says: its
        // even split, or, where a dim does not divide, XLA's padded layout with the
        // empty trailing regions left out (as a writer of uneven shards saves them).
        let saved_sharding = positions(hlo, saved_logical)?;
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
            let data = Tensor::from_le_bytes(dtype, &extent, view.data()).map_err(|_| {
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
