//! XLA's `HloSharding`: how an array's tiles map onto logical devices, with XLA's
//! canonicalisations and its text form.

use std::fmt;

use crate::tile::TileAssignment;
use crate::{Error, Result};

/// What the trailing (non-data) dims of a tiled sharding mean.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SubgroupType {
    /// The devices along this dim each compute the same tile by hand (shard_map).
    Manual,
    /// The devices along this dim hold partial values still to be summed.
    Unreduced,
    /// The devices along this dim hold copies of the same tile.
    Replicated,
}

impl SubgroupType {
    /// XLA's name (`manual`, `unreduced`, `replicated`).
    pub fn name(self) -> &'static str {
        match self {
            SubgroupType::Manual => "manual",
            SubgroupType::Unreduced => "unreduced",
            SubgroupType::Replicated => "replicated",
        }
    }
}

/// An XLA sharding, with the same canonical forms as XLA's `HloSharding`.
///
/// Build tiled shardings through [`HloSharding::tile`], [`HloSharding::partial_tile`]
/// and [`HloSharding::subgroup`] (or by parsing), which canonicalise exactly as XLA does:
/// trivial subgroup dims are dropped, same-type subgroup dims merge, subgroups sort as
/// `manual, unreduced, replicated`, a lone replicated subgroup becomes
/// `last_tile_dim_replicate` with each replication group's devices sorted, and a
/// sharding with no data tiling collapses to `{replicated}`, `{manual}` or
/// `{unreduced}`.
///
/// Printing (`Display`) is byte-identical to XLA's `HloSharding::ToString`; parsing
/// (`FromStr`) accepts what XLA's HLO parser accepts for these forms.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum HloSharding {
    /// Every device holds the whole array.
    Replicated,
    /// Manually partitioned: every device holds its own part, chosen by the program.
    Manual,
    /// Every device holds a partial value; the array is their sum.
    Unreduced,
    /// One device (a logical device id) holds the whole array.
    Maximal {
        /// The owning logical device.
        device: usize,
    },
    /// Tiled over the leading dims of `tiles`; the trailing dims are subgroups.
    Tiled(Tiled),
    /// One sharding per leaf of a tuple.
    Tuple(Vec<HloSharding>),
}

/// A tiled sharding: tile assignment, then how its trailing dims are used.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Tiled {
    tiles: TileAssignment,
    replicate_on_last_tile_dim: bool,
    subgroup_types: Vec<SubgroupType>,
}

impl Tiled {
    /// The tile assignment (data dims, then subgroup dims).
    pub fn tiles(&self) -> &TileAssignment {
        &self.tiles
    }

    /// Whether the last tile dim is a replication group (`last_tile_dim_replicate`).
    pub fn replicate_on_last_tile_dim(&self) -> bool {
        self.replicate_on_last_tile_dim
    }

    /// The subgroup types of the trailing dims (`last_tile_dims={..}`).
    pub fn subgroup_types(&self) -> &[SubgroupType] {
        &self.subgroup_types
    }

    /// The subgroup types including the `last_tile_dim_replicate` form.
    pub fn all_subgroup_types(&self) -> Vec<SubgroupType> {
        if self.replicate_on_last_tile_dim {
            vec![SubgroupType::Replicated]
        } else {
            self.subgroup_types.clone()
        }
    }

    /// Number of trailing subgroup dims.
    pub fn num_subgroup_dims(&self) -> usize {
        self.subgroup_types.len() + usize::from(self.replicate_on_last_tile_dim)
    }

    /// The number of shards along each data dim.
    pub fn data_dims(&self) -> &[usize] {
        let dims = self.tiles.dims();
        &dims[..dims.len() - self.num_subgroup_dims()]
    }

    /// How many devices hold each distinct data tile (product of replicated subgroups).
    pub fn num_replicas(&self) -> usize {
        let dims = self.tiles.dims();
        let data = dims.len() - self.num_subgroup_dims();
        self.all_subgroup_types()
            .iter()
            .zip(&dims[data..])
            .filter(|(t, _)| **t == SubgroupType::Replicated)
            .map(|(_, d)| d)
            .product()
    }
}

impl HloSharding {
    /// A tiled sharding with no subgroups (XLA's `HloSharding::Tile`).
    pub fn tile(tiles: TileAssignment) -> HloSharding {
        HloSharding::Tiled(Tiled {
            tiles,
            replicate_on_last_tile_dim: false,
            subgroup_types: vec![],
        })
    }

