//! The training loop: a checked [`Plan`] run on a strategy, step by step (a host call
//! of `steps_per_run` steps at a time), with the one-device check beside it,
//! evaluations, checkpoints, the losses, metrics and plot sinks, and a stop flag.

use std::collections::{HashMap, VecDeque};
use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use meshwork_checkpoint::{CheckpointManager, read_checkpoint};
use meshwork_nn::Optimizer;
use meshwork_strategy::Strategy;
use meshwork_types::{DType, Tensor};

use crate::config::Config;
use crate::data::Classification;
use crate::files::{create_new, write_atomic, write_new};
use crate::model::{Layout, Net, Savers};
use crate::observe::{Observer, Start, Step};
use crate::plan::{Plan, plan};
use crate::processes::Point;
use crate::report::{CheckOutcome, Report, number_text, svg};
use crate::resume::Origin;
use crate::rng::permutation;
use crate::steps::{Eval, Recipe, Steps, start};
use crate::{Error, Result};

/// A training run, every setting checked: [`Trainer::new`] refuses bad settings,
/// files and checkpoints before anything is written; [`Trainer::run`] trains.
///
/// ```
/// use std::sync::atomic::AtomicBool;
/// use meshwork_train::{Config, ModelKind, Quiet, Trainer};
///
/// let mut config = Config::new(ModelKind::Mlp);
/// config.mesh = Some((2, 1));
/// config.steps = Some(3);
/// let report = Trainer::new(&config)?.run(&mut Quiet, &AtomicBool::new(false))?;
/// assert_eq!(report.losses.len(), 3);
/// # Ok::<(), meshwork_train::Error>(())
/// ```
pub struct Trainer {
    plan: Plan,
}

impl std::fmt::Debug for Trainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("model", &self.plan.net.describe())
            .field("layout", &self.plan.layout)
            .field("steps", &self.plan.steps)
            .finish_non_exhaustive()
    }
}

