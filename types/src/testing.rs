//! proptest strategies for every vocabulary type (feature `proptest`).

use proptest::prelude::*;

use crate::{DType, DeviceId, ReduceOp, Shape, Tensor, TensorSpec};

/// Any device id.
pub fn device_id() -> impl Strategy<Value = DeviceId> {
    any::<u32>().prop_map(DeviceId)
}

/// Any dtype.
pub fn dtype() -> impl Strategy<Value = DType> {
    proptest::sample::select(DType::ALL.to_vec())
}

/// Any reduce op.
pub fn reduce_op() -> impl Strategy<Value = ReduceOp> {
    proptest::sample::select(ReduceOp::ALL.to_vec())
}

/// Shapes of rank `0..=max_rank` with every dim in `0..=max_dim`.
///
/// Keep `max_dim.pow(max_rank)` within `usize` (it is for any sizes a test allocates).
pub fn shape(max_rank: usize, max_dim: usize) -> impl Strategy<Value = Shape> {
    proptest::collection::vec(0..=max_dim, 0..=max_rank)
        .prop_map(|dims| Shape::new(&dims).expect("max_dim^max_rank fits in usize"))
}

/// Tensor specs over [`dtype`] and [`shape`].
pub fn tensor_spec(max_rank: usize, max_dim: usize) -> impl Strategy<Value = TensorSpec> {
    (dtype(), shape(max_rank, max_dim)).prop_map(|(dtype, shape)| TensorSpec { dtype, shape })
}

/// Tensors of any dtype over [`shape`], their elements any bit pattern (floats include
/// NaNs and infinities: compare them by [`Tensor::to_le_bytes`]).
pub fn tensor(max_rank: usize, max_dim: usize) -> impl Strategy<Value = Tensor> {
    tensor_spec(max_rank, max_dim).prop_flat_map(|spec| {
        let bytes = spec.byte_size().expect("small specs");
        proptest::collection::vec(any::<u8>(), bytes).prop_map(move |b| {
            Tensor::from_le_bytes(spec.dtype, spec.shape.dims(), &b).expect("as many bytes")
        })
    })
}
