//! `meshwork train`: the MLP on a device mesh, with progress, a summary and a check
//! against one device.

use std::io::{IsTerminal, Write};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use meshwork_strategy::Error as StrategyError;
use meshwork_strategy::checkpoint::{CheckpointManager, Error as CheckpointError};
use meshwork_strategy::mlp::{self, Dataset, Params, Progress, TrainConfig};
use meshwork_strategy::types::DType;
use ndarray::{Array1, Array2, Ix2};
use serde_json::Value;

use crate::args::{self, Args, Exit, Usage, note, outln};
use crate::npy;

pub(crate) const HELP: &str = "\
meshwork train — train an MLP h = relu(x·W1 + b1), z = h·W2 + b2 (softmax cross-entropy,
plain SGD) on a data x model mesh: the batch split over the data axis, W1 by columns and
W2 by rows over the model axis.

flags:
  --model mlp|transformer|cnn   the reference transformer or a small CNN (see
                        `meshwork train --model transformer --help`, `... --model cnn
                        --help`); `--model mlp` trains this MLP, with these defaults,
                        through the same trainer as they do: every training flag of
                        `--model transformer --help` (optimizers, schedules, clipping,
                        evaluation, pipelines, metrics, plots). Without --model: this
                        page's path, the main job
  --mesh DxM            data x model devices (default 2x2; 1x1 is one device)
  --steps N             total steps (default 200; a resumed run continues up to N)
  --batch B             global batch (default 64); step s takes rows s·B … s·B+B−1 of the
                        data (mod its size), in order
  --shuffle             ... or in a per-epoch permutation drawn from --seed
  --lr LR               learning rate (default 0.5)
  --hidden H            hidden units (default 32)
  --dtype f32|f64       (default f64)
  --seed S              seeds the built-in data, the initial weights and --shuffle (default 0)
  --data-x X.npy        features [rows, features] instead of the built-in data
  --data-y Y.npy        labels: class ids [rows] or one-hot [rows, classes]
  --init INIT.safetensors   initial w1 [features, hidden], b1 [hidden], w2 [hidden, classes],
                        b2 [classes] (f32 or f64)
  --classes N           the number of classes (default: the largest label + 1, which
                        may be at most twice the number of rows)
  --losses-json FILE    write every step's global loss as a JSON list (also when the
                        run is interrupted); an existing file is replaced only if it
                        is such a list
  --checkpoint-dir DIR  a checkpoint directory meshwork owns: created if absent, or an
                        empty or earlier meshwork checkpoint directory (anything else is
                        refused, never changed); one step-NNNNNNNN/ per saved step and a
                        `latest` pointer; saved at the end and every N steps
  --checkpoint-every N
  --keep N              checkpoints kept in --checkpoint-dir, newest first (default 3)
  --resume PATH         continue from a checkpoint directory (its latest complete step)
                        or one step-NNNNNNNN/ in it, on any mesh (resharded on load);
                        the model sizes and dtype come from the checkpoint
  --steps-per-run N     steps per host call (default 1)
  --max-memory SIZE     refuse a run whose estimated memory exceeds SIZE (default 8G;
                        suffixes K, M, G, T)
  --no-check            skip the comparison with a one-device run of the same steps
  --quiet               no progress line and no summary (errors still say what failed)
  --plot FILE.svg       the loss per step as an SVG line chart (a new file)

Ctrl-C (SIGINT) or SIGTERM finishes the current host call, saves a checkpoint if
--checkpoint-dir is given, writes --losses-json and exits with status 130; a second
Ctrl-C exits at once. A loss that is not finite stops the run with status 1, and so
does a one-device check that fails.
";

const VALUED: &[&str] = &[
    "model",
    "mesh",
    "steps",
    "batch",
    "lr",
    "hidden",
    "dtype",
    "seed",
    "data-x",
    "data-y",
    "init",
    "losses-json",
    "checkpoint-dir",
    "checkpoint-every",
    "keep",
    "resume",
    "steps-per-run",
    "classes",
    "max-memory",
    "plot",
];
const SWITCHES: &[&str] = &["shuffle", "no-check", "quiet"];

/// `outln!` unless `--quiet`.
macro_rules! say {
    ($quiet:expr, $($arg:tt)*) => {
        if !$quiet {
            outln!($($arg)*)
        }
    };
}

/// The built-in data: 512 rows of 8 features, 3 classes.
const ROWS: usize = 512;
const FEATURES: usize = 8;
const CLASSES: usize = 3;

fn usage(flag: &str, e: impl std::fmt::Display) -> Usage {
    Usage(format!("--{flag}: {e}"))
}

