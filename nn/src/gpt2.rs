//! GPT-2 as Hugging Face's `GPT2LMHeadModel` computes it, its parameters named as
//! `save_pretrained` writes them, so a checkpoint's tensors are the program's
//! parameters by name.
//!
//! Token and learned position embeddings; pre-LN blocks `x + attn(ln_1(x))`, then
//! `x + mlp(ln_2(x))`; the attention's `c_attn` fused in Conv1D layout `[in, 3·out]`
//! (q, k, v side by side), scores scaled by `1/sqrt(head_dim)`, causal; the MLP
//! `c_proj(gelu_new(c_fc(h)))`, `gelu_new` being the tanh approximation; biases
//! everywhere; LayerNorm with the config's eps; logits `ln_f(x) · wteᵀ` (tied).
//!
//! ```
//! use meshwork_program::Builder;
//! use meshwork_nn::Gpt2;
//! use meshwork_types::DType;
//!
//! let gpt = Gpt2::preset("tiny").unwrap();
//! let mut b = Builder::new();
//! let rows = b.param("rows", "i32[2,9]".parse()?)?;
//! let loss = gpt.loss(&mut b, rows, DType::F32)?;
//! let p = b.finish(&[loss])?;
//! assert!(p.params().iter().any(|p| p.name == "transformer.h.1.attn.c_attn.weight"));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use meshwork_program::{Builder, Result, Value};
use meshwork_types::DType;

use crate::layers::{dims, layer_norm_named, param, problem, softmax_cross_entropy};

/// A GPT-2 model's sizes (Hugging Face's `GPT2Config`: `vocab_size`, `n_positions`,
/// `n_embd`, `n_layer`, `n_head`, `n_inner`, `layer_norm_epsilon`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gpt2 {
    /// Vocabulary size (`vocab_size`).
    pub vocab: usize,
    /// The longest context (`n_positions`): rows of the position table.
    pub positions: usize,
    /// Model width (`n_embd`).
    pub dim: usize,
    /// Blocks (`n_layer`).
    pub layers: usize,
    /// Attention heads (`n_head`), dividing the width.
    pub heads: usize,
    /// MLP hidden units (`n_inner`; 4 × width when the config has none).
    pub inner: usize,
    /// LayerNorm's epsilon (`layer_norm_epsilon`).
    pub eps: f64,
}

/// How [`Gpt2::loss_blocked`] cuts its attention and loss into pieces (0: not cut).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Blocking {
    /// Queries per attention block: each block's scores are `[B, H, block, ≤T]`.
    pub query_block: usize,
    /// Positions per loss chunk: each chunk's logits are `[B, chunk, V]`.
    pub loss_chunk: usize,
}

impl Gpt2 {
    /// The sizes of a named model: `gpt2` (124M), `gpt2-medium` (355M), or `tiny` (a
    /// 2-block, width-32 model for tests and examples).
    pub fn preset(name: &str) -> Option<Gpt2> {
        let gpt = |vocab, positions, dim, layers, heads| Gpt2 {
            vocab,
            positions,
            dim,
            layers,
            heads,
            inner: 4 * dim,
            eps: 1e-5,
        };
        match name {
            "gpt2" => Some(gpt(50257, 1024, 768, 12, 12)),
            "gpt2-medium" => Some(gpt(50257, 1024, 1024, 24, 16)),
            "tiny" => Some(gpt(320, 64, 32, 2, 4)),
            _ => None,
        }
    }

    /// The names of its parameters, in the order the program makes them, with their
    /// shapes.
    pub fn parameters(&self) -> Vec<(String, Vec<usize>)> {
        let (d, f) = (self.dim, self.inner);
        let mut out = vec![
            ("transformer.wte.weight".to_string(), vec![self.vocab, d]),
            ("transformer.wpe.weight".to_string(), vec![self.positions, d]),
        ];
        for i in 0..self.layers {
            let h = format!("transformer.h.{i}");
            for (name, shape) in [
                ("ln_1.weight", vec![d]),
                ("ln_1.bias", vec![d]),
                ("attn.c_attn.weight", vec![d, 3 * d]),
                ("attn.c_attn.bias", vec![3 * d]),
                ("attn.c_proj.weight", vec![d, d]),
                ("attn.c_proj.bias", vec![d]),
                ("ln_2.weight", vec![d]),
                ("ln_2.bias", vec![d]),
                ("mlp.c_fc.weight", vec![d, f]),
                ("mlp.c_fc.bias", vec![f]),
                ("mlp.c_proj.weight", vec![f, d]),
                ("mlp.c_proj.bias", vec![d]),
            ] {
                out.push((format!("{h}.{name}"), shape));
            }
        }
        out.push(("transformer.ln_f.weight".to_string(), vec![d]));
        out.push(("transformer.ln_f.bias".to_string(), vec![d]));
        out
    }

