//! Small array operations on the executor's dtype-erased tensors that the façade needs
//! on the host: concatenation, row slices, sums, shards.

use std::ops::Range;

use meshwork_executor::Tensor;
use meshwork_sharding::{Mode, Sharding};
use meshwork_types::DType;
use ndarray::{ArrayD, Axis, IxDyn, Slice};

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

/// The sum over `axis`, keeping the other dims.
pub(crate) fn sum_axis(t: &Tensor, axis: usize) -> Tensor {
    map!(t, a => a.sum_axis(Axis(axis)))
}

/// Element-wise `x + y`.
pub(crate) fn add(x: &Tensor, y: &Tensor) -> Result<Tensor> {
    if x.shape() != y.shape() {
        return Err(Error::ShapeMismatch {
            what: "addition",
            expected: x.shape().to_vec(),
            actual: y.shape().to_vec(),
            axis: None,
        });
    }
    zip!(x, y, a, b => a + b, Error::DTypeMismatch { what: "addition", expected: x.dtype(), actual: y.dtype() })
}

/// Element-wise `x / n` in the element type (integers truncate toward zero).
pub(crate) fn divide(x: &Tensor, n: f64) -> Tensor {
    match x {
        Tensor::F32(a) => Tensor::F32(a.mapv(|v| v / n as f32)),
        Tensor::F64(a) => Tensor::F64(a.mapv(|v| v / n)),
        Tensor::I32(a) => Tensor::I32(a.mapv(|v| v / n as i32)),
        Tensor::I64(a) => Tensor::I64(a.mapv(|v| v / n as i64)),
        other => unreachable!("executor tensors have four dtypes, not {}", other.dtype()),
    }
}

/// Feeds the tensor's dtype, shape and element bits to `h`.
pub(crate) fn hash_bits(t: &Tensor, h: &mut impl std::hash::Hasher) {
    h.write_u8(t.dtype() as u8);
    t.shape().iter().for_each(|&d| h.write_usize(d));
    fn each<T: Copy>(a: &ArrayD<T>, mut f: impl FnMut(T)) {
        match a.as_slice() {
            Some(s) => s.iter().for_each(|&v| f(v)),
            None => a.iter().for_each(|&v| f(v)),
        }
    }
    match t {
        Tensor::F32(a) => each(a, |v| h.write_u32(v.to_bits())),
        Tensor::F64(a) => each(a, |v| h.write_u64(v.to_bits())),
        Tensor::I32(a) => each(a, |v| h.write_i32(v)),
        Tensor::I64(a) => each(a, |v| h.write_i64(v)),
        other => unreachable!("executor tensors have four dtypes, not {}", other.dtype()),
    }
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

/// A tensor of `dtype` and `shape` from little-endian bytes.
pub(crate) fn from_le_bytes(dtype: DType, shape: &[usize], bytes: &[u8]) -> Option<Tensor> {
    let n: usize = shape.iter().product();
    macro_rules! go {
        ($t:ty, $v:ident) => {{
            let size = std::mem::size_of::<$t>();
            if bytes.len() != n * size {
                return None;
            }
            let v: Vec<$t> = bytes
                .chunks_exact(size)
                .map(|c| <$t>::from_le_bytes(c.try_into().expect("chunk size")))
                .collect();
            Tensor::$v(ArrayD::from_shape_vec(IxDyn(shape), v).ok()?)
        }};
    }
    Some(match dtype {
        DType::F32 => go!(f32, F32),
        DType::F64 => go!(f64, F64),
        DType::I32 => go!(i32, I32),
        DType::I64 => go!(i64, I64),
        _ => return None,
    })
}

/// The tensor's elements as little-endian bytes, row-major.
pub(crate) fn to_le_bytes(t: &Tensor) -> Vec<u8> {
    macro_rules! go {
        ($a:ident) => {
            $a.iter().flat_map(|x| x.to_le_bytes()).collect()
        };
    }
    match t {
        Tensor::F32(a) => go!(a),
        Tensor::F64(a) => go!(a),
        Tensor::I32(a) => go!(a),
        Tensor::I64(a) => go!(a),
        other => unreachable!("executor tensors have four dtypes, not {}", other.dtype()),
    }
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
