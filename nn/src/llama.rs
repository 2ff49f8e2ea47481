//! The Llama family as Hugging Face's `transformers` computes it — `LlamaForCausalLM`,
//! `MistralForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM` — from a `config.json`
//! alone, its parameters named as `save_pretrained` writes them (linear weights
//! `[out, in]`), so a checkpoint's tensors are the program's parameters by name.
//!
//! Token embeddings; pre-norm blocks `x + attn(rms(x))`, then `x + mlp(rms(x))`;
//! RMSNorm computed in float32 as `transformers` does whatever the model's dtype
//! ([`torch_cpu::rms_norm`]); rotary positions (`default`, `linear` and `llama3`
//! scalings, the tables in float32); grouped-query attention (key/value heads each
//! serving consecutive query heads), scaled by `head_dim^-0.5`, causal; optional q/k/v
//! (and o) biases, Qwen 3's RMSNorm of each head's queries and keys; a SwiGLU MLP
//! `down(silu(gate(x)) · up(x))`; logits against `lm_head` or, tied, the embeddings.
//!
//! ```
//! use meshwork_program::Builder;
//! use meshwork_nn::Llama;
//! use meshwork_types::DType;
//!
//! let config = serde_json::json!({
//!     "model_type": "qwen3", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
//!     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
//!     "head_dim": 4, "tie_word_embeddings": true,
//! });
//! let model = Llama::from_config(&config)?;
//! assert!(model.qk_norm && model.tie && model.kv_heads == 1);
//! let mut b = Builder::new();
//! let rows = b.param("rows", "i32[2,9]".parse()?)?;
//! let loss = model.loss(&mut b, rows, DType::F32)?;
//! let p = b.finish(&[loss])?;
//! assert!(p.params().iter().any(|p| p.name == "model.layers.1.self_attn.k_norm.weight"));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use meshwork_program::{Builder, Result, Value};
use meshwork_types::{DType, Tensor};
use serde_json::Value as Json;

use crate::layers::{dims, param, problem};
use crate::lm::{self, Blocking, Scale};
use crate::model::{Adapter, Build};
use crate::torch_cpu;

/// Which `transformers` class computes the model (`model_type`): they differ in the
/// biases they have and in Qwen 3's per-head norms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LlamaKind {
    /// `llama`: `attention_bias` (q, k, v, o) and `mlp_bias` as configured.
    Llama,
    /// `mistral`: no biases; a sliding window.
    Mistral,
    /// `qwen2`: q, k and v biases always, none elsewhere.
    Qwen2,
    /// `qwen3`: `attention_bias` (q, k, v, o) as configured; RMSNorm of each head's
    /// queries and keys.
    Qwen3,
}

impl LlamaKind {
    /// Its `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            LlamaKind::Llama => "llama",
            LlamaKind::Mistral => "mistral",
            LlamaKind::Qwen2 => "qwen2",
            LlamaKind::Qwen3 => "qwen3",
        }
    }

    /// The kind of `model_type`, if it is one of the family.
    pub fn of(model_type: &str) -> Option<LlamaKind> {
        Some(match model_type {
            "llama" => LlamaKind::Llama,
            "mistral" => LlamaKind::Mistral,
            "qwen2" => LlamaKind::Qwen2,
            "qwen3" => LlamaKind::Qwen3,
            _ => return None,
        })
    }

    /// The `…ForCausalLM` class name `transformers` gives it.
    pub fn architecture(self) -> &'static str {
        match self {
            LlamaKind::Llama => "LlamaForCausalLM",
            LlamaKind::Mistral => "MistralForCausalLM",
            LlamaKind::Qwen2 => "Qwen2ForCausalLM",
            LlamaKind::Qwen3 => "Qwen3ForCausalLM",
        }
    }
}

/// Rotary positions' frequency scaling (`rope_type`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// `default`: `θ^(-2i/d)`.
    Default,
    /// `linear`: every frequency divided by `factor`.
    Linear {
        /// The divisor.
        factor: f64,
    },
    /// `llama3`: low frequencies divided by `factor`, high ones kept, those between
    /// interpolated (Llama 3.1's long-context scaling).
    Llama3 {
        /// The divisor of low frequencies.
        factor: f64,
        /// `low_freq_factor`.
        low: f64,
        /// `high_freq_factor`.
        high: f64,
        /// `original_max_position_embeddings`.
        original: usize,
    },
}

/// A Llama-family model's configuration: what changes its computation.
#[derive(Debug, Clone, PartialEq)]
pub struct Llama {
    /// The `transformers` class.
    pub kind: LlamaKind,
    /// `vocab_size`.
    pub vocab: usize,
    /// `hidden_size`.
    pub dim: usize,
    /// `intermediate_size`: the MLP's width.
    pub ffn: usize,
    /// `num_hidden_layers`.
    pub layers: usize,
    /// `num_attention_heads`.
    pub heads: usize,
    /// `num_key_value_heads` (dividing the heads; 1: multi-query attention).
    pub kv_heads: usize,
    /// `head_dim`.
    pub head_dim: usize,
    /// `max_position_embeddings`: the longest context.
    pub positions: usize,
    /// `rms_norm_eps`.
    pub eps: f64,
    /// `rope_theta`.
    pub rope_theta: f64,
    /// The rotary scaling.
    pub rope: RopeScaling,
    /// `tie_word_embeddings`: logits against the token embeddings.
    pub tie: bool,
    /// Biases on q, k and v.
    pub qkv_bias: bool,
    /// A bias on o.
    pub o_bias: bool,
    /// Biases on gate, up and down.
    pub mlp_bias: bool,
    /// Qwen 3's RMSNorm of each head's queries and keys.
    pub qk_norm: bool,
    /// The attention window of layers that slide (`None`: every layer attends to the
    /// whole context).
    pub sliding_window: Option<usize>,
    /// `pad_token_id`: the embedding's `padding_idx`, whose row the embedding lookup
    /// gives no gradient (and a fresh model initialises to zero), as PyTorch's
    /// `nn.Embedding` does.
    pub pad: Option<usize>,
}

