//! The operations of a program and their attributes.

use std::fmt;

use meshwork_types::{DType, ReduceOp};

/// Elementwise functions of one operand.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Unary {
    /// `-x`.
    Neg,
    /// `e^x`.
    Exp,
    /// Natural logarithm.
    Log,
    /// Hyperbolic tangent.
    Tanh,
    /// The sigmoid `1 / (1 + e^-x)`.
    Logistic,
    /// Square root.
    Sqrt,
    /// `1 / sqrt(x)`.
    Rsqrt,
    /// `|x|`.
    Abs,
    /// `x * x`.
    Square,
    /// `max(x, 0)`.
    Relu,
    /// GELU, tanh approximation (`jax.nn.gelu(approximate=True)`).
    Gelu,
    /// Sine.
    Sin,
    /// Cosine.
    Cos,
    /// The identity, whose gradient is zero.
    StopGradient,
    /// The identity, which a compiler may not merge with equal work or move work
    /// across (XLA's `optimization_barrier`): what keeps a rematerialized region's
    /// work from being merged back into the forward pass's. Its gradient passes
    /// through.
    Barrier,
}

/// Elementwise functions of two operands (NumPy broadcasting).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Binary {
    /// `a + b`.
    Add,
    /// `a - b`.
    Sub,
    /// `a * b`.
    Mul,
    /// `a / b`; on integers floor division (`jnp.floor_divide`, Python's `//`), where
    /// a zero divisor is a run-time error and `MIN / -1` wraps to `MIN`.
    Div,
    /// The larger.
    Max,
    /// The smaller.
    Min,
    /// `a ^ b`.
    Pow,
}

/// Elementwise comparisons (NumPy broadcasting, bool result).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Compare {
    /// `a < b`.
    Lt,
    /// `a <= b`.
    Le,
    /// `a > b`.
    Gt,
    /// `a >= b`.
    Ge,
    /// `a == b`.
    Eq,
    /// `a != b`.
    Ne,
}

/// Reductions over axes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reduction {
    /// The sum.
    Sum,
    /// The largest element.
    Max,
    /// The mean.
    Mean,
}

/// `conv2d` padding, as XLA and TensorFlow name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Padding {
    /// Output size `ceil(in / stride)`; the total padding split with the smaller half
    /// before.
    Same,
    /// No padding: output size `floor((in - k) / stride) + 1`.
    Valid,
}

