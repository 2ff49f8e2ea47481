//! Optimizers as program steps: a training step is one program — forward, backward
//! and the update of every trained parameter and its optimizer state.
//!
//! The formulas are those of the JAX reference run (`gen_transformer_case.py`) and
//! PyTorch where it has none, for parameter `p`, gradient `g`, learning rate `lr` and
//! `t = step + 1`:
//!
//! | optimizer | update |
//! |---|---|
//! | SGD | `p -= lr g` |
//! | momentum (PyTorch's, no dampening) | `m = μ m + g`; `p -= lr m` |
//! | Adam | `m = β₁ m + (1-β₁) g`; `v = β₂ v + (1-β₂) g²`; `p -= lr (m / (1-β₁ᵗ)) / (sqrt(v / (1-β₂ᵗ)) + ε)` |
//! | AdamW (decoupled decay) | Adam's update plus `lr λ p` (for parameters of 2 or more dims only, when 1-D ones are exempt) |

use meshwork_program::{Builder, Error, Program, Result, Value};
use meshwork_types::{DType, Shape, Tensor, TensorSpec};

/// An optimizer and its hyper-parameters (the learning rate is an input of the step,
/// so schedules need no new program).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Optimizer {
    /// Plain gradient descent.
    Sgd,
    /// SGD with momentum `momentum` (PyTorch's: `m = μ m + g`, `p -= lr m`).
    Momentum {
        /// μ.
        momentum: f64,
    },
    /// Adam with bias correction.
    Adam {
        /// β₁.
        beta1: f64,
        /// β₂.
        beta2: f64,
        /// ε.
        eps: f64,
    },
    /// Adam with decoupled weight decay (Loshchilov & Hutter; PyTorch's `AdamW`).
    AdamW {
        /// β₁.
        beta1: f64,
        /// β₂.
        beta2: f64,
        /// ε.
        eps: f64,
        /// λ.
        weight_decay: f64,
        /// Whether 1-D parameters (biases, LayerNorm's) decay too: `torch.optim.AdamW`
        /// decays every parameter it is given (`true`); nanoGPT exempts those with
        /// fewer than 2 dims (`false`).
        decay_1d: bool,
    },
}

impl Optimizer {
    /// Adam with β₁ = 0.9, β₂ = 0.999, ε = 1e-8 (the reference run's).
    pub fn adam() -> Optimizer {
        Optimizer::Adam { beta1: 0.9, beta2: 0.999, eps: 1e-8 }
    }

    /// AdamW with Adam's defaults and decay `weight_decay` on every parameter (as
    /// `torch.optim.AdamW` given all of them).
    pub fn adamw(weight_decay: f64) -> Optimizer {
        Optimizer::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay, decay_1d: true }
    }

    /// How a run's metadata names it: its `Debug` form, except that AdamW decaying
    /// every parameter (the default, and all there was before the choice existed)
    /// is written as it was then, so older checkpoints' runs still match.
    pub fn describe(&self) -> String {
        match *self {
            Optimizer::AdamW { beta1, beta2, eps, weight_decay, decay_1d: true } => format!(
                "AdamW {{ beta1: {beta1:?}, beta2: {beta2:?}, eps: {eps:?}, weight_decay: \
                 {weight_decay:?} }}"
            ),
            other => format!("{other:?}"),
        }
    }

    /// The names of its state tensors per parameter (each of the parameter's spec).
    pub fn state_names(&self) -> &'static [&'static str] {
        match self {
            Optimizer::Sgd => &[],
            Optimizer::Momentum { .. } => &["momentum"],
            Optimizer::Adam { .. } | Optimizer::AdamW { .. } => &["m", "v"],
        }
    }
}

/// A training step as one program.
///
/// Inputs: the model program's parameters (all of them, in order), then the optimizer
/// state (for each trained parameter, each of [`Optimizer::state_names`], named
/// `optimizer.<name>.<param>`), then the scalars `optimizer.lr` and `optimizer.step`
/// (0-based, of the loss's dtype). Results: the loss (before the update), the updated
/// trained parameters, then the updated state in input order (and, when asked, the
/// gradients' norm).
#[derive(Debug, Clone)]
pub struct TrainStep {
    /// The step's program.
    pub program: Program,
    /// The trained parameters (values of the model program, which are the step
    /// program's parameters of the same numbers; with micro-batches, the step
    /// program's, after the micro-batches').
    pub trained: Vec<Value>,
    /// The frozen parameters ([`StepOptions::frozen`]) as the step program's: held
    /// between steps, neither fed each step nor updated.
    pub frozen: Vec<Value>,
    /// The optimizer.
    pub optimizer: Optimizer,
    /// Its dynamic loss scaling, if any.
    pub loss_scale: Option<LossScale>,
    /// Whether the step's last result is the gradients' global norm
    /// ([`StepOptions::grad_norm`]).
    pub grad_norm: bool,
}

