//! The command line: every command's flags (clap's derive), their values parsed and
//! checked alone (sizes, meshes, dtypes); what they mean together is the trainer's to
//! check.

use std::path::PathBuf;

use clap::error::ErrorKind;
use clap::{Args, Parser, Subcommand, ValueEnum};
use meshwork_train::{
    BackendKind, Check, Config, DEFAULT_MAX_MEMORY, Data, ModelKind, OptimizerKind,
    OptimizerSettings, Partitioner, Schedule,
};
use meshwork_types::DType;

use crate::out::{Exit, out};

/// The commands (the visible subcommands of [`Cli`], so the list cannot drift), for
/// `help COMMAND`.
pub(crate) fn commands() -> Vec<String> {
    use clap::CommandFactory;
    Cli::command()
        .get_subcommands()
        .filter(|c| !c.is_hide_set())
        .map(|c| c.get_name().to_string())
        .collect()
}

/// meshwork — run one model on many devices.
///
/// Bad input exits with status 2 and one line naming the problem and the flag; a
/// failed training run exits with 1, an interrupted one (Ctrl-C, SIGTERM) with 130.
#[derive(Debug, Parser)]
#[command(name = "meshwork", version, disable_help_subcommand = true)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Option<Command>,
}

/// A command.
#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Train a model on a data x model device mesh: the MLP (the main job), the
    /// reference transformer or a CNN.
    Train(Box<TrainArgs>),
    /// The transformer's training step as each device of a mesh runs it.
    Inspect(Box<InspectArgs>),
    /// Generate tokens from a Hugging Face checkpoint folder (GPT-2, the Llama family), with a key-value cache.
    ///
    /// Greedy at --temperature 0 (the default), else sampled from --seed; stops at the
    /// config's eos_token_id, as transformers' generate does. Prints the ids: the
    /// prompt's, then the new ones (or, with a tokenizer, the new text). --chat
    /// MESSAGES.json renders the folder's chat template with a generation prompt, as
    /// transformers' apply_chat_template does.
    Generate(GenerateArgs),
    /// Encode a text file with a Hugging Face tokenizer into token rows (.npy).
    ///
    /// Writes [rows, T + 1] int32 ids, cut as train --text FILE --tokenizer T.json
    /// --seq T cuts them, for train --data-tokens. The text is encoded in chunks, with
    /// the ids of encoding it whole.
    Tokenize(TokenizeArgs),
    /// Evaluate weights on data: the mean next-token cross-entropy and perplexity.
    ///
    /// Over every full row of T + 1 tokens of the data (cut as train --text cuts
    /// them), --batch rows at a time: prints "loss L  perplexity P  tokens N" (or
    /// {"loss", "perplexity", "tokens"} with --json). The weights: --init DIR (a
    /// Hugging Face folder) or a meshwork checkpoint (--init CKPT or --resume CKPT,
    /// its data, tokenizer and sizes taken from it unless given). Takes train's model,
    /// data, mesh and back end flags; nothing is trained, nor written but the token cache.
    Eval(Box<EvalArgs>),
    /// Write a checkpoint's weights as a Hugging Face folder (--hf) or a LoRA run's adapter as a peft folder (--lora).
    ///
    /// What the run's --export-hf and --export-lora would have written had it ended at
    /// that step: its model (and a LoRA run's base) remembered by the checkpoint. Each
    /// folder new or empty; nothing is trained.
    Export(ExportArgs),
    /// Draw which device holds which block of a sharded array.
    ///
    /// Prints the shard shape, the XLA sharding and the index map (each device and the
    /// index ranges it holds, with its replica id where several devices hold the same
    /// block), and for arrays of rank 1 or 2 draws which device holds which block (no
    /// picture is drawn for rank 3 and up). Takes arrays of at most 2^48 elements and
    /// meshes of at most 8192 devices.
    Shard(ShardArgs),
    /// The transfer plan between two shardings of an array.
    ///
    /// The transfer plan between two shardings: the box copies, and the elements and
    /// bytes that cross devices against the array's total (its elements, and its bytes at
    /// --dtype). More than 100% crosses when the target replicates blocks onto devices
    /// that lacked them. Takes arrays of at most 2^48 elements and meshes of at most 8192
    /// devices.
    Reshard(ReshardArgs),
    /// Place a dataflow graph's ops on devices (TensorFlow's placer rules).
    ///
    /// Places a graph ({"nodes": [...]}, TensorFlow's placer rules) and prints node, op and
    /// device. The op catalog comes from --ops or the graph file's "op_catalog". Short
    /// device names get the /job:localhost/replica:0/task:0/device: prefix. Files of at
    /// most 64 MiB are read.
    Place(PlaceArgs),
    /// The version.
    #[command(hide = true)]
    Version,
}

/// `--model`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Model {
    /// h = relu(x·W1 + b1), z = h·W2 + b2 (the main job).
    Mlp,
    /// The reference decoder-only transformer.
    Transformer,
    /// Two convolutions and a linear head on images.
    Cnn,
    /// GPT-2 (Hugging Face's GPT2LMHeadModel): --init a checkpoint folder, or --preset
    Gpt2,
    /// Llama (LlamaForCausalLM: Llama 2/3, SmolLM, TinyLlama): --init a checkpoint folder, or --preset
    Llama,
    /// Mistral (MistralForCausalLM): --init a checkpoint folder
    Mistral,
    /// Qwen 2 and 2.5 (Qwen2ForCausalLM): --init a checkpoint folder, or --preset
    Qwen2,
    /// Qwen 3 (Qwen3ForCausalLM): --init a checkpoint folder
    Qwen3,
}

impl From<Model> for ModelKind {
    fn from(m: Model) -> ModelKind {
        match m {
            Model::Mlp => ModelKind::Mlp,
            Model::Transformer => ModelKind::Transformer,
            Model::Cnn => ModelKind::Cnn,
            Model::Gpt2 => ModelKind::Gpt2,
            Model::Llama => ModelKind::Llama,
            Model::Mistral => ModelKind::Mistral,
            Model::Qwen2 => ModelKind::Qwen2,
            Model::Qwen3 => ModelKind::Qwen3,
        }
    }
}

/// `--optimizer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Optimizer {
    /// Plain SGD.
    Sgd,
    /// SGD with momentum 0.9.
    Momentum,
    /// Adam (β 0.9, 0.999).
    Adam,
    /// AdamW, weight decay 0.01.
    Adamw,
}

impl From<Optimizer> for OptimizerKind {
    fn from(o: Optimizer) -> OptimizerKind {
        match o {
            Optimizer::Sgd => OptimizerKind::Sgd,
            Optimizer::Momentum => OptimizerKind::Momentum,
            Optimizer::Adam => OptimizerKind::Adam,
            Optimizer::Adamw => OptimizerKind::AdamW,
        }
    }
}

/// `--dtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Float {
    /// 32-bit floats.
    F32,
    /// 64-bit floats.
    F64,
}

impl From<Float> for DType {
    fn from(f: Float) -> DType {
        match f {
            Float::F32 => DType::F32,
            Float::F64 => DType::F64,
        }
    }
}

/// `--precision`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum PrecisionArg {
    /// Everything in --dtype.
    Full,
    /// Products (matmuls) in bfloat16, as torch.autocast; weights, optimizer state and the rest in --dtype.
    Bf16,
    /// Products in float16, the rest in --dtype.
    F16,
}

impl PrecisionArg {
    fn dtype(self) -> Option<DType> {
        match self {
            PrecisionArg::Full => None,
            PrecisionArg::Bf16 => Some(DType::BF16),
            PrecisionArg::F16 => Some(DType::F16),
        }
    }
}

/// `--schedule`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum ScheduleArg {
    /// The learning rate after warm-up.
    Constant,
    /// A cosine decay to 0 one step past the last (or to --min-lr at the last).
    Cosine,
    /// A linear decay to 0 one step past the last (or to --min-lr at the last).
    Linear,
}