/// One operation. Axes are non-negative here (the builder turns negative axes into
/// these); the ops without operands carry what they make.
#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    /// An elementwise function of one operand.
    Unary(Unary),
    /// An elementwise function of two operands with NumPy broadcasting.
    Binary(Binary),
    /// An elementwise comparison with NumPy broadcasting; bool result.
    Compare(Compare),
    /// `select(pred, on_true, on_false)` (`jnp.where`), broadcasting all three.
    Select,
    /// A rank-0 constant of a float or integer dtype.
    Constant {
        /// The value (converted to `dtype`).
        value: f64,
        /// Its dtype.
        dtype: DType,
    },
    /// XLA's `dot_general`: batch dims first, then the lhs's free dims, then the rhs's.
    DotGeneral {
        /// Contracted dims of the lhs.
        lhs_contract: Vec<usize>,
        /// Contracted dims of the rhs, paired with `lhs_contract` by position.
        rhs_contract: Vec<usize>,
        /// Batch dims of the lhs.
        lhs_batch: Vec<usize>,
        /// Batch dims of the rhs, paired with `lhs_batch` by position.
        rhs_batch: Vec<usize>,
    },
    /// A reduction over `axes` (sorted, distinct), keeping them as size-1 dims if
    /// `keepdims`.
    Reduce {
        /// Which reduction.
        kind: Reduction,
        /// The reduced axes.
        axes: Vec<usize>,
        /// Keep the reduced axes as size 1.
        keepdims: bool,
    },
    /// The same elements in another shape of the same size.
    Reshape {
        /// The new shape.
        shape: Vec<usize>,
    },
    /// Output dim `i` is input dim `perm[i]`.
    Transpose {
        /// A permutation of the dims.
        perm: Vec<usize>,
    },
    /// NumPy broadcasting to `shape`.
    BroadcastTo {
        /// The target shape.
        shape: Vec<usize>,
    },
    /// `lax.slice`: per dim, `start..stop` (stop exclusive) by `step >= 1`.
    Slice {
        /// First index per dim.
        start: Vec<usize>,
        /// End (exclusive) per dim.
        stop: Vec<usize>,
        /// Stride per dim.
        step: Vec<usize>,
    },
    /// Concatenation of the operands along `axis`.
    Concat {
        /// The axis.
        axis: usize,
    },
    /// `jnp.take(table, indices, axis)`: the table's dims before `axis`, then the
    /// indices' shape, then the table's dims after `axis`.
    Take {
        /// The axis of the table that the indices select along.
        axis: usize,
    },
    /// One-hot encoding of integer indices: one more trailing dim of `depth`.
    OneHot {
        /// The number of classes.
        depth: usize,
        /// The output dtype (a float).
        dtype: DType,
    },
    /// Softmax along `axis`.
    Softmax {
        /// The axis.
        axis: usize,
    },
    /// Log-softmax along `axis`.
    LogSoftmax {
        /// The axis.
        axis: usize,
    },
    /// Scaled dot-product attention of heads: queries `[B, H, Tq, D]`, keys
    /// `[B, H, Tk, D]` and values `[B, H, Tk, Dv]` of one float dtype give
    /// `[B, H, Tq, Dv]`. Its meaning is its definition
    /// ([`attention_definition`](crate::composite::attention_definition)): the scores
    /// `q·kᵀ` in the operands' dtype, then in f32 (or the operands' dtype where wider)
    /// scaled, masked to `-1e9` where a key comes after its query (causal, the last
    /// query seeing every key) and softmaxed, then back in the operands' dtype times
    /// the values. One op so that a back end may run it fused (cuDNN's flash
    /// attention on NVIDIA GPUs); the interpreters and XLA's plain lowering run its
    /// definition.
    Attention(AttentionSpec),
    /// [`Op::Attention`]'s gradient with respect to operand `wrt` (0 the queries, 1
    /// the keys, 2 the values), of operands `(q, k, v, dout)`, `dout` the cotangent of
    /// its output: the vector-Jacobian product of its definition.
    AttentionGrad {
        /// The attention differentiated.
        attention: AttentionSpec,
        /// Which operand's gradient.
        wrt: usize,
    },
    /// Softmax cross-entropy of float logits `[..., C]` against integer labels `[...]`
    /// (the logits' shape without the class axis), per position:
    /// `-Σ_c log_softmax(logits)[c] · one_hot(label)[c]`, so `logsumexp − logits[label]`
    /// for a label in `0..C` and 0 for one outside it (an all-zero one-hot row, as
    /// `jax.nn.one_hot` gives). Its meaning is its definition
    /// ([`cross_entropy_definition`](crate::composite::cross_entropy_definition)),
    /// which also makes a row with a non-finite logit NaN. One op so that a back end
    /// may run it in one pass over the logits (the fast interpreter's CPU kernel); the
    /// reference interpreter and XLA run its definition.
    CrossEntropy,
    /// [`Op::CrossEntropy`]'s gradient with respect to the logits, of operands
    /// `(logits, labels, dloss)`, `dloss` the cotangent of its output: the
    /// vector-Jacobian product of its definition, `dloss · (softmax(logits) −
    /// one_hot(label))` (0 for a label outside `0..C`).
    CrossEntropyGrad,
    /// Index of the first maximum along `axis` (i64, the axis removed).
    Argmax {
        /// The axis.
        axis: usize,
    },
    /// 2-D convolution, `x` NHWC and `w` HWIO.
    Conv2d {
        /// Strides along H and W.
        strides: [usize; 2],
        /// SAME or VALID.
        padding: Padding,
    },
    /// Zero padding: `low` before, `high` after and `interior` between the elements
    /// of each dim (XLA's `pad` with a zero value; the transpose of a strided slice).
    Pad {
        /// Zeros before each dim.
        low: Vec<usize>,
        /// Zeros after each dim.
        high: Vec<usize>,
        /// Zeros between neighbouring elements of each dim.
        interior: Vec<usize>,
    },
    /// `operand` with `updates` added at `indices` along `axis` (repeated indices
    /// accumulate): args `[operand, indices, updates]`, `updates` shaped as
    /// `take(operand, indices, axis)`. The transpose of `take`.
    ScatterAdd {
        /// The axis the indices select along.
        axis: usize,
    },
    /// The gradient of `conv2d` with respect to its input: args `[g, w]` (g NHWC of the
    /// convolution's output, w HWIO), result the input's shape (the result spec).
    Conv2dBackpropInput {
        /// The convolution's strides.
        strides: [usize; 2],
        /// Its padding.
        padding: Padding,
        /// The input's shape NHWC.
        input: [usize; 4],
    },
    /// The gradient of `conv2d` with respect to its filter: args `[x, g]`, result the
    /// filter's shape HWIO.
    Conv2dBackpropFilter {
        /// The convolution's strides.
        strides: [usize; 2],
        /// Its padding.
        padding: Padding,
        /// The filter's shape HWIO.
        filter: [usize; 4],
    },
    /// Elementwise conversion to `dtype`.
    Convert {
        /// The target dtype.
        dtype: DType,
    },
    /// A tensor given whole: a table the program closes over (what `jax.jit` makes of
    /// a NumPy array it captures, or a module's non-persistent buffer). Float dtypes
    /// only.
    Literal {
        /// The value.
        value: std::sync::Arc<meshwork_types::Tensor>,
    },
    /// `0, 1, 2, …` along `axis` of a new tensor of `dtype` and `shape`.
    Iota {
        /// Its dtype.
        dtype: DType,
        /// Its shape.
        shape: Vec<usize>,
        /// The counting axis.
        axis: usize,
    },
    /// Uniform random floats as JAX draws them: args `[k1, k2, x]`, `i32` of one
    /// shape (the bits of JAX's `uint32` words); the result `f32` in `[0, 1)`,
    /// `bitcast((y >> 9) | 0x3f800000) - 1` of `y = y1 ^ y2`, the Threefry-2x32 block
    /// (20 rounds) of counter `(0, x)` under key `(k1, k2)`. Element `x` of
    /// `jax.random.uniform(key, shape)` (float32, `jax_threefry_partitionable`) is
    /// the value at `(key[0], key[1], x)`, `x` its index in row-major order: counting
    /// by position, the draw is the same however the array is split. No gradient.
    ThreefryUniform,
    /// Reduces the operand across each group of replicas.
    AllReduce {
        /// The reduction.
        op: ReduceOp,
        /// Replica groups (each replica in one).
        groups: Vec<Vec<usize>>,
    },
    /// Concatenates the group's operands along `axis`, in group order.
    AllGather {
        /// The axis.
        axis: usize,
        /// Replica groups of equal size.
        groups: Vec<Vec<usize>>,
    },
    /// Reduces across the group and keeps this replica's part of `axis`.
    ReduceScatter {
        /// The reduction.
        op: ReduceOp,
        /// The scattered axis (divisible by the group size).
        axis: usize,
        /// Replica groups of equal size.
        groups: Vec<Vec<usize>>,
    },
    /// Splits `split_axis` over the group, exchanges, concatenates on `concat_axis`.
    AllToAll {
        /// The axis split into one piece per member.
        split_axis: usize,
        /// The axis the received pieces are concatenated along.
        concat_axis: usize,
        /// Replica groups of equal size.
        groups: Vec<Vec<usize>>,
    },
    /// This replica's block of `axis`: the dim split into as many blocks as the group
    /// has members, member `k` keeping block `k` (nothing moves; the SPMD
    /// partitioner's local slice of a replicated value).
    ShardSlice {
        /// The axis split.
        axis: usize,
        /// Replica groups of equal size.
        groups: Vec<Vec<usize>>,
    },
    /// The transpose of [`Op::ShardSlice`]: the operand at this replica's block of
    /// `axis` (group size times longer), zeros elsewhere.
    ShardPad {
        /// The axis grown.
        axis: usize,
        /// Replica groups of equal size.
        groups: Vec<Vec<usize>>,
    },
    /// Sends the operand along `(source, target)` replica pairs; a replica that is no
    /// target gets zeros.
    CollectivePermute {
        /// Distinct sources and distinct targets.
        pairs: Vec<(usize, usize)>,
    },
    /// Sends the operand to device `peer` on `channel`; its result is a rank-0 bool
    /// token that orders it.
    Send {
        /// The channel, shared with the matching `Recv`.
        channel: u32,
        /// The receiving device.
        peer: usize,
    },
    /// Receives a tensor of `dtype` and `shape` from device `peer` on `channel`.
    Recv {
        /// The channel, shared with the matching `Send`.
        channel: u32,
        /// The sending device.
        peer: usize,
        /// What arrives.
        dtype: DType,
        /// Its shape.
        shape: Vec<usize>,
    },
    /// Streams the operands to the host's consumer `consumer` (through the outfeed);
    /// its result is a rank-0 bool token.
    Emit {
        /// The consumer id.
        consumer: u32,
    },
}

