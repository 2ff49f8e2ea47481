//! Hugging Face GPT-2 checkpoints: a folder `GPT2LMHeadModel.save_pretrained` writes
//! (`config.json` and `model.safetensors`, or the shards a
//! `model.safetensors.index.json` names) read into a [`Gpt2`] and its weights by the
//! model's parameter names, and written back in the same layout.
//!
//! Both layouts users meet load: `save_pretrained`'s names (`transformer.h.0…`) and the
//! original checkpoints' (`h.0…`, no prefix). The attention-mask buffers
//! (`attn.bias`, `attn.masked_bias`) and a stored `lm_head.weight` (tied to `wte`) are
//! skipped. Tensors may be f64, f32, bf16 or f16; they become the run's dtype. A
//! missing tensor, a wrong shape, an unknown tensor or `model_type`, or an attention
//! variant meshwork does not compute (`scale_attn_weights: false`,
//! `scale_attn_by_inverse_layer_idx: true`) is a usage error naming it. Dropout
//! (`*_pdrop`) is not applied: meshwork trains without it.

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use meshwork_nn::Gpt2;
use meshwork_types::{DType, Tensor};
use serde_json::Value as Json;

use crate::{Error, Result, files};

/// The most bytes a `config.json` or an index may take.
const JSON_LIMIT: u64 = 16 << 20;

/// A GPT-2 checkpoint as read: the model's sizes, its `config.json` as written (kept
/// for the export), and every weight by parameter name.
#[derive(Debug, Clone)]
pub struct HfGpt2 {
    /// The sizes.
    pub model: Gpt2,
    /// `config.json` as it was.
    pub config: Json,
    /// The weights, by [`Gpt2::parameters`]' names, of the dtype asked for.
    pub weights: HashMap<String, Tensor>,
}

fn bad(flag: &str, path: &Path, problem: impl std::fmt::Display) -> Error {
    Error::flag(flag, format!("{}: {problem}", path.display()))
}

/// The GPT-2 sizes of a Hugging Face `config.json` (`path` names it in errors).
pub fn gpt2_config(flag: &str, path: &Path, config: &Json) -> Result<Gpt2> {
    match config.get("model_type").and_then(Json::as_str) {
        Some("gpt2") => {}
        Some(other) => {
            return Err(bad(flag, path, format!("model_type \"{other}\"; meshwork reads gpt2")));
        }
        None => return Err(bad(flag, path, "no model_type (want \"gpt2\")")),
    }
    // `gelu_pytorch_tanh` is the same tanh approximation as `gelu_new`.
    if let Some(act) = config.get("activation_function").and_then(Json::as_str)
        && act != "gelu_new"
        && act != "gelu_pytorch_tanh"
    {
        return Err(bad(flag, path, format!("activation_function \"{act}\"; GPT-2's is gelu_new")));
    }
    // Attention variants meshwork does not compute are refused, not ignored.
    if config.get("scale_attn_weights").and_then(Json::as_bool) == Some(false) {
        return Err(bad(
            flag,
            path,
            "scale_attn_weights false (unscaled attention) is not supported",
        ));
    }
    if config.get("scale_attn_by_inverse_layer_idx").and_then(Json::as_bool) == Some(true) {
        return Err(bad(
            flag,
            path,
            "scale_attn_by_inverse_layer_idx true (scores divided by the layer's index) is not supported",
        ));
    }
    if config.get("tie_word_embeddings").and_then(Json::as_bool) == Some(false) {
        return Err(bad(flag, path, "untied word embeddings; GPT-2 ties lm_head to wte"));
    }
    let size = |key: &str| -> Result<usize> {
        let v = config.get(key).and_then(Json::as_u64).filter(|&v| v > 0);
        let v = v.ok_or_else(|| bad(flag, path, format!("{key} is not a positive integer")))?;
        usize::try_from(v)
            .ok()
            .filter(|&v| v <= 1 << 24)
            .ok_or_else(|| bad(flag, path, format!("{key} = {v} is beyond 2^24")))
    };
    let dim = size("n_embd")?;
    let heads = size("n_head")?;
    if !dim.is_multiple_of(heads) {
        return Err(bad(flag, path, format!("n_head = {heads} does not divide n_embd = {dim}")));
    }
    let inner = match config.get("n_inner") {
        None | Some(Json::Null) => dim * 4,
        Some(_) => size("n_inner")?,
    };
    let eps = match config.get("layer_norm_epsilon") {
        None => 1e-5,
        Some(v) => v
            .as_f64()
            .filter(|e| e.is_finite() && *e > 0.0)
            .ok_or_else(|| bad(flag, path, "layer_norm_epsilon is not a positive number"))?,
    };
    let layers = size("n_layer")?;
    if layers > 1 << 12 {
        return Err(bad(flag, path, format!("n_layer = {layers} is beyond 4096")));
    }
    let model = Gpt2 {
        vocab: size("vocab_size")?,
        positions: size("n_positions")?,
        dim,
        layers,
        heads,
        inner,
        eps,
    };
    // Every parameter's element count fits.
    for (name, shape) in model.parameters() {
        if shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).is_none() {
            return Err(bad(flag, path, format!("{name} of {shape:?} is too large")));
        }
    }
    Ok(model)
}

