//! The reference decoder-only transformer of the JAX run (`gen_transformer_case.py`),
//! whole, over a pipeline's stages, or as a pipeline trains it.

use meshwork_program::{Builder, Result, Value};
use meshwork_types::DType;

use crate::Pipeline;
use crate::layers::{decoder_block, embedding, layer_norm, param, problem, softmax_cross_entropy};

/// The reference run's decoder-only transformer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transformer {
    /// Vocabulary size V.
    pub vocab: usize,
    /// Sequence length T.
    pub seq: usize,
    /// Model dim D.
    pub dim: usize,
    /// Attention heads H (dividing D).
    pub heads: usize,
    /// Decoder blocks L.
    pub layers: usize,
    /// MLP hidden units F.
    pub ffn: usize,
}

impl Transformer {
    /// Logits `[B, T, V]` of integer `tokens` `[B, T]`: parameters `embed`, `pos`,
    /// `layers.{i}.*`, `ln_f.*` and `unembed`, of `dtype`.
    pub fn logits(&self, b: &mut Builder, tokens: Value, dtype: DType) -> Result<Value> {
        self.logits_on(b, tokens, dtype, &[])
    }

    /// [`logits`](Self::logits) with the model spread over `stages` devices as a
    /// pipeline is written in TensorFlow: the embedding in a `device` scope of the
    /// first, decoder block `i` of `L` on stage `i·K/L`, the final norm and the
    /// unembedding on the last. No stages: no device scopes.
    pub fn logits_on(
        &self,
        b: &mut Builder,
        tokens: Value,
        dtype: DType,
        stages: &[&str],
    ) -> Result<Value> {
        let td = b.spec(tokens)?.shape.dims().to_vec();
        if td.len() != 2 || td[1] != self.seq {
            return Err(problem(
                "transformer",
                b,
                &[tokens],
                format!("tokens must be [batch, {}]", self.seq),
            ));
        }
        let k = stages.len();
        let on =
            |b: &mut Builder, stage: usize, f: &mut dyn FnMut(&mut Builder) -> Result<Value>| {
                match stages.get(stage) {
                    Some(device) => b.device(device, |b| f(b)),
                    None => f(b),
                }
            };
        let mut x = on(b, 0, &mut |b| {
            let x = embedding(b, tokens, self.vocab, self.dim, "embed", dtype)?;
            let pos = param(b, "pos", dtype, &[self.seq, self.dim])?;
            b.add(x, pos)
        })?;
        for i in 0..self.layers {
            let stage = if k == 0 { 0 } else { i * k / self.layers };
            x = on(b, stage, &mut |b| {
                b.scope(&format!("layers.{i}"), |b| decoder_block(b, x, self.heads, self.ffn))
            })?;
        }
        on(b, k.saturating_sub(1), &mut |b| {
            let h = b.scope("ln_f", |b| layer_norm(b, x, 1e-5))?;
            let w = param(b, "unembed", dtype, &[self.dim, self.vocab])?;
            b.matmul(h, w)
        })
    }

    /// The mean next-token loss of integer `rows` `[B, T + 1]`: inputs `row[:T]`,
    /// targets `row[1:]`.
    pub fn loss(&self, b: &mut Builder, rows: Value, dtype: DType) -> Result<Value> {
        self.loss_on(b, rows, dtype, &[])
    }

    /// [`loss`](Self::loss) with the model over `stages` devices as
    /// [`logits_on`](Self::logits_on) spreads it (the loss on the last stage).
    pub fn loss_on(
        &self,
        b: &mut Builder,
        rows: Value,
        dtype: DType,
        stages: &[&str],
    ) -> Result<Value> {
        let rd = b.spec(rows)?.shape.dims().to_vec();
        if rd.len() != 2 || rd[1] != self.seq + 1 {
            return Err(problem(
                "transformer",
                b,
                &[rows],
                format!("rows must be [batch, {}]", self.seq + 1),
            ));
        }
        let on =
            |b: &mut Builder, device: Option<&&str>, f: &dyn Fn(&mut Builder) -> Result<Value>| {
                match device {
                    Some(device) => b.device(device, f),
                    None => f(b),
                }
            };
        let inputs =
            on(b, stages.first(), &|b| b.slice(rows, &[0, 0], &[rd[0], self.seq], &[1, 1]))?;
        let logits = self.logits_on(b, inputs, dtype, stages)?;
        on(b, stages.last(), &|b| {
            let targets = b.slice(rows, &[0, 1], &[rd[0], self.seq + 1], &[1, 1])?;
            softmax_cross_entropy(b, logits, targets)
        })
    }

