//! Unit and property tests of the builder and inference.

use meshwork_types::{DType, TensorSpec};
use proptest::prelude::*;

use crate::{Builder, Error, Op, Padding, Program, Reduction, Tensor, Value};

fn spec(text: &str) -> TensorSpec {
    text.parse().unwrap()
}

/// Builds `op` over parameters of `args` specs; the result's spec or the error.
fn infer(op: Op, args: &[&str]) -> Result<String, Error> {
    let mut b = Builder::new();
    let vals: Vec<Value> =
        args.iter().enumerate().map(|(k, s)| b.param(&format!("p{k}"), spec(s)).unwrap()).collect();
    let v = b.push(op, &vals)?;
    Ok(b.spec(v).unwrap().to_string())
}

#[test]
fn elementwise_ops_broadcast_as_numpy_does() {
    let add = || Op::Binary(crate::Binary::Add);
    assert_eq!(infer(add(), &["f64[2,3]", "f64[3]"]).unwrap(), "f64[2,3]");
    assert_eq!(infer(add(), &["f64[4,1,3]", "f64[2,1]"]).unwrap(), "f64[4,2,3]");
    assert_eq!(infer(add(), &["f64[]", "f64[5]"]).unwrap(), "f64[5]");
    assert_eq!(infer(Op::Compare(crate::Compare::Lt), &["i64[2]", "i64[]"]).unwrap(), "bool[2]");
    assert_eq!(infer(Op::Select, &["bool[2,1]", "f32[3]", "f32[]"]).unwrap(), "f32[2,3]");
    let e = infer(add(), &["f64[2,3]", "f64[2]"]).unwrap_err().to_string();
    assert!(e.contains("add(f64[2,3], f64[2])") && e.contains("do not broadcast"), "{e}");
    let e = infer(add(), &["f64[2]", "f32[2]"]).unwrap_err().to_string();
    assert!(e.contains("dtypes f64 and f32"), "{e}");
    let e = infer(Op::Unary(crate::Unary::Exp), &["i64[2]"]).unwrap_err().to_string();
    assert!(e.contains("needs a float"), "{e}");
}

#[test]
fn dot_general_puts_batch_then_lhs_free_then_rhs_free_dims() {
    let dot = |lc: &[usize], rc: &[usize], lb: &[usize], rb: &[usize]| Op::DotGeneral {
        lhs_contract: lc.to_vec(),
        rhs_contract: rc.to_vec(),
        lhs_batch: lb.to_vec(),
        rhs_batch: rb.to_vec(),
    };
    assert_eq!(infer(dot(&[1], &[0], &[], &[]), &["f32[8,4]", "f32[4,16]"]).unwrap(), "f32[8,16]");
    // Batched attention scores: [b,h,q,d] x [b,h,k,d] -> [b,h,q,k].
    assert_eq!(
        infer(dot(&[3], &[3], &[0, 1], &[0, 1]), &["f64[2,4,5,8]", "f64[2,4,6,8]"]).unwrap(),
        "f64[2,4,5,6]"
    );
    // Batch dims in the listed order, before free dims.
    assert_eq!(
        infer(dot(&[0], &[2], &[2], &[0]), &["f64[3,5,7]", "f64[7,2,3]"]).unwrap(),
        "f64[7,5,2]"
    );
    let e = infer(dot(&[1], &[1], &[], &[]), &["f64[8,4]", "f64[4,16]"]).unwrap_err();
    assert!(e.to_string().contains("lhs dim 1 (size 4) pairs with rhs dim 1 (size 16)"), "{e}");
    assert!(infer(dot(&[1, 1], &[0, 1], &[], &[]), &["f64[4,4]", "f64[4,4]"]).is_err());
    assert!(infer(dot(&[2], &[0], &[], &[]), &["f64[4,4]", "f64[4,4]"]).is_err());
}

#[test]
fn shape_ops_follow_jax() {
    let reduce =
        |kind, axes: &[usize], keepdims| Op::Reduce { kind, axes: axes.to_vec(), keepdims };
    assert_eq!(infer(reduce(Reduction::Sum, &[0, 2], false), &["f64[2,3,4]"]).unwrap(), "f64[3]");
    assert_eq!(infer(reduce(Reduction::Max, &[1], true), &["i32[2,3]"]).unwrap(), "i32[2,1]");
    assert!(infer(reduce(Reduction::Mean, &[0], false), &["i64[2]"]).is_err());
    assert_eq!(infer(Op::Reshape { shape: vec![6, 2] }, &["f32[3,4]"]).unwrap(), "f32[6,2]");
    assert!(infer(Op::Reshape { shape: vec![5] }, &["f32[3,4]"]).is_err());
    assert_eq!(
        infer(Op::Transpose { perm: vec![2, 0, 1] }, &["f32[2,3,4]"]).unwrap(),
        "f32[4,2,3]"
    );
    assert!(infer(Op::Transpose { perm: vec![0, 0] }, &["f32[2,3]"]).is_err());
    let e = infer(Op::BroadcastTo { shape: vec![5, 2, 3] }, &["f32[3,1]"]).unwrap_err();
    assert!(e.to_string().contains("does not broadcast"), "{e}");
    assert_eq!(
        infer(Op::BroadcastTo { shape: vec![5, 2, 3] }, &["f32[1,3]"]).unwrap(),
        "f32[5,2,3]"
    );
    let slice = Op::Slice { start: vec![1, 0], stop: vec![7, 3], step: vec![2, 1] };
    assert_eq!(infer(slice, &["f64[8,3]"]).unwrap(), "f64[3,3]");
    assert!(
        infer(Op::Slice { start: vec![2], stop: vec![1], step: vec![1] }, &["f64[4]"]).is_err()
    );
    assert!(
        infer(Op::Slice { start: vec![0], stop: vec![4], step: vec![0] }, &["f64[4]"]).is_err()
    );
    assert_eq!(infer(Op::Concat { axis: 1 }, &["f64[2,3]", "f64[2,5]"]).unwrap(), "f64[2,8]");
    assert!(infer(Op::Concat { axis: 1 }, &["f64[2,3]", "f64[3,5]"]).is_err());
    assert_eq!(infer(Op::Take { axis: 1 }, &["f64[4,10,3]", "i64[2,5]"]).unwrap(), "f64[4,2,5,3]");
    assert!(infer(Op::Take { axis: 0 }, &["f64[4]", "f64[2]"]).is_err());
    assert_eq!(infer(Op::OneHot { depth: 7, dtype: DType::F64 }, &["i64[3]"]).unwrap(), "f64[3,7]");
    assert_eq!(infer(Op::Argmax { axis: 1 }, &["f32[2,5]"]).unwrap(), "i64[2]");
    assert_eq!(infer(Op::Softmax { axis: 0 }, &["f32[2,5]"]).unwrap(), "f32[2,5]");
}

#[test]
fn conv2d_sizes_match_same_and_valid_padding() {
    let conv = |s, padding| Op::Conv2d { strides: [s, s], padding };
    assert_eq!(
        infer(conv(1, Padding::Same), &["f64[2,5,5,3]", "f64[3,3,3,8]"]).unwrap(),
        "f64[2,5,5,8]"
    );
    assert_eq!(
        infer(conv(2, Padding::Same), &["f64[2,5,5,3]", "f64[3,3,3,8]"]).unwrap(),
        "f64[2,3,3,8]"
    );
    assert_eq!(
        infer(conv(2, Padding::Valid), &["f64[2,5,5,3]", "f64[3,3,3,8]"]).unwrap(),
        "f64[2,2,2,8]"
    );
    assert!(infer(conv(1, Padding::Valid), &["f64[1,2,2,3]", "f64[3,3,3,8]"]).is_err());
    assert!(infer(conv(1, Padding::Same), &["f64[1,5,5,4]", "f64[3,3,3,8]"]).is_err());
}

#[test]
fn collectives_change_the_dims_they_gather_or_scatter() {
    let g = vec![vec![0, 1], vec![2, 3]];
    let t = |op| infer(op, &["f32[4,6]"]);
    assert_eq!(t(Op::AllGather { axis: 1, groups: g.clone() }).unwrap(), "f32[4,12]");
    assert_eq!(
        t(Op::ReduceScatter { op: meshwork_types::ReduceOp::Sum, axis: 0, groups: g.clone() })
            .unwrap(),
        "f32[2,6]"
    );
    assert_eq!(
        t(Op::AllToAll { split_axis: 0, concat_axis: 1, groups: g.clone() }).unwrap(),
        "f32[2,12]"
    );
    assert!(t(Op::AllGather { axis: 0, groups: vec![vec![0], vec![1, 2]] }).is_err());
    assert!(
        t(Op::AllReduce { op: meshwork_types::ReduceOp::Sum, groups: vec![vec![0, 0]] }).is_err()
    );
    assert!(t(Op::CollectivePermute { pairs: vec![(0, 1), (2, 1)] }).is_err());
    assert_eq!(t(Op::Send { channel: 3, peer: 1 }).unwrap(), "bool[]");
    let recv = Op::Recv { channel: 3, peer: 0, dtype: DType::F32, shape: vec![2, 2] };
    assert_eq!(infer(recv, &[]).unwrap(), "f32[2,2]");
}

#[test]
fn builder_names_scopes_and_refuses_what_it_cannot_check() {
    let mut b = Builder::new();
    let x = b.param("x", spec("f64[2,3]")).unwrap();
    let err = b.param("x", spec("f64[1]")).unwrap_err();
    assert_eq!(err, Error::DuplicateName { name: "x".into() });
    let y = b
        .scope("layers", |b| {
            b.scope("0", |b| {
                let w = b.param("w", spec("f64[3,4]"))?;
                let h = b.matmul(x, w)?;
                b.name(h, "h")
            })
        })
        .unwrap();
    assert_eq!(b.spec(y).unwrap().to_string(), "f64[2,4]");
    assert!(matches!(b.param("u", spec("u8[2]")), Err(Error::UnsupportedDType { .. })));
    for bad in ["", "h ", " h", "h\n"] {
        assert!(matches!(b.param(bad, spec("f64[1]")), Err(Error::BadName { .. })), "{bad:?}");
    }
    // A shape with no elements whose strides would overflow is refused, as a parameter
    // and as a result.
    let huge =
        TensorSpec::new(DType::F64, meshwork_types::Shape::new(&[0, 1 << 40, 1 << 40]).unwrap());
    let mut b2 = Builder::new();
    assert!(matches!(b2.param("huge", huge), Err(Error::Type { op: "param", .. })));
    let z = b2.param("z", spec("f64[0]")).unwrap();
    assert!(b2.broadcast_to(z, &[1 << 40, 1 << 40, 0]).is_err());
    // Integer constants fit their dtype; integer division never panics.
    assert!(b.constant(3e9, DType::I32).is_err());
    assert!(b.constant(-2147483648.0, DType::I32).is_ok());
    assert!(b.constant(9.3e18, DType::I64).is_err());
    assert!(matches!(b.relu(Value(99)), Err(Error::UndefinedValue { value: 99, .. })));
    assert!(b.reduce_sum(y, &[-3], false).is_err());
    let s = b.reduce_sum(y, &[-1], true).unwrap();
    let p = b.finish(&[s, y]).unwrap();
    assert_eq!(p.params().iter().map(|p| p.name.as_str()).collect::<Vec<_>>(), ["x", "layers.0.w"]);
    assert_eq!(p.value_named("layers.0.h"), Some(y));
    assert_eq!(p.spec(p.results()[0]).unwrap().to_string(), "f64[2,1]");
    assert!(matches!(Builder::new().finish(&[]), Err(Error::NoResults)));
}

/// Parameters made between instructions come first in the program, and the printed
/// text numbers values in that order.
#[test]
fn finish_puts_parameters_first_and_prints_one_line_per_instruction() {
    let mut b = Builder::new();
    let x = b.param("x", spec("f32[2,2]")).unwrap();
    let e = b.exp(x).unwrap();
    let w = b.param("w", spec("f32[2,2]")).unwrap();
    let m = b.mul(e, w).unwrap();
    let c = b.constant(0.5, DType::F32).unwrap();
    let out = b.add(m, c).unwrap();
    let p: Program = b.finish(&[out]).unwrap();
    assert_eq!(
        p.to_string(),
        "param %0 \"x\": f32[2,2]\n\
         param %1 \"w\": f32[2,2]\n\
         %2 = f32[2,2] exp(%0)\n\
         %3 = f32[2,2] mul(%2, %1)\n\
         %4 = f32[] constant(), value=0.5\n\
         %5 = f32[2,2] add(%3, %4)\n\
         return %5\n"
    );
}

