//! Reading the text form back (printing is `Program`'s `Display`). The text is rebuilt
//! through the [`Builder`], so a parsed program is checked like a built one, and every
//! instruction's printed spec must be the one inference gives.

use std::str::FromStr;

use meshwork_types::{ReduceOp, TensorSpec};

use crate::builder::Builder;
use crate::op::{Binary, Compare, Op, Padding, Reduction, Unary};
use crate::program::{Program, Value};
use crate::{Error, Result};

impl FromStr for Program {
    type Err = Error;

    /// Parses the text [`Display`](std::fmt::Display) prints: parameters, then
    /// instructions numbered in order, then `return`.
    fn from_str(text: &str) -> Result<Program> {
        parse(text)
    }
}

fn bad(line: usize, text: &str, problem: impl Into<String>) -> Error {
    Error::Parse { line, text: text.to_string(), problem: problem.into() }
}

/// Splits `s` at top-level `, ` (outside braces and quotes).
fn split_top(s: &str) -> Vec<&str> {
    let (mut depth, mut quoted, mut start, mut out) = (0i32, false, 0, Vec::new());
    let bytes = s.as_bytes();
    let mut k = 0;
    while k < bytes.len() {
        match bytes[k] {
            b'\\' if quoted => k += 1,
            b'"' => quoted = !quoted,
            b'{' if !quoted => depth += 1,
            b'}' if !quoted => depth -= 1,
            b',' if !quoted && depth == 0 => {
                out.push(s[start..k].trim());
                start = k + 1;
            }
            _ => {}
        }
        k += 1;
    }
    out.push(s[start..].trim());
    out
}

/// `{1,2}` → `[1, 2]`.
fn list(s: &str) -> Option<Vec<usize>> {
    let inner = s.strip_prefix('{')?.strip_suffix('}')?;
    if inner.trim().is_empty() {
        return Some(Vec::new());
    }
    inner.split(',').map(|d| d.trim().parse().ok()).collect()
}

/// `{{0,1},{2,3}}` → groups.
fn groups(s: &str) -> Option<Vec<Vec<usize>>> {
    let inner = s.strip_prefix('{')?.strip_suffix('}')?;
    if inner.trim().is_empty() {
        return Some(Vec::new());
    }
    split_top(inner).into_iter().map(list).collect()
}

fn reduce_op(s: &str) -> Option<ReduceOp> {
    match s {
        "sum" => Some(ReduceOp::Sum),
        "mean" => Some(ReduceOp::Mean),
        "min" => Some(ReduceOp::Min),
        "max" => Some(ReduceOp::Max),
        _ => None,
    }
}

/// A `"…"` string as `{:?}` prints it; the rest of the text after it.
fn quoted(s: &str) -> Option<(String, &str)> {
    let rest = s.strip_prefix('"')?;
    let mut out = String::new();
    let mut chars = rest.char_indices();
    while let Some((k, c)) = chars.next() {
        match c {
            '"' => return Some((out, &rest[k + 1..])),
            '\\' => {
                let (_, e) = chars.next()?;
                match e {
                    'n' => out.push('\n'),
                    't' => out.push('\t'),
                    'r' => out.push('\r'),
                    '0' => out.push('\0'),
                    '\\' | '"' | '\'' => out.push(e),
                    'u' => {
                        let (_, open) = chars.next()?;
                        if open != '{' {
                            return None;
                        }
                        let mut hex = String::new();
                        loop {
                            let (_, h) = chars.next()?;
                            if h == '}' {
                                break;
                            }
                            hex.push(h);
                        }
                        out.push(char::from_u32(u32::from_str_radix(&hex, 16).ok()?)?);
                    }
                    _ => return None,
                }
            }
            c => out.push(c),
        }
    }
    None
}

/// `%7` → 7.
fn value(s: &str) -> Option<u32> {
    s.strip_prefix('%')?.parse().ok()
}

