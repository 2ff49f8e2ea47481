//! Text generation from a Hugging Face checkpoint folder (GPT-2, the Llama family), as
//! `transformers`' `generate` does: the prompt and then each new token through one
//! decoding step with a key-value cache (the model's [`Decoder`]), compiled once on
//! the run's back end with the weights and the cache resident on the device; greedy at
//! temperature 0, else sampled (temperature, top-k, top-p) from the seed; stopping at
//! the end-of-text id (`generation_config.json`'s, else `config.json`'s). Unlike
//! `transformers`' sampling there is no default top-k of 50, and top-k keeps exactly k
//! tokens (ties at the k-th broken by id).

use std::path::PathBuf;

use meshwork_nn::Decoder;
use meshwork_strategy::partition::Shardings;
use meshwork_strategy::sharding::Mesh;
use meshwork_types::{DType, Tensor};
use serde_json::Value as Json;

use crate::rng::SplitMix;
use crate::{BackendKind, Error, Result};

/// What `meshwork generate` does.
#[derive(Debug, Clone)]
pub struct GenerateConfig {
    /// `--init`: a Hugging Face checkpoint folder (GPT-2, the Llama family).
    pub init: PathBuf,
    /// `--prompt-ids` (or, with a tokenizer, `--prompt`'s ids).
    pub prompt_ids: Vec<i64>,
    /// `--tokenizer`: decodes the new tokens into [`Generated::text`].
    pub tokenizer: Option<PathBuf>,
    /// `--max-new-tokens`.
    pub max_new_tokens: usize,
    /// `--temperature` (0: greedy).
    pub temperature: f64,
    /// `--top-k`: sample among the k likeliest tokens.
    pub top_k: Option<usize>,
    /// `--top-p`: sample among the likeliest tokens whose probabilities reach p.
    pub top_p: Option<f64>,
    /// `--seed` of the sampling.
    pub seed: u64,
    /// `--dtype` of the computation (f32 or f64).
    pub dtype: DType,
    /// `--backend`.
    pub backend: BackendKind,
    /// `--max-memory` in bytes: the most the checkpoint's weights may take.
    pub max_memory: u64,
    /// `--lora DIR`: a `peft` adapter folder merged into the weights before decoding.
    pub lora: Option<PathBuf>,
    /// `--logits FILE`: keep the logits each new token was picked from
    /// ([`Generated::logits`]).
    pub keep_logits: bool,
}

/// What was generated: the prompt, and the prompt followed by the new tokens (as
/// `generate` returns them).
#[derive(Debug, Clone, PartialEq)]
pub struct Generated {
    /// The prompt's ids.
    pub prompt_ids: Vec<i64>,
    /// The prompt's ids, then the new ones (ending at the end-of-text id when one was
    /// generated).
    pub ids: Vec<i64>,
    /// The new tokens decoded, with a tokenizer.
    pub text: Option<String>,
    /// What was passed over on the way (a `generation_config.json` that cannot be
    /// read), for people.
    pub warnings: Vec<String>,
    /// With [`GenerateConfig::keep_logits`], the logits (over the vocabulary) each new
    /// token was picked from, one row per new token, as `transformers`' `generate`
    /// returns them with `output_logits=True`.
    pub logits: Vec<Vec<f64>>,
}

impl Generated {
    /// [`logits`](Self::logits) as the bytes of a `.npy` file: `[new tokens,
    /// vocabulary]`, little-endian float64.
    pub fn logits_npy(&self) -> Vec<u8> {
        let vocab = self.logits.first().map_or(0, Vec::len);
        let flat: Vec<f64> = self.logits.concat();
        meshwork_io::npy::encode(&[self.logits.len(), vocab], &flat)
            .expect("rows of the vocabulary's length")
    }
}

/// `text`'s ids by the tokenizer at `path` (`--prompt`).
pub fn prompt_ids(path: &std::path::Path, text: &str) -> Result<Vec<i64>> {
    let tokenizer = crate::data::read_tokenizer(path)?;
    Ok(crate::data::encode(&tokenizer, text)?.into_iter().map(i64::from).collect())
}

