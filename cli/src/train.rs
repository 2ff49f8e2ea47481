//! `meshwork train`: the flags into a [`Config`](meshwork_train::Config), the trainer
//! run with a progress display, and its report as a summary.

use std::io::IsTerminal;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use indicatif::{ProgressBar, ProgressStyle};
use meshwork_train::{Error, Observer, Start, Step, Trainer, loss_text, stop_on_signals};

use crate::args::TrainArgs;
use crate::out::{Exit, note, out, outln};

/// The trainer's error as the command's exit.
pub(crate) fn exit(e: Error) -> Exit {
    match e {
        Error::Usage(m) => Exit::Usage(m),
        other => Exit::Failed(other.to_string()),
    }
}

/// On a terminal, a progress bar (redrawn on stderr); otherwise a line a tenth of the
/// run apart. Warnings go to stderr, the headline to stdout; a reader that closed
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
}

impl Observer for Progress {
    fn start(&mut self, start: &Start) {
        for w in &start.warnings {
            note(format_args!("meshwork train: warning: {w}"));
        }
        if self.quiet {
            return;
        }
        if let Err(Exit::Closed) = out(format_args!("{}\n", start.headline)) {
            self.closed = true;
            self.stop.store(true, Ordering::SeqCst);
        }
        self.every = (start.steps / 10).max(1);
        self.first = start.first;
        if std::io::stderr().is_terminal() {
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
                    "step {:>5}/{} loss {}  {rate}",
                    s.step,
                    s.steps,
                    loss_text(s.loss)
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

/// Trains as `args` say; the summary on stdout unless `--quiet`.
pub(crate) fn run(args: &TrainArgs) -> Result<(), Exit> {
    let trainer = Trainer::new(&args.config()?).map_err(exit)?;
    let stop = stop_on_signals().map_err(exit)?;
    let mut progress = Progress {
        quiet: args.quiet(),
        stop: stop.clone(),
        closed: false,
        bar: None,
        every: 1,
        first: 0,
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
