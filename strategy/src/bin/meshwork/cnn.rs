//! `meshwork train --model cnn`: two convolutions with ReLU and a linear head on NHWC
//! images, trained data-parallel on a mesh's data axis (the weights replicated), with
//! a check against one device.

use std::time::Instant;

use meshwork_program::nn::{self};
use meshwork_program::{Builder, Padding, Program, Tensor, Value};
use meshwork_strategy::Strategy;
use meshwork_strategy::sharding::Mesh;
use meshwork_strategy::spmd::Shardings;
use meshwork_strategy::types::{DType, Shape, TensorSpec};

use crate::args::{self, Args, Exit, Usage, outln};
use crate::lm::{dtype_flag, learning_rate, optimizer_flag, sparkline};
use crate::npy;
use crate::train::{check_output_file, loss_text, number_text, write_atomic};

pub(crate) const HELP: &str = "\
meshwork train --model cnn — train conv(3x3, F1) + ReLU, conv(3x3 stride 2, F2) + ReLU,
then a linear head (softmax cross-entropy) on NHWC images, data-parallel over a mesh's
data axis.

flags:
  --data-x X.npy        images [N, H, W, C] (default: built-in 8x8 one-channel images of
                        4 classes, a brighter quadrant each under noise)
  --data-y Y.npy        class ids [N]
  --filters F1,F2       (default 8,16)
  --batch B             (default 32); step s reads rows (s·B + i) mod N
  --steps N             (default 100)
  --optimizer sgd|momentum|adam|adamw   (default adam)
  --lr LR               (default 0.01 for Adam/AdamW, 0.1 otherwise)
  --warmup N, --schedule constant|cosine
  --dtype f32|f64       (default f32)
  --seed S              the built-in images and the initial weights (default 0)
  --mesh Dx1            data-parallel devices (default 1x1)
  --losses-json FILE    every step's loss as a JSON list
  --no-check            skip the comparison of every step's loss with one device
  --quiet
";

pub(crate) const VALUED: &[&str] = &[
    "model",
    "data-x",
    "data-y",
    "filters",
    "batch",
    "steps",
    "optimizer",
    "lr",
    "warmup",
    "schedule",
    "dtype",
    "seed",
    "mesh",
    "losses-json",
];
pub(crate) const SWITCHES: &[&str] = &["no-check", "quiet"];

fn usage(flag: &str, e: impl std::fmt::Display) -> Usage {
    Usage(format!("--{flag}: {e}"))
}

/// Images `[N, H, W, C]` as f64 and class ids `[N]`.
struct Images {
    dims: [usize; 4],
    x: Vec<f64>,
    y: Vec<i32>,
    classes: usize,
}

fn images(a: &Args, seed: u64) -> Result<Images, Usage> {
    let limit = 8 << 30;
    match (a.get("data-x"), a.get("data-y")) {
        (None, None) => {
            let (n, h, w) = (512, 8, 8);
            let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            let mut uniform = || {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 11) as f64 / (1u64 << 53) as f64
            };
            let mut x = Vec::with_capacity(n * h * w);
            let mut y = Vec::with_capacity(n);
            for _ in 0..n {
                let k = (uniform() * 4.0) as usize % 4;
                for r in 0..h {
                    for c in 0..w {
                        let lit = (r >= h / 2) as usize * 2 + (c >= w / 2) as usize == k;
                        x.push(if lit { 0.5 } else { 0.0 } + 2.0 * (uniform() - 0.5));
                    }
                }
                y.push(k as i32);
            }
            Ok(Images { dims: [n, h, w, 1], x, y, classes: 4 })
        }
        (Some(xp), Some(yp)) => {
            let x = npy::read(xp, limit).map_err(|e| usage("data-x", e))?;
            let [n, h, w, c] = x.shape()[..] else {
                return Err(usage(
                    "data-x",
                    format!("{xp} has shape {:?}; want [N, H, W, C]", x.shape()),
                ));
            };
            if n == 0 || h < 2 || w < 2 || c == 0 {
                return Err(usage(
                    "data-x",
                    format!("{xp}: images of shape {:?} are too small", x.shape()),
                ));
            }
            let yv = npy::read(yp, limit).map_err(|e| usage("data-y", e))?;
            if yv.shape() != [n] {
                return Err(usage(
                    "data-y",
                    format!("{yp} has shape {:?}; want [{n}]", yv.shape()),
                ));
            }
            let mut y = Vec::with_capacity(n);
            for (i, &v) in yv.iter().enumerate() {
                if v.fract() != 0.0 || !(0.0..65536.0).contains(&v) {
                    return Err(usage(
                        "data-y",
                        format!("{yp}: row {i} holds {v}, not a class id"),
                    ));
                }
                y.push(v as i32);
            }
            let classes = y.iter().copied().max().unwrap_or(0) as usize + 1;
            if classes < 2 {
                return Err(usage("data-y", format!("{yp} holds one class")));
            }
            Ok(Images { dims: [n, h, w, c], x: x.iter().copied().collect(), y, classes })
        }
        (Some(_), None) => Err(Usage("--data-x needs --data-y (the labels)".into())),
        (None, Some(_)) => Err(Usage("--data-y needs --data-x (the images)".into())),
    }
}

