//! `meshwork train --model transformer`: the reference decoder-only transformer (the
//! program layer's `nn::Transformer`) trained on a `data x model` mesh (SPMD,
//! Megatron's shardings) or in a pipeline of stages (placed programs, GPipe's
//! micro-batches), with a check against one device.

use std::collections::HashMap;
use std::io::{IsTerminal, Write};
use std::path::Path;
use std::time::Instant;

use meshwork_nn::{Optimizer, TrainStep};
use meshwork_nn::{Pipeline, Transformer};
use meshwork_program::fast::Input;
use meshwork_program::{Builder, Program, Tensor, Value};
use meshwork_strategy::Strategy;
use meshwork_strategy::partition::{Shardings, megatron_spec};
use meshwork_strategy::placed::PlaceOptions;
use meshwork_strategy::sharding::Mesh;
use meshwork_strategy::types::{DType, Shape, TensorSpec};

use crate::args::{self, Args, Exit, Usage, outln};
use crate::npy;
use crate::train::{check_output_file, loss_text, number_text, write_atomic};

pub(crate) const HELP: &str = "\
meshwork train --model transformer — train the reference decoder-only transformer
(pre-norm blocks of causal attention and a GELU MLP, softmax cross-entropy on the next
token) on a data x model mesh (the batch over data, Megatron's shardings over model),
or in a pipeline of stages (blocks spread over devices, GPipe's micro-batches).

flags:
  --layers L --dim D --heads H --ffn F --vocab V --seq T
                        the model (defaults 2, 64, 4, 256, 256, 32); with --init the
                        sizes come from the file (it does not say the heads: --heads is
                        needed) and a flag that disagrees is an error
  --init INIT.safetensors   initial weights: embed [V, D], pos [T, D], layers.{i}.ln1.scale,
                        .ln1.bias, .attn.wq/.wk/.wv/.wo [D, D], .ln2.*, .mlp.w1 [D, F],
                        .mlp.b1, .mlp.w2 [F, D], .mlp.b2, ln_f.scale, ln_f.bias, unembed [D, V]
  --data-tokens TOKENS.npy  integer rows [N, T+1]; step s reads rows (s·B + i) mod N,
                        inputs row[:T], targets row[1:] (default: built-in rows)
  --text FILE           ... or a file's bytes as tokens (vocab 256): row i is bytes
                        i·T … i·T+T
  --clip-norm C         clip the gradients to global norm C (PyTorch's clip_grad_norm_)
  --batch B             rows per step (default 8)
  --steps N             steps (default 100)
  --optimizer sgd|momentum|adam|adamw   (default adam; momentum 0.9, AdamW decay 0.01)
  --lr LR               learning rate (default 0.01 for Adam/AdamW, 0.1 otherwise)
  --dtype f32|f64       (default f32)
  --seed S              seeds the built-in rows and the initial weights (default 0)
  --mesh DxM            data x model devices (default 1x1)
  --stages K            pipeline stages (default 1): the blocks spread over K devices per
                        data replica (D x K devices; needs --mesh Dx1)
  --microbatches M      micro-batches per replica and step in a pipeline (default 1)
  --warmup N            steps of linear learning-rate warm-up (default 0)
  --schedule constant|cosine   after warm-up: constant (default), or cosine decay to 0
                        at the last step
  --shuffle             read the rows in a per-epoch permutation drawn from --seed
  --eval-every N        every N steps (and after the last), the loss and next-token
                        accuracy on held-out rows: the last --eval-fraction of the data
                        (default 0.1), which training then never reads
  --eval-fraction F
  --checkpoint-dir DIR  sharded checkpoints in a directory meshwork owns (created if
                        absent; anything else is refused): at the end and every N steps
  --checkpoint-every N
  --keep N              checkpoints kept, newest first (default 3)
  --resume PATH         continue from a checkpoint directory (its latest step) or one
                        step-NNNNNNNN/ in it, on any mesh or pipeline; the model's sizes
                        come from the checkpoint, and the run's other flags must give what
                        the saved run had: the same data (checked by a CRC), --dtype,
                        --optimizer, --batch, --lr, --warmup, --schedule, --clip-norm,
                        --seed, --shuffle and --eval-fraction (a difference is refused)
  --losses-json FILE    every step's loss as a JSON list, written at the end and when
                        the run stops or fails; an existing file is replaced only if it
                        is such a list
  --metrics-jsonl FILE  one JSON line per step as the run goes (step, loss, lr,
                        tokens/s); a new file (an existing one is refused)
  --plot FILE.svg       the loss per step as an SVG line chart; a new file
  --steps-per-run N     steps per host call on a mesh (default 1; TPUStrategy's
                        steps_per_execution): the devices run N steps between returns
                        to the host; a pipeline runs one step per call
  --max-memory SIZE     refuse a run whose estimated memory exceeds SIZE (default 8G;
                        suffixes K, M, G, T)
  --no-check            skip the comparison of every step's loss with one device (on
                        by default for runs estimated at 1 GB or less)
  --check               ... and run it for a larger run too
  --quiet               no progress lines and no summary

Ctrl-C (SIGINT) or SIGTERM stops after the current host call, saves a checkpoint if
--checkpoint-dir is given, writes --losses-json and exits with status 130.
";

pub(crate) const VALUED: &[&str] = &[
    "model",
    "layers",
    "dim",
    "heads",
    "ffn",
    "vocab",
    "seq",
    "init",
    "data-tokens",
    "batch",
    "steps",
    "optimizer",
    "lr",
    "dtype",
    "seed",
    "mesh",
    "stages",
    "microbatches",
    "losses-json",
    "warmup",
    "schedule",
    "metrics-jsonl",
    "plot",
    "eval-every",
    "eval-fraction",
    "text",
    "clip-norm",
    "checkpoint-dir",
    "checkpoint-every",
    "keep",
    "resume",
    "data-x",
    "data-y",
    "filters",
    "steps-per-run",
    "max-memory",
    "hidden",
    "classes",
];
pub(crate) const SWITCHES: &[&str] = &["no-check", "check", "quiet", "shuffle"];

/// Each device of a CPU mesh is a thread.
const MAX_DEVICES: usize = 64;
/// Rows of the built-in data.
const BUILT_IN_ROWS: usize = 512;
/// Steps a run may take (its losses are kept).
const MAX_STEPS: usize = 100_000_000;

fn usage(flag: &str, e: impl std::fmt::Display) -> Usage {
    Usage(format!("--{flag}: {e}"))
}

/// The model's sizes from the flags, or from `--init`'s tensors (a flag that
/// disagrees is an error naming both).
fn model(a: &Args, init: Option<&HashMap<String, Tensor>>) -> Result<Transformer, Usage> {
    let flag = |name: &str, default: usize| -> Result<(usize, bool), Usage> {
        match a.get(name) {
            None => Ok((default, false)),
            Some(_) => {
                let v: usize = a.parse_or(name, default, "a size (a whole number ≥ 1)")?;
                if v == 0 {
                    return Err(usage(name, "must be at least 1"));
                }
                Ok((v, true))
            }
        }
    };
    let (mut layers, mut dim, mut ffn, mut vocab, mut seq) = (
        flag("layers", 2)?,
        flag("dim", 64)?,
        flag("ffn", 256)?,
        flag("vocab", 256)?,
        flag("seq", 32)?,
    );
    let heads = flag("heads", 4)?.0;
    if let Some(init) = init {
        let dims = |name: &str| -> Result<Vec<usize>, Usage> {
            init.get(name)
                .map(|t| t.shape().to_vec())
                .ok_or_else(|| usage("init", format!("has no tensor {name:?}")))
        };
        let embed = dims("embed")?;
        let pos = dims("pos")?;
        let w1 = dims("layers.0.mlp.w1")?;
        let (Some(&v), Some(&d), Some(&t), Some(&f)) =
            (embed.first(), embed.get(1), pos.first(), w1.get(1))
        else {
            return Err(usage("init", "embed, pos and layers.0.mlp.w1 must be matrices"));
        };
        let l = (0..).take_while(|i| init.contains_key(&format!("layers.{i}.attn.wq"))).count();
        for (name, slot, from_file) in [
            ("layers", &mut layers, l),
            ("dim", &mut dim, d),
            ("ffn", &mut ffn, f),
            ("vocab", &mut vocab, v),
            ("seq", &mut seq, t),
        ] {
            if slot.1 && slot.0 != from_file {
                return Err(usage(
                    name,
                    format!("{} disagrees with --init, whose tensors say {from_file}", slot.0),
                ));
            }
            slot.0 = from_file;
        }
    }
    if !dim.0.is_multiple_of(heads) {
        return Err(usage("heads", format!("{heads} heads do not divide --dim {}", dim.0)));
    }
    Ok(Transformer { vocab: vocab.0, seq: seq.0, dim: dim.0, heads, layers: layers.0, ffn: ffn.0 })
}

/// `--max-memory`'s refusal.
fn memory_error(need: f64, limit: u64) -> Usage {
    Usage(format!(
        "--max-memory: the run would hold about {:.2} GB, more than {:.2} GB; give smaller sizes or a larger --max-memory",
        need / 1e9,
        limit as f64 / 1e9
    ))
}

/// The model's sizes from a resumed checkpoint's metadata; a flag must agree.
fn model_from(a: &Args, meta: &serde_json::Value) -> Result<Transformer, Usage> {
    let size = |name: &str| -> Result<usize, Usage> {
        let saved = meta[name]
            .as_u64()
            .and_then(|v| usize::try_from(v).ok())
            .ok_or_else(|| usage("resume", format!("the checkpoint's metadata has no {name}")))?;
        if a.get(name).is_some() {
            let v: usize = a.parse_or(name, saved, "a size")?;
            if v != saved {
                return Err(usage(
                    name,
                    format!("{v} disagrees with --resume's checkpoint ({saved})"),
                ));
            }
        }
        Ok(saved)
    };
    Ok(Transformer {
        vocab: size("vocab")?,
        seq: size("seq")?,
        dim: size("dim")?,
        heads: size("heads")?,
        layers: size("layers")?,
        ffn: size("ffn")?,
    })
}

/// The tensors of a safetensors file (f32 or f64), by name.
fn read_init(path: &str, limit: u64) -> Result<HashMap<String, Tensor>, Usage> {
    let bytes = args::read_file("init", path, limit)?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| usage("init", format!("{path} is not a safetensors file: {e}")))?;
    let mut out = HashMap::new();
    for (name, view) in st.tensors() {
        let shape = view.shape().to_vec();
        let data = view.data();
        let t = match view.dtype() {
            safetensors::Dtype::F64 => Tensor::f64(
                &shape,
                data.chunks_exact(8)
                    .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
                    .collect(),
            ),
            safetensors::Dtype::F32 => Tensor::f32(
                &shape,
                data.chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                    .collect(),
            ),
            other => {
                return Err(usage("init", format!("{name} is {other:?}; want F32 or F64")));
            }
        }
        .map_err(|e| usage("init", format!("{name}: {e}")))?;
        let finite = match view.dtype() {
            safetensors::Dtype::F64 => data
                .chunks_exact(8)
                .position(|c| !f64::from_le_bytes(c.try_into().expect("8 bytes")).is_finite()),
            _ => data
                .chunks_exact(4)
                .position(|c| !f32::from_le_bytes(c.try_into().expect("4 bytes")).is_finite()),
        };
        if let Some(k) = finite {
            return Err(usage("init", format!("{name}[{k}] (flat) is not a finite number")));
        }
        out.insert(name, t);
    }
    Ok(out)
}

/// A tensor of `dtype` with `t`'s values.
fn cast(t: &Tensor, dtype: DType) -> Result<Tensor, Usage> {
    let values = t.to_f64();
    let dims = t.shape();
    let made = match dtype {
        DType::F64 => Tensor::f64(dims, values),
        _ => Tensor::f32(dims, values.into_iter().map(|v| v as f32).collect()),
    };
    made.map_err(|e| Usage(format!("a weight of shape {dims:?}: {e}")))
}

/// A deterministic stream for the built-in rows and the initial weights.
struct Noise(u64);

/// SplitMix64 of `x`: a well-mixed, never-zero xorshift state for any seed.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (z ^ (z >> 31)).max(1)
}

