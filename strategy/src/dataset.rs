//! Input distribution: global batches split over the replicas, or one input pipeline
//! per host.

use meshwork_executor::Tensor;

use crate::values::{Arg, PerReplica};
use crate::{Error, Result, ops};

/// What to do with a final batch smaller than the others.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Remainder {
    /// Drop it.
    Drop,
    /// Serve it, split as evenly as the rows allow (the first replicas get one row more);
    /// [`Strategy::reduce`](crate::Strategy::reduce) with an axis weighs replicas by
    /// their rows, so a MEAN over the batch stays exact.
    #[default]
    Ragged,
}

/// One step's input: every tensor of the batch split by rows over the replicas.
#[derive(Debug, Clone, PartialEq)]
pub struct DistributedBatch {
    /// One per-replica argument per input tensor (this process's replicas).
    pub args: Vec<Arg>,
    /// Rows each (of this process's) replicas got.
    pub rows: Vec<usize>,
}

/// Where an input pipeline runs (`tf.distribute.InputContext`). With several processes,
/// each process runs the pipelines of the hosts whose replicas it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InputContext {
    /// Pipelines (hosts) in all.
    pub num_input_pipelines: usize,
    /// This pipeline.
    pub input_pipeline_id: usize,
    /// Replicas in sync.
    pub num_replicas_in_sync: usize,
}

impl InputContext {
    /// The per-replica batch of a global batch (TF's check and wording).
    pub fn get_per_replica_batch_size(&self, global_batch_size: usize) -> Result<usize> {
        per_replica(global_batch_size, self.num_replicas_in_sync)
    }
}

fn per_replica(global: usize, replicas: usize) -> Result<usize> {
    if replicas == 0 || !global.is_multiple_of(replicas) {
        return Err(Error::BatchNotDivisible { global_batch_size: global, num_replicas: replicas });
    }
    Ok(global / replicas)
}

/// Splits `rows` over `parts`: the first `rows % parts` get one more.
fn split_rows(rows: usize, parts: usize) -> Vec<usize> {
    (0..parts).map(|k| rows / parts + usize::from(k < rows % parts)).collect()
}

/// The rows of a batch (all inputs must agree).
fn batch_rows(batch: &[Tensor], index: usize) -> Result<usize> {
    let first = batch.first().ok_or(Error::Empty { what: "batch" })?;
    let rows = |t: &Tensor| t.shape().first().copied().ok_or(Error::GatherScalar);
    let expected = rows(first)?;
    for (input, t) in batch.iter().enumerate() {
        let actual = rows(t)?;
        if actual != expected {
            return Err(Error::BatchRows { batch: index, input, expected, actual });
        }
    }
    Ok(expected)
}

/// Each input of `batch` cut into consecutive row blocks of `counts`.
fn cut(batch: &[Tensor], counts: &[usize]) -> Vec<Vec<Tensor>> {
    batch
        .iter()
        .map(|t| {
            let mut at = 0;
            counts
                .iter()
                .map(|&c| {
                    at += c;
                    ops::rows(t, at - c..at)
                })
                .collect()
        })
        .collect()
}

/// Global batches distributed over replicas ([`Strategy::distribute_dataset`](crate::Strategy::distribute_dataset)).
pub struct DistributedDataset<I> {
    batches: I,
    replicas: usize,
    /// This process's replicas: the ones whose pieces are kept.
    local: std::ops::Range<usize>,
    remainder: Remainder,
    batch_size: Option<usize>,
    index: usize,
    done: bool,
}

impl<I: Iterator<Item = Vec<Tensor>>> DistributedDataset<I> {
    pub(crate) fn new(
        batches: I,
        replicas: usize,
        local: std::ops::Range<usize>,
        remainder: Remainder,
    ) -> Self {
        DistributedDataset {
            batches,
            replicas,
            local,
            remainder,
            batch_size: None,
            index: 0,
            done: false,
        }
    }