/// A `config.json` field meshwork refuses (`key`) and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The key, as written (`rope_parameters.rope_type`).
    pub key: String,
    /// What is wrong with it.
    pub problem: String,
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.key, self.problem)
    }
}

impl std::error::Error for ConfigError {}

fn refuse(key: &str, problem: impl Into<String>) -> ConfigError {
    ConfigError { key: key.to_string(), problem: problem.into() }
}

/// The most of any one size a config may give.
const MAX_SIZE: u64 = 1 << 24;

/// The defaults `transformers` 5's config class of `kind` gives a missing field:
/// (vocab, hidden, intermediate, layers, heads, key/value heads, positions), the key/value
/// heads 0 where a missing count is the attention heads' (Llama's).
fn defaults(kind: LlamaKind) -> [usize; 7] {
    match kind {
        LlamaKind::Llama => [32000, 4096, 11008, 32, 32, 0, 2048],
        LlamaKind::Mistral => [32000, 4096, 14336, 32, 32, 8, 131_072],
        LlamaKind::Qwen2 | LlamaKind::Qwen3 => [151_936, 4096, 22016, 32, 32, 32, 32768],
    }
}

impl Llama {
    /// The model a Hugging Face `config.json` describes, in either layout
    /// `transformers` has written (4.x: `rope_theta` and `rope_scaling` at the top;
    /// 5.x: `rope_parameters`), each missing field at its class's default. A field that
    /// would change the computation and is not computed here (another rope type, an
    /// activation other than SiLU, `pretraining_tp` above 1, logit soft-capping,
    /// attention dropout, interleaved rotary, quantization) is refused naming it; a
    /// sliding window is kept and checked against the context by
    /// [`check_context`](Self::check_context).
    pub fn from_config(c: &Json) -> std::result::Result<Llama, ConfigError> {
        let Some(obj) = c.as_object() else {
            return Err(refuse("config.json", "not a JSON object"));
        };
        let model_type = obj.get("model_type").and_then(Json::as_str).unwrap_or("");
        let kind = LlamaKind::of(model_type).ok_or_else(|| {
            refuse("model_type", format!("{model_type:?} is not llama, mistral, qwen2 or qwen3"))
        })?;
        let [vocab, dim, ffn, layers, heads, kv, positions] = defaults(kind);
        let size = |key: &str, default: usize| -> std::result::Result<usize, ConfigError> {
            match obj.get(key) {
                None | Some(Json::Null) => Ok(default),
                Some(v) => match v.as_u64() {
                    Some(n) if (1..=MAX_SIZE).contains(&n) => Ok(n as usize),
                    _ => Err(refuse(key, format!("{v} is not a size from 1 to 2^24"))),
                },
            }
        };
        let vocab = size("vocab_size", vocab)?;
        let dim = size("hidden_size", dim)?;
        let ffn = size("intermediate_size", ffn)?;
        let layers = size("num_hidden_layers", layers)?;
        if layers > 4096 {
            return Err(refuse("num_hidden_layers", format!("{layers} is beyond 4096")));
        }
        let heads = size("num_attention_heads", heads)?;
        // An explicit null is the attention heads' count in every class.
        let null = matches!(obj.get("num_key_value_heads"), Some(Json::Null));
        let kv_default = if null || kv == 0 { heads } else { kv };
        let kv_heads = size("num_key_value_heads", kv_default)?;
        if !heads.is_multiple_of(kv_heads) {
            return Err(refuse(
                "num_key_value_heads",
                format!("{kv_heads} does not divide num_attention_heads {heads}"),
            ));
        }
        // Qwen 3's class defaults head_dim to 128; the others take hidden / heads.
        let head_default = if kind == LlamaKind::Qwen3 { 128 } else { dim / heads };
        let head_dim = size("head_dim", head_default)?;
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(refuse("head_dim", format!("{head_dim} is not an even size")));
        }
        let positions = size("max_position_embeddings", positions)?;
        let number = |key: &str, default: f64| -> std::result::Result<f64, ConfigError> {
            match obj.get(key) {
                None | Some(Json::Null) => Ok(default),
                Some(v) => v
                    .as_f64()
                    .filter(|x| x.is_finite() && *x > 0.0)
                    .ok_or_else(|| refuse(key, format!("{v} is not a positive number"))),
            }
        };
        let eps = number("rms_norm_eps", 1e-6)?;
        let flag = |key: &str, default: bool| -> std::result::Result<bool, ConfigError> {
            match obj.get(key) {
                None | Some(Json::Null) => Ok(default),
                Some(Json::Bool(b)) => Ok(*b),
                Some(v) => Err(refuse(key, format!("{v} is not true or false"))),
            }
        };
        let tie = flag("tie_word_embeddings", false)?;
        let (qkv_bias, o_bias, mlp_bias, qk_norm) = match kind {
            LlamaKind::Llama => {
                let a = flag("attention_bias", false)?;
                (a, a, flag("mlp_bias", false)?, false)
            }
            LlamaKind::Mistral => (false, false, false, false),
            LlamaKind::Qwen2 => (true, false, false, false),
            LlamaKind::Qwen3 => {
                let a = flag("attention_bias", false)?;
                (a, a, false, true)
            }
        };
        // What would change the computation and is not computed here.
        // `swish` is transformers' other name for SiLU.
        match obj.get("hidden_act") {
            None | Some(Json::Null) => {}
            Some(Json::String(a)) if a == "silu" || a == "swish" => {}
            Some(other) => {
                return Err(refuse("hidden_act", format!("{other}; meshwork computes silu")));
            }
        }
        if let Some(v) = obj.get("pretraining_tp").filter(|v| !v.is_null())
            && v.as_u64() != Some(1)
        {
            return Err(refuse(
                "pretraining_tp",
                format!("{v}: only 1 (no sliced projections) is computed"),
            ));
        }
        if let Some(v) = obj.get("attention_dropout").filter(|v| !v.is_null())
            && v.as_f64() != Some(0.0)
        {
            return Err(refuse(
                "attention_dropout",
                format!("{v}: meshwork trains the model without attention dropout"),
            ));
        }
        for key in ["attn_logit_softcapping", "final_logit_softcapping"] {
            if let Some(v) = obj.get(key).filter(|v| !v.is_null()) {
                return Err(refuse(key, format!("{v}: soft-capping is not computed")));
            }
        }
        if let Some(v) = obj.get("partial_rotary_factor").filter(|v| !v.is_null())
            && v.as_f64() != Some(1.0)
        {
            return Err(refuse(
                "partial_rotary_factor",
                format!("{v}: only whole heads rotate here"),
            ));
        }
        for key in ["rope_interleaved", "use_mrope"] {
            if flag(key, false)? {
                return Err(refuse(key, "true is not computed"));
            }
        }
        if obj.get("quantization_config").is_some_and(|v| !v.is_null()) {
            return Err(refuse("quantization_config", "quantized weights are not read"));
        }
        let (rope_theta, rope) = rope_of(obj)?;
        let sliding_window = sliding_window(kind, obj, layers)?;
        // PyTorch's `padding_idx`: in 0..vocab, or counted from the end when negative.
        let pad = match obj.get("pad_token_id") {
            None | Some(Json::Null) => None,
            Some(v) => match v.as_i64() {
                Some(p) if (0..vocab as i64).contains(&p) => Some(p as usize),
                Some(p) if p < 0 && p >= -(vocab as i64) => Some((vocab as i64 + p) as usize),
                _ => {
                    return Err(refuse(
                        "pad_token_id",
                        format!("{v} is not a token of the vocabulary of {vocab}"),
                    ));
                }
            },
        };
        let model = Llama {
            kind,
            vocab,
            dim,
            ffn,
            layers,
            heads,
            kv_heads,
            head_dim,
            positions,
            eps,
            rope_theta,
            rope,
            tie,
            qkv_bias,
            o_bias,
            mlp_bias,
            qk_norm,
            sliding_window,
            pad,
        };
        for (name, shape) in model.parameters() {
            if shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).is_none() {
                return Err(refuse("config.json", format!("{name} of {shape:?} is too large")));
            }
        }
        Ok(model)
    }

    /// That a context of `t` positions is one the model computes as `transformers`
    /// does: at most its positions, and no longer than a sliding window (which would
    /// mask keys meshwork does not mask).
    pub fn check_context(&self, t: usize) -> std::result::Result<(), ConfigError> {
        if t == 0 || t > self.positions {
            return Err(refuse(
                "max_position_embeddings",
                format!("a context of {t}; the model has {} positions", self.positions),
            ));
        }
        if let Some(w) = self.sliding_window
            && w < t
        {
            return Err(refuse(
                "sliding_window",
                format!(
                    "{w} is shorter than the context of {t}, and sliding attention is not computed"
                ),
            ));
        }
        Ok(())
    }

    /// The sizes of a named model without a checkpoint: `smollm2-135m`, `qwen2.5-0.5b`,
    /// `llama-3.2-1b`, or `tiny-llama` (a 2-block, width-32 model for tests).
    pub fn preset(name: &str) -> Option<Llama> {
        let config = match name {
            "smollm2-135m" => serde_json::json!({
                "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
                "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
                "rope_theta": 100000.0, "tie_word_embeddings": true,
            }),
            "qwen2.5-0.5b" => serde_json::json!({
                "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896,
                "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
                "num_key_value_heads": 2, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                "rope_theta": 1000000.0, "tie_word_embeddings": true,
            }),
            "llama-3.2-1b" => serde_json::json!({
                "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
                "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
                "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072,
                "rms_norm_eps": 1e-5, "tie_word_embeddings": true,
                "rope_theta": 500000.0,
                "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
            }),
            "tiny-llama" => serde_json::json!({
                "model_type": "llama", "vocab_size": 320, "hidden_size": 32,
                "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "max_position_embeddings": 64,
            }),
            _ => return None,
        };
        Llama::from_config(&config).ok()
    }

    /// The names of the presets.
    pub const PRESETS: [&'static str; 4] =
        ["tiny-llama", "smollm2-135m", "qwen2.5-0.5b", "llama-3.2-1b"];

    /// The `config.json` `transformers` 5 writes for the model (for a model from a
    /// preset; one read from a file is written back as it was read).
    pub fn config(&self) -> Json {
        let mut rope = serde_json::json!({"rope_theta": self.rope_theta});
        match self.rope {
            RopeScaling::Default => rope["rope_type"] = "default".into(),
            RopeScaling::Linear { factor } => {
                rope["rope_type"] = "linear".into();
                rope["factor"] = factor.into();
            }
            RopeScaling::Llama3 { factor, low, high, original } => {
                rope["rope_type"] = "llama3".into();
                rope["factor"] = factor.into();
                rope["low_freq_factor"] = low.into();
                rope["high_freq_factor"] = high.into();
                rope["original_max_position_embeddings"] = original.into();
            }
        }
        let mut c = serde_json::json!({
            "model_type": self.kind.model_type(),
            "architectures": [self.kind.architecture()],
            "vocab_size": self.vocab,
            "hidden_size": self.dim,
            "intermediate_size": self.ffn,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.positions,
            "rms_norm_eps": self.eps,
            "hidden_act": "silu",
            "tie_word_embeddings": self.tie,
            "rope_parameters": rope,
            "attention_dropout": 0.0,
            "pad_token_id": self.pad,
        });
        match self.kind {
            LlamaKind::Llama => {
                c["attention_bias"] = self.qkv_bias.into();
                c["mlp_bias"] = self.mlp_bias.into();
            }
            LlamaKind::Qwen3 => c["attention_bias"] = self.qkv_bias.into(),
            LlamaKind::Mistral => c["sliding_window"] = serde_json::json!(self.sliding_window),
            LlamaKind::Qwen2 => {}
        }
        if let (Some(w), LlamaKind::Qwen2 | LlamaKind::Qwen3) = (self.sliding_window, self.kind) {
            c["use_sliding_window"] = true.into();
            c["sliding_window"] = w.into();
            c["max_window_layers"] = 0.into();
        }
        c
    }

    /// Its parameters' names and shapes, in the order the program makes them.
    pub fn parameters(&self) -> Vec<(String, Vec<usize>)> {
        let (d, f, hd) = (self.dim, self.ffn, self.head_dim);
        let (q, kv) = (self.heads * hd, self.kv_heads * hd);
        let mut out = vec![("model.embed_tokens.weight".to_string(), vec![self.vocab, d])];
        for i in 0..self.layers {
            let l = format!("model.layers.{i}");
            let mut add = |name: &str, shape: Vec<usize>| out.push((format!("{l}.{name}"), shape));
            add("input_layernorm.weight", vec![d]);
            for (proj, rows) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
                add(&format!("self_attn.{proj}.weight"), vec![rows, d]);
                if self.qkv_bias {
                    add(&format!("self_attn.{proj}.bias"), vec![rows]);
                }
            }
            if self.qk_norm {
                add("self_attn.q_norm.weight", vec![hd]);
                add("self_attn.k_norm.weight", vec![hd]);
            }
            add("self_attn.o_proj.weight", vec![d, q]);
            if self.o_bias {
                add("self_attn.o_proj.bias", vec![d]);
            }
            add("post_attention_layernorm.weight", vec![d]);
            for (proj, shape) in [("gate_proj", [f, d]), ("up_proj", [f, d]), ("down_proj", [d, f])]
            {
                add(&format!("mlp.{proj}.weight"), shape.to_vec());
                if self.mlp_bias {
                    add(&format!("mlp.{proj}.bias"), vec![shape[0]]);
                }
            }
        }
        out.push(("model.norm.weight".to_string(), vec![d]));
        if !self.tie {
            out.push(("lm_head.weight".to_string(), vec![self.vocab, d]));
        }
        out
    }

    /// The rotary inverse frequencies `[head_dim / 2]` as `transformers` computes them
    /// in float32 (the scaling's arithmetic too, operation by operation).
    pub fn inv_freq(&self) -> Vec<f32> {
        let theta = self.rope_theta as f32;
        let inv: Vec<f32> =
            torch_cpu::pow_arange(theta, self.head_dim).iter().map(|p| 1.0 / p).collect();
        match self.rope {
            RopeScaling::Default => inv,
            RopeScaling::Linear { factor } => inv.iter().map(|i| i / factor as f32).collect(),
            RopeScaling::Llama3 { factor, low, high, original } => {
                let (factor, ocl) = (factor as f32, original as f32);
                let low_wavelen = (original as f64 / low) as f32;
                let high_wavelen = (original as f64 / high) as f32;
                let two_pi = (2.0 * std::f64::consts::PI) as f32;
                let span = (high - low) as f32;
                inv.iter()
                    .map(|&i| {
                        // `2 * math.pi / inv_freq` is `inv_freq.reciprocal() * (2π)`.
                        let wavelen = (1.0 / i) * two_pi;
                        let scaled = if wavelen > low_wavelen { i / factor } else { i };
                        let smooth = ((1.0 / wavelen) * ocl - low as f32) / span;
                        let smoothed = (1.0 - smooth) * scaled / factor + smooth * scaled;
                        // `~(w < high) * ~(w > low)`: the wavelengths are finite.
                        let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
                        if medium { smoothed } else { scaled }
                    })
                    .collect()
            }
        }
    }

    /// The embeddings of integer `ids` from `table`, the padding row's held out of
    /// differentiation (PyTorch's `padding_idx`: its gradient is zero).
    fn embed(&self, b: &mut Builder, table: Value, ids: Value) -> Result<Value> {
        let x = b.take(table, ids, 0)?;
        let Some(pad) = self.pad else { return Ok(x) };
        let d = dims(b, ids)?.1;
        let pad = b.constant(pad as f64, DType::I32)?;
        let at = b.eq(ids, pad)?;
        let mut shape = d.clone();
        shape.push(1);
        let at = b.reshape(at, &shape)?;
        let held = b.stop_gradient(x)?;
        b.select(at, held, x)
    }

    /// The rotary tables `cos` and `sin` of positions `0..n`, `[n, head_dim]` (each
    /// row the frequencies twice, as `torch.cat((freqs, freqs))`), float32 values as
    /// `dtype` literals.
    fn rope_tables(&self, b: &mut Builder, n: usize, dtype: DType) -> Result<(Value, Value)> {
        let inv = self.inv_freq();
        let hd = self.head_dim;
        let mut cos = Vec::with_capacity(n * hd);
        let mut sin = Vec::with_capacity(n * hd);
        for p in 0..n {
            let angles: Vec<f32> = inv.iter().map(|&f| p as f32 * f).collect();
            for _ in 0..2 {
                cos.extend(angles.iter().map(|&a| f64::from(torch_cpu::cos(a))));
                sin.extend(angles.iter().map(|&a| f64::from(torch_cpu::sin(a))));
            }
        }
        let table = |values: Vec<f64>| Tensor::from_f64(dtype, &[n, hd], &values);
        let cos = b.literal(table(cos)?)?;
        let sin = b.literal(table(sin)?)?;
        Ok((cos, sin))
    }

    /// `x · cos + rotate_half(x) · sin` of heads `x` `[B, H, T, hd]`, the tables
    /// broadcast from `[T, hd]`.
    fn rotate(b: &mut Builder, x: Value, cos: Value, sin: Value) -> Result<Value> {
        let d = dims(b, x)?.1;
        let (bs, h, t, hd) = (d[0], d[1], d[2], d[3]);
        let half = hd / 2;
        let x1 = b.slice(x, &[0, 0, 0, 0], &[bs, h, t, half], &[1, 1, 1, 1])?;
        let x2 = b.slice(x, &[0, 0, 0, half], &[bs, h, t, hd], &[1, 1, 1, 1])?;
        let minus = b.neg(x2)?;
        let rotated = b.concat(&[minus, x1], 3)?;
        let shape = [1, 1, t, hd];
        let cos = b.reshape(cos, &shape)?;
        let sin = b.reshape(sin, &shape)?;
        let a = b.mul(x, cos)?;
        let r = b.mul(rotated, sin)?;
        b.add(a, r)
    }

    /// `x · Wᵀ (+ bias)` of the linear layer in scope `name`: parameters `weight`
    /// `[out, in]` and, with `bias`, `bias` `[out]`.
    fn linear(
        b: &mut Builder,
        x: Value,
        (name, out, bias): (&str, usize, bool),
        adapter: Option<&dyn Adapter>,
    ) -> Result<Value> {
        b.scope(name, |b| {
            let (dtype, d) = dims(b, x)?;
            let inp = d[d.len() - 1];
            let w = param(b, "weight", dtype, &[out, inp])?;
            let mut y = b.dot_general(x, w, &[d.len() - 1], &[1], &[], &[])?;
            if bias {
                let bb = param(b, "bias", dtype, &[out])?;
                y = b.add(y, bb)?;
            }
            match adapter {
                Some(a) => Ok(a.linear(b, &b.scope_name(), x, y)?.unwrap_or(y)),
                None => Ok(y),
            }
        })
    }

    /// `x` `[B, T, n·hd]` as heads `[B, n, T, hd]`, each head RMS-normed under scope
    /// `norm` first when one is named.
    fn heads_of(&self, b: &mut Builder, x: Value, n: usize, norm: Option<&str>) -> Result<Value> {
        let d = dims(b, x)?.1;
        let x = b.reshape(x, &[d[0], d[1], n, self.head_dim])?;
        let x = match norm {
            Some(name) => b.scope(name, |b| torch_cpu::rms_norm(b, x, self.eps))?,
            None => x,
        };
        b.transpose(x, &[0, 2, 1, 3])
    }

    /// The attention's q, k and v heads of `h` `[B, T, D]` (k and v of the key/value
    /// heads), q and k rotated by the tables.
    fn qkv(
        &self,
        b: &mut Builder,
        h: Value,
        (cos, sin): (Value, Value),
        ad: Option<&dyn Adapter>,
    ) -> Result<[Value; 3]> {
        let hd = self.head_dim;
        let q = Llama::linear(b, h, ("q_proj", self.heads * hd, self.qkv_bias), ad)?;
        let k = Llama::linear(b, h, ("k_proj", self.kv_heads * hd, self.qkv_bias), ad)?;
        let v = Llama::linear(b, h, ("v_proj", self.kv_heads * hd, self.qkv_bias), ad)?;
        let norm = |n: &'static str| self.qk_norm.then_some(n);
        let q = self.heads_of(b, q, self.heads, norm("q_norm"))?;
        let k = self.heads_of(b, k, self.kv_heads, norm("k_norm"))?;
        let v = self.heads_of(b, v, self.kv_heads, None)?;
        let q = Llama::rotate(b, q, cos, sin)?;
        let k = Llama::rotate(b, k, cos, sin)?;
        Ok([q, k, v])
    }

    /// One block on `x` `[B, T, D]`, its parameters in the current scope: `attend`
    /// turns the rotated `[q, k, v]` heads (k and v of the key/value heads) into the
    /// attention's `[B, H, T, hd]`.
    fn block(
        &self,
        b: &mut Builder,
        x: Value,
        tables: (Value, Value),
        attend: &mut dyn FnMut(&mut Builder, [Value; 3]) -> Result<Value>,
        ad: Option<&dyn Adapter>,
    ) -> Result<Value> {
        let d = dims(b, x)?.1;
        let (bs, t) = (d[0], d[1]);
        let h = b.scope("input_layernorm", |b| torch_cpu::rms_norm(b, x, self.eps))?;
        let a = b.scope("self_attn", |b| {
            let qkv = self.qkv(b, h, tables, ad)?;
            let o = attend(b, qkv)?;
            let o = b.transpose(o, &[0, 2, 1, 3])?;
            let o = b.reshape(o, &[bs, t, self.heads * self.head_dim])?;
            Llama::linear(b, o, ("o_proj", self.dim, self.o_bias), ad)
        })?;
        let x = b.add(x, a)?;
        let h = b.scope("post_attention_layernorm", |b| torch_cpu::rms_norm(b, x, self.eps))?;
        let m = b.scope("mlp", |b| {
            let gate = Llama::linear(b, h, ("gate_proj", self.ffn, self.mlp_bias), ad)?;
            let up = Llama::linear(b, h, ("up_proj", self.ffn, self.mlp_bias), ad)?;
            let sig = b.logistic(gate)?;
            let silu = b.mul(gate, sig)?;
            let g = b.mul(silu, up)?;
            Llama::linear(b, g, ("down_proj", self.dim, self.mlp_bias), ad)
        })?;
        b.add(x, m)
    }

    /// That the heads fit the model and a context of `t` is computed as `transformers`
    /// does (`at` names the input in the error).
    fn check(&self, b: &Builder, at: Value, t: usize) -> Result<()> {
        if let Err(e) = self.check_context(t) {
            return Err(problem("llama", b, &[at], e.to_string()));
        }
        if self.kv_heads == 0 || !self.heads.is_multiple_of(self.kv_heads) {
            return Err(problem(
                "llama",
                b,
                &[at],
                format!("{} key/value heads do not divide {} heads", self.kv_heads, self.heads),
            ));
        }
        Ok(())
    }

    /// The final states `[B, T, D]` (after `model.norm`) of integer `ids` `[B, T]` and
    /// the output matrix `[V, D]` the logits are taken against.
    fn hidden(&self, b: &mut Builder, ids: Value, build: &Build<'_>) -> Result<(Value, Value)> {
        let (dtype, blocking, ad) = (build.dtype, build.blocking, build.adapter);
        let (_, d) = dims(b, ids)?;
        let [_, t] = d[..] else {
            return Err(problem("llama", b, &[ids], "ids must be [batch, time]".into()));
        };
        self.check(b, ids, t)?;
        let embed = param(b, "model.embed_tokens.weight", dtype, &[self.vocab, self.dim])?;
        let mut x = self.embed(b, embed, ids)?;
        let tables = self.rope_tables(b, t, dtype)?;
        let heads = self.heads;
        let block = blocking;
        let mut attend = |b: &mut Builder, [q, k, v]: [Value; 3]| -> Result<Value> {
            let k = lm::repeat_kv(b, k, heads)?;
            let v = lm::repeat_kv(b, v, heads)?;
            lm::causal(b, [q, k, v], block, Scale::MultiplyByInverseSqrt)
        };
        for i in 0..self.layers {
            x = b.scope(&format!("model.layers.{i}"), |b| {
                self.block(b, x, tables, &mut attend, ad)
            })?;
        }
        let h = b.scope("model.norm", |b| torch_cpu::rms_norm(b, x, self.eps))?;
        let head = match self.tie {
            true => embed,
            false => param(b, "lm_head.weight", dtype, &[self.vocab, self.dim])?,
        };
        Ok((h, head))
    }

    /// Logits `[B, T, V]` of integer `ids` `[B, T]`, the parameters of `dtype`.
    pub fn logits(&self, b: &mut Builder, ids: Value, dtype: DType) -> Result<Value> {
        self.logits_with(b, ids, &Build::new(dtype))
    }

    /// [`logits`](Self::logits) built with `build` (an adapter over the linear layers).
    pub fn logits_with(&self, b: &mut Builder, ids: Value, build: &Build<'_>) -> Result<Value> {
        let (h, head) = self.hidden(b, ids, build)?;
        b.dot_general(h, head, &[2], &[1], &[], &[])
    }

    /// The mean next-token cross-entropy of integer `rows` `[B, T + 1]`: inputs
    /// `row[:T]`, targets `row[1:]`.
    pub fn loss(&self, b: &mut Builder, rows: Value, dtype: DType) -> Result<Value> {
        self.loss_blocked(b, rows, dtype, Blocking::default())
    }

    /// [`loss`](Self::loss) with the attention and the loss cut into pieces by
    /// `blocking` (scopes `….self_attn.q_block.{i}` and `lm_head.chunk.{j}`, the
    /// regions a training step recomputes in its backward pass).
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
        let (ids, targets, _, _) = lm::split_rows(b, rows, "llama")?;
        let (h, head) = self.hidden(b, ids, build)?;
        lm::next_token_loss(b, h, head, targets, build.blocking.loss_chunk)
    }

    /// The names of the key-value cache's parameters, `cache.{k,v}.{layer}`, each
    /// `[B, kv_heads, context, head_dim]` (the key/value heads only), in the order
    /// [`decode_step`](Self::decode_step) makes them.
    pub fn cache_names(&self) -> Vec<String> {
        (0..self.layers).flat_map(|i| [format!("cache.k.{i}"), format!("cache.v.{i}")]).collect()
    }

    /// One step of decoding with a key-value cache: the logits `[B, V]` of integer
    /// `token` `[B]` at integer scalar `position` (`0..context`), given every earlier
    /// position's rotated keys and values in the cache parameters
    /// ([`cache_names`](Self::cache_names)), which it returns with this position's
    /// written in. Results: the logits, then each cache in order.
    pub fn decode_step(
        &self,
        b: &mut Builder,
        token: Value,
        position: Value,
        context: usize,
        dtype: DType,
    ) -> Result<Vec<Value>> {
        self.decode_with(b, [token, position], context, &Build::new(dtype))
    }

    /// [`decode_step`](Self::decode_step) built with `build` (an adapter over its
    /// linear layers: LoRA applied in the step).
    pub fn decode_with(
        &self,
        b: &mut Builder,
        [token, position]: [Value; 2],
        context: usize,
        build: &Build<'_>,
    ) -> Result<Vec<Value>> {
        let (dtype, adapter) = (build.dtype, build.adapter);
        let (_, d) = dims(b, token)?;
        let [bs] = d[..] else {
            return Err(problem("llama", b, &[token], "the token must be [batch]".into()));
        };
        self.check(b, token, context)?;
        let embed = param(b, "model.embed_tokens.weight", dtype, &[self.vocab, self.dim])?;
        let mut caches = Vec::with_capacity(2 * self.layers);
        for name in self.cache_names() {
            caches.push(param(b, &name, dtype, &[bs, self.kv_heads, context, self.head_dim])?);
        }
        let ids = b.reshape(token, &[bs, 1])?;
        let mut x = b.take(embed, ids, 0)?;
        // This position's rows of the tables.
        let (cos, sin) = self.rope_tables(b, context, dtype)?;
        let at = b.reshape(position, &[1])?;
        let tables = (b.take(cos, at, 0)?, b.take(sin, at, 0)?);
        let (here, seen) = lm::cache_masks(b, position, context)?;
        let mut out = Vec::with_capacity(1 + caches.len());
        for i in 0..self.layers {
            let (kc, vc) = (caches[2 * i], caches[2 * i + 1]);
            let mut written = None;
            let heads = self.heads;
            let mut attend = |b: &mut Builder, [q, k, v]: [Value; 3]| -> Result<Value> {
                let nk = lm::write_cache(b, kc, k, here)?;
                let nv = lm::write_cache(b, vc, v, here)?;
                written = Some((nk, nv));
                let k = lm::repeat_kv(b, nk, heads)?;
                let v = lm::repeat_kv(b, nv, heads)?;
                lm::attention(b, [q, k, v], seen, Scale::MultiplyByInverseSqrt)
            };
            x = b.scope(&format!("model.layers.{i}"), |b| {
                self.block(b, x, tables, &mut attend, adapter)
            })?;
            let (nk, nv) = written.expect("the block attends once");
            out.push(nk);
            out.push(nv);
        }
        let h = b.scope("model.norm", |b| torch_cpu::rms_norm(b, x, self.eps))?;
        let h = b.reshape(h, &[bs, self.dim])?;
        let head = match self.tie {
            true => embed,
            false => param(b, "lm_head.weight", dtype, &[self.vocab, self.dim])?,
        };
        let logits = b.dot_general(h, head, &[1], &[1], &[], &[])?;
        out.insert(0, logits);
        Ok(out)
    }
}

