//! Model families as a run resolves them: from the flags, the data, `--init` (a
//! safetensors file or a Hugging Face folder) and a resumed checkpoint to the model (a
//! [`Net`]) and the rows it trains on. One module per family behind [`Family`]; the
//! plan asks the family, never which family it is.

mod classify;
mod hf;
mod transformer;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use meshwork_types::DType;
use serde_json::Value as Json;

use crate::config::{Config, Data, ModelKind, OptimizerKind};
use crate::data::{self, Classification, Examples};
use crate::model::Net;
use crate::resume::Saved;
use crate::{Error, Result};

pub(crate) use hf::lm_from_config;

/// A family's defaults for what a run does not set.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Defaults {
    /// `--steps`.
    pub(crate) steps: usize,
    /// `--batch`.
    pub(crate) batch: usize,
    /// `--optimizer`.
    pub(crate) optimizer: OptimizerKind,
    /// `--lr` with SGD or momentum, and with Adam or AdamW.
    pub(crate) lr: (f64, f64),
    /// `--dtype`.
    pub(crate) dtype: DType,
    /// `--mesh` on the interpreter (on XLA: 1x1).
    pub(crate) mesh: (usize, usize),
}

impl Defaults {
    /// Most families': 100 steps of 8 rows, Adam at 0.01 (SGD at 0.1), f32, one device.
    const LM: Defaults = Defaults {
        steps: 100,
        batch: 8,
        optimizer: OptimizerKind::Adam,
        lr: (0.1, 0.01),
        dtype: DType::F32,
        mesh: (1, 1),
    };
}

/// What `--init` names.
pub(crate) enum Init {
    /// Nothing: the weights are drawn from the seed.
    None,
    /// A safetensors file's tensors, by name.
    File(crate::init::InitFile),
    /// A Hugging Face checkpoint folder and its `config.json`.
    Folder {
        /// The folder.
        dir: PathBuf,
        /// Its `config.json`.
        config: Json,
    },
}

impl Init {
    /// The file's tensors' shapes, when `--init` is a file.
    pub(crate) fn file(&self) -> Option<&HashMap<String, crate::init::Shaped>> {
        match self {
            Init::File(f) => Some(&f.shapes),
            _ => None,
        }
    }
}

/// What a family resolves a run from.
pub(crate) struct Ctx<'a> {
    pub(crate) config: &'a Config,
    /// `--mesh`'s data and model axes.
    pub(crate) mesh: (usize, usize),
    /// Stages per replica (1: a mesh).
    pub(crate) stages: usize,
    /// `--max-memory`.
    pub(crate) limit: u64,
    pub(crate) init: &'a Init,
    pub(crate) saved: Option<&'a Saved>,
    /// Refuses a model whose run would hold more than `--max-memory` (before its data
    /// are read).
    pub(crate) memory: &'a dyn Fn(&Net) -> Result<()>,
    /// Across processes: the rows this process trains on (it reads only those).
    pub(crate) share: Option<&'a crate::processes::Share>,
}

/// A family's resolution of a run: the model, its rows and what came with them.
pub(crate) struct Resolved {
    pub(crate) net: Net,
    pub(crate) examples: Examples,
    /// Rows of the data, all of them.
    pub(crate) rows: usize,
    /// The main job's data (its final accuracy), for a classifier.
    pub(crate) classification: Option<Classification>,
    pub(crate) warnings: Vec<String>,
    /// A Hugging Face folder's weights, indexed to be read part by part when placed.
    pub(crate) shards: Option<crate::hf::HfShards>,
    /// The `config.json` an export writes (as read, or the model's own).
    pub(crate) hf_config: Option<Json>,
    /// The `generation_config.json` an export writes beside it (as read), if any.
    pub(crate) generation_config: Option<Json>,
    /// `--eval-data`'s rows (the last of `rows`).
    pub(crate) eval_rows: Option<usize>,
}

impl Resolved {
    fn new(net: Net, examples: Examples, rows: usize) -> Resolved {
        Resolved {
            net,
            examples,
            rows,
            classification: None,
            warnings: Vec::new(),
            shards: None,
            hf_config: None,
            generation_config: None,
            eval_rows: None,
        }
    }
}

