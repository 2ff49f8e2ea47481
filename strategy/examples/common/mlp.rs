//! The main job's MLP written by hand on [`Strategy::run_steps`]: forward, backward and
//! SGD in ndarray on each device of a `data × model` mesh — the batch split over the
//! data axis, the hidden layer over the model axis (W1 by columns, b1 with it, W2 by
//! rows, b2 replicated), gradients all-reduced across replicas, per-step losses
//! streamed to the host through the outfeed.
//!
//! It is an example of the façade's closure API, and the independent oracle the
//! program layer's MLP (`meshwork-nn`, trained by `meshwork-train`) is tested against:
//! its gradients are derived by hand, not by autodiff. It is included by path (`mod
//! mlp;`) from the examples that measure it and the tests that compare with it.
//!
//! `h = relu(x·W1 + b1)`, `z = h·W2 + b2`, loss = mean softmax cross-entropy over the
//! global batch. In f64 every mesh gives the single-device losses to within rounding
//! (the sums only group differently).

#![allow(dead_code, unreachable_pub)]

use std::collections::BTreeMap;
use std::ops::ControlFlow;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use meshwork_strategy::types::{DType, ReduceOp, Tensor};
use meshwork_strategy::{
    Arg, DeviceAssignment, Layout, MetricEvent, MetricSpec, Remainder, Strategy, StrategyContext,
    Topology, Variable, VariableOptions,
};
use ndarray::{Array1, Array2, ArrayD, Axis, Ix1, Ix2, NdFloat};

/// What goes wrong: the strategy's errors, or a message.
pub type Error = Box<dyn std::error::Error>;
/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

/// A classification dataset: rows of features and their class ids.
#[derive(Debug, Clone, PartialEq)]
pub struct Dataset {
    /// `[rows, features]`.
    pub x: Array2<f64>,
    /// The class of each row, `0..classes`.
    pub labels: Vec<usize>,
    /// Number of classes.
    pub classes: usize,
}

impl Dataset {
    /// The built-in data: `rows` Gaussian points in `features` dims, labelled by the
    /// arg-max of a fixed random teacher (`classes` classes), all from `seed`.
    pub fn synthetic(seed: u64, rows: usize, features: usize, classes: usize) -> Dataset {
        let mut rng = SplitMix(seed ^ 0x6d65_7368_776f_726b);
        let x = Array2::from_shape_fn((rows, features), |_| rng.normal());
        let teacher = Array2::from_shape_fn((features, classes), |_| rng.normal());
        let scores = x.dot(&teacher);
        let labels = scores
            .outer_iter()
            .map(|row| {
                row.iter()
                    .enumerate()
                    .fold((0, f64::NEG_INFINITY), |b, (k, &v)| if v > b.1 { (k, v) } else { b })
                    .0
            })
            .collect();
        Dataset { x, labels, classes }
    }

    /// Rows.
    pub fn rows(&self) -> usize {
        self.x.nrows()
    }

    /// Features per row.
    pub fn features(&self) -> usize {
        self.x.ncols()
    }
}

/// The model's parameters (in f64; training casts them to its dtype).
#[derive(Debug, Clone, PartialEq)]
pub struct Params {
    /// `[features, hidden]`.
    pub w1: Array2<f64>,
    /// `[hidden]`.
    pub b1: Array1<f64>,
    /// `[hidden, classes]`.
    pub w2: Array2<f64>,
    /// `[classes]`.
    pub b2: Array1<f64>,
}

impl Params {
    /// Scaled Gaussian weights (`1/sqrt(fan_in)`) and zero biases, from `seed`.
    pub fn init(seed: u64, features: usize, hidden: usize, classes: usize) -> Params {
        let mut rng = SplitMix(seed ^ 0x696e_6974);
        let s1 = 1.0 / (features as f64).sqrt();
        let s2 = 1.0 / (hidden as f64).sqrt();
        Params {
            w1: Array2::from_shape_fn((features, hidden), |_| rng.normal() * s1),
            b1: Array1::zeros(hidden),
            w2: Array2::from_shape_fn((hidden, classes), |_| rng.normal() * s2),
            b2: Array1::zeros(classes),
        }
    }

