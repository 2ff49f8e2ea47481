//! What the composite ops mean: [`Op::Attention`], [`Op::CrossEntropy`] and their
//! gradients as programs of primitive ops, which the interpreters run, XLA's plain
//! lowering inlines, and a fused kernel or lowering (cuDNN) must agree with.

use meshwork_types::{DType, TensorSpec};

use crate::builder::Builder;
use crate::op::{AttentionSpec, Op};
use crate::program::{Program, Value};
use crate::{Error, Result};

/// The dtype attention's scores are scaled, masked and softmaxed in: f32 for half
/// operands (as cuDNN and JAX's reference do), the operands' own otherwise.
pub fn softmax_dtype(operands: DType) -> DType {
    match operands {
        DType::BF16 | DType::F16 => DType::F32,
        d => d,
    }
}

/// Attention of `q`, `k`, `v` (values of `b`) in primitive ops, as
/// [`Op::Attention`] defines it.
pub fn attention_primitives(
    b: &mut Builder,
    [q, k, v]: [Value; 3],
    a: AttentionSpec,
) -> Result<Value> {
    let dtype = b.spec(q)?.dtype;
    let (tq, tk) = (b.spec(q)?.shape.dims()[2], b.spec(k)?.shape.dims()[2]);
    let wide = softmax_dtype(dtype);
    let s = b.dot_general(q, k, &[3], &[3], &[0, 1], &[0, 1])?;
    let s = if wide == dtype { s } else { b.convert(s, wide)? };
    let c = b.constant(a.scale, wide)?;
    let s = if a.divide { b.div(s, c)? } else { b.mul(s, c)? };
    let s = if a.causal {
        // Query i sees the keys up to i + (Tk − Tq).
        let qi = b.iota(DType::I32, &[tq, tk], 0)?;
        let qi = if tk > tq {
            let offset = b.constant((tk - tq) as f64, DType::I32)?;
            b.add(qi, offset)?
        } else {
            qi
        };
        let ki = b.iota(DType::I32, &[tq, tk], 1)?;
        let mask = b.ge(qi, ki)?;
        let masked = b.constant(-1e9, wide)?;
        b.select(mask, s, masked)?
    } else {
        s
    };
    let p = b.softmax(s, -1)?;
    let p = if wide == dtype { p } else { b.convert(p, dtype)? };
    b.dot_general(p, v, &[3], &[2], &[0, 1], &[0, 1])
}

/// [`Op::Attention`]'s definition over operands of `specs`: a program of `(q, k, v)`
/// returning the attention.
pub fn attention_definition(specs: &[TensorSpec], a: AttentionSpec) -> Result<Program> {
    check(&Op::Attention(a), specs)?;
    let mut b = Builder::new();
    let q = b.param("q", specs[0].clone())?;
    let k = b.param("k", specs[1].clone())?;
    let v = b.param("v", specs[2].clone())?;
    let out = attention_primitives(&mut b, [q, k, v], a)?;
    b.finish(&[out])
}

/// [`Op::AttentionGrad`]'s definition over operands `(q, k, v, dout)` of `specs`: a
/// program of those four returning the gradient with respect to operand `wrt`, the
/// vector-Jacobian product of [`attention_definition`].
pub fn attention_grad_definition(
    specs: &[TensorSpec],
    a: AttentionSpec,
    wrt: usize,
) -> Result<Program> {
    check(&Op::AttentionGrad { attention: a, wrt }, specs)?;
    let forward = attention_definition(&specs[..3], a)?;
    // vjp: (q, k, v, cotangent) → (out, d wrt); the gradient alone is kept.
    let mut vjp = crate::grad::vjp(&forward, &[Value(wrt as u32)])?;
    let gradient = vjp.results[1];
    vjp.results = vec![gradient];
    Ok(vjp.without_dead_code())
}

/// The per-position softmax cross-entropy of `logits` `[..., C]` against integer
/// `labels` `[...]` (values of `b`) in primitive ops, as [`Op::CrossEntropy`] defines
/// it: `-Σ_c log_softmax(logits)[c] · one_hot(label)[c]`.
pub fn cross_entropy_primitives(b: &mut Builder, logits: Value, labels: Value) -> Result<Value> {
    let spec = b.spec(logits)?.clone();
    let classes = spec.shape.dims().last().copied().unwrap_or(0);
    let lp = b.log_softmax(logits, -1)?;
    let hot = b.one_hot(labels, classes, spec.dtype)?;
    let picked = b.mul(lp, hot)?;
    let per = b.reduce_sum(picked, &[-1], false)?;
    b.neg(per)
}

/// [`Op::CrossEntropy`]'s definition over operands of `specs`: a program of
/// `(logits, labels)` returning the per-position loss.
pub fn cross_entropy_definition(specs: &[TensorSpec]) -> Result<Program> {
    check(&Op::CrossEntropy, specs)?;
    let mut b = Builder::new();
    let logits = b.param("logits", specs[0].clone())?;
    let labels = b.param("labels", specs[1].clone())?;
    let out = cross_entropy_primitives(&mut b, logits, labels)?;
    b.finish(&[out])
}

/// [`Op::CrossEntropyGrad`]'s definition over operands `(logits, labels, dloss)` of
/// `specs`: a program of those three returning the gradient with respect to the
/// logits, the vector-Jacobian product of [`cross_entropy_definition`].
pub fn cross_entropy_grad_definition(specs: &[TensorSpec]) -> Result<Program> {
    check(&Op::CrossEntropyGrad, specs)?;
    let forward = cross_entropy_definition(&specs[..2])?;
    // vjp: (logits, labels, cotangent) → (loss, d logits); the gradient alone is kept.
    let mut vjp = crate::grad::vjp(&forward, &[Value(0)])?;
    let gradient = vjp.results[1];
    vjp.results = vec![gradient];
    Ok(vjp.without_dead_code())
}

/// The composite op's operands checked as the op's shape inference does.
fn check(op: &Op, specs: &[TensorSpec]) -> Result<()> {
    let refs: Vec<&TensorSpec> = specs.iter().collect();
    crate::infer::infer(op, &refs).map(drop).map_err(|problem| Error::Type {
        op: op.name(),
        at: "its definition".into(),
        operands: specs.to_vec(),
        problem,
    })
}

/// The definition of a composite op over operands of `specs`; `None` for a primitive.
pub fn definition(op: &Op, specs: &[TensorSpec]) -> Option<Result<Program>> {
    match op {
        Op::Attention(a) => Some(attention_definition(specs, *a)),
        Op::AttentionGrad { attention, wrt } => {
            Some(attention_grad_definition(specs, *attention, *wrt))
        }
        Op::CrossEntropy => Some(cross_entropy_definition(specs)),
        Op::CrossEntropyGrad => Some(cross_entropy_grad_definition(specs)),
        _ => None,
    }
}