/// The loss scale's parameter (state carried step to step).
pub const LOSS_SCALE: &str = "loss_scale.scale";
/// The count of finite steps since the scale last changed (state).
pub const LOSS_SCALE_GOOD: &str = "loss_scale.good";

/// Dynamic loss scaling, as PyTorch's `GradScaler`: the loss is multiplied by the
/// scale before the backward pass and the gradients divided by it after; a step whose
/// gradients are not all finite changes no weight or optimizer state and multiplies
/// the scale by `backoff`; after `growth_interval` finite steps in a row the scale is
/// multiplied by `growth`. (The step count Adam's bias correction reads is the
/// host's, which counts skipped steps too, where PyTorch's does not.)
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossScale {
    /// The first scale (`GradScaler`'s 65536).
    pub init: f64,
    /// Finite steps before the scale grows (2000).
    pub growth_interval: usize,
    /// Its growth (2).
    pub growth: f64,
    /// Its backoff after a non-finite step (0.5).
    pub backoff: f64,
}

impl Default for LossScale {
    fn default() -> LossScale {
        LossScale { init: 65536.0, growth_interval: 2000, growth: 2.0, backoff: 0.5 }
    }
}

impl TrainStep {
    /// Builds the step that trains `wrt` (float parameters of `program`) to lower
    /// `loss` (a float scalar of `program`) with `optimizer`.
    pub fn new(
        program: &Program,
        loss: Value,
        wrt: &[Value],
        optimizer: Optimizer,
    ) -> Result<TrainStep> {
        TrainStep::clipped(program, loss, wrt, optimizer, None)
    }

    /// [`new`](Self::new), the gradients first clipped to global norm `max_norm` as
    /// PyTorch's `clip_grad_norm_` does: with `n = sqrt(Σ sum(g²))` over every trained
    /// parameter's gradient, each `g` becomes `g · min(1, max_norm / (n + 1e-6))`.
    pub fn clipped(
        program: &Program,
        loss: Value,
        wrt: &[Value],
        optimizer: Optimizer,
        max_norm: Option<f64>,
    ) -> Result<TrainStep> {
        let options = StepOptions { max_norm, ..StepOptions::default() };
        TrainStep::with_options(program, loss, wrt, optimizer, &options)
    }

