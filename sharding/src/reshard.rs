//! Resharding: a plan of box copies from one sharding's shards to another's that moves
//! no byte already in place, and its application to in-memory shards.

use std::ops::Range;

use meshwork_types::DeviceId;
use ndarray::{ArrayD, ArrayViewD, ArrayViewMutD, IxDyn};

use crate::data::{BoxCopy, check_buffers, extent};
use crate::par::run_jobs;
use crate::{Error, Mode, Result, ShardIndex, Sharding};

/// One box copy of a reshard plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transfer {
    /// Index of the source shard (in the source sharding's index-map order).
    pub src: usize,
    /// Index of the destination shard (in the target sharding's index-map order).
    pub dst: usize,
    /// The device sending.
    pub src_device: DeviceId,
    /// The device receiving.
    pub dst_device: DeviceId,
    /// The region copied, in global coordinates.
    pub region: Vec<Range<usize>>,
}

impl Transfer {
    /// Whether the copy stays on one device (moves no bytes between devices).
    pub fn is_local(&self) -> bool {
        self.src_device == self.dst_device
    }

    /// Elements copied.
    pub fn elements(&self) -> usize {
        self.region.iter().map(Range::len).product()
    }
}

/// How to turn shards of one sharding into shards of another, for one global shape.
///
/// For every destination shard and every distinct source region overlapping it, one
/// copy of the overlap: from the destination device itself when it already holds that
/// region (a local copy), otherwise from the holder that has sent the least so far.
/// Since every device holds at most one source region, the bytes that cross devices —
/// each destination's region minus what the same device already holds — are the
/// minimum any plan can move.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReshardPlan {
    from: Vec<ShardIndex>,
    to: Vec<ShardIndex>,
    transfers: Vec<Transfer>,
}

impl ReshardPlan {
    /// Plans the move of an array of `shape` from `from` to `to` (same or different
    /// device sets).
    pub fn new(from: &Sharding, to: &Sharding, shape: &[usize], mode: Mode) -> Result<ReshardPlan> {
        let from_index = from.index_map(shape, mode)?;
        let to_index = to.index_map(shape, mode)?;
        // Distinct source regions with their holders, in order of first appearance.
        let mut regions: Vec<(&[Range<usize>], Vec<usize>)> = Vec::new();
        for (i, entry) in from_index.iter().enumerate() {
            match regions.iter_mut().find(|(r, _)| *r == entry.ranges.as_slice()) {
                Some((_, holders)) => holders.push(i),
                None => regions.push((&entry.ranges, vec![i])),
            }
        }
        let mut sent = vec![0usize; from_index.len()];
        let mut transfers = Vec::new();
        for (dst, target) in to_index.iter().enumerate() {
            for (region, holders) in &regions {
                let Some(overlap) = intersect(region, &target.ranges) else {
                    continue;
                };
                let local =
                    holders.iter().copied().find(|&h| from_index[h].device == target.device);
                let src = local.unwrap_or_else(|| {
                    *holders.iter().min_by_key(|&&h| sent[h]).expect("a region has a holder")
                });
                let transfer = Transfer {
                    src,
                    dst,
                    src_device: from_index[src].device,
                    dst_device: target.device,
                    region: overlap,
                };
                if !transfer.is_local() {
                    sent[src] += transfer.elements();
                }
                transfers.push(transfer);
            }
        }
        Ok(ReshardPlan { from: from_index, to: to_index, transfers })
    }

    /// The copies, grouped by destination shard.
    pub fn transfers(&self) -> &[Transfer] {
        &self.transfers
    }

    /// The source shards' index map.
    pub fn source_index(&self) -> &[ShardIndex] {
        &self.from
    }

    /// The destination shards' index map.
    pub fn target_index(&self) -> &[ShardIndex] {
        &self.to
    }

    /// Elements that cross from one device to another.
    pub fn elements_moved(&self) -> usize {
        self.transfers.iter().filter(|t| !t.is_local()).map(Transfer::elements).sum()
    }

    /// Bytes that cross devices, for elements of `element_size` bytes.
    pub fn bytes_moved(&self, element_size: usize) -> usize {
        self.elements_moved() * element_size
    }

    /// Elements in all destination shards together (what a plan that moved everything
    /// would move).
    pub fn total_elements(&self) -> usize {
        self.to.iter().map(|e| e.ranges.iter().map(Range::len).product::<usize>()).sum()
    }

    /// Builds the destination shards from `src` (the source shards, index-map order).
    pub fn apply<T: Copy + Default + Send + Sync>(
        &self,
        src: &[ArrayViewD<'_, T>],
    ) -> Result<Vec<ArrayD<T>>> {
        let mut out: Vec<ArrayD<T>> = self
            .to
            .iter()
            .map(|e| ArrayD::from_elem(IxDyn(&extent(&e.ranges)), T::default()))
            .collect();
        let mut views: Vec<ArrayViewMutD<'_, T>> = out.iter_mut().map(|a| a.view_mut()).collect();
        self.apply_into(src, &mut views)?;
        Ok(out)
    }

    /// Writes the destination shards into caller buffers (index-map order, each shaped
    /// like its region and contiguous).
    pub fn apply_into<T: Copy + Send + Sync>(
        &self,
        src: &[ArrayViewD<'_, T>],
        dst: &mut [ArrayViewMutD<'_, T>],
    ) -> Result<()> {
        check_buffers(&self.from, src.iter().map(|a| a.shape()))?;
        check_buffers(&self.to, dst.iter().map(|a| a.shape()))?;
        let sources: Vec<_> = src.iter().map(|a| a.as_standard_layout()).collect();
        // One job per destination shard: its transfers write only its buffer.
        let mut jobs = Vec::with_capacity(dst.len());
        let mut transfers = self.transfers.as_slice();
        for (d, buffer) in dst.iter_mut().enumerate() {
            let device = self.to[d].device;
            let data = buffer.as_slice_mut().ok_or(Error::NotContiguous { device })?;
            let count = transfers.iter().take_while(|t| t.dst == d).count();
            let (mine, rest) = transfers.split_at(count);
            transfers = rest;
            jobs.push((size_of_val(data), (d, mine, data)));
        }
        run_jobs(jobs, &|(d, mine, data): (usize, &[Transfer], &mut [T])| {
            let target = &self.to[d];
            let dst_shape = extent(&target.ranges);
            for t in mine {
                let source = &self.from[t.src];
                let src_data = sources[t.src].as_slice().expect("standard layout is contiguous");
                let src_at: Vec<usize> =
                    t.region.iter().zip(&source.ranges).map(|(r, o)| r.start - o.start).collect();
                let dst_at: Vec<usize> =
                    t.region.iter().zip(&target.ranges).map(|(r, o)| r.start - o.start).collect();
                let ext = extent(&t.region);
                BoxCopy {
                    src_shape: &extent(&source.ranges),
                    src_at: &src_at,
                    dst_shape: &dst_shape,
                    dst_at: &dst_at,
                    extent: &ext,
                }
                .copy(src_data, data);
            }
        });
        Ok(())
    }
}

/// The overlap of two boxes, or `None` if it holds no element. (A rank-0 box is the
/// one scalar element, so two of them overlap.)
fn intersect(a: &[Range<usize>], b: &[Range<usize>]) -> Option<Vec<Range<usize>>> {
    let overlap: Vec<Range<usize>> =
        a.iter().zip(b).map(|(x, y)| x.start.max(y.start)..x.end.min(y.end)).collect();
    if overlap.iter().all(|r| r.start < r.end) { Some(overlap) } else { None }
}
