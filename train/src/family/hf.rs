//! The families with a Hugging Face layout — GPT-2 and the Llama family (Llama,
//! Mistral, Qwen 2, Qwen 3) — sized by `--init`'s `config.json`, a resumed
//! checkpoint's metadata or `--preset`; trained on token rows of `--seq + 1` (a text
//! through `--tokenizer`, by default the folder's `tokenizer.json`).

use std::path::{Path, PathBuf};

use meshwork_nn::{CausalLm, Gpt2, Llama, LlamaKind};
use serde_json::Value as Json;

use super::{Bytes, Ctx, Defaults, Family, Init, Resolved, classifier_flags, not_ours, token_data};
use crate::config::{Config, Data, ModelKind};
use crate::model::Net;
use crate::resume::Saved;
use crate::{Error, Result};

/// A family with a Hugging Face layout.
pub(crate) struct HfFamily(ModelKind);

pub(crate) static GPT2: HfFamily = HfFamily(ModelKind::Gpt2);
pub(crate) static LLAMA: HfFamily = HfFamily(ModelKind::Llama);
pub(crate) static MISTRAL: HfFamily = HfFamily(ModelKind::Mistral);
pub(crate) static QWEN2: HfFamily = HfFamily(ModelKind::Qwen2);
pub(crate) static QWEN3: HfFamily = HfFamily(ModelKind::Qwen3);

/// The presets of GPT-2, then of the Llama family.
pub(crate) const PRESETS: [&str; 7] =
    ["tiny", "gpt2", "gpt2-medium", "tiny-llama", "smollm2-135m", "qwen2.5-0.5b", "llama-3.2-1b"];

/// The model a preset names, and its family.
pub(crate) fn preset(name: &str) -> Option<(ModelKind, Sizes)> {
    if let Some(g) = Gpt2::preset(name) {
        return Some((ModelKind::Gpt2, Sizes::Gpt2(g)));
    }
    let l = Llama::preset(name)?;
    let kind = ModelKind::named(l.kind.model_type()).expect("a family of its own");
    Some((kind, Sizes::Llama(l)))
}

/// A model's sizes before the training context is known.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Sizes {
    Gpt2(Gpt2),
    Llama(Llama),
}

impl Sizes {
    fn positions(&self) -> usize {
        match self {
            Sizes::Gpt2(g) => g.positions,
            Sizes::Llama(l) => l.positions,
        }
    }

    /// The model trained on rows of `seq + 1`, after `seq` is checked against it
    /// (`whose` names where the sizes came from, for the refusal).
    fn with_seq(self, seq: usize, whose: &str) -> Result<Net> {
        if seq == 0 || seq > self.positions() {
            return Err(Error::flag(
                "seq",
                format!("{seq}: the context is 1 to the model's {} positions", self.positions()),
            ));
        }
        Ok(match self {
            Sizes::Gpt2(model) => Net::new(CausalLm { model, seq }),
            Sizes::Llama(model) => {
                model
                    .check_context(seq)
                    .map_err(|e| Error::usage(format!("--seq {seq} with {whose}: {e}")))?;
                Net::new(CausalLm { model, seq })
            }
        })
    }
}

/// The model of a Hugging Face `config.json` (at `path`, named by `--flag`), trained
/// (or decoding) over `seq` positions.
pub(crate) fn lm_from_config(flag: &str, path: &Path, config: &Json, seq: usize) -> Result<Net> {
    sizes_of_config(flag, path, config)?.with_seq(seq, &path.display().to_string())
}

fn sizes_of_config(flag: &str, path: &Path, config: &Json) -> Result<Sizes> {
    let bad = |e| crate::hf::config_error(flag, path, e);
    match config.get("model_type").and_then(Json::as_str) {
        Some("gpt2") => Ok(Sizes::Gpt2(Gpt2::from_config(config).map_err(bad)?)),
        _ => Ok(Sizes::Llama(Llama::from_config(config).map_err(bad)?)),
    }
}