    /// The step with `options`: clipping, gradient accumulation over micro-batches
    /// and rematerialized regions ([`StepOptions`]).
    ///
    /// With `micro_batches = N > 1`, `program` is the loss of **one micro-batch**: every
    /// parameter not in `wrt` (the batch) becomes `N` parameters named
    /// `micro.{i}.{name}`, and the step computes the gradient of each micro-batch in
    /// turn (its forward and backward pass, then the next's), summing them as it goes,
    /// then takes the mean loss and the mean gradient — for a loss that is a mean over
    /// its rows, the loss and gradient of the whole batch, with one micro-batch's
    /// activations held at a time. The step's parameters: the micro-batches' in order,
    /// then the trained parameters (named as in `program`), the state, `lr`, `step`;
    /// [`trained`](Self::trained) holds the trained parameters' values in the step's
    /// program.
    pub fn with_options(
        program: &Program,
        loss: Value,
        wrt: &[Value],
        optimizer: Optimizer,
        options: &StepOptions,
    ) -> Result<TrainStep> {
        let max_norm = options.max_norm;
        if let Some(c) = max_norm
            && !(c.is_finite() && c > 0.0)
        {
            return Err(Error::Type {
                op: "clip_norm",
                at: "a training step".into(),
                operands: Vec::new(),
                problem: format!("the maximum norm {c} is not a positive number"),
            });
        }
        // With loss scaling, the loss is multiplied by the scale (a parameter) before
        // the backward pass, so every cotangent is scaled from the seed on.
        let scaled;
        let (program, loss, shared) = match options.loss_scale {
            None => (program, loss, Vec::new()),
            Some(_) => {
                let mut b = Builder::from_program(program)?;
                let dtype = b.spec(loss)?.dtype;
                let spec = TensorSpec::new(dtype, Shape::scalar());
                let scale = b.param(LOSS_SCALE, spec)?;
                let times = b.mul(loss, scale)?;
                scaled = b.finish(&[times])?;
                let scale = Value(program.params().len() as u32);
                (&scaled, scaled.results()[0], vec![scale])
            }
        };
        if let Some(f) = options.frozen.iter().find(|f| {
            wrt.contains(f) || f.index() >= program.params().len().saturating_sub(shared.len())
        }) {
            return Err(Error::Type {
                op: "frozen",
                at: "a training step".into(),
                operands: Vec::new(),
                problem: format!("parameter {} is trained, or not the model program's", f.0),
            });
        }
        let frozen_names: Vec<String> =
            options.frozen.iter().map(|f| program.params()[f.index()].name.clone()).collect();
        let one = meshwork_program::grad_remat(program, loss, wrt, &options.remat)?;
        let (g, wrt, shared) = if options.micro_batches > 1 {
            // The frozen parameters are held once, shared by the micro-batches.
            let held: Vec<Value> = shared.iter().chain(&options.frozen).copied().collect();
            let (g, wrt, held) = accumulate(&one, wrt, &held, options.micro_batches)?;
            (g, wrt, held[..shared.len()].to_vec())
        } else {
            (one, wrt.to_vec(), shared)
        };
        let wrt = &wrt[..];
        let program = &g;
        let mut b = Builder::from_program(program)?;
        let dtype = program.spec(program.results()[0]).expect("the loss").dtype;
        // The loss and gradients, unscaled; whether every gradient is finite.
        let mut grads: Vec<Value> = program.results()[1..].to_vec();
        let mut loss_out = program.results()[0];
        let mut finite = None;
        if let Some(&scale) = shared.first() {
            loss_out = b.div(loss_out, scale)?;
            let zero = b.constant(0.0, dtype)?;
            let mut total = zero;
            for gw in &mut grads {
                *gw = b.div(*gw, scale)?;
                // inf · 0 and NaN · 0 are NaN: the sum is NaN unless all are finite.
                let z = b.mul(*gw, zero)?;
                let rank = b.spec(z)?.shape.rank() as isize;
                let axes: Vec<isize> = (0..rank).collect();
                let s = b.reduce_sum(z, &axes, false)?;
                total = b.add(total, s)?;
            }
            finite = Some(b.eq(total, total)?);
        }
        // The gradients' global norm (for clipping, and as a result when asked).
        let mut norm = None;
        if max_norm.is_some() || options.grad_norm {
            let mut total = None;
            for &gw in &grads {
                let sq = b.mul(gw, gw)?;
                let rank = b.spec(gw)?.shape.rank() as isize;
                let axes: Vec<isize> = (0..rank).collect();
                let s = b.reduce_sum(sq, &axes, false)?;
                total = Some(match total {
                    None => s,
                    Some(t) => b.add(t, s)?,
                });
            }
            norm = match total {
                Some(total) => Some(b.sqrt(total)?),
                None => Some(b.constant(0.0, dtype)?),
            };
        }
        // The gradients, clipped.
        if let Some(max_norm) = max_norm
            && let Some(norm) = norm.filter(|_| !grads.is_empty())
        {
            let tiny = b.constant(1e-6, dtype)?;
            let den = b.add(norm, tiny)?;
            let c = b.constant(max_norm, dtype)?;
            let coef = b.div(c, den)?;
            let one = b.constant(1.0, dtype)?;
            let factor = b.min(coef, one)?;
            for gw in &mut grads {
                *gw = b.mul(*gw, factor)?;
            }
        }
        let names = optimizer.state_names();
        let mut state = Vec::new();
        for &w in wrt {
            let p = &program.params()[w.index()];
            for s in names {
                // Slots live where their parameter does, as TensorFlow's slot variables.
                let v = b.param(&format!("optimizer.{s}.{}", p.name), p.spec.clone())?;
                state.push(b.set_device(v, &p.device)?);
            }
        }
        let scalar = TensorSpec::new(dtype, Shape::scalar());
        let lr = b.param("optimizer.lr", scalar.clone())?;
        let step = b.param("optimizer.step", scalar)?;
        let c = |b: &mut Builder, x: f64| b.constant(x, dtype);
        // Bias corrections 1 - βᵗ, t = step + 1, shared by every parameter.
        let corrections = match optimizer {
            Optimizer::Adam { beta1, beta2, .. } | Optimizer::AdamW { beta1, beta2, .. } => {
                let one = c(&mut b, 1.0)?;
                let t = b.add(step, one)?;
                let mut corr = Vec::new();
                for beta in [beta1, beta2] {
                    let bt = c(&mut b, beta)?;
                    let pow = b.pow(bt, t)?;
                    corr.push(b.sub(one, pow)?);
                }
                Some((corr[0], corr[1]))
            }
            _ => None,
        };
        let (mut new_params, mut new_state) = (Vec::new(), Vec::new());
        for (k, &w) in wrt.iter().enumerate() {
            let (p, gw) = (w, grads[k]);
            let st = &state[k * names.len()..(k + 1) * names.len()];
            // As TensorFlow's optimizers, each update is colocated with its parameter.
            let updated = b.colocate_with(p, |b| {
                Ok(match optimizer {
                    Optimizer::Sgd => {
                        let d = b.mul(lr, gw)?;
                        b.sub(p, d)?
                    }
                    Optimizer::Momentum { momentum } => {
                        let mu = c(b, momentum)?;
                        let mm = b.mul(mu, st[0])?;
                        let m = b.add(mm, gw)?;
                        new_state.push(m);
                        let d = b.mul(lr, m)?;
                        b.sub(p, d)?
                    }
                    Optimizer::Adam { beta1, beta2, eps }
                    | Optimizer::AdamW { beta1, beta2, eps, .. } => {
                        let (c1, c2) = corrections.expect("made for Adam");
                        let (b1, nb1) = (c(b, beta1)?, c(b, 1.0 - beta1)?);
                        let (b2, nb2) = (c(b, beta2)?, c(b, 1.0 - beta2)?);
                        let m0 = b.mul(b1, st[0])?;
                        let m1 = b.mul(nb1, gw)?;
                        let m = b.add(m0, m1)?;
                        let g2 = b.mul(gw, gw)?;
                        let v0 = b.mul(b2, st[1])?;
                        let v1 = b.mul(nb2, g2)?;
                        let v = b.add(v0, v1)?;
                        new_state.push(m);
                        new_state.push(v);
                        let mhat = b.div(m, c1)?;
                        let vhat = b.div(v, c2)?;
                        let root = b.sqrt(vhat)?;
                        let e = c(b, eps)?;
                        let den = b.add(root, e)?;
                        let mut upd = b.div(mhat, den)?;
                        if let Optimizer::AdamW { weight_decay, decay_1d, .. } = optimizer {
                            let rank = b.spec(p)?.shape.rank();
                            if decay_1d || rank >= 2 {
                                let wd = c(b, weight_decay)?;
                                let decay = b.mul(wd, p)?;
                                upd = b.add(upd, decay)?;
                            }
                        }
                        let d = b.mul(lr, upd)?;
                        b.sub(p, d)?
                    }
                })
            })?;
            new_params.push(updated);
        }
        // A step whose gradients are not all finite changes nothing but the scale.
        let mut scale_state = Vec::new();
        if let (Some(ok), Some(&scale), Some(ls)) = (finite, shared.first(), options.loss_scale) {
            let keep = |b: &mut Builder, new: Value, old: Value| -> Result<Value> {
                let dims = b.spec(old)?.shape.dims().to_vec();
                let pred = b.broadcast_to(ok, &dims)?;
                b.select(pred, new, old)
            };
            for (new, &old) in new_params.iter_mut().zip(wrt) {
                *new = b.colocate_with(old, |b| keep(b, *new, old))?;
            }
            for (new, &old) in new_state.iter_mut().zip(&state) {
                *new = b.colocate_with(old, |b| keep(b, *new, old))?;
            }
            let spec = TensorSpec::new(dtype, Shape::scalar());
            let good = b.param(LOSS_SCALE_GOOD, spec)?;
            let one = c(&mut b, 1.0)?;
            let good1 = b.add(good, one)?;
            let interval = c(&mut b, ls.growth_interval as f64)?;
            let grow = b.ge(good1, interval)?;
            let up = c(&mut b, ls.growth)?;
            let grown = b.mul(scale, up)?;
            let scale_ok = b.select(grow, grown, scale)?;
            let zero = c(&mut b, 0.0)?;
            let good_ok = b.select(grow, zero, good1)?;
            let down = c(&mut b, ls.backoff)?;
            let backed = b.mul(scale, down)?;
            scale_state.push(b.select(ok, scale_ok, backed)?);
            scale_state.push(b.select(ok, good_ok, zero)?);
        }
        let mut results = vec![loss_out];
        results.extend(new_params);
        results.extend(new_state);
        results.extend(scale_state);
        if options.grad_norm {
            results.push(norm.expect("computed when asked"));
        }
        let program = b.finish(&results)?.without_dead_code();
        // The loss scale's parameters go with the optimizer state, before lr and step.
        let program = match options.loss_scale {
            None => program,
            Some(_) => move_before_scalars(&program, &[LOSS_SCALE, LOSS_SCALE_GOOD])?,
        };
        let frozen = frozen_names
            .iter()
            .map(|n| {
                let k = program.params().iter().position(|p| p.name == *n).expect("kept");
                Value(k as u32)
            })
            .collect();
        Ok(TrainStep {
            program,
            trained: wrt.to_vec(),
            frozen,
            optimizer,
            loss_scale: options.loss_scale,
            grad_norm: options.grad_norm,
        })
    }

