//! Small array operations on the executor's dtype-erased tensors that the façade needs
//! on the host: concatenation, row slices, sums, shards.

use std::ops::Range;

use meshwork_executor::Tensor;
use meshwork_sharding::{Mode, Sharding};
use meshwork_types::DType;
use ndarray::{Axis, Slice};

use crate::{Error, Result};

/// Applies `$body` to the array of any variant, re-wrapping a returned array.
macro_rules! map {
    ($t:expr, $a:ident => $body:expr) => {
        match $t {
            Tensor::F32($a) => Tensor::F32($body),
            Tensor::F64($a) => Tensor::F64($body),
            Tensor::I32($a) => Tensor::I32($body),
            Tensor::I64($a) => Tensor::I64($body),
            other => unreachable!("executor tensors have four dtypes, not {}", other.dtype()),
        }
    };
}
pub(crate) use map;

/// Applies `$body` to the arrays of two tensors of one dtype, re-wrapping the result;
/// `$err` when the dtypes differ.
macro_rules! zip {
    ($x:expr, $y:expr, $a:ident, $b:ident => $body:expr, $err:expr) => {
        match ($x, $y) {
            (Tensor::F32($a), Tensor::F32($b)) => Ok(Tensor::F32($body)),
            (Tensor::F64($a), Tensor::F64($b)) => Ok(Tensor::F64($body)),
            (Tensor::I32($a), Tensor::I32($b)) => Ok(Tensor::I32($body)),
            (Tensor::I64($a), Tensor::I64($b)) => Ok(Tensor::I64($body)),
            _ => Err($err),
        }
    };
}
pub(crate) use zip;

/// The tensors must share a dtype.
fn one_dtype(what: &'static str, parts: &[&Tensor]) -> Result<DType> {
    let dtype = parts.first().map(|t| t.dtype()).ok_or(Error::Empty { what })?;
    if let Some(t) = parts.iter().find(|t| t.dtype() != dtype) {
        return Err(Error::DTypeMismatch { what, expected: dtype, actual: t.dtype() });
    }
    Ok(dtype)
}

/// The array views of `parts`, all of variant `$v`.
macro_rules! views {
    ($parts:expr, $v:ident) => {
        $parts
            .iter()
            .map(|t| match t {
                Tensor::$v(a) => a.view(),
                _ => unreachable!("one dtype, checked"),
            })
            .collect::<Vec<_>>()
    };
}

/// Checks that `parts` (`&[&Tensor]`) share one dtype, then evaluates `$body` with
/// `$views` their array views and `$wrap` the variant's constructor.
macro_rules! with_views {
    ($what:expr, $parts:expr, |$views:ident, $wrap:ident| $body:expr) => {{
        let parts: &[&Tensor] = $parts;
        one_dtype($what, parts)?;
        match parts[0] {
            Tensor::F32(_) => {
                let ($views, $wrap) = (views!(parts, F32), Tensor::F32);
                $body
            }
            Tensor::F64(_) => {
                let ($views, $wrap) = (views!(parts, F64), Tensor::F64);
                $body
            }
            Tensor::I32(_) => {
                let ($views, $wrap) = (views!(parts, I32), Tensor::I32);
                $body
            }
            Tensor::I64(_) => {
                let ($views, $wrap) = (views!(parts, I64), Tensor::I64);
                $body
            }
            other => unreachable!("executor tensors have four dtypes, not {}", other.dtype()),
        }
    }};
}

/// Concatenates `parts` along `axis` (shapes may differ only there).
pub(crate) fn concat(what: &'static str, parts: &[&Tensor], axis: usize) -> Result<Tensor> {
    let rank = parts.first().ok_or(Error::Empty { what })?.shape().len();
    if axis >= rank {
        return Err(Error::AxisOutOfRange { axis, rank });
    }
    for t in parts {
        let (a, b) = (t.shape(), parts[0].shape());
        if a.len() != rank || a.iter().zip(b).enumerate().any(|(d, (x, y))| d != axis && x != y) {
            return Err(Error::ShapeMismatch {
                what,
                expected: b.to_vec(),
                actual: a.to_vec(),
                axis: Some(axis),
            });
        }
    }
    Ok(with_views!(what, parts, |views, wrap| {
        wrap(ndarray::concatenate(Axis(axis), &views).expect("shapes checked"))
    }))
}

/// Rows `range` of `t` (along axis 0), copied.
pub(crate) fn rows(t: &Tensor, range: Range<usize>) -> Tensor {
    map!(t, a => a.slice_axis(Axis(0), Slice::from(range)).to_owned())
}

