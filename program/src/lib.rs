//! meshwork's tensor programs: an SSA IR of typed ops, a builder that checks every
//! instruction and infers its result's dtype and shape as it is added, and a text form
//! (HLO-like, one instruction per line).
//!
//! A [`Program`] has typed parameters, instructions in evaluation order (each uses only
//! earlier values) and results. Its op set ([`Op`]) is the JAX oracle's (elementwise,
//! compare/select, `dot_general` with batch and contracting dims, reductions,
//! reshape/transpose/broadcast/slice/concat, `take`, `one_hot`, `softmax`,
//! `log_softmax`, `argmax`, `conv2d` NHWC/HWIO SAME/VALID, constants, `stop_gradient`)
//! plus `convert`, `iota`, the collectives over replica groups, `send`/`recv` between
//! devices and `emit` to the host. Dtypes are f32, f64, i32, i64 and bool.
//!
//! Model code can also use value handles: a [`Graph`] hands out [`Var`]s that chain
//! ops as methods and take `+ - * /` (`(x.matmul(w)? + b)?.relu()?`), each step checked
//! like the builder's.
//!
//! The text form reads back (`text.parse::<Program>()`, rebuilt through the builder,
//! so parsed programs are checked like built ones). [`grad`] and [`vjp`] differentiate
//! a program into a new one (reverse mode, following JAX at ties and kinks);
//! [`Program::combine_all_reduces`] merges independent all-reduces as XLA's combiner
//! does. Two interpreters run programs: [`reference`](mod@reference) (naive loops, the
//! oracle) and [`fast`](mod@fast) (GEMM-backed products, fused elementwise chains, pooled
//! buffers, a thread budget). Collectives, `send`/`recv` and `emit` run through the
//! [`Collectives`], [`Channels`] and [`HostSink`] of an [`Env`], which the strategy
//! crate implements over the executor and the outfeed.
//!
//! It is **not** a model library (layers, optimizers and training steps are
//! `meshwork-nn`'s), a partitioner or a placer (`meshwork-partition`), and it depends on
//! no sibling crate, only on `types`.
//!
//! ```
//! use meshwork_program::Builder;
//! use meshwork_types::DType;
//!
//! let mut b = Builder::new();
//! let x = b.param("x", "f64[4,3]".parse()?)?;
//! let w = b.param("w", "f64[3,2]".parse()?)?;
//! let z = b.matmul(x, w)?;
//! let h = b.relu(z)?;
//! let loss = b.reduce_mean(h, &[0, 1], false)?;
//! let p = b.finish(&[loss])?;
//! assert_eq!(p.spec(loss).unwrap().dtype, DType::F64);
//! assert!(p.to_string().contains("relu(%2)"));
//! // A mistake is a typed error naming the op and its operands.
//! let mut b = meshwork_program::Builder::new();
//! let x = b.param("x", "f64[4,3]".parse()?)?;
//! assert!(b.matmul(x, x).unwrap_err().to_string().contains("dot_general(f64[4,3], f64[4,3])"));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod builder;
mod catalogue;
mod combine;
pub mod composite;
mod env;
mod error;
pub mod fast;
mod grad;
mod graph;
mod infer;
mod op;
mod program;
pub mod random;
pub mod reference;
mod tensor;
mod text;

pub use builder::Builder;
pub use catalogue::{Catalogue, Kernels};
pub use env::{Channels, Collectives, Env, HostSink};
pub use error::{Error, Result};
pub use grad::{grad, grad_remat, vjp};
pub use graph::{Graph, Var};
pub use meshwork_types::Tensor;
pub use op::{AttentionSpec, Binary, Compare, Op, Padding, Reduction, Unary};
pub use program::{Instr, Param, Program, Value};

#[cfg(test)]
mod tests;
