//! LoRA as `peft` computes it: each targeted linear layer `y = W x (+ b)` becomes
//! `y + s · B (A x)`, with `A` `[r, in]` and `B` `[out, r]` trained and the base
//! frozen; `s = α / r`, or `α / √r` with `use_rslora`. `A` starts as `peft` starts it
//! (Kaiming-uniform with `a = √5`: uniform in `±1/√in`) and `B` at zero, so a fresh
//! adapter changes nothing.
//!
//! [`LoraConfig`] reads and writes `peft`'s `adapter_config.json` (refusing, by key,
//! what changes the computation and is not computed here: DoRA, biases, saved
//! modules, per-layer ranks, …); [`Lora`] is the [`Adapter`] over a model's
//! [`linears`](crate::Model::linears) that [`LoraModel`] wraps any family with: its
//! parameters are the base's and each targeted layer's `{layer}.lora_A.weight` and
//! `{layer}.lora_B.weight`, named in a `peft` folder `base_model.model.{name}`.
//!
//! With `lora_dropout` `p` above 0, a loss (never an evaluation) drops each input of
//! each adapter (`B A dropout(x)`, as `peft` applies it) with probability `p` and
//! scales the rest by `1 / (1 − p)`: JAX's Bernoulli draws, under per-row keys the
//! loss program is fed as [`DROPOUT_KEYS`] ([`Lora::dropout_keys`]).
//!
//! ```
//! use meshwork_nn::{CausalLm, Llama, LoraConfig, LoraModel, Model};
//!
//! let llama = CausalLm { model: Llama::preset("tiny-llama").unwrap(), seq: 16 };
//! let config = LoraConfig::new(8, 16.0, &["q_proj", "v_proj"]);
//! let model = LoraModel::new(std::sync::Arc::new(llama), config, true)?;
//! let trained: Vec<_> =
//!     model.parameters().into_iter().filter(|(n, _)| model.trains(n)).collect();
//! assert_eq!(trained[0].0, "model.layers.0.self_attn.q_proj.lora_A.weight");
//! assert_eq!(trained[0].1[0], 8);
//! assert!(!model.trains("model.layers.0.self_attn.q_proj.weight"));
//! # Ok::<(), String>(())
//! ```

use std::sync::Arc;

use meshwork_program::{Builder, Result, Value};
use serde_json::Value as Json;

use crate::layers::{dims, param};
use crate::model::{Adapter, Build, Decoder, HfFormat, Input, LinearLayer, Model, Parallel};

/// Which linear layers an adapter wraps (`target_modules`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Targets {
    /// Layers whose name is one of these or ends with `.` and one of these (`q_proj`
    /// matches `model.layers.0.self_attn.q_proj`), as `peft` matches a list.
    Names(Vec<String>),
    /// `all-linear`: every linear layer of the blocks (not the output layer).
    AllLinear,
}

impl Targets {
    /// Whether layer `name` is targeted.
    pub fn matches(&self, name: &str) -> bool {
        match self {
            Targets::AllLinear => true,
            Targets::Names(names) => names.iter().any(|t| {
                name == t || name.strip_suffix(t.as_str()).is_some_and(|p| p.ends_with('.'))
            }),
        }
    }
}

/// A LoRA adapter's settings, as `peft`'s `LoraConfig` holds those that change the
/// computation.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// The rank `r`.
    pub r: usize,
    /// `lora_alpha`.
    pub alpha: f64,
    /// `target_modules`.
    pub targets: Targets,
    /// `lora_dropout` (0: none).
    pub dropout: f64,
    /// `use_rslora`: the scale is `α / √r`.
    pub rslora: bool,
}

/// The `adapter_config.json` keys that change what an adapter computes, with the value
/// that does not (`null`, and an empty list or map, mean the same): any other value is
/// refused naming the key.
const UNSUPPORTED: [(&str, &str); 20] = [
    ("use_dora", "false"),
    ("bias", "\"none\""),
    ("modules_to_save", "null"),
    ("lora_bias", "false"),
    ("rank_pattern", "{}"),
    ("alpha_pattern", "{}"),
    ("layers_to_transform", "null"),
    ("layers_pattern", "null"),
    ("exclude_modules", "null"),
    ("target_parameters", "null"),
    ("trainable_token_indices", "null"),
    ("layer_replication", "null"),
    // peft 0.21's variants that change the forward pass or the adapter's layout.
    ("alora_invocation_tokens", "null"),
    ("use_bdlora", "null"),
    ("use_qalora", "false"),
    ("arrow_config", "null"),
    ("kasa_config", "null"),
    ("monteclora_config", "null"),
    ("velora_config", "null"),
    ("lora_ga_config", "null"),
];