/// `rope_theta` and the scaling, from `rope_parameters` (5.x) or `rope_theta` and
/// `rope_scaling` (4.x).
fn rope_of(
    obj: &serde_json::Map<String, Json>,
) -> std::result::Result<(f64, RopeScaling), ConfigError> {
    let (params, at) = match obj.get("rope_parameters").filter(|v| !v.is_null()) {
        Some(p) => (Some(p), "rope_parameters"),
        None => (obj.get("rope_scaling").filter(|v| !v.is_null()), "rope_scaling"),
    };
    let empty = serde_json::Map::new();
    let params = match params {
        None => &empty,
        Some(p) => p.as_object().ok_or_else(|| refuse(at, "not a JSON object"))?,
    };
    let key = |k: &str| format!("{at}.{k}");
    let theta = match params.get("rope_theta").or_else(|| obj.get("rope_theta")) {
        None | Some(Json::Null) => 10000.0,
        Some(v) => v
            .as_f64()
            .filter(|x| x.is_finite() && *x > 1.0)
            .ok_or_else(|| refuse("rope_theta", format!("{v} is not a number above 1")))?,
    };
    let kind = params
        .get("rope_type")
        .or_else(|| params.get("type"))
        .map(|v| v.as_str().ok_or_else(|| refuse(&key("rope_type"), format!("{v} is not a name"))))
        .transpose()?
        .unwrap_or("default");
    let number = |k: &str| -> std::result::Result<f64, ConfigError> {
        params
            .get(k)
            .and_then(Json::as_f64)
            .filter(|x| x.is_finite() && *x > 0.0)
            .ok_or_else(|| refuse(&key(k), "not a positive number"))
    };
    if let Some(v) = params.get("partial_rotary_factor").filter(|v| !v.is_null())
        && v.as_f64() != Some(1.0)
    {
        return Err(refuse(
            &key("partial_rotary_factor"),
            format!("{v}: only whole heads rotate here"),
        ));
    }
    if params.get("mrope_section").is_some_and(|v| !v.is_null()) {
        return Err(refuse(&key("mrope_section"), "multimodal rotary positions are not computed"));
    }
    let scaling = match kind {
        "default" => RopeScaling::Default,
        "linear" => RopeScaling::Linear { factor: number("factor")? },
        "llama3" => {
            let (low, high) = (number("low_freq_factor")?, number("high_freq_factor")?);
            if high <= low {
                return Err(refuse(&key("high_freq_factor"), "not above low_freq_factor"));
            }
            let original = params
                .get("original_max_position_embeddings")
                .and_then(Json::as_u64)
                .filter(|&n| (1..=MAX_SIZE).contains(&n))
                .ok_or_else(|| refuse(&key("original_max_position_embeddings"), "not a size"))?;
            RopeScaling::Llama3 {
                factor: number("factor")?,
                low,
                high,
                original: original as usize,
            }
        }
        other => {
            return Err(refuse(
                &key("rope_type"),
                format!("{other:?}; meshwork computes default, linear and llama3"),
            ));
        }
    };
    Ok((theta, scaling))
}

