//! Reading a safetensors file by regions: a replica reads the bytes of its own shard
//! of a tensor and nothing else (any dims, any region), the general form of candle's
//! `ShardedSafeTensors` (which splits dim 0 or 1 evenly).

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom};
use std::ops::Range;
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::{DType, Tensor};

use crate::params::{self, Param};
use crate::{Error, Result};

/// Headers longer than this are refused before they are read (real ones are a few
/// kilobytes per thousand tensors).
const MAX_HEADER: u64 = 100 << 20;

/// One tensor's entry in the header.
#[derive(Debug, Clone)]
struct Entry {
    /// `None`: a dtype the bridge does not read (an integer buffer).
    dtype: Option<DType>,
    shape: Vec<usize>,
    /// Its bytes, from the start of the file.
    start: u64,
}

/// An open safetensors file, its header read and checked.
pub(crate) struct File {
    path: String,
    file: Mutex<std::fs::File>,
    tensors: HashMap<String, Entry>,
    read: AtomicU64,
}

impl File {
    /// Opens `path` and reads its header: every tensor's dtype, shape and byte range
    /// checked against each other and the file's size.
    pub(crate) fn open(path: &Path) -> Result<File> {
        let name = path.display().to_string();
        let bad = |problem: String| Error::Load { path: name.clone(), problem };
        let mut file = std::fs::File::open(path).map_err(|e| bad(e.to_string()))?;
        let meta = file.metadata().map_err(|e| bad(e.to_string()))?;
        if !meta.is_file() {
            return Err(bad("not a regular file".into()));
        }
        let size = meta.len();
        let mut head = [0u8; 8];
        file.read_exact(&mut head).map_err(|e| bad(format!("no header length ({e})")))?;
        let n = u64::from_le_bytes(head);
        if n > MAX_HEADER || n + 8 > size {
            return Err(bad(format!("a header of {n} bytes in a file of {size}")));
        }
        let mut text = vec![0u8; n as usize];
        file.read_exact(&mut text).map_err(|e| bad(format!("header cut short ({e})")))?;
        let header: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(&text).map_err(|e| bad(format!("header is not JSON: {e}")))?;
        let data = 8 + n;
        let mut tensors = HashMap::new();
        for (key, v) in header {
            if key == "__metadata__" {
                continue;
            }
            let field = |f: &str| v.get(f).ok_or_else(|| bad(format!("{key} has no {f}")));
            // Other dtypes (integer buffers a model does not train) are refused only
            // when a parameter is read from them.
            let dtype = match field("dtype")?.as_str() {
                Some("F32") => Some(DType::F32),
                Some("F64") => Some(DType::F64),
                Some("F16") => Some(DType::F16),
                Some("BF16") => Some(DType::BF16),
                Some(_) => None,
                None => return Err(bad(format!("{key}'s dtype is not a string"))),
            };
            let shape: Vec<usize> = serde_json::from_value(field("shape")?.clone())
                .map_err(|e| bad(format!("{key}'s shape: {e}")))?;
            let [a, b]: [u64; 2] = serde_json::from_value(field("data_offsets")?.clone())
                .map_err(|e| bad(format!("{key}'s data_offsets: {e}")))?;
            let want =
                shape.iter().try_fold(dtype.map_or(1, |d| d.size_in_bytes()) as u64, |acc, &d| {
                    acc.checked_mul(d as u64)
                });
            // Offsets from an untrusted header: every sum checked.
            let end = data.checked_add(b).filter(|&e| e <= size);
            if b < a || (dtype.is_some() && Some(b - a) != want) || end.is_none() {
                return Err(bad(format!(
                    "{key}: bytes {a}..{b} for shape {shape:?} of {} in a file of {size} bytes",
                    dtype.map_or("?".to_string(), |d| format!("{d:?}"))
                )));
            }
            tensors.insert(key, Entry { dtype, shape, start: data + a });
        }
        Ok(File { path: name, file: Mutex::new(file), tensors, read: AtomicU64::new(0) })
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
                Some(e) if e.shape != p.shape => {
                    return Err(Error::Load {
                        path: self.path.clone(),
                        problem: format!(
                            "{} is {:?}; the model's is {:?}",
                            p.name, e.shape, p.shape
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
        let rank = e.shape.len();
        if region.len() != rank
            || region.iter().zip(&e.shape).any(|(r, &d)| r.start > r.end || r.end > d)
        {
            return Err(Error::Load {
                path: self.path.clone(),
                problem: format!("region {region:?} is not inside {name} of shape {:?}", e.shape),
            });
        }
        let Some(dtype_in_file) = e.dtype else {
            return Err(Error::Load {
                path: self.path.clone(),
                problem: format!("{name} is not F32, F64, F16 or BF16, which the bridge reads"),
            });
        };
        let size = dtype_in_file.size_in_bytes();
        let ext: Vec<usize> = region.iter().map(|r| r.len()).collect();
        let count: usize = ext.iter().product();
        let mut bytes = vec![0u8; count * size];
        if count > 0 {
            // Dims t.. are whole in the region: each run spans them, and dim t-1's range.
            let mut t = rank;
            while t > 0 && region[t - 1] == (0..e.shape[t - 1]) {
                t -= 1;
            }
            let inner: usize = e.shape[t..].iter().product();
            let run = if t == 0 { inner } else { ext[t - 1] * inner };
            let outer: Vec<Range<usize>> = region[..t.saturating_sub(1)].to_vec();
            let mut index: Vec<usize> = outer.iter().map(|r| r.start).collect();
            let mut file = self.file.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let mut at = 0;
            loop {
                // The run's first element, row-major.
                let mut offset = 0usize;
                for d in 0..t {
                    let i = if d + 1 == t { region[d].start } else { index[d] };
                    offset = offset * e.shape[d] + i;
                }
                offset *= inner;
                // Inside the tensor's bytes, which the header check bounded.
                let pos = e.start + (offset * size) as u64;
                let dst = &mut bytes[at..at + run * size];
                file.seek(SeekFrom::Start(pos)).and_then(|_| file.read_exact(dst)).map_err(
                    |err| Error::Load {
                        path: self.path.clone(),
                        problem: format!("{name}: {err}"),
                    },
                )?;
                at += run * size;
                // The next outer index (an odometer over the dims before t-1).
                let mut d = outer.len();
                let done = loop {
                    if d == 0 {
                        break true;
                    }
                    d -= 1;
                    index[d] += 1;
                    if index[d] < outer[d].end {
                        break false;
                    }
                    index[d] = outer[d].start;
                };
                if done {
                    break;
                }
            }
            self.read.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        }
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
        assert!(e.to_string().contains("bytes 0..96"), "{e}");
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
