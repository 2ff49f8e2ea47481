//! Moving data: splitting an `ndarray` array into per-device shards and assembling it
//! back.
//!
//! Every copy is a box copy between two row-major buffers, done row by row with
//! `copy_from_slice` (trailing dims that both sides hold whole are merged into one
//! longer row), so a shard costs one read and one write of its bytes.

use std::ops::Range;

use meshwork_types::DeviceId;
use ndarray::{ArrayD, ArrayViewD, ArrayViewMutD, IxDyn};

use crate::par::run_jobs;
use crate::{Error, Mode, Result, ShardIndex, Sharding};

/// One device's part of a sharded array.
#[derive(Debug, Clone, PartialEq)]
pub struct Shard<T> {
    /// The device holding it.
    pub device: DeviceId,
    /// The region of the global array it holds.
    pub ranges: Vec<Range<usize>>,
    /// Its first holder has replica id 0.
    pub replica_id: usize,
    /// The data: exactly the region (in uneven mode, trailing shards are short or
    /// empty; pad to [`Sharding::shard_shape`] yourself if you need XLA's padded
    /// buffers).
    pub data: ArrayD<T>,
}

/// Splits `global` into one shard per device of `sharding`, in index-map order
/// (device-assignment order; a maximal sharding gives one shard).
pub fn shard<T: Copy>(
    global: &ArrayViewD<'_, T>,
    sharding: &Sharding,
    mode: Mode,
) -> Result<Vec<Shard<T>>> {
    let index = sharding.index_map(global.shape(), mode)?;
    let source = global.as_standard_layout();
    let src = source.as_slice().expect("standard layout is contiguous");
    let shape = global.shape();
    Ok(index
        .into_iter()
        .map(|ShardIndex { device, ranges, replica_id }| {
            let ext = extent(&ranges);
            let mut data = Vec::with_capacity(ext.iter().product());
            let box_ = BoxCopy {
                src_shape: shape,
                src_at: &starts(&ranges),
                dst_shape: &ext,
                dst_at: &vec![0; ext.len()],
                extent: &ext,
            };
            box_.for_each_row(|src_offset, _, len| {
                data.extend_from_slice(&src[src_offset..src_offset + len])
            });
            let data = ArrayD::from_shape_vec(IxDyn(&ext), data).expect("region-sized data");
            Shard { device, ranges, replica_id, data }
        })
        .collect())
}

