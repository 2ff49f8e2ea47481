//! Roundtrip and overflow properties of the vocabulary types.

use proptest::prelude::*;

use crate::testing;
use crate::{DType, DeviceId, Error, ReduceOp, Shape, ShapeSyntax, TensorSpec};

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
