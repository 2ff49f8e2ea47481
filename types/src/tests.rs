//! Roundtrip and overflow properties of the vocabulary types.

use proptest::prelude::*;

use crate::testing;
use crate::{DType, DeviceId, Error, ReduceOp, Shape, ShapeSyntax, Tensor, TensorSpec};

fn check_roundtrip<T>(value: &T)
where
    T: std::fmt::Display + std::str::FromStr<Err = Error> + PartialEq + std::fmt::Debug,
{
    let text = value.to_string();
    let back: T = text.parse().unwrap_or_else(|e| panic!("`{text}` does not parse back: {e}"));
    assert_eq!(&back, value, "`{text}`");
}

proptest! {
    #[test]
    fn prop_device_id_roundtrip(id in testing::device_id()) {
        check_roundtrip(&id);
    }

    #[test]
    fn prop_dtype_roundtrip(dtype in testing::dtype()) {
        check_roundtrip(&dtype);
    }

    #[test]
    fn prop_reduce_op_roundtrip(op in testing::reduce_op()) {
        check_roundtrip(&op);
        // Case is ignored on parse.
        prop_assert_eq!(op.name().to_ascii_uppercase().parse::<ReduceOp>()?, op);
    }

    #[test]
    fn prop_shape_roundtrip(shape in testing::shape(6, 1 << 10)) {
        check_roundtrip(&shape);
        prop_assert_eq!(Shape::new(shape.dims())?, shape.clone());
    }

    #[test]
    fn prop_tensor_spec_roundtrip(spec in testing::tensor_spec(6, 1 << 10)) {
        check_roundtrip(&spec);
    }

    /// The element count equals the product computed in 128-bit arithmetic, and is an
    /// error exactly when that product does not fit in a usize.
    #[test]
    fn prop_element_count_is_checked(
        dims in proptest::collection::vec(
            prop_oneof![0..4usize, any::<usize>(), Just(usize::MAX)], 0..5)
    ) {
        let exact = dims.iter().try_fold(1u128, |acc, &d| acc.checked_mul(d as u128));
        let fits = dims.contains(&0) || exact.is_some_and(|n| n <= usize::MAX as u128);
        match Shape::new(&dims) {
            Ok(shape) => {
                prop_assert!(fits);
                prop_assert_eq!(shape.num_elements() as u128, exact.unwrap_or(0));
            }
            Err(Error::ElementCountOverflow { dims: reported }) => {
                prop_assert!(!fits);
                prop_assert_eq!(reported, dims);
            }
            Err(other) => prop_assert!(false, "unexpected error {other}"),
        }
    }

    /// The byte size equals elements × element size, and is an error exactly when that
    /// does not fit in a usize.
    #[test]
    fn prop_byte_size_is_checked(
        dims in proptest::collection::vec(prop_oneof![1..4usize, any::<usize>()], 0..3),
        dtype in testing::dtype(),
    ) {
        prop_assume!(Shape::new(&dims).is_ok());
        let shape = Shape::new(&dims)?;
        let exact = shape.num_elements() as u128 * dtype.size_in_bytes() as u128;
        match shape.byte_size(dtype) {
            Ok(bytes) => prop_assert_eq!(bytes as u128, exact),
            Err(Error::ByteSizeOverflow { shape: s, dtype: d }) => {
                prop_assert!(exact > usize::MAX as u128);
                prop_assert_eq!((s, d), (shape, dtype));
            }
            Err(other) => prop_assert!(false, "unexpected error {other}"),
        }
    }
}

#[test]
fn dtype_sizes_and_aliases() {
    let expected = [
        ("bool", 1),
        ("u8", 1),
        ("u16", 2),
        ("u32", 4),
        ("u64", 8),
        ("i8", 1),
        ("i16", 2),
        ("i32", 4),
        ("i64", 8),
        ("f16", 2),
        ("bf16", 2),
        ("f32", 4),
        ("f64", 8),
    ];
    for (dtype, (name, size)) in DType::ALL.into_iter().zip(expected) {
        assert_eq!(dtype.name(), name);
        assert_eq!(dtype.size_in_bytes(), size, "{name}");
    }
    for (alias, dtype) in [
        ("float32", DType::F32),
        ("bfloat16", DType::BF16),
        ("pred", DType::Bool),
        ("bool_", DType::Bool),
        ("s32", DType::I32),
        ("int64", DType::I64),
        ("uint8", DType::U8),
    ] {
        assert_eq!(alias.parse::<DType>(), Ok(dtype), "{alias}");
    }
    assert!(DType::F32.is_float() && !DType::F32.is_integer());
    assert!(DType::U8.is_integer() && !DType::Bool.is_integer() && !DType::Bool.is_float());
}