/// Whether `value` of a key whose computed value is `fine` computes the same.
fn computed(value: &Json, fine: &str) -> bool {
    let unset = value.is_null()
        || value.as_array().is_some_and(Vec::is_empty)
        || value.as_object().is_some_and(serde_json::Map::is_empty);
    unset || serde_json::from_str::<Json>(fine).is_ok_and(|f| *value == f)
}

impl LoraConfig {
    /// Rank `r`, `alpha`, the layers named `targets` (`all-linear` alone: every one),
    /// no dropout, `α / r`.
    pub fn new(r: usize, alpha: f64, targets: &[&str]) -> LoraConfig {
        let targets = match targets {
            ["all-linear"] => Targets::AllLinear,
            names => Targets::Names(names.iter().map(|s| s.to_string()).collect()),
        };
        LoraConfig { r, alpha, targets, dropout: 0.0, rslora: false }
    }

    /// The scale of `B A x`: `α / r`, or `α / √r` with `use_rslora`.
    pub fn scale(&self) -> f64 {
        let r = self.r as f64;
        if self.rslora { self.alpha / r.sqrt() } else { self.alpha / r }
    }

    /// The settings of a `peft` `adapter_config.json`; an error names the key that is
    /// missing, malformed, or set to something that changes the computation and is not
    /// computed here.
    pub fn from_peft(config: &Json) -> std::result::Result<LoraConfig, String> {
        if !config.is_object() {
            return Err("is not a JSON object".into());
        }
        if let Some(t) = config.get("peft_type").filter(|t| !t.is_null())
            && t != "LORA"
        {
            return Err(format!("peft_type is {t}: only LORA adapters are read"));
        }
        for (key, fine) in UNSUPPORTED {
            if let Some(v) = config.get(key)
                && !computed(v, fine)
            {
                return Err(format!(
                    "{key} is {}: only {key} = {fine} is computed",
                    short(&v.to_string())
                ));
            }
        }
        let r =
            config.get("r").and_then(Json::as_u64).filter(|&r| r > 0 && r <= 1 << 20).ok_or_else(
                || format!("r must be a positive integer, not {}", show(config, "r")),
            )?;
        let alpha =
            config.get("lora_alpha").and_then(Json::as_f64).filter(|a| a.is_finite()).ok_or_else(
                || format!("lora_alpha must be a number, not {}", show(config, "lora_alpha")),
            )?;
        let dropout = match config.get("lora_dropout") {
            None | Some(Json::Null) => 0.0,
            Some(v) => v
                .as_f64()
                .filter(|d| (0.0..1.0).contains(d))
                .ok_or_else(|| format!("lora_dropout must be in [0, 1), not {v}"))?,
        };
        let rslora = match config.get("use_rslora") {
            None | Some(Json::Null) => false,
            Some(v) => {
                v.as_bool().ok_or_else(|| format!("use_rslora must be true or false, not {v}"))?
            }
        };
        let targets = match config.get("target_modules") {
            Some(Json::String(s)) if s == "all-linear" => Targets::AllLinear,
            Some(Json::String(s)) => {
                return Err(format!(
                    "target_modules is the pattern {s:?}: only a list of names or \"all-linear\" is read"
                ));
            }
            Some(Json::Array(a)) if !a.is_empty() => Targets::Names(
                a.iter()
                    .map(|t| t.as_str().map(str::to_string))
                    .collect::<Option<Vec<_>>>()
                    .ok_or("target_modules must be a list of names")?,
            ),
            other => {
                return Err(format!(
                    "target_modules must be a list of layer names, not {}",
                    other.map_or("missing".into(), |v| short(&v.to_string()))
                ));
            }
        };
        let r = usize::try_from(r).map_err(|_| "r is too large")?;
        Ok(LoraConfig { r, alpha, targets, dropout, rslora })
    }

