//! Tile assignments: which logical device holds each tile, as an explicit list or as
//! XLA's compact iota form `[dims]<=[reshape]T(perm)`.

use std::fmt;

use crate::{Error, Result};

/// The compact form of a tile assignment: `arange(n).reshape(reshape_dims)
/// .transpose(transpose_perm)`, flattened and read in the tile dims' row-major order.
///
/// Always canonical, as XLA's `CanonicalizeIotaDims` leaves it: no size-1 reshape dims,
/// and no two dims that are adjacent both in the reshape and in the permutation (they
/// would merge). The canonical form of a device order is unique, so it is found from
/// the materialised order itself.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Iota {
    reshape_dims: Vec<usize>,
    transpose_perm: Vec<usize>,
}

impl Iota {
    /// The reshape dims, major first.
    pub fn reshape_dims(&self) -> &[usize] {
        &self.reshape_dims
    }

    /// The transpose applied after the reshape.
    pub fn transpose_perm(&self) -> &[usize] {
        &self.transpose_perm
    }

    /// The canonical iota form of `order`, if it has one.
    ///
    /// Reads the order as nested arithmetic runs, minor first: a block of `b` elements
    /// repeats `len` times with a constant `stride`. Maximal runs are exactly XLA's
    /// merged dims. The order is an iota iff it starts at 0, the runs cover it, and the
    /// strides, sorted, form a mixed radix (each stride is the product of the lengths of
    /// the smaller-stride runs).
    pub(crate) fn detect(order: &[usize]) -> Option<Iota> {
        let n = order.len();
        if n == 0 || order[0] != 0 {
            return None;
        }
        if n == 1 {
            return Some(Iota { reshape_dims: vec![1], transpose_perm: vec![0] });
        }
        // (length, stride), minor level first.
        let mut levels: Vec<(usize, usize)> = Vec::new();
        let mut block = 1;
        while block < n {
            let stride = order[block];
            let mut len = 1;
            while (len + 1) * block <= n {
                let start = len * block;
                let shifted = order[start..start + block]
                    .iter()
                    .zip(&order[..block])
                    .all(|(&v, &base)| v == base + len * stride);
                if !shifted {
                    break;
                }
                len += 1;
            }
            if len == 1 || !n.is_multiple_of(len * block) {
                return None;
            }
            levels.push((len, stride));
            block *= len;
        }
        // The strides must form a mixed radix.
        let mut by_stride: Vec<usize> = (0..levels.len()).collect();
        by_stride.sort_by_key(|&i| levels[i].1);
        let mut expected = 1;
        for &i in &by_stride {
            if levels[i].1 != expected {
                return None;
            }
            expected *= levels[i].0;
        }
        // Reshape dims: largest stride (most major) first. Output order: the most major
        // level first, i.e. `levels` reversed.
        let reshape_of_level: Vec<usize> = {
            let mut rank = vec![0; levels.len()];
            for (pos, &i) in by_stride.iter().rev().enumerate() {
                rank[i] = pos;
            }
            rank
        };
        let reshape_dims = by_stride.iter().rev().map(|&i| levels[i].0).collect();
        let transpose_perm = (0..levels.len()).rev().map(|i| reshape_of_level[i]).collect();
        Some(Iota { reshape_dims, transpose_perm })
    }

    fn materialize(reshape_dims: &[usize], perm: &[usize]) -> Vec<usize> {
        let n: usize = reshape_dims.iter().product();
        let strides = row_major_strides(reshape_dims);
        let out_dims: Vec<usize> = perm.iter().map(|&p| reshape_dims[p]).collect();
        let out_strides: Vec<usize> = perm.iter().map(|&p| strides[p]).collect();
        let mut out = Vec::with_capacity(n);
        for_each_index(&out_dims, |idx| {
            out.push(idx.iter().zip(&out_strides).map(|(i, s)| i * s).sum());
        });
        out
    }
}

impl fmt::Display for Iota {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "<=[{}]", join(&self.reshape_dims))?;
        if self.reshape_dims.len() > 1 {
            write!(f, "T({})", join(&self.transpose_perm))?;
        }
        Ok(())
    }
}

/// Which logical device (a position in a device assignment) holds each tile.
///
/// `dims` are the tile dims (data dims, then any subgroup dims); `devices` is the
/// row-major list of logical devices, a permutation of `0..n`. An assignment built from
/// an iota keeps its compact form (and prints as `<=[..]`); equality compares only dims
/// and devices, so an explicit list equals the same iota.
#[derive(Debug, Clone)]
pub struct TileAssignment {
    dims: Vec<usize>,
    devices: Vec<usize>,
    iota: Option<Iota>,
}

impl PartialEq for TileAssignment {
    fn eq(&self, other: &Self) -> bool {
        self.dims == other.dims && self.devices == other.devices
    }
}

impl Eq for TileAssignment {}

impl std::hash::Hash for TileAssignment {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.dims.hash(state);
        self.devices.hash(state);
    }
}

impl TileAssignment {
    /// An explicit assignment: `devices` in row-major order over `dims`.
    pub fn explicit(dims: Vec<usize>, devices: Vec<usize>) -> Result<TileAssignment> {
        let expected = tile_count(&dims)?;
        if devices.len() != expected {
            return Err(Error::TileCount { dims, expected, actual: devices.len() });
        }
        check_permutation(&devices)?;
        Ok(TileAssignment { dims, devices, iota: None })
    }

