//! What a run is asked to do: every setting of `meshwork train`, each `None` where the
//! model's default applies (the MLP's main job trains 200 steps of 64 rows with SGD at
//! 0.5 in f64 on a 2x2 mesh; the transformer and the CNN 100 steps with Adam at 0.01 in
//! f32 on one device).

use std::path::PathBuf;

use meshwork_nn::Optimizer;
use meshwork_types::DType;

/// Which model a run trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ModelKind {
    /// `h = relu(x·W1 + b1)`, `z = h·W2 + b2`, softmax cross-entropy: the main job.
    #[default]
    Mlp,
    /// Two convolutions and a linear head on NHWC images.
    Cnn,
    /// The reference decoder-only transformer (next-token loss).
    Transformer,
    /// GPT-2 (Hugging Face's `GPT2LMHeadModel`; next-token loss).
    Gpt2,
    /// Llama (`LlamaForCausalLM`: Llama 2 and 3, SmolLM, TinyLlama).
    Llama,
    /// Mistral (`MistralForCausalLM`).
    Mistral,
    /// Qwen 2 and 2.5 (`Qwen2ForCausalLM`).
    Qwen2,
    /// Qwen 3 (`Qwen3ForCausalLM`).
    Qwen3,
    /// The model the files name: `--init DIR`'s `config.json` (its `model_type`), or
    /// `--resume`'s checkpoint, or `--preset`; else the MLP.
    Auto,
}

impl ModelKind {
    /// `mlp`, `cnn`, `transformer`, `gpt2`, `llama`, `mistral`, `qwen2`, `qwen3`
    /// (`auto`).
    pub fn name(self) -> &'static str {
        match self {
            ModelKind::Mlp => "mlp",
            ModelKind::Cnn => "cnn",
            ModelKind::Transformer => "transformer",
            ModelKind::Gpt2 => "gpt2",
            ModelKind::Llama => "llama",
            ModelKind::Mistral => "mistral",
            ModelKind::Qwen2 => "qwen2",
            ModelKind::Qwen3 => "qwen3",
            ModelKind::Auto => "auto",
        }
    }

    /// The kind of a `--model` name (or a Hugging Face `model_type`).
    pub fn named(name: &str) -> Option<ModelKind> {
        [
            ModelKind::Mlp,
            ModelKind::Cnn,
            ModelKind::Transformer,
            ModelKind::Gpt2,
            ModelKind::Llama,
            ModelKind::Mistral,
            ModelKind::Qwen2,
            ModelKind::Qwen3,
        ]
        .into_iter()
        .find(|k| k.name() == name)
    }

    /// Whether its checkpoints are Hugging Face folders (GPT-2 and the Llama family).
    pub fn has_hf_layout(self) -> bool {
        matches!(
            self,
            ModelKind::Gpt2
                | ModelKind::Llama
                | ModelKind::Mistral
                | ModelKind::Qwen2
                | ModelKind::Qwen3
        )
    }
}

/// Which optimizer updates the weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptimizerKind {
    /// Plain SGD.
    Sgd,
    /// SGD with momentum 0.9 (PyTorch's, no dampening).
    Momentum,
    /// Adam (β 0.9, 0.999; ε 1e-8).
    Adam,
    /// AdamW (β 0.9, 0.999; ε 1e-8; weight decay 0.01 on every parameter).
    AdamW,
}

impl OptimizerKind {
    /// The optimizer.
    pub fn optimizer(self) -> Optimizer {
        match self {
            OptimizerKind::Sgd => Optimizer::Sgd,
            OptimizerKind::Momentum => Optimizer::Momentum { momentum: 0.9 },
            OptimizerKind::Adam => Optimizer::adam(),
            OptimizerKind::AdamW => Optimizer::adamw(0.01),
        }
    }
}

/// The optimizer's settings users tune (`--weight-decay`, `--beta1`, `--beta2`,
/// `--eps`, `--no-decay-1d`): each `None` where the optimizer's default applies (β
/// 0.9 and 0.999, ε 1e-8, AdamW's decay 0.01 on every parameter, as
/// `torch.optim.AdamW`'s defaults).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct OptimizerSettings {
    /// AdamW's decoupled weight decay λ.
    pub weight_decay: Option<f64>,
    /// Adam's and AdamW's β₁.
    pub beta1: Option<f64>,
    /// Adam's and AdamW's β₂.
    pub beta2: Option<f64>,
    /// Adam's and AdamW's ε.
    pub eps: Option<f64>,
    /// AdamW: no decay of 1-D parameters (biases, LayerNorm's), as nanoGPT.
    pub no_decay_1d: bool,
}