/// Loads `--data-x`/`--data-y`, or makes the built-in data. `limit` bounds the bytes
/// read; `classes` is `--classes`.
pub(crate) fn dataset(
    a: &Args,
    seed: u64,
    limit: u64,
    classes: Option<usize>,
) -> Result<Dataset, Usage> {
    let (xp, yp) = match (a.get("data-x"), a.get("data-y")) {
        (None, None) => {
            if let Some(c) = classes
                && c != CLASSES
            {
                return Err(Usage(format!(
                    "--classes {c}: the built-in data has {CLASSES} classes (give --data-x and --data-y for other data)"
                )));
            }
            return Ok(Dataset::synthetic(seed, ROWS, FEATURES, CLASSES));
        }
        (Some(x), Some(y)) => (x, y),
        (Some(_), None) => return Err(Usage("--data-x needs --data-y (the labels)".into())),
        (None, Some(_)) => return Err(Usage("--data-y needs --data-x (the features)".into())),
    };
    let x = npy::read(xp, limit).map_err(|e| usage("data-x", e))?;
    if x.ndim() != 2 {
        return Err(usage(
            "data-x",
            format!("{xp} has shape {:?}; want [rows, features]", x.shape()),
        ));
    }
    let x: Array2<f64> = x.into_dimensionality::<Ix2>().expect("rank 2");
    if x.nrows() == 0 || x.ncols() == 0 {
        return Err(usage("data-x", format!("{xp} holds no data (shape {:?})", x.shape())));
    }
    if x.iter().any(|v| !v.is_finite()) {
        return Err(usage("data-x", format!("{xp} holds NaN or infinite values")));
    }
    let y = npy::read(yp, limit).map_err(|e| usage("data-y", e))?;
    let ids = |y: ndarray::ArrayD<f64>| -> Result<Vec<usize>, Usage> {
        y.iter()
            .map(|&v| (v >= 0.0 && v.fract() == 0.0 && v < 1e15).then_some(v as usize))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| usage("data-y", format!("{yp}: class ids must be whole numbers ≥ 0")))
    };
    let (labels, found) = match y.shape() {
        [_] => {
            let labels = ids(y)?;
            let found = labels.iter().max().map_or(0, |m| m + 1);
            (labels, found)
        }
        // A column of class ids, as `y.reshape(-1, 1)` saves them.
        [_, 1] => {
            let labels = ids(y)?;
            let found = labels.iter().max().map_or(0, |m| m + 1);
            (labels, found)
        }
        [_, _] => {
            let onehot = y.into_dimensionality::<Ix2>().expect("rank 2");
            let labels = onehot
                .outer_iter()
                .map(|row| {
                    let ones: Vec<usize> = row
                        .iter()
                        .enumerate()
                        .filter(|(_, v)| **v == 1.0)
                        .map(|(k, _)| k)
                        .collect();
                    (ones.len() == 1 && row.iter().all(|v| *v == 0.0 || *v == 1.0)).then(|| ones[0])
                })
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| {
                    usage("data-y", format!("{yp}: one-hot rows must hold one 1 and otherwise 0"))
                })?;
            (labels, onehot.ncols())
        }
        other => {
            return Err(usage(
                "data-y",
                format!(
                    "{yp} has shape {other:?}; want class ids [rows] or [rows, 1], or one-hot [rows, classes]"
                ),
            ));
        }
    };
    if labels.len() != x.nrows() {
        return Err(usage(
            "data-y",
            format!("{} labels for {} rows of --data-x", labels.len(), x.nrows()),
        ));
    }
    let classes = match classes {
        Some(c) if c < found => {
            return Err(usage(
                "classes",
                format!("{c} classes, but {yp} holds class {} (ids count from 0)", found - 1),
            ));
        }
        Some(c) => c,
        // Without --classes the largest label sets the output layer; a label far beyond
        // the data (a stray id) would silently build a huge layer, so it must be asked for.
        None if found > 2 * labels.len() => {
            return Err(usage(
                "data-y",
                format!(
                    "{yp} holds class {} but only {} rows: give --classes N if the model really has {found} classes",
                    found - 1,
                    labels.len()
                ),
            ));
        }
        None => found,
    };
    if classes < 2 {
        return Err(usage("data-y", format!("{yp} has {classes} class; need at least 2")));
    }
    Ok(Dataset { x, labels, classes })
}

