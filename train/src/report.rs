//! What a run did, and how it is told to people: the report the trainer returns, its
//! summary lines, a sparkline of the losses and an SVG chart.

use std::time::Duration;

/// What a training run did.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    /// What was trained: `MLP 8 -> 32 -> 3`.
    pub model: String,
    /// Where: `mesh 2x2`, `2 x 3-stage pipeline, 4 micro-batches`.
    pub layout: String,
    /// The dtype of the weights.
    pub dtype: meshwork_types::DType,
    /// The first step this run made (0 unless resumed).
    pub first_step: usize,
    /// The last step asked for.
    pub steps: usize,
    /// The loss of every step this run made.
    pub losses: Vec<f64>,
    /// Each evaluation: (step, counted from 0 within this run; loss; accuracy).
    pub evals: Vec<(usize, f64, f64)>,
    /// Rows each evaluation reads.
    pub eval_rows: usize,
    /// Whether the evaluation's accuracy counts classes (or next tokens).
    pub classifies: bool,
    /// The accuracy over every training row after the last step, for a classifier
    /// trained without held-out rows; and the rows.
    pub accuracy: Option<(f64, usize)>,
    /// Seconds spent in steps.
    pub busy: Duration,
    /// Rows per step.
    pub batch: usize,
    /// What a row counts for in throughput, and its name: `(T, "tokens")`,
    /// `(1, "samples")`.
    pub per_row: (usize, &'static str),
    /// The last checkpoint this run saved: its step and directory.
    pub saved: Option<(usize, std::path::PathBuf)>,
    /// The checkpoint directory.
    pub checkpoint_dir: Option<std::path::PathBuf>,
    /// The one-device check.
    pub check: CheckOutcome,
    /// Whether a stop was requested and the run ended early (saved, outputs written).
    pub stopped: bool,
    /// Across processes: the payload bytes this process sent the others per step of
    /// this run (every exchange, measured on its link), and the fewest the
    /// partitioner's collectives need it to send per step.
    pub between_processes: Option<(f64, u64)>,
}

/// Whether every step's loss was checked against one device's, and how close.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum CheckOutcome {
    /// Checked: the largest absolute and relative differences, and the tolerance.
    Checked {
        /// `max |loss − 1-device loss|`.
        most: f64,
        /// `max |loss − 1-device loss| / |1-device loss|`.
        relative: f64,
        /// The relative tolerance a step had to meet.
        tolerance: f64,
        /// The largest relative difference (norm-wise, per tensor) of the weights
        /// and optimizer state after a host call, each host call's steps taken from
        /// the same state.
        state: f64,
        /// The relative tolerance the state had to meet.
        state_tolerance: f64,
    },
    /// Not run: the run is on one device.
    OneDevice,
    /// Not run: estimated over 1 GB (`--check` runs it).
    Large,
    /// Not run: `--no-check`.
    Skipped,
    /// Not run: the mesh spreads over this many processes, none of which holds a
    /// whole batch.
    Spread(usize),
}

impl Report {
    /// The summary a person reads at the end of a run, one line each.
    pub fn summary(&self) -> Vec<String> {
        let mut out = Vec::new();
        let made = self.losses.len();
        let first = self.first_step;
        out.push(format!(
            "meshwork train: {} on {}, {}, steps {first}..{}",
            self.model,
            self.layout,
            self.dtype,
            first + made
        ));
        if self.losses.is_empty() && !self.stopped {
            out.push(format!(
                "  nothing to run: the checkpoint is at step {first}, already at or past --steps {}",
                self.steps
            ));
            return out;
        }
        if let (Some(first_loss), Some(last)) = (self.losses.first(), self.losses.last()) {
            out.push(format!(
                "  final loss   {}  (first {})",
                loss_text(*last),
                loss_text(*first_loss)
            ));
            out.push(format!("  loss curve   {}", sparkline(&self.losses, 60)));
        }
        if let Some(&(k, l, acc)) = self.evals.last() {
            out.push(format!(
                "  eval         after step {}: loss {}, {} {:.2}% on {} held-out rows",
                k + first + 1,
                loss_text(l),
                if self.classifies { "accuracy" } else { "next-token accuracy" },
                100.0 * acc,
                self.eval_rows
            ));
        }
        if let Some((acc, rows)) = self.accuracy {
            out.push(format!("  accuracy     {:.1}% of {rows} rows", 100.0 * acc));
        }
        let (per_row, unit) = self.per_row;
        let secs = self.busy.as_secs_f64();
        out.push(format!(
            "  throughput   {:.0} {unit}/s ({} in {secs:.2} s)",
            (made * self.batch) as f64 * per_row as f64 / secs.max(1e-9),
            steps_text(made)
        ));
        if let Some((sent, least)) = self.between_processes {
            out.push(format!(
                "  processes    this one sent {sent:.0} bytes per step to the others (the collectives need {least}; {})",
                bytes_text(sent)
            ));
        }
        if let (Some((at, _)), Some(dir)) = (&self.saved, &self.checkpoint_dir) {
            out.push(format!("  checkpoint   step {at} in {}", dir.display()));
        }
        out.push(match self.check {
            CheckOutcome::Checked { most, relative, tolerance, state, state_tolerance } => format!(
                "  check        every step equal to one device's from the same state: max |loss - 1-device loss| = {most:.1e} (relative {relative:.1e}, tolerance {tolerance:e}); weights and optimizer state relative {state:.1e} (tolerance {state_tolerance:e})"
            ),
            CheckOutcome::Large => "  check        not run: a large run (--check runs it)".into(),
            CheckOutcome::OneDevice => "  check        this run is the one-device run".into(),
            CheckOutcome::Skipped => "  check        skipped (--no-check)".into(),
            CheckOutcome::Spread(n) => format!(
                "  check        not run: the mesh spreads over {n} processes (compare --losses-json with a one-process run's)"
            ),
        });
        if self.stopped {
            out.push(format!(
                "  stopped      by a signal after step {}{}",
                first + made,
                if self.saved.is_some() { "; resume with --resume" } else { "" }
            ));
        }
        out
    }
}

/// A loss for people: fixed-point in the usual range, scientific beyond it.
pub fn loss_text(x: f64) -> String {
    if x == 0.0 || (1e-4..1e6).contains(&x.abs()) { format!("{x:.6}") } else { format!("{x:.6e}") }
}

/// A number for people: plain in the usual range, scientific beyond it.
pub fn number_text(x: f64) -> String {
    if x == 0.0 || (1e-4..1e6).contains(&x.abs()) { format!("{x}") } else { format!("{x:e}") }
}

/// "1 step", "2 steps".
pub fn steps_text(n: usize) -> String {
    if n == 1 { "1 step".into() } else { format!("{n} steps") }
}

/// The train loss per step (and the eval loss at its steps, `(step, loss, _)`) as an
/// SVG line chart.
pub fn svg(losses: &[f64], evals: &[(usize, f64, f64)], first: usize, title: &str) -> String {
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
pub fn sparkline(losses: &[f64], width: usize) -> String {
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

/// A byte count for people: `512 B`, `1.50 MB` (decimal units).
pub(crate) fn bytes_text(b: f64) -> String {
    match b {
        b if b >= 1e9 => format!("{:.2} GB", b / 1e9),
        b if b >= 1e6 => format!("{:.2} MB", b / 1e6),
        b if b >= 1e3 => format!("{:.1} kB", b / 1e3),
        b => format!("{b:.0} B"),
    }
}