impl Noise {
    fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f64 {
        (0..4).map(|_| self.uniform()).sum::<f64>() * 3f64.sqrt() - 2.0 * 3f64.sqrt()
    }
}

/// Initial weights at the reference run's scales (the weights are the parameters
/// after the first `fed`): matrices and filters at `1/sqrt(fan_in)`.
fn random_init(program: &Program, fed: usize, noise: &mut Noise) -> HashMap<String, Tensor> {
    let mut out = HashMap::new();
    for p in &program.params()[fed..] {
        let d = p.spec.shape.dims();
        let n = p.spec.shape.num_elements();
        let name = p.name.as_str();
        let (scale, shift) = if name == "embed" {
            (0.5, 0.0)
        } else if name == "pos" {
            (0.1, 0.0)
        } else if name.ends_with(".scale") {
            (0.1, 1.0)
        } else if name.ends_with(".bias") || name.ends_with(".b1") || name.ends_with(".b2") {
            (0.0, 0.0)
        } else {
            let fan_in = n / d.last().copied().unwrap_or(1).max(1);
            (1.0 / (fan_in.max(1) as f64).sqrt(), 0.0)
        };
        let values = (0..n).map(|_| shift + scale * noise.normal()).collect();
        out.insert(p.name.clone(), Tensor::f64(d, values).expect("sizes of a built program"));
    }
    out
}

/// Token rows `[N, T+1]`: `--data-tokens`, or the built-in rows (a noisy affine
/// sequence a model can learn: each token is 3·previous + 1 mod V, one in eight
/// random).
fn rows(a: &Args, model: &Transformer, seed: u64, limit: u64) -> Result<(usize, Vec<i32>), Usage> {
    let width = model.seq + 1;
    if let Some(path) = a.get("text") {
        if a.get("data-tokens").is_some() {
            return Err(Usage("--text and --data-tokens both give the rows; give one".into()));
        }
        if model.vocab != 256 {
            return Err(usage(
                "text",
                format!("bytes are tokens of a vocabulary of 256, not --vocab {}", model.vocab),
            ));
        }
        // The bytes and their tokens (4 bytes each) are held at once.
        let bytes = args::read_file("text", path, limit / 5)?;
        let n = bytes.len().saturating_sub(1) / model.seq;
        if n == 0 {
            return Err(usage(
                "text",
                format!(
                    "{path} has {} bytes: fewer than one row of --seq {} + 1",
                    bytes.len(),
                    model.seq
                ),
            ));
        }
        let mut tokens = Vec::with_capacity(n * width);
        for i in 0..n {
            let row = &bytes[i * model.seq..i * model.seq + width];
            tokens.extend(row.iter().map(|&b| i32::from(b)));
        }
        return Ok((n, tokens));
    }
    let Some(path) = a.get("data-tokens") else {
        let mut noise = Noise(mix(seed));
        let v = model.vocab as u64;
        let mut tokens = Vec::with_capacity(BUILT_IN_ROWS * width);
        for _ in 0..BUILT_IN_ROWS {
            let mut t = (noise.uniform() * v as f64) as u64 % v;
            for _ in 0..width {
                tokens.push(t as i32);
                t = if noise.uniform() < 0.125 {
                    (noise.uniform() * v as f64) as u64 % v
                } else {
                    (3 * t + 1) % v
                };
            }
        }
        return Ok((BUILT_IN_ROWS, tokens));
    };
    let x = npy::read(path, limit).map_err(|e| usage("data-tokens", e))?;
    let shape = x.shape().to_vec();
    if shape.len() != 2 || shape[1] != width || shape[0] == 0 {
        return Err(usage(
            "data-tokens",
            format!("{path} has shape {shape:?}; want [rows, {width}] (--seq {} + 1)", model.seq),
        ));
    }
    let mut tokens = Vec::with_capacity(x.len());
    for (k, &t) in x.iter().enumerate() {
        if t.fract() != 0.0 || t < 0.0 || t >= model.vocab as f64 {
            return Err(usage(
                "data-tokens",
                format!(
                    "{path}: row {}, column {} holds {t}, not a token id below --vocab {}",
                    k / width,
                    k % width,
                    model.vocab
                ),
            ));
        }
        tokens.push(t as i32);
    }
    Ok((shape[0], tokens))
}

/// How the steps run.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// SPMD on a `data x model` mesh.
    Mesh { data: usize, model: usize },
    /// `replicas` replicas of a pipeline of `stages` stages.
    Pipeline { replicas: usize, stages: usize, micro: usize },
}

/// The CNN's sizes: images `[H, W, C]`, classes, the two convolutions' filters.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Cnn {
    image: [usize; 3],
    classes: usize,
    filters: [usize; 2],
}

/// The MLP's sizes.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Mlp {
    features: usize,
    hidden: usize,
    classes: usize,
}

/// The model a run trains.
#[derive(Clone, Copy)]
enum Net {
    Transformer(Transformer),
    Cnn(Cnn),
    Mlp(Mlp),
}

impl Net {
    /// Parameters fed each step, before the weights: the rows, or images and labels.
    fn fed(&self) -> usize {
        match self {
            Net::Transformer(_) => 1,
            Net::Cnn(_) | Net::Mlp(_) => 2,
        }
    }

    /// What a row counts for in throughput: its tokens, or one sample.
    fn per_row(&self) -> (usize, &'static str) {
        match self {
            Net::Transformer(m) => (m.seq, "tokens"),
            Net::Cnn(_) | Net::Mlp(_) => (1, "samples"),
        }
    }

    /// A checkpoint's description of the model.
    fn meta(&self) -> serde_json::Value {
        match self {
            Net::Transformer(m) => serde_json::json!({
                "model": "transformer", "layers": m.layers, "dim": m.dim, "heads": m.heads,
                "ffn": m.ffn, "vocab": m.vocab, "seq": m.seq,
            }),
            Net::Cnn(c) => serde_json::json!({
                "model": "cnn", "image": c.image, "classes": c.classes, "filters": c.filters,
            }),
            Net::Mlp(m) => serde_json::json!({
                "model": "mlp", "features": m.features, "hidden": m.hidden, "classes": m.classes,
            }),
        }
    }

    /// One line for people.
    fn describe(&self) -> String {
        match self {
            Net::Transformer(m) => format!(
                "transformer L{} D{} H{} F{} V{} T{}",
                m.layers, m.dim, m.heads, m.ffn, m.vocab, m.seq
            ),
            Net::Cnn(c) => format!(
                "CNN conv3x3x{} conv3x3x{}/2 linear({}) on {}x{}x{} images",
                c.filters[0], c.filters[1], c.classes, c.image[0], c.image[1], c.image[2]
            ),
            Net::Mlp(m) => format!("MLP {} -> {} -> {}", m.features, m.hidden, m.classes),
        }
    }

    /// The fed parameters for `batch` rows.
    fn feeds(
        &self,
        b: &mut Builder,
        batch: usize,
        dtype: DType,
    ) -> Result<Vec<Value>, meshwork_program::Error> {
        let spec = |dtype, dims: &[usize]| -> Result<TensorSpec, meshwork_program::Error> {
            Ok(TensorSpec::new(dtype, Shape::new(dims)?))
        };
        Ok(match self {
            Net::Transformer(m) => vec![b.param("rows", spec(DType::I32, &[batch, m.seq + 1])?)?],
            Net::Cnn(c) => {
                let [h, w, ch] = c.image;
                vec![
                    b.param("x", spec(dtype, &[batch, h, w, ch])?)?,
                    b.param("y", spec(DType::I32, &[batch])?)?,
                ]
            }
            Net::Mlp(m) => vec![
                b.param("x", spec(dtype, &[batch, m.features])?)?,
                b.param("y", spec(DType::I32, &[batch])?)?,
            ],
        })
    }
}

/// The rows a run reads.
enum Examples {
    /// Token rows `[N, T+1]`.
    Tokens { width: usize, tokens: Vec<i32> },
    /// Inputs `[N, dims…]` (images, features) and class ids.
    Images { per: usize, dims: Vec<usize>, x: Vec<f64>, y: Vec<i32> },
}

impl Examples {
    /// A CRC-32C of the rows (their values, labels and shape): a resumed run must read
    /// the data the checkpoint's run read.
    fn fingerprint(&self) -> u32 {
        match self {
            Examples::Tokens { width, tokens } => {
                let crc = crc32c::crc32c(&(*width as u64).to_le_bytes());
                tokens.iter().fold(crc, |c, t| crc32c::crc32c_append(c, &t.to_le_bytes()))
            }
            Examples::Images { dims, x, y, .. } => {
                let crc = dims
                    .iter()
                    .fold(0, |c, d| crc32c::crc32c_append(c, &(*d as u64).to_le_bytes()));
                let crc = x.iter().fold(crc, |c, v| crc32c::crc32c_append(c, &v.to_le_bytes()));
                y.iter().fold(crc, |c, l| crc32c::crc32c_append(c, &l.to_le_bytes()))
            }
        }
    }