    /// [`loss`](Self::loss) as a pipeline trains it: each of `pipeline`'s D replicas
    /// takes an equal, contiguous share of the rows and cuts it into the pipeline's M
    /// micro-batches; every micro-batch runs the model over the replica's K stages
    /// ([`loss_on`](Self::loss_on)), all forwards in micro-batch order, so that — the
    /// backward pass running in reverse — a stage works on one micro-batch while the
    /// next stage works on the one before (GPipe's schedule). The loss is the mean of
    /// the D·M micro-batch losses (the batch's mean: shares are equal), taken on the
    /// last stage of replica 0; gradients of the one set of weights (created on
    /// replica 0's stages, [`reuse_params`](Builder::reuse_params) elsewhere) sum the
    /// micro-batches' contributions where they are made, and a replica's sum crosses to
    /// the weights' device once.
    pub fn loss_pipelined(
        &self,
        b: &mut Builder,
        rows: Value,
        dtype: DType,
        pipeline: &Pipeline,
    ) -> Result<Value> {
        let rd = b.spec(rows)?.shape.dims().to_vec();
        let (d, m) = (pipeline.replicas.len(), pipeline.micro_batches);
        let k = pipeline.replicas.first().map_or(0, Vec::len);
        let fault = if d == 0 || k == 0 || m == 0 {
            Some("a pipeline has at least one replica, stage and micro-batch".to_string())
        } else if pipeline.replicas.iter().any(|r| r.len() != k) {
            Some("every replica has the same number of stages".to_string())
        } else if rd.len() != 2 || rd[1] != self.seq + 1 {
            Some(format!("rows must be [batch, {}]", self.seq + 1))
        } else if rd[0] % (d * m) != 0 {
            Some(format!(
                "a batch of {} rows does not split into {d} replicas × {m} micro-batches",
                rd[0]
            ))
        } else {
            None
        };
        if let Some(fault) = fault {
            return Err(problem("transformer pipeline", b, &[rows], fault));
        }
        let micro = rd[0] / (d * m);
        let stages: Vec<Vec<&str>> =
            pipeline.replicas.iter().map(|r| r.iter().map(String::as_str).collect()).collect();
        let losses = b.reuse_params(|b| {
            let mut losses = Vec::with_capacity(d * m);
            for mb in 0..m {
                for (r, stages) in stages.iter().enumerate() {
                    let start = (r * m + mb) * micro;
                    let chunk = b.device(stages[0], |b| {
                        b.slice(rows, &[start, 0], &[start + micro, self.seq + 1], &[1, 1])
                    })?;
                    losses.push(self.loss_on(b, chunk, dtype, stages)?);
                }
            }
            Ok(losses)
        })?;
        if losses.len() == 1 {
            return Ok(losses[0]);
        }
        b.device(stages[0][k - 1], |b| {
            let mut total = losses[0];
            for &l in &losses[1..] {
                total = b.add(total, l)?;
            }
            let scale = b.scalar_like(total, 1.0 / (d * m) as f64)?;
            b.mul(total, scale)
        })
    }
}

/// The reference transformer's initial weights: the embedding at 0.5, positions at 0.1,
/// LayerNorm scales about 1 (0.1 spread), biases 0, matrices at `1/sqrt(fan_in)`; a
/// draw for every element.
pub(crate) fn fan_in_init(name: &str, dims: &[usize], normal: &mut dyn FnMut() -> f64) -> Vec<f64> {
    let n: usize = dims.iter().product();
    let (scale, shift) = if name == "embed" {
        (0.5, 0.0)
    } else if name == "pos" {
        (0.1, 0.0)
    } else if name.ends_with(".scale") {
        (0.1, 1.0)
    } else if name.ends_with(".bias") || name.ends_with(".b1") || name.ends_with(".b2") {
        (0.0, 0.0)
    } else {
        let fan_in = n / dims.last().copied().unwrap_or(1).max(1);
        (1.0 / (fan_in.max(1) as f64).sqrt(), 0.0)
    };
    (0..n).map(|_| shift + scale * normal()).collect()
}