impl Op {
    /// The op's name in the text form (and the oracle's).
    pub fn name(&self) -> &'static str {
        match self {
            Op::Unary(u) => match u {
                Unary::Neg => "neg",
                Unary::Exp => "exp",
                Unary::Log => "log",
                Unary::Tanh => "tanh",
                Unary::Logistic => "logistic",
                Unary::Sqrt => "sqrt",
                Unary::Rsqrt => "rsqrt",
                Unary::Abs => "abs",
                Unary::Square => "square",
                Unary::Relu => "relu",
                Unary::Gelu => "gelu",
                Unary::Sin => "sin",
                Unary::Cos => "cos",
                Unary::StopGradient => "stop_gradient",
                Unary::Barrier => "optimization_barrier",
            },
            Op::Binary(b) => match b {
                Binary::Add => "add",
                Binary::Sub => "sub",
                Binary::Mul => "mul",
                Binary::Div => "div",
                Binary::Max => "max",
                Binary::Min => "min",
                Binary::Pow => "pow",
            },
            Op::Compare(c) => match c {
                Compare::Lt => "lt",
                Compare::Le => "le",
                Compare::Gt => "gt",
                Compare::Ge => "ge",
                Compare::Eq => "eq",
                Compare::Ne => "ne",
            },
            Op::Select => "select",
            Op::ThreefryUniform => "threefry_uniform",
            Op::Constant { .. } => "constant",
            Op::DotGeneral { .. } => "dot_general",
            Op::Reduce { kind, .. } => match kind {
                Reduction::Sum => "reduce_sum",
                Reduction::Max => "reduce_max",
                Reduction::Mean => "reduce_mean",
            },
            Op::Reshape { .. } => "reshape",
            Op::Transpose { .. } => "transpose",
            Op::BroadcastTo { .. } => "broadcast_to",
            Op::Slice { .. } => "slice",
            Op::Concat { .. } => "concat",
            Op::Take { .. } => "take",
            Op::OneHot { .. } => "one_hot",
            Op::Softmax { .. } => "softmax",
            Op::LogSoftmax { .. } => "log_softmax",
            Op::Argmax { .. } => "argmax",
            Op::Attention(_) => "attention",
            Op::AttentionGrad { .. } => "attention_grad",
            Op::CrossEntropy => "cross_entropy",
            Op::CrossEntropyGrad => "cross_entropy_grad",
            Op::Conv2d { .. } => "conv2d",
            Op::Pad { .. } => "pad",
            Op::ScatterAdd { .. } => "scatter_add",
            Op::Conv2dBackpropInput { .. } => "conv2d_backprop_input",
            Op::Conv2dBackpropFilter { .. } => "conv2d_backprop_filter",
            Op::Convert { .. } => "convert",
            Op::Iota { .. } => "iota",
            Op::Literal { .. } => "literal",
            Op::AllReduce { .. } => "all_reduce",
            Op::AllGather { .. } => "all_gather",
            Op::ReduceScatter { .. } => "reduce_scatter",
            Op::AllToAll { .. } => "all_to_all",
            Op::ShardSlice { .. } => "shard_slice",
            Op::ShardPad { .. } => "shard_pad",
            Op::CollectivePermute { .. } => "collective_permute",
            Op::Send { .. } => "send",
            Op::Recv { .. } => "recv",
            Op::Emit { .. } => "emit",
        }
    }

    /// Whether the op exchanges data with other replicas or devices, or the host, or
    /// needs to know which replica runs it (so an interpreter needs the matching trait
    /// to run it).
    pub fn communicates(&self) -> bool {
        matches!(
            self,
            Op::AllReduce { .. }
                | Op::AllGather { .. }
                | Op::ReduceScatter { .. }
                | Op::AllToAll { .. }
                | Op::CollectivePermute { .. }
                | Op::ShardSlice { .. }
                | Op::ShardPad { .. }
                | Op::Send { .. }
                | Op::Recv { .. }
                | Op::Emit { .. }
        )
    }
}

