//! The reference transformer: its sizes from the flags, `--init`'s tensors (with
//! `--heads`) or a resumed checkpoint; byte-level text.

use std::collections::HashMap;

use meshwork_nn::{Model, Transformer};

use super::{Bytes, Ctx, Defaults, Family, Resolved, classifier_flags, not_ours, token_data};
use crate::config::Config;
use crate::model::Net;
use crate::resume::Saved;
use crate::{Error, Result};

/// The reference transformer.
pub(crate) struct TransformerFamily;

pub(crate) static TRANSFORMER: TransformerFamily = TransformerFamily;

impl Family for TransformerFamily {
    fn name(&self) -> &'static str {
        "transformer"
    }

    fn defaults(&self) -> Defaults {
        Defaults::LM
    }

    fn resolve(&self, ctx: &Ctx<'_>) -> Result<Resolved> {
        let config = ctx.config;
        not_ours("transformer", &classifier_flags(config))?;
        not_ours("transformer", &[("positions", config.positions.is_some())])?;
        for (flag, given) in [
            ("preset", config.preset.is_some()),
            ("tokenizer", config.tokenizer.is_some()),
            ("data-jsonl", matches!(config.data, crate::Data::Jsonl { .. })),
            ("text (several files)", matches!(config.data, crate::Data::Documents { .. })),
        ] {
            if given {
                return Err(Error::usage(format!(
                    "--{flag} is for GPT-2 and the Llama family; the model is transformer"
                )));
            }
        }
        let file = ctx.init.file();
        if file.is_some() && config.heads.is_none() {
            return Err(heads_with_init());
        }
        let model = match ctx.saved {
            Some(saved) => transformer_from_saved(config, saved)?,
            None => transformer_from_flags(config, file)?,
        };
        let (d, m) = ctx.mesh;
        model.check_mesh(d, m).map_err(Error::usage)?;
        // Block i goes on stage ⌊i·K/L⌋ and the head on the last: up to L + 1 stages
        // leave none idle.
        if ctx.stages > model.max_stages() {
            return Err(Error::usage(format!(
                "--stages {}: the transformer's {} blocks and its head fill at most {} stages",
                ctx.stages,
                model.layers,
                model.max_stages()
            )));
        }
        let net = Net::new(model);
        (ctx.memory)(&net)?;
        let data = token_data(
            config,
            (model.vocab, model.seq),
            None,
            Bytes::Exactly,
            ctx.limit,
            ctx.share,
        )?;
        let mut resolved = Resolved::new(net, data.examples, data.rows);
        resolved.eval_rows = data.eval_rows;
        Ok(resolved)
    }
}

/// The refusal of `--init` without `--heads`: the file does not say how many heads
/// its attention has.
pub(crate) fn heads_with_init() -> Error {
    Error::flag(
        "heads",
        "an --init file does not say how many heads its attention has; give --heads",
    )
}

/// The transformer's sizes from the flags, or from `--init`'s tensors (a flag that
/// disagrees is an error naming both).
pub(crate) fn transformer_from_flags(
    config: &Config,
    init: Option<&HashMap<String, crate::init::Shaped>>,
) -> Result<Transformer> {
    let flag = |name: &str, given: Option<usize>, default: usize| -> Result<(usize, bool)> {
        match given {
            None => Ok((default, false)),
            Some(0) => Err(Error::flag(name, "must be at least 1")),
            Some(v) => Ok((v, true)),
        }
    };
    let (mut layers, mut dim, mut ffn, mut vocab, mut seq) = (
        flag("layers", config.layers, 2)?,
        flag("dim", config.dim, 64)?,
        flag("ffn", config.ffn, 256)?,
        flag("vocab", config.vocab, 256)?,
        flag("seq", config.seq, 32)?,
    );
    let heads = flag("heads", config.heads, 4)?.0;
    if let Some(init) = init {
        let dims = |name: &str| -> Result<Vec<usize>> {
            init.get(name)
                .map(|t| t.shape().to_vec())
                .ok_or_else(|| Error::flag("init", format!("has no tensor {name:?}")))
        };
        let embed = dims("embed")?;
        let pos = dims("pos")?;
        let w1 = dims("layers.0.mlp.w1")?;
        let (Some(&v), Some(&d), Some(&t), Some(&f)) =
            (embed.first(), embed.get(1), pos.first(), w1.get(1))
        else {
            return Err(Error::flag("init", "embed, pos and layers.0.mlp.w1 must be matrices"));
        };
        let l = (0..).take_while(|i| init.contains_key(&format!("layers.{i}.attn.wq"))).count();
        for (name, slot, from_file) in [
            ("layers", &mut layers, l),
            ("dim", &mut dim, d),
            ("ffn", &mut ffn, f),
            ("vocab", &mut vocab, v),
            ("seq", &mut seq, t),
        ] {
            if slot.1 && slot.0 != from_file {
                return Err(Error::flag(
                    name,
                    format!("{} disagrees with --init, whose tensors say {from_file}", slot.0),
                ));
            }
            slot.0 = from_file;
        }
    }
    transformer(vocab.0, seq.0, dim.0, heads, layers.0, ffn.0)
}

/// The transformer's sizes from a resumed checkpoint's metadata (checked as flags);
/// a flag must agree.
fn transformer_from_saved(config: &Config, saved: &Saved) -> Result<Transformer> {
    let size = |name: &str, given: Option<usize>| -> Result<usize> {
        let theirs = saved.size(name)?;
        match given {
            Some(v) if v != theirs => Err(Error::flag(
                "resume",
                format!(
                    "{} holds a model with {name} {theirs}; --{name} is {v}",
                    saved.dir.display()
                ),
            )),
            _ => Ok(theirs),
        }
    };
    transformer(
        size("vocab", config.vocab)?,
        size("seq", config.seq)?,
        size("dim", config.dim)?,
        size("heads", config.heads)?,
        size("layers", config.layers)?,
        size("ffn", config.ffn)?,
    )
}

/// A transformer whose heads divide its dim.
fn transformer(
    vocab: usize,
    seq: usize,
    dim: usize,
    heads: usize,
    layers: usize,
    ffn: usize,
) -> Result<Transformer> {
    if heads == 0 || !dim.is_multiple_of(heads) {
        return Err(Error::flag("heads", format!("{heads} heads do not divide --dim {dim}")));
    }
    Ok(Transformer { vocab, seq, dim, heads, layers, ffn })
}