/// `DxM` → `(D, M)`.
fn mesh_2d(text: &str) -> Result<(usize, usize), String> {
    let bad = || format!("{text:?} is not a mesh like 2x2 (data x model)");
    let (d, m) = text.split_once(['x', 'X']).ok_or_else(bad)?;
    let d: usize = d.trim().parse().map_err(|_| bad())?;
    let m: usize = m.trim().parse().map_err(|_| bad())?;
    if d == 0 || m == 0 {
        return Err(format!("{text:?}: a mesh needs at least one device along each axis"));
    }
    Ok((d, m))
}

/// `F1,F2`.
fn two_counts(text: &str) -> Result<[usize; 2], String> {
    let counts: Vec<usize> = text
        .split(',')
        .map(|d| d.trim().parse().map_err(|_| format!("{text:?} is not two counts like 8,16")))
        .collect::<Result<_, _>>()?;
    <[usize; 2]>::try_from(counts).map_err(|_| format!("{text:?}: give two counts, F1,F2"))
}

/// `8G`, `512M`, `4096` → bytes (at least 1).
fn bytes(text: &str) -> Result<u64, String> {
    let bad = || format!("{text:?} is not a size like 8G, 512M or 4096");
    let t = text.trim();
    let (digits, shift) = match t.char_indices().last() {
        Some((at, 'K' | 'k')) => (&t[..at], 10),
        Some((at, 'M' | 'm')) => (&t[..at], 20),
        Some((at, 'G' | 'g')) => (&t[..at], 30),
        Some((at, 'T' | 't')) => (&t[..at], 40),
        _ => (t, 0),
    };
    let n: u64 = digits.parse().map_err(|_| bad())?;
    n.checked_mul(1u64 << shift).filter(|&b| b > 0).ok_or_else(bad)
}

/// The transformer's sizes, each at its default when not given (or from `--init`);
/// for GPT-2 they override its preset's.
#[derive(Debug, Args)]
#[command(next_help_heading = "Model")]
pub(crate) struct Sizes {
    /// The transformer's decoder blocks (default 2; GPT-2: its preset's)
    #[arg(long, value_name = "L")]
    layers: Option<usize>,
    /// The transformer's width (default 64; GPT-2: its preset's)
    #[arg(long, value_name = "D")]
    dim: Option<usize>,
    /// The transformer's attention heads (default 4; GPT-2: its preset's)
    #[arg(long, value_name = "H")]
    heads: Option<usize>,
    /// The transformer's MLP width (default 256; GPT-2: 4 × its width)
    #[arg(long, value_name = "F")]
    ffn: Option<usize>,
    /// The transformer's vocabulary (default 256; GPT-2: its preset's)
    #[arg(long, value_name = "V")]
    vocab: Option<usize>,
    /// The transformer's context length (default 32; GPT-2: the training context, default the smaller of 64 and its positions)
    #[arg(long, value_name = "T")]
    seq: Option<usize>,
    /// GPT-2's positions, the longest context it takes (default: its preset's)
    #[arg(long, value_name = "N")]
    positions: Option<usize>,
}

/// The optimizer's settings (each at the optimizer's default when not given).
#[derive(Debug, Args)]
#[command(next_help_heading = "Optimizer")]
pub(crate) struct OptimizerFlags {
    /// AdamW's decoupled weight decay, on every parameter (default 0.01; 0 under a fine-tune's defaults)
    #[arg(long, value_name = "W")]
    weight_decay: Option<f64>,
    /// Adam's and AdamW's beta1 (default 0.9)
    #[arg(long, value_name = "B1")]
    beta1: Option<f64>,
    /// Adam's and AdamW's beta2 (default 0.999)
    #[arg(long, value_name = "B2")]
    beta2: Option<f64>,
    /// Adam's and AdamW's epsilon (default 1e-8)
    #[arg(long, value_name = "EPS")]
    eps: Option<f64>,
    /// AdamW: no weight decay of biases and LayerNorm parameters (1-D), as nanoGPT
    #[arg(long)]
    no_decay_1d: bool,
}

/// A LoRA adapter trained over the frozen base, as `peft` computes it.
#[derive(Debug, Args)]
#[command(next_help_heading = "LoRA")]
pub(crate) struct LoraFlags {
    /// Train a LoRA adapter of rank R over the frozen base (GPT-2, the Llama family; default 8 when another --lora flag is given)
    #[arg(long, value_name = "R")]
    lora_r: Option<usize>,
    /// LoRA's alpha: the adapter's output is scaled by alpha / R (default 8, as peft's)
    #[arg(long, value_name = "A", allow_negative_numbers = true)]
    lora_alpha: Option<f64>,
    /// The linear layers the adapter wraps, by name or dotted suffix (q_proj,v_proj; GPT-2's c_attn), or all-linear (default: peft's for the family)
    #[arg(long, value_name = "NAMES", value_delimiter = ',')]
    lora_targets: Option<Vec<String>>,
    /// Dropout on the adapter's input, as peft's lora_dropout (default 0, or a --lora-init folder's; 0 trains a folder's adapter without its dropout). Masks are drawn as JAX draws them, from --seed, the step and the row
    #[arg(long, value_name = "P")]
    lora_dropout: Option<f64>,
    /// Scale the adapter's output by alpha / sqrt(R) (peft's use_rslora)
    #[arg(long)]
    lora_rslora: bool,
    /// Start the adapter from a peft folder (adapter_config.json and adapter_model.safetensors), its rank, alpha and targets taken from it
    #[arg(long, value_name = "DIR")]
    lora_init: Option<PathBuf>,
    /// Hold the frozen base in bfloat16 (rounded once, converted to --dtype where it is read); the adapter, its optimizer state and the rest stay in --dtype
    #[arg(long, value_name = "DTYPE")]
    base_dtype: Option<BaseDtype>,
}

/// `--base-dtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum BaseDtype {
    /// bfloat16: half the bytes of f32, f32's range.
    Bf16,
}

impl LoraFlags {
    /// `--base-dtype`.
    fn base_dtype(&self) -> Option<DType> {
        self.base_dtype.map(|BaseDtype::Bf16| DType::BF16)
    }

    fn settings(&self) -> Option<meshwork_train::LoraSettings> {
        let given = self.lora_r.is_some()
            || self.lora_alpha.is_some()
            || self.lora_targets.is_some()
            || self.lora_dropout.is_some()
            || self.lora_rslora
            || self.lora_init.is_some();
        given.then(|| meshwork_train::LoraSettings {
            r: self.lora_r,
            alpha: self.lora_alpha,
            targets: self.lora_targets.clone(),
            dropout: self.lora_dropout,
            rslora: self.lora_rslora,
            init: self.lora_init.clone(),
        })
    }
}

/// The memory savers: how a step computes, never what (the losses stay the same).
#[derive(Debug, Args)]
#[command(next_help_heading = "Mesh and back end")]
pub(crate) struct MemoryFlags {
    /// Split each step's batch into N micro-batches and accumulate their gradients (--batch stays the step's batch; one micro-batch's activations are held at a time)
    #[arg(long, value_name = "N")]
    grad_accum: Option<usize>,
    /// Recompute each transformer block's activations in the backward pass instead of holding them (JAX's checkpoint)
    #[arg(long)]
    remat: bool,
    /// Split weights, gradients and optimizer state over the data axis, each along its largest dimension the axis divides (ZeRO-3 by shardings: the partitioner gathers and reduce-scatters)
    #[arg(long)]
    fsdp: bool,
}

impl OptimizerFlags {
    fn settings(&self) -> OptimizerSettings {
        OptimizerSettings {
            weight_decay: self.weight_decay,
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            no_decay_1d: self.no_decay_1d,
        }
    }
}

/// `meshwork export`'s arguments.
#[derive(Debug, Args)]
pub(crate) struct ExportArgs {
    /// A checkpoint directory (its latest step) or one step-NNNNNNNN/ in it
    #[arg(value_name = "CKPT")]
    checkpoint: PathBuf,
    /// Write the weights (a LoRA run's merged into its base) as a Hugging Face folder that transformers' from_pretrained loads (new or empty)
    #[arg(long, value_name = "DIR")]
    pub(crate) hf: Option<PathBuf>,
    /// A LoRA run's adapter as a peft folder that PeftModel.from_pretrained loads (new or empty)
    #[arg(long, value_name = "DIR")]
    pub(crate) lora: Option<PathBuf>,
    /// A LoRA run's base, where its checkpoint does not record it (a Hugging Face folder)
    #[arg(long, value_name = "DIR")]
    init: Option<PathBuf>,
}

