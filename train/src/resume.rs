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

/// What a run trains on and how, as its checkpoints record it (`"flags"` in their
/// run metadata) so that `--resume DIR` alone continues it: the model's source
/// (`--init`, `--preset`), the data (paths made absolute, and each file's SHA-256
/// when the run saves checkpoints; process 0's), the tokenizer that encodes `--text`
/// (`--init`'s folder's if not given), `--seq`, and as the run resolved them
/// `--batch`, `--steps`, the optimizer and its settings, `--lr` and the schedule;
/// `--clip-norm`, `--dtype`, `--precision`, `--seed`, `--shuffle`, the evaluation's
/// and the checkpoints' cadence. What only changes where or how fast a run goes (the
/// mesh, the back end, the memory savers, the token cache's folder) and its other
/// outputs are not remembered.
pub(crate) fn flags_record(config: &crate::Config, run: &Resolved) -> Result<Value> {
    use meshwork_nn::Optimizer;
    use serde_json::json;
    let abs = |p: Option<&Path>| -> Value {
        p.map(|p| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf()).display().to_string())
            .into()
    };
    let leads = config.processes.as_ref().is_none_or(crate::Processes::leads);
    let sha256 = match config.checkpoint_dir.is_some() && leads {
        true => Value::Array(
            data_paths(&config.data)
                .iter()
                .map(|p| file_sha(p).map(Value::from))
                .collect::<Result<Vec<_>>>()?,
        ),
        false => Value::Null,
    };
    let mut data = data_json(&config.data, &abs);
    data["sha256"] = sha256;
    // The validation set likewise.
    let eval_data = match &config.eval_data {
        None => Value::Null,
        Some(d) => {
            let mut json = data_json(d, &abs);
            if config.checkpoint_dir.is_some() && leads {
                json["sha256"] = Value::Array(
                    data_paths(d)
                        .iter()
                        .map(|p| file_sha(p).map(Value::from))
                        .collect::<Result<Vec<_>>>()?,
                );
            }
            json
        }
    };
    let folder_tokenizer = config.init.as_ref().map(|d| d.join("tokenizer.json")).filter(|t| {
        t.is_file()
            && matches!(
                config.data,
                crate::Data::Text(_) | crate::Data::Jsonl { .. } | crate::Data::Documents { .. }
            )
    });
    let tokenizer = config.tokenizer.clone().or(folder_tokenizer);
    let (optimizer, settings) = match run.optimizer {
        Optimizer::Sgd => ("sgd", json!({})),
        Optimizer::Momentum { .. } => ("momentum", json!({})),
        Optimizer::Adam { beta1, beta2, eps } => {
            ("adam", json!({"beta1": beta1, "beta2": beta2, "eps": eps}))
        }
        Optimizer::AdamW { beta1, beta2, eps, weight_decay, decay_1d } => (
            "adamw",
            json!({"beta1": beta1, "beta2": beta2, "eps": eps,
                   "weight_decay": weight_decay, "no_decay_1d": !decay_1d}),
        ),
    };
    Ok(json!({
        "init": abs(config.init.as_deref()),
        "preset": config.preset,
        "data": data,
        "tokenizer": abs(tokenizer.as_deref()),
        "seq": config.seq,
        "batch": run.batch,
        "steps": run.steps,
        "optimizer": optimizer,
        "optimizer_settings": settings,
        "lr": run.lr,
        "schedule": run.schedule.name(),
        "min_lr": config.min_lr,
        "warmup": config.warmup,
        "clip_norm": config.clip_norm,
        "dtype": run.dtype.to_string(),
        "precision": config.precision.map(|d| d.to_string()),
        "base_dtype": config.base_dtype.map(|d| d.to_string()),
        "loss_scale_init": config.loss_scale_init,
        "seed": config.seed,
        "shuffle": config.shuffle,
        "eval_every": config.eval_every,
        "eval_fraction": config.eval_fraction,
        "eval_data": eval_data,
        "checkpoint_dir": abs(config.checkpoint_dir.as_deref()),
        "checkpoint_every": config.checkpoint_every,
        "keep": config.keep,
    }))
}