/// Loads `--init`, checking names, shapes and values against the data.
fn init_file(path: &str, data: &Dataset, limit: u64) -> Result<Params, Usage> {
    let bytes = args::read_file("init", path, limit)?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| usage("init", format!("{path} is not a safetensors file: {e}")))?;
    let get = |name: &str, rank: usize| -> Result<(Vec<usize>, Vec<f64>), Usage> {
        let t = st.tensor(name).map_err(|_| {
            usage("init", format!("{path} has no tensor {name:?} (want w1, b1, w2, b2)"))
        })?;
        if t.shape().len() != rank {
            return Err(usage(
                "init",
                format!("{name} has shape {:?}; want rank {rank}", t.shape()),
            ));
        }
        let values: Vec<f64> = match t.dtype() {
            safetensors::Dtype::F32 => t
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4")) as f64)
                .collect(),
            safetensors::Dtype::F64 => t
                .data()
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().expect("8")))
                .collect(),
            other => return Err(usage("init", format!("{name} is {other:?}; want F32 or F64"))),
        };
        if let Some(k) = values.iter().position(|v| !v.is_finite()) {
            return Err(usage(
                "init",
                format!(
                    "{path}: {name} holds {} at element {k}; weights must be finite",
                    values[k]
                ),
            ));
        }
        Ok((t.shape().to_vec(), values))
    };
    let (s1, w1) = get("w1", 2)?;
    let (sb1, b1) = get("b1", 1)?;
    let (s2, w2) = get("w2", 2)?;
    let (sb2, b2) = get("b2", 1)?;
    let hidden = s1[1];
    if hidden == 0 {
        return Err(usage(
            "init",
            format!("{path}: w1 has shape {s1:?}; a model needs at least 1 hidden unit"),
        ));
    }
    let want = [
        ("w1", &s1, vec![data.features(), hidden]),
        ("b1", &sb1, vec![hidden]),
        ("w2", &s2, vec![hidden, data.classes]),
        ("b2", &sb2, vec![data.classes]),
    ];
    for (name, got, want) in want {
        if *got != want {
            return Err(usage(
                "init",
                format!(
                    "{name} has shape {got:?}; the data ({} features, {} classes) needs {want:?}",
                    data.features(),
                    data.classes
                ),
            ));
        }
    }
    Ok(Params {
        w1: Array2::from_shape_vec((s1[0], s1[1]), w1).expect("checked"),
        b1: Array1::from(b1),
        w2: Array2::from_shape_vec((s2[0], s2[1]), w2).expect("checked"),
        b2: Array1::from(b2),
    })
}

/// `--checkpoint-dir`, `--checkpoint-every` (0: only at the end) and `--keep`
/// (default 3), checked together.
pub(crate) fn checkpoint_flags(a: &Args) -> Result<(Option<&str>, usize, usize), Usage> {
    let dir = a.get("checkpoint-dir");
    for flag in ["checkpoint-every", "keep"] {
        if a.get(flag).is_some() && dir.is_none() {
            return Err(Usage(format!("--{flag} needs --checkpoint-dir")));
        }
    }
    let every: usize = a.parse_or("checkpoint-every", 0, "a step count")?;
    let keep: usize = a.parse_or("keep", 3, "a number of checkpoints")?;
    if keep == 0 {
        return Err(Usage("--keep must be at least 1 (the newest checkpoint)".into()));
    }
    Ok((dir, every, keep))
}

/// `16G`, `512M`, `1T`, `4096` → bytes.
pub(crate) fn bytes_flag(flag: &str, text: &str) -> Result<u64, Usage> {
    let bad = || Usage(format!("--{flag} {text:?} is not a size like 8G, 512M or 4096"));
    let t = text.trim();
    let (digits, shift) = match t.char_indices().last() {
        Some((at, 'K' | 'k')) => (&t[..at], 10),
        Some((at, 'M' | 'm')) => (&t[..at], 20),
        Some((at, 'G' | 'g')) => (&t[..at], 30),
        Some((at, 'T' | 't')) => (&t[..at], 40),
        _ => (t, 0),
    };
    let n: u64 = digits.parse().map_err(|_| bad())?;
    n.checked_mul(1u64 << shift).filter(|&b| b > 0).ok_or_else(bad)
}

/// What a run will hold at once, roughly, in bytes: the weights on every device with
/// their working copies and gradients, a host call's batches, the activations of a
/// step, and the one-device check's copy. Computed in f64 so no size overflows.
fn memory_estimate(config: &TrainConfig, data: &Dataset, hidden: usize, check: bool) -> f64 {
    let size = config.dtype.size_in_bytes() as f64;
    let (f, h, c) = (data.features() as f64, hidden as f64, data.classes as f64);
    let (d, m, b) = (config.data as f64, config.model as f64, config.batch as f64);
    let params = f * h + h + h * c + c;
    // Per replica: the weights (split over its model devices, b2 on each), read,
    // gradient and update copies; the host keeps f64 copies (init, result, check).
    let weights =
        (d * 4.0 + if check { 4.0 } else { 0.0 }) * (params + c * m) * size + 3.0 * params * 8.0;
    // A host call's global batches, as f64 and in the dtype.
    let spr = config.steps_per_run.min(config.steps.max(1)) as f64;
    let inputs = spr * b * (f + c) * (8.0 + size);
    // A step: inputs and one-hot on every model device, hidden activations (pre, h,
    // their gradients), scores and their gradients.
    let acts = (b * (f + c) * m * 2.0 + b * h * 4.0 + b * c * m * 4.0) * size;
    weights + inputs + acts * if check { 2.0 } else { 1.0 }
}

