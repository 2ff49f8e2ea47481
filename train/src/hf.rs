//! Hugging Face checkpoint folders of every model with a Hugging Face layout (GPT-2,
//! the Llama family): a folder `save_pretrained` writes (`config.json` and
//! `model.safetensors`, or the shards a `model.safetensors.index.json` names), indexed
//! from the safetensors headers by the model's own names ([`meshwork_nn::HfFormat`]) so that any
//! box of a weight — a device's shard — is read alone ([`HfShards`]), and written back
//! in the same layout ([`write()`]; sharded with an index past 5 GB).
//!
//! Tensors may be f64, f32, bf16 or f16; they become the run's dtype. A missing tensor,
//! a wrong shape, one the model does not have, or a `config.json` field that would
//! change the computation and that meshwork does not compute is a usage error naming
//! it. The base model's own dropout is not applied: meshwork trains it without (a
//! LoRA adapter's `lora_dropout` is applied).

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use meshwork_nn::{ConfigError, Model};
use meshwork_types::{DType, Tensor};
use serde_json::Value as Json;

use crate::{Error, Result, files};

/// The most bytes a `config.json` or an index may take.
const JSON_LIMIT: u64 = 16 << 20;

/// The most bytes of tensor data one file of an export holds (`transformers`' 5 GB).
pub const SHARD_BYTES: u64 = 5_000_000_000;

fn bad(flag: &str, path: &Path, problem: impl std::fmt::Display) -> Error {
    Error::flag(flag, format!("{}: {problem}", path.display()))
}

/// A `config.json` field refused, in one line naming the flag, the file and the key.
pub fn config_error(flag: &str, path: &Path, e: ConfigError) -> Error {
    bad(flag, path, e)
}

/// `dir/config.json` as written (named by `--flag` in errors).
pub fn read_config(flag: &str, dir: &Path) -> Result<Json> {
    let path = dir.join("config.json");
    let text = files::read_capped(flag, &path, JSON_LIMIT)?;
    let config: Json =
        serde_json::from_slice(&text).map_err(|e| bad(flag, &path, format!("not JSON: {e}")))?;
    if !config.is_object() {
        return Err(bad(flag, &path, "not a JSON object"));
    }
    Ok(config)
}

/// The files beside a `tokenizer.json` that describe the same tokenizer to
/// `transformers`' `AutoTokenizer` (its class, special tokens and chat template).
const TOKENIZER_COMPANIONS: [&str; 4] = [
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
];

/// The tokenizer files an export copies (name in the export, bytes): `tokenizer`
/// as `tokenizer.json` and, when it is a folder's `tokenizer.json`, the companion
/// files beside it ([`TOKENIZER_COMPANIONS`]); each a regular file of at most
/// [`crate::data::MAX_TOKENIZER_BYTES`], else refused naming it.
pub(crate) fn tokenizer_files(tokenizer: &Path) -> Result<Vec<(String, Vec<u8>)>> {
    let limit = crate::data::MAX_TOKENIZER_BYTES;
    let mut out =
        vec![("tokenizer.json".to_string(), files::read_capped("tokenizer", tokenizer, limit)?)];
    if tokenizer.file_name().is_some_and(|n| n == "tokenizer.json")
        && let Some(dir) = tokenizer.parent()
    {
        for name in TOKENIZER_COMPANIONS {
            let path = dir.join(name);
            if std::fs::symlink_metadata(&path).is_ok() {
                out.push((name.to_string(), files::read_capped("tokenizer", &path, limit)?));
            }
        }
    }
    Ok(out)
}

/// Writes `files` (name, bytes) into the export folder `dir`, each a new file.
pub(crate) fn write_files(flag: &str, dir: &Path, named: &[(String, Vec<u8>)]) -> Result<()> {
    for (name, bytes) in named {
        let path = dir.join(name);
        files::write_new(&path, bytes).map_err(|e| bad(flag, &path, e))?;
    }
    Ok(())
}

/// The folder's `generation_config.json` (generation's defaults, its end-of-text ids
/// among them), if it has one: a JSON object, or refused naming it.
pub fn read_generation_config(flag: &str, dir: &Path) -> Result<Option<Json>> {
    let path = dir.join("generation_config.json");
    // Anything at the name (a dangling link, a FIFO) is read, and refused if it is
    // not a regular file: only a name nothing holds means "none".
    if std::fs::symlink_metadata(&path).is_err() {
        return Ok(None);
    }
    let text = files::read_capped(flag, &path, JSON_LIMIT)?;
    let config: Json =
        serde_json::from_slice(&text).map_err(|e| bad(flag, &path, format!("not JSON: {e}")))?;
    if !config.is_object() {
        return Err(bad(flag, &path, "not a JSON object"));
    }
    Ok(Some(config))
}

