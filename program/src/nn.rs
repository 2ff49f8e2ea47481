//! Composites models are written with: layers that add their parameters (named within
//! the builder's current scope, so names match checkpoint tensor names) and their ops.
//!
//! The transformer pieces are exactly those of the JAX reference run
//! (`gen_transformer_case.py`): layer norm with a biased variance, tanh GELU, causal
//! attention masked to exactly `-1e9`, pre-norm residual blocks. A decoder block:
//!
//! ```
//! use meshwork_program::{Builder, nn};
//!
//! let mut b = Builder::new();
//! let x = b.param("x", "f32[2,8,16]".parse()?)?;
//! let y = b.scope("layers.0", |b| nn::decoder_block(b, x, 4, 64))?;
//! let p = b.finish(&[y])?;
//! let names: Vec<&str> = p.params().iter().map(|p| p.name.as_str()).collect();
//! assert!(names.contains(&"layers.0.attn.wq") && names.contains(&"layers.0.mlp.b2"));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use meshwork_types::{DType, Shape, TensorSpec};

use crate::builder::Builder;
use crate::op::Padding;
use crate::program::Value;
use crate::{Error, Result};

fn dims(b: &Builder, x: Value) -> Result<(DType, Vec<usize>)> {
    let s = b.spec(x)?;
    Ok((s.dtype, s.shape.dims().to_vec()))
}

fn param(b: &mut Builder, name: &str, dtype: DType, dims: &[usize]) -> Result<Value> {
    b.param(name, TensorSpec::new(dtype, Shape::new(dims)?))
}

fn problem(op: &'static str, b: &Builder, args: &[Value], problem: String) -> Error {
    Error::Type {
        op,
        at: "nn".into(),
        operands: args.iter().filter_map(|&a| b.spec(a).ok().cloned()).collect(),
        problem,
    }
}

/// `x @ weight + bias`: parameters `weight` `[in, out]` and, if named, `bias` `[out]`,
/// of `x`'s dtype; `in` is `x`'s last dim.
pub fn linear(
    b: &mut Builder,
    x: Value,
    out: usize,
    weight: &str,
    bias: Option<&str>,
) -> Result<Value> {
    let (dtype, d) = dims(b, x)?;
    let Some(&inp) = d.last() else {
        return Err(problem("linear", b, &[x], "a scalar has no features".into()));
    };
    let w = param(b, weight, dtype, &[inp, out])?;
    let y = b.matmul(x, w)?;
    match bias {
        Some(name) => {
            let bb = param(b, name, dtype, &[out])?;
            b.add(y, bb)
        }
        None => Ok(y),
    }
}

/// Layer norm over the last axis: `(x - mean) / sqrt(var + eps) · scale + bias` with the
/// biased variance; parameters `scale` and `bias` of the last dim.
pub fn layer_norm(b: &mut Builder, x: Value, eps: f64) -> Result<Value> {
    let (dtype, d) = dims(b, x)?;
    let Some(&n) = d.last() else {
        return Err(problem("layer_norm", b, &[x], "a scalar has no axis to normalize".into()));
    };
    let scale = param(b, "scale", dtype, &[n])?;
    let bias = param(b, "bias", dtype, &[n])?;
    let mu = b.reduce_mean(x, &[-1], true)?;
    let c = b.sub(x, mu)?;
    let sq = b.mul(c, c)?;
    let var = b.reduce_mean(sq, &[-1], true)?;
    let e = b.constant(eps, dtype)?;
    let ve = b.add(var, e)?;
    let r = b.rsqrt(ve)?;
    let y = b.mul(c, r)?;
    let y = b.mul(y, scale)?;
    b.add(y, bias)
}

/// GELU, tanh approximation (`jax.nn.gelu(approximate=True)`).
pub fn gelu(b: &mut Builder, x: Value) -> Result<Value> {
    b.gelu(x)
}

/// Rows of an embedding table `name` `[vocab, dim]` of `dtype` picked by integer `ids`:
/// the result is `ids`' shape plus `dim`.
pub fn embedding(
    b: &mut Builder,
    ids: Value,
    vocab: usize,
    dim: usize,
    name: &str,
    dtype: DType,
) -> Result<Value> {
    let table = param(b, name, dtype, &[vocab, dim])?;
    b.take(table, ids, 0)
}

