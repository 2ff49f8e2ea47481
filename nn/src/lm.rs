//! What the language models share: causal attention over `[B, H, T, hd]` heads (whole,
//! or by blocks of queries), grouped-query heads repeated for it, and the next-token
//! loss of final states against an output matrix (whole, or by chunks of positions).

use meshwork_program::{AttentionSpec, Builder, Result, Value};
use meshwork_types::DType;

use crate::layers::{dims, softmax_cross_entropy};

/// How a language model's attention and loss are cut into pieces (0: not cut).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Blocking {
    /// Queries per attention block: each block's scores are `[B, H, block, ≤T]`.
    pub query_block: usize,
    /// Positions per loss chunk: each chunk's logits are `[B, chunk, V]`.
    pub loss_chunk: usize,
    /// Whole (uncut) causal attention as one [`Op::Attention`], for a back end that
    /// runs it fused (cuDNN where [`cudnn_attention`] takes it, the fast interpreter's
    /// CPU kernel in f32 and f64), whatever `query_block` says; primitive ops
    /// otherwise. Whoever sets it checks that the back end takes it.
    ///
    /// [`Op::Attention`]: meshwork_program::Op::Attention
    pub fused_attention: bool,
}

/// Whether cuDNN's fused (flash) attention takes causal attention of `heads` heads of
/// `head_dim` over `seq` positions computed in `dtype`, as JAX's cuDNN wrapper checks
/// before emitting it (`jax._src.cudnn.fused_attention_stablehlo`): half precision
/// (bf16 or f16), a head dim that is a multiple of 8 and at most 128, and at least one
/// position. A deviceless compile does not check these (XLA builds cuDNN graphs only
/// with a GPU), so meshwork must. `Err` says which does not hold.
pub fn cudnn_attention(
    dtype: DType,
    heads: usize,
    head_dim: usize,
    seq: usize,
) -> Result<(), String> {
    if !matches!(dtype, DType::BF16 | DType::F16) {
        return Err(format!(
            "cuDNN's fused attention takes bf16 or f16, not {dtype} (give --precision bf16)"
        ));
    }
    if head_dim == 0 || !head_dim.is_multiple_of(8) || head_dim > 128 {
        return Err(format!(
            "cuDNN's fused attention takes a head dim that is a multiple of 8 up to 128, not {head_dim}"
        ));
    }
    if heads == 0 || seq == 0 {
        return Err("cuDNN's fused attention needs at least one head and one position".into());
    }
    Ok(())
}

/// How attention scores are scaled, as the model's reference computes it (the two
/// round differently).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Scale {
    /// Divided by `sqrt(hd)` (GPT-2's `attn_weights / value.size(-1) ** 0.5`).
    DivideBySqrt,
    /// Multiplied by `hd^-0.5` (the Llama family's `scaling`).
    MultiplyByInverseSqrt,
}

/// The heads of `q`, `k`, `v` `[B, H, T, hd]` attending where `mask` (broadcast to the
/// scores `[B, H, Tq, Tk]`) holds, scaled by `scale`, the rest masked to exactly
/// `-1e9`: `[B, H, Tq, hd]`.
pub(crate) fn attention(
    b: &mut Builder,
    [q, k, v]: [Value; 3],
    mask: Value,
    scale: Scale,
) -> Result<Value> {
    let (dtype, d) = dims(b, q)?;
    let s = b.dot_general(q, k, &[3], &[3], &[0, 1], &[0, 1])?;
    let hd = d[3] as f64;
    let s = match scale {
        Scale::DivideBySqrt => {
            let root = b.constant(hd.sqrt(), dtype)?;
            b.div(s, root)?
        }
        Scale::MultiplyByInverseSqrt => {
            let inv = b.constant(hd.powf(-0.5), dtype)?;
            b.mul(s, inv)?
        }
    };
    let masked = b.constant(-1e9, dtype)?;
    let s = b.select(mask, s, masked)?;
    let p = b.softmax(s, -1)?;
    b.dot_general(p, v, &[3], &[2], &[0, 1], &[0, 1])
}

