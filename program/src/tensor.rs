//! Host tensors as the interpreters hold them: `meshwork_types::Tensor`s in standard
//! (row-major, contiguous) layout, read and written as slices.
//!
//! Inside a run every buffer is such a tensor: a kernel's output is made 1-D from its
//! elements and takes the value's shape when it leaves the run, and an input that is
//! not in standard layout is copied into it once, on entry.

use meshwork_types::{Element, Tensor};
use ndarray::IxDyn;

pub(crate) use crate::infer::supported;

/// The elements of a buffer of `T` (standard layout, as every buffer of a run is).
pub(crate) fn elems<T: Element>(t: &Tensor) -> &[T] {
    match t.as_slice::<T>() {
        Some(s) => s,
        None => unreachable!(
            "a {} buffer (standard layout: {}) where the plan reads {}",
            t.dtype(),
            t.is_standard_layout(),
            T::DTYPE
        ),
    }
}

/// The elements of a buffer of `T`, mutably.
pub(crate) fn elems_mut<T: Element>(t: &mut Tensor) -> &mut [T] {
    let (dtype, standard) = (t.dtype(), t.is_standard_layout());
    match t.as_slice_mut::<T>() {
        Some(s) => s,
        None => unreachable!(
            "a {dtype} buffer (standard layout: {standard}) where the plan writes {}",
            T::DTYPE
        ),
    }
}

/// A run's buffer (standard layout, any shape of the same element count) under
/// `dims`, without copying.
pub(crate) fn shaped(t: Tensor, dims: &[usize]) -> Tensor {
    meshwork_types::map_tensor!(t, a => a
        .into_shape_with_order(IxDyn(dims))
        .expect("a standard-layout buffer of the value's element count"))
}