/// Causal multi-head self-attention over `x` `[B, T, D]` with `heads` heads of `D /
/// heads` dims: parameters `wq`, `wk`, `wv`, `wo` `[D, D]`; scores scaled by
/// `1/sqrt(D/heads)`, keys after the query masked to exactly `-1e9`, softmax over keys.
pub fn causal_self_attention(b: &mut Builder, x: Value, heads: usize) -> Result<Value> {
    let (dtype, d) = dims(b, x)?;
    let [bs, t, dim] = d[..] else {
        return Err(problem(
            "causal_self_attention",
            b,
            &[x],
            "x must be [batch, time, dim]".into(),
        ));
    };
    if heads == 0 || dim % heads != 0 {
        return Err(problem(
            "causal_self_attention",
            b,
            &[x],
            format!("{heads} heads do not divide the model dim {dim}"),
        ));
    }
    let hd = dim / heads;
    let mut proj = |name: &str| -> Result<Value> {
        let w = param(b, name, dtype, &[dim, dim])?;
        let y = b.matmul(x, w)?;
        b.reshape(y, &[bs, t, heads, hd])
    };
    let (q, k, v) = (proj("wq")?, proj("wk")?, proj("wv")?);
    // [B, H, Tq, Tk]: batch dims (b, h), then q's time, then k's.
    let s = b.dot_general(q, k, &[3], &[3], &[0, 2], &[0, 2])?;
    let root = b.constant((hd as f64).sqrt(), dtype)?;
    let s = b.div(s, root)?;
    let qi = b.iota(DType::I32, &[t, t], 0)?;
    let ki = b.iota(DType::I32, &[t, t], 1)?;
    let causal = b.ge(qi, ki)?;
    let masked = b.constant(-1e9, dtype)?;
    let s = b.select(causal, s, masked)?;
    let p = b.softmax(s, -1)?;
    // [B, H, Tq, hd] -> [B, Tq, H, hd] -> [B, T, D].
    let o = b.dot_general(p, v, &[3], &[1], &[0, 1], &[0, 2])?;
    let o = b.transpose(o, &[0, 2, 1, 3])?;
    let o = b.reshape(o, &[bs, t, dim])?;
    let wo = param(b, "wo", dtype, &[dim, dim])?;
    b.matmul(o, wo)
}

/// The mean softmax cross-entropy of `logits` `[..., C]` against integer `labels`
/// `[...]` (exactly the logits' shape without the class axis):
/// `-mean(log_softmax(logits)[label])`. A label outside `0..C` has an all-zero one-hot
/// row, as `jax.nn.one_hot` gives, so it adds 0 to the sum (and still counts in the
/// mean); check labels before if that is not wanted.
pub fn softmax_cross_entropy(b: &mut Builder, logits: Value, labels: Value) -> Result<Value> {
    let (dtype, d) = dims(b, logits)?;
    let Some(&classes) = d.last() else {
        return Err(problem(
            "softmax_cross_entropy",
            b,
            &[logits],
            "logits need a class axis".into(),
        ));
    };
    let (_, ld) = dims(b, labels)?;
    if ld[..] != d[..d.len() - 1] {
        return Err(problem(
            "softmax_cross_entropy",
            b,
            &[logits, labels],
            "labels must have the logits' shape without the class axis".into(),
        ));
    }
    let lp = b.log_softmax(logits, -1)?;
    let hot = b.one_hot(labels, classes, dtype)?;
    let picked = b.mul(lp, hot)?;
    let per = b.reduce_sum(picked, &[-1], false)?;
    let axes: Vec<isize> = (0..d.len() as isize - 1).collect();
    let mean = b.reduce_mean(per, &axes, false)?;
    b.neg(mean)
}

/// `conv2d(x, weight) + bias`: `x` NHWC, parameters `weight` `[kh, kw, C, out]` (HWIO)
/// and `bias` `[out]`.
#[allow(clippy::too_many_arguments)]
pub fn conv2d(
    b: &mut Builder,
    x: Value,
    kernel: [usize; 2],
    out: usize,
    strides: [usize; 2],
    padding: Padding,
    weight: &str,
    bias: &str,
) -> Result<Value> {
    let (dtype, d) = dims(b, x)?;
    let [_, _, _, c] = d[..] else {
        return Err(problem("conv2d", b, &[x], "x must be NHWC".into()));
    };
    let w = param(b, weight, dtype, &[kernel[0], kernel[1], c, out])?;
    let y = b.conv2d(x, w, strides, padding)?;
    let bb = param(b, bias, dtype, &[out])?;
    b.add(y, bb)
}

/// The transformer's MLP block: `gelu(x @ w1 + b1) @ w2 + b2` with `hidden` units
/// (parameters `w1`, `b1`, `w2`, `b2`; the output has `x`'s last dim).
pub fn mlp_block(b: &mut Builder, x: Value, hidden: usize) -> Result<Value> {
    let (_, d) = dims(b, x)?;
    let out = *d
        .last()
        .ok_or_else(|| problem("mlp_block", b, &[x], "a scalar has no features".into()))?;
    let h = linear(b, x, hidden, "w1", Some("b1"))?;
    let h = b.gelu(h)?;
    linear(b, h, out, "w2", Some("b2"))
}

