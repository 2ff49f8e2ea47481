//! `meshwork train`: the MLP on a device mesh, with progress, a summary and a check
//! against one device.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};

use meshwork_strategy::mlp::{self, Dataset, Params, Progress, TrainConfig};
use meshwork_strategy::types::DType;
use ndarray::{Array1, Array2, Ix1, Ix2};

use crate::args::{self, Args, Usage};
use crate::npy;

pub(crate) const HELP: &str = "\
meshwork train — train an MLP h = relu(x·W1 + b1), z = h·W2 + b2 (softmax cross-entropy,
plain SGD) on a data x model mesh: the batch split over the data axis, W1 by columns and
W2 by rows over the model axis.

flags:
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
  --losses-json FILE    write every step's global loss as a JSON list
  --checkpoint-dir DIR  save a sharded checkpoint there at the end (and every N steps)
  --checkpoint-every N
  --resume DIR          continue from a checkpoint, on any mesh (resharded on load)
  --steps-per-run N     steps per host call (default 1)
  --no-check            skip the comparison with a one-device run of the same steps
";

const VALUED: &[&str] = &[
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
    "resume",
    "steps-per-run",
];
const SWITCHES: &[&str] = &["shuffle", "no-check"];

/// The built-in data: 512 rows of 8 features, 3 classes.
const ROWS: usize = 512;
const FEATURES: usize = 8;
const CLASSES: usize = 3;

fn usage(flag: &str, e: impl std::fmt::Display) -> Usage {
    Usage(format!("--{flag}: {e}"))
}

/// Loads `--data-x`/`--data-y`, or makes the built-in data.
fn dataset(a: &Args, seed: u64) -> Result<Dataset, Usage> {
    let (xp, yp) = match (a.get("data-x"), a.get("data-y")) {
        (None, None) => return Ok(Dataset::synthetic(seed, ROWS, FEATURES, CLASSES)),
        (Some(x), Some(y)) => (x, y),
        (Some(_), None) => return Err(Usage("--data-x needs --data-y (the labels)".into())),
        (None, Some(_)) => return Err(Usage("--data-y needs --data-x (the features)".into())),
    };
    let x = npy::read(xp).map_err(|e| usage("data-x", e))?;
    let x: Array2<f64> = x
        .into_dimensionality::<Ix2>()
        .map_err(|e| usage("data-x", format!("{xp} must be [rows, features]: {e}")))?;
    if x.nrows() == 0 || x.ncols() == 0 {
        return Err(usage("data-x", format!("{xp} holds no data")));
    }
    if x.iter().any(|v| !v.is_finite()) {
        return Err(usage("data-x", format!("{xp} holds NaN or infinite values")));
    }
    let y = npy::read(yp).map_err(|e| usage("data-y", e))?;
    let (labels, classes) = match y.ndim() {
        1 => {
            let ids = y.into_dimensionality::<Ix1>().expect("rank 1");
            let labels = ids
                .iter()
                .map(|&v| (v >= 0.0 && v.fract() == 0.0 && v < 1e9).then_some(v as usize))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| {
                    usage("data-y", format!("{yp}: class ids must be whole numbers ≥ 0"))
                })?;
            let classes = labels.iter().max().map_or(0, |m| m + 1);
            (labels, classes)
        }
        2 => {
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
        n => {
            return Err(usage(
                "data-y",
                format!("{yp} has rank {n}; want class ids [rows] or one-hot [rows, classes]"),
            ));
        }
    };
    if labels.len() != x.nrows() {
        return Err(usage(
            "data-y",
            format!("{} labels for {} rows of --data-x", labels.len(), x.nrows()),
        ));
    }
    if classes < 2 {
        return Err(usage("data-y", format!("{yp} has {classes} class; need at least 2")));
    }
    Ok(Dataset { x, labels, classes })
}

/// Loads `--init`, checking names and shapes against the data.
fn init_file(path: &str, data: &Dataset) -> Result<Params, Usage> {
    let bytes =
        std::fs::read(path).map_err(|e| usage("init", format!("cannot read {path}: {e}")))?;
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
        Ok((t.shape().to_vec(), values))
    };
    let (s1, w1) = get("w1", 2)?;
    let (sb1, b1) = get("b1", 1)?;
    let (s2, w2) = get("w2", 2)?;
    let (sb2, b2) = get("b2", 1)?;
    let hidden = s1[1];
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

