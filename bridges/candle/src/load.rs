//! Reading a safetensors file by regions: a replica reads the bytes of its own shard
//! of a tensor and nothing else (any dims, any region), the general form of candle's
//! `ShardedSafeTensors` (which splits dim 0 or 1 evenly).

use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::{DType, Tensor};

use crate::params::{self, Param};
use crate::{Error, Result};

/// One tensor's entry in the header.
#[derive(Debug, Clone)]
struct Entry {
    /// `None`: a dtype the bridge does not read (an integer buffer).
    dtype: Option<DType>,
    /// Where its bytes are, as the header (checked) says.
    stored: meshwork_io::safetensors::Entry,
}

/// An open safetensors file, its header read and checked.
pub(crate) struct File {
    path: String,
    file: std::fs::File,
    tensors: HashMap<String, Entry>,
    read: AtomicU64,
}

impl File {
    /// Opens `path` and reads its header, checked by meshwork's one safetensors
    /// reader (every tensor's bytes against its dtype and shape, no overlaps or gaps,
    /// unique names, the file's size).
    pub(crate) fn open(path: &Path) -> Result<File> {
        use meshwork_io::safetensors::Dtype as S;
        let name = path.display().to_string();
        let bad = |problem: String| Error::Load { path: name.clone(), problem };
        let (file, len) =
            meshwork_io::files::open_regular_io(path).map_err(|e| bad(e.to_string()))?;
        let header = meshwork_io::safetensors::read_header(&file, len).map_err(bad)?;
        let tensors = header
            .entries
            .into_iter()
            .map(|stored| {
                // Other dtypes (integer buffers a model does not train) are refused only
                // when a parameter is read from them.
                let dtype = match stored.dtype {
                    S::F32 => Some(DType::F32),
                    S::F64 => Some(DType::F64),
                    S::F16 => Some(DType::F16),
                    S::BF16 => Some(DType::BF16),
                    _ => None,
                };
                (stored.name.clone(), Entry { dtype, stored })
            })
            .collect();
        Ok(File { path: name, file, tensors, read: AtomicU64::new(0) })
    }

    /// Checks that the file holds every parameter with its shape.
    pub(crate) fn check(&self, params: &[Param]) -> Result<()> {
        for p in params {
            match self.tensors.get(&p.name) {
                None => {
                    return Err(Error::Load {
                        path: self.path.clone(),
                        problem: format!("no tensor {} (the model's parameter)", p.name),
                    });
                }
                Some(e) if e.dtype.is_none() => {
                    return Err(Error::Load {
                        path: self.path.clone(),
                        problem: format!(
                            "{} is not F32, F64, F16 or BF16, which the bridge reads",
                            p.name
                        ),
                    });
                }
                Some(e) if e.stored.shape != p.shape => {
                    return Err(Error::Load {
                        path: self.path.clone(),
                        problem: format!(
                            "{} is {:?}; the model's is {:?}",
                            p.name, e.stored.shape, p.shape
                        ),
                    });
                }
                Some(_) => {}
            }
        }
        Ok(())
    }

    /// Data bytes read so far.
    #[cfg(test)]
    pub(crate) fn bytes_read(&self) -> u64 {
        self.read.load(Ordering::Relaxed)
    }

