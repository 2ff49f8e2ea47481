//! From a run's settings to what it will do: every setting checked (alone, against the
//! others, against the data, the initial weights and a resumed checkpoint) and the
//! memory the run will hold estimated — all before anything is written or allocated
//! by size. A refusal is one line naming the flag.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use meshwork_checkpoint::find_checkpoint;
use meshwork_nn::{Cnn, Mlp, Optimizer, Transformer};
use meshwork_types::{DType, Tensor};
use serde_json::Value;

use crate::config::{
    BackendKind, Check, Config, Data, ModelKind, OptimizerKind, Partitioner, Schedule,
};
use crate::data::{self, BUILT_IN_CLASSIFICATION, Classification, Examples, Images};
use crate::files::{Output, check_output, read_losses};
use crate::model::{Layout, Net, Savers};
use crate::report::number_text;
use crate::resume::{Origin, Saved};
use crate::{Error, Result, init};

/// Most devices a run may use: each is a thread of this process.
pub const MAX_DEVICES: usize = 1024;
/// Most steps a run may take (its losses are kept).
pub const MAX_STEPS: usize = 100_000_000;
/// Runs estimated to hold at most this many bytes are checked against one device by
/// default.
const CHECK_BYTES: f64 = 1e9;

/// A run, resolved and checked.
pub(crate) struct Plan {
    pub(crate) net: Net,
    pub(crate) layout: Layout,
    pub(crate) batch: usize,
    pub(crate) steps: usize,
    pub(crate) dtype: DType,
    pub(crate) optimizer: Optimizer,
    pub(crate) lr: f64,
    pub(crate) warmup: usize,
    pub(crate) cosine: bool,
    pub(crate) clip: Option<f64>,
    pub(crate) seed: u64,
    pub(crate) shuffle: bool,
    pub(crate) steps_per_run: usize,
    /// Steps between evaluations (0: none).
    pub(crate) eval_every: usize,
    /// Rows trained on (the first `rows`), and held out after them.
    pub(crate) rows: usize,
    pub(crate) held: usize,
    pub(crate) examples: Examples,
    /// The main job's data (for the final accuracy of an MLP without held-out rows).
    pub(crate) classification: Option<Classification>,
    /// Initial weights by name (in the file's dtype), unless resumed.
    pub(crate) init: Option<HashMap<String, Tensor>>,
    /// A Hugging Face checkpoint folder's weights, read part by part when placed.
    pub(crate) shards: Option<crate::hf::HfShards>,
    pub(crate) saved: Option<Saved>,
    pub(crate) meta: Value,
    pub(crate) warnings: Vec<String>,
    pub(crate) check: bool,
    pub(crate) never_check: bool,
    pub(crate) checkpoint_dir: Option<PathBuf>,
    pub(crate) checkpoint_every: usize,
    pub(crate) keep: usize,
    pub(crate) losses_json: Option<PathBuf>,
    /// The losses a resumed run's `--losses-json` holds of the steps before it.
    pub(crate) losses_before: Vec<Option<f64>>,
    pub(crate) metrics_jsonl: Option<PathBuf>,
    pub(crate) plot: Option<PathBuf>,
    /// `--export-hf`'s folder and the `config.json` it gets.
    pub(crate) export_hf: Option<(PathBuf, Value)>,
    /// `--grad-accum`, `--remat`, `--fsdp`.
    pub(crate) savers: Savers,
    /// `--precision` (`None`: full).
    pub(crate) precision: Option<DType>,
    /// f16's dynamic loss scaling.
    pub(crate) loss_scale: Option<meshwork_nn::LossScale>,
    /// GPT-2's attention and loss in pieces (on the interpreter).
    pub(crate) blocking: meshwork_nn::Blocking,
    /// XLA's back end when `--backend xla` (its plugin loaded, a client made).
    pub(crate) xla: Option<std::sync::Arc<meshwork_strategy::backend::Xla>>,
}

fn usage(message: impl Into<String>) -> Error {
    Error::usage(message)
}

/// `DxM` as given.
fn mesh_text((d, m): (usize, usize)) -> String {
    format!("{d}x{m}")
}

/// The checked plan of `config`.
impl Plan {
    /// The run's initial weights: `--init`'s (taken from the plan), or random ones of
    /// the one-device program from the run's seed.
    pub(crate) fn take_init(&mut self) -> Result<HashMap<String, Tensor>> {
        if self.shards.is_some() {
            // Read as they are placed ([`Plan::shards`]).
            return Ok(HashMap::new());
        }
        match self.init.take() {
            Some(file) => Ok(file),
            None => {
                let one_device = Layout::Mesh { data: 1, model: 1 };
                let (program, _) = self.net.loss_program(self.batch, self.dtype, one_device)?;
                self.net.random_init(&program, self.seed)
            }
        }
    }

    /// A strategy of the layout's devices on the run's back end.
    pub(crate) fn strategy(&self) -> Result<meshwork_strategy::Strategy> {
        let strategy = meshwork_strategy::Strategy::data_parallel(self.layout.devices())
            .map_err(Error::failed)?;
        Ok(match &self.xla {
            Some(xla) => strategy.with_backend(xla.clone()),
            None => strategy,
        })
    }
}