#[test]
fn parse_errors_say_what_and_where() {
    assert_eq!("f31".parse::<DType>(), Err(Error::UnknownDType { name: "f31".into() }));
    assert_eq!(
        "2,3".parse::<Shape>(),
        Err(Error::InvalidShape { input: "2,3".into(), reason: ShapeSyntax::MissingBrackets })
    );
    assert_eq!(
        "[2,x,3]".parse::<Shape>(),
        Err(Error::InvalidShape {
            input: "[2,x,3]".into(),
            reason: ShapeSyntax::BadDim { index: 1 }
        })
    );
    assert_eq!(
        "[2,-1]".parse::<Shape>(),
        Err(Error::InvalidShape {
            input: "[2,-1]".into(),
            reason: ShapeSyntax::BadDim { index: 1 }
        })
    );
    assert_eq!(
        "[+2]".parse::<Shape>(),
        Err(Error::InvalidShape { input: "[+2]".into(), reason: ShapeSyntax::BadDim { index: 0 } })
    );
    assert_eq!(
        "[2,]".parse::<Shape>(),
        Err(Error::InvalidShape { input: "[2,]".into(), reason: ShapeSyntax::BadDim { index: 1 } })
    );
    assert_eq!("f32".parse::<TensorSpec>(), Err(Error::InvalidTensorSpec { input: "f32".into() }));
    assert_eq!("q8[2]".parse::<TensorSpec>(), Err(Error::UnknownDType { name: "q8".into() }));
    assert_eq!("-1".parse::<DeviceId>(), Err(Error::InvalidDeviceId { input: "-1".into() }));
    assert_eq!(
        "4294967296".parse::<DeviceId>(),
        Err(Error::InvalidDeviceId { input: "4294967296".into() })
    );
    assert_eq!("avg".parse::<ReduceOp>(), Err(Error::UnknownReduceOp { name: "avg".into() }));
    let huge = format!("[{},{}]", usize::MAX, 2);
    assert_eq!(
        huge.parse::<Shape>(),
        Err(Error::ElementCountOverflow { dims: vec![usize::MAX, 2] })
    );
}

#[test]
fn scalars_and_empty_tensors() {
    let scalar: Shape = "[]".parse().unwrap();
    assert_eq!(scalar, Shape::scalar());
    assert_eq!(scalar, Shape::default());
    assert_eq!((scalar.rank(), scalar.num_elements()), (0, 1));
    assert_eq!("[ 2, 3 ]".parse::<Shape>().unwrap().dims(), &[2, 3]);
    // A zero dim means no elements, whatever the other dims are.
    let empty = Shape::new(&[0, usize::MAX, 2]).unwrap();
    assert_eq!(empty.num_elements(), 0);
    assert_eq!(empty.byte_size(DType::F64), Ok(0));
    assert_eq!("bool[]".parse::<TensorSpec>().unwrap().byte_size(), Ok(1));
}

#[cfg(feature = "serde")]
mod serde_roundtrip {
    use super::*;

    fn json_roundtrip<T>(value: &T) -> String
    where
        T: serde::Serialize + serde::de::DeserializeOwned + PartialEq + std::fmt::Debug,
    {
        let json = serde_json::to_string(value).unwrap();
        let back: T = serde_json::from_str(&json).unwrap();
        assert_eq!(&back, value, "{json}");
        json
    }

    proptest! {
        #[test]
        fn prop_serde_roundtrip(
            id in testing::device_id(),
            op in testing::reduce_op(),
            spec in testing::tensor_spec(6, 1 << 10),
        ) {
            prop_assert_eq!(json_roundtrip(&id), id.0.to_string());
            prop_assert_eq!(json_roundtrip(&op), format!("\"{op}\""));
            prop_assert_eq!(json_roundtrip(&spec), format!("\"{spec}\""));
            json_roundtrip(&spec.dtype);
            json_roundtrip(&spec.shape);
        }
    }

    #[test]
    fn serde_rejects_invalid_values() {
        let overflow = format!("[{},2]", usize::MAX);
        let err = serde_json::from_str::<Shape>(&overflow).unwrap_err();
        assert!(err.to_string().contains("more elements than fit"), "{err}");
        let err = serde_json::from_str::<DType>("\"f31\"").unwrap_err();
        assert!(err.to_string().contains("unknown dtype `f31`"), "{err}");
    }
}

proptest! {
    /// A tensor's bytes make the same tensor back (bit for bit, NaNs included), in any
    /// memory layout: a transposed array's bytes are its row-major elements, which a
    /// copy into standard layout also gives.
    #[test]
    fn prop_tensor_bytes_roundtrip(t in testing::tensor(4, 5)) {
        let bytes = t.to_le_bytes();
        prop_assert_eq!(bytes.len(), t.byte_size());
        let back = Tensor::from_le_bytes(t.dtype(), t.shape(), &bytes)?;
        prop_assert_eq!(back.to_le_bytes(), bytes.clone());
        prop_assert_eq!(back.spec(), t.spec());
        let transposed = crate::map_tensor!(t.clone(), a => a.reversed_axes());
        let copied = transposed.clone().into_standard_layout();
        prop_assert!(copied.is_standard_layout());
        prop_assert_eq!(transposed.to_le_bytes(), copied.to_le_bytes());
        // Reshaping keeps the row-major elements.
        let flat = transposed.clone().reshape(&[transposed.len()])?;
        prop_assert_eq!(flat.to_le_bytes(), copied.to_le_bytes());
        // One byte short or over is refused, naming the spec.
        if !bytes.is_empty() {
            let short = Tensor::from_le_bytes(t.dtype(), t.shape(), &bytes[1..]);
            let is_bytes_error = matches!(short, Err(Error::TensorBytes { .. }));
            prop_assert!(is_bytes_error);
        }
    }

    /// `to_f64` reads the elements in row-major order, whatever the layout, and
    /// `from_f64` of f64 values gives them back exactly.
    #[test]
    fn prop_tensor_f64_values(dims in proptest::collection::vec(0usize..4, 0..4), seed in any::<u64>()) {
        let n: usize = dims.iter().product();
        let values: Vec<f64> = (0..n).map(|k| (seed.wrapping_mul(k as u64 + 1) % 1000) as f64 - 500.0).collect();
        let t = Tensor::from_f64(DType::F64, &dims, &values)?;
        prop_assert_eq!(t.to_f64(), values.clone());
        let i = Tensor::from_f64(DType::I32, &dims, &values)?;
        prop_assert_eq!(i.to_f64(), values);
    }
}