impl Family for HfFamily {
    fn name(&self) -> &'static str {
        self.0.name()
    }

    fn defaults(&self) -> Defaults {
        Defaults::LM
    }

    fn hf_layout(&self) -> bool {
        true
    }

    fn resolve(&self, ctx: &Ctx<'_>) -> Result<Resolved> {
        let config = ctx.config;
        not_ours(self.display(), &classifier_flags(config))?;
        let (sizes, whose, hf_config) = self.sizes(ctx)?;
        let seq = self.seq(config, ctx.saved, sizes.positions())?;
        let net = sizes.with_seq(seq, &whose)?;
        let (d, m) = ctx.mesh;
        net.model().check_mesh(d, m).map_err(Error::usage)?;
        if ctx.stages > 1 {
            return Err(Error::usage(format!(
                "--stages: {} trains on meshes, not in pipelines",
                self.display()
            )));
        }
        (ctx.memory)(&net)?;
        // A Hugging Face folder is indexed here (every tensor checked from the
        // headers); its weights are read when they are placed, each device's part alone.
        let (shards, folder) = match ctx.init {
            Init::Folder { dir, .. } => (
                Some(crate::hf::index(
                    "init",
                    dir,
                    net.model(),
                    meshwork_types::DType::F64,
                    ctx.limit,
                )?),
                Some(dir.as_path()),
            ),
            _ => (None, None),
        };
        let tokenizer = tokenizer(config, folder)?;
        let vocab = net.model().decoder().map_or(0, |d| d.vocab());
        let data = token_data(
            config,
            (vocab, seq),
            tokenizer.as_deref(),
            Bytes::AtLeast,
            ctx.limit,
            ctx.share,
        )?;
        let mut resolved = Resolved::new(net.clone(), data.examples, data.rows);
        resolved.warnings.extend(data.warning);
        resolved.eval_rows = data.eval_rows;
        resolved.shards = shards;
        resolved.hf_config = Some(
            hf_config.unwrap_or_else(|| net.model().hf().map_or(Json::Null, |hf| hf.config_json())),
        );
        // Generation's defaults travel with the model: from the folder, or from the
        // checkpoint a resumed run started from.
        resolved.generation_config = match (ctx.saved, folder) {
            (Some(saved), _) => {
                saved.meta.get("generation_config").filter(|g| g.is_object()).cloned()
            }
            // One that cannot be read is passed over, as `transformers` passes it over.
            (None, Some(dir)) => {
                crate::hf::read_generation_config("init", dir).unwrap_or_else(|e| {
                    resolved.warnings.push(format!("{e}; it is not exported"));
                    None
                })
            }
            (None, None) => None,
        };
        Ok(resolved)
    }
}