    /// The `adapter_config.json` `peft` writes for this adapter on a base of
    /// `model_type` (`fan_in_fan_out` for GPT-2's `Conv1D` layers).
    pub fn peft_json(&self, model_type: &str) -> Json {
        let targets = match &self.targets {
            Targets::AllLinear => Json::from("all-linear"),
            Targets::Names(names) => Json::from(names.clone()),
        };
        serde_json::json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": null,
            "r": self.r,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": targets,
            "use_rslora": self.rslora,
            "use_dora": false,
            "bias": "none",
            "fan_in_fan_out": model_type == "gpt2",
            "modules_to_save": null,
            "init_lora_weights": true,
            "inference_mode": true,
            "rank_pattern": {},
            "alpha_pattern": {},
            "model_type": model_type,
        })
    }
}

fn show(config: &Json, key: &str) -> String {
    config.get(key).map_or("missing".into(), |v| short(&v.to_string()))
}

/// `text` cut to 60 characters for a one-line message.
fn short(text: &str) -> String {
    match text.char_indices().nth(60) {
        Some((i, _)) => format!("{}…", &text[..i]),
        None => text.to_string(),
    }
}

/// A LoRA adapter over a model's linear layers: the [`Adapter`] a loss, evaluation or
/// decoding program is built with.
#[derive(Debug, Clone, PartialEq)]
pub struct Lora {
    /// Its settings.
    pub config: LoraConfig,
    /// The layers it wraps, in the model's order.
    layers: Vec<LinearLayer>,
}

/// The suffix of a layer's `A` matrix.
const A: &str = "lora_A.weight";
/// The suffix of a layer's `B` matrix.
const B: &str = "lora_B.weight";

impl Lora {
    /// The adapter of `config` over those of `linears` it targets. With `strict`, every
    /// name in `target_modules` must match a layer (a typo is refused); otherwise, as
    /// `peft` loads a folder, some layer must match.
    pub fn new(
        config: LoraConfig,
        linears: &[LinearLayer],
        strict: bool,
    ) -> std::result::Result<Lora, String> {
        let layers: Vec<LinearLayer> =
            linears.iter().filter(|l| config.targets.matches(&l.name)).cloned().collect();
        if let Targets::Names(names) = &config.targets {
            let unmatched: Vec<&str> = names
                .iter()
                .filter(|t| {
                    !linears.iter().any(|l| Targets::Names(vec![(*t).clone()]).matches(&l.name))
                })
                .map(String::as_str)
                .collect();
            let example = linears.first().map_or("none".into(), |l| l.name.clone());
            if layers.is_empty() || (strict && !unmatched.is_empty()) {
                return Err(format!(
                    "target modules {} match no linear layer of the model (its layers are named like {example})",
                    unmatched.join(",")
                ));
            }
        }
        if layers.is_empty() {
            return Err("the model has no linear layer an adapter wraps".into());
        }
        if !(0.0..1.0).contains(&config.dropout) {
            return Err(format!(
                "lora_dropout {}: a dropout is at least 0 and below 1",
                config.dropout
            ));
        }
        Ok(Lora { config, layers })
    }

    /// The layers it wraps.
    pub fn layers(&self) -> &[LinearLayer] {
        &self.layers
    }

    /// Its parameters' names and shapes: each layer's `A` `[r, in]`, then its `B`
    /// `[out, r]`.
    pub fn parameters(&self) -> Vec<(String, Vec<usize>)> {
        let r = self.config.r;
        self.layers
            .iter()
            .flat_map(|l| {
                [
                    (format!("{}.{A}", l.name), vec![r, l.inputs]),
                    (format!("{}.{B}", l.name), vec![l.outputs, r]),
                ]
            })
            .collect()
    }

    /// Whether `name` is one of an adapter's matrices.
    pub fn is_adapter(name: &str) -> bool {
        name.ends_with(&format!(".{A}")) || name.ends_with(&format!(".{B}"))
    }

    /// The layer and whether it is `A` (else `B`) of adapter parameter `name`.
    fn layer_of(&self, name: &str) -> Option<(&LinearLayer, bool)> {
        let (layer, is_a) = match name.strip_suffix(&format!(".{A}")) {
            Some(l) => (l, true),
            None => (name.strip_suffix(&format!(".{B}"))?, false),
        };
        self.layers.iter().find(|l| l.name == layer).map(|l| (l, is_a))
    }

