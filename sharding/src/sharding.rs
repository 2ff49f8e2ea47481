//! A sharding bound to devices (JAX's `GSPMDSharding`), and its index maps.

use std::collections::HashMap;
use std::ops::Range;

use meshwork_types::DeviceId;

use crate::hlo::{HloSharding, SubgroupType, Tiled};
use crate::mesh::check_unique;
use crate::tile::for_each_index;
use crate::{Error, Result};

/// How dims that do not divide evenly are treated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Mode {
    /// Every sharded dim must divide evenly, as JAX requires
    /// ([`Error::Indivisible`] otherwise).
    #[default]
    Strict,
    /// XLA's padded layout: shards of `ceil(d / k)` elements, the trailing ones short
    /// or empty (`offset = min(i·⌈d/k⌉, d)`, `limit = min((i+1)·⌈d/k⌉, d)`).
    Uneven,
}

/// Which part of the global array one device holds.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ShardIndex {
    /// The device.
    pub device: DeviceId,
    /// `[start, stop)` per dim of the global array.
    pub ranges: Vec<Range<usize>>,
    /// How many devices before this one (in device-assignment order) hold the same
    /// region: 0 for the first holder.
    pub replica_id: usize,
}

/// An [`HloSharding`] over a device assignment: tile value `k` names device
/// `device_assignment[k]`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Sharding {
    hlo: HloSharding,
    device_assignment: Vec<DeviceId>,
}

impl Sharding {
    /// Binds `hlo` to devices. The devices must be distinct; a tiled sharding must tile
    /// over exactly as many devices as the assignment has, and a maximal one must name
    /// one of them.
    pub fn new(hlo: HloSharding, device_assignment: Vec<DeviceId>) -> Result<Sharding> {
        check_unique(&device_assignment)?;
        let n = device_assignment.len();
        for leaf in hlo.leaves() {
            match leaf {
                HloSharding::Tiled(tiled) if tiled.tiles().num_elements() != n => {
                    return Err(Error::DeviceCountMismatch {
                        sharding_devices: tiled.tiles().num_elements(),
                        assignment_devices: n,
                    });
                }
                HloSharding::Maximal { device } if *device >= n => {
                    return Err(Error::MaximalOutOfRange {
                        device: *device,
                        assignment_devices: n,
                    });
                }
                _ => {}
            }
        }
        Ok(Sharding { hlo, device_assignment })
    }

    /// The XLA sharding.
    pub fn hlo(&self) -> &HloSharding {
        &self.hlo
    }

    /// The devices, in device-assignment order.
    pub fn device_assignment(&self) -> &[DeviceId] {
        &self.device_assignment
    }

    /// Whether every device holds the whole array (JAX's
    /// `GSPMDSharding.is_fully_replicated`): the sharding is replicated, or its tile
    /// assignment names a single device (maximal, or tiled over one device).
    pub fn is_fully_replicated(&self) -> bool {
        self.hlo.num_devices() == 1 || self.hlo.is_replicated()
    }

    /// The shape of every shard of an array of `shape` (JAX's `shard_shape`). In
    /// [`Mode::Uneven`] this is the padded shape `ceil(d / k)`; actual trailing shards
    /// may be shorter (see [`index_map`](Self::index_map)).
    pub fn shard_shape(&self, shape: &[usize], mode: Mode) -> Result<Vec<usize>> {
        check_shape(shape)?;
        match &self.hlo {
            HloSharding::Replicated | HloSharding::Maximal { .. } | HloSharding::Unreduced => {
                Ok(shape.to_vec())
            }
            HloSharding::Manual => Err(Error::Manual),
            HloSharding::Tuple(leaves) => Err(Error::Tuple { leaves: leaves.len() }),
            HloSharding::Tiled(tiled) => {
                if tiled.subgroup_types().contains(&SubgroupType::Manual) {
                    return Err(Error::Manual);
                }
                let shards = checked_data_dims(tiled, shape)?;
                shape
                    .iter()
                    .zip(shards)
                    .enumerate()
                    .map(|(dim, (&size, &k))| match mode {
                        Mode::Strict if size % k != 0 => {
                            Err(Error::Indivisible { dim, size, shards: k })
                        }
                        _ => Ok(size.div_ceil(k)),
                    })
                    .collect()
            }
        }
    }