    /// Logits `[B, T, V]` of integer `ids` `[B, T]` (`T` at most `positions`), the
    /// parameters of `dtype`.
    pub fn logits(&self, b: &mut Builder, ids: Value, dtype: DType) -> Result<Value> {
        let (h, wte) = self.hidden(b, ids, dtype, Blocking::default())?;
        // Tied: the logits are the final states against every token's embedding.
        let last = b.spec(h)?.shape.rank() - 1;
        b.dot_general(h, wte, &[last], &[1], &[], &[])
    }

    /// The final states `[B, T, D]` (after `ln_f`) of integer `ids` `[B, T]`, and the
    /// token embedding the logits are tied to.
    fn hidden(
        &self,
        b: &mut Builder,
        ids: Value,
        dtype: DType,
        blocking: Blocking,
    ) -> Result<(Value, Value)> {
        let (_, d) = dims(b, ids)?;
        let [_, t] = d[..] else {
            return Err(problem("gpt2", b, &[ids], "ids must be [batch, time]".into()));
        };
        self.check(b, ids, t)?;
        let wte = param(b, "transformer.wte.weight", dtype, &[self.vocab, self.dim])?;
        let wpe = param(b, "transformer.wpe.weight", dtype, &[self.positions, self.dim])?;
        let tokens = b.take(wte, ids, 0)?;
        let pos = b.slice(wpe, &[0, 0], &[t, self.dim], &[1, 1])?;
        let mut x = b.add(tokens, pos)?;
        let block = blocking.query_block;
        let mut attend = |b: &mut Builder, qkv: [Value; 3]| Gpt2::causal_blocked(b, qkv, block);
        for i in 0..self.layers {
            x = b.scope(&format!("transformer.h.{i}"), |b| self.block(b, x, &mut attend))?;
        }
        let h = b.scope("transformer.ln_f", |b| self.layer_norm(b, x))?;
        Ok((h, wte))
    }

    /// The mean next-token cross-entropy of integer `rows` `[B, T + 1]`: inputs
    /// `row[:T]`, targets `row[1:]`.
    pub fn loss(&self, b: &mut Builder, rows: Value, dtype: DType) -> Result<Value> {
        self.loss_blocked(b, rows, dtype, Blocking::default())
    }

    /// [`loss`](Self::loss) with the attention and the loss cut into pieces by
    /// `blocking`: the same loss (up to the order of its sums), computed so that no
    /// value holds a whole `[T, T]` score matrix or a whole `[B, T, V]` of logits.
    /// Each piece is built in a scope of its own (`….attn.q_block.{i}`,
    /// `lm_head.chunk.{j}`), the regions a training step recomputes in its backward
    /// pass ([`meshwork_program::grad_remat`]) so that they stay one at a time there
    /// too.
    pub fn loss_blocked(
        &self,
        b: &mut Builder,
        rows: Value,
        dtype: DType,
        blocking: Blocking,
    ) -> Result<Value> {
        let (_, d) = dims(b, rows)?;
        let [bs, w] = d[..] else {
            return Err(problem("gpt2", b, &[rows], "rows must be [batch, time + 1]".into()));
        };
        if w < 2 {
            return Err(problem("gpt2", b, &[rows], "rows need at least 2 tokens".into()));
        }
        let t = w - 1;
        let ids = b.slice(rows, &[0, 0], &[bs, t], &[1, 1])?;
        let targets = b.slice(rows, &[0, 1], &[bs, w], &[1, 1])?;
        let (h, wte) = self.hidden(b, ids, dtype, blocking)?;
        let chunk = blocking.loss_chunk;
        if chunk == 0 || chunk >= t {
            let logits = b.dot_general(h, wte, &[2], &[1], &[], &[])?;
            return softmax_cross_entropy(b, logits, targets);
        }
        // Σ over chunks of positions of the summed token losses, then the mean.
        let mut total = None;
        for (j, start) in (0..t).step_by(chunk).enumerate() {
            let end = (start + chunk).min(t);
            let sum = b.scope(&format!("lm_head.chunk.{j}"), |b| {
                let hj = b.slice(h, &[0, start, 0], &[bs, end, self.dim], &[1, 1, 1])?;
                let yj = b.slice(targets, &[0, start], &[bs, end], &[1, 1])?;
                let logits = b.dot_general(hj, wte, &[2], &[1], &[], &[])?;
                let lp = b.log_softmax(logits, -1)?;
                let hot = b.one_hot(yj, self.vocab, dtype)?;
                let picked = b.mul(lp, hot)?;
                b.reduce_sum(picked, &[0, 1, 2], false)
            })?;
            total = Some(match total {
                None => sum,
                Some(s) => b.add(s, sum)?,
            });
        }
        let total = total.expect("a context of at least one position");
        let count = b.constant((bs * t) as f64, dtype)?;
        let mean = b.div(total, count)?;
        b.neg(mean)
    }