pub(crate) fn plan(config: &Config) -> Result<Plan> {
    let kind = config.model;
    let mlp = kind == ModelKind::Mlp;
    let limit = config.max_memory;
    // Where it runs.
    let xla = matches!(config.backend, BackendKind::Xla { .. });
    let default_mesh = if mlp && !xla { (2, 2) } else { (1, 1) };
    let (data_axis, model_axis) = config.mesh.unwrap_or(default_mesh);
    if data_axis == 0 || model_axis == 0 {
        return Err(usage(format!(
            "--mesh {}: a mesh needs at least one device along each axis",
            mesh_text((data_axis, model_axis))
        )));
    }
    let stages = config.stages.unwrap_or(1);
    let micro = config.microbatches.unwrap_or(1);
    if stages == 0 || micro == 0 {
        return Err(usage("--stages and --microbatches must be at least 1"));
    }
    if stages > 1 && model_axis > 1 {
        return Err(usage(format!(
            "--stages {stages} with --mesh {data_axis}x{model_axis}: a pipeline's replicas are the mesh's data axis (use --mesh {data_axis}x1)"
        )));
    }
    if micro > 1 && stages == 1 {
        return Err(usage("--microbatches needs --stages K (a pipeline)"));
    }
    let devices = data_axis
        .checked_mul(model_axis)
        .and_then(|d| d.checked_mul(stages))
        .filter(|&d| d <= MAX_DEVICES)
        .ok_or_else(|| {
            usage(format!(
                "--mesh {data_axis}x{model_axis} with {stages} stages is more than {MAX_DEVICES} devices; each device of a CPU mesh is a thread"
            ))
        })?;
    let layout = if stages > 1 {
        Layout::Pipeline { replicas: data_axis, stages, micro }
    } else {
        Layout::Mesh { data: data_axis, model: model_axis }
    };
    if stages > 1
        && matches!(config.backend, BackendKind::Xla { partitioner: Partitioner::Xla, .. })
    {
        return Err(usage(format!(
            "--partitioner xla splits SPMD meshes; {} is placed stage by stage (drop --partitioner xla)",
            layout.describe()
        )));
    }
    // How much, how fast.
    let steps = config.steps.unwrap_or(if mlp { 200 } else { 100 });
    let batch = config.batch.unwrap_or(match kind {
        ModelKind::Mlp => 64,
        ModelKind::Cnn => 32,
        ModelKind::Transformer | ModelKind::Gpt2 => 8,
    });
    if steps == 0 {
        return Err(usage("--steps must be at least 1"));
    }
    if batch == 0 {
        return Err(usage("--batch must be at least 1"));
    }
    if steps > MAX_STEPS {
        return Err(usage(format!("--steps {steps} is more than {MAX_STEPS}")));
    }
    match layout {
        Layout::Mesh { .. } if !batch.is_multiple_of(data_axis) => {
            return Err(usage(format!(
                "--batch {batch} does not split over the {data_axis} data replicas of --mesh {data_axis}x{model_axis}"
            )));
        }
        Layout::Pipeline { .. } if !batch.is_multiple_of(data_axis.saturating_mul(micro)) => {
            return Err(usage(format!(
                "--batch {batch} does not split into {data_axis} replicas × {micro} micro-batches"
            )));
        }
        _ => {}
    }
    let savers = savers(config, layout, batch)?;
    let optimizer_kind =
        config.optimizer.unwrap_or(if mlp { OptimizerKind::Sgd } else { OptimizerKind::Adam });
    let optimizer = optimizer_kind.with(&config.optimizer_settings)?;
    let lr = config.lr.unwrap_or(if mlp {
        0.5
    } else if matches!(optimizer_kind, OptimizerKind::Adam | OptimizerKind::AdamW) {
        0.01
    } else {
        0.1
    });
    if !(lr.is_finite() && lr > 0.0) {
        return Err(usage(format!("--lr {} must be a positive number", number_text(lr))));
    }
    let dtype_flag = config.dtype;
    if let Some(d) = dtype_flag
        && !matches!(d, DType::F32 | DType::F64)
    {
        return Err(usage(format!("--dtype {d} is not f32 or f64")));
    }
    if config.steps_per_run == 0 {
        return Err(usage("--steps-per-run must be at least 1"));
    }
    if let Some(p) = config.precision
        && !matches!(p, DType::BF16 | DType::F16)
    {
        return Err(usage(format!("--precision {p}: products compute in bf16 or f16 (or full)")));
    }
    // f16 products scale the loss (dynamically, as GradScaler).
    let loss_scale = match (config.precision, config.loss_scale_init) {
        (Some(DType::F16), init) => {
            let init = init.unwrap_or(65536.0);
            if !(init.is_finite() && init > 0.0) {
                return Err(usage(format!(
                    "--loss-scale-init {} must be a positive number",
                    number_text(init)
                )));
            }
            if stages > 1 {
                return Err(usage(
                    "--precision f16 scales the loss on a mesh's step; a pipeline takes bf16 or full",
                ));
            }
            Some(meshwork_nn::LossScale { init, ..meshwork_nn::LossScale::default() })
        }
        (_, Some(_)) => return Err(usage("--loss-scale-init needs --precision f16")),
        (_, None) => None,
    };
    if let Some(c) = config.clip_norm
        && !(c.is_finite() && c > 0.0)
    {
        return Err(usage(format!("--clip-norm {c} must be a positive number")));
    }
    let cosine = config.schedule == Schedule::Cosine;
    // Outputs: known writable before any work, each its own path, nothing of the
    // user's replaced.
    if let Some(p) = &config.losses_json {
        check_output("losses-json", p, Output::Losses)?;
    }
    if let Some(p) = &config.plot {
        check_output("plot", p, Output::New)?;
    }
    if let Some(p) = &config.metrics_jsonl {
        check_output("metrics-jsonl", p, Output::New)?;
    }
    if let Some(dir) = &config.export_hf {
        if kind != ModelKind::Gpt2 {
            return Err(usage(format!("--export-hf is GPT-2's; the model is {}", kind.name())));
        }
        crate::hf::check_export("export-hf", dir)?;
    }
    let outputs: Vec<(&str, &Path)> = [
        ("export-hf", config.export_hf.as_deref()),
        ("losses-json", config.losses_json.as_deref()),
        ("metrics-jsonl", config.metrics_jsonl.as_deref()),
        ("plot", config.plot.as_deref()),
        ("checkpoint-dir", config.checkpoint_dir.as_deref()),
    ]
    .into_iter()
    .filter_map(|(f, p)| p.map(|p| (f, p)))
    .collect();
    // Compared as the files they name: `l.json` and `./l.json` are one file.
    let named = |p: &Path| {
        let parent = p.parent().filter(|q| !q.as_os_str().is_empty()).unwrap_or(Path::new("."));
        (
            std::fs::canonicalize(parent).unwrap_or_else(|_| parent.to_path_buf()),
            p.file_name().map(ToOwned::to_owned),
        )
    };
    // Nothing is written inside the export folder (it must stay empty until the end).
    if let Some(dir) = &config.export_hf {
        let full = |q: &Path| std::path::absolute(q).unwrap_or_else(|_| q.to_path_buf());
        if let Some((f, p)) = outputs.iter().skip(1).find(|(_, p)| full(p).starts_with(full(dir))) {
            return Err(Error::flag(
                f,
                format!(
                    "{} is inside --export-hf {}; give it a path outside",
                    p.display(),
                    dir.display()
                ),
            ));
        }
    }
    for (i, (f, p)) in outputs.iter().enumerate() {
        if let Some((g, _)) = outputs[..i].iter().find(|(_, q)| q == p || named(q) == named(p)) {
            return Err(Error::flag(
                f,
                format!("{} is also --{g}'s; give each output its own path", p.display()),
            ));
        }
    }
    // Checkpoints.
    for (flag, given) in
        [("checkpoint-every", config.checkpoint_every.is_some()), ("keep", config.keep.is_some())]
    {
        if given && config.checkpoint_dir.is_none() {
            return Err(usage(format!("--{flag} needs --checkpoint-dir")));
        }
    }
    let keep = config.keep.unwrap_or(3);
    if keep == 0 {
        return Err(usage("--keep must be at least 1 (the newest checkpoint)"));
    }
    if let Some(d) = &config.checkpoint_dir
        && let Ok(meta) = std::fs::symlink_metadata(d)
        && !meta.is_dir()
    {
        return Err(Error::usage(format!(
            "--checkpoint-dir {}: it is {}, not a directory meshwork made",
            d.display(),
            crate::files::kind(&meta)
        )));
    }
    if config.init.is_some() && config.resume.is_some() {
        return Err(usage(
            "--init and --resume both set the weights; give one (a resumed run takes its weights from the checkpoint)",
        ));
    }
    let saved = config.resume.as_deref().map(|p| Saved::read(p, kind.name())).transpose()?;
    // GPT-2's `--init` may be a Hugging Face checkpoint folder (its sizes too).
    let mut hf: Option<crate::hf::HfGpt2> = None;
    let mut hf_config: Option<Value> = None;
    // A Hugging Face folder is indexed here (every tensor checked from the headers);
    // its weights are read when they are placed, each device's part alone.
    let mut shards: Option<crate::hf::HfShards> = None;
    let file = match config.init.as_deref() {
        Some(p) if kind == ModelKind::Gpt2 && p.is_dir() => {
            let (read, index) = crate::hf::index_gpt2("init", p, DType::F64, limit)?;
            hf_config = Some(read.config.clone());
            hf = Some(read);
            shards = Some(index);
            None
        }
        Some(p) => Some(init::read_init(p, limit)?),
        None => None,
    };
    if config.preset.is_some() && kind != ModelKind::Gpt2 {
        return Err(usage(format!("--preset is GPT-2's; the model is {}", kind.name())));
    }
    if config.cache_dir.is_some() && config.tokenizer.is_none() {
        return Err(usage("--cache-dir caches --text encoded by --tokenizer; give one"));
    }
    if config.tokenizer.is_some() {
        if kind != ModelKind::Gpt2 {
            return Err(usage(format!("--tokenizer is GPT-2's; the model is {}", kind.name())));
        }
        if !matches!(config.data, Data::Text(_)) {
            return Err(usage("--tokenizer encodes --text FILE; give one"));
        }
    }
    let data_flags = |what: &str, refused: &[(&str, bool)]| -> Result<()> {
        for (flag, given) in refused {
            if *given {
                return Err(usage(format!("--{flag} is not the {what}'s")));
            }
        }
        Ok(())
    };
    let (is_text, is_tokens, is_npy) = (
        matches!(config.data, Data::Text(_)),
        matches!(config.data, Data::Tokens(_)),
        matches!(config.data, Data::Npy { .. }),
    );
    let transformer_flags = [
        ("layers", config.layers.is_some()),
        ("dim", config.dim.is_some()),
        ("heads", config.heads.is_some()),
        ("ffn", config.ffn.is_some()),
        ("vocab", config.vocab.is_some()),
        ("seq", config.seq.is_some()),
    ];
    let mut dtype = dtype_flag.unwrap_or(if mlp { DType::F64 } else { DType::F32 });
    if let Some(saved) = &saved
        && let Some(theirs) = saved.dtype()?
    {
        match dtype_flag {
            Some(d) if d != theirs => {
                return Err(Error::flag(
                    "resume",
                    format!("{} was trained in {theirs}; --dtype is {d}", saved.dir.display()),
                ));
            }
            _ => dtype = theirs,
        }
    }
    // The model's memory and the run's bookkeeping against --max-memory (checked before
    // the transformer's rows are read, and for every model once its data are known).
    let memory = |net: &Net| {
        let extra = bookkeeping(config, steps);
        let need = net.memory_estimate(batch, config.steps_per_run, dtype, layout, true, savers);
        check_memory(need.total() + extra, limit)
    };
    let mut classification = None;
    let mut cache_warning = None;
    let (net, examples, rows_all) = match kind {
        ModelKind::Mlp => {
            data_flags(
                "MLP",
                &[
                    ("text", is_text),
                    ("data-tokens", is_tokens),
                    ("filters", config.filters.is_some()),
                ],
            )?;
            data_flags("MLP", &transformer_flags)?;
            if let Some(c) = config.classes
                && c < 2
            {
                return Err(usage(format!("--classes {c}: need at least 2")));
            }
            if stages > 2 {
                return Err(usage(format!("--stages {stages}: the MLP has 2 layers")));
            }
            let data = match &config.data {
                Data::BuiltIn => {
                    let (rows, features, classes) = BUILT_IN_CLASSIFICATION;
                    if let Some(c) = config.classes
                        && c != classes
                    {
                        return Err(usage(format!(
                            "--classes {c}: the built-in data has {classes} classes (give --data-x and --data-y for other data)"
                        )));
                    }
                    Classification::synthetic(config.seed, rows, features, classes)
                }
                Data::Npy { x, y } => Classification::from_npy(x, y, limit, config.classes)?,
                _ => unreachable!("refused above"),
            };
            // The hidden units: the flag, or the file's, or the checkpoint's; a flag that
            // disagrees with either is refused.
            let from_file = match &file {
                Some(f) => Some(mlp_init_hidden(f, &data)?),
                None => None,
            };
            let from_saved = match &saved {
                Some(s) => Some(s.size("hidden")?),
                None => None,
            };
            if let (Some(h), Some(f)) = (config.hidden, from_file)
                && h != f
            {
                return Err(usage(format!(
                    "--hidden {h} disagrees with --init, whose w1 has {f} hidden units"
                )));
            }
            if let (Some(h), Some(s), Some(saved)) = (config.hidden, from_saved, &saved)
                && h != s
            {
                return Err(Error::flag(
                    "resume",
                    format!(
                        "{} holds a model with hidden {s}; --hidden is {h}",
                        saved.dir.display()
                    ),
                ));
            }
            let hidden = config.hidden.or(from_file).or(from_saved).unwrap_or(32);
            if hidden == 0 {
                return Err(usage("--hidden must be at least 1"));
            }
            if let Some(saved) = &saved {
                for (what, flag, ours) in
                    [("features", "data-x", data.features()), ("classes", "data-y", data.classes)]
                {
                    let theirs = saved.size(what)?;
                    if theirs != ours {
                        return Err(Error::flag(
                            "resume",
                            format!(
                                "{} holds a model with {theirs} {what}; --{flag} gives {ours}",
                                saved.dir.display()
                            ),
                        ));
                    }
                }
            }
            if !hidden.is_multiple_of(model_axis) {
                return Err(usage(format!(
                    "--hidden {hidden} does not split over the {model_axis} model devices of --mesh {data_axis}x{model_axis}"
                )));
            }
            let net = Mlp { features: data.features(), hidden, classes: data.classes };
            let n = data.rows();
            let x: Vec<f64> = data.x.iter().copied().collect();
            let y = data
                .labels
                .iter()
                .map(|&l| {
                    i32::try_from(l).map_err(|_| {
                        Error::flag(
                            "data-y",
                            format!("class {l} is past the 2^31 classes a label holds"),
                        )
                    })
                })
                .collect::<Result<Vec<i32>>>()?;
            let examples = Examples::Images { per: net.features, dims: vec![net.features], x, y };
            classification = Some(data);
            (Net::Mlp(net), examples, n)
        }
        ModelKind::Cnn => {
            if model_axis > 1 {
                return Err(usage(format!(
                    "--mesh {data_axis}x{model_axis}: the CNN's weights are not split over a model axis (--mesh Dx1, or --stages K)"
                )));
            }
            if stages > 3 {
                return Err(usage(format!("--stages {stages}: the CNN has 3 layers")));
            }
            data_flags(
                "CNN",
                &[
                    ("text", is_text),
                    ("data-tokens", is_tokens),
                    ("hidden", config.hidden.is_some()),
                    ("classes", config.classes.is_some()),
                ],
            )?;
            data_flags("CNN", &transformer_flags)?;
            let images = match &config.data {
                Data::BuiltIn => Images::synthetic(config.seed),
                Data::Npy { x, y } => Images::from_npy(x, y, limit)?,
                _ => unreachable!("refused above"),
            };
            // The filters: from --init's convolutions (HWIO), the checkpoint's run, or
            // --filters; a flag that disagrees with the file or the checkpoint is refused.
            let from_file = match &file {
                Some(f) => {
                    let out = |name: &str| {
                        f.get(name).and_then(|t| match t.shape() {
                            &[3, 3, _, o] => Some(o),
                            _ => None,
                        })
                    };
                    match (out("conv1.weight"), out("conv2.weight")) {
                        (Some(f1), Some(f2)) => Some([f1, f2]),
                        _ => {
                            return Err(Error::flag(
                                "init",
                                "the CNN needs conv1.weight and conv2.weight of shape [3, 3, in, out]",
                            ));
                        }
                    }
                }
                None => None,
            };
            let from_saved = match &saved {
                Some(s) => s.filters()?,
                None => None,
            };
            let [f1, f2] = match config.filters {
                None => from_saved.or(from_file).unwrap_or([8, 16]),
                Some([f1, f2]) => {
                    for (whose, had) in
                        [("--init's convolutions", from_file), ("the checkpoint", from_saved)]
                    {
                        if let Some([g1, g2]) = had
                            && [g1, g2] != [f1, f2]
                        {
                            return Err(Error::flag(
                                "filters",
                                format!("{f1},{f2} disagrees with {whose}, which have {g1},{g2}"),
                            ));
                        }
                    }
                    [f1, f2]
                }
            };
            if f1 == 0 || f2 == 0 {
                return Err(usage(format!("--filters {f1},{f2}: each convolution needs a filter")));
            }
            let [n, h, w, c] = images.dims;
            let net = Cnn { image: [h, w, c], classes: images.classes, filters: [f1, f2] };
            if let Some(saved) = &saved
                && saved.image() != Some(serde_json::json!(net.image))
            {
                return Err(Error::flag(
                    "resume",
                    format!(
                        "the checkpoint's images are {}, the data's {:?}",
                        saved.image().unwrap_or_default(),
                        net.image
                    ),
                ));
            }
            let examples =
                Examples::Images { per: h * w * c, dims: vec![h, w, c], x: images.x, y: images.y };
            (Net::Cnn(net), examples, n)
        }
        ModelKind::Gpt2 => {
            data_flags(
                "GPT-2",
                &[
                    ("data-x", is_npy),
                    ("data-y", is_npy),
                    ("filters", config.filters.is_some()),
                    ("hidden", config.hidden.is_some()),
                    ("classes", config.classes.is_some()),
                ],
            )?;
            let (model, seq) = gpt2_sizes(config, hf.as_ref(), file.as_ref(), saved.as_ref())?;
            if let Layout::Mesh { model: m, .. } = layout
                && (!model.heads.is_multiple_of(m)
                    || !model.dim.is_multiple_of(m)
                    || !model.inner.is_multiple_of(m))
            {
                return Err(usage(format!(
                    "--mesh {data_axis}x{m}: the model axis must divide GPT-2's heads {}, width {} and MLP width {}",
                    model.heads, model.dim, model.inner
                )));
            }
            if stages > 1 {
                return Err(usage("--stages: GPT-2 trains on meshes, not in pipelines"));
            }
            let net = Net::Gpt2 { model, seq };
            memory(&net)?;
            let (n, tokens) = match &config.data {
                Data::BuiltIn => data::token_rows_synthetic(config.seed, model.vocab, seq),
                Data::Text(path) if config.tokenizer.is_some() => {
                    let tokenizer = config.tokenizer.as_deref().expect("checked");
                    let cache = config.cache_dir.as_deref();
                    let rows = crate::tokenize::token_rows(
                        path,
                        tokenizer,
                        model.vocab,
                        seq,
                        limit,
                        cache,
                    )?;
                    if let (Some(dir), None) = (cache, &rows.cached) {
                        cache_warning = Some(format!(
                            "--cache-dir {}: the encoded rows could not be cached there",
                            dir.display()
                        ));
                    }
                    (rows.n, rows.tokens)
                }
                Data::Text(path) => {
                    if model.vocab < 256 {
                        return Err(Error::flag(
                            "text",
                            format!(
                                "bytes are tokens 0..256; GPT-2's vocabulary here is {}",
                                model.vocab
                            ),
                        ));
                    }
                    data::token_rows_of_text(path, seq, limit)?
                }
                Data::Tokens(path) => data::token_rows_of_npy(path, model.vocab, seq, limit)?,
                Data::Npy { .. } => unreachable!("refused above"),
            };
            (net, Examples::Tokens { width: seq + 1, tokens }, n)
        }
        ModelKind::Transformer => {
            data_flags(
                "transformer",
                &[
                    ("data-x", is_npy),
                    ("data-y", is_npy),
                    ("filters", config.filters.is_some()),
                    ("hidden", config.hidden.is_some()),
                    ("classes", config.classes.is_some()),
                ],
            )?;
            if file.is_some() && config.heads.is_none() {
                return Err(heads_with_init());
            }
            let model = match &saved {
                Some(saved) => transformer_from_saved(config, saved)?,
                None => transformer_from_flags(config, file.as_ref())?,
            };
            if let Layout::Mesh { model: m, .. } = layout
                && (!model.heads.is_multiple_of(m) || !model.ffn.is_multiple_of(m))
            {
                return Err(usage(format!(
                    "--mesh {data_axis}x{m}: the model axis must divide --heads {} and --ffn {}",
                    model.heads, model.ffn
                )));
            }
            // Block i goes on stage ⌊i·K/L⌋ and the head on the last: up to L + 1 stages
            // leave none idle.
            if stages > model.layers.saturating_add(1) {
                return Err(usage(format!(
                    "--stages {stages}: the transformer's {} blocks and its head fill at most {} stages",
                    model.layers,
                    model.layers.saturating_add(1)
                )));
            }
            let net = Net::Transformer(model);
            memory(&net)?;
            let (n, tokens) = match &config.data {
                Data::BuiltIn => data::token_rows_synthetic(config.seed, model.vocab, model.seq),
                Data::Text(path) => {
                    if model.vocab != 256 {
                        return Err(Error::flag(
                            "text",
                            format!(
                                "bytes are tokens of a vocabulary of 256, not --vocab {}",
                                model.vocab
                            ),
                        ));
                    }
                    data::token_rows_of_text(path, model.seq, limit)?
                }
                Data::Tokens(path) => data::token_rows_of_npy(path, model.vocab, model.seq, limit)?,
                Data::Npy { .. } => unreachable!("refused above"),
            };
            (net, Examples::Tokens { width: model.seq + 1, tokens }, n)
        }
    };
    memory(&net)?;
    if let Some(f) = &file {
        check_init(&net, f, classification.as_ref())?;
    }
    // What a checkpoint records of the run, and what a resume compares.
    let mut meta = net.meta();
    meta["dtype"] = dtype.to_string().into();
    meta["optimizer"] = optimizer.describe().into();
    meta["clip_norm"] = serde_json::json!(config.clip_norm);
    if loss_scale.is_some() {
        // Its checkpoints carry the loss scale: resumed only by such a run.
        meta["loss_scale"] = true.into();
    }
    meta["batch"] = batch.into();
    meta["seed"] = config.seed.into();
    meta["shuffle"] = config.shuffle.into();
    meta["lr"] = lr.into();
    meta["warmup"] = config.warmup.into();
    meta["schedule"] = (if cosine { "cosine" } else { "constant" }).into();
    meta["cosine_steps"] = serde_json::json!(cosine.then_some(steps));
    let eval_every = config.eval_every.unwrap_or(0);
    if config.eval_every.is_some() && eval_every == 0 {
        return Err(usage("--eval-every must be at least 1 (a step count)"));
    }
    let fraction = config.eval_fraction.unwrap_or(0.1);
    if config.eval_fraction.is_some() && eval_every == 0 {
        return Err(usage("--eval-fraction needs --eval-every N"));
    }
    if !(fraction > 0.0 && fraction < 1.0) {
        return Err(usage(format!("--eval-fraction {fraction} is not between 0 and 1")));
    }
    meta["eval_fraction"] = serde_json::json!((eval_every > 0).then_some(fraction));
    meta["data"] = match &config.data {
        Data::BuiltIn => serde_json::json!([null, null, null]),
        Data::Tokens(p) => serde_json::json!([p, null, null]),
        Data::Text(p) => serde_json::json!([null, p, null]),
        Data::Npy { x, .. } => serde_json::json!([null, null, x]),
    };
    meta["rows"] = rows_all.into();
    meta["data_fingerprint"] = examples.fingerprint().into();
    let mut warnings: Vec<String> = cache_warning.into_iter().collect();
    if let Some(saved) = &saved {
        compare(saved, &meta, classification.as_ref(), &mut warnings)?;
    }
    let held = if eval_every > 0 { (fraction * rows_all as f64).ceil() as usize } else { 0 };
    let rows = rows_all - held.min(rows_all);
    if eval_every > 0 && (held < batch || rows == 0) {
        return Err(usage(format!(
            "--eval-fraction {fraction} of {rows_all} rows holds out {held}: need at least --batch {batch} held out and a row to train on"
        )));
    }
    // A checkpoint directory holding later steps than this run starts from would mix
    // two runs.
    let first = saved.as_ref().map_or(0, |s| s.step);
    if let Some(d) = &config.checkpoint_dir
        && d.is_dir()
        && let Ok((_, Some(latest))) = find_checkpoint(d)
        && latest > first
    {
        return Err(Error::flag(
            "checkpoint-dir",
            format!(
                "{} already holds checkpoints up to step {latest}, which this run (from step {first}) would not continue; resume from it with --resume, or give another directory",
                d.display()
            ),
        ));
    }
    // A resumed run's losses file holds every step's loss: the earlier steps' come from
    // the file the saved run wrote.
    let losses_before = match (&saved, &config.losses_json) {
        (Some(saved), Some(path)) if saved.step < steps => earlier_losses(saved, path)?,
        _ => Vec::new(),
    };
    let need = net.memory_estimate(batch, config.steps_per_run, dtype, layout, true, savers);
    let small = need.total() <= CHECK_BYTES;
    // On XLA (one device or a mesh), each step is checked against the interpreter on one
    // device.
    // Half-precision products round differently when split over devices: such runs
    // are checked only when asked (with a tolerance for it).
    let check = (devices > 1 || xla)
        && match config.check {
            Check::Never => false,
            Check::Always => true,
            Check::Auto => small && config.precision.is_none(),
        };
    Ok(Plan {
        net,
        layout,
        batch,
        steps,
        dtype,
        optimizer,
        lr,
        warmup: config.warmup,
        cosine,
        clip: config.clip_norm,
        seed: config.seed,
        shuffle: config.shuffle,
        steps_per_run: config.steps_per_run,
        eval_every,
        rows,
        held,
        examples,
        classification,
        init: file,
        shards,
        saved,
        meta,
        warnings,
        check,
        never_check: config.check == Check::Never,
        checkpoint_dir: config.checkpoint_dir.clone(),
        checkpoint_every: config.checkpoint_every.unwrap_or(0),
        keep,
        losses_json: config.losses_json.clone(),
        losses_before,
        metrics_jsonl: config.metrics_jsonl.clone(),
        plot: config.plot.clone(),
        export_hf: match (&config.export_hf, net) {
            (None, _) => None,
            (Some(dir), Net::Gpt2 { model, .. }) => Some((
                dir.clone(),
                hf_config.clone().unwrap_or_else(|| crate::hf::config_of(&model)),
            )),
            (Some(_), _) => unreachable!("refused before"),
        },
        savers,
        precision: config.precision,
        loss_scale,
        blocking: config.blocking.unwrap_or_else(|| blocking(&net, batch, dtype, xla)),
        xla: xla_backend(&config.backend, need.total(), devices)?,
    })
}

