//! Typed tensors as they travel in payloads: encode to little-endian bytes, decode to
//! `ndarray` arrays.

use meshwork_types::{DType, Shape, TensorSpec};
use ndarray::{ArrayD, IxDyn};

use crate::{Error, Result};

/// A tensor of any dtype. `f16` and `bf16` carry their raw 16-bit patterns.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Tensor {
    /// `bool` (one byte per element on the wire: 0 or 1).
    Bool(ArrayD<bool>),
    /// `u8`.
    U8(ArrayD<u8>),
    /// `u16`.
    U16(ArrayD<u16>),
    /// `u32`.
    U32(ArrayD<u32>),
    /// `u64`.
    U64(ArrayD<u64>),
    /// `i8`.
    I8(ArrayD<i8>),
    /// `i16`.
    I16(ArrayD<i16>),
    /// `i32`.
    I32(ArrayD<i32>),
    /// `i64`.
    I64(ArrayD<i64>),
    /// `f16`, as raw bits.
    F16(ArrayD<u16>),
    /// `bf16`, as raw bits.
    BF16(ArrayD<u16>),
    /// `f32`.
    F32(ArrayD<f32>),
    /// `f64`.
    F64(ArrayD<f64>),
}

/// Applies `$body` to the array inside any variant, bound as `$a`.
macro_rules! each {
    ($t:expr, $a:ident => $body:expr) => {
        match $t {
            Tensor::Bool($a) => $body,
            Tensor::U8($a) => $body,
            Tensor::U16($a) | Tensor::F16($a) | Tensor::BF16($a) => $body,
            Tensor::U32($a) => $body,
            Tensor::U64($a) => $body,
            Tensor::I8($a) => $body,
            Tensor::I16($a) => $body,
            Tensor::I32($a) => $body,
            Tensor::I64($a) => $body,
            Tensor::F32($a) => $body,
            Tensor::F64($a) => $body,
        }
    };
}

/// Element types that travel as little-endian bytes.
trait Element: Copy {
    const SIZE: usize;
    fn write(self, out: &mut Vec<u8>);
    fn read(bytes: &[u8]) -> Self;
}

macro_rules! element {
    ($($t:ty),*) => {$(
        impl Element for $t {
            const SIZE: usize = std::mem::size_of::<$t>();
            fn write(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn read(bytes: &[u8]) -> Self {
                <$t>::from_le_bytes(bytes.try_into().expect("exact chunk"))
            }
        }
    )*};
}

element!(u8, u16, u32, u64, i8, i16, i32, i64, f32, f64);

impl Element for bool {
    const SIZE: usize = 1;
    fn write(self, out: &mut Vec<u8>) {
        out.push(u8::from(self));
    }
    fn read(bytes: &[u8]) -> Self {
        bytes[0] != 0
    }
}

fn encode_array<T: Element>(a: &ArrayD<T>, out: &mut Vec<u8>) {
    out.reserve(a.len() * T::SIZE);
    match a.as_slice() {
        Some(slice) => slice.iter().for_each(|&x| x.write(out)),
        None => a.iter().for_each(|&x| x.write(out)),
    }
}

fn decode_array<T: Element>(shape: &Shape, bytes: &[u8]) -> ArrayD<T> {
    let data: Vec<T> = bytes.chunks_exact(T::SIZE).map(T::read).collect();
    ArrayD::from_shape_vec(IxDyn(shape.dims()), data).expect("length checked against the spec")
}

impl Tensor {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            Tensor::Bool(_) => DType::Bool,
            Tensor::U8(_) => DType::U8,
            Tensor::U16(_) => DType::U16,
            Tensor::U32(_) => DType::U32,
            Tensor::U64(_) => DType::U64,
            Tensor::I8(_) => DType::I8,
            Tensor::I16(_) => DType::I16,
            Tensor::I32(_) => DType::I32,
            Tensor::I64(_) => DType::I64,
            Tensor::F16(_) => DType::F16,
            Tensor::BF16(_) => DType::BF16,
            Tensor::F32(_) => DType::F32,
            Tensor::F64(_) => DType::F64,
        }
    }

    /// The dims.
    pub fn shape(&self) -> &[usize] {
        each!(self, a => a.shape())
    }

    /// Dtype and shape.
    pub fn spec(&self) -> Result<TensorSpec> {
        Ok(TensorSpec::new(self.dtype(), Shape::new(self.shape())?))
    }

    /// Appends the elements, row-major, little-endian.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        each!(self, a => encode_array(a, out))
    }

    /// Decodes one tensor of `spec` from exactly its bytes.
    pub fn decode(spec: &TensorSpec, bytes: &[u8]) -> Tensor {
        let s = &spec.shape;
        match spec.dtype {
            DType::Bool => Tensor::Bool(decode_array(s, bytes)),
            DType::U8 => Tensor::U8(decode_array(s, bytes)),
            DType::U16 => Tensor::U16(decode_array(s, bytes)),
            DType::U32 => Tensor::U32(decode_array(s, bytes)),
            DType::U64 => Tensor::U64(decode_array(s, bytes)),
            DType::I8 => Tensor::I8(decode_array(s, bytes)),
            DType::I16 => Tensor::I16(decode_array(s, bytes)),
            DType::I32 => Tensor::I32(decode_array(s, bytes)),
            DType::I64 => Tensor::I64(decode_array(s, bytes)),
            DType::F16 => Tensor::F16(decode_array(s, bytes)),
            DType::BF16 => Tensor::BF16(decode_array(s, bytes)),
            DType::F32 => Tensor::F32(decode_array(s, bytes)),
            DType::F64 => Tensor::F64(decode_array(s, bytes)),
            other => unreachable!("every dtype is decoded; {other} is new"),
        }
    }
}

/// Encodes `tensors` as the payload of `consumer`, checking them against `specs`.
pub fn encode_payload(
    consumer: u32,
    specs: &[TensorSpec],
    tensors: &[Tensor],
    out: &mut Vec<u8>,
) -> Result<()> {
    if tensors.len() != specs.len() {
        return Err(Error::TensorMismatch {
            consumer,
            index: tensors.len().min(specs.len()),
            actual: format!("{} tensors", tensors.len()),
            expected: format!("{} tensors", specs.len()),
        });
    }
    for (index, (t, spec)) in tensors.iter().zip(specs).enumerate() {
        let actual = t.spec()?;
        if &actual != spec {
            return Err(Error::TensorMismatch {
                consumer,
                index,
                actual: actual.to_string(),
                expected: spec.to_string(),
            });
        }
    }
    out.clear();
    for t in tensors {
        t.encode_into(out);
    }
    Ok(())
}

/// Decodes a payload of `specs` (its length already checked).
pub fn decode_payload(specs: &[TensorSpec], payload: &[u8]) -> Vec<Tensor> {
    let mut at = 0;
    specs
        .iter()
        .map(|spec| {
            let len = spec.byte_size().expect("registered specs have a byte size");
            let t = Tensor::decode(spec, &payload[at..at + len]);
            at += len;
            t
        })
        .collect()
}