impl crate::Model for Transformer {
    fn family(&self) -> &'static str {
        "transformer"
    }
    fn describe(&self) -> String {
        format!(
            "transformer L{} D{} H{} F{} V{} T{}",
            self.layers, self.dim, self.heads, self.ffn, self.vocab, self.seq
        )
    }
    fn meta(&self) -> serde_json::Value {
        serde_json::json!({
            "model": "transformer", "layers": self.layers, "dim": self.dim, "heads": self.heads,
            "ffn": self.ffn, "vocab": self.vocab, "seq": self.seq,
        })
    }
    fn inputs(&self) -> Vec<crate::Input> {
        vec![crate::Input { name: "rows", dtype: Some(DType::I32), dims: vec![self.seq + 1] }]
    }
    fn parameters(&self) -> Vec<(String, Vec<usize>)> {
        crate::model::declared_parameters(self)
    }
    /// In closed form (sizes a run is refused for must not be built to be counted).
    fn parameter_count(&self) -> f64 {
        let [v, t, d, f, l] =
            [self.vocab, self.seq, self.dim, self.ffn, self.layers].map(|x| x as f64);
        2.0 * v * d + t * d + l * (4.0 * d * d + 2.0 * d * f + f + 5.0 * d) + 2.0 * d
    }
    fn loss(&self, b: &mut Builder, inputs: &[Value], build: &crate::Build<'_>) -> Result<Value> {
        Transformer::loss(self, b, inputs[0], build.dtype)
    }
    fn evaluate(
        &self,
        b: &mut Builder,
        inputs: &[Value],
        build: &crate::Build<'_>,
    ) -> Result<(Value, Value)> {
        let dtype = build.dtype;
        let rows = inputs[0];
        let batch = b.spec(rows)?.shape.dims()[0];
        let ids = b.slice(rows, &[0, 0], &[batch, self.seq], &[1, 1])?;
        let targets = b.slice(rows, &[0, 1], &[batch, self.seq + 1], &[1, 1])?;
        let logits = self.logits(b, ids, dtype)?;
        crate::model::token_metrics(b, logits, targets, dtype)
    }
    fn max_stages(&self) -> usize {
        // Block i goes on stage ⌊i·K/L⌋ and the head on the last.
        self.layers.saturating_add(1)
    }
    fn loss_pipelined(
        &self,
        b: &mut Builder,
        inputs: &[Value],
        dtype: DType,
        pipeline: &Pipeline,
    ) -> Result<Value> {
        Transformer::loss_pipelined(self, b, inputs[0], dtype, pipeline)
    }
    fn check_mesh(&self, data: usize, model: usize) -> std::result::Result<(), String> {
        if self.heads.is_multiple_of(model) && self.ffn.is_multiple_of(model) {
            return Ok(());
        }
        Err(format!(
            "--mesh {data}x{model}: the model axis must divide --heads {} and --ffn {}",
            self.heads, self.ffn
        ))
    }
    fn split(&self, name: &str, _model: usize) -> Option<usize> {
        let ends = |s: &[&str]| s.iter().any(|x| name.ends_with(x));
        if ends(&["attn.wq", "attn.wk", "attn.wv", "mlp.w1"]) {
            Some(1)
        } else if ends(&["attn.wo", "mlp.w2", "mlp.b1"]) {
            Some(0)
        } else {
            None
        }
    }
    fn is_block(&self, name: &str) -> bool {
        crate::model::numbered(name, "layers.")
    }
    fn layers(&self) -> usize {
        self.layers
    }
    fn init(&self, name: &str, dims: &[usize], normal: &mut dyn FnMut() -> f64) -> Vec<f64> {
        fan_in_init(name, dims, normal)
    }
    fn activations_per_row(&self, remat: bool) -> f64 {
        let [v, t, d, f, h] =
            [self.vocab, self.seq, self.dim, self.ffn, self.heads].map(|x| x as f64);
        let rows = t + 1.0;
        let block = rows * (12.0 * d + 3.0 * f + 3.0 * h * t);
        crate::model::blocks_held(rows * 3.0 * v, block, rows * d, self.layers as f64, remat)
    }
    fn per_row(&self) -> (usize, &'static str) {
        (self.seq, "tokens")
    }
    fn classifies(&self) -> bool {
        false
    }
}