    /// The state the step carries from one step to the next, after the trained
    /// parameters: the optimizer's slots, then the loss scale and its count of good
    /// steps when it scales the loss.
    pub fn state_len(&self) -> usize {
        self.trained.len() * self.optimizer.state_names().len()
            + if self.loss_scale.is_some() { 2 } else { 0 }
    }

    /// The initial optimizer state: zeros of each state tensor's spec, in input order.
    pub fn init_state(&self) -> Result<Vec<Tensor>> {
        let n = self.program.params().len() - 2;
        let first = n - self.state_len();
        let mut state = self.program.params()[first..n]
            .iter()
            .map(|p| zeros(&p.spec))
            .collect::<Result<Vec<_>>>()?;
        if let Some(ls) = self.loss_scale {
            let k = state.len() - 2;
            let dtype = self.program.params()[first + k].spec.dtype;
            state[k] = scalar(dtype, ls.init)?;
        }
        Ok(state)
    }

    /// The scalars `lr` and `step` as the step's last two inputs.
    pub fn scalars(&self, lr: f64, step: usize) -> Result<[Tensor; 2]> {
        let dtype = self.program.params().last().expect("the step input").spec.dtype;
        Ok([scalar(dtype, lr)?, scalar(dtype, step as f64)?])
    }
}

