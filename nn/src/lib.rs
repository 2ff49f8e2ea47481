//! Models for meshwork's program layer: the layers models are written with, the
//! optimizers and the training step that makes forward, backward and update one
//! program, and the models meshwork trains (an MLP, a CNN, the reference transformer),
//! whole or spread over a pipeline's stages.
//!
//! - Layers ([`linear`], [`layer_norm`], [`embedding`], [`causal_self_attention`],
//!   [`conv2d`], [`decoder_block`], [`softmax_cross_entropy`], …) add their parameters
//!   to a [`Builder`](meshwork_program::Builder), named within its current scope, so
//!   names match checkpoint tensor names (`layers.0.attn.wq`).
//! - [`TrainStep`] differentiates a loss and appends an [`Optimizer`]'s update of
//!   every trained parameter (SGD, momentum, Adam, AdamW; optional clipping to a
//!   global norm); the step is a program like any other, which a strategy partitions,
//!   places or runs.
//! - Models: [`Mlp`], [`Cnn`], [`Transformer`], and [`Gpt2`] (Hugging Face's
//!   `GPT2LMHeadModel`, its parameters named as its checkpoints name them);
//!   [`Pipeline`] says where a pipelined
//!   step's stages run, and [`Transformer::loss_pipelined`] and [`loss_pipelined`]
//!   write the micro-batched step GPipe runs.
//!
//! It is **not** the IR, autodiff or an interpreter (those are `meshwork-program`'s),
//! and it knows nothing of devices beyond the device scopes a pipeline writes.
//!
//! ```
//! use meshwork_nn::{Mlp, Optimizer, TrainStep, softmax_cross_entropy};
//! use meshwork_program::{Builder, Tensor, fast};
//!
//! let mlp = Mlp { features: 4, hidden: 8, classes: 3 };
//! let mut b = Builder::new();
//! let x = b.param("x", "f64[2,4]".parse()?)?;
//! let y = b.param("y", "i32[2]".parse()?)?;
//! let logits = mlp.logits(&mut b, x)?;
//! let loss = softmax_cross_entropy(&mut b, logits, y)?;
//! let program = b.finish(&[loss])?;
//! let weights: Vec<_> = program.params()[2..].iter().map(|p| p.name.clone()).collect();
//! assert_eq!(weights, ["w1", "b1", "w2", "b2"]);
//! // Forward, backward and SGD's update of the four weights, as one program.
//! let wrt: Vec<_> = (2..6).map(|k| meshwork_program::Value(k)).collect();
//! let step = TrainStep::new(&program, loss, &wrt, Optimizer::Sgd)?;
//! assert_eq!(step.program.results().len(), 1 + 4);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod cnn;
mod gpt2;
mod layers;
mod llama;
mod lm;
mod lora;
mod mlp;
mod model;
mod optim;
mod pipeline;
pub mod torch_cpu;
mod transformer;

pub use cnn::Cnn;
pub use gpt2::Gpt2;
pub use layers::{
    causal_self_attention, conv2d, decoder_block, embedding, gelu, layer_norm, linear, mlp_block,
    softmax_cross_entropy,
};
pub use llama::{ConfigError, Llama, LlamaKind, RopeScaling};
pub use lm::{Blocking, CausalLm, cudnn_attention};
pub use lora::{DROPOUT_KEYS, Lora, LoraConfig, LoraModel, Targets};
pub use mlp::Mlp;
pub use model::{
    Adapter, Build, Decoder, HfFormat, INIT_STREAM, Input, LinearLayer, Model, Parallel, Stored,
};
pub use optim::{LOSS_SCALE, LOSS_SCALE_GOOD, LossScale, Optimizer, StepOptions, TrainStep};
pub use pipeline::{LogitsOn, Pipeline, loss_pipelined};
pub use transformer::Transformer;