/// The safetensors files of a checkpoint folder: `model.safetensors`, or the shards
/// its index names (plain file names in the folder).
fn weight_files(flag: &str, dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if !index.is_file() {
        return Err(bad(flag, dir, "no model.safetensors or model.safetensors.index.json in it"));
    }
    let text = files::read_capped(flag, &index, JSON_LIMIT)?;
    let json: Json =
        serde_json::from_slice(&text).map_err(|e| bad(flag, &index, format!("not JSON: {e}")))?;
    let map = json
        .get("weight_map")
        .and_then(Json::as_object)
        .ok_or_else(|| bad(flag, &index, "no weight_map"))?;
    let mut out: Vec<PathBuf> = Vec::new();
    for (tensor, file) in map {
        let name = file.as_str().filter(|f| {
            !f.is_empty() && !f.contains('/') && !f.contains('\\') && *f != "." && *f != ".."
        });
        let file = name.ok_or_else(|| {
            bad(flag, &index, format!("{tensor} is in {file}, not a file name in the folder"))
        })?;
        let path = dir.join(file);
        if !out.contains(&path) {
            out.push(path);
        }
    }
    out.sort();
    Ok(out)
}

/// The model a checkpoint folder's `config.json` describes (GPT-2 or the Llama family,
/// by its `model_type`) over a context of `seq` positions, and the config as written.
pub fn model_of(flag: &str, dir: &Path, seq: usize) -> Result<(crate::Net, Json)> {
    let config = read_config(flag, dir)?;
    let net = crate::family::lm_from_config(flag, &dir.join("config.json"), &config, seq)?;
    Ok((net, config))
}

/// Every weight of `model` from the checkpoint folder `dir` (named by `--flag`), as
/// `dtype`, reading at most `limit` bytes of weights.
pub fn read(
    flag: &str,
    dir: &Path,
    model: &dyn Model,
    dtype: DType,
    limit: u64,
) -> Result<HashMap<String, Tensor>> {
    let shards = index(flag, dir, model, dtype, limit)?;
    model
        .parameters()
        .into_iter()
        .map(|(name, shape)| {
            let whole: Vec<Range<usize>> = shape.iter().map(|&d| 0..d).collect();
            let t = shards.read(&name, &whole, dtype)?;
            Ok((name, t))
        })
        .collect()
}

/// Where a checkpoint's tensors are, read from the safetensors headers alone: each
/// parameter's file, dtype, shape and data offset. [`read`](Self::read) reads any box
/// of a tensor — a device's shard — and only its bytes.
#[derive(Debug)]
pub struct HfShards {
    flag: String,
    files: Vec<PathBuf>,
    tensors: HashMap<String, Stored>,
    /// Bytes of tensor data read so far.
    read: std::sync::atomic::AtomicU64,
}

/// A tensor as stored.
#[derive(Debug, Clone)]
struct Stored {
    file: usize,
    /// Its header entry: name, shape, where its bytes are.
    entry: meshwork_io::safetensors::Entry,
    dtype: DType,
}

/// A stored dtype meshwork reads as a float, `None` for any other.
fn float_dtype(d: meshwork_io::safetensors::Dtype) -> Option<DType> {
    use meshwork_io::safetensors::Dtype as S;
    match d {
        S::F64 => Some(DType::F64),
        S::F32 => Some(DType::F32),
        S::BF16 => Some(DType::BF16),
        S::F16 => Some(DType::F16),
        _ => None,
    }
}