/// Any op over any operands, with any attributes: the builder returns a spec or a
/// typed error, never panics, and an accepted result's element count fits in `usize`.
fn any_op() -> impl Strategy<Value = Op> {
    let dims = || proptest::collection::vec(0usize..6, 0..4);
    let axis = || 0usize..5;
    let groups = || proptest::collection::vec(proptest::collection::vec(0usize..6, 0..4), 0..3);
    prop_oneof![
        Just(Op::Binary(crate::Binary::Add)),
        Just(Op::Compare(crate::Compare::Ge)),
        Just(Op::Select),
        Just(Op::ThreefryUniform),
        Just(Op::Unary(crate::Unary::Gelu)),
        (dims(), dims(), dims(), dims()).prop_map(|(a, b, c, d)| Op::DotGeneral {
            lhs_contract: a,
            rhs_contract: b,
            lhs_batch: c,
            rhs_batch: d
        }),
        (dims(), any::<bool>()).prop_map(|(axes, keepdims)| Op::Reduce {
            kind: Reduction::Max,
            axes,
            keepdims
        }),
        proptest::collection::vec(0usize..usize::MAX, 0..4).prop_map(|shape| Op::Reshape { shape }),
        dims().prop_map(|perm| Op::Transpose { perm }),
        proptest::collection::vec(0usize..usize::MAX, 0..4)
            .prop_map(|shape| Op::BroadcastTo { shape }),
        (dims(), dims(), dims()).prop_map(|(start, stop, step)| Op::Slice { start, stop, step }),
        axis().prop_map(|axis| Op::Concat { axis }),
        axis().prop_map(|axis| Op::Take { axis }),
        (0usize..usize::MAX, any_dtype()).prop_map(|(depth, dtype)| Op::OneHot { depth, dtype }),
        axis().prop_map(|axis| Op::Argmax { axis }),
        (0usize..4, 0usize..4, any::<bool>()).prop_map(|(s, t, same)| Op::Conv2d {
            strides: [s, t],
            padding: if same { Padding::Same } else { Padding::Valid }
        }),
        (axis(), groups()).prop_map(|(axis, groups)| Op::AllGather { axis, groups }),
        (axis(), axis(), groups()).prop_map(|(s, c, groups)| Op::AllToAll {
            split_axis: s,
            concat_axis: c,
            groups
        }),
        (proptest::collection::vec(0usize..usize::MAX, 0..4), axis(), any_dtype())
            .prop_map(|(shape, axis, dtype)| { Op::Iota { dtype, shape, axis } }),
        (any::<f64>(), any_dtype()).prop_map(|(value, dtype)| Op::Constant { value, dtype }),
        (prop::sample::select(DType::ALL.to_vec()), proptest::collection::vec(0usize..4, 0..3))
            .prop_flat_map(|(dtype, shape)| {
                let n: usize = shape.iter().product();
                proptest::collection::vec(-1e3f64..1e3, n)
                    .prop_map(move |v| (dtype, shape.clone(), v))
            })
            .prop_filter_map("a float literal", |(dtype, shape, v)| {
                let t = Tensor::from_f64(dtype, &shape, &v).ok()?;
                Some(Op::Literal { value: std::sync::Arc::new(t) })
            }),
        (-3i32..3, any_dtype()).prop_map(|(v, dtype)| Op::Constant { value: f64::from(v), dtype }),
        (dims(), dims(), dims()).prop_map(|(low, high, interior)| Op::Pad { low, high, interior }),
        axis().prop_map(|axis| Op::ScatterAdd { axis }),
        (0usize..4, any::<bool>(), proptest::array::uniform4(0usize..usize::MAX)).prop_map(
            |(s, same, input)| Op::Conv2dBackpropInput {
                strides: [s, s + 1],
                padding: if same { Padding::Same } else { Padding::Valid },
                input
            }
        ),
        (0usize..4, any::<bool>(), proptest::array::uniform4(0usize..8)).prop_map(
            |(s, same, filter)| Op::Conv2dBackpropFilter {
                strides: [s + 1, s],
                padding: if same { Padding::Same } else { Padding::Valid },
                filter
            }
        ),
        any_dtype().prop_map(|dtype| Op::Convert { dtype }),
        axis().prop_map(|axis| Op::Softmax { axis }),
        axis().prop_map(|axis| Op::LogSoftmax { axis }),
        (-4.0f64..4.0, any::<bool>(), any::<bool>()).prop_map(|(scale, divide, causal)| {
            Op::Attention(crate::AttentionSpec { scale, divide, causal })
        }),
        (-4.0f64..4.0, any::<bool>(), any::<bool>(), 0usize..4).prop_map(
            |(scale, divide, causal, wrt)| Op::AttentionGrad {
                attention: crate::AttentionSpec { scale, divide, causal },
                wrt
            }
        ),
        groups().prop_map(|groups| Op::AllReduce { op: meshwork_types::ReduceOp::Sum, groups }),
        (axis(), groups()).prop_map(|(axis, groups)| Op::ReduceScatter {
            op: meshwork_types::ReduceOp::Mean,
            axis,
            groups
        }),
        proptest::collection::vec((0usize..6, 0usize..6), 0..4)
            .prop_map(|pairs| Op::CollectivePermute { pairs }),
        (axis(), groups()).prop_map(|(axis, groups)| Op::ShardSlice { axis, groups }),
        (axis(), groups()).prop_map(|(axis, groups)| Op::ShardPad { axis, groups }),
        (any::<u32>(), 0usize..8).prop_map(|(channel, peer)| Op::Send { channel, peer }),
        (any::<u32>(), proptest::collection::vec(0usize..usize::MAX, 0..4), any_dtype())
            .prop_map(|(channel, shape, dtype)| Op::Recv { channel, peer: 1, dtype, shape }),
        any::<u32>().prop_map(|consumer| Op::Emit { consumer }),
    ]
}

/// Any dtype, the ones programs compute in most often.
fn any_dtype() -> impl Strategy<Value = DType> {
    prop_oneof![
        3 => prop::sample::select(vec![DType::F32, DType::F64, DType::I32, DType::I64, DType::Bool]),
        1 => prop::sample::select(DType::ALL.to_vec()),
    ]
}

fn any_spec() -> impl Strategy<Value = TensorSpec> {
    (any_dtype(), proptest::collection::vec(0usize..6, 0..5))
        .prop_map(|(d, dims)| TensorSpec::new(d, meshwork_types::Shape::new(&dims).unwrap()))
}

/// The dtypes the interpreters compute in (independent of the crate's own list).
const COMPUTED: [DType; 7] =
    [DType::F32, DType::F64, DType::BF16, DType::F16, DType::I32, DType::I64, DType::Bool];

proptest! {
    /// Any op over operands of any dtype: the builder refuses a parameter or result of
    /// a dtype the interpreters cannot compute in, and a program it accepts runs on
    /// both interpreters (when small and local) to results of its specs, or fails with
    /// an error — never a panic, never a tensor of another dtype or shape.
    #[test]
    fn prop_the_builder_never_panics(op in any_op(), specs in proptest::collection::vec(any_spec(), 0..4)) {
        let mut b = Builder::new();
        let mut vals = Vec::new();
        for (k, s) in specs.iter().enumerate() {
            match b.param(&format!("p{k}"), s.clone()) {
                Ok(v) => vals.push(v),
                Err(e) => {
                    prop_assert!(!COMPUTED.contains(&s.dtype), "{} refused: {}", s, e);
                    prop_assert!(matches!(e, Error::UnsupportedDType { .. }), "{}", e);
                    return Ok(());
                }
            }
            prop_assert!(COMPUTED.contains(&s.dtype), "a {} parameter accepted", s);
        }
        match b.push(op.clone(), &vals) {
            Ok(v) => {
                let s = b.spec(v).unwrap().clone();
                prop_assert!(COMPUTED.contains(&s.dtype), "a {} result accepted", s);
                prop_assert!(s.shape.dims().iter().try_fold(1usize, |n, &d| n.checked_mul(d)).is_some());
                let p = b.finish(&[v]).unwrap();
                // The text names the op and every operand.
                let text = p.to_string();
                prop_assert!(text.contains(op.name()), "{}", text);
                let small = s.shape.num_elements() <= 1 << 12
                    && specs.iter().all(|t| t.shape.num_elements() <= 1 << 12);
                if small && !op.communicates() {
                    let feed: Vec<Tensor> = specs
                        .iter()
                        .map(|t| Tensor::zeros(t.dtype, t.shape.dims()).unwrap())
                        .collect();
                    let fast = crate::fast::evaluate(&p, &feed);
                    let reference = crate::reference::evaluate(&p, &feed);
                    prop_assert_eq!(fast.is_ok(), reference.is_ok(), "{} {:?} {:?}", text, fast, reference);
                    if let (Ok(f), Ok(r)) = (fast, reference) {
                        prop_assert_eq!(f[0].spec(), s.clone(), "fast: {}", text);
                        prop_assert_eq!(r[0].spec(), s, "reference: {}", text);
                    }
                }
            }
            Err(e) => {
                let text = e.to_string();
                prop_assert!(text.contains(op.name()) || matches!(e, Error::Types(_)), "{}", text);
            }
        }
    }
}

#[test]
fn the_reference_interpreter_refuses_what_it_cannot_compute() {
    use crate::reference;
    let mut b = Builder::new();
    let table = b.param("table", spec("f64[3,2]")).unwrap();
    let idx = b.param("idx", spec("i64[2]")).unwrap();
    let rows = b.take(table, idx, 0).unwrap();
    let p = b.finish(&[rows]).unwrap();
    let t = Tensor::f64(&[3, 2], vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]).unwrap();
    let ok = reference::evaluate(&p, &[t.clone(), Tensor::i64(&[2], vec![2, 0]).unwrap()]).unwrap();
    assert_eq!(ok[0], Tensor::f64(&[2, 2], vec![4.0, 5.0, 0.0, 1.0]).unwrap());
    // An index outside the table is clamped into it, as XLA's gather does (the XLA
    // back end's tests check the two agree).
    let out = reference::evaluate(&p, &[t.clone(), Tensor::i64(&[2], vec![-1, 3]).unwrap()]);
    assert_eq!(out.unwrap()[0], Tensor::f64(&[2, 2], vec![0.0, 1.0, 4.0, 5.0]).unwrap());
    // Indices into an empty axis: a typed error naming the instruction.
    let mut b = Builder::new();
    let empty = b.param("table", spec("f64[0,2]")).unwrap();
    let idx = b.param("idx", spec("i64[1]")).unwrap();
    let rows = b.take(empty, idx, 0).unwrap();
    let e = b.finish(&[rows]).unwrap();
    let none = Tensor::f64(&[0, 2], vec![]).unwrap();
    match reference::evaluate(&e, &[none, Tensor::i64(&[1], vec![0]).unwrap()]) {
        Err(Error::Runtime { at, problem }) => {
            assert_eq!(at, "%2 (take)");
            assert!(problem.contains("empty"), "{problem}");
        }
        other => panic!("{other:?}"),
    }
    // Inputs that do not match the parameters.
    assert!(matches!(reference::evaluate(&p, std::slice::from_ref(&t)), Err(Error::Inputs { .. })));
    let wrong = Tensor::i64(&[3], vec![0, 1, 2]).unwrap();
    assert!(matches!(reference::evaluate(&p, &[t.clone(), wrong]), Err(Error::Inputs { .. })));
    // A tensor whose data does not fill its shape.
    assert!(matches!(
        Tensor::f64(&[2, 2], vec![1.0]),
        Err(meshwork_types::Error::TensorSize { .. })
    ));
    // The fast interpreter clamps and refuses the same way.
    let out = crate::fast::evaluate(&p, &[t.clone(), Tensor::i64(&[2], vec![-1, 3]).unwrap()]);
    assert_eq!(out.unwrap()[0], Tensor::f64(&[2, 2], vec![0.0, 1.0, 4.0, 5.0]).unwrap());
    let none = Tensor::f64(&[0, 2], vec![]).unwrap();
    let err = crate::fast::evaluate(&e, &[none, Tensor::i64(&[1], vec![0]).unwrap()]);
    assert!(matches!(err, Err(Error::Runtime { ref at, .. }) if at == "%2 (take)"), "{err:?}");
    // Integer floor division: MIN / -1 wraps, x / 0 is a typed error, in both.
    let mut b = Builder::new();
    let (p_, q_) = (b.param("p", spec("i64[3]")).unwrap(), b.param("q", spec("i64[3]")).unwrap());
    let d = b.div(p_, q_).unwrap();
    let p = b.finish(&[d]).unwrap();
    let feed = [
        Tensor::i64(&[3], vec![i64::MIN, -7, 7]).unwrap(),
        Tensor::i64(&[3], vec![-1, 2, -2]).unwrap(),
    ];
    let want = Tensor::i64(&[3], vec![i64::MIN, -4, -4]).unwrap();
    assert_eq!(reference::evaluate(&p, &feed).unwrap()[0], want);
    assert_eq!(crate::fast::evaluate(&p, &feed).unwrap()[0], want);
    let zero = [feed[0].clone(), Tensor::i64(&[3], vec![1, 0, 1]).unwrap()];
    assert!(matches!(reference::evaluate(&p, &zero), Err(Error::Runtime { .. })));
    assert!(matches!(crate::fast::evaluate(&p, &zero), Err(Error::Runtime { .. })));
    // A SAME convolution of an empty image is empty, in both.
    let mut b = Builder::new();
    let x = b.param("x", spec("f64[1,0,3,2]")).unwrap();
    let w = b.param("w", spec("f64[3,3,2,4]")).unwrap();
    let y = b.conv2d(x, w, [1, 1], Padding::Same).unwrap();
    let p = b.finish(&[y]).unwrap();
    let feed = [
        Tensor::f64(&[1, 0, 3, 2], vec![]).unwrap(),
        Tensor::f64(&[3, 3, 2, 4], vec![0.5; 72]).unwrap(),
    ];
    assert_eq!(reference::evaluate(&p, &feed).unwrap()[0].spec().to_string(), "f64[1,0,3,4]");
    assert_eq!(crate::fast::evaluate(&p, &feed).unwrap()[0].spec().to_string(), "f64[1,0,3,4]");
    // Softmax over an empty axis or of an empty array is empty, in both.
    for (shape, axis) in [("f32[3,0]", -1), ("f32[0,4]", -1), ("f64[3,0]", 0)] {
        let mut b = Builder::new();
        let x = b.param("x", spec(shape)).unwrap();
        let y = b.softmax(x, axis).unwrap();
        let z = b.log_softmax(x, axis).unwrap();
        let p = b.finish(&[y, z]).unwrap();
        let t = spec(shape);
        let feed = [Tensor::zeros(t.dtype, t.shape.dims()).unwrap()];
        let want = reference::evaluate(&p, &feed).unwrap();
        assert_eq!(crate::fast::evaluate(&p, &feed).unwrap(), want, "{shape}");
    }
    // Ops that talk to other devices need an Env that has them.
    let mut b = Builder::new();
    let x = b.param("x", spec("f32[2]")).unwrap();
    let s = b.all_reduce(x, meshwork_types::ReduceOp::Sum, &[vec![0]]).unwrap();
    let p = b.finish(&[s]).unwrap();
    let one = [Tensor::f32(&[2], vec![1.0, 2.0]).unwrap()];
    let err = reference::evaluate(&p, &one).unwrap_err();
    assert!(err.to_string().contains("%1 (all_reduce): all_reduce needs collectives"), "{err}");
    let err = crate::fast::evaluate(&p, &one).unwrap_err();
    assert!(err.to_string().contains("all_reduce needs collectives"), "{err}");
}

