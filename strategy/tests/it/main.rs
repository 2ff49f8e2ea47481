//! The strategy façade through its public API: the seed's checks and messages, TF's
//! base-API behaviours, properties of runs, variables, datasets and checkpoints.

mod api;
mod checkpoints;
// The hand-written MLP: the oracle the program layer's MLP is compared with.
#[path = "../../examples/common/mlp.rs"]
mod mlp;
mod oracle;
mod placed;
mod processes;
mod properties;
mod seed;
mod spmd;
mod training;

use meshwork_strategy::Tensor;
use ndarray::{ArrayD, IxDyn};

pub(crate) fn f64s(shape: &[usize], v: Vec<f64>) -> Tensor {
    Tensor::F64(ArrayD::from_shape_vec(IxDyn(shape), v).unwrap())
}

pub(crate) fn f32s(shape: &[usize], v: Vec<f32>) -> Tensor {
    Tensor::F32(ArrayD::from_shape_vec(IxDyn(shape), v).unwrap())
}

pub(crate) fn as_f64(t: &Tensor) -> Vec<f64> {
    match t {
        Tensor::F64(a) => a.iter().copied().collect(),
        Tensor::F32(a) => a.iter().map(|&x| x as f64).collect(),
        Tensor::I32(a) => a.iter().map(|&x| x as f64).collect(),
        Tensor::I64(a) => a.iter().map(|&x| x as f64).collect(),
        other => panic!("unexpected {other:?}"),
    }
}