/// A pre-norm decoder block over `x` `[B, T, D]`, as the reference run's:
/// `x += attn(ln1(x))`, `x += mlp(ln2(x))`, with parameters under `ln1`, `attn`, `ln2`
/// and `mlp` (layer norm eps 1e-5).
pub fn decoder_block(b: &mut Builder, x: Value, heads: usize, ffn: usize) -> Result<Value> {
    let h = b.scope("ln1", |b| layer_norm(b, x, 1e-5))?;
    let a = b.scope("attn", |b| causal_self_attention(b, h, heads))?;
    let x = b.add(x, a)?;
    let h = b.scope("ln2", |b| layer_norm(b, x, 1e-5))?;
    let m = b.scope("mlp", |b| mlp_block(b, h, ffn))?;
    b.add(x, m)
}

/// The reference run's decoder-only transformer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transformer {
    /// Vocabulary size V.
    pub vocab: usize,
    /// Sequence length T.
    pub seq: usize,
    /// Model dim D.
    pub dim: usize,
    /// Attention heads H (dividing D).
    pub heads: usize,
    /// Decoder blocks L.
    pub layers: usize,
    /// MLP hidden units F.
    pub ffn: usize,
}

impl Transformer {
    /// Logits `[B, T, V]` of integer `tokens` `[B, T]`: parameters `embed`, `pos`,
    /// `layers.{i}.*`, `ln_f.*` and `unembed`, of `dtype`.
    pub fn logits(&self, b: &mut Builder, tokens: Value, dtype: DType) -> Result<Value> {
        self.logits_on(b, tokens, dtype, &[])
    }

    /// [`logits`](Self::logits) with the model spread over `stages` devices as a
    /// pipeline is written in TensorFlow: the embedding in a `device` scope of the
    /// first, decoder block `i` of `L` on stage `i·K/L`, the final norm and the
    /// unembedding on the last. No stages: no device scopes.
    pub fn logits_on(
        &self,
        b: &mut Builder,
        tokens: Value,
        dtype: DType,
        stages: &[&str],
    ) -> Result<Value> {
        let td = b.spec(tokens)?.shape.dims().to_vec();
        if td.len() != 2 || td[1] != self.seq {
            return Err(problem(
                "transformer",
                b,
                &[tokens],
                format!("tokens must be [batch, {}]", self.seq),
            ));
        }
        let k = stages.len();
        let on =
            |b: &mut Builder, stage: usize, f: &mut dyn FnMut(&mut Builder) -> Result<Value>| {
                match stages.get(stage) {
                    Some(device) => b.device(device, |b| f(b)),
                    None => f(b),
                }
            };
        let mut x = on(b, 0, &mut |b| {
            let x = embedding(b, tokens, self.vocab, self.dim, "embed", dtype)?;
            let pos = param(b, "pos", dtype, &[self.seq, self.dim])?;
            b.add(x, pos)
        })?;
        for i in 0..self.layers {
            let stage = if k == 0 { 0 } else { i * k / self.layers };
            x = on(b, stage, &mut |b| {
                b.scope(&format!("layers.{i}"), |b| decoder_block(b, x, self.heads, self.ffn))
            })?;
        }
        on(b, k.saturating_sub(1), &mut |b| {
            let h = b.scope("ln_f", |b| layer_norm(b, x, 1e-5))?;
            let w = param(b, "unembed", dtype, &[self.dim, self.vocab])?;
            b.matmul(h, w)
        })
    }

    /// The mean next-token loss of integer `rows` `[B, T + 1]`: inputs `row[:T]`,
    /// targets `row[1:]`.
    pub fn loss(&self, b: &mut Builder, rows: Value, dtype: DType) -> Result<Value> {
        self.loss_on(b, rows, dtype, &[])
    }

