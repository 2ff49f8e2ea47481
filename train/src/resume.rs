//! What a checkpoint says about the run that saved it, read as strictly as flags: a
//! size of 0, past a `usize`, or one that does not fit the rest of the model is
//! refused before anything is sized by it.
//!
//! Three kinds of checkpoints resume: the trainer's (its run metadata: the model and
//! its sizes, the dtype, the optimizer, the schedule and the data's fingerprint), the
//! main job's from before the one trainer (`"kind": "meshwork-mlp"`: an MLP trained by
//! SGD, its step count in a variable `step`), and checkpoints without run metadata
//! (saved by the library), taken as an MLP whose sizes its variables' shapes say.

use std::path::{Path, PathBuf};

use meshwork_checkpoint::{
    Pinned, checkpoint_metadata, checkpoint_variables, pin_checkpoint, read_checkpoint,
};
use meshwork_types::DType;
use serde_json::Value;

use crate::{Error, Result};

/// How a checkpoint was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Origin {
    /// By this trainer: weights, optimizer state and `optimizer.step`.
    Trainer,
    /// By the main job before the one trainer: `w1`, `b1`, `w2`, `b2` and a step
    /// count `step`, trained by SGD.
    MainJob,
    /// By the library, without run metadata: an MLP's `w1`, `b1`, `w2`, `b2`.
    Bare,
}

/// A checkpoint to resume from, and what it says about its run.
#[derive(Debug, Clone)]
pub(crate) struct Saved {
    /// The checkpoint's directory.
    pub(crate) dir: PathBuf,
    /// The step held against another run's pruning until this run has read it
    /// ([`release`](Self::release)).
    pinned: std::sync::Arc<std::sync::Mutex<Option<Pinned>>>,
    /// How it was written.
    pub(crate) origin: Origin,
    /// Its run metadata in the trainer's keys (for older checkpoints, what they say
    /// of it translated; what they do not say is absent).
    pub(crate) meta: Value,
    /// The steps its run had taken: its step counter variable (`optimizer.step`, or
    /// the main job's `step`), or its directory's `step-N` name, or 0.
    pub(crate) step: usize,
}

fn refuse(problem: impl std::fmt::Display) -> Error {
    Error::flag("resume", problem)
}

impl Saved {
    /// The checkpoint `path` names (a checkpoint directory's latest step, or one step).
    pub(crate) fn read(path: &Path) -> Result<Saved> {
        let pinned = pin_checkpoint(path).map_err(refuse)?;
        let (dir, step) = (pinned.dir.clone(), pinned.step);
        let shown = dir.display().to_string();
        let meta = checkpoint_metadata(&dir).map_err(refuse)?;
        let (origin, meta) = match meta {
            Some(m) if m.get("model").and_then(Value::as_str).is_some() => (Origin::Trainer, m),
            Some(m) if m.get("kind").and_then(Value::as_str) == Some("meshwork-mlp") => {
                (Origin::MainJob, main_job_meta(&m))
            }
            Some(_) => {
                return Err(refuse(format!("{shown} holds run metadata meshwork does not know")));
            }
            None => (Origin::Bare, bare_meta(&dir)?),
        };
        let step = saved_step(&dir, step)?;
        let _ = shown;
        let pinned = std::sync::Arc::new(std::sync::Mutex::new(Some(pinned)));
        Ok(Saved { dir, pinned, origin, meta, step })
    }

    /// Lets the step go once its values are read: from now on a save may prune it.
    pub(crate) fn release(&self) {
        self.pinned.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
    }

    /// The model its run trained (`--model`'s name).
    pub(crate) fn model(&self) -> &str {
        self.meta["model"].as_str().unwrap_or_default()
    }

    /// That it is a checkpoint of a run of `model`.
    pub(crate) fn check_model(&self, model: &str) -> Result<()> {
        let theirs = self.model();
        if theirs != model {
            return Err(refuse(format!(
                "{} is not a checkpoint of a {model} run (it is a {theirs} run's)",
                self.dir.display()
            )));
        }
        Ok(())
    }

    /// Size `name` of the saved model, checked as its flag would be: a whole number of
    /// at least 1 that fits a `usize`.
    pub(crate) fn size(&self, name: &str) -> Result<usize> {
        let v = &self.meta[name];
        match v.as_u64().and_then(|n| usize::try_from(n).ok()) {
            Some(n) if n >= 1 => Ok(n),
            _ => Err(refuse(format!(
                "{}: its metadata gives {name} {v}, not a size of at least 1",
                self.dir.display()
            ))),
        }
    }