/// The tokenizer `--init` comes with: a Hugging Face folder's `tokenizer.json`, or
/// the one a checkpoint's run used (else its model folder's), if there is one.
pub fn tokenizer_of(init: &std::path::Path) -> Option<PathBuf> {
    match crate::trainer::is_checkpoint(init) {
        true => crate::resume::recorded_tokenizer(init),
        false => Some(init.join("tokenizer.json")).filter(|t| t.is_file()),
    }
}

/// The end-of-text ids, as `transformers` 5 finds them: `generation_config.json`'s
/// `eos_token_id` when the folder has that file (none if it names none), else the
/// `eos_token_id` `config.json` writes (none if it writes none: generation does not
/// fall back to the config class's default); a number or a list of numbers. A
/// `generation_config.json` that cannot be read, or an `eos_token_id` that is not
/// token ids, is refused naming the file: generating past an end the model has would
/// be silently wrong output.
fn eos_ids(dir: &std::path::Path, generation: Option<&Json>, config: &Json) -> Result<Vec<i64>> {
    let (found, file) = match generation {
        Some(generation) => (
            generation.get("eos_token_id").cloned().unwrap_or(Json::Null),
            "generation_config.json",
        ),
        None => (config.get("eos_token_id").cloned().unwrap_or(Json::Null), "config.json"),
    };
    let id = |v: &Json| v.as_i64().filter(|&i| i >= 0);
    let ids = match &found {
        Json::Null => Some(Vec::new()),
        Json::Array(a) => a.iter().map(id).collect(),
        one => id(one).map(|i| vec![i]),
    };
    ids.ok_or_else(|| {
        let shown: String = found.to_string().chars().take(60).collect();
        Error::flag(
            "init",
            format!(
                "{}: eos_token_id is {shown}, not a token id or a list of them",
                dir.join(file).display()
            ),
        )
    })
}

/// Picks the next token from `logits`: the first largest at temperature 0, else a draw
/// from the softmax of `logits / temperature` restricted to the top `k` and to the
/// smallest set of likeliest tokens whose probability reaches `p` (at least one).
fn pick(logits: &[f64], c: &GenerateConfig, rng: &mut SplitMix) -> usize {
    let first_max = |xs: &[f64]| {
        xs.iter().enumerate().fold(0, |best, (i, &x)| if x > xs[best] { i } else { best })
    };
    if c.temperature == 0.0 {
        return first_max(logits);
    }
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    if let Some(k) = c.top_k {
        order.truncate(k.max(1));
    }
    let top = logits[order[0]];
    let weights: Vec<f64> =
        order.iter().map(|&i| ((logits[i] - top) / c.temperature).exp()).collect();
    let total: f64 = weights.iter().sum();
    let mut probs: Vec<f64> = weights.iter().map(|w| w / total).collect();
    if let Some(p) = c.top_p {
        let mut reached = 0.0;
        let keep = probs
            .iter()
            .position(|&q| {
                reached += q;
                reached >= p
            })
            .map_or(probs.len(), |i| i + 1);
        order.truncate(keep);
        probs.truncate(keep);
        let kept: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|q| *q /= kept);
    }
    let mut u = rng.uniform();
    for (&i, &q) in order.iter().zip(&probs) {
        if u < q {
            return i;
        }
        u -= q;
    }
    order[order.len() - 1]
}