    /// The feeds of rows `idx`.
    fn batch(&self, idx: &[usize], dtype: DType) -> Result<Vec<Tensor>, Exit> {
        let failed = |e: meshwork_strategy::types::Error| Exit::Failed(e.to_string());
        match self {
            Examples::Tokens { width, tokens } => {
                let mut out = Vec::with_capacity(idx.len() * width);
                for &r in idx {
                    out.extend_from_slice(&tokens[r * width..(r + 1) * width]);
                }
                Ok(vec![Tensor::i32(&[idx.len(), *width], out).map_err(failed)?])
            }
            Examples::Images { per, dims, x, y } => {
                let mut xs = Vec::with_capacity(idx.len() * per);
                for &r in idx {
                    xs.extend_from_slice(&x[r * per..(r + 1) * per]);
                }
                let mut shape = vec![idx.len()];
                shape.extend(dims);
                let x = match dtype {
                    DType::F64 => Tensor::f64(&shape, xs),
                    _ => Tensor::f32(&shape, xs.into_iter().map(|v| v as f32).collect()),
                }
                .map_err(failed)?;
                let ys = idx.iter().map(|&r| y[r]).collect();
                Ok(vec![x, Tensor::i32(&[idx.len()], ys).map_err(failed)?])
            }
        }
    }
}

/// Bytes a run holds at once, roughly (in f64, so no size overflows): every device's
/// weights with their gradients, optimizer state and working copies, a step's
/// activations, and the one-device check's copy of both.
fn memory_estimate(net: &Net, batch: usize, dtype: DType, devices: usize, check: bool) -> f64 {
    let b = batch as f64;
    let (params, acts) = match net {
        Net::Transformer(m) => {
            let [v, t, d, f, l, h] =
                [m.vocab, m.seq, m.dim, m.ffn, m.layers, m.heads].map(|x| x as f64);
            let params =
                2.0 * v * d + t * d + l * (4.0 * d * d + 2.0 * d * f + f + 5.0 * d) + 2.0 * d;
            (params, b * (t + 1.0) * (l * (12.0 * d + 3.0 * f + 3.0 * h * t) + 3.0 * v))
        }
        Net::Cnn(c) => {
            let [hh, w, ch] = c.image.map(|x| x as f64);
            let [f1, f2, k] = [c.filters[0], c.filters[1], c.classes].map(|x| x as f64);
            let flat = (hh / 2.0).ceil() * (w / 2.0).ceil() * f2;
            let params = 9.0 * ch * f1 + f1 + 9.0 * f1 * f2 + f2 + flat * k + k;
            (params, b * (hh * w * (ch + 3.0 * f1 + 3.0 * f2) + 3.0 * k))
        }
        Net::Mlp(m) => {
            let [f, h, k] = [m.features, m.hidden, m.classes].map(|x| x as f64);
            (f * h + h + h * k + k, b * (f + 3.0 * h + 3.0 * k))
        }
    };
    let copies = devices as f64 + f64::from(u8::from(check));
    (params * 6.0 * copies + acts * 2.0 * copies.min(2.0)) * dtype.size_in_bytes() as f64
}

/// A training run: one step at a time, returning its loss.
trait Run {
    fn step(&mut self, feeds: &[Tensor], lr: f64, s: usize) -> Result<f64, Exit>;
    /// Steps `first..first + feeds.len()` in one host call where the run can (a
    /// compiled step), one by one otherwise.
    fn steps(
        &mut self,
        feeds: &[Vec<Tensor>],
        lrs: &[f64],
        first: usize,
    ) -> Result<Vec<f64>, Exit> {
        feeds.iter().zip(lrs).enumerate().map(|(i, (f, &lr))| self.step(f, lr, first + i)).collect()
    }
    /// Weight `name`'s current value.
    fn weight(&self, name: &str) -> Result<Tensor, Exit>;
    /// Saves the weights, optimizer state and `steps` as step `steps` of `manager`.
    fn save(
        &mut self,
        manager: &mut meshwork_strategy::checkpoint::CheckpointManager,
        meta: &serde_json::Value,
        steps: usize,
    ) -> StrategyResult<std::path::PathBuf>;
    /// Restores a checkpoint (saved by any layout); returns its step count.
    fn restore(&mut self, dir: &Path) -> StrategyResult<usize>;
}

type StrategyResult<T> = Result<T, meshwork_strategy::Error>;

struct SpmdRun<'s>(meshwork_strategy::spmd::CompiledTrainStep<'s>);

impl Run for SpmdRun<'_> {
    fn step(&mut self, feeds: &[Tensor], lr: f64, _: usize) -> Result<f64, Exit> {
        self.0.step(feeds, lr).map_err(|e| Exit::Failed(e.to_string()))
    }
    fn steps(&mut self, feeds: &[Vec<Tensor>], lrs: &[f64], _: usize) -> Result<Vec<f64>, Exit> {
        self.0.run_steps(feeds, lrs).map_err(|e| Exit::Failed(e.to_string()))
    }
    fn weight(&self, name: &str) -> Result<Tensor, Exit> {
        self.0.get(name).map_err(|e| Exit::Failed(e.to_string()))
    }
    fn save(
        &mut self,
        manager: &mut meshwork_strategy::checkpoint::CheckpointManager,
        meta: &serde_json::Value,
        steps: usize,
    ) -> StrategyResult<std::path::PathBuf> {
        self.0.set_steps(steps);
        self.0.save_to(manager, steps, meta)
    }
    fn restore(&mut self, dir: &Path) -> StrategyResult<usize> {
        self.0.restore_checkpoint(dir)?;
        Ok(self.0.steps())
    }
}

struct PlacedRun<'s> {
    placed: meshwork_strategy::placed::Placed<'s>,
    step: TrainStep,
    /// The one-device loss program, which checkpoints are written through.
    host: (Program, Value, Vec<Value>, Optimizer, Option<f64>),
    /// Parameters fed each step.
    fed: usize,
}

impl PlacedRun<'_> {
    /// A one-device training step to write or read checkpoints through (a pipeline's
    /// weights and state are whole tensors, as one device holds them).
    fn with_host<T>(
        &self,
        f: impl FnOnce(&mut meshwork_strategy::spmd::CompiledTrainStep<'_>) -> StrategyResult<T>,
    ) -> StrategyResult<T> {
        let (program, loss, weights, optimizer, clip) = &self.host;
        let one = Strategy::data_parallel(1)?;
        let mesh = Mesh::iota(&[("data", 1), ("model", 1)])?;
        let mut host = one.compile_train_step_clipped(
            program,
            *loss,
            weights,
            *optimizer,
            *clip,
            &Shardings::new(mesh),
        )?;
        f(&mut host)
    }

    /// The weights' and optimizer state's names.
    fn state_names(&self) -> Vec<String> {
        let ps = self.step.program.params();
        ps[self.fed..ps.len() - 2].iter().map(|p| p.name.clone()).collect()
    }
}

impl Run for PlacedRun<'_> {
    fn step(&mut self, feeds: &[Tensor], lr: f64, s: usize) -> Result<f64, Exit> {
        let failed = |e: &dyn std::fmt::Display| Exit::Failed(e.to_string());
        let [lr, count] = self.step.scalars(lr, s).map_err(|e| failed(&e))?;
        let mut all = feeds.to_vec();
        all.extend([lr, count]);
        let out = self.placed.step(&all).map_err(|e| failed(&e))?;
        Ok(out[0].to_f64()[0])
    }
    fn weight(&self, name: &str) -> Result<Tensor, Exit> {
        self.placed.get(name).map_err(|e| Exit::Failed(e.to_string()))
    }
    fn save(
        &mut self,
        manager: &mut meshwork_strategy::checkpoint::CheckpointManager,
        meta: &serde_json::Value,
        steps: usize,
    ) -> StrategyResult<std::path::PathBuf> {
        let names = self.state_names();
        self.with_host(|host| {
            for name in &names {
                host.set(name, &self.placed.get(name)?)?;
            }
            host.set_steps(steps);
            host.save_to(manager, steps, meta)
        })
    }
    fn restore(&mut self, dir: &Path) -> StrategyResult<usize> {
        let names = self.state_names();
        let (values, steps) = self.with_host(|host| {
            host.restore_checkpoint(dir)?;
            let values = names.iter().map(|n| host.get(n)).collect::<StrategyResult<Vec<_>>>()?;
            Ok((values, host.steps()))
        })?;
        for (name, t) in names.iter().zip(values) {
            self.placed.set(name, t)?;
        }
        Ok(steps)
    }
}

/// The held-out evaluation: the loss and accuracy (of the next token, or the class)
/// of `batch` rows at a time.
struct Eval {
    exe: meshwork_program::fast::Executable,
    program: Program,
    fed: usize,
    /// The held-out rows' feeds, `batch` rows at a time.
    chunks: Vec<Vec<Tensor>>,
}

impl Eval {
    fn new(net: &Net, dtype: DType, batch: usize, chunks: Vec<Vec<Tensor>>) -> Result<Eval, Exit> {
        let bad = |e: meshwork_program::Error| Exit::Usage(e.to_string());
        let mut b = Builder::new();
        let feeds = net.feeds(&mut b, batch, dtype).map_err(bad)?;
        let (logits, labels, axes) = match net {
            Net::Transformer(model) => {
                let rows = feeds[0];
                let inputs = b.slice(rows, &[0, 0], &[batch, model.seq], &[1, 1]).map_err(bad)?;
                let targets =
                    b.slice(rows, &[0, 1], &[batch, model.seq + 1], &[1, 1]).map_err(bad)?;
                (model.logits(&mut b, inputs, dtype).map_err(bad)?, targets, vec![0, 1])
            }
            Net::Cnn(c) => (
                crate::cnn::logits(&mut b, feeds[0], c.filters, c.classes).map_err(bad)?,
                feeds[1],
                vec![0],
            ),
            Net::Mlp(m) => (
                crate::cnn::mlp_logits_on(&mut b, feeds[0], m.hidden, m.classes, &[])
                    .map_err(bad)?,
                feeds[1],
                vec![0],
            ),
        };
        let loss = meshwork_nn::softmax_cross_entropy(&mut b, logits, labels).map_err(bad)?;
        let pred = b.argmax(logits, -1).map_err(bad)?;
        let pred = b.convert(pred, DType::I32).map_err(bad)?;
        let hit = b.eq(pred, labels).map_err(bad)?;
        let hit = b.convert(hit, dtype).map_err(bad)?;
        let accuracy = b.reduce_mean(hit, &axes, false).map_err(bad)?;
        let program = b.finish(&[loss, accuracy]).map_err(bad)?;
        let exe = meshwork_program::fast::Executable::compile(
            &program,
            meshwork_program::fast::Options::for_devices(1),
        );
        Ok(Eval { exe, program, fed: net.fed(), chunks })
    }