/// A model family: its defaults, and how it turns a run's settings into its model and
/// rows.
pub(crate) trait Family: Sync {
    /// Its `--model` name.
    fn name(&self) -> &'static str;
    /// Its defaults.
    fn defaults(&self) -> Defaults;
    /// Whether its models have blocks (which `--remat` recomputes).
    fn blocks(&self) -> bool {
        true
    }
    /// Whether its checkpoints are Hugging Face folders (`--export-hf`).
    fn hf_layout(&self) -> bool {
        false
    }
    /// The model and rows of the run `ctx` describes, every flag checked against the
    /// family (a flag of another family refused naming it).
    fn resolve(&self, ctx: &Ctx<'_>) -> Result<Resolved>;
}

/// The family `--model kind` names.
pub(crate) fn of(kind: ModelKind) -> &'static dyn Family {
    match kind {
        ModelKind::Mlp | ModelKind::Auto => &classify::MLP,
        ModelKind::Cnn => &classify::CNN,
        ModelKind::Transformer => &transformer::TRANSFORMER,
        ModelKind::Gpt2 => &hf::GPT2,
        ModelKind::Llama => &hf::LLAMA,
        ModelKind::Mistral => &hf::MISTRAL,
        ModelKind::Qwen2 => &hf::QWEN2,
        ModelKind::Qwen3 => &hf::QWEN3,
    }
}

/// The family a run trains: `--model`, or (with `--model` left to the files) the
/// model `--init DIR`'s `config.json`, `--resume`'s checkpoint or `--preset` names,
/// else the MLP.
/// A `--model` that disagrees with `--init`'s folder is refused.
pub(crate) fn choose(
    config: &Config,
    init: &Init,
    saved_model: Option<&str>,
) -> Result<&'static dyn Family> {
    let from_folder = match init {
        Init::Folder { dir, config: c } => {
            let path = dir.join("config.json");
            let model_type = c.get("model_type").and_then(Json::as_str).unwrap_or("");
            let kind = ModelKind::named(model_type).filter(|k| k.has_hf_layout()).ok_or_else(|| {
                Error::flag(
                    "init",
                    format!(
                        "{}: model_type: {model_type:?} is not one meshwork reads (gpt2, llama, mistral, qwen2, qwen3)",
                        path.display()
                    ),
                )
            })?;
            Some((kind, path))
        }
        _ => None,
    };
    match (config.model, from_folder) {
        (ModelKind::Auto, Some((kind, _))) => Ok(of(kind)),
        (ModelKind::Auto, None) => {
            let from_preset = config.preset.as_deref().and_then(hf::preset).map(|(k, _)| k);
            let kind = saved_model.and_then(ModelKind::named).or(from_preset);
            Ok(of(kind.unwrap_or(ModelKind::Mlp)))
        }
        (kind, Some((theirs, path))) if theirs != kind => Err(Error::flag(
            "model",
            format!(
                "{} disagrees with --init's {}, whose model_type is {}",
                kind.name(),
                path.display(),
                theirs.name()
            ),
        )),
        (kind, _) => Ok(of(kind)),
    }
}

/// Refuses each given flag of `refused` as not `what`'s.
pub(crate) fn not_ours(what: &str, refused: &[(&str, bool)]) -> Result<()> {
    for (flag, given) in refused {
        if *given {
            return Err(Error::usage(format!("--{flag} is not the {what}'s")));
        }
    }
    Ok(())
}

