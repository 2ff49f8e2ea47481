//! Pipelines: where the stages of a pipelined training step run, and the mean loss of
//! a model trained that way (GPipe's micro-batches).

use meshwork_program::{Builder, Result, Value};

use crate::layers::softmax_cross_entropy;

/// Where a pipelined training step runs ([`Transformer::loss_pipelined`](crate::Transformer::loss_pipelined)): D
/// data-parallel replicas of K pipeline stages each (D × K devices), and the
/// micro-batches each replica's share of a batch is cut into.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pipeline {
    /// `replicas[d][k]`: the device of stage `k` of replica `d`.
    pub replicas: Vec<Vec<String>>,
    /// Micro-batches per replica and step.
    pub micro_batches: usize,
}

impl Pipeline {
    /// `replicas` × `stages` CPU devices, stage `k` of replica `d` on
    /// `/device:CPU:{d·stages + k}`.
    pub fn cpus(replicas: usize, stages: usize, micro_batches: usize) -> Pipeline {
        Pipeline {
            replicas: (0..replicas)
                .map(|d| (0..stages).map(|k| format!("/device:CPU:{}", d * stages + k)).collect())
                .collect(),
            micro_batches,
        }
    }
}

/// A model's logits of a micro-batch over a replica's stages: `(builder, inputs,
/// stages) -> logits`.
pub type LogitsOn<'a> = &'a dyn Fn(&mut Builder, Value, &[&str]) -> Result<Value>;

/// The mean softmax cross-entropy of inputs `x` `[B, …]` and class ids `y` `[B]`
/// trained as `pipeline` says, as [`Transformer::loss_pipelined`](crate::Transformer::loss_pipelined)
/// trains the transformer: each replica's share of the rows cut into micro-batches,
/// all forwards in micro-batch order, the model (`logits_on`: the logits of a
/// micro-batch over a replica's stages) once per micro-batch, one set of weights.
pub fn loss_pipelined(
    b: &mut Builder,
    x: Value,
    y: Value,
    pipeline: &Pipeline,
    logits_on: LogitsOn<'_>,
) -> Result<Value> {
    let dims = b.spec(x)?.shape.dims().to_vec();
    let (d, m) = (pipeline.replicas.len(), pipeline.micro_batches);
    let micro = dims[0] / (d * m).max(1);
    let losses = b.reuse_params(|b| {
        let mut losses = Vec::with_capacity(d * m);
        for mb in 0..m {
            for (r, stages) in pipeline.replicas.iter().enumerate() {
                let stages: Vec<&str> = stages.iter().map(String::as_str).collect();
                let start = (r * m + mb) * micro;
                let (first, last) = (stages[0], stages[stages.len() - 1]);
                let xs = b.device(first, |b| {
                    let mut lo = vec![0; dims.len()];
                    let mut hi = dims.clone();
                    (lo[0], hi[0]) = (start, start + micro);
                    b.slice(x, &lo, &hi, &vec![1; dims.len()])
                })?;
                let logits = logits_on(b, xs, &stages)?;
                losses.push(b.device(last, |b| {
                    let ys = b.slice(y, &[start], &[start + micro], &[1])?;
                    softmax_cross_entropy(b, logits, ys)
                })?);
            }
        }
        Ok(losses)
    })?;
    let last = pipeline.replicas[0][pipeline.replicas[0].len() - 1].clone();
    b.device(&last, |b| {
        let mut total = losses[0];
        for &l in &losses[1..] {
            total = b.add(total, l)?;
        }
        if losses.len() == 1 {
            return Ok(total);
        }
        let scale = b.scalar_like(total, 1.0 / losses.len() as f64)?;
        b.mul(total, scale)
    })
}