    /// (loss, accuracy) over the held-out rows with `run`'s weights.
    fn run(&self, run: &dyn Run) -> Result<(f64, f64), Exit> {
        let mut weights = Vec::new();
        for p in &self.program.params()[self.fed..] {
            weights.push(run.weight(&p.name)?);
        }
        let (mut loss, mut accuracy) = (0.0, 0.0);
        for chunk in &self.chunks {
            // The rows and the weights are read in place.
            let inputs = chunk.iter().chain(&weights).map(Input::Borrowed).collect();
            let out = self
                .exe
                .run_inputs(inputs, &meshwork_program::Env::local())
                .map_err(|e| Exit::Failed(format!("evaluation: {e}")))?;
            loss += out[0].to_f64()[0];
            accuracy += out[1].to_f64()[0];
        }
        let k = self.chunks.len() as f64;
        Ok((loss / k, accuracy / k))
    }
}

/// The loss program of `net` for `batch` rows over `layout`.
fn loss_program(
    net: &Net,
    batch: usize,
    dtype: DType,
    layout: Layout,
) -> Result<(Program, Value), Exit> {
    let bad = |e: meshwork_program::Error| Exit::Usage(e.to_string());
    let mut b = Builder::new();
    let feeds = net.feeds(&mut b, batch, dtype).map_err(bad)?;
    let loss = match (net, layout) {
        (Net::Transformer(model), Layout::Mesh { .. }) => model.loss(&mut b, feeds[0], dtype),
        (Net::Transformer(model), Layout::Pipeline { replicas, stages, micro }) => {
            model.loss_pipelined(&mut b, feeds[0], dtype, &Pipeline::cpus(replicas, stages, micro))
        }
        (Net::Cnn(c), Layout::Mesh { .. }) => {
            crate::cnn::logits(&mut b, feeds[0], c.filters, c.classes)
                .and_then(|logits| meshwork_nn::softmax_cross_entropy(&mut b, logits, feeds[1]))
        }
        (Net::Cnn(c), Layout::Pipeline { replicas, stages, micro }) => crate::cnn::loss_pipelined(
            &mut b,
            feeds[0],
            feeds[1],
            &Pipeline::cpus(replicas, stages, micro),
            &|b, x, st| crate::cnn::logits_on(b, x, c.filters, c.classes, st),
        ),
        (Net::Mlp(m), Layout::Mesh { .. }) => {
            crate::cnn::mlp_logits_on(&mut b, feeds[0], m.hidden, m.classes, &[])
                .and_then(|logits| meshwork_nn::softmax_cross_entropy(&mut b, logits, feeds[1]))
        }
        (Net::Mlp(m), Layout::Pipeline { replicas, stages, micro }) => crate::cnn::loss_pipelined(
            &mut b,
            feeds[0],
            feeds[1],
            &Pipeline::cpus(replicas, stages, micro),
            &|b, x, st| crate::cnn::mlp_logits_on(b, x, m.hidden, m.classes, st),
        ),
    }
    .map_err(bad)?;
    Ok((b.finish(&[loss]).map_err(bad)?, loss))
}

/// What a run trains: the model, its batch, dtype, optimizer, clipping and weights.
struct Recipe<'a> {
    net: &'a Net,
    batch: usize,
    dtype: DType,
    optimizer: Optimizer,
    clip: Option<f64>,
    init: &'a HashMap<String, Tensor>,
}

/// Compiles (or places) the training step of `recipe` over `layout` on `strategy`.
fn start<'s>(
    strategy: &'s Strategy,
    layout: Layout,
    recipe: &Recipe<'_>,
) -> Result<Box<dyn Run + 's>, Exit> {
    let Recipe { net, batch, dtype, optimizer, clip, init } = *recipe;
    let failed = |e: &dyn std::fmt::Display| Exit::Failed(e.to_string());
    let fed = net.fed();
    let (program, loss) = loss_program(net, batch, dtype, layout)?;
    let weights: Vec<Value> = (fed..program.params().len()).map(|k| Value(k as u32)).collect();
    for p in &program.params()[fed..] {
        let t =
            init.get(&p.name).ok_or_else(|| Exit::Usage(format!("--init has no {}", p.name)))?;
        if t.shape() != p.spec.shape.dims() {
            return Err(Exit::Usage(format!(
                "--init: {} is {:?}, the model's is {:?}",
                p.name,
                t.shape(),
                p.spec.shape.dims()
            )));
        }
    }
    let weight = |name: &str| -> Result<Tensor, Exit> {
        let t = init.get(name).ok_or_else(|| Exit::Usage(format!("--init has no {name}")))?;
        Ok(cast(t, dtype)?)
    };
    match layout {
        Layout::Mesh { data, model: m } => {
            let mesh = Mesh::iota(&[("data", data), ("model", m)]).map_err(|e| failed(&e))?;
            let mut shardings = Shardings::new(mesh);
            for p in &program.params()[..fed] {
                shardings = shardings.with(&p.name, "P('data')").map_err(|e| failed(&e))?;
            }
            for p in &program.params()[fed..] {
                shardings =
                    match (net, p.name.as_str()) {
                        // The main job's split: W1 by columns, W2 by rows over `model`.
                        (Net::Mlp(_), "w1") => shardings.with(&p.name, "P(None, 'model')"),
                        (Net::Mlp(_), "b1") => shardings.with(&p.name, "P('model')"),
                        (Net::Mlp(_), "w2") => shardings.with(&p.name, "P('model', None)"),
                        _ => Ok(shardings
                            .with_spec(&p.name, megatron_spec(&p.name, p.spec.shape.rank()))),
                    }
                    .map_err(|e| failed(&e))?;
            }
            let step = strategy
                .compile_train_step_clipped(&program, loss, &weights, optimizer, clip, &shardings)
                .map_err(|e| failed(&e))?;
            for p in &program.params()[fed..] {
                step.set(&p.name, &weight(&p.name)?).map_err(|e| failed(&e))?;
            }
            Ok(Box::new(SpmdRun(step)))
        }
        Layout::Pipeline { .. } => {
            let step = TrainStep::clipped(&program, loss, &weights, optimizer, clip)
                .map_err(|e| failed(&e))?;
            let sp = &step.program;
            let carry: Vec<(usize, usize)> =
                (1..sp.results().len()).map(|r| (r, r - 1 + fed)).collect();
            let placed =
                strategy.place(sp, &carry, &PlaceOptions::default()).map_err(|e| failed(&e))?;
            for p in &program.params()[fed..] {
                placed.set(&p.name, weight(&p.name)?).map_err(|e| failed(&e))?;
            }
            let first_state = fed + weights.len();
            for (k, t) in step.init_state().map_err(|e| failed(&e))?.into_iter().enumerate() {
                placed.set(&sp.params()[first_state + k].name, t).map_err(|e| failed(&e))?;
            }
            let (host_program, host_loss) =
                loss_program(net, batch, dtype, Layout::Mesh { data: 1, model: 1 })?;
            let host = (host_program, host_loss, weights.clone(), optimizer, clip);
            Ok(Box::new(PlacedRun { placed, step, host, fed }))
        }
    }
}

/// The learning rate of step `s`: linear warm-up over `warmup` steps, then constant
/// or cosine decay to 0 at the last of `steps`.
pub(crate) fn learning_rate(lr: f64, s: usize, steps: usize, warmup: usize, cosine: bool) -> f64 {
    if s < warmup {
        return lr * (s + 1) as f64 / warmup as f64;
    }
    if !cosine || steps <= warmup + 1 {
        return lr;
    }
    let t = (s - warmup) as f64 / (steps - warmup - 1) as f64;
    lr * 0.5 * (1.0 + (std::f64::consts::PI * t).cos())
}

/// A terminal's progress bar (on stderr) of `steps` steps: position, count, a message
/// (the loss and the rate) and the time left.
pub(crate) fn progress_bar(steps: usize) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(steps as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:32.cyan/blue} {pos}/{len} steps  {msg}  eta {eta}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
        .progress_chars("█▉▊▋▌▍▎▏ "),
    );
    bar
}

/// `result`, having written the losses so far to `--losses-json` (`json`) when it is
/// an error: a run that fails leaves its losses as one that finishes does.
fn kept<T>(json: Option<&str>, losses: &[f64], result: Result<T, Exit>) -> Result<T, Exit> {
    if result.is_err()
        && let Some(p) = json
    {
        let _ = write_atomic(p, &serde_json::to_string(losses).unwrap_or_default());
    }
    result
}

/// Step `s`'s loss on `where_` against one device's (`want`, when checked): a loss
/// that is not finite, or one further than `tol` (relative) from one device's, fails
/// the run. Steps are counted from 0 and named from 1, as the progress lines do.
fn check_step(s: usize, loss: f64, want: Option<f64>, tol: f64, where_: &str) -> Result<(), Exit> {
    if !loss.is_finite() {
        return Err(Exit::Failed(format!("step {}: the loss is {loss}", s + 1)));
    }
    match want {
        Some(want) if !want.is_finite() || (loss - want).abs() > tol * want.abs().max(1e-12) => {
            Err(Exit::Failed(format!(
                "step {}: loss {loss} on {where_}, {want} on one device (tolerance {tol:e} relative)",
                s + 1,
            )))
        }
        _ => Ok(()),
    }
}

/// Opens `path` as a new file (never one that exists: meshwork does not overwrite
/// what it did not create).
fn new_file(flag: &str, path: &str) -> Result<std::fs::File, Usage> {
    std::fs::OpenOptions::new().write(true).create_new(true).open(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::AlreadyExists {
            usage(flag, format!("{path} exists; meshwork writes only new files here"))
        } else {
            usage(flag, format!("cannot create {path}: {e}"))
        }
    })
}

