//! The host tensor every meshwork crate passes around: one `ndarray` array of one of
//! the [`DType`]s.

use ndarray::{ArrayD, IxDyn};

use crate::{DType, Error, Result, Shape, TensorSpec};

pub use half::{bf16, f16};

/// A tensor on the host: an `ndarray` array of one element type, one variant per
/// [`DType`] (so a `match` over it is exhaustive, and a new dtype is a new variant the
/// compiler finds every use of).
///
/// The executor's collectives, the program layer's interpreters, the outfeed's
/// payloads, checkpoints and the bridges all take and return this type. Arrays may be
/// in any memory layout; [`Tensor::into_standard_layout`] makes them row-major and
/// contiguous, and [`Tensor::as_slice`] reads one that is.
///
/// ```
/// use meshwork_types::{DType, Tensor};
///
/// let t = Tensor::f32(&[2, 3], vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0])?;
/// assert_eq!(t.dtype(), DType::F32);
/// assert_eq!(t.shape(), &[2, 3]);
/// assert_eq!(t.spec().to_string(), "f32[2,3]");
/// assert_eq!(t.as_slice::<f32>().unwrap()[4], 4.0);
/// let bytes = t.to_le_bytes();
/// assert_eq!(Tensor::from_le_bytes(DType::F32, &[2, 3], &bytes)?, t);
/// // The number of elements must match the shape.
/// assert!(Tensor::f64(&[2, 2], vec![1.0]).is_err());
/// # Ok::<(), meshwork_types::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub enum Tensor {
    /// `bool`.
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
    /// `f16` (IEEE half precision).
    F16(ArrayD<f16>),
    /// `bf16`.
    BF16(ArrayD<bf16>),
    /// `f32`.
    F32(ArrayD<f32>),
    /// `f64`.
    F64(ArrayD<f64>),
}

/// Applies `$body` to the array inside any variant of a [`Tensor`], bound as `$a`.
///
/// The body is instantiated once per element type, so it may be generic over it.
#[macro_export]
macro_rules! each_tensor {
    ($t:expr, $a:ident => $body:expr) => {
        match $t {
            $crate::Tensor::Bool($a) => $body,
            $crate::Tensor::U8($a) => $body,
            $crate::Tensor::U16($a) => $body,
            $crate::Tensor::U32($a) => $body,
            $crate::Tensor::U64($a) => $body,
            $crate::Tensor::I8($a) => $body,
            $crate::Tensor::I16($a) => $body,
            $crate::Tensor::I32($a) => $body,
            $crate::Tensor::I64($a) => $body,
            $crate::Tensor::F16($a) => $body,
            $crate::Tensor::BF16($a) => $body,
            $crate::Tensor::F32($a) => $body,
            $crate::Tensor::F64($a) => $body,
        }
    };
}

/// Applies `$body` (an expression giving an array of the same element type) to the
/// array inside any variant of a [`Tensor`], bound as `$a`, and wraps the result in
/// the same variant.
#[macro_export]
macro_rules! map_tensor {
    ($t:expr, $a:ident => $body:expr) => {
        match $t {
            $crate::Tensor::Bool($a) => $crate::Tensor::Bool($body),
            $crate::Tensor::U8($a) => $crate::Tensor::U8($body),
            $crate::Tensor::U16($a) => $crate::Tensor::U16($body),
            $crate::Tensor::U32($a) => $crate::Tensor::U32($body),
            $crate::Tensor::U64($a) => $crate::Tensor::U64($body),
            $crate::Tensor::I8($a) => $crate::Tensor::I8($body),
            $crate::Tensor::I16($a) => $crate::Tensor::I16($body),
            $crate::Tensor::I32($a) => $crate::Tensor::I32($body),
            $crate::Tensor::I64($a) => $crate::Tensor::I64($body),
            $crate::Tensor::F16($a) => $crate::Tensor::F16($body),
            $crate::Tensor::BF16($a) => $crate::Tensor::BF16($body),
            $crate::Tensor::F32($a) => $crate::Tensor::F32($body),
            $crate::Tensor::F64($a) => $crate::Tensor::F64($body),
        }
    };
}

/// Runs `$body` with `$t` bound (as a type alias) to the element type of `$dtype`,
/// for every dtype: the way to build a tensor of a dtype known only at run time.
#[macro_export]
macro_rules! with_element {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            $crate::DType::Bool => {
                type $t = bool;
                $body
            }
            $crate::DType::U8 => {
                type $t = u8;
                $body
            }
            $crate::DType::U16 => {
                type $t = u16;
                $body
            }
            $crate::DType::U32 => {
                type $t = u32;
                $body
            }
            $crate::DType::U64 => {
                type $t = u64;
                $body
            }
            $crate::DType::I8 => {
                type $t = i8;
                $body
            }
            $crate::DType::I16 => {
                type $t = i16;
                $body
            }
            $crate::DType::I32 => {
                type $t = i32;
                $body
            }
            $crate::DType::I64 => {
                type $t = i64;
                $body
            }
            $crate::DType::F16 => {
                type $t = $crate::f16;
                $body
            }
            $crate::DType::BF16 => {
                type $t = $crate::bf16;
                $body
            }
            $crate::DType::F32 => {
                type $t = f32;
                $body
            }
            $crate::DType::F64 => {
                type $t = f64;
                $body
            }
        }
    };
}

