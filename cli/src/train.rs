//! `meshwork train`: the flags into a [`Config`](meshwork_train::Config), the trainer
//! run with a progress display, and its report as a summary.

use std::io::IsTerminal;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use indicatif::{ProgressBar, ProgressStyle};
use meshwork_train::{Error, Observer, Start, Step, Trainer, loss_text, stop_on_signals};

use crate::args::TrainArgs;
use crate::out::{Exit, note, out, outln, readable};

/// The trainer's error as the command's exit.
pub(crate) fn exit(e: Error) -> Exit {
    match e {
        Error::Usage(m) => Exit::Usage(m),
        other => Exit::Failed(other.to_string()),
    }
}

/// On a terminal, a progress bar (redrawn on stderr); otherwise, or with
/// `--log-every N`, a line every N steps (default: a tenth of the run apart). Warnings go to stderr, the headline to stdout; a reader that closed
/// stdout stops the run (after its host call, saved), as `meshwork train | head -1`
/// asks.
struct Progress {
    quiet: bool,
    /// The run's stop flag, and whether stdout was found closed.
    stop: Arc<AtomicBool>,
    closed: bool,
    bar: Option<ProgressBar>,
    /// Steps between lines, and the run's first step (its line is always drawn).
    every: usize,
    first: usize,
    /// `--log-every`: lines every that many steps, never a bar.
    log_every: Option<usize>,
}

impl Observer for Progress {
    fn start(&mut self, start: &Start) {
        for w in &start.warnings {
            note(format_args!("meshwork train: warning: {}", readable(w)));
        }
        if self.quiet {
            return;
        }
        if let Err(Exit::Closed) = out(format_args!("{}\n", start.headline)) {
            self.closed = true;
            self.stop.store(true, Ordering::SeqCst);
        }
        self.every = self.log_every.unwrap_or((start.steps / 10).max(1));
        self.first = start.first;
        if self.log_every.is_none() && std::io::stderr().is_terminal() {
            let bar = ProgressBar::new((start.steps - start.first) as u64);
            bar.set_style(
                ProgressStyle::with_template(
                    "{bar:32.cyan/blue} {pos}/{len} steps  {msg}  eta {eta}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("█▉▊▋▌▍▎▏ "),
            );
            self.bar = Some(bar);
        }
    }

    fn step(&mut self, s: &Step) {
        if self.quiet {
            return;
        }
        let rate = format!("{:.0} {}/s", s.rate, s.unit);
        match &self.bar {
            Some(bar) => {
                bar.set_message(format!("loss {}  {rate}", loss_text(s.loss)));
                bar.inc(1);
            }
            None if s.step == self.first + 1
                || s.step == s.steps
                || s.step.is_multiple_of(self.every) =>
            {
                note(format_args!(
                    "step {:>5}/{} loss {}  lr {}  {rate}",
                    s.step,
                    s.steps,
                    loss_text(s.loss),
                    meshwork_train::number_text(s.lr)
                ))
            }
            None => {}
        }
        if let Some((loss, accuracy)) = s.eval {
            let line = format!(
                "eval after step {}: loss {}, {} {:.2}%",
                s.step,
                loss_text(loss),
                if s.classifies { "accuracy" } else { "next-token accuracy" },
                100.0 * accuracy
            );
            match &self.bar {
                Some(bar) => bar.println(line),
                None => note(format_args!("{line}")),
            }
        }
    }

    fn end(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish();
            note(format_args!(""));
        }
    }
}

/// The MPI job this process is a rank of, when an MPI launcher started it: `mpirun`
/// (Open MPI, MPICH), or Slurm's `srun --mpi=pmix`. Its environment says so; a
/// process started otherwise runs alone, as without MPI.
fn launcher_ranks() -> Option<(String, usize)> {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS"].into_iter().find_map(
        |var| {
            let n: usize = std::env::var(var).ok()?.trim().parse().ok()?;
            Some((var.to_string(), n))
        },
    )
}

/// This process's rank in the MPI job its launcher started, if one did.
pub(crate) fn launcher_rank() -> Option<usize> {
    ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"]
        .into_iter()
        .find_map(|var| std::env::var(var).ok()?.trim().parse().ok())
}

/// The job's processes, joined over MPI (kept alive by the returned guard, which
/// finalises MPI when dropped): `None` in a process started alone.
#[cfg(feature = "mpi")]
fn join_job() -> Result<Option<(meshwork_train::Processes, meshwork_train::Mpi)>, Exit> {
    if launcher_ranks().is_none() {
        return Ok(None);
    }
    let joined = meshwork_train::join_mpi().map_err(exit)?;
    if joined.as_ref().is_some_and(|(p, _)| !p.leads()) {
        crate::out::silence();
    }
    Ok(joined)
}

/// Without MPI: a launcher that started several copies is refused (each would train
/// alone, all writing the same outputs).
#[cfg(not(feature = "mpi"))]
fn join_job() -> Result<Option<(meshwork_train::Processes, ())>, Exit> {
    match launcher_ranks() {
        Some((var, n)) if n > 1 => Err(Exit::Usage(format!(
            "started as one of {n} processes ({var}), but this meshwork is built without MPI; build it with `cargo build --release --features mpi` to train one mesh over them"
        ))),
        _ => Ok(None),
    }
}

/// Trains as `args` say; the summary on stdout unless `--quiet`. Started by an MPI
/// launcher (in a binary built with the `mpi` feature), the job's processes train
/// one mesh together and process 0 alone speaks.
pub(crate) fn run(args: &TrainArgs) -> Result<(), Exit> {
    let mut config = args.config()?;
    // The MPI guard lives to the end of the run (dropping it finalises MPI).
    let (processes, _mpi) = join_job()?.unzip();
    // A fine-tune keeps its checkpoint (not across processes: each would pick alone),
    // in a directory claimed here and removed again (with `meshwork-runs`, if this
    // run made it) when the run leaves it empty.
    let claimed = match processes.is_none() {
        true => args.claim_checkpoint_dir()?,
        false => None,
    };
    if let Some((dir, _)) = &claimed {
        config.checkpoint_dir = Some(dir.clone());
    }
    config.processes = processes;
    let ran = train(args, &config);
    let empty = |d: &std::path::Path| std::fs::read_dir(d).is_ok_and(|mut d| d.next().is_none());
    if let Some((dir, made_parent)) = &claimed
        && empty(dir)
        && std::fs::remove_dir(dir).is_ok()
        && *made_parent
        && let Some(parent) = dir.parent().filter(|p| empty(p))
    {
        let _ = std::fs::remove_dir(parent);
    }
    ran
}

/// Trains `config` as `args` say (the summary on stdout unless `--quiet`).
fn train(args: &TrainArgs, config: &meshwork_train::Config) -> Result<(), Exit> {
    let trainer = Trainer::new(config).map_err(exit)?;
    let stop = stop_on_signals().map_err(exit)?;
    let mut progress = Progress {
        quiet: args.quiet(),
        stop: stop.clone(),
        closed: false,
        bar: None,
        every: 1,
        first: 0,
        log_every: args.log_every(),
    };
    let report = trainer.run(&mut progress, &stop).map_err(exit)?;
    if progress.closed {
        return Err(Exit::Closed);
    }
    if !args.quiet() {
        for line in report.summary() {
            outln!("{line}");
        }
    }
    if report.stopped {
        note(format_args!(
            "meshwork: stopped after step {}{}",
            report.first_step + report.losses.len(),
            if report.saved.is_some() { "; resume with --resume" } else { "" }
        ));
        return Err(Exit::Interrupted);
    }
    Ok(())
}