impl OptimizerKind {
    /// The optimizer with `settings`, or a usage error naming the flag that does not
    /// fit (a setting of another optimizer, a β outside `[0, 1)`, an ε or decay that
    /// is not a positive (or, for the decay, non-negative) number).
    pub fn with(self, settings: &OptimizerSettings) -> crate::Result<Optimizer> {
        let adam = matches!(self, OptimizerKind::Adam | OptimizerKind::AdamW);
        let name = match self {
            OptimizerKind::Sgd => "sgd",
            OptimizerKind::Momentum => "momentum",
            OptimizerKind::Adam => "adam",
            OptimizerKind::AdamW => "adamw",
        };
        fn refuse<T>(flag: &str, problem: String) -> crate::Result<T> {
            Err(crate::Error::flag(flag, problem))
        }
        for (flag, set) in [
            ("beta1", settings.beta1.is_some()),
            ("beta2", settings.beta2.is_some()),
            ("eps", settings.eps.is_some()),
        ] {
            if set && !adam {
                return refuse(flag, format!("applies to adam and adamw; the optimizer is {name}"));
            }
        }
        for (flag, set) in [
            ("weight-decay", settings.weight_decay.is_some()),
            ("no-decay-1d", settings.no_decay_1d),
        ] {
            if set && self != OptimizerKind::AdamW {
                return refuse(flag, format!("applies to adamw; the optimizer is {name}"));
            }
        }
        let text = crate::number_text;
        let beta = |flag: &str, v: Option<f64>, default: f64| match v {
            None => Ok(default),
            Some(b) if (0.0..1.0).contains(&b) => Ok(b),
            Some(b) => refuse(flag, format!("{} is not in [0, 1)", text(b))),
        };
        let beta1 = beta("beta1", settings.beta1, 0.9)?;
        let beta2 = beta("beta2", settings.beta2, 0.999)?;
        let eps = match settings.eps {
            None => 1e-8,
            Some(e) if e.is_finite() && e > 0.0 => e,
            Some(e) => return refuse("eps", format!("{} is not a positive number", text(e))),
        };
        let weight_decay = match settings.weight_decay {
            None => 0.01,
            Some(w) if w.is_finite() && w >= 0.0 => w,
            Some(w) => {
                return refuse("weight-decay", format!("{} is not a number ≥ 0", text(w)));
            }
        };
        Ok(match self {
            OptimizerKind::Sgd | OptimizerKind::Momentum => self.optimizer(),
            OptimizerKind::Adam => Optimizer::Adam { beta1, beta2, eps },
            OptimizerKind::AdamW => Optimizer::AdamW {
                beta1,
                beta2,
                eps,
                weight_decay,
                decay_1d: !settings.no_decay_1d,
            },
        })
    }
}

/// The learning rate after warm-up. The decays end where Hugging Face's schedulers
/// do: at 0 one step past the last (the last step still learns), or at
/// [`Config::min_lr`] at the last step when that is given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Schedule {
    /// Constant.
    #[default]
    Constant,
    /// A cosine decay (`get_cosine_schedule_with_warmup`'s).
    Cosine,
    /// A linear decay (`get_linear_schedule_with_warmup`'s, `Trainer`'s default).
    Linear,
}

impl Schedule {
    /// The name `--schedule` takes and a checkpoint records.
    pub fn name(self) -> &'static str {
        match self {
            Schedule::Constant => "constant",
            Schedule::Cosine => "cosine",
            Schedule::Linear => "linear",
        }
    }
}

/// Whether every step's loss is checked against one device's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Check {
    /// For runs estimated at 1 GB or less.
    #[default]
    Auto,
    /// Always (`--check`).
    Always,
    /// Never (`--no-check`).
    Never,
}

/// Where the rows come from.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Data {
    /// The model's built-in rows (drawn from the seed).
    #[default]
    BuiltIn,
    /// Features or images `[N, …]` and class ids (`--data-x`, `--data-y`).
    Npy {
        /// The inputs.
        x: PathBuf,
        /// The labels.
        y: PathBuf,
    },
    /// Token rows `[N, T+1]` (`--data-tokens`).
    Tokens(PathBuf),
    /// A text file's bytes as tokens (`--text`).
    Text(PathBuf),
    /// A JSON Lines file of documents (`--data-jsonl FILE --text-field F`), encoded by
    /// the tokenizer one by one with its end-of-text token between them.
    Jsonl {
        /// The file.
        path: PathBuf,
        /// The field of each line's object that holds its document.
        field: String,
    },
    /// Documents from several files, in order (`--text A B …` or a directory's
    /// `.txt` and `.jsonl` files): a `.jsonl` file's lines' `field`, any other file
    /// whole; encoded by the tokenizer one by one with its end-of-text token between
    /// them.
    Documents {
        /// The files.
        paths: Vec<PathBuf>,
        /// The field of each `.jsonl` line's object that holds its document.
        field: String,
    },
}