/// `--backend xla`'s back end: the plugin (`--pjrt-plugin` or `MESHWORK_PJRT_PLUGIN`)
/// loaded and a client made on it, before any long work; a missing or bad plugin is
/// a usage error naming the flag.
/// A run estimated to hold `need` bytes on the device is refused here when the
/// device reports less memory (a GPU's allocator does; the CPU plugin does not).
fn xla_backend(
    backend: &BackendKind,
    need: f64,
    devices: usize,
) -> Result<Option<std::sync::Arc<meshwork_strategy::backend::Xla>>> {
    use meshwork_strategy::xla::find;
    let BackendKind::Xla { plugin, partitioner } = backend else { return Ok(None) };
    let flag = if plugin.is_some() { "pjrt-plugin" } else { "backend" };
    let path = find::plugin_path(plugin.as_deref()).map_err(|e| Error::flag(flag, e))?;
    let plugin = find::load(&path).map_err(|e| Error::flag(flag, e))?;
    let xla = meshwork_strategy::backend::Xla::with_devices(&plugin, devices)
        .map_err(|e| Error::flag(flag, e))?
        .with_partitioner(*partitioner);
    let client = xla.session().client();
    let limit = client
        .device(0)
        .ok()
        .and_then(|d| client.memory_stats(d))
        .and_then(|m| m.bytes_limit.map(|l| (l - m.bytes_in_use).max(0)));
    if let Some(free) = limit
        && need > free as f64
    {
        return Err(Error::usage(format!(
            "--backend xla: the run would hold about {:.2} GB on the device, which has {:.2} GB free; give smaller sizes or --batch",
            need / 1e9,
            free as f64 / 1e9
        )));
    }
    Ok(Some(std::sync::Arc::new(xla)))
}

