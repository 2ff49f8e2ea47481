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

/// What `--plot` draws: this run's train losses (one per step, the first being
/// step `first + 1`), its evaluations (`(index into losses, eval loss)`), and the
/// learning rate of each step.
#[derive(Debug, Clone, Copy)]
pub struct Curves<'a> {
    /// The train loss of each step (not finite where a step's was not).
    pub losses: &'a [f64],
    /// The eval loss after step `first + index + 1`.
    pub evals: &'a [(usize, f64)],
    /// The learning rate of each step (as long as `losses`, or empty).
    pub lrs: &'a [f64],
    /// Steps made before this run (a resumed run's).
    pub first: usize,
    /// The chart's title.
    pub title: &'a str,
}

/// The most points a curve is drawn with: longer runs are drawn by the mean of
/// consecutive steps (so a file stays small at any length).
const MOST_POINTS: usize = 1000;

/// About `most` round tick values (1, 2 or 5 times a power of ten apart) covering
/// `[lo, hi]`: the range widened to the ticks at its ends, and the ticks.
pub(crate) fn ticks(lo: f64, hi: f64, most: usize) -> ((f64, f64), Vec<f64>) {
    let (lo, hi) = match (lo.is_finite() && hi.is_finite(), hi > lo) {
        (false, _) => (0.0, 1.0),
        (true, true) => (lo, hi),
        (true, false) => (lo - 0.5 * lo.abs().max(1e-12), lo + 0.5 * lo.abs().max(1e-12)),
    };
    let raw = (hi - lo) / most.max(1) as f64;
    let power = 10f64.powi(raw.log10().floor() as i32);
    let step = [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * power)
        .find(|&s| s >= raw * (1.0 - 1e-9))
        .unwrap_or(10.0 * power);
    let (a, b) = ((lo / step).floor(), (hi / step).ceil());
    let values = (0..=(b - a) as usize).map(|k| (a + k as f64) * step).collect();
    ((a * step, b * step), values)
}

/// A tick value with as many decimals as its spacing needs (`0.0005`, `2.5`, `120`),
/// in exponent form when very small or large.
fn tick_text(v: f64, step: f64) -> String {
    if v == 0.0 {
        return "0".into();
    }
    if step.abs() < 1e-4 || v.abs() >= 1e6 {
        return format!("{v:.1e}");
    }
    let decimals = (-step.log10().floor()).max(0.0) as usize;
    format!("{v:.decimals$}")
}

/// `values` drawn by at most [`MOST_POINTS`] points: `(x, mean)` of consecutive
/// groups (x the group's first index), groups holding a value that is not finite
/// left out.
fn thinned(values: &[f64]) -> Vec<(f64, Option<f64>)> {
    let per = values.len().div_ceil(MOST_POINTS).max(1);
    values
        .chunks(per)
        .enumerate()
        .map(|(k, c)| {
            let finite = c.iter().all(|x| x.is_finite());
            let mean = c.iter().sum::<f64>() / c.len() as f64;
            ((k * per) as f64 + (c.len() - 1) as f64 / 2.0, finite.then_some(mean))
        })
        .collect()
}

/// One panel of the chart: its box on the page, its x range (steps) and y range.
struct Panel {
    left: f64,
    top: f64,
    width: f64,
    height: f64,
    x: (f64, f64),
    y: (f64, f64),
}

impl Panel {
    fn at(&self, x: f64, y: f64) -> (f64, f64) {
        let px = self.left + self.width * (x - self.x.0) / (self.x.1 - self.x.0);
        let py = self.top + self.height * (1.0 - (y - self.y.0) / (self.y.1 - self.y.0));
        (px, py)
    }