impl HfShards {
    /// Box `ranges` (`[start, stop)` per dim) of parameter `name`, as `dtype`: only
    /// the box's bytes are read (a run per row of its last dim, or fewer where rows
    /// are whole), converted, and checked finite.
    pub fn read(&self, name: &str, ranges: &[Range<usize>], dtype: DType) -> Result<Tensor> {
        let stored = self.tensors.get(name).ok_or_else(|| {
            Error::flag(&self.flag, format!("the checkpoint has no tensor {name}"))
        })?;
        let path = &self.files[stored.file];
        let what = format!("--{}", self.flag);
        let (file, _) = files::open_regular(&what, path)?;
        let bytes = meshwork_io::safetensors::read_box(&what, path, &file, &stored.entry, ranges)?;
        self.read.fetch_add(bytes.len() as u64, std::sync::atomic::Ordering::Relaxed);
        let dims: Vec<usize> = ranges.iter().map(|r| r.end - r.start).collect();
        let name = &stored.entry.name;
        let t = Tensor::from_le_bytes(stored.dtype, &dims, &bytes)
            .map_err(|e| bad(&self.flag, path, format!("{}: {e}", name)))?;
        let values = t.to_f64();
        if let Some((k, v)) = values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(bad(
                &self.flag,
                path,
                format!("{}[{k}] (flat, in the box read) is {v}", name),
            ));
        }
        let t = Tensor::from_f64(dtype, &dims, &values)
            .map_err(|e| bad(&self.flag, path, format!("{}: {e}", name)))?;
        // A value past the run's dtype's range would become an infinity.
        if let Some((k, _)) = t.to_f64().iter().enumerate().find(|(_, v)| !v.is_finite()) {
            let v = values[k];
            return Err(bad(
                &self.flag,
                path,
                format!("{}[{k}] (flat, in the box read) is {v}, past {dtype}", name),
            ));
        }
        Ok(t)
    }

    /// A safetensors file of meshwork's tensor names (`--init FILE`) indexed from its
    /// header alone: each tensor f32 or f64 (as [`read_init`](crate::read_init)
    /// takes them), its bytes inside the file. Its values are read by [`read`](Self::read),
    /// a box at a time, checked finite there.
    pub(crate) fn of_file(flag: &str, path: &Path) -> Result<HfShards> {
        let (_, header) = meshwork_io::safetensors::open(&format!("--{flag}"), path)?;
        let mut tensors = HashMap::new();
        for entry in header.entries {
            let name = entry.name.clone();
            let dtype = match entry.dtype {
                meshwork_io::safetensors::Dtype::F64 => DType::F64,
                meshwork_io::safetensors::Dtype::F32 => DType::F32,
                other => {
                    return Err(Error::flag(flag, format!("{name} is {other:?}; want F32 or F64")));
                }
            };
            tensors.insert(name, Stored { file: 0, entry, dtype });
        }
        Ok(HfShards {
            flag: flag.to_string(),
            files: vec![path.to_path_buf()],
            tensors,
            read: 0.into(),
        })
    }

    /// Every tensor's name and shape as stored.
    pub(crate) fn shapes(&self) -> impl Iterator<Item = (&str, &[usize])> {
        self.tensors.iter().map(|(n, s)| (n.as_str(), s.entry.shape.as_slice()))
    }

    /// A parameter's shape as stored.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.tensors.get(name).map(|s| s.entry.shape.as_slice())
    }

    /// A CRC-32C of every tensor as stored — its name, dtype, shape and bytes, in the
    /// order of their names — whatever files hold them: what a LoRA run's checkpoint
    /// records of the base its adapter was trained over, so that a resumed run refuses
    /// another base. Reads the data once, 8 MiB at a time.
    pub(crate) fn fingerprint(&self) -> Result<u32> {
        use std::os::unix::fs::FileExt;
        let what = format!("--{}", self.flag);
        let mut names: Vec<&String> = self.tensors.keys().collect();
        names.sort();
        let mut crc = 0u32;
        let mut buffer = vec![0u8; 8 << 20];
        let mut open: Option<(usize, std::fs::File)> = None;
        for name in names {
            let stored = &self.tensors[name];
            let e = &stored.entry;
            crc = crc32c::crc32c_append(crc, name.as_bytes());
            crc = crc32c::crc32c_append(crc, format!("{:?}{:?}", e.dtype, e.shape).as_bytes());
            let path = &self.files[stored.file];
            if open.as_ref().is_none_or(|(k, _)| *k != stored.file) {
                open = Some((stored.file, files::open_regular(&what, path)?.0));
            }
            let (_, file) = open.as_ref().expect("opened just above");
            let mut at = e.start;
            let end = e.start + e.bytes;
            while at < end {
                let n =
                    usize::try_from(end - at).map_or(buffer.len(), |left| left.min(buffer.len()));
                file.read_exact_at(&mut buffer[..n], at)
                    .map_err(|err| bad(&self.flag, path, format!("{name}: {err}")))?;
                crc = crc32c::crc32c_append(crc, &buffer[..n]);
                at += n as u64;
            }
        }
        Ok(crc)
    }

    /// Bytes of tensor data [`read`](Self::read) has read so far.
    pub fn bytes_read(&self) -> u64 {
        self.read.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// The checkpoint folder `dir` (named by `--flag`) of `model` checked and indexed from
/// its safetensors headers, no weight read: where each weight is. Every tensor is
/// checked (one of the model's, by [`HfFormat::parameter_of`] in either layout the
/// model reads; the model's shape; a float dtype; stored once; none missing; its bytes
/// inside its file), and the weights kept as `dtype` must fit in `limit` bytes.
///
/// [`HfFormat::parameter_of`]: meshwork_nn::HfFormat::parameter_of
pub fn index(
    flag: &str,
    dir: &Path,
    model: &dyn Model,
    dtype: DType,
    limit: u64,
) -> Result<HfShards> {
    let Some(hf) = model.hf() else {
        return Err(bad(flag, dir, format!("the {} has no Hugging Face layout", model.family())));
    };
    let params = model.parameters();
    // The weights as read (the file) and as kept (f64 values, then the run's dtype),
    // against the limit before any is read.
    let elements: u64 =
        params.iter().map(|(_, s)| s.iter().map(|&d| d as u64).product::<u64>()).sum();
    let need = elements.saturating_mul(8 + dtype.size_in_bytes() as u64);
    if need > limit {
        return Err(bad(
            flag,
            dir,
            format!(
                "its {elements} weights take about {need} bytes in memory; the limit is {limit}"
            ),
        ));
    }
    let want: HashMap<&str, &Vec<usize>> = params.iter().map(|(n, s)| (n.as_str(), s)).collect();
    let files_ = weight_files(flag, dir)?;
    let mut tensors = HashMap::new();
    for (f, path) in files_.iter().enumerate() {
        // Every entry's range is checked here, those the model skips too.
        let (_, header) = meshwork_io::safetensors::open(&format!("--{flag}"), path)?;
        for entry in header.entries {
            let name = entry.name.clone();
            let param = match hf.parameter_of(&name) {
                meshwork_nn::Stored::Parameter(param) => param,
                meshwork_nn::Stored::Skipped => continue,
                meshwork_nn::Stored::Foreign => {
                    return Err(bad(
                        flag,
                        path,
                        format!("{name} is not a tensor of the {}", model.family()),
                    ));
                }
            };
            let Some(&shape) = want.get(param.as_str()) else {
                return Err(bad(
                    flag,
                    path,
                    format!("{name} is not a tensor of the {}", model.family()),
                ));
            };
            if entry.shape != **shape {
                return Err(bad(
                    flag,
                    path,
                    format!("{name} is {:?}; the config makes it {shape:?}", entry.shape),
                ));
            }
            let Some(dtype) = float_dtype(entry.dtype) else {
                return Err(bad(
                    flag,
                    path,
                    format!("{name} is {:?}; want F64, F32, BF16 or F16", entry.dtype),
                ));
            };
            if tensors.insert(param, Stored { file: f, entry, dtype }).is_some() {
                return Err(bad(flag, path, format!("{name} is stored twice")));
            }
        }
    }
    if let Some((name, _)) = params.iter().find(|(n, _)| !tensors.contains_key(n)) {
        return Err(bad(flag, dir, format!("no tensor {}", hf.stored_name(name))));
    }
    Ok(HfShards { flag: flag.to_string(), files: files_, tensors, read: 0.into() })
}

/// Checks, before any work, that `dir` can take an export: absent (in a folder that
/// exists) or an empty folder.
pub fn check_export(flag: &str, dir: &Path) -> Result<()> {
    match std::fs::symlink_metadata(dir) {
        Ok(m) if m.is_dir() => {
            let empty = std::fs::read_dir(dir).map_err(|e| bad(flag, dir, e))?.next().is_none();
            if empty { Ok(()) } else { Err(bad(flag, dir, "exists and is not an empty folder")) }
        }
        Ok(_) => Err(bad(flag, dir, "exists and is not an empty folder")),
        Err(_) => {
            let parent =
                dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
            if parent.is_dir() {
                Ok(())
            } else {
                Err(bad(flag, dir, format!("folder {} does not exist", parent.display())))
            }
        }
    }
}

/// Writes `model`'s `weights` (by parameter name, f32 or f64) into the new folder `dir`
/// as `save_pretrained` lays it out: `config.json` (`config` as it was read, its
/// dtype key — `dtype`, or 4.x's `torch_dtype` where it has one — set to the
/// weights'), `generation_config.json` where `generation` is some, and
/// `model.safetensors`, or past [`SHARD_BYTES`] of tensor data the files
/// `model-0000k-of-0000n.safetensors` and `model.safetensors.index.json`. `dir` must not
/// exist or be empty; nothing in it is replaced.
pub fn write(
    flag: &str,
    dir: &Path,
    described: (&dyn Model, &Json, Option<&Json>),
    weights: &HashMap<String, Tensor>,
) -> Result<()> {
    write_sharded(flag, dir, described, weights, SHARD_BYTES)
}

/// [`write()`] with files of at most `shard_bytes` of tensor data (a larger tensor
/// alone in its file).
pub fn write_sharded(
    flag: &str,
    dir: &Path,
    (model, config, generation): (&dyn Model, &Json, Option<&Json>),
    weights: &HashMap<String, Tensor>,
    shard_bytes: u64,
) -> Result<()> {
    let Some(hf) = model.hf() else {
        return Err(bad(flag, dir, format!("the {} has no Hugging Face layout", model.family())));
    };
    if dir.exists() {
        let empty = std::fs::read_dir(dir).map_err(|e| bad(flag, dir, e))?.next().is_none();
        if !empty || !dir.is_dir() {
            return Err(bad(flag, dir, "exists and is not an empty folder"));
        }
    } else {
        std::fs::create_dir_all(dir).map_err(|e| bad(flag, dir, format!("cannot create: {e}")))?;
    }
    let mut stored = Vec::new();
    let mut dtype = None;
    for (name, shape) in model.parameters() {
        let t = weights.get(&name).ok_or_else(|| Error::usage(format!("no weight {name}")))?;
        if t.shape() != &shape[..] {
            return Err(Error::usage(format!("{name} is {:?}, want {shape:?}", t.shape())));
        }
        let d = match t.dtype() {
            DType::F64 => safetensors::Dtype::F64,
            DType::F32 => safetensors::Dtype::F32,
            other => return Err(Error::usage(format!("{name} is {other}; want f32 or f64"))),
        };
        dtype = Some(t.dtype());
        stored.push((hf.stored_name(&name), d, shape, t.to_le_bytes()));
    }
    // Files of at most `shard_bytes` of tensor data each (a larger tensor alone).
    let mut groups: Vec<Vec<usize>> = vec![Vec::new()];
    let mut bytes = 0u64;
    for (k, (_, _, _, data)) in stored.iter().enumerate() {
        let size = data.len() as u64;
        if bytes > 0 && bytes + size > shard_bytes {
            groups.push(Vec::new());
            bytes = 0;
        }
        groups.last_mut().expect("a group").push(k);
        bytes += size;
    }
    let n = groups.len();
    let name_of = |k: usize| match n {
        1 => "model.safetensors".to_string(),
        _ => format!("model-{:05}-of-{n:05}.safetensors", k + 1),
    };
    let mut weight_map = serde_json::Map::new();
    let mut total = 0u64;
    for (k, group) in groups.iter().enumerate() {
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = group
            .iter()
            .map(|&i| {
                let (name, d, shape, data) = &stored[i];
                total += data.len() as u64;
                weight_map.insert(name.clone(), Json::String(name_of(k)));
                let view = safetensors::tensor::TensorView::new(*d, shape.clone(), data)
                    .map_err(|e| Error::usage(format!("{name}: {e}")))?;
                Ok((name.clone(), view))
            })
            .collect::<Result<_>>()?;
        // `{"format": "pt"}`, which older transformers require of a safetensors file.
        let metadata = [("format".to_string(), "pt".to_string())].into_iter().collect();
        let data = safetensors::serialize(views, Some(metadata)).map_err(|e| bad(flag, dir, e))?;
        let path = dir.join(name_of(k));
        files::write_new(&path, &data).map_err(|e| bad(flag, &path, e))?;
    }
    if n > 1 {
        let index =
            serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        let text = serde_json::to_vec_pretty(&index).map_err(|e| bad(flag, dir, e))?;
        let path = dir.join("model.safetensors.index.json");
        files::write_new(&path, &text).map_err(|e| bad(flag, &path, e))?;
    }
    let mut config = config.clone();
    if let (Some(obj), Some(d)) = (config.as_object_mut(), dtype) {
        let name = if d == DType::F64 { "float64" } else { "float32" };
        let key = if obj.contains_key("torch_dtype") && !obj.contains_key("dtype") {
            "torch_dtype"
        } else {
            "dtype"
        };
        obj.insert(key.into(), Json::String(name.into()));
    }
    let text = serde_json::to_vec_pretty(&config).map_err(|e| bad(flag, dir, e))?;
    let path = dir.join("config.json");
    files::write_new(&path, &text).map_err(|e| bad(flag, &path, e))?;
    if let Some(generation) = generation {
        let text = serde_json::to_vec_pretty(generation).map_err(|e| bad(flag, dir, e))?;
        let path = dir.join("generation_config.json");
        files::write_new(&path, &text).map_err(|e| bad(flag, &path, e))?;
    }
    Ok(())
}
