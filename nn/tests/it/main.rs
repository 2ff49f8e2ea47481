//! The models and training steps through their public API: optimizers against their
//! formulas, and the transformer against the JAX reference run.

mod lora_dropout;
mod steps;
mod transformer;