impl ExportArgs {
    /// The export's settings.
    pub(crate) fn config(&self) -> Config {
        Config {
            resume: Some(self.checkpoint.clone()),
            init: self.init.clone(),
            export_hf: self.hf.clone(),
            export_lora: self.lora.clone(),
            ..Config::new(ModelKind::Auto)
        }
    }
}

/// `meshwork eval`'s flags: train's, and `--json`.
#[derive(Debug, Args)]
pub(crate) struct EvalArgs {
    #[command(flatten)]
    pub(crate) train: TrainArgs,
    /// Print {"loss", "perplexity", "tokens"} instead of a line
    #[arg(long, help_heading = "Output")]
    pub(crate) json: bool,
}

/// `meshwork train`'s flags.
#[derive(Debug, Args)]
#[command(allow_negative_numbers = true)]
pub(crate) struct TrainArgs {
    /// The model (see `meshwork help train --model M` for its defaults and flags); default: the one --init DIR's config.json, --resume's checkpoint or --preset names, else mlp
    #[arg(help_heading = "Model", long, value_enum)]
    pub(crate) model: Option<Model>,
    /// How a language model's causal attention runs: cudnn (cuDNN's fused attention, NVIDIA GPUs, bf16/f16, head dim a multiple of 8 up to 128) or xla (its primitive ops: XLA's own lowering, and on the interpreter one op at a time); default: cudnn where the back end is a CUDA one and cuDNN takes it, on the interpreter its fused CPU kernel (f32, f64)
    #[arg(help_heading = "Model", long, value_enum)]
    attention: Option<AttentionArg>,
    /// The weights' dtype (default f64 for the MLP, else f32)
    #[arg(help_heading = "Model", long, value_enum)]
    dtype: Option<Float>,
    /// The dtype products compute in (bf16, f16: mixed precision, the weights and optimizer state staying in --dtype)
    #[arg(help_heading = "Model", long, value_enum, default_value_t = PrecisionArg::Full)]
    precision: PrecisionArg,
    /// f16's first loss scale (default 65536; halved after a step with non-finite gradients, which is skipped, and doubled after 2000 finite steps, as PyTorch's GradScaler)
    #[arg(help_heading = "Model", long, value_name = "S")]
    loss_scale_init: Option<f64>,
    /// The MLP's hidden units (default 32)
    #[arg(help_heading = "Model", long, value_name = "H")]
    hidden: Option<usize>,
    /// The MLP's classes (default: the largest label + 1)
    #[arg(help_heading = "Model", long, value_name = "N")]
    classes: Option<usize>,
    /// The CNN's two convolutions' filters (default 8,16)
    #[arg(help_heading = "Model", long, value_name = "F1,F2", value_parser = two_counts)]
    filters: Option<[usize; 2]>,
    #[command(flatten)]
    sizes: Sizes,
    /// Initial weights (safetensors, f32 or f64), by the model's names; for GPT-2 and the Llama family a Hugging Face checkpoint folder (config.json, model.safetensors or a sharded index), which also names the model
    #[arg(help_heading = "Model", long, value_name = "INIT")]
    init: Option<PathBuf>,
    /// Sizes by name without a checkpoint: GPT-2's tiny (default), gpt2, gpt2-medium; the Llama family's tiny-llama (default), smollm2-135m, qwen2.5-0.5b, llama-3.2-1b
    #[arg(help_heading = "Model", long, value_name = "NAME")]
    preset: Option<String>,
    /// Rows per step (default 64, CNN 32, transformer 8); step s takes rows s·B … s·B+B−1 of the data (mod its size)
    #[arg(help_heading = "Data", long, value_name = "B")]
    batch: Option<usize>,
    /// ... or the rows in a per-epoch permutation drawn from --seed
    #[arg(help_heading = "Data", long)]
    shuffle: bool,
    /// Seeds the built-in data, the initial weights and --shuffle
    #[arg(help_heading = "Data", long, value_name = "S", default_value_t = 0)]
    seed: u64,
    /// Features or images [rows, ...] (.npy) instead of the built-in data
    #[arg(help_heading = "Data", long, value_name = "X.npy", requires = "data_y", conflicts_with_all = ["text", "data_tokens"])]
    data_x: Option<PathBuf>,
    /// Labels: class ids [rows] or one-hot [rows, classes] (.npy)
    #[arg(help_heading = "Data", long, value_name = "Y.npy", requires = "data_x")]
    data_y: Option<PathBuf>,
    /// The transformer's token rows [rows, seq + 1] (.npy)
    #[arg(help_heading = "Data", long, value_name = "TOKENS.npy", conflicts_with = "text")]
    data_tokens: Option<PathBuf>,
    /// A text file, encoded by the tokenizer into consecutive rows (or whose bytes are the transformer's tokens, --vocab 256); or several files and directories (their .txt and .jsonl files, by name), each text one document and each .jsonl line one, the tokenizer's end-of-text token between them
    #[arg(help_heading = "Data", long, value_name = "FILE|DIR", num_args = 1..)]
    text: Vec<PathBuf>,
    /// A JSON Lines file, one document per line in --text-field: encoded one by one by the tokenizer (--tokenizer, or --init DIR's), its end-of-text token between documents, then cut into rows as --text is
    #[arg(help_heading = "Data", long, value_name = "FILE.jsonl", conflicts_with_all = ["text", "data_tokens", "data_x"])]
    data_jsonl: Option<PathBuf>,
    /// The field of each --data-jsonl (and .jsonl --eval-data) line that holds its document (default: text)
    #[arg(help_heading = "Data", long, value_name = "F")]
    text_field: Option<String>,
    /// A Hugging Face tokenizer.json that encodes --text (consecutive rows of --seq + 1 tokens, the tail dropped); default: --init DIR's tokenizer.json
    #[arg(help_heading = "Data", long, value_name = "tokenizer.json")]
    tokenizer: Option<PathBuf>,
    /// Where --text encoded by a tokenizer is cached as .npy rows, keyed by the SHA-256 of the text, the tokenizer and --seq (default: meshwork's folder in the user's cache directory, $XDG_CACHE_HOME/meshwork or ~/.cache/meshwork)
    #[arg(help_heading = "Data", long, value_name = "DIR")]
    cache_dir: Option<PathBuf>,
    /// Evaluate on held-out rows every N steps (and after the last)
    #[arg(help_heading = "Data", long, value_name = "N")]
    eval_every: Option<usize>,
    /// The fraction of the rows held out for --eval-every (default 0.1)
    #[arg(help_heading = "Data", long, value_name = "F")]
    eval_fraction: Option<f64>,
    /// A validation set evaluated every --eval-every steps (default: after the last) instead of held-out rows: token rows (.npy), documents (.jsonl, --text-field) or a text, cut into rows of --seq + 1 as the training data are
    #[arg(help_heading = "Data", long, value_name = "FILE", conflicts_with = "eval_fraction")]
    eval_data: Option<PathBuf>,
    /// The last step (default 200 for the MLP, else 100); a resumed run continues up to it
    #[arg(help_heading = "Optimizer", long, value_name = "N")]
    steps: Option<usize>,
    /// Instead of --steps: as many steps as take N passes over the training rows (with --shuffle, each pass in its own order)
    #[arg(help_heading = "Optimizer", long, value_name = "N", conflicts_with = "steps")]
    epochs: Option<usize>,
    /// The optimizer (default sgd for the MLP, else adam; adamw under a fine-tune's defaults)
    #[arg(help_heading = "Optimizer", long, value_enum)]
    optimizer: Option<Optimizer>,
    #[command(flatten)]
    optimizer_flags: OptimizerFlags,
    /// Learning rate (default 0.5 for the MLP; 0.01 with adam or adamw, else 0.1; 5e-5 under a fine-tune's defaults)
    #[arg(help_heading = "Optimizer", long, value_name = "LR")]
    lr: Option<f64>,
    /// Linear warm-up of the learning rate over N steps
    #[arg(help_heading = "Optimizer", long, value_name = "N", default_value_t = 0)]
    warmup: usize,
    /// The learning rate after warm-up (default constant; linear under a fine-tune's defaults)
    #[arg(help_heading = "Optimizer", long, value_enum)]
    schedule: Option<ScheduleArg>,
    /// Where a linear or cosine decay ends, reached at the last step (default: 0, one step past the last, as transformers' schedulers)
    #[arg(help_heading = "Optimizer", long, value_name = "LR")]
    min_lr: Option<f64>,
    /// Clip the gradients to this global norm
    #[arg(help_heading = "Optimizer", long, value_name = "NORM")]
    clip_norm: Option<f64>,
    #[command(flatten)]
    lora: LoraFlags,
    /// Data x model devices (default 2x2 for the MLP on the interpreter, else 1x1; each device is a thread)
    #[arg(help_heading = "Mesh and back end", long, value_name = "DxM", value_parser = mesh_2d)]
    mesh: Option<(usize, usize)>,
    /// What runs the steps: meshwork's interpreter on CPU threads, or XLA through a PJRT plugin (one device, a mesh or a pipeline)
    #[arg(help_heading = "Mesh and back end", long, value_enum, default_value_t = BackendArg::Interpreter)]
    backend: BackendArg,
    /// Who splits a mesh's step with --backend xla: meshwork's partitioner (per-device programs), or XLA's (the global program with its shardings, as jax.jit)
    #[arg(help_heading = "Mesh and back end", long, value_enum, default_value_t = PartitionerArg::Meshwork)]
    partitioner: PartitionerArg,
    /// The PJRT plugin for --backend xla (default: $MESHWORK_PJRT_PLUGIN); `pip install xla-cpu-pjrt` for CPUs, `pip install "jax[cuda13]"` for NVIDIA GPUs
    #[arg(help_heading = "Mesh and back end", long, value_name = "PATH")]
    pjrt_plugin: Option<PathBuf>,
    /// A pipeline of K stages per data replica (--mesh Dx1)
    #[arg(help_heading = "Mesh and back end", long, value_name = "K")]
    stages: Option<usize>,
    /// Micro-batches per replica and step in a pipeline (default 1)
    #[arg(help_heading = "Mesh and back end", long, value_name = "M")]
    microbatches: Option<usize>,
    #[command(flatten)]
    memory: MemoryFlags,
    /// Steps per host call
    #[arg(help_heading = "Mesh and back end", long, value_name = "N", default_value_t = 1)]
    steps_per_run: usize,
    /// Refuse a run estimated to hold more than SIZE (suffixes K, M, G, T; default 8G)
    #[arg(help_heading = "Mesh and back end", long, value_name = "SIZE", value_parser = bytes)]
    max_memory: Option<u64>,
    /// Check every step against one device's (from the run's state) even for a large run
    #[arg(help_heading = "Mesh and back end", long, conflicts_with = "no_check")]
    check: bool,
    /// Skip the comparison with a one-device run of the same steps
    #[arg(help_heading = "Mesh and back end", long)]
    no_check: bool,
    /// Continue from a checkpoint directory (its latest complete step) or one step-NNNNNNNN/ in it, on any mesh; what the run was given (data, tokenizer, --seq, --batch, --steps, optimizer, schedule, seed, checkpoint directory) is taken from it unless given again
    #[arg(help_heading = "Checkpoints", long, value_name = "PATH")]
    resume: Option<PathBuf>,
    /// With --resume: train on a data file that changed since the checkpoint's run read it (refused otherwise)
    #[arg(help_heading = "Checkpoints", long, requires = "resume")]
    data_changed_ok: bool,
    /// A checkpoint directory meshwork owns: created if absent, or an empty or earlier meshwork checkpoint directory (anything else is refused, never changed); saved at the end and every N steps. Default for a fine-tune (--init a Hugging Face folder, not resumed): a new meshwork-runs/FOLDER-N in the working directory
    #[arg(help_heading = "Checkpoints", long, value_name = "DIR")]
    checkpoint_dir: Option<PathBuf>,
    /// Save no checkpoint where a fine-tune would save one by default
    #[arg(help_heading = "Checkpoints", long, conflicts_with = "checkpoint_dir")]
    no_checkpoints: bool,
    /// Save a checkpoint every N steps
    #[arg(help_heading = "Checkpoints", long, value_name = "N")]
    checkpoint_every: Option<usize>,
    /// Checkpoints kept in --checkpoint-dir, newest first (default 3)
    #[arg(help_heading = "Checkpoints", long, value_name = "N")]
    keep: Option<usize>,
    /// Write the trained adapter as a peft folder (new or empty) that PeftModel.from_pretrained loads
    #[arg(help_heading = "Output", long, value_name = "DIR")]
    export_lora: Option<PathBuf>,
    /// GPT-2 and the Llama family: write the final weights as a Hugging Face checkpoint folder (new or empty) that transformers' from_pretrained loads
    #[arg(help_heading = "Output", long, value_name = "DIR")]
    export_hf: Option<PathBuf>,
    /// No progress and no summary (errors still say what failed)
    #[arg(help_heading = "Output", long)]
    quiet: bool,
    /// A progress line (step, loss, lr, speed) every N steps, never a progress bar (default: a bar on a terminal, else a line a tenth of the run apart)
    #[arg(help_heading = "Output", long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..), conflicts_with = "quiet")]
    log_every: Option<u64>,
    /// Every step's global loss as a JSON list, written at the end, at every checkpoint and when the run fails or is interrupted (a resumed run's holds the earlier steps too: give the file the saving run wrote); an existing file is replaced only if it is such a list
    #[arg(help_heading = "Output", long, value_name = "FILE")]
    losses_json: Option<PathBuf>,
    /// A JSON line per step as the run goes (a new file): step, loss, lr, tokens (or examples) per second, the gradients' global norm (grad_norm, before clipping), the evaluation's loss when there is one
    #[arg(help_heading = "Output", long, value_name = "FILE")]
    metrics_jsonl: Option<PathBuf>,
    /// The train and eval losses and the learning rate per step as an SVG chart (a new file)
    #[arg(help_heading = "Output", long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
}