/// What a run keeps per step beside the model: each step's loss (8 bytes) and, with
/// `--losses-json`, its list and JSON text (about 40 more); per step of a host call, the
/// losses, the one-device check's and the learning rates in flight (48 bytes).
fn bookkeeping(config: &Config, steps: usize) -> f64 {
    let per_step = if config.losses_json.is_some() { 48.0 } else { 8.0 };
    per_step * steps as f64 + 48.0 * config.steps_per_run as f64
}

/// Refuses a run whose estimated memory (the model's, and its bookkeeping) `need` is
/// over `limit` (`--max-memory`).
fn check_memory(need: f64, limit: u64) -> Result<()> {
    if need > limit as f64 {
        return Err(memory_error(need, limit));
    }
    Ok(())
}

/// Queries per attention block on the interpreter (contexts up to it are not cut).
pub(crate) const QUERY_BLOCK: usize = 64;
/// Bytes of logits a loss chunk holds at most on the interpreter.
pub(crate) const LOSS_CHUNK_BYTES: usize = 16 << 20;

/// How GPT-2's attention and loss are cut on the interpreter: queries
/// [`QUERY_BLOCK`] at a time, and the loss in chunks of positions whose logits (of
/// the whole batch) hold at most [`LOSS_CHUNK_BYTES`]. XLA takes them whole (it fuses
/// and schedules them itself).
fn blocking(net: &Net, batch: usize, dtype: DType, xla: bool) -> meshwork_nn::Blocking {
    match net {
        Net::Gpt2 { model, seq } if !xla => {
            let row = batch.max(1) * model.vocab.max(1) * dtype.size_in_bytes();
            let chunk = (LOSS_CHUNK_BYTES / row).max(1);
            meshwork_nn::Blocking {
                query_block: if *seq > QUERY_BLOCK { QUERY_BLOCK } else { 0 },
                loss_chunk: if chunk < *seq { chunk } else { 0 },
            }
        }
        _ => meshwork_nn::Blocking::default(),
    }
}