/// The loss program for `batch` images.
fn program(
    data: &Images,
    filters: [usize; 2],
    batch: usize,
    dtype: DType,
) -> Result<(Program, Value), meshwork_program::Error> {
    let [_, h, w, c] = data.dims;
    let mut b = Builder::new();
    let x = b.param("x", TensorSpec::new(dtype, Shape::new(&[batch, h, w, c])?))?;
    let y = b.param("y", TensorSpec::new(DType::I32, Shape::new(&[batch])?))?;
    let a = nn::conv2d(
        &mut b,
        x,
        [3, 3],
        filters[0],
        [1, 1],
        Padding::Same,
        "conv1.weight",
        "conv1.bias",
    )?;
    let a = b.relu(a)?;
    let a = nn::conv2d(
        &mut b,
        a,
        [3, 3],
        filters[1],
        [2, 2],
        Padding::Same,
        "conv2.weight",
        "conv2.bias",
    )?;
    let a = b.relu(a)?;
    let d = b.spec(a)?.shape.dims().to_vec();
    let flat = b.reshape(a, &[batch, d[1] * d[2] * d[3]])?;
    let logits = nn::linear(&mut b, flat, data.classes, "head.weight", Some("head.bias"))?;
    let loss = nn::softmax_cross_entropy(&mut b, logits, y)?;
    Ok((b.finish(&[loss])?, loss))
}

/// What a step trains: program, loss, weights, optimizer, initial values.
type What<'a> =
    (&'a Program, Value, &'a [Value], meshwork_program::Optimizer, &'a [(String, Tensor)]);

/// The training step of `what` (program, loss, weights, optimizer, initial values)
/// compiled data-parallel over `d` devices of `strategy`.
fn compile<'s>(
    strategy: &'s Strategy,
    d: usize,
    what: What<'_>,
) -> Result<meshwork_strategy::spmd::CompiledTrainStep<'s>, Exit> {
    let failed = |e: &dyn std::fmt::Display| Exit::Failed(e.to_string());
    let (prog, loss, weights, optimizer, init) = what;
    let mesh = Mesh::iota(&[("data", d)]).map_err(|e| failed(&e))?;
    let shardings = Shardings::new(mesh)
        .with("x", "P('data')")
        .and_then(|s| s.with("y", "P('data')"))
        .map_err(|e| failed(&e))?;
    let step = strategy
        .compile_train_step(prog, loss, weights, optimizer, &shardings)
        .map_err(|e| failed(&e))?;
    for (name, t) in init {
        step.set(name, t).map_err(|e| failed(&e))?;
    }
    Ok(step)
}