impl TrainArgs {
    /// Whether `--quiet` was given.
    pub(crate) fn quiet(&self) -> bool {
        self.quiet
    }

    /// The checkpoint directory a fine-tune saves into when none is given, claimed
    /// (made, so that two runs never take the same one): the first
    /// `meshwork-runs/<--init folder's name>-<n>` (n = 1, 2, …) that this call could
    /// create, for a run from a Hugging Face folder (its `config.json`) that neither
    /// resumes nor says `--checkpoint-dir` or `--no-checkpoints`; and whether this
    /// call made `meshwork-runs` too.
    pub(crate) fn claim_checkpoint_dir(&self) -> Result<Option<(PathBuf, bool)>, Exit> {
        let Some(name) = self.default_run_name() else { return Ok(None) };
        let parent = PathBuf::from("meshwork-runs");
        let cannot = |p: &std::path::Path, e: std::io::Error| {
            Exit::Usage(format!(
                "--checkpoint-dir (default {}): cannot create it: {e}; give --checkpoint-dir or --no-checkpoints",
                p.display()
            ))
        };
        let made = match std::fs::create_dir(&parent) {
            Ok(()) => true,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => false,
            Err(e) => return Err(cannot(&parent, e)),
        };
        for n in 1..10_000u32 {
            let dir = parent.join(format!("{name}-{n}"));
            match std::fs::create_dir(&dir) {
                Ok(()) => return Ok(Some((dir, made))),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(cannot(&dir, e)),
            }
        }
        Err(Exit::Usage(format!(
            "--checkpoint-dir: {} holds 9999 runs of {name}; give --checkpoint-dir or --no-checkpoints",
            parent.display()
        )))
    }