/// Checks, before training, that `--losses-json` can be written: its directory exists
/// and takes a new file, and the path is not a directory, device or link. Nothing at
/// the path is touched.
pub(crate) fn check_output_file(flag: &str, path: &str) -> Result<(), Usage> {
    let p = Path::new(path);
    if path.is_empty() || path.ends_with('/') || p.file_name().is_none() {
        return Err(usage(flag, format!("{path:?} names no file")));
    }
    let parent = p.parent().filter(|q| !q.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if !parent.is_dir() {
        return Err(usage(flag, format!("directory {} does not exist", parent.display())));
    }
    match std::fs::symlink_metadata(p) {
        Ok(m) if !m.is_file() => {
            return Err(usage(
                flag,
                format!(
                    "{path} exists and is not a regular file; meshwork replaces only regular files"
                ),
            ));
        }
        // An existing file is replaced only when it is what meshwork writes there: a
        // losses list (a JSON list of numbers) from an earlier run.
        Ok(_) if flag == "losses-json" => {
            let ours = args::read_file(flag, path, 1 << 28)
                .ok()
                .and_then(|b| serde_json::from_slice::<Vec<Option<f64>>>(&b).ok())
                .is_some();
            if !ours {
                return Err(usage(
                    flag,
                    format!(
                        "{path} exists and is not a losses list meshwork wrote; meshwork replaces only its own files"
                    ),
                ));
            }
        }
        _ => {}
    }
    let probe = temp_beside(p);
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)
        .map_err(|e| usage(flag, format!("cannot write in {}: {e}", parent.display())))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// A temporary name beside `path` that meshwork alone makes.
fn temp_beside(path: &Path) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    path.with_file_name(format!(".{name}.meshwork-tmp-{}", std::process::id()))
}