/// A run's settings as it resolved them (the defaults taken), for [`flags_record`].
pub(crate) struct Resolved {
    pub(crate) steps: usize,
    pub(crate) batch: usize,
    pub(crate) optimizer: meshwork_nn::Optimizer,
    pub(crate) lr: f64,
    pub(crate) schedule: crate::Schedule,
    pub(crate) dtype: DType,
}

/// The files `data` reads.
fn data_paths(data: &crate::Data) -> Vec<PathBuf> {
    match data {
        crate::Data::BuiltIn => Vec::new(),
        crate::Data::Npy { x, y } => vec![x.clone(), y.clone()],
        crate::Data::Tokens(p) | crate::Data::Text(p) | crate::Data::Jsonl { path: p, .. } => {
            vec![p.clone()]
        }
        crate::Data::Documents { paths, .. } => paths.clone(),
    }
}

/// `data` as the flags record it: its kind, its files (absolute) and a JSONL
/// file's field.
fn data_json(data: &crate::Data, abs: &dyn Fn(Option<&Path>) -> Value) -> Value {
    let kind = match data {
        crate::Data::BuiltIn => "built-in",
        crate::Data::Npy { .. } => "npy",
        crate::Data::Tokens(_) => "tokens",
        crate::Data::Text(_) => "text",
        crate::Data::Jsonl { .. } => "jsonl",
        crate::Data::Documents { .. } => "documents",
    };
    let paths: Vec<Value> = data_paths(data).iter().map(|p| abs(Some(p))).collect();
    let field = match data {
        crate::Data::Jsonl { field, .. } | crate::Data::Documents { field, .. } => {
            Value::from(field.as_str())
        }
        _ => Value::Null,
    };
    serde_json::json!({"kind": kind, "paths": paths, "field": field})
}

/// The data `recorded` ([`data_json`]) names; `None` where it names none it can read.
fn data_of(recorded: &Value) -> Option<crate::Data> {
    use crate::Data;
    let paths: Vec<PathBuf> = recorded["paths"]
        .as_array()?
        .iter()
        .map(|p| p.as_str().map(PathBuf::from))
        .collect::<Option<_>>()?;
    Some(match (recorded["kind"].as_str()?, paths.as_slice()) {
        ("built-in", []) => Data::BuiltIn,
        ("npy", [x, y]) => Data::Npy { x: x.clone(), y: y.clone() },
        ("tokens", [t]) => Data::Tokens(t.clone()),
        ("text", [t]) => Data::Text(t.clone()),
        ("jsonl", [t]) => {
            Data::Jsonl { path: t.clone(), field: recorded["field"].as_str()?.into() }
        }
        ("documents", [_, ..]) => {
            Data::Documents { paths: paths.clone(), field: recorded["field"].as_str()?.into() }
        }
        _ => return None,
    })
}

