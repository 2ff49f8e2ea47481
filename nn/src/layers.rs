//! Composites models are written with: layers that add their parameters (named within
//! the builder's current scope, so names match checkpoint tensor names) and their ops.
//!
//! The transformer pieces are exactly those of the JAX reference run
//! (`gen_transformer_case.py`): layer norm with a biased variance, tanh GELU, causal
//! attention masked to exactly `-1e9`, pre-norm residual blocks. A decoder block:
//!
//! ```
//! use meshwork_program::Builder;
//!
//! let mut b = Builder::new();
//! let x = b.param("x", "f32[2,8,16]".parse()?)?;
//! let y = b.scope("layers.0", |b| meshwork_nn::decoder_block(b, x, 4, 64))?;
//! let p = b.finish(&[y])?;
//! let names: Vec<&str> = p.params().iter().map(|p| p.name.as_str()).collect();
//! assert!(names.contains(&"layers.0.attn.wq") && names.contains(&"layers.0.mlp.b2"));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use meshwork_types::{DType, Shape, TensorSpec};

use meshwork_program::{Builder, Error, Padding, Result, Value};

pub(crate) fn dims(b: &Builder, x: Value) -> Result<(DType, Vec<usize>)> {
    let s = b.spec(x)?;
    Ok((s.dtype, s.shape.dims().to_vec()))
}

pub(crate) fn param(b: &mut Builder, name: &str, dtype: DType, dims: &[usize]) -> Result<Value> {
    b.param(name, TensorSpec::new(dtype, Shape::new(dims)?))
}

pub(crate) fn problem(op: &'static str, b: &Builder, args: &[Value], problem: String) -> Error {
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
    layer_norm_named(b, x, eps, "scale", "bias")
}

/// [`layer_norm`] with its parameters named `scale` and `bias` (Hugging Face's
/// `weight` and `bias`, say).
pub(crate) fn layer_norm_named(
    b: &mut Builder,
    x: Value,
    eps: f64,
    scale: &str,
    bias: &str,
) -> Result<Value> {
    let (dtype, d) = dims(b, x)?;
    let Some(&n) = d.last() else {
        return Err(problem("layer_norm", b, &[x], "a scalar has no axis to normalize".into()));
    };
    let scale = param(b, scale, dtype, &[n])?;
    let bias = param(b, bias, dtype, &[n])?;
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
/// mean); check labels before if that is not wanted. One [`Op::CrossEntropy`] per
/// position, then their mean. As in that definition (a one-hot row times the
/// log-softmax), a row with a non-finite logit (a class masked to `-inf`, say) has a
/// NaN loss; mask with a large finite negative number instead.
///
/// [`Op::CrossEntropy`]: meshwork_program::Op::CrossEntropy
pub fn softmax_cross_entropy(b: &mut Builder, logits: Value, labels: Value) -> Result<Value> {
    let (_, d) = dims(b, logits)?;
    if d.is_empty() {
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
    let per = b.cross_entropy(logits, labels)?;
    let axes: Vec<isize> = (0..d.len() as isize - 1).collect();
    b.reduce_mean(per, &axes, false)
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