pub(crate) fn run(argv: &[String]) -> Result<(), Exit> {
    let a = Args::parse(argv, VALUED, SWITCHES)?;
    if let Some(p) = a.positional.first() {
        return Err(Usage(format!("train takes no positional argument ({p:?})")).into());
    }
    let (data_axis, model_axis) = args::mesh("mesh", a.get("mesh").unwrap_or("1x1"))?;
    if model_axis != 1 || data_axis > 64 {
        return Err(Usage(format!(
            "--mesh {data_axis}x{model_axis}: the CNN trains data-parallel on at most 64 devices (--mesh Dx1)"
        ))
        .into());
    }
    let steps: usize = a.parse_or("steps", 100, "a step count")?;
    let batch: usize = a.parse_or("batch", 32, "a batch size")?;
    if steps == 0 || batch == 0 || !batch.is_multiple_of(data_axis) {
        return Err(Usage(format!(
            "--steps and --batch must be at least 1, and --batch {batch} split over {data_axis} replicas"
        ))
        .into());
    }
    let filters: Vec<usize> = args::dims("filters", a.get("filters").unwrap_or("8,16"))?;
    let [f1, f2] = filters[..] else {
        return Err(Usage(format!("--filters {filters:?}: give two counts, F1,F2")).into());
    };
    let optimizer = optimizer_flag(&a)?;
    let default_lr = if matches!(
        optimizer,
        meshwork_program::Optimizer::Sgd | meshwork_program::Optimizer::Momentum { .. }
    ) {
        0.1
    } else {
        0.01
    };
    let lr: f64 = a.parse_or("lr", default_lr, "a learning rate")?;
    if !(lr.is_finite() && lr > 0.0) {
        return Err(Usage(format!("--lr {} must be a positive number", number_text(lr))).into());
    }
    let warmup: usize = a.parse_or("warmup", 0, "a step count")?;
    let cosine = match a.get("schedule").unwrap_or("constant") {
        "constant" => false,
        "cosine" => true,
        other => {
            return Err(Usage(format!("--schedule {other:?} is not constant or cosine")).into());
        }
    };
    let dtype = dtype_flag(&a)?;
    let seed: u64 = a.parse_or("seed", 0, "a seed (a whole number ≥ 0)")?;
    if let Some(p) = a.get("losses-json") {
        check_output_file("losses-json", p)?;
    }
    let quiet = a.on("quiet");
    let data = images(&a, seed)?;
    let failed = |e: &dyn std::fmt::Display| Exit::Failed(e.to_string());
    let (prog, loss) =
        program(&data, [f1, f2], batch, dtype).map_err(|e| Exit::Usage(e.to_string()))?;
    let weights: Vec<Value> = (2..prog.params().len()).map(|k| Value(k as u32)).collect();
    // He-scaled initial weights, zero biases.
    let mut state = (seed ^ 0x5851_f42d_4c95_7f2d) | 1;
    let mut normal = || {
        let mut u = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 11) as f64 / (1u64 << 53) as f64
        };
        (0..4).map(|_| u()).sum::<f64>() * 3f64.sqrt() - 2.0 * 3f64.sqrt()
    };
    let mut init = Vec::new();
    for p in &prog.params()[2..] {
        let d = p.spec.shape.dims();
        let n = p.spec.shape.num_elements();
        let fan_in = if d.len() > 1 { n / d[d.len() - 1] } else { 0 };
        let v: Vec<f64> = if fan_in == 0 {
            vec![0.0; n]
        } else {
            (0..n).map(|_| normal() * (2.0 / fan_in as f64).sqrt()).collect()
        };
        let t = match dtype {
            DType::F64 => Tensor::f64(d, v),
            _ => Tensor::f32(d, v.into_iter().map(|x| x as f32).collect()),
        }
        .map_err(|e| failed(&e))?;
        init.push((p.name.clone(), t));
    }
    let strategy = Strategy::data_parallel(data_axis).map_err(|e| failed(&e))?;
    let what = (&prog, loss, &weights[..], optimizer, &init[..]);
    let mut run = compile(&strategy, data_axis, what)?;
    let check = !a.on("no-check") && data_axis > 1;
    let one = Strategy::data_parallel(1).map_err(|e| failed(&e))?;
    let mut reference = if check { Some(compile(&one, 1, what)?) } else { None };
    let [n, h, w, c] = data.dims;
    if !quiet {
        outln!(
            "training CNN conv3x3x{f1} conv3x3x{f2}/2 linear({}) on {n} images {h}x{w}x{c} ({dtype}, {optimizer:?}, lr {}) on mesh {data_axis}x1, batch {batch}, {steps} steps",
            data.classes,
            number_text(lr)
        );
    }
    let per = h * w * c;
    let tol = if dtype == DType::F64 { 1e-9 } else { 1e-4 };
    let mut losses = Vec::with_capacity(steps);
    let mut busy = 0.0;
    let every = (steps / 10).max(1);
    for s in 0..steps {
        let mut xs = Vec::with_capacity(batch * per);
        let mut ys = Vec::with_capacity(batch);
        for i in 0..batch {
            let r = (s * batch + i) % n;
            xs.extend_from_slice(&data.x[r * per..(r + 1) * per]);
            ys.push(data.y[r]);
        }
        let x = match dtype {
            DType::F64 => Tensor::f64(&[batch, h, w, c], xs),
            _ => Tensor::f32(&[batch, h, w, c], xs.into_iter().map(|v| v as f32).collect()),
        }
        .map_err(|e| failed(&e))?;
        let y = Tensor::i32(&[batch], ys).map_err(|e| failed(&e))?;
        let lr = learning_rate(lr, s, steps, warmup, cosine);
        let t = Instant::now();
        let feeds = [x, y];
        let l = run.step(&feeds, lr).map_err(|e| failed(&e))?;
        busy += t.elapsed().as_secs_f64();
        losses.push(l);
        if !l.is_finite() {
            return Err(Exit::Failed(format!("step {s}: the loss is {l}")));
        }
        if let Some(r) = reference.as_mut() {
            let want = r.step(&feeds, lr).map_err(|e| failed(&e))?;
            if (l - want).abs() > tol * want.abs().max(1e-12) {
                return Err(Exit::Failed(format!(
                    "step {s}: loss {} on {data_axis} devices, {} on one (tolerance {tol:e} relative)",
                    loss_text(l),
                    loss_text(want)
                )));
            }
        }
        if !quiet && ((s + 1) % every == 0 || s + 1 == steps) {
            eprintln!(
                "step {:>5}/{steps} loss {}  {:.0} samples/s",
                s + 1,
                loss_text(l),
                ((s + 1) * batch) as f64 / busy
            );
        }
    }
    if let Some(p) = a.get("losses-json") {
        let text = serde_json::to_string(&losses).map_err(|e| failed(&e))?;
        write_atomic(p, &text).map_err(|e| Exit::Usage(format!("--losses-json {p}: {e}")))?;
    }
    if !quiet {
        outln!(
            "loss {} -> {} over {steps} steps, {:.0} samples/s{}",
            loss_text(losses[0]),
            loss_text(losses[steps - 1]),
            (steps * batch) as f64 / busy,
            if check { ", every step equal to one device's" } else { "" }
        );
        outln!("{}", sparkline(&losses, 60));
    }
    Ok(())
}