    /// The initial values of adapter parameter `name` as `peft` draws them: `A`
    /// uniform in `±1/√in` (Kaiming-uniform, `a = √5`) from `uniform` (in `[0, 1)`),
    /// `B` zero.
    pub fn init(&self, name: &str, uniform: &mut dyn FnMut() -> f64) -> Option<Vec<f64>> {
        let (layer, is_a) = self.layer_of(name)?;
        let r = self.config.r;
        Some(if is_a {
            let bound = 1.0 / (layer.inputs as f64).sqrt();
            (0..r * layer.inputs).map(|_| (2.0 * uniform() - 1.0) * bound).collect()
        } else {
            vec![0.0; layer.outputs * r]
        })
    }

    /// The dim of adapter parameter `name` split over a model axis where its base layer
    /// is split (`base_split`: whether the model splits the layer's weight): a
    /// column-parallel layer's `B` by its rows (the outputs), a row-parallel layer's
    /// `A` by its columns (the inputs); the other matrix whole.
    pub fn split(&self, name: &str, base_split: bool) -> Option<usize> {
        let (layer, is_a) = self.layer_of(name)?;
        match (base_split, layer.parallel, is_a) {
            (true, Parallel::Column, false) => Some(0),
            (true, Parallel::Row, true) => Some(1),
            _ => None,
        }
    }

    /// The name `peft` saves adapter parameter `name` under.
    pub fn peft_name(name: &str) -> String {
        format!("base_model.model.{name}")
    }

    /// The adapter parameter a `peft` folder's tensor `stored` is
    /// (`base_model.model.{layer}.lora_A.weight`, or with the adapter's name
    /// `….lora_A.default.weight` as some versions save it).
    pub fn of_peft_name(stored: &str) -> Option<String> {
        let name = stored.strip_prefix("base_model.model.")?;
        let name = name
            .replace(".lora_A.default.weight", ".lora_A.weight")
            .replace(".lora_B.default.weight", ".lora_B.weight");
        Lora::is_adapter(&name).then_some(name)
    }

    /// `W` of layer `layer` with the adapter merged in: `W + s · B A` (`W` `[out, in]`,
    /// or `[in, out]` with `transposed`, GPT-2's `Conv1D`), given `a` `[r, in]` and `b`
    /// `[out, r]` row-major.
    pub fn merged(
        &self,
        layer: &str,
        w: &[f64],
        (a, b): (&[f64], &[f64]),
        transposed: bool,
    ) -> Option<Vec<f64>> {
        let l = self.layers.iter().find(|l| l.name == layer)?;
        let (r, n_in, n_out) = (self.config.r, l.inputs, l.outputs);
        if w.len() != n_in * n_out || a.len() != r * n_in || b.len() != n_out * r {
            return None;
        }
        let s = self.config.scale();
        let mut out = w.to_vec();
        for o in 0..n_out {
            for i in 0..n_in {
                let ba: f64 = (0..r).map(|k| b[o * r + k] * a[k * n_in + i]).sum();
                let at = if transposed { i * n_out + o } else { o * n_in + i };
                out[at] += s * ba;
            }
        }
        Some(out)
    }
}

/// The name of the fed keys of a LoRA model with dropout, `i32` `[rows, layers, 2]`.
pub const DROPOUT_KEYS: &str = "lora_dropout_keys";

impl Lora {
    /// The dropout keys of `rows` rows of step `step` (counted from 0) of a run seeded
    /// `seed`, `[rows, layers, 2]` (the bits of JAX's `uint32` key words): row `i`'s
    /// key for the `l`-th layer the adapter wraps is
    /// `fold_in(fold_in(fold_in(PRNGKey(seed), step), i), l)` (the step and the row
    /// taken modulo 2³², as `fold_in`'s `uint32` holds them). A row's masks depend on
    /// the run's seed, the step and its place in the batch alone: the same on any mesh,
    /// over any number of micro-batches or processes, and after a resume.
    pub fn dropout_keys(&self, seed: u64, step: u64, rows: usize) -> Vec<i32> {
        use meshwork_program::random::{fold_in, key};
        let step_key = fold_in(key(seed), step as u32);
        let mut keys = Vec::with_capacity(rows * self.layers.len() * 2);
        for i in 0..rows {
            let row = fold_in(step_key, i as u32);
            for l in 0..self.layers.len() {
                let [k1, k2] = fold_in(row, l as u32);
                keys.extend([k1 as i32, k2 as i32]);
            }
        }
        keys
    }

