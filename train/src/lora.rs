//! LoRA runs: the adapter a run trains over its frozen base — from the `--lora-*`
//! flags or a `peft` folder (`--lora-init DIR`) — its initial values, and the `peft`
//! folder `--export-lora` writes.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use meshwork_nn::{Lora, LoraConfig, LoraModel, Model};
use meshwork_types::{DType, Tensor};
use serde_json::Value as Json;

use crate::config::LoraSettings;
use crate::model::Net;
use crate::rng::SplitMix;
use crate::{Error, Result, files};

/// The largest `--lora-r`.
const MAX_RANK: usize = 1 << 16;

/// The salt of the stream a new adapter's `A` matrices are drawn from.
const LORA_STREAM: u64 = 0x1f83_d9ab_fb41_bd6b;

/// `peft`'s default targets for a base of `family` (its
/// `TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`).
fn default_targets(family: &str) -> Option<&'static [&'static str]> {
    match family {
        "gpt2" => Some(&["c_attn"]),
        "llama" | "mistral" | "qwen2" | "qwen3" => Some(&["q_proj", "v_proj"]),
        _ => None,
    }
}

/// `net` with the adapter `settings` describe (a resumed run's, `saved`, as its
/// checkpoint records it), and the adapter's initial values: read from
/// `--lora-init`'s folder, or drawn from `seed` as `peft` draws them (`A`
/// Kaiming-uniform, `B` zero; a resumed run's are then restored).
pub(crate) fn attach(
    net: Net,
    settings: &LoraSettings,
    saved: Option<&Json>,
    seed: u64,
    limit: u64,
) -> Result<(Net, HashMap<String, Tensor>)> {
    let family = net.name();
    if let Some(d) = settings.dropout.filter(|d| !(0.0..1.0).contains(d)) {
        return Err(Error::flag(
            "lora-dropout",
            format!("{d}: a dropout is at least 0 and below 1"),
        ));
    }
    let from_dir = match (&settings.init, saved) {
        (Some(dir), _) => Some((
            read_config("lora-init", dir, limit)?,
            format!("--lora-init {}'s", dir.display()),
        )),
        (None, Some(saved)) => Some((
            LoraConfig::from_peft(saved)
                .map_err(|e| Error::flag("resume", format!("the checkpoint's adapter: {e}")))?,
            "the resumed checkpoint's".to_string(),
        )),
        (None, None) => None,
    };
    let config = match from_dir {
        Some((mut config, whose)) => {
            agree(settings, &config, &whose)?;
            // `--lora-dropout 0` beside a folder's dropout: trained without it.
            if settings.dropout == Some(0.0) {
                config.dropout = 0.0;
            }
            config
        }
        None => {
            let targets: Vec<String> = match &settings.targets {
                Some(t) => t.clone(),
                None => default_targets(family)
                    .ok_or_else(|| {
                        Error::flag(
                            "lora-targets",
                            format!("the {family} has no linear layers a LoRA adapter wraps"),
                        )
                    })?
                    .iter()
                    .map(|s| s.to_string())
                    .collect(),
            };
            let names: Vec<&str> = targets.iter().map(String::as_str).collect();
            // peft's defaults: r 8, lora_alpha 8.
            let r = settings.r.unwrap_or(8);
            if !(1..=MAX_RANK).contains(&r) {
                return Err(Error::flag("lora-r", format!("{r}: the rank is 1 to {MAX_RANK}")));
            }
            let alpha = settings.alpha.unwrap_or(8.0);
            if !alpha.is_finite() {
                return Err(Error::flag("lora-alpha", format!("{alpha} is not a number")));
            }
            let mut c = LoraConfig::new(r, alpha, &names);
            c.dropout = settings.dropout.unwrap_or(0.0);
            c.rslora = settings.rslora;
            c
        }
    };
    let flag = if settings.init.is_some() { "lora-init" } else { "lora-targets" };
    let base: Arc<dyn Model> = net.shared();
    let model =
        LoraModel::new(base, config, settings.init.is_none()).map_err(|e| Error::flag(flag, e))?;
    let values = match &settings.init {
        Some(dir) => read_adapter("lora-init", dir, model.lora(), limit)?,
        None => {
            let mut rng = SplitMix::new(seed ^ LORA_STREAM);
            let mut uniform = || rng.uniform();
            model
                .lora()
                .parameters()
                .into_iter()
                .map(|(name, dims)| {
                    let v = model.lora().init(&name, &mut uniform).expect("the adapter's own");
                    Ok((name, Tensor::f64(&dims, v).map_err(Error::failed)?))
                })
                .collect::<Result<_>>()?
        }
    };
    Ok((Net::new(model), values))
}