    /// Hidden units.
    pub fn hidden(&self) -> usize {
        self.w1.ncols()
    }

    /// The fraction of `data`'s rows whose arg-max score is their label.
    pub fn accuracy(&self, data: &Dataset) -> f64 {
        let h = (data.x.dot(&self.w1) + &self.b1).mapv(|v| v.max(0.0));
        let z = h.dot(&self.w2) + &self.b2;
        let right =
            z.outer_iter()
                .zip(&data.labels)
                .filter(|(row, label)| {
                    let best = row.iter().enumerate().fold((0, f64::NEG_INFINITY), |b, (k, &v)| {
                        if v > b.1 { (k, v) } else { b }
                    });
                    best.0 == **label
                })
                .count();
        right as f64 / data.rows().max(1) as f64
    }
}

/// SplitMix64, with a Box–Muller normal.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn uniform(&mut self) -> f64 {
        ((self.next() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    fn normal(&mut self) -> f64 {
        let (u, v) = (self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }
}

/// How to train.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainConfig {
    /// Data-parallel replicas (`D` of `DxM`).
    pub data: usize,
    /// Model-parallel logical devices per replica (`M`).
    pub model: usize,
    /// Total steps.
    pub steps: usize,
    /// The global batch.
    pub batch: usize,
    /// The learning rate.
    pub lr: f64,
    /// f32 or f64.
    pub dtype: DType,
    /// Step `s` takes rows `s·B … s·B+B−1` (mod the dataset) in order, or, if set, in a
    /// per-epoch permutation drawn from this seed.
    pub shuffle: Option<u64>,
    /// Steps per host call.
    pub steps_per_run: usize,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            data: 2,
            model: 2,
            steps: 200,
            batch: 64,
            lr: 0.5,
            dtype: DType::F64,
            shuffle: None,
            steps_per_run: 1,
        }
    }
}

/// What a training run did.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainReport {
    /// The global loss of every step, as streamed by the replicas.
    pub losses: Vec<f64>,
    /// The parameters at the end.
    pub params: Params,
    /// Wall time of the steps.
    pub elapsed: Duration,
    /// Whether `progress` stopped the run before its last step.
    pub stopped: bool,
}

/// One progress report: after the host call that ended with `step`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Progress {
    /// Steps done (of `total`).
    pub done: usize,
    /// The total.
    pub total: usize,
    /// The last step's global loss.
    pub loss: f64,
    /// Samples per second so far.
    pub samples_per_sec: f64,
}

const LOSS: u32 = 1;

/// The rows of step `s`.
fn step_rows(s: usize, batch: usize, rows: usize, shuffle: Option<u64>) -> Vec<usize> {
    // A step spans at most a few epochs; draw each one's permutation once.
    let mut drawn: Vec<(usize, Vec<usize>)> = Vec::new();
    (0..batch)
        .map(|i| {
            let k = s * batch + i;
            let (epoch, at) = (k / rows, k % rows);
            match shuffle {
                None => at,
                Some(seed) => {
                    if !drawn.iter().any(|(e, _)| *e == epoch) {
                        drawn.push((epoch, permutation(seed, epoch, rows)));
                    }
                    drawn.iter().find(|(e, _)| *e == epoch).map_or(at, |(_, p)| p[at])
                }
            }
        })
        .collect()
}

/// The row order of epoch `epoch` of `n` rows when shuffling with `seed`: a
/// Fisher–Yates shuffle driven by SplitMix64. Every trainer of meshwork reads shuffled
/// rows in this order, so runs of the same seed see the same batches.
pub fn permutation(seed: u64, epoch: usize, n: usize) -> Vec<usize> {
    let mut rng = SplitMix(seed ^ (epoch as u64).wrapping_mul(0x2545_f491_4f6c_dd1d));
    let mut p: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        p.swap(i, (rng.next() % (i as u64 + 1)) as usize);
    }
    p
}

/// Element types the model trains in.
trait Real: NdFloat {
    fn tensor(a: ArrayD<Self>) -> Tensor;
    fn array(t: Tensor) -> Option<ArrayD<Self>>;
    fn of(x: f64) -> Self;
    fn f64(self) -> f64;
}

