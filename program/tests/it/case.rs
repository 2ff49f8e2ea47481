//! Reading the JAX program oracle's cases (`testdata/cases.jsonl`, `FORMAT.md`): each
//! case's program, built with the builder, and its tensors. Shared by the oracle
//! tests, the conformance example and the strategy crate's SPMD tests.

use meshwork_program::{Builder, Padding, Program, Tensor, Value};
use meshwork_types::{DType, TensorSpec};
use serde_json::Value as Json;

pub(crate) fn dims(v: &Json) -> Vec<usize> {
    v.as_array().unwrap().iter().map(|d| d.as_u64().unwrap() as usize).collect()
}

pub(crate) fn dtype(name: &str) -> DType {
    match name {
        "f64" => DType::F64,
        "i64" => DType::I64,
        "bool" => DType::Bool,
        other => panic!("the oracle has no dtype {other}"),
    }
}

/// Builds one case's program; returns it, or the builder's error.
pub(crate) fn build(case: &Json) -> Result<Program, meshwork_program::Error> {
    let mut b = Builder::new();
    let mut values: std::collections::HashMap<String, Value> = Default::default();
    for input in case["inputs"].as_array().unwrap() {
        let spec = TensorSpec::new(
            dtype(input["dtype"].as_str().unwrap()),
            meshwork_types::Shape::new(&dims(&input["shape"])).unwrap(),
        );
        let name = input["name"].as_str().unwrap();
        values.insert(name.into(), b.param(name, spec)?);
    }
    for op in case["ops"].as_array().unwrap() {
        let args: Vec<Value> =
            op["args"].as_array().unwrap().iter().map(|a| values[a.as_str().unwrap()]).collect();
        let int = |k: &str| op[k].as_i64().unwrap();
        let list = |k: &str| dims(&op[k]);
        let name = op["op"].as_str().unwrap();
        let v = match name {
            "neg" => b.neg(args[0]),
            "exp" => b.exp(args[0]),
            "log" => b.log(args[0]),
            "tanh" => b.tanh(args[0]),
            "logistic" => b.logistic(args[0]),
            "sqrt" => b.sqrt(args[0]),
            "rsqrt" => b.rsqrt(args[0]),
            "abs" => b.abs(args[0]),
            "square" => b.square(args[0]),
            "relu" => b.relu(args[0]),
            "gelu" => b.gelu(args[0]),
            "sin" => b.sin(args[0]),
            "cos" => b.cos(args[0]),
            "stop_gradient" => b.stop_gradient(args[0]),
            "add" => b.add(args[0], args[1]),
            "sub" => b.sub(args[0], args[1]),
            "mul" => b.mul(args[0], args[1]),
            "div" => b.div(args[0], args[1]),
            "max" => b.max(args[0], args[1]),
            "min" => b.min(args[0], args[1]),
            "pow" => b.pow(args[0], args[1]),
            "lt" => b.lt(args[0], args[1]),
            "le" => b.le(args[0], args[1]),
            "gt" => b.gt(args[0], args[1]),
            "ge" => b.ge(args[0], args[1]),
            "eq" => b.eq(args[0], args[1]),
            "ne" => b.ne(args[0], args[1]),
            "select" => b.select(args[0], args[1], args[2]),
            "constant" => b.constant(op["value"].as_f64().unwrap(), DType::F64),
            "dot_general" => b.dot_general(
                args[0],
                args[1],
                &list("lhs_contract"),
                &list("rhs_contract"),
                &list("lhs_batch"),
                &list("rhs_batch"),
            ),
            "reduce_sum" | "reduce_max" | "reduce_mean" => {
                let axes: Vec<isize> = op["axes"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|a| a.as_i64().unwrap() as isize)
                    .collect();
                let keep = op["keepdims"].as_bool().unwrap();
                match name {
                    "reduce_sum" => b.reduce_sum(args[0], &axes, keep),
                    "reduce_max" => b.reduce_max(args[0], &axes, keep),
                    _ => b.reduce_mean(args[0], &axes, keep),
                }
            }
            "reshape" => b.reshape(args[0], &list("shape")),
            "transpose" => b.transpose(args[0], &list("perm")),
            "broadcast_to" => b.broadcast_to(args[0], &list("shape")),
            "slice" => b.slice(args[0], &list("start"), &list("stop"), &list("step")),
            "concat" => b.concat(&args, int("axis") as isize),
            "take" => b.take(args[0], args[1], int("axis") as isize),
            "one_hot" => b.one_hot(args[0], int("depth") as usize, DType::F64),
            "softmax" => b.softmax(args[0], int("axis") as isize),
            "log_softmax" => b.log_softmax(args[0], int("axis") as isize),
            "argmax" => b.argmax(args[0], int("axis") as isize),
            "conv2d" => {
                let s = list("strides");
                let padding = match op["padding"].as_str().unwrap() {
                    "SAME" => Padding::Same,
                    _ => Padding::Valid,
                };
                b.conv2d(args[0], args[1], [s[0], s[1]], padding)
            }
            other => panic!("op {other} is not in the oracle's format"),
        }?;
        values.insert(op["out"].as_str().unwrap().into(), v);
    }
    let outputs: Vec<Value> =
        case["outputs"].as_array().unwrap().iter().map(|o| values[o.as_str().unwrap()]).collect();
    b.finish(&outputs)
}

/// The oracle's tensor `t` (`{dtype, shape, data}`).
pub(crate) fn tensor(t: &Json) -> Tensor {
    let d = dims(&t["shape"]);
    let data = t["data"].as_array().unwrap();
    match t["dtype"].as_str().unwrap() {
        "f64" => Tensor::f64(&d, data.iter().map(|x| x.as_f64().unwrap()).collect()),
        "i64" => Tensor::i64(&d, data.iter().map(|x| x.as_i64().unwrap()).collect()),
        "bool" => Tensor::bool(&d, data.iter().map(|x| x.as_bool().unwrap()).collect()),
        other => panic!("the oracle has no dtype {other}"),
    }
    .unwrap()
}