/// The learning rate of step `s` (from 0) of `steps`: a linear warm-up over `warmup`
/// steps to `lr`, then `lr`, or a cosine decay to 0 at the last step.
pub fn learning_rate(lr: f64, s: usize, steps: usize, warmup: usize, cosine: bool) -> f64 {
    if s < warmup {
        return lr * (s + 1) as f64 / warmup as f64;
    }
    if !cosine || steps <= warmup + 1 {
        return lr;
    }
    let t = (s - warmup) as f64 / (steps - warmup - 1) as f64;
    lr * 0.5 * (1.0 + (std::f64::consts::PI * t).cos())
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

/// Step `s`'s loss on `layout` against one device's (`want`, when checked): a loss
/// that is not finite, or one further than `tol` (relative) from one device's, fails
/// the run. Steps are counted from 0 and named from 1, as the progress lines do.
pub(crate) fn check_step(
    s: usize,
    loss: f64,
    want: Option<f64>,
    tol: f64,
    layout: &str,
) -> Result<()> {
    if !loss.is_finite() {
        return Err(Error::failed(format!("step {}: the loss is {loss}", s + 1)));
    }
    match want {
        Some(want) if !want.is_finite() || (loss - want).abs() > tol * want.abs().max(1e-12) => {
            Err(Error::failed(format!(
                "step {}: loss {loss} on {layout}, {want} on one device (tolerance {tol:e} relative)",
                s + 1,
            )))
        }
        _ => Ok(()),
    }
}

/// A checkpoint directory meshwork may not use, in one line naming `--checkpoint-dir`.
fn directory_refused(e: meshwork_checkpoint::Error) -> Error {
    match e {
        meshwork_checkpoint::Error::Directory { path, problem } => {
            Error::usage(format!("--checkpoint-dir {}: {problem}", path.display()))
        }
        other => Error::flag("checkpoint-dir", other),
    }
}

/// A checkpoint save that failed, in one line naming `--checkpoint-dir` and the step.
fn save_failed(e: meshwork_strategy::Error) -> Error {
    match e {
        meshwork_strategy::Error::Checkpoint(meshwork_checkpoint::Error::Save {
            path,
            step,
            problem,
        }) => Error::failed(format!(
            "--checkpoint-dir {}: cannot save step {step}: {problem}",
            path.display()
        )),
        other => Error::failed(format!("--checkpoint-dir: {other}")),
    }
}

/// A losses list for a file: every step's loss, `null` where it was not finite.
fn losses_json(before: &[Option<f64>], losses: &[f64]) -> Vec<u8> {
    let all: Vec<Option<f64>> =
        before.iter().copied().chain(losses.iter().map(|&l| l.is_finite().then_some(l))).collect();
    serde_json::to_vec(&all).unwrap_or_else(|_| b"[]".to_vec())
}

impl Trainer {
    /// Checks `config` — each setting, the settings together, the data, `--init`, the
    /// checkpoint resumed and the outputs — and estimates the run's memory against
    /// `max_memory`. Nothing is written.
    ///
    /// Across processes ([`Config::processes`]) every process plans alike and they
    /// agree: where any refuses (a file missing on one node), every one returns that
    /// refusal, named by the process that saw it.
    pub fn new(config: &Config) -> Result<Trainer> {
        let planned = plan(config);
        match config.processes.as_ref().filter(|p| p.count() > 1) {
            Some(p) => {
                // What every process must have planned alike (`plan_digest`).
                let digest = planned.as_ref().map_or(0, |plan| plan_digest(config, plan));
                p.agree_at(Point::Planned, digest, planned, false).map(|(plan, _)| Trainer { plan })
            }
            None => Ok(Trainer { plan: planned? }),
        }
    }

    /// The model the run trains.
    pub fn net(&self) -> &Net {
        &self.plan.net
    }

    /// How its steps are spread over the devices.
    pub fn layout(&self) -> Layout {
        self.plan.layout
    }

    /// The step it starts at (0 unless resumed) and the step it stops at.
    pub fn step_range(&self) -> std::ops::Range<usize> {
        self.plan.saved.as_ref().map_or(0, |s| s.step)..self.plan.steps
    }

    /// Whether each step's loss will be checked against one device's.
    pub fn checks(&self) -> bool {
        self.plan.check
    }

    /// Trains: steps from the first (0, or the resumed checkpoint's) to the last,
    /// telling `observer` as it goes. When `stop` is set, the run ends after its
    /// current host call: a checkpoint is saved where one is asked for, the outputs
    /// written, and the report says it stopped.
    ///
    /// A loss that is not finite, a one-device check that fails or a checkpoint that
    /// cannot be saved end the run with [`Error::Failed`], the losses so far written.
    ///
    /// Across processes every process calls it: each runs its positions, they meet
    /// between host calls (to stop after the same step when any saw `stop`), each
    /// writes its own parts of every checkpoint, process 0 alone writes the other
    /// outputs, and all return the same outcome — a failure in any process fails the
    /// run in every one, named by the process that saw it.
    pub fn run(self, observer: &mut dyn Observer, stop: &AtomicBool) -> Result<Report> {
        let processes = self.plan.processes.clone();
        let outcome = self.run_here(observer, stop);
        match (processes, outcome) {
            (None, r) => r.map_err(Ended::into_error),
            (Some(_), Err(Ended::Agreed(e))) => Err(e),
            (Some(p), r) => {
                p.agree_at(Point::End, 0, r.map_err(Ended::into_error), false).map(|(r, _)| r)
            }
        }
    }

    fn run_here(self, observer: &mut dyn Observer, stop: &AtomicBool) -> Result<Report, Ended> {
        let mut p = self.plan;
        // A checkpoint at or past the last step: nothing to run, nothing written.
        if let Some(saved) = p.saved.as_ref().filter(|s| s.step >= p.steps) {
            let mut report = Report::empty(&p, saved.step);
            report.layout = p.layout.describe();
            return Ok(report);
        }
        let mut where_ = match &p.backend.backend {
            Some(b) => format!("{} on {}", p.layout.describe(), b.describe()),
            None => p.layout.describe(),
        };
        if let Some(procs) = &p.processes {
            where_.push_str(&format!(" over {} processes", procs.count()));
        }
        let init = p.take_init()?;
        let strategy = p.strategy()?;
        let one = Strategy::data_parallel(1).map_err(Error::failed)?;
        let mut run = Running::start(&p, &strategy, &one, &init)?;
        drop(init);
        let first = sync(&p, Point::Started, run.restore(&p), false)?.0;
        if let Some(saved) = &p.saved {
            saved.release();
        }
        // Every check passed in every process: now the outputs are made (process 0's,
        // then the others join its checkpoint directory).
        let opened = if p.leads() { Outputs::open(&p, first) } else { Ok(Outputs::none()) };
        let mut out = sync(&p, Point::Opened, opened, false)?.0;
        for aside in out.manager.iter().flat_map(CheckpointManager::set_aside) {
            p.warnings.push(format!(
                "--checkpoint-dir: a damaged step (no complete index) was set aside as {}",
                aside.display()
            ));
        }
        if p.processes.is_some() {
            let joined = match out.manager.take() {
                Some(m) => Ok(Some(m)),
                None => p
                    .checkpoint_dir
                    .as_ref()
                    .map(CheckpointManager::join)
                    .transpose()
                    .map_err(directory_refused),
            };
            out.manager = sync(&p, Point::Joined, joined, false)?.0;
        }
        observer.start(&Start {
            headline: format!(
                "training {} on {} rows ({}, {}, lr {}) on {where_}, batch {}, {} steps",
                p.net.describe(),
                p.rows,
                p.dtype,
                optimizer_text(p.optimizer),
                number_text(p.lr),
                p.batch,
                p.steps
            ),
            first,
            steps: p.steps,
            warnings: p.warnings.clone(),
        });
        let mut progress = Progress::default();
        let sent_before = p.processes.as_ref().map(crate::Processes::bytes_sent);
        let outcome = run.train(&p, &mut out, &mut progress, (observer, stop), (first, &where_));
        observer.end();
        // The losses are written whether the run finished, stopped or failed.
        if let Some(path) = p.losses_json.as_ref().filter(|_| p.leads()) {
            let written = write_atomic(path, &losses_json(&p.losses_before, &progress.losses));
            if let Err(e) = written {
                let e = Error::failed(format!("--losses-json {}: {e}", path.display()));
                return Err(outcome.err().unwrap_or(Ended::Here(e)));
            }
        }
        let stopped = outcome?;
        run.finish(&p, &progress, &where_, first, (out.export.as_ref(), out.export_lora.as_ref()))?;
        let accuracy = match (&p.classification, &run.eval) {
            (Some(data), None) if !stopped => Some(run.accuracy(&p, &one, data)?),
            _ => None,
        };
        let check = if p.check {
            let tolerance = tolerance(&p);
            CheckOutcome::Checked { most: progress.most, relative: progress.most_rel, tolerance }
        } else if p.layout.devices() == 1 {
            CheckOutcome::OneDevice
        } else if let Some(procs) = &p.processes {
            CheckOutcome::Spread(procs.count())
        } else if p.never_check {
            CheckOutcome::Skipped
        } else {
            CheckOutcome::Large
        };
        let mut report = Report::empty(&p, first);
        report.layout = where_;
        report.eval_rows = run.eval.as_ref().map_or(0, Eval::rows);
        report.losses = progress.losses;
        report.evals = progress.evals;
        report.accuracy = accuracy;
        report.busy = progress.busy;
        report.saved = progress.saved_at.zip(p.checkpoint_dir.clone());
        report.check = check;
        report.stopped = stopped;
        if let (Some(procs), Some(before)) = (&p.processes, sent_before) {
            let steps = report.losses.len().max(1) as f64;
            let sent = procs.bytes_sent().saturating_sub(before) as f64 / steps;
            let least = run.run.cross_process_minimum(procs.count()).unwrap_or(0);
            report.between_processes = Some((sent, least));
        }
        Ok(report)
    }
}

/// The one-device check's tolerance (relative): half-precision products round far
/// more than f32, f32 than f64; an f64 run of a model with float32 parts (the Llama
/// family's RMSNorm) agrees across back ends to float32's rounding there (1e-9 to
/// 1e-8 measured over 10 steps; 1e-6 allowed).
fn tolerance(p: &Plan) -> f64 {
    match (p.precision, p.dtype) {
        (Some(_), _) => 5e-2,
        (None, DType::F64) if p.net.model().float32_parts() => 1e-6,
        (None, DType::F64) => 1e-9,
        (None, _) => 1e-3,
    }
}

/// What every process of a spread run must have planned alike, as a number: the
/// run's record (model, rows, optimizer, schedule), its layout, savers, precision,
/// steps and host calls, evaluation and checkpoint cadence, back end, where it starts,
/// and the sizes of the files it reads (each process's copy must be the same file).
fn plan_digest(config: &Config, p: &Plan) -> u64 {
    let size = |path: Option<&Path>| path.and_then(|f| std::fs::metadata(f).ok()).map(|m| m.len());
    let data = match &config.data {
        crate::Data::Tokens(f) | crate::Data::Text(f) => [size(Some(f)), None],
        crate::Data::Npy { x, y } => [size(Some(x)), size(Some(y))],
        crate::Data::BuiltIn => [None, None],
    };
    let text = format!(
        "{} {} {:?} {:?} {:?} {:?} {} {} {} {} {:?} {:?} {:?}",
        p.meta,
        p.steps,
        p.saved.as_ref().map(|s| s.step),
        p.layout,
        p.savers,
        p.precision,
        p.steps_per_run,
        p.eval_every,
        p.checkpoint_every,
        p.dtype,
        p.backend.backend.as_ref().map(|b| b.describe()),
        data,
        size(config.init.as_deref().filter(|i| i.is_file())),
    );
    u64::from(crc32c::crc32c(text.as_bytes())) | 1
}

/// How a run that did not finish ended: a failure here, or one every process
/// already agreed on (which is returned as it is, without agreeing again).
enum Ended {
    Here(Error),
    Agreed(Error),
}

impl Ended {
    fn into_error(self) -> Error {
        match self {
            Ended::Here(e) | Ended::Agreed(e) => e,
        }
    }
}

impl From<Error> for Ended {
    fn from(e: Error) -> Ended {
        Ended::Here(e)
    }
}

/// Where the run spreads over processes: every process's `mine` and stop request
/// agreed ([`Processes::agree`](crate::Processes::agree)); alone: `mine` as it is.
fn sync<T>(p: &Plan, at: Point, mine: Result<T>, stop: bool) -> Result<(T, bool), Ended> {
    match &p.processes {
        Some(procs) => procs.agree_at(at, 0, mine, stop).map_err(Ended::Agreed),
        None => Ok((mine?, stop)),
    }
}

impl Report {
    /// A report of `p` from step `first` with nothing run yet.
    fn empty(p: &Plan, first: usize) -> Report {
        Report {
            model: p.net.describe(),
            layout: String::new(),
            dtype: p.dtype,
            first_step: first,
            steps: p.steps,
            losses: Vec::new(),
            evals: Vec::new(),
            eval_rows: 0,
            classifies: p.net.classifies(),
            accuracy: None,
            busy: Duration::ZERO,
            batch: p.batch,
            per_row: p.net.per_row(),
            saved: None,
            checkpoint_dir: p.checkpoint_dir.clone(),
            check: CheckOutcome::Skipped,
            stopped: false,
            between_processes: None,
        }
    }
}

/// What a run has done so far.
#[derive(Default)]
struct Progress {
    losses: Vec<f64>,
    evals: Vec<(usize, f64, f64)>,
    busy: Duration,
    saved_at: Option<usize>,
    /// The one-device check's largest absolute and relative differences.
    most: f64,
    most_rel: f64,
}

/// What a run writes as it goes: its checkpoints and its metrics lines; and the
/// folder its export goes into, made and held from the start.
struct Outputs {
    manager: Option<CheckpointManager>,
    metrics: Option<std::fs::File>,
    export: Option<ExportDir>,
    export_lora: Option<ExportDir>,
}

/// `--export-hf`'s (or `--export-lora`'s) folder, made (or found empty) before training and held open: the
/// export is written through this handle, so a link put at its path during the run
/// is never followed. A folder this run made and left empty (a failed run) is removed.
struct ExportDir {
    path: std::path::PathBuf,
    handle: std::fs::File,
    made: bool,
}

impl ExportDir {
    /// Makes or opens the empty folder `path` (never through a symbolic link).
    fn open(flag: &str, path: &Path) -> Result<ExportDir> {
        use std::os::unix::fs::OpenOptionsExt;
        let refuse =
            |e: &dyn std::fmt::Display| Error::flag(flag, format!("{}: {e}", path.display()));
        let made = match std::fs::create_dir(path) {
            Ok(()) => true,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => false,
            Err(e) => return Err(refuse(&format!("cannot create it: {e}"))),
        };
        let handle = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
            .open(path)
            .map_err(|e| refuse(&format!("not a folder meshwork can write into ({e})")))?;
        let dir = ExportDir { path: path.to_path_buf(), handle, made };
        if std::fs::read_dir(dir.through()).map_err(|e| refuse(&e))?.next().is_some() {
            return Err(refuse(&"exists and is not an empty folder"));
        }
        Ok(dir)
    }

    /// The folder as this process holds it, whatever is at its path now.
    fn through(&self) -> std::path::PathBuf {
        use std::os::fd::AsRawFd;
        std::path::PathBuf::from(format!("/proc/self/fd/{}", self.handle.as_raw_fd()))
    }

    /// `text` with the handle's path shown as the user's.
    fn shown(&self, text: &str) -> String {
        text.replace(&self.through().display().to_string(), &self.path.display().to_string())
    }
}

impl Drop for ExportDir {
    fn drop(&mut self) {
        // Only an empty folder goes (`remove_dir`), and only through its path when it
        // is still the folder made (not a link put there).
        if self.made
            && std::fs::read_dir(self.through()).is_ok_and(|mut d| d.next().is_none())
            && std::fs::symlink_metadata(&self.path).is_ok_and(|m| m.is_dir())
        {
            let _ = std::fs::remove_dir(&self.path);
        }
    }
}

impl Outputs {
    /// No outputs (a process other than the one that writes them).
    fn none() -> Outputs {
        Outputs { manager: None, metrics: None, export: None, export_lora: None }
    }

    /// The checkpoint directory (locked; refused if it holds later steps than
    /// `first`) and the metrics file, made.
    fn open(p: &Plan, first: usize) -> Result<Outputs> {
        let manager = p
            .checkpoint_dir
            .as_ref()
            .map(|d| CheckpointManager::open(d, p.keep))
            .transpose()
            .map_err(directory_refused)?;
        if let Some(m) = &manager
            && let Some((latest, _)) = m.latest().map_err(directory_refused)?
            && latest > first
        {
            return Err(Error::flag(
                "checkpoint-dir",
                format!(
                    "{} already holds checkpoints up to step {latest}, which this run (from step {first}) would not continue; resume from it with --resume, or give another directory",
                    m.root().display()
                ),
            ));
        }
        let metrics =
            p.metrics_jsonl.as_ref().map(|path| create_new("metrics-jsonl", path)).transpose()?;
        let export = p
            .export_hf
            .as_ref()
            .map(|(dir, _, _)| ExportDir::open("export-hf", dir))
            .transpose()?;
        let export_lora =
            p.export_lora.as_ref().map(|dir| ExportDir::open("export-lora", dir)).transpose()?;
        Ok(Outputs { manager, metrics, export, export_lora })
    }
}

/// A run's compiled steps, the one-device check beside them and the evaluation.
struct Running<'s> {
    run: Box<dyn Steps + 's>,
    reference: Option<Box<dyn Steps + 's>>,
    eval: Option<Eval<'s>>,
}