    /// The grid, the axes and their tick labels (`y_ticks`' values; x's labelled
    /// when `x_labels`).
    fn frame(&self, out: &mut String, y_ticks: &[f64], x_ticks: &[f64], x_labels: bool) {
        use std::fmt::Write;
        let (l, t, r, b) = (self.left, self.top, self.left + self.width, self.top + self.height);
        let step = |v: &[f64]| if v.len() > 1 { v[1] - v[0] } else { 1.0 };
        for &v in y_ticks {
            let (_, y) = self.at(self.x.0, v);
            let _ = writeln!(
                out,
                "<line x1=\"{l:.1}\" y1=\"{y:.1}\" x2=\"{r:.1}\" y2=\"{y:.1}\" stroke=\"#e0e0e0\"/>\n\
                 <text x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\" text-anchor=\"end\">{}</text>",
                l - 6.0,
                y + 4.0,
                tick_text(v, step(y_ticks))
            );
        }
        for &v in x_ticks {
            let (x, _) = self.at(v, self.y.0);
            let _ = writeln!(
                out,
                "<line x1=\"{x:.1}\" y1=\"{t:.1}\" x2=\"{x:.1}\" y2=\"{b:.1}\" stroke=\"#e0e0e0\"/>"
            );
            if x_labels {
                let _ = writeln!(
                    out,
                    "<text x=\"{x:.1}\" y=\"{:.1}\" font-size=\"11\" text-anchor=\"middle\">{}</text>",
                    b + 16.0,
                    tick_text(v, step(x_ticks))
                );
            }
        }
        let _ = writeln!(
            out,
            "<rect x=\"{l:.1}\" y=\"{t:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"none\" stroke=\"black\"/>",
            self.width, self.height
        );
    }

    /// `points` (x, y; `None` breaks the line) as polylines in `color`.
    fn line(&self, out: &mut String, points: &[(f64, Option<f64>)], color: &str, width: f64) {
        use std::fmt::Write;
        for run in points.split(|(_, y)| y.is_none()).filter(|r| !r.is_empty()) {
            let pts: Vec<String> = run
                .iter()
                .map(|&(x, y)| {
                    let (px, py) = self.at(x, y.expect("split at None"));
                    format!("{px:.1},{py:.1}")
                })
                .collect();
            let _ = writeln!(
                out,
                "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"{width}\" points=\"{}\"/>",
                pts.join(" ")
            );
        }
    }
}