    /// `x` `[rows, …]` with `peft`'s dropout (`lora_dropout` `p`) as flax draws it: each
    /// element kept where `uniform < 1 − p` (JAX's `bernoulli`, the float32 uniform of
    /// [`Op::ThreefryUniform`](meshwork_program::Op::ThreefryUniform) at its index in
    /// its row, under the row's key for layer `l` from `keys`) and divided by `1 − p`,
    /// else zero.
    fn dropped(&self, b: &mut Builder, x: Value, keys: Value, l: usize) -> Result<Value> {
        let (dtype, d) = dims(b, x)?;
        let per_row: usize = d[1..].iter().product();
        if per_row > i32::MAX as usize {
            return Err(crate::layers::problem(
                "lora_dropout",
                b,
                &[x],
                format!("a row of {per_row} inputs: dropout counts at most 2^31 a row"),
            ));
        }
        let mut key_dims = vec![d[0]];
        key_dims.extend(std::iter::repeat_n(1, d.len() - 1));
        let word = |b: &mut Builder, w: usize| -> Result<Value> {
            let k = b.slice(keys, &[0, l, w], &[d[0], l + 1, w + 1], &[1, 1, 1])?;
            let k = b.reshape(k, &key_dims)?;
            b.broadcast_to(k, &d)
        };
        let (k1, k2) = (word(b, 0)?, word(b, 1)?);
        let counter = b.iota(meshwork_types::DType::I32, &[per_row], 0)?;
        let counter = b.reshape(counter, &d[1..])?;
        let counter = b.broadcast_to(counter, &d)?;
        let uniform = b.threefry_uniform(k1, k2, counter)?;
        let keep = 1.0 - self.config.dropout;
        let p = b.constant(keep, meshwork_types::DType::F32)?;
        let kept = b.lt(uniform, p)?;
        let scale = b.constant(keep, dtype)?;
        let scaled = b.div(x, scale)?;
        let zero = b.constant(0.0, dtype)?;
        b.select(kept, scaled, zero)
    }

    /// `y + s · B A x` of layer `layer` (`x` through dropout with `keys`, if given).
    fn wrap(
        &self,
        b: &mut Builder,
        layer: &str,
        (x, y): (Value, Value),
        keys: Option<Value>,
    ) -> Result<Option<Value>> {
        let Some(at) = self.layers.iter().position(|l| l.name == layer) else { return Ok(None) };
        let l = &self.layers[at];
        let x = match keys {
            Some(keys) if self.config.dropout > 0.0 => self.dropped(b, x, keys, at)?,
            _ => x,
        };
        let (dtype, d) = dims(b, x)?;
        let last = d.len() - 1;
        let r = self.config.r;
        let a = param(b, A, dtype, &[r, l.inputs])?;
        let bm = param(b, B, dtype, &[l.outputs, r])?;
        let xa = b.dot_general(x, a, &[last], &[1], &[], &[])?;
        let xab = b.dot_general(xa, bm, &[last], &[1], &[], &[])?;
        let s = b.constant(self.config.scale(), b.spec(xab)?.dtype)?;
        let scaled = b.mul(xab, s)?;
        Ok(Some(b.add(y, scaled)?))
    }
}

impl Adapter for Lora {
    fn linear(&self, b: &mut Builder, layer: &str, x: Value, y: Value) -> Result<Option<Value>> {
        self.wrap(b, layer, (x, y), None)
    }
}

/// A LoRA adapter training with dropout: its keys' fed value.
struct Dropout<'a> {
    lora: &'a Lora,
    keys: Value,
}

impl Adapter for Dropout<'_> {
    fn linear(&self, b: &mut Builder, layer: &str, x: Value, y: Value) -> Result<Option<Value>> {
        self.lora.wrap(b, layer, (x, y), Some(self.keys))
    }
}

/// A model with a LoRA adapter: the base's computation with [`Lora`] over its linear
/// layers, the base's parameters frozen ([`trains`](Model::trains) only the adapter's).
#[derive(Debug)]
pub struct LoraModel {
    base: Arc<dyn Model>,
    lora: Lora,
    /// The loss program's parameters (the base's with each adapter's after its layer).
    parameters: Vec<(String, Vec<usize>)>,
}