/// The window of the layers that slide, when any does (`None`: none does). A
/// `layer_types` entry other than full or sliding attention is refused, whether or
/// not the window is used.
fn sliding_window(
    kind: LlamaKind,
    obj: &serde_json::Map<String, Json>,
    layers: usize,
) -> std::result::Result<Option<usize>, ConfigError> {
    let window = match obj.get("sliding_window") {
        None => match kind {
            LlamaKind::Mistral => Some(4096),
            _ => None,
        },
        Some(Json::Null) => None,
        Some(v) => Some(
            v.as_u64()
                .filter(|&n| n >= 1)
                .ok_or_else(|| refuse("sliding_window", format!("{v} is not a size")))?
                as usize,
        ),
    };
    let types = match obj.get("layer_types").filter(|v| !v.is_null()) {
        Some(Json::Array(a)) => Some(
            a.iter()
                .map(|t| match t.as_str() {
                    Some("full_attention") => Ok(false),
                    Some("sliding_attention") => Ok(true),
                    _ => Err(refuse(
                        "layer_types",
                        format!("{t}: meshwork computes full_attention (and sliding_attention over a window no shorter than the context)"),
                    )),
                })
                .collect::<std::result::Result<Vec<bool>, ConfigError>>()?,
        ),
        Some(v) => return Err(refuse("layer_types", format!("{v} is not a list"))),
        None => None,
    };
    Ok(match kind {
        // Llama has no sliding window; Mistral slides every layer.
        LlamaKind::Llama => None,
        LlamaKind::Mistral => window,
        LlamaKind::Qwen2 | LlamaKind::Qwen3 => {
            let on = match obj.get("use_sliding_window") {
                None | Some(Json::Null) => false,
                Some(Json::Bool(b)) => *b,
                Some(v) => {
                    return Err(refuse("use_sliding_window", format!("{v} is not true or false")));
                }
            };
            let Some(window) = window.filter(|_| on) else { return Ok(None) };
            let types = match types {
                Some(t) => t,
                None => {
                    let first = match obj.get("max_window_layers") {
                        None | Some(Json::Null) => 28,
                        Some(v) => v.as_u64().ok_or_else(|| {
                            refuse("max_window_layers", format!("{v} is not a count"))
                        })? as usize,
                    };
                    (0..layers).map(|i| i >= first).collect()
                }
            };
            types.iter().any(|&s| s).then_some(window)
        }
    })
}