/// `--grad-accum`, `--remat` and `--fsdp`, each checked against the layout and batch.
fn savers(config: &Config, layout: Layout, batch: usize) -> Result<Savers> {
    let micro = config.grad_accum.unwrap_or(1);
    if micro == 0 {
        return Err(usage("--grad-accum must be at least 1"));
    }
    let pipeline = matches!(layout, Layout::Pipeline { .. });
    for (flag, given) in [
        ("grad-accum", config.grad_accum.is_some()),
        ("remat", config.remat),
        ("fsdp", config.fsdp),
    ] {
        if given && pipeline {
            return Err(usage(format!(
                "--{flag} applies to a mesh's step; {} cuts its batch with --microbatches",
                layout.describe()
            )));
        }
    }
    if let Layout::Mesh { data, model } = layout
        && !batch.is_multiple_of(data.saturating_mul(micro))
    {
        return Err(usage(format!(
            "--batch {batch} does not split into --grad-accum {micro} micro-batches over the {data} data replicas of --mesh {data}x{model}"
        )));
    }
    if config.fsdp
        && matches!(config.backend, BackendKind::Xla { partitioner: Partitioner::Xla, .. })
    {
        return Err(usage(
            "--fsdp gathers weights where meshwork's partitioner reads them; with --partitioner xla it would not (drop one)",
        ));
    }
    if config.remat && !matches!(config.model, ModelKind::Transformer | ModelKind::Gpt2) {
        return Err(usage(format!(
            "--remat recomputes a transformer's blocks; the {} has none",
            config.model.name()
        )));
    }
    Ok(Savers { micro, remat: config.remat, fsdp: config.fsdp })
}

