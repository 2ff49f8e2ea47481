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
use crate::plan::{Plan, plan, plan_evaluation, plan_weights};
use crate::processes::Point;
use crate::report::{CheckOutcome, Curves, Report, number_text, svg};
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
/// steps to `lr` (step `s` < `warmup` at `lr · (s + 1) / warmup`), then `schedule`:
/// constant, or a linear or cosine decay as `transformers`' schedulers compute it —
/// from `lr` at step `warmup` to 0 one step past the last, so the last step still
/// learns — or, with `min_lr`, to `min_lr` reached at the last step.
pub fn learning_rate(
    lr: f64,
    s: usize,
    steps: usize,
    warmup: usize,
    schedule: crate::Schedule,
    min_lr: Option<f64>,
) -> f64 {
    if s < warmup {
        return lr * (s + 1) as f64 / warmup as f64;
    }
    let span = steps.saturating_sub(warmup).saturating_sub(usize::from(min_lr.is_some()));
    if schedule == crate::Schedule::Constant || span == 0 {
        return lr;
    }
    let t = ((s - warmup) as f64 / span as f64).min(1.0);
    let left = match schedule {
        crate::Schedule::Linear => 1.0 - t,
        _ => 0.5 * (1.0 + (std::f64::consts::PI * t).cos()),
    };
    let floor = min_lr.unwrap_or(0.0);
    floor + (lr - floor) * left
}

/// The schedule as the run's header line says it: `, linear to 0`, `, cosine to
/// 1e-6, warm-up 10` (empty for a constant rate without warm-up).
fn schedule_text(p: &Plan) -> String {
    let mut text = String::new();
    if p.schedule != crate::Schedule::Constant {
        let end = number_text(p.min_lr.unwrap_or(0.0));
        text.push_str(&format!(", {} to {end}", p.schedule.name()));
    }
    if p.warmup > 0 {
        text.push_str(&format!(", warm-up {}", p.warmup));
    }
    text
}

/// `--plot`'s chart of the losses so far (process 0's to write), when asked for.
fn write_plot(p: &Plan, progress: &Progress, where_: &str, first: usize) -> Result<()> {
    if let Some(path) = p.plot.as_ref().filter(|_| p.leads()) {
        let title = format!("meshwork: {} training loss on {where_}", p.net.describe());
        let evals: Vec<(usize, f64)> = progress.evals.iter().map(|&(s, l, _)| (s, l)).collect();
        let curves = Curves {
            losses: &progress.losses,
            evals: &evals,
            lrs: &progress.lrs[..progress.lrs.len().min(progress.losses.len())],
            first,
            title: &title,
        };
        write_new(path, svg(&curves).as_bytes())
            .map_err(|e| Error::failed(format!("--plot {}: {e}", path.display())))?;
    }
    Ok(())
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
                "step {}: loss {loss} on {layout}, {want} on one device (tolerance {tol:e} relative); --no-check skips this comparison",
                s + 1,
            )))
        }
        _ => Ok(()),
    }
}

/// A step's loss and, when checked, the one-device check's.
type Checked = (f64, Option<f64>);

/// How far the one-device check's state (weights and optimizer slots) is from the
/// run's after a host call: the largest relative difference and where.
#[derive(Debug, Clone)]
struct StateDifference {
    relative: f64,
    name: String,
}

/// `‖a − b‖ / ‖b‖` (Euclidean, over the elements finite in both, scaled by the
/// largest so that nothing overflows; `‖a‖` against 0 when `b` is all zeros);
/// infinite where an element is finite in one and not the other, or the shapes
/// differ. (Elements not finite in both are the loss's to report.)
fn relative_difference(a: &Tensor, b: &Tensor) -> f64 {
    if a.shape() != b.shape() {
        return f64::INFINITY;
    }
    let (a, b) = (a.to_f64(), b.to_f64());
    let mut scale = 0.0f64;
    for (x, y) in a.iter().zip(&b) {
        if x.is_finite() != y.is_finite() {
            return f64::INFINITY;
        }
        if x.is_finite() {
            scale = scale.max(x.abs()).max(y.abs());
        }
    }
    if scale == 0.0 {
        return 0.0;
    }
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (x, y) in a.iter().zip(&b).filter(|(x, _)| x.is_finite()) {
        let (x, y) = (x / scale, y / scale);
        diff += (x - y) * (x - y);
        norm += y * y;
    }
    if norm == 0.0 {
        return diff.sqrt() * scale;
    }
    (diff / norm).sqrt()
}

