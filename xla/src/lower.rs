//! A meshwork [`Program`] lowered to a StableHLO module in MLIR's generic text form,
//! which every PJRT plugin reads (format `"mlir"`): one `func.func @main` whose
//! arguments are the program's parameters, then what it `recv`s, and whose results are
//! its results, then what it `emit`s, then what it `send`s. A placed program's parts
//! are separate executables, so their transfers are for the runtime (the strategy's
//! XLA back end copies a part's output to another part's device), not XLA channels
//! between programs.
//!
//! A module for XLA's partitioner carries `mhlo.sharding` on its arguments and results
//! (XLA's `HloSharding` text, as JAX writes it for `jit` with `NamedSharding`s) and
//! `mhlo.num_partitions`; it is compiled with `use_spmd_partitioning`.
//!
//! Each op keeps the meaning the program layer gives it, lowered as JAX lowers the same
//! function (`jnp.floor_divide` on integers is a truncating divide corrected by the
//! remainder's sign, `argmax` a max then the first index reaching it, `softmax` the
//! max-shifted exponentials). Where the program layer leaves a meaning to the back end,
//! XLA's holds, and the interpreters were made to agree:
//! - `take` clamps an index outside the axis into it (XLA's `gather`), and so does
//!   `scatter_add`, its transpose (its indices are clamped before XLA's `scatter`,
//!   which would drop such an update);
//! - float → int `convert` truncates toward zero, saturates, and maps NaN to 0;
//! - `max`/`min` and `reduce_max` propagate NaN.
//!
//! What the interpreters refuse at run time and XLA cannot (integer division by zero,
//! a negative integer power) gives XLA's values: `x / 0` is `-1` and `x ^ -n` is 0
//! except for `x = ±1`.

use std::fmt::Write as _;

use meshwork_program::{Binary, Compare, Op, Padding, Program, Reduction, Unary, Value};
use meshwork_types::{DType, ReduceOp, TensorSpec};

use crate::{Error, Result};

/// How a program is lowered.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LowerOptions {
    /// Replicas the module runs on (`mhlo.num_replicas`); 0 or 1 for one device.
    pub replicas: usize,
    /// `(result, parameter)` pairs: the parameter's buffer is donated to the result
    /// (`tf.aliasing_output`), as `jax.jit(donate_argnums=…)` does.
    pub donate: Vec<(usize, usize)>,
    /// Partitions for XLA's SPMD partitioner (`mhlo.num_partitions`); 0 or 1 for none.
    pub partitions: usize,
    /// With partitions: each parameter's sharding, XLA's `HloSharding` text
    /// (`{devices=[2,1]<=[2]}`); empty for none.
    pub param_shardings: Vec<String>,
    /// With partitions: each result's sharding (what the program `emit`s is
    /// `{replicated}`); empty for none.
    pub result_shardings: Vec<String>,
    /// Lower [`Op::Attention`] and [`Op::AttentionGrad`] to cuDNN's fused attention
    /// (`__cudnn$fmhaSoftmax` and `…Backward`, as JAX's
    /// `dot_product_attention(implementation="cudnn")`): for NVIDIA GPUs only, whose
    /// plugin has the handlers. Otherwise they lower as their definitions.
    pub cudnn_attention: bool,
}

/// `s` as an MLIR string literal.
fn quoted(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\22"),
            '\\' => out.push_str("\\5C"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A lowered program.
#[derive(Debug, Clone, PartialEq)]
pub struct Lowered {
    /// The module's text.
    pub text: String,
    /// The module's outputs: the program's results, then each `emit`'s operands, then
    /// each `send`'s operand.
    pub outputs: Vec<TensorSpec>,
    /// Each `emit`, in program order: its consumer and how many outputs it adds.
    pub emits: Vec<(u32, usize)>,
    /// Each `send`, in program order: an output the runtime moves to the peer device
    /// (after the results and the emits' outputs).
    pub sends: Vec<Transfer>,
    /// Each `recv`, in program order: a parameter the runtime fills from the peer
    /// device (after the program's parameters).
    pub recvs: Vec<Transfer>,
}

/// A tensor a `send` or `recv` moves between devices: in the lowered module an output
/// (send) or a parameter (recv), for a runtime to move between executables (none does
/// yet), so that one executable per device needs no cross-program channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transfer {
    /// The channel, shared by the matching send and recv.
    pub channel: u32,
    /// The other device.
    pub peer: usize,
    /// What moves.
    pub spec: TensorSpec,
}

/// The StableHLO element type of a dtype.
fn element(dtype: DType) -> Result<&'static str, String> {
    Ok(match dtype {
        DType::Bool => "i1",
        DType::I8 => "i8",
        DType::I16 => "i16",
        DType::I32 => "i32",
        DType::I64 => "i64",
        DType::U8 => "ui8",
        DType::U16 => "ui16",
        DType::U32 => "ui32",
        DType::U64 => "ui64",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::F32 => "f32",
        DType::F64 => "f64",
    })
}

/// `tensor<2x3xf32>`.
fn ty(dtype: DType, dims: &[usize]) -> String {
    let mut s = String::from("tensor<");
    for d in dims {
        let _ = write!(s, "{d}x");
    }
    s.push_str(element(dtype).unwrap_or("f32"));
    s.push('>');
    s
}

/// `array<i64: 1, 2>`.
fn i64s(v: impl IntoIterator<Item = impl std::fmt::Display>) -> String {
    let items: Vec<String> = v.into_iter().map(|x| x.to_string()).collect();
    if items.is_empty() { "array<i64>".into() } else { format!("array<i64: {}>", items.join(", ")) }
}

/// `[1, 2]`.
fn list(v: &[usize]) -> String {
    let items: Vec<String> = v.iter().map(ToString::to_string).collect();
    format!("[{}]", items.join(", "))
}

/// `dense<[[0, 1], [2, 3]]> : tensor<2x2xi64>`, rows padded with -1 to one length.
fn groups_attr(groups: &[Vec<usize>]) -> String {
    let width = groups.iter().map(Vec::len).max().unwrap_or(0);
    let rows: Vec<String> = groups
        .iter()
        .map(|g| {
            let mut r: Vec<String> = g.iter().map(ToString::to_string).collect();
            r.resize(width, "-1".into());
            format!("[{}]", r.join(", "))
        })
        .collect();
    format!("dense<[{}]> : tensor<{}x{}xi64>", rows.join(", "), groups.len(), width)
}

/// A rank-0 constant's literal: exact (hexadecimal bits for floats).
fn literal(dtype: DType, value: f64) -> String {
    match dtype {
        DType::F64 => format!("0x{:016X}", value.to_bits()),
        DType::F32 => format!("0x{:08X}", (value as f32).to_bits()),
        DType::BF16 => format!("0x{:04X}", meshwork_types::bf16::from_f32(value as f32).to_bits()),
        DType::F16 => format!("0x{:04X}", meshwork_types::f16::from_f32(value as f32).to_bits()),
        DType::Bool => (value != 0.0).to_string(),
        _ => (value as i64).to_string(),
    }
}

/// The module being written.
struct Emitter<'p> {
    program: &'p Program,
    body: String,
    next: usize,
    /// The name of each program value (`%arg0`, `%3`).
    names: Vec<String>,
    /// Extra outputs of `emit`s: names and specs.
    emitted: Vec<(String, TensorSpec)>,
    emits: Vec<(u32, usize)>,
    /// Values sent (extra outputs after the emits'), and what they are.
    sent: Vec<String>,
    sends: Vec<Transfer>,
    recvs: Vec<Transfer>,
    /// Where the current instruction is, for errors.
    at: String,
    /// The replicas the module runs on (the size of per-replica tables).
    replicas: usize,
    /// Attention through cuDNN ([`LowerOptions::cudnn_attention`]).
    cudnn: bool,
    /// cuDNN calls made, by their operands' names: a forward's output and softmax
    /// statistics (by `q, k, v`), a backward's three gradients (by `q, k, v, dout`).
    fmha: std::collections::HashMap<Vec<String>, Vec<String>>,
}