/// The size flags (`--layers`, `--dim`, `--heads`, `--ffn`, `--vocab`, `--seq`,
/// `--positions`), each with whether it was given.
pub(crate) fn size_flags(config: &Config) -> [(&'static str, bool); 7] {
    [
        ("layers", config.layers.is_some()),
        ("dim", config.dim.is_some()),
        ("heads", config.heads.is_some()),
        ("ffn", config.ffn.is_some()),
        ("vocab", config.vocab.is_some()),
        ("seq", config.seq.is_some()),
        ("positions", config.positions.is_some()),
    ]
}

/// The flags of the classifiers' data and sizes (`--data-x`, `--data-y`, `--filters`,
/// `--hidden`, `--classes`), each with whether it was given: what a language model
/// refuses.
pub(crate) fn classifier_flags(config: &Config) -> [(&'static str, bool); 5] {
    let npy = matches!(config.data, Data::Npy { .. });
    [
        ("data-x", npy),
        ("data-y", npy),
        ("filters", config.filters.is_some()),
        ("hidden", config.hidden.is_some()),
        ("classes", config.classes.is_some()),
    ]
}

/// How a language model takes a text file's bytes as tokens.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Bytes {
    /// Its vocabulary must be exactly the 256 bytes.
    Exactly,
    /// Its vocabulary must hold the 256 bytes (ids 0..256).
    AtLeast,
}

/// A language model's rows of `seq + 1` tokens below `vocab`: built in (from the seed),
/// `--data-tokens`, or `--text` (through `tokenizer` when there is one, its rows cached
/// under `--cache-dir`, else its bytes as tokens as `bytes` allows); and a warning when
/// the encoded rows could not be cached.
///
/// With `--eval-data`, its rows (read as the training data are) follow the training
/// rows, and their count is returned beside: the rows evaluated.
///
/// Across processes (`share`), each process reads only the rows it trains on: of
/// `--data-tokens` directly, of `--text` from the token cache, which process 0 fills
/// (encoding the text once) while the others wait; without a cache every process
/// encodes the text.
pub(crate) fn token_data(
    config: &Config,
    (vocab, seq): (usize, usize),
    tokenizer: Option<&Path>,
    bytes: Bytes,
    limit: u64,
    share: Option<&crate::processes::Share>,
) -> Result<TokenData> {
    let Some(eval) = &config.eval_data else {
        let (examples, rows, warning) =
            token_rows(config, (vocab, seq), tokenizer, bytes, limit, share)?;
        return Ok(TokenData { examples, rows, eval_rows: None, warning });
    };
    if share.is_some() {
        return Err(Error::flag(
            "eval-data",
            "is read by one process: a run spread over processes evaluates held-out rows (--eval-fraction)",
        ));
    }
    if config.eval_fraction.is_some() {
        return Err(Error::usage(
            "--eval-data is the evaluation's rows: give it or --eval-fraction, not both",
        ));
    }
    // A text's bytes are tokens only where the training text's are too.
    if tokenizer.is_none() && matches!(eval, Data::Text(_)) && !matches!(config.data, Data::Text(_))
    {
        return Err(Error::flag(
            "eval-data",
            "a text is encoded by a tokenizer: give --tokenizer tokenizer.json (or --init a folder that has one)",
        ));
    }
    let (train, rows, warning) = token_rows(config, (vocab, seq), tokenizer, bytes, limit, None)?;
    let of_eval = Config { data: eval.clone(), eval_data: None, ..config.clone() };
    let (held, n, eval_warning) = token_rows(&of_eval, (vocab, seq), tokenizer, bytes, limit, None)
        .map_err(|e| {
            // Named as --eval-data's, not as the training data's flag.
            let m = e.to_string();
            let inner = m.strip_prefix("--").and_then(|r| r.split_once(": ")).map(|(_, r)| r);
            Error::flag("eval-data", inner.unwrap_or(&m))
        })?;
    if n == 0 {
        return Err(Error::flag("eval-data", format!("holds no full row of {} tokens", seq + 1)));
    }
    let (Examples::Tokens { mut tokens, width, .. }, Examples::Tokens { tokens: more, .. }) =
        (train, held)
    else {
        unreachable!("token rows")
    };
    tokens.extend(more);
    let warning = match (warning, eval_warning) {
        (Some(a), Some(b)) => Some(format!("{a}; {b}")),
        (a, b) => a.or(b),
    };
    Ok(TokenData {
        examples: Examples::Tokens { width, tokens, index: None },
        rows: rows + n,
        eval_rows: Some(n),
        warning,
    })
}

/// A language model's rows ([`token_data`]).
pub(crate) struct TokenData {
    pub(crate) examples: Examples,
    /// All the rows, the evaluation's among them.
    pub(crate) rows: usize,
    /// `--eval-data`'s rows, the last ones.
    pub(crate) eval_rows: Option<usize>,
    /// The encoded rows could not be cached.
    pub(crate) warning: Option<String>,
}

/// [`token_data`]'s rows of `config.data`.
fn token_rows(
    config: &Config,
    (vocab, seq): (usize, usize),
    tokenizer: Option<&Path>,
    bytes: Bytes,
    limit: u64,
    share: Option<&crate::processes::Share>,
) -> Result<(Examples, usize, Option<String>)> {
    let mut warning = None;
    if let Some(share) = share {
        let wanted = |n: usize| share.wanted(n);
        let read = |flag: &str, file: &Path| {
            let (n, tokens, index) =
                data::token_rows_of_npy_wanted(flag, file, (vocab, seq), limit, &wanted)?;
            Ok((Examples::Tokens { width: seq + 1, tokens, index: Some(index) }, n, None))
        };
        match (&config.data, tokenizer, config.cache_dir.as_deref()) {
            (Data::Tokens(path), _, _) => return read("data-tokens", path),
            (Data::Text(path), Some(tokenizer), Some(cache)) => {
                let procs = &share.processes;
                let made = if procs.leads() {
                    crate::tokenize::token_rows(path, tokenizer, vocab, seq, limit, Some(cache))
                        .map(|rows| {
                            warning = rows.warning;
                            rows.cached.is_some()
                        })
                } else {
                    Ok(false)
                };
                // Every process learns whether process 0 cached the rows.
                if procs.lead_says(made)? {
                    let key = crate::tokenize::cache_key(path, tokenizer, seq + 1)?;
                    let Some((file, _)) = crate::tokenize::cached_entry(cache, &key) else {
                        return Err(Error::flag(
                            "cache-dir",
                            format!(
                                "process 0 cached the rows of {} but this process finds no \
                                 entry for the text as it reads it now (did it change?)",
                                path.display()
                            ),
                        ));
                    };
                    let (examples, n, _) = read("cache-dir", &file)?;
                    return Ok((examples, n, warning));
                }
            }
            _ => {}
        }
    }
    let (n, tokens) = match &config.data {
        Data::BuiltIn => data::token_rows_synthetic(config.seed, vocab, seq),
        Data::Jsonl { .. } | Data::Documents { .. } => {
            let (flag, paths, field) = match &config.data {
                Data::Jsonl { path, field } => ("data-jsonl", vec![path.clone()], field),
                Data::Documents { paths, field } => ("text", paths.clone(), field),
                _ => unreachable!("matched above"),
            };
            let Some(tokenizer) = tokenizer else {
                return Err(Error::flag(
                    flag,
                    "documents are encoded by a tokenizer: give --tokenizer tokenizer.json (or --init a folder that has one)",
                ));
            };
            let cache = config.cache_dir.as_deref();
            let rows = crate::tokenize::documents_rows(
                flag,
                &paths,
                field,
                tokenizer,
                (vocab, seq),
                limit,
                cache,
            )?;
            warning = cache_warning(cache, &rows);
            (rows.n, rows.tokens)
        }
        Data::Text(path) => match tokenizer {
            Some(tokenizer) => {
                let cache = config.cache_dir.as_deref();
                let rows = crate::tokenize::token_rows(path, tokenizer, vocab, seq, limit, cache)?;
                warning = cache_warning(cache, &rows);
                (rows.n, rows.tokens)
            }
            None => {
                match bytes {
                    Bytes::Exactly if vocab != 256 => {
                        return Err(Error::flag(
                            "text",
                            format!("bytes are tokens of a vocabulary of 256, not --vocab {vocab}"),
                        ));
                    }
                    Bytes::AtLeast if vocab < 256 => {
                        return Err(Error::flag(
                            "text",
                            format!(
                                "bytes are tokens 0..256; the model's vocabulary here is {vocab}"
                            ),
                        ));
                    }
                    _ => {}
                }
                data::token_rows_of_text(path, seq, limit)?
            }
        },
        Data::Tokens(path) => data::token_rows_of_npy(path, vocab, seq, limit)?,
        Data::Npy { .. } => unreachable!("a language model refuses --data-x first"),
    };
    Ok((Examples::Tokens { width: seq + 1, tokens, index: None }, n, warning))
}

/// What to tell of encoded `rows` and the token cache `cache`: the rows' own warning
/// (a damaged entry replaced), or that they could not be cached there.
fn cache_warning(cache: Option<&Path>, rows: &crate::tokenize::TokenRows) -> Option<String> {
    match (cache, &rows.cached) {
        (Some(dir), None) => Some(format!(
            "--cache-dir {}: the encoded rows could not be cached there",
            dir.display()
        )),
        _ => rows.warning.clone(),
    }
}

/// Every weight the model has is in the `--init` file, of its shape.
pub(crate) fn check_init(net: &Net, file: &HashMap<String, crate::init::Shaped>) -> Result<()> {
    for (name, dims) in net.weight_dims() {
        let t = file.get(&name).ok_or_else(|| Error::flag("init", format!("has no {name}")))?;
        if t.shape() != dims.as_slice() {
            return Err(Error::flag(
                "init",
                format!("{name} is {:?}, the model's is {:?}", t.shape(), dims),
            ));
        }
    }
    Ok(())
}