    /// The name a fine-tune's default checkpoint directory starts with: its `--init`
    /// folder's, when one is due ([`claim_checkpoint_dir`](Self::claim_checkpoint_dir)).
    fn default_run_name(&self) -> Option<String> {
        let init = self.init.as_ref().filter(|d| d.join("config.json").is_file())?;
        if self.checkpoint_dir.is_some() || self.no_checkpoints || self.resume.is_some() {
            return None;
        }
        let name = std::path::absolute(init)
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .filter(|n| !n.is_empty() && !n.starts_with('.'))
            .unwrap_or_else(|| "run".into());
        Some(name)
    }

    /// `--log-every`.
    pub(crate) fn log_every(&self) -> Option<usize> {
        self.log_every.map(|n| usize::try_from(n).unwrap_or(usize::MAX))
    }

    /// The run's settings; a flag that needs another is a usage error.
    pub(crate) fn config(&self) -> Result<Config, Exit> {
        let field = self.text_field.clone().unwrap_or_else(|| "text".into());
        // One text file keeps its meaning (the tokenizer's, or the transformer's
        // bytes); several files or a directory are documents.
        let text = match self.text.as_slice() {
            [] => None,
            [one] if !one.is_dir() && !meshwork_train::tokenize::is_jsonl(one) => {
                Some(Data::Text(one.clone()))
            }
            many => {
                let files =
                    meshwork_train::tokenize::text_files(many).map_err(crate::train::exit)?;
                Some(Data::Documents { paths: files, field: field.clone() })
            }
        };
        let data = match (&self.data_x, &self.data_y, text, &self.data_tokens) {
            (Some(x), Some(y), _, _) => Data::Npy { x: x.clone(), y: y.clone() },
            (_, _, Some(t), _) => t,
            (_, _, _, Some(t)) => Data::Tokens(t.clone()),
            _ => match &self.data_jsonl {
                Some(path) => Data::Jsonl { path: path.clone(), field: field.clone() },
                None => Data::BuiltIn,
            },
        };
        // --eval-data's kind by its name: token rows, documents, else a text.
        let eval_data = self.eval_data.as_ref().map(|p| {
            match p.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase).as_deref() {
                Some("npy") => Data::Tokens(p.clone()),
                Some("jsonl") => Data::Jsonl { path: p.clone(), field: field.clone() },
                _ => Data::Text(p.clone()),
            }
        });
        let jsonl = |d: &Data| match d {
            Data::Jsonl { .. } => true,
            Data::Documents { paths, .. } => {
                paths.iter().any(|p| meshwork_train::tokenize::is_jsonl(p))
            }
            _ => false,
        };
        if self.text_field.is_some() && !jsonl(&data) && !eval_data.as_ref().is_some_and(jsonl) {
            return Err(Exit::Usage(
                "--text-field names the field of .jsonl lines (--data-jsonl, --text or --eval-data); give one"
                    .into(),
            ));
        }
        // A tokenizer that encodes --text: --tokenizer, or --init's folder's.
        let folder_tokenizer =
            self.init.as_ref().is_some_and(|d| d.is_dir() && d.join("tokenizer.json").is_file());
        let documents =
            |d: &Data| matches!(d, Data::Text(_) | Data::Jsonl { .. } | Data::Documents { .. });
        let texts = documents(&data) || eval_data.as_ref().is_some_and(documents);
        let tokenizes = self.tokenizer.is_some() || (texts && folder_tokenizer);
        Ok(Config {
            model: self.model.map_or(ModelKind::Auto, Into::into),
            layers: self.sizes.layers,
            dim: self.sizes.dim,
            heads: self.sizes.heads,
            ffn: self.sizes.ffn,
            vocab: self.sizes.vocab,
            seq: self.sizes.seq,
            positions: self.sizes.positions,
            attention: self.attention.map(Into::into),
            hidden: self.hidden,
            classes: self.classes,
            filters: self.filters,
            data,
            init: self.init.clone(),
            preset: self.preset.clone(),
            tokenizer: self.tokenizer.clone(),
            cache_dir: match (&self.cache_dir, tokenizes) {
                (Some(dir), _) => Some(dir.clone()),
                (None, true) => meshwork_train::tokenize::default_cache_dir(),
                (None, false) => None,
            },
            export_hf: self.export_hf.clone(),
            lora: self.lora.settings(),
            export_lora: self.export_lora.clone(),
            base_dtype: self.lora.base_dtype(),
            resume: self.resume.clone(),
            mesh: self.mesh,
            backend: backend_kind(self.backend, &self.pjrt_plugin, self.partitioner)?,
            stages: self.stages,
            microbatches: self.microbatches,
            steps: self.steps,
            epochs: self.epochs,
            batch: self.batch,
            optimizer: self.optimizer.map(Into::into),
            optimizer_settings: self.optimizer_flags.settings(),
            lr: self.lr,
            dtype: self.dtype.map(Into::into),
            seed: self.seed,
            shuffle: self.shuffle,
            warmup: self.warmup,
            schedule: self.schedule.map(|s| match s {
                ScheduleArg::Constant => Schedule::Constant,
                ScheduleArg::Cosine => Schedule::Cosine,
                ScheduleArg::Linear => Schedule::Linear,
            }),
            min_lr: self.min_lr,
            data_changed_ok: self.data_changed_ok,
            clip_norm: self.clip_norm,
            grad_accum: self.memory.grad_accum,
            remat: self.memory.remat,
            fsdp: self.memory.fsdp,
            precision: self.precision.dtype(),
            loss_scale_init: self.loss_scale_init,
            blocking: None,
            processes: None,
            eval_every: self.eval_every,
            eval_fraction: self.eval_fraction,
            eval_data,
            checkpoint_dir: self.checkpoint_dir.clone(),
            checkpoint_every: self.checkpoint_every,
            keep: self.keep,
            steps_per_run: self.steps_per_run,
            max_memory: self.max_memory.unwrap_or(DEFAULT_MAX_MEMORY),
            check: if self.check {
                Check::Always
            } else if self.no_check {
                Check::Never
            } else {
                Check::Auto
            },
            losses_json: self.losses_json.clone(),
            metrics_jsonl: self.metrics_jsonl.clone(),
            plot: self.plot.clone(),
        })
    }
}

/// `--backend`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum BackendArg {
    /// meshwork's interpreter on CPU threads.
    Interpreter,
    /// XLA through a PJRT plugin (--pjrt-plugin or MESHWORK_PJRT_PLUGIN).
    Xla,
}

/// `--attention`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum AttentionArg {
    /// cuDNN's fused attention.
    Cudnn,
    /// Its primitive ops (XLA's own lowering).
    Xla,
}

impl From<AttentionArg> for meshwork_train::AttentionKind {
    fn from(a: AttentionArg) -> Self {
        match a {
            AttentionArg::Cudnn => meshwork_train::AttentionKind::Cudnn,
            AttentionArg::Xla => meshwork_train::AttentionKind::Xla,
        }
    }
}

/// `--partitioner`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum PartitionerArg {
    /// meshwork's partitioner: per-device programs with its collectives.
    Meshwork,
    /// XLA's SPMD partitioner (--backend xla).
    Xla,
}

/// The partitioner `--partitioner` names.
fn partitioner_of(partitioner: PartitionerArg) -> Partitioner {
    match partitioner {
        PartitionerArg::Meshwork => Partitioner::Meshwork,
        PartitionerArg::Xla => Partitioner::Xla,
    }
}

/// The back end `--backend`, `--pjrt-plugin` and `--partitioner` name.
fn backend_kind(
    backend: BackendArg,
    plugin: &Option<PathBuf>,
    partitioner: PartitionerArg,
) -> Result<BackendKind, Exit> {
    let partitioner = partitioner_of(partitioner);
    match backend {
        BackendArg::Interpreter if partitioner == Partitioner::Xla => Err(Exit::Usage(
            "--partitioner xla needs --backend xla (the interpreter runs meshwork's partitions)"
                .into(),
        )),
        BackendArg::Interpreter if plugin.is_some() => Err(Exit::Usage(
            "--pjrt-plugin: nothing here loads a plugin; add --backend xla (or --target) to run on it"
                .into(),
        )),
        BackendArg::Interpreter => Ok(BackendKind::Interpreter),
        BackendArg::Xla => Ok(BackendKind::Xla { plugin: plugin.clone(), partitioner }),
    }
}