/// Splits the device requests (`@device="…"`, `@colocate={%1,%2}`) off the end of
/// `tail`: what comes before them, the device and the colocated value numbers.
fn requests(tail: &str) -> std::result::Result<(&str, Option<String>, Vec<u32>), String> {
    let Some(at) = (if tail.starts_with('@') { Some(0) } else { tail.find(" @").map(|i| i + 1) })
    else {
        return Ok((tail, None, Vec::new()));
    };
    let (mut device, mut colocate) = (None, Vec::new());
    for item in tail[at..].split(' ').filter(|i| !i.is_empty()) {
        if let Some(d) = item.strip_prefix("@device=") {
            let d = quoted(d)
                .filter(|(_, after)| after.is_empty())
                .map(|(d, _)| d)
                .ok_or_else(|| format!("{item:?} is not `@device=\"SPEC\"`"))?;
            device = Some(d);
        } else if let Some(list) =
            item.strip_prefix("@colocate={").and_then(|l| l.strip_suffix('}'))
        {
            for v in list.split(',') {
                colocate.push(value(v).ok_or_else(|| format!("{v:?} is not a value"))?);
            }
        } else {
            return Err(format!("unexpected {item:?} among the device requests"));
        }
    }
    Ok((tail[..at].trim_end(), device, colocate))
}

fn parse(text: &str) -> Result<Program> {
    let mut b = Builder::new();
    // The builder's value for each printed number.
    let mut values: Vec<Value> = Vec::new();
    let mut results = None;
    for (n, raw) in text.lines().enumerate() {
        let line = n + 1;
        let t = raw.trim();
        if t.is_empty() {
            continue;
        }
        if results.is_some() {
            return Err(bad(line, t, "nothing may follow `return`"));
        }
        if let Some(rest) = t.strip_prefix("param ") {
            // param %0 "name": f64[2,3]
            let (num, rest) = rest
                .split_once(' ')
                .ok_or_else(|| bad(line, t, "want `param %N \"name\": SPEC`"))?;
            if value(num) != Some(values.len() as u32) {
                return Err(bad(
                    line,
                    t,
                    format!("values are numbered in order: want %{}", values.len()),
                ));
            }
            let (name, rest) = quoted(rest).ok_or_else(|| bad(line, t, "want a quoted name"))?;
            let (rest, device, colocate) = requests(rest).map_err(|p| bad(line, t, p))?;
            if !colocate.is_empty() {
                return Err(bad(line, t, "a parameter has no `@colocate`"));
            }
            let spec = rest
                .strip_prefix(": ")
                .and_then(|s| s.parse::<TensorSpec>().ok())
                .ok_or_else(|| bad(line, t, "want `: SPEC` after the name"))?;
            let v = b.param(&name, spec).map_err(|e| bad(line, t, e.to_string()))?;
            if let Some(d) = device {
                b.set_device(v, &d).map_err(|e| bad(line, t, e.to_string()))?;
            }
            values.push(v);
            continue;
        }
        if let Some(rest) = t.strip_prefix("return") {
            let rest = rest.trim();
            let mut out = Vec::new();
            for r in rest.split(',').map(str::trim).filter(|r| !r.is_empty()) {
                let k = value(r).ok_or_else(|| bad(line, t, format!("{r:?} is not a value")))?;
                let v = values
                    .get(k as usize)
                    .ok_or_else(|| bad(line, t, format!("%{k} is not defined")))?;
                out.push(*v);
            }
            results = Some(out);
            continue;
        }
        // %N = SPEC op(args)[, attrs][ "name"]
        let (num, rest) =
            t.split_once(" = ").ok_or_else(|| bad(line, t, "want `%N = SPEC op(...)`"))?;
        if value(num) != Some(values.len() as u32) {
            return Err(bad(
                line,
                t,
                format!("values are numbered in order: want %{}", values.len()),
            ));
        }
        let (spec_text, rest) =
            rest.split_once(' ').ok_or_else(|| bad(line, t, "want a spec and an op"))?;
        let spec: TensorSpec =
            spec_text.parse().map_err(|e| bad(line, t, format!("bad spec: {e}")))?;
        let open = rest.find('(').ok_or_else(|| bad(line, t, "want `op(...)`"))?;
        let close =
            rest[open..].find(')').map(|c| open + c).ok_or_else(|| bad(line, t, "unclosed `(`"))?;
        let name = &rest[..open];
        let mut args = Vec::new();
        for a in rest[open + 1..close].split(',').map(str::trim).filter(|a| !a.is_empty()) {
            let k = value(a).ok_or_else(|| bad(line, t, format!("{a:?} is not a value")))?;
            let v = values
                .get(k as usize)
                .ok_or_else(|| bad(line, t, format!("%{k} is used before it is defined")))?;
            args.push(*v);
        }
        // Attributes, then an optional quoted name.
        let mut tail = rest[close + 1..].trim();
        let mut label = None;
        let start = tail.rfind(" \"").map(|q| q + 1).or_else(|| tail.starts_with('"').then_some(0));
        if let Some(q) = start
            && let Some((s, _)) = quoted(&tail[q..]).filter(|(_, after)| after.is_empty())
        {
            label = Some(s);
            tail = tail[..q].trim();
        }
        let (rest_tail, device, colocate) = requests(tail).map_err(|p| bad(line, t, p))?;
        tail = rest_tail.trim();
        let mut attrs: Vec<(&str, &str)> = Vec::new();
        if let Some(list_text) = tail.strip_prefix(',') {
            for item in split_top(list_text.trim()) {
                let (k, v) = item.split_once('=').ok_or_else(|| {
                    bad(line, t, format!("attribute {item:?} is not `name=value`"))
                })?;
                attrs.push((k.trim(), v.trim()));
            }
        } else if !tail.is_empty() {
            return Err(bad(line, t, format!("unexpected {tail:?} after the operands")));
        }
        let op = op_of(name, &attrs, &spec).map_err(|p| bad(line, t, p))?;
        let v = b.push(op, &args).map_err(|e| bad(line, t, e.to_string()))?;
        let inferred = b.spec(v).map_err(|e| bad(line, t, e.to_string()))?;
        if *inferred != spec {
            return Err(bad(line, t, format!("the op gives {inferred}, the text says {spec}")));
        }
        if let Some(l) = label {
            b.name(v, &l).map_err(|e| bad(line, t, e.to_string()))?;
        }
        if let Some(d) = device {
            b.set_device(v, &d).map_err(|e| bad(line, t, e.to_string()))?;
        }
        for c in colocate {
            let w = values
                .get(c as usize)
                .ok_or_else(|| bad(line, t, format!("colocation with %{c}, not defined before")))?;
            b.colocate(v, *w).map_err(|e| bad(line, t, e.to_string()))?;
        }
        values.push(v);
    }
    let results = results.ok_or(Error::Parse {
        line: text.lines().count(),
        text: String::new(),
        problem: "no `return` line".into(),
    })?;
    b.finish(&results)
}

