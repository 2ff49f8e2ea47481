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
use crate::model::{Adapter, Build};

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
        self.logits_with(b, ids, &Build::new(dtype))
    }

    /// [`logits`](Self::logits) built with `build` (an adapter over the linear layers).
    pub fn logits_with(&self, b: &mut Builder, ids: Value, build: &Build<'_>) -> Result<Value> {
        let (h, wte) = self.hidden(b, ids, build)?;
        // Tied: the logits are the final states against every token's embedding.
        let last = b.spec(h)?.shape.rank() - 1;
        b.dot_general(h, wte, &[last], &[1], &[], &[])
    }

    /// The final states `[B, T, D]` (after `ln_f`) of integer `ids` `[B, T]`, and the
    /// token embedding the logits are tied to.
    fn hidden(&self, b: &mut Builder, ids: Value, build: &Build<'_>) -> Result<(Value, Value)> {
        let (dtype, blocking, ad) = (build.dtype, build.blocking, build.adapter);
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
        let block = blocking;
        let mut attend =
            |b: &mut Builder, qkv: [Value; 3]| lm::causal(b, qkv, block, Scale::DivideBySqrt);
        for i in 0..self.layers {
            x = b.scope(&format!("transformer.h.{i}"), |b| self.block(b, x, &mut attend, ad))?;
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
        self.loss_with(b, rows, &Build { dtype, blocking, adapter: None })
    }

    /// [`loss_blocked`](Self::loss_blocked) built with `build` (its dtype, pieces and
    /// adapter over the linear layers).
    pub fn loss_with(&self, b: &mut Builder, rows: Value, build: &Build<'_>) -> Result<Value> {
        let (ids, targets, _, _) = lm::split_rows(b, rows, "gpt2")?;
        let (h, wte) = self.hidden(b, ids, build)?;
        lm::next_token_loss(b, h, wte, targets, build.blocking.loss_chunk)
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
            x = b.scope(&format!("transformer.h.{i}"), |b| self.block(b, x, &mut attend, None))?;
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

    /// Conv1D (`x @ weight + bias`, `weight` `[in, out]`) under scope `name`, its output
    /// through `adapter` when there is one.
    fn conv1d(
        b: &mut Builder,
        x: Value,
        (name, out): (&str, usize),
        adapter: Option<&dyn Adapter>,
    ) -> Result<Value> {
        b.scope(name, |b| {
            let (dtype, d) = dims(b, x)?;
            let w = param(b, "weight", dtype, &[d[d.len() - 1], out])?;
            let bias = param(b, "bias", dtype, &[out])?;
            let y = b.matmul(x, w)?;
            let y = b.add(y, bias)?;
            match adapter {
                Some(a) => Ok(a.linear(b, &b.scope_name(), x, y)?.unwrap_or(y)),
                None => Ok(y),
            }
        })
    }

    /// One block on `x` `[B, T, D]`, its parameters in the current scope: `attend`
    /// turns the heads' `[q, k, v]` (`[B, H, T, hd]`) into theirs.
    fn block(
        &self,
        b: &mut Builder,
        x: Value,
        attend: &mut dyn FnMut(&mut Builder, [Value; 3]) -> Result<Value>,
        ad: Option<&dyn Adapter>,
    ) -> Result<Value> {
        let d = dims(b, x)?.1;
        let (bs, t, dim) = (d[0], d[1], self.dim);
        let (heads, hd) = (self.heads, dim / self.heads);
        let h = b.scope("ln_1", |b| self.layer_norm(b, x))?;
        let a = b.scope("attn", |b| {
            let qkv = Gpt2::conv1d(b, h, ("c_attn", 3 * dim), ad)?;
            let mut split = |k: usize| -> Result<Value> {
                let part = b.slice(qkv, &[0, 0, k * dim], &[bs, t, (k + 1) * dim], &[1, 1, 1])?;
                let part = b.reshape(part, &[bs, t, heads, hd])?;
                b.transpose(part, &[0, 2, 1, 3])
            };
            let qkv = [split(0)?, split(1)?, split(2)?];
            let o = attend(b, qkv)?;
            let o = b.transpose(o, &[0, 2, 1, 3])?;
            let o = b.reshape(o, &[bs, t, dim])?;
            Gpt2::conv1d(b, o, ("c_proj", dim), ad)
        })?;
        let x = b.add(x, a)?;
        let h = b.scope("ln_2", |b| self.layer_norm(b, x))?;
        let m = b.scope("mlp", |b| {
            let u = Gpt2::conv1d(b, h, ("c_fc", self.inner), ad)?;
            let g = b.gelu(u)?;
            Gpt2::conv1d(b, g, ("c_proj", dim), ad)
        })?;
        b.add(x, m)
    }
}

impl crate::Model for crate::CausalLm<Gpt2> {
    fn family(&self) -> &'static str {
        "gpt2"
    }
    fn describe(&self) -> String {
        let g = &self.model;
        format!(
            "GPT-2 L{} D{} H{} F{} V{} context {} of {}",
            g.layers, g.dim, g.heads, g.inner, g.vocab, self.seq, g.positions
        )
    }
    fn meta(&self) -> serde_json::Value {
        let g = &self.model;
        serde_json::json!({
            "model": "gpt2", "vocab": g.vocab, "positions": g.positions, "dim": g.dim,
            "layers": g.layers, "heads": g.heads, "inner": g.inner, "eps": g.eps, "seq": self.seq,
        })
    }
    fn inputs(&self) -> Vec<crate::Input> {
        vec![crate::Input { name: "rows", dtype: Some(DType::I32), dims: vec![self.seq + 1] }]
    }
    fn parameters(&self) -> Vec<(String, Vec<usize>)> {
        self.model.parameters()
    }
    fn loss(&self, b: &mut Builder, inputs: &[Value], build: &Build<'_>) -> Result<Value> {
        self.model.loss_with(b, inputs[0], build)
    }
    fn evaluate(
        &self,
        b: &mut Builder,
        inputs: &[Value],
        build: &Build<'_>,
    ) -> Result<(Value, Value)> {
        lm::evaluate_rows(b, inputs[0], build.dtype, &|b, ids| {
            self.model.logits_with(b, ids, build)
        })
    }
    fn check_mesh(&self, data: usize, model: usize) -> std::result::Result<(), String> {
        let g = &self.model;
        if [g.heads, g.dim, g.inner].iter().all(|x| x.is_multiple_of(model)) {
            return Ok(());
        }
        Err(format!(
            "--mesh {data}x{model}: the model axis must divide GPT-2's heads {}, width {} and MLP width {}",
            g.heads, g.dim, g.inner
        ))
    }
    /// Megatron's: `c_attn` and `c_fc` by columns (their biases with them), the
    /// projections by rows.
    fn split(&self, name: &str, _model: usize) -> Option<usize> {
        let ends = |s: &[&str]| s.iter().any(|x| name.ends_with(x));
        if ends(&["attn.c_attn.weight", "mlp.c_fc.weight"]) {
            Some(1)
        } else if ends(&[
            "attn.c_proj.weight",
            "mlp.c_proj.weight",
            "attn.c_attn.bias",
            "mlp.c_fc.bias",
        ]) {
            Some(0)
        } else {
            None
        }
    }
    fn is_block(&self, name: &str) -> bool {
        crate::model::numbered(name, "transformer.h.")
    }
    fn layers(&self) -> usize {
        self.model.layers
    }
    /// `GPT2LMHeadModel`'s: normals of 0.02, the residual projections' scaled by
    /// `1/sqrt(2·layers)`, zero biases, unit LayerNorm (a draw for every element).
    fn init(&self, name: &str, dims: &[usize], normal: &mut dyn FnMut() -> f64) -> Vec<f64> {
        let n: usize = dims.iter().product();
        let residual = 0.02 / ((2 * self.model.layers) as f64).sqrt();
        let (scale, shift) = if name.contains(".ln_") && name.ends_with(".weight") {
            (0.0, 1.0)
        } else if name.ends_with(".bias") {
            (0.0, 0.0)
        } else if name.ends_with("c_proj.weight") {
            (residual, 0.0)
        } else {
            (0.02, 0.0)
        };
        (0..n).map(|_| shift + scale * normal()).collect()
    }
    fn activations_per_row(&self, remat: bool) -> f64 {
        let g = &self.model;
        let [v, t, d, f, h] = [g.vocab, self.seq, g.dim, g.inner, g.heads].map(|x| x as f64);
        let rows = t + 1.0;
        let block = rows * (14.0 * d + 3.0 * f + 3.0 * h * t);
        crate::model::blocks_held(rows * 3.0 * v, block, rows * d, g.layers as f64, remat)
    }
    fn attention_scores_per_row(&self, remat: bool) -> f64 {
        let g = &self.model;
        let [t, h] = [self.seq, g.heads].map(|x| x as f64);
        let held = if remat { 1.0 } else { g.layers as f64 };
        (t + 1.0) * 3.0 * h * t * held
    }
    fn per_row(&self) -> (usize, &'static str) {
        (self.seq, "tokens")
    }
    fn classifies(&self) -> bool {
        false
    }
    fn decoder(&self) -> Option<&dyn crate::Decoder> {
        Some(&self.model)
    }
    fn hf(&self) -> Option<&dyn crate::HfFormat> {
        Some(&self.model)
    }
    fn linears(&self) -> Vec<crate::LinearLayer> {
        use crate::Parallel::{Column, Row};
        let (d, f) = (self.model.dim, self.model.inner);
        (0..self.model.layers)
            .flat_map(|i| {
                let h = format!("transformer.h.{i}");
                [
                    (format!("{h}.attn.c_attn"), d, 3 * d, Column),
                    (format!("{h}.attn.c_proj"), d, d, Row),
                    (format!("{h}.mlp.c_fc"), d, f, Column),
                    (format!("{h}.mlp.c_proj"), f, d, Row),
                ]
            })
            .map(|(name, inputs, outputs, parallel)| crate::LinearLayer {
                name,
                inputs,
                outputs,
                parallel,
                conv1d: true,
            })
            .collect()
    }
}