/// Writes `text` to `path` whole or not at all (a temporary file beside it, then a
/// rename); the temporary file is removed on failure.
pub(crate) fn write_atomic(path: &str, text: &str) -> std::io::Result<()> {
    let tmp = temp_beside(Path::new(path));
    let result = (|| {
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).open(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// A loss for people: fixed-point in the usual range, scientific beyond it.
pub(crate) fn loss_text(x: f64) -> String {
    if x == 0.0 || (1e-4..1e6).contains(&x.abs()) { format!("{x:.6}") } else { format!("{x:.6e}") }
}

/// A number for people: plain in the usual range, scientific beyond it.
pub(crate) fn number_text(x: f64) -> String {
    if x == 0.0 || (1e-4..1e6).contains(&x.abs()) { format!("{x}") } else { format!("{x:e}") }
}

/// "1 step", "2 steps".
fn steps_text(n: usize) -> String {
    if n == 1 { "1 step".into() } else { format!("{n} steps") }
}

/// Progress on stderr: an `indicatif` bar on a terminal, otherwise a plain line every
/// tenth of the run.
struct Bar {
    tty: Option<indicatif::ProgressBar>,
    last_line: usize,
}

impl Bar {
    fn show(&mut self, p: Progress) {
        let message = format!("loss {}  {:.0} samples/s", loss_text(p.loss), p.samples_per_sec);
        if let Some(bar) = &self.tty {
            bar.set_length(p.total as u64);
            bar.set_position(p.done as u64);
            bar.set_message(message);
            return;
        }
        let tenth = (p.total / 10).max(1);
        if p.done / tenth != self.last_line || p.done == p.total {
            self.last_line = p.done / tenth;
            let mut err = std::io::stderr();
            let _ = writeln!(err, "step {:>5}/{} {message}", p.done, p.total);
            let _ = err.flush();
        }
    }

    /// Leaves the bar drawn as it stands (the run ended, finished or not).
    fn end(&self) {
        if let Some(bar) = &self.tty {
            bar.abandon();
            let _ = writeln!(std::io::stderr());
        }
    }
}

/// Most devices a CPU mesh may have: each is a thread.
const MAX_DEVICES: usize = 1024;

/// What a checkpoint says about the run that saved it (its index's metadata).
struct Saved {
    dir: PathBuf,
    step: Option<usize>,
    meta: Option<Value>,
}

impl Saved {
    fn get(&self, path: &[&str]) -> Option<&Value> {
        path.iter().try_fold(self.meta.as_ref()?, |v, k| v.get(k))
    }

    fn usize(&self, path: &[&str]) -> Option<usize> {
        self.get(path).and_then(Value::as_u64).and_then(|n| usize::try_from(n).ok())
    }
}

/// `--resume`: the checkpoint and its metadata.
fn saved_run(path: &str) -> Result<Saved, Usage> {
    let (dir, step) =
        meshwork_strategy::checkpoint::find_checkpoint(path).map_err(|e| usage("resume", e))?;
    let mut meta =
        meshwork_strategy::checkpoint::checkpoint_metadata(&dir).map_err(|e| usage("resume", e))?;
    if meta.is_none() {
        // A checkpoint without run metadata (saved by the library, or by an earlier
        // meshwork): the model's sizes and dtype from its variables.
        let vars = meshwork_strategy::checkpoint::checkpoint_variables(&dir)
            .map_err(|e| usage("resume", e))?;
        let find = |name: &str| vars.iter().find(|(n, _, _)| n == name);
        if let (Some((_, dtype, w1)), Some((_, _, w2))) = (find("w1"), find("w2"))
            && let ([features, hidden], [_, classes]) = (w1.as_slice(), w2.as_slice())
        {
            meta = Some(serde_json::json!({
                "model": { "features": features, "hidden": hidden, "classes": classes },
                "dtype": dtype.to_string(),
            }));
        }
    }
    let mut saved = Saved { dir, step, meta };
    if let Some(s) = saved.usize(&["step"]) {
        saved.step = Some(s);
    }
    Ok(saved)
}

/// Installs SIGINT/SIGTERM handlers: the first sets the returned flag (the run stops
/// after its current host call), a second SIGINT exits at once with status 130.
pub(crate) fn stop_flag() -> Result<Arc<AtomicBool>, Usage> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let stop = Arc::new(AtomicBool::new(false));
    let install = || -> std::io::Result<()> {
        for signal in [SIGINT, SIGTERM] {
            signal_hook::flag::register_conditional_shutdown(signal, 130, stop.clone())?;
            signal_hook::flag::register(signal, stop.clone())?;
        }
        Ok(())
    };
    install().map_err(|e| Usage(format!("cannot install the signal handlers: {e}")))?;
    Ok(stop)
}

/// The strategy's error as one line for a user, naming the flag it concerns.
fn strategy_error(e: StrategyError, config: &TrainConfig) -> Exit {
    match &e {
        StrategyError::NonFiniteLoss { .. } => Exit::Failed(format!("training diverged: {e}")),
        StrategyError::Checkpoint(CheckpointError::Save { path, step, problem }) => Exit::Failed(
            format!("--checkpoint-dir {}: cannot save step {step}: {problem}", path.display()),
        ),
        StrategyError::Checkpoint(CheckpointError::Directory { path, problem })
            if config.checkpoint_dir.is_some() =>
        {
            Exit::Usage(format!("--checkpoint-dir {}: {problem}", path.display()))
        }
        StrategyError::Checkpoint(_) if config.resume.is_some() => {
            Exit::Usage(format!("--resume: {e}"))
        }
        _ => Exit::Failed(e.to_string()),
    }
}

pub(crate) fn run(argv: &[String]) -> Result<(), Exit> {
    let a = Args::parse(argv, VALUED, SWITCHES)?;
    if let Some(p) = a.positional.first() {
        return Err(Usage(format!(
            "train takes no positional argument ({p:?}); see `meshwork help train`"
        ))
        .into());
    }
    let (data_axis, model_axis) = args::mesh("mesh", a.get("mesh").unwrap_or("2x2"))?;
    if data_axis.checked_mul(model_axis).is_none_or(|n| n > MAX_DEVICES) {
        return Err(Usage(format!(
            "--mesh {data_axis}x{model_axis} has more than {MAX_DEVICES} devices; each device of a CPU mesh is a thread"
        ))
        .into());
    }
    let steps: usize = a.parse_or("steps", 200, "a step count")?;
    if steps == 0 && a.get("resume").is_none() {
        return Err(Usage("--steps must be at least 1".into()).into());
    }
    let batch: usize = a.parse_or("batch", 64, "a batch size")?;
    let lr: f64 = a.parse_or("lr", 0.5, "a learning rate")?;
    if !(lr.is_finite() && lr > 0.0) {
        return Err(Usage(format!("--lr {} must be a positive number", number_text(lr))).into());
    }
    let seed: u64 = a.parse_or("seed", 0, "a seed (a whole number ≥ 0)")?;
    let dtype_flag = match a.get("dtype") {
        None => None,
        Some("f32") => Some(DType::F32),
        Some("f64") => Some(DType::F64),
        Some(other) => return Err(Usage(format!("--dtype {other:?} is not f32 or f64")).into()),
    };
    let steps_per_run: usize = a.parse_or("steps-per-run", 1, "a step count")?;
    if steps_per_run == 0 {
        return Err(Usage("--steps-per-run must be at least 1".into()).into());
    }
    let (checkpoint_dir, checkpoint_every, keep) = checkpoint_flags(&a)?;
    if batch == 0 {
        return Err(Usage("--batch must be at least 1".into()).into());
    }
    if !batch.is_multiple_of(data_axis) {
        return Err(Usage(format!(
            "--batch {batch} does not split over the {data_axis} data replicas of --mesh {data_axis}x{model_axis}"
        ))
        .into());
    }
    let classes: Option<usize> = match a.get("classes") {
        None => None,
        Some(_) => {
            let c: usize = a.parse_or("classes", 0, "a number of classes")?;
            if c < 2 {
                return Err(Usage(format!("--classes {c}: need at least 2")).into());
            }
            Some(c)
        }
    };
    let limit = match a.get("max-memory") {
        Some(t) => bytes_flag("max-memory", t)?,
        None => 8 << 30,
    };
    if a.get("init").is_some() && a.get("resume").is_some() {
        return Err(Usage(
            "--init and --resume both set the weights; give one (a resumed run takes its weights from the checkpoint)"
                .into(),
        )
        .into());
    }
    // Outputs first: no work is done before they are known to be writable.
    if let Some(p) = a.get("losses-json") {
        check_output_file("losses-json", p)?;
    }
    if let Some(p) = a.get("plot") {
        check_output_file("plot", p)?;
        if Path::new(p).exists() || a.get("losses-json") == Some(p) {
            return Err(usage(
                "plot",
                format!("{p} exists or is --losses-json's; give a new file"),
            )
            .into());
        }
    }
    let quiet = a.on("quiet");
    let saved = a.get("resume").map(saved_run).transpose()?;
    let data = dataset(&a, seed, limit, classes)?;
    // With --resume the model's sizes and dtype come from the checkpoint; a flag that
    // disagrees is an error naming both.
    let hidden_flag: Option<usize> = match a.get("hidden") {
        None => None,
        Some(_) => Some(a.parse_or("hidden", 32, "a number of hidden units")?),
    };
    let mut dtype = dtype_flag.unwrap_or(DType::F64);
    let mut hidden = hidden_flag.unwrap_or(32);
    if let Some(saved) = &saved {
        let dir = saved.dir.display();
        for (what, flag, ours) in
            [("features", "data-x", data.features()), ("classes", "data-y", data.classes)]
        {
            if let Some(theirs) = saved.usize(&["model", what])
                && theirs != ours
            {
                return Err(usage(
                    "resume",
                    format!("{dir} holds a model with {theirs} {what}; --{flag} gives {ours}"),
                )
                .into());
            }
        }
        if let Some(theirs) = saved.usize(&["model", "hidden"]) {
            match hidden_flag {
                Some(h) if h != theirs => {
                    return Err(usage(
                        "resume",
                        format!("{dir} holds a model with hidden {theirs}; --hidden is {h}"),
                    )
                    .into());
                }
                _ => hidden = theirs,
            }
        }
        if let Some(theirs) =
            saved.get(&["dtype"]).and_then(Value::as_str).and_then(|d| d.parse::<DType>().ok())
        {
            match dtype_flag {
                Some(d) if d != theirs => {
                    return Err(usage(
                        "resume",
                        format!("{dir} was trained in {theirs}; --dtype is {d}"),
                    )
                    .into());
                }
                _ => dtype = theirs,
            }
        }
        if let Some(step) = saved.step
            && step >= steps
        {
            outln!(
                "meshwork train: the checkpoint {dir} is at step {step}, already at or past --steps {steps}: nothing to train"
            );
            return Ok(());
        }
    }
    let config = TrainConfig {
        data: data_axis,
        model: model_axis,
        steps,
        batch,
        lr,
        dtype,
        shuffle: a.on("shuffle").then_some(seed),
        steps_per_run,
        checkpoint_dir: checkpoint_dir.map(PathBuf::from),
        checkpoint_every,
        keep,
        resume: saved.as_ref().map(|s| s.dir.clone()),
        seed,
    };
    // Before anything the size controls is allocated.
    let check_memory = |hidden: usize| -> Result<(), Usage> {
        let need = memory_estimate(&config, &data, hidden, !a.on("no-check"));
        if need > limit as f64 {
            return Err(memory_error(need, limit, hidden, &data));
        }
        Ok(())
    };
    let init = match a.get("init") {
        Some(path) => {
            let p = init_file(path, &data, limit)?;
            if let Some(h) = hidden_flag
                && h != p.hidden()
            {
                return Err(Usage(format!(
                    "--hidden {h} disagrees with --init, whose w1 has {} hidden units",
                    p.hidden()
                ))
                .into());
            }
            p
        }
        None => {
            if hidden == 0 {
                return Err(Usage("--hidden must be at least 1".into()).into());
            }
            check_memory(hidden)?;
            Params::init(seed, data.features(), hidden, data.classes)
        }
    };
    if !init.hidden().is_multiple_of(model_axis) {
        return Err(Usage(format!(
            "--hidden {} does not split over the {model_axis} model devices of --mesh {data_axis}x{model_axis}",
            init.hidden()
        ))
        .into());
    }
    if a.get("init").is_some() {
        check_memory(init.hidden())?;
    }
    let mut checkpoints = None;
    if let Some(dir) = checkpoint_dir {
        // Created, checked and locked now and held through the run, so a directory
        // that cannot be used fails before any step.
        let m = CheckpointManager::open(dir, keep).map_err(|e| match e {
            CheckpointError::Directory { path, problem } => {
                Usage(format!("--checkpoint-dir {}: {problem}", path.display()))
            }
            e => usage("checkpoint-dir", e),
        })?;
        let start = saved.as_ref().and_then(|s| s.step).unwrap_or(0);
        if let Some(&newest) = m.steps().map_err(|e| usage("checkpoint-dir", e))?.last()
            && newest > start
        {
            return Err(usage(
                "checkpoint-dir",
                format!(
                    "{dir} already holds checkpoints up to {}, which this run (starting at step {start}) would not continue; resume from it with --resume {dir}, or give another directory",
                    meshwork_strategy::checkpoint::step_name(newest)
                ),
            )
            .into());
        }
        checkpoints = Some(m);
    }
    if let Some(saved) = &saved {
        warn_differences(saved, &config, &data);
    }
    if !quiet {
        note(format_args!(
            "meshwork train: {data_axis}x{model_axis} mesh ({data_axis} data x {model_axis} model devices), {dtype}, \
         {} of {batch} rows, hidden {}, lr {}, {} rows x {} features, {} classes",
            steps_text(steps),
            init.hidden(),
            number_text(lr),
            data.rows(),
            data.features(),
            data.classes
        ));
    }
    let stop = stop_flag()?;
    let tty = (std::io::stderr().is_terminal() && !quiet).then(|| crate::lm::progress_bar(steps));
    let mut bar = Bar { tty, last_line: usize::MAX };
    let report = mlp::train_with(&config, &data, &init, checkpoints, &mut |p| {
        if !quiet {
            bar.show(p);
        }
        if stop.load(Ordering::SeqCst) { ControlFlow::Break(()) } else { ControlFlow::Continue(()) }
    });
    bar.end();
    let report = report.map_err(|e| strategy_error(e, &config))?;
    if let Some(path) = a.get("plot") {
        let title = format!("meshwork: MLP training loss on {data_axis}x{model_axis}");
        let svg = crate::lm::svg(&report.losses, &[], report.first_step, &title);
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(path)
            .and_then(|mut f| f.write_all(svg.as_bytes()))
            .map_err(|e| usage("plot", format!("cannot write {path}: {e}")))?;
    }
    if let Some(path) = a.get("losses-json") {
        let text = serde_json::to_string(&report.losses).map_err(|e| usage("losses-json", e))?;
        write_atomic(path, &text)
            .map_err(|e| usage("losses-json", format!("cannot write {path}: {e}")))?;
    }
    let made = report.losses.len();
    if report.first_step >= steps && made == 0 {
        say!(
            quiet,
            "meshwork train: the checkpoint is at step {}, already at or past --steps {steps}: nothing to train",
            report.first_step
        );
        return Ok(());
    }
    say!(
        quiet,
        "meshwork train: {data_axis}x{model_axis} mesh, {dtype}, steps {}..{}",
        report.first_step,
        report.first_step + made
    );
    match (report.losses.first(), report.losses.last()) {
        (Some(first), Some(last)) => {
            say!(quiet, "  final loss   {}  (first {})", loss_text(*last), loss_text(*first));
            say!(quiet, "  loss curve   {}", crate::lm::sparkline(&report.losses, 60));
        }
        _ => say!(quiet, "  final loss   -  (no steps left to run)"),
    }
    say!(
        quiet,
        "  accuracy     {:.1}% of {} rows",
        100.0 * report.params.accuracy(&data),
        data.rows()
    );
    let secs = report.elapsed.as_secs_f64();
    say!(
        quiet,
        "  throughput   {:.0} samples/s ({} in {secs:.2} s)",
        (made * batch) as f64 / secs.max(1e-9),
        steps_text(made)
    );
    if let Some(dir) = &report.saved {
        say!(quiet, "  checkpoint   {}", dir.display());
    }
    if report.stopped {
        say!(
            quiet,
            "  stopped      by a signal after step {}{}",
            report.first_step + made,
            if report.saved.is_some() { "; resume with --resume" } else { "" }
        );
        return Err(Exit::Interrupted);
    }
    if a.on("no-check") || made == 0 {
        say!(quiet, "  check        skipped");
    } else if data_axis * model_axis == 1 {
        say!(quiet, "  check        this run is the one-device run");
    } else {
        let single = TrainConfig {
            data: 1,
            model: 1,
            steps_per_run: 1,
            checkpoint_dir: None,
            checkpoint_every: 0,
            ..config.clone()
        };
        let one = mlp::train(&single, &data, &init, &mut |_| {
            if stop.load(Ordering::SeqCst) {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        })
        .map_err(|e| Exit::Failed(format!("the one-device check failed: {e}")))?;
        if one.stopped {
            say!(quiet, "  check        stopped by a signal");
            return Err(Exit::Interrupted);
        }
        // A mesh groups the sums differently from one device, so losses differ by
        // rounding; anything beyond this is a real difference. NaN never passes.
        let tolerance = if dtype == DType::F32 { 1e-3 } else { 1e-9 };
        let (mut abs, mut rel, mut worst) = (0.0f64, 0.0f64, None);
        for (k, (a, b)) in report.losses.iter().zip(&one.losses).enumerate() {
            let r = (a - b).abs() / b.abs().max(f64::MIN_POSITIVE);
            let within = r <= tolerance; // false for NaN
            if !within && worst.is_none() {
                worst = Some((report.first_step + k, *a, *b));
            }
            abs = abs.max((a - b).abs());
            rel = rel.max(r);
        }
        if one.losses.len() != made {
            return Err(Exit::Failed(format!(
                "the one-device check made {} of {made} steps",
                one.losses.len()
            )));
        }
        if let Some((step, a, b)) = worst {
            return Err(Exit::Failed(format!(
                "the one-device check failed at step {step}: loss {a} on {data_axis}x{model_axis}, {b} on one device (relative tolerance {tolerance:e})"
            )));
        }
        say!(
            quiet,
            "  check        max |loss - 1x1 loss| = {abs:.1e} over {} (relative {rel:.1e})",
            steps_text(made)
        );
    }
    Ok(())
}

fn memory_error(need: f64, limit: u64, hidden: usize, data: &Dataset) -> Usage {
    Usage(format!(
        "this run needs about {} (hidden {hidden}, {} features, {} classes), over the {} limit; lower --batch, --hidden, --steps-per-run or --mesh, or raise --max-memory",
        bytes_text(need),
        data.features(),
        data.classes,
        bytes_text(limit as f64)
    ))
}

/// `1.5 GiB`, `512.0 MiB`, `800 B`.
fn bytes_text(bytes: f64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if bytes < 1024.0 {
        return format!("{bytes:.0} B");
    }
    let mut value = bytes / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// Warns (one line each) where the resumed checkpoint's run differs from this one in
/// what may legitimately change: learning rate, batch, data, seed, shuffling.
fn warn_differences(saved: &Saved, config: &TrainConfig, data: &Dataset) {
    let dir = saved.dir.display();
    let warn = |what: String| note(format_args!("meshwork train: warning: {what}"));
    if let Some(lr) = saved.get(&["lr"]).and_then(Value::as_f64)
        && lr != config.lr
    {
        warn(format!(
            "--lr {} differs from the checkpoint's {} ({dir}); continuing with {}",
            number_text(config.lr),
            number_text(lr),
            number_text(config.lr)
        ));
    }
    if let Some(b) = saved.usize(&["batch"])
        && b != config.batch
    {
        warn(format!("--batch {} differs from the checkpoint's {b} ({dir})", config.batch));
    }
    if let Some(fp) = saved.get(&["data", "fingerprint"]).and_then(Value::as_u64)
        && fp != u64::from(mlp::fingerprint(data))
    {
        warn(format!(
            "the data differ from the data the checkpoint was trained on ({} rows then, {} now)",
            saved.usize(&["data", "rows"]).map_or("?".into(), |r| r.to_string()),
            data.rows()
        ));
    }
    if let Some(seed) = saved.get(&["seed"]).and_then(Value::as_u64)
        && seed != config.seed
    {
        warn(format!("--seed {} differs from the checkpoint's {seed}", config.seed));
    }
    if let Some(shuffle) = saved.get(&["shuffle"])
        && *shuffle != serde_json::json!(config.shuffle)
    {
        warn("--shuffle differs from the checkpoint's run".into());
    }
}