impl LoraModel {
    /// `base` with the adapter of `config` (`strict`: every target must name a layer;
    /// see [`Lora::new`]).
    pub fn new(
        base: Arc<dyn Model>,
        config: LoraConfig,
        strict: bool,
    ) -> std::result::Result<LoraModel, String> {
        let lora = Lora::new(config, &base.linears(), strict)?;
        let mut model = LoraModel { base, lora, parameters: Vec::new() };
        model.parameters = crate::model::declared_parameters(&model);
        if model.parameters.is_empty() {
            return Err(format!("{} does not build with an adapter", model.base.describe()));
        }
        // Every matrix of the adapter is one the model's program reads (a layer
        // `linears` names but the program does not build would train nothing).
        for (name, dims) in model.lora.parameters() {
            if !model.parameters.iter().any(|(n, d)| *n == name && *d == dims) {
                return Err(format!("{} builds no {name} of {dims:?}", model.base.describe()));
            }
        }
        Ok(model)
    }

    /// The adapter.
    pub fn lora(&self) -> &Lora {
        &self.lora
    }

    /// The base model.
    pub fn base(&self) -> &dyn Model {
        self.base.as_ref()
    }

    /// The base weights of `weights` (the base's parameters and the adapter's, by
    /// name) with the adapter merged in: each wrapped layer's weight `W + s · B A`
    /// (stored `[in, out]` for a `Conv1D` layer), the adapter's matrices left out.
    /// `None` when a weight is missing or of another size.
    pub fn merge(
        &self,
        weights: &std::collections::HashMap<String, meshwork_types::Tensor>,
    ) -> Option<std::collections::HashMap<String, meshwork_types::Tensor>> {
        let mut out: std::collections::HashMap<String, meshwork_types::Tensor> = weights
            .iter()
            .filter(|(n, _)| !Lora::is_adapter(n))
            .map(|(n, t)| (n.clone(), t.clone()))
            .collect();
        for l in &self.lora.layers {
            let name = format!("{}.weight", l.name);
            let w = out.get(&name)?;
            let a = weights.get(&format!("{}.{A}", l.name))?.to_f64();
            let b = weights.get(&format!("{}.{B}", l.name))?.to_f64();
            let merged = self.lora.merged(&l.name, &w.to_f64(), (&a, &b), l.conv1d)?;
            let t = meshwork_types::Tensor::from_f64(w.dtype(), w.shape(), &merged).ok()?;
            out.insert(name, t);
        }
        Some(out)
    }

    /// The base's inputs of `inputs` (its [`inputs`](Model::inputs)' values) and the
    /// dropout keys among them, if it has dropout; an error if they are not what
    /// [`inputs`](Model::inputs) says.
    fn keys<'v>(&self, b: &Builder, inputs: &'v [Value]) -> Result<(&'v [Value], Option<Value>)> {
        let want = self.inputs().len();
        if inputs.len() != want {
            return Err(crate::layers::problem(
                "lora",
                b,
                inputs,
                format!("{} inputs given: the model with its adapter takes {want}", inputs.len()),
            ));
        }
        let Some((&keys, base)) = inputs.split_last().filter(|_| self.dropout()) else {
            return Ok((inputs, None));
        };
        let spec = b.spec(keys)?;
        let d = spec.shape.dims();
        let layers = self.lora.layers.len();
        if spec.dtype != meshwork_types::DType::I32 || d.len() != 3 || d[1..] != [layers, 2] {
            return Err(crate::layers::problem(
                "lora",
                b,
                &[keys],
                format!("the dropout keys must be i32 [rows, {layers}, 2]"),
            ));
        }
        Ok((base, Some(keys)))
    }

    /// Whether its loss drops some of each wrapped layer's inputs (`lora_dropout` above
    /// 0): its loss program is then fed [`DROPOUT_KEYS`].
    pub fn dropout(&self) -> bool {
        self.lora.config.dropout > 0.0
    }

    fn with<'a>(&'a self, build: &Build<'_>) -> Build<'a> {
        Build { dtype: build.dtype, blocking: build.blocking, adapter: Some(&self.lora) }
    }
}