/// Generates from `config`.
pub fn generate(config: &GenerateConfig) -> Result<Generated> {
    if config.prompt_ids.is_empty() {
        return Err(Error::flag("prompt-ids", "give at least one token"));
    }
    if !(config.temperature.is_finite() && config.temperature >= 0.0) {
        return Err(Error::flag("temperature", "must be a number ≥ 0"));
    }
    if config.top_k == Some(0) {
        return Err(Error::flag("top-k", "must be at least 1"));
    }
    if let Some(p) = config.top_p
        && !(p > 0.0 && p <= 1.0)
    {
        return Err(Error::flag("top-p", "must be in (0, 1]"));
    }
    if config.temperature == 0.0 && (config.top_k.is_some() || config.top_p.is_some()) {
        return Err(Error::usage("--top-k and --top-p sample: they need --temperature above 0"));
    }
    if !matches!(config.dtype, DType::F32 | DType::F64) {
        return Err(Error::flag("dtype", format!("{} is not f32 or f64", config.dtype)));
    }
    // A Hugging Face folder, or a meshwork checkpoint as `--export-hf` would write it.
    let checkpoint = match crate::trainer::is_checkpoint(&config.init) {
        true => Some(crate::trainer::checkpoint_model("init", &config.init, config.max_memory)?),
        false => None,
    };
    let (hf_config, generation) = match &checkpoint {
        Some(c) => (c.config.clone(), c.generation.clone()),
        None => (
            crate::hf::read_config("init", &config.init)?,
            crate::hf::read_generation_config("init", &config.init)?,
        ),
    };
    let context = config.prompt_ids.len().saturating_add(config.max_new_tokens);
    let path = config.init.join("config.json");
    let net = crate::family::lm_from_config("init", &path, &hf_config, 1)?;
    let decoder = net.model().decoder().ok_or_else(|| {
        Error::flag("init", format!("the {} does not generate", net.model().family()))
    })?;
    if let Some(&bad) =
        config.prompt_ids.iter().find(|&&t| t < 0 || t as u64 >= decoder.vocab() as u64)
    {
        return Err(Error::flag(
            "prompt-ids",
            format!("{bad} is not a token of the vocabulary of {}", decoder.vocab()),
        ));
    }
    if let Err(problem) = decoder.check_context(context) {
        return Err(Error::usage(format!(
            "--prompt-ids ({} tokens) and --max-new-tokens {} make {context} positions: {problem}",
            config.prompt_ids.len(),
            config.max_new_tokens,
        )));
    }
    // The cache, beside the weights the reader bounds.
    let caches = decoder.cache(1, context);
    let cache = caches.iter().map(|(_, s)| s.iter().product::<usize>() as u64).sum::<u64>();
    let cache_bytes = cache.saturating_mul(config.dtype.size_in_bytes() as u64);
    if cache_bytes > config.max_memory {
        return Err(Error::usage(format!(
            "the key-value cache of {context} positions takes {cache_bytes} bytes; --max-memory is {}",
            config.max_memory
        )));
    }
    let weights = match checkpoint {
        // In the run's dtype.
        Some(c) => c
            .weights
            .into_iter()
            .map(|(name, t)| match t.dtype() == config.dtype {
                true => Ok((name, t)),
                false => Tensor::from_f64(config.dtype, t.shape(), &t.to_f64())
                    .map(|t| (name, t))
                    .map_err(Error::failed),
            })
            .collect::<Result<_>>()?,
        None => crate::hf::read(
            "init",
            &config.init,
            net.model(),
            config.dtype,
            config.max_memory - cache_bytes,
        )?,
    };
    // A LoRA adapter merged into the weights once: `W + s · B A`.
    let weights = match &config.lora {
        Some(dir) => {
            let lora = crate::lora::read_config("lora", dir, config.max_memory)?;
            let model = meshwork_nn::LoraModel::new(net.shared(), lora, false)
                .map_err(|e| Error::flag("lora", format!("{}: {e}", dir.display())))?;
            let mut all = weights;
            all.extend(crate::lora::read_adapter("lora", dir, model.lora(), config.max_memory)?);
            model.merge(&all).ok_or_else(|| {
                Error::flag("lora", format!("{}: the adapter does not merge", dir.display()))
            })?
        }
        None => weights,
    };
    let warnings = Vec::new();
    let eos = eos_ids(&config.init, generation.as_ref(), &hf_config)?;
    let strategy = strategy_on(&config.backend)?;
    let dims = net.weight_dims();
    let step = compile_decoder(&strategy, config.dtype, decoder, (&dims, &caches), context)?;
    for (name, _) in net.weight_dims() {
        step.set(&name, &weights[&name]).map_err(Error::failed)?;
    }
    for (name, shape) in &caches {
        let zeros = Tensor::zeros(config.dtype, shape).map_err(Error::failed)?;
        step.set(name, &zeros).map_err(Error::failed)?;
    }
    let mut rng = SplitMix::new(config.seed);
    let mut ids = config.prompt_ids.clone();
    let mut next = None;
    let mut kept = Vec::new();
    if config.keep_logits {
        // The rows kept, beside the weights and the cache.
        let bytes =
            (decoder.vocab() as u64).saturating_mul(8).saturating_mul(config.max_new_tokens as u64);
        if bytes.saturating_add(cache_bytes) > config.max_memory {
            return Err(Error::usage(format!(
                "--logits of {} new tokens take {bytes} bytes; --max-memory is {}",
                config.max_new_tokens, config.max_memory
            )));
        }
    }
    for (p, &t) in config.prompt_ids.iter().enumerate() {
        next = Some(run_step(&step, t, p)?);
    }
    for _ in 0..config.max_new_tokens {
        let logits = next.take().expect("the prompt's last logits");
        // Finite weights can still overflow in the run's dtype: a token picked from
        // an infinity or a NaN is no sample of the model.
        if let Some((id, v)) = logits.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(Error::failed(format!(
                "the logits at position {} are not finite (token {id}: {v}) in {}; \
                 nothing was generated from them",
                ids.len() - 1,
                config.dtype
            )));
        }
        let t = pick(&logits, config, &mut rng) as i64;
        ids.push(t);
        if config.keep_logits {
            kept.push(logits);
        }
        if eos.contains(&t) || ids.len() == context {
            break;
        }
        next = Some(run_step(&step, t, ids.len() - 1)?);
    }
    let text = match &config.tokenizer {
        None => None,
        Some(path) => {
            let tokenizer = crate::data::read_tokenizer(path)?;
            let new: Vec<u32> = ids[config.prompt_ids.len()..].iter().map(|&t| t as u32).collect();
            Some(crate::data::guarded(|| tokenizer.decode(&new, false))?.map_err(|e| {
                Error::flag("tokenizer", format!("cannot decode the new tokens: {e}"))
            })?)
        }
    };
    Ok(Generated { prompt_ids: config.prompt_ids.clone(), ids, text, warnings, logits: kept })
}