macro_rules! real {
    ($t:ty, $v:ident) => {
        impl Real for $t {
            fn tensor(a: ArrayD<$t>) -> Tensor {
                Tensor::$v(a)
            }
            fn array(t: Tensor) -> Option<ArrayD<$t>> {
                match t {
                    Tensor::$v(a) => Some(a),
                    _ => None,
                }
            }
            fn of(x: f64) -> $t {
                x as $t
            }
            fn f64(self) -> f64 {
                self as f64
            }
        }
    };
}

real!(f32, F32);
real!(f64, F64);

fn bad(what: &str) -> Error {
    format!("{what} has an unexpected dtype or rank").into()
}

/// A value of a device's step that is not what the model wrote.
fn unexpected(what: &str) -> meshwork_strategy::Error {
    meshwork_strategy::Error::Variable {
        variable: what.into(),
        problem: "has an unexpected dtype or rank".into(),
    }
}

fn mat<T: Real>(t: Tensor, what: &str) -> meshwork_strategy::Result<Array2<T>> {
    T::array(t).and_then(|a| a.into_dimensionality::<Ix2>().ok()).ok_or_else(|| unexpected(what))
}

fn vec1<T: Real>(t: Tensor, what: &str) -> meshwork_strategy::Result<Array1<T>> {
    T::array(t).and_then(|a| a.into_dimensionality::<Ix1>().ok()).ok_or_else(|| unexpected(what))
}

fn cast<T: Real, D: ndarray::Dimension>(a: &ndarray::Array<f64, D>) -> Tensor {
    T::tensor(a.mapv(T::of).into_dyn())
}

/// The variables of the model.
#[derive(Clone)]
struct Vars {
    w1: Variable,
    b1: Variable,
    w2: Variable,
    b2: Variable,
}

/// One device's step: forward on its rows and hidden units, backward, gradients summed
/// over replicas, SGD update; streams the replica's loss sum and returns it.
fn step<T: Real>(
    ctx: &StrategyContext<'_>,
    args: &[Tensor],
    v: &Vars,
    lr: f64,
    batch: usize,
) -> meshwork_strategy::Result<Vec<Tensor>> {
    let x: Array2<T> = mat(args[0].clone(), "x")?;
    let y: Array2<T> = mat(args[1].clone(), "y")?;
    let (w1, b1) = (mat::<T>(ctx.read(&v.w1)?, "w1")?, vec1::<T>(ctx.read(&v.b1)?, "b1")?);
    let (w2, b2) = (mat::<T>(ctx.read(&v.w2)?, "w2")?, vec1::<T>(ctx.read(&v.b2)?, "b2")?);
    let zero = T::zero();
    let pre = x.dot(&w1) + &b1;
    let h = pre.mapv(|a| a.max(zero));
    let partial = T::tensor(h.dot(&w2).into_dyn());
    let z = mat::<T>(ctx.all_reduce_logical(ReduceOp::Sum, partial)?, "z")? + &b2;
    // log-softmax by rows.
    let max = z.map_axis(Axis(1), |r| r.iter().fold(T::neg_infinity(), |m, &a| m.max(a)));
    let shifted = &z - &max.insert_axis(Axis(1));
    let log_sum = shifted.mapv(|a| a.exp()).sum_axis(Axis(1)).mapv(|s| s.ln());
    let log_p = &shifted - &log_sum.insert_axis(Axis(1));
    let loss = -(&y * &log_p).sum();
    let global_step = match &args[2] {
        Tensor::I64(a) => a.iter().next().copied().unwrap_or(0) as u64,
        _ => return Err(unexpected("step")),
    };
    ctx.emit(LOSS, global_step, &[Tensor::F64(ndarray::arr0(loss.f64()).into_dyn())])?;
    // Backward, for the mean over the global batch.
    let dz = (log_p.mapv(|a| a.exp()) - &y) / T::of(batch as f64);
    let dw2 = h.t().dot(&dz);
    let db2 = dz.sum_axis(Axis(0));
    let dh = dz.dot(&w2.t());
    let dpre = dh * &pre.mapv(|a| if a > zero { T::one() } else { zero });
    let dw1 = x.t().dot(&dpre);
    let db1 = dpre.sum_axis(Axis(0));
    let lr = T::of(lr);
    // Sum each gradient over the replicas, then step; in static dims (fast loops).
    macro_rules! sgd {
        ($var:expr, $value:expr, $grad:expr) => {{
            let mut value = $value;
            let summed = T::array(ctx.all_reduce(ReduceOp::Sum, T::tensor($grad.into_dyn()))?)
                .and_then(|g| g.into_shape_with_order(value.raw_dim()).ok())
                .ok_or_else(|| unexpected("gradient"))?;
            value.zip_mut_with(&summed, |w, &g| *w -= g * lr);
            ctx.assign($var, T::tensor(value.into_dyn()))?;
        }};
    }
    sgd!(&v.w1, w1, dw1);
    sgd!(&v.b1, b1, db1);
    sgd!(&v.w2, w2, dw2);
    sgd!(&v.b2, b2, db2);
    Ok(vec![Tensor::F64(ndarray::arr0(loss.f64()).into_dyn())])
}