/// The causal attention of `[B, H, T, hd]` heads, its queries taken `block` at a time
/// (0: all at once), each block against only the keys up to its last query, in a scope
/// `q_block.{i}` of its own: a block's scores are `[B, H, block, ≤T]`, never
/// `[B, H, T, T]`.
pub(crate) fn causal(
    b: &mut Builder,
    [q, k, v]: [Value; 3],
    blocking: Blocking,
    scale: Scale,
) -> Result<Value> {
    let block = blocking.query_block;
    let (_, d) = dims(b, q)?;
    let (bs, heads, t, hd) = (d[0], d[1], d[2], d[3]);
    let whole = block == 0 || block >= t;
    if blocking.fused_attention {
        let spec = match scale {
            Scale::DivideBySqrt => {
                AttentionSpec { scale: (hd as f64).sqrt(), divide: true, causal: true }
            }
            Scale::MultiplyByInverseSqrt => {
                AttentionSpec { scale: (hd as f64).powf(-0.5), divide: false, causal: true }
            }
        };
        return b.attention(q, k, v, spec);
    }
    if whole {
        let qi = b.iota(DType::I32, &[t, t], 0)?;
        let ki = b.iota(DType::I32, &[t, t], 1)?;
        let mask = b.ge(qi, ki)?;
        return attention(b, [q, k, v], mask, scale);
    }
    let mut outs = Vec::with_capacity(t.div_ceil(block));
    for (i, start) in (0..t).step_by(block).enumerate() {
        let end = (start + block).min(t);
        outs.push(b.scope(&format!("q_block.{i}"), |b| {
            let qb = b.slice(q, &[0, 0, start, 0], &[bs, heads, end, hd], &[1, 1, 1, 1])?;
            let kb = b.slice(k, &[0, 0, 0, 0], &[bs, heads, end, hd], &[1, 1, 1, 1])?;
            let vb = b.slice(v, &[0, 0, 0, 0], &[bs, heads, end, hd], &[1, 1, 1, 1])?;
            let qi = b.iota(DType::I32, &[end - start, end], 0)?;
            let offset = b.constant(start as f64, DType::I32)?;
            let qi = b.add(qi, offset)?;
            let ki = b.iota(DType::I32, &[end - start, end], 1)?;
            let mask = b.ge(qi, ki)?;
            attention(b, [qb, kb, vb], mask, scale)
        })?);
    }
    b.concat(&outs, 2)
}

/// Grouped-query attention's keys or values `[B, KV, T, hd]` repeated for `heads`
/// query heads (each key/value head serving `heads / KV` consecutive ones, as
/// `repeat_kv` does): `[B, heads, T, hd]`.
pub(crate) fn repeat_kv(b: &mut Builder, x: Value, heads: usize) -> Result<Value> {
    let d = dims(b, x)?.1;
    let (bs, kv, t, hd) = (d[0], d[1], d[2], d[3]);
    if kv == heads {
        return Ok(x);
    }
    let x = b.reshape(x, &[bs, kv, 1, t, hd])?;
    let x = b.broadcast_to(x, &[bs, kv, heads / kv, t, hd])?;
    b.reshape(x, &[bs, heads, t, hd])
}