/// A stand-in for the strategy crate's implementations: this replica's peer holds the
/// same tensor (so an all-reduce sum doubles it), channels loop back, and the host
/// records what is emitted. `wrong` makes the all-reduce return a wrong shape.
#[derive(Default)]
struct Loopback {
    queue: std::sync::Mutex<Vec<(u32, Tensor)>>,
    emitted: std::sync::Mutex<Vec<(u32, Vec<Tensor>)>>,
    wrong: bool,
    replica: usize,
}

impl crate::Collectives for Loopback {
    fn replica_id(&self) -> usize {
        self.replica
    }
    fn all_reduce(
        &self,
        x: Tensor,
        _: meshwork_types::ReduceOp,
        _: &[Vec<usize>],
    ) -> crate::Result<Tensor> {
        if self.wrong {
            return Ok(Tensor::f64(&[1], vec![0.0])?);
        }
        let d = x.shape().to_vec();
        Ok(Tensor::f64(&d, x.to_f64().iter().map(|v| 2.0 * v).collect())?)
    }
    fn all_gather(&self, x: Tensor, _: usize, _: &[Vec<usize>]) -> crate::Result<Tensor> {
        Ok(x)
    }
    fn reduce_scatter(
        &self,
        x: Tensor,
        _: meshwork_types::ReduceOp,
        _: usize,
        _: &[Vec<usize>],
    ) -> crate::Result<Tensor> {
        Ok(x)
    }
    fn all_to_all(&self, x: Tensor, _: usize, _: usize, _: &[Vec<usize>]) -> crate::Result<Tensor> {
        Ok(x)
    }
    fn collective_permute(&self, _: Tensor, _: &[(usize, usize)]) -> crate::Result<Tensor> {
        Err(Error::Communication {
            at: "collective_permute".into(),
            problem: "peer 1 failed".into(),
        })
    }
}

impl crate::Channels for Loopback {
    fn send(&self, channel: u32, _: usize, x: Tensor) -> crate::Result<()> {
        self.queue.lock().unwrap().push((channel, x));
        Ok(())
    }
    fn recv(&self, channel: u32, _: usize, _: &TensorSpec) -> crate::Result<Tensor> {
        let mut q = self.queue.lock().unwrap();
        let at = q.iter().position(|(c, _)| *c == channel).expect("sent first");
        Ok(q.remove(at).1)
    }
}

impl crate::HostSink for Loopback {
    fn emit(&self, consumer: u32, values: &[Tensor]) -> crate::Result<()> {
        self.emitted.lock().unwrap().push((consumer, values.to_vec()));
        Ok(())
    }
}

/// Both interpreters run collectives, send/recv and emit through the Env's traits,
/// check what the implementation returns against the instruction's spec, and name
/// the instruction when the implementation fails.
#[test]
fn both_interpreters_communicate_through_the_env() {
    use crate::{Env, Tensor, fast, reference};
    let mut b = Builder::new();
    let x = b.param("x", spec("f64[3]")).unwrap();
    let s = b.all_reduce(x, meshwork_types::ReduceOp::Sum, &[vec![0, 1]]).unwrap();
    let tok = b.send(s, 7, 1).unwrap();
    let r = b.recv(&spec("f64[3]"), 7, 1).unwrap();
    let y = b.add(r, x).unwrap();
    let e = b.emit(&[y, tok], 3).unwrap();
    let p = b.finish(&[y, e]).unwrap();
    let feed = [Tensor::f64(&[3], vec![1.0, 2.0, 3.0]).unwrap()];
    for run in [0, 1] {
        let lb = Loopback::default();
        let env = Env::local().with_collectives(&lb).with_channels(&lb).with_host(&lb);
        let out = if run == 0 {
            reference::evaluate_with(&p, &feed, &env)
        } else {
            fast::Executable::compile(&p, fast::Options::default()).run(&feed, &env)
        }
        .unwrap();
        assert_eq!(out[0].to_f64(), vec![3.0, 6.0, 9.0], "interpreter {run}");
        assert_eq!(out[1], Tensor::bool(&[], vec![true]).unwrap());
        let emitted = lb.emitted.lock().unwrap();
        assert_eq!(emitted.len(), 1);
        assert_eq!((emitted[0].0, emitted[0].1[0].to_f64()), (3, vec![3.0, 6.0, 9.0]));
        // A peer that answers with the wrong shape, and one that fails.
        let bad = Loopback { wrong: true, ..Loopback::default() };
        let env = Env::local().with_collectives(&bad).with_channels(&bad).with_host(&bad);
        let err = if run == 0 {
            reference::evaluate_with(&p, &feed, &env)
        } else {
            fast::Executable::compile(&p, fast::Options::default()).run(&feed, &env)
        }
        .unwrap_err();
        assert!(err.to_string().contains("%1 (all_reduce): the peer returned f64[1]"), "{err}");
    }
    let mut b = Builder::new();
    let x = b.param("x", spec("f64[3]")).unwrap();
    let y = b.collective_permute(x, &[(0, 1), (1, 0)]).unwrap();
    let p = b.finish(&[y]).unwrap();
    let lb = Loopback::default();
    let err = fast::Executable::compile(&p, fast::Options::default())
        .run(&feed, &Env::local().with_collectives(&lb))
        .unwrap_err();
    assert!(
        matches!(&err, Error::Communication { at, problem } if at == "%1 (collective_permute)" && problem.contains("peer 1 failed")),
        "{err:?}"
    );
}

/// f32 values are rounded to f32 after every op: an f32 program gives f32 arithmetic's
/// result where f64 would differ.
#[test]
fn f32_programs_round_every_value_to_f32() {
    use crate::reference;
    let mut b = Builder::new();
    let x = b.param("x", spec("f32[1]")).unwrap();
    let y = b.param("y", spec("f32[1]")).unwrap();
    let s = b.add(x, y).unwrap();
    let d = b.sub(s, x).unwrap();
    let p = b.finish(&[d]).unwrap();
    let (a, c) = (1.0e8f32, 1.0f32);
    let got = reference::evaluate(
        &p,
        &[Tensor::f32(&[1], vec![a]).unwrap(), Tensor::f32(&[1], vec![c]).unwrap()],
    )
    .unwrap();
    assert_eq!(got[0], Tensor::f32(&[1], vec![(a + c) - a]).unwrap());
    assert_ne!((a + c) - a, c, "the data must tell f32 from f64 arithmetic");
}

/// A literal is its tensor, exactly, in both interpreters and in the text form (its
/// bytes); a literal that is not of a float dtype is refused.
#[test]
fn literals_are_their_tensors_exactly() {
    for dtype in [DType::F64, DType::F32, DType::BF16, DType::F16] {
        let values = [0.1, -2.5, 1e-3, 7.0, 0.3, -0.0];
        let t = Tensor::from_f64(dtype, &[2, 3], &values).unwrap();
        let mut b = Builder::new();
        let x = b
            .param("x", TensorSpec::new(dtype, meshwork_types::Shape::new(&[3]).unwrap()))
            .unwrap();
        let l = b.literal(t.clone()).unwrap();
        let y = b.add(l, x).unwrap();
        let p = b.finish(&[l, y]).unwrap();
        let back: Program = p.to_string().parse().unwrap();
        assert_eq!(back, p, "{dtype}");
        let x = Tensor::from_f64(dtype, &[3], &[1.0, 2.0, 3.0]).unwrap();
        let want: Vec<f64> =
            values.iter().zip([1.0, 2.0, 3.0].iter().cycle()).map(|(a, b)| a + b).collect();
        for out in [
            crate::fast::evaluate(&p, std::slice::from_ref(&x)).unwrap(),
            crate::reference::evaluate(&p, std::slice::from_ref(&x)).unwrap(),
        ] {
            assert_eq!(out[0].to_f64(), t.to_f64(), "{dtype}");
            let rounded = Tensor::from_f64(dtype, &[2, 3], &want).unwrap().to_f64();
            assert_eq!(out[1].to_f64(), rounded, "{dtype}");
        }
    }
    let mut b = Builder::new();
    let e = b.literal(Tensor::i32(&[2], vec![1, 2]).unwrap()).unwrap_err();
    assert!(e.to_string().contains("float dtypes"), "{e}");
}

/// Print → parse → print is stable for a program with scopes, names and every kind of
/// attribute; parse errors quote the line.
#[test]
fn text_reads_back_to_the_same_program() {
    let mut b = Builder::new();
    let x = b.param("layers.0 \"x\"", spec("f32[2,4,6]")).unwrap();
    let w = b.param("w", spec("f32[6,4]")).unwrap();
    let h = b
        .scope("blk", |b| {
            let h = b.dot_general(x, w, &[2], &[0], &[], &[])?;
            let h = b.gelu(h)?;
            b.name(h, "h")
        })
        .unwrap();
    let s = b.reduce_sum(h, &[0, 2], true).unwrap();
    let c = b.constant(-0.1, DType::F32).unwrap();
    let m = b.mul(s, c).unwrap();
    let t = b.transpose(m, &[2, 1, 0]).unwrap();
    let g = b.all_gather(t, 0, &[vec![0, 1], vec![2, 3]]).unwrap();
    let r = b.all_reduce(g, meshwork_types::ReduceOp::Mean, &[vec![0, 1, 2, 3]]).unwrap();
    let p2 = b.collective_permute(r, &[(0, 1), (1, 0)]).unwrap();
    let tok = b.emit(&[p2, h], 7).unwrap();
    let i = b.iota(DType::I64, &[3, 2], 1).unwrap();
    let oh = b.one_hot(i, 5, DType::F64).unwrap();
    let rv = b.recv(&spec("f32[2]"), 4, 1).unwrap();
    let sent = b.send(rv, 5, 0).unwrap();
    let sl = b.slice(x, &[0, 1, 0], &[2, 4, 6], &[1, 2, 3]).unwrap();
    let p = b.finish(&[tok, oh, sent, sl]).unwrap();
    let text = p.to_string();
    let back: Program = text.parse().unwrap();
    assert_eq!(back, p);
    assert_eq!(back.to_string(), text);
    // A wrong spec, a forward reference, an unknown op, a missing return: line and text.
    let lines: Vec<&str> = text.lines().collect();
    let broken = text.replace("f32[2,4,4] dot_general", "f32[2,4,5] dot_general");
    let e = broken.parse::<Program>().unwrap_err().to_string();
    assert!(e.contains("the op gives f32[2,4,4], the text says f32[2,4,5]"), "{e}");
    assert!(
        e.starts_with(&format!(
            "line {}:",
            lines.iter().position(|l| l.contains("dot_general")).unwrap() + 1
        )),
        "{e}"
    );
    let e =
        "param %0 \"x\": f32[2]\n%1 = f32[2] exp(%2)\nreturn %1\n".parse::<Program>().unwrap_err();
    assert!(e.to_string().contains("%2 is used before it is defined"), "{e}");
    let e =
        "param %0 \"x\": f32[2]\n%1 = f32[2] frob(%0)\nreturn %1\n".parse::<Program>().unwrap_err();
    assert!(e.to_string().contains("unknown op \"frob\""), "{e}");
    assert!("param %0 \"x\": f32[2]\n".parse::<Program>().is_err());
}

proptest! {
    /// Any accepted single-op program prints, parses back equal, and prints the same.
    #[test]
    fn prop_text_roundtrips(op in any_op(), specs in proptest::collection::vec(any_spec(), 0..4)) {
        let mut b = Builder::new();
        // Parameters of dtypes programs do not compute in are refused (see above).
        let Ok(vals) = specs
            .iter()
            .enumerate()
            .map(|(k, s)| b.param(&format!("p{k}"), s.clone()))
            .collect::<Result<Vec<Value>, _>>()
        else {
            return Ok(());
        };
        if let Ok(v) = b.push(op, &vals) {
            let p = b.finish(&[v]).unwrap();
            let text = p.to_string();
            let back: Program = text.parse().unwrap();
            prop_assert_eq!(back.to_string(), text);
        }
    }

    /// Random text — and random edits of a valid program's text — parse to a program
    /// or a typed error, never a panic.
    #[test]
    fn prop_the_parser_never_panics(
        edits in proptest::collection::vec((0usize..400, prop::sample::select(vec!['%', '{', '}', ',', '"', '=', '\\', ' ', '\n', '1', 'x', '('])), 0..6),
    ) {
        let good = "param %0 \"x\": f32[2,3]\nparam %1 \"w\": f32[3,4]\n%2 = f32[2,4] dot_general(%0, %1), lhs_contract={1}, rhs_contract={0}, lhs_batch={}, rhs_batch={} \"h\"\n%3 = f32[2] reduce_sum(%2), axes={1}, keepdims=false\nreturn %3, %2\n";
        let mut text: Vec<char> = good.chars().collect();
        for (at, c) in edits {
            let at = at % (text.len() + 1);
            text.insert(at, c);
        }
        let text: String = text.into_iter().collect();
        let _ = text.parse::<Program>();
    }
}

