//! The trainer in-process: every model on meshes and pipelines against JAX's runs and
//! the hand-written MLP, resuming (the main job's older checkpoints too), evaluation,
//! schedules and sinks, stopping, and every refusal before any work.

mod cnn;
mod commands;
mod common;
mod finetune;
mod gpt2;
mod llama;
mod lora;
mod mlp;
mod processes;
mod refusals;
mod resume;
mod transformer;

use common::*;