/// `meshwork tokenize`'s flags.
#[derive(Debug, Args)]
#[command(allow_negative_numbers = true)]
pub(crate) struct TokenizeArgs {
    /// The text file to encode (UTF-8; encoded in chunks, with the ids of encoding it whole)
    #[arg(long, value_name = "FILE")]
    pub(crate) text: PathBuf,
    /// A Hugging Face tokenizer.json
    #[arg(long, value_name = "tokenizer.json")]
    pub(crate) tokenizer: PathBuf,
    /// Rows of T + 1 tokens: consecutive, non-overlapping, the tail dropped (as train --text --tokenizer --seq T cuts them)
    #[arg(long, value_name = "T")]
    pub(crate) seq: usize,
    /// The .npy file to write ([rows, T + 1], int32; a new file), which train --data-tokens reads
    #[arg(long, value_name = "FILE.npy")]
    pub(crate) out: PathBuf,
    /// Refuse a text whose ids would hold more than SIZE (suffixes K, M, G, T)
    #[arg(long, value_name = "SIZE", value_parser = bytes, default_value = "8G")]
    pub(crate) max_memory: u64,
}

/// `meshwork generate`'s flags.
#[derive(Debug, Args)]
#[command(allow_negative_numbers = true)]
pub(crate) struct GenerateArgs {
    /// A Hugging Face checkpoint folder (config.json, model.safetensors) of GPT-2 or the Llama family, or a meshwork checkpoint of one (a checkpoint directory or one step-NNNNNNNN/ in it)
    #[arg(long, value_name = "DIR")]
    init: PathBuf,
    /// The prompt's token ids, comma-separated
    #[arg(long, value_name = "IDS", value_delimiter = ',', num_args = 1.., required_unless_present_any = ["prompt", "chat"], conflicts_with_all = ["prompt", "chat"])]
    prompt_ids: Vec<i64>,
    /// The prompt as text, encoded by the tokenizer
    #[arg(long, value_name = "TEXT", conflicts_with = "chat")]
    prompt: Option<String>,
    /// A conversation, a JSON list of {"role", "content"}: the prompt is the folder's chat template rendered with a generation prompt, encoded by the tokenizer
    #[arg(long, value_name = "MESSAGES.json")]
    chat: Option<PathBuf>,
    /// A Hugging Face tokenizer.json: encodes --prompt or --chat, decodes the new tokens ("text" in --json); default: --init's tokenizer.json (a checkpoint's: the one its run used)
    #[arg(long, value_name = "tokenizer.json")]
    tokenizer: Option<PathBuf>,
    /// How many tokens to generate after the prompt
    #[arg(long, value_name = "N")]
    max_new_tokens: usize,
    /// Softmax temperature; 0 picks the likeliest token (greedy)
    #[arg(long, value_name = "X", default_value_t = 0.0)]
    temperature: f64,
    /// Sample among the K likeliest tokens
    #[arg(long, value_name = "K")]
    top_k: Option<usize>,
    /// Sample among the likeliest tokens whose probabilities reach P
    #[arg(long, value_name = "P")]
    top_p: Option<f64>,
    /// The sampling's seed
    #[arg(long, value_name = "S", default_value_t = 0)]
    seed: u64,
    /// The computation's dtype
    #[arg(long, value_enum, default_value_t = Float::F32)]
    dtype: Float,
    /// What runs the steps: meshwork's interpreter, or XLA through a PJRT plugin
    #[arg(long, value_enum, default_value_t = BackendArg::Interpreter)]
    backend: BackendArg,
    /// The PJRT plugin for --backend xla (default: $MESHWORK_PJRT_PLUGIN)
    #[arg(long, value_name = "PATH")]
    pjrt_plugin: Option<PathBuf>,
    /// Refuse a checkpoint of more than SIZE (suffixes K, M, G, T)
    #[arg(long, value_name = "SIZE", value_parser = bytes, default_value = "8G")]
    max_memory: u64,
    /// A peft LoRA adapter folder (adapter_config.json, adapter_model.safetensors) merged into the weights before decoding
    #[arg(long, value_name = "DIR")]
    pub(crate) lora: Option<PathBuf>,
    /// Print {"prompt_ids": [...], "ids": [...], "text": "..."} ("text" with --tokenizer) instead of a line of ids
    #[arg(long)]
    pub(crate) json: bool,
    /// Write the logits each new token was picked from to FILE.npy ([new tokens, vocabulary], float64; a new file)
    #[arg(long, value_name = "FILE.npy")]
    pub(crate) logits: Option<PathBuf>,
}

impl GenerateArgs {
    /// The generation's settings.
    pub(crate) fn config(&self) -> Result<meshwork_train::generate::GenerateConfig, Exit> {
        // The tokenizer: --tokenizer, or the folder's (for a text or chat prompt, or to
        // decode).
        let tokenizer =
            self.tokenizer.clone().or_else(|| meshwork_train::generate::tokenizer_of(&self.init));
        let needs = || {
            tokenizer.clone().ok_or_else(|| {
                Exit::Usage(format!(
                    "--tokenizer: {} has no tokenizer.json; give --tokenizer to encode the prompt",
                    self.init.display()
                ))
            })
        };
        let exit = crate::train::exit;
        let prompt_ids = match (&self.prompt, &self.chat) {
            (Some(text), _) => {
                meshwork_train::generate::prompt_ids(&needs()?, text).map_err(exit)?
            }
            (None, Some(messages)) => {
                // A checkpoint's chat template is its tokenizer's folder's.
                let tokenizer = needs()?;
                let folder = match self.init.join("config.json").exists() {
                    true => self.init.clone(),
                    false => tokenizer.parent().map_or_else(|| self.init.clone(), Into::into),
                };
                meshwork_train::chat::chat_prompt_ids(&folder, &tokenizer, messages)
                    .map_err(exit)?
            }
            (None, None) => self.prompt_ids.clone(),
        };
        // An empty prompt is the flag's that gave it.
        if prompt_ids.is_empty() {
            let flag = if self.prompt.is_some() { "--prompt" } else { "--chat" };
            if self.prompt.is_some() || self.chat.is_some() {
                return Err(Exit::Usage(format!(
                    "{flag}: it encodes to no tokens; generation needs at least one"
                )));
            }
        }
        Ok(meshwork_train::generate::GenerateConfig {
            init: self.init.clone(),
            prompt_ids,
            tokenizer,
            max_new_tokens: self.max_new_tokens,
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            seed: self.seed,
            dtype: self.dtype.into(),
            backend: backend_kind(self.backend, &self.pjrt_plugin, PartitionerArg::Meshwork)?,
            max_memory: self.max_memory,
            lora: self.lora.clone(),
            keep_logits: self.logits.is_some(),
        })
    }
}