/// The parent directory of an output path must exist before training starts.
fn writable_parent(flag: &str, path: &str) -> Result<(), Usage> {
    let parent =
        Path::new(path).parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if !parent.is_dir() {
        return Err(usage(flag, format!("directory {} does not exist", parent.display())));
    }
    Ok(())
}

/// Writes `text` to `path` whole or not at all.
fn write_atomic(path: &str, text: &str) -> std::io::Result<()> {
    let tmp = format!("{path}.partial-{}", std::process::id());
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// A progress line on stderr: redrawn on a terminal, every tenth of the run otherwise.
struct Bar {
    tty: bool,
    last_line: usize,
}

impl Bar {
    fn show(&mut self, p: Progress) {
        let width = 24;
        let filled = (p.done * width).checked_div(p.total).unwrap_or(width).min(width);
        let line = format!(
            "step {:>5}/{} [{}{}] loss {:.6}  {:.0} samples/s",
            p.done,
            p.total,
            "=".repeat(filled),
            " ".repeat(width - filled),
            p.loss,
            p.samples_per_sec
        );
        let mut err = std::io::stderr();
        if self.tty {
            let _ = write!(err, "\r{line}");
            if p.done == p.total {
                let _ = writeln!(err);
            }
        } else {
            let tenth = (p.total / 10).max(1);
            if p.done / tenth != self.last_line || p.done == p.total {
                self.last_line = p.done / tenth;
                let _ = writeln!(err, "{line}");
            }
        }
        let _ = err.flush();
    }
}

pub(crate) fn run(argv: &[String]) -> Result<(), Usage> {
    let a = Args::parse(argv, VALUED, SWITCHES)?;
    if let Some(p) = a.positional.first() {
        return Err(Usage(format!(
            "train takes no positional argument ({p:?}); see `meshwork help train`"
        )));
    }
    let (data_axis, model_axis) = args::mesh("mesh", a.get("mesh").unwrap_or("2x2"))?;
    let steps: usize = a.parse_or("steps", 200, "a step count")?;
    let batch: usize = a.parse_or("batch", 64, "a batch size")?;
    let lr: f64 = a.parse_or("lr", 0.5, "a learning rate")?;
    if !(lr.is_finite() && lr > 0.0) {
        return Err(Usage(format!("--lr {lr} must be a positive number")));
    }
    let seed: u64 = a.parse_or("seed", 0, "a seed (a whole number ≥ 0)")?;
    let dtype = match a.get("dtype").unwrap_or("f64") {
        "f32" => DType::F32,
        "f64" => DType::F64,
        other => return Err(Usage(format!("--dtype {other:?} is not f32 or f64"))),
    };
    let steps_per_run: usize = a.parse_or("steps-per-run", 1, "a step count")?;
    if steps_per_run == 0 {
        return Err(Usage("--steps-per-run must be at least 1".into()));
    }
    let checkpoint_every: usize = a.parse_or("checkpoint-every", 0, "a step count")?;
    if checkpoint_every > 0 && a.get("checkpoint-dir").is_none() {
        return Err(Usage("--checkpoint-every needs --checkpoint-dir".into()));
    }
    if batch == 0 {
        return Err(Usage("--batch must be at least 1".into()));
    }
    if !batch.is_multiple_of(data_axis) {
        return Err(Usage(format!(
            "--batch {batch} does not split over the {data_axis} data replicas of --mesh {data_axis}x{model_axis}"
        )));
    }
    if let Some(p) = a.get("losses-json") {
        writable_parent("losses-json", p)?;
    }
    if let Some(p) = a.get("checkpoint-dir") {
        writable_parent("checkpoint-dir", p)?;
    }
    if let Some(dir) = a.get("resume")
        && !Path::new(dir).join("index.json").is_file()
    {
        return Err(usage("resume", format!("{dir} holds no complete checkpoint (no index.json)")));
    }
    let data = dataset(&a, seed)?;
    let init = match a.get("init") {
        Some(path) => {
            let p = init_file(path, &data)?;
            if let Some(h) = a.get("hidden")
                && h.parse::<usize>().ok() != Some(p.hidden())
            {
                return Err(Usage(format!(
                    "--hidden {h} disagrees with --init, whose w1 has {} hidden units",
                    p.hidden()
                )));
            }
            p
        }
        None => {
            let hidden: usize = a.parse_or("hidden", 32, "a number of hidden units")?;
            if hidden == 0 {
                return Err(Usage("--hidden must be at least 1".into()));
            }
            Params::init(seed, data.features(), hidden, data.classes)
        }
    };
    if !init.hidden().is_multiple_of(model_axis) {
        return Err(Usage(format!(
            "--hidden {} does not split over the {model_axis} model devices of --mesh {data_axis}x{model_axis}",
            init.hidden()
        )));
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
        checkpoint_dir: a.get("checkpoint-dir").map(PathBuf::from),
        checkpoint_every,
        resume: a.get("resume").map(PathBuf::from),
    };
    eprintln!(
        "meshwork train: {data_axis}x{model_axis} mesh ({data_axis} data x {model_axis} model devices), {dtype}, \
         {steps} steps of {batch} rows, hidden {}, lr {lr}, {} rows x {} features, {} classes",
        init.hidden(),
        data.rows(),
        data.features(),
        data.classes
    );
    let mut bar = Bar { tty: std::io::stderr().is_terminal(), last_line: usize::MAX };
    let report =
        mlp::train(&config, &data, &init, &mut |p| bar.show(p)).map_err(|e| {
            match &config.resume {
                Some(dir)
                    if matches!(
                        e,
                        meshwork_strategy::Error::Checkpoint { .. }
                            | meshwork_strategy::Error::CheckpointMismatch { .. }
                    ) =>
                {
                    usage("resume", format!("{}: {e}", dir.display()))
                }
                _ => Usage(e.to_string()),
            }
        })?;
    if let Some(path) = a.get("losses-json") {
        let text = serde_json::to_string(&report.losses).map_err(|e| usage("losses-json", e))?;
        write_atomic(path, &text)
            .map_err(|e| usage("losses-json", format!("cannot write {path}: {e}")))?;
    }
    let made = report.losses.len();
    println!(
        "meshwork train: {data_axis}x{model_axis} mesh, {dtype}, steps {}..{}",
        report.first_step,
        report.first_step + made
    );
    match (report.losses.first(), report.losses.last()) {
        (Some(first), Some(last)) => println!("  final loss   {last:.6}  (first {first:.6})"),
        _ => println!("  final loss   -  (no steps left to run)"),
    }
    println!(
        "  accuracy     {:.1}% of {} rows",
        100.0 * report.params.accuracy(&data),
        data.rows()
    );
    let secs = report.elapsed.as_secs_f64();
    println!(
        "  throughput   {:.0} samples/s ({made} steps in {secs:.2} s)",
        (made * batch) as f64 / secs.max(1e-9)
    );
    if a.on("no-check") || made == 0 {
        println!("  check        skipped");
    } else if data_axis * model_axis == 1 {
        println!("  check        this run is the one-device run");
    } else {
        let single = TrainConfig {
            data: 1,
            model: 1,
            steps_per_run: 1,
            checkpoint_dir: None,
            checkpoint_every: 0,
            ..config.clone()
        };
        let one = mlp::train(&single, &data, &init, &mut |_| {})
            .map_err(|e| Usage(format!("the one-device check failed: {e}")))?;
        let (mut abs, mut rel) = (0.0f64, 0.0f64);
        for (a, b) in report.losses.iter().zip(&one.losses) {
            abs = abs.max((a - b).abs());
            rel = rel.max((a - b).abs() / b.abs().max(f64::MIN_POSITIVE));
        }
        println!(
            "  check        max |loss - 1x1 loss| = {abs:.1e} over {made} steps (relative {rel:.1e})"
        );
    }
    Ok(())
}