    /// [`loss`](Self::loss) with the model over `stages` devices as
    /// [`logits_on`](Self::logits_on) spreads it (the loss on the last stage).
    pub fn loss_on(
        &self,
        b: &mut Builder,
        rows: Value,
        dtype: DType,
        stages: &[&str],
    ) -> Result<Value> {
        let rd = b.spec(rows)?.shape.dims().to_vec();
        if rd.len() != 2 || rd[1] != self.seq + 1 {
            return Err(problem(
                "transformer",
                b,
                &[rows],
                format!("rows must be [batch, {}]", self.seq + 1),
            ));
        }
        let on =
            |b: &mut Builder, device: Option<&&str>, f: &dyn Fn(&mut Builder) -> Result<Value>| {
                match device {
                    Some(device) => b.device(device, f),
                    None => f(b),
                }
            };
        let inputs =
            on(b, stages.first(), &|b| b.slice(rows, &[0, 0], &[rd[0], self.seq], &[1, 1]))?;
        let logits = self.logits_on(b, inputs, dtype, stages)?;
        on(b, stages.last(), &|b| {
            let targets = b.slice(rows, &[0, 1], &[rd[0], self.seq + 1], &[1, 1])?;
            softmax_cross_entropy(b, logits, targets)
        })
    }

    /// [`loss`](Self::loss) as a pipeline trains it: each of `pipeline`'s D replicas
    /// takes an equal, contiguous share of the rows and cuts it into the pipeline's M
    /// micro-batches; every micro-batch runs the model over the replica's K stages
    /// ([`loss_on`](Self::loss_on)), all forwards in micro-batch order, so that — the
    /// backward pass running in reverse — a stage works on one micro-batch while the
    /// next stage works on the one before (GPipe's schedule). The loss is the mean of
    /// the D·M micro-batch losses (the batch's mean: shares are equal), taken on the
    /// last stage of replica 0; gradients of the one set of weights (created on
    /// replica 0's stages, [`reuse_params`](Builder::reuse_params) elsewhere) sum the
    /// micro-batches' contributions where they are made, and a replica's sum crosses to
    /// the weights' device once.
    pub fn loss_pipelined(
        &self,
        b: &mut Builder,
        rows: Value,
        dtype: DType,
        pipeline: &Pipeline,
    ) -> Result<Value> {
        let rd = b.spec(rows)?.shape.dims().to_vec();
        let (d, m) = (pipeline.replicas.len(), pipeline.micro_batches);
        let k = pipeline.replicas.first().map_or(0, Vec::len);
        let fault = if d == 0 || k == 0 || m == 0 {
            Some("a pipeline has at least one replica, stage and micro-batch".to_string())
        } else if pipeline.replicas.iter().any(|r| r.len() != k) {
            Some("every replica has the same number of stages".to_string())
        } else if rd.len() != 2 || rd[1] != self.seq + 1 {
            Some(format!("rows must be [batch, {}]", self.seq + 1))
        } else if rd[0] % (d * m) != 0 {
            Some(format!(
                "a batch of {} rows does not split into {d} replicas × {m} micro-batches",
                rd[0]
            ))
        } else {
            None
        };
        if let Some(fault) = fault {
            return Err(problem("transformer pipeline", b, &[rows], fault));
        }
        let micro = rd[0] / (d * m);
        let stages: Vec<Vec<&str>> =
            pipeline.replicas.iter().map(|r| r.iter().map(String::as_str).collect()).collect();
        let losses = b.reuse_params(|b| {
            let mut losses = Vec::with_capacity(d * m);
            for mb in 0..m {
                for (r, stages) in stages.iter().enumerate() {
                    let start = (r * m + mb) * micro;
                    let chunk = b.device(stages[0], |b| {
                        b.slice(rows, &[start, 0], &[start + micro, self.seq + 1], &[1, 1])
                    })?;
                    losses.push(self.loss_on(b, chunk, dtype, stages)?);
                }
            }
            Ok(losses)
        })?;
        if losses.len() == 1 {
            return Ok(losses[0]);
        }
        b.device(stages[0][k - 1], |b| {
            let mut total = losses[0];
            for &l in &losses[1..] {
                total = b.add(total, l)?;
            }
            let scale = b.scalar_like(total, 1.0 / (d * m) as f64)?;
            b.mul(total, scale)
        })
    }
}

/// Where a pipelined training step runs ([`Transformer::loss_pipelined`]): D
/// data-parallel replicas of K pipeline stages each (D × K devices), and the
/// micro-batches each replica's share of a batch is cut into.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pipeline {
    /// `replicas[d][k]`: the device of stage `k` of replica `d`.
    pub replicas: Vec<Vec<String>>,
    /// Micro-batches per replica and step.
    pub micro_batches: usize,
}

impl Pipeline {
    /// `replicas` × `stages` CPU devices, stage `k` of replica `d` on
    /// `/device:CPU:{d·stages + k}`.
    pub fn cpus(replicas: usize, stages: usize, micro_batches: usize) -> Pipeline {
        Pipeline {
            replicas: (0..replicas)
                .map(|d| (0..stages).map(|k| format!("/device:CPU:{}", d * stages + k)).collect())
                .collect(),
            micro_batches,
        }
    }
}