    /// A tiled sharding whose last tile dim is a replication group (XLA's
    /// `HloSharding::PartialTile`): collapses to `{replicated}` when nothing is tiled,
    /// drops a trivial last dim, and sorts each group's devices.
    pub fn partial_tile(tiles: TileAssignment) -> HloSharding {
        let n = tiles.num_elements();
        let dims = tiles.dims();
        let group = *dims.last().expect("tile dims are non-empty");
        if dims.len() == 1 || group == n {
            return HloSharding::Replicated;
        }
        if group == 1 {
            let data = dims[..dims.len() - 1].to_vec();
            return HloSharding::tile(tiles.reshape(data));
        }
        let mut devices = tiles.devices().to_vec();
        for chunk in devices.chunks_mut(group) {
            chunk.sort_unstable();
        }
        let tiles = tiles.with_devices(dims.to_vec(), devices);
        HloSharding::Tiled(Tiled {
            tiles,
            replicate_on_last_tile_dim: true,
            subgroup_types: vec![],
        })
    }

    /// A tiled sharding whose trailing `subgroup_types.len()` tile dims are subgroups
    /// (XLA's `HloSharding::Subgroup`), canonicalised as XLA does.
    pub fn subgroup(tiles: TileAssignment, subgroup_types: &[SubgroupType]) -> Result<HloSharding> {
        let rank = tiles.dims().len();
        if subgroup_types.len() > rank {
            return Err(Error::TooManySubgroups { subgroups: subgroup_types.len(), rank });
        }
        if subgroup_types.is_empty() {
            return Ok(HloSharding::tile(tiles));
        }
        let data_rank = rank - subgroup_types.len();
        let data_tiles: usize = tiles.dims()[..data_rank].iter().product();
        if data_tiles == 1 && subgroup_types.iter().all(|t| *t == subgroup_types[0]) {
            return Ok(collapsed(subgroup_types[0]));
        }
        // Drop trivial dims, merge dims of one type, order the types.
        let mut by_type: [Vec<usize>; 3] = Default::default();
        let mut removed = Vec::new();
        let mut needs_merging = false;
        for (i, &t) in subgroup_types.iter().enumerate() {
            let dim = data_rank + i;
            if tiles.dims()[dim] == 1 {
                removed.push(dim);
                needs_merging = true;
                continue;
            }
            let slot = &mut by_type[type_order(t)];
            needs_merging |= !slot.is_empty();
            slot.push(dim);
        }
        needs_merging |= by_type.iter().filter(|dims| !dims.is_empty()).count() > 1;
        if !needs_merging {
            return Ok(create_sharding(tiles, subgroup_types.to_vec()));
        }
        let mut perm: Vec<usize> = (0..data_rank).collect();
        let mut merged_dims = tiles.dims()[..data_rank].to_vec();
        let mut merged_types = Vec::new();
        for (slot, t) in by_type.iter().zip(ORDERED_TYPES) {
            if slot.is_empty() {
                continue;
            }
            perm.extend(slot);
            merged_dims.push(slot.iter().map(|&d| tiles.dims()[d]).product());
            merged_types.push(t);
        }
        perm.extend(removed);
        if merged_dims.is_empty() {
            // Rank-0 data and only trivial subgroups: one device holds everything. XLA
            // would build a tile assignment with no dims (printed `{devices=[]0}`,
            // which its own parser rejects); this is the replicated sharding.
            return Ok(HloSharding::Replicated);
        }
        let merged = tiles.transpose(&perm).reshape(merged_dims);
        Ok(create_sharding(merged, merged_types))
    }

    /// Whether every device holds the whole array (XLA's `IsReplicated`; a tuple when
    /// every leaf is).
    pub fn is_replicated(&self) -> bool {
        self.all_leaves(|leaf| matches!(leaf, HloSharding::Replicated))
    }

    /// Whether one device, or every device, holds the whole array: replicated or
    /// maximal (XLA's `IsTileMaximal`; a tuple when every leaf is).
    pub fn is_tile_maximal(&self) -> bool {
        self.all_leaves(|leaf| {
            matches!(leaf, HloSharding::Replicated | HloSharding::Maximal { .. })
        })
    }

    /// Whether this is `{manual}` (XLA's `IsManual`; a tiled sharding with manual
    /// subgroups is not; a tuple when every leaf is).
    pub fn is_manual(&self) -> bool {
        self.all_leaves(|leaf| matches!(leaf, HloSharding::Manual))
    }

    /// Whether this is `{unreduced}` (XLA's `IsUnreduced`; a tiled sharding with
    /// unreduced subgroups is not; a tuple when every leaf is).
    pub fn is_unreduced(&self) -> bool {
        self.all_leaves(|leaf| matches!(leaf, HloSharding::Unreduced))
    }

    /// Whether this is tiled, whatever its subgroups (XLA's `IsTiled`: neither tile
    /// maximal, manual nor unreduced; a tuple when every leaf is).
    pub fn is_tiled(&self) -> bool {
        self.all_leaves(|leaf| matches!(leaf, HloSharding::Tiled(_)))
    }