/// The flags given beside `--lora-init` (or `--resume`) agree with its adapter's
/// settings (`whose`: whose they are, for the message).
fn agree(settings: &LoraSettings, config: &LoraConfig, whose: &str) -> Result<()> {
    let differ = |flag: &str, given: String, theirs: String| {
        Err(Error::flag(flag, format!("{given} disagrees with {whose} {theirs}")))
    };
    if let Some(r) = settings.r.filter(|&r| r != config.r) {
        return differ("lora-r", r.to_string(), format!("r {}", config.r));
    }
    if let Some(a) = settings.alpha.filter(|&a| a != config.alpha) {
        return differ("lora-alpha", a.to_string(), format!("lora_alpha {}", config.alpha));
    }
    if let Some(t) = &settings.targets {
        let names: Vec<&str> = t.iter().map(String::as_str).collect();
        // As sets: peft saves `target_modules` in no particular order.
        let sorted = |targets: meshwork_nn::Targets| match targets {
            meshwork_nn::Targets::Names(mut n) => {
                n.sort();
                n.dedup();
                meshwork_nn::Targets::Names(n)
            }
            all => all,
        };
        if sorted(LoraConfig::new(1, 1.0, &names).targets) != sorted(config.targets.clone()) {
            return differ("lora-targets", t.join(","), "target_modules".into());
        }
    }
    // (0 beside a folder's dropout trains without it.)
    if let Some(d) = settings.dropout.filter(|&d| d != config.dropout && d != 0.0) {
        return differ("lora-dropout", d.to_string(), format!("lora_dropout {}", config.dropout));
    }
    if settings.rslora && !config.rslora {
        return differ("lora-rslora", "--lora-rslora".into(), "use_rslora false".into());
    }
    Ok(())
}

/// The adapter settings of the `peft` folder `dir` (`adapter_config.json`) given by
/// `--flag`.
pub(crate) fn read_config(flag: &str, dir: &Path, limit: u64) -> Result<LoraConfig> {
    let path = dir.join("adapter_config.json");
    let bytes = files::read_file(flag, &path, limit.min(1 << 20))?;
    let json: Json = serde_json::from_slice(&bytes)
        .map_err(|e| Error::flag(flag, format!("{}: {e}", path.display())))?;
    LoraConfig::from_peft(&json).map_err(|e| Error::flag(flag, format!("{}: {e}", path.display())))
}

/// The adapter tensors of the `peft` folder `dir` given by `--flag`, by the model's
/// names: exactly the adapter's matrices, each of its shape.
pub(crate) fn read_adapter(
    flag: &str,
    dir: &Path,
    lora: &Lora,
    limit: u64,
) -> Result<HashMap<String, Tensor>> {
    let path = dir.join("adapter_model.safetensors");
    let bad = |e: String| Error::flag(flag, format!("{}: {e}", path.display()));
    let stored = crate::init::read_tensors(flag, &path, limit)?;
    let mut out = HashMap::new();
    for (stored_name, t) in stored {
        let name = Lora::of_peft_name(&stored_name)
            .ok_or_else(|| bad(format!("{stored_name} is not a LoRA matrix of the model")))?;
        out.insert(name, t);
    }
    for (name, dims) in lora.parameters() {
        let t = out.get(&name).ok_or_else(|| bad(format!("has no {}", Lora::peft_name(&name))))?;
        if t.shape() != dims.as_slice() {
            return Err(bad(format!(
                "{} is {:?}; the adapter's is {dims:?}",
                Lora::peft_name(&name),
                t.shape()
            )));
        }
    }
    if out.len() != lora.parameters().len() {
        let known: Vec<String> = lora.parameters().into_iter().map(|(n, _)| n).collect();
        let extra = out.keys().find(|n| !known.contains(n)).cloned().unwrap_or_default();
        return Err(bad(format!(
            "{} wraps a layer the adapter config does not target",
            Lora::peft_name(&extra)
        )));
    }
    Ok(out)
}

/// Writes the adapter of `model` with `weights` (the run's, by name) into the folder
/// `dir` as `peft` saves one: `adapter_model.safetensors` (its matrices named
/// `base_model.model.…`, in `dtype`) and `adapter_config.json`.
pub(crate) fn write(
    dir: &Path,
    model: &LoraModel,
    weights: &HashMap<String, Tensor>,
    dtype: DType,
) -> Result<()> {
    let bad = |path: &Path, e: &dyn std::fmt::Display| {
        Error::failed(format!("--export-lora {}: {e}", path.display()))
    };
    let d = match dtype {
        DType::F64 => safetensors::Dtype::F64,
        _ => safetensors::Dtype::F32,
    };
    let mut stored = Vec::new();
    for (name, dims) in model.lora().parameters() {
        let t = weights.get(&name).ok_or_else(|| Error::failed(format!("no weight {name}")))?;
        let t = crate::init::cast(
            t,
            if d == safetensors::Dtype::F64 { DType::F64 } else { DType::F32 },
        )?;
        stored.push((Lora::peft_name(&name), dims, t.to_le_bytes()));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = stored
        .iter()
        .map(|(name, dims, data)| {
            let view = safetensors::tensor::TensorView::new(d, dims.clone(), data)
                .map_err(|e| Error::failed(format!("{name}: {e}")))?;
            Ok((name.clone(), view))
        })
        .collect::<Result<_>>()?;
    // `{"format": "pt"}`, which transformers and peft expect of a safetensors file.
    let metadata = [("format".to_string(), "pt".to_string())].into_iter().collect();
    let data = safetensors::serialize(views, Some(metadata)).map_err(|e| bad(dir, &e))?;
    let path = dir.join("adapter_model.safetensors");
    meshwork_io::files::write_new(&path, &data).map_err(|e| bad(&path, &e))?;
    let config = model.lora().config.peft_json(model.base().family());
    let text = serde_json::to_vec_pretty(&config).map_err(|e| bad(dir, &e))?;
    let path = dir.join("adapter_config.json");
    meshwork_io::files::write_new(&path, &text).map_err(|e| bad(&path, &e))?;
    Ok(())
}