/// The run's curves as an SVG chart: the train loss (and the eval loss, marked at
/// each evaluation) against the step, with round ticks, a grid and a legend; below
/// it, when the rates are given, the learning rate in a second panel on the same
/// steps. Steps whose loss is not finite break the line.
pub fn svg(c: &Curves<'_>) -> String {
    use std::fmt::Write;
    let (w, left, right) = (720.0, 72.0, 24.0);
    let with_lr = !c.lrs.is_empty();
    let h = if with_lr { 500.0 } else { 380.0 };
    let width = w - left - right;
    // Steps on x: the first drawn is step first + 1.
    let x0 = c.first as f64 + 1.0;
    let x1 = (c.first + c.losses.len().max(2)) as f64;
    let ((mut x0, mut x1), mut x_ticks) = ticks(x0, x1, 8);
    // Whole steps.
    if x_ticks.len() > 1 && x_ticks[1] - x_ticks[0] < 1.0 {
        (x0, x1) = (x0.floor(), x1.ceil());
        x_ticks = (x0 as u64..=x1 as u64).map(|v| v as f64).collect();
    }
    let train: Vec<(f64, Option<f64>)> =
        thinned(c.losses).into_iter().map(|(x, y)| (c.first as f64 + 1.0 + x, y)).collect();
    let evals: Vec<(f64, Option<f64>)> = c
        .evals
        .iter()
        .map(|&(s, l)| ((c.first + s + 1) as f64, l.is_finite().then_some(l)))
        .collect();
    let shown = train.iter().chain(&evals).filter_map(|p| p.1);
    let (lo, hi) = shown.fold((f64::MAX, f64::MIN), |(l, h), y| (l.min(y), h.max(y)));
    // No finite loss to show (a run that failed before its first step): an empty 0–1
    // panel, not one whose range runs from f64::MAX down to f64::MIN.
    let (lo, hi) = if lo <= hi { (lo, hi) } else { (0.0, 1.0) };
    let ((y0, y1), y_ticks) = ticks(lo, hi, 6);
    let loss = Panel { left, top: 44.0, width, height: 280.0, x: (x0, x1), y: (y0, y1) };
    let escaped = c.title.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;");
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\" font-family=\"sans-serif\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{left}\" y=\"24\" font-size=\"14\">{escaped}</text>\n"
    );
    loss.frame(&mut out, &y_ticks, &x_ticks, !with_lr);
    let _ = writeln!(
        out,
        "<text x=\"16\" y=\"{:.1}\" font-size=\"12\" transform=\"rotate(-90 16 {:.1})\" text-anchor=\"middle\">loss</text>",
        loss.top + loss.height / 2.0,
        loss.top + loss.height / 2.0
    );
    loss.line(&mut out, &train, "steelblue", 1.5);
    if !evals.is_empty() {
        loss.line(&mut out, &evals, "darkorange", 2.0);
        for &(x, y) in &evals {
            if let Some(y) = y {
                let (px, py) = loss.at(x, y);
                let _ = writeln!(
                    out,
                    "<circle cx=\"{px:.1}\" cy=\"{py:.1}\" r=\"3\" fill=\"darkorange\"/>"
                );
            }
        }
    }
    // The legend, in the loss panel's top right corner.
    let entries: Vec<(&str, &str)> = [("train", "steelblue"), ("eval", "darkorange")]
        .into_iter()
        .take(if evals.is_empty() { 1 } else { 2 })
        .collect();
    let (lx, ly) = (loss.left + loss.width - 92.0, loss.top + 8.0);
    let _ = writeln!(
        out,
        "<rect x=\"{lx:.1}\" y=\"{ly:.1}\" width=\"84\" height=\"{:.1}\" fill=\"white\" stroke=\"#999\"/>",
        8.0 + 16.0 * entries.len() as f64
    );
    for (k, (name, color)) in entries.iter().enumerate() {
        let y = ly + 14.0 + 16.0 * k as f64;
        let _ = writeln!(
            out,
            "<line x1=\"{:.1}\" y1=\"{y:.1}\" x2=\"{:.1}\" y2=\"{y:.1}\" stroke=\"{color}\" stroke-width=\"2\"/>\n\
             <text x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\">{name}</text>",
            lx + 8.0,
            lx + 30.0,
            lx + 36.0,
            y + 4.0
        );
    }
    if with_lr {
        let rates: Vec<(f64, Option<f64>)> =
            thinned(c.lrs).into_iter().map(|(x, y)| (c.first as f64 + 1.0 + x, y)).collect();
        let (lo, hi) = rates
            .iter()
            .filter_map(|p| p.1)
            .fold((f64::MAX, f64::MIN), |(l, h), y| (l.min(y), h.max(y)));
        // The rate from 0, so that a decay reads as one.
        let ((r0, r1), r_ticks) = ticks(lo.min(0.0), hi, 3);
        let lr = Panel { left, top: 352.0, width, height: 108.0, x: (x0, x1), y: (r0, r1) };
        lr.frame(&mut out, &r_ticks, &x_ticks, true);
        lr.line(&mut out, &rates, "seagreen", 1.5);
        let _ = writeln!(
            out,
            "<text x=\"16\" y=\"{:.1}\" font-size=\"12\" transform=\"rotate(-90 16 {:.1})\" text-anchor=\"middle\">lr</text>",
            lr.top + lr.height / 2.0,
            lr.top + lr.height / 2.0
        );
    }
    let _ = writeln!(
        out,
        "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"12\" text-anchor=\"middle\">step</text>\n</svg>",
        left + width / 2.0,
        h - 6.0
    );
    out
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The numbers in an attribute's value (`points="1,2 3,4"` gives 1 2 3 4).
    fn numbers(svg: &str, element: &str, attribute: &str) -> Vec<Vec<f64>> {
        svg.lines()
            .filter(|l| l.starts_with(&format!("<{element} ")))
            .filter_map(|l| {
                let start = l.find(&format!(" {attribute}=\""))? + attribute.len() + 3;
                let value = &l[start..start + l[start..].find('"')?];
                Some(
                    value
                        .split([' ', ','])
                        .filter(|t| !t.is_empty())
                        .map(|t| t.parse().unwrap())
                        .collect(),
                )
            })
            .collect()
    }

    proptest! {
        /// The ticks are round (1, 2 or 5 times a power of ten apart, each a whole
        /// multiple of that spacing), evenly spaced, cover the range from its ends,
        /// and are few.
        #[test]
        fn ticks_are_round_and_cover_the_range(
            lo in -1e6f64..1e6,
            span in 1e-9f64..1e6,
            most in 2usize..12,
        ) {
            let hi = lo + span;
            let ((a, b), t) = ticks(lo, hi, most);
            prop_assert!(a <= lo && b >= hi, "{a} {b} {lo} {hi}");
            prop_assert!(t.len() >= 2 && t.len() <= 2 * most + 2, "{t:?}");
            let step = t[1] - t[0];
            let mantissa = step / 10f64.powf(step.log10().floor());
            prop_assert!(
                [1.0, 2.0, 5.0, 10.0].iter().any(|m| (mantissa - m).abs() < 1e-6),
                "{step}"
            );
            for (k, v) in t.iter().enumerate() {
                prop_assert!((v - (t[0] + k as f64 * step)).abs() <= 1e-9 * step.max(v.abs()));
                prop_assert!(((v / step) - (v / step).round()).abs() < 1e-6);
            }
            prop_assert_eq!((t[0], *t.last().unwrap()), (a, b));
        }

        /// Every point drawn lies inside its panel, whatever the losses (some not
        /// finite) and rates; nothing that is not a number reaches the file; a long
        /// run is drawn with a bounded number of points.
        #[test]
        fn the_chart_stays_inside_its_panels(
            losses in proptest::collection::vec(
                prop_oneof![9 => -1e3f64..1e3, 1 => Just(f64::NAN), 1 => Just(f64::INFINITY)],
                0..3000,
            ),
            first in 0usize..1000,
            evals in proptest::collection::vec((0usize..3000, 0.0f64..10.0), 0..5),
        ) {
            let lrs: Vec<f64> = (0..losses.len()).map(|k| 0.1 / (1 + k) as f64).collect();
            let evals: Vec<(usize, f64)> =
                evals.into_iter().filter(|e| e.0 < losses.len()).collect();
            let chart = svg(&Curves { losses: &losses, evals: &evals, lrs: &lrs, first, title: "t" });
            prop_assert!(!chart.contains("NaN") && !chart.contains("inf"), "{chart}");
            for points in numbers(&chart, "polyline", "points") {
                prop_assert!(points.len() <= 2 * MOST_POINTS + 2 * evals.len() + 2);
                for xy in points.chunks(2) {
                    prop_assert!((72.0 - 0.1..=696.0 + 0.1).contains(&xy[0]), "x {}", xy[0]);
                    let loss_panel = (44.0 - 0.1..=324.0 + 0.1).contains(&xy[1]);
                    let lr_panel = (352.0 - 0.1..=460.0 + 0.1).contains(&xy[1]);
                    prop_assert!(loss_panel || lr_panel, "y {}", xy[1]);
                }
            }
        }
    }

    /// The chart of a short run with evaluations: a train and an eval line, their
    /// legend, round tick labels on both axes, and the rates' panel; the first point
    /// at step `first + 1`, the highest loss at the top tick.
    #[test]
    fn a_short_run_has_a_legend_ticks_and_a_rates_panel() {
        let losses = [4.0, 3.0, 2.5, 2.0];
        let lrs = [0.1, 0.075, 0.05, 0.025];
        let c = Curves {
            losses: &losses,
            evals: &[(1, 3.5), (3, 2.8)],
            lrs: &lrs,
            first: 10,
            title: "a<b",
        };
        let chart = svg(&c);
        assert!(chart.starts_with("<svg ") && chart.trim_end().ends_with("</svg>"));
        assert!(chart.contains(">a&lt;b</text>"));
        for label in [">train</text>", ">eval</text>", ">lr</text>", ">loss</text>", ">step</text>"]
        {
            assert!(chart.contains(label), "{label}");
        }
        // Loss ticks 2.0 … 4.0 by 0.5, whole steps 11 … 14, rate ticks.
        for label in [">2.0</text>", ">4.0</text>", ">11</text>", ">14</text>", ">0.10</text>"] {
            assert!(chart.contains(label), "{label}");
        }
        let lines = numbers(&chart, "polyline", "points");
        // Train, eval, rates.
        assert_eq!(lines.len(), 3, "{lines:?}");
        assert_eq!(lines[0].len(), 8);
        assert_eq!((lines[0][0], lines[0][1]), (72.0, 44.0), "step 11 at the left, 4.0 at the top");
        assert_eq!(numbers(&chart, "circle", "cx").len(), 2);
        // Without rates, one panel.
        let bare = svg(&Curves { lrs: &[], evals: &[], ..c });
        assert!(!bare.contains(">lr</text>") && !bare.contains(">eval</text>"));
        assert_eq!(numbers(&bare, "polyline", "points").len(), 1);
    }
}