/// The model's name for checkpoint tensor `name`: `Some` for a parameter (with
/// `save_pretrained`'s prefix added to an original checkpoint's name), `None` for what
/// is skipped (the attention-mask buffers, a stored tied `lm_head`).
fn canonical(name: &str) -> Option<String> {
    if name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias") {
        return None;
    }
    if name == "lm_head.weight" {
        return None;
    }
    if name.starts_with("transformer.") {
        Some(name.to_string())
    } else {
        Some(format!("transformer.{name}"))
    }
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
    let text = files::read_file(flag, &index, JSON_LIMIT)?;
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

/// Reads the GPT-2 checkpoint folder `dir` (named by `--flag`), its weights as
/// `dtype` (f32 or f64), reading at most `limit` bytes of weights.
pub fn read_gpt2(flag: &str, dir: &Path, dtype: DType, limit: u64) -> Result<HfGpt2> {
    let (mut hf, shards) = index_gpt2(flag, dir, dtype, limit)?;
    for (name, shape) in hf.model.parameters() {
        let whole: Vec<Range<usize>> = shape.iter().map(|&d| 0..d).collect();
        hf.weights.insert(name.clone(), shards.read(&name, &whole, dtype)?);
    }
    Ok(hf)
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
    /// Its name in the file.
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    /// The absolute offset of its first byte.
    offset: u64,
}