impl HfFamily {
    /// The family as people name it.
    fn display(&self) -> &'static str {
        match self.0 {
            ModelKind::Gpt2 => "GPT-2",
            ModelKind::Llama => "Llama",
            ModelKind::Mistral => "Mistral",
            ModelKind::Qwen2 => "Qwen 2",
            _ => "Qwen 3",
        }
    }

    /// The sizes, where they came from, and the `config.json` an export writes: from a
    /// resumed run's checkpoint, `--init`'s folder, or `--preset` (GPT-2's overridden
    /// by the size flags); each refused where another source fixes them.
    fn sizes(&self, ctx: &Ctx<'_>) -> Result<(Sizes, String, Option<Json>)> {
        let config = ctx.config;
        let size_flags = [
            ("layers", config.layers),
            ("dim", config.dim),
            ("heads", config.heads),
            ("ffn", config.ffn),
            ("vocab", config.vocab),
            ("positions", config.positions),
        ];
        let family = self.display();
        let fixed = |whose: &str| -> Result<()> {
            if let Some((flag, _)) = size_flags.iter().find(|(_, v)| v.is_some()) {
                return Err(Error::usage(format!("--{flag}: {family}'s sizes come from {whose}")));
            }
            if config.preset.is_some() {
                return Err(Error::usage(format!("--preset: {family}'s sizes come from {whose}")));
            }
            Ok(())
        };
        if let Some(saved) = ctx.saved {
            fixed("the checkpoint --resume names")?;
            let sizes = self.sizes_of_saved(saved)?;
            // The folder's config as it was read (recorded since, and used only where
            // it describes the model the checkpoint holds), else the model's.
            let recorded = saved.meta.get("hf_config").filter(|c| {
                c.is_object() && sizes_of_config("resume", &saved.dir, c).is_ok_and(|s| s == sizes)
            });
            let hf_config = match (recorded, &sizes) {
                (Some(c), _) => Some(c.clone()),
                (None, Sizes::Llama(_)) => saved.meta.get("config").cloned(),
                (None, Sizes::Gpt2(_)) => None,
            };
            return Ok((sizes, saved.dir.display().to_string(), hf_config));
        }
        match ctx.init {
            Init::Folder { dir, config: c } => {
                fixed("--init's config.json")?;
                let path = dir.join("config.json");
                let sizes = sizes_of_config("init", &path, c)?;
                Ok((sizes, path.display().to_string(), Some(c.clone())))
            }
            Init::File(_) => Err(Error::flag(
                "init",
                format!(
                    "{family} reads a Hugging Face checkpoint folder (config.json and model.safetensors)"
                ),
            )),
            Init::None => {
                let default = if self.0 == ModelKind::Gpt2 { "tiny" } else { "tiny-llama" };
                let name = config.preset.as_deref().unwrap_or(default);
                let (kind, sizes) = preset(name).ok_or_else(|| {
                    Error::flag("preset", format!("{name}: the presets are {}", PRESETS.join(", ")))
                })?;
                // A preset of another family is refused; a family's default is its own
                // tiny model (the tiny Llama, computed as that family).
                let sizes = match sizes {
                    Sizes::Gpt2(g) if self.0 == ModelKind::Gpt2 => {
                        Sizes::Gpt2(gpt2_overrides(config, g)?)
                    }
                    Sizes::Llama(l) if kind == self.0 || config.preset.is_none() => {
                        fixed_flags(&size_flags, &format!("--preset {name}"), family)?;
                        Sizes::Llama(retype(l, self.0))
                    }
                    _ => {
                        return Err(Error::flag(
                            "preset",
                            format!(
                                "{name} is a {} model; the model is {}",
                                kind.name(),
                                self.0.name()
                            ),
                        ));
                    }
                };
                Ok((sizes, format!("--preset {name}"), None))
            }
        }
    }

    /// The sizes a resumed checkpoint's metadata says.
    fn sizes_of_saved(&self, saved: &Saved) -> Result<Sizes> {
        let dir = saved.dir.display();
        let m = &saved.meta;
        if self.0 == ModelKind::Gpt2 {
            let size = |k: &str| saved.size(k);
            let model = Gpt2 {
                vocab: size("vocab")?,
                positions: size("positions")?,
                dim: size("dim")?,
                layers: size("layers")?,
                heads: size("heads")?,
                inner: size("inner")?,
                eps: m.get("eps").and_then(Json::as_f64).unwrap_or(1e-5),
            };
            if model.heads == 0 || !model.dim.is_multiple_of(model.heads) {
                return Err(Error::flag(
                    "resume",
                    format!("{dir} holds a GPT-2 whose heads do not divide its width"),
                ));
            }
            return Ok(Sizes::Gpt2(model));
        }
        let c = m.get("config").ok_or_else(|| {
            Error::flag("resume", format!("{dir}: its metadata has no model config"))
        })?;
        let model = Llama::from_config(c)
            .map_err(|e| Error::flag("resume", format!("{dir}: its model config: {e}")))?;
        Ok(Sizes::Llama(model))
    }

    /// The training context: the checkpoint's (which `--seq` must match), `--seq`, or
    /// the smaller of 64 and the model's positions.
    fn seq(&self, config: &Config, saved: Option<&Saved>, positions: usize) -> Result<usize> {
        Ok(match (config.seq, saved) {
            (Some(s), Some(saved)) if s != saved.size("seq")? => {
                return Err(Error::flag(
                    "resume",
                    format!(
                        "{} trained on a context of {}; --seq is {s}",
                        saved.dir.display(),
                        saved.size("seq")?
                    ),
                ));
            }
            (_, Some(saved)) => saved.size("seq")?,
            (Some(s), None) => s,
            (None, None) => positions.min(64),
        })
    }
}