    /// Whether this is a tuple sharding.
    pub fn is_tuple(&self) -> bool {
        matches!(self, HloSharding::Tuple(_))
    }

    /// How many devices XLA's tile assignment names (XLA's `num_devices`): the tiles of
    /// a tiled sharding, 1 for a maximal one, 0 for replicated, manual, unreduced and
    /// tuple shardings, which have no tile assignment.
    pub fn num_devices(&self) -> usize {
        match self {
            HloSharding::Tiled(tiled) => tiled.tiles.num_elements(),
            HloSharding::Maximal { .. } => 1,
            _ => 0,
        }
    }

    /// `test` holds for this sharding, or for every leaf of a tuple.
    fn all_leaves(&self, test: fn(&HloSharding) -> bool) -> bool {
        match self {
            HloSharding::Tuple(leaves) => leaves.iter().all(|leaf| leaf.all_leaves(test)),
            leaf => test(leaf),
        }
    }

    /// The leaves of a tuple sharding, or the sharding itself as a single leaf.
    pub fn leaves(&self) -> &[HloSharding] {
        match self {
            HloSharding::Tuple(leaves) => leaves,
            other => std::slice::from_ref(other),
        }
    }

    /// Leaf `index` of a tuple sharding.
    pub fn leaf(&self, index: usize) -> Result<&HloSharding> {
        let leaves = self.leaves();
        leaves.get(index).ok_or(Error::NoSuchLeaf { index, leaves: leaves.len() })
    }
}

/// XLA's subgroup order after normalisation: manual, unreduced, then replicated last.
const ORDERED_TYPES: [SubgroupType; 3] =
    [SubgroupType::Manual, SubgroupType::Unreduced, SubgroupType::Replicated];

fn type_order(t: SubgroupType) -> usize {
    ORDERED_TYPES.iter().position(|&o| o == t).expect("every type is ordered")
}

fn collapsed(t: SubgroupType) -> HloSharding {
    match t {
        SubgroupType::Manual => HloSharding::Manual,
        SubgroupType::Unreduced => HloSharding::Unreduced,
        SubgroupType::Replicated => HloSharding::Replicated,
    }
}

/// XLA's `create_sharding` step of `Subgroup`: replicated subgroups go through
/// `PartialTile` so their groups are sorted.
fn create_sharding(tiles: TileAssignment, types: Vec<SubgroupType>) -> HloSharding {
    if types == [SubgroupType::Replicated] {
        return HloSharding::partial_tile(tiles);
    }
    if let [only] = types[..]
        && tiles.num_elements() == *tiles.dims().last().expect("non-empty dims")
    {
        // No data tiling left after merging. XLA collapses only the manual case here
        // and would print `{devices=[2]0,1 last_tile_dims={unreduced}}`, which its own
        // parser reads back as `{unreduced}`; collapsing every type keeps
        // print→parse→print stable.
        return collapsed(only);
    }
    if types.last() == Some(&SubgroupType::Replicated) {
        return match HloSharding::partial_tile(tiles) {
            HloSharding::Tiled(tiled) => HloSharding::Tiled(Tiled {
                tiles: tiled.tiles,
                replicate_on_last_tile_dim: false,
                subgroup_types: types,
            }),
            other => unreachable!("merged subgroup dims are non-trivial, got {other}"),
        };
    }
    HloSharding::Tiled(Tiled { tiles, replicate_on_last_tile_dim: false, subgroup_types: types })
}

impl fmt::Display for HloSharding {
    /// XLA's `HloSharding::ToString()` (without metadata).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HloSharding::Replicated => f.write_str("{replicated}"),
            HloSharding::Manual => f.write_str("{manual}"),
            HloSharding::Unreduced => f.write_str("{unreduced}"),
            HloSharding::Maximal { device } => write!(f, "{{maximal device={device}}}"),
            HloSharding::Tiled(tiled) => {
                write!(f, "{{devices={}", tiled.tiles)?;
                if tiled.replicate_on_last_tile_dim {
                    f.write_str(" last_tile_dim_replicate")?;
                }
                if !tiled.subgroup_types.is_empty() {
                    f.write_str(" last_tile_dims={")?;
                    for (i, t) in tiled.subgroup_types.iter().enumerate() {
                        if i > 0 {
                            f.write_str(", ")?;
                        }
                        f.write_str(t.name())?;
                    }
                    f.write_str("}")?;
                }
                f.write_str("}")
            }
            HloSharding::Tuple(leaves) => {
                f.write_str("{")?;
                for (i, leaf) in leaves.iter().enumerate() {
                    if i > 0 {
                        if i % 5 == 0 {
                            write!(f, ", /*index={i}*/")?;
                        } else {
                            f.write_str(", ")?;
                        }
                    }
                    write!(f, "{leaf}")?;
                }
                f.write_str("}")
            }
        }
    }
}

#[cfg(test)]
mod tests;