/// Element counts, sizes and conversions that cannot be a tensor are typed errors.
#[test]
fn tensors_refuse_wrong_counts_and_sizes() {
    assert_eq!(
        Tensor::f64(&[2, 2], vec![1.0]).unwrap_err(),
        Error::TensorSize { dims: vec![2, 2], elements: 1 }
    );
    assert!(matches!(
        Tensor::zeros(DType::F32, &[usize::MAX / 2, 4]),
        Err(Error::ElementCountOverflow { .. })
    ));
    assert!(matches!(
        Tensor::zeros(DType::F64, &[1 << 61]),
        Err(Error::ByteSizeOverflow { .. } | Error::OutOfMemory { .. })
    ));
    let z = Tensor::zeros(DType::BF16, &[2, 3]).unwrap();
    assert_eq!((z.dtype(), z.shape(), z.to_f64()), (DType::BF16, &[2usize, 3][..], vec![0.0; 6]));
    assert!(matches!(z.clone().reshape(&[4]), Err(Error::TensorSize { .. })));
    // Floats to integers truncate toward zero and saturate; NaN is 0 (XLA's convert).
    let t = Tensor::from_f64(DType::I32, &[5], &[3e9, -3e9, f64::NAN, 2.7, -2.7]).unwrap();
    assert_eq!(t.as_slice::<i32>().unwrap(), &[i32::MAX, i32::MIN, 0, 2, -2]);
    let u = Tensor::from_f64(DType::U8, &[3], &[-1.0, 300.0, f64::INFINITY]).unwrap();
    assert_eq!(u.as_slice::<u8>().unwrap(), &[0, 255, 255]);
    // The typed accessors see only their own dtype.
    assert!(t.as_slice::<i64>().is_none() && t.as_array::<f32>().is_none());
    assert!(t.into_array::<f32>().is_err());
}

/// `x` rounded to nearest (ties to even) into a float that keeps `mantissa` stored bits
/// and in whose normal range `x` lies, read off its f64 bits: the dropped bits compared
/// with half of the last kept one. The oracle of the half floats' conversion.
fn nearest_by_bits(x: f64, mantissa: u32) -> f64 {
    let drop = 52 - mantissa;
    let bits = x.to_bits();
    let dropped = bits & ((1u64 << drop) - 1);
    let half = 1u64 << (drop - 1);
    let mut kept = bits >> drop;
    if dropped > half || (dropped == half && kept & 1 == 1) {
        kept += 1;
    }
    f64::from_bits(kept << drop)
}

proptest! {
    /// f64 values become bf16 and f16 rounded to nearest, ties to even, in one step:
    /// exact ties, and values one bit of f64 past or short of a tie (which a
    /// conversion that drops the low bits first, or rounds through f32 to nearest,
    /// gets wrong), over each type's normal range.
    #[test]
    fn prop_half_floats_from_f64_round_to_nearest(
        half_type in prop_oneof![Just((DType::BF16, 7u32, -126i64, 126i64)), Just((DType::F16, 10, -14, 14))],
        kept in any::<u64>(),
        tail_kind in 0usize..6,
        random in any::<u64>(),
        exponent in 0.0f64..=1.0,
        negative in any::<bool>(),
    ) {
        let (dtype, mantissa, lo, hi) = half_type;
        let drop = 52 - mantissa;
        let half = 1u64 << (drop - 1);
        let tail = match tail_kind {
            0 => 0,
            1 => half,
            2 => half + 1,
            3 => half - 1,
            4 => half + (1 << 32),
            _ => random & ((1u64 << drop) - 1),
        };
        let e = lo + ((hi - lo) as f64 * exponent).round() as i64;
        let bits = (u64::from(negative) << 63)
            | (((e + 1023) as u64) << 52)
            | ((kept & ((1u64 << mantissa) - 1)) << drop)
            | tail;
        let x = f64::from_bits(bits);
        let got = Tensor::from_f64(dtype, &[1], &[x]).unwrap().to_f64()[0];
        prop_assert_eq!(got, nearest_by_bits(x, mantissa), "{} of {:e}", dtype, x);
    }
}
