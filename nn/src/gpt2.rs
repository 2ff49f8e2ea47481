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

use crate::layers::{dims, layer_norm_named, param, problem};
use crate::lm::{self, Blocking, Scale};

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
        let mut attend =
            |b: &mut Builder, qkv: [Value; 3]| lm::causal(b, qkv, block, Scale::DivideBySqrt);
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
        let (ids, targets, _, _) = lm::split_rows(b, rows, "gpt2")?;
        let (h, wte) = self.hidden(b, ids, dtype, blocking)?;
        lm::next_token_loss(b, h, wte, targets, blocking.loss_chunk)
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
        let (here, seen) = lm::cache_masks(b, position, context)?;
        let mut out = Vec::with_capacity(1 + caches.len());
        for i in 0..self.layers {
            let (kc, vc) = (caches[2 * i], caches[2 * i + 1]);
            let mut written = None;
            // This position's key and value written into the cache, the query
            // attending to the cached positions up to it.
            let mut attend = |b: &mut Builder, [q, k, v]: [Value; 3]| -> Result<Value> {
                let nk = lm::write_cache(b, kc, k, here)?;
                let nv = lm::write_cache(b, vc, v, here)?;
                written = Some((nk, nv));
                lm::attention(b, [q, nk, nv], seen, Scale::DivideBySqrt)
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
