//! From a run's settings to what it will do: every setting checked (alone, against the
//! others, against the data, the initial weights and a resumed checkpoint) and the
//! memory the run will hold estimated — all before anything is written or allocated
//! by size. A refusal is one line naming the flag. The model and its rows come from
//! its family ([`crate::family`]); nothing here asks which model it is.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use meshwork_checkpoint::find_checkpoint;
use meshwork_nn::Optimizer;
use meshwork_types::{DType, Tensor};
use serde_json::Value;

use crate::config::{BackendKind, Check, Config, Data, OptimizerKind, Partitioner, Schedule};
use crate::data::{Classification, Examples};
use crate::family::{self, Ctx, Defaults, Family, Init};
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
    pub(crate) schedule: Schedule,
    /// `--min-lr`: a decay's end, reached at the last step.
    pub(crate) min_lr: Option<f64>,
    /// The optimizer and schedule are the fine-tuning defaults ([`FINE_TUNE_LR`]).
    pub(crate) fine_tune: bool,
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
    /// A language model's Hugging Face `config.json` and `generation_config.json`
    /// (from its folder, preset or checkpoint): what `--export-hf` writes.
    pub(crate) hf: Option<(Value, Option<Value>)>,
    /// `--export-hf`'s folder.
    pub(crate) export_hf: Option<PathBuf>,
    /// The tokenizer files `--export-hf` copies into its folder (name, bytes): the
    /// run's tokenizer, else its model folder's.
    pub(crate) tokenizer_files: Vec<(String, Vec<u8>)>,
    /// `--export-lora`'s folder.
    pub(crate) export_lora: Option<PathBuf>,
    /// A LoRA adapter's initial values (by name; empty without one), set over the
    /// base's.
    pub(crate) adapter: HashMap<String, Tensor>,
    /// `--grad-accum`, `--remat`, `--fsdp`.
    pub(crate) savers: Savers,
    /// `--precision` (`None`: full).
    pub(crate) precision: Option<DType>,
    /// f16's dynamic loss scaling.
    pub(crate) loss_scale: Option<meshwork_nn::LossScale>,
    /// A language model's attention and loss in pieces (on the interpreter).
    pub(crate) blocking: meshwork_nn::Blocking,
    /// The back end (`--backend`, `--target`): made before any long work.
    pub(crate) backend: crate::backend::Chosen,
    /// Why attention lowers plainly on a back end that could run it through cuDNN.
    pub(crate) attention_note: Option<String>,
    /// The processes the mesh spreads over (`None`: this one alone).
    pub(crate) processes: Option<crate::Processes>,
    /// Across processes: the batch slots this one trains on (its rows alone are read).
    pub(crate) slots: Option<Vec<usize>>,
}

fn usage(message: impl Into<String>) -> Error {
    Error::usage(message)
}

/// `DxM` as given.
fn mesh_text((d, m): (usize, usize)) -> String {
    format!("{d}x{m}")
}

impl Plan {
    /// The run's initial weights: `--init`'s (taken from the plan), or the model's
    /// random ones from the run's seed.
    pub(crate) fn take_init(&mut self) -> Result<HashMap<String, Tensor>> {
        // A LoRA adapter's values over the base's.
        let adapter = std::mem::take(&mut self.adapter);
        let mut init = if self.shards.is_some() {
            // Read as they are placed ([`Plan::shards`]).
            HashMap::new()
        } else {
            match self.init.take() {
                Some(file) => file,
                None => self.net.random_init(self.seed)?,
            }
        };
        init.extend(adapter);
        Ok(init)
    }

    /// A strategy of the layout's devices on the run's back end.
    pub(crate) fn strategy(&self) -> Result<meshwork_strategy::Strategy> {
        self.backend.strategy(self.layout.devices(), self.processes.as_ref())
    }

    /// Whether this process writes the run's outputs and reports (process 0, or the
    /// only one).
    pub(crate) fn leads(&self) -> bool {
        self.processes.as_ref().is_none_or(crate::Processes::leads)
    }
}

/// Where a run's steps run: the layout and its devices.
struct Placement {
    layout: Layout,
    mesh: (usize, usize),
    stages: usize,
    devices: usize,
    xla: bool,
}

/// `--mesh`, `--stages` and `--microbatches`, checked alone and together.
fn placement(config: &Config, defaults: &Defaults) -> Result<Placement> {
    let xla = config.backend.is_xla();
    let default_mesh = if xla { (1, 1) } else { defaults.mesh };
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
    if stages > 1 && config.backend.partitioner() == Partitioner::Xla {
        return Err(usage(format!(
            "--partitioner xla splits SPMD meshes; {} is placed stage by stage (drop --partitioner xla)",
            layout.describe()
        )));
    }
    Ok(Placement { layout, mesh: (data_axis, model_axis), stages, devices, xla })
}

/// How much a run does and how: steps, batch, optimizer, learning rate, precision.
struct Settings {
    steps: usize,
    batch: usize,
    savers: Savers,
    optimizer: Optimizer,
    lr: f64,
    loss_scale: Option<meshwork_nn::LossScale>,
    schedule: Schedule,
    fine_tune: bool,
}

/// The learning rate of a fine-tune's defaults (Hugging Face `Trainer`'s: AdamW
/// without weight decay, this rate, a linear decay to 0), taken when `--init` is a
/// pretrained folder and no optimizer setting is given.
pub(crate) const FINE_TUNE_LR: f64 = 5e-5;