impl crate::Decoder for Gpt2 {
    fn vocab(&self) -> usize {
        self.vocab
    }
    fn heads(&self) -> usize {
        self.heads
    }
    fn positions(&self) -> usize {
        self.positions
    }
    fn check_context(&self, context: usize) -> std::result::Result<(), String> {
        if context == 0 || context > self.positions {
            return Err(format!("{context} positions; the model has {}", self.positions));
        }
        Ok(())
    }
    fn cache(&self, batch: usize, context: usize) -> Vec<(String, Vec<usize>)> {
        let hd = self.dim / self.heads.max(1);
        self.cache_names().into_iter().map(|n| (n, vec![batch, self.heads, context, hd])).collect()
    }
    fn decode_step(
        &self,
        b: &mut Builder,
        token: Value,
        position: Value,
        context: usize,
        dtype: DType,
    ) -> Result<Vec<Value>> {
        Gpt2::decode_step(self, b, token, position, context, dtype)
    }
}

impl crate::HfFormat for Gpt2 {
    /// Both layouts: `save_pretrained`'s names, and the original checkpoints' without
    /// the `transformer.` prefix; the attention-mask buffers and a stored tied
    /// `lm_head` are skipped.
    fn parameter_of(&self, stored: &str) -> crate::Stored {
        if stored.ends_with(".attn.bias") || stored.ends_with(".attn.masked_bias") {
            return crate::Stored::Skipped;
        }
        if stored == "lm_head.weight" {
            return crate::Stored::Skipped;
        }
        let name = match stored.starts_with("transformer.") {
            true => stored.to_string(),
            false => format!("transformer.{stored}"),
        };
        match self.parameters().iter().any(|(n, _)| *n == name) {
            true => crate::Stored::Parameter(name),
            false => crate::Stored::Foreign,
        }
    }
    fn stored_name(&self, name: &str) -> String {
        name.to_string()
    }
    fn config_json(&self) -> serde_json::Value {
        serde_json::json!({
            "model_type": "gpt2",
            "architectures": ["GPT2LMHeadModel"],
            "vocab_size": self.vocab,
            "n_positions": self.positions,
            "n_embd": self.dim,
            "n_layer": self.layers,
            "n_head": self.heads,
            "n_inner": self.inner,
            "layer_norm_epsilon": self.eps,
            "activation_function": "gelu_new",
            "tie_word_embeddings": true,
            "attn_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "resid_pdrop": 0.0,
            "bos_token_id": 50256,
            "eos_token_id": 50256,
        })
    }
}

