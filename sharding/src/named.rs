//! `NamedSharding`: a mesh and a partition spec, validated as JAX validates them, and
//! lowered to an [`HloSharding`] exactly as JAX lowers them.

use crate::hlo::{HloSharding, SubgroupType};
use crate::tile::TileAssignment;
use crate::{AxisType, DimSpec, Error, Mesh, PartitionSpec, Result, Sharding};

/// A partition spec over a mesh (JAX's `NamedSharding`), validated on construction.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NamedSharding {
    mesh: Mesh,
    spec: PartitionSpec,
}

impl NamedSharding {
    /// Checks `spec` against `mesh` in JAX's order: an axis used twice
    /// ([`Error::DuplicateSpecAxis`]), an axis the mesh lacks
    /// ([`Error::UnknownSpecAxis`]), then `unreduced`/`reduced` axes that are unknown
    /// or not Explicit ([`Error::UnreducedAxisType`]).
    pub fn new(mesh: Mesh, spec: PartitionSpec) -> Result<NamedSharding> {
        let used: Vec<&String> = spec.dims().iter().flat_map(DimSpec::axes).collect();
        for (i, axis) in used.iter().enumerate() {
            if used[..i].contains(axis) {
                return Err(Error::DuplicateSpecAxis { axis: (*axis).clone() });
            }
        }
        let unknown = |axis: &String| Error::UnknownSpecAxis {
            axis: axis.clone(),
            mesh_axes: mesh.axis_names().to_vec(),
        };
        if let Some(axis) = used.iter().find(|a| mesh.axis_index(a).is_none()) {
            return Err(unknown(axis));
        }
        for axis in spec.unreduced().iter().chain(spec.reduced()) {
            let index = mesh.axis_index(axis).ok_or_else(|| unknown(axis))?;
            let axis_type = mesh.axis_types()[index];
            if axis_type != AxisType::Explicit {
                return Err(Error::UnreducedAxisType { axis: axis.clone(), axis_type });
            }
        }
        Ok(NamedSharding { mesh, spec })
    }

    /// The mesh.
    pub fn mesh(&self) -> &Mesh {
        &self.mesh
    }

    /// The partition spec.
    pub fn spec(&self) -> &PartitionSpec {
        &self.spec
    }

    /// The XLA sharding of a rank-`rank` array, as JAX's
    /// `named_sharding_to_xla_hlo_sharding` builds it: size-1 axes dropped; each dim
    /// tiled by the product of its axes (in the order written); unused axes become
    /// trailing subgroups (replicated, manual for Manual axes, unreduced); the tile
    /// assignment is an iota over mesh positions, canonicalised by
    /// [`HloSharding::subgroup`].
    ///
    /// Errors with [`Error::SpecLongerThanRank`] when an entry past the rank shards
    /// over a non-trivial axis.
    pub fn to_hlo(&self, rank: usize) -> Result<HloSharding> {
        let mesh = &self.mesh;
        let keep: Vec<usize> = (0..mesh.shape().len()).filter(|&i| mesh.shape()[i] != 1).collect();
        let position = |axis: usize| keep.iter().position(|&k| k == axis).expect("kept axis");
        // (mesh axis, tensor dim), dim-major, tuple order kept.
        let mut mapping = Vec::new();
        for (dim, entry) in self.spec.dims().iter().enumerate() {
            for name in entry.axes() {
                let axis = mesh.axis_index(name).expect("validated");
                if mesh.shape()[axis] != 1 {
                    if dim >= rank {
                        return Err(Error::SpecLongerThanRank { entry: dim, rank });
                    }
                    mapping.push((axis, dim));
                }
            }
        }
        let special = |axis: usize| -> Option<SubgroupType> {
            let name = &mesh.axis_names()[axis];
            if self.spec.unreduced().contains(name) {
                Some(SubgroupType::Unreduced)
            } else if mesh.axis_types()[axis] == AxisType::Manual {
                Some(SubgroupType::Manual)
            } else {
                None
            }
        };
        let unused: Vec<usize> =
            keep.iter().copied().filter(|a| !mapping.iter().any(|(m, _)| m == a)).collect();
        if unused.len() == keep.len() && !unused.iter().any(|&a| special(a).is_some()) {
            return Ok(HloSharding::Replicated);
        }
        let mut dims = vec![1; rank];
        let mut perm = Vec::new();
        for &(axis, dim) in &mapping {
            dims[dim] *= mesh.shape()[axis];
            perm.push(position(axis));
        }
        let mut types = Vec::new();
        for t in [SubgroupType::Replicated, SubgroupType::Manual, SubgroupType::Unreduced] {
            let axes: Vec<usize> = unused
                .iter()
                .copied()
                .filter(|&a| special(a).unwrap_or(SubgroupType::Replicated) == t)
                .collect();
            if axes.is_empty() {
                continue;
            }
            types.push(t);
            dims.push(axes.iter().map(|&a| mesh.shape()[a]).product());
            perm.extend(axes.iter().map(|&a| position(a)));
        }
        let reshape: Vec<usize> = keep.iter().map(|&a| mesh.shape()[a]).collect();
        let tiles = TileAssignment::iota(dims, &reshape, &perm)?;
        HloSharding::subgroup(tiles, &types)
    }

    /// The sharding of a rank-`rank` array over the mesh's devices, to place data with.
    ///
    /// Refuses what JAX's `device_put` refuses: an `UNCONSTRAINED` entry
    /// ([`Error::UnconstrainedEntry`]), then a spec longer than `rank`
    /// ([`Error::SpecTooLong`], even when the extra entries are `None`, which
    /// [`to_hlo`](Self::to_hlo) accepts).
    pub fn to_sharding(&self, rank: usize) -> Result<Sharding> {
        let dims = self.spec.dims();
        if let Some(entry) = dims.iter().position(|d| *d == DimSpec::Unconstrained) {
            return Err(Error::UnconstrainedEntry { entry });
        }
        if dims.len() > rank {
            return Err(Error::SpecTooLong { entries: dims.len(), rank });
        }
        Sharding::new(self.to_hlo(rank)?, self.mesh.devices().to_vec())
    }

    /// Whether every device holds the whole array (JAX's
    /// `NamedSharding.is_fully_replicated`): a one-device mesh always does; otherwise
    /// nothing may be unreduced and the axes the spec shards over must all have size 1.
    pub fn is_fully_replicated(&self) -> bool {
        if self.mesh.size() == 1 {
            return true;
        }
        if !self.spec.unreduced().is_empty() {
            return false;
        }
        self.spec
            .dims()
            .iter()
            .flat_map(DimSpec::axes)
            .all(|axis| self.mesh.axis_size(axis) == Some(1))
    }
}
