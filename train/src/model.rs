//! The models the trainer trains — the MLP, the CNN, the reference transformer and GPT-2 of
//! `meshwork-nn` — as one [`Net`]: what each feeds per step, its loss program on a mesh
//! or in a pipeline, its evaluation, its initial weights, its shardings, and what it
//! holds in memory.

use std::collections::HashMap;

use meshwork_nn::{
    Blocking, Cnn, Gpt2, Mlp, Pipeline, Transformer, loss_pipelined, softmax_cross_entropy,
};
use meshwork_partition::spmd::megatron_spec;
use meshwork_program::{Builder, Program, Value};
use meshwork_sharding::PartitionSpec;
use meshwork_types::{DType, Shape, Tensor, TensorSpec};

use crate::rng::SplitMix;
use crate::{Error, Result};

/// How a run's steps are spread over the devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// SPMD on a `data x model` mesh.
    Mesh {
        /// Data-parallel replicas.
        data: usize,
        /// Model-parallel devices per replica.
        model: usize,
    },
    /// `replicas` replicas of a pipeline of `stages` stages, each replica's rows cut
    /// into `micro` micro-batches.
    Pipeline {
        /// Data-parallel replicas.
        replicas: usize,
        /// Stages per replica.
        stages: usize,
        /// Micro-batches per replica and step.
        micro: usize,
    },
}

impl Layout {
    /// The devices it takes.
    pub fn devices(&self) -> usize {
        match *self {
            Layout::Mesh { data, model } => data * model,
            Layout::Pipeline { replicas, stages, .. } => replicas * stages,
        }
    }

    /// `mesh 2x2`, `2 x 3-stage pipeline, 4 micro-batches`.
    pub fn describe(&self) -> String {
        match *self {
            Layout::Mesh { data, model } => format!("mesh {data}x{model}"),
            Layout::Pipeline { replicas, stages, micro } => {
                format!("{replicas} x {stages}-stage pipeline, {micro} micro-batches")
            }
        }
    }
}

/// The memory savers of a run (`--grad-accum`, `--remat`, `--fsdp`): how its steps
/// compute, never what (the losses are the same without them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Savers {
    /// Micro-batches each step's batch is split into, their gradients accumulated.
    pub(crate) micro: usize,
    /// Each block's activations recomputed in the backward pass.
    pub(crate) remat: bool,
    /// Weights, gradients and optimizer state split over the data axis.
    pub(crate) fsdp: bool,
}

impl Default for Savers {
    fn default() -> Savers {
        Savers { micro: 1, remat: false, fsdp: false }
    }
}

/// The instruction ranges of a loss program that a training step may recompute.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Regions {
    /// Each transformer block (`--remat`).
    pub(crate) blocks: Vec<std::ops::Range<usize>>,
    /// GPT-2's attention query blocks and loss chunks ([`Blocking`]): always
    /// recomputed, so that they are held one at a time in the backward pass too.
    pub(crate) pieces: Vec<std::ops::Range<usize>>,
}

impl Regions {
    /// The regions to recompute: the pieces, and the blocks with `remat`.
    pub(crate) fn recomputed(self, remat: bool) -> Vec<std::ops::Range<usize>> {
        let mut out = self.pieces;
        if remat {
            out.extend(self.blocks);
        }
        out
    }
}

/// A run's estimated bytes ([`Net::memory_estimate`]), by what holds them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Estimate {
    /// Weights with their gradients, optimizer state and working copies, on every
    /// device (and the one-device check's).
    pub(crate) weights: f64,
    /// A step's activations (and the check's).
    pub(crate) activations: f64,
    /// A host call's batches, read and fed.
    pub(crate) feeds: f64,
}

impl Estimate {
    /// All of it.
    pub(crate) fn total(&self) -> f64 {
        self.weights + self.activations + self.feeds
    }
}

/// The model a run trains.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Net {
    /// The reference decoder-only transformer.
    Transformer(Transformer),
    /// GPT-2 (Hugging Face's), trained on rows of `seq + 1` tokens.
    Gpt2 {
        /// The model.
        model: Gpt2,
        /// The training context T (at most the model's positions).
        seq: usize,
    },
    /// Two convolutions and a linear head on images.
    Cnn(Cnn),
    /// A two-layer perceptron.
    Mlp(Mlp),
}

fn spec(dtype: DType, dims: &[usize]) -> meshwork_program::Result<TensorSpec> {
    Ok(TensorSpec::new(dtype, Shape::new(dims)?))
}

