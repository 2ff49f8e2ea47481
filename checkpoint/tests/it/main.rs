//! The checkpoint format and the checkpoint directory through their public API:
//! shards written under any sharding read back whole; damaged, mismatching or
//! ill-sized checkpoints are refused; a crash at any instant of a managed save leaves
//! a complete checkpoint; a directory that is not meshwork's is never touched.

mod directory;
mod format;

use std::path::{Path, PathBuf};

use meshwork_checkpoint::CheckpointEntry;
use meshwork_sharding::{HloSharding, Mode, Sharding, shard};
use meshwork_types::{DType, DeviceId, Tensor};

/// The entry of `value` (f64) named `name` under `hlo` over `devices` positions: every
/// distinct region once, as a writer that holds all of them gives it.
pub(crate) fn entry(
    name: &str,
    value: &Tensor,
    hlo: &HloSharding,
    devices: usize,
) -> CheckpointEntry {
    let sharding = Sharding::new(hlo.clone(), (0..devices as u32).map(DeviceId).collect()).unwrap();
    let a = value.as_array::<f64>().expect("an f64 value");
    let shards = shard(&a.view(), &sharding, Mode::Strict)
        .unwrap()
        .into_iter()
        .filter(|s| s.replica_id == 0)
        .map(|s| (s.device.0 as usize, s.ranges, Tensor::F64(s.data)))
        .collect();
    CheckpointEntry {
        name: name.into(),
        dtype: DType::F64,
        shape: value.shape().to_vec(),
        hlo: hlo.clone(),
        shards,
    }
}

/// A `[4, 6]` f64 value from `seed`.
pub(crate) fn value(seed: u64) -> Tensor {
    let f = |i: u64| (i.wrapping_mul(seed | 1) % 1000) as f64 * 0.5;
    Tensor::f64(&[4, 6], (0..24).map(f).collect()).unwrap()
}

/// Every entry of `dir`, recursively, with its bytes (directories as `None`).
pub(crate) fn snapshot(dir: &Path) -> Vec<(PathBuf, Option<Vec<u8>>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                out.push((p.clone(), None));
                stack.push(p);
            } else {
                out.push((p.clone(), Some(std::fs::read(&p).unwrap())));
            }
        }
    }
    out.sort();
    out
}