/// Splits `global` into caller-provided buffers, one per entry of the index map in
/// order, each shaped like its region and contiguous. Reusing buffers across steps
/// avoids faulting in fresh memory every time.
pub fn shard_into<T: Copy + Send + Sync>(
    global: &ArrayViewD<'_, T>,
    sharding: &Sharding,
    mode: Mode,
    out: &mut [ArrayViewMutD<'_, T>],
) -> Result<()> {
    let index = sharding.index_map(global.shape(), mode)?;
    check_buffers(&index, out.iter().map(|b| b.shape()))?;
    let source = global.as_standard_layout();
    let src = source.as_slice().expect("standard layout is contiguous");
    let mut jobs = Vec::with_capacity(index.len());
    for (entry, buffer) in index.iter().zip(out.iter_mut()) {
        let dst = buffer.as_slice_mut().ok_or(Error::NotContiguous { device: entry.device })?;
        jobs.push((size_of_val(dst), (entry, dst)));
    }
    let shape = global.shape();
    run_jobs(jobs, &|(entry, dst): (&ShardIndex, &mut [T])| {
        let ext = extent(&entry.ranges);
        let zero = vec![0; ext.len()];
        BoxCopy {
            src_shape: shape,
            src_at: &starts(&entry.ranges),
            dst_shape: &ext,
            dst_at: &zero,
            extent: &ext,
        }
        .copy(src, dst);
    });
    Ok(())
}

/// Assembles the global array of `shape` from `shards` (index-map order, each shaped
/// like its region). Each distinct region is read once, from its first holder.
pub fn assemble<T: Copy + Default + Send + Sync>(
    shards: &[ArrayViewD<'_, T>],
    sharding: &Sharding,
    shape: &[usize],
    mode: Mode,
) -> Result<ArrayD<T>> {
    // Check the shape (and the shards) before allocating the output.
    let index = sharding.index_map(shape, mode)?;
    check_buffers(&index, shards.iter().map(|s| s.shape()))?;
    let mut out = ArrayD::from_elem(IxDyn(shape), T::default());
    assemble_into(shards, sharding, mode, &mut out.view_mut())?;
    Ok(out)
}

/// [`assemble`] into a caller-provided contiguous array of the global shape.
pub fn assemble_into<T: Copy + Send + Sync>(
    shards: &[ArrayViewD<'_, T>],
    sharding: &Sharding,
    mode: Mode,
    out: &mut ArrayViewMutD<'_, T>,
) -> Result<()> {
    let shape = out.shape().to_vec();
    let index = sharding.index_map(&shape, mode)?;
    check_buffers(&index, shards.iter().map(|s| s.shape()))?;
    let dst = out.as_slice_mut().ok_or(Error::OutputNotContiguous)?;
    let sources: Vec<_> = index
        .iter()
        .zip(shards)
        .filter(|(entry, _)| entry.replica_id == 0)
        .map(|(entry, shard)| (entry, shard.as_standard_layout()))
        .collect();
    // Split the output into bands of whole outer rows, one job each; a band takes the
    // part of every shard that falls in it.
    let outer = shape.first().copied().unwrap_or(1).max(1);
    let row: usize = shape.iter().skip(1).product();
    let bands = std::thread::available_parallelism().map_or(1, usize::from).min(outer);
    let per_band = outer.div_ceil(bands);
    // (A scalar is one band of one element.)
    let mut jobs = Vec::with_capacity(bands);
    let mut rest = dst;
    let mut first_row = 0;
    while first_row < outer && !rest.is_empty() {
        let rows = per_band.min(outer - first_row);
        let (band, tail) = rest.split_at_mut((rows * row).min(rest.len()));
        jobs.push((size_of_val(band), (first_row..first_row + rows, band)));
        rest = tail;
        first_row += rows;
    }
    run_jobs(jobs, &|(rows, band): (Range<usize>, &mut [T])| {
        let mut band_shape = shape.clone();
        if let Some(first) = band_shape.first_mut() {
            *first = rows.len();
        }
        for (entry, local) in &sources {
            let src = local.as_slice().expect("standard layout is contiguous");
            let mut region = entry.ranges.clone();
            if let Some(r0) = region.first_mut() {
                *r0 = r0.start.max(rows.start)..r0.end.min(rows.end);
                if r0.start >= r0.end {
                    continue;
                }
            }
            let ext = extent(&region);
            let src_at: Vec<usize> =
                region.iter().zip(&entry.ranges).map(|(r, o)| r.start - o.start).collect();
            let mut dst_at = starts(&region);
            if let Some(d0) = dst_at.first_mut() {
                *d0 -= rows.start;
            }
            BoxCopy {
                src_shape: &extent(&entry.ranges),
                src_at: &src_at,
                dst_shape: &band_shape,
                dst_at: &dst_at,
                extent: &ext,
            }
            .copy(src, band);
        }
    });
    Ok(())
}

/// A box of `extent` elements at `src_at` in a row-major buffer of `src_shape`, to be
/// copied to `dst_at` in a row-major buffer of `dst_shape`.
pub(crate) struct BoxCopy<'a> {
    pub(crate) src_shape: &'a [usize],
    pub(crate) src_at: &'a [usize],
    pub(crate) dst_shape: &'a [usize],
    pub(crate) dst_at: &'a [usize],
    pub(crate) extent: &'a [usize],
}

impl BoxCopy<'_> {
    /// Copies the box from `src` to `dst`.
    pub(crate) fn copy<T: Copy>(&self, src: &[T], dst: &mut [T]) {
        self.for_each_row(|s, d, len| dst[d..d + len].copy_from_slice(&src[s..s + len]));
    }

    /// Calls `f(src_offset, dst_offset, len)` for every contiguous row of the box, in
    /// row-major order of the box. Trailing dims that both buffers hold whole merge into
    /// one row.
    pub(crate) fn for_each_row(&self, mut f: impl FnMut(usize, usize, usize)) {
        let rank = self.extent.len();
        if self.extent.contains(&0) {
            return;
        }
        let mut merged = rank;
        while merged > 0
            && self.extent[merged - 1] == self.src_shape[merged - 1]
            && self.extent[merged - 1] == self.dst_shape[merged - 1]
        {
            merged -= 1;
        }
        let src_strides = crate::tile::row_major_strides(self.src_shape);
        let dst_strides = crate::tile::row_major_strides(self.dst_shape);
        if merged == 0 {
            return f(0, 0, self.extent.iter().product());
        }
        // Rows run along dim `merged - 1` and everything after it.
        let row_dim = merged - 1;
        let len: usize = self.extent[row_dim..].iter().product();
        let outer = &self.extent[..row_dim];
        crate::tile::for_each_index(outer, |idx| {
            let mut s = self.src_at[row_dim] * src_strides[row_dim];
            let mut d = self.dst_at[row_dim] * dst_strides[row_dim];
            for (i, &k) in idx.iter().enumerate() {
                s += (self.src_at[i] + k) * src_strides[i];
                d += (self.dst_at[i] + k) * dst_strides[i];
            }
            f(s, d, len);
        });
    }
}

fn starts(ranges: &[Range<usize>]) -> Vec<usize> {
    ranges.iter().map(|r| r.start).collect()
}

pub(crate) fn extent(ranges: &[Range<usize>]) -> Vec<usize> {
    ranges.iter().map(Range::len).collect()
}

pub(crate) fn check_buffers<'a>(
    index: &[ShardIndex],
    shapes: impl ExactSizeIterator<Item = &'a [usize]>,
) -> Result<()> {
    if shapes.len() != index.len() {
        return Err(Error::ShardCount { expected: index.len(), actual: shapes.len() });
    }
    for (entry, actual) in index.iter().zip(shapes) {
        let expected = extent(&entry.ranges);
        if actual != expected.as_slice() {
            return Err(Error::ShardShape {
                device: entry.device,
                expected,
                actual: actual.to_vec(),
            });
        }
    }
    Ok(())
}