    /// The names of the key-value cache's parameters, `cache.{k,v}.{layer}`, each
    /// `[B, heads, context, head_dim]`, in the order [`decode_step`](Self::decode_step)
    /// makes them (and returns their next values).
    pub fn cache_names(&self) -> Vec<String> {
        (0..self.layers).flat_map(|i| [format!("cache.k.{i}"), format!("cache.v.{i}")]).collect()
    }

    /// One step of decoding with a key-value cache (what `generate` runs per token):
    /// the logits `[B, V]` of integer `token` `[B]` at integer scalar `position`
    /// (`0..context`), given every earlier position's keys and values in the cache
    /// parameters ([`cache_names`](Self::cache_names)), which it returns with this
    /// position's written in. Positions after `position` are masked, so the cache
    /// may hold anything there. Results: the logits, then each cache in order.
    pub fn decode_step(
        &self,
        b: &mut Builder,
        token: Value,
        position: Value,
        context: usize,
        dtype: DType,
    ) -> Result<Vec<Value>> {
        let (_, d) = dims(b, token)?;
        let [bs] = d[..] else {
            return Err(problem("gpt2", b, &[token], "the token must be [batch]".into()));
        };
        self.check(b, token, context)?;
        let (dim, heads) = (self.dim, self.heads);
        let hd = dim / heads;
        let wte = param(b, "transformer.wte.weight", dtype, &[self.vocab, dim])?;
        let wpe = param(b, "transformer.wpe.weight", dtype, &[self.positions, dim])?;
        let mut caches = Vec::with_capacity(2 * self.layers);
        for name in self.cache_names() {
            caches.push(param(b, &name, dtype, &[bs, heads, context, hd])?);
        }
        let ids = b.reshape(token, &[bs, 1])?;
        let tok = b.take(wte, ids, 0)?;
        let at = b.reshape(position, &[1])?;
        let pos = b.take(wpe, at, 0)?;
        let mut x = b.add(tok, pos)?;
        // Which cache slots this step writes (its position) and reads (up to it).
        let slots = b.iota(DType::I32, &[context], 0)?;
        let here = b.eq(slots, position)?;
        let here = b.reshape(here, &[1, 1, context, 1])?;
        let seen = b.le(slots, position)?;
        let seen = b.reshape(seen, &[1, 1, 1, context])?;
        let mut out = Vec::with_capacity(1 + caches.len());
        for i in 0..self.layers {
            let (kc, vc) = (caches[2 * i], caches[2 * i + 1]);
            let mut written = None;
            // This position's key and value written into the cache, the query
            // attending to the cached positions up to it.
            let mut attend = |b: &mut Builder, [q, k, v]: [Value; 3]| -> Result<Value> {
                let shape = [bs, heads, context, hd];
                let kb = b.broadcast_to(k, &shape)?;
                let vb = b.broadcast_to(v, &shape)?;
                let nk = b.select(here, kb, kc)?;
                let nv = b.select(here, vb, vc)?;
                written = Some((nk, nv));
                Gpt2::attention(b, q, nk, nv, seen)
            };
            x = b.scope(&format!("transformer.h.{i}"), |b| self.block(b, x, &mut attend))?;
            let (nk, nv) = written.expect("the block attends once");
            out.push(nk);
            out.push(nv);
        }
        let h = b.scope("transformer.ln_f", |b| self.layer_norm(b, x))?;
        let h = b.reshape(h, &[bs, dim])?;
        let logits = b.dot_general(h, wte, &[1], &[1], &[], &[])?;
        out.insert(0, logits);
        Ok(out)
    }

    /// That a context of `t` positions fits the model and its heads divide its width
    /// (`at` names the input in the error).
    fn check(&self, b: &Builder, at: Value, t: usize) -> Result<()> {
        if t == 0 || t > self.positions {
            return Err(problem(
                "gpt2",
                b,
                &[at],
                format!("a context of {t} tokens; the model has {} positions", self.positions),
            ));
        }
        if self.heads == 0 || !self.dim.is_multiple_of(self.heads) {
            return Err(problem(
                "gpt2",
                b,
                &[at],
                format!("{} heads do not divide the width {}", self.heads, self.dim),
            ));
        }
        Ok(())
    }

