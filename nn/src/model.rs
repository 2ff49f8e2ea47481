//! The one model seam: every model family meshwork trains — the MLP, the CNN, the
//! reference transformer, GPT-2 and the Llama family — stands behind [`Model`], so that
//! a trainer, an inspector or a decoder asks the model, never which model it is: what a
//! step feeds it, its parameters with their checkpoint names, its loss program (on a
//! mesh, or over a pipeline's stages), its evaluation, how Megatron splits each weight
//! over a model axis, its initial weights, what it holds per row, its decoding step
//! ([`Decoder`]), its Hugging Face names and config ([`HfFormat`]), and every linear
//! layer ([`Model::linears`], which an [`Adapter`] such as LoRA reaches while the
//! program is built) and which parameters train ([`Model::trains`]: a LoRA model's
//! base is frozen).
//!
//! ```
//! use meshwork_nn::{Build, CausalLm, Llama, Model};
//! use meshwork_program::Builder;
//! use meshwork_types::DType;
//!
//! // The tiny Llama trained on rows of 16 + 1 tokens.
//! let llama = Llama::preset("tiny-llama").unwrap();
//! let model: Box<dyn Model> = Box::new(CausalLm { model: llama, seq: 16 });
//! let mut b = Builder::new();
//! let feeds = model.feeds(&mut b, 2, DType::F32)?;
//! let loss = model.loss(&mut b, &feeds, &Build::new(DType::F32))?;
//! let program = b.finish(&[loss])?;
//! let weights: Vec<_> = program.params()[feeds.len()..].iter().map(|p| p.name.clone()).collect();
//! let names: Vec<_> = model.parameters().into_iter().map(|(n, _)| n).collect();
//! assert_eq!(weights, names);
//! assert_eq!(model.split("model.layers.0.self_attn.q_proj.weight", 2), Some(0));
//! assert!(model.decoder().is_some() && model.hf().is_some());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use meshwork_program::{Builder, Result, Value};
use meshwork_types::{DType, Shape, TensorSpec};
use serde_json::Value as Json;

use crate::{Blocking, Pipeline};

/// One input a step feeds per row: its name, its dtype (`None`: the weights' dtype)
/// and its dims after the batch's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Input {
    /// The parameter's name (`rows`, `x`, `y`).
    pub name: &'static str,
    /// Its dtype (`None`: the weights').
    pub dtype: Option<DType>,
    /// A row's dims.
    pub dims: Vec<usize>,
}

/// What a loss program is built with besides the model: the weights' dtype, how the
/// attention and loss are cut into pieces, and an adapter over the linear layers.
#[derive(Clone, Copy)]
pub struct Build<'a> {
    /// The weights' dtype.
    pub dtype: DType,
    /// Attention by query blocks and the loss by chunks (the language models).
    pub blocking: Blocking,
    /// What wraps each linear layer's output (LoRA), if anything.
    pub adapter: Option<&'a dyn Adapter>,
}

impl std::fmt::Debug for Build<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Build")
            .field("dtype", &self.dtype)
            .field("blocking", &self.blocking)
            .field("adapter", &self.adapter.is_some())
            .finish()
    }
}

impl Build<'_> {
    /// Weights of `dtype`, nothing cut, no adapter.
    pub fn new(dtype: DType) -> Build<'static> {
        Build { dtype, blocking: Blocking::default(), adapter: None }
    }
}

/// What wraps a model's linear layers as its program is built (LoRA's `W x + B A x`).
pub trait Adapter: Sync {
    /// The output of linear layer `layer` (its full name, `model.layers.0.self_attn.q_proj`)
    /// given its input `x` and its own output `y`; `None` leaves the layer as it is.
    fn linear(&self, b: &mut Builder, layer: &str, x: Value, y: Value) -> Result<Option<Value>>;
}

/// How Megatron splits a linear layer over a model axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parallel {
    /// By its outputs (q, k, v, gate, up; GPT-2's `c_attn` and `c_fc`).
    Column,
    /// By its inputs (o, down; GPT-2's `c_proj`s).
    Row,
    /// Whole on every device.
    Replicated,
}

/// A linear layer of a model, as [`Model::linears`] lists them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinearLayer {
    /// Its full name (its weight is `{name}.weight`).
    pub name: String,
    /// Input features.
    pub inputs: usize,
    /// Output features.
    pub outputs: usize,
    /// Its split over a model axis.
    pub parallel: Parallel,
    /// Its weight stored `[in, out]` (GPT-2's `Conv1D`), not `[out, in]`.
    pub conv1d: bool,
}