/// The state after step `s` against the one-device check's ([`StateDifference`]):
/// further than `tol` fails the run, naming the tensor.
fn check_state(s: usize, diff: &StateDifference, tol: f64, layout: &str) -> Result<()> {
    if diff.relative <= tol {
        return Ok(());
    }
    Err(Error::failed(format!(
        "after step {}: {} on {layout} is {:.1e} (relative) from one device's (tolerance {tol:e}); --no-check skips this comparison",
        s + 1,
        diff.name,
        diff.relative,
    )))
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
                "training {} on {} rows ({}, {}, lr {}{}{}) on {where_}, batch {}, {} steps",
                p.net.describe(),
                p.rows,
                p.dtype,
                optimizer_text(p.optimizer),
                number_text(p.lr),
                schedule_text(&p),
                if p.fine_tune { "; fine-tuning defaults, as transformers' Trainer" } else { "" },
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
        // A failed run's plot too (its steps so far), unless writing it fails as well.
        if outcome.is_err() && !progress.losses.is_empty() {
            let _ = write_plot(&p, &progress, &where_, first);
        }
        let stopped = outcome?;
        run.finish(&p, &progress, &where_, first, (out.export.as_ref(), out.export_lora.as_ref()))?;
        let accuracy = match (&p.classification, run.eval.is_empty()) {
            (Some(data), true) if !stopped => Some(run.accuracy(&p, &one, data)?),
            _ => None,
        };
        let check = if p.check {
            let tolerance = tolerance(&p);
            CheckOutcome::Checked {
                most: progress.most,
                relative: progress.most_rel,
                tolerance,
                state: progress.most_state,
                state_tolerance: state_tolerance(&p),
            }
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
        report.eval_rows = run.eval.iter().map(Eval::rows).sum();
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

/// The check's tolerance for the state after a host call (relative, norm-wise, the
/// largest over the tensors). Adam divides each gradient by its own scale, so an
/// element whose gradient is rounding noise takes a whole step either way: the state
/// differs more than the loss. Measured (GPT-2's oracle, Adam at 0.01 through a loss
/// spike, 2x1, 100 steps): 1.8e-13 in f64, 1.7e-4 in f32, 2.2e-2 with bf16 products;
/// the Llama family's f64 runs 6e-15 on the interpreter (their float32 parts round
/// differently on XLA: allowed 1e-4). A forgotten reduction moves it by order 1.
fn state_tolerance(p: &Plan) -> f64 {
    match (p.precision, p.dtype) {
        (Some(_), _) => 0.25,
        (None, DType::F64) if p.net.model().float32_parts() => 1e-4,
        (None, DType::F64) => 1e-9,
        (None, _) => 1e-2,
    }
}

/// What every process of a spread run must have planned alike, as a number: the
/// run's record (model, rows, optimizer, schedule), its layout, savers, precision,
/// steps and host calls, evaluation and checkpoint cadence, back end, where it starts,
/// and the sizes of the files it reads (each process's copy must be the same file).
fn plan_digest(config: &Config, p: &Plan) -> u64 {
    let size = |path: Option<&Path>| path.and_then(|f| std::fs::metadata(f).ok()).map(|m| m.len());
    let data = match &config.data {
        crate::Data::Tokens(f) | crate::Data::Text(f) | crate::Data::Jsonl { path: f, .. } => {
            [size(Some(f)), None]
        }
        crate::Data::Npy { x, y } => [size(Some(x)), size(Some(y))],
        crate::Data::Documents { paths, .. } => {
            [paths.iter().map(|p| size(Some(p))).sum::<Option<u64>>(), None]
        }
        crate::Data::BuiltIn => [None, None],
    };
    // The recorded flags hold each process's own paths (and process 0's hashes).
    let mut meta = p.meta.clone();
    if let Some(m) = meta.as_object_mut() {
        m.remove("flags");
    }
    let text = format!(
        "{} {} {:?} {:?} {:?} {:?} {:?} {} {} {} {} {:?} {:?} {:?} {}",
        meta,
        p.steps,
        p.saved.as_ref().map(|s| s.step),
        p.layout,
        p.savers,
        p.precision,
        // The dtype the frozen base is held in: the step's parameters' dtypes.
        p.net.base_dtype(),
        p.steps_per_run,
        p.eval_every,
        p.checkpoint_every,
        p.dtype,
        p.backend.backend.as_ref().map(|b| b.describe()),
        data,
        size(config.init.as_deref().filter(|i| i.is_file())),
        // Whether the step returns its gradients' norm (a result of its own).
        p.metrics_jsonl.is_some(),
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
    /// The learning rate of each step taken.
    lrs: Vec<f64>,
    evals: Vec<(usize, f64, f64)>,
    busy: Duration,
    saved_at: Option<usize>,
    /// The one-device check's largest absolute and relative differences.
    most: f64,
    most_rel: f64,
    /// The largest relative difference of the state after a host call.
    most_state: f64,
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
        let export =
            p.export_hf.as_ref().map(|dir| ExportDir::open("export-hf", dir)).transpose()?;
        let export_lora =
            p.export_lora.as_ref().map(|dir| ExportDir::open("export-lora", dir)).transpose()?;
        Ok(Outputs { manager, metrics, export, export_lora })
    }
}

/// A run's compiled steps, the one-device check beside them and the evaluation.
struct Running<'s> {
    run: Box<dyn Steps + 's>,
    /// The one-device check's steps, and the state it takes from the run before each
    /// host call (every weight and optimizer slot but the frozen weights).
    reference: Option<(Box<dyn Steps + 's>, Vec<String>)>,
    /// The evaluation over the held-out rows: `--batch` rows at a time, and the
    /// rows left over as one more batch.
    eval: Vec<Eval<'s>>,
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
        let eval = match p.eval_every > 0 {
            true => evals_of_rows(p, one, p.rows, p.held)?,
            false => Vec::new(),
        };
        // The check runs the plain step: no micro-batches, recomputation or split weights.
        let plain = Recipe { savers: Savers::default(), grad_norm: false, ..recipe };
        let one_device = Layout::Mesh { data: 1, model: 1 };
        let reference = match p.check {
            true => {
                let steps = start(one, one_device, &plain)?;
                let model = p.net.model();
                let shared = steps
                    .held()?
                    .into_iter()
                    .map(|(name, _)| name)
                    .filter(|n| model.trains(n) || !p.net.weight_dims().iter().any(|(w, _)| w == n))
                    .collect();
                Some((steps, shared))
            }
            false => None,
        };
        Ok(Running { run, reference, eval })
    }

    /// The step a resumed run starts from, its state restored (a trainer's checkpoint
    /// whole; an older one's weights by the model's names, and its step count).
    fn restore(&mut self, p: &Plan) -> Result<usize> {
        let Some(saved) = &p.saved else { return Ok(0) };
        let restored = |e: meshwork_strategy::Error| Error::flag("resume", e);
        if saved.origin == Origin::Trainer {
            let at = self.run.restore(&saved.dir).map_err(restored)?;
            if let Some((r, _)) = self.reference.as_mut() {
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
            if let Some((r, _)) = self.reference.as_mut() {
                r.set(name, t.clone())?;
            }
            self.run.set(name, t)?;
        }
        self.run.set_steps(saved.step);
        if let Some((r, _)) = self.reference.as_mut() {
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
        let mut ahead: VecDeque<Checked> = VecDeque::new();
        let mut norms: VecDeque<Option<f64>> = VecDeque::new();
        // The check of the state a host call left: (its last step, the difference).
        let mut state_at: Option<(usize, StateDifference)> = None;
        for s in first..steps {
            let lr = learning_rate(p.lr, s, steps, p.warmup, p.schedule, p.min_lr);
            if ahead.is_empty() {
                let (losses, state) = self.host_call(p, &mut rows, s, &mut progress.busy)?;
                ahead.extend(losses);
                norms = self.run.grad_norms().into();
                state_at = state.map(|d| (s + ahead.len().max(1) - 1, d));
            }
            let (loss, want) = ahead
                .pop_front()
                .ok_or_else(|| Error::failed("a host call returned fewer losses than steps"))?;
            let grad_norm = norms.pop_front().flatten();
            progress.losses.push(loss);
            progress.lrs.push(lr);
            if let Some(want) = want {
                progress.most = progress.most.max((loss - want).abs());
                let rel = (loss - want).abs() / want.abs().max(f64::MIN_POSITIVE);
                progress.most_rel = progress.most_rel.max(rel);
            }
            let checked = check_step(s, loss, want, tol, where_).and_then(|()| {
                match state_at.take_if(|(at, _)| *at == s) {
                    Some((_, diff)) => {
                        progress.most_state = progress.most_state.max(diff.relative);
                        check_state(s, &diff, state_tolerance(p), where_)
                    }
                    None => Ok(()),
                }
            });
            if let Err(e) = checked {
                // The failing step's line too, saying why (the run's error says it
                // again; a metrics file that cannot be written adds nothing to it).
                if let Some(f) = out.metrics.as_mut() {
                    let line = serde_json::json!({
                        "step": s + 1, "loss": loss, "lr": lr, "failed": e.to_string(),
                    });
                    let _ = writeln!(f, "{line}").and_then(|()| f.flush());
                }
                return Err(e.into());
            }
            let rate = ((s + 1 - first) * p.batch) as f64 * per_row as f64
                / progress.busy.as_secs_f64().max(1e-12);
            if let Some(m) = out.manager.as_mut()
                && (s + 1 == steps
                    || (p.checkpoint_every > 0 && (s + 1).is_multiple_of(p.checkpoint_every)))
            {
                self.save(p, m, progress, s + 1)?;
            }
            let evaluated = match self.eval.is_empty() {
                false if (s + 1).is_multiple_of(p.eval_every) || s + 1 == steps => {
                    let (l, acc) = self.evaluate()?;
                    progress.evals.push((s - first, l, acc));
                    Some((l, acc))
                }
                _ => None,
            };
            if let Some(f) = out.metrics.as_mut() {
                let mut line = serde_json::json!({"step": s + 1, "loss": loss, "lr": lr});
                if let Some(n) = grad_norm {
                    line["grad_norm"] = n.into();
                }
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

    /// One host call from step `s`: its steps run (and the check's, from the run's
    /// state), their losses and the check's beside them, and how far the check's
    /// state after them is from the run's.
    fn host_call(
        &mut self,
        p: &Plan,
        rows: &mut Rows,
        s: usize,
        busy: &mut Duration,
    ) -> Result<(Vec<Checked>, Option<StateDifference>)> {
        let mut end = s.saturating_add(p.steps_per_run).min(p.steps);
        for every in [p.eval_every, p.checkpoint_every] {
            if let Some(k) = s.checked_div(every) {
                end = end.min((k + 1).saturating_mul(every));
            }
        }
        let feeds = (s..end).map(|k| rows.batch(p, k)).collect::<Result<Vec<_>>>()?;
        let lrs: Vec<f64> = (s..end)
            .map(|k| learning_rate(p.lr, k, p.steps, p.warmup, p.schedule, p.min_lr))
            .collect();
        // The check starts from the run's state, so that it compares these steps'
        // arithmetic alone, not rounding amplified over the steps before (a loss
        // spike makes trajectories drift apart however exact each step is).
        // (Read a tensor at a time: no second copy of the state is held.)
        if let Some((r, shared)) = self.reference.as_mut() {
            for name in shared.iter() {
                r.set(name, self.run.weight(name)?)?;
            }
        }
        let t = Instant::now();
        let got = self.run.steps(&feeds, &lrs, s)?;
        *busy += t.elapsed();
        let Some((r, shared)) = self.reference.as_mut() else {
            return Ok((got.into_iter().map(|l| (l, None)).collect(), None));
        };
        let want = r.steps(&feeds, &lrs, s)?;
        // What the steps made of the state (a wrong gradient shows here before any
        // loss does), compared norm-wise tensor by tensor.
        let mut worst = StateDifference { relative: 0.0, name: String::new() };
        for name in shared.iter() {
            let relative = relative_difference(&self.run.weight(name)?, &r.weight(name)?);
            if relative > worst.relative || relative.is_nan() {
                worst = StateDifference { relative, name: name.clone() };
            }
        }
        Ok((got.into_iter().zip(want.into_iter().map(Some)).collect(), Some(worst)))
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
        if p.export_hf.is_some() || p.export_lora.is_some() {
            // Gathered to the process that writes the folders, not to every one (the
            // adapter's matrices alone for --export-lora without --export-hf).
            let weights = self.gathered(p, p.export_hf.is_some())?;
            if let (Some(model), Some(export)) =
                (p.net.model().as_lora(), export_lora.filter(|_| p.leads()))
            {
                crate::lora::write(&export.through(), model, &weights, p.dtype)
                    .map_err(|e| Error::failed(export.shown(&e.to_string())))?;
            }
            if let Some(export) = export.filter(|_| p.leads()) {
                let Some((config, generation)) = &p.hf else {
                    return Err(Error::failed("--export-hf: the model has no Hugging Face config"));
                };
                let (model, weights) = merged(p, weights)?;
                let written = crate::hf::write(
                    "export-hf",
                    &export.through(),
                    (model, config, generation.as_ref()),
                    &weights,
                )
                .and_then(|()| {
                    crate::hf::write_files("export-hf", &export.through(), &p.tokenizer_files)
                });
                written.map_err(|e| Error::failed(export.shown(&e.to_string())))?;
            }
        }
        write_plot(p, progress, where_, first)
    }

    /// The mean (loss, accuracy) over the held-out rows, each row weighted alike.
    fn evaluate(&self) -> Result<(f64, f64)> {
        self.mean_of(&self.eval)
    }

    /// The mean (loss, accuracy) of `evals` with the run's current weights, each row
    /// weighted alike.
    fn mean_of(&self, evals: &[Eval<'_>]) -> Result<(f64, f64)> {
        let (mut loss, mut right, mut rows) = (0.0, 0.0, 0usize);
        for e in evals {
            let (l, a) = e.run(self.run.as_ref())?;
            loss += l * e.rows() as f64;
            right += a * e.rows() as f64;
            rows += e.rows();
        }
        let rows = rows.max(1) as f64;
        Ok((loss / rows, right / rows))
    }

    /// The run's weights by name in its dtype, gathered to the process that writes the
    /// exports (the others get none): all of them, or a LoRA run's adapter alone. (A
    /// base held in `--base-dtype` bf16 converts up exactly.)
    fn gathered(&self, p: &Plan, all: bool) -> Result<HashMap<String, Tensor>> {
        let mut weights = HashMap::new();
        for (name, _) in p.net.weight_dims() {
            if !all && !p.net.model().trains(&name) {
                continue;
            }
            if let Some(w) = self.run.weight_first(&name)? {
                let w = if w.dtype() == p.dtype { w } else { crate::init::cast(&w, p.dtype)? };
                weights.insert(name.clone(), w);
            }
        }
        Ok(weights)
    }

    /// A classifier trained on all its rows: its accuracy on them, every row a batch
    /// at a time (and the rows left over as one more), and how many.
    fn accuracy(&self, p: &Plan, one: &Strategy, data: &Classification) -> Result<(f64, usize)> {
        let n = data.rows();
        Ok((self.mean_over_rows(p, one, n)?.1, n))
    }

    /// The mean (loss, accuracy) over rows `0..n` of the plan's examples, `--batch`
    /// rows at a time and the rows left over as one more batch, each row weighted
    /// alike, with the run's current weights on `one`.
    fn mean_over_rows(&self, p: &Plan, one: &Strategy, n: usize) -> Result<(f64, f64)> {
        self.mean_of(&evals_of_rows(p, one, 0, n)?)
    }

    /// The run `p` plans, compiled on `strategy` and given its initial weights or
    /// its resumed checkpoint's (nothing trained; the checkpoint released).
    fn restored(p: &mut Plan, strategy: &'s Strategy, one: &'s Strategy) -> Result<Running<'s>> {
        let init = p.take_init()?;
        let mut run = Running::start(p, strategy, one, &init)?;
        drop(init);
        run.restore(p)?;
        if let Some(saved) = &p.saved {
            saved.release();
        }
        Ok(run)
    }
}

/// Evaluations of rows `start..start + n` of the plan's examples on `one`: `--batch`
/// rows at a time, and the rows left over as one more batch.
fn evals_of_rows<'s>(p: &Plan, one: &'s Strategy, start: usize, n: usize) -> Result<Vec<Eval<'s>>> {
    let batch = p.batch;
    let mut evals = Vec::new();
    for (first, size, count) in
        [(start, batch, n / batch), (start + n / batch * batch, n % batch, 1)]
    {
        if size == 0 || count == 0 {
            continue;
        }
        let chunks = (0..count)
            .map(|c| {
                let idx: Vec<usize> = (first + c * size..first + (c + 1) * size).collect();
                p.net.with_keys(p.examples.batch(&idx, p.dtype)?, p.seed, None)
            })
            .collect::<Result<Vec<_>>>()?;
        evals.push(Eval::new(one, &p.net, p.dtype, size, chunks)?);
    }
    Ok(evals)
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
        p.net.with_keys(p.examples.batch(&idx, p.dtype)?, p.seed, Some(s))
    }
}

/// The model `--export-hf` writes and its weights: a LoRA run's base with the
/// adapter merged in, else the run's own.
fn merged(
    p: &Plan,
    weights: HashMap<String, Tensor>,
) -> Result<(&dyn meshwork_nn::Model, HashMap<String, Tensor>)> {
    match p.net.model().as_lora() {
        Some(l) => Ok((
            l.base(),
            l.merge(&weights).ok_or_else(|| {
                Error::failed("--export-hf: the adapter does not merge into its base")
            })?,
        )),
        None => Ok((p.net.model(), weights)),
    }
}

/// Whether `dir` is a meshwork checkpoint (a checkpoint directory or one step of
/// it) rather than a Hugging Face folder (which has a `config.json`).
pub(crate) fn is_checkpoint(dir: &Path) -> bool {
    dir.is_dir()
        && !dir.join("config.json").exists()
        && meshwork_checkpoint::find_checkpoint(dir).is_ok()
}

/// `config` with a meshwork checkpoint given as `--init` taken as `--resume`.
fn checkpoint_as_resume(config: &Config) -> Config {
    let mut config = config.clone();
    if config.resume.is_none() && config.init.as_deref().is_some_and(is_checkpoint) {
        config.resume = config.init.take();
    }
    config
}

/// A language model's checkpoint as `--export-hf` would write it: its Hugging Face
/// `config.json` and `generation_config.json`, and its weights by name (a LoRA run's
/// adapter merged into its base) in the checkpoint's dtype.
pub(crate) struct HfCheckpoint {
    pub(crate) config: serde_json::Value,
    pub(crate) generation: Option<serde_json::Value>,
    pub(crate) weights: HashMap<String, Tensor>,
}

/// The language model of the checkpoint `dir` (its latest step, or the step it is),
/// restored on one device of the interpreter; its data are not read. A checkpoint
/// of a model without a Hugging Face layout is refused as `--flag`'s.
pub(crate) fn checkpoint_model(flag: &str, dir: &Path, max_memory: u64) -> Result<HfCheckpoint> {
    let config = Config {
        resume: Some(dir.to_path_buf()),
        mesh: Some((1, 1)),
        check: crate::Check::Never,
        max_memory,
        ..Config::new(crate::ModelKind::Auto)
    };
    let mut p = plan_weights(&config)?;
    let Some((hf, generation)) = p.hf.clone() else {
        return Err(Error::flag(
            flag,
            format!(
                "{}: the checkpoint's {} has no Hugging Face layout (GPT-2, the Llama family)",
                dir.display(),
                p.net.model().family()
            ),
        ));
    };
    let strategy = p.strategy()?;
    let one = Strategy::data_parallel(1).map_err(Error::failed)?;
    let run = Running::restored(&mut p, &strategy, &one)?;
    let weights = run.gathered(&p, true)?;
    let (_, weights) = merged(&p, weights)?;
    Ok(HfCheckpoint { config: hf, generation, weights })
}

/// What [`evaluate`] measured: the mean loss over every row of the data (the mean
/// next-token cross-entropy of a language model, each row's positions alike), its
/// perplexity `e^loss`, the rows, and the tokens (or examples) it predicted.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Evaluation {
    /// The mean loss.
    pub loss: f64,
    /// `e^loss`.
    pub perplexity: f64,
    /// The rows evaluated: every full row of the data.
    pub rows: usize,
    /// The tokens predicted (rows × `--seq`), or the examples for a classifier.
    pub tokens: usize,
}

/// Evaluates the weights `config` names — `--init` (a file or Hugging Face folder), or
/// a checkpoint (`--resume`, or as `--init`; its data and sizes remembered unless
/// given) — on every
/// row of its data, `--batch` rows at a time and the rows left over as one more batch,
/// on its mesh and back end; nothing is trained, and nothing written but the token
/// cache (its outputs, held-out rows and one-device check are left out).
pub fn evaluate(config: &Config) -> Result<Evaluation> {
    // A checkpoint given as --init is resumed from.
    let config = checkpoint_as_resume(config);
    if config.processes.as_ref().is_some_and(|p| p.count() > 1) {
        return Err(Error::usage("evaluate runs in one process; start it alone"));
    }
    let quiet = Config {
        steps: Some(config.steps.unwrap_or(1)),
        check: crate::Check::Never,
        eval_every: None,
        eval_fraction: None,
        eval_data: None,
        losses_json: None,
        metrics_jsonl: None,
        plot: None,
        export_hf: None,
        export_lora: None,
        ..config
    };
    let mut p = plan_evaluation(&quiet)?;
    let strategy = p.strategy()?;
    let one = Strategy::data_parallel(1).map_err(Error::failed)?;
    let run = Running::restored(&mut p, &strategy, &one)?;
    let n = p.rows;
    if n == 0 {
        return Err(Error::usage("the data hold no full row to evaluate"));
    }
    let loss = run.mean_over_rows(&p, &one, n)?.0;
    let per_row = p.net.per_row().0;
    Ok(Evaluation { loss, perplexity: loss.exp(), rows: n, tokens: n * per_row })
}

/// Writes the weights of a checkpoint (`config.resume`, or a checkpoint given as
/// `--init`) as `--export-hf`'s Hugging Face folder and, for a LoRA run's, as
/// `--export-lora`'s `peft` folder — what the run would have written had it ended at
/// that step (its model and data remembered by the checkpoint, a LoRA run's base
/// too); each folder new or empty, checked before anything is read. Nothing is
/// trained.
pub fn export(config: &Config) -> Result<()> {
    let config = checkpoint_as_resume(config);
    if config.resume.is_none() {
        return Err(Error::usage("export writes a checkpoint's weights: give the checkpoint"));
    }
    if config.export_hf.is_none() && config.export_lora.is_none() {
        return Err(Error::usage("export: give --hf DIR or --lora DIR"));
    }
    let quiet = Config {
        check: crate::Check::Never,
        eval_every: None,
        eval_fraction: None,
        eval_data: None,
        checkpoint_dir: None,
        losses_json: None,
        metrics_jsonl: None,
        plot: None,
        ..config
    };
    let mut p = plan_weights(&quiet)?;
    let first = p.saved.as_ref().map_or(0, |s| s.step);
    let strategy = p.strategy()?;
    let one = Strategy::data_parallel(1).map_err(Error::failed)?;
    let run = Running::restored(&mut p, &strategy, &one)?;
    let export = p.export_hf.as_ref().map(|dir| ExportDir::open("export-hf", dir)).transpose()?;
    let export_lora =
        p.export_lora.as_ref().map(|dir| ExportDir::open("export-lora", dir)).transpose()?;
    run.finish(&p, &Progress::default(), "", first, (export.as_ref(), export_lora.as_ref()))
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
    use proptest::prelude::*;

    fn t(values: &[f64]) -> Tensor {
        Tensor::from_f64(DType::F64, &[values.len()], values).unwrap()
    }

    proptest! {
        /// The state's difference is `‖a − b‖ / ‖b‖` written out (for values that do
        /// not overflow), 0 for equal tensors, and the same for the tensors scaled by
        /// 1e300 (no overflow to a NaN or infinity).
        #[test]
        fn the_state_difference_is_the_relative_norm(
            pairs in proptest::collection::vec((-1e3f64..1e3, -1e3f64..1e3), 1..40),
        ) {
            let (a, b): (Vec<f64>, Vec<f64>) = pairs.into_iter().unzip();
            let diff: f64 = a.iter().zip(&b).map(|(x, y)| (x - y) * (x - y)).sum::<f64>().sqrt();
            let norm: f64 = b.iter().map(|y| y * y).sum::<f64>().sqrt();
            let want = if norm == 0.0 { diff } else { diff / norm };
            let got = relative_difference(&t(&a), &t(&b));
            prop_assert!((got - want).abs() <= 1e-12 * want.max(1.0), "{got} {want}");
            prop_assert_eq!(relative_difference(&t(&a), &t(&a)), 0.0);
            let big = |v: &[f64]| v.iter().map(|x| x * 1e300).collect::<Vec<_>>();
            let scaled = relative_difference(&t(&big(&a)), &t(&big(&b)));
            prop_assert!((scaled - want).abs() <= 1e-9 * want.max(1.0), "{scaled} {want}");
        }
    }

    /// A value finite in one state and not the other is an infinite difference; one
    /// not finite in both is left to the loss; other shapes differ infinitely.
    #[test]
    fn non_finite_states_and_other_shapes() {
        assert_eq!(relative_difference(&t(&[1.0, f64::NAN]), &t(&[1.0, 2.0])), f64::INFINITY);
        assert_eq!(relative_difference(&t(&[1.0, f64::NAN]), &t(&[1.0, f64::NAN])), 0.0);
        assert_eq!(relative_difference(&t(&[1.0]), &t(&[1.0, 2.0])), f64::INFINITY);
        // Against zeros, the norm itself (rounding noise stays tiny).
        assert_eq!(relative_difference(&t(&[3e-300, 4e-300]), &t(&[0.0, 0.0])), 5e-300);
        assert_eq!(relative_difference(&t(&[0.0, 0.0]), &t(&[0.0, 0.0])), 0.0);
        let m = failed(check_state(
            2,
            &StateDifference { relative: 0.5, name: "w".into() },
            1e-9,
            "mesh 2x1",
        ));
        assert!(m.starts_with("after step 3: w on mesh 2x1 is 5.0e-1 (relative)"), "{m}");
        assert!(
            check_state(2, &StateDifference { relative: 1e-10, name: "w".into() }, 1e-9, "x")
                .is_ok()
        );
    }

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

    /// The schedule: a linear warm-up to the rate, then constant, or a decay that
    /// equals `transformers`' schedulers after the warm-up (their rates, printed by
    /// `get_linear_schedule_with_warmup` and `get_cosine_schedule_with_warmup` over
    /// an SGD at 0.1, 2026-11-28), or one that reaches `--min-lr` at the last step.
    #[test]
    fn the_learning_rate_warms_up_then_decays() {
        use crate::Schedule::{Constant, Cosine, Linear};
        assert_eq!(learning_rate(0.1, 0, 10, 4, Constant, None), 0.025);
        assert_eq!(learning_rate(0.1, 3, 10, 4, Constant, None), 0.1);
        assert_eq!(learning_rate(0.1, 9, 10, 4, Constant, None), 0.1);
        let hf = [
            (Linear, 0, 10, &[0.1, 0.09, 0.08, 0.07, 0.06, 0.05, 0.04, 0.03, 0.02, 0.01][..]),
            (Linear, 3, 11, &[0.1, 0.0875, 0.075, 0.0625, 0.05, 0.0375, 0.025, 0.0125][..]),
            (
                Cosine,
                0,
                10,
                &[
                    0.1,
                    0.09755282581475769,
                    0.09045084971874738,
                    0.07938926261462366,
                    0.06545084971874737,
                    0.05,
                    0.03454915028125263,
                    0.02061073738537635,
                    0.009549150281252633,
                    0.0024471741852423235,
                ][..],
            ),
            (
                Cosine,
                3,
                11,
                &[
                    0.1,
                    0.09619397662556434,
                    0.08535533905932738,
                    0.0691341716182545,
                    0.05,
                    0.030865828381745515,
                    0.014644660940672627,
                    0.0038060233744356634,
                ][..],
            ),
        ];
        for (schedule, warmup, steps, theirs) in hf {
            for (k, want) in theirs.iter().enumerate() {
                let got = learning_rate(0.1, warmup + k, steps, warmup, schedule, None);
                assert!(
                    (got - want).abs() < 1e-15,
                    "{schedule:?} step {}: {got} {want}",
                    warmup + k
                );
            }
        }
        // With --min-lr the decay ends there at the last step, from the rate at the first.
        for schedule in [Linear, Cosine] {
            assert_eq!(learning_rate(0.1, 4, 10, 4, schedule, Some(0.01)), 0.1);
            let last = learning_rate(0.1, 9, 10, 4, schedule, Some(0.01));
            assert!((last - 0.01).abs() < 1e-15, "{last}");
            let zero = learning_rate(0.1, 9, 10, 4, schedule, Some(0.0));
            assert!(zero.abs() < 1e-15, "{zero}");
        }
        let mid = learning_rate(0.1, 7, 11, 4, Linear, Some(0.02));
        assert!((mid - 0.06).abs() < 1e-15, "{mid}");
        // A decay of one step keeps the rate.
        assert_eq!(learning_rate(0.1, 0, 1, 0, Linear, Some(0.0)), 0.1);
    }

    /// The losses file holds the earlier steps then this run's, `null` where a loss
    /// was not finite.
    #[test]
    fn the_losses_file_holds_every_step() {
        let text = losses_json(&[Some(1.5), None], &[0.5, f64::NAN]);
        assert_eq!(String::from_utf8(text).unwrap(), "[1.5,null,0.5,null]");
    }
}