/// Autodiff follows JAX at ties and kinks: `max`/`min` split a tie's cotangent in
/// halves (`jax.grad(lambda x: jnp.maximum(x, 1.))(1.) == 0.5`), `reduce_max` shares it
/// among equal maxima, `relu` and `abs` have derivative 0 at 0; integer values have no
/// gradient and a non-scalar loss is refused.
#[test]
fn gradients_at_ties_and_kinks_follow_jax() {
    use crate::{Tensor, grad, reference};
    let run =
        |build: &dyn Fn(&mut Builder, Value) -> crate::Result<Value>, x: Vec<f64>| -> Vec<f64> {
            let mut b = Builder::new();
            let p = b.param("x", spec(&format!("f64[{}]", x.len()))).unwrap();
            let y = build(&mut b, p).unwrap();
            let loss = b.reduce_sum(y, &[0], false).unwrap();
            let prog = b.finish(&[loss]).unwrap();
            let g = grad(&prog, loss, &[p]).unwrap();
            let out = reference::evaluate(&g, &[Tensor::f64(&[x.len()], x).unwrap()]).unwrap();
            out[1].to_f64()
        };
    let max1 = |b: &mut Builder, x: Value| {
        let one = b.constant(1.0, DType::F64)?;
        b.max(x, one)
    };
    assert_eq!(run(&max1, vec![1.0, 2.0, 0.0]), vec![0.5, 1.0, 0.0]);
    let min1 = |b: &mut Builder, x: Value| {
        let one = b.constant(1.0, DType::F64)?;
        b.min(x, one)
    };
    assert_eq!(run(&min1, vec![1.0, 2.0, 0.0]), vec![0.5, 0.0, 1.0]);
    assert_eq!(run(&|b, x| b.relu(x), vec![-1.0, 0.0, 2.0]), vec![0.0, 0.0, 1.0]);
    assert_eq!(run(&|b, x| b.abs(x), vec![-1.0, 0.0, 2.0]), vec![-1.0, 0.0, 1.0]);
    let rmax = |b: &mut Builder, x: Value| b.reduce_max(x, &[0], true);
    assert_eq!(run(&rmax, vec![3.0, 1.0, 3.0]), vec![0.5, 0.0, 0.5]);
    // What has no gradient.
    let mut b = Builder::new();
    let i = b.param("i", spec("i64[2]")).unwrap();
    let f = b.param("f", spec("f64[2]")).unwrap();
    let c = b.convert(i, DType::F64).unwrap();
    let y = b.mul(c, f).unwrap();
    let p = b.finish(&[y]).unwrap();
    assert!(matches!(grad(&p, y, &[f]), Err(Error::NoGradient { .. })), "a vector loss");
    assert!(matches!(crate::vjp(&p, &[i]), Err(Error::NoGradient { .. })), "an integer input");
    assert!(crate::vjp(&p, &[f]).is_ok());
}

/// Transposes of the ops autodiff itself emits (`pad`, `scatter_add`, the conv2d
/// backprops) equal central differences, so gradient programs can be differentiated
/// again (conv2d's second order).
#[test]
fn transposes_of_transposes_equal_finite_differences() {
    use crate::{Tensor, grad, reference};
    type Make<'a> = &'a dyn Fn(&mut Builder, Value, Value) -> crate::Result<Value>;
    let build: [Make<'_>; 4] = [
        &|b, x, _| {
            b.push(Op::Pad { low: vec![1, 0], high: vec![0, 2], interior: vec![1, 0] }, &[x])
        },
        &|b, x, u| {
            let i = b.iota(DType::I64, &[2], 0)?;
            let u = b.slice(u, &[0, 0], &[2, 3], &[1, 1])?;
            b.push(Op::ScatterAdd { axis: 0 }, &[x, i, u])
        },
        &|b, x, w| {
            let x4 = b.reshape(x, &[1, 2, 3, 1])?;
            let w4 = b.reshape(w, &[2, 2, 1, 3])?;
            let g = b.conv2d(x4, w4, [1, 1], Padding::Same)?;
            b.push(
                Op::Conv2dBackpropInput {
                    strides: [1, 1],
                    padding: Padding::Same,
                    input: [1, 2, 3, 1],
                },
                &[g, w4],
            )
        },
        &|b, x, w| {
            let x4 = b.reshape(x, &[1, 2, 3, 1])?;
            let w4 = b.reshape(w, &[2, 2, 1, 3])?;
            let g = b.conv2d(x4, w4, [1, 1], Padding::Valid)?;
            let t = b.tanh(g)?;
            b.push(
                Op::Conv2dBackpropFilter {
                    strides: [1, 1],
                    padding: Padding::Valid,
                    filter: [2, 2, 1, 3],
                },
                &[x4, t],
            )
        },
    ];
    for (case, f) in build.iter().enumerate() {
        let mut b = Builder::new();
        let x = b.param("x", spec("f64[2,3]")).unwrap();
        let w = b.param("w", spec("f64[4,3]")).unwrap();
        let y = f(&mut b, x, w).unwrap();
        let s = b.sin(y).unwrap();
        let rank = b.spec(s).unwrap().shape.rank();
        let axes: Vec<isize> = (0..rank as isize).collect();
        let loss = b.reduce_sum(s, &axes, false).unwrap();
        let p = b.finish(&[loss]).unwrap();
        let g = grad(&p, loss, &[x, w]).unwrap();
        let xs: Vec<f64> = (0..6).map(|k| 0.3 * k as f64 - 0.7).collect();
        let ws: Vec<f64> = (0..12).map(|k| 0.2 * (k as f64).sin()).collect();
        let feed = |xs: &[f64], ws: &[f64]| {
            vec![
                Tensor::f64(&[2, 3], xs.to_vec()).unwrap(),
                Tensor::f64(&[4, 3], ws.to_vec()).unwrap(),
            ]
        };
        let out = reference::evaluate(&g, &feed(&xs, &ws)).unwrap();
        let l =
            |xs: &[f64], ws: &[f64]| reference::evaluate(&p, &feed(xs, ws)).unwrap()[0].to_f64()[0];
        let h = 1e-6;
        for (which, base) in [(0usize, &xs), (1, &ws)] {
            for i in 0..base.len() {
                let (mut up, mut dn) = (base.clone(), base.clone());
                up[i] += h;
                dn[i] -= h;
                let fd = if which == 0 {
                    (l(&up, &ws) - l(&dn, &ws)) / (2.0 * h)
                } else {
                    (l(&xs, &up) - l(&xs, &dn)) / (2.0 * h)
                };
                let got = out[1 + which].to_f64()[i];
                assert!(
                    (fd - got).abs() <= 1e-6 * (1.0 + got.abs()),
                    "case {case} input {which}[{i}]: {got} vs fd {fd}"
                );
            }
        }
    }
}

/// The collectives' transposes are the collectives JAX uses: all-reduce sum to itself,
/// all-gather to reduce-scatter and back, all-to-all with its axes swapped, a permute
/// to the reverse permute.
#[test]
fn collectives_transpose_to_their_adjoints() {
    use meshwork_types::ReduceOp;
    let groups = vec![vec![0, 1]];
    let mut b = Builder::new();
    let x = b.param("x", spec("f64[4,2]")).unwrap();
    let a = b.all_reduce(x, ReduceOp::Sum, &groups).unwrap();
    let g = b.all_gather(a, 0, &groups).unwrap();
    let r = b.reduce_scatter(g, ReduceOp::Sum, 1, &groups).unwrap();
    let t = b.all_to_all(r, 0, 1, &groups).unwrap();
    let p = b.collective_permute(t, &[(0, 1), (1, 0)]).unwrap();
    let s = b.reduce_sum(p, &[0, 1], false).unwrap();
    let prog = b.finish(&[s]).unwrap();
    let back = crate::grad(&prog, s, &[x]).unwrap().to_string();
    for want in [
        "collective_permute(",
        "all_to_all(",
        "split_axis=1, concat_axis=0",
        "all_gather(",
        "reduce_scatter(",
        "all_reduce(",
    ] {
        assert!(back.contains(want), "{want} in\n{back}");
    }
    // Max has no transpose here.
    let mut b = Builder::new();
    let x = b.param("x", spec("f64[2]")).unwrap();
    let m = b.all_reduce(x, ReduceOp::Max, &groups).unwrap();
    let s = b.reduce_sum(m, &[0], false).unwrap();
    let prog = b.finish(&[s]).unwrap();
    assert!(matches!(crate::grad(&prog, s, &[x]), Err(Error::NoTransposeRule { .. })));
}

/// Model code with handles and operators builds exactly the program the builder's
/// method calls build, and its mistakes are the builder's typed errors.
#[test]
fn graph_operators_build_what_the_builder_builds() {
    use crate::Graph;

    let g = Graph::new();
    let x = g.param("x", spec("f64[4,3]")).unwrap();
    let loss = g
        .scope("mlp", |g| {
            let w = g.param("w", spec("f64[3,5]"))?;
            let b = g.param("b", spec("f64[5]"))?;
            let h = (x.matmul(w)? + b)?.relu()?;
            let y = ((2.0 * h)? - 1.0)?;
            let z = (-(y / h.exp()?)? * y)?;
            z.reduce_mean(&[0, 1], false)?.named("loss")
        })
        .unwrap();
    let with_ops = g.finish(&[loss]).unwrap();

    let mut b = Builder::new();
    let x = b.param("x", spec("f64[4,3]")).unwrap();
    let loss = b
        .scope("mlp", |b| {
            let w = b.param("w", spec("f64[3,5]"))?;
            let bias = b.param("b", spec("f64[5]"))?;
            let m = b.matmul(x, w)?;
            let s = b.add(m, bias)?;
            let h = b.relu(s)?;
            let two = b.constant(2.0, DType::F64)?;
            let h2 = b.mul(two, h)?;
            let one = b.constant(1.0, DType::F64)?;
            let y = b.sub(h2, one)?;
            let e = b.exp(h)?;
            let q = b.div(y, e)?;
            let n = b.neg(q)?;
            let z = b.mul(n, y)?;
            let l = b.reduce_mean(z, &[0, 1], false)?;
            b.name(l, "loss")
        })
        .unwrap();
    let with_calls = b.finish(&[loss]).unwrap();
    assert_eq!(with_ops.to_string(), with_calls.to_string());

    // Mistakes: the builder's typed error, through the operator and through `?`.
    let g = Graph::new();
    let a = g.param("a", spec("f32[2,3]")).unwrap();
    let c = g.param("c", spec("f32[2]")).unwrap();
    let e = (a + c).unwrap_err().to_string();
    assert!(e.contains("add(f32[2,3], f32[2])") && e.contains("do not broadcast"), "{e}");
    let e = ((a * 3.0) + c).unwrap_err().to_string();
    assert!(e.contains("add(f32[2,3], f32[2])"), "{e}");
    assert!(matches!(a.matmul(a), Err(Error::Type { op: "dot_general", .. })));
    assert!(a.reduce_sum(&[2], false).is_err());
    // A handle of another graph is refused, not silently read as this graph's value.
    let other = Graph::new();
    let o = other.param("o", spec("f32[2,3]")).unwrap();
    let e = (a + o).unwrap_err().to_string();
    assert!(e.contains("another graph"), "{e}");
    assert!(g.finish(&[o]).is_err());
    // A handle used while its builder is lent to `with` is refused, not a RefCell panic.
    let busy = g.with(|_| a.relu().map(|v| v.value()));
    assert_eq!(busy.unwrap_err(), Error::GraphBusy { op: "var" });
    assert!(matches!(g.with(|_| g.param("z", spec("f32[1]"))), Err(Error::GraphBusy { .. })));
    // After finish, old handles refer to nothing.
    let p = g.finish(&[a]).unwrap();
    assert_eq!(p.params().len(), 2);
    assert!(matches!(a.relu(), Err(Error::UndefinedValue { .. })));
    assert!(g.var(Value(0)).is_err());
    // Even once the graph holds values again, an old handle is not read as a new value.
    let fresh = g.param("fresh", spec("f32[2,3]")).unwrap();
    assert!(matches!(a.relu(), Err(Error::UndefinedValue { .. })));
    assert!(matches!(fresh + a, Err(Error::UndefinedValue { .. })));
    assert!(a.spec().is_err() && (fresh * 2.0).is_ok());
}

/// Operators compute what they say: `2x - 1`, `x / y`, `-x` against plain Rust.
#[test]
fn graph_operators_evaluate_to_their_arithmetic() {
    use crate::{Graph, Tensor};

    let g = Graph::new();
    let x = g.param("x", spec("f64[3]")).unwrap();
    let y = g.param("y", spec("f64[3]")).unwrap();
    let a = ((2.0 * x).unwrap() - 1.0).unwrap();
    let q = (x / y).unwrap();
    let n = (-x).unwrap();
    let r = (1.0 / y).unwrap();
    let p = g.finish(&[a, q, n, r]).unwrap();
    let xs = vec![0.5, -2.0, 3.0];
    let ys = vec![4.0, 0.25, -1.5];
    let out = crate::reference::evaluate(
        &p,
        &[Tensor::f64(&[3], xs.clone()).unwrap(), Tensor::f64(&[3], ys.clone()).unwrap()],
    )
    .unwrap();
    let want: [Vec<f64>; 4] = [
        xs.iter().map(|x| 2.0 * x - 1.0).collect(),
        xs.iter().zip(&ys).map(|(x, y)| x / y).collect(),
        xs.iter().map(|x| -x).collect(),
        ys.iter().map(|y| 1.0 / y).collect(),
    ];
    for (got, want) in out.iter().zip(want) {
        assert_eq!(got.to_f64(), want);
    }
}