    /// The iota assignment `arange(n).reshape(reshape_dims).transpose(perm)` laid over
    /// `dims`.
    pub fn iota(
        dims: Vec<usize>,
        reshape_dims: &[usize],
        perm: &[usize],
    ) -> Result<TileAssignment> {
        let expected = tile_count(&dims)?;
        let actual = tile_count(reshape_dims)?;
        if actual != expected {
            return Err(Error::TileCount { dims, expected, actual });
        }
        check_transpose(perm, reshape_dims.len())?;
        let devices = Iota::materialize(reshape_dims, perm);
        let iota = Iota::detect(&devices).expect("a materialised iota is an iota");
        Ok(TileAssignment { dims, devices, iota: Some(iota) })
    }

    /// The plain iota `0..n` over `dims` (XLA's `<=[n]`).
    pub fn identity(dims: Vec<usize>) -> Result<TileAssignment> {
        let n = tile_count(&dims)?;
        TileAssignment::iota(dims, &[n], &[0])
    }

    /// The tile dims.
    pub fn dims(&self) -> &[usize] {
        &self.dims
    }

    /// The logical device of every tile, row-major over [`dims`](Self::dims).
    pub fn devices(&self) -> &[usize] {
        &self.devices
    }

    /// The compact form, if this assignment was built as (and still is) an iota.
    pub fn iota_form(&self) -> Option<&Iota> {
        self.iota.as_ref()
    }

    /// Number of tiles (= devices).
    pub fn num_elements(&self) -> usize {
        self.devices.len()
    }

    /// Same devices, other dims with the same product (a reshape keeps the iota form).
    pub(crate) fn reshape(&self, dims: Vec<usize>) -> TileAssignment {
        debug_assert_eq!(dims.iter().product::<usize>(), self.devices.len());
        TileAssignment { dims, devices: self.devices.clone(), iota: self.iota.clone() }
    }

    /// Transposes the tile dims by `perm`. An iota stays an iota when the result has an
    /// iota form (as XLA's `IotaTileAssignment::Transpose`); a list stays a list.
    pub(crate) fn transpose(&self, perm: &[usize]) -> TileAssignment {
        let dims: Vec<usize> = perm.iter().map(|&p| self.dims[p]).collect();
        let devices = transpose_values(&self.devices, &self.dims, perm);
        self.with_devices(dims, devices)
    }

    /// A new assignment in the same form as this one: iota if this is an iota and the
    /// new order has an iota form, explicit otherwise.
    pub(crate) fn with_devices(&self, dims: Vec<usize>, devices: Vec<usize>) -> TileAssignment {
        let iota = self.iota.as_ref().and_then(|_| Iota::detect(&devices));
        TileAssignment { dims, devices, iota }
    }
}

impl fmt::Display for TileAssignment {
    /// XLA's text: `[dims]<=[reshape]T(perm)` or `[dims]d0,d1,...`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{}]", join(&self.dims))?;
        match &self.iota {
            Some(iota) => write!(f, "{iota}"),
            None => f.write_str(&join(&self.devices)),
        }
    }
}

pub(crate) fn join(values: &[usize]) -> String {
    let mut out = String::new();
    for (i, v) in values.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(&v.to_string());
    }
    out
}

/// The most tiles (devices) a tile assignment may have. Assignments are materialised,
/// so this bounds the memory a parsed `{devices=[n]<=[n]}` can ask for (8 MiB).
pub const MAX_TILES: usize = 1 << 20;

/// The product of tile dims; every dim must be at least 1, the product at most
/// [`MAX_TILES`].
fn tile_count(dims: &[usize]) -> Result<usize> {
    let count = dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
    match count {
        Some(n) if !dims.is_empty() && !dims.contains(&0) && n <= MAX_TILES => Ok(n),
        _ => Err(Error::BadTileDims { dims: dims.to_vec() }),
    }
}

fn check_permutation(values: &[usize]) -> Result<()> {
    let mut seen = vec![false; values.len()];
    for &v in values {
        if v >= values.len() || std::mem::replace(&mut seen[v], true) {
            return Err(Error::NotAPermutation { devices: values.to_vec() });
        }
    }
    Ok(())
}

pub(crate) fn check_transpose(perm: &[usize], rank: usize) -> Result<()> {
    let mut seen = vec![false; rank];
    let ok = perm.len() == rank
        && perm.iter().all(|&p| p < rank && !std::mem::replace(&mut seen[p], true));
    if ok { Ok(()) } else { Err(Error::BadTranspose { perm: perm.to_vec(), rank }) }
}

pub(crate) fn row_major_strides(dims: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * dims[i + 1];
    }
    strides
}

/// Calls `f` with every multi-index of `dims`, row-major.
pub(crate) fn for_each_index(dims: &[usize], mut f: impl FnMut(&[usize])) {
    if dims.contains(&0) {
        return;
    }
    let mut idx = vec![0; dims.len()];
    loop {
        f(&idx);
        let mut d = dims.len();
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < dims[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// `values` (row-major over `dims`) transposed by `perm`, row-major over the new dims.
fn transpose_values(values: &[usize], dims: &[usize], perm: &[usize]) -> Vec<usize> {
    let strides = row_major_strides(dims);
    let new_dims: Vec<usize> = perm.iter().map(|&p| dims[p]).collect();
    let new_strides: Vec<usize> = perm.iter().map(|&p| strides[p]).collect();
    let mut out = Vec::with_capacity(values.len());
    for_each_index(&new_dims, |idx| {
        out.push(values[idx.iter().zip(&new_strides).map(|(i, s)| i * s).sum::<usize>()]);
    });
    out
}

#[cfg(test)]
mod tests;