impl Emitter<'_> {
    fn fresh(&mut self) -> String {
        self.next += 1;
        format!("%t{}", self.next)
    }

    /// Writes `%r = "name"(operands) {attrs} : (operand types) -> result type`.
    fn op(&mut self, name: &str, operands: &[(&str, &str)], attrs: &str, result: &str) -> String {
        self.op_region(name, operands, "", attrs, result)
    }

    fn op_region(
        &mut self,
        name: &str,
        operands: &[(&str, &str)],
        region: &str,
        attrs: &str,
        result: &str,
    ) -> String {
        let r = self.fresh();
        let names: Vec<&str> = operands.iter().map(|o| o.0).collect();
        let types: Vec<&str> = operands.iter().map(|o| o.1).collect();
        let _ = write!(self.body, "    {r} = \"stablehlo.{name}\"({})", names.join(", "));
        if !region.is_empty() {
            let _ = write!(self.body, " ({region})");
        }
        if !attrs.is_empty() {
            let _ = write!(self.body, " {{{attrs}}}");
        }
        let _ = writeln!(self.body, " : ({}) -> {result}", types.join(", "));
        r
    }

    /// A scalar constant broadcast to `dims`.
    fn splat(&mut self, dtype: DType, value: f64, dims: &[usize]) -> String {
        let scalar = ty(dtype, &[]);
        let c = self.op(
            "constant",
            &[],
            &format!("value = dense<{}> : {scalar}", literal(dtype, value)),
            &scalar,
        );
        if dims.is_empty() {
            return c;
        }
        self.op(
            "broadcast_in_dim",
            &[(&c, &scalar)],
            "broadcast_dimensions = array<i64>",
            &ty(dtype, dims),
        )
    }

    /// NumPy broadcasting of `x` (of `from` dims) to `to` dims.
    fn broadcast(&mut self, x: &str, dtype: DType, from: &[usize], to: &[usize]) -> String {
        if from == to {
            return x.to_string();
        }
        let offset = to.len() - from.len();
        self.op(
            "broadcast_in_dim",
            &[(x, &ty(dtype, from))],
            &format!("broadcast_dimensions = {}", i64s(offset..to.len())),
            &ty(dtype, to),
        )
    }

    /// `x` broadcast along the dims not in `kept` (`kept[i]` is where dim `i` of `x`
    /// goes in `to`).
    fn broadcast_dims(
        &mut self,
        x: &str,
        dtype: DType,
        from: &[usize],
        kept: &[usize],
        to: &[usize],
    ) -> String {
        self.op(
            "broadcast_in_dim",
            &[(x, &ty(dtype, from))],
            &format!("broadcast_dimensions = {}", i64s(kept.iter())),
            &ty(dtype, to),
        )
    }

    /// A binary elementwise op on operands of the same dims.
    fn binary(&mut self, name: &str, a: &str, b: &str, dtype: DType, dims: &[usize]) -> String {
        let t = ty(dtype, dims);
        self.op(name, &[(a, &t), (b, &t)], "", &t)
    }

    /// [`Op::ThreefryUniform`] of `i32` keys and counters of `dims`, in 32-bit
    /// unsigned integer ops (`meshwork_program::random` is its definition; JAX lowers
    /// its `threefry2x32` on the CPU to the same ops).
    fn threefry_uniform(&mut self, [k1, k2, x]: [&str; 3], dims: &[usize]) -> String {
        let (i, u) = (ty(DType::I32, dims), ty(DType::U32, dims));
        let unsigned = |e: &mut Self, v: &str| e.op("bitcast_convert", &[(v, &i)], "", &u);
        let (k1, k2, x) = (unsigned(self, k1), unsigned(self, k2), unsigned(self, x));
        let c = |e: &mut Self, v: u32| e.splat(DType::U32, f64::from(v), dims);
        let add = |e: &mut Self, a: &str, b: &str| e.binary("add", a, b, DType::U32, dims);
        let xor = |e: &mut Self, a: &str, b: &str| e.binary("xor", a, b, DType::U32, dims);
        let parity = c(self, 0x1BD1_1BDA);
        let k12 = xor(self, &k1, &k2);
        let ks = [k1.clone(), k2.clone(), xor(self, &k12, &parity)];
        // The counter's high word is 0.
        let (mut x0, mut x1) = (ks[0].clone(), add(self, &x, &ks[1]));
        for i in 0..5 {
            for r in [[13, 15, 26, 6], [17, 29, 16, 24]][i % 2] {
                x0 = add(self, &x0, &x1);
                let (left, right) = (c(self, r), c(self, 32 - r));
                let hi = self.binary("shift_left", &x1, &left, DType::U32, dims);
                let lo = self.binary("shift_right_logical", &x1, &right, DType::U32, dims);
                let rotated = self.binary("or", &hi, &lo, DType::U32, dims);
                x1 = xor(self, &rotated, &x0);
            }
            x0 = add(self, &x0, &ks[(i + 1) % 3]);
            let round = c(self, i as u32 + 1);
            let k = add(self, &ks[(i + 2) % 3], &round);
            x1 = add(self, &x1, &k);
        }
        let y = xor(self, &x0, &x1);
        let nine = c(self, 9);
        let mantissa = self.binary("shift_right_logical", &y, &nine, DType::U32, dims);
        let one_bits = c(self, 0x3f80_0000);
        let bits = self.binary("or", &mantissa, &one_bits, DType::U32, dims);
        let f = ty(DType::F32, dims);
        let one_to_two = self.op("bitcast_convert", &[(&bits, &u)], "", &f);
        let one = self.splat(DType::F32, 1.0, dims);
        self.binary("subtract", &one_to_two, &one, DType::F32, dims)
    }

    fn unary(&mut self, name: &str, a: &str, dtype: DType, dims: &[usize]) -> String {
        let t = ty(dtype, dims);
        self.op(name, &[(a, &t)], "", &t)
    }

    fn compare(&mut self, dir: &str, a: &str, b: &str, dtype: DType, dims: &[usize]) -> String {
        let t = ty(dtype, dims);
        self.op(
            "compare",
            &[(a, &t), (b, &t)],
            &format!("comparison_direction = #stablehlo<comparison_direction {dir}>"),
            &ty(DType::Bool, dims),
        )
    }

    /// The body of a two-operand scalar computation (`add`, `maximum`, …).
    fn region(name: &str, dtype: DType) -> String {
        let t = ty(dtype, &[]);
        format!(
            "{{\n    ^bb0(%a: {t}, %b: {t}):\n      %c = \"stablehlo.{name}\"(%a, %b) : ({t}, {t}) -> {t}\n      \"stablehlo.return\"(%c) : ({t}) -> ()\n    }}"
        )
    }

    /// A reduction of `x` over `axes` with `name` (`add`, `maximum`, `minimum`)
    /// starting from `init`.
    fn reduce(
        &mut self,
        name: &str,
        init: f64,
        x: &str,
        dtype: DType,
        dims: &[usize],
        axes: &[usize],
    ) -> String {
        let zero = self.splat(dtype, init, &[]);
        let out: Vec<usize> =
            (0..dims.len()).filter(|d| !axes.contains(d)).map(|d| dims[d]).collect();
        let scalar = ty(dtype, &[]);
        self.op_region(
            "reduce",
            &[(x, &ty(dtype, dims)), (&zero, &scalar)],
            &Self::region(name, dtype),
            &format!("dimensions = {}", i64s(axes.iter())),
            &ty(dtype, &out),
        )
    }

    fn fail(&self, problem: impl Into<String>) -> Error {
        Error::Lower { at: self.at.clone(), problem: problem.into() }
    }
}

/// The smallest value of an integer or float dtype (a max-reduction's start).
fn lowest(dtype: DType) -> f64 {
    match dtype {
        DType::I32 => f64::from(i32::MIN),
        DType::I64 => i64::MIN as f64,
        DType::Bool => 0.0,
        _ => f64::NEG_INFINITY,
    }
}

/// The `stablehlo` op that combines a collective's [`ReduceOp`] (a mean sums, then
/// divides).
fn combiner(op: ReduceOp) -> &'static str {
    match op {
        ReduceOp::Sum | ReduceOp::Mean => "add",
        ReduceOp::Min => "minimum",
        ReduceOp::Max => "maximum",
    }
}