impl crate::Model for crate::CausalLm<Llama> {
    fn family(&self) -> &'static str {
        self.model.kind.model_type()
    }
    fn describe(&self) -> String {
        let m = &self.model;
        format!(
            "{} L{} D{} H{} KV{} F{} V{} context {} of {}",
            m.kind.architecture().trim_end_matches("ForCausalLM"),
            m.layers,
            m.dim,
            m.heads,
            m.kv_heads,
            m.ffn,
            m.vocab,
            self.seq,
            m.positions
        )
    }
    /// Its configuration as `transformers` 5 writes it (`config`), and the context.
    fn meta(&self) -> Json {
        serde_json::json!({
            "model": self.model.kind.model_type(), "config": self.model.config(), "seq": self.seq,
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
    /// Megatron's, the key/value heads replicated over the model positions that share
    /// them where the axis is larger than their count (as Megatron and vLLM do).
    fn check_mesh(&self, data: usize, model: usize) -> std::result::Result<(), String> {
        let m = &self.model;
        let kv = m.kv_heads.is_multiple_of(model) || model.is_multiple_of(m.kv_heads);
        if m.heads.is_multiple_of(model) && m.ffn.is_multiple_of(model) && kv {
            return Ok(());
        }
        Err(format!(
            "--mesh {data}x{model}: the model axis must divide the {} attention heads and the MLP width {}, and divide or be a multiple of the {} key/value heads",
            m.heads, m.ffn, m.kv_heads
        ))
    }
    fn split(&self, name: &str, model: usize) -> Option<usize> {
        let ends = |s: &[&str]| s.iter().any(|x| name.ends_with(x));
        let kv_split = self.model.kv_heads.is_multiple_of(model);
        if ends(&["self_attn.q_proj.weight", "self_attn.q_proj.bias", "mlp.gate_proj.weight"])
            || ends(&["mlp.gate_proj.bias", "mlp.up_proj.weight", "mlp.up_proj.bias"])
        {
            Some(0)
        } else if ends(&["self_attn.k_proj.weight", "self_attn.k_proj.bias"])
            || ends(&["self_attn.v_proj.weight", "self_attn.v_proj.bias"])
        {
            kv_split.then_some(0)
        } else if ends(&["self_attn.o_proj.weight", "mlp.down_proj.weight"]) {
            Some(1)
        } else {
            None
        }
    }
    fn is_block(&self, name: &str) -> bool {
        crate::model::numbered(name, "model.layers.")
    }
    fn layers(&self) -> usize {
        self.model.layers
    }
    /// `transformers`' `_init_weights`: normals of 0.02 (`initializer_range`) for the
    /// embeddings and linear weights, zero biases, unit norms (a draw for every element).
    fn init(&self, name: &str, dims: &[usize], normal: &mut dyn FnMut() -> f64) -> Vec<f64> {
        let n: usize = dims.iter().product();
        let (scale, shift) = if name.ends_with("norm.weight") {
            (0.0, 1.0)
        } else if name.ends_with(".bias") {
            (0.0, 0.0)
        } else {
            (0.02, 0.0)
        };
        let mut values: Vec<f64> = (0..n).map(|_| shift + scale * normal()).collect();
        // The padding row of the embeddings starts at zero.
        if let (Some(p), "model.embed_tokens.weight") = (self.model.pad, name) {
            values[p * self.model.dim..(p + 1) * self.model.dim].fill(0.0);
        }
        values
    }
    fn activations_per_row(&self, remat: bool) -> f64 {
        let m = &self.model;
        let [v, t, d, f] = [m.vocab, self.seq, m.dim, m.ffn].map(|x| x as f64);
        let [h, kv, hd] = [m.heads, m.kv_heads, m.head_dim].map(|x| x as f64);
        let rows = t + 1.0;
        let block = rows * (10.0 * d + 6.0 * (h + kv) * hd + 5.0 * f + 3.0 * h * t);
        crate::model::blocks_held(rows * 3.0 * v, block, rows * d, m.layers as f64, remat)
    }
    fn attention_scores_per_row(&self, remat: bool) -> f64 {
        let m = &self.model;
        let [t, h] = [self.seq, m.heads].map(|x| x as f64);
        let held = if remat { 1.0 } else { m.layers as f64 };
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
    fn float32_parts(&self) -> bool {
        true
    }
    fn linears(&self) -> Vec<crate::LinearLayer> {
        use crate::Parallel::{Column, Row};
        let m = &self.model;
        let (d, f) = (m.dim, m.ffn);
        let (q, kv) = (m.heads * m.head_dim, m.kv_heads * m.head_dim);
        (0..m.layers)
            .flat_map(|i| {
                let l = format!("model.layers.{i}");
                [
                    (format!("{l}.self_attn.q_proj"), d, q, Column),
                    (format!("{l}.self_attn.k_proj"), d, kv, Column),
                    (format!("{l}.self_attn.v_proj"), d, kv, Column),
                    (format!("{l}.self_attn.o_proj"), q, d, Row),
                    (format!("{l}.mlp.gate_proj"), d, f, Column),
                    (format!("{l}.mlp.up_proj"), d, f, Column),
                    (format!("{l}.mlp.down_proj"), f, d, Row),
                ]
            })
            .map(|(name, inputs, outputs, parallel)| crate::LinearLayer {
                name,
                inputs,
                outputs,
                parallel,
                conv1d: false,
            })
            .collect()
    }
}

impl crate::Decoder for Llama {
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
        Llama::check_context(self, context).map_err(|e| e.to_string())
    }
    fn cache(&self, batch: usize, context: usize) -> Vec<(String, Vec<usize>)> {
        let shape = vec![batch, self.kv_heads, context, self.head_dim];
        self.cache_names().into_iter().map(|n| (n, shape.clone())).collect()
    }
    fn decode_step(
        &self,
        b: &mut Builder,
        token: Value,
        position: Value,
        context: usize,
        dtype: DType,
    ) -> Result<Vec<Value>> {
        Llama::decode_step(self, b, token, position, context, dtype)
    }
}

impl crate::HfFormat for Llama {
    /// `save_pretrained`'s names; a stored `lm_head.weight` of a tied model and the
    /// rotary buffers older checkpoints carry are skipped.
    fn parameter_of(&self, stored: &str) -> crate::Stored {
        if stored.ends_with(".rotary_emb.inv_freq") || (self.tie && stored == "lm_head.weight") {
            return crate::Stored::Skipped;
        }
        match self.parameters().iter().any(|(n, _)| n == stored) {
            true => crate::Stored::Parameter(stored.to_string()),
            false => crate::Stored::Foreign,
        }
    }
    fn stored_name(&self, name: &str) -> String {
        name.to_string()
    }
    fn config_json(&self) -> Json {
        self.config()
    }
}