/// How a training step computes its gradients, beyond the optimizer.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepOptions {
    /// Clip the gradients to this global norm first (PyTorch's `clip_grad_norm_`).
    pub max_norm: Option<f64>,
    /// Micro-batches whose gradients are accumulated into one step (0 or 1: none).
    pub micro_batches: usize,
    /// Ranges of the loss program's instructions whose activations the backward pass
    /// recomputes ([`meshwork_program::grad_remat`]): a transformer's blocks.
    pub remat: Vec<std::ops::Range<usize>>,
    /// Dynamic loss scaling (for f16 products).
    pub loss_scale: Option<LossScale>,
    /// Parameters of the model program that are neither trained nor fed per
    /// micro-batch: a frozen base under a LoRA adapter, held once.
    pub frozen: Vec<Value>,
    /// Return the gradients' global norm `sqrt(Σ sum(g²))` over every trained
    /// parameter (before clipping; unscaled under loss scaling) as the step's last
    /// result, after the state: what `transformers`' `Trainer` logs as `grad_norm`.
    pub grad_norm: bool,
}

/// The accumulated gradient program of `n` micro-batches from `one`'s (parameters:
/// the model's; results: the loss, then the gradient of each of `wrt`): each
/// parameter not in `wrt` repeated per micro-batch (`micro.{i}.{name}`), then the
/// `wrt` parameters; each micro-batch's pass copied in turn with its loss and
/// gradients added to the running sums right after it, the sums divided by `n` at the
/// end. Returns the program and the `wrt` parameters' values in it.
fn accumulate(
    one: &Program,
    wrt: &[Value],
    shared: &[Value],
    n: usize,
) -> Result<(Program, Vec<Value>, Vec<Value>)> {
    let mut b = Builder::new();
    let params = one.params();
    let trained = |k: usize| wrt.iter().chain(shared).any(|w| w.index() == k);
    let mut fed = vec![Vec::new(); n];
    for (i, fed) in fed.iter_mut().enumerate() {
        for (k, p) in params.iter().enumerate() {
            if !trained(k) {
                let v = b.param(&format!("micro.{i}.{}", p.name), p.spec.clone())?;
                fed.push((k, b.set_device(v, &p.device)?));
            }
        }
    }
    let mut weights = Vec::with_capacity(wrt.len() + shared.len());
    for &w in wrt.iter().chain(shared) {
        let p = &params[w.index()];
        let v = b.param(&p.name, p.spec.clone())?;
        weights.push(b.set_device(v, &p.device)?);
    }
    let mut sums: Vec<Value> = Vec::new();
    for (i, fed) in fed.iter().enumerate() {
        let mut map: Vec<Option<Value>> = vec![None; one.num_values()];
        for &(k, v) in fed {
            map[k] = Some(v);
        }
        for (w, &v) in wrt.iter().chain(shared).zip(&weights) {
            map[w.index()] = Some(v);
        }
        let at = |map: &[Option<Value>], v: &Value| map[v.index()].expect("defined earlier");
        for (j, instr) in one.instrs().iter().enumerate() {
            let args: Vec<Value> = instr.args.iter().map(|a| at(&map, a)).collect();
            let with: Vec<Value> = instr.colocate.iter().map(|c| at(&map, c)).collect();
            let name = instr.name.as_ref().map(|n| format!("micro.{i}.{n}"));
            map[params.len() + j] = Some(b.push_copy(instr, &args, &with, name.as_deref())?);
        }
        let outs: Vec<Value> = one.results().iter().map(|r| at(&map, r)).collect();
        if sums.is_empty() {
            sums = outs;
        } else {
            // Each sum beside its micro-batch's value (a gradient where its weight is).
            for (s, o) in sums.iter_mut().zip(outs) {
                *s = b.colocate_with(o, |b| b.add(*s, o))?;
            }
        }
    }
    let dtype = b.spec(sums[0])?.dtype;
    let count = b.constant(n as f64, dtype)?;
    let mut results = Vec::with_capacity(sums.len());
    for s in sums {
        results.push(b.colocate_with(s, |b| b.div(s, count))?);
    }
    let program = b.finish(&results)?;
    let first = n * (params.len() - wrt.len() - shared.len());
    let at = |k: usize| Value((first + k) as u32);
    let wrt_out = (0..wrt.len()).map(at).collect();
    let shared_out = (wrt.len()..wrt.len() + shared.len()).map(at).collect();
    Ok((program, wrt_out, shared_out))
}