    /// LayerNorm with Hugging Face's parameter names (`weight`, `bias`) and the
    /// model's eps.
    fn layer_norm(&self, b: &mut Builder, x: Value) -> Result<Value> {
        layer_norm_named(b, x, self.eps, "weight", "bias")
    }

    /// Conv1D (`x @ weight + bias`, `weight` `[in, out]`) under scope `name`.
    fn conv1d(b: &mut Builder, x: Value, name: &str, out: usize) -> Result<Value> {
        b.scope(name, |b| {
            let (dtype, d) = dims(b, x)?;
            let w = param(b, "weight", dtype, &[d[d.len() - 1], out])?;
            let bias = param(b, "bias", dtype, &[out])?;
            let y = b.matmul(x, w)?;
            b.add(y, bias)
        })
    }

    /// The heads of `q`, `k`, `v` `[B, H, T, hd]` attending where `mask`
    /// (broadcast to the scores `[B, H, Tq, Tk]`) holds, scaled by `1/sqrt(hd)`, the
    /// rest masked to exactly `-1e9`: `[B, H, Tq, hd]`.
    fn attention(b: &mut Builder, q: Value, k: Value, v: Value, mask: Value) -> Result<Value> {
        let (dtype, d) = dims(b, q)?;
        let s = b.dot_general(q, k, &[3], &[3], &[0, 1], &[0, 1])?;
        let root = b.constant((d[3] as f64).sqrt(), dtype)?;
        let s = b.div(s, root)?;
        let masked = b.constant(-1e9, dtype)?;
        let s = b.select(mask, s, masked)?;
        let p = b.softmax(s, -1)?;
        b.dot_general(p, v, &[3], &[2], &[0, 1], &[0, 1])
    }

    /// The causal attention of a block over `[B, H, T, hd]` heads, its queries taken
    /// `block` at a time (0: all at once), each block against only the keys up to
    /// its last query, in a scope `q_block.{i}` of its own: a block's scores are
    /// `[B, H, block, ≤T]`, never `[B, H, T, T]`.
    fn causal_blocked(b: &mut Builder, [q, k, v]: [Value; 3], block: usize) -> Result<Value> {
        let d = dims(b, q)?.1;
        let (bs, heads, t, hd) = (d[0], d[1], d[2], d[3]);
        if block == 0 || block >= t {
            let qi = b.iota(DType::I32, &[t, t], 0)?;
            let ki = b.iota(DType::I32, &[t, t], 1)?;
            let causal = b.ge(qi, ki)?;
            return Gpt2::attention(b, q, k, v, causal);
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
                let causal = b.ge(qi, ki)?;
                Gpt2::attention(b, qb, kb, vb, causal)
            })?);
        }
        b.concat(&outs, 2)
    }

    /// One block on `x` `[B, T, D]`, its parameters in the current scope: `attend`
    /// turns the heads' `[q, k, v]` (`[B, H, T, hd]`) into theirs.
    fn block(
        &self,
        b: &mut Builder,
        x: Value,
        attend: &mut dyn FnMut(&mut Builder, [Value; 3]) -> Result<Value>,
    ) -> Result<Value> {
        let d = dims(b, x)?.1;
        let (bs, t, dim) = (d[0], d[1], self.dim);
        let (heads, hd) = (self.heads, dim / self.heads);
        let h = b.scope("ln_1", |b| self.layer_norm(b, x))?;
        let a = b.scope("attn", |b| {
            let qkv = Gpt2::conv1d(b, h, "c_attn", 3 * dim)?;
            let mut split = |k: usize| -> Result<Value> {
                let part = b.slice(qkv, &[0, 0, k * dim], &[bs, t, (k + 1) * dim], &[1, 1, 1])?;
                let part = b.reshape(part, &[bs, t, heads, hd])?;
                b.transpose(part, &[0, 2, 1, 3])
            };
            let qkv = [split(0)?, split(1)?, split(2)?];
            let o = attend(b, qkv)?;
            let o = b.transpose(o, &[0, 2, 1, 3])?;
            let o = b.reshape(o, &[bs, t, dim])?;
            Gpt2::conv1d(b, o, "c_proj", dim)
        })?;
        let x = b.add(x, a)?;
        let h = b.scope("ln_2", |b| self.layer_norm(b, x))?;
        let m = b.scope("mlp", |b| {
            let u = Gpt2::conv1d(b, h, "c_fc", self.inner)?;
            let g = b.gelu(u)?;
            Gpt2::conv1d(b, g, "c_proj", dim)
        })?;
        b.add(x, m)
    }
}
