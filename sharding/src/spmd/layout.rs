//! A value's layout over a mesh in mesh-axis form: which mesh axes tile each dim, and
//! over which axes the value is a pending sum.

use std::fmt;
use std::ops::Range;

use crate::{AxisType, DimSpec, Error, HloSharding, Mesh, NamedSharding, PartitionSpec, Result};

/// How a value is laid out over the devices of a [`Mesh`]: for each dim, the mesh axes
/// that tile it (major first, as a `PartitionSpec` entry lists them), and the axes over
/// which every device holds a *partial* value whose sum over the axis is the value
/// (XLA's `unreduced`: what a `dot_general` contracting a sharded dim produces).
///
/// Axes are indices into the mesh's axes. A layout never mentions a size-1 axis (they
/// shard nothing), uses an axis at most once, and keeps `partial` sorted. Device `i`
/// of a layout is `mesh.devices()[i]`: mesh positions are row-major over the mesh shape.
///
/// Every layout is a `NamedSharding` ([`to_named`](Self::to_named)), so it lowers to
/// the `HloSharding` JAX would give; [`from_hlo`](Self::from_hlo) finds the layout of
/// an `HloSharding` over a given mesh.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Layout {
    dims: Vec<Vec<usize>>,
    partial: Vec<usize>,
}

impl Layout {
    /// Every device holds the whole value.
    pub fn replicated(rank: usize) -> Layout {
        Layout { dims: vec![Vec::new(); rank], partial: Vec::new() }
    }

    /// A layout over `mesh` with `dims[d]` the axes tiling dim `d` (major first) and
    /// `partial` the pending-sum axes. Size-1 axes are dropped; an axis out of range
    /// or used twice is an error.
    pub fn new(mesh: &Mesh, dims: Vec<Vec<usize>>, partial: Vec<usize>) -> Result<Layout> {
        let n = mesh.shape().len();
        let mut seen = vec![false; n];
        let mut check = |a: usize| -> Result<bool> {
            if a >= n {
                return Err(Error::LayoutAxis { axis: a, axes: n });
            }
            if std::mem::replace(&mut seen[a], true) {
                return Err(Error::DuplicateSpecAxis { axis: mesh.axis_names()[a].clone() });
            }
            Ok(mesh.shape()[a] != 1)
        };
        let mut kept = Vec::with_capacity(dims.len());
        for axes in dims {
            let mut d = Vec::with_capacity(axes.len());
            for a in axes {
                if check(a)? {
                    d.push(a);
                }
            }
            kept.push(d);
        }
        let mut p = Vec::with_capacity(partial.len());
        for a in partial {
            if check(a)? {
                p.push(a);
            }
        }
        p.sort_unstable();
        Ok(Layout { dims: kept, partial: p })
    }

    /// The layout a partition spec (with its `unreduced` axes as pending sums) gives a
    /// rank-`rank` value over `mesh`. `UNCONSTRAINED` entries and specs longer than the
    /// rank are refused, as JAX's `device_put` refuses them.
    pub fn from_spec(mesh: &Mesh, spec: &PartitionSpec, rank: usize) -> Result<Layout> {
        let named = NamedSharding::new(mesh.clone(), spec.clone())?;
        let entries = named.spec().dims();
        if let Some(entry) = entries.iter().position(|d| *d == DimSpec::Unconstrained) {
            return Err(Error::UnconstrainedEntry { entry });
        }
        if entries.len() > rank {
            return Err(Error::SpecTooLong { entries: entries.len(), rank });
        }
        let index = |name: &String| mesh.axis_index(name).expect("NamedSharding validated");
        let mut dims = vec![Vec::new(); rank];
        for (d, entry) in entries.iter().enumerate() {
            dims[d] = entry.axes().iter().map(index).collect();
        }
        let partial = spec.unreduced().iter().map(index).collect();
        Layout::new(mesh, dims, partial)
    }

    /// The value's rank.
    pub fn rank(&self) -> usize {
        self.dims.len()
    }

    /// The mesh axes tiling each dim, major first.
    pub fn dims(&self) -> &[Vec<usize>] {
        &self.dims
    }

    /// The axes over which the value is a pending sum (sorted).
    pub fn partial(&self) -> &[usize] {
        &self.partial
    }

    /// Whether every device holds the whole, summed value.
    pub fn is_replicated(&self) -> bool {
        self.partial.is_empty() && self.dims.iter().all(Vec::is_empty)
    }

    /// The same tiling with no pending sums.
    pub fn without_partial(&self) -> Layout {
        Layout { dims: self.dims.clone(), partial: Vec::new() }
    }

    /// A layout from parts already known to be valid; sorts `partial`.
    pub(crate) fn from_parts(dims: Vec<Vec<usize>>, mut partial: Vec<usize>) -> Layout {
        partial.sort_unstable();
        partial.dedup();
        Layout { dims, partial }
    }

    /// Mutable parts, for the transition planner.
    pub(crate) fn parts_mut(&mut self) -> (&mut Vec<Vec<usize>>, &mut Vec<usize>) {
        (&mut self.dims, &mut self.partial)
    }