impl Model for LoraModel {
    fn family(&self) -> &'static str {
        self.base.family()
    }
    fn describe(&self) -> String {
        let c = &self.lora.config;
        let dropout =
            if self.dropout() { format!(", dropout {}", c.dropout) } else { String::new() };
        format!(
            "{} with LoRA r {} α {} on {} layers{dropout}",
            self.base.describe(),
            c.r,
            c.alpha,
            self.lora.layers.len()
        )
    }
    fn meta(&self) -> Json {
        let mut meta = self.base.meta();
        meta["lora"] = self.lora.config.peft_json(self.base.family());
        meta
    }
    /// The base's, and with dropout [`DROPOUT_KEYS`] (`i32` `[layers, 2]` a row,
    /// [`Lora::dropout_keys`]), which an evaluation reads nothing of.
    fn inputs(&self) -> Vec<Input> {
        let mut inputs = self.base.inputs();
        if self.dropout() {
            let layers = self.lora.layers.len();
            inputs.push(Input {
                name: DROPOUT_KEYS,
                dtype: Some(meshwork_types::DType::I32),
                dims: vec![layers, 2],
            });
        }
        inputs
    }
    fn parameters(&self) -> Vec<(String, Vec<usize>)> {
        self.parameters.clone()
    }
    fn trains(&self, name: &str) -> bool {
        Lora::is_adapter(name)
    }
    fn loss(&self, b: &mut Builder, inputs: &[Value], build: &Build<'_>) -> Result<Value> {
        match self.keys(b, inputs)? {
            (base, Some(keys)) => {
                let adapter = Dropout { lora: &self.lora, keys };
                let build = Build { adapter: Some(&adapter), ..*build };
                self.base.loss(b, base, &build)
            }
            (base, None) => self.base.loss(b, base, &self.with(build)),
        }
    }
    fn evaluate(
        &self,
        b: &mut Builder,
        inputs: &[Value],
        build: &Build<'_>,
    ) -> Result<(Value, Value)> {
        // No dropout in an evaluation: its keys are not read.
        let (base, _) = self.keys(b, inputs)?;
        self.base.evaluate(b, base, &self.with(build))
    }
    fn check_mesh(&self, data: usize, model: usize) -> std::result::Result<(), String> {
        self.base.check_mesh(data, model)
    }
    fn split(&self, name: &str, model: usize) -> Option<usize> {
        if !Lora::is_adapter(name) {
            return self.base.split(name, model);
        }
        let layer = name.rsplitn(3, '.').nth(2)?;
        let base_split = self.base.split(&format!("{layer}.weight"), model).is_some();
        self.lora.split(name, base_split)
    }
    fn is_block(&self, name: &str) -> bool {
        self.base.is_block(name)
    }
    fn layers(&self) -> usize {
        self.base.layers()
    }
    /// The base's initial values for its parameters, drawn from `normal` as the base
    /// draws them (the same values as the base model alone from the same stream); an
    /// adapter's distributed as `peft` draws them ([`Lora::init`]) from a stream of its
    /// own seeded by its name, so that it takes no draws from the base's. (The trainer
    /// draws a new adapter from `--seed` instead.)
    fn init(&self, name: &str, dims: &[usize], normal: &mut dyn FnMut() -> f64) -> Vec<f64> {
        // SplitMix64 seeded by the name's FNV-1a hash: uniforms in [0, 1).
        let mut state = name.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, c| {
            (h ^ u64::from(c)).wrapping_mul(0x0100_0000_01b3)
        });
        let mut uniform = || {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            (z ^ (z >> 31)) as f64 / 2f64.powi(64)
        };
        match self.lora.init(name, &mut uniform) {
            Some(v) => v,
            None => self.base.init(name, dims, normal),
        }
    }
    fn init_stream(&self) -> u64 {
        self.base.init_stream()
    }
    /// The base's, and with dropout each wrapped layer's dropped input and its mask,
    /// which the backward pass reads (an element and a half an input; one block's
    /// with `remat`).
    fn activations_per_row(&self, remat: bool) -> f64 {
        let base = self.base.activations_per_row(remat);
        if !self.dropout() {
            return base;
        }
        let positions = self.base.per_row().0 as f64;
        let inputs: f64 = self.lora.layers.iter().map(|l| l.inputs as f64).sum();
        let held = inputs * positions * 1.5;
        base + if remat { held / self.base.layers().max(1) as f64 } else { held }
    }
    fn attention_scores_per_row(&self, remat: bool) -> f64 {
        self.base.attention_scores_per_row(remat)
    }
    fn per_row(&self) -> (usize, &'static str) {
        self.base.per_row()
    }
    fn classifies(&self) -> bool {
        self.base.classifies()
    }
    fn decoder(&self) -> Option<&dyn Decoder> {
        None
    }
    fn hf(&self) -> Option<&dyn HfFormat> {
        self.base.hf()
    }
    fn float32_parts(&self) -> bool {
        self.base.float32_parts()
    }
    fn linears(&self) -> Vec<LinearLayer> {
        self.base.linears()
    }
    fn as_lora(&self) -> Option<&LoraModel> {
        Some(self)
    }
}