/// The train loss per step (and the eval loss at its steps, `(step, loss, _)`) as an
/// SVG line chart.
pub(crate) fn svg(
    losses: &[f64],
    evals: &[(usize, f64, f64)],
    first: usize,
    title: &str,
) -> String {
    let (w, h, pad) = (640.0, 360.0, 48.0);
    let (lo, hi) = losses
        .iter()
        .chain(evals.iter().map(|e| &e.1))
        .filter(|x| x.is_finite())
        .fold((f64::MAX, f64::MIN), |(l, h), &x| (l.min(x), h.max(x)));
    let (lo, hi) = if hi > lo { (lo, hi) } else { (lo - 1.0, lo + 1.0) };
    let n = losses.len().max(2) - 1;
    let at = |s: usize, x: f64| {
        let px = pad + (w - 2.0 * pad) * s as f64 / n as f64;
        let py = h - pad - (h - 2.0 * pad) * (x - lo) / (hi - lo);
        format!("{px:.1},{py:.1}")
    };
    let points: Vec<String> = losses.iter().enumerate().map(|(s, &x)| at(s, x)).collect();
    let eval_points: Vec<String> = evals.iter().map(|&(s, x, _)| at(s, x)).collect();
    let eval_line = if evals.is_empty() {
        String::new()
    } else {
        format!(
            "<polyline fill=\"none\" stroke=\"darkorange\" stroke-width=\"2\" points=\"{}\"/>\n\
             <text x=\"{}\" y=\"40\" font-family=\"sans-serif\" font-size=\"11\" fill=\"darkorange\" text-anchor=\"end\">eval</text>\n",
            eval_points.join(" "),
            w - pad
        )
    };
    let escaped = title.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;");
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{pad}\" y=\"24\" font-family=\"sans-serif\" font-size=\"14\">{escaped}</text>\n\
         <line x1=\"{pad}\" y1=\"{b}\" x2=\"{r}\" y2=\"{b}\" stroke=\"black\"/>\n\
         <line x1=\"{pad}\" y1=\"{pad}\" x2=\"{pad}\" y2=\"{b}\" stroke=\"black\"/>\n\
         <text x=\"4\" y=\"{pad}\" font-family=\"sans-serif\" font-size=\"11\">{hi:.3}</text>\n\
         <text x=\"4\" y=\"{b}\" font-family=\"sans-serif\" font-size=\"11\">{lo:.3}</text>\n\
         <text x=\"{r}\" y=\"{t}\" font-family=\"sans-serif\" font-size=\"11\" text-anchor=\"end\">step {steps}</text>\n\
         <polyline fill=\"none\" stroke=\"steelblue\" stroke-width=\"1.5\" points=\"{}\"/>\n{eval_line}</svg>\n",
        points.join(" "),
        b = h - pad,
        r = w - pad,
        t = h - pad + 16.0,
        steps = first + losses.len(),
    )
}

/// A loss curve in one line of block characters.
pub(crate) fn sparkline(losses: &[f64], width: usize) -> String {
    const BARS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];
    if losses.is_empty() {
        return String::new();
    }
    let per = losses.len().div_ceil(width).max(1);
    let points: Vec<f64> =
        losses.chunks(per).map(|c| c.iter().sum::<f64>() / c.len() as f64).collect();
    let (lo, hi) = points.iter().fold((f64::MAX, f64::MIN), |(l, h), &x| (l.min(x), h.max(x)));
    points
        .iter()
        .map(|&x| {
            let k = if hi > lo { ((x - lo) / (hi - lo) * 7.0).round() as usize } else { 0 };
            BARS[k.min(7)]
        })
        .collect()
}

/// `meshwork inspect --model transformer`'s help.
pub(crate) const INSPECT_HELP: &str = "\
meshwork inspect --model transformer — print the training step of the transformer as
each device runs it on a data x model mesh: the per-device program with its
collectives, then how many collectives (and launches) a step runs and the bytes it
moves between devices.

flags:
  --mesh DxM            (default 1x2)
  --layers --dim --heads --ffn --vocab --seq   the model (defaults 2, 64, 4, 256, 256, 32)
  --init INIT.safetensors   the sizes from a file's tensors
  --batch B             (default 8)
  --optimizer sgd|momentum|adam|adamw   (default adam)
  --dtype f32|f64       (default f32)
";

const INSPECT_VALUED: &[&str] = &[
    "model",
    "layers",
    "dim",
    "heads",
    "ffn",
    "vocab",
    "seq",
    "init",
    "batch",
    "optimizer",
    "dtype",
    "mesh",
];

/// `--optimizer`'s value.
/// The refusal of `--init` without `--heads`: the file does not say how many heads
/// the attention has.
fn heads_with_init() -> Exit {
    Exit::Usage(
        "--heads: an --init file does not say how many heads its attention has; give --heads"
            .into(),
    )
}

/// The data flags a run's metadata recorded (`[--data-tokens, --text, --data-x]`), as
/// a person gives them.
fn data_text(data: &serde_json::Value) -> String {
    let given: Vec<String> = ["--data-tokens", "--text", "--data-x"]
        .iter()
        .zip(data.as_array().into_iter().flatten())
        .filter_map(|(flag, v)| v.as_str().map(|p| format!("{flag} {p}")))
        .collect();
    if given.is_empty() { "the built-in data".into() } else { given.join(" ") }
}

/// What an evaluation's accuracy counts: the next token, or the class.
fn accuracy_label(net: &Net) -> &'static str {
    if matches!(net, Net::Transformer(_)) { "next-token accuracy" } else { "accuracy" }
}

/// An optimizer as a person names it: `adam`, `momentum 0.9`, `adamw (decay 0.01)`.
fn optimizer_text(o: Optimizer) -> String {
    match o {
        Optimizer::Sgd => "sgd".into(),
        Optimizer::Momentum { momentum } => format!("momentum {momentum}"),
        Optimizer::Adam { .. } => "adam".into(),
        Optimizer::AdamW { weight_decay, .. } => format!("adamw (decay {weight_decay})"),
    }
}

pub(crate) fn optimizer_flag(a: &Args) -> Result<Optimizer, Usage> {
    let default = if a.get("model") == Some("mlp") { "sgd" } else { "adam" };
    Ok(match a.get("optimizer").unwrap_or(default) {
        "sgd" => Optimizer::Sgd,
        "momentum" => Optimizer::Momentum { momentum: 0.9 },
        "adam" => Optimizer::adam(),
        "adamw" => Optimizer::adamw(0.01),
        other => {
            return Err(Usage(format!(
                "--optimizer {other:?} is not sgd, momentum, adam or adamw"
            )));
        }
    })
}

/// `--dtype`'s value (default f32).
pub(crate) fn dtype_flag(a: &Args) -> Result<DType, Usage> {
    let default = if a.get("model") == Some("mlp") { "f64" } else { "f32" };
    match a.get("dtype").unwrap_or(default) {
        "f32" => Ok(DType::F32),
        "f64" => Ok(DType::F64),
        other => Err(Usage(format!("--dtype {other:?} is not f32 or f64"))),
    }
}

/// `meshwork inspect --model transformer`: the partitioned training step.
pub(crate) fn inspect(argv: &[String]) -> Result<(), Exit> {
    let a = Args::parse(argv, INSPECT_VALUED, &[])?;
    if let Some(p) = a.positional.first() {
        return Err(Usage(format!("inspect takes no positional argument ({p:?})")).into());
    }
    let (data, m) = args::mesh("mesh", a.get("mesh").unwrap_or("1x2"))?;
    if data * m > MAX_DEVICES {
        return Err(Usage(format!("--mesh {data}x{m} has more than {MAX_DEVICES} devices")).into());
    }
    let cnn = a.get("model") == Some("cnn");
    let batch: usize = a.parse_or("batch", if cnn { 32 } else { 8 }, "a batch size")?;
    if batch == 0 || !batch.is_multiple_of(data) {
        return Err(Usage(format!("--batch {batch} does not split over {data} replicas")).into());
    }
    let optimizer = optimizer_flag(&a)?;
    let dtype = dtype_flag(&a)?;
    let file = a.get("init").map(|p| read_init(p, 8 << 30)).transpose()?;
    if file.is_some() && a.get("heads").is_none() {
        return Err(heads_with_init());
    }
    let model = model(&a, file.as_ref())?;
    if !model.heads.is_multiple_of(m) || !model.ffn.is_multiple_of(m) {
        return Err(Usage(format!(
            "--mesh {data}x{m}: the model axis must divide --heads {} and --ffn {}",
            model.heads, model.ffn
        ))
        .into());
    }
    let failed = |e: &dyn std::fmt::Display| Exit::Failed(e.to_string());
    let (program, loss) =
        loss_program(&Net::Transformer(model), batch, dtype, Layout::Mesh { data, model: m })?;
    let weights: Vec<Value> = (1..program.params().len()).map(|k| Value(k as u32)).collect();
    let mesh = Mesh::iota(&[("data", data), ("model", m)]).map_err(|e| failed(&e))?;
    let mut shardings = Shardings::new(mesh).with("rows", "P('data')").map_err(|e| failed(&e))?;
    for p in &program.params()[1..] {
        shardings = shardings.with_spec(&p.name, megatron_spec(&p.name, p.spec.shape.rank()));
    }
    let strategy = Strategy::data_parallel(data * m).map_err(|e| failed(&e))?;
    let step = strategy
        .compile_train_step(&program, loss, &weights, optimizer, &shardings)
        .map_err(|e| failed(&e))?;
    let part = step.compiled().partitioned();
    outln!("{part}");
    let mut kinds: std::collections::BTreeMap<String, usize> = Default::default();
    for c in part.collectives() {
        *kinds.entry(format!("{} over {}", c.op, c.axes.join("+"))).or_default() += 1;
    }
    outln!(
        "# transformer L{} D{} H{} F{} V{} T{}, batch {batch}, {dtype}, {optimizer:?} on mesh {data}x{m}",
        model.layers,
        model.dim,
        model.heads,
        model.ffn,
        model.vocab,
        model.seq
    );
    outln!(
        "# a step runs {} collectives in {} launches ({}) and moves {:.3} MB between devices",
        part.collectives().len(),
        part.launches(),
        kinds.iter().map(|(k, n)| format!("{n} {k}")).collect::<Vec<_>>().join(", "),
        part.bytes_moved() as f64 / 1e6
    );
    Ok(())
}