/// What runs the steps (`--backend`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum BackendKind {
    /// meshwork's interpreter on CPU threads (the default).
    #[default]
    Interpreter,
    /// XLA through a PJRT plugin: `--pjrt-plugin PATH`, or `MESHWORK_PJRT_PLUGIN`
    /// when `None`. One device, a `--mesh DxM`, or a pipeline.
    Xla {
        /// `--pjrt-plugin`.
        plugin: Option<PathBuf>,
        /// `--partitioner`: who splits a mesh's step, meshwork or XLA.
        partitioner: Partitioner,
    },
    /// XLA compiling for GPUs that are not here (`--target`, for `inspect`): the CUDA
    /// plugin (`--pjrt-plugin` or `MESHWORK_PJRT_PLUGIN`) compiles the step for the
    /// target's topology without a device.
    XlaTarget {
        /// `--pjrt-plugin`.
        plugin: Option<PathBuf>,
        /// `--partitioner`.
        partitioner: Partitioner,
        /// `--target`: `h100`, `h100x8`, `2xh100x8`.
        target: String,
        /// `--target-config`: a `GpuTargetConfigProto` text file in place of the
        /// shipped one.
        target_config: Option<PathBuf>,
    },
    /// A back end of the caller's own (no flag): the steps compile through it, split
    /// by the partitioner it names.
    Custom(CustomBackend),
}

/// A [`Backend`](meshwork_strategy::backend::Backend) implementation given to the
/// trainer (a back end of one's own, or one wrapping meshwork's to test what runs on
/// it); two are equal when they are the same object.
#[derive(Debug, Clone)]
pub struct CustomBackend(pub std::sync::Arc<dyn meshwork_strategy::backend::Backend>);

