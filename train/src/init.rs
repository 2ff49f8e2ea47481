//! Initial weights from a safetensors file (`--init`): every tensor, f32 or f64,
//! checked finite, by name.

use std::collections::HashMap;
use std::path::Path;

use meshwork_types::{DType, Tensor};

use crate::{Error, Result, files};

/// The tensors of the safetensors file `path` (f32 or f64, every value finite), by
/// name, reading at most `limit` bytes.
pub fn read_init(path: &Path, limit: u64) -> Result<HashMap<String, Tensor>> {
    let bytes = files::read_file("init", path, limit)?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| {
        Error::flag("init", format!("{} is not a safetensors file: {e}", path.display()))
    })?;
    let mut out = HashMap::new();
    for (name, view) in st.tensors() {
        let dtype = match view.dtype() {
            safetensors::Dtype::F64 => DType::F64,
            safetensors::Dtype::F32 => DType::F32,
            other => {
                return Err(Error::flag("init", format!("{name} is {other:?}; want F32 or F64")));
            }
        };
        let t = Tensor::from_le_bytes(dtype, view.shape(), view.data())
            .map_err(|e| Error::flag("init", format!("{name}: {e}")))?;
        if let Some((k, v)) = t.to_f64().iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(Error::flag(
                "init",
                format!("{name}[{k}] (flat) is {v}, not a finite number"),
            ));
        }
        out.insert(name, t);
    }
    Ok(out)
}

/// `t`'s values as a tensor of `dtype` (f32 or f64).
pub(crate) fn cast(t: &Tensor, dtype: DType) -> Result<Tensor> {
    Tensor::from_f64(dtype, t.shape(), &t.to_f64())
        .map_err(|e| Error::usage(format!("a weight of shape {:?}: {e}", t.shape())))
}
