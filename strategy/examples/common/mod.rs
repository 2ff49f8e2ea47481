//! What the strategy's benchmark examples share: medians, a deterministic noise
//! stream, and the benchmark transformer's initial weights and token batches (the
//! reference run's initialisation scales).

#![allow(dead_code)]

use std::time::Instant;

use meshwork_nn as nn;
use meshwork_nn::Optimizer;
use meshwork_program::{Builder, Program, Tensor, Value};
use meshwork_strategy::Strategy;
use meshwork_strategy::partition::Shardings;
use meshwork_strategy::types::{DType, Shape, TensorSpec};

/// The median of `v` (the upper one of an even count).
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// A deterministic standard-normal-ish stream (sum of uniforms), scaled.
/// The benchmarks' inputs: SplitMix64, the stream meshwork's trainer draws from
/// (`meshwork_train::rng::SplitMix`, which these examples sit below), seeded by the
/// wrapped value.
pub(crate) struct Noise(pub(crate) u64);

impl Noise {
    pub(crate) fn uniform(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
    pub(crate) fn normal(&mut self) -> f64 {
        (0..4).map(|_| self.uniform()).sum::<f64>() * 3f64.sqrt() - 2.0 * 3f64.sqrt()
    }
    pub(crate) fn f32s(&mut self, n: usize, scale: f64, shift: f64) -> Vec<f32> {
        (0..n).map(|_| (shift + scale * self.normal()) as f32).collect()
    }
}

pub(crate) fn spec(dims: &[usize], dtype: DType) -> TensorSpec {
    TensorSpec::new(dtype, Shape::new(dims).expect("a small shape"))
}

/// The benchmark transformer: V256 T128 D256 H8 L4 F1024.
pub(crate) const TRANSFORMER: nn::Transformer =
    nn::Transformer { vocab: 256, seq: 128, dim: 256, heads: 8, layers: 4, ffn: 1024 };

/// Initial f32 values of a transformer program's weights (every parameter after the
/// first, the rows), at the reference run's scales.
pub(crate) fn transformer_init(
    program: &Program,
    noise: &mut Noise,
) -> Result<Vec<(String, Tensor)>, meshwork_program::Error> {
    program.params()[1..]
        .iter()
        .map(|p| {
            let d = p.spec.shape.dims();
            let n = p.spec.shape.num_elements();
            let fan_in = d[0] as f64;
            let name = p.name.as_str();
            let v = if name == "embed" {
                noise.f32s(n, 0.5, 0.0)
            } else if name == "pos" {
                noise.f32s(n, 0.1, 0.0)
            } else if name.ends_with(".scale") {
                noise.f32s(n, if name.starts_with("ln_f") { 0.0 } else { 0.1 }, 1.0)
            } else if name.ends_with(".bias") {
                noise.f32s(n, if name.starts_with("ln_f") { 0.0 } else { 0.1 }, 0.0)
            } else if name.ends_with(".b1") || name.ends_with(".b2") {
                vec![0.0; n]
            } else {
                noise.f32s(n, 1.0 / fan_in.sqrt(), 0.0)
            };
            Ok((p.name.clone(), Tensor::f32(d, v)?))
        })
        .collect()
}

/// `steps` batches of `batch` token rows `[batch, seq + 1]`, cycling through
/// `rows_total` random rows.
pub(crate) fn token_batches(
    model: &nn::Transformer,
    batch: usize,
    rows_total: usize,
    steps: usize,
    noise: &mut Noise,
) -> Result<Vec<Tensor>, meshwork_program::Error> {
    let width = model.seq + 1;
    let vocab = model.vocab as f64;
    let tokens: Vec<i32> = (0..rows_total * width)
        .map(|_| (noise.uniform() * vocab) as i32 % model.vocab as i32)
        .collect();
    (0..steps)
        .map(|s| {
            let mut rows = Vec::with_capacity(batch * width);
            for i in 0..batch {
                let r = (s * batch + i) % rows_total;
                rows.extend_from_slice(&tokens[r * width..(r + 1) * width]);
            }
            Ok(Tensor::i32(&[batch, width], rows)?)
        })
        .collect()
}

/// Runs a JAX script of `strategy/benches/jax/`, returning its stdout lines, or `None`
/// when JAX is absent.
pub(crate) fn jax(script: &str, args: &[&str]) -> Option<Vec<String>> {
    let path = format!("{}/benches/jax/{script}", env!("CARGO_MANIFEST_DIR"));
    let out = std::process::Command::new("python3").arg(&path).args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).lines().map(String::from).collect())
}