/// `--max-memory`'s refusal.
pub(crate) fn memory_error(need: f64, limit: u64) -> Error {
    usage(format!(
        "--max-memory: the run would hold about {:.2} GB, more than {:.2} GB; give smaller sizes, --batch, --steps or --steps-per-run, or a larger --max-memory",
        need / 1e9,
        limit as f64 / 1e9
    ))
}

/// The refusal of `--init` without `--heads`: the file does not say how many heads
/// the attention has.
pub(crate) fn heads_with_init() -> Error {
    Error::flag(
        "heads",
        "an --init file does not say how many heads its attention has; give --heads",
    )
}

/// The MLP's hidden units an `--init` file's w1 says, its four tensors checked against
/// the data: names, ranks and shapes.
fn mlp_init_hidden(f: &HashMap<String, Tensor>, data: &Classification) -> Result<usize> {
    let get = |name: &str, rank: usize| -> Result<Vec<usize>> {
        let t = f.get(name).ok_or_else(|| {
            Error::flag("init", format!("has no tensor {name:?} (want w1, b1, w2, b2)"))
        })?;
        if t.shape().len() != rank {
            return Err(Error::flag(
                "init",
                format!("{name} has shape {:?}; want rank {rank}", t.shape()),
            ));
        }
        Ok(t.shape().to_vec())
    };
    let (s1, sb1, s2, sb2) = (get("w1", 2)?, get("b1", 1)?, get("w2", 2)?, get("b2", 1)?);
    let hidden = s1[1];
    if hidden == 0 {
        return Err(Error::flag(
            "init",
            format!("w1 has shape {s1:?}; a model needs at least 1 hidden unit"),
        ));
    }
    let want = [
        ("w1", &s1, vec![data.features(), hidden]),
        ("b1", &sb1, vec![hidden]),
        ("w2", &s2, vec![hidden, data.classes]),
        ("b2", &sb2, vec![data.classes]),
    ];
    for (name, got, want) in want {
        if *got != want {
            return Err(Error::flag(
                "init",
                format!(
                    "{name} has shape {got:?}; the data ({} features, {} classes) needs {want:?}",
                    data.features(),
                    data.classes
                ),
            ));
        }
    }
    Ok(hidden)
}

