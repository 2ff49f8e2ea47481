//! The float types the fast interpreter computes in natively (f32 and f64).

use crate::tensor::Data;

/// f32 or f64, with the elementwise functions the ops need.
pub(crate) trait Float:
    Copy
    + Send
    + Sync
    + PartialOrd
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + std::ops::Neg<Output = Self>
    + std::ops::AddAssign
    + 'static
{
    const ZERO: Self;
    const ONE: Self;
    const NAN: Self;
    const NEG_INFINITY: Self;
    /// The dtype of this type.
    const DTYPE: meshwork_types::DType;
    fn from_f64(x: f64) -> Self;
    fn from_usize(x: usize) -> Self;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn tanh(self) -> Self;
    fn sqrt(self) -> Self;
    fn abs(self) -> Self;
    fn sin(self) -> Self;
    fn cos(self) -> Self;
    fn powf(self, y: Self) -> Self;
    fn is_nan(self) -> bool;
    /// The elements of `d`, which is of this type.
    fn slice(d: &Data) -> &[Self];
    /// The elements of `d`, which is of this type, to write.
    fn slice_mut(d: &mut Data) -> &mut [Self];

    /// `jnp.maximum`: NaN if either is.
    #[inline(always)]
    fn max_nan(self, y: Self) -> Self {
        if self.is_nan() || y.is_nan() {
            Self::NAN
        } else if y > self {
            y
        } else {
            self
        }
    }

    /// `jnp.minimum`: NaN if either is.
    #[inline(always)]
    fn min_nan(self, y: Self) -> Self {
        if self.is_nan() || y.is_nan() {
            Self::NAN
        } else if y < self {
            y
        } else {
            self
        }
    }
}

macro_rules! float {
    ($t:ty, $variant:ident) => {
        impl Float for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const NAN: Self = <$t>::NAN;
            const NEG_INFINITY: Self = <$t>::NEG_INFINITY;
            const DTYPE: meshwork_types::DType = meshwork_types::DType::$variant;
            #[inline(always)]
            fn from_f64(x: f64) -> Self {
                x as $t
            }
            #[inline(always)]
            fn from_usize(x: usize) -> Self {
                x as $t
            }
            #[inline(always)]
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            #[inline(always)]
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            #[inline(always)]
            fn tanh(self) -> Self {
                <$t>::tanh(self)
            }
            #[inline(always)]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline(always)]
            fn abs(self) -> Self {
                <$t>::abs(self)
            }
            #[inline(always)]
            fn sin(self) -> Self {
                <$t>::sin(self)
            }
            #[inline(always)]
            fn cos(self) -> Self {
                <$t>::cos(self)
            }
            #[inline(always)]
            fn powf(self, y: Self) -> Self {
                <$t>::powf(self, y)
            }
            #[inline(always)]
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
            fn slice(d: &Data) -> &[Self] {
                match d {
                    Data::$variant(v) => v,
                    other => unreachable!(
                        "a {} buffer where the plan expects {}",
                        other.dtype(),
                        stringify!($t)
                    ),
                }
            }
            fn slice_mut(d: &mut Data) -> &mut [Self] {
                match d {
                    Data::$variant(v) => v,
                    other => unreachable!(
                        "a {} buffer where the plan expects {}",
                        other.dtype(),
                        stringify!($t)
                    ),
                }
            }
        }
    };
}

float!(f32, F32);
float!(f64, F64);