/// A model that decodes tokens with a key-value cache.
pub trait Decoder {
    /// Its vocabulary.
    fn vocab(&self) -> usize;
    /// The longest context it takes.
    fn positions(&self) -> usize;
    /// Its attention's query heads (what sizes the scores `[B, heads, T, T]`).
    fn heads(&self) -> usize;
    /// That a context of `context` positions is one it decodes as its reference does.
    fn check_context(&self, context: usize) -> std::result::Result<(), String>;
    /// The cache's parameters for `batch` rows of `context` positions: names and shapes,
    /// in the order [`decode_step`](Self::decode_step) makes and returns them.
    fn cache(&self, batch: usize, context: usize) -> Vec<(String, Vec<usize>)>;
    /// One step: the logits `[B, V]` of integer `token` `[B]` at integer scalar
    /// `position`, then each cache with this position written in.
    fn decode_step(
        &self,
        b: &mut Builder,
        token: Value,
        position: Value,
        context: usize,
        dtype: DType,
    ) -> Result<Vec<Value>>;
}

/// What a checkpoint tensor is to a model ([`HfFormat::parameter_of`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stored {
    /// The parameter of this name.
    Parameter(String),
    /// Something the model does not read (a buffer, a tied head stored anyway).
    Skipped,
    /// Not the model's.
    Foreign,
}

/// A model stored in Hugging Face's layout.
pub trait HfFormat {
    /// What the checkpoint tensor `stored` is to the model.
    fn parameter_of(&self, stored: &str) -> Stored;
    /// The name `save_pretrained` gives parameter `name`.
    fn stored_name(&self, name: &str) -> String;
    /// The `config.json` `transformers` writes for the model (for a model that did not
    /// come from one).
    fn config_json(&self) -> Json;
}

/// The salt of the random stream most models' initial weights are drawn from.
pub const INIT_STREAM: u64 = 0x5851_f42d_4c95_7f2d;