/// Every weight the model has is in the `--init` file, of its shape.
fn check_init(net: &Net, f: &HashMap<String, Tensor>, data: Option<&Classification>) -> Result<()> {
    if let (Net::Mlp(_), Some(data)) = (net, data) {
        mlp_init_hidden(f, data)?;
    }
    let (program, _) = net.loss_program(1, DType::F64, Layout::Mesh { data: 1, model: 1 })?;
    for p in &program.params()[net.fed()..] {
        let t = f.get(&p.name).ok_or_else(|| Error::flag("init", format!("has no {}", p.name)))?;
        if t.shape() != p.spec.shape.dims() {
            return Err(Error::flag(
                "init",
                format!("{} is {:?}, the model's is {:?}", p.name, t.shape(), p.spec.shape.dims()),
            ));
        }
    }
    Ok(())
}

/// GPT-2's sizes and training context: from a resumed run's checkpoint, `--init`'s
/// `config.json`, or `--preset` (default `tiny`), each size flag (`--layers`, `--dim`,
/// `--heads`, `--ffn`, `--vocab`) overriding a preset's and refused where a file or
/// checkpoint fixes it; `--seq` the context (default the smaller of 64 and the
/// model's positions), at most the model's positions.
fn gpt2_sizes(
    config: &Config,
    hf: Option<&crate::hf::HfGpt2>,
    file: Option<&HashMap<String, Tensor>>,
    saved: Option<&Saved>,
) -> Result<(meshwork_nn::Gpt2, usize)> {
    let size_flags = [
        ("layers", config.layers),
        ("dim", config.dim),
        ("heads", config.heads),
        ("ffn", config.ffn),
        ("vocab", config.vocab),
    ];
    let fixed = |whose: &str| -> Result<()> {
        if let Some((flag, _)) = size_flags.iter().find(|(_, v)| v.is_some()) {
            return Err(usage(format!("--{flag}: GPT-2's sizes come from {whose}")));
        }
        if config.preset.is_some() {
            return Err(usage(format!("--preset: GPT-2's sizes come from {whose}")));
        }
        Ok(())
    };
    let model = if let Some(saved) = saved {
        fixed("the checkpoint --resume names")?;
        let m = &saved.meta;
        let size = |k: &str| saved.size(k);
        let model = meshwork_nn::Gpt2 {
            vocab: size("vocab")?,
            positions: size("positions")?,
            dim: size("dim")?,
            layers: size("layers")?,
            heads: size("heads")?,
            inner: size("inner")?,
            eps: m.get("eps").and_then(Value::as_f64).unwrap_or(1e-5),
        };
        if model.heads == 0 || !model.dim.is_multiple_of(model.heads) {
            return Err(Error::flag(
                "resume",
                format!(
                    "{} holds a GPT-2 whose heads do not divide its width",
                    saved.dir.display()
                ),
            ));
        }
        model
    } else if let Some(hf) = hf {
        fixed("--init's config.json")?;
        hf.model
    } else {
        if file.is_some() {
            return Err(Error::flag(
                "init",
                "GPT-2 reads a Hugging Face checkpoint folder (config.json and model.safetensors)",
            ));
        }
        let name = config.preset.as_deref().unwrap_or("tiny");
        let mut m = meshwork_nn::Gpt2::preset(name).ok_or_else(|| {
            Error::flag("preset", format!("{name}: the presets are tiny, gpt2 and gpt2-medium"))
        })?;
        for (flag, value) in size_flags {
            match value {
                Some(0) => return Err(Error::flag(flag, "must be at least 1")),
                Some(v) if v > 1 << 24 => {
                    return Err(Error::flag(flag, format!("{v} is beyond 2^24")));
                }
                Some(v) => match flag {
                    "layers" => m.layers = v,
                    "dim" => m.dim = v,
                    "heads" => m.heads = v,
                    "ffn" => m.inner = v,
                    _ => m.vocab = v,
                },
                None => {}
            }
        }
        // A new width without --ffn keeps GPT-2's MLP of 4 × width.
        if config.dim.is_some() && config.ffn.is_none() {
            m.inner = 4 * m.dim;
        }
        if !m.dim.is_multiple_of(m.heads) {
            return Err(usage(format!("--heads {} does not divide --dim {}", m.heads, m.dim)));
        }
        if m.layers > 1 << 12 {
            return Err(Error::flag("layers", format!("{} is beyond 4096", m.layers)));
        }
        m
    };
    let seq = match (config.seq, saved) {
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
        (None, None) => model.positions.min(64),
    };
    if seq == 0 || seq > model.positions {
        return Err(Error::flag(
            "seq",
            format!("{seq}: GPT-2's context is 1 to its {} positions", model.positions),
        ));
    }
    Ok((model, seq))
}