impl Net {
    /// `mlp`, `cnn` or `transformer`.
    pub fn name(&self) -> &'static str {
        match self {
            Net::Transformer(_) => "transformer",
            Net::Gpt2 { .. } => "gpt2",
            Net::Cnn(_) => "cnn",
            Net::Mlp(_) => "mlp",
        }
    }

    /// Parameters fed each step, before the weights: the rows, or inputs and labels.
    pub fn fed(&self) -> usize {
        match self {
            Net::Transformer(_) | Net::Gpt2 { .. } => 1,
            Net::Cnn(_) | Net::Mlp(_) => 2,
        }
    }

    /// What a row counts for in throughput: its tokens, or one sample.
    pub fn per_row(&self) -> (usize, &'static str) {
        match self {
            Net::Transformer(m) => (m.seq, "tokens"),
            Net::Gpt2 { seq, .. } => (*seq, "tokens"),
            Net::Cnn(_) | Net::Mlp(_) => (1, "samples"),
        }
    }

    /// Whether the accuracy of an evaluation counts classes (or next tokens).
    pub fn classifies(&self) -> bool {
        !matches!(self, Net::Transformer(_) | Net::Gpt2 { .. })
    }

    /// A checkpoint's description of the model.
    pub(crate) fn meta(&self) -> serde_json::Value {
        match self {
            Net::Transformer(m) => serde_json::json!({
                "model": "transformer", "layers": m.layers, "dim": m.dim, "heads": m.heads,
                "ffn": m.ffn, "vocab": m.vocab, "seq": m.seq,
            }),
            Net::Gpt2 { model: g, seq } => serde_json::json!({
                "model": "gpt2", "vocab": g.vocab, "positions": g.positions, "dim": g.dim,
                "layers": g.layers, "heads": g.heads, "inner": g.inner, "eps": g.eps, "seq": seq,
            }),
            Net::Cnn(c) => serde_json::json!({
                "model": "cnn", "image": c.image, "classes": c.classes, "filters": c.filters,
            }),
            Net::Mlp(m) => serde_json::json!({
                "model": "mlp", "features": m.features, "hidden": m.hidden, "classes": m.classes,
            }),
        }
    }

    /// One line for people.
    pub fn describe(&self) -> String {
        match self {
            Net::Transformer(m) => format!(
                "transformer L{} D{} H{} F{} V{} T{}",
                m.layers, m.dim, m.heads, m.ffn, m.vocab, m.seq
            ),
            Net::Gpt2 { model: g, seq } => format!(
                "GPT-2 L{} D{} H{} F{} V{} context {seq} of {}",
                g.layers, g.dim, g.heads, g.inner, g.vocab, g.positions
            ),
            Net::Cnn(c) => format!(
                "CNN conv3x3x{} conv3x3x{}/2 linear({}) on {}x{}x{} images",
                c.filters[0], c.filters[1], c.classes, c.image[0], c.image[1], c.image[2]
            ),
            Net::Mlp(m) => format!("MLP {} -> {} -> {}", m.features, m.hidden, m.classes),
        }
    }

    /// The fed parameters for `batch` rows.
    pub(crate) fn feeds(
        &self,
        b: &mut Builder,
        batch: usize,
        dtype: DType,
    ) -> meshwork_program::Result<Vec<Value>> {
        Ok(match self {
            Net::Transformer(m) => vec![b.param("rows", spec(DType::I32, &[batch, m.seq + 1])?)?],
            Net::Gpt2 { seq, .. } => vec![b.param("rows", spec(DType::I32, &[batch, seq + 1])?)?],
            Net::Cnn(c) => {
                let [h, w, ch] = c.image;
                vec![
                    b.param("x", spec(dtype, &[batch, h, w, ch])?)?,
                    b.param("y", spec(DType::I32, &[batch])?)?,
                ]
            }
            Net::Mlp(m) => vec![
                b.param("x", spec(dtype, &[batch, m.features])?)?,
                b.param("y", spec(DType::I32, &[batch])?)?,
            ],
        })
    }

    /// The loss program of `batch` rows laid out by `layout` (device scopes for a
    /// pipeline), and its loss value: the fed parameters first, then the weights.
    pub(crate) fn loss_program(
        &self,
        batch: usize,
        dtype: DType,
        layout: Layout,
    ) -> Result<(Program, Value)> {
        self.loss_program_blocks(batch, dtype, layout, None, Blocking::default())
            .map(|(p, l, _)| (p, l))
    }

    /// [`loss_program`](Self::loss_program) with its products computed in `precision`
    /// (`--precision`: bf16 or f16, the weights and everything else in `dtype`) and
    /// GPT-2's attention and loss cut into pieces by `blocking`, and the regions a
    /// step recomputes in its backward pass.
    pub(crate) fn loss_program_blocks(
        &self,
        batch: usize,
        dtype: DType,
        layout: Layout,
        precision: Option<DType>,
        blocking: Blocking,
    ) -> Result<(Program, Value, Regions)> {
        let bad = |e: meshwork_program::Error| Error::usage(e.to_string());
        let mut b = Builder::new();
        let feeds = self.feeds(&mut b, batch, dtype).map_err(bad)?;
        let classify = |b: &mut Builder, logits: Value| softmax_cross_entropy(b, logits, feeds[1]);
        if let (Net::Gpt2 { .. }, Layout::Pipeline { .. }) = (self, layout) {
            return Err(Error::usage("--stages: GPT-2 trains on meshes, not in pipelines"));
        }
        // --precision: products in bf16 or f16, everything else in the weights' dtype.
        let loss = b
            .matmuls_in(precision, |b| match (self, layout) {
                (Net::Transformer(model), Layout::Mesh { .. }) => model.loss(b, feeds[0], dtype),
                (Net::Gpt2 { model, .. }, Layout::Mesh { .. }) => {
                    model.loss_blocked(b, feeds[0], dtype, blocking)
                }
                (Net::Gpt2 { .. }, Layout::Pipeline { .. }) => unreachable!("refused above"),
                (Net::Transformer(model), Layout::Pipeline { replicas, stages, micro }) => model
                    .loss_pipelined(b, feeds[0], dtype, &Pipeline::cpus(replicas, stages, micro)),
                (Net::Cnn(c), Layout::Mesh { .. }) => {
                    c.logits(b, feeds[0]).and_then(|l| classify(b, l))
                }
                (Net::Mlp(m), Layout::Mesh { .. }) => {
                    m.logits(b, feeds[0]).and_then(|l| classify(b, l))
                }
                (net, Layout::Pipeline { replicas, stages, micro }) => {
                    let logits_on = |b: &mut Builder, x: Value, st: &[&str]| match net {
                        Net::Cnn(c) => c.logits_on(b, x, st),
                        Net::Mlp(m) => m.logits_on(b, x, st),
                        Net::Transformer(_) | Net::Gpt2 { .. } => unreachable!("matched above"),
                    };
                    let pipeline = Pipeline::cpus(replicas, stages, micro);
                    loss_pipelined(b, feeds[0], feeds[1], &pipeline, &logits_on)
                }
            })
            .map_err(bad)?;
        // A block is a top-level scope `transformer.h.N` (GPT-2) or `layers.N`.
        let block = |name: &str| {
            let index = name.strip_prefix("transformer.h.").or(name.strip_prefix("layers."));
            index.is_some_and(|i| !i.is_empty() && i.bytes().all(|c| c.is_ascii_digit()))
        };
        let blocks = match self {
            Net::Transformer(_) | Net::Gpt2 { .. } => b
                .scope_spans()
                .iter()
                .filter(|(name, _)| block(name))
                .map(|(_, r)| r.clone())
                .collect(),
            Net::Mlp(_) | Net::Cnn(_) => Vec::new(),
        };
        // The attention's query blocks and the loss's chunks.
        let piece =
            |name: &str| name.contains(".attn.q_block.") || name.starts_with("lm_head.chunk.");
        let pieces = b
            .scope_spans()
            .iter()
            .filter(|(name, _)| piece(name))
            .map(|(_, r)| r.clone())
            .collect();
        let program = b.finish(&[loss]).map_err(bad)?;
        let loss = program.results()[0];
        Ok((program, loss, Regions { blocks, pieces }))
    }

    /// The evaluation program of `batch` rows: the mean loss and accuracy (of the class,
    /// or of the next token), the fed parameters first, then the weights.
    pub(crate) fn eval_program(&self, batch: usize, dtype: DType) -> Result<Program> {
        let bad = |e: meshwork_program::Error| Error::usage(e.to_string());
        let mut b = Builder::new();
        let feeds = self.feeds(&mut b, batch, dtype).map_err(bad)?;
        let (logits, labels, axes) = match self {
            Net::Transformer(model) => {
                let rows = feeds[0];
                let inputs = b.slice(rows, &[0, 0], &[batch, model.seq], &[1, 1]).map_err(bad)?;
                let targets =
                    b.slice(rows, &[0, 1], &[batch, model.seq + 1], &[1, 1]).map_err(bad)?;
                (model.logits(&mut b, inputs, dtype).map_err(bad)?, targets, vec![0, 1])
            }
            Net::Gpt2 { model, seq } => {
                let rows = feeds[0];
                let inputs = b.slice(rows, &[0, 0], &[batch, *seq], &[1, 1]).map_err(bad)?;
                let targets = b.slice(rows, &[0, 1], &[batch, seq + 1], &[1, 1]).map_err(bad)?;
                (model.logits(&mut b, inputs, dtype).map_err(bad)?, targets, vec![0, 1])
            }
            Net::Cnn(c) => (c.logits(&mut b, feeds[0]).map_err(bad)?, feeds[1], vec![0]),
            Net::Mlp(m) => (m.logits(&mut b, feeds[0]).map_err(bad)?, feeds[1], vec![0]),
        };
        let loss = softmax_cross_entropy(&mut b, logits, labels).map_err(bad)?;
        let pred = b.argmax(logits, -1).map_err(bad)?;
        let pred = b.convert(pred, DType::I32).map_err(bad)?;
        let hit = b.eq(pred, labels).map_err(bad)?;
        let hit = b.convert(hit, dtype).map_err(bad)?;
        let accuracy = b.reduce_mean(hit, &axes, false).map_err(bad)?;
        b.finish(&[loss, accuracy]).map_err(bad)
    }

    /// Each weight's partition spec on a `data x model` mesh: the MLP's hidden layer
    /// over `model` (W1 by columns, b1 with it, W2 by rows), the transformer's blocks
    /// by Megatron's specs, the rest replicated.
    pub(crate) fn weight_spec(&self, name: &str, rank: usize) -> PartitionSpec {
        let parse = |s: &str| s.parse().expect("a valid partition spec");
        match (self, name) {
            (Net::Mlp(_), "w1") => parse("P(None, 'model')"),
            (Net::Mlp(_), "b1") => parse("P('model')"),
            (Net::Mlp(_), "w2") => parse("P('model', None)"),
            (Net::Mlp(_) | Net::Cnn(_), _) => PartitionSpec::replicated(),
            (Net::Transformer(_) | Net::Gpt2 { .. }, _) => megatron_spec(name, rank),
        }
    }

    /// Weight `name` of `dims`'s layout under `--fsdp` on a `data x model` mesh: its
    /// [`weight_spec`](Self::weight_spec) (none when `model` is 1) with the data axis
    /// added on its largest dimension that the model axis does not split and that
    /// `data` divides (the first of equals); `None` when it has none, and it stays
    /// whole on every replica.
    pub(crate) fn fsdp_spec(
        &self,
        name: &str,
        dims: &[usize],
        (data, model): (usize, usize),
    ) -> Option<PartitionSpec> {
        use meshwork_sharding::DimSpec;
        let base = match model {
            1 => PartitionSpec::replicated(),
            _ => self.weight_spec(name, dims.len()),
        };
        let mut specs: Vec<DimSpec> = (0..dims.len())
            .map(|d| base.dims().get(d).cloned().unwrap_or(DimSpec::Replicated))
            .collect();
        if data < 2 {
            return None;
        }
        let pick = (0..dims.len())
            .filter(|&d| specs[d] == DimSpec::Replicated && dims[d].is_multiple_of(data))
            .max_by_key(|&d| (dims[d], std::cmp::Reverse(d)))?;
        specs[pick] = DimSpec::Axes(vec!["data".into()]);
        Some(PartitionSpec::new(specs))
    }

    /// Each weight's name and dims, as the model program declares them.
    pub(crate) fn weight_dims(&self) -> Result<Vec<(String, Vec<usize>)>> {
        let (program, _) = self.loss_program(1, DType::F64, Layout::Mesh { data: 1, model: 1 })?;
        Ok(program.params()[self.fed()..]
            .iter()
            .map(|p| (p.name.clone(), p.spec.shape.dims().to_vec()))
            .collect())
    }

    /// Its blocks (the transformer's and GPT-2's; 0 for the others).
    fn layers(&self) -> usize {
        match self {
            Net::Transformer(m) => m.layers,
            Net::Gpt2 { model, .. } => model.layers,
            Net::Mlp(_) | Net::Cnn(_) => 0,
        }
    }

    /// Its weights' element count.
    pub fn parameters(&self) -> f64 {
        match self {
            Net::Transformer(m) => {
                let [v, t, d, f, l] = [m.vocab, m.seq, m.dim, m.ffn, m.layers].map(|x| x as f64);
                2.0 * v * d + t * d + l * (4.0 * d * d + 2.0 * d * f + f + 5.0 * d) + 2.0 * d
            }
            Net::Gpt2 { model, .. } => model
                .parameters()
                .iter()
                .map(|(_, s)| s.iter().map(|&d| d as f64).product::<f64>())
                .sum(),
            Net::Cnn(c) => c.parameters() as f64,
            Net::Mlp(m) => m.parameters() as f64,
        }
    }

    /// Elements of a row's fed inputs (tokens, pixels or features, and labels).
    pub(crate) fn row_elements(&self) -> f64 {
        match self {
            Net::Transformer(m) => (m.seq + 1) as f64,
            Net::Gpt2 { seq, .. } => (seq + 1) as f64,
            Net::Cnn(c) => (c.image.iter().product::<usize>() + 1) as f64,
            Net::Mlp(m) => (m.features + 1) as f64,
        }
    }

    /// Activation elements a step computes per row (forward values and their
    /// gradients); with `remat`, what a step holds at once: every block's input and one
    /// block's values.
    fn activations_per_row(&self, remat: bool) -> f64 {
        // (per-row elements outside the blocks, of one block, of a block's input)
        let (outside, block, input, layers) = match self {
            Net::Transformer(m) => {
                let [v, t, d, f, h] = [m.vocab, m.seq, m.dim, m.ffn, m.heads].map(|x| x as f64);
                let rows = t + 1.0;
                let block = rows * (12.0 * d + 3.0 * f + 3.0 * h * t);
                (rows * 3.0 * v, block, rows * d, m.layers as f64)
            }
            Net::Gpt2 { model: g, seq } => {
                let [v, t, d, f, h] = [g.vocab, *seq, g.dim, g.inner, g.heads].map(|x| x as f64);
                let rows = t + 1.0;
                let block = rows * (14.0 * d + 3.0 * f + 3.0 * h * t);
                (rows * 3.0 * v, block, rows * d, g.layers as f64)
            }
            Net::Cnn(c) => {
                let [hh, w, ch] = c.image.map(|x| x as f64);
                let [f1, f2, k] = [c.filters[0], c.filters[1], c.classes].map(|x| x as f64);
                return hh * w * (ch + 3.0 * f1 + 3.0 * f2) + 3.0 * k;
            }
            Net::Mlp(m) => {
                let [f, h, k] = [m.features, m.hidden, m.classes].map(|x| x as f64);
                return f + 3.0 * h + 3.0 * k;
            }
        };
        if remat && layers > 0.0 {
            outside + layers * input + block
        } else {
            outside + layers * block
        }
    }

    /// Bytes a run holds at once, roughly (in f64, so no size overflows): every
    /// device's weights with their gradients, optimizer state and working copies (a
    /// `1/D` part of each weight `--fsdp` splits over `D` replicas), a step's
    /// activations (of one micro-batch with `--grad-accum`, one block's at a time with
    /// `--remat`), a host call's batches (`steps_per_run` of `batch` rows, built at
    /// once and split per device), and the one-device check's copy of it all (which
    /// runs without the savers).
    pub(crate) fn memory_estimate(
        &self,
        batch: usize,
        steps_per_run: usize,
        dtype: DType,
        layout: Layout,
        check: bool,
        savers: Savers,
    ) -> Estimate {
        let size = dtype.size_in_bytes() as f64;
        let b = batch as f64;
        let devices = layout.devices() as f64;
        let checked = f64::from(u8::from(check));
        let whole = self.parameters();
        let held = match layout {
            Layout::Mesh { data, model } if savers.fsdp && data > 1 => {
                self.weight_dims().map_or(whole, |ws| {
                    ws.iter()
                        .map(|(name, dims)| {
                            let n: f64 = dims.iter().map(|&d| d as f64).product();
                            match self.fsdp_spec(name, dims, (data, model)) {
                                Some(_) => n / data as f64,
                                None => n,
                            }
                        })
                        .sum()
                })
            }
            _ => whole,
        };
        // --fsdp's whole copies: every weight gathered for the step, or (with --remat,
        // which gathers a block's weights again in its backward pass) a block's
        // weights and whole gradients at a time.
        let gathered = match layout {
            Layout::Mesh { data, .. } if savers.fsdp && data > 1 => {
                let layers = self.layers().max(1) as f64;
                if savers.remat { 2.0 * whole / layers } else { whole }
            }
            _ => 0.0,
        };
        let weights = ((held * 6.0 + gathered) * devices + whole * 6.0 * checked) * size;
        // The run's own (counted twice over a mesh without the check) and the check's.
        let own = (devices + checked).min(2.0) - checked;
        let micro = savers.micro.max(1) as f64;
        let activations = 2.0
            * size
            * (own * b / micro * self.activations_per_row(savers.remat)
                + checked * b * self.activations_per_row(false));
        // The host call's feeds: the global batches, then their parts on the devices
        // (the check's too), in f64 where they are read and in the dtype where fed.
        let calls = steps_per_run.max(1) as f64;
        let feeds = calls * b * self.row_elements() * (8.0 + size * (1.0 + checked));
        Estimate { weights, activations, feeds }
    }

    /// Initial weights drawn from `seed` for the weights of `program` (its parameters
    /// after the fed ones): the MLP's as the main job has always drawn them (scaled
    /// normals, zero biases, one stream), the others at the reference run's scales
    /// (matrices and filters at `1/sqrt(fan_in)`).
    pub(crate) fn random_init(
        &self,
        program: &Program,
        seed: u64,
    ) -> Result<HashMap<String, Tensor>> {
        let failed = |e: meshwork_types::Error| Error::failed(e);
        if let Net::Mlp(m) = self {
            let (f, h, c) = (m.features, m.hidden, m.classes);
            let mut rng = SplitMix::new(seed ^ 0x696e_6974);
            let (s1, s2) = (1.0 / (f as f64).sqrt(), 1.0 / (h as f64).sqrt());
            let w1: Vec<f64> = (0..f * h).map(|_| rng.normal() * s1).collect();
            let w2: Vec<f64> = (0..h * c).map(|_| rng.normal() * s2).collect();
            return Ok(HashMap::from([
                ("w1".to_string(), Tensor::f64(&[f, h], w1).map_err(failed)?),
                ("b1".to_string(), Tensor::f64(&[h], vec![0.0; h]).map_err(failed)?),
                ("w2".to_string(), Tensor::f64(&[h, c], w2).map_err(failed)?),
                ("b2".to_string(), Tensor::f64(&[c], vec![0.0; c]).map_err(failed)?),
            ]));
        }
        let mut rng = SplitMix::new(seed ^ 0x5851_f42d_4c95_7f2d);
        let mut out = HashMap::new();
        if let Net::Gpt2 { model, .. } = self {
            // `GPT2LMHeadModel`'s initialisation: normals of 0.02, the residual
            // projections' scaled by 1/sqrt(2·layers), zero biases, unit LayerNorm.
            let residual = 0.02 / ((2 * model.layers) as f64).sqrt();
            for (name, dims) in model.parameters() {
                let n: usize = dims.iter().product();
                let (scale, shift) = if name.contains(".ln_") && name.ends_with(".weight") {
                    (0.0, 1.0)
                } else if name.ends_with(".bias") {
                    (0.0, 0.0)
                } else if name.ends_with("c_proj.weight") {
                    (residual, 0.0)
                } else {
                    (0.02, 0.0)
                };
                let values = (0..n).map(|_| shift + scale * rng.normal()).collect();
                out.insert(name, Tensor::f64(&dims, values).map_err(failed)?);
            }
            return Ok(out);
        }
        for p in &program.params()[self.fed()..] {
            let d = p.spec.shape.dims();
            let n = p.spec.shape.num_elements();
            let name = p.name.as_str();
            let (scale, shift) = if name == "embed" {
                (0.5, 0.0)
            } else if name == "pos" {
                (0.1, 0.0)
            } else if name.ends_with(".scale") {
                (0.1, 1.0)
            } else if name.ends_with(".bias") || name.ends_with(".b1") || name.ends_with(".b2") {
                (0.0, 0.0)
            } else {
                let fan_in = n / d.last().copied().unwrap_or(1).max(1);
                (1.0 / (fan_in.max(1) as f64).sqrt(), 0.0)
            };
            let values = (0..n).map(|_| shift + scale * rng.normal()).collect();
            out.insert(p.name.clone(), Tensor::f64(d, values).map_err(failed)?);
        }
        Ok(out)
    }
}