impl<'s> Running<'s> {
    /// The run's steps on `strategy`, the check's and the evaluation on `one`, from
    /// the initial weights `init`.
    fn start(
        p: &Plan,
        strategy: &'s Strategy,
        one: &'s Strategy,
        init: &HashMap<String, Tensor>,
    ) -> Result<Running<'s>> {
        let recipe = Recipe::of(p, init);
        let run = start(strategy, p.layout, &recipe)?;
        let eval = if p.eval_every > 0 {
            let (rows, batch) = (p.rows, p.batch);
            let chunks = (0..p.held / batch)
                .map(|c| {
                    let idx: Vec<usize> = (rows + c * batch..rows + (c + 1) * batch).collect();
                    p.examples.batch(&idx, p.dtype)
                })
                .collect::<Result<Vec<_>>>()?;
            Some(Eval::new(one, &p.net, p.dtype, batch, chunks)?)
        } else {
            None
        };
        // The check runs the plain step: no micro-batches, recomputation or split weights.
        let plain = Recipe { savers: Savers::default(), ..recipe };
        let one_device = Layout::Mesh { data: 1, model: 1 };
        let reference = if p.check { Some(start(one, one_device, &plain)?) } else { None };
        Ok(Running { run, reference, eval })
    }

    /// The step a resumed run starts from, its state restored (a trainer's checkpoint
    /// whole; an older one's weights by the model's names, and its step count).
    fn restore(&mut self, p: &Plan) -> Result<usize> {
        let Some(saved) = &p.saved else { return Ok(0) };
        let restored = |e: meshwork_strategy::Error| Error::flag("resume", e);
        if saved.origin == Origin::Trainer {
            let at = self.run.restore(&saved.dir).map_err(restored)?;
            if let Some(r) = self.reference.as_mut() {
                r.restore(&saved.dir).map_err(restored)?;
            }
            return Ok(at);
        }
        // The weights alone (SGD keeps no state), and the step.
        let wanted: Vec<(String, DType, Vec<usize>)> =
            p.net.weight_dims().into_iter().map(|(n, s)| (n, p.dtype, s)).collect();
        let values = read_checkpoint(&saved.dir, &wanted)
            .map_err(|e| Error::flag("resume", format!("{}: {e}", saved.dir.display())))?;
        for ((name, _, _), t) in wanted.iter().zip(values) {
            if let Some(r) = self.reference.as_mut() {
                r.set(name, t.clone())?;
            }
            self.run.set(name, t)?;
        }
        self.run.set_steps(saved.step);
        if let Some(r) = self.reference.as_mut() {
            r.set_steps(saved.step);
        }
        Ok(saved.step)
    }

    /// The steps from `first` to the last, a host call (`steps_per_run` steps, up to
    /// the next evaluation or checkpoint) at a time; `Ok(true)` when stopped on
    /// request.
    fn train(
        &mut self,
        p: &Plan,
        out: &mut Outputs,
        progress: &mut Progress,
        (observer, stop): (&mut dyn Observer, &AtomicBool),
        (first, where_): (usize, &str),
    ) -> Result<bool, Ended> {
        let steps = p.steps;
        let tol = tolerance(p);
        let (per_row, unit) = p.net.per_row();
        let mut rows = Rows::new(p);
        let mut ahead: VecDeque<(f64, Option<f64>)> = VecDeque::new();
        for s in first..steps {
            let lr = learning_rate(p.lr, s, steps, p.warmup, p.cosine);
            if ahead.is_empty() {
                ahead.extend(self.host_call(p, &mut rows, s, &mut progress.busy)?);
            }
            let (loss, want) = ahead
                .pop_front()
                .ok_or_else(|| Error::failed("a host call returned fewer losses than steps"))?;
            progress.losses.push(loss);
            if let Some(want) = want {
                progress.most = progress.most.max((loss - want).abs());
                let rel = (loss - want).abs() / want.abs().max(f64::MIN_POSITIVE);
                progress.most_rel = progress.most_rel.max(rel);
            }
            check_step(s, loss, want, tol, where_)?;
            let rate = ((s + 1 - first) * p.batch) as f64 * per_row as f64
                / progress.busy.as_secs_f64().max(1e-12);
            if let Some(m) = out.manager.as_mut()
                && (s + 1 == steps
                    || (p.checkpoint_every > 0 && (s + 1).is_multiple_of(p.checkpoint_every)))
            {
                self.save(p, m, progress, s + 1)?;
            }
            let evaluated = match &self.eval {
                Some(e) if (s + 1).is_multiple_of(p.eval_every) || s + 1 == steps => {
                    let (l, acc) = e.run(self.run.as_ref())?;
                    progress.evals.push((s - first, l, acc));
                    Some((l, acc))
                }
                _ => None,
            };
            if let Some(f) = out.metrics.as_mut() {
                let mut line = serde_json::json!({"step": s + 1, "loss": loss, "lr": lr});
                line[format!("{unit}_per_s")] = rate.into();
                if let Some((l, acc)) = evaluated {
                    line["eval_loss"] = l.into();
                    line["eval_accuracy"] = acc.into();
                }
                writeln!(f, "{line}")
                    .and_then(|()| f.flush())
                    .map_err(|e| Error::failed(format!("--metrics-jsonl: cannot write: {e}")))?;
            }
            let classifies = p.net.classifies();
            observer.step(&Step {
                step: s + 1,
                steps,
                loss,
                lr,
                rate,
                unit,
                eval: evaluated,
                classifies,
            });
            let mut stopping = stop.load(Ordering::SeqCst);
            if p.processes.is_some() && ahead.is_empty() && (s + 1 < steps || evaluated.is_some()) {
                // Every process stops after the same step; and waits here (as long as an
                // agreement may) while process 0 alone evaluates, also after the last.
                stopping = sync(p, Point::Step, Ok(()), stopping)?.1;
            }
            if stopping && ahead.is_empty() && s + 1 < steps {
                if let Some(m) = out.manager.as_mut()
                    && progress.saved_at != Some(s + 1)
                {
                    self.save(p, m, progress, s + 1)?;
                }
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// One host call from step `s`: its steps run (and the check's), their losses and
    /// the check's beside them.
    fn host_call(
        &mut self,
        p: &Plan,
        rows: &mut Rows,
        s: usize,
        busy: &mut Duration,
    ) -> Result<Vec<(f64, Option<f64>)>> {
        let mut end = s.saturating_add(p.steps_per_run).min(p.steps);
        for every in [p.eval_every, p.checkpoint_every] {
            if let Some(k) = s.checked_div(every) {
                end = end.min((k + 1).saturating_mul(every));
            }
        }
        let feeds = (s..end).map(|k| rows.batch(p, k)).collect::<Result<Vec<_>>>()?;
        let lrs: Vec<f64> =
            (s..end).map(|k| learning_rate(p.lr, k, p.steps, p.warmup, p.cosine)).collect();
        let t = Instant::now();
        let got = self.run.steps(&feeds, &lrs, s)?;
        *busy += t.elapsed();
        let want = match self.reference.as_mut() {
            Some(r) => r.steps(&feeds, &lrs, s)?.into_iter().map(Some).collect(),
            None => vec![None; got.len()],
        };
        Ok(got.into_iter().zip(want).collect())
    }

    /// Saves the losses so far, then step `step` into `manager`: in that order, so
    /// that a kill at any instant leaves a losses file holding at least the saved
    /// step's losses (a resumed run takes the first `step` of them; any beyond are
    /// the killed run's later steps, which it trains again).
    fn save(
        &mut self,
        p: &Plan,
        manager: &mut CheckpointManager,
        progress: &mut Progress,
        step: usize,
    ) -> Result<()> {
        if let Some(path) = p.losses_json.as_ref().filter(|_| p.leads()) {
            write_atomic(path, &losses_json(&p.losses_before, &progress.losses))
                .map_err(|e| Error::failed(format!("--losses-json {}: {e}", path.display())))?;
        }
        self.run.save(manager, &p.meta, step).map_err(save_failed)?;
        progress.saved_at = Some(step);
        Ok(())
    }

    /// The outputs made at the end: `--export-hf`'s folder (a LoRA run's adapter
    /// merged into its base), `--export-lora`'s and `--plot`.
    fn finish(
        &self,
        p: &Plan,
        progress: &Progress,
        where_: &str,
        first: usize,
        (export, export_lora): (Option<&ExportDir>, Option<&ExportDir>),
    ) -> Result<()> {
        let lora = p.net.model().as_lora();
        if p.export_hf.is_some() || p.export_lora.is_some() {
            let mut weights = HashMap::new();
            // Gathered to the process that writes the folder, not to every one (the
            // adapter's matrices alone for --export-lora without --export-hf).
            for (name, _) in p.net.weight_dims() {
                if p.export_hf.is_none() && !p.net.model().trains(&name) {
                    continue;
                }
                if let Some(w) = self.run.weight_first(&name)? {
                    weights.insert(name.clone(), w);
                }
            }
            if let (Some(model), Some(export)) = (lora, export_lora.filter(|_| p.leads())) {
                crate::lora::write(&export.through(), model, &weights, p.dtype)
                    .map_err(|e| Error::failed(export.shown(&e.to_string())))?;
            }
            if let (Some((_, config, generation)), Some(export)) =
                (&p.export_hf, export.filter(|_| p.leads()))
            {
                // A LoRA run's base with the adapter merged in.
                let (model, weights) = match lora {
                    Some(l) => (
                        l.base(),
                        l.merge(&weights).ok_or_else(|| {
                            Error::failed("--export-hf: the adapter does not merge into its base")
                        })?,
                    ),
                    None => (p.net.model(), weights),
                };
                crate::hf::write(
                    "export-hf",
                    &export.through(),
                    (model, config, generation.as_ref()),
                    &weights,
                )
                .map_err(|e| Error::failed(export.shown(&e.to_string())))?;
            }
        }
        if let Some(path) = p.plot.as_ref().filter(|_| p.leads()) {
            let title = format!("meshwork: {} training loss on {where_}", p.net.describe());
            write_new(path, svg(&progress.losses, &progress.evals, first, &title).as_bytes())
                .map_err(|e| Error::failed(format!("--plot {}: {e}", path.display())))?;
        }
        Ok(())
    }

    /// A classifier trained on all its rows: its accuracy on them, every row a batch
    /// at a time (and the rows left over as one more), and how many.
    fn accuracy(&self, p: &Plan, one: &Strategy, data: &Classification) -> Result<(f64, usize)> {
        let (n, batch) = (data.rows(), p.batch);
        let mut right = 0.0;
        for (start, size, count) in [(0, batch, n / batch), (n / batch * batch, n % batch, 1)] {
            if size == 0 || count == 0 {
                continue;
            }
            let chunks = (0..count)
                .map(|c| {
                    let idx: Vec<usize> = (start + c * size..start + (c + 1) * size).collect();
                    p.examples.batch(&idx, p.dtype)
                })
                .collect::<Result<Vec<_>>>()?;
            let part = Eval::new(one, &p.net, p.dtype, size, chunks)?;
            right += part.run(self.run.as_ref())?.1 * (size * count) as f64;
        }
        Ok((right / n.max(1) as f64, n))
    }
}

/// Which rows each step trains on: step `s` takes rows `s·B … s·B+B−1` (mod the rows),
/// or with `--shuffle` those of a per-epoch permutation drawn from the seed.
pub(crate) struct Rows {
    order: (usize, Vec<usize>),
    rows: usize,
    shuffle: Option<u64>,
}

impl Rows {
    /// The order of `rows` training rows (`shuffle`: the seed of `--shuffle`).
    pub(crate) fn order(rows: usize, shuffle: Option<u64>) -> Rows {
        Rows { order: (usize::MAX, Vec::new()), rows, shuffle }
    }

    fn new(p: &Plan) -> Rows {
        Rows::order(p.rows, p.shuffle.then_some(p.seed))
    }

    /// The row the `k`-th example of the run (step `k / B`, slot `k % B`) is.
    pub(crate) fn row(&mut self, k: usize) -> usize {
        let rows = self.rows.max(1);
        match self.shuffle {
            Some(seed) => {
                if self.order.0 != k / rows {
                    self.order = (k / rows, permutation(seed, k / rows, rows));
                }
                self.order.1[k % rows]
            }
            None => k % rows,
        }
    }

    /// Step `s`'s feeds.
    fn batch(&mut self, p: &Plan, s: usize) -> Result<Vec<Tensor>> {
        let idx: Vec<usize> = (0..p.batch).map(|i| self.row(s * p.batch + i)).collect();
        // The rows this process's positions train on must have been read (the others
        // go to other processes' positions, which drop them).
        if let Some(i) = p.slots.iter().flatten().find(|&&i| !p.examples.has(idx[i])) {
            return Err(Error::failed(format!(
                "step {}: row {} (slot {i}) was not read by this process (a bug in choosing its rows)",
                s + 1,
                idx[*i]
            )));
        }
        p.examples.batch(&idx, p.dtype)
    }
}

/// The weights of a run by name, for tests and tools: what [`Trainer::run`] starts
/// from for `config` (its `--init` file or folder, or the weights drawn from its seed).
pub fn initial_weights(config: &Config) -> Result<HashMap<String, Tensor>> {
    let mut p = plan(config)?;
    if let Some(shards) = &p.shards {
        return p
            .net
            .weight_dims()
            .into_iter()
            .map(|(name, shape)| {
                let whole: Vec<std::ops::Range<usize>> = shape.iter().map(|&d| 0..d).collect();
                let t = shards.read(&name, &whole, p.dtype)?;
                Ok((name, t))
            })
            .collect();
    }
    p.take_init()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failed(r: Result<()>) -> String {
        match r {
            Err(Error::Failed(m)) => m,
            other => panic!("expected a failed run, got {other:?}"),
        }
    }

    /// The one-device check fails a run on a loss off one device's by more than the
    /// tolerance, on one device's loss not being finite, and on any loss that is not.
    #[test]
    fn the_check_fails_a_step_off_one_devices_loss() {
        assert!(check_step(3, 2.0, Some(2.0 + 1e-10), 1e-9, "mesh 2x2").is_ok());
        assert!(check_step(3, 2.0, None, 1e-9, "mesh 2x2").is_ok());
        let m = failed(check_step(3, 2.0, Some(2.0 + 1e-8), 1e-9, "mesh 2x2"));
        assert!(m.starts_with("step 4: loss 2 on mesh 2x2, 2.00000001 on one device"), "{m}");
        assert!(failed(check_step(0, 2.0, Some(f64::NAN), 1e-9, "mesh 2x2")).contains("NaN"));
        assert!(
            failed(check_step(5, f64::INFINITY, Some(2.0), 1e-9, "x"))
                .contains("step 6: the loss is inf")
        );
        // Relative: the same absolute gap passes on a large loss.
        assert!(check_step(1, 2e3, Some(2e3 + 1e-8), 1e-9, "x").is_ok());
    }

    /// The schedule: a linear warm-up to the rate, then constant or a cosine to 0 at
    /// the last step, against the formula written out.
    #[test]
    fn the_learning_rate_warms_up_then_decays() {
        assert_eq!(learning_rate(0.1, 0, 10, 4, false), 0.025);
        assert_eq!(learning_rate(0.1, 3, 10, 4, false), 0.1);
        assert_eq!(learning_rate(0.1, 9, 10, 4, false), 0.1);
        assert_eq!(learning_rate(0.1, 4, 10, 4, true), 0.1);
        assert!(learning_rate(0.1, 9, 10, 4, true).abs() < 1e-15);
        let mid = learning_rate(0.1, 7, 11, 4, true);
        assert!((mid - 0.05).abs() < 1e-12, "{mid}");
    }

    /// The losses file holds the earlier steps then this run's, `null` where a loss
    /// was not finite.
    #[test]
    fn the_losses_file_holds_every_step() {
        let text = losses_json(&[Some(1.5), None], &[0.5, f64::NAN]);
        assert_eq!(String::from_utf8(text).unwrap(), "[1.5,null,0.5,null]");
    }
}