/// `{1,2}`.
pub(crate) struct List<'a>(pub(crate) &'a [usize]);

impl fmt::Display for List<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("{")?;
        for (k, d) in self.0.iter().enumerate() {
            if k > 0 {
                f.write_str(",")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("}")
    }
}

/// `{{0,1},{2,3}}`.
pub(crate) struct Groups<'a>(pub(crate) &'a [Vec<usize>]);

impl fmt::Display for Groups<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("{")?;
        for (k, g) in self.0.iter().enumerate() {
            if k > 0 {
                f.write_str(",")?;
            }
            write!(f, "{}", List(g))?;
        }
        f.write_str("}")
    }
}

fn reduce_name(op: ReduceOp) -> &'static str {
    match op {
        ReduceOp::Sum => "sum",
        ReduceOp::Mean => "mean",
        ReduceOp::Min => "min",
        ReduceOp::Max => "max",
    }
}

/// The attributes in the text form: `, name=value` for each, in a fixed order.
pub(crate) struct Attributes<'a>(pub(crate) &'a Op);

impl fmt::Display for Attributes<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Op::Unary(_) | Op::Binary(_) | Op::Compare(_) | Op::Select | Op::ThreefryUniform => {
                Ok(())
            }
            // `{:?}` prints the shortest text that reads back to the same f64.
            Op::Constant { value, .. } => write!(f, ", value={value:?}"),
            Op::DotGeneral { lhs_contract, rhs_contract, lhs_batch, rhs_batch } => write!(
                f,
                ", lhs_contract={}, rhs_contract={}, lhs_batch={}, rhs_batch={}",
                List(lhs_contract),
                List(rhs_contract),
                List(lhs_batch),
                List(rhs_batch)
            ),
            Op::Reduce { axes, keepdims, .. } => {
                write!(f, ", axes={}, keepdims={keepdims}", List(axes))
            }
            Op::Reshape { shape } | Op::BroadcastTo { shape } => {
                write!(f, ", shape={}", List(shape))
            }
            Op::Transpose { perm } => write!(f, ", perm={}", List(perm)),
            Op::Slice { start, stop, step } => {
                write!(f, ", start={}, stop={}, step={}", List(start), List(stop), List(step))
            }
            Op::Concat { axis }
            | Op::Take { axis }
            | Op::Softmax { axis }
            | Op::LogSoftmax { axis }
            | Op::Argmax { axis } => write!(f, ", axis={axis}"),
            Op::OneHot { depth, .. } => write!(f, ", depth={depth}"),
            Op::Attention(a) => write!(f, "{a}"),
            Op::AttentionGrad { attention, wrt } => write!(f, "{attention}, wrt={wrt}"),
            Op::Conv2d { strides, padding }
            | Op::Conv2dBackpropInput { strides, padding, .. }
            | Op::Conv2dBackpropFilter { strides, padding, .. } => write!(
                f,
                ", strides={}, padding={}",
                List(strides),
                match padding {
                    Padding::Same => "SAME",
                    Padding::Valid => "VALID",
                }
            ),
            Op::Pad { low, high, interior } => {
                write!(f, ", low={}, high={}, interior={}", List(low), List(high), List(interior))
            }
            Op::ScatterAdd { axis } => write!(f, ", axis={axis}"),
            Op::Convert { .. } | Op::CrossEntropy | Op::CrossEntropyGrad => Ok(()),
            Op::Iota { axis, .. } => write!(f, ", axis={axis}"),
            // Its little-endian bytes in hex: the text reads back to the same value.
            Op::Literal { value } => {
                f.write_str(", bytes=")?;
                value.to_le_bytes().iter().try_for_each(|b| write!(f, "{b:02x}"))
            }
            Op::AllReduce { op, groups } => {
                write!(f, ", op={}, groups={}", reduce_name(*op), Groups(groups))
            }
            Op::AllGather { axis, groups }
            | Op::ShardSlice { axis, groups }
            | Op::ShardPad { axis, groups } => {
                write!(f, ", axis={axis}, groups={}", Groups(groups))
            }
            Op::ReduceScatter { op, axis, groups } => {
                write!(f, ", op={}, axis={axis}, groups={}", reduce_name(*op), Groups(groups))
            }
            Op::AllToAll { split_axis, concat_axis, groups } => write!(
                f,
                ", split_axis={split_axis}, concat_axis={concat_axis}, groups={}",
                Groups(groups)
            ),
            Op::CollectivePermute { pairs } => {
                f.write_str(", pairs={")?;
                for (k, (s, t)) in pairs.iter().enumerate() {
                    if k > 0 {
                        f.write_str(",")?;
                    }
                    write!(f, "{{{s},{t}}}")?;
                }
                f.write_str("}")
            }
            Op::Send { channel, peer } | Op::Recv { channel, peer, .. } => {
                write!(f, ", channel={channel}, peer={peer}")
            }
            Op::Emit { consumer } => write!(f, ", consumer={consumer}"),
        }
    }
}

/// How [`Op::Attention`] scales and masks its scores.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionSpec {
    /// The scores are multiplied by `scale`, or divided by it when `divide` (the two
    /// round differently: GPT-2 divides by `√D`, the Llama family multiplies by
    /// `D^-½`).
    pub scale: f64,
    /// Divide by `scale` instead of multiplying.
    pub divide: bool,
    /// Mask the keys after each query (the last query sees every key).
    pub causal: bool,
}

impl AttentionSpec {
    /// The factor the scores are multiplied by, in effect.
    pub fn multiplier(&self) -> f64 {
        if self.divide { 1.0 / self.scale } else { self.scale }
    }
}

impl fmt::Display for AttentionSpec {
    /// `, scale=…, divide=…, causal=…`, as in the text form.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, ", scale={:?}, divide={}, causal={}", self.scale, self.divide, self.causal)
    }
}