/// Trains on `data` from `init`, calling `progress` after every host call; `progress`
/// returning `Break` stops the run after that call.
pub fn train(
    config: &TrainConfig,
    data: &Dataset,
    init: &Params,
    progress: &mut dyn FnMut(Progress) -> ControlFlow<()>,
) -> Result<TrainReport> {
    match config.dtype {
        DType::F32 => train_as::<f32>(config, data, init, progress),
        DType::F64 => train_as::<f64>(config, data, init, progress),
        other => Err(format!("the MLP trains in f32 or f64, not {other}").into()),
    }
}

fn train_as<T: Real>(
    config: &TrainConfig,
    data: &Dataset,
    init: &Params,
    progress: &mut dyn FnMut(Progress) -> ControlFlow<()>,
) -> Result<TrainReport> {
    let (d, m) = (config.data, config.model);
    let topology = Topology::new(vec![d * m], m)?;
    let assignment = DeviceAssignment::build(&topology, &[m], None)?;
    // Per step: each replica's loss sum, kept by replica so the global loss is summed
    // in replica order (bit-reproducible whatever order the streams arrive in).
    let losses: Arc<Mutex<Losses>> = Arc::default();
    let log = losses.clone();
    let spec = MetricSpec { id: LOSS, name: "loss".into(), specs: vec!["f64[]".parse()?] };
    let strategy = Strategy::new(assignment)?.with_metrics(
        &[spec],
        Arc::new(move |e: &MetricEvent| {
            if let Some(Tensor::F64(a)) = e.tensors.first() {
                let mut l = log.lock().unwrap_or_else(|p| p.into_inner());
                record(&mut l, e.step, e.replica, d, a.iter().next().copied().unwrap_or(f64::NAN));
            }
        }),
    )?;
    let split =
        |dims: Vec<usize>| VariableOptions { layout: Layout::Split(dims), ..Default::default() };
    let vars = Vars {
        w1: strategy.create_variable("w1", cast::<T, _>(&init.w1), split(vec![1, m]))?,
        b1: strategy.create_variable("b1", cast::<T, _>(&init.b1), split(vec![m]))?,
        w2: strategy.create_variable("w2", cast::<T, _>(&init.w2), split(vec![m, 1]))?,
        b2: strategy.create_variable("b2", cast::<T, _>(&init.b2), VariableOptions::default())?,
    };
    let (batch, lr) = (config.batch, config.lr);
    let onehot = |rows: &[usize]| {
        Array2::from_shape_fn((rows.len(), data.classes), |(i, k)| {
            f64::from(u8::from(data.labels[rows[i]] == k))
        })
    };
    let per_run = config.steps_per_run.max(1);
    let started = Instant::now();
    let mut s = 0;
    while s < config.steps {
        let n = per_run.min(config.steps - s);
        let mut steps = Vec::with_capacity(n);
        for k in s..s + n {
            let rows = step_rows(k, batch, data.rows(), config.shuffle);
            let x = data.x.select(Axis(0), &rows);
            let global = vec![cast::<T, _>(&x), cast::<T, _>(&onehot(&rows))];
            let split = strategy.distribute_dataset(vec![global], Remainder::Drop).next();
            let split = split.ok_or("an empty batch")??;
            let mut args = split.args;
            args.push(Arg::Shared(Tensor::I64(ndarray::arr0(k as i64).into_dyn())));
            steps.push(args);
        }
        let v = vars.clone();
        strategy.run_steps(move |ctx, args| step::<T>(ctx, args, &v, lr, batch), &steps)?;
        strategy.flush_metrics(Duration::from_secs(60))?;
        s += n;
        let loss = global_loss(&losses, s as u64 - 1, d, batch)?;
        let secs = started.elapsed().as_secs_f64().max(1e-9);
        let flow = progress(Progress {
            done: s,
            total: config.steps,
            loss,
            samples_per_sec: (s * batch) as f64 / secs,
        });
        if flow.is_break() {
            break;
        }
    }
    let elapsed = started.elapsed();
    let stopped = s < config.steps;
    let losses =
        (0..s as u64).map(|k| global_loss(&losses, k, d, batch)).collect::<Result<Vec<_>>>()?;
    let read = |v: &Variable| -> Result<ArrayD<f64>> {
        match strategy.read_variable(v)? {
            Tensor::F32(a) => Ok(a.mapv(f64::from)),
            Tensor::F64(a) => Ok(a),
            _ => Err(bad(v.name())),
        }
    };
    let two = |a: ArrayD<f64>, what: &str| a.into_dimensionality::<Ix2>().map_err(|_| bad(what));
    let one = |a: ArrayD<f64>, what: &str| a.into_dimensionality::<Ix1>().map_err(|_| bad(what));
    let params = Params {
        w1: two(read(&vars.w1)?, "w1")?,
        b1: one(read(&vars.b1)?, "b1")?,
        w2: two(read(&vars.w2)?, "w2")?,
        b2: one(read(&vars.b2)?, "b2")?,
    };
    Ok(TrainReport { losses, params, elapsed, stopped })
}