impl Gpt2 {
    /// The GPT-2 a Hugging Face `config.json` describes (`GPT2Config`'s fields). An
    /// attention variant or activation meshwork does not compute, or untied
    /// embeddings, is refused naming the key.
    pub fn from_config(
        config: &serde_json::Value,
    ) -> std::result::Result<Gpt2, crate::ConfigError> {
        use serde_json::Value as Json;
        let refuse = |key: &str, problem: String| crate::ConfigError { key: key.into(), problem };
        match config.get("model_type").and_then(Json::as_str) {
            Some("gpt2") => {}
            other => {
                return Err(refuse("model_type", format!("{other:?}; GPT-2's is \"gpt2\"")));
            }
        }
        // `gelu_pytorch_tanh` is the same tanh approximation as `gelu_new`.
        if let Some(act) = config.get("activation_function").and_then(Json::as_str)
            && act != "gelu_new"
            && act != "gelu_pytorch_tanh"
        {
            return Err(refuse("activation_function", format!("\"{act}\"; GPT-2's is gelu_new")));
        }
        // Attention variants meshwork does not compute are refused, not ignored.
        if config.get("scale_attn_weights").and_then(Json::as_bool) == Some(false) {
            return Err(refuse(
                "scale_attn_weights",
                "false (unscaled attention) is not supported".into(),
            ));
        }
        if config.get("scale_attn_by_inverse_layer_idx").and_then(Json::as_bool) == Some(true) {
            return Err(refuse(
                "scale_attn_by_inverse_layer_idx",
                "true (scores divided by the layer's index) is not supported".into(),
            ));
        }
        if config.get("tie_word_embeddings").and_then(Json::as_bool) == Some(false) {
            return Err(refuse(
                "tie_word_embeddings",
                "false: untied word embeddings; GPT-2 ties lm_head to wte".into(),
            ));
        }
        let size = |key: &str| -> std::result::Result<usize, crate::ConfigError> {
            let v = config.get(key).and_then(Json::as_u64).filter(|&v| v > 0);
            let v = v.ok_or_else(|| refuse(key, "is not a positive integer".into()))?;
            usize::try_from(v)
                .ok()
                .filter(|&v| v <= 1 << 24)
                .ok_or_else(|| refuse(key, format!("{v} is beyond 2^24")))
        };
        let dim = size("n_embd")?;
        let heads = size("n_head")?;
        if !dim.is_multiple_of(heads) {
            return Err(refuse("n_head", format!("{heads} does not divide n_embd = {dim}")));
        }
        let inner = match config.get("n_inner") {
            None | Some(Json::Null) => dim * 4,
            Some(_) => size("n_inner")?,
        };
        let eps = match config.get("layer_norm_epsilon") {
            None => 1e-5,
            Some(v) => v
                .as_f64()
                .filter(|e| e.is_finite() && *e > 0.0)
                .ok_or_else(|| refuse("layer_norm_epsilon", "is not a positive number".into()))?,
        };
        let layers = size("n_layer")?;
        if layers > 1 << 12 {
            return Err(refuse("n_layer", format!("{layers} is beyond 4096")));
        }
        let model = Gpt2 {
            vocab: size("vocab_size")?,
            positions: size("n_positions")?,
            dim,
            layers,
            heads,
            inner,
            eps,
        };
        // Every parameter's element count fits.
        for (name, shape) in model.parameters() {
            if shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).is_none() {
                return Err(refuse("config.json", format!("{name} of {shape:?} is too large")));
            }
        }
        Ok(model)
    }
}