    /// Whether mesh axis `a` tiles a dim or is pending.
    pub fn uses(&self, a: usize) -> bool {
        self.partial.contains(&a) || self.dims.iter().any(|d| d.contains(&a))
    }

    /// The number of tiles along each dim.
    pub fn tiles(&self, mesh: &Mesh) -> Vec<usize> {
        self.dims.iter().map(|axes| axes.iter().map(|&a| mesh.shape()[a]).product()).collect()
    }

    /// How many distinct tiles the value is cut into (the product of [`tiles`]); what
    /// "more tiled" compares.
    ///
    /// [`tiles`]: Self::tiles
    pub fn tile_count(&self, mesh: &Mesh) -> usize {
        self.tiles(mesh).iter().product()
    }

    /// Each device's shape for a value of global `shape`, or
    /// [`Error::Indivisible`] naming the first dim its tiles do not divide.
    pub fn local_shape(&self, mesh: &Mesh, shape: &[usize]) -> Result<Vec<usize>> {
        if shape.len() != self.rank() {
            return Err(Error::RankMismatch {
                sharding_rank: self.rank(),
                shape_rank: shape.len(),
            });
        }
        self.tiles(mesh)
            .into_iter()
            .zip(shape)
            .enumerate()
            .map(|(dim, (t, &size))| {
                if size % t == 0 {
                    Ok(size / t)
                } else {
                    Err(Error::Indivisible { dim, size, shards: t })
                }
            })
            .collect()
    }

    /// Which block of dim `dim` mesh position `device` holds (`0..tiles`).
    pub fn block(&self, mesh: &Mesh, device: usize, dim: usize) -> Result<usize> {
        self.position(mesh, device)?;
        let axes = self.dims.get(dim).ok_or(Error::OutOfRange {
            what: "dim",
            index: dim,
            count: self.rank(),
        })?;
        Ok(block_of(mesh, &coords(mesh, device), axes))
    }

    fn position(&self, mesh: &Mesh, device: usize) -> Result<()> {
        if device >= mesh.size() {
            return Err(Error::OutOfRange {
                what: "mesh position",
                index: device,
                count: mesh.size(),
            });
        }
        Ok(())
    }

    /// The index ranges mesh position `device` holds of a value of global `shape`
    /// (whose dims the tiles must divide).
    pub fn region(&self, mesh: &Mesh, shape: &[usize], device: usize) -> Result<Vec<Range<usize>>> {
        self.position(mesh, device)?;
        let local = self.local_shape(mesh, shape)?;
        let c = coords(mesh, device);
        Ok((0..self.rank())
            .map(|d| {
                let b = block_of(mesh, &c, &self.dims[d]);
                b * local[d]..(b + 1) * local[d]
            })
            .collect())
    }

    /// The partition spec of this layout (`unreduced` for the pending axes).
    pub fn to_spec(&self, mesh: &Mesh) -> PartitionSpec {
        let name = |a: &usize| mesh.axis_names()[*a].clone();
        let mut dims: Vec<DimSpec> = self
            .dims
            .iter()
            .map(|axes| {
                if axes.is_empty() {
                    DimSpec::Replicated
                } else {
                    DimSpec::Axes(axes.iter().map(name).collect())
                }
            })
            .collect();
        while dims.last() == Some(&DimSpec::Replicated) {
            dims.pop();
        }
        PartitionSpec::new(dims).with_unreduced(self.partial.iter().map(name).collect())
    }

    /// The `NamedSharding` of this layout over `mesh`.
    /// Pending axes are lowered as JAX's `unreduced`, which JAX allows on Explicit
    /// axes only: an Auto axis is made Explicit for it.
    pub fn to_named(&self, mesh: &Mesh) -> Result<NamedSharding> {
        let mut types = mesh.axis_types().to_vec();
        for &a in &self.partial {
            if types[a] == AxisType::Auto {
                types[a] = AxisType::Explicit;
            }
        }
        let mesh = if types == mesh.axis_types() {
            mesh.clone()
        } else {
            Mesh::with_types(
                mesh.axis_names().to_vec(),
                mesh.shape().to_vec(),
                types,
                mesh.devices().to_vec(),
            )?
        };
        let spec = self.to_spec(&mesh);
        NamedSharding::new(mesh, spec)
    }

    /// The `HloSharding` JAX lowers this layout to.
    pub fn to_hlo(&self, mesh: &Mesh) -> Result<HloSharding> {
        self.to_named(mesh)?.to_hlo(self.rank())
    }