/// Refuses each given size flag: the sizes come from `whose`.
fn fixed_flags(flags: &[(&str, Option<usize>)], whose: &str, family: &str) -> Result<()> {
    if let Some((flag, _)) = flags.iter().find(|(_, v)| v.is_some()) {
        return Err(Error::usage(format!("--{flag}: {family}'s sizes come from {whose}")));
    }
    Ok(())
}

/// A tiny preset as the family `kind` computes it (its biases and norms).
fn retype(l: Llama, kind: ModelKind) -> Llama {
    let Some(to) = LlamaKind::of(kind.name()) else { return l };
    if to == l.kind {
        return l;
    }
    let mut c = l.config();
    c["model_type"] = to.model_type().into();
    Llama::from_config(&c).unwrap_or(l)
}

/// GPT-2's preset with the size flags (`--layers`, `--dim`, `--heads`, `--ffn`,
/// `--vocab`) over it; a new width without `--ffn` keeps GPT-2's MLP of 4 × width.
fn gpt2_overrides(config: &Config, mut m: Gpt2) -> Result<Gpt2> {
    for (flag, value) in [
        ("layers", config.layers),
        ("dim", config.dim),
        ("heads", config.heads),
        ("ffn", config.ffn),
        ("vocab", config.vocab),
        ("positions", config.positions),
    ] {
        match value {
            Some(0) => return Err(Error::flag(flag, "must be at least 1")),
            Some(v) if v > 1 << 24 => return Err(Error::flag(flag, format!("{v} is beyond 2^24"))),
            Some(v) => match flag {
                "layers" => m.layers = v,
                "dim" => m.dim = v,
                "heads" => m.heads = v,
                "ffn" => m.inner = v,
                "positions" => m.positions = v,
                _ => m.vocab = v,
            },
            None => {}
        }
    }
    if config.dim.is_some() && config.ffn.is_none() {
        m.inner = 4 * m.dim;
    }
    if !m.dim.is_multiple_of(m.heads) {
        return Err(Error::usage(format!("--heads {} does not divide --dim {}", m.heads, m.dim)));
    }
    if m.layers > 1 << 12 {
        return Err(Error::flag("layers", format!("{} is beyond 4096", m.layers)));
    }
    Ok(m)
}

/// The tokenizer that encodes `--text`: `--tokenizer`, or the `tokenizer.json` of
/// `--init`'s folder; none for other data. `--cache-dir` needs one.
fn tokenizer(config: &Config, folder: Option<&Path>) -> Result<Option<PathBuf>> {
    let texts = |d: &Data| matches!(d, Data::Text(_) | Data::Jsonl { .. } | Data::Documents { .. });
    if !texts(&config.data) && !config.eval_data.as_ref().is_some_and(texts) {
        return Ok(None);
    }
    let found = config
        .tokenizer
        .clone()
        .or_else(|| folder.map(|d| d.join("tokenizer.json")).filter(|p| p.is_file()));
    if config.cache_dir.is_some() && found.is_none() {
        return Err(Error::usage(
            "--cache-dir caches --text encoded by --tokenizer (or --init's tokenizer.json); give one",
        ));
    }
    Ok(found)
}