/// A model family behind the trainer (see the module's documentation).
pub trait Model: std::fmt::Debug + Send + Sync {
    /// The family's `--model` name (`mlp`, `cnn`, `transformer`, `gpt2`, `llama`,
    /// `mistral`, `qwen2`, `qwen3`): what a checkpoint records as its `model`.
    fn family(&self) -> &'static str;
    /// One line for people (`GPT-2 L12 D768 …`).
    fn describe(&self) -> String;
    /// Its sizes and options as a checkpoint's run metadata records them (with
    /// `"model"`), from which [`family`](Self::family)'s resolver makes it again.
    fn meta(&self) -> Json;
    /// What a step feeds it per row, in order.
    fn inputs(&self) -> Vec<Input>;
    /// Its parameters' names (checkpoint tensor names) and shapes, in the order its
    /// programs make them.
    fn parameters(&self) -> Vec<(String, Vec<usize>)>;
    /// The mean loss of `inputs` (the parameters [`feeds`](Self::feeds) made).
    fn loss(&self, b: &mut Builder, inputs: &[Value], build: &Build<'_>) -> Result<Value>;
    /// The mean loss and accuracy (of the class, or of the next token) of `inputs`,
    /// built with `build` (its dtype; an adapter over the linear layers).
    fn evaluate(
        &self,
        b: &mut Builder,
        inputs: &[Value],
        build: &Build<'_>,
    ) -> Result<(Value, Value)>;
    /// Whether parameter `name` is trained (a frozen base's are not: only an
    /// adapter's train).
    fn trains(&self, name: &str) -> bool {
        let _ = name;
        true
    }

    /// The most pipeline stages it spreads over (1: it trains on meshes only).
    fn max_stages(&self) -> usize {
        1
    }
    /// Its loss as a pipeline trains it (GPipe's micro-batches over device scopes).
    fn loss_pipelined(
        &self,
        b: &mut Builder,
        inputs: &[Value],
        dtype: DType,
        pipeline: &Pipeline,
    ) -> Result<Value> {
        let _ = (inputs, dtype, pipeline);
        Err(meshwork_program::Error::Type {
            op: "pipeline",
            at: b.scope_name(),
            operands: Vec::new(),
            problem: format!("{} trains on meshes, not in pipelines", self.describe()),
        })
    }
    /// Why it cannot be split over a `data x model` mesh of `model` devices along the
    /// model axis (one line naming what does not divide), if it cannot.
    fn check_mesh(&self, data: usize, model: usize) -> std::result::Result<(), String>;
    /// The dim of parameter `name` Megatron splits over a model axis of `model`
    /// devices (`None`: whole on every device).
    fn split(&self, name: &str, model: usize) -> Option<usize>;
    /// Whether the scope `name` (its full name) is one of its blocks, the regions
    /// `--remat` recomputes.
    fn is_block(&self, name: &str) -> bool {
        let _ = name;
        false
    }
    /// Its blocks (0 for a model without).
    fn layers(&self) -> usize {
        0
    }
    /// The initial values of parameter `name` of `dims`, drawing standard normals from
    /// `normal` (the same stream across the parameters, in order).
    fn init(&self, name: &str, dims: &[usize], normal: &mut dyn FnMut() -> f64) -> Vec<f64>;
    /// The salt of the random stream its initial weights are drawn from.
    fn init_stream(&self) -> u64 {
        INIT_STREAM
    }
    /// Activation elements a step computes per row (forward values and their
    /// gradients); with `remat`, what a step holds at once.
    fn activations_per_row(&self, remat: bool) -> f64;
    /// The part of [`activations_per_row`](Self::activations_per_row) that attention's
    /// `[T, T]` scores hold, which fused attention (cuDNN's flash attention) never
    /// makes; 0 for a model without causal self-attention of its own.
    fn attention_scores_per_row(&self, remat: bool) -> f64 {
        let _ = remat;
        0.0
    }
    /// What a row counts for in throughput: its tokens, or one sample.
    fn per_row(&self) -> (usize, &'static str);
    /// Whether an evaluation's accuracy counts classes (or next tokens).
    fn classifies(&self) -> bool;
    /// Its decoding step, if it generates.
    fn decoder(&self) -> Option<&dyn Decoder> {
        None
    }
    /// Its Hugging Face layout, if it has one.
    fn hf(&self) -> Option<&dyn HfFormat> {
        None
    }
    /// Whether it computes parts in float32 whatever the weights' dtype (the Llama
    /// family's RMSNorm and rotary tables, as `transformers` does): two back ends then
    /// agree only to float32's rounding in those parts.
    fn float32_parts(&self) -> bool {
        false
    }
    /// Every linear layer an [`Adapter`] can wrap.
    fn linears(&self) -> Vec<LinearLayer> {
        Vec::new()
    }
    /// The model as a base with a LoRA adapter, if it is one.
    fn as_lora(&self) -> Option<&crate::LoraModel> {
        None
    }

    /// Its fed parameters for `batch` rows, in [`inputs`](Self::inputs)' order.
    fn feeds(&self, b: &mut Builder, batch: usize, dtype: DType) -> Result<Vec<Value>> {
        self.inputs()
            .into_iter()
            .map(|input| {
                let mut dims = vec![batch];
                dims.extend(&input.dims);
                b.param(
                    input.name,
                    TensorSpec::new(input.dtype.unwrap_or(dtype), Shape::new(&dims)?),
                )
            })
            .collect()
    }
    /// Elements of a row's fed inputs.
    fn row_elements(&self) -> f64 {
        self.inputs().iter().map(|i| i.dims.iter().product::<usize>() as f64).sum()
    }
    /// Its weights' element count.
    fn parameter_count(&self) -> f64 {
        self.parameters().iter().map(|(_, s)| s.iter().map(|&d| d as f64).product::<f64>()).sum()
    }
}

/// `model`'s parameters as its loss program of one row declares them (for models
/// whose names are their layers' own).
pub(crate) fn declared_parameters(model: &dyn Model) -> Vec<(String, Vec<usize>)> {
    let mut b = Builder::new();
    let built = model
        .feeds(&mut b, 1, DType::F64)
        .and_then(|feeds| Ok((feeds.len(), model.loss(&mut b, &feeds, &Build::new(DType::F64))?)));
    let Ok((fed, loss)) = built else { return Vec::new() };
    let Ok(program) = b.finish(&[loss]) else { return Vec::new() };
    program.params()[fed..].iter().map(|p| (p.name.clone(), p.spec.shape.dims().to_vec())).collect()
}

/// The next-token accuracy and loss of a language model's logits `[B, T, V]` against
/// `targets` `[B, T]`.
pub(crate) fn token_metrics(
    b: &mut Builder,
    logits: Value,
    targets: Value,
    dtype: DType,
) -> Result<(Value, Value)> {
    class_metrics(b, logits, targets, dtype, &[0, 1])
}

/// The mean softmax cross-entropy of `logits` against `labels` and the accuracy of
/// their argmax, averaged over `axes`.
pub(crate) fn class_metrics(
    b: &mut Builder,
    logits: Value,
    labels: Value,
    dtype: DType,
    axes: &[isize],
) -> Result<(Value, Value)> {
    let loss = crate::softmax_cross_entropy(b, logits, labels)?;
    let pred = b.argmax(logits, -1)?;
    let pred = b.convert(pred, DType::I32)?;
    let hit = b.eq(pred, labels)?;
    let hit = b.convert(hit, dtype)?;
    let accuracy = b.reduce_mean(hit, axes, false)?;
    Ok((loss, accuracy))
}

/// Whether scope `name` is `prefix` followed by a number (`layers.3`).
pub(crate) fn numbered(name: &str, prefix: &str) -> bool {
    name.strip_prefix(prefix)
        .is_some_and(|i| !i.is_empty() && i.bytes().all(|c| c.is_ascii_digit()))
}

/// Activations a step holds per row: those outside the blocks and `layers` blocks'
/// (`block` each); with `remat`, every block's input (`input`) and one block's values.
pub(crate) fn blocks_held(outside: f64, block: f64, input: f64, layers: f64, remat: bool) -> f64 {
    if remat && layers > 0.0 { outside + layers * input + block } else { outside + layers * block }
}