    /// The saved dtype (f32 or f64).
    pub(crate) fn dtype(&self) -> Result<Option<DType>> {
        match self.meta.get("dtype") {
            None => Ok(None),
            Some(v) => match v.as_str().and_then(|d| d.parse::<DType>().ok()) {
                Some(d @ (DType::F32 | DType::F64)) => Ok(Some(d)),
                _ => Err(refuse(format!(
                    "{}: its metadata gives dtype {v}, not f32 or f64",
                    self.dir.display()
                ))),
            },
        }
    }

    /// The CNN's saved filters, `[F1, F2]`.
    pub(crate) fn filters(&self) -> Result<Option<[usize; 2]>> {
        match self.meta.get("filters") {
            None => Ok(None),
            Some(v) => match serde_json::from_value::<[u64; 2]>(v.clone()) {
                Ok([a, b]) if a >= 1 && b >= 1 => Ok(Some([
                    usize::try_from(a).map_err(|_| refuse("a filter count past a usize"))?,
                    usize::try_from(b).map_err(|_| refuse("a filter count past a usize"))?,
                ])),
                _ => Err(refuse(format!(
                    "{}: its metadata gives filters {v}, not two counts of at least 1",
                    self.dir.display()
                ))),
            },
        }
    }

    /// The CNN's saved image shape, `[H, W, C]`.
    pub(crate) fn image(&self) -> Option<Value> {
        self.meta.get("image").cloned()
    }
}

/// The step a checkpoint was saved at: its step counter (`optimizer.step`, or the
/// main job's `step`), a scalar integer of at least 0 and at most
/// [`MAX_STEPS`](crate::MAX_STEPS); or else the step its directory is named for.
fn saved_step(dir: &Path, named: Option<usize>) -> Result<usize> {
    let vars = checkpoint_variables(dir).map_err(refuse)?;
    let Some((name, dtype, shape)) =
        ["optimizer.step", "step"].iter().find_map(|n| vars.iter().find(|(v, _, _)| v == n))
    else {
        return Ok(named.unwrap_or(0));
    };
    let bad = |what: String| {
        refuse(format!("{}: its step counter {name} is {what}, not a step count", dir.display()))
    };
    if !shape.is_empty() || !matches!(dtype, DType::I32 | DType::I64) {
        return Err(bad(format!("{dtype}{shape:?}")));
    }
    let value = read_checkpoint(dir, &[(name.clone(), *dtype, Vec::new())]).map_err(refuse)?;
    let n = value.first().map(|t| t.to_f64()[0]).unwrap_or(-1.0);
    if !(0.0..=crate::MAX_STEPS as f64).contains(&n) {
        return Err(bad(format!("{n}")));
    }
    Ok(n as usize)
}

/// The main job's metadata in the trainer's keys.
fn main_job_meta(m: &Value) -> Value {
    let mut meta = serde_json::json!({
        "model": "mlp",
        "features": m["model"]["features"],
        "hidden": m["model"]["hidden"],
        "classes": m["model"]["classes"],
        "optimizer": format!("{:?}", meshwork_nn::Optimizer::Sgd),
    });
    for key in ["dtype", "lr", "batch", "seed"] {
        if let Some(v) = m.get(key) {
            meta[key] = v.clone();
        }
    }
    // `shuffle` was the shuffling seed or null.
    if let Some(s) = m.get("shuffle") {
        meta["shuffle"] = (!s.is_null()).into();
    }
    if let Some(fp) = m["data"].get("fingerprint") {
        meta["main_job_fingerprint"] = fp.clone();
    }
    if let Some(rows) = m["data"].get("rows") {
        meta["rows"] = rows.clone();
    }
    meta
}

/// A checkpoint without run metadata: an MLP whose sizes its variables say.
fn bare_meta(dir: &Path) -> Result<Value> {
    let vars = checkpoint_variables(dir).map_err(refuse)?;
    let find = |name: &str| vars.iter().find(|(n, _, _)| n == name);
    match (find("w1"), find("w2")) {
        (Some((_, dtype, w1)), Some((_, _, w2))) => match (w1.as_slice(), w2.as_slice()) {
            ([features, hidden], [_, classes]) => Ok(serde_json::json!({
                "model": "mlp",
                "features": features, "hidden": hidden, "classes": classes,
                "dtype": dtype.to_string(),
                "optimizer": format!("{:?}", meshwork_nn::Optimizer::Sgd),
            })),
            _ => Err(refuse(format!(
                "{}: its w1 and w2 are {w1:?} and {w2:?}, not an MLP's matrices",
                dir.display()
            ))),
        },
        _ => Err(refuse(format!(
            "{} holds no run metadata and no MLP weights (w1, w2) to take the model from",
            dir.display()
        ))),
    }
}