/// A data file's SHA-256 in hex, streamed.
fn file_sha(path: &Path) -> Result<String> {
    use sha2::Digest;
    use std::io::Read;
    let cannot = |e: std::io::Error| Error::usage(format!("cannot read {}: {e}", path.display()));
    let mut file = std::fs::File::open(path).map_err(cannot)?;
    let mut hash = sha2::Sha256::new();
    let mut block = vec![0u8; 1 << 16];
    loop {
        let n = file.read(&mut block).map_err(cannot)?;
        if n == 0 {
            break;
        }
        hash.update(&block[..n]);
    }
    Ok(hash.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// The tokenizer a run used: `tokenizer` (given, or remembered), else the one its
/// checkpoint's `flags` record, else the `tokenizer.json` in its model folder
/// (`init`, else the recorded one), if that is a file.
pub(crate) fn tokenizer_used(
    tokenizer: Option<PathBuf>,
    init: Option<&Path>,
    flags: Option<&Value>,
) -> Option<PathBuf> {
    let recorded = |key: &str| flags.and_then(|f| f[key].as_str()).map(PathBuf::from);
    tokenizer.or_else(|| recorded("tokenizer").filter(|t| t.is_file())).or_else(|| {
        [init.map(Path::to_path_buf), recorded("init")]
            .into_iter()
            .flatten()
            .map(|d| d.join("tokenizer.json"))
            .find(|t| t.is_file())
    })
}

/// [`tokenizer_used`] by the checkpoint `dir`'s run, if it can be read.
pub(crate) fn recorded_tokenizer(dir: &Path) -> Option<PathBuf> {
    let saved = Saved::read(dir).ok()?;
    tokenizer_used(None, None, saved.meta.get("flags"))
}

/// `config` with what it leaves unset taken from the flags its resumed checkpoint's
/// run was given (`flags`, [`flags_record`]), and a line for each flag given anyway
/// that differs from that run's. A data file the run read whose SHA-256 has changed
/// since is refused unless `--data-changed-ok` (when training; an evaluation takes
/// the data as they are); a run that only needs the weights leaves the data as given
/// and does not look at them. (`--seed`,
/// `--warmup` and `--shuffle` have no unset value: at their defaults they are taken
/// from the run.)
pub(crate) fn remembered(
    config: &crate::Config,
    dir: &Path,
    flags: &Value,
    lora: bool,
    purpose: crate::plan::Purpose,
) -> Result<(crate::Config, Vec<String>)> {
    use crate::plan::Purpose;
    use crate::{Config, Data, OptimizerKind, Schedule};
    let mut c: Config = config.clone();
    let mut notes = Vec::new();
    let bad = |key: &str| {
        refuse(format!(
            "{}: its recorded flags give {key} {}, which meshwork cannot read",
            dir.display(),
            flags[key]
        ))
    };
    let path = |key: &str| -> Result<Option<PathBuf>> {
        match &flags[key] {
            Value::Null => Ok(None),
            Value::String(s) => Ok(Some(PathBuf::from(s))),
            _ => Err(bad(key)),
        }
    };
    let num = |key: &str| -> Result<Option<f64>> {
        match &flags[key] {
            Value::Null => Ok(None),
            v => v.as_f64().map(Some).ok_or_else(|| bad(key)),
        }
    };
    let count = |key: &str| -> Result<Option<usize>> {
        match &flags[key] {
            Value::Null => Ok(None),
            v => v.as_u64().and_then(|n| usize::try_from(n).ok()).map(Some).ok_or_else(|| bad(key)),
        }
    };
    let dtype = |key: &str| -> Result<Option<DType>> {
        match &flags[key] {
            Value::Null => Ok(None),
            v => v.as_str().and_then(|s| s.parse().ok()).map(Some).ok_or_else(|| bad(key)),
        }
    };
    // Unset: the run's; given and not the run's: a note (unless the settings'
    // comparison with the checkpoint warns of it: `said`).
    fn take<T: Clone + PartialEq + Shown>(
        mine: &mut Option<T>,
        theirs: Option<T>,
        flag: &str,
        notes: &mut Vec<String>,
    ) {
        match (mine.as_ref(), theirs) {
            (None, t) => *mine = t,
            (Some(m), Some(t)) if !m.same(&t) => {
                notes.push(format!("{flag} {} given: the resumed run had {}", m.shown(), t.shown()))
            }
            _ => {}
        }
    }
    let mut said = Vec::new();
    // A LoRA run's base (its checkpoint holds the adapter alone); a full run's
    // weights are the checkpoint's.
    if lora {
        take(&mut c.init, path("init")?, "--init", &mut notes);
        // Unset is a setting here too (the base in --dtype): a run that had none told
        // when this one narrows its base.
        let theirs = dtype("base_dtype")?;
        match (c.base_dtype, theirs) {
            (None, t) => c.base_dtype = t,
            (Some(m), None) => notes
                .push(format!("--base-dtype {m} given: the resumed run held its base in --dtype")),
            (Some(m), Some(t)) if m != t => {
                notes.push(format!("--base-dtype {m} given: the resumed run had {t}"))
            }
            _ => {}
        }
    }
    take(&mut c.tokenizer, path("tokenizer")?, "--tokenizer", &mut notes);
    take(&mut c.seq, count("seq")?, "--seq", &mut notes);
    take(&mut c.batch, count("batch")?, "--batch", &mut said);
    // --epochs given: the steps are its.
    if c.epochs.is_none() {
        take(&mut c.steps, count("steps")?, "--steps", &mut notes);
    }
    let optimizer = match flags["optimizer"].as_str() {
        None => None,
        Some("sgd") => Some(OptimizerKind::Sgd),
        Some("momentum") => Some(OptimizerKind::Momentum),
        Some("adam") => Some(OptimizerKind::Adam),
        Some("adamw") => Some(OptimizerKind::AdamW),
        Some(_) => return Err(bad("optimizer")),
    };
    // The optimizer's settings go with it: taken when the optimizer is the run's.
    let same_optimizer = c.optimizer.is_none() || c.optimizer == optimizer;
    take(&mut c.optimizer, optimizer, "--optimizer", &mut notes);
    if same_optimizer {
        let s = &flags["optimizer_settings"];
        let setting = |key: &str| -> Result<Option<f64>> {
            match &s[key] {
                Value::Null => Ok(None),
                v => v.as_f64().map(Some).ok_or_else(|| bad("optimizer_settings")),
            }
        };
        let o = &mut c.optimizer_settings;
        take(&mut o.weight_decay, setting("weight_decay")?, "--weight-decay", &mut notes);
        take(&mut o.beta1, setting("beta1")?, "--beta1", &mut notes);
        take(&mut o.beta2, setting("beta2")?, "--beta2", &mut notes);
        take(&mut o.eps, setting("eps")?, "--eps", &mut notes);
        o.no_decay_1d |= s["no_decay_1d"].as_bool().unwrap_or(false);
    }
    take(&mut c.lr, num("lr")?, "--lr", &mut said);
    let schedule = match flags["schedule"].as_str() {
        None => None,
        Some(name) => Some(
            [Schedule::Constant, Schedule::Cosine, Schedule::Linear]
                .into_iter()
                .find(|s| s.name() == name)
                .ok_or_else(|| bad("schedule"))?,
        ),
    };
    take(&mut c.schedule, schedule, "--schedule", &mut said);
    take(&mut c.min_lr, num("min_lr")?, "--min-lr", &mut said);
    take(&mut c.clip_norm, num("clip_norm")?, "--clip-norm", &mut said);
    take(&mut c.dtype, dtype("dtype")?, "--dtype", &mut notes);
    take(&mut c.precision, dtype("precision")?, "--precision", &mut notes);
    take(&mut c.loss_scale_init, num("loss_scale_init")?, "--loss-scale-init", &mut notes);
    take(&mut c.eval_every, count("eval_every")?, "--eval-every", &mut notes);
    take(&mut c.eval_fraction, num("eval_fraction")?, "--eval-fraction", &mut said);
    // Resumed by its checkpoint directory (not one step of it), the run goes on
    // saving there as it did.
    let theirs = path("checkpoint_dir")?;
    let same = |a: &Path, b: &Path| {
        std::fs::canonicalize(a).ok().is_some_and(|a| std::fs::canonicalize(b).ok() == Some(a))
    };
    if let (None, Some(dir), Some(resume)) = (&c.checkpoint_dir, &theirs, &config.resume)
        && same(dir, resume)
    {
        c.checkpoint_dir = theirs.clone();
        take(&mut c.checkpoint_every, count("checkpoint_every")?, "--checkpoint-every", &mut notes);
        take(&mut c.keep, count("keep")?, "--keep", &mut notes);
        if let Some(dir) = &theirs {
            notes.push(format!(
                "saving into {} as the resumed run did (--checkpoint-dir to save elsewhere)",
                dir.display()
            ));
        }
    }
    let defaults = Config::default();
    if c.warmup == defaults.warmup {
        c.warmup = count("warmup")?.unwrap_or(c.warmup);
    }
    if c.seed == defaults.seed {
        c.seed = flags["seed"].as_u64().unwrap_or(c.seed);
    }
    c.shuffle |= flags["shuffle"].as_bool().unwrap_or(false);
    if purpose == Purpose::Weights {
        return Ok((c, notes));
    }
    if purpose == Purpose::Train && !flags["eval_data"].is_null() {
        let recorded = &flags["eval_data"];
        let theirs = data_of(recorded).ok_or_else(|| bad("eval_data"))?;
        match &c.eval_data {
            None => {
                check_unchanged(&theirs, &recorded["sha256"], config.data_changed_ok)?;
                c.eval_data = Some(theirs);
            }
            Some(mine) if absolute(&data_paths(mine)) != data_paths(&theirs) => {
                notes.push(format!(
                    "--eval-data {} given: the resumed run had {}",
                    shown(&data_paths(mine)),
                    shown(&data_paths(&theirs))
                ))
            }
            Some(_) => {}
        }
    }
    // The data: as given (a note where they are not the run's), else the run's.
    let theirs: Vec<PathBuf> = flags["data"]["paths"]
        .as_array()
        .map(|ps| ps.iter().filter_map(Value::as_str).map(PathBuf::from).collect())
        .unwrap_or_default();
    if c.data == Data::BuiltIn {
        c.data = match flags["data"]["kind"].is_null() {
            true => Data::BuiltIn,
            false => data_of(&flags["data"]).ok_or_else(|| bad("data"))?,
        };
    }
    let mine: Vec<PathBuf> = data_paths(&c.data)
        .iter()
        .map(|p| std::path::absolute(p).unwrap_or_else(|_| p.clone()))
        .collect();
    if mine != theirs {
        notes.push(format!(
            "the data given ({}) are not the resumed run's ({})",
            shown(&mine),
            if theirs.is_empty() { "built-in rows".into() } else { shown(&theirs) }
        ));
    } else if purpose == Purpose::Train {
        check_unchanged(&c.data, &flags["data"]["sha256"], config.data_changed_ok)?;
    }
    Ok((c, notes))
}

/// `data`'s files against the SHA-256s a checkpoint recorded of them (`shas`, a
/// list; none recorded: nothing to compare): one that changed is refused unless
/// `ok` (`--data-changed-ok`).
fn check_unchanged(data: &crate::Data, shas: &Value, ok: bool) -> Result<()> {
    let Some(shas) = shas.as_array() else { return Ok(()) };
    for (p, sha) in data_paths(data).iter().zip(shas) {
        let now = file_sha(p).map_err(|e| refuse(e.to_string()))?;
        if sha.as_str() != Some(now.as_str()) && !ok {
            return Err(refuse(format!(
                "{} has changed since the resumed run read it (SHA-256 {} then, {now} now); --data-changed-ok trains on it as it is now",
                p.display(),
                sha.as_str().unwrap_or("?"),
            )));
        }
    }
    Ok(())
}

/// `paths` made absolute, as the flags record them.
fn absolute(paths: &[PathBuf]) -> Vec<PathBuf> {
    paths.iter().map(|p| std::path::absolute(p).unwrap_or_else(|_| p.clone())).collect()
}

/// Paths joined for a note.
fn shown(paths: &[PathBuf]) -> String {
    if paths.is_empty() {
        return "built-in rows".into();
    }
    paths.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
}

/// A remembered flag's value as a note shows it, and whether a given one is the same
/// (a path by its absolute form).
trait Shown {
    fn shown(&self) -> String;
    fn same(&self, other: &Self) -> bool;
}

macro_rules! shown_by_display {
    ($($t:ty),*) => {$(
        impl Shown for $t {
            fn shown(&self) -> String {
                self.to_string()
            }
            fn same(&self, other: &Self) -> bool {
                self == other
            }
        }
    )*};
}

shown_by_display!(usize, DType);

impl Shown for f64 {
    fn shown(&self) -> String {
        crate::number_text(*self)
    }
    fn same(&self, other: &Self) -> bool {
        self == other
    }
}

impl Shown for PathBuf {
    fn shown(&self) -> String {
        self.display().to_string()
    }
    fn same(&self, other: &Self) -> bool {
        let abs = |p: &PathBuf| std::path::absolute(p).unwrap_or_else(|_| p.clone());
        abs(self) == abs(other)
    }
}

impl Shown for crate::OptimizerKind {
    fn shown(&self) -> String {
        format!("{self:?}").to_lowercase()
    }
    fn same(&self, other: &Self) -> bool {
        self == other
    }
}

impl Shown for crate::Schedule {
    fn shown(&self) -> String {
        self.name().to_string()
    }
    fn same(&self, other: &Self) -> bool {
        self == other
    }
}