/// The decoding step of `decoder` compiled on `config`'s back end: the weights (by
/// `weights`' names) returned unchanged and carried into themselves, the caches carried
/// into themselves updated, so that both stay on the device.
fn compile_decoder<'s>(
    strategy: &'s meshwork_strategy::Strategy,
    dtype: DType,
    decoder: &dyn Decoder,
    (weights, caches): (&[Named], &[Named]),
    context: usize,
) -> Result<meshwork_strategy::spmd::Compiled<'s>> {
    let bad = |e: meshwork_program::Error| Error::failed(e);
    let mut b = meshwork_program::Builder::new();
    let scalar = |dims: &[usize]| -> Result<meshwork_types::TensorSpec> {
        let shape = meshwork_types::Shape::new(dims).map_err(Error::failed)?;
        Ok(meshwork_types::TensorSpec::new(DType::I32, shape))
    };
    let token = b.param("token", scalar(&[1])?).map_err(bad)?;
    let position = b.param("position", scalar(&[])?).map_err(bad)?;
    let outs = decoder.decode_step(&mut b, token, position, context, dtype).map_err(bad)?;
    let step_program = b.finish(&outs).map_err(bad)?;
    let mut b = meshwork_program::Builder::from_program(&step_program).map_err(bad)?;
    let mut results = step_program.results().to_vec();
    for (name, _) in weights {
        let k =
            step_program.params().iter().position(|p| &p.name == name).ok_or_else(|| {
                Error::failed(format!("the decoding step has no parameter {name}"))
            })?;
        results.push(b.identity(meshwork_program::Value(k as u32)).map_err(bad)?);
    }
    let program = b.finish(&results).map_err(bad)?;
    let mut carry: Vec<(usize, &str)> =
        caches.iter().enumerate().map(|(j, (n, _))| (1 + j, n.as_str())).collect();
    carry.extend(weights.iter().enumerate().map(|(j, (n, _))| (1 + caches.len() + j, n.as_str())));
    let mesh = Mesh::iota(&[("data", 1)]).map_err(Error::failed)?;
    strategy.compile(&program, &Shardings::new(mesh), &carry).map_err(Error::failed)
}