/// Lowers `program` to a StableHLO module.
pub fn lower(program: &Program, options: &LowerOptions) -> Result<Lowered> {
    let np = program.params().len();
    let mut e = Emitter {
        program,
        body: String::new(),
        next: 0,
        names: (0..np).map(|k| format!("%arg{k}")).collect(),
        emitted: Vec::new(),
        emits: Vec::new(),
        sent: Vec::new(),
        sends: Vec::new(),
        recvs: Vec::new(),
        at: String::new(),
        replicas: options.replicas.max(1),
        cudnn: options.cudnn_attention,
        fmha: std::collections::HashMap::new(),
    };
    for (i, instr) in program.instrs().iter().enumerate() {
        e.at = format!("%{} = {}", np + i, instr.op.name());
        let name = lower_instr(&mut e, instr)?;
        e.names.push(name);
    }
    let mut outputs: Vec<TensorSpec> = Vec::new();
    let mut returned: Vec<String> = Vec::new();
    for &r in program.results() {
        e.at = format!("result {r}");
        let spec = spec_of(&e, r)?;
        returned.push(e.names[r.index()].clone());
        outputs.push(spec);
    }
    for (name, spec) in &e.emitted {
        returned.push(name.clone());
        outputs.push(spec.clone());
    }
    for (name, t) in e.sent.iter().zip(&e.sends) {
        returned.push(name.clone());
        outputs.push(t.spec.clone());
    }
    // The module and its function in generic form too: `builtin.module` holding a
    // `func.func` whose one block takes the arguments.
    let replicas = options.replicas.max(1);
    let partitions = options.partitions.max(1);
    let mut args: Vec<(String, String)> = program
        .params()
        .iter()
        .enumerate()
        .map(|(k, p)| (format!("%arg{k}"), ty(p.spec.dtype, p.spec.shape.dims())))
        .collect();
    args.extend(
        e.recvs
            .iter()
            .enumerate()
            .map(|(k, t)| (format!("%recv{k}"), ty(t.spec.dtype, t.spec.shape.dims()))),
    );
    let arg_types: Vec<&str> = args.iter().map(|a| a.1.as_str()).collect();
    let block: Vec<String> = args.iter().map(|(n, t)| format!("{n}: {t}")).collect();
    let types: Vec<String> = outputs.iter().map(|s| ty(s.dtype, s.shape.dims())).collect();
    let sharded = !options.param_shardings.is_empty() || !options.result_shardings.is_empty();
    if sharded
        && (options.param_shardings.len() != program.params().len()
            || options.result_shardings.len() != program.results().len()
            || !e.recvs.is_empty())
    {
        return Err(Error::Arguments(format!(
            "shardings for {} parameters and {} results of a program of {} and {}{}",
            options.param_shardings.len(),
            options.result_shardings.len(),
            program.params().len(),
            program.results().len(),
            if e.recvs.is_empty() { "" } else { " that receives (XLA partitions whole programs)" }
        )));
    }
    let arg_attrs: Vec<String> = (0..args.len())
        .map(|k| {
            let mut attrs = Vec::new();
            if let Some(s) = options.param_shardings.get(k) {
                attrs.push(format!("mhlo.sharding = {}", quoted(s)));
            }
            if let Some(&(result, _)) = options.donate.iter().find(|&&(_, param)| param == k) {
                attrs.push(format!("tf.aliasing_output = {result} : i32"));
            }
            format!("{{{}}}", attrs.join(", "))
        })
        .collect();
    let res_attrs = if sharded {
        let all: Vec<String> = (0..outputs.len())
            .map(|k| {
                let s = options.result_shardings.get(k).map_or("{replicated}", String::as_str);
                format!("{{mhlo.sharding = {}}}", quoted(s))
            })
            .collect();
        format!(", res_attrs = [{}]", all.join(", "))
    } else {
        String::new()
    };
    let mut text = String::from("\"builtin.module\"() ({\n  \"func.func\"() ({\n");
    let _ = writeln!(text, "  ^bb0({}):", block.join(", "));
    text.push_str(&e.body);
    let _ = writeln!(
        text,
        "    \"func.return\"({}) : ({}) -> ()",
        returned.join(", "),
        types.join(", ")
    );
    let _ = writeln!(
        text,
        "  }}) {{arg_attrs = [{}], function_type = ({}) -> ({}){res_attrs}, sym_name = \"main\", sym_visibility = \"public\"}} : () -> ()",
        arg_attrs.join(", "),
        arg_types.join(", "),
        types.join(", ")
    );
    let _ = writeln!(
        text,
        "}}) {{mhlo.num_partitions = {partitions} : i32, mhlo.num_replicas = {replicas} : i32, sym_name = \"meshwork\"}} : () -> ()"
    );
    Ok(Lowered { text, outputs, emits: e.emits, sends: e.sends, recvs: e.recvs })
}

/// The spec of `v`, or a lowering error (a value the program does not define).
fn spec_of(e: &Emitter<'_>, v: Value) -> Result<TensorSpec> {
    e.program.spec(v).cloned().ok_or_else(|| e.fail(format!("{v} is not a value of the program")))
}

/// Lowers `program` in place, its parameters the values `args`: its value's name.
fn inline(e: &mut Emitter<'_>, program: &Program, args: &[String]) -> Result<String> {
    let mut sub = Emitter {
        program,
        body: std::mem::take(&mut e.body),
        next: e.next,
        names: args.to_vec(),
        emitted: Vec::new(),
        emits: Vec::new(),
        sent: Vec::new(),
        sends: Vec::new(),
        recvs: Vec::new(),
        at: e.at.clone(),
        replicas: e.replicas,
        cudnn: false,
        fmha: std::collections::HashMap::new(),
    };
    let lowered = program.instrs().iter().try_for_each(|instr| {
        let name = lower_instr(&mut sub, instr)?;
        sub.names.push(name);
        Ok::<(), Error>(())
    });
    e.body = std::mem::take(&mut sub.body);
    e.next = sub.next;
    lowered?;
    let result = program.results().first().ok_or_else(|| e.fail("a definition without result"))?;
    Ok(sub.names[result.index()].clone())
}

/// Whether cuDNN's fused attention takes heads `q, k, v` of `specs` as JAX's wrapper
/// checks: bf16 or f16, one head dim for all three that is a multiple of 8 up to 128,
/// as many queries as keys (its causal mask is aligned top-left, the op's definition
/// bottom-right: the two agree only then). Elsewhere the op lowers as its definition.
fn cudnn_takes(specs: &[TensorSpec]) -> bool {
    let (q, k, v) = (specs[0].shape.dims(), specs[1].shape.dims(), specs[2].shape.dims());
    matches!(specs[0].dtype, DType::BF16 | DType::F16)
        && q[3] == v[3]
        && q[3] % 8 == 0
        && q[3] <= 128
        && q[2] == k[2]
}

/// `x` `[B,H,T,D]` transposed to `[B,T,H,D]` (cuDNN's operand layout as JAX gives it).
fn to_bthd(e: &mut Emitter<'_>, x: &str, spec: &TensorSpec) -> String {
    let d = spec.shape.dims();
    e.op(
        "transpose",
        &[(x, &ty(spec.dtype, d))],
        "permutation = array<i64: 0, 2, 1, 3>",
        &ty(spec.dtype, &[d[0], d[2], d[1], d[3]]),
    )
}

/// The `backend_config` of a cuDNN attention call, as JAX writes it.
fn fmha_config(
    a: meshwork_program::AttentionSpec,
    scores: &[usize],
    dtype: DType,
    backward: bool,
) -> String {
    let element = if dtype == DType::F16 { "F16" } else { "BF16" };
    let dims: Vec<String> = scores.iter().map(|d| format!("\"{d}\"")).collect();
    let dot = |lc: &str, rc: &str, lb: &str, rb: &str| {
        format!(
            "{{\"lhs_contracting_dimensions\": [{lc}], \"rhs_contracting_dimensions\": [{rc}], \"lhs_batch_dimensions\": [{lb}], \"rhs_batch_dimensions\": [{rb}]}}"
        )
    };
    let dots = if backward {
        format!(
            "\"bmm1_grad_gemm1_dot_dimension_numbers\": {}, \"bmm1_grad_gemm2_dot_dimension_numbers\": {}, \"bmm2_grad_gemm1_dot_dimension_numbers\": {}, \"bmm2_grad_gemm2_dot_dimension_numbers\": {}",
            dot("\"2\"", "\"1\"", "\"0\", \"1\"", "\"0\", \"2\""),
            dot("\"3\"", "\"1\"", "\"0\", \"1\"", "\"0\", \"2\""),
            dot("\"2\"", "\"1\"", "\"0\", \"1\"", "\"0\", \"2\""),
            dot("\"3\"", "\"3\"", "\"0\", \"2\"", "\"0\", \"2\""),
        )
    } else {
        format!(
            "\"bmm1_dot_dimension_numbers\": {}, \"bmm2_dot_dimension_numbers\": {}",
            dot("\"3\"", "\"3\"", "\"0\", \"2\"", "\"0\", \"2\""),
            dot("\"3\"", "\"1\"", "\"0\", \"1\"", "\"0\", \"2\""),
        )
    };
    format!(
        "{{\"operation_queue_id\": \"0\", \"cudnn_fmha_backend_config\": {{\"algorithm\": {{\"algo_id\": \"0\", \"math_type\": \"TENSOR_OP_MATH\", \"tuning_knobs\": {{\"17\": \"1\", \"24\": \"0\"}}, \"is_cudnn_frontend\": true, \"workspace_size\": \"0\"}}, \"fmha_scale\": {:?}, \"intermediate_tensor_shape\": {{\"element_type\": \"{element}\", \"dimensions\": [{}], \"tuple_shapes\": [], \"layout\": {{\"dim_level_types\": [], \"dim_unique\": [], \"dim_ordered\": [], \"minor_to_major\": [\"3\", \"2\", \"1\", \"0\"], \"tiles\": [], \"element_size_in_bits\": \"0\", \"memory_space\": \"0\", \"index_primitive_type\": \"PRIMITIVE_TYPE_INVALID\", \"pointer_primitive_type\": \"PRIMITIVE_TYPE_INVALID\", \"dynamic_shape_metadata_prefix_bytes\": \"0\"}}, \"is_dynamic_dimension\": [false, false, false, false]}}, \"is_flash_attention\": true, \"mask_type\": \"{}\", {dots}, \"dropout_rate\": 0.0, \"seed\": 42, \"sliding_window_length\": 0, \"max_seg_per_batch\": 1, \"is_paged_attention\": false}}}}",
        a.multiplier(),
        dims.join(", "),
        if a.causal { "CAUSAL" } else { "NO_MASK" },
    )
}