/// The op named `name` with attributes `attrs` (the result's `spec` gives the dtype and
/// shape of ops that make a tensor).
fn op_of(name: &str, attrs: &[(&str, &str)], spec: &TensorSpec) -> std::result::Result<Op, String> {
    let get = |key: &str| {
        attrs
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| *v)
            .ok_or_else(|| format!("{name} needs `{key}=`"))
    };
    let num = |key: &str| {
        get(key).and_then(|v| v.parse::<usize>().map_err(|_| format!("`{key}={v}` is not a count")))
    };
    let lst = |key: &str| {
        get(key)
            .and_then(|v| list(v).ok_or_else(|| format!("`{key}={v}` is not a list like {{1,2}}")))
    };
    let grp = || {
        get("groups").and_then(|v| {
            groups(v).ok_or_else(|| format!("`groups={v}` is not like {{{{0,1}},{{2,3}}}}"))
        })
    };
    let red = || {
        get("op").and_then(|v| {
            reduce_op(v).ok_or_else(|| format!("`op={v}` is not sum, mean, min or max"))
        })
    };
    let known: &[&str] = match name {
        "constant" => &["value"],
        "literal" => &["bytes"],
        "dot_general" => &["lhs_contract", "rhs_contract", "lhs_batch", "rhs_batch"],
        "reduce_sum" | "reduce_max" | "reduce_mean" => &["axes", "keepdims"],
        "reshape" | "broadcast_to" => &["shape"],
        "transpose" => &["perm"],
        "slice" => &["start", "stop", "step"],
        "concat" | "take" | "softmax" | "log_softmax" | "argmax" | "iota" => &["axis"],
        "one_hot" => &["depth"],
        "attention" => &["scale", "divide", "causal"],
        "attention_grad" => &["scale", "divide", "causal", "wrt"],
        "conv2d" | "conv2d_backprop_input" | "conv2d_backprop_filter" => &["strides", "padding"],
        "pad" => &["low", "high", "interior"],
        "scatter_add" => &["axis"],
        "all_reduce" => &["op", "groups"],
        "all_gather" | "shard_slice" | "shard_pad" => &["axis", "groups"],
        "reduce_scatter" => &["op", "axis", "groups"],
        "all_to_all" => &["split_axis", "concat_axis", "groups"],
        "collective_permute" => &["pairs"],
        "send" | "recv" => &["channel", "peer"],
        "emit" => &["consumer"],
        _ => &[],
    };
    if let Some((k, _)) = attrs.iter().find(|(k, _)| !known.contains(k)) {
        return Err(format!("{name} has no attribute `{k}`"));
    }
    let unary = |u| Ok(Op::Unary(u));
    let dims = spec.shape.dims().to_vec();
    Ok(match name {
        "neg" => return unary(Unary::Neg),
        "exp" => return unary(Unary::Exp),
        "log" => return unary(Unary::Log),
        "tanh" => return unary(Unary::Tanh),
        "logistic" => return unary(Unary::Logistic),
        "sqrt" => return unary(Unary::Sqrt),
        "rsqrt" => return unary(Unary::Rsqrt),
        "abs" => return unary(Unary::Abs),
        "square" => return unary(Unary::Square),
        "relu" => return unary(Unary::Relu),
        "gelu" => return unary(Unary::Gelu),
        "sin" => return unary(Unary::Sin),
        "cos" => return unary(Unary::Cos),
        "stop_gradient" => return unary(Unary::StopGradient),
        "optimization_barrier" => return unary(Unary::Barrier),
        "add" => Op::Binary(Binary::Add),
        "sub" => Op::Binary(Binary::Sub),
        "mul" => Op::Binary(Binary::Mul),
        "div" => Op::Binary(Binary::Div),
        "max" => Op::Binary(Binary::Max),
        "min" => Op::Binary(Binary::Min),
        "pow" => Op::Binary(Binary::Pow),
        "lt" => Op::Compare(Compare::Lt),
        "le" => Op::Compare(Compare::Le),
        "gt" => Op::Compare(Compare::Gt),
        "ge" => Op::Compare(Compare::Ge),
        "eq" => Op::Compare(Compare::Eq),
        "ne" => Op::Compare(Compare::Ne),
        "select" => Op::Select,
        "threefry_uniform" => Op::ThreefryUniform,
        "constant" => {
            let v = get("value")?;
            let value: f64 = v.parse().map_err(|_| format!("`value={v}` is not a number"))?;
            Op::Constant { value, dtype: spec.dtype }
        }
        "dot_general" => Op::DotGeneral {
            lhs_contract: lst("lhs_contract")?,
            rhs_contract: lst("rhs_contract")?,
            lhs_batch: lst("lhs_batch")?,
            rhs_batch: lst("rhs_batch")?,
        },
        "reduce_sum" | "reduce_max" | "reduce_mean" => {
            let kind = match name {
                "reduce_sum" => Reduction::Sum,
                "reduce_max" => Reduction::Max,
                _ => Reduction::Mean,
            };
            let keepdims = match get("keepdims")? {
                "true" => true,
                "false" => false,
                v => return Err(format!("`keepdims={v}` is not true or false")),
            };
            Op::Reduce { kind, axes: lst("axes")?, keepdims }
        }
        "reshape" => Op::Reshape { shape: lst("shape")? },
        "broadcast_to" => Op::BroadcastTo { shape: lst("shape")? },
        "transpose" => Op::Transpose { perm: lst("perm")? },
        "slice" => Op::Slice { start: lst("start")?, stop: lst("stop")?, step: lst("step")? },
        "concat" => Op::Concat { axis: num("axis")? },
        "take" => Op::Take { axis: num("axis")? },
        "softmax" => Op::Softmax { axis: num("axis")? },
        "log_softmax" => Op::LogSoftmax { axis: num("axis")? },
        "argmax" => Op::Argmax { axis: num("axis")? },
        "one_hot" => Op::OneHot { depth: num("depth")?, dtype: spec.dtype },
        "attention" | "attention_grad" => {
            let flag = |key: &str| match get(key)? {
                "true" => Ok(true),
                "false" => Ok(false),
                v => Err(format!("`{key}={v}` is not true or false")),
            };
            let v = get("scale")?;
            let scale: f64 = v.parse().map_err(|_| format!("`scale={v}` is not a number"))?;
            let attention = crate::op::AttentionSpec {
                scale,
                divide: flag("divide")?,
                causal: flag("causal")?,
            };
            if name == "attention" {
                Op::Attention(attention)
            } else {
                Op::AttentionGrad { attention, wrt: num("wrt")? }
            }
        }
        "cross_entropy" => Op::CrossEntropy,
        "cross_entropy_grad" => Op::CrossEntropyGrad,
        "pad" => Op::Pad { low: lst("low")?, high: lst("high")?, interior: lst("interior")? },
        "scatter_add" => Op::ScatterAdd { axis: num("axis")? },
        "conv2d" | "conv2d_backprop_input" | "conv2d_backprop_filter" => {
            let s = lst("strides")?;
            let strides: [usize; 2] =
                s.as_slice().try_into().map_err(|_| format!("`strides` {s:?} needs 2 entries"))?;
            let padding = match get("padding")? {
                "SAME" => Padding::Same,
                "VALID" => Padding::Valid,
                v => return Err(format!("`padding={v}` is not SAME or VALID")),
            };
            match name {
                "conv2d" => Op::Conv2d { strides, padding },
                _ => {
                    let shape: [usize; 4] = dims
                        .as_slice()
                        .try_into()
                        .map_err(|_| format!("{name} makes a rank-4 tensor, not {spec}"))?;
                    if name == "conv2d_backprop_input" {
                        Op::Conv2dBackpropInput { strides, padding, input: shape }
                    } else {
                        Op::Conv2dBackpropFilter { strides, padding, filter: shape }
                    }
                }
            }
        }
        "convert" => Op::Convert { dtype: spec.dtype },
        "iota" => Op::Iota { dtype: spec.dtype, shape: dims, axis: num("axis")? },
        "literal" => {
            let hex = get("bytes")?;
            let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
            if hex.len() % 2 != 0 {
                return Err("`bytes` is not whole bytes of hex".into());
            }
            let bytes = hex
                .as_bytes()
                .chunks(2)
                .map(|p| Some(digit(p[0])? << 4 | digit(p[1])?))
                .collect::<Option<Vec<u8>>>()
                .ok_or("`bytes` is not hex")?;
            let value = meshwork_types::Tensor::from_le_bytes(spec.dtype, &dims, &bytes)
                .map_err(|e| format!("`bytes` are not a {spec}: {e}"))?;
            Op::Literal { value: std::sync::Arc::new(value) }
        }
        "all_reduce" => Op::AllReduce { op: red()?, groups: grp()? },
        "all_gather" => Op::AllGather { axis: num("axis")?, groups: grp()? },
        "shard_slice" => Op::ShardSlice { axis: num("axis")?, groups: grp()? },
        "shard_pad" => Op::ShardPad { axis: num("axis")?, groups: grp()? },
        "reduce_scatter" => Op::ReduceScatter { op: red()?, axis: num("axis")?, groups: grp()? },
        "all_to_all" => Op::AllToAll {
            split_axis: num("split_axis")?,
            concat_axis: num("concat_axis")?,
            groups: grp()?,
        },
        "collective_permute" => {
            let g = get("pairs").and_then(|v| {
                groups(v).ok_or_else(|| format!("`pairs={v}` is not like {{{{0,1}},{{1,0}}}}"))
            })?;
            let pairs = g
                .into_iter()
                .map(|p| match p.as_slice() {
                    [s, t] => Ok((*s, *t)),
                    _ => Err(format!("pair {p:?} needs 2 entries")),
                })
                .collect::<std::result::Result<Vec<_>, String>>()?;
            Op::CollectivePermute { pairs }
        }
        "send" | "recv" => {
            let channel = get("channel")?;
            let channel: u32 =
                channel.parse().map_err(|_| format!("`channel={channel}` is not a channel id"))?;
            let peer = num("peer")?;
            if name == "send" {
                Op::Send { channel, peer }
            } else {
                Op::Recv { channel, peer, dtype: spec.dtype, shape: dims }
            }
        }
        "emit" => {
            let c = get("consumer")?;
            Op::Emit {
                consumer: c.parse().map_err(|_| format!("`consumer={c}` is not a consumer id"))?,
            }
        }
        other => return Err(format!("unknown op {other:?}")),
    })
}