/// The element types of [`Tensor`]'s variants: what converts between an
/// `ArrayD<T>` and a tensor, and between `T` and its little-endian bytes.
pub trait Element: Copy + PartialEq + Default + Send + Sync + std::fmt::Debug + 'static {
    /// The dtype of this element type.
    const DTYPE: DType;
    /// Wraps an array in its variant.
    fn wrap(a: ArrayD<Self>) -> Tensor;
    /// The array of a tensor of this element type.
    fn unwrap(t: &Tensor) -> Option<&ArrayD<Self>>;
    /// The array of a tensor of this element type, mutably.
    fn unwrap_mut(t: &mut Tensor) -> Option<&mut ArrayD<Self>>;
    /// The array of a tensor of this element type, taken; another tensor comes back.
    fn take(t: Tensor) -> std::result::Result<ArrayD<Self>, Tensor>;
    /// Appends the element's little-endian bytes.
    fn write_le(self, out: &mut Vec<u8>);
    /// The element of exactly `size_in_bytes` little-endian bytes.
    fn read_le(bytes: &[u8]) -> Self;
    /// The value as an f64 (bools as 0 and 1; 64-bit integers rounded).
    fn to_f64(self) -> f64;
}

macro_rules! element {
    ($($t:ty => $v:ident, $d:ident, $f:expr;)*) => {$(
        impl Element for $t {
            const DTYPE: DType = DType::$d;
            fn wrap(a: ArrayD<$t>) -> Tensor {
                Tensor::$v(a)
            }
            fn unwrap(t: &Tensor) -> Option<&ArrayD<$t>> {
                match t {
                    Tensor::$v(a) => Some(a),
                    _ => None,
                }
            }
            fn unwrap_mut(t: &mut Tensor) -> Option<&mut ArrayD<$t>> {
                match t {
                    Tensor::$v(a) => Some(a),
                    _ => None,
                }
            }
            fn take(t: Tensor) -> std::result::Result<ArrayD<$t>, Tensor> {
                match t {
                    Tensor::$v(a) => Ok(a),
                    other => Err(other),
                }
            }
            fn write_le(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn read_le(bytes: &[u8]) -> $t {
                <$t>::from_le_bytes(bytes.try_into().expect("exactly one element's bytes"))
            }
            fn to_f64(self) -> f64 {
                let f: fn($t) -> f64 = $f;
                f(self)
            }
        }
    )*};
}

element! {
    u8 => U8, U8, f64::from;
    u16 => U16, U16, f64::from;
    u32 => U32, U32, f64::from;
    u64 => U64, U64, |x| x as f64;
    i8 => I8, I8, f64::from;
    i16 => I16, I16, f64::from;
    i32 => I32, I32, f64::from;
    i64 => I64, I64, |x| x as f64;
    f16 => F16, F16, f64::from;
    bf16 => BF16, BF16, f64::from;
    f32 => F32, F32, f64::from;
    f64 => F64, F64, |x| x;
}

impl Element for bool {
    const DTYPE: DType = DType::Bool;
    fn wrap(a: ArrayD<bool>) -> Tensor {
        Tensor::Bool(a)
    }
    fn unwrap(t: &Tensor) -> Option<&ArrayD<bool>> {
        match t {
            Tensor::Bool(a) => Some(a),
            _ => None,
        }
    }
    fn unwrap_mut(t: &mut Tensor) -> Option<&mut ArrayD<bool>> {
        match t {
            Tensor::Bool(a) => Some(a),
            _ => None,
        }
    }
    fn take(t: Tensor) -> std::result::Result<ArrayD<bool>, Tensor> {
        match t {
            Tensor::Bool(a) => Ok(a),
            other => Err(other),
        }
    }
    fn write_le(self, out: &mut Vec<u8>) {
        out.push(u8::from(self));
    }
    /// Any non-zero byte is `true`.
    fn read_le(bytes: &[u8]) -> bool {
        bytes[0] != 0
    }
    fn to_f64(self) -> f64 {
        f64::from(u8::from(self))
    }
}

/// `x` rounded toward zero to f32, its last bit set when that dropped anything (rounded
/// to odd): rounding the result to nearest into a float of at most 22 significant bits
/// (bf16's 8, f16's 11) gives `x` rounded to nearest in one step (Boldo and Melquiond,
/// "When double rounding is odd", 2005). Infinities and NaN pass through, and a finite
/// `x` beyond f32's range becomes an infinity (beyond bf16's and f16's too).
pub(crate) fn rounded_to_odd(x: f64) -> f32 {
    let nearest = x as f32;
    if !nearest.is_finite() || f64::from(nearest) == x {
        return nearest;
    }
    // Rounded away from zero: one step back toward it (f32's magnitude is its bits).
    let mut bits = nearest.to_bits();
    if f64::from(nearest).abs() > x.abs() {
        bits -= 1;
    }
    f32::from_bits(bits | 1)
}

impl Tensor {
    /// A tensor of `dims` holding `values` in row-major order, or
    /// [`Error::TensorSize`] when their number is not the shape's element count.
    pub fn from_vec<T: Element>(dims: &[usize], values: Vec<T>) -> Result<Tensor> {
        let shape = Shape::new(dims)?;
        if values.len() != shape.num_elements() {
            return Err(Error::TensorSize { dims: dims.to_vec(), elements: values.len() });
        }
        let a = ArrayD::from_shape_vec(IxDyn(dims), values).expect("the length was checked");
        Ok(T::wrap(a))
    }

    /// An f32 tensor of `dims` (see [`from_vec`](Self::from_vec)).
    pub fn f32(dims: &[usize], values: Vec<f32>) -> Result<Tensor> {
        Tensor::from_vec(dims, values)
    }

    /// An f64 tensor of `dims`.
    pub fn f64(dims: &[usize], values: Vec<f64>) -> Result<Tensor> {
        Tensor::from_vec(dims, values)
    }

    /// An i32 tensor of `dims`.
    pub fn i32(dims: &[usize], values: Vec<i32>) -> Result<Tensor> {
        Tensor::from_vec(dims, values)
    }

    /// An i64 tensor of `dims`.
    pub fn i64(dims: &[usize], values: Vec<i64>) -> Result<Tensor> {
        Tensor::from_vec(dims, values)
    }

    /// A bool tensor of `dims`.
    pub fn bool(dims: &[usize], values: Vec<bool>) -> Result<Tensor> {
        Tensor::from_vec(dims, values)
    }

    /// A tensor of `dtype` and `dims` holding `values` converted from f64 (rounded to
    /// the nearest float, truncated toward zero and saturated for integers, non-zero
    /// for bools): what tests and data readers build tensors of a run-time dtype with.
    pub fn from_f64(dtype: DType, dims: &[usize], values: &[f64]) -> Result<Tensor> {
        fn int<T: TryFrom<i128> + Default + Copy>(x: f64, lo: T, hi: T) -> T {
            if x.is_nan() {
                return T::default();
            }
            // `as` from f64 truncates toward zero and saturates.
            T::try_from(x as i128).unwrap_or(if x < 0.0 { lo } else { hi })
        }
        macro_rules! ints {
            ($t:ty) => {
                values.iter().map(|&x| int::<$t>(x, <$t>::MIN, <$t>::MAX)).collect::<Vec<$t>>()
            };
        }
        match dtype {
            DType::Bool => Tensor::from_vec(dims, values.iter().map(|&x| x != 0.0).collect()),
            DType::U8 => Tensor::from_vec(dims, ints!(u8)),
            DType::U16 => Tensor::from_vec(dims, ints!(u16)),
            DType::U32 => Tensor::from_vec(dims, ints!(u32)),
            DType::U64 => Tensor::from_vec(dims, ints!(u64)),
            DType::I8 => Tensor::from_vec(dims, ints!(i8)),
            DType::I16 => Tensor::from_vec(dims, ints!(i16)),
            DType::I32 => Tensor::from_vec(dims, ints!(i32)),
            DType::I64 => Tensor::from_vec(dims, ints!(i64)),
            // Through f32 rounded to odd: `half`'s own conversions from f64 drop the
            // low 32 bits before rounding, so miss a value just past a tie.
            DType::F16 => Tensor::from_vec(
                dims,
                values.iter().map(|&x| f16::from_f32(rounded_to_odd(x))).collect(),
            ),
            DType::BF16 => Tensor::from_vec(
                dims,
                values.iter().map(|&x| bf16::from_f32(rounded_to_odd(x))).collect(),
            ),
            DType::F32 => Tensor::from_vec(dims, values.iter().map(|&x| x as f32).collect()),
            DType::F64 => Tensor::from_vec(dims, values.to_vec()),
        }
    }

    /// Zeros of `dtype` and `dims`: [`Error::ByteSizeOverflow`] for a size past the
    /// address space, and [`Error::OutOfMemory`] when the allocator has no room (where
    /// `ArrayD::zeros` would abort the process). Checked before anything is written.
    pub fn zeros(dtype: DType, dims: &[usize]) -> Result<Tensor> {
        let shape = Shape::new(dims)?;
        let bytes = shape.byte_size(dtype)?;
        if bytes > isize::MAX as usize {
            return Err(Error::ByteSizeOverflow { shape, dtype });
        }
        let n = shape.num_elements();
        with_element!(dtype, T => {
            let mut v: Vec<T> = Vec::new();
            v.try_reserve_exact(n).map_err(|_| Error::OutOfMemory { bytes })?;
            v.resize(n, T::default());
            Tensor::from_vec(dims, v)
        })
    }

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

    /// The dims, outermost first.
    pub fn shape(&self) -> &[usize] {
        each_tensor!(self, a => a.shape())
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        each_tensor!(self, a => a.len())
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Its dtype and shape.
    pub fn spec(&self) -> TensorSpec {
        // An existing array's element count fits in a usize, so its shape is valid.
        let shape = Shape::new(self.shape()).expect("an array's element count fits a usize");
        TensorSpec::new(self.dtype(), shape)
    }

    /// Its bytes in memory (element count times element size).
    pub fn byte_size(&self) -> usize {
        self.len() * self.dtype().size_in_bytes()
    }

    /// Whether its elements are row-major and contiguous.
    pub fn is_standard_layout(&self) -> bool {
        each_tensor!(self, a => a.is_standard_layout())
    }

    /// The same tensor with its elements row-major and contiguous (no copy when they
    /// are already).
    pub fn into_standard_layout(self) -> Tensor {
        map_tensor!(self, a => if a.is_standard_layout() {
            a
        } else {
            a.as_standard_layout().into_owned()
        })
    }

    /// The elements in row-major order, when the tensor is of `T` and in standard
    /// layout.
    pub fn as_slice<T: Element>(&self) -> Option<&[T]> {
        T::unwrap(self)?.as_slice()
    }

    /// The elements in row-major order, mutably, when the tensor is of `T` and in
    /// standard layout.
    pub fn as_slice_mut<T: Element>(&mut self) -> Option<&mut [T]> {
        T::unwrap_mut(self)?.as_slice_mut()
    }

    /// The array, when the tensor is of `T`.
    pub fn as_array<T: Element>(&self) -> Option<&ArrayD<T>> {
        T::unwrap(self)
    }

    /// The array, taken, when the tensor is of `T` (the tensor back otherwise).
    pub fn into_array<T: Element>(self) -> std::result::Result<ArrayD<T>, Tensor> {
        T::take(self)
    }

    /// The elements in row-major order as f64 (see [`Element::to_f64`]): for
    /// comparisons, tests and reports.
    pub fn to_f64(&self) -> Vec<f64> {
        each_tensor!(self, a => a.iter().map(|&x| Element::to_f64(x)).collect())
    }

    /// The same elements under `dims` (the same element count), in row-major order.
    pub fn reshape(self, dims: &[usize]) -> Result<Tensor> {
        let len = self.len();
        if Shape::new(dims)?.num_elements() != len {
            return Err(Error::TensorSize { dims: dims.to_vec(), elements: len });
        }
        Ok(map_tensor!(self.into_standard_layout(), a => {
            a.into_shape_with_order(IxDyn(dims)).expect("a standard layout of the same count")
        }))
    }

    /// The elements in row-major order, little-endian (a bool as one byte, 0 or 1).
    pub fn to_le_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.byte_size());
        self.write_le_bytes(&mut out);
        out
    }

    /// Appends the elements in row-major order, little-endian, to `out`.
    pub fn write_le_bytes(&self, out: &mut Vec<u8>) {
        each_tensor!(self, a => match a.as_slice() {
            Some(s) => s.iter().for_each(|&x| x.write_le(out)),
            None => a.iter().for_each(|&x| x.write_le(out)),
        })
    }

    /// The tensor of `dtype` and `dims` whose row-major elements are the little-endian
    /// `bytes`, or [`Error::TensorBytes`] when there are not exactly as many bytes as
    /// the shape needs (checked before anything is allocated).
    pub fn from_le_bytes(dtype: DType, dims: &[usize], bytes: &[u8]) -> Result<Tensor> {
        let shape = Shape::new(dims)?;
        let want = shape.byte_size(dtype)?;
        if bytes.len() != want {
            return Err(Error::TensorBytes {
                spec: TensorSpec::new(dtype, shape),
                bytes: bytes.len(),
            });
        }
        let size = dtype.size_in_bytes();
        with_element!(dtype, T => {
            let v: Vec<T> = bytes.chunks_exact(size).map(T::read_le).collect();
            Tensor::from_vec(dims, v)
        })
    }
}
