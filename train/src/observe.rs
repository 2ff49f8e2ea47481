//! What a run tells its caller as it goes: a progress bar, log lines, a notebook.

/// A run as it starts.
#[derive(Debug, Clone, PartialEq)]
pub struct Start {
    /// One line: `training MLP 8 -> 32 -> 3 on 512 rows (f64, sgd, lr 0.5) on mesh 2x2, batch 64, 200 steps`.
    pub headline: String,
    /// The first step (0 unless resumed).
    pub first: usize,
    /// The last step.
    pub steps: usize,
    /// Warnings about the resumed checkpoint's run (a learning rate that differs, say).
    pub warnings: Vec<String>,
}

/// One step done.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Step {
    /// The step, counted from 1.
    pub step: usize,
    /// The last step.
    pub steps: usize,
    /// Its loss.
    pub loss: f64,
    /// Its learning rate.
    pub lr: f64,
    /// Rows (or tokens) per second of step time so far.
    pub rate: f64,
    /// `samples` or `tokens`.
    pub unit: &'static str,
    /// The evaluation after it, if one ran: (loss, accuracy).
    pub eval: Option<(f64, f64)>,
    /// Whether the evaluation's accuracy counts classes (or next tokens).
    pub classifies: bool,
}

/// Receives a run's events. Every method has an empty default.
pub trait Observer {
    /// Before the first step, after every check passed.
    fn start(&mut self, _start: &Start) {}
    /// After each step.
    fn step(&mut self, _step: &Step) {}
    /// After the last step (or the stop), before the outputs are written.
    fn end(&mut self) {}
}

/// An observer that ignores everything.
#[derive(Debug, Clone, Copy, Default)]
pub struct Quiet;

impl Observer for Quiet {}