/// `meshwork inspect`'s flags.
#[derive(Debug, Args)]
#[command(allow_negative_numbers = true)]
pub(crate) struct InspectArgs {
    /// The model (default: the one --init DIR's config.json or --preset names, else mlp)
    #[arg(long, value_enum)]
    model: Option<Model>,
    /// Data x model devices (default 1x2; with --target, its GPUs along the data axis)
    #[arg(long, value_name = "DxM", value_parser = mesh_2d)]
    mesh: Option<(usize, usize)>,
    #[command(flatten)]
    sizes: Sizes,
    /// Compile the step for GPUs that are not here and report XLA's memory per device, whether it fits, and a roofline: h100 (one), h100xN (N on one host), HxGPUxN (H hosts of N); GPUs: h100, a100. Needs the CUDA plugin (--pjrt-plugin or $MESHWORK_PJRT_PLUGIN: jax-cuda13-pjrt's xla_cuda_plugin.so), no GPU
    #[arg(long, value_name = "T")]
    pub(crate) target: Option<String>,
    /// With --target: the GPU's XLA target config (a GpuTargetConfigProto text file) in place of the shipped one
    #[arg(long, value_name = "FILE.txtpb")]
    target_config: Option<PathBuf>,
    /// With --target: write XLA's optimized module of one device's step (a serialized HloModuleProtoWithConfig; a new file)
    #[arg(long, value_name = "FILE")]
    pub(crate) optimized_hlo: Option<PathBuf>,
    /// The sizes from a file's tensors (safetensors; for GPT-2 and the Llama family a Hugging Face checkpoint folder, which also names the model)
    #[arg(long, value_name = "INIT")]
    init: Option<PathBuf>,
    /// Sizes by name: GPT-2's tiny, gpt2, gpt2-medium; the Llama family's tiny-llama, smollm2-135m, qwen2.5-0.5b, llama-3.2-1b
    #[arg(long, value_name = "NAME")]
    preset: Option<String>,
    /// Rows per step
    #[arg(long, value_name = "B", default_value_t = 8)]
    batch: usize,
    #[command(flatten)]
    memory: MemoryFlags,
    #[command(flatten)]
    lora: LoraFlags,
    /// The optimizer
    #[arg(long, value_enum, default_value_t = Optimizer::Adam)]
    optimizer: Optimizer,
    #[command(flatten)]
    optimizer_flags: OptimizerFlags,
    /// The weights' dtype
    #[arg(long, value_enum, default_value_t = Float::F32)]
    dtype: Float,
    /// With --json: the dtype products compute in
    #[arg(long, value_enum, default_value_t = PrecisionArg::Full)]
    precision: PrecisionArg,
    /// Refuse a step estimated to hold more than SIZE (suffixes K, M, G, T)
    #[arg(long, value_name = "SIZE", value_parser = bytes, default_value = "8G")]
    max_memory: u64,
    /// xla: print the per-device step as the StableHLO module XLA compiles (no plugin needed); with --json, run on XLA (default: interpreter; with --target, xla)
    #[arg(long, value_enum)]
    backend: Option<BackendArg>,
    /// The PJRT plugin for --backend xla --json (default: $MESHWORK_PJRT_PLUGIN)
    #[arg(long, value_name = "PATH")]
    pjrt_plugin: Option<PathBuf>,
    /// With --backend xla: who splits the step (meshwork, or XLA's partitioner)
    #[arg(long, value_enum, default_value_t = PartitionerArg::Meshwork)]
    partitioner: PartitionerArg,
    /// How a language model's causal attention runs: cudnn (cuDNN's fused attention, NVIDIA GPUs, bf16/f16, head dim a multiple of 8 up to 128) or xla (its primitive ops: XLA's own lowering, and on the interpreter one op at a time); default: cudnn where the back end is a CUDA one and cuDNN takes it, on the interpreter its fused CPU kernel (f32, f64)
    #[arg(long, value_enum)]
    attention: Option<AttentionArg>,
    /// With --json: a pipeline of K stages per data replica (--mesh Dx1)
    #[arg(long, value_name = "K")]
    stages: Option<usize>,
    /// With --json: micro-batches per replica and step in a pipeline
    #[arg(long, value_name = "M")]
    microbatches: Option<usize>,
    /// Run 3 steps of any --model and print, as one JSON object, what the run really does: bytes held per device, bytes moved per step, compilations (read from the runtime)
    #[arg(long)]
    pub(crate) json: bool,
}

impl InspectArgs {
    /// The step's settings, as a training run's.
    pub(crate) fn config(&self) -> Result<Config, Exit> {
        let targeted = self.target.is_some();
        if !targeted && (self.target_config.is_some() || self.optimized_hlo.is_some()) {
            return Err(Exit::Usage("--target-config and --optimized-hlo need --target".into()));
        }
        if targeted && self.backend == Some(BackendArg::Interpreter) {
            return Err(Exit::Usage(
                "--target compiles with XLA; drop --backend interpreter".into(),
            ));
        }
        let planned = self.json || targeted;
        if !planned && (self.stages.is_some() || self.microbatches.is_some()) {
            return Err(Exit::Usage("--stages and --microbatches need --json".into()));
        }
        let m = &self.memory;
        let precise = self.precision != PrecisionArg::Full;
        if !planned && (m.grad_accum.is_some() || m.remat || m.fsdp || precise) {
            return Err(Exit::Usage(
                "--grad-accum, --remat, --fsdp and --precision need --json (which runs the step they change) or --target".into(),
            ));
        }
        if !planned && self.partitioner == PartitionerArg::Xla {
            return Err(Exit::Usage(
                "--partitioner xla: without --json inspect prints meshwork's per-device module; add --json to run and measure XLA's partitioning".into(),
            ));
        }
        let backend = match &self.target {
            Some(target) => BackendKind::XlaTarget {
                plugin: self.pjrt_plugin.clone(),
                partitioner: partitioner_of(self.partitioner),
                target: target.clone(),
                target_config: self.target_config.clone(),
            },
            None => backend_kind(
                self.backend.unwrap_or(BackendArg::Interpreter),
                &self.pjrt_plugin,
                self.partitioner,
            )?,
        };
        let mesh = match (self.mesh, &self.target) {
            (Some(mesh), _) => mesh,
            (None, Some(t)) => {
                let devices = meshwork_train::target_devices(t).map_err(crate::train::exit)?;
                (devices, 1)
            }
            (None, None) => (1, 2),
        };
        Ok(Config {
            layers: self.sizes.layers,
            dim: self.sizes.dim,
            heads: self.sizes.heads,
            ffn: self.sizes.ffn,
            vocab: self.sizes.vocab,
            seq: self.sizes.seq,
            positions: self.sizes.positions,
            attention: self.attention.map(Into::into),
            init: self.init.clone(),
            preset: self.preset.clone(),
            grad_accum: self.memory.grad_accum,
            remat: self.memory.remat,
            fsdp: self.memory.fsdp,
            precision: self.precision.dtype(),
            mesh: Some(mesh),
            batch: Some(self.batch),
            optimizer: Some(self.optimizer.into()),
            optimizer_settings: self.optimizer_flags.settings(),
            dtype: Some(self.dtype.into()),
            max_memory: self.max_memory,
            backend,
            stages: self.stages,
            microbatches: self.microbatches,
            steps: Some(3),
            check: Check::Never,
            lora: self.lora.settings(),
            base_dtype: self.lora.base_dtype(),
            ..Config::new(self.model.map_or(ModelKind::Auto, Into::into))
        })
    }
}

/// An array's shape and a named mesh: what `shard` and `reshard` lay out.
#[derive(Debug, Args)]
pub(crate) struct ArrayOnMesh {
    /// The array's shape
    #[arg(long, value_name = "8,8")]
    pub(crate) shape: String,
    /// The mesh's axis sizes
    #[arg(long, value_name = "2x4")]
    pub(crate) mesh: String,
    /// The mesh's axis names
    #[arg(long, value_name = "a,b")]
    pub(crate) axes: String,
}

/// `meshwork shard`'s flags.
#[derive(Debug, Args)]
#[command(allow_negative_numbers = true)]
pub(crate) struct ShardArgs {
    #[command(flatten)]
    pub(crate) array: ArrayOnMesh,
    /// A JAX PartitionSpec over the named mesh axes, no longer than the array's rank, or an XLA sharding such as "{devices=[2,4]<=[8]}" over the mesh's devices
    #[arg(long, value_name = "SPEC")]
    pub(crate) spec: String,
}

/// `meshwork reshard`'s flags.
#[derive(Debug, Args)]
#[command(allow_negative_numbers = true)]
pub(crate) struct ReshardArgs {
    #[command(flatten)]
    pub(crate) array: ArrayOnMesh,
    /// The source sharding (a PartitionSpec or an XLA sharding)
    #[arg(long, value_name = "SPEC")]
    pub(crate) from: String,
    /// The target sharding
    #[arg(long, value_name = "SPEC")]
    pub(crate) to: String,
    /// The element type the bytes are counted in
    #[arg(long, value_name = "DTYPE", default_value = "f32")]
    pub(crate) dtype: String,
}