/// A training step computes no gradient nobody asked for (the input's, of a product
/// whose other operand is trained), keeps what communicates, and its weight gradients
/// come out of `dot_general` in the weights' layout, with no transpose copy.
#[test]
fn gradients_hold_no_dead_code_and_no_transpose_of_products() {
    use crate::grad;

    let mut b = Builder::new();
    let x = b.param("x", spec("f64[8,5]")).unwrap();
    let w = b.param("w", spec("f64[5,3]")).unwrap();
    let h = b.matmul(x, w).unwrap();
    let h = b.tanh(h).unwrap();
    let s = b.reduce_sum(h, &[0, 1], false).unwrap();
    let _tok = b.emit(&[s], 7).unwrap();
    let unused = b.exp(x).unwrap();
    let _ = b.reduce_sum(unused, &[0], false).unwrap();
    let p = b.finish(&[s]).unwrap();
    let ops = |p: &Program| p.instrs().iter().map(|i| i.op.name()).collect::<Vec<_>>();

    let pruned = p.without_dead_code();
    assert_eq!(ops(&pruned), ["dot_general", "tanh", "reduce_sum", "emit"]);
    let g = grad(&p, s, &[w]).unwrap();
    let names = ops(&g);
    // One product forward, one for dw; none for dx, no transpose, no exp.
    assert_eq!(names.iter().filter(|n| **n == "dot_general").count(), 2, "{g}");
    assert!(!names.contains(&"transpose") && !names.contains(&"exp"), "{g}");
    assert!(names.contains(&"emit"), "{g}");
    let dw = g.results()[1];
    assert_eq!(g.spec(dw).unwrap().to_string(), "f64[5,3]");
    assert_eq!(g.instr(dw).unwrap().op.name(), "dot_general", "{g}");
}

/// `shard_slice` keeps this replica's block, `shard_pad` puts it back among zeros,
/// in both interpreters, and each is the other's transpose.
#[test]
fn shard_slice_and_pad_use_the_replica_position() {
    let mut b = Builder::new();
    let x = b.param("x", "f64[4,3]".parse().unwrap()).unwrap();
    let groups = vec![vec![2, 0], vec![1, 3]];
    let s = b.shard_slice(x, 0, &groups).unwrap();
    let p = b.shard_pad(s, 1, &groups).unwrap();
    let program = b.finish(&[s, p]).unwrap();
    assert!(program.to_string().contains("shard_slice(%0), axis=0, groups={{2,0},{1,3}}"));
    assert_eq!(program.to_string().parse::<Program>().unwrap(), program);
    let x = Tensor::f64(&[4, 3], (0..12).map(f64::from).collect()).unwrap();
    // Replica 0 is member 1 of {2, 0}: rows 2..4, then columns 3..6 of 6.
    let env = Loopback::default();
    let env = crate::Env::local().with_collectives(&env);
    for out in [
        crate::reference::evaluate_with(&program, std::slice::from_ref(&x), &env).unwrap(),
        crate::fast::Executable::compile(&program, crate::fast::Options::default())
            .run(std::slice::from_ref(&x), &env)
            .unwrap(),
    ] {
        assert_eq!(out[0].to_f64(), [6.0, 7.0, 8.0, 9.0, 10.0, 11.0]);
        assert_eq!(out[1].to_f64(), [0.0, 0.0, 0.0, 6.0, 7.0, 8.0, 0.0, 0.0, 0.0, 9.0, 10.0, 11.0]);
    }
    // The vjp of the slice pads the cotangent back into this replica's block.
    let mut b = Builder::new();
    let x2 = b.param("x", "f64[4,3]".parse().unwrap()).unwrap();
    let s2 = b.shard_slice(x2, 0, &groups).unwrap();
    let v = crate::vjp(&b.finish(&[s2]).unwrap(), &[x2]).unwrap();
    assert!(v.to_string().contains("shard_pad("), "{v}");
    let c = Tensor::f64(&[2, 3], vec![1.0; 6]).unwrap();
    let out = crate::reference::evaluate_with(&v, &[x, c], &env).unwrap();
    assert_eq!(out[1].to_f64(), [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]);
}

/// The fast interpreter's threaded paths against the reference, at sizes that take
/// them with 2 threads: softmax rows spread over threads (>= 32Ki elements), a batch
/// of products split over the batch, products of many rows split by rows (the rhs not
/// transposed) or by columns (transposed), wide ones split by columns (evenly, and
/// unevenly with the rhs transposed), and narrow products kept on one thread.
#[test]
fn threaded_kernels_equal_the_reference() {
    use crate::fast::{Executable, Options};
    use crate::{Env, Tensor, reference};
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut noise = |n: usize| -> Vec<f64> {
        (0..n)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                (seed >> 11) as f64 / (1u64 << 53) as f64 * 4.0 - 2.0
            })
            .collect()
    };
    for dtype in ["f32", "f64"] {
        let mut b = Builder::new();
        let x = b.param("x", spec(&format!("{dtype}[64,1024]"))).unwrap();
        let q = b.param("q", spec(&format!("{dtype}[8,64,48]"))).unwrap();
        let k = b.param("k", spec(&format!("{dtype}[8,48,64]"))).unwrap();
        let w = b.param("w", spec(&format!("{dtype}[1024,256]"))).unwrap();
        let v = b.param("v", spec(&format!("{dtype}[1024,8]"))).unwrap();
        let sm = b.softmax(x, -1).unwrap();
        let lsm = b.log_softmax(x, -1).unwrap();
        let batched = b
            .push(
                Op::DotGeneral {
                    lhs_contract: vec![2],
                    rhs_contract: vec![1],
                    lhs_batch: vec![0],
                    rhs_batch: vec![0],
                },
                &[q, k],
            )
            .unwrap();
        let wide = b.matmul(x, w).unwrap();
        let narrow = b.matmul(x, v).unwrap();
        // `x · yᵀ` of two matrices: the rhs walked along its rows (`x·Wᵀ`).
        let times_transposed = |b: &mut Builder, x, y| {
            let op = Op::DotGeneral {
                lhs_contract: vec![1],
                rhs_contract: vec![1],
                lhs_batch: vec![],
                rhs_batch: vec![],
            };
            b.push(op, &[x, y]).unwrap()
        };
        // Many rows (301, split unevenly over the threads), the rhs transposed.
        let t = b.param("t", spec(&format!("{dtype}[301,64]"))).unwrap();
        let u = b.param("u", spec(&format!("{dtype}[96,64]"))).unwrap();
        let tall = times_transposed(&mut b, t, u);
        // Many rows, the rhs not transposed: split by rows.
        let r = b.param("r", spec(&format!("{dtype}[64,96]"))).unwrap();
        let tall_rows = b.matmul(t, r).unwrap();
        // Many rows, the rhs transposed and wide enough: split by columns.
        let u2 = b.param("u2", spec(&format!("{dtype}[160,64]"))).unwrap();
        let tall_cols = times_transposed(&mut b, t, u2);
        // Columns split unevenly (200: runs of 112 and 88), the rhs transposed (x·Wᵀ).
        let y = b.param("y", spec(&format!("{dtype}[200,1024]"))).unwrap();
        let uneven = times_transposed(&mut b, x, y);
        let p = b
            .finish(&[sm, lsm, batched, wide, narrow, tall, tall_rows, tall_cols, uneven])
            .unwrap();
        let feed: Vec<Tensor> = p
            .params()
            .iter()
            .map(|q| {
                let d = q.spec.shape.dims();
                let vals = noise(q.spec.shape.num_elements());
                if dtype == "f32" {
                    Tensor::f32(d, vals.iter().map(|&x| x as f32).collect()).unwrap()
                } else {
                    Tensor::f64(d, vals).unwrap()
                }
            })
            .collect();
        let want = reference::evaluate(&p, &feed).unwrap();
        let exe = Executable::compile(&p, Options::default().threads(2));
        let got = exe.run(&feed, &Env::local()).unwrap();
        let tol = if dtype == "f32" { 1e-4 } else { 1e-12 };
        for (r, (g, w)) in got.iter().zip(&want).enumerate() {
            let (g, w) = (g.to_f64(), w.to_f64());
            let scale = w.iter().fold(0f64, |m, x| m.max(x.abs()));
            for (i, (a, b)) in g.iter().zip(&w).enumerate() {
                assert!(
                    (a - b).abs() <= tol * (1.0 + scale),
                    "{dtype} result {r} [{i}]: {a} vs {b}"
                );
            }
        }
    }
}

#[test]
fn device_scopes_nest_as_tensorflow_merges_them() {
    let mut b = Builder::new();
    let x = b.param("x", spec("f64[4]")).unwrap();
    let (w, y, z, u) = b
        .device("/job:worker/task:1", |b| {
            let w = b.param("w", spec("f64[4]"))?;
            let y = b.device("GPU:0", |b| b.add(x, w))?;
            let z = b.device("/task:2/cpu:1", |b| b.neg(y))?;
            let u = b.device("", |b| b.neg(z))?;
            Ok((w, y, z, u))
        })
        .unwrap();
    let p = b.finish(&[u]).unwrap();
    assert_eq!(p.params()[0].device, "");
    assert_eq!(p.params()[1].device, "/job:worker/task:1");
    let w = p.params()[w.index()].device.clone();
    assert_eq!(w, "/job:worker/task:1");
    assert_eq!(p.instr(y).unwrap().device, "/job:worker/task:1/device:GPU:0");
    assert_eq!(p.instr(z).unwrap().device, "/job:worker/task:2/cpu:1");
    assert_eq!(p.instr(u).unwrap().device, "", "an empty spec clears the request");

    // What cannot print and read back is refused, naming the request.
    let mut b = Builder::new();
    let x = b.param("x", spec("f64[4]")).unwrap();
    for bad in ["/device:CPU:0 ", "/device:\"CPU\":0", "/device:CPU:0,1", "/device:{0}", "/d@v"] {
        let e = b.device(bad, |b| b.neg(x)).unwrap_err();
        assert!(matches!(&e, Error::BadDevice { device, .. } if device == bad), "{bad}: {e}");
    }
    assert!(matches!(b.set_device(Value(9), "CPU:0"), Err(Error::UndefinedValue { .. })));
}

#[test]
fn colocation_takes_the_targets_device_and_stacks() {
    let mut b = Builder::new();
    let w = b.device("/device:CPU:1", |b| b.param("w", spec("f64[4]"))).unwrap();
    let x = b.param("x", spec("f64[4]")).unwrap();
    let (a, c, d) = b
        .device("/device:CPU:0", |b| {
            b.colocate_with(w, |b| {
                let a = b.add(w, x)?;
                let (c, d) = b.colocate_with(a, |b| {
                    let c = b.neg(a)?;
                    let d = b.device("CPU:2", |b| b.neg(c))?;
                    Ok((c, d))
                })?;
                Ok((a, c, d))
            })
        })
        .unwrap();
    let e = b.neg(d).unwrap();
    b.set_device(e, "CPU:3").unwrap();
    b.colocate(e, c).unwrap();
    assert!(b.colocate(c, e).is_err(), "a colocation target comes first");
    let p = b.finish(&[e]).unwrap();
    let ins = |v: Value| p.instr(v).unwrap();
    // Inside `colocate_with`, the target's request replaces the enclosing scope.
    assert_eq!((ins(a).device.as_str(), ins(a).colocate.clone()), ("/device:CPU:1", vec![w]));
    assert_eq!((ins(c).device.as_str(), ins(c).colocate.clone()), ("/device:CPU:1", vec![w, a]));
    assert_eq!((ins(d).device.as_str(), ins(d).colocate.clone()), ("/device:CPU:2", vec![w, a]));
    assert_eq!((ins(e).device.as_str(), ins(e).colocate.clone()), ("/device:CPU:3", vec![c]));
    // Requests print and read back; reopening a program keeps them.
    let text = p.to_string();
    assert!(text.contains("@device=\"/device:CPU:1\""), "{text}");
    assert!(text.contains(&format!("@colocate={{{w},{a}}}")), "{text}");
    let back: Program = text.parse().unwrap();
    assert_eq!(back, p);
    assert_eq!(Builder::from_program(&p).unwrap().finish(p.results()).unwrap(), p);
    // A colocation with code that dies goes with it.
    let mut b = Builder::from_program(&p).unwrap();
    let dead = b.neg(x).unwrap();
    let f = b.colocate_with(dead, |b| b.neg(x)).unwrap();
    let q = b.finish(&[f]).unwrap().without_dead_code();
    assert!(q.instrs().iter().all(|i| i.colocate.is_empty()), "{q}");
}

#[test]
fn gradients_are_placed_beside_what_they_derive_from() {
    let mut b = Builder::new();
    let w = b.device("/device:CPU:1", |b| b.param("w", spec("f64[3,2]"))).unwrap();
    let x = b.param("x", spec("f64[4,3]")).unwrap();
    let h = b.device("/device:CPU:2", |b| b.matmul(x, w)).unwrap();
    let t = b.tanh(h).unwrap();
    let loss = b.reduce_sum(t, &[0, 1], false).unwrap();
    let p = b.finish(&[loss]).unwrap();
    let g = crate::grad(&p, loss, &[w]).unwrap();
    let n = p.instrs().len();
    // Every instruction autodiff added is colocated with a forward instruction and
    // requested where it is.
    for i in &g.instrs()[n..] {
        let [target] = i.colocate[..] else { panic!("{g}") };
        let fwd = g.instr(target).expect("colocated with an instruction");
        assert_eq!(i.device, fwd.device, "{g}");
    }
    assert!(g.instrs()[n..].iter().any(|i| i.device == "/device:CPU:2"), "{g}");
}