    fn split(&mut self, batch: Vec<Tensor>) -> Result<Option<DistributedBatch>> {
        let rows = batch_rows(&batch, self.index)?;
        let full = *self.batch_size.get_or_insert(rows);
        let counts = if rows >= full {
            vec![per_replica(rows, self.replicas)?; self.replicas]
        } else if self.remainder == Remainder::Drop {
            return Ok(None);
        } else {
            split_rows(rows, self.replicas)
        };
        let local = self.local.clone();
        let args = cut(&batch, &counts)
            .into_iter()
            .map(|v| Arg::PerReplica(PerReplica::new(v[local.clone()].to_vec())))
            .collect();
        Ok(Some(DistributedBatch { args, rows: counts[local].to_vec() }))
    }
}

impl<I: Iterator<Item = Vec<Tensor>>> Iterator for DistributedDataset<I> {
    type Item = Result<DistributedBatch>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        let batch = self.batches.next()?;
        let out = self.split(batch);
        self.index += 1;
        match out {
            Ok(Some(b)) => Some(Ok(b)),
            Ok(None) => {
                self.done = true;
                None
            }
            Err(e) => {
                self.done = true;
                Some(Err(e))
            }
        }
    }
}

/// One host's input pipeline: its batches.
pub type Pipeline = Box<dyn Iterator<Item = Vec<Tensor>> + Send>;

/// The function that makes each host's pipeline.
pub type PipelineFn = dyn Fn(&InputContext) -> Pipeline;

/// One input pipeline per host, each feeding its host's replicas
/// ([`Strategy::distribute_datasets_from_function`](crate::Strategy::distribute_datasets_from_function)).
pub struct PerHostDataset {
    pipelines: Vec<(Vec<usize>, Pipeline)>,
    replicas: usize,
    local: std::ops::Range<usize>,
    remainder: Remainder,
    index: usize,
    done: bool,
}

impl PerHostDataset {
    pub(crate) fn new(
        pipelines: Vec<(Vec<usize>, Pipeline)>,
        replicas: usize,
        local: std::ops::Range<usize>,
        remainder: Remainder,
    ) -> PerHostDataset {
        PerHostDataset { pipelines, replicas, local, remainder, index: 0, done: false }
    }

    fn step(&mut self) -> Option<Result<DistributedBatch>> {
        let mut per_replica_args: Vec<Option<Vec<Tensor>>> = vec![None; self.replicas];
        let mut rows = vec![0; self.replicas];
        for (replicas, pipeline) in &mut self.pipelines {
            let batch = pipeline.next()?;
            let n = match batch_rows(&batch, self.index) {
                Ok(n) => n,
                Err(e) => return Some(Err(e)),
            };
            let counts = if n.is_multiple_of(replicas.len()) {
                vec![n / replicas.len(); replicas.len()]
            } else if self.remainder == Remainder::Drop {
                return None;
            } else {
                split_rows(n, replicas.len())
            };
            let pieces = cut(&batch, &counts);
            for (k, &r) in replicas.iter().enumerate() {
                per_replica_args[r] = Some(pieces.iter().map(|p| p[k].clone()).collect());
                rows[r] = counts[k];
            }
        }
        let per_replica: Vec<Vec<Tensor>> = per_replica_args[self.local.clone()]
            .iter()
            .map(|a| a.clone().unwrap_or_default())
            .collect();
        let rows = rows[self.local.clone()].to_vec();
        let inputs = per_replica.first().map_or(0, Vec::len);
        if let Some((r, _)) = per_replica.iter().enumerate().find(|(_, a)| a.len() != inputs) {
            return Some(Err(Error::BatchRows {
                batch: self.index,
                input: r,
                expected: inputs,
                actual: per_replica[r].len(),
            }));
        }
        let args = (0..inputs)
            .map(|i| {
                Arg::PerReplica(PerReplica::new(per_replica.iter().map(|a| a[i].clone()).collect()))
            })
            .collect();
        Some(Ok(DistributedBatch { args, rows }))
    }
}

impl Iterator for PerHostDataset {
    type Item = Result<DistributedBatch>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        let out = self.step();
        self.index += 1;
        if !matches!(out, Some(Ok(_))) {
            self.done = true;
        }
        out
    }
}