/// `meshwork place`'s flags.
#[derive(Debug, Args)]
#[command(allow_negative_numbers = true)]
pub(crate) struct PlaceArgs {
    /// The graph
    #[arg(value_name = "GRAPH.json")]
    pub(crate) graph: PathBuf,
    /// The devices, like CPU:0,CPU:1,GPU:0
    #[arg(long, value_name = "DEVICES")]
    pub(crate) devices: String,
    /// The op catalog, if not in the graph file
    #[arg(long, value_name = "CATALOG.json")]
    pub(crate) ops: Option<PathBuf>,
    /// Soft placement: an op's unsupported device request falls back
    #[arg(long)]
    pub(crate) soft: bool,
    /// The placed graph in Graphviz's dot
    #[arg(long)]
    pub(crate) dot: bool,
    /// Why NODE landed where it did
    #[arg(long, value_name = "NODE")]
    pub(crate) explain: Option<String>,
}

/// The `--model` named in `argv` (for the train page's notes), if it names one.
pub(crate) fn model_named(argv: &[String]) -> Option<Model> {
    let mut named = None;
    for (k, a) in argv.iter().enumerate() {
        let value = match a.strip_prefix("--model=") {
            Some(v) => Some(v),
            None if a == "--model" => argv.get(k + 1).map(String::as_str),
            None => None,
        };
        if let Some(v) = value {
            named = Model::from_str(v, false).ok();
        }
    }
    named
}

/// What `meshwork help train [--model M]` adds to the flags: the model's defaults and
/// its own flags, and how a run ends.
pub(crate) fn train_notes(model: Option<Model>) -> String {
    let model_text = match model.unwrap_or(Model::Mlp) {
        Model::Mlp => {
            "\
--model mlp (the main job): h = relu(x·W1 + b1), z = h·W2 + b2, softmax cross-entropy,
on a data x model mesh: the batch split over the data axis, W1 by columns and W2 by rows
over the model axis. Defaults: --mesh 2x2, --steps 200, --batch 64, --optimizer sgd,
--lr 0.5, --dtype f64, --hidden 32. The built-in data: 512 rows of 8 features in 3
classes, drawn from --seed. Its flags: --hidden, --classes, --data-x/--data-y, --init
(w1 [features, hidden], b1 [hidden], w2 [hidden, classes], b2 [classes]). A checkpoint
of an earlier meshwork (its \"meshwork-mlp\" metadata, or none: the sizes from the
variables' shapes) resumes."
        }
        Model::Transformer => {
            "\
--model transformer: the reference decoder-only transformer (next-token loss), on a mesh
(heads and the MLP split over the model axis, Megatron's way) or in a pipeline of
--stages (GPipe, --microbatches). Defaults: --mesh 1x1, --steps 100, --batch 8,
--optimizer adam, --lr 0.01, --dtype f32, --layers 2 --dim 64 --heads 4 --ffn 256
--vocab 256 --seq 32. Data: built-in rows drawn from --seed, --text FILE (bytes as
tokens), or --data-tokens TOKENS.npy [rows, seq + 1]. --init takes the sizes from its
tensors (with --heads)."
        }
        Model::Cnn => {
            "\
--model cnn: conv3x3(F1) relu, conv3x3/2(F2) relu, a linear head, on NHWC images, over
the data axis (--mesh Dx1) or in a pipeline of up to 3 stages. Defaults: --mesh 1x1,
--steps 100, --batch 32, --optimizer adam, --lr 0.01, --dtype f32, --filters 8,16.
Data: built-in 8x8x1 images drawn from --seed, or --data-x [N, H, W, C] with --data-y."
        }
        Model::Gpt2 => {
            "\
--model gpt2: GPT-2 as Hugging Face's GPT2LMHeadModel computes it (next-token loss), on
a mesh (the batch over data; c_attn and c_fc by columns, the projections by rows over
model). --init DIR reads a Hugging Face checkpoint folder (config.json and
model.safetensors, or a sharded index; f64, f32, bf16 or f16; with or without the
transformer. prefix), its sizes with it; else --preset tiny (default), gpt2 or
gpt2-medium, whose sizes --layers, --dim, --heads, --ffn and --vocab override, with
GPT-2's initialisation from --seed. --seq is the training context (default the smaller
of 64 and the model's positions). Defaults: --mesh 1x1, --steps 100, --batch 8,
--optimizer adam, --lr 0.01, --dtype f32. Data: built-in rows drawn from --seed,
--data-tokens TOKENS.npy [rows, seq + 1], --text FILE --tokenizer tokenizer.json
(the whole file encoded, cut into consecutive rows of --seq + 1 tokens, the tail
dropped), or --text FILE alone with byte k as token k (not GPT-2's BPE, whose ids
0..255 are its bytes in another order). Dropout (the config's
*_pdrop) is not applied. --export-hf DIR writes the final weights as a checkpoint
folder."
        }
        Model::Llama | Model::Mistral | Model::Qwen2 | Model::Qwen3 => {
            "\
--model llama|mistral|qwen2|qwen3: the Llama family as Hugging Face's LlamaForCausalLM,
MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM compute it (next-token loss):
RMSNorm in float32, rotary positions (default, linear and llama3 scaling), grouped-query
attention, SwiGLU, q/k/v biases (Qwen 2), per-head q/k norms (Qwen 3), tied or untied
embeddings. --init DIR reads a Hugging Face checkpoint folder (config.json in
transformers 4.x's or 5.x's layout; model.safetensors or a sharded index; f64, f32, bf16
or f16), which names the model (--model may be left out; if given it must agree);
a config.json field that would change the computation and is not computed (another
rope type, a sliding window shorter than --seq, soft-capping, pretraining_tp > 1, ...)
is refused naming it. Else --preset tiny-llama (default), smollm2-135m, qwen2.5-0.5b or
llama-3.2-1b, with transformers' initialisation from --seed. On a mesh, q/k/v and the
MLP's gate and up split by rows over model, o and down by columns; key/value heads are
split too, or, where model is larger than their count, held whole by every model
position. --seq is the training context (default the smaller of 64 and
the model's positions). Data: --text FILE through --tokenizer (default: the folder's
tokenizer.json), --data-tokens, or built-in rows. --export-hf DIR writes the final
weights as a checkpoint folder in the layout they were read in."
        }
    };
    format!(
        "{model_text}

A new run with --init DIR (a pretrained Hugging Face folder) and none of --optimizer, --lr,
--schedule, --weight-decay, --beta1, --beta2, --eps or --no-decay-1d, the run takes
transformers' Trainer's defaults for fine-tuning: adamw without weight decay, lr 5e-5,
a linear decay to 0 one step past the last (--min-lr ends it there at the last step),
as the header line says.

Every step is checked against the same step on one device, for runs estimated at 1 GB
or less (--check for larger ones, --no-check to skip it): the one-device run takes the
run's weights and optimizer state before each host call (--steps-per-run steps, 1 by
default), and its losses (relative
tolerance 1e-9 in f64, 1e-3 in f32) and the state it leaves (1e-9, 1e-2) must match the
run's, so a loss spike that makes two runs drift apart does not fail it and a wrong
collective does.

Ctrl-C (SIGINT) or SIGTERM finishes the current host call, saves a checkpoint if
--checkpoint-dir is given, writes --losses-json and exits with status 130; a second one
exits at once. A loss that is not finite stops the run with status 1, and so does a
one-device check that fails."
    )
}

/// A clap error as one line: its message and the list it gives (the missing flags),
/// without the usage and the pointer to `--help`.
pub(crate) fn one_line(e: &clap::Error) -> String {
    let text = e.render().to_string();
    text.lines()
        .map(str::trim)
        .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
        .filter(|l| !l.is_empty() && !l.starts_with("tip:"))
        .map(|l| l.strip_prefix("error: ").unwrap_or(l))
        .collect::<Vec<_>>()
        .join(" ")
}

/// What a clap error ends in: help and the version printed (status 0), anything else
/// one line naming the flag and the command's help page (status 2).
pub(crate) fn clap_exit(e: clap::Error, argv: &[String]) -> Result<(), Exit> {
    match e.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => out(format_args!("{}", e.render())),
        ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            out(format_args!("{}", e.render()))?;
            Err(Exit::Usage("a command is missing; see `meshwork help`".into()))
        }
        _ => {
            let command = argv
                .iter()
                .skip(1)
                .find(|a| commands().contains(a))
                .map_or(String::new(), |c| format!(" {c}"));
            Err(Exit::Usage(format!("{}; see `meshwork help{command}`", one_line(&e))))
        }
    }
}
