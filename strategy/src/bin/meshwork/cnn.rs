//! `meshwork train --model cnn`'s model and data: two convolutions with ReLU and a
//! linear head on NHWC images (trained by the transformer's trainer, `lm.rs`,
//! data-parallel on a mesh's data axis).

use meshwork_nn as nn;
use meshwork_program::{Builder, Padding, Value};

use crate::args::{Args, Usage};
use crate::npy;

pub(crate) const HELP: &str = "\
meshwork train --model cnn — train conv(3x3, F1) + ReLU, conv(3x3 stride 2, F2) + ReLU,
then a linear head (softmax cross-entropy) on NHWC images, data-parallel over a mesh's
data axis, or in a pipeline of stages.

flags:
  --data-x X.npy        images [N, H, W, C] (default: built-in 8x8 one-channel images of
                        4 classes, a brighter quadrant each under noise)
  --data-y Y.npy        class ids [N]
  --filters F1,F2       (default 8,16; with --init, the file's convolutions say them)
  --init INIT.safetensors   initial conv1.weight [3, 3, C, F1], conv1.bias, conv2.weight
                        [3, 3, F1, F2], conv2.bias, head.weight [⌈H/2⌉·⌈W/2⌉·F2, classes],
                        head.bias (f32 or f64)
  --batch B             (default 32); step s reads rows (s·B + i) mod N
  --mesh Dx1            data-parallel devices (default 1x1)
  --stages K --microbatches M   a pipeline of K ≤ 3 stages (conv1, conv2, head spread
                        over them) per data replica, GPipe's micro-batches
  and the transformer's training flags (`meshwork train --model transformer --help`):
  --steps, --optimizer, --lr, --warmup, --schedule, --clip-norm, --dtype, --seed,
  --shuffle, --eval-every (accuracy of the class), --eval-fraction,
  --losses-json, --metrics-jsonl, --plot, --checkpoint-dir, --checkpoint-every, --keep,
  --resume, --no-check, --quiet
";

fn usage(flag: &str, e: impl std::fmt::Display) -> Usage {
    Usage(format!("--{flag}: {e}"))
}

/// Images `[N, H, W, C]` as f64 and class ids `[N]`.
pub(crate) struct Images {
    pub(crate) dims: [usize; 4],
    pub(crate) x: Vec<f64>,
    pub(crate) y: Vec<i32>,
    pub(crate) classes: usize,
}

/// `--data-x`/`--data-y` (read within `limit` bytes), or the built-in images.
pub(crate) fn images(a: &Args, seed: u64, limit: u64) -> Result<Images, Usage> {
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
            if let Some((k, v)) = x.iter().enumerate().find(|(_, v)| !v.is_finite()) {
                return Err(usage(
                    "data-x",
                    format!("{xp}: value {k} (flat) is {v}, not a finite number"),
                ));
            }
            let yv = npy::read(yp, limit).map_err(|e| usage("data-y", e))?;
            if yv.shape() != [n] && yv.shape() != [n, 1] {
                return Err(usage(
                    "data-y",
                    format!("{yp} has shape {:?}; want [{n}] (or [{n}, 1])", yv.shape()),
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
            // The classes are the largest id + 1; one stray id must not build a head
            // of thousands of classes that no row has.
            if classes > 2 * n {
                return Err(usage(
                    "data-y",
                    format!(
                        "{yp}: the largest class id {} is more than twice the {n} rows; is it a stray label?",
                        classes - 1
                    ),
                ));
            }
            Ok(Images { dims: [n, h, w, c], x: x.iter().copied().collect(), y, classes })
        }
        (Some(_), None) => Err(Usage("--data-x needs --data-y (the labels)".into())),
        (None, Some(_)) => Err(Usage("--data-y needs --data-x (the images)".into())),
    }
}

/// The CNN's logits `[B, classes]` of images `x` `[B, H, W, C]`: parameters
/// `conv1.*`, `conv2.*`, `head.*`.
pub(crate) fn logits(
    b: &mut Builder,
    x: Value,
    filters: [usize; 2],
    classes: usize,
) -> Result<Value, meshwork_program::Error> {
    logits_on(b, x, filters, classes, &[])
}

/// [`logits`] with its three layers spread over `stages` devices as a pipeline is
/// written in TensorFlow: layer `i` of 3 in a `device` scope of stage `i·K/3` (no
/// stages: no scopes).
pub(crate) fn logits_on(
    b: &mut Builder,
    x: Value,
    filters: [usize; 2],
    classes: usize,
    stages: &[&str],
) -> Result<Value, meshwork_program::Error> {
    type Layer<'f> = &'f mut dyn FnMut(&mut Builder) -> Result<Value, meshwork_program::Error>;
    let batch = b.spec(x)?.shape.dims()[0];
    let on =
        |b: &mut Builder, layer: usize, f: Layer<'_>| match stages.get(layer * stages.len() / 3) {
            Some(device) => b.device(device, |b| f(b)),
            None => f(b),
        };
    let (w1, w2) = (["conv1.weight", "conv1.bias"], ["conv2.weight", "conv2.bias"]);
    let a = on(b, 0, &mut |b| {
        let a = nn::conv2d(b, x, [3, 3], filters[0], [1, 1], Padding::Same, w1[0], w1[1])?;
        b.relu(a)
    })?;
    let a = on(b, 1, &mut |b| {
        let a = nn::conv2d(b, a, [3, 3], filters[1], [2, 2], Padding::Same, w2[0], w2[1])?;
        b.relu(a)
    })?;
    on(b, 2, &mut |b| {
        let d = b.spec(a)?.shape.dims().to_vec();
        let flat = b.reshape(a, &[batch, d[1] * d[2] * d[3]])?;
        nn::linear(b, flat, classes, "head.weight", Some("head.bias"))
    })
}

/// A model's logits of a micro-batch over a replica's stages.
pub(crate) type LogitsOn<'a> =
    &'a dyn Fn(&mut Builder, Value, &[&str]) -> Result<Value, meshwork_program::Error>;

/// The mean loss of inputs `x` `[B, …]` and class ids `y` `[B]` trained as `pipeline`
/// says, as the transformer's `loss_pipelined`: each replica's share of the rows cut
/// into micro-batches, in micro-batch order, the model (`logits_on`: the logits of a
/// micro-batch over a replica's stages) once per micro-batch, one set of weights.
pub(crate) fn loss_pipelined(
    b: &mut Builder,
    x: Value,
    y: Value,
    pipeline: &nn::Pipeline,
    logits_on: LogitsOn<'_>,
) -> Result<Value, meshwork_program::Error> {
    let dims = b.spec(x)?.shape.dims().to_vec();
    let (d, m) = (pipeline.replicas.len(), pipeline.micro_batches);
    let micro = dims[0] / (d * m).max(1);
    let losses = b.reuse_params(|b| {
        let mut losses = Vec::with_capacity(d * m);
        for mb in 0..m {
            for (r, stages) in pipeline.replicas.iter().enumerate() {
                let stages: Vec<&str> = stages.iter().map(String::as_str).collect();
                let start = (r * m + mb) * micro;
                let (first, last) = (stages[0], stages[stages.len() - 1]);
                let xs = b.device(first, |b| {
                    let mut lo = vec![0; dims.len()];
                    let mut hi = dims.clone();
                    (lo[0], hi[0]) = (start, start + micro);
                    b.slice(x, &lo, &hi, &vec![1; dims.len()])
                })?;
                let logits = logits_on(b, xs, &stages)?;
                losses.push(b.device(last, |b| {
                    let ys = b.slice(y, &[start], &[start + micro], &[1])?;
                    nn::softmax_cross_entropy(b, logits, ys)
                })?);
            }
        }
        Ok(losses)
    })?;
    let last = pipeline.replicas[0][pipeline.replicas[0].len() - 1].clone();
    b.device(&last, |b| {
        let mut total = losses[0];
        for &l in &losses[1..] {
            total = b.add(total, l)?;
        }
        if losses.len() == 1 {
            return Ok(total);
        }
        let scale = b.scalar_like(total, 1.0 / losses.len() as f64)?;
        b.mul(total, scale)
    })
}

/// The MLP's logits `[B, classes]` of `x` `[B, features]`: `relu(x·w1 + b1)·w2 + b2`,
/// the two layers over `stages` (the first on stage 0, the second on the last).
pub(crate) fn mlp_logits_on(
    b: &mut Builder,
    x: Value,
    hidden: usize,
    classes: usize,
    stages: &[&str],
) -> Result<Value, meshwork_program::Error> {
    let first = |b: &mut Builder| -> Result<Value, meshwork_program::Error> {
        let h = nn::linear(b, x, hidden, "w1", Some("b1"))?;
        b.relu(h)
    };
    let h = match stages.first() {
        Some(device) => b.device(device, first)?,
        None => first(b)?,
    };
    let second = |b: &mut Builder| nn::linear(b, h, classes, "w2", Some("b2"));
    match stages.last() {
        Some(device) => b.device(device, second),
        None => second(b),
    }
}