#[test]
fn reused_parameters_are_one_parameter_read_once_per_device() {
    let mut b = Builder::new();
    let x = b.param("x", spec("f64[3]")).unwrap();
    let (w0, y0, w1, w1b, w2) = b
        .reuse_params(|b| {
            let w0 = b.device("CPU:0", |b| b.scope("l", |b| b.param("w", spec("f64[3]"))))?;
            let y0 = b.device("CPU:0", |b| b.scope("l", |b| b.param("w", spec("f64[3]"))))?;
            let w1 = b.device("CPU:1", |b| b.scope("l", |b| b.param("w", spec("f64[3]"))))?;
            let w1b = b.device("CPU:1", |b| b.scope("l", |b| b.param("w", spec("f64[3]"))))?;
            let w2 = b.scope("l", |b| b.param("w", spec("f64[3]")))?;
            Ok((w0, y0, w1, w1b, w2))
        })
        .unwrap();
    assert_eq!((w0, y0, w2), (w0, w0, w0), "same device or no request: the parameter");
    assert_eq!(w1, w1b, "one read per device");
    assert_ne!(w1, w0);
    // Outside `reuse_params` a name is declared once; inside, a spec must match.
    assert!(matches!(b.param("l.w", spec("f64[3]")), Err(Error::DuplicateName { .. })));
    let e = b.reuse_params(|b| b.scope("l", |b| b.param("w", spec("f64[4]")))).unwrap_err();
    assert!(matches!(&e, Error::Type { op: "param", .. }), "{e}");
    let fresh = b.reuse_params(|b| b.param("v", spec("f64[3]"))).unwrap();
    let s = b.add(w1, fresh).unwrap();
    let t = b.mul(s, x).unwrap();
    let p = b.finish(&[t]).unwrap();
    let names: Vec<&str> = p.params().iter().map(|q| q.name.as_str()).collect();
    assert_eq!(names, ["x", "l.w", "v"]);
    let copies: Vec<_> = p.instrs().iter().filter(|i| matches!(i.op, Op::Convert { .. })).collect();
    let [copy] = copies[..] else { panic!("one copy: {p}") };
    assert_eq!((copy.args.as_slice(), copy.device.as_str()), (&[Value(1)][..], "/device:CPU:1"));
    let run = |p: &Program, inputs: Vec<Tensor>| crate::reference::evaluate(p, &inputs).unwrap();
    let xs = Tensor::f64(&[3], vec![1.0, 2.0, 3.0]).unwrap();
    let ws = Tensor::f64(&[3], vec![0.5, -1.0, 2.0]).unwrap();
    let vs = Tensor::f64(&[3], vec![1.0, 1.0, 1.0]).unwrap();
    assert_eq!(run(&p, vec![xs, ws, vs])[0].to_f64(), vec![1.5, 0.0, 9.0]);
}

#[test]
fn a_values_cotangent_is_summed_per_device_then_beside_the_value() {
    // `x` on CPU:0 is read twice on CPU:1 and twice on CPU:2: its gradient adds the
    // two contributions on each of those devices, then the two sums on CPU:0.
    let mut b = Builder::new();
    let x = b.device("CPU:0", |b| b.param("x", spec("f64[3]"))).unwrap();
    let on = |b: &mut Builder, d: &str, f: fn(&mut Builder, Value) -> crate::Result<Value>| {
        b.device(d, |b| f(b, x)).unwrap()
    };
    let a1 = on(&mut b, "CPU:1", |b, x| b.sin(x));
    let b1 = on(&mut b, "CPU:2", |b, x| b.cos(x));
    let a2 = on(&mut b, "CPU:1", |b, x| b.exp(x));
    let b2 = on(&mut b, "CPU:2", |b, x| b.tanh(x));
    let (s1, s2) = (b.add(a1, b1).unwrap(), b.add(a2, b2).unwrap());
    let s = b.add(s1, s2).unwrap();
    let loss = b.device("CPU:3", |b| b.reduce_sum(s, &[0], false)).unwrap();
    let p = b.finish(&[loss]).unwrap();
    let g = crate::grad(&p, loss, &[x]).unwrap();
    let dx = g.instr(g.results()[1]).unwrap();
    assert_eq!(dx.device, "/device:CPU:0", "{g}");
    let from: Vec<&str> = dx.args.iter().map(|a| g.instr(*a).unwrap().device.as_str()).collect();
    assert_eq!(from, ["/device:CPU:2", "/device:CPU:1"], "{g}");
    // And the gradient is right: cos x - sin x + exp x + 1 - tanh² x.
    let xs = vec![0.3, -1.2, 2.0];
    let out = crate::reference::evaluate(&g, &[Tensor::f64(&[3], xs.clone()).unwrap()]).unwrap();
    for (got, x) in out[1].to_f64().iter().zip(&xs) {
        let want = x.cos() - x.sin() + x.exp() + 1.0 - x.tanh().powi(2);
        assert!((got - want).abs() < 1e-12, "{got} vs {want}");
    }
}

#[test]
fn a_kernel_is_chosen_by_tensorflows_type_attribute() {
    use crate::Catalogue;
    let mut b = Builder::new();
    let x = b.param("x", spec("f32[3]")).unwrap();
    let i = b.param("i", spec("i32[3]")).unwrap();
    let up = b.convert(x, DType::F64).unwrap();
    let down = b.convert(up, DType::F32).unwrap();
    let p = b.lt(x, down).unwrap();
    let sel = b.select(p, up, up).unwrap();
    let hot = b.one_hot(i, 4, DType::F64).unwrap();
    let prog = b.finish(&[sel, hot]).unwrap();
    let dtype = |v: Value| Catalogue::kernel_dtype(&prog, prog.instr(v).unwrap());
    assert_eq!(dtype(up), DType::F64, "Cast needs its destination's kernel");
    assert_eq!(dtype(down), DType::F64, "and its source's");
    assert_eq!(dtype(p), DType::F32);
    assert_eq!(dtype(sel), DType::F64, "Select's T is its values' dtype");
    assert_eq!(dtype(hot), DType::F64, "OneHot's T is its result's");
}

/// Float → int `convert` truncates toward zero and saturates, NaN → 0, as XLA does:
/// JAX 0.10.2's `jit` maps f32 [3e9, -3e9, NaN, inf, -inf, 2.7, -2.7] to i32
/// [2147483647, -2147483648, 0, 2147483647, -2147483648, 2, -2]. Both interpreters, from
/// both float dtypes, into every integer dtype programs compute in.
#[test]
fn float_to_int_convert_saturates_as_xla_does() {
    let inputs = [3e9, -3e9, f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 2.7, -2.7, 1e20, -1e20];
    let i32_want = [i32::MAX, i32::MIN, 0, i32::MAX, i32::MIN, 2, -2, i32::MAX, i32::MIN];
    let i64_want =
        [3_000_000_000, -3_000_000_000, 0, i64::MAX, i64::MIN, 2, -2, i64::MAX, i64::MIN];
    for from in [DType::F32, DType::F64] {
        for to in [DType::I32, DType::I64] {
            let mut b = Builder::new();
            let x = b.param("x", TensorSpec::new(from, "[9]".parse().unwrap())).unwrap();
            let y = b.convert(x, to).unwrap();
            let p = b.finish(&[y]).unwrap();
            let feed = [Tensor::from_f64(from, &[9], &inputs).unwrap()];
            let want: Vec<f64> = match to {
                DType::I32 => i32_want.iter().map(|&v| f64::from(v)).collect(),
                _ => i64_want.iter().map(|&v| v as f64).collect(),
            };
            let reference = crate::reference::evaluate(&p, &feed).unwrap();
            let fast = crate::fast::evaluate(&p, &feed).unwrap();
            for (name, got) in [("reference", &reference[0]), ("fast", &fast[0])] {
                assert_eq!(got.dtype(), to, "{name} {from}->{to}");
                // f32's 3e9 is 3000000000 exactly; i64's extremes compare as f64.
                assert_eq!(got.to_f64(), want, "{name} {from}->{to}");
            }
            if to == DType::I64 {
                let exact: Vec<i64> = reference[0].as_slice::<i64>().unwrap().to_vec();
                assert_eq!(exact, i64_want, "{from}->i64 exactly");
            }
        }
    }
}

/// A value of a dtype the interpreters do not compute in (the unsigned and narrow
/// integers) is refused where it would enter a program: a parameter, or an
/// instruction's result (a constant, an iota, a one-hot, a convert, a receive), built
/// or parsed. Half precision (bf16, f16) is computed.
#[test]
fn ops_refuse_dtypes_the_interpreters_cannot_compute() {
    let parsed = "%0 = u16[] constant(), value=1\nreturn %0".parse::<Program>();
    assert!(
        matches!(&parsed, Err(Error::Parse { line: 1, problem, .. }) if problem.contains("dtype u16")),
        "{parsed:?}"
    );
    let mut b = Builder::new();
    let e = b.iota(DType::U8, &[3], 0).unwrap_err();
    assert!(matches!(e, Error::UnsupportedDType { dtype: DType::U8, .. }), "{e:?}");
    assert!(b.constant(1.0, DType::I16).is_err());
    let i = b.param("i", spec("i32[4]")).unwrap();
    assert!(b.one_hot(i, 3, DType::U32).is_err());
    assert!(b.convert(i, DType::U16).is_err());
    assert!(b.param("h", spec("u8[2]")).is_err());
    // What is supported still builds.
    for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16, DType::I32, DType::I64] {
        assert!(b.iota(dtype, &[3], 0).is_ok() && b.constant(1.0, dtype).is_ok());
    }
    assert!(b.one_hot(i, 3, DType::F16).is_ok() && b.param("g", spec("bf16[2]")).is_ok());
}

/// A buffer sized by a program's shapes that the allocator cannot give is an error of
/// the run, not an abort of the process (8 TiB of f64, past any machine's memory and
/// swap), in both interpreters and in `Executable::buffer`.
#[test]
fn a_buffer_too_large_for_memory_is_an_error_not_an_abort() {
    let huge = 1usize << 40;
    let mut b = Builder::new();
    let one = b.constant(1.0, DType::F64).unwrap();
    let wide = b.broadcast_to(one, &[huge]).unwrap();
    let program = b.finish(&[wide]).unwrap();
    let fast = crate::fast::Executable::compile(&program, crate::fast::Options::for_devices(1));
    let err = fast.run(&[], &crate::Env::local()).unwrap_err();
    assert!(err.to_string().contains("memory"), "{err}");
    let spec = TensorSpec::new(DType::F64, meshwork_types::Shape::new(&[huge]).unwrap());
    assert!(fast.buffer(&spec).unwrap_err().to_string().contains("memory"));
    let err = crate::reference::evaluate(&program, &[]).unwrap_err();
    assert!(err.to_string().contains("memory"), "{err}");
}

/// Attention by brute force in f64: for each query, a softmax over the keys it sees
/// (causal: those up to its position plus `Tk − Tq`), then the values so weighted.
#[allow(clippy::too_many_arguments)]
fn attention_by_hand(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    [b, h, tq, tk, d, dv]: [usize; 6],
    scale: f64,
    causal: bool,
) -> Vec<f64> {
    let mut out = vec![0.0; b * h * tq * dv];
    for bh in 0..b * h {
        for i in 0..tq {
            let seen = if causal { i + tk - tq + 1 } else { tk };
            let s: Vec<f64> = (0..seen)
                .map(|j| {
                    (0..d).map(|x| q[(bh * tq + i) * d + x] * k[(bh * tk + j) * d + x]).sum::<f64>()
                        * scale
                })
                .collect();
            let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
            for (j, sj) in s.iter().enumerate() {
                let w = (sj - m).exp() / z;
                for y in 0..dv {
                    out[(bh * tq + i) * dv + y] += w * v[(bh * tk + j) * dv + y];
                }
            }
        }
    }
    out
}

/// Heads `[b, h, t, d]` of f64 from `seed`, in `[-2, 2)`.
fn heads(dims: [usize; 4], seed: u64) -> Tensor {
    let n: usize = dims.iter().product();
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let values = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 11) as f64 / (1u64 << 53) as f64 * 4.0 - 2.0
        })
        .collect();
    Tensor::f64(&dims, values).unwrap()
}