    /// The layout over `mesh` whose lowering is `hlo` (for a rank-`rank` value):
    /// searched over every assignment of the mesh's axes to the dims `hlo` tiles (in
    /// every order), to pending sums or to nothing, preferring the fewest pending axes. Refused with
    /// [`Error::NotOnMesh`] when no layout over this mesh lowers to `hlo` (its devices
    /// are not a product of the mesh's axes) or the mesh has more than 6 axes larger
    /// than 1.
    pub fn from_hlo(mesh: &Mesh, hlo: &HloSharding, rank: usize) -> Result<Layout> {
        let axes: Vec<usize> = (0..mesh.shape().len()).filter(|&a| mesh.shape()[a] != 1).collect();
        let not_on_mesh = || Error::NotOnMesh { sharding: hlo.to_string(), mesh: mesh.to_string() };
        if axes.len() > 6 {
            return Err(not_on_mesh());
        }
        // Only dims the sharding tiles can take an axis: the search is over those, so
        // its size depends on the mesh and the sharding, never on the rank alone.
        let tiled: Vec<usize> = match hlo {
            HloSharding::Tiled(t) => {
                (0..t.data_dims().len()).filter(|&d| t.data_dims()[d] > 1).collect()
            }
            _ => Vec::new(),
        };
        if tiled.len() > axes.len() || tiled.iter().any(|&d| d >= rank) {
            return Err(not_on_mesh());
        }
        // Slot per axis: 0 unused, 1 pending, 2 + j on dim `tiled[j]`.
        let slots = tiled.len() + 2;
        let mut choice = vec![0usize; axes.len()];
        let mut best: Option<Layout> = None;
        loop {
            let mut groups: Vec<Vec<usize>> = vec![Vec::new(); rank];
            let mut partial = Vec::new();
            for (k, &s) in choice.iter().enumerate() {
                match s {
                    0 => {}
                    1 => partial.push(axes[k]),
                    s => groups[tiled[s - 2]].push(axes[k]),
                }
            }
            if best.as_ref().is_none_or(|b| partial.len() < b.partial.len())
                && let Some(found) = orders(&groups, 0, &mut Vec::new(), &mut |dims| {
                    let l = Layout { dims: dims.to_vec(), partial: partial.clone() };
                    l.to_hlo(mesh).ok().filter(|h| h == hlo).map(|_| l)
                })
            {
                best = Some(found);
            }
            // Next assignment (odometer).
            let mut k = 0;
            loop {
                if k == choice.len() {
                    return best.ok_or_else(not_on_mesh);
                }
                choice[k] += 1;
                if choice[k] < slots {
                    break;
                }
                choice[k] = 0;
                k += 1;
            }
        }
    }

    /// The layout as a partition spec over `mesh`'s axis names:
    /// `P('data', None, 'model')`, with `unreduced={...}` for pending sums.
    pub fn display<'a>(&'a self, mesh: &'a Mesh) -> impl fmt::Display + 'a {
        struct Show<'a>(&'a Layout, &'a Mesh);
        impl fmt::Display for Show<'_> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}", self.0.to_spec(self.1))
            }
        }
        Show(self, mesh)
    }
}

/// Tries every order of the axes within each dim; the first `f` that answers wins.
fn orders<T>(
    groups: &[Vec<usize>],
    d: usize,
    acc: &mut Vec<Vec<usize>>,
    f: &mut impl FnMut(&[Vec<usize>]) -> Option<T>,
) -> Option<T> {
    if d == groups.len() {
        return f(acc);
    }
    let mut perm = groups[d].clone();
    perm.sort_unstable();
    loop {
        acc.push(perm.clone());
        let found = orders(groups, d + 1, acc, f);
        acc.pop();
        if found.is_some() {
            return found;
        }
        if !next_permutation(&mut perm) {
            return None;
        }
    }
}

fn next_permutation(v: &mut [usize]) -> bool {
    let Some(i) = (1..v.len()).rev().find(|&i| v[i - 1] < v[i]) else {
        return false;
    };
    let j = (i..v.len()).rev().find(|&j| v[j] > v[i - 1]).expect("v[i] qualifies");
    v.swap(i - 1, j);
    v[i..].reverse();
    true
}

/// The mesh coordinates of device position `device` (row-major over the mesh shape).
pub(crate) fn coords(mesh: &Mesh, mut device: usize) -> Vec<usize> {
    let shape = mesh.shape();
    let mut c = vec![0; shape.len()];
    for a in (0..shape.len()).rev() {
        c[a] = device % shape[a];
        device /= shape[a];
    }
    c
}

/// The row-major index of coordinates `c` over `axes` (major first).
pub(crate) fn block_of(mesh: &Mesh, c: &[usize], axes: &[usize]) -> usize {
    axes.iter().fold(0, |acc, &a| acc * mesh.shape()[a] + c[a])
}

/// The replica groups of a collective over mesh `axes`: one group per setting of the
/// other axes (in row-major order of those), each listing mesh positions row-major
/// over `axes` in the order given, so member `k` of a group holds block `k` of a dim
/// tiled by `axes`.
pub fn axis_groups(mesh: &Mesh, axes: &[usize]) -> Vec<Vec<usize>> {
    let n = mesh.size();
    let k: usize = axes.iter().map(|&a| mesh.shape()[a]).product();
    let others: Vec<usize> = (0..mesh.shape().len()).filter(|a| !axes.contains(a)).collect();
    let mut groups: Vec<Vec<usize>> = vec![vec![usize::MAX; k]; n / k.max(1)];
    for device in 0..n {
        let c = coords(mesh, device);
        groups[block_of(mesh, &c, &others)][block_of(mesh, &c, axes)] = device;
    }
    groups
}
