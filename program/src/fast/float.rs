//! The float types the fast interpreter computes in natively (f32 and f64).

use meshwork_types::Tensor;

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
    fn ln(self) -> Self;
    /// `exp` for loops over many elements: branch-free, so the loop vectorizes (f32:
    /// [`exp_f32`], within 1 ulp; f64: the library's, exact to the last bit the
    /// reference expects).
    fn exp_many(self) -> Self;
    /// `tanh` for loops over many elements (f32: [`tanh_f32`]; f64: the library's).
    fn tanh_many(self) -> Self;
    fn sqrt(self) -> Self;
    fn abs(self) -> Self;
    fn sin(self) -> Self;
    fn cos(self) -> Self;
    fn powf(self, y: Self) -> Self;
    fn is_nan(self) -> bool;
    /// The elements of `d`, which is of this type.
    fn slice(d: &Tensor) -> &[Self];
    /// The elements of `d`, which is of this type, to write.
    fn slice_mut(d: &mut Tensor) -> &mut [Self];

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
    ($t:ty, $variant:ident, $exp_many:expr, $tanh_many:expr) => {
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
            fn exp_many(self) -> Self {
                $exp_many(self)
            }
            #[inline(always)]
            fn tanh_many(self) -> Self {
                $tanh_many(self)
            }
            #[inline(always)]
            fn ln(self) -> Self {
                <$t>::ln(self)
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
            fn slice(d: &Tensor) -> &[Self] {
                crate::tensor::elems(d)
            }
            fn slice_mut(d: &mut Tensor) -> &mut [Self] {
                crate::tensor::elems_mut(d)
            }
        }
    };
}

float!(f32, F32, exp_f32, tanh_f32);
float!(f64, F64, f64::exp, f64::tanh);

/// `tanh` of an f32 as XLA's CPU backend and Eigen compute it: a 13/6-degree rational
/// function of the input clamped to [-9, 9] (beyond which tanh rounds to ±1), and the
/// input itself below 4e-4 in magnitude; at most 8 ulp (about 5e-7 relative) from the
/// correctly rounded result over every f32 (the `float_scan` example checks each one).
/// Branch-free (comparisons become blends), so loops over it vectorize; plain
/// multiplies and adds (no fused multiply-add), so every CPU gets the same bits. NaN
/// stays NaN.
// The coefficients as published (Eigen), rounded to f32 by the compiler.
#[allow(clippy::excessive_precision)]
#[inline(always)]
pub fn tanh_f32(x: f32) -> f32 {
    // `clamp` keeps NaN (`max`/`min` would turn it into a bound) and becomes blends.
    let c = x.clamp(-9.0, 9.0);
    let x2 = c * c;
    let mut p = x2 * -2.760_768_5e-16 + 2.000_187_9e-13;
    p = x2 * p + -8.604_671_5e-11;
    p = x2 * p + 5.122_297e-8;
    p = x2 * p + 1.485_722_4e-5;
    p = x2 * p + 6.372_619_3e-4;
    p = x2 * p + 4.893_524_6e-3;
    p *= c;
    let mut q = x2 * 1.198_258_4e-6 + 1.185_347_1e-4;
    q = x2 * q + 2.268_434_6e-3;
    q = x2 * q + 4.893_525e-3;
    // Rounding can take the ratio a hair past ±1; tanh never is.
    let t = p / q;
    let t = t.clamp(-1.0, 1.0);
    if x.abs() < 4e-4 { x } else { t }
}

