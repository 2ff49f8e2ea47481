//! Parameters: the backends that hand a candle model its variables, and conversions
//! between candle tensors, flat buffers and the executor's tensors.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use candle_core::{DType, Device, Shape, Tensor, Var, WithDType};
use candle_nn::var_builder::SimpleBackend;
use meshwork_executor::Tensor as ExecTensor;
use ndarray::{ArrayD, IxDyn};

use crate::bucket::Kind;
use crate::{Error, Result};

/// A parameter as the model's builder asked for it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Param {
    /// Its name (the `VarBuilder` path).
    pub(crate) name: String,
    /// Its shape.
    pub(crate) shape: Vec<usize>,
    /// Its element type.
    pub(crate) kind: Kind,
}

impl Param {
    /// Its elements.
    pub(crate) fn len(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The element type of a candle dtype the bridge trains.
pub(crate) fn kind_of(name: &str, dtype: DType) -> Result<Kind> {
    match dtype {
        DType::F32 => Ok(Kind::F32),
        DType::F64 => Ok(Kind::F64),
        other => Err(Error::DType { name: name.to_string(), dtype: other }),
    }
}

#[derive(Default)]
struct Recorded {
    order: Vec<(String, Var)>,
    index: HashMap<String, usize>,
    preset: HashMap<String, Tensor>,
    /// Variables made by the builder's initializer (no preset value).
    initialized: Vec<String>,
    /// Calls of `get`.
    asked: usize,
}

/// A `VarBuilder` backend that creates each variable once, from a preset value when
/// it has one (else the builder's initializer), and records the order they were
/// asked for in: the registration order DDP buckets reverse.
#[derive(Clone, Default)]
pub(crate) struct Recorder(Arc<Mutex<Recorded>>);

impl Recorder {
    /// A recorder that gives `preset[name]` (cast to the asked dtype) to the builder.
    pub(crate) fn with_values(preset: HashMap<String, Tensor>) -> Recorder {
        Recorder(Arc::new(Mutex::new(Recorded { preset, ..Recorded::default() })))
    }

    /// The variables, in the order the builder asked for them.
    pub(crate) fn vars(&self) -> Vec<(String, Var)> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).order.clone()
    }

    /// Variables the builder's initializer made (no preset value was given).
    pub(crate) fn initialized(&self) -> Vec<String> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).initialized.clone()
    }

    /// How many times the builder asked for a variable (new or not).
    pub(crate) fn asked(&self) -> usize {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).asked
    }

    /// Preset values the builder never asked for.
    pub(crate) fn unused(&self) -> Vec<String> {
        let mut v: Vec<String> =
            self.0.lock().unwrap_or_else(PoisonError::into_inner).preset.keys().cloned().collect();
        v.sort();
        v
    }
}

impl SimpleBackend for Recorder {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let mut r = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        r.asked += 1;
        if let Some(&k) = r.index.get(name) {
            let t = r.order[k].1.as_tensor();
            if t.shape() != &s {
                candle_core::bail!("{name} was asked for as {:?} and as {s:?}", t.shape());
            }
            return Ok(t.clone());
        }
        let var = match r.preset.remove(name) {
            Some(t) => {
                if t.shape() != &s {
                    candle_core::bail!(
                        "{name}: the given value is {:?}, the model's {s:?}",
                        t.shape()
                    );
                }
                Var::from_tensor(&t.to_dtype(dtype)?.to_device(dev)?)?
            }
            None => {
                r.initialized.push(name.to_string());
                h.var(s, dtype, dev)?
            }
        };
        let k = r.order.len();
        r.index.insert(name.to_string(), k);
        r.order.push((name.to_string(), var.clone()));
        Ok(var.as_tensor().clone())
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        candle_core::bail!(
            "{name}: the bridge gives parameters by shape (use `get`, not `get_unchecked`)"
        )
    }

    fn contains_tensor(&self, name: &str) -> bool {
        let r = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        r.index.contains_key(name) || r.preset.contains_key(name)
    }
}

/// A `VarBuilder` backend over given variables (an FSDP step's gathered parameters):
/// the builder gets exactly these, by name and shape, and nothing else.
pub(crate) struct Served(pub(crate) HashMap<String, Var>);