impl PartialEq for CustomBackend {
    fn eq(&self, other: &CustomBackend) -> bool {
        std::sync::Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for CustomBackend {}

impl BackendKind {
    /// Whether XLA compiles the steps (on a client's devices or for a target).
    pub fn is_xla(&self) -> bool {
        matches!(self, BackendKind::Xla { .. } | BackendKind::XlaTarget { .. })
    }

    /// Who splits a mesh's step.
    pub fn partitioner(&self) -> Partitioner {
        match self {
            BackendKind::Interpreter => Partitioner::Meshwork,
            BackendKind::Xla { partitioner, .. } | BackendKind::XlaTarget { partitioner, .. } => {
                *partitioner
            }
            BackendKind::Custom(b) => b.0.partitioner(),
        }
    }
}

pub use meshwork_strategy::backend::Partitioner;

/// How causal attention runs (`--attention`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionKind {
    /// cuDNN's fused (flash) attention: the custom calls JAX emits for
    /// `dot_product_attention(implementation="cudnn")`; refused where cuDNN does not
    /// take the model's attention or the back end is not a CUDA one.
    Cudnn,
    /// Attention's primitive ops: XLA's own lowering of them, and on the interpreter
    /// the ops one at a time instead of its fused CPU kernel.
    Xla,
}

/// A training run's settings: the command line's flags, by name.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// `--model`.
    pub model: ModelKind,
    /// `--layers`, the transformer's decoder blocks.
    pub layers: Option<usize>,
    /// `--dim`.
    pub dim: Option<usize>,
    /// `--heads`.
    pub heads: Option<usize>,
    /// `--ffn`.
    pub ffn: Option<usize>,
    /// `--vocab`.
    pub vocab: Option<usize>,
    /// `--seq`.
    pub seq: Option<usize>,
    /// `--positions`: a GPT-2's positions (its context at most).
    pub positions: Option<usize>,
    /// `--attention`: `None` lowers it with cuDNN where the back end is a CUDA one and
    /// cuDNN takes it, runs it with the fast interpreter's fused kernel on the
    /// interpreter (f32 and f64 products), plainly otherwise.
    pub attention: Option<AttentionKind>,
    /// `--hidden`, the MLP's hidden units.
    pub hidden: Option<usize>,
    /// `--classes`, the MLP's classes when its labels do not say them all.
    pub classes: Option<usize>,
    /// `--filters`, the CNN's two convolutions' channels.
    pub filters: Option<[usize; 2]>,
    /// The rows.
    pub data: Data,
    /// `--init`, initial weights (a safetensors file).
    pub init: Option<PathBuf>,
    /// `--resume`, a checkpoint directory (its latest step) or one step of it.
    pub resume: Option<PathBuf>,
    /// `--mesh DxM`.
    pub mesh: Option<(usize, usize)>,
    /// `--backend` (and `--pjrt-plugin`).
    pub backend: BackendKind,
    /// `--stages`: a pipeline of that many stages per data replica.
    pub stages: Option<usize>,
    /// `--microbatches` per replica and step in a pipeline.
    pub microbatches: Option<usize>,
    /// `--steps`: the last step (a resumed run continues up to it).
    pub steps: Option<usize>,
    /// `--epochs`: instead of `--steps`, as many steps as take this many passes over
    /// the training rows (the last one's batch filled from the next pass's rows).
    pub epochs: Option<usize>,
    /// `--batch`: rows per step.
    pub batch: Option<usize>,
    /// `--preset`: GPT-2's sizes by name (`tiny`, `gpt2`, `gpt2-medium`).
    pub preset: Option<String>,
    /// `--tokenizer`: a Hugging Face `tokenizer.json` that encodes `--text` (GPT-2).
    pub tokenizer: Option<PathBuf>,
    /// `--cache-dir`: where `--text`'s encoded rows are cached (none: not cached; the
    /// command line's default is meshwork's folder in the user's cache directory).
    pub cache_dir: Option<PathBuf>,
    /// `--optimizer`.
    pub optimizer: Option<OptimizerKind>,
    /// `--weight-decay`, `--beta1`, `--beta2`, `--eps`, `--no-decay-1d`.
    pub optimizer_settings: OptimizerSettings,
    /// `--lr`.
    pub lr: Option<f64>,
    /// `--dtype`: f32 or f64.
    pub dtype: Option<DType>,
    /// `--seed`: the built-in rows, the initial weights and the shuffled order.
    pub seed: u64,
    /// `--shuffle`: rows in a per-epoch permutation drawn from the seed.
    pub shuffle: bool,
    /// `--warmup` steps of linear learning-rate warm-up.
    pub warmup: usize,
    /// `--schedule` (`None`: linear with a pretrained `--init` folder's fine-tuning
    /// defaults, else constant).
    pub schedule: Option<Schedule>,
    /// `--data-changed-ok`: a resumed run trains on a data file that changed since the
    /// checkpoint's run read it (refused otherwise).
    pub data_changed_ok: bool,
    /// `--min-lr`: where a decaying schedule ends, reached at the last step (`None`:
    /// 0, reached one step past the last).
    pub min_lr: Option<f64>,
    /// `--clip-norm`: gradients clipped to this global norm.
    pub clip_norm: Option<f64>,
    /// `--eval-every`: evaluate on held-out rows every that many steps.
    pub eval_every: Option<usize>,
    /// `--eval-fraction` of the rows held out (default 0.1).
    pub eval_fraction: Option<f64>,
    /// `--eval-data`: a language model's validation set (token rows, a text or a
    /// JSON Lines file, cut into rows as the training data are), evaluated every
    /// `--eval-every` steps (by default after the last alone) instead of held-out
    /// rows.
    pub eval_data: Option<Data>,
    /// `--checkpoint-dir`: a directory meshwork owns.
    pub checkpoint_dir: Option<PathBuf>,
    /// `--checkpoint-every` steps (and at the end).
    pub checkpoint_every: Option<usize>,
    /// `--keep` checkpoints (default 3).
    pub keep: Option<usize>,
    /// `--steps-per-run`: steps per host call.
    pub steps_per_run: usize,
    /// `--max-memory` in bytes: a run estimated to hold more is refused.
    pub max_memory: u64,
    /// `--check` / `--no-check`.
    pub check: Check,
    /// `--losses-json`: every step's loss as a JSON list.
    pub losses_json: Option<PathBuf>,
    /// `--metrics-jsonl`: a JSON line per step as the run goes.
    pub metrics_jsonl: Option<PathBuf>,
    /// `--plot`: the losses as an SVG line chart.
    pub plot: Option<PathBuf>,
    /// `--export-hf`: GPT-2's final weights as a Hugging Face checkpoint folder.
    pub export_hf: Option<PathBuf>,
    /// `--lora-r`, `--lora-alpha`, `--lora-targets`, `--lora-dropout`, `--lora-rslora`,
    /// `--lora-init`: a LoRA adapter trained over the frozen base (`None`: every
    /// weight trains).
    pub lora: Option<LoraSettings>,
    /// `--export-lora`: the trained adapter as a `peft` folder.
    pub export_lora: Option<PathBuf>,
    /// `--base-dtype bf16`: a LoRA run's frozen base held in bf16 (rounded to nearest
    /// once, converted to `--dtype` where the model reads it), the adapter and
    /// everything else in `--dtype`; `None`: the base in `--dtype` too.
    pub base_dtype: Option<DType>,
    /// `--grad-accum N`: each step's batch in N micro-batches, their gradients
    /// accumulated (the same losses, one micro-batch's activations held at a time).
    pub grad_accum: Option<usize>,
    /// `--remat`: each transformer block's activations recomputed in the backward pass.
    pub remat: bool,
    /// `--fsdp`: weights, gradients and optimizer state split over the data axis.
    pub fsdp: bool,
    /// `--precision`: bf16 or f16 products (as `torch.autocast`), the weights, optimizer
    /// state and everything else in `--dtype`; `None` (`full`): all in `--dtype`.
    pub precision: Option<DType>,
    /// `--loss-scale-init`: f16's first loss scale (default 65536, as `GradScaler`).
    pub loss_scale_init: Option<f64>,
    /// How GPT-2's attention and loss are cut into pieces (`None`: the back end's
    /// default: on the interpreter, queries 64 at a time and loss chunks of at most
    /// 16 MiB of logits; on XLA, whole). No flag sets it; the library's tests do.
    pub blocking: Option<meshwork_nn::Blocking>,
    /// The processes the run's mesh spreads over (an MPI job's ranks): `None`, this
    /// one alone. Every process runs the same settings; each runs its share of the
    /// mesh's positions, and process 0 writes the outputs.
    pub processes: Option<crate::Processes>,
}