proptest! {
    /// `attention` on both interpreters equals attention computed by hand, causal or
    /// not, scaled by multiplying or dividing, for any head sizes.
    #[test]
    fn prop_attention_is_softmax_weighted_values(
        (b, h, tq, extra, d, dv) in (1usize..3, 1usize..3, 1usize..5, 0usize..3, 1usize..5, 1usize..4),
        causal in any::<bool>(),
        divide in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let tk = tq + extra;
        let (q, k, v) = (heads([b, h, tq, d], seed), heads([b, h, tk, d], seed ^ 1), heads([b, h, tk, dv], seed ^ 2));
        let a = crate::AttentionSpec { scale: 0.7, divide, causal };
        let mut bl = Builder::new();
        let pq = bl.param("q", q.spec()).unwrap();
        let pk = bl.param("k", k.spec()).unwrap();
        let pv = bl.param("v", v.spec()).unwrap();
        let out = bl.attention(pq, pk, pv, a).unwrap();
        let p = bl.finish(&[out]).unwrap();
        let want = attention_by_hand(
            &q.to_f64(), &k.to_f64(), &v.to_f64(), [b, h, tq, tk, d, dv],
            if divide { 1.0 / 0.7 } else { 0.7 }, causal,
        );
        let inputs = [q, k, v];
        for got in [crate::reference::evaluate(&p, &inputs).unwrap(), crate::fast::evaluate(&p, &inputs).unwrap()] {
            prop_assert_eq!(got[0].shape(), &[b, h, tq, dv]);
            for (g, w) in got[0].to_f64().iter().zip(&want) {
                prop_assert!((g - w).abs() <= 1e-12 * (1.0 + w.abs()), "{} vs {}", g, w);
            }
        }
    }

    /// The gradients of `attention` (its `attention_grad`s) equal central finite
    /// differences of the attention computed by hand.
    #[test]
    fn prop_attention_gradients_are_finite_differences(
        (tq, extra, d) in (1usize..4, 0usize..2, 1usize..4),
        causal in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let (b, h, tk, dv) = (1, 2, tq + extra, 2);
        let q = heads([b, h, tq, d], seed);
        let k = heads([b, h, tk, d], seed ^ 1);
        let v = heads([b, h, tk, dv], seed ^ 2);
        let weights = heads([b, h, tq, dv], seed ^ 3).to_f64();
        let a = crate::AttentionSpec { scale: 0.5, divide: false, causal };
        // loss = Σ attention · weights.
        let mut bl = Builder::new();
        let pq = bl.param("q", q.spec()).unwrap();
        let pk = bl.param("k", k.spec()).unwrap();
        let pv = bl.param("v", v.spec()).unwrap();
        let pw = bl.param("w", Tensor::f64(&[b, h, tq, dv], weights.clone()).unwrap().spec()).unwrap();
        let out = bl.attention(pq, pk, pv, a).unwrap();
        let prod = bl.mul(out, pw).unwrap();
        let loss = bl.reduce_sum(prod, &[0, 1, 2, 3], false).unwrap();
        let forward = bl.finish(&[loss]).unwrap();
        let g = crate::grad(&forward, forward.results()[0], &[Value(0), Value(1), Value(2)]).unwrap();
        let fused = g.instrs().iter().any(|i| matches!(i.op, Op::AttentionGrad { .. }));
        prop_assert!(fused, "the gradient holds attention_grad");
        let w = Tensor::f64(&[b, h, tq, dv], weights.clone()).unwrap();
        let got = crate::fast::evaluate(&g, &[q.clone(), k.clone(), v.clone(), w]).unwrap();
        let dims = [b, h, tq, tk, d, dv];
        let loss_of = |q: &[f64], k: &[f64], v: &[f64]| -> f64 {
            attention_by_hand(q, k, v, dims, 0.5, causal).iter().zip(&weights).map(|(a, w)| a * w).sum()
        };
        let base = [q.to_f64(), k.to_f64(), v.to_f64()];
        for wrt in 0..3 {
            let grad = got[1 + wrt].to_f64();
            for i in 0..base[wrt].len() {
                let eps = 1e-6;
                let mut plus = base.clone();
                plus[wrt][i] += eps;
                let mut minus = base.clone();
                minus[wrt][i] -= eps;
                let fd = (loss_of(&plus[0], &plus[1], &plus[2]) - loss_of(&minus[0], &minus[1], &minus[2])) / (2.0 * eps);
                prop_assert!((grad[i] - fd).abs() <= 1e-6 * (1.0 + fd.abs()), "d{} [{}]: {} vs {}", wrt, i, grad[i], fd);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
    /// The fast interpreter's fused attention (queries 64 at a time, each block against
    /// the keys its last query sees) and its gradients, all three at once or each
    /// alone, equal the reference interpreter's run of their definitions, in f64 and
    /// f32, on 1 to 3 threads, at lengths across the blocks' edges.
    #[test]
    fn prop_fused_attention_and_gradients_equal_their_definitions(
        (b, h, tq, extra, d, dv) in (1usize..3, 1usize..4, 1usize..150, 0usize..4, 1usize..9, 1usize..9),
        causal in any::<bool>(),
        divide in any::<bool>(),
        f32 in any::<bool>(),
        threads in 1usize..4,
        alone in 0usize..4,
        seed in any::<u64>(),
    ) {
        let tk = tq + extra;
        let dtype = if f32 { DType::F32 } else { DType::F64 };
        let cast = |t: Tensor| if f32 { Tensor::from_f64(DType::F32, t.shape(), &t.to_f64()).unwrap() } else { t };
        let q = cast(heads([b, h, tq, d], seed));
        let k = cast(heads([b, h, tk, d], seed ^ 1));
        let v = cast(heads([b, h, tk, dv], seed ^ 2));
        let w = cast(heads([b, h, tq, dv], seed ^ 3));
        let a = crate::AttentionSpec { scale: 0.3, divide, causal };
        let mut bl = Builder::new();
        let pq = bl.param("q", q.spec()).unwrap();
        let pk = bl.param("k", k.spec()).unwrap();
        let pv = bl.param("v", v.spec()).unwrap();
        let pw = bl.param("w", w.spec()).unwrap();
        let out = bl.attention(pq, pk, pv, a).unwrap();
        let prod = bl.mul(out, pw).unwrap();
        let loss = bl.reduce_sum(prod, &[0, 1, 2, 3], false).unwrap();
        let forward = bl.finish(&[loss, out]).unwrap();
        // All three gradients, or one alone (`alone` < 3).
        let wrt: Vec<Value> = if alone < 3 { vec![Value(alone as u32)] } else { (0..3).map(|i| Value(i as u32)).collect() };
        let g = crate::grad(&forward, forward.results()[0], &wrt).unwrap();
        let bl = Builder::from_program(&g).unwrap();
        let results: Vec<Value> = g.results().iter().copied().chain([forward.results()[1]]).collect();
        let g = bl.finish(&results).unwrap();
        prop_assert_eq!(g.spec(results[0]).unwrap().dtype, dtype);
        let inputs = [q, k, v, w];
        let want = crate::reference::evaluate(&g, &inputs).unwrap();
        let exe = crate::fast::Executable::compile(&g, crate::fast::Options::default().threads(threads));
        // All three gradients run as one step (the later two with the first).
        prop_assert_eq!(exe.grouped_attention_grads(), if alone == 3 { 2 } else { 0 });
        let got = exe.run(&inputs, &crate::Env::local()).unwrap();
        let tol = if f32 { 2e-5 } else { 1e-12 };
        for (r, (x, y)) in got.iter().zip(&want).enumerate() {
            prop_assert_eq!(x.shape(), y.shape());
            let (x, y) = (x.to_f64(), y.to_f64());
            let scale = 1.0 + y.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            for (e, (p, q)) in x.iter().zip(&y).enumerate() {
                prop_assert!((p - q).abs() <= tol * scale, "result {} element {}: {} vs {}", r, e, p, q);
            }
        }
    }
}

/// `attention_grad`s of one attention asking twice for one operand's gradient (a
/// program written by hand, not by `grad`): the repeat runs on its own, and every
/// result equals the reference's.
#[test]
fn repeated_attention_gradients_each_get_their_own_result() {
    let a = crate::AttentionSpec { scale: 0.5, divide: false, causal: true };
    let mut bl = Builder::new();
    let mut params = Vec::new();
    for (name, dims) in
        [("q", [1, 2, 70, 4]), ("k", [1, 2, 70, 4]), ("v", [1, 2, 70, 3]), ("d", [1, 2, 70, 3])]
    {
        let spec = TensorSpec::new(DType::F64, meshwork_types::Shape::new(&dims).unwrap());
        params.push(bl.param(name, spec).unwrap());
    }
    let grads: Vec<Value> = [1, 0, 1, 2, 2]
        .into_iter()
        .map(|wrt| bl.push(Op::AttentionGrad { attention: a, wrt }, &params).unwrap())
        .collect();
    let p = bl.finish(&grads).unwrap();
    let inputs: Vec<Tensor> = p
        .params()
        .iter()
        .enumerate()
        .map(|(i, q)| heads(q.spec.shape.dims().try_into().unwrap(), 7 + i as u64))
        .collect();
    let exe = crate::fast::Executable::compile(&p, crate::fast::Options::default());
    // The first of each operand's gradients join the first's step: wrt 0 and 2.
    assert_eq!(exe.grouped_attention_grads(), 2);
    let want = crate::reference::evaluate(&p, &inputs).unwrap();
    for _ in 0..2 {
        let got = exe.run(&inputs, &crate::Env::local()).unwrap();
        for (r, (x, y)) in got.iter().zip(&want).enumerate() {
            let (x, y) = (x.to_f64(), y.to_f64());
            let scale = 1.0 + y.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            for (e, (p, q)) in x.iter().zip(&y).enumerate() {
                assert!((p - q).abs() <= 1e-12 * scale, "result {r} element {e}: {p} vs {q}");
            }
        }
    }
}

/// Attention refuses heads that do not agree, and causal attention over fewer keys
/// than queries; its gradient refuses a cotangent of the wrong shape and `wrt` past
/// the values; a second derivative has no rule.
#[test]
fn attention_refuses_what_it_cannot_take() {
    let a = crate::AttentionSpec { scale: 1.0, divide: false, causal: true };
    let e = infer(Op::Attention(a), &["f32[1,2,3,4]", "f32[1,2,3,5]", "f32[1,2,3,4]"]).unwrap_err();
    assert!(e.to_string().contains("heads do not agree"), "{e}");
    let e = infer(Op::Attention(a), &["f32[1,2,4,4]", "f32[1,2,3,4]", "f32[1,2,3,4]"]).unwrap_err();
    assert!(e.to_string().contains("causal attention of 4 queries over 3 keys"), "{e}");
    let e = infer(Op::Attention(a), &["f32[1,2,3,4]", "f64[1,2,3,4]", "f32[1,2,3,4]"]).unwrap_err();
    assert!(e.to_string().contains("differ in dtype"), "{e}");
    let e = infer(Op::Attention(a), &["i32[1,2,3,4]", "i32[1,2,3,4]", "i32[1,2,3,4]"]).unwrap_err();
    assert!(e.to_string().contains("float"), "{e}");
    assert_eq!(
        infer(Op::Attention(a), &["f32[1,2,3,4]", "f32[1,2,5,4]", "f32[1,2,5,7]"]).unwrap(),
        "f32[1,2,3,7]"
    );
    let g = |wrt| Op::AttentionGrad { attention: a, wrt };
    let qkv = ["f32[1,2,3,4]", "f32[1,2,5,4]", "f32[1,2,5,7]"];
    assert_eq!(infer(g(1), &[qkv[0], qkv[1], qkv[2], "f32[1,2,3,7]"]).unwrap(), "f32[1,2,5,4]");
    let e = infer(g(3), &[qkv[0], qkv[1], qkv[2], "f32[1,2,3,7]"]).unwrap_err();
    assert!(e.to_string().contains("wrt is 3"), "{e}");
    let e = infer(g(0), &[qkv[0], qkv[1], qkv[2], "f32[1,2,3,4]"]).unwrap_err();
    assert!(e.to_string().contains("cotangent"), "{e}");
    // attention_grad has no transpose rule of its own.
    let mut b = Builder::new();
    let ps: Vec<Value> = [qkv[0], qkv[1], qkv[2], "f32[1,2,3,7]"]
        .iter()
        .enumerate()
        .map(|(i, s)| b.param(&format!("p{i}"), spec(s)).unwrap())
        .collect();
    let d = b.push(g(0), &ps).unwrap();
    let l = b.reduce_sum(d, &[0, 1, 2, 3], false).unwrap();
    let p = b.finish(&[l]).unwrap();
    let e = crate::grad(&p, p.results()[0], &[Value(0)]).unwrap_err();
    assert!(matches!(e, Error::NoTransposeRule { op: "attention_grad", .. }), "{e}");
}

proptest! {
    /// The fast interpreter converts between float dtypes as the reference does, bit
    /// for bit: half precision widened, f32 and f64 either way, narrowed to half
    /// precision (its own kernel where it has one, the reference's otherwise).
    #[test]
    fn prop_fast_float_conversions_are_the_reference_s(
        values in proptest::collection::vec(
            prop_oneof![-7e4f64..7e4, -1e-3f64..1e-3, Just(0.0), Just(1.0 + f64::EPSILON)],
            1..300,
        ),
        from in prop_oneof![Just(DType::BF16), Just(DType::F16), Just(DType::F32), Just(DType::F64)],
        to in prop_oneof![Just(DType::BF16), Just(DType::F16), Just(DType::F32), Just(DType::F64)],
    ) {
        let x = Tensor::from_f64(from, &[values.len()], &values).unwrap();
        let mut b = Builder::new();
        let p = b.param("x", spec(&format!("{from}[{}]", values.len()))).unwrap();
        let y = b.convert(p, to).unwrap();
        let program = b.finish(&[y]).unwrap();
        let fast = crate::fast::evaluate(&program, std::slice::from_ref(&x)).unwrap();
        let reference = crate::reference::evaluate(&program, std::slice::from_ref(&x)).unwrap();
        prop_assert_eq!(fast[0].dtype(), to);
        prop_assert_eq!(&fast[0], &reference[0], "{} to {}", from, to);
        // A widening is exact (an oracle of its own): the same values.
        if to.size_in_bytes() > from.size_in_bytes() && !(from == DType::F16 && to == DType::BF16) {
            prop_assert_eq!(fast[0].to_f64(), x.to_f64(), "{} to {}", from, to);
        }
    }
}

/// The fast interpreter reads optimization barriers through (no copy) and computes
/// what the reference does, a barrier read by later instructions, one whose value is
/// a result, and a half-precision one alike.
#[test]
fn the_fast_interpreter_reads_barriers_through() {
    for dtype in ["f32", "bf16"] {
        let mut b = Builder::new();
        let x = b.param("x", spec(&format!("{dtype}[4]"))).unwrap();
        let fenced = b.optimization_barrier(x).unwrap();
        let twice = b.optimization_barrier(fenced).unwrap();
        let y = b.mul(twice, fenced).unwrap();
        let p = b.finish(&[y, fenced]).unwrap();
        let feed =
            [Tensor::from_f64(dtype.parse().unwrap(), &[4], &[1.5, -2.0, 0.25, 3.0]).unwrap()];
        let fast = crate::fast::evaluate(&p, &feed).unwrap();
        let reference = crate::reference::evaluate(&p, &feed).unwrap();
        assert_eq!(fast, reference, "{dtype}");
        assert_eq!(fast[1], feed[0], "{dtype}: a barrier's value is its operand");
    }
    // Read through, a barrier holds no copy: a step's peak is the barrier-free one's.
    let peak = |fenced: bool| {
        let mut b = Builder::new();
        let x = b.param("x", spec("f32[4096]")).unwrap();
        let read = if fenced { b.optimization_barrier(x).unwrap() } else { x };
        // A reduction reads it (no fused group holds the barrier's copy in registers).
        let y = b.reduce_sum(read, &[0], false).unwrap();
        let p = b.finish(&[y]).unwrap();
        crate::fast::Executable::compile(&p, crate::fast::Options::default()).peak_bytes()
    };
    assert_eq!(peak(true), peak(false));
}

/// A training loop's steady state makes no fresh buffers: run after run, with the
/// state read in place, its results taken as the next state and the old state given
/// back ([`recycle`](crate::fast::Executable::recycle)), nothing is allocated fresh
/// after the first runs — even when the run's size classes peak at different times
/// (sixteen products held together early, four state-sized ones late), so that what
/// the pool must keep passes the plan's peak.
#[test]
fn a_training_loop_reuses_its_buffers_after_the_first_run() {
    use crate::fast::{Executable, Input, Options};
    let mut b = Builder::new();
    let s = b.param("s", spec("f32[32,32]")).unwrap();
    let m = b.param("m", spec("f32[32,32]")).unwrap();
    let x = b.param("x", spec("f32[16,16]")).unwrap();
    let mut products = vec![b.dot_general(x, x, &[1], &[0], &[], &[]).unwrap()];
    for _ in 1..16 {
        let last = *products.last().unwrap();
        products.push(b.dot_general(last, x, &[1], &[0], &[], &[]).unwrap());
    }
    let mut total = products[0];
    for &p in &products[1..] {
        total = b.add(total, p).unwrap();
    }
    let r = b.reduce_sum(total, &[0, 1], false).unwrap();
    let mut late = vec![b.dot_general(s, s, &[1], &[0], &[], &[]).unwrap()];
    for _ in 1..4 {
        let last = *late.last().unwrap();
        late.push(b.dot_general(last, s, &[1], &[0], &[], &[]).unwrap());
    }
    let mut t = late[0];
    for &l in &late[1..] {
        t = b.add(t, l).unwrap();
    }
    let r = b.broadcast_to(r, &[32, 32]).unwrap();
    let s2 = b.mul(t, r).unwrap();
    let s2 = b.tanh(s2).unwrap();
    let m2 = b.add(m, s2).unwrap();
    let p = b.finish(&[s2, m2]).unwrap();
    let exe = Executable::compile(&p, Options { pool_bytes: 0, ..Options::default() });
    let x =
        Tensor::f32(&[16, 16], (0..256).map(|k| (k as f32 * 0.01).sin() * 0.05).collect()).unwrap();
    let mut state = vec![
        Tensor::f32(&[32, 32], vec![0.01; 1024]).unwrap(),
        Tensor::f32(&[32, 32], vec![0.0; 1024]).unwrap(),
    ];
    let mut after = Vec::new();
    for _ in 0..6 {
        let inputs =
            vec![Input::Borrowed(&state[0]), Input::Borrowed(&state[1]), Input::Borrowed(&x)];
        let out = exe.run_inputs(inputs, &crate::Env::local()).unwrap();
        exe.recycle(std::mem::replace(&mut state, out));
        after.push(exe.fresh_bytes());
    }
    assert!(after[0] >= 2 * 4096, "{after:?}");
    assert!(after[2..].iter().all(|&f| f == after[1]), "fresh bytes after each run: {after:?}");
}

/// A cross-entropy program of `logits` against `labels` (of `label_dtype`), weighted by
/// `w` per position: results the weighted sum, the per-position losses and the
/// gradient of the sum with respect to the logits. With `computed` the loss is of
/// `1.5 · logits`, a buffer of the run's own that dies at the gradient (which the
/// fast interpreter then writes over it).
fn cross_entropy_program(logits: &TensorSpec, label_dtype: DType, computed: bool) -> Program {
    let dims = logits.shape.dims();
    let positions = meshwork_types::Shape::new(&dims[..dims.len() - 1]).unwrap();
    let mut bl = Builder::new();
    let x = bl.param("logits", logits.clone()).unwrap();
    let y = bl.param("labels", TensorSpec::new(label_dtype, positions.clone())).unwrap();
    let w = bl.param("w", TensorSpec::new(logits.dtype, positions)).unwrap();
    let z = if computed {
        let c = bl.constant(1.5, logits.dtype).unwrap();
        bl.mul(x, c).unwrap()
    } else {
        x
    };
    let per = bl.cross_entropy(z, y).unwrap();
    let weighted = bl.mul(per, w).unwrap();
    let axes: Vec<isize> = (0..dims.len() as isize - 1).collect();
    let loss = bl.reduce_sum(weighted, &axes, false).unwrap();
    let forward = bl.finish(&[loss, per]).unwrap();
    let g = crate::grad(&forward, forward.results()[0], &[Value(0)]).unwrap();
    let bl = Builder::from_program(&g).unwrap();
    let results: Vec<Value> = g.results().iter().copied().chain([forward.results()[1]]).collect();
    bl.finish(&results).unwrap()
}

/// Labels for `rows` rows of `classes`: in range, and with `outside` some below 0 or
/// past the last class.
fn labels(rows: usize, classes: usize, outside: bool, seed: u64) -> Vec<i64> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let n = classes as i64;
    (0..rows)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let c = (x >> 20) as i64 % (n + 3);
            match (c - n, outside) {
                (k, _) if k < 0 => c,
                (k, true) => [-1, n, n + 7][k as usize],
                (_, false) => c % n,
            }
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// The fast interpreter's fused cross-entropy and its gradient equal the reference
    /// interpreter's run of their definitions (a log-softmax, a one-hot product and a
    /// sum), in f64 and f32, on 1 to 3 threads, for rows across the lanes' edges and
    /// past the size that spreads them over threads, for labels in and outside range,
    /// the gradient into a buffer of its own or over the logits.
    #[test]
    fn prop_fused_cross_entropy_and_gradient_equal_their_definitions(
        (b, t, classes) in (1usize..4, 1usize..40, 1usize..700),
        spread in 0.1f64..30.0,
        outside in any::<bool>(),
        f32 in any::<bool>(),
        i32_labels in any::<bool>(),
        threads in 1usize..4,
        computed in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let dtype = if f32 { DType::F32 } else { DType::F64 };
        let label_dtype = if i32_labels { DType::I32 } else { DType::I64 };
        let cast = |t: Tensor| Tensor::from_f64(dtype, t.shape(), &t.to_f64()).unwrap();
        let raw = heads([b, t, classes, 1], seed).to_f64();
        let x = cast(Tensor::f64(&[b, t, classes], raw.iter().map(|v| v * spread).collect()).unwrap());
        let w = cast(heads([b, t, 1, 1], seed ^ 5).reshape(&[b, t]).unwrap());
        let ids = labels(b * t, classes, outside, seed ^ 9);
        let y = Tensor::from_f64(label_dtype, &[b, t], &ids.iter().map(|&i| i as f64).collect::<Vec<_>>()).unwrap();
        let p = cross_entropy_program(&x.spec(), label_dtype, computed);
        let inputs = [x, y, w];
        let want = crate::reference::evaluate(&p, &inputs).unwrap();
        let exe = crate::fast::Executable::compile(&p, crate::fast::Options::default().threads(threads));
        let got = exe.run(&inputs, &crate::Env::local()).unwrap();
        // The gradient of logits the run made went over them; of a parameter, not.
        prop_assert_eq!(exe.losses_in_place(), usize::from(computed));
        let tol = if f32 { 2e-5 } else { 1e-12 };
        for (r, (x, y)) in got.iter().zip(&want).enumerate() {
            prop_assert_eq!(x.shape(), y.shape());
            let (x, y) = (x.to_f64(), y.to_f64());
            let scale = 1.0 + y.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            for (e, (p, q)) in x.iter().zip(&y).enumerate() {
                prop_assert!((p - q).abs() <= tol * scale, "result {} element {}: {} vs {}", r, e, p, q);
            }
        }
    }
}

/// A loss cotangent that is not finite makes the definition's whole gradient row NaN
/// (each `0 · t`), whatever the label; the fused kernel's too, into a buffer of its
/// own or over the logits.
#[test]
fn fused_cross_entropy_gradient_keeps_the_definitions_nan_rows() {
    for (dtype, computed) in [(DType::F32, false), (DType::F64, true), (DType::F32, true)] {
        let x = Tensor::from_f64(dtype, &[6, 3], &[0.5, -1.0, 2.0].repeat(6)).unwrap();
        let y = Tensor::from_f64(DType::I64, &[6], &[0.0, 1.0, 7.0, -1.0, 2.0, 1.0]).unwrap();
        let inf = f64::INFINITY;
        let w = Tensor::from_f64(dtype, &[6], &[1.0, inf, f64::NAN, -inf, 2.0, 1.0]).unwrap();
        let p = cross_entropy_program(&x.spec(), DType::I64, computed);
        let inputs = [x, y, w];
        let want = crate::reference::evaluate(&p, &inputs).unwrap()[1].to_f64();
        let got = crate::fast::Executable::compile(&p, crate::fast::Options::default())
            .run(&inputs, &crate::Env::local())
            .unwrap()[1]
            .to_f64();
        for (e, (a, b)) in got.iter().zip(&want).enumerate() {
            assert_eq!(a.is_nan(), b.is_nan(), "{dtype} element {e}: {got:?} vs {want:?}");
            assert!(a.is_nan() || (a - b).abs() < 1e-6, "{dtype} element {e}: {a} vs {b}");
        }
        assert!(got[3..12].iter().all(|v| v.is_nan()), "{got:?}");
    }
}

/// A row with a non-finite logit has the definition's NaN loss in the fused kernel
/// too, whatever its label; a finite row beside it keeps its loss, and the gradient
/// of a label outside the classes is 0.
#[test]
fn fused_cross_entropy_keeps_the_definitions_nan_rows() {
    for dtype in [DType::F32, DType::F64] {
        let rows: [[f64; 3]; 6] = [
            [1.0, 2.0, 3.0],
            [f64::NEG_INFINITY, 2.0, 3.0],
            [f64::INFINITY, 2.0, 3.0],
            [f64::NAN, 2.0, 3.0],
            [f64::NEG_INFINITY, 2.0, 3.0],
            [0.5, -1.0, 4.0],
        ];
        let x = Tensor::from_f64(dtype, &[6, 3], &rows.concat()).unwrap();
        let y = Tensor::from_f64(DType::I64, &[6], &[2.0, 1.0, 0.0, 2.0, 7.0, -1.0]).unwrap();
        let w = Tensor::from_f64(dtype, &[6], &[1.0; 6]).unwrap();
        let p = cross_entropy_program(&x.spec(), DType::I64, false);
        let inputs = [x, y, w];
        let want = crate::reference::evaluate(&p, &inputs).unwrap();
        let got = crate::fast::Executable::compile(&p, crate::fast::Options::default())
            .run(&inputs, &crate::Env::local())
            .unwrap();
        let (per, want_per) = (got[2].to_f64(), want[2].to_f64());
        for r in 0..6 {
            assert_eq!(
                per[r].is_nan(),
                want_per[r].is_nan(),
                "{dtype} row {r}: {per:?} vs {want_per:?}"
            );
        }
        assert!(per[1..5].iter().all(|v| v.is_nan()), "{per:?}");
        let lse = |r: [f64; 3]| r.iter().map(|v| v.exp()).sum::<f64>().ln();
        assert!((per[0] - (lse(rows[0]) - 3.0)).abs() < 1e-6, "{per:?}");
        assert_eq!(per[5], 0.0);
        assert_eq!(&got[1].to_f64()[15..], &[0.0; 3]);
    }
}

/// Cross-entropy refuses integer logits, float labels, labels of another shape and
/// logits with no class axis; its gradient a cotangent of the wrong shape.
#[test]
fn cross_entropy_refuses_what_it_cannot_take() {
    let e = infer(Op::CrossEntropy, &["i32[2,3]", "i32[2]"]).unwrap_err();
    assert!(e.to_string().contains("float"), "{e}");
    let e = infer(Op::CrossEntropy, &["f32[2,3]", "f32[2]"]).unwrap_err();
    assert!(e.to_string().contains("integers"), "{e}");
    let e = infer(Op::CrossEntropy, &["f32[2,3]", "i32[3]"]).unwrap_err();
    assert!(e.to_string().contains("without the class axis"), "{e}");
    let e = infer(Op::CrossEntropy, &["f32[]", "i32[]"]).unwrap_err();
    assert!(e.to_string().contains("class axis"), "{e}");
    assert_eq!(infer(Op::CrossEntropy, &["f64[2,4,3]", "i64[2,4]"]).unwrap(), "f64[2,4]");
    let e = infer(Op::CrossEntropyGrad, &["f32[2,3]", "i32[2]", "f32[3]"]).unwrap_err();
    assert!(e.to_string().contains("loss cotangent"), "{e}");
    assert_eq!(infer(Op::CrossEntropyGrad, &["f32[2,3]", "i32[2]", "f32[2]"]).unwrap(), "f32[2,3]");
}