/// The transformer's sizes from the flags, or from `--init`'s tensors (a flag that
/// disagrees is an error naming both).
pub(crate) fn transformer_from_flags(
    config: &Config,
    init: Option<&HashMap<String, Tensor>>,
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

/// Compares this run with the checkpoint's: the model's optimizer must be the same
/// (its state is saved); what may legitimately change (the learning rate and its
/// schedule, the batch, clipping, the seed and shuffling, the held-out fraction, the
/// data) is warned about, one line each.
fn compare(
    saved: &Saved,
    meta: &Value,
    classification: Option<&Classification>,
    warnings: &mut Vec<String>,
) -> Result<()> {
    let dir = saved.dir.display();
    let theirs = &saved.meta;
    if let Some(o) = theirs.get("optimizer")
        && *o != meta["optimizer"]
    {
        return Err(Error::flag(
            "resume",
            format!(
                "{dir} was saved by a run with optimizer {o}; this one has {} (its state cannot carry over)",
                meta["optimizer"]
            ),
        ));
    }
    for (key, flag) in [
        ("lr", "--lr"),
        ("batch", "--batch"),
        ("warmup", "--warmup"),
        ("schedule", "--schedule"),
        ("cosine_steps", "--steps (the cosine schedule's length)"),
        ("clip_norm", "--clip-norm"),
        ("seed", "--seed"),
        ("shuffle", "--shuffle"),
        ("eval_fraction", "--eval-fraction"),
    ] {
        if let Some(v) = theirs.get(key)
            && *v != meta[key]
        {
            warnings.push(format!(
                "{flag} {} differs from the checkpoint's {v} ({dir}); continuing with {}",
                meta[key], meta[key]
            ));
        }
    }
    let scaled = |m: &Value| m.get("loss_scale").is_some_and(|v| *v == Value::Bool(true));
    if scaled(theirs) != scaled(meta) {
        return Err(Error::flag(
            "resume",
            format!(
                "{dir} was saved by a run {} loss scaling and this one {} (--precision f16 scales the loss; resume with the same --precision)",
                if scaled(theirs) { "with" } else { "without" },
                if scaled(meta) { "scales it" } else { "does not" },
            ),
        ));
    }
    let other_data = match saved.origin {
        Origin::Trainer => {
            theirs.get("data_fingerprint").is_some_and(|f| *f != meta["data_fingerprint"])
                || theirs.get("rows").is_some_and(|r| *r != meta["rows"])
        }
        Origin::MainJob => {
            let fp = classification.map(Classification::fingerprint);
            theirs.get("main_job_fingerprint").and_then(Value::as_u64) != fp.map(u64::from)
        }
        Origin::Bare => false,
    };
    if other_data {
        warnings.push(format!(
            "the data differ from the data the checkpoint was trained on ({} rows then, {} now)",
            theirs.get("rows").map_or("?".into(), |r| r.to_string()),
            meta["rows"]
        ));
    }
    Ok(())
}

/// The losses of the steps before a resumed run: the first `step` of the losses list
/// at `path` (the file the saved run wrote). A file that does not hold them is
/// refused, saying why: the file would otherwise hold only the resumed steps.
fn earlier_losses(saved: &Saved, path: &Path) -> Result<Vec<Option<f64>>> {
    let step = saved.step;
    if step == 0 {
        return Ok(Vec::new());
    }
    let why = "a resumed run writes every step's loss into --losses-json";
    if !path.exists() {
        return Err(Error::flag(
            "losses-json",
            format!(
                "{} does not exist, and {why}: give the losses file of the run that saved the checkpoint (it holds the first {step} steps)",
                path.display()
            ),
        ));
    }
    let losses = read_losses("losses-json", path)?;
    if losses.len() < step {
        return Err(Error::flag(
            "losses-json",
            format!(
                "{} holds {} losses, and {why}: the checkpoint is at step {step}; give the losses file of the run that saved it",
                path.display(),
                losses.len()
            ),
        ));
    }
    Ok(losses[..step].to_vec())
}