/// `exp` of an f32, branch-free (Cephes' `expf`): `x = n ln 2 + r` with `|r| <= ln 2 /
/// 2` (ln 2 in two parts), a degree-6 polynomial for `e^r`, and `2^n` applied as two
/// exact powers of two so results below the normal range come out as the right
/// subnormals and above it as infinity. At most 1 ulp from the correctly rounded
/// result wherever that is a normal number (the `float_scan` example checks every f32);
/// NaN stays NaN.
#[allow(clippy::excessive_precision)]
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    // e^-104 is below half the smallest subnormal, e^89 above the largest finite.
    let c = x.clamp(-104.0, 89.0);
    // Rounded to the nearest integer by the 1.5·2^23 trick (SSE2 only, no libm call):
    // the sum's low mantissa bits hold that integer.
    let biased = c * std::f32::consts::LOG2_E + 12_582_912.0;
    let n = biased - 12_582_912.0;
    let r = n * -0.693_359_4 + c;
    let r = n * 2.121_944_4e-4 + r;
    let mut y = r * 1.987_569_2e-4 + 1.398_2e-3;
    y = r * y + 8.333_452e-3;
    y = r * y + 4.166_579_6e-2;
    y = r * y + 1.666_666_5e-1;
    y = r * y + 5.000_000_1e-1;
    y = (r * r) * y + r + 1.0;
    // n is in [-150, 129]; each half is within the normal exponents. Read from the
    // bits (integer lanes) rather than by `as i32`, which does not vectorize.
    let n = biased.to_bits() as i32 - 0x4B40_0000;
    let h = n >> 1;
    let pow2 = |k: i32| f32::from_bits(((k + 127) as u32) << 23);
    let out = y * pow2(h) * pow2(n - h);
    if x.is_nan() { x } else { out }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    /// The distance in units in the last place between two finite f32s of one sign.
    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    /// Within `ulp` of the correctly rounded value (`f64`'s, rounded), or within an
    /// absolute `abs` where the result is tiny.
    fn near(got: f32, want: f64, ulp: u32, abs: f64) -> bool {
        let w = want as f32;
        got == w
            || (got.signum() == w.signum() && ulps(got, w) <= ulp)
            || (f64::from(got) - want).abs() <= abs
    }

    /// `exp_f32` as first written, with its power of two from `n as i32` and `n / 2`
    /// (which do not vectorize): the oracle the bit-reading form must equal.
    #[allow(clippy::excessive_precision)]
    fn exp_f32_by_cast(x: f32) -> f32 {
        let c = x.clamp(-104.0, 89.0);
        let n = (c * std::f32::consts::LOG2_E + 12_582_912.0) - 12_582_912.0;
        let r = n * -0.693_359_4 + c;
        let r = n * 2.121_944_4e-4 + r;
        let mut y = r * 1.987_569_2e-4 + 1.398_2e-3;
        y = r * y + 8.333_452e-3;
        y = r * y + 4.166_579_6e-2;
        y = r * y + 1.666_666_5e-1;
        y = r * y + 5.000_000_1e-1;
        y = (r * r) * y + r + 1.0;
        let n = n as i32;
        let h = n / 2;
        let pow2 = |k: i32| f32::from_bits(((k + 127) as u32) << 23);
        let out = y * pow2(h) * pow2(n - h);
        if x.is_nan() { x } else { out }
    }

    /// `exp_f32` gives the cast form's bits for every 65,537th f32 and across the
    /// range where the power of two is odd and negative (so split unevenly) and where
    /// results turn subnormal. (Every f32 agreed when the form changed, 2026-11-29.)
    #[test]
    fn exp_reads_the_same_power_of_two_as_the_cast() {
        let strided = (0..=u32::MAX).step_by(65_537).map(f32::from_bits);
        let edges = (0..200_000).map(|k| -110.0 + k as f32 * 0.000_55);
        for x in strided.chain(edges) {
            let (a, b) = (super::exp_f32(x), exp_f32_by_cast(x));
            assert!(
                a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                "exp({x}): {a} vs {b}"
            );
        }
    }

    #[test]
    fn tanh_and_exp_keep_their_edges() {
        for x in [f32::NAN, -f32::NAN] {
            assert!(super::tanh_f32(x).is_nan() && super::exp_f32(x).is_nan());
        }
        assert_eq!(super::tanh_f32(f32::INFINITY), 1.0);
        assert_eq!(super::tanh_f32(f32::NEG_INFINITY), -1.0);
        assert_eq!(super::tanh_f32(0.0), 0.0);
        assert_eq!(super::tanh_f32(1e-30), 1e-30);
        assert_eq!(super::exp_f32(f32::INFINITY), f32::INFINITY);
        assert_eq!(super::exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(super::exp_f32(0.0), 1.0);
        assert_eq!(super::exp_f32(88.8), f32::INFINITY);
        assert_eq!(super::exp_f32(-120.0), 0.0);
        // The subnormal range comes out graded, not flushed.
        let s = super::exp_f32(-95.0);
        assert!(s > 0.0 && !s.is_normal());
        assert!(near(s, (-95f64).exp(), 1, 2e-45));
    }

    proptest! {
        /// Against the library's f64 functions, rounded: tanh within 8 ulp, exp within
        /// 1 ulp over its normal range and within one subnormal step below it (an
        /// exhaustive scan over all f32s, the `float_scan` example, found these maxima).
        #[test]
        fn prop_tanh_and_exp_are_within_a_few_ulp(x in -120f32..100f32, small in -1e-2f32..1e-2f32) {
            for v in [x, small, x / 10.0] {
                let t = super::tanh_f32(v);
                prop_assert!(t.abs() <= 1.0, "tanh({v}) = {t}");
                prop_assert!(near(t, f64::from(v).tanh(), 8, 0.0), "tanh({v}) = {t}, want {}", f64::from(v).tanh());
                let e = super::exp_f32(v);
                let want = f64::from(v).exp();
                prop_assert!(near(e, want, 1, 1.5e-45), "exp({v}) = {e}, want {want}");
            }
        }
    }
}
