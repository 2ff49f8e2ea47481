//! The training loop: a checked [`Plan`] run on a strategy, step by step (a host call
//! of `steps_per_run` steps at a time), with the one-device check beside it,
//! evaluations, checkpoints, the losses, metrics and plot sinks, and a stop flag.

use std::collections::{HashMap, VecDeque};
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use meshwork_checkpoint::{CheckpointManager, read_checkpoint};
use meshwork_nn::Optimizer;
use meshwork_strategy::Strategy;
use meshwork_types::{DType, Tensor};

use crate::config::Config;
use crate::files::{create_new, write_atomic, write_new};
use crate::model::{Layout, Net, Savers};
use crate::observe::{Observer, Start, Step};
use crate::plan::{Plan, plan};
use crate::report::{CheckOutcome, Report, number_text, svg};
use crate::resume::Origin;
use crate::rng::permutation;
use crate::steps::{Eval, Recipe, start};
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
    pub fn new(config: &Config) -> Result<Trainer> {
        Ok(Trainer { plan: plan(config)? })
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
    pub fn run(self, observer: &mut dyn Observer, stop: &AtomicBool) -> Result<Report> {
        let mut p = self.plan;
        // A checkpoint at or past the last step: nothing to run, nothing written.
        if let Some(saved) = p.saved.as_ref().filter(|s| s.step >= p.steps) {
            return Ok(Report {
                model: p.net.describe(),
                layout: p.layout.describe(),
                dtype: p.dtype,
                first_step: saved.step,
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
            });
        }
        let one_device = Layout::Mesh { data: 1, model: 1 };
        let devices = p.layout.devices();
        let where_ = match &p.xla {
            Some(xla) => {
                format!("{} on XLA ({})", p.layout.describe(), xla.session().client().platform())
            }
            None => p.layout.describe(),
        };
        let init = p.take_init()?;
        let strategy = p.strategy()?;
        let recipe = Recipe {
            net: &p.net,
            batch: p.batch,
            dtype: p.dtype,
            optimizer: p.optimizer,
            clip: p.clip,
            init: &init,
            savers: p.savers,
            precision: p.precision,
            loss_scale: p.loss_scale,
            blocking: p.blocking,
            shards: p.shards.as_ref(),
        };
        let mut run = start(&strategy, p.layout, &recipe)?;
        let one = Strategy::data_parallel(1).map_err(Error::failed)?;
        let eval = if p.eval_every > 0 {
            let (rows, batch) = (p.rows, p.batch);
            let chunks = (0..p.held / batch)
                .map(|c| {
                    let idx: Vec<usize> = (rows + c * batch..rows + (c + 1) * batch).collect();
                    p.examples.batch(&idx, p.dtype)
                })
                .collect::<Result<Vec<_>>>()?;
            Some(Eval::new(&one, &p.net, p.dtype, batch, chunks)?)
        } else {
            None
        };
        // The check runs the plain step: no micro-batches, recomputation or split weights.
        let plain = Recipe { savers: Savers::default(), ..recipe };
        let mut reference = if p.check { Some(start(&one, one_device, &plain)?) } else { None };
        drop(init);
        let first = match &p.saved {
            None => 0,
            Some(saved) => {
                let restored = |e: meshwork_strategy::Error| Error::flag("resume", e);
                match saved.origin {
                    Origin::Trainer => {
                        let at = run.restore(&saved.dir).map_err(restored)?;
                        if let Some(r) = reference.as_mut() {
                            r.restore(&saved.dir).map_err(restored)?;
                        }
                        at
                    }
                    Origin::MainJob | Origin::Bare => {
                        // The MLP's weights alone (SGD keeps no state), and the step.
                        let names = ["w1", "b1", "w2", "b2"];
                        let Net::Mlp(m) = p.net else {
                            return Err(Error::flag(
                                "resume",
                                "an MLP's checkpoint for another model",
                            ));
                        };
                        let (f, h, c) = (m.features, m.hidden, m.classes);
                        let shapes = [vec![f, h], vec![h], vec![h, c], vec![c]];
                        let wanted: Vec<(String, DType, Vec<usize>)> = names
                            .iter()
                            .zip(shapes)
                            .map(|(n, s)| (n.to_string(), p.dtype, s))
                            .collect();
                        let values = read_checkpoint(&saved.dir, &wanted).map_err(|e| {
                            Error::flag("resume", format!("{}: {e}", saved.dir.display()))
                        })?;
                        for (name, t) in names.iter().zip(values) {
                            if let Some(r) = reference.as_mut() {
                                r.set(name, t.clone())?;
                            }
                            run.set(name, t)?;
                        }
                        run.set_steps(saved.step);
                        if let Some(r) = reference.as_mut() {
                            r.set_steps(saved.step);
                        }
                        saved.step
                    }
                }
            }
        };
        // Every check passed: now the outputs are made.
        let mut manager = p
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
        let mut metrics =
            p.metrics_jsonl.as_ref().map(|path| create_new("metrics-jsonl", path)).transpose()?;
        let steps = p.steps;
        observer.start(&Start {
            headline: format!(
                "training {} on {} rows ({}, {}, lr {}) on {where_}, batch {}, {steps} steps",
                p.net.describe(),
                p.rows,
                p.dtype,
                optimizer_text(p.optimizer),
                number_text(p.lr),
                p.batch
            ),
            first,
            steps,
            warnings: p.warnings.clone(),
        });
        let tol = match (p.precision, p.dtype) {
            (Some(_), _) => 5e-2,
            (None, DType::F64) => 1e-9,
            (None, _) => 1e-3,
        };
        let (per_row, unit) = p.net.per_row();
        let classifies = p.net.classifies();
        let mut losses: Vec<f64> = Vec::new();
        let mut evals: Vec<(usize, f64, f64)> = Vec::new();
        let mut busy = Duration::ZERO;
        let mut saved_at = None;
        // The one-device check's largest absolute and relative differences.
        let (mut most, mut most_rel) = (0.0f64, 0.0f64);
        let mut order: (usize, Vec<usize>) = (usize::MAX, Vec::new());
        let (rows, batch, seed, shuffle) = (p.rows, p.batch, p.seed, p.shuffle);
        let mut batch_of = |s: usize| -> Result<Vec<Tensor>> {
            let mut idx = Vec::with_capacity(batch);
            for i in 0..batch {
                let k = s * batch + i;
                let r = if shuffle {
                    if order.0 != k / rows {
                        order = (k / rows, permutation(seed, k / rows, rows));
                    }
                    order.1[k % rows]
                } else {
                    k % rows
                };
                idx.push(r);
            }
            p.examples.batch(&idx, p.dtype)
        };
        let meta = &p.meta;
        // The steps, a host call (`steps_per_run` steps, up to the next evaluation or
        // checkpoint) at a time; `Ok(true)` when stopped on request.
        let outcome = (|| -> Result<bool> {
            let mut ahead: VecDeque<(f64, Option<f64>)> = VecDeque::new();
            for s in first..steps {
                let lr = learning_rate(p.lr, s, steps, p.warmup, p.cosine);
                if ahead.is_empty() {
                    let mut end = s.saturating_add(p.steps_per_run).min(steps);
                    for every in [p.eval_every, p.checkpoint_every] {
                        if let Some(k) = s.checked_div(every) {
                            end = end.min((k + 1).saturating_mul(every));
                        }
                    }
                    let feeds = (s..end).map(&mut batch_of).collect::<Result<Vec<_>>>()?;
                    let lrs: Vec<f64> = (s..end)
                        .map(|k| learning_rate(p.lr, k, steps, p.warmup, p.cosine))
                        .collect();
                    let t = Instant::now();
                    let got = run.steps(&feeds, &lrs, s)?;
                    busy += t.elapsed();
                    let want = match reference.as_mut() {
                        Some(r) => r.steps(&feeds, &lrs, s)?.into_iter().map(Some).collect(),
                        None => vec![None; got.len()],
                    };
                    ahead.extend(got.into_iter().zip(want));
                }
                let (loss, want) = ahead
                    .pop_front()
                    .ok_or_else(|| Error::failed("a host call returned fewer losses than steps"))?;
                losses.push(loss);
                if let Some(want) = want {
                    most = most.max((loss - want).abs());
                    most_rel =
                        most_rel.max((loss - want).abs() / want.abs().max(f64::MIN_POSITIVE));
                }
                check_step(s, loss, want, tol, &where_)?;
                let rate = ((s + 1 - first) * batch) as f64 * per_row as f64
                    / busy.as_secs_f64().max(1e-12);
                if let Some(m) = manager.as_mut()
                    && (s + 1 == steps
                        || (p.checkpoint_every > 0 && (s + 1).is_multiple_of(p.checkpoint_every)))
                {
                    run.save(m, meta, s + 1).map_err(save_failed)?;
                    saved_at = Some(s + 1);
                    // The losses file holds the saved steps too, so a run resumed
                    // after a crash finds them there.
                    if let Some(path) = &p.losses_json {
                        write_atomic(path, &losses_json(&p.losses_before, &losses)).map_err(
                            |e| Error::failed(format!("--losses-json {}: {e}", path.display())),
                        )?;
                    }
                }
                let evaluated = match &eval {
                    Some(e) if (s + 1).is_multiple_of(p.eval_every) || s + 1 == steps => {
                        let (l, acc) = e.run(run.as_ref())?;
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
                    writeln!(f, "{line}").and_then(|()| f.flush()).map_err(|e| {
                        Error::failed(format!("--metrics-jsonl: cannot write: {e}"))
                    })?;
                }
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
                if stop.load(Ordering::SeqCst) && ahead.is_empty() && s + 1 < steps {
                    if let Some(m) = manager.as_mut()
                        && saved_at != Some(s + 1)
                    {
                        run.save(m, meta, s + 1).map_err(save_failed)?;
                        saved_at = Some(s + 1);
                    }
                    return Ok(true);
                }
            }
            Ok(false)
        })();
        observer.end();
        // The losses are written whether the run finished, stopped or failed.
        if let Some(path) = &p.losses_json {
            let written = write_atomic(path, &losses_json(&p.losses_before, &losses));
            if let Err(e) = written {
                let e = Error::failed(format!("--losses-json {}: {e}", path.display()));
                return Err(outcome.err().unwrap_or(e));
            }
        }
        let stopped = outcome?;
        if let Some((dir, config)) = &p.export_hf
            && let Net::Gpt2 { model, .. } = p.net
        {
            let mut weights = HashMap::new();
            for (name, _) in model.parameters() {
                weights.insert(name.clone(), run.weight(&name)?);
            }
            crate::hf::write_gpt2("export-hf", dir, &model, config, &weights)
                .map_err(|e| Error::failed(e.to_string()))?;
        }
        if let Some(path) = &p.plot {
            let title = format!("meshwork: {} training loss on {where_}", p.net.describe());
            write_new(path, svg(&losses, &evals, first, &title).as_bytes())
                .map_err(|e| Error::failed(format!("--plot {}: {e}", path.display())))?;
        }
        // A classifier trained on all its rows: its accuracy on them.
        let accuracy = match &p.classification {
            Some(data) if eval.is_none() && !stopped => {
                // Every row, a batch at a time (and the rows left over as one more).
                let (n, batch) = (data.rows(), p.batch);
                let mut right = 0.0;
                for (start, size, count) in
                    [(0, batch, n / batch), (n / batch * batch, n % batch, 1)]
                {
                    if size == 0 || count == 0 {
                        continue;
                    }
                    let chunks = (0..count)
                        .map(|c| {
                            let idx: Vec<usize> =
                                (start + c * size..start + (c + 1) * size).collect();
                            p.examples.batch(&idx, p.dtype)
                        })
                        .collect::<Result<Vec<_>>>()?;
                    let part = Eval::new(&one, &p.net, p.dtype, size, chunks)?;
                    right += part.run(run.as_ref())?.1 * (size * count) as f64;
                }
                Some((right / n.max(1) as f64, n))
            }
            _ => None,
        };
        let check = if p.check {
            CheckOutcome::Checked { most, relative: most_rel, tolerance: tol }
        } else if devices == 1 {
            CheckOutcome::OneDevice
        } else if p.never_check {
            CheckOutcome::Skipped
        } else {
            CheckOutcome::Large
        };
        let saved = saved_at.zip(p.checkpoint_dir.clone());
        Ok(Report {
            model: p.net.describe(),
            layout: where_,
            dtype: p.dtype,
            first_step: first,
            steps,
            losses,
            evals,
            eval_rows: eval.as_ref().map_or(0, Eval::rows),
            classifies,
            accuracy,
            busy,
            batch,
            per_row: (per_row, unit),
            saved,
            checkpoint_dir: p.checkpoint_dir.clone(),
            check,
            stopped,
        })
    }
}

/// The weights of a run by name, for tests and tools: what [`Trainer::run`] starts
/// from for `config` (its `--init` file, or the weights drawn from its seed).
pub fn initial_weights(config: &Config) -> Result<HashMap<String, Tensor>> {
    let p = plan(config)?;
    if let (Some(shards), Net::Gpt2 { model, .. }) = (&p.shards, &p.net) {
        return model
            .parameters()
            .into_iter()
            .map(|(name, shape)| {
                let whole: Vec<std::ops::Range<usize>> = shape.iter().map(|&d| 0..d).collect();
                Ok((name.clone(), shards.read(&name, &whole, p.dtype)?))
            })
            .collect();
    }
    match p.init {
        Some(file) => Ok(file),
        None => {
            let (program, _) =
                p.net.loss_program(p.batch, p.dtype, Layout::Mesh { data: 1, model: 1 })?;
            p.net.random_init(&program, p.seed)
        }
    }
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