    /// The part `region` of tensor `name`, as `dtype`: reads the region's bytes (runs
    /// along the trailing dims it spans whole) and no others.
    pub(crate) fn read_region(
        &self,
        name: &str,
        region: &[Range<usize>],
        dtype: DType,
    ) -> Result<Tensor> {
        let e = self.tensors.get(name).ok_or_else(|| Error::Load {
            path: self.path.clone(),
            problem: format!("no tensor {name}"),
        })?;
        let Some(dtype_in_file) = e.dtype else {
            return Err(Error::Load {
                path: self.path.clone(),
                problem: format!("{name} is not F32, F64, F16 or BF16, which the bridge reads"),
            });
        };
        let bytes = meshwork_io::safetensors::read_box_of(&self.file, &e.stored, region)
            .map_err(|problem| Error::Load { path: self.path.clone(), problem })?;
        self.read.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        let ext: Vec<usize> = region.iter().map(|r| r.len()).collect();
        let t = match dtype_in_file {
            DType::F64 => params::tensor(
                bytes
                    .chunks_exact(8)
                    .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
                    .collect::<Vec<f64>>(),
                &ext,
            )?,
            DType::F32 => params::tensor(
                bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                    .collect::<Vec<f32>>(),
                &ext,
            )?,
            DType::F16 => {
                Tensor::from_raw_buffer(&bytes, DType::F16, &ext, &candle_core::Device::Cpu)?
            }
            _ => Tensor::from_raw_buffer(&bytes, DType::BF16, &ext, &candle_core::Device::Cpu)?,
        };
        Ok(t.to_dtype(dtype)?)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// A safetensors file of one f64 tensor `w` of `shape`, values 0, 1, 2, …
    fn file_of(shape: &[usize]) -> (std::path::PathBuf, Vec<f64>) {
        let n: usize = shape.iter().product();
        let values: Vec<f64> = (0..n).map(|i| i as f64).collect();
        let header = serde_json::json!({
            "__metadata__": {"format": "pt"},
            "w": {"dtype": "F64", "shape": shape, "data_offsets": [0, 8 * n]},
        })
        .to_string();
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend(header.as_bytes());
        bytes.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        let path = std::env::temp_dir().join(format!(
            "meshwork-candle-load-{}-{}.safetensors",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos())
        ));
        std::fs::write(&path, bytes).unwrap();
        (path, values)
    }

    /// `shape` and a region inside it.
    fn shape_and_region() -> impl Strategy<Value = (Vec<usize>, Vec<Range<usize>>)> {
        proptest::collection::vec(1usize..6, 1..5).prop_flat_map(|shape| {
            let ranges: Vec<_> = shape
                .iter()
                .map(|&d| (0..=d, 0..=d).prop_map(|(a, b)| a.min(b)..a.max(b)))
                .collect();
            (Just(shape), ranges)
        })
    }

    proptest! {
        /// A region read from the file equals the region of the whole tensor, and
        /// exactly the region's bytes are read.
        #[test]
        fn a_region_is_read_alone_and_exactly((shape, region) in shape_and_region()) {
            let (path, values) = file_of(&shape);
            let f = File::open(&path).unwrap();
            let got = f.read_region("w", &region, DType::F64).unwrap();
            let whole = ndarray::ArrayD::from_shape_vec(ndarray::IxDyn(&shape), values).unwrap();
            let info: Vec<ndarray::SliceInfoElem> = region.iter().map(|r| r.clone().into()).collect();
            let want: Vec<f64> = whole.slice(info.as_slice()).iter().copied().collect();
            let count: usize = region.iter().map(|r| r.len()).product();
            let ext: Vec<usize> = region.iter().map(|r| r.len()).collect();
            prop_assert_eq!(got.dims(), ext.as_slice());
            prop_assert_eq!(params::flat::<f64>(&got).unwrap(), want);
            prop_assert_eq!(f.bytes_read(), 8 * count as u64);
            let _ = std::fs::remove_file(path);
        }
    }

    #[test]
    fn a_damaged_header_or_region_is_a_typed_error() {
        let (path, _) = file_of(&[3, 4]);
        let f = File::open(&path).unwrap();
        assert!(matches!(f.read_region("w", &[0..4, 0..4], DType::F64), Err(Error::Load { .. })));
        assert!(matches!(f.read_region("v", &[0..1, 0..1], DType::F64), Err(Error::Load { .. })));
        let mut bytes = std::fs::read(&path).unwrap();
        bytes.truncate(bytes.len() - 8);
        std::fs::write(&path, &bytes).unwrap();
        let e = File::open(&path).err().expect("a file cut short");
        assert!(e.to_string().contains("cut short"), "{e}");
        // Offsets that would wrap around.
        let header = serde_json::json!({
            "w": {"dtype": "F32", "shape": [1], "data_offsets": [u64::MAX - 4, u64::MAX]},
        })
        .to_string();
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend(header.as_bytes());
        bytes.extend([0u8; 4]);
        std::fs::write(&path, &bytes).unwrap();
        assert!(matches!(File::open(&path), Err(Error::Load { .. })));
        std::fs::write(&path, u64::MAX.to_le_bytes()).unwrap();
        assert!(matches!(File::open(&path), Err(Error::Load { .. })));
        let _ = std::fs::remove_file(path);
    }
}