/// Per step, each replica's loss sum (`None` until it arrives).
type Losses = BTreeMap<u64, Vec<Option<f64>>>;

/// Keeps replica `replica`'s loss sum of step `step` (of `replicas`), whatever order
/// the replicas' streams deliver in.
fn record(losses: &mut Losses, step: u64, replica: usize, replicas: usize, sum: f64) {
    let entry = losses.entry(step).or_insert_with(|| vec![None; replicas]);
    if let Some(slot) = entry.get_mut(replica) {
        *slot = Some(sum);
    }
}

/// The global loss of step `k`, from the replicas' streamed loss sums, added in replica
/// order.
fn global_loss(losses: &Mutex<Losses>, k: u64, replicas: usize, batch: usize) -> Result<f64> {
    let l = losses.lock().unwrap_or_else(|p| p.into_inner());
    let sums = l.get(&k).map(|v| v.iter().flatten().copied().collect::<Vec<f64>>());
    match sums {
        Some(sums) if sums.len() == replicas => {
            Ok(sums.iter().fold(0.0, |acc, &x| acc + x) / batch as f64)
        }
        other => Err(format!(
            "step {k}: {} of {replicas} replica losses arrived",
            other.map_or(0, |o| o.len())
        )
        .into()),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::{Losses, global_loss, record};

    /// Sums whose total depends on the order they are added in, arriving out of
    /// replica order: the global loss is the replica-order sum, bit for bit.
    #[test]
    fn the_global_loss_adds_replicas_in_replica_order_whatever_the_arrival_order() {
        let sums = [1e16, 1.0, -1e16];
        let replica_order = ((0.0 + sums[0]) + sums[1]) + sums[2];
        let arrival_order = ((0.0 + sums[2]) + sums[0]) + sums[1];
        assert_ne!(replica_order, arrival_order, "the data must tell orders apart");
        let mut losses = Losses::new();
        for r in [2, 0, 1] {
            record(&mut losses, 7, r, 3, sums[r]);
        }
        let got = global_loss(&Mutex::new(losses), 7, 3, 1).unwrap();
        assert_eq!(got.to_bits(), replica_order.to_bits());
        // A step some replica has not reported yet is an error, not a partial sum.
        let mut partial = Losses::new();
        record(&mut partial, 1, 0, 3, 1.0);
        assert!(global_loss(&Mutex::new(partial), 1, 3, 1).is_err());
    }
}
