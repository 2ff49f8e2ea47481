//! Shapes and tensor specs.

use std::fmt;
use std::str::FromStr;

use crate::{DType, Error, Result, ShapeSyntax};

/// The dimensions of a tensor, outermost first.
///
/// Invariant: the element count (the product of the dims) fits in a `usize`; the
/// constructors check it, so [`Shape::num_elements`] never overflows. A rank-0 shape is
/// a scalar with one element; a shape with a zero dim has no elements.
///
/// Text form: `[2,3]`, `[]` for a scalar. Parsing allows spaces after commas.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Shape {
    dims: Vec<usize>,
    num_elements: usize,
}

impl Shape {
    /// A shape with these dims, or [`Error::ElementCountOverflow`] if their product does
    /// not fit in a `usize`.
    pub fn new(dims: &[usize]) -> Result<Shape> {
        Shape::from_vec(dims.to_vec())
    }

    fn from_vec(dims: Vec<usize>) -> Result<Shape> {
        match checked_product(&dims) {
            Some(num_elements) => Ok(Shape { dims, num_elements }),
            None => Err(Error::ElementCountOverflow { dims }),
        }
    }

    /// The rank-0 shape of a scalar.
    pub fn scalar() -> Shape {
        Shape { dims: Vec::new(), num_elements: 1 }
    }

    /// The dims, outermost first.
    pub fn dims(&self) -> &[usize] {
        &self.dims
    }

    /// The number of dims.
    pub fn rank(&self) -> usize {
        self.dims.len()
    }

    /// The number of elements (1 for a scalar, 0 if any dim is 0).
    pub fn num_elements(&self) -> usize {
        self.num_elements
    }

    /// The size in bytes of a dense tensor of this shape and `dtype`, or
    /// [`Error::ByteSizeOverflow`].
    pub fn byte_size(&self, dtype: DType) -> Result<usize> {
        self.num_elements
            .checked_mul(dtype.size_in_bytes())
            .ok_or_else(|| Error::ByteSizeOverflow { shape: self.clone(), dtype })
    }

    /// The dims as an owned vector.
    pub fn into_dims(self) -> Vec<usize> {
        self.dims
    }
}

/// The product of `dims`, or `None` on overflow. An empty product is 1.
///
/// A zero dim makes the product 0 whatever the other dims are, as in the tensor: `[0,
/// usize::MAX, 2]` has zero elements, not an overflow.
fn checked_product(dims: &[usize]) -> Option<usize> {
    if dims.contains(&0) {
        return Some(0);
    }
    dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

impl Default for Shape {
    /// The scalar shape.
    fn default() -> Shape {
        Shape::scalar()
    }
}

impl TryFrom<Vec<usize>> for Shape {
    type Error = Error;

    fn try_from(dims: Vec<usize>) -> Result<Shape> {
        Shape::from_vec(dims)
    }
}

impl TryFrom<&[usize]> for Shape {
    type Error = Error;

    fn try_from(dims: &[usize]) -> Result<Shape> {
        Shape::new(dims)
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.dims.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

impl FromStr for Shape {
    type Err = Error;

    fn from_str(s: &str) -> Result<Shape> {
        let syntax = |reason| Error::InvalidShape { input: s.to_owned(), reason };
        let inner = s
            .trim()
            .strip_prefix('[')
            .and_then(|rest| rest.strip_suffix(']'))
            .ok_or(syntax(ShapeSyntax::MissingBrackets))?;
        if inner.trim().is_empty() {
            return Ok(Shape::scalar());
        }
        let dims = inner
            .split(',')
            .enumerate()
            .map(|(index, part)| {
                let part = part.trim();
                // `usize::from_str` accepts a leading `+`; a dim is plain digits.
                if part.starts_with('+') {
                    return Err(syntax(ShapeSyntax::BadDim { index }));
                }
                part.parse::<usize>().map_err(|_| syntax(ShapeSyntax::BadDim { index }))
            })
            .collect::<Result<Vec<_>>>()?;
        Shape::from_vec(dims)
    }
}

/// The dtype and shape of a tensor: everything needed to size and check a buffer.
///
/// Text form: `f32[8,128]` (XLA's), `bool[]` for a scalar.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TensorSpec {
    /// The element type.
    pub dtype: DType,
    /// The dimensions.
    pub shape: Shape,
}

impl TensorSpec {
    /// A spec from its parts.
    pub fn new(dtype: DType, shape: Shape) -> TensorSpec {
        TensorSpec { dtype, shape }
    }

    /// The size in bytes of a dense tensor with this spec, or
    /// [`Error::ByteSizeOverflow`].
    pub fn byte_size(&self) -> Result<usize> {
        self.shape.byte_size(self.dtype)
    }
}

impl fmt::Display for TensorSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.dtype, self.shape)
    }
}

impl FromStr for TensorSpec {
    type Err = Error;

    fn from_str(s: &str) -> Result<TensorSpec> {
        let trimmed = s.trim();
        let open =
            trimmed.find('[').ok_or_else(|| Error::InvalidTensorSpec { input: s.to_owned() })?;
        let (dtype, shape) = trimmed.split_at(open);
        Ok(TensorSpec { dtype: dtype.trim().parse()?, shape: shape.parse()? })
    }
}