impl HfShards {
    /// Box `ranges` (`[start, stop)` per dim) of parameter `name`, as `dtype`: only
    /// the box's bytes are read (a run per row of its last dim, or fewer where rows
    /// are whole), converted, and checked finite.
    pub fn read(&self, name: &str, ranges: &[Range<usize>], dtype: DType) -> Result<Tensor> {
        use std::os::unix::fs::FileExt;
        let stored = self.tensors.get(name).ok_or_else(|| {
            Error::flag(&self.flag, format!("the checkpoint has no tensor {name}"))
        })?;
        let path = &self.files[stored.file];
        let shape = &stored.shape;
        if ranges.len() != shape.len()
            || ranges.iter().zip(shape).any(|(r, &d)| r.start > r.end || r.end > d)
        {
            return Err(bad(&self.flag, path, format!("{name}: no box {ranges:?} in {shape:?}")));
        }
        let size = stored.dtype.size_in_bytes();
        let dims: Vec<usize> = ranges.iter().map(|r| r.end - r.start).collect();
        let count: usize = dims.iter().product();
        // Trailing dims taken whole join one run.
        let mut run = 1;
        let mut inner = shape.len();
        while inner > 0 && ranges[inner - 1] == (0..shape[inner - 1]) {
            run *= shape[inner - 1];
            inner -= 1;
        }
        if inner > 0 {
            run *= dims[inner - 1];
        }
        let strides: Vec<usize> =
            (0..shape.len()).map(|d| shape[d + 1..].iter().product()).collect();
        let (file, _) = files::open_regular(&format!("--{}", self.flag), path)?;
        let mut bytes = Vec::new();
        bytes
            .try_reserve_exact(count * size)
            .map_err(|_| bad(&self.flag, path, format!("{name}: no memory for {count} values")))?;
        let mut chunk = vec![0u8; run * size];
        // Each run's first index: the outer dims' indices, the run's dim from its start.
        let outer = if inner == 0 { 0 } else { inner - 1 };
        let mut index: Vec<usize> = ranges[..outer].iter().map(|r| r.start).collect();
        if count > 0 {
            loop {
                let mut flat: usize = index.iter().zip(&strides).map(|(i, s)| i * s).sum();
                if inner > 0 {
                    flat += ranges[inner - 1].start * strides[inner - 1];
                }
                file.read_exact_at(&mut chunk, stored.offset + (flat * size) as u64).map_err(
                    |e| {
                        bad(&self.flag, path, format!("{}: cannot read its data: {e}", stored.name))
                    },
                )?;
                bytes.extend_from_slice(&chunk);
                self.read.fetch_add(chunk.len() as u64, std::sync::atomic::Ordering::Relaxed);
                // The next outer index, last dim fastest.
                let mut d = outer;
                loop {
                    if d == 0 {
                        break;
                    }
                    d -= 1;
                    index[d] += 1;
                    if index[d] < ranges[d].end {
                        break;
                    }
                    index[d] = ranges[d].start;
                    if d == 0 {
                        d = usize::MAX;
                        break;
                    }
                }
                if outer == 0 || d == usize::MAX {
                    break;
                }
            }
        }
        let t = Tensor::from_le_bytes(stored.dtype, &dims, &bytes)
            .map_err(|e| bad(&self.flag, path, format!("{}: {e}", stored.name)))?;
        let values = t.to_f64();
        if let Some((k, v)) = values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(bad(
                &self.flag,
                path,
                format!("{}[{k}] (flat, in the box read) is {v}", stored.name),
            ));
        }
        let t = Tensor::from_f64(dtype, &dims, &values)
            .map_err(|e| bad(&self.flag, path, format!("{}: {e}", stored.name)))?;
        // A value past the run's dtype's range would become an infinity.
        if let Some((k, _)) = t.to_f64().iter().enumerate().find(|(_, v)| !v.is_finite()) {
            let v = values[k];
            return Err(bad(
                &self.flag,
                path,
                format!("{}[{k}] (flat, in the box read) is {v}, past {dtype}", stored.name),
            ));
        }
        Ok(t)
    }

    /// A parameter's shape as stored.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.tensors.get(name).map(|s| s.shape.as_slice())
    }

    /// Bytes of tensor data [`read`](Self::read) has read so far.
    pub fn bytes_read(&self) -> u64 {
        self.read.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// The most bytes a safetensors header may take.
const HEADER_LIMIT: u64 = 100 << 20;

/// The GPT-2 checkpoint folder `dir` (named by `--flag`) checked and indexed from its
/// `config.json` and its safetensors headers, no weight read: the sizes and config
/// (its `weights` empty) and where each weight is. Every tensor is checked as
/// [`read_gpt2`] checks it (a GPT-2 name in either layout, the config's shape, a float
/// dtype, stored once, none missing, its bytes inside its file), and the weights
/// kept as `dtype` must fit in `limit` bytes.
pub fn index_gpt2(flag: &str, dir: &Path, dtype: DType, limit: u64) -> Result<(HfGpt2, HfShards)> {
    use std::io::Read;
    let config_path = dir.join("config.json");
    let text = files::read_file(flag, &config_path, JSON_LIMIT)?;
    let config: Json = serde_json::from_slice(&text)
        .map_err(|e| bad(flag, &config_path, format!("not JSON: {e}")))?;
    let model = gpt2_config(flag, &config_path, &config)?;
    // The weights as read (the file) and as kept (f64 values, then the run's dtype),
    // against the limit before any is read.
    let elements: u64 =
        model.parameters().iter().map(|(_, s)| s.iter().map(|&d| d as u64).product::<u64>()).sum();
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
    let want: HashMap<String, Vec<usize>> = model.parameters().into_iter().collect();
    let files_ = weight_files(flag, dir)?;
    let mut tensors = HashMap::new();
    for (f, path) in files_.iter().enumerate() {
        let (mut file, len) = files::open_regular(&format!("--{flag}"), path)?;
        let mut head = [0u8; 8];
        file.read_exact(&mut head)
            .map_err(|e| bad(flag, path, format!("not a safetensors file: {e}")))?;
        let n = u64::from_le_bytes(head);
        if n > HEADER_LIMIT || n.saturating_add(8) > len {
            return Err(bad(flag, path, format!("not a safetensors file: a header of {n} bytes")));
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact(&mut header)
            .map_err(|e| bad(flag, path, format!("not a safetensors file: {e}")))?;
        let json: serde_json::Map<String, Json> = serde_json::from_slice(&header)
            .map_err(|e| bad(flag, path, format!("not a safetensors file: {e}")))?;
        let data_start = 8 + n;
        for (name, entry) in json {
            if name == "__metadata__" {
                continue;
            }
            let Some(param) = canonical(&name) else { continue };
            let Some(shape) = want.get(&param) else {
                return Err(bad(flag, path, format!("{name} is not a GPT-2 tensor")));
            };
            let stored_shape: Option<Vec<usize>> = entry["shape"]
                .as_array()
                .and_then(|a| a.iter().map(|d| d.as_u64().map(|d| d as usize)).collect());
            let Some(stored_shape) = stored_shape else {
                return Err(bad(flag, path, format!("{name} has no shape")));
            };
            if stored_shape != *shape {
                return Err(bad(
                    flag,
                    path,
                    format!("{name} is {stored_shape:?}; the config makes it {shape:?}"),
                ));
            }
            let stored = match entry["dtype"].as_str() {
                Some("F64") => DType::F64,
                Some("F32") => DType::F32,
                Some("BF16") => DType::BF16,
                Some("F16") => DType::F16,
                other => {
                    return Err(bad(
                        flag,
                        path,
                        format!("{name} is {}; want F64, F32, BF16 or F16", other.unwrap_or("?")),
                    ));
                }
            };
            let offsets: Option<Vec<u64>> =
                entry["data_offsets"].as_array().and_then(|a| a.iter().map(Json::as_u64).collect());
            let bytes = shape.iter().product::<usize>() as u64 * stored.size_in_bytes() as u64;
            let inside = |e: u64| data_start.checked_add(e).is_some_and(|end| end <= len);
            let (begin, end) = match offsets.as_deref() {
                Some(&[b, e]) if e >= b && e - b == bytes && inside(e) => (b, e),
                _ => {
                    return Err(bad(
                        flag,
                        path,
                        format!("{name}: its data_offsets do not hold {bytes} bytes in the file"),
                    ));
                }
            };
            let _ = end;
            let entry = Stored {
                file: f,
                name: name.clone(),
                dtype: stored,
                shape: stored_shape,
                offset: data_start + begin,
            };
            if tensors.insert(param, entry).is_some() {
                return Err(bad(flag, path, format!("{name} is stored twice")));
            }
        }
    }
    if let Some((name, _)) = model.parameters().into_iter().find(|(n, _)| !tensors.contains_key(n))
    {
        return Err(bad(flag, dir, format!("no tensor {name}")));
    }
    let shards = HfShards { flag: flag.to_string(), files: files_, tensors, read: 0.into() };
    Ok((HfGpt2 { model, config, weights: HashMap::new() }, shards))
}

/// A `config.json` for `model` (what `GPT2Config` writes of it), for a model that
/// came from a preset rather than a checkpoint.
pub fn config_of(model: &Gpt2) -> Json {
    serde_json::json!({
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": model.vocab,
        "n_positions": model.positions,
        "n_embd": model.dim,
        "n_layer": model.layers,
        "n_head": model.heads,
        "n_inner": model.inner,
        "layer_norm_epsilon": model.eps,
        "activation_function": "gelu_new",
        "tie_word_embeddings": true,
        "attn_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "resid_pdrop": 0.0,
        "bos_token_id": 50256,
        "eos_token_id": 50256,
    })
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

/// Writes `model`'s `weights` (by parameter name, f32 or f64) into the new folder
/// `dir` as `save_pretrained` lays it out — `config.json` (`config`, its `dtype`
/// set to the weights') and `model.safetensors` — for
/// `GPT2LMHeadModel.from_pretrained`. `dir` must not exist or be empty; nothing in it
/// is replaced.
pub fn write_gpt2(
    flag: &str,
    dir: &Path,
    model: &Gpt2,
    config: &Json,
    weights: &HashMap<String, Tensor>,
) -> Result<()> {
    if dir.exists() {
        let empty = std::fs::read_dir(dir).map_err(|e| bad(flag, dir, e))?.next().is_none();
        if !empty || !dir.is_dir() {
            return Err(bad(flag, dir, "exists and is not an empty folder"));
        }
    } else {
        std::fs::create_dir_all(dir).map_err(|e| bad(flag, dir, format!("cannot create: {e}")))?;
    }
    let params = model.parameters();
    let mut stored = Vec::with_capacity(params.len());
    let mut dtype = None;
    for (name, shape) in &params {
        let t = weights.get(name).ok_or_else(|| Error::usage(format!("no weight {name}")))?;
        if t.shape() != &shape[..] {
            return Err(Error::usage(format!("{name} is {:?}, want {shape:?}", t.shape())));
        }
        let d = match t.dtype() {
            DType::F64 => safetensors::Dtype::F64,
            DType::F32 => safetensors::Dtype::F32,
            other => return Err(Error::usage(format!("{name} is {other}; want f32 or f64"))),
        };
        dtype = Some(t.dtype());
        stored.push((name.clone(), d, shape.clone(), t.to_le_bytes()));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = stored
        .iter()
        .map(|(n, d, s, b)| {
            let view = safetensors::tensor::TensorView::new(*d, s.clone(), b)
                .map_err(|e| Error::usage(format!("{n}: {e}")))?;
            Ok((n.clone(), view))
        })
        .collect::<Result<_>>()?;
    let bytes = safetensors::serialize(views, None).map_err(|e| bad(flag, dir, e))?;
    let mut config = config.clone();
    if let (Some(obj), Some(d)) = (config.as_object_mut(), dtype) {
        let name = if d == DType::F64 { "float64" } else { "float32" };
        obj.insert("dtype".into(), Json::String(name.into()));
    }
    let text = serde_json::to_vec_pretty(&config).map_err(|e| bad(flag, dir, e))?;
    for (file, data) in [("model.safetensors", &bytes), ("config.json", &text)] {
        let path = dir.join(file);
        files::write_new(&path, data).map_err(|e| bad(flag, &path, e))?;
    }
    Ok(())
}
