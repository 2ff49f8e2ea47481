//! Host tensors: what programs take and return.

use meshwork_types::{DType, Shape, TensorSpec};

use crate::{Error, Result};

/// A tensor's elements, row-major, in its dtype.
#[derive(Debug, Clone, PartialEq)]
pub enum Data {
    /// f32 elements.
    F32(Vec<f32>),
    /// f64 elements.
    F64(Vec<f64>),
    /// i32 elements.
    I32(Vec<i32>),
    /// i64 elements.
    I64(Vec<i64>),
    /// bool elements.
    Bool(Vec<bool>),
}

impl Data {
    /// The number of elements.
    pub fn len(&self) -> usize {
        match self {
            Data::F32(v) => v.len(),
            Data::F64(v) => v.len(),
            Data::I32(v) => v.len(),
            Data::I64(v) => v.len(),
            Data::Bool(v) => v.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The dtype.
    pub fn dtype(&self) -> DType {
        match self {
            Data::F32(_) => DType::F32,
            Data::F64(_) => DType::F64,
            Data::I32(_) => DType::I32,
            Data::I64(_) => DType::I64,
            Data::Bool(_) => DType::Bool,
        }
    }
}

/// A tensor: a shape and its elements.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    shape: Shape,
    data: Data,
}

impl Tensor {
    /// A tensor of `shape` holding `data` (as many elements as the shape has).
    pub fn new(shape: Shape, data: Data) -> Result<Tensor> {
        if data.len() != shape.num_elements() {
            return Err(Error::TensorSize { shape: shape.dims().to_vec(), elements: data.len() });
        }
        Ok(Tensor { shape, data })
    }

    /// An f64 tensor of `dims`.
    pub fn f64(dims: &[usize], values: Vec<f64>) -> Result<Tensor> {
        Tensor::new(Shape::new(dims)?, Data::F64(values))
    }

    /// An f32 tensor of `dims`.
    pub fn f32(dims: &[usize], values: Vec<f32>) -> Result<Tensor> {
        Tensor::new(Shape::new(dims)?, Data::F32(values))
    }

    /// An i64 tensor of `dims`.
    pub fn i64(dims: &[usize], values: Vec<i64>) -> Result<Tensor> {
        Tensor::new(Shape::new(dims)?, Data::I64(values))
    }

    /// A bool tensor of `dims`.
    pub fn bool(dims: &[usize], values: Vec<bool>) -> Result<Tensor> {
        Tensor::new(Shape::new(dims)?, Data::Bool(values))
    }

    /// The shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// The elements.
    pub fn data(&self) -> &Data {
        &self.data
    }

    /// The elements, taken.
    pub fn into_data(self) -> Data {
        self.data
    }

    /// An i32 tensor of `dims`.
    pub fn i32(dims: &[usize], values: Vec<i32>) -> Result<Tensor> {
        Tensor::new(Shape::new(dims)?, Data::I32(values))
    }

    /// The dtype and shape.
    pub fn spec(&self) -> TensorSpec {
        TensorSpec::new(self.data.dtype(), self.shape.clone())
    }

    /// The elements as f64 (integers and bools converted; for comparisons and tests).
    pub fn to_f64(&self) -> Vec<f64> {
        match &self.data {
            Data::F32(v) => v.iter().map(|&x| f64::from(x)).collect(),
            Data::F64(v) => v.clone(),
            Data::I32(v) => v.iter().map(|&x| f64::from(x)).collect(),
            Data::I64(v) => v.iter().map(|&x| x as f64).collect(),
            Data::Bool(v) => v.iter().map(|&x| f64::from(u8::from(x))).collect(),
        }
    }
}