/// The mean next-token cross-entropy of final states `h` `[B, T, D]` against
/// `targets` `[B, T]`, the logits `h · headᵀ` (`head` `[V, D]`); with `chunk` (0: all
/// at once) the logits a chunk of positions at a time, each in a scope
/// `lm_head.chunk.{j}` of its own.
pub(crate) fn next_token_loss(
    b: &mut Builder,
    h: Value,
    head: Value,
    targets: Value,
    chunk: usize,
) -> Result<Value> {
    let (dtype, d) = dims(b, h)?;
    let (bs, t, dim) = (d[0], d[1], d[2]);
    if chunk == 0 || chunk >= t {
        let logits = b.dot_general(h, head, &[2], &[1], &[], &[])?;
        return softmax_cross_entropy(b, logits, targets);
    }
    // Σ over chunks of positions of the summed token losses, then the mean.
    let mut total = None;
    for (j, start) in (0..t).step_by(chunk).enumerate() {
        let end = (start + chunk).min(t);
        let sum = b.scope(&format!("lm_head.chunk.{j}"), |b| {
            let hj = b.slice(h, &[0, start, 0], &[bs, end, dim], &[1, 1, 1])?;
            let yj = b.slice(targets, &[0, start], &[bs, end], &[1, 1])?;
            let logits = b.dot_general(hj, head, &[2], &[1], &[], &[])?;
            let per = b.cross_entropy(logits, yj)?;
            b.reduce_sum(per, &[0, 1], false)
        })?;
        total = Some(match total {
            None => sum,
            Some(s) => b.add(s, sum)?,
        });
    }
    let total = total.expect("a context of at least one position");
    let count = b.constant((bs * t) as f64, dtype)?;
    b.div(total, count)
}

/// The inputs `row[:T]` and targets `row[1:]` of integer `rows` `[B, T + 1]` (`op`
/// names the model in errors).
pub(crate) fn split_rows(
    b: &mut Builder,
    rows: Value,
    op: &'static str,
) -> Result<(Value, Value, usize, usize)> {
    let (_, d) = dims(b, rows)?;
    let [bs, w] = d[..] else {
        return Err(crate::layers::problem(
            op,
            b,
            &[rows],
            "rows must be [batch, time + 1]".into(),
        ));
    };
    if w < 2 {
        return Err(crate::layers::problem(op, b, &[rows], "rows need at least 2 tokens".into()));
    }
    let t = w - 1;
    let ids = b.slice(rows, &[0, 0], &[bs, t], &[1, 1])?;
    let targets = b.slice(rows, &[0, 1], &[bs, w], &[1, 1])?;
    Ok((ids, targets, bs, t))
}

/// Decoding's masks of a cache of `context` slots at integer scalar `position`: where
/// this step writes (`[1, 1, context, 1]`) and which slots it reads (`[1, 1, 1,
/// context]`, up to `position`).
pub(crate) fn cache_masks(
    b: &mut Builder,
    position: Value,
    context: usize,
) -> Result<(Value, Value)> {
    let slots = b.iota(DType::I32, &[context], 0)?;
    let here = b.eq(slots, position)?;
    let here = b.reshape(here, &[1, 1, context, 1])?;
    let seen = b.le(slots, position)?;
    let seen = b.reshape(seen, &[1, 1, 1, context])?;
    Ok((here, seen))
}

/// `cache` `[B, H, context, hd]` with slot `here` (a mask from [`cache_masks`]) set to
/// `new` `[B, H, 1, hd]`.
pub(crate) fn write_cache(b: &mut Builder, cache: Value, new: Value, here: Value) -> Result<Value> {
    let shape = dims(b, cache)?.1;
    let wide = b.broadcast_to(new, &shape)?;
    b.select(here, wide, cache)
}

/// A causal language model trained on rows of `seq + 1` tokens: what the trainer
/// trains of [`Gpt2`](crate::Gpt2) and [`Llama`](crate::Llama) (whose own sizes do not
/// say the training context).
#[derive(Debug, Clone, PartialEq)]
pub struct CausalLm<M> {
    /// The model.
    pub model: M,
    /// The training context T.
    pub seq: usize,
}

/// The evaluation of a language model whose logits of `ids` `logits` gives: the
/// next-token loss and accuracy of `rows` `[B, seq + 1]`.
pub(crate) fn evaluate_rows(
    b: &mut Builder,
    rows: Value,
    dtype: DType,
    logits: &dyn Fn(&mut Builder, Value) -> Result<Value>,
) -> Result<(Value, Value)> {
    let (ids, targets, _, _) = split_rows(b, rows, "evaluation")?;
    let l = logits(b, ids)?;
    crate::model::token_metrics(b, l, targets, dtype)
}