/// A LoRA adapter's settings as the flags give them (`None`: from `--lora-init`'s
/// folder, or `peft`'s default).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoraSettings {
    /// `--lora-r`: the rank (default 8).
    pub r: Option<usize>,
    /// `--lora-alpha` (default 8, as `peft`'s).
    pub alpha: Option<f64>,
    /// `--lora-targets`: layer names (`q_proj,v_proj`) or `all-linear` (default:
    /// `peft`'s for the family: `q_proj,v_proj`; GPT-2's `c_attn`).
    pub targets: Option<Vec<String>>,
    /// `--lora-dropout` (default 0).
    pub dropout: Option<f64>,
    /// `--lora-rslora`: the scale `α/√r` (`use_rslora`).
    pub rslora: bool,
    /// `--lora-init DIR`: the `peft` folder the adapter starts from, its settings
    /// from its `adapter_config.json`.
    pub init: Option<PathBuf>,
}

/// The default `--max-memory`: 8 GiB.
pub const DEFAULT_MAX_MEMORY: u64 = 8 << 30;

impl Default for Config {
    fn default() -> Config {
        Config {
            model: ModelKind::Mlp,
            layers: None,
            dim: None,
            heads: None,
            ffn: None,
            vocab: None,
            seq: None,
            positions: None,
            attention: None,
            hidden: None,
            classes: None,
            filters: None,
            data: Data::BuiltIn,
            init: None,
            resume: None,
            mesh: None,
            backend: BackendKind::Interpreter,
            stages: None,
            microbatches: None,
            steps: None,
            epochs: None,
            batch: None,
            preset: None,
            tokenizer: None,
            cache_dir: None,
            optimizer: None,
            optimizer_settings: OptimizerSettings::default(),
            lr: None,
            dtype: None,
            seed: 0,
            shuffle: false,
            warmup: 0,
            schedule: None,
            min_lr: None,
            data_changed_ok: false,
            clip_norm: None,
            eval_every: None,
            eval_fraction: None,
            eval_data: None,
            checkpoint_dir: None,
            checkpoint_every: None,
            keep: None,
            steps_per_run: 1,
            max_memory: DEFAULT_MAX_MEMORY,
            check: Check::Auto,
            losses_json: None,
            metrics_jsonl: None,
            plot: None,
            export_hf: None,
            lora: None,
            export_lora: None,
            grad_accum: None,
            remat: false,
            fsdp: false,
            precision: None,
            base_dtype: None,
            loss_scale_init: None,
            blocking: None,
            processes: None,
        }
    }
}

impl Config {
    /// The settings of `--model model`, everything else at its default.
    pub fn new(model: ModelKind) -> Config {
        Config { model, ..Config::default() }
    }
}