/// The sum over `axis`, keeping the other dims; integers wrap on overflow (as the
/// executor's reductions do), in every build profile.
pub(crate) fn sum_axis(t: &Tensor, axis: usize) -> Tensor {
    match t {
        Tensor::F32(a) => Tensor::F32(a.sum_axis(Axis(axis))),
        Tensor::F64(a) => Tensor::F64(a.sum_axis(Axis(axis))),
        Tensor::I32(a) => Tensor::I32(a.fold_axis(Axis(axis), 0, |&s, &x| s.wrapping_add(x))),
        Tensor::I64(a) => Tensor::I64(a.fold_axis(Axis(axis), 0, |&s, &x| s.wrapping_add(x))),
        other => unreachable!("executor tensors have four dtypes, not {}", other.dtype()),
    }
}

/// Element-wise `x + y`; integers wrap on overflow.
pub(crate) fn add(x: &Tensor, y: &Tensor) -> Result<Tensor> {
    if x.shape() != y.shape() {
        return Err(Error::ShapeMismatch {
            what: "addition",
            expected: x.shape().to_vec(),
            actual: y.shape().to_vec(),
            axis: None,
        });
    }
    match (x, y) {
        (Tensor::F32(a), Tensor::F32(b)) => Ok(Tensor::F32(a + b)),
        (Tensor::F64(a), Tensor::F64(b)) => Ok(Tensor::F64(a + b)),
        (Tensor::I32(a), Tensor::I32(b)) => {
            Ok(Tensor::I32(ndarray::Zip::from(a).and(b).map_collect(|&p, &q| p.wrapping_add(q))))
        }
        (Tensor::I64(a), Tensor::I64(b)) => {
            Ok(Tensor::I64(ndarray::Zip::from(a).and(b).map_collect(|&p, &q| p.wrapping_add(q))))
        }
        _ => Err(Error::DTypeMismatch { what: "addition", expected: x.dtype(), actual: y.dtype() }),
    }
}

/// Element-wise `x / n` in the element type (integers truncate toward zero). A float
/// divided by 0 gives NaN or infinity as IEEE says; an integer tensor divided by 0 —
/// a MEAN over no rows — has no value to give and is an error.
pub(crate) fn divide(x: &Tensor, n: f64) -> Result<Tensor> {
    let int = |n: f64| -> Result<i64> {
        if n == 0.0 {
            Err(Error::Empty { what: "a MEAN of an integer tensor over zero rows" })
        } else {
            Ok(n as i64)
        }
    };
    Ok(match x {
        Tensor::F32(a) => Tensor::F32(a.mapv(|v| v / n as f32)),
        Tensor::F64(a) => Tensor::F64(a.mapv(|v| v / n)),
        Tensor::I32(a) => {
            let n = int(n)?;
            Tensor::I32(a.mapv(|v| (i64::from(v) / n) as i32))
        }
        Tensor::I64(a) => {
            let n = int(n)?;
            Tensor::I64(a.mapv(|v| v.wrapping_div(n)))
        }
        other => unreachable!("executor tensors have four dtypes, not {}", other.dtype()),
    })
}

/// A tensor with a new leading dim of 1.
pub(crate) fn expand(t: &Tensor) -> Tensor {
    map!(t, a => a.clone().insert_axis(Axis(0)))
}

/// The shards of `t` under `sharding` (one per device, in device order).
pub(crate) fn shard(t: &Tensor, sharding: &Sharding) -> Result<Vec<Tensor>> {
    macro_rules! go {
        ($v:ident, $a:ident) => {
            meshwork_sharding::shard(&$a.view(), sharding, Mode::Strict)?
                .into_iter()
                .map(|s| Tensor::$v(s.data))
                .collect()
        };
    }
    Ok(match t {
        Tensor::F32(a) => go!(F32, a),
        Tensor::F64(a) => go!(F64, a),
        Tensor::I32(a) => go!(I32, a),
        Tensor::I64(a) => go!(I64, a),
        other => unreachable!("executor tensors have four dtypes, not {}", other.dtype()),
    })
}

/// The global tensor of `shape` from `shards` under `sharding`.
pub(crate) fn assemble(shards: &[Tensor], sharding: &Sharding, shape: &[usize]) -> Result<Tensor> {
    let refs: Vec<&Tensor> = shards.iter().collect();
    Ok(with_views!("shards", &refs, |views, wrap| {
        wrap(meshwork_sharding::assemble(&views, sharding, shape, Mode::Strict)?)
    }))
}

/// The destination shards of `plan` from `shards` (its source shards).
pub(crate) fn apply_plan(
    plan: &meshwork_sharding::ReshardPlan,
    shards: &[Tensor],
) -> Result<Vec<Tensor>> {
    let refs: Vec<&Tensor> = shards.iter().collect();
    Ok(with_views!("shards", &refs, |views, wrap| {
        plan.apply(&views)?.into_iter().map(wrap).collect()
    }))
}