/// `program` with the parameters named `names` moved to just before its last two
/// (`optimizer.lr`, `optimizer.step`), in that order.
fn move_before_scalars(program: &Program, names: &[&str]) -> Result<Program> {
    let params = program.params();
    let moved: Vec<usize> =
        names.iter().filter_map(|n| params.iter().position(|p| p.name == *n)).collect();
    let mut order: Vec<usize> = (0..params.len()).filter(|k| !moved.contains(k)).collect();
    let at = order.len() - 2;
    order.splice(at..at, moved);
    let mut b = Builder::new();
    let mut map = vec![Value(0); program.num_values()];
    for &k in &order {
        let p = &params[k];
        let v = b.param(&p.name, p.spec.clone())?;
        map[k] = b.set_device(v, &p.device)?;
    }
    for (i, instr) in program.instrs().iter().enumerate() {
        let args: Vec<Value> = instr.args.iter().map(|a| map[a.index()]).collect();
        let with: Vec<Value> = instr.colocate.iter().map(|c| map[c.index()]).collect();
        map[params.len() + i] = b.push_copy(instr, &args, &with, instr.name.as_deref())?;
    }
    let results: Vec<Value> = program.results().iter().map(|r| map[r.index()]).collect();
    b.finish(&results)
}

/// Zeros of `spec` (f32 or f64): an allocation the allocator cannot give is an error,
/// not an abort.
fn zeros(spec: &TensorSpec) -> Result<Tensor> {
    match spec.dtype {
        DType::F32 | DType::F64 => Ok(Tensor::zeros(spec.dtype, spec.shape.dims())?),
        other => Err(Error::UnsupportedDType { at: "optimizer state".into(), dtype: other }),
    }
}

fn scalar(dtype: DType, x: f64) -> Result<Tensor> {
    Ok(match dtype {
        DType::F32 => Tensor::f32(&[], vec![x as f32]),
        _ => Tensor::f64(&[], vec![x]),
    }?)
}