    /// Which region of an array of `shape` each device holds, in device-assignment
    /// order (JAX's `devices_indices_map`), with replica ids.
    ///
    /// A maximal sharding lists only its owner. Unreduced and manual shardings (and
    /// tiled ones with such subgroups) hold partial or hand-partitioned values, not
    /// slices, and have no index map ([`Error::Unreduced`], [`Error::Manual`]); like
    /// JAX, the shard shape is checked first, so an indivisible dim is reported before
    /// either.
    pub fn index_map(&self, shape: &[usize], mode: Mode) -> Result<Vec<ShardIndex>> {
        self.shard_shape(shape, mode)?;
        if let HloSharding::Tiled(tiled) = &self.hlo
            && tiled.subgroup_types().contains(&SubgroupType::Unreduced)
        {
            return Err(Error::Unreduced);
        }
        self.tile_regions(shape)
    }

    /// XLA's `TileOffsetForDevice` / `TileLimitForDevice` for every device, in
    /// device-assignment order: ceil-division offsets (exact division when dims
    /// divide), clamped to the dims. Defined for every tiled sharding, whatever its
    /// subgroups mean; a maximal sharding lists its owner, a replicated one every
    /// device. Replica ids count earlier devices with the same region.
    pub fn tile_regions(&self, shape: &[usize]) -> Result<Vec<ShardIndex>> {
        check_shape(shape)?;
        let full = || shape.iter().map(|&d| 0..d).collect::<Vec<_>>();
        let regions: Vec<(DeviceId, Vec<Range<usize>>)> = match &self.hlo {
            HloSharding::Unreduced => return Err(Error::Unreduced),
            HloSharding::Manual => return Err(Error::Manual),
            HloSharding::Tuple(leaves) => {
                return Err(Error::Tuple { leaves: leaves.len() });
            }
            HloSharding::Replicated => {
                self.device_assignment.iter().map(|&d| (d, full())).collect()
            }
            HloSharding::Maximal { device } => vec![(self.device_assignment[*device], full())],
            HloSharding::Tiled(tiled) => {
                checked_data_dims(tiled, shape)?;
                self.tiled_regions(tiled, shape)
            }
        };
        let mut holders: HashMap<Vec<Range<usize>>, usize> = HashMap::new();
        let mut out: Vec<ShardIndex> = Vec::with_capacity(regions.len());
        for (device, ranges) in regions {
            let count = holders.entry(ranges.clone()).or_default();
            let replica_id = *count;
            *count += 1;
            out.push(ShardIndex { device, ranges, replica_id });
        }
        Ok(out)
    }

    /// (device, region) in device-assignment order.
    fn tiled_regions(&self, tiled: &Tiled, shape: &[usize]) -> Vec<(DeviceId, Vec<Range<usize>>)> {
        let data = tiled.data_dims();
        let chunk: Vec<usize> = shape.iter().zip(data).map(|(&d, &k)| d.div_ceil(k)).collect();
        let mut by_logical: Vec<Vec<Range<usize>>> = vec![Vec::new(); self.device_assignment.len()];
        let devices = tiled.tiles().devices();
        let mut flat = 0;
        for_each_index(tiled.tiles().dims(), |coords| {
            by_logical[devices[flat]] = (0..shape.len())
                .map(|i| {
                    let start = (coords[i] * chunk[i]).min(shape[i]);
                    let stop = ((coords[i] + 1) * chunk[i]).min(shape[i]);
                    start..stop
                })
                .collect();
            flat += 1;
        });
        self.device_assignment.iter().copied().zip(by_logical).collect()
    }
}

/// A shape's element count must fit in a `usize` (so every region's does too).
fn check_shape(shape: &[usize]) -> Result<()> {
    meshwork_types::Shape::new(shape)?;
    Ok(())
}

/// The data dims of `tiled`, checked against the tensor's rank.
fn checked_data_dims<'a>(tiled: &'a Tiled, shape: &[usize]) -> Result<&'a [usize]> {
    let data = tiled.data_dims();
    if data.len() != shape.len() {
        return Err(Error::RankMismatch { sharding_rank: data.len(), shape_rank: shape.len() });
    }
    Ok(data)
}
