//! Initial weights from a safetensors file (`--init`): every tensor, f32 or f64,
//! checked finite, by name.

use std::collections::HashMap;
use std::path::Path;

use meshwork_types::{DType, Tensor};

use crate::{Error, Result, files};

/// The tensors of the safetensors file `path` (f32 or f64, every value finite), by
/// name, reading at most `limit` bytes.
pub fn read_init(path: &Path, limit: u64) -> Result<HashMap<String, Tensor>> {
    read_tensors("init", path, limit)
}

/// [`read_init`] of a file given by `--flag`, whose errors name it.
pub(crate) fn read_tensors(flag: &str, path: &Path, limit: u64) -> Result<HashMap<String, Tensor>> {
    let bytes = files::read_file(flag, path, limit)?;
    let header = meshwork_io::safetensors::parse(&bytes)
        .map_err(|e| Error::flag(flag, format!("{}: {e}", path.display())))?;
    let mut out = HashMap::new();
    for entry in header.entries {
        let name = entry.name;
        let dtype = match entry.dtype {
            meshwork_io::safetensors::Dtype::F64 => DType::F64,
            meshwork_io::safetensors::Dtype::F32 => DType::F32,
            other => {
                return Err(Error::flag(flag, format!("{name} is {other:?}; want F32 or F64")));
            }
        };
        // Inside the file: the header check bounded every entry by its size.
        let data = &bytes[entry.start as usize..(entry.start + entry.bytes) as usize];
        let t = Tensor::from_le_bytes(dtype, &entry.shape, data)
            .map_err(|e| Error::flag(flag, format!("{name}: {e}")))?;
        if let Some((k, v)) = t.to_f64().iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(Error::flag(
                flag,
                format!("{name}[{k}] (flat) is {v}, not a finite number"),
            ));
        }
        out.insert(name, t);
    }
    Ok(out)
}

/// `t`'s values as a tensor of `dtype` (f32, f64, or a frozen base's bf16: rounded to
/// nearest).
pub(crate) fn cast(t: &Tensor, dtype: DType) -> Result<Tensor> {
    Tensor::from_f64(dtype, t.shape(), &t.to_f64())
        .map_err(|e| Error::usage(format!("a weight of shape {:?}: {e}", t.shape())))
}

/// A tensor of an `--init` file as its header states it: what a family reads the
/// model's sizes from, and what is checked against the model.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Shaped(pub(crate) Vec<usize>);

impl Shaped {
    /// Its shape.
    pub(crate) fn shape(&self) -> &[usize] {
        &self.0
    }
}

/// An `--init` file: every tensor's shape, and its values — read whole, or (across
/// processes) left in the file, each process reading the boxes its devices hold.
#[derive(Debug)]
pub(crate) struct InitFile {
    pub(crate) shapes: HashMap<String, Shaped>,
    /// The values, read whole (`None`: read by boxes through `boxes`).
    pub(crate) values: Option<HashMap<String, Tensor>>,
    pub(crate) boxes: Option<crate::hf::HfShards>,
}

impl InitFile {
    /// The file read whole.
    pub(crate) fn read(path: &Path, limit: u64) -> Result<InitFile> {
        let values = read_init(path, limit)?;
        let shapes = values.iter().map(|(n, t)| (n.clone(), Shaped(t.shape().to_vec()))).collect();
        Ok(InitFile { shapes, values: Some(values), boxes: None })
    }

    /// The file indexed from its header alone, its values read later by boxes.
    pub(crate) fn indexed(path: &Path) -> Result<InitFile> {
        let boxes = crate::hf::HfShards::of_file("init", path)?;
        let shapes = boxes.shapes().map(|(n, s)| (n.to_string(), Shaped(s.to_vec()))).collect();
        Ok(InitFile { shapes, values: None, boxes: Some(boxes) })
    }
}