pub(crate) fn run(argv: &[String]) -> Result<(), Exit> {
    let a = Args::parse(argv, VALUED, SWITCHES)?;
    if let Some(p) = a.positional.first() {
        return Err(Usage(format!(
            "train takes no positional argument ({p:?}); see `meshwork help train`"
        ))
        .into());
    }
    let max_memory = match a.get("max-memory") {
        Some(t) => crate::train::bytes_flag("max-memory", t)?,
        None => 8 << 30,
    };
    // What reading the data and the initial weights may hold.
    let limit = max_memory;
    // `--model mlp` keeps the main job's defaults (2x2, 200 steps of 64 rows, SGD at
    // 0.5, f64).
    let mlp = a.get("model") == Some("mlp");
    let (data, model_axis) =
        args::mesh("mesh", a.get("mesh").unwrap_or(if mlp { "2x2" } else { "1x1" }))?;
    let stages: usize = a.parse_or("stages", 1, "a number of stages")?;
    let micro: usize = a.parse_or("microbatches", 1, "a number of micro-batches")?;
    if stages == 0 || micro == 0 {
        return Err(Usage("--stages and --microbatches must be at least 1".into()).into());
    }
    if stages > 1 && model_axis > 1 {
        return Err(Usage(format!(
            "--stages {stages} with --mesh {data}x{model_axis}: a pipeline's replicas are the mesh's data axis (use --mesh {data}x1)"
        ))
        .into());
    }
    if micro > 1 && stages == 1 {
        return Err(Usage("--microbatches needs --stages K (a pipeline)".into()).into());
    }
    let devices = data
        .checked_mul(model_axis)
        .and_then(|d| d.checked_mul(stages))
        .filter(|&d| d <= MAX_DEVICES)
        .ok_or_else(|| {
            Usage(format!(
                "--mesh {data}x{model_axis} with {stages} stages is more than {MAX_DEVICES} devices; each device of a CPU mesh is a thread"
            ))
        })?;
    if devices > MAX_DEVICES {
        return Err(Usage(format!(
            "{devices} devices is more than {MAX_DEVICES}; each device of a CPU mesh is a thread"
        ))
        .into());
    }
    let layout = if stages > 1 {
        Layout::Pipeline { replicas: data, stages, micro }
    } else {
        Layout::Mesh { data, model: model_axis }
    };
    let steps: usize = a.parse_or("steps", if mlp { 200 } else { 100 }, "a step count")?;
    let cnn = a.get("model") == Some("cnn");
    let default_batch = if mlp {
        64
    } else if cnn {
        32
    } else {
        8
    };
    let batch: usize = a.parse_or("batch", default_batch, "a batch size")?;
    if steps == 0 || batch == 0 {
        return Err(Usage("--steps and --batch must be at least 1".into()).into());
    }
    if steps > MAX_STEPS {
        return Err(Usage(format!("--steps {steps} is more than {MAX_STEPS}")).into());
    }
    let shares = data.saturating_mul(if stages > 1 { micro } else { 1 });
    if !batch.is_multiple_of(shares) {
        return Err(Usage(format!(
            "--batch {batch} does not split into {data} replicas{}",
            if stages > 1 { format!(" × {micro} micro-batches") } else { String::new() }
        ))
        .into());
    }
    let optimizer = optimizer_flag(&a)?;
    let default_lr = if mlp {
        0.5
    } else if matches!(optimizer, Optimizer::Adam { .. } | Optimizer::AdamW { .. }) {
        0.01
    } else {
        0.1
    };
    let lr: f64 = a.parse_or("lr", default_lr, "a learning rate")?;
    let base_lr = lr;
    if !(lr.is_finite() && lr > 0.0) {
        return Err(Usage(format!("--lr {} must be a positive number", number_text(lr))).into());
    }
    let dtype = dtype_flag(&a)?;
    let seed: u64 = a.parse_or("seed", 0, "a seed (a whole number ≥ 0)")?;
    let warmup: usize = a.parse_or("warmup", 0, "a step count")?;
    let steps_per_run: usize = a.parse_or("steps-per-run", 1, "a step count")?;
    if steps_per_run == 0 {
        return Err(Usage("--steps-per-run must be at least 1".into()).into());
    }
    let clip = match a.get("clip-norm") {
        None => None,
        Some(_) => {
            let c: f64 = a.parse_or("clip-norm", 1.0, "a norm")?;
            if !(c.is_finite() && c > 0.0) {
                return Err(Usage(format!("--clip-norm {c} must be a positive number")).into());
            }
            Some(c)
        }
    };
    let cosine = match a.get("schedule").unwrap_or("constant") {
        "constant" => false,
        "cosine" => true,
        other => {
            return Err(Usage(format!("--schedule {other:?} is not constant or cosine")).into());
        }
    };
    if let Some(p) = a.get("losses-json") {
        check_output_file("losses-json", p)?;
    }
    if let Some(p) = a.get("plot") {
        check_output_file("plot", p)?;
        if Path::new(p).exists() {
            return Err(
                usage("plot", format!("{p} exists; meshwork writes only new files here")).into()
            );
        }
    }
    if let Some(p) = a.get("metrics-jsonl") {
        check_output_file("metrics-jsonl", p)?;
        if Path::new(p).exists() {
            return Err(usage(
                "metrics-jsonl",
                format!("{p} exists; meshwork writes only new files here"),
            )
            .into());
        }
    }
    let outputs: Vec<(&str, &str)> = ["losses-json", "metrics-jsonl", "plot", "checkpoint-dir"]
        .into_iter()
        .filter_map(|f| a.get(f).map(|p| (f, p)))
        .collect();
    for (i, (f, p)) in outputs.iter().enumerate() {
        if let Some((g, _)) = outputs[..i].iter().find(|(_, q)| Path::new(q) == Path::new(p)) {
            return Err(
                usage(f, format!("{p} is also --{g}'s; give each output its own path")).into()
            );
        }
    }
    let quiet = a.on("quiet");
    let (checkpoint_dir, checkpoint_every, keep) = crate::train::checkpoint_flags(&a)?;
    if a.get("init").is_some() && a.get("resume").is_some() {
        return Err(Usage(
            "--init and --resume both set the weights; give one (a resumed run takes its weights from the checkpoint)".into(),
        )
        .into());
    }
    let resume = match a.get("resume") {
        None => None,
        Some(p) => {
            let (dir, _) = meshwork_strategy::checkpoint::find_checkpoint(p)
                .map_err(|e| usage("resume", e))?;
            let meta = meshwork_strategy::checkpoint::checkpoint_metadata(&dir)
                .map_err(|e| usage("resume", e))?
                .filter(|m| m["model"] == a.get("model").unwrap_or("transformer"))
                .ok_or_else(|| {
                    usage(
                        "resume",
                        format!(
                            "{} is not a checkpoint of a {} run",
                            dir.display(),
                            a.get("model").unwrap_or("transformer")
                        ),
                    )
                })?;
            Some((dir, meta))
        }
    };
    let file = a.get("init").map(|p| read_init(p, limit)).transpose()?;
    let (net, examples, n_all) = if mlp {
        for flag in
            ["text", "data-tokens", "layers", "dim", "heads", "ffn", "vocab", "seq", "filters"]
        {
            if a.get(flag).is_some() {
                return Err(Usage(format!("--{flag} is not the MLP's")).into());
            }
        }
        let classes = match a.get("classes") {
            None => None,
            Some(_) => Some(a.parse_or("classes", 2, "a number of classes")?)
                .filter(|&c| c >= 2)
                .map(Some)
                .ok_or_else(|| Usage("--classes: need at least 2".into()))?,
        };
        let saved_hidden = resume
            .as_ref()
            .and_then(|(_, m)| m["hidden"].as_u64())
            .and_then(|h| usize::try_from(h).ok());
        let init_hidden =
            file.as_ref().and_then(|f| f.get("w1")).and_then(|t| t.shape().get(1).copied());
        let hidden: usize = a.parse_or(
            "hidden",
            saved_hidden.or(init_hidden).unwrap_or(32),
            "a number of hidden units",
        )?;
        if let Some(h) = init_hidden
            && h != hidden
        {
            return Err(usage(
                "hidden",
                format!("{hidden} disagrees with --init, whose w1 has {h}"),
            )
            .into());
        }
        if hidden == 0 {
            return Err(Usage("--hidden must be at least 1".into()).into());
        }
        if stages > 2 {
            return Err(Usage(format!("--stages {stages}: the MLP has 2 layers")).into());
        }
        let data_set = crate::train::dataset(&a, seed, limit, classes)?;
        let net = Mlp { features: data_set.features(), hidden, classes: data_set.classes };
        if model_axis > 1 && !hidden.is_multiple_of(model_axis) {
            return Err(Usage(format!(
                "--mesh {data}x{model_axis}: the model axis must divide --hidden {hidden}"
            ))
            .into());
        }
        let need = memory_estimate(&Net::Mlp(net), batch, dtype, devices, true);
        if need > max_memory as f64 {
            return Err(memory_error(need, max_memory).into());
        }
        if let Some((_, saved)) = &resume
            && (saved["features"] != net.features || saved["classes"] != net.classes)
        {
            return Err(usage(
                "resume",
                format!(
                    "the checkpoint's MLP takes {} features to {} classes, the data {} to {}",
                    saved["features"], saved["classes"], net.features, net.classes
                ),
            )
            .into());
        }
        let n = data_set.x.nrows();
        let x: Vec<f64> = data_set.x.iter().copied().collect();
        let y = data_set.labels.iter().map(|&l| l as i32).collect();
        let examples = Examples::Images { per: net.features, dims: vec![net.features], x, y };
        (Net::Mlp(net), examples, n)
    } else if cnn {
        if model_axis > 1 {
            return Err(Usage(format!(
                "--mesh {data}x{model_axis}: the CNN's weights are not split over a model axis (--mesh Dx1, or --stages K)"
            ))
            .into());
        }
        if stages > 3 {
            return Err(Usage(format!("--stages {stages}: the CNN has 3 layers")).into());
        }
        let images = crate::cnn::images(&a, seed, limit)?;
        // The filters: from --init's convolutions (HWIO), the checkpoint's run, or
        // --filters; a flag that disagrees with the file or the checkpoint is refused.
        let from_file = match &file {
            Some(f) => {
                let out = |name: &str| {
                    f.get(name).and_then(|t| match t.shape() {
                        &[3, 3, _, o] => Some(o),
                        _ => None,
                    })
                };
                match (out("conv1.weight"), out("conv2.weight")) {
                    (Some(f1), Some(f2)) => Some([f1, f2]),
                    _ => {
                        return Err(usage(
                            "init",
                            "the CNN needs conv1.weight and conv2.weight of shape [3, 3, in, out]",
                        )
                        .into());
                    }
                }
            }
            None => None,
        };
        let from_saved = resume
            .as_ref()
            .and_then(|(_, m)| serde_json::from_value::<[usize; 2]>(m["filters"].clone()).ok());
        let [f1, f2] = match a.get("filters") {
            None => from_saved.or(from_file).unwrap_or([8, 16]),
            Some(text) => {
                let filters: Vec<usize> = args::dims("filters", text)?;
                let [f1, f2] = filters[..] else {
                    return Err(
                        Usage(format!("--filters {filters:?}: give two counts, F1,F2")).into()
                    );
                };
                for (whose, had) in
                    [("--init's convolutions", from_file), ("the checkpoint", from_saved)]
                {
                    if let Some([g1, g2]) = had
                        && [g1, g2] != [f1, f2]
                    {
                        return Err(usage(
                            "filters",
                            format!("{f1},{f2} disagrees with {whose}, which have {g1},{g2}"),
                        )
                        .into());
                    }
                }
                [f1, f2]
            }
        };
        if f1 == 0 || f2 == 0 {
            return Err(
                Usage(format!("--filters {f1},{f2}: each convolution needs a filter")).into()
            );
        }
        for flag in [
            "text",
            "data-tokens",
            "layers",
            "dim",
            "heads",
            "ffn",
            "vocab",
            "seq",
            "hidden",
            "classes",
        ] {
            if a.get(flag).is_some() {
                return Err(Usage(format!("--{flag} is not the CNN's")).into());
            }
        }
        let [n, h, w, c] = images.dims;
        let net = Cnn { image: [h, w, c], classes: images.classes, filters: [f1, f2] };
        if let Some((_, saved)) = &resume
            && saved["image"] != serde_json::json!(net.image)
        {
            return Err(usage(
                "resume",
                format!(
                    "the checkpoint's images are {}, the data's {:?}",
                    saved["image"], net.image
                ),
            )
            .into());
        }
        let need = memory_estimate(&Net::Cnn(net), batch, dtype, devices, true);
        if need > max_memory as f64 {
            return Err(memory_error(need, max_memory).into());
        }
        let examples =
            Examples::Images { per: h * w * c, dims: vec![h, w, c], x: images.x, y: images.y };
        (Net::Cnn(net), examples, n)
    } else {
        for flag in ["data-x", "data-y", "filters", "hidden", "classes"] {
            if a.get(flag).is_some() {
                return Err(Usage(format!("--{flag} is not the transformer's")).into());
            }
        }
        if a.get("init").is_some() && a.get("heads").is_none() {
            return Err(heads_with_init());
        }
        let model = match &resume {
            Some((_, meta)) => model_from(&a, meta)?,
            None => model(&a, file.as_ref())?,
        };
        if let Layout::Mesh { model: m, .. } = layout
            && (!model.heads.is_multiple_of(m) || !model.ffn.is_multiple_of(m))
        {
            return Err(Usage(format!(
                "--mesh {data}x{m}: the model axis must divide --heads {} and --ffn {}",
                model.heads, model.ffn
            ))
            .into());
        }
        // Block i goes on stage ⌊i·K/L⌋ and the head on the last: up to L + 1 stages
        // leave none idle.
        if stages > model.layers + 1 {
            return Err(Usage(format!(
                "--stages {stages}: the transformer's {} blocks and its head fill at most {} stages",
                model.layers,
                model.layers + 1
            ))
            .into());
        }
        let need = memory_estimate(&Net::Transformer(model), batch, dtype, devices, true);
        if need > max_memory as f64 {
            return Err(memory_error(need, max_memory).into());
        }
        let (n, tokens) = rows(&a, &model, seed, limit)?;
        (Net::Transformer(model), Examples::Tokens { width: model.seq + 1, tokens }, n)
    };
    let mut meta = net.meta();
    meta["dtype"] = dtype.to_string().into();
    meta["optimizer"] = format!("{optimizer:?}").into();
    meta["clip_norm"] = serde_json::json!(clip);
    meta["batch"] = batch.into();
    // What the data order and the learning rates of a step depend on.
    meta["seed"] = seed.into();
    meta["shuffle"] = a.on("shuffle").into();
    meta["lr"] = lr.into();
    meta["warmup"] = warmup.into();
    meta["schedule"] = (if cosine { "cosine" } else { "constant" }).into();
    meta["cosine_steps"] = serde_json::json!(cosine.then_some(steps));
    meta["eval_fraction"] = serde_json::json!(
        a.get("eval-every").is_some().then(|| a.get("eval-fraction").unwrap_or("0.1"))
    );
    meta["data"] = serde_json::json!([a.get("data-tokens"), a.get("text"), a.get("data-x")]);
    meta["rows"] = n_all.into();
    meta["data_fingerprint"] = examples.fingerprint().into();
    if let Some((dir, saved)) = &resume {
        for key in [
            "dtype",
            "optimizer",
            "clip_norm",
            "batch",
            "seed",
            "shuffle",
            "lr",
            "warmup",
            "schedule",
            "cosine_steps",
            "eval_fraction",
            "rows",
            "data_fingerprint",
        ] {
            if saved[key] != meta[key] && (key == "rows" || key == "data_fingerprint") {
                return Err(usage(
                    "resume",
                    format!(
                        "{} was saved by a run on other data ({}: {} rows, CRC-32C {}); this run's data has {} rows, CRC-32C {}",
                        dir.display(),
                        data_text(&saved["data"]),
                        saved["rows"],
                        saved["data_fingerprint"],
                        meta["rows"],
                        meta["data_fingerprint"]
                    ),
                )
                .into());
            }
            if saved[key] != meta[key] {
                return Err(usage(
                    "resume",
                    format!(
                        "{} was saved by a run with {key} {}; this one has {}",
                        dir.display(),
                        saved[key],
                        meta[key]
                    ),
                )
                .into());
            }
        }
    }
    if let Some(d) = checkpoint_dir {
        let p = Path::new(d);
        if p.exists() && !p.is_dir() {
            return Err(
                usage("checkpoint-dir", format!("{d} exists and is not a directory")).into()
            );
        }
    }
    let eval_every: usize = a.parse_or("eval-every", 0, "a step count")?;
    if a.get("eval-every").is_some() && eval_every == 0 {
        return Err(Usage("--eval-every must be at least 1 (a step count)".into()).into());
    }
    let fraction: f64 = a.parse_or("eval-fraction", 0.1, "a fraction")?;
    if a.get("eval-fraction").is_some() && eval_every == 0 {
        return Err(Usage("--eval-fraction needs --eval-every N".into()).into());
    }
    if !(fraction > 0.0 && fraction < 1.0) {
        return Err(Usage(format!("--eval-fraction {fraction} is not between 0 and 1")).into());
    }
    let held = if eval_every > 0 { (fraction * n_all as f64).ceil() as usize } else { 0 };
    let n = n_all - held;
    if eval_every > 0 && (held < batch || n == 0) {
        return Err(Usage(format!(
            "--eval-fraction {fraction} of {n_all} rows holds out {held}: need at least --batch {batch} held out and a row to train on"
        ))
        .into());
    }
    let init = match (file, net) {
        (Some(f), _) => f,
        // The main job's initial weights for the same seed.
        (None, Net::Mlp(m)) => {
            let p = meshwork_strategy::mlp::Params::init(seed, m.features, m.hidden, m.classes);
            let t = |shape: &[usize], v: Vec<f64>| {
                Tensor::f64(shape, v).map_err(|e| Exit::Failed(e.to_string()))
            };
            let (f, h, c) = (m.features, m.hidden, m.classes);
            HashMap::from([
                ("w1".to_string(), t(&[f, h], p.w1.iter().copied().collect())?),
                ("b1".to_string(), t(&[h], p.b1.to_vec())?),
                ("w2".to_string(), t(&[h, c], p.w2.iter().copied().collect())?),
                ("b2".to_string(), t(&[c], p.b2.to_vec())?),
            ])
        }
        (None, _) => {
            let (program, _) =
                loss_program(&net, batch, dtype, Layout::Mesh { data: 1, model: 1 })?;
            random_init(&program, net.fed(), &mut Noise(mix(seed ^ 0x5851_f42d_4c95_7f2d)))
        }
    };
    let shuffle = a.on("shuffle");
    let mut order: (usize, Vec<usize>) = (usize::MAX, Vec::new());
    let mut batch_of = |s: usize| -> Result<Vec<Tensor>, Exit> {
        let mut idx = Vec::with_capacity(batch);
        for i in 0..batch {
            let k = s * batch + i;
            let r = if shuffle {
                if order.0 != k / n {
                    order = (k / n, meshwork_strategy::mlp::permutation(seed, k / n, n));
                }
                order.1[k % n]
            } else {
                k % n
            };
            idx.push(r);
        }
        examples.batch(&idx, dtype)
    };
    let strategy = Strategy::data_parallel(devices).map_err(|e| Exit::Failed(e.to_string()))?;
    let recipe = Recipe { net: &net, batch, dtype, optimizer, clip, init: &init };
    let mut run = start(&strategy, layout, &recipe)?;
    let eval = if eval_every > 0 {
        let chunks = (0..held / batch)
            .map(|c| {
                examples.batch(&(n + c * batch..n + (c + 1) * batch).collect::<Vec<_>>(), dtype)
            })
            .collect::<Result<Vec<_>, Exit>>()?;
        Some(Eval::new(&net, dtype, batch, chunks)?)
    } else {
        None
    };
    let mut evals: Vec<(usize, f64, f64)> = Vec::new();
    // The one-device check: on by default for runs small enough to repeat on one
    // device (at most 1 GB by the estimate), on with --check, off with --no-check.
    let small = memory_estimate(&net, batch, dtype, devices, true) <= 1e9;
    if a.on("check") && a.on("no-check") {
        return Err(Usage("--check and --no-check contradict each other; give one".into()).into());
    }
    let check = devices > 1 && !a.on("no-check") && (small || a.on("check"));
    let one = Strategy::data_parallel(1).map_err(|e| Exit::Failed(e.to_string()))?;
    let mut reference =
        if check { Some(start(&one, Layout::Mesh { data: 1, model: 1 }, &recipe)?) } else { None };
    let first = match &resume {
        None => 0,
        Some((dir, _)) => {
            let restored = |e: meshwork_strategy::Error| Exit::Usage(format!("--resume: {e}"));
            let at = run.restore(dir).map_err(restored)?;
            if let Some(r) = reference.as_mut() {
                r.restore(dir).map_err(restored)?;
            }
            if at >= steps {
                return Err(Usage(format!(
                    "--resume: the checkpoint is at step {at}; --steps {steps} leaves nothing to run"
                ))
                .into());
            }
            at
        }
    };
    // Every check passed: now the outputs are made.
    let mut manager = checkpoint_dir
        .map(|d| meshwork_strategy::checkpoint::CheckpointManager::open(d, keep))
        .transpose()
        .map_err(|e| usage("checkpoint-dir", e))?;
    if let Some(m) = &manager
        && let Some((latest, _)) = m.latest().map_err(|e| usage("checkpoint-dir", e))?
        && latest > first
    {
        return Err(usage(
            "checkpoint-dir",
            format!(
                "{} already holds checkpoints up to step {latest}, which this run (from step {first}) would not continue; resume from it with --resume, or give another directory",
                checkpoint_dir.unwrap_or_default()
            ),
        )
        .into());
    }
    let mut metrics = a.get("metrics-jsonl").map(|p| new_file("metrics-jsonl", p)).transpose()?;
    let stop = crate::train::stop_flag()?;
    let where_ = match layout {
        Layout::Mesh { data, model } => format!("mesh {data}x{model}"),
        Layout::Pipeline { replicas, stages, micro } => {
            format!("{replicas} x {stages}-stage pipeline, {micro} micro-batches")
        }
    };
    if !quiet {
        outln!(
            "training {} on {n} rows ({dtype}, {}, lr {}) on {where_}, batch {batch}, {steps} steps",
            net.describe(),
            optimizer_text(optimizer),
            number_text(lr)
        );
    }
    // On a terminal, a progress bar (redrawn on stderr); otherwise plain lines, a
    // tenth of the run apart.
    let bar = (std::io::stderr().is_terminal() && !quiet).then(|| progress_bar(steps - first));
    let tol = if dtype == DType::F64 { 1e-9 } else { 1e-4 };
    let (per_row, unit) = net.per_row();
    let mut losses = Vec::with_capacity(steps);
    let mut busy = 0.0;
    let every = (steps / 10).max(1);
    let mut saved_at = None;
    // The one-device check's largest absolute and relative differences.
    let (mut most, mut most_rel) = (0.0f64, 0.0f64);
    // Losses computed ahead, a host call (--steps-per-run steps, up to the next
    // evaluation or checkpoint) at a time; the one-device check's beside them.
    let mut ahead: std::collections::VecDeque<(f64, Option<f64>)> = Default::default();
    let json = a.get("losses-json");
    for s in first..steps {
        let lr = learning_rate(lr, s, steps, warmup, cosine);
        if ahead.is_empty() {
            let mut end = s.saturating_add(steps_per_run).min(steps);
            for every in [eval_every, checkpoint_every] {
                if let Some(k) = s.checked_div(every) {
                    end = end.min((k + 1).saturating_mul(every));
                }
            }
            let feeds =
                kept(json, &losses, (s..end).map(&mut batch_of).collect::<Result<Vec<_>, _>>())?;
            let lrs: Vec<f64> =
                (s..end).map(|k| learning_rate(base_lr, k, steps, warmup, cosine)).collect();
            let t = Instant::now();
            let got = kept(json, &losses, run.steps(&feeds, &lrs, s))?;
            busy += t.elapsed().as_secs_f64();
            let want = match reference.as_mut() {
                Some(r) => {
                    kept(json, &losses, r.steps(&feeds, &lrs, s))?.into_iter().map(Some).collect()
                }
                None => vec![None; got.len()],
            };
            ahead.extend(got.into_iter().zip(want));
        }
        let (loss, want) = ahead.pop_front().expect("a step computed ahead");
        losses.push(loss);
        if let Some(want) = want {
            most = most.max((loss - want).abs());
            most_rel = most_rel.max((loss - want).abs() / want.abs().max(f64::MIN_POSITIVE));
        }
        kept(json, &losses, check_step(s, loss, want, tol, &where_))?;
        let rate = ((s + 1 - first) * batch) as f64 * per_row as f64 / busy;
        if let Some(m) = manager.as_mut()
            && (s + 1 == steps || (checkpoint_every > 0 && (s + 1) % checkpoint_every == 0))
        {
            let saved = run.save(m, &meta, s + 1);
            kept(json, &losses, saved.map_err(|e| Exit::Failed(format!("--checkpoint-dir: {e}"))))?;
            saved_at = Some(s + 1);
        }
        let evaluated = match &eval {
            Some(e) if (s + 1) % eval_every == 0 || s + 1 == steps => {
                let (l, acc) = kept(json, &losses, e.run(run.as_ref()))?;
                evals.push((s - first, l, acc));
                Some((l, acc))
            }
            _ => None,
        };
        if let Some(f) = metrics.as_mut() {
            let mut line = serde_json::json!({"step": s + 1, "loss": loss, "lr": lr});
            line[format!("{unit}_per_s")] = rate.into();
            if let Some((l, acc)) = evaluated {
                line["eval_loss"] = l.into();
                line["eval_accuracy"] = acc.into();
            }
            let written = writeln!(f, "{line}").and_then(|()| f.flush());
            kept(
                json,
                &losses,
                written.map_err(|e| Exit::Usage(format!("--metrics-jsonl: cannot write: {e}"))),
            )?;
        }
        if let Some(bar) = &bar {
            bar.set_message(format!("loss {}  {rate:.0} {unit}/s", loss_text(loss)));
            bar.inc(1);
        } else if !quiet && (s + 1 == steps || (s + 1) % every == 0) {
            eprintln!("step {:>5}/{steps} loss {}  {rate:.0} {unit}/s", s + 1, loss_text(loss));
        }
        if let Some((l, acc)) = evaluated
            && !quiet
        {
            let line = format!(
                "eval after step {}: loss {}, {} {:.2}%",
                s + 1,
                loss_text(l),
                accuracy_label(&net),
                100.0 * acc
            );
            match &bar {
                Some(bar) => bar.println(line),
                None => eprintln!("{line}"),
            }
        }
        if stop.load(std::sync::atomic::Ordering::SeqCst) && ahead.is_empty() && s + 1 < steps {
            if let Some(bar) = &bar {
                bar.abandon();
                eprintln!();
            }
            if let Some(m) = manager.as_mut()
                && saved_at != Some(s + 1)
            {
                run.save(m, &meta, s + 1)
                    .map_err(|e| Exit::Failed(format!("--checkpoint-dir: {e}")))?;
            }
            if let Some(p) = a.get("losses-json") {
                let text =
                    serde_json::to_string(&losses).map_err(|e| Exit::Failed(e.to_string()))?;
                write_atomic(p, &text)
                    .map_err(|e| Exit::Usage(format!("--losses-json {p}: {e}")))?;
            }
            eprintln!(
                "meshwork: stopped after step {}{}",
                s + 1,
                if manager.is_some() { "; resume with --resume" } else { "" }
            );
            return Err(Exit::Interrupted);
        }
    }
    if let Some(bar) = &bar {
        bar.finish();
        eprintln!();
    }
    if let Some(p) = a.get("losses-json") {
        let text = serde_json::to_string(&losses).map_err(|e| Exit::Failed(e.to_string()))?;
        write_atomic(p, &text).map_err(|e| Exit::Usage(format!("--losses-json {p}: {e}")))?;
    }
    if let Some(p) = a.get("plot") {
        let title = format!("meshwork: {} training loss on {where_}", net.describe());
        let mut f = new_file("plot", p)?;
        f.write_all(svg(&losses, &evals, first, &title).as_bytes())
            .map_err(|e| Exit::Usage(format!("--plot {p}: {e}")))?;
    }
    if !quiet {
        let made = losses.len();
        outln!("meshwork train: {} on {where_}, {dtype}, steps {first}..{steps}", net.describe());
        if let (Some(first_loss), Some(last)) = (losses.first(), losses.last()) {
            outln!("  final loss   {}  (first {})", loss_text(*last), loss_text(*first_loss));
            outln!("  loss curve   {}", sparkline(&losses, 60));
        }
        if let Some(&(k, l, acc)) = evals.last() {
            outln!(
                "  eval         after step {}: loss {}, {} {:.2}% on {} held-out rows",
                k + first + 1,
                loss_text(l),
                accuracy_label(&net),
                100.0 * acc,
                held / batch * batch
            );
        }
        outln!(
            "  throughput   {:.0} {unit}/s ({} in {busy:.2} s)",
            (made * batch) as f64 * per_row as f64 / busy.max(1e-9),
            if made == 1 { "1 step".to_string() } else { format!("{made} steps") }
        );
        if let Some(at) = saved_at {
            outln!("  checkpoint   step {at} in {}", checkpoint_dir.unwrap_or_default());
        }
        if check {
            outln!(
                "  check        every step equal to one device's: max |loss - 1-device loss| = {most:.1e} (relative {most_rel:.1e}, tolerance {tol:e})"
            );
        } else if devices > 1 && !a.on("no-check") {
            outln!("  check        not run: a large run (--check runs it)");
        } else if devices == 1 {
            outln!("  check        this run is the one-device run");
        } else {
            outln!("  check        skipped (--no-check)");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failed(r: Result<(), Exit>) -> String {
        match r {
            Err(Exit::Failed(m)) => m,
            other => panic!("expected a failed run, got {:?}", other.is_ok()),
        }
    }

    /// The one-device check fails a run on a loss off one device's by more than the
    /// tolerance, on one device's loss not being finite, and on any loss that is not.
    #[test]
    fn the_check_fails_a_step_off_one_devices_loss() {
        assert!(check_step(3, 2.0, Some(2.0 + 1e-10), 1e-9, "mesh 2x2").is_ok());
        assert!(check_step(3, 2.0, None, 1e-9, "mesh 2x2").is_ok());
        let m = failed(check_step(3, 2.0, Some(2.0 + 1e-8), 1e-9, "mesh 2x2"));
        assert!(
            m.starts_with("step 4: loss 2 on mesh 2x2, 2.00000001 on one device")
                && m.contains("on mesh 2x2")
                && m.contains("on one device"),
            "{m}"
        );
        assert!(failed(check_step(0, 2.0, Some(f64::NAN), 1e-9, "mesh 2x2")).contains("NaN"));
        assert!(
            failed(check_step(5, f64::INFINITY, Some(2.0), 1e-9, "x"))
                .contains("step 6: the loss is inf")
        );
        // Relative: the same absolute gap passes on a large loss.
        assert!(check_step(1, 2e3, Some(2e3 + 1e-8), 1e-9, "x").is_ok());
    }
}