impl SimpleBackend for Served {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _: candle_nn::Init,
        _: DType,
        _: &Device,
    ) -> candle_core::Result<Tensor> {
        match self.0.get(name) {
            Some(v) if v.shape() == &s => Ok(v.as_tensor().clone()),
            Some(v) => candle_core::bail!("{name} is {:?}; the builder asked for {s:?}", v.shape()),
            None => candle_core::bail!(
                "the builder asked for {name}, which it did not ask for when the trainer was made"
            ),
        }
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        candle_core::bail!(
            "{name}: the bridge gives parameters by shape (use `get`, not `get_unchecked`)"
        )
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }
}

/// The element types a bucket carries, with their executor tensor variants.
pub(crate) trait Elem: WithDType + Copy + Default + Send + Sync + 'static {
    /// A 1-D executor tensor of `v`.
    fn exec(v: Vec<Self>) -> ExecTensor;
    /// The values of an executor tensor of this type.
    fn values(t: ExecTensor) -> Option<Vec<Self>>;
}

impl Elem for f32 {
    fn exec(v: Vec<f32>) -> ExecTensor {
        let n = v.len();
        ExecTensor::F32(ArrayD::from_shape_vec(IxDyn(&[n]), v).expect("a 1-D buffer"))
    }
    fn values(t: ExecTensor) -> Option<Vec<f32>> {
        match t {
            ExecTensor::F32(a) => Some(into_vec(a)),
            _ => None,
        }
    }
}

impl Elem for f64 {
    fn exec(v: Vec<f64>) -> ExecTensor {
        let n = v.len();
        ExecTensor::F64(ArrayD::from_shape_vec(IxDyn(&[n]), v).expect("a 1-D buffer"))
    }
    fn values(t: ExecTensor) -> Option<Vec<f64>> {
        match t {
            ExecTensor::F64(a) => Some(into_vec(a)),
            _ => None,
        }
    }
}

/// An array's values, row-major: its buffer itself when it is contiguous (an element
/// by element walk of an n-d array costs far more than the values).
pub(crate) fn into_vec<T: Clone>(a: ArrayD<T>) -> Vec<T> {
    if a.as_slice().is_none() {
        return a.iter().cloned().collect();
    }
    let n = a.len();
    let (mut v, offset) = a.into_raw_vec_and_offset();
    v.drain(..offset.unwrap_or(0).min(v.len()));
    v.truncate(n);
    v
}

/// A candle tensor's values, row-major.
pub(crate) fn flat<T: Elem>(t: &Tensor) -> candle_core::Result<Vec<T>> {
    t.flatten_all()?.to_vec1::<T>()
}

/// A candle tensor on the CPU of `shape` holding `values`.
pub(crate) fn tensor<T: Elem>(values: Vec<T>, shape: &[usize]) -> candle_core::Result<Tensor> {
    Tensor::from_vec(values, shape, &Device::Cpu)
}

/// An executor tensor of a candle tensor (f32 or f64), for checkpoints.
pub(crate) fn to_exec(t: &Tensor) -> candle_core::Result<ExecTensor> {
    let shape = IxDyn(t.dims());
    Ok(match t.dtype() {
        DType::F64 => ExecTensor::F64(
            ArrayD::from_shape_vec(shape, flat::<f64>(t)?).map_err(candle_core::Error::wrap)?,
        ),
        _ => ExecTensor::F32(
            ArrayD::from_shape_vec(shape, flat::<f32>(&t.to_dtype(DType::F32)?)?)
                .map_err(candle_core::Error::wrap)?,
        ),
    })
}

/// A candle tensor of an executor tensor, cast to `dtype`.
pub(crate) fn from_exec(t: ExecTensor, dtype: DType) -> candle_core::Result<Tensor> {
    let shape = t.shape().to_vec();
    let t = match t {
        ExecTensor::F64(a) => tensor(into_vec(a), &shape)?,
        ExecTensor::F32(a) => tensor(into_vec(a), &shape)?,
        other => candle_core::bail!("a checkpoint value of dtype {}", other.dtype()),
    };
    t.to_dtype(dtype)
}

#[cfg(test)]
mod tests {
    use ndarray::{ArrayD, IxDyn, s};

    use super::into_vec;

    #[test]
    fn an_arrays_values_come_out_row_major_however_it_is_laid_out() {
        let a = ArrayD::from_shape_vec(IxDyn(&[3, 4]), (0..12).collect::<Vec<i32>>()).unwrap();
        assert_eq!(into_vec(a.clone()), (0..12).collect::<Vec<_>>());
        let t = a.clone().reversed_axes();
        assert_eq!(into_vec(t), vec![0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11]);
        let rows = a.slice_move(s![1.., ..]).into_dyn();
        assert_eq!(into_vec(rows), (4..12).collect::<Vec<_>>());
    }
}