/// Writes one cuDNN custom call of `results` types; the names of its results.
fn custom_call(
    e: &mut Emitter<'_>,
    target: &str,
    operands: &[(String, String)],
    config: &str,
    operand_layouts: &[&str],
    results: &[(String, &str)],
) -> Vec<String> {
    let r = e.fresh();
    let names: Vec<&str> = operands.iter().map(|o| o.0.as_str()).collect();
    let types: Vec<&str> = operands.iter().map(|o| o.1.as_str()).collect();
    let layouts = |l: &[&str]| {
        l.iter()
            .map(|l| {
                format!(
                    "dense<{l}> : tensor<{}xindex>",
                    l.matches(',').count() + 1 - usize::from(*l == "[]")
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    let result_types: Vec<&str> = results.iter().map(|r| r.0.as_str()).collect();
    let result_layouts: Vec<&str> = results.iter().map(|r| r.1).collect();
    let _ = writeln!(
        e.body,
        "    {r}:{n} = \"stablehlo.custom_call\"({ops}) {{api_version = 2 : i32, backend_config = {config}, call_target_name = {target}, operand_layouts = [{ol}], result_layouts = [{rl}]}} : ({ts}) -> ({rs})",
        n = results.len(),
        ops = names.join(", "),
        config = quoted(config),
        target = quoted(target),
        ol = layouts(operand_layouts),
        rl = layouts(&result_layouts),
        ts = types.join(", "),
        rs = result_types.join(", "),
    );
    (0..results.len()).map(|k| format!("{r}#{k}")).collect()
}

const ROW_MAJOR_4: &str = "[3, 2, 1, 0]";

/// cuDNN's forward attention of `q, k, v` (`[B,H,T,D]`), made once per operands: its
/// output `[B,H,Tq,Dv]` and softmax statistics `[B,H,Tq]` (f32).
fn fmha_forward(
    e: &mut Emitter<'_>,
    args: &[String],
    specs: &[TensorSpec],
    a: meshwork_program::AttentionSpec,
) -> Result<Vec<String>> {
    let mut key: Vec<String> = args[..3].to_vec();
    key.push(format!("{a:?}"));
    if let Some(done) = e.fmha.get(&key) {
        return Ok(done.clone());
    }
    let (q, k, v) = (&specs[0], &specs[1], &specs[2]);
    let dt = q.dtype;
    if !matches!(dt, DType::BF16 | DType::F16) {
        return Err(e.fail(format!("cuDNN's fused attention takes bf16 or f16 heads, not {dt}")));
    }
    let (qd, kd, vd) = (q.shape.dims(), k.shape.dims(), v.shape.dims());
    let operands: Vec<(String, String)> = [(0, q), (1, k), (2, v)]
        .into_iter()
        .map(|(i, s)| {
            let t = to_bthd(e, &args[i], s);
            let d = s.shape.dims();
            (t, ty(dt, &[d[0], d[2], d[1], d[3]]))
        })
        .collect();
    let config = fmha_config(a, &[qd[0], qd[1], qd[2], kd[2]], dt, false);
    let out_ty = ty(dt, &[qd[0], qd[1], qd[2], vd[3]]);
    let stats_ty = ty(DType::F32, &[qd[0], qd[1], qd[2]]);
    let names = custom_call(
        e,
        "__cudnn$fmhaSoftmax",
        &operands,
        &config,
        &[ROW_MAJOR_4; 3],
        &[(out_ty, "[3, 1, 2, 0]"), (stats_ty, "[2, 1, 0]"), ("tensor<0xui8>".into(), "[0]")],
    );
    let done = vec![names[0].clone(), names[1].clone()];
    e.fmha.insert(key, done.clone());
    Ok(done)
}

/// cuDNN's backward attention of `q, k, v, dout`, made once per operands: the
/// gradients of `q`, `k` and `v` (`[B,H,T,D]` each).
fn fmha_backward(
    e: &mut Emitter<'_>,
    args: &[String],
    specs: &[TensorSpec],
    a: meshwork_program::AttentionSpec,
) -> Result<Vec<String>> {
    let mut key: Vec<String> = args[..4].to_vec();
    key.push(format!("{a:?} backward"));
    if let Some(done) = e.fmha.get(&key) {
        return Ok(done.clone());
    }
    let forward = fmha_forward(e, &args[..3], &specs[..3], a)?;
    let (q, k, v, g) = (&specs[0], &specs[1], &specs[2], &specs[3]);
    let dt = q.dtype;
    let (qd, kd, vd) = (q.shape.dims(), k.shape.dims(), v.shape.dims());
    let bthd = |s: &TensorSpec| {
        let d = s.shape.dims();
        ty(dt, &[d[0], d[2], d[1], d[3]])
    };
    let mut operands: Vec<(String, String)> = [(0, q), (1, k), (2, v)]
        .into_iter()
        .map(|(i, s)| (to_bthd(e, &args[i], s), bthd(s)))
        .collect();
    operands.push((forward[1].clone(), ty(DType::F32, &[qd[0], qd[1], qd[2]])));
    operands.push((to_bthd(e, &args[3], g), bthd(g)));
    let out = to_bthd(e, &forward[0], g);
    operands.push((out, bthd(g)));
    let config = fmha_config(a, &[qd[0], qd[1], qd[2], kd[2]], dt, true);
    let names = custom_call(
        e,
        "__cudnn$fmhaSoftmaxBackward",
        &operands,
        &config,
        &[ROW_MAJOR_4, ROW_MAJOR_4, ROW_MAJOR_4, "[2, 1, 0]", ROW_MAJOR_4, ROW_MAJOR_4],
        &[
            (ty(dt, qd), "[3, 1, 2, 0]"),
            (ty(dt, kd), "[3, 1, 2, 0]"),
            (ty(dt, vd), "[3, 1, 2, 0]"),
            ("tensor<0xui8>".into(), "[0]"),
        ],
    );
    let done = names[..3].to_vec();
    e.fmha.insert(key, done.clone());
    Ok(done)
}

/// Lowers one instruction; returns the name of its value.
fn lower_instr(e: &mut Emitter<'_>, instr: &meshwork_program::Instr) -> Result<String> {
    let args: Vec<String> = instr.args.iter().map(|a| e.names[a.index()].clone()).collect();
    let specs: Vec<TensorSpec> =
        instr.args.iter().map(|&a| spec_of(e, a)).collect::<Result<_>>()?;
    let out = instr.spec.clone();
    let (dt, dims) = (out.dtype, out.shape.dims().to_vec());
    element(dt).map_err(|p| e.fail(p))?;
    let arg_ty = |k: usize| ty(specs[k].dtype, specs[k].shape.dims());
    let a_dims = |k: usize| specs[k].shape.dims().to_vec();
    Ok(match &instr.op {
        Op::Unary(u) => {
            let x = &args[0];
            match u {
                Unary::Neg => e.unary("negate", x, dt, &dims),
                Unary::Exp => e.unary("exponential", x, dt, &dims),
                Unary::Log => e.unary("log", x, dt, &dims),
                Unary::Tanh => e.unary("tanh", x, dt, &dims),
                Unary::Logistic => e.unary("logistic", x, dt, &dims),
                Unary::Sqrt => e.unary("sqrt", x, dt, &dims),
                Unary::Rsqrt => e.unary("rsqrt", x, dt, &dims),
                Unary::Abs => e.unary("abs", x, dt, &dims),
                Unary::Sin => e.unary("sine", x, dt, &dims),
                Unary::Cos => e.unary("cosine", x, dt, &dims),
                Unary::Square => e.binary("multiply", x, x, dt, &dims),
                Unary::Relu => {
                    let zero = e.splat(dt, 0.0, &dims);
                    e.binary("maximum", x, &zero, dt, &dims)
                }
                Unary::Gelu => {
                    // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), as jax.nn.gelu.
                    let x2 = e.binary("multiply", x, x, dt, &dims);
                    let x3 = e.binary("multiply", &x2, x, dt, &dims);
                    let c = e.splat(dt, 0.044715, &dims);
                    let cx3 = e.binary("multiply", &c, &x3, dt, &dims);
                    let inner = e.binary("add", x, &cx3, dt, &dims);
                    let k = e.splat(dt, (2.0 / std::f64::consts::PI).sqrt(), &dims);
                    let arg = e.binary("multiply", &k, &inner, dt, &dims);
                    let t = e.unary("tanh", &arg, dt, &dims);
                    let one = e.splat(dt, 1.0, &dims);
                    let s = e.binary("add", &one, &t, dt, &dims);
                    let half = e.splat(dt, 0.5, &dims);
                    let cdf = e.binary("multiply", &half, &s, dt, &dims);
                    e.binary("multiply", x, &cdf, dt, &dims)
                }
                Unary::StopGradient => x.clone(),
                Unary::Barrier => {
                    let t = ty(dt, &dims);
                    e.op("optimization_barrier", &[(x, &t)], "", &t)
                }
            }
        }
        Op::Binary(b) => {
            let adt = specs[0].dtype;
            let x = e.broadcast(&args[0], adt, &a_dims(0), &dims);
            let y = e.broadcast(&args[1], adt, &a_dims(1), &dims);
            let name = match b {
                Binary::Add => "add",
                Binary::Sub => "subtract",
                Binary::Mul => "multiply",
                Binary::Max => "maximum",
                Binary::Min => "minimum",
                Binary::Pow => "power",
                Binary::Div if dt.is_float() => "divide",
                Binary::Div => {
                    // Floor division: the truncated quotient, less one where the
                    // remainder is not zero and the operands' signs differ.
                    let q = e.binary("divide", &x, &y, dt, &dims);
                    let r = e.binary("remainder", &x, &y, dt, &dims);
                    let zero = e.splat(dt, 0.0, &dims);
                    let nonzero = e.compare("NE", &r, &zero, dt, &dims);
                    let xn = e.compare("LT", &x, &zero, dt, &dims);
                    let yn = e.compare("LT", &y, &zero, dt, &dims);
                    let differ = e.compare("NE", &xn, &yn, DType::Bool, &dims);
                    let fix = e.binary("and", &nonzero, &differ, DType::Bool, &dims);
                    let one = e.splat(dt, 1.0, &dims);
                    let q1 = e.binary("subtract", &q, &one, dt, &dims);
                    let (bt, t) = (ty(DType::Bool, &dims), ty(dt, &dims));
                    return Ok(e.op("select", &[(&fix, &bt), (&q1, &t), (&q, &t)], "", &t));
                }
            };
            e.binary(name, &x, &y, dt, &dims)
        }
        Op::Compare(c) => {
            let adt = specs[0].dtype;
            let x = e.broadcast(&args[0], adt, &a_dims(0), &dims);
            let y = e.broadcast(&args[1], adt, &a_dims(1), &dims);
            let dir = match c {
                Compare::Lt => "LT",
                Compare::Le => "LE",
                Compare::Gt => "GT",
                Compare::Ge => "GE",
                Compare::Eq => "EQ",
                Compare::Ne => "NE",
            };
            e.compare(dir, &x, &y, adt, &dims)
        }
        Op::Select => {
            let p = e.broadcast(&args[0], DType::Bool, &a_dims(0), &dims);
            let t = e.broadcast(&args[1], dt, &a_dims(1), &dims);
            let f = e.broadcast(&args[2], dt, &a_dims(2), &dims);
            let (bt, vt) = (ty(DType::Bool, &dims), ty(dt, &dims));
            e.op("select", &[(&p, &bt), (&t, &vt), (&f, &vt)], "", &vt)
        }
        Op::ThreefryUniform => e.threefry_uniform([&args[0], &args[1], &args[2]], &dims),
        Op::Constant { value, dtype } => e.splat(*dtype, *value, &[]),
        Op::Literal { value } => {
            // MLIR's hex form of a dense attribute: the row-major little-endian bytes.
            let hex: String = value.to_le_bytes().iter().map(|b| format!("{b:02X}")).collect();
            let t = ty(value.dtype(), value.shape());
            e.op("constant", &[], &format!("value = dense<\"0x{hex}\"> : {t}"), &t)
        }
        Op::DotGeneral { lhs_contract, rhs_contract, lhs_batch, rhs_batch } => {
            let mut fields = Vec::new();
            if !lhs_batch.is_empty() {
                fields.push(format!("lhs_batching_dimensions = {}", list(lhs_batch)));
                fields.push(format!("rhs_batching_dimensions = {}", list(rhs_batch)));
            }
            if !lhs_contract.is_empty() {
                fields.push(format!("lhs_contracting_dimensions = {}", list(lhs_contract)));
                fields.push(format!("rhs_contracting_dimensions = {}", list(rhs_contract)));
            }
            let attrs = format!("dot_dimension_numbers = #stablehlo.dot<{}>", fields.join(", "));
            e.op("dot_general", &[(&args[0], &arg_ty(0)), (&args[1], &arg_ty(1))], &attrs, &ty(dt, &dims))
        }
        Op::Reduce { kind, axes, keepdims } => {
            let (x, xd) = (&args[0], a_dims(0));
            let reduced: Vec<usize> = (0..xd.len()).filter(|d| !axes.contains(d)).map(|d| xd[d]).collect();
            let mut r = match kind {
                Reduction::Sum | Reduction::Mean => e.reduce("add", 0.0, x, dt, &xd, axes),
                Reduction::Max => e.reduce("maximum", lowest(dt), x, dt, &xd, axes),
            };
            if *kind == Reduction::Mean {
                let count: usize = axes.iter().map(|&a| xd[a]).product();
                let n = e.splat(dt, count as f64, &reduced);
                r = e.binary("divide", &r, &n, dt, &reduced);
            }
            if *keepdims && reduced != dims {
                r = e.op("reshape", &[(&r, &ty(dt, &reduced))], "", &ty(dt, &dims));
            }
            r
        }
        Op::Reshape { .. } => e.op("reshape", &[(&args[0], &arg_ty(0))], "", &ty(dt, &dims)),
        Op::Transpose { perm } => e.op(
            "transpose",
            &[(&args[0], &arg_ty(0))],
            &format!("permutation = {}", i64s(perm.iter())),
            &ty(dt, &dims),
        ),
        Op::BroadcastTo { .. } => {
            let d = a_dims(0);
            e.broadcast(&args[0], dt, &d, &dims)
        }
        Op::Slice { start, stop, step } => e.op(
            "slice",
            &[(&args[0], &arg_ty(0))],
            &format!(
                "start_indices = {}, limit_indices = {}, strides = {}",
                i64s(start.iter()),
                i64s(stop.iter()),
                i64s(step.iter())
            ),
            &ty(dt, &dims),
        ),
        Op::Concat { axis } => {
            let types: Vec<String> = (0..args.len()).map(arg_ty).collect();
            let ops: Vec<(&str, &str)> = args.iter().zip(&types).map(|(a, t)| (a.as_str(), t.as_str())).collect();
            e.op("concatenate", &ops, &format!("dimension = {axis} : i64"), &ty(dt, &dims))
        }
        Op::Take { axis } => {
            let (td, id) = (a_dims(0), a_dims(1));
            let ni = id.len();
            let offset: Vec<usize> =
                (0..td.len()).filter(|&d| d != *axis).map(|d| if d < *axis { d } else { d - 1 + ni }).collect();
            let mut sizes = td.clone();
            sizes[*axis] = 1;
            let mut fields = Vec::new();
            if !offset.is_empty() {
                fields.push(format!("offset_dims = {}", list(&offset)));
            }
            fields.push(format!("collapsed_slice_dims = [{axis}]"));
            fields.push(format!("start_index_map = [{axis}]"));
            fields.push(format!("index_vector_dim = {ni}"));
            e.op(
                "gather",
                &[(&args[0], &arg_ty(0)), (&args[1], &arg_ty(1))],
                &format!(
                    "dimension_numbers = #stablehlo.gather<{}>, indices_are_sorted = false, slice_sizes = {}",
                    fields.join(", "),
                    i64s(sizes.iter())
                ),
                &ty(dt, &dims),
            )
        }
        Op::ScatterAdd { axis } => {
            let (od, id) = (a_dims(0), a_dims(1));
            let ni = id.len();
            let window: Vec<usize> =
                (0..od.len()).filter(|&d| d != *axis).map(|d| if d < *axis { d } else { d - 1 + ni }).collect();
            let mut fields = Vec::new();
            if !window.is_empty() {
                fields.push(format!("update_window_dims = {}", list(&window)));
            }
            fields.push(format!("inserted_window_dims = [{axis}]"));
            fields.push(format!("scatter_dims_to_operand_dims = [{axis}]"));
            fields.push(format!("index_vector_dim = {ni}"));
            let idt = specs[1].dtype;
            let lo = e.splat(idt, 0.0, &id);
            let hi = e.splat(idt, od[*axis].saturating_sub(1) as f64, &id);
            let it = arg_ty(1);
            let clamped = e.op("clamp", &[(&lo, &it), (&args[1], &it), (&hi, &it)], "", &it);
            e.op_region(
                "scatter",
                &[(&args[0], &arg_ty(0)), (&clamped, &it), (&args[2], &arg_ty(2))],
                &Emitter::region("add", dt),
                &format!(
                    "indices_are_sorted = false, scatter_dimension_numbers = #stablehlo.scatter<{}>, unique_indices = false",
                    fields.join(", ")
                ),
                &ty(dt, &dims),
            )
        }
        Op::OneHot { depth: _, dtype } => {
            let (idt, id) = (specs[0].dtype, a_dims(0));
            let kept: Vec<usize> = (0..id.len()).collect();
            let b = e.broadcast_dims(&args[0], idt, &id, &kept, &dims);
            let iota = e.op("iota", &[], &format!("iota_dimension = {} : i64", id.len()), &ty(idt, &dims));
            let eq = e.compare("EQ", &b, &iota, idt, &dims);
            e.op("convert", &[(&eq, &ty(DType::Bool, &dims))], "", &ty(*dtype, &dims))
        }
        Op::Attention(a) if e.cudnn && cudnn_takes(&specs) => {
            fmha_forward(e, &args, &specs, *a)?[0].clone()
        }
        Op::AttentionGrad { attention, wrt } if e.cudnn && cudnn_takes(&specs) => {
            fmha_backward(e, &args, &specs, *attention)?[*wrt].clone()
        }
        Op::Attention(_) | Op::AttentionGrad { .. } | Op::CrossEntropy | Op::CrossEntropyGrad => {
            let definition = meshwork_program::composite::definition(&instr.op, &specs)
                .expect("a composite op has a definition")
                .map_err(|err| e.fail(err.to_string()))?;
            inline(e, &definition, &args)?
        }
        Op::Softmax { axis } | Op::LogSoftmax { axis } => {
            let x = &args[0];
            let kept: Vec<usize> = (0..dims.len()).filter(|d| d != axis).collect();
            let rd: Vec<usize> = kept.iter().map(|&d| dims[d]).collect();
            let m = e.reduce("maximum", f64::NEG_INFINITY, x, dt, &dims, &[*axis]);
            let bm = e.broadcast_dims(&m, dt, &rd, &kept, &dims);
            let shifted = e.binary("subtract", x, &bm, dt, &dims);
            let ex = e.unary("exponential", &shifted, dt, &dims);
            let s = e.reduce("add", 0.0, &ex, dt, &dims, &[*axis]);
            if matches!(instr.op, Op::Softmax { .. }) {
                let bs = e.broadcast_dims(&s, dt, &rd, &kept, &dims);
                e.binary("divide", &ex, &bs, dt, &dims)
            } else {
                let ls = e.unary("log", &s, dt, &rd);
                let bls = e.broadcast_dims(&ls, dt, &rd, &kept, &dims);
                e.binary("subtract", &shifted, &bls, dt, &dims)
            }
        }
        Op::Argmax { axis } => {
            // The first index reaching the maximum (a NaN counts as the maximum).
            let (xdt, xd) = (specs[0].dtype, a_dims(0));
            let x = &args[0];
            let kept: Vec<usize> = (0..xd.len()).filter(|d| d != axis).collect();
            let m = e.reduce("maximum", lowest(xdt), x, xdt, &xd, &[*axis]);
            let bm = e.broadcast_dims(&m, xdt, &dims, &kept, &xd);
            let mut hit = e.compare("EQ", x, &bm, xdt, &xd);
            if xdt.is_float() {
                let nan = e.compare("NE", x, x, xdt, &xd);
                hit = e.binary("or", &hit, &nan, DType::Bool, &xd);
            }
            let iota = e.op("iota", &[], &format!("iota_dimension = {axis} : i64"), &ty(DType::I64, &xd));
            let n = e.splat(DType::I64, xd[*axis] as f64, &xd);
            let (bt, it) = (ty(DType::Bool, &xd), ty(DType::I64, &xd));
            let idx = e.op("select", &[(&hit, &bt), (&iota, &it), (&n, &it)], "", &it);
            e.reduce("minimum", i64::MAX as f64, &idx, DType::I64, &xd, &[*axis])
        }
        Op::Conv2d { strides, padding } => {
            let (xd, wd) = (a_dims(0), a_dims(1));
            let pads = conv_pads(*padding, &xd, &wd, *strides, &dims);
            conv(e, &args, &[arg_ty(0), arg_ty(1)], "[b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f]", *strides, [1, 1], [1, 1], pads, &ty(dt, &dims))
        }
        Op::Conv2dBackpropInput { strides, padding, input } => {
            // The gradient flows back through a convolution of the stride-dilated
            // output gradient with the spatially reversed filter, its in and out
            // features swapped.
            let (gd, wd) = (a_dims(0), a_dims(1));
            let fwd = conv_pads(*padding, input, &wd, *strides, &gd);
            let mut pads = [[0i64; 2]; 2];
            for s in 0..2 {
                let k = wd[s] as i64;
                let lo = k - 1 - fwd[s][0];
                let span = (gd[1 + s] as i64 - 1) * strides[s] as i64 + 1;
                pads[s] = [lo, input[1 + s] as i64 + k - 1 - lo - span];
            }
            let wt = arg_ty(1);
            let rev = e.op("reverse", &[(&args[1], &wt)], "dimensions = array<i64: 0, 1>", &wt);
            conv(e, &[args[0].clone(), rev], &[arg_ty(0), wt], "[b, 0, 1, f]x[0, 1, o, i]->[b, 0, 1, f]", [1, 1], *strides, [1, 1], pads, &ty(dt, &dims))
        }
        Op::Conv2dBackpropFilter { strides, padding, filter } => {
            // The filter's gradient: the input (batch as features) convolved with the
            // output gradient dilated by the strides.
            let (xd, gd) = (a_dims(0), a_dims(1));
            let fwd = conv_pads(*padding, &xd, filter, *strides, &gd);
            let mut pads = [[0i64; 2]; 2];
            for s in 0..2 {
                let lo = fwd[s][0];
                let span = (gd[1 + s] as i64 - 1) * strides[s] as i64;
                pads[s] = [lo, filter[s] as i64 + span - lo - xd[1 + s] as i64];
            }
            conv(e, &args, &[arg_ty(0), arg_ty(1)], "[f, 0, 1, b]x[i, 0, 1, o]->[0, 1, b, f]", [1, 1], [1, 1], *strides, pads, &ty(dt, &dims))
        }
        Op::Pad { low, high, interior } => {
            let zero = e.splat(dt, 0.0, &[]);
            e.op(
                "pad",
                &[(&args[0], &arg_ty(0)), (&zero, &ty(dt, &[]))],
                &format!(
                    "edge_padding_high = {}, edge_padding_low = {}, interior_padding = {}",
                    i64s(high.iter()),
                    i64s(low.iter()),
                    i64s(interior.iter())
                ),
                &ty(dt, &dims),
            )
        }
        Op::Convert { dtype } => {
            if specs[0].dtype == *dtype {
                args[0].clone()
            } else {
                e.op("convert", &[(&args[0], &arg_ty(0))], "", &ty(dt, &dims))
            }
        }
        Op::Iota { dtype, shape, axis } => e.op("iota", &[], &format!("iota_dimension = {axis} : i64"), &ty(*dtype, shape)),
        Op::AllReduce { op, groups } => {
            let name = combiner(*op);
            let t = ty(dt, &dims);
            let mut r = e.op_region(
                "all_reduce",
                &[(&args[0], &t)],
                &Emitter::region(name, dt),
                &format!("replica_groups = {}", groups_attr(groups)),
                &t,
            );
            if *op == ReduceOp::Mean {
                // Groups may differ in size: each replica divides by its own group's.
                let c = group_size(e, groups, dt, &dims);
                r = e.binary("divide", &r, &c, dt, &dims);
            }
            r
        }
        Op::AllGather { axis, groups } => e.op(
            "all_gather",
            &[(&args[0], &arg_ty(0))],
            &format!("all_gather_dim = {axis} : i64, replica_groups = {}", groups_attr(groups)),
            &ty(dt, &dims),
        ),
        Op::ReduceScatter { op, axis, groups } => {
            let name = combiner(*op);
            let mut r = e.op_region(
                "reduce_scatter",
                &[(&args[0], &arg_ty(0))],
                &Emitter::region(name, dt),
                &format!("replica_groups = {}, scatter_dimension = {axis} : i64", groups_attr(groups)),
                &ty(dt, &dims),
            );
            if *op == ReduceOp::Mean {
                // Scattering groups are of one size (the builder checks).
                let c = group_size(e, groups, dt, &dims);
                r = e.binary("divide", &r, &c, dt, &dims);
            }
            r
        }
        Op::AllToAll { split_axis, concat_axis, groups } => e.op(
            "all_to_all",
            &[(&args[0], &arg_ty(0))],
            &format!(
                "concat_dimension = {concat_axis} : i64, replica_groups = {}, split_count = {} : i64, split_dimension = {split_axis} : i64",
                groups_attr(groups),
                groups.first().map_or(1, Vec::len)
            ),
            &ty(dt, &dims),
        ),
        Op::CollectivePermute { pairs } => {
            let rows: Vec<String> = pairs.iter().map(|(s, t)| format!("[{s}, {t}]")).collect();
            e.op(
                "collective_permute",
                &[(&args[0], &arg_ty(0))],
                &format!(
                    "source_target_pairs = dense<[{}]> : tensor<{}x2xi64>",
                    rows.join(", "),
                    pairs.len()
                ),
                &ty(dt, &dims),
            )
        }
        Op::ShardSlice { axis, groups } => {
            let start = block_start(e, groups, dims[*axis]);
            let xd = a_dims(0);
            let idx = dynamic_indices(e, &start, *axis, xd.len());
            let ops: Vec<(&str, String)> =
                std::iter::once((args[0].as_str(), arg_ty(0))).chain(idx.iter().map(|i| (i.as_str(), ty(DType::I64, &[])))).collect();
            let refs: Vec<(&str, &str)> = ops.iter().map(|(a, t)| (*a, t.as_str())).collect();
            e.op("dynamic_slice", &refs, &format!("slice_sizes = {}", i64s(dims.iter())), &ty(dt, &dims))
        }
        Op::ShardPad { axis, groups } => {
            let xd = a_dims(0);
            let start = block_start(e, groups, xd[*axis]);
            let zeros = e.splat(dt, 0.0, &dims);
            let idx = dynamic_indices(e, &start, *axis, xd.len());
            let t = ty(dt, &dims);
            let ops: Vec<(&str, String)> = [(zeros.as_str(), t.clone()), (args[0].as_str(), arg_ty(0))]
                .into_iter()
                .chain(idx.iter().map(|i| (i.as_str(), ty(DType::I64, &[]))))
                .collect();
            let refs: Vec<(&str, &str)> = ops.iter().map(|(a, t)| (*a, t.as_str())).collect();
            e.op("dynamic_update_slice", &refs, "", &t)
        }
        Op::Emit { consumer } => {
            let n = args.len();
            for (a, s) in args.iter().zip(&specs) {
                e.emitted.push((a.clone(), s.clone()));
            }
            e.emits.push((*consumer, n));
            e.splat(DType::Bool, 1.0, &[])
        }
        Op::Send { channel, peer } => {
            e.sent.push(args[0].clone());
            e.sends.push(Transfer { channel: *channel, peer: *peer, spec: specs[0].clone() });
            e.splat(DType::Bool, 1.0, &[])
        }
        Op::Recv { channel, peer, .. } => {
            e.recvs.push(Transfer { channel: *channel, peer: *peer, spec: out.clone() });
            format!("%recv{}", e.recvs.len() - 1)
        }
    })
}

/// Where this replica's block of an axis of `block` elements starts: its position in
/// its group times `block`, looked up by `replica_id` (an i64 scalar).
fn block_start(e: &mut Emitter<'_>, groups: &[Vec<usize>], block: usize) -> String {
    per_replica(e, groups, 0, |k, _| (k * block) as i64)
}

/// An i64 scalar of this replica's entry in a table by replica: `value(position in
/// its group, group size)`, or `absent` for a replica in no group. Looked up by
/// `replica_id`.
fn per_replica(
    e: &mut Emitter<'_>,
    groups: &[Vec<usize>],
    absent: i64,
    value: impl Fn(usize, usize) -> i64,
) -> String {
    let replicas = groups.iter().flatten().copied().max().map_or(1, |m| m + 1).max(e.replicas);
    let mut table = vec![absent; replicas];
    for g in groups {
        for (k, &r) in g.iter().enumerate() {
            table[r] = value(k, g.len());
        }
    }
    let values: Vec<String> = table.iter().map(ToString::to_string).collect();
    let tt = format!("tensor<{replicas}xi64>");
    let t = e.op("constant", &[], &format!("value = dense<[{}]> : {tt}", values.join(", ")), &tt);
    let id = e.op("replica_id", &[], "", "tensor<ui32>");
    let id64 = e.op("convert", &[(&id, "tensor<ui32>")], "", "tensor<i64>");
    let at = e.op(
        "dynamic_slice",
        &[(&t, &tt), (&id64, "tensor<i64>")],
        "slice_sizes = array<i64: 1>",
        "tensor<1xi64>",
    );
    e.op("reshape", &[(&at, "tensor<1xi64>")], "", "tensor<i64>")
}

/// The size of this replica's group as a `dtype` tensor of `dims`: a constant when
/// every group has one size, else looked up by `replica_id`.
fn group_size(e: &mut Emitter<'_>, groups: &[Vec<usize>], dtype: DType, dims: &[usize]) -> String {
    let first = groups.first().map_or(1, Vec::len);
    if groups.iter().all(|g| g.len() == first) {
        return e.splat(dtype, first as f64, dims);
    }
    let n = per_replica(e, groups, 1, |_, size| size as i64);
    let scalar = ty(dtype, &[]);
    let n = e.op("convert", &[(&n, "tensor<i64>")], "", &scalar);
    if dims.is_empty() {
        return n;
    }
    e.op(
        "broadcast_in_dim",
        &[(&n, &scalar)],
        "broadcast_dimensions = array<i64>",
        &ty(dtype, dims),
    )
}

/// The start indices of a dynamic slice along `axis` (zero elsewhere).
fn dynamic_indices(e: &mut Emitter<'_>, start: &str, axis: usize, rank: usize) -> Vec<String> {
    let zero = e.splat(DType::I64, 0.0, &[]);
    (0..rank).map(|d| if d == axis { start.to_string() } else { zero.clone() }).collect()
}

/// The `[low, high]` padding of each spatial dim of a conv2d (NHWC input `x`, HWIO
/// filter `w`, output `out`).
fn conv_pads(
    padding: Padding,
    x: &[usize],
    w: &[usize],
    strides: [usize; 2],
    out: &[usize],
) -> [[i64; 2]; 2] {
    let mut pads = [[0i64; 2]; 2];
    if padding == Padding::Same {
        for s in 0..2 {
            let need = (out[1 + s] as i64 - 1) * strides[s] as i64 + w[s] as i64 - x[1 + s] as i64;
            let total = need.max(0);
            pads[s] = [total / 2, total - total / 2];
        }
    }
    pads
}

/// A `stablehlo.convolution`.
#[allow(clippy::too_many_arguments)]
fn conv(
    e: &mut Emitter<'_>,
    args: &[String],
    types: &[String],
    layout: &str,
    strides: [usize; 2],
    lhs_dilation: [usize; 2],
    rhs_dilation: [usize; 2],
    pads: [[i64; 2]; 2],
    result: &str,
) -> String {
    e.op(
        "convolution",
        &[(&args[0], &types[0]), (&args[1], &types[1])],
        &format!(
            "batch_group_count = 1 : i64, dimension_numbers = #stablehlo.conv<{layout}>, feature_group_count = 1 : i64, lhs_dilation = {}, padding = dense<[[{}, {}], [{}, {}]]> : tensor<2x2xi64>, rhs_dilation = {}, window_strides = {}",
            i64s(lhs_dilation.iter()),
            pads[0][0],
            pads[0][1],
            pads[1][0],
            pads[1][1],
            i64s(rhs_dilation.iter()),
            i64s(strides.iter())
        ),
        result,
    )
}

#[cfg(test)]
mod tests {
    use meshwork_program::Builder;

    use super::*;

    /// The lines of `text` that apply `op`.
    fn count(text: &str, op: &str) -> usize {
        text.lines().filter(|l| l.contains(&format!("\"stablehlo.{op}\""))).count()
    }

    #[test]
    fn integer_floor_division_corrects_the_truncated_quotient_as_jax_does() {
        let mut b = Builder::new();
        let x = b.param("x", "i64[3]".parse().unwrap()).unwrap();
        let y = b.param("y", "i64[3]".parse().unwrap()).unwrap();
        let q = b.div(x, y).unwrap();
        let f = b.param("f", "f64[3]".parse().unwrap()).unwrap();
        let g = b.div(f, f).unwrap();
        let p = b.finish(&[q, g]).unwrap();
        let text = lower(&p, &LowerOptions::default()).unwrap().text;
        assert_eq!(count(&text, "divide"), 2, "{text}");
        assert_eq!(count(&text, "remainder"), 1);
        assert_eq!(count(&text, "select"), 1);
        // Generic form throughout: the module and the function too.
        assert!(text.starts_with("\"builtin.module\"() ({"), "{text}");
        assert!(text.contains("\"func.func\"() ({"));
        assert!(text.contains("function_type = (tensor<3xi64>, tensor<3xi64>, tensor<3xf64>) -> (tensor<3xi64>, tensor<3xf64>)"), "{text}");
    }

    /// Half precision lowers as itself: bf16 and f16 tensors, products taken in the
    /// operands' dtype, constants as their exact bits.
    #[test]
    fn half_precision_lowers_to_bf16_and_f16() {
        let mut b = Builder::new();
        let x = b.param("x", "f32[2,3]".parse().unwrap()).unwrap();
        let w = b.param("w", "f32[3,2]".parse().unwrap()).unwrap();
        let y = b.matmuls_in(Some(DType::BF16), |b| b.matmul(x, w)).unwrap();
        let h = b.convert(y, DType::F16).unwrap();
        let third = b.constant(1.0 / 3.0, DType::F16).unwrap();
        let z = b.mul(h, third).unwrap();
        let p = b.finish(&[z]).unwrap();
        let text = lower(&p, &LowerOptions::default()).unwrap().text;
        assert!(
            text.contains("(tensor<2x3xbf16>, tensor<3x2xbf16>) -> tensor<2x2xbf16>"),
            "{text}"
        );
        // 1/3 in f16 is 0x3555.
        assert!(text.contains("dense<0x3555> : tensor<f16>"), "{text}");
        assert!(text.contains("-> (tensor<2x2xf16>)"), "{text}");
    }

    #[test]
    fn donated_parameters_alias_their_results() {
        let mut b = Builder::new();
        let w = b.param("w", "f32[2,2]".parse().unwrap()).unwrap();
        let x = b.param("x", "f32[2,2]".parse().unwrap()).unwrap();
        let loss = b.reduce_sum(x, &[0, 1], false).unwrap();
        let w2 = b.add(w, x).unwrap();
        let p = b.finish(&[loss, w2]).unwrap();
        let text =
            lower(&p, &LowerOptions { replicas: 1, donate: vec![(1, 0)], ..Default::default() })
                .unwrap()
                .text;
        assert!(text.contains("arg_attrs = [{tf.aliasing_output = 1 : i32}, {}]"), "{text}");
    }

    #[test]
    fn emits_sends_and_recvs_are_outputs_and_parameters_in_program_order() {
        let mut b = Builder::new();
        let x = b.param("x", "f32[4]".parse().unwrap()).unwrap();
        let r = b.recv(&"i32[2]".parse().unwrap(), 9, 3).unwrap();
        b.send(x, 4, 1).unwrap();
        b.emit(&[x, r], 7).unwrap();
        let p = b.finish(&[x]).unwrap();
        let l = lower(&p, &LowerOptions::default()).unwrap();
        let specs: Vec<String> = l.outputs.iter().map(ToString::to_string).collect();
        assert_eq!(specs, ["f32[4]", "f32[4]", "i32[2]", "f32[4]"]);
        assert_eq!(l.emits, [(7, 2)]);
        assert_eq!(l.sends, [Transfer { channel: 4, peer: 1, spec: "f32[4]".parse().unwrap() }]);
        assert_eq!(l.recvs, [Transfer { channel: 9, peer: 3, spec: "i32[2]".parse().unwrap() }]);
        assert!(
            l.text.contains("^bb0(%arg0: tensor<4xf32>, %recv0: tensor<2xi32>):"),
            "{}",
            l.text
        );
    }

    #[test]
    fn a_mean_over_groups_of_different_sizes_divides_by_each_replicas_group() {
        let mut b = Builder::new();
        let x = b.param("x", "f64[2]".parse().unwrap()).unwrap();
        let m = b.all_reduce(x, ReduceOp::Mean, &[vec![0, 1, 2], vec![3]]).unwrap();
        let p = b.finish(&[m]).unwrap();
        let text = lower(&p, &LowerOptions { replicas: 4, ..Default::default() }).unwrap().text;
        assert!(text.contains("dense<[3, 3, 3, 1]> : tensor<4xi64>"), "{text}");
        assert!(
            text.contains("replica_groups = dense<[[0, 1, 2], [3, -1, -1]]> : tensor<2x3xi64>"),
            "{text}"
        );
        assert!(text.contains("mhlo.num_replicas = 4 : i32"));
    }

    #[test]
    fn constants_are_exact() {
        assert_eq!(literal(DType::F64, 0.1), "0x3FB999999999999A");
        assert_eq!(literal(DType::F32, f64::NEG_INFINITY), "0xFF800000");
        assert_eq!(literal(DType::I64, -3.0), "-3");
        assert_eq!(literal(DType::Bool, 1.0), "true");
    }

    /// Attention of `[2,4,T,D]` heads of `dtype` (T queries and keys, or fewer
    /// queries) and its gradients, lowered with cuDNN asked for.
    fn attention_lowered(dtype: &str, tq: usize, d: usize) -> String {
        let mut b = Builder::new();
        let q = b.param("q", format!("{dtype}[2,4,{tq},{d}]").parse().unwrap()).unwrap();
        let k = b.param("k", format!("{dtype}[2,4,16,{d}]").parse().unwrap()).unwrap();
        let v = b.param("v", format!("{dtype}[2,4,16,{d}]").parse().unwrap()).unwrap();
        let a = meshwork_program::AttentionSpec { scale: 0.5, divide: false, causal: true };
        let out = b.attention(q, k, v, a).unwrap();
        let p = b.finish(&[out]).unwrap();
        let back = meshwork_program::vjp(&p, &[Value(0), Value(1), Value(2)]).unwrap();
        let options = LowerOptions { cudnn_attention: true, ..LowerOptions::default() };
        lower(&back, &options).unwrap().text
    }

    #[test]
    fn attention_goes_to_cudnn_only_where_cudnn_takes_it() {
        let calls = |text: &str| text.matches("__cudnn$fmhaSoftmax").count();
        // bf16, head dim 64, as many queries as keys: one forward, one backward.
        let fused = attention_lowered("bf16", 16, 64);
        assert_eq!(calls(&fused), 2, "{fused}");
        assert_eq!(fused.matches("__cudnn$fmhaSoftmaxBackward").count(), 1);
        // f32, a head dim of 12, or fewer queries than keys: the definition, inlined.
        for (dtype, tq, d) in [("f32", 16, 64), ("bf16", 16, 12), ("bf16", 8, 64), ("f16", 16, 256)]
        {
            let plain = attention_lowered(dtype, tq, d);
            assert_eq!(calls(&plain), 0, "{dtype} {tq} {d}");
            assert!(count(&plain, "exponential") >= 1, "{dtype} {tq} {d}");
        }
        // Without cuDNN asked for, never.
        let mut b = Builder::new();
        let spec: TensorSpec = "bf16[1,2,8,64]".parse().unwrap();
        let (q, k, v) = (
            b.param("q", spec.clone()).unwrap(),
            b.param("k", spec.clone()).unwrap(),
            b.param("v", spec).unwrap(),
        );
        let a = meshwork_program::AttentionSpec { scale: 0.5, divide: false, causal: true };
        let out = b.attention(q, k, v, a).unwrap();
        let p = b.finish(&[out]).unwrap();
        assert_eq!(calls(&lower(&p, &LowerOptions::default()).unwrap().text), 0);
    }
}