/// JAX's figure for mesh `DxM`: the number after the mesh on its line.
pub(crate) fn jax_figure(lines: &Option<Vec<String>>, d: usize, m: usize) -> Option<f64> {
    let key = format!("{d}x{m}");
    let line = lines.as_ref()?.iter().find(|l| l.split_whitespace().next() == Some(&key))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// A model to train: its loss program, trained weights with their initial values,
/// optimizer, batches and learning rate; `per_step` items (tokens or samples) a step.
pub(crate) struct Model {
    pub(crate) program: Program,
    pub(crate) loss: Value,
    pub(crate) weights: Vec<Value>,
    pub(crate) optimizer: Optimizer,
    pub(crate) init: Vec<(String, Tensor)>,
    pub(crate) batches: Vec<Vec<Tensor>>,
    pub(crate) lr: f64,
    pub(crate) per_step: usize,
}

/// Times the model's steps compiled over `shardings`: 1 untimed and 5 timed runs from
/// the same initial state; returns the median rate, the bytes a step moves and the
/// collectives it runs.
pub(crate) fn time_runs(
    strategy: &Strategy,
    model: &Model,
    shardings: &Shardings,
) -> Result<(f64, u64, (usize, usize)), meshwork_strategy::Error> {
    let mut step = strategy.compile_train_step(
        &model.program,
        model.loss,
        &model.weights,
        model.optimizer,
        shardings,
    )?;
    let moved = step.compiled().partitioned().bytes_moved();
    let collectives = (
        step.compiled().partitioned().collectives().len(),
        step.compiled().partitioned().launches(),
    );
    let mut rates = Vec::new();
    for run in 0..6 {
        for (name, t) in &model.init {
            step.set(name, t)?;
        }
        step.reset_optimizer()?;
        let t0 = Instant::now();
        for b in &model.batches {
            step.step(b, model.lr)?;
        }
        let dt = t0.elapsed().as_secs_f64();
        if run > 0 {
            rates.push((model.batches.len() * model.per_step) as f64 / dt);
        }
    }
    Ok((median(rates), moved, collectives))
}

/// The benchmark transformer's training: `batch` rows a step, `steps` steps a run,
/// Adam at lr 1e-3, f32.
pub(crate) fn transformer_model(
    batch: usize,
    steps: usize,
) -> Result<Model, Box<dyn std::error::Error>> {
    let model = TRANSFORMER;
    let rows_total = 512;
    let mut b = Builder::new();
    let rows = b.param("rows", spec(&[batch, model.seq + 1], DType::I32))?;
    let loss = model.loss(&mut b, rows, DType::F32)?;
    let program = b.finish(&[loss])?;
    let weights: Vec<Value> = (1..program.params().len()).map(|k| Value(k as u32)).collect();
    let mut noise = Noise(0x9e37_79b9_7f4a_7c15);
    let init = transformer_init(&program, &mut noise)?;
    let batches: Vec<Vec<Tensor>> = token_batches(&model, batch, rows_total, steps, &mut noise)?
        .into_iter()
        .map(|t| vec![t])
        .collect();

    let train = Model {
        program: program.clone(),
        loss,
        weights,
        optimizer: Optimizer::adam(),
        init,
        batches,
        lr: 1e-3,
        per_step: batch * model.seq,
    };
    Ok(train)
}