/// `--steps`, `--batch`, the savers, the optimizer and its settings, `--lr`,
/// `--schedule`, `--min-lr`, `--dtype`, `--steps-per-run`, `--precision`,
/// `--loss-scale-init` and `--clip-norm`, each at the family's default where not
/// given — or, for a `pretrained` folder given no optimizer setting (`--optimizer`,
/// `--lr`, `--schedule`, `--weight-decay`, `--beta1`, `--beta2`, `--eps`,
/// `--no-decay-1d`), at a fine-tune's ([`FINE_TUNE_LR`]).
fn settings(config: &Config, f: &dyn Family, p: &Placement, pretrained: bool) -> Result<Settings> {
    let defaults = f.defaults();
    // With --epochs, the steps are known once the rows are (`epoch_steps`).
    let steps = match (config.steps, config.epochs) {
        (Some(_), Some(_)) => return Err(usage("give --steps or --epochs, not both")),
        (None, Some(0)) => return Err(usage("--epochs must be at least 1")),
        (None, Some(_)) if config.processes.as_ref().is_some_and(|p| p.count() > 1) => {
            return Err(usage("--epochs: a run spread over processes takes --steps"));
        }
        (None, Some(_)) => 1,
        (s, None) => s.unwrap_or(defaults.steps),
    };
    let batch = config.batch.unwrap_or(defaults.batch);
    if steps == 0 {
        return Err(usage("--steps must be at least 1"));
    }
    if batch == 0 {
        return Err(usage("--batch must be at least 1"));
    }
    if steps > MAX_STEPS {
        return Err(usage(format!("--steps {steps} is more than {MAX_STEPS}")));
    }
    let (data_axis, model_axis) = p.mesh;
    match p.layout {
        Layout::Mesh { .. } if !batch.is_multiple_of(data_axis) => {
            return Err(usage(format!(
                "--batch {batch} does not split over the {data_axis} data replicas of --mesh {data_axis}x{model_axis}"
            )));
        }
        Layout::Pipeline { micro, .. }
            if !batch.is_multiple_of(data_axis.saturating_mul(micro)) =>
        {
            return Err(usage(format!(
                "--batch {batch} does not split into {data_axis} replicas × {micro} micro-batches"
            )));
        }
        _ => {}
    }
    let savers = savers(config, p.layout, batch, f.blocks(), f.name())?;
    // (A resumed run keeps its own: recorded in its checkpoint, or given again.)
    let fine_tune = pretrained
        && config.resume.is_none()
        && config.optimizer.is_none()
        && config.lr.is_none()
        && config.schedule.is_none()
        && config.optimizer_settings == crate::OptimizerSettings::default();
    let (optimizer_kind, optimizer_settings) = if fine_tune {
        let none = crate::OptimizerSettings { weight_decay: Some(0.0), ..Default::default() };
        (OptimizerKind::AdamW, none)
    } else {
        (config.optimizer.unwrap_or(defaults.optimizer), config.optimizer_settings)
    };
    let optimizer = optimizer_kind.with(&optimizer_settings)?;
    let adam = matches!(optimizer_kind, OptimizerKind::Adam | OptimizerKind::AdamW);
    let lr = match config.lr {
        Some(lr) => lr,
        None if fine_tune => FINE_TUNE_LR,
        None if adam => defaults.lr.1,
        None => defaults.lr.0,
    };
    if !(lr.is_finite() && lr > 0.0) {
        return Err(usage(format!("--lr {} must be a positive number", number_text(lr))));
    }
    let schedule = match config.schedule {
        Some(s) => s,
        None if fine_tune => Schedule::Linear,
        None => Schedule::Constant,
    };
    if let Some(m) = config.min_lr {
        if schedule == Schedule::Constant {
            return Err(usage("--min-lr is where a decay ends: give --schedule linear or cosine"));
        }
        if !(m.is_finite() && (0.0..=lr).contains(&m)) {
            return Err(usage(format!(
                "--min-lr {} must be a number from 0 to --lr ({})",
                number_text(m),
                number_text(lr)
            )));
        }
    }
    if let Some(d) = config.dtype
        && !matches!(d, DType::F32 | DType::F64)
    {
        return Err(usage(format!("--dtype {d} is not f32 or f64")));
    }
    if let Some(d) = config.base_dtype
        && d != DType::BF16
    {
        return Err(usage(format!(
            "--base-dtype {d}: a LoRA run's frozen base is held in bf16 (or, without the flag, in --dtype)"
        )));
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
            if p.stages > 1 {
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
    Ok(Settings { steps, batch, savers, optimizer, lr, loss_scale, schedule, fine_tune })
}

/// The outputs: known writable before any work, each its own path, nothing of the
/// user's replaced, nothing written inside the export folder.
fn check_outputs(config: &Config, f: &dyn Family, lora_run: bool) -> Result<()> {
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
        if !f.hf_layout() {
            return Err(usage(format!(
                "--export-hf writes a Hugging Face folder (GPT-2, the Llama family); the model is {}",
                f.name()
            )));
        }
        crate::hf::check_export("export-hf", dir)?;
    }
    if let Some(dir) = &config.export_lora {
        if !lora_run {
            return Err(Error::flag(
                "export-lora",
                "writes a LoRA run's adapter; give the adapter (--lora-r, --lora-targets or --lora-init)",
            ));
        }
        crate::hf::check_export("export-lora", dir)?;
    }
    let outputs: Vec<(&str, &Path)> = [
        ("export-hf", config.export_hf.as_deref()),
        ("export-lora", config.export_lora.as_deref()),
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
    for (flag, dir) in [("export-hf", &config.export_hf), ("export-lora", &config.export_lora)] {
        let Some(dir) = dir else { continue };
        let full = |q: &Path| std::path::absolute(q).unwrap_or_else(|_| q.to_path_buf());
        if let Some((f, p)) =
            outputs.iter().filter(|(f, _)| *f != flag).find(|(_, p)| full(p).starts_with(full(dir)))
        {
            return Err(Error::flag(
                f,
                format!(
                    "{} is inside --{flag} {}; give it a path outside",
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
    if let Some(p) = &config.plot
        && !p.extension().is_some_and(|e| e.eq_ignore_ascii_case("svg"))
    {
        return Err(Error::flag(
            "plot",
            format!("{}: the plot is SVG; give a name ending .svg", p.display()),
        ));
    }
    Ok(())
}

/// `--checkpoint-every`, `--keep` and `--checkpoint-dir`'s kind; `--keep`.
fn check_checkpoints(config: &Config) -> Result<usize> {
    for (flag, given) in
        [("checkpoint-every", config.checkpoint_every.is_some()), ("keep", config.keep.is_some())]
    {
        if given && config.checkpoint_dir.is_none() {
            return Err(usage(format!("--{flag} needs --checkpoint-dir")));
        }
    }
    if config.checkpoint_every == Some(0) {
        return Err(usage(
            "--checkpoint-every must be at least 1 (a step count); without it a run saves at its end",
        ));
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
    Ok(keep)
}

/// What names the weights: `--init` (a file's tensors, or a Hugging Face folder's
/// `config.json`, its weights indexed later) and `--resume`'s checkpoint; refused
/// together.
///
/// A LoRA run is the exception: its checkpoints hold the adapter, its settings and its
/// optimizer state, not the base, so it resumes with `--init` (the base) and
/// `--resume` (the adapter) together.
fn weights_from(config: &Config) -> Result<(Init, Option<Saved>)> {
    let lora = config.lora.as_ref();
    if config.resume.is_some() && lora.is_some_and(|l| l.init.is_some()) {
        return Err(usage(
            "--lora-init and --resume both set the adapter; give one (a resumed LoRA run takes its adapter from the checkpoint)",
        ));
    }
    let both = || {
        usage(
            "--init and --resume both set the weights; give one (a resumed run takes its weights from the checkpoint; a LoRA run's, its adapter, with the base as --init)",
        )
    };
    let saved = match config.resume.as_deref().map(Saved::read).transpose() {
        Ok(saved) => saved,
        // Both given for a run that is not LoRA: that is what is wrong.
        Err(_) if config.init.is_some() && lora.is_none() => return Err(both()),
        Err(e) => return Err(e),
    };
    if let Some(saved) = &saved {
        let saved_lora = saved.meta.get("lora").is_some_and(|l| !l.is_null());
        if config.init.is_some() && !saved_lora {
            return Err(both());
        }
        if saved_lora && config.init.is_none() {
            return Err(Error::flag(
                "resume",
                format!(
                    "{} is a LoRA run's checkpoint (the adapter, not its base): give the base as --init",
                    saved.dir.display()
                ),
            ));
        }
        if !saved_lora && lora.is_some() {
            return Err(Error::flag(
                "resume",
                format!(
                    "{} is not a LoRA run's checkpoint; --lora flags start a new adapter",
                    saved.dir.display()
                ),
            ));
        }
    }
    let init = match config.init.as_deref() {
        Some(p) if p.is_dir() && p.join("config.json").exists() => {
            Init::Folder { dir: p.to_path_buf(), config: crate::hf::read_config("init", p)? }
        }
        _ => Init::None,
    };
    Ok((init, saved))
}

/// The data flags' combinations any family refuses.
fn check_data_flags(config: &Config, init: &Init) -> Result<()> {
    let folder = matches!(init, Init::Folder { .. });
    if config.cache_dir.is_some() && config.tokenizer.is_none() && !folder {
        return Err(usage("--cache-dir caches --text encoded by --tokenizer; give one"));
    }
    let texts = |d: &Data| matches!(d, Data::Text(_) | Data::Jsonl { .. } | Data::Documents { .. });
    if config.tokenizer.is_some()
        && !texts(&config.data)
        && !config.eval_data.as_ref().is_some_and(texts)
    {
        return Err(usage("--tokenizer encodes --text FILE (or --data-jsonl FILE); give one"));
    }
    Ok(())
}

/// The run's dtype: `--dtype`, or a resumed checkpoint's (which `--dtype` must match),
/// or the family's.
fn dtype_of(config: &Config, saved: Option<&Saved>, default: DType) -> Result<DType> {
    let mut dtype = config.dtype.unwrap_or(default);
    if let Some(saved) = saved
        && let Some(theirs) = saved.dtype()?
    {
        match config.dtype {
            Some(d) if d != theirs => {
                return Err(Error::flag(
                    "resume",
                    format!("{} was trained in {theirs}; --dtype is {d}", saved.dir.display()),
                ));
            }
            _ => dtype = theirs,
        }
    }
    Ok(dtype)
}

/// The run `config` asks for: with `--resume`, what it leaves unset taken from the
/// resumed run's recorded flags ([`crate::resume::remembered`]), a note for each flag
/// given that differs.
pub(crate) fn plan(config: &Config) -> Result<Plan> {
    plan_for(config, Purpose::Train)
}

/// [`plan`] for a run that only needs its weights (`export`, `generate` from a
/// checkpoint): a resumed checkpoint's data are neither read nor required, and the
/// built-in rows stand in for them.
pub(crate) fn plan_weights(config: &Config) -> Result<Plan> {
    plan_for(config, Purpose::Weights)
}

/// [`plan`] for `evaluate`: a resumed checkpoint's data are taken as they are now
/// (a changed file is evaluated, not refused), and what only training does — its
/// held-out rows, validation set, epochs, checkpoints — is not taken from it.
pub(crate) fn plan_evaluation(config: &Config) -> Result<Plan> {
    plan_for(config, Purpose::Evaluate)
}

/// What a plan is for: what a resumed checkpoint's recorded flags give it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Purpose {
    /// Training: every flag the run was given.
    Train,
    /// An evaluation of every row of the data: the data, not the training's outputs.
    Evaluate,
    /// The weights alone: not the data.
    Weights,
}

fn plan_for(config: &Config, purpose: Purpose) -> Result<Plan> {
    let data = purpose != Purpose::Weights;
    // A checkpoint that cannot be read is `weights_from`'s to refuse, saying why.
    let saved = config.resume.as_deref().and_then(|r| Saved::read(r).ok());
    let flags = saved
        .as_ref()
        .filter(|s| s.origin == Origin::Trainer)
        .and_then(|s| s.meta.get("flags").map(|f| (s, f)));
    let (mut config, notes) = match flags {
        Some((saved, flags)) => {
            let lora = saved.meta.get("lora").is_some_and(|l| !l.is_null());
            crate::resume::remembered(config, &saved.dir, flags, lora, purpose)?
        }
        None => (config.clone(), Vec::new()),
    };
    // The tokenizer the run used, else its model folder's.
    let tokenizer = crate::resume::tokenizer_used(
        config.tokenizer.clone(),
        config.init.as_deref(),
        flags.map(|(_, f)| f),
    );
    drop(saved);
    if !data {
        config.data = Data::BuiltIn;
        config.tokenizer = None;
        config.cache_dir = None;
    }
    if purpose != Purpose::Train {
        config.eval_every = None;
        config.eval_fraction = None;
        config.eval_data = None;
        config.epochs = None;
        config.checkpoint_dir = None;
        config.checkpoint_every = None;
        config.keep = None;
    }
    let mut p = plan_of(&config)?;
    p.warnings.splice(0..0, notes);
    if p.export_hf.is_some()
        && p.leads()
        && let Some(path) = tokenizer
    {
        match crate::hf::tokenizer_files(&path) {
            Ok(files) => p.tokenizer_files = files,
            Err(e) => p.warnings.push(format!("--export-hf will hold no tokenizer: {e}")),
        }
    }
    Ok(p)
}

fn plan_of(config: &Config) -> Result<Plan> {
    let limit = config.max_memory;
    let (init, saved) = weights_from(config)?;
    let family = family::choose(config, &init, saved.as_ref().map(Saved::model))?;
    if let Some(saved) = &saved {
        saved.check_model(family.name())?;
    }
    let place = placement(config, &family.defaults())?;
    let local_devices = spread(config, &place)?;
    let mut run = settings(config, family, &place, matches!(init, Init::Folder { .. }))?;
    // The outputs are process 0's to write (its file system's paths).
    if config.processes.as_ref().is_none_or(crate::Processes::leads) {
        let saved_lora =
            saved.as_ref().is_some_and(|s| s.meta.get("lora").is_some_and(|l| !l.is_null()));
        check_outputs(config, family, config.lora.is_some() || saved_lora)?;
    }
    let keep = check_checkpoints(config)?;
    // A safetensors file's weights (a folder is the family's to index).
    let mut init = match (init, config.init.as_deref()) {
        // Across processes, indexed: each process reads the boxes its devices hold.
        (Init::None, Some(p)) if config.processes.as_ref().is_some_and(|q| q.count() > 1) => {
            Init::File(init::InitFile::indexed(p)?)
        }
        (Init::None, Some(p)) => Init::File(init::InitFile::read(p, limit)?),
        (init, _) => init,
    };
    check_data_flags(config, &init)?;
    let dtype = dtype_of(config, saved.as_ref(), family.defaults().dtype)?;
    // The model's memory and the run's bookkeeping against --max-memory (checked before
    // a model's rows are read, and again once its data are known), the one-device
    // check's copy counted unless the check can never run.
    let targeted = matches!(config.backend, BackendKind::XlaTarget { .. });
    let spread_over = config.processes.as_ref().filter(|p| p.count() > 1);
    let checkable = config.check != Check::Never
        && (place.devices > 1 || place.xla)
        && !targeted
        && spread_over.is_none();
    // Spread over processes, each holds its own positions' share of the state (and
    // its host calls' batches whole).
    let spread_share = spread_over.map_or(1.0, |p| p.count() as f64);
    // (With --epochs, of one step: a step's bookkeeping is a few bytes.)
    let bookkept = bookkeeping(config, run.steps);
    let need_with = |net: &Net, savers: Savers, check: bool| {
        let need = net.memory_estimate(
            run.batch,
            config.steps_per_run,
            dtype,
            place.layout,
            check,
            savers,
        );
        (need.weights + need.activations) / spread_share + need.feeds + bookkept
    };
    let memory = |net: &Net| {
        // A target's devices are not this machine's: XLA's compile judges their
        // memory (`inspect --target`), not --max-memory.
        if targeted {
            return Ok(());
        }
        let need = need_with(net, run.savers, checkable);
        if need <= limit as f64 {
            return Ok(());
        }
        // What would bring it within the limit, each alone, then together.
        let mut tries: Vec<(String, Savers, bool)> = Vec::new();
        if let Layout::Mesh { data, .. } = place.layout {
            let s = run.savers;
            if checkable {
                tries.push(("--no-check".into(), s, false));
            }
            let mut all = s;
            if !s.remat && family.blocks() {
                tries.push(("--remat".into(), Savers { remat: true, ..s }, checkable));
                all.remat = true;
            }
            if !s.fsdp && data > 1 && config.backend.partitioner() == Partitioner::Meshwork {
                tries.push(("--fsdp".into(), Savers { fsdp: true, ..s }, checkable));
                all.fsdp = true;
            }
            // The fewest micro-batches that fit (a power of two, up to 1024).
            let per = data.saturating_mul(s.micro).max(1);
            let accum = (1..=10)
                .map(|e| 1usize << e)
                .filter(|&k| k <= run.batch / per && run.batch.is_multiple_of(per * k))
                .map(|k| Savers { micro: s.micro * k, ..s })
                .find(|m| need_with(net, *m, checkable) <= limit as f64);
            if let Some(m) = accum {
                tries.push((format!("--grad-accum {}", m.micro), m, checkable));
            }
            if all != s {
                let names = [("--remat", all.remat && !s.remat), ("--fsdp", all.fsdp && !s.fsdp)];
                let named: Vec<&str> =
                    names.iter().filter(|(_, on)| *on).map(|(n, _)| *n).collect();
                if named.len() > 1 {
                    tries.push((named.join(" "), all, checkable));
                }
            }
        }
        let fits: Vec<(String, f64)> = tries
            .into_iter()
            .map(|(flags, savers, check)| (flags, need_with(net, savers, check)))
            .filter(|(_, n)| *n <= limit as f64)
            .collect();
        Err(memory_error(need, limit, &fits))
    };
    // Spread over processes, each reads only the rows its positions train on.
    let share = config.processes.as_ref().filter(|p| p.count() > 1 && place.stages == 1).map(|p| {
        crate::processes::Share {
            processes: p.clone(),
            slots: p.slots(place.mesh, run.batch, run.savers.micro),
            batch: run.batch,
            steps: saved.as_ref().map_or(0, |s| s.step)..run.steps,
            shuffle: config.shuffle.then_some(config.seed),
            held_out: config
                .eval_every
                .filter(|&e| e > 0)
                .map(|_| config.eval_fraction.unwrap_or(0.1)),
        }
    });
    let ctx = Ctx {
        config,
        mesh: place.mesh,
        stages: place.stages,
        limit,
        init: &init,
        saved: saved.as_ref(),
        memory: &memory,
        share: share.as_ref(),
    };
    let resolved = family.resolve(&ctx)?;
    if config.eval_data.is_some() && resolved.eval_rows.is_none() {
        return Err(Error::flag(
            "eval-data",
            format!(
                "is a language model's validation set; the {} evaluates held-out rows (--eval-fraction)",
                family.name()
            ),
        ));
    }
    let net = resolved.net;
    if let Some(f) = init.file() {
        family::check_init(&net, f)?;
    }
    // A LoRA adapter over the base, the base frozen (a resumed LoRA run's settings
    // from its checkpoint).
    let saved_lora = saved.as_ref().and_then(|s| s.meta.get("lora")).filter(|l| !l.is_null());
    let settings = config.lora.clone().or_else(|| saved_lora.map(|_| Default::default()));
    let (net, adapter) = match &settings {
        Some(settings) => {
            if place.stages > 1 {
                return Err(usage("--stages: a LoRA adapter trains on meshes, not in pipelines"));
            }
            let (net, adapter) =
                crate::lora::attach(net, settings, saved_lora, config.seed, limit)?;
            // The base in bf16 (nothing to do where --dtype is bf16 already).
            let base = config.base_dtype.filter(|&d| d != dtype);
            (net.with_base_dtype(base), adapter)
        }
        None if config.base_dtype.is_some() => {
            return Err(usage(
                "--base-dtype holds a LoRA run's frozen base; give an adapter (--lora-r, --lora-targets or --lora-init)",
            ));
        }
        None => (net, HashMap::new()),
    };
    if let Some(epochs) = config.epochs {
        run.steps = epoch_steps(config, epochs, run.batch, (resolved.rows, resolved.eval_rows))?;
    }
    memory(&net)?;
    let rows = (resolved.rows, resolved.eval_rows);
    let mut record = record(config, &net, &run, dtype, &resolved.examples, rows)?;
    // What identifies a LoRA run's base (its adapter is trained over it): the stored
    // tensors' fingerprint, when the base comes from a file or folder.
    if settings.is_some() {
        let base = match (&init, &config.init) {
            (Init::File(_), Some(path)) => {
                Some(crate::hf::HfShards::of_file("init", path)?.fingerprint()?)
            }
            (Init::Folder { .. }, _) => {
                resolved.shards.as_ref().map(crate::hf::HfShards::fingerprint).transpose()?
            }
            _ => None,
        };
        record.meta["lora_base"] = serde_json::json!(base.map(|c| format!("crc32c:{c:08x}")));
    }
    // What an export after a resumed run writes again.
    if let Some(c) = &resolved.hf_config {
        record.meta["hf_config"] = c.clone();
    }
    if let Some(g) = &resolved.generation_config {
        record.meta["generation_config"] = g.clone();
    }
    let mut warnings = resolved.warnings;
    if let Some(saved) = &saved {
        compare(saved, &record.meta, resolved.classification.as_ref(), &mut warnings)?;
    }
    let first = saved.as_ref().map_or(0, |s| s.step);
    check_checkpoint_dir(config, first)?;
    // A resumed run's losses file holds every step's loss: the earlier steps' come from
    // the file the saved run wrote.
    // (Process 0's file: the others write no losses.)
    let leads = config.processes.as_ref().is_none_or(crate::Processes::leads);
    let losses_before = match (&saved, &config.losses_json) {
        (Some(saved), Some(path)) if saved.step < run.steps && leads => {
            earlier_losses(saved, path)?
        }
        _ => Vec::new(),
    };
    let need = net.memory_estimate(
        run.batch,
        config.steps_per_run,
        dtype,
        place.layout,
        checkable,
        run.savers,
    );
    // On XLA (one device or a mesh), each step is checked against the interpreter on one
    // device. Half-precision products round differently when split over devices: such
    // runs are checked only when asked (with a tolerance for it).
    let check = (place.devices > 1 || place.xla)
        && !targeted
        && spread_over.is_none()
        && match config.check {
            Check::Never => false,
            Check::Always => true,
            Check::Auto => need.total() <= CHECK_BYTES && config.precision.is_none(),
        };
    let backend = crate::backend::make(&config.backend, local_devices)?;
    let (fused, attention_note) = attention(config, &net, &backend, dtype)?;
    Ok(Plan {
        layout: place.layout,
        batch: run.batch,
        steps: run.steps,
        dtype,
        optimizer: run.optimizer,
        lr: run.lr,
        warmup: config.warmup,
        schedule: run.schedule,
        min_lr: config.min_lr,
        fine_tune: run.fine_tune,
        clip: config.clip_norm,
        seed: config.seed,
        shuffle: config.shuffle,
        steps_per_run: config.steps_per_run,
        eval_every: record.eval_every,
        rows: record.rows,
        held: record.held,
        examples: resolved.examples,
        classification: resolved.classification,
        init: match &mut init {
            Init::File(f) => f.values.take(),
            _ => None,
        },
        shards: match init {
            Init::File(f) => f.boxes.or(resolved.shards),
            _ => resolved.shards,
        },
        saved,
        meta: record.meta,
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
        export_lora: config.export_lora.clone(),
        adapter,
        hf: resolved.hf_config.map(|c| (c, resolved.generation_config)),
        export_hf: config.export_hf.clone(),
        tokenizer_files: Vec::new(),
        savers: run.savers,
        precision: config.precision,
        loss_scale: run.loss_scale,
        blocking: config.blocking.unwrap_or_else(|| {
            let mut b = blocking(&net, run.batch, dtype, place.xla);
            b.fused_attention = fused;
            if fused {
                // The fused op takes attention whole; the CPU kernel blocks its queries
                // itself, holding no layer's scores.
                b.query_block = 0;
            }
            b
        }),
        attention_note,
        backend,
        net,
        processes: spread_over.cloned(),
        slots: share.map(|s| s.slots),
    })
}

/// The devices this process runs: all of the layout's, or its share of a mesh spread
/// over the job's processes — refused, in one line, where the run cannot spread.
fn spread(config: &Config, place: &Placement) -> Result<usize> {
    let Some(p) = config.processes.as_ref().filter(|p| p.count() > 1) else {
        return Ok(place.devices);
    };
    let n = p.count();
    let layout = place.layout.describe();
    if place.stages > 1 {
        return Err(usage(format!(
            "{layout} across {n} processes: a pipeline's stages run in one process (use --mesh DxM over the processes, or run the pipeline in one)"
        )));
    }
    if !place.devices.is_multiple_of(n) {
        return Err(usage(format!(
            "--mesh {} has {} devices, which do not split evenly over the job's {n} processes",
            mesh_text(place.mesh),
            place.devices
        )));
    }
    match &config.backend {
        BackendKind::XlaTarget { .. } => {
            return Err(usage(format!(
                "--target compiles for GPUs without running; run it in one process, not {n}"
            )));
        }
        BackendKind::Xla { partitioner: Partitioner::Xla, .. } => {
            return Err(usage(format!(
                "--partitioner xla needs XLA's collectives between the devices, which span {n} processes here; use meshwork's partitioner (drop --partitioner xla)"
            )));
        }
        _ => {}
    }
    if config.check == Check::Always {
        return Err(usage(format!(
            "--check repeats each step on one device with the whole batch, which no one of the {n} processes holds; compare with a one-process run's --losses-json instead"
        )));
    }
    Ok(place.devices / n)
}

/// `--epochs N`'s steps: `N` passes over the training rows (the rows but those
/// `--eval-data` or `--eval-fraction` holds out), `--batch` rows a step.
fn epoch_steps(
    config: &Config,
    epochs: usize,
    batch: usize,
    (rows_all, eval_rows): (usize, Option<usize>),
) -> Result<usize> {
    let held = match (eval_rows, config.eval_every.filter(|&e| e > 0)) {
        (Some(n), _) => n,
        (None, Some(_)) => (config.eval_fraction.unwrap_or(0.1) * rows_all as f64).ceil() as usize,
        (None, None) => 0,
    };
    let rows = rows_all.saturating_sub(held) as u128;
    let steps = (epochs as u128 * rows).div_ceil(batch.max(1) as u128);
    match steps {
        0 => Err(usage("--epochs: the data hold no row to train on")),
        s if s > MAX_STEPS as u128 => Err(usage(format!(
            "--epochs {epochs} of {rows} rows at --batch {batch} is {s} steps, more than {MAX_STEPS}"
        ))),
        s => Ok(s as usize),
    }
}

/// What a checkpoint records of a run, and the held-out split of its rows.
struct Record {
    meta: Value,
    eval_every: usize,
    rows: usize,
    held: usize,
}

/// The run's metadata (what a resume compares) and `--eval-every`'s held-out rows.
fn record(
    config: &Config,
    net: &Net,
    run: &Settings,
    dtype: DType,
    examples: &Examples,
    (rows_all, eval_rows): (usize, Option<usize>),
) -> Result<Record> {
    let mut meta = net.meta();
    meta["dtype"] = dtype.to_string().into();
    meta["optimizer"] = run.optimizer.describe().into();
    meta["clip_norm"] = serde_json::json!(config.clip_norm);
    if run.loss_scale.is_some() {
        // Its checkpoints carry the loss scale: resumed only by such a run.
        meta["loss_scale"] = true.into();
    }
    meta["batch"] = run.batch.into();
    meta["seed"] = config.seed.into();
    meta["shuffle"] = config.shuffle.into();
    meta["lr"] = run.lr.into();
    meta["warmup"] = config.warmup.into();
    meta["schedule"] = run.schedule.name().into();
    let decays = run.schedule != Schedule::Constant;
    meta["schedule_steps"] = serde_json::json!(decays.then_some(run.steps));
    meta["min_lr"] = serde_json::json!(config.min_lr);
    // --eval-data alone evaluates after the last step.
    let eval_every =
        config.eval_every.unwrap_or(if eval_rows.is_some() { run.steps.max(1) } else { 0 });
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
    meta["eval_fraction"] =
        serde_json::json!((eval_every > 0 && eval_rows.is_none()).then_some(fraction));
    meta["data"] = match &config.data {
        Data::BuiltIn => serde_json::json!([null, null, null]),
        Data::Tokens(p) => serde_json::json!([p, null, null]),
        Data::Text(p) => serde_json::json!([null, p, null]),
        Data::Npy { x, .. } => serde_json::json!([null, null, x]),
        Data::Jsonl { path, .. } => serde_json::json!([null, null, null, path]),
        Data::Documents { paths, .. } => serde_json::json!([null, null, null, paths]),
    };
    meta["rows"] = rows_all.into();
    meta["data_fingerprint"] = serde_json::json!(examples.fingerprint());
    let resolved = crate::resume::Resolved {
        steps: run.steps,
        batch: run.batch,
        optimizer: run.optimizer,
        lr: run.lr,
        schedule: run.schedule,
        dtype,
    };
    meta["flags"] = crate::resume::flags_record(config, &resolved)?;
    if let Some(held) = eval_rows {
        return Ok(Record { meta, eval_every, rows: rows_all - held, held });
    }
    let held = if eval_every > 0 { (fraction * rows_all as f64).ceil() as usize } else { 0 };
    let rows = rows_all - held.min(rows_all);
    if eval_every > 0 && rows == 0 {
        return Err(usage(format!(
            "--eval-fraction {fraction} of {rows_all} rows holds out {held}: no row is left to train on"
        )));
    }
    Ok(Record { meta, eval_every, rows, held })
}

/// A checkpoint directory holding later steps than this run starts from (`first`)
/// would mix two runs.
fn check_checkpoint_dir(config: &Config, first: usize) -> Result<()> {
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
    Ok(())
}

/// Whether a language model's attention is one fused op (`--attention`; by default
/// where the back end runs it through cuDNN and cuDNN takes it), and, when it is not
/// on such a back end, why.
fn attention(
    config: &Config,
    net: &Net,
    backend: &crate::backend::Chosen,
    dtype: DType,
) -> Result<(bool, Option<String>)> {
    use crate::config::AttentionKind;
    let cudnn = backend.backend.as_ref().is_some_and(|b| b.cudnn());
    if config.attention == Some(AttentionKind::Xla) {
        return Ok((false, None));
    }
    let forced = config.attention == Some(AttentionKind::Cudnn);
    if forced && !cudnn {
        return Err(usage(
            "--attention cudnn: cuDNN runs on NVIDIA GPUs; use --target, or --backend xla with the CUDA plugin",
        ));
    }
    if !cudnn {
        // The interpreter runs whole causal attention as one op through its fused CPU
        // kernel where its products are f32 or f64. Half-precision products keep the
        // primitive ops: the op would be widened to f32 whole, where the primitives
        // round the scores and probabilities to the half dtype as JAX's reference
        // does. XLA's CPU and non-cuDNN lowerings inline the definition, so they keep
        // the primitives too.
        let interpreter = backend.backend.is_none();
        let compute = config.precision.unwrap_or(dtype);
        return Ok((interpreter && matches!(compute, DType::F32 | DType::F64), None));
    }
    if config.backend.partitioner() == Partitioner::Xla {
        // XLA's partitioner does not split a custom call it has no partitioner for: it
        // would gather every device's heads and run all of attention on each.
        let why = "XLA's partitioner cannot split cuDNN's calls (JAX registers a custom partitioning for them); meshwork's partitioner does";
        return if forced {
            Err(usage(format!("--attention cudnn with --partitioner xla: {why}")))
        } else {
            Ok((false, Some(why.into())))
        };
    }
    // [B, KV, T, hd] per layer's cache: the head dim.
    let head = net.model().decoder().and_then(|d| d.cache(1, 1).first().map(|(_, s)| s.clone()));
    let why = match head {
        None if !forced => return Ok((false, None)),
        None => Err(format!(
            "the {} has no attention cuDNN runs (GPT-2 and the Llama family do)",
            net.describe()
        )),
        Some(s) => meshwork_nn::cudnn_attention(
            config.precision.unwrap_or(dtype),
            s.get(1).copied().unwrap_or(0),
            s.last().copied().unwrap_or(0),
            net.per_row().0,
        ),
    };
    match why {
        Ok(()) => Ok((true, None)),
        Err(why) if forced => Err(usage(format!("--attention cudnn: {why}"))),
        Err(why) => Ok((false, Some(why))),
    }
}

/// What a run keeps per step beside the model: each step's loss (8 bytes) and, with
/// `--losses-json`, its list and JSON text (about 40 more); per step of a host call, the
/// losses, the one-device check's and the learning rates in flight (48 bytes).
fn bookkeeping(config: &Config, steps: usize) -> f64 {
    let per_step = if config.losses_json.is_some() { 48.0 } else { 8.0 };
    per_step * steps as f64 + 48.0 * config.steps_per_run as f64
}

/// Queries per attention block on the interpreter, where attention is cut.
pub(crate) const QUERY_BLOCK: usize = 64;
/// Bytes of attention scores `[B, H, T, T]` (of one layer) the interpreter computes
/// whole; above it, queries are taken [`QUERY_BLOCK`] at a time. Whole attention is
/// faster (one product per layer instead of a block's slices, masks and their
/// gradients' pads; measured at T 256 on SmolLM2's shape), cut attention holds less.
pub(crate) const WHOLE_SCORES_BYTES: usize = 16 << 20;
/// Bytes of logits a loss chunk holds at most on the interpreter.
pub(crate) const LOSS_CHUNK_BYTES: usize = 256 << 20;

/// How a language model's attention and loss are cut on the interpreter: queries
/// [`QUERY_BLOCK`] at a time when a layer's whole scores would hold more than
/// [`WHOLE_SCORES_BYTES`], and the loss in chunks of positions whose logits (of the
/// whole batch) hold at most [`LOSS_CHUNK_BYTES`]. XLA takes them whole (it fuses and
/// schedules them itself); the other models are not cut.
fn blocking(net: &Net, batch: usize, dtype: DType, xla: bool) -> meshwork_nn::Blocking {
    match net.model().decoder() {
        Some(d) if !xla => {
            let seq = net.per_row().0;
            let row = batch.max(1) * d.vocab().max(1) * dtype.size_in_bytes();
            let chunk = (LOSS_CHUNK_BYTES / row).max(1);
            let scores = [batch.max(1), d.heads(), seq, seq, dtype.size_in_bytes()]
                .into_iter()
                .fold(1usize, usize::saturating_mul);
            meshwork_nn::Blocking {
                query_block: if scores > WHOLE_SCORES_BYTES && seq > QUERY_BLOCK {
                    QUERY_BLOCK
                } else {
                    0
                },
                loss_chunk: if chunk < seq { chunk } else { 0 },
                fused_attention: false,
            }
        }
        _ => meshwork_nn::Blocking::default(),
    }
}

/// `--grad-accum`, `--remat` and `--fsdp`, each checked against the layout and batch.
fn savers(
    config: &Config,
    layout: Layout,
    batch: usize,
    blocks: bool,
    name: &str,
) -> Result<Savers> {
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
    if config.fsdp && config.backend.partitioner() == Partitioner::Xla {
        return Err(usage(
            "--fsdp gathers weights where meshwork's partitioner reads them; with --partitioner xla it would not (drop one)",
        ));
    }
    if config.remat && !blocks {
        return Err(usage(format!(
            "--remat recomputes a transformer's blocks; the {name} has none"
        )));
    }
    Ok(Savers { micro, remat: config.remat, fsdp: config.fsdp })
}

/// `--max-memory`'s refusal: what the run would hold, and the flags that would bring
/// it within the limit (`fits`: each with what the run would hold then).
pub(crate) fn memory_error(need: f64, limit: u64, fits: &[(String, f64)]) -> Error {
    let fit = match fits {
        [] => String::new(),
        _ => format!(
            "{} would fit; or ",
            fits.iter()
                .map(|(f, b)| format!("{f} ({})", crate::report::bytes_text(*b)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    usage(format!(
        "--max-memory: the run would hold about {}, more than {}; {fit}give a larger mesh, smaller sizes or --batch, fewer --steps-per-run, or a larger --max-memory",
        crate::report::bytes_text(need),
        crate::report::bytes_text(limit as f64)
    ))
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
    let base = |m: &Value| m.get("lora_base").and_then(Value::as_str).map(str::to_string);
    if let (Some(a), Some(b)) = (base(theirs), base(meta))
        && a != b
    {
        return Err(Error::flag(
            "resume",
            format!(
                "{dir}'s adapter was trained over a base of fingerprint {a}; --init's is {b} (resume over the same base)"
            ),
        ));
    }
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
        ("schedule_steps", "--steps (the schedule's length)"),
        ("min_lr", "--min-lr"),
        ("clip_norm", "--clip-norm"),
        ("seed", "--seed"),
        ("shuffle", "--shuffle"),
        ("eval_fraction", "--eval-fraction"),
    ] {
        // (Older checkpoints named the schedule's length `cosine_steps`.)
        let v = match key {
            "schedule_steps" => theirs.get(key).or_else(|| theirs.get("cosine_steps")),
            _ => theirs.get(key),
        };
        if let Some(v) = v
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
            // A process that read only its rows has no fingerprint of them all.
            theirs.get("data_fingerprint").is_some_and(|f| {
                !f.is_null()
                    && !meta["data_fingerprint"].is_null()
                    && *f != meta["data_fingerprint"]
            }) || theirs.get("rows").is_some_and(|r| *r != meta["rows"])
        }
        Origin::MainJob => {
            // A process of a spread run holds only its rows: no fingerprint to compare.
            let fp = classification.map(Classification::fingerprint);
            fp.is_some()
                && theirs.get("main_job_fingerprint").and_then(Value::as_u64) != fp.map(u64::from)
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