/// A tensor's name and shape.
type Named = (String, Vec<usize>);

/// A one-device strategy on `backend` (made by the one back-end factory); a target is
/// for `inspect`, which compiles without running.
fn strategy_on(backend: &BackendKind) -> Result<meshwork_strategy::Strategy> {
    if let BackendKind::XlaTarget { target, .. } = backend {
        return Err(Error::usage(format!(
            "--target {target} compiles for GPUs that are not here; generate runs (use --backend xla on a machine with the GPU)"
        )));
    }
    crate::backend::make(backend, 1)?.strategy(1, None)
}

/// The logits of `token` at `position`, the cache updated on the device.
fn run_step(
    step: &meshwork_strategy::spmd::Compiled<'_>,
    token: i64,
    position: usize,
) -> Result<Vec<f64>> {
    let feeds = [
        Tensor::i32(&[1], vec![token as i32]).map_err(Error::failed)?,
        Tensor::i32(&[], vec![position as i32]).map_err(Error::failed)?,
    ];
    let out = step.step(&feeds).map_err(Error::failed)?;
    Ok(out[0].to_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The end-of-text ids of the folder `dir` with `config`.
    fn eos(dir: &std::path::Path, config: &Json) -> Result<Vec<i64>> {
        eos_ids(dir, crate::hf::read_generation_config("init", dir)?.as_ref(), config)
    }

    /// The end-of-text ids as `transformers` 5.24 finds them (checked there: a Llama
    /// saved without `eos_token_id` and without `generation_config.json` generates
    /// with `generation_config.eos_token_id` None, though `LlamaConfig` defaults it to
    /// 2).
    #[test]
    fn eos_ids_are_the_generation_configs_else_the_configs_written() {
        let dir = tempfile::tempdir().unwrap();
        let with = serde_json::json!({"model_type": "llama", "eos_token_id": 5});
        let without = serde_json::json!({"model_type": "llama"});
        // No generation_config.json: config.json's, or none (no class default).
        assert_eq!(eos(dir.path(), &with).unwrap(), vec![5]);
        assert!(eos(dir.path(), &without).unwrap().is_empty());
        // Its ids (a list) over config.json's; naming none, none.
        let generation = dir.path().join("generation_config.json");
        std::fs::write(&generation, r#"{"eos_token_id": [7, 9]}"#).unwrap();
        assert_eq!(eos(dir.path(), &with).unwrap(), vec![7, 9]);
        std::fs::write(&generation, r#"{"do_sample": false}"#).unwrap();
        assert!(eos(dir.path(), &with).unwrap().is_empty());
        // One that cannot be read, or ids that are not ids: refused, naming the file.
        std::fs::write(&generation, "{not json").unwrap();
        let e = eos(dir.path(), &with).unwrap_err().to_string();
        assert!(e.contains("generation_config.json"), "{e}");
        for bad in [r#""2""#, "2.5", "-1", r#"[1, "x"]"#, "{}"] {
            std::fs::write(&generation, format!(r#"{{"eos_token_id": {bad}}}"#)).unwrap();
            let e = eos(dir.path(), &with).unwrap_err().to_string();
            assert!(e.contains("eos_token_id") && e.contains("generation_config.json"), "{e}");
        }
        std::fs::remove_file(&generation).unwrap();
        let made = std::process::Command::new("mkfifo").arg(&generation).status().unwrap();
        assert!(made.success());
        let e = eos(dir.path(), &with).unwrap_err().to_string();
        assert!(e.contains("named pipe"), "{e}");
    }
}
