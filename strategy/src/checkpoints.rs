//! A strategy's variables in sharded checkpoints (the checkpoint crate's format): each
//! variable's distinct shards as its sharding over the logical devices holds them, and
//! back onto whatever layout the restoring strategy gives it.

use std::path::{Path, PathBuf};

use meshwork_checkpoint::{CheckpointEntry, CheckpointManager};
use meshwork_types::{DType, Tensor};
use serde_json::Value;

use crate::strategy::Strategy;
use crate::variable::{Aggregation, Synchronization, VarState};
use crate::{Error, Result, ops};

/// The value a checkpoint keeps of a variable: the synchronised value of a
/// sync-on-write variable, the aggregated read of a sync-on-read one (replica 0's copy
/// when it has no aggregation).
fn saved_value(s: &VarState) -> Result<Tensor> {
    if s.sync == Synchronization::OnRead && s.aggregation == Aggregation::None {
        s.value_of(0)
    } else {
        s.read()
    }
}

impl Strategy {
    /// Saves every variable as a new checkpoint in `dir`: created if absent, or an
    /// existing empty directory. Anything else at `dir` is refused and left alone —
    /// this never replaces or deletes what it did not write. The index is written last,
    /// so a save cut short leaves no directory that restores. For rolling checkpoints
    /// of a training run use a [`CheckpointManager`] ([`save_to`](Self::save_to)).
    ///
    /// With several processes every process calls it: process 0 writes (every
    /// process holds the same sync-on-write values) and all return once it has.
    pub fn save_checkpoint(&self, dir: impl AsRef<Path>) -> Result<()> {
        self.save_checkpoint_with(dir.as_ref(), None)
    }

    /// [`save_checkpoint`](Self::save_checkpoint) with `metadata` (any JSON: a run's
    /// configuration, say) kept in the index, where
    /// [`checkpoint_metadata`](meshwork_checkpoint::checkpoint_metadata) reads it back.
    pub fn save_checkpoint_with_metadata(
        &self,
        dir: impl AsRef<Path>,
        metadata: &Value,
    ) -> Result<()> {
        self.save_checkpoint_with(dir.as_ref(), Some(metadata))
    }

    fn save_checkpoint_with(&self, dir: &Path, metadata: Option<&Value>) -> Result<()> {
        if !self.is_multi_process() {
            let entries = self.checkpoint_entries()?;
            let devices = self.num_logical_devices();
            return Ok(meshwork_checkpoint::write_checkpoint(dir, devices, entries, metadata)?);
        }
        if let Some(s) = self.states().iter().find(|s| s.sync == Synchronization::OnRead) {
            return Err(Error::Variable {
                variable: s.name.clone(),
                problem: "is synchronised on read, and other processes hold some of its copies: \
                          a multi-process checkpoint cannot save it"
                    .into(),
            });
        }
        let written = if self.local_replicas().start == 0 {
            self.checkpoint_entries().and_then(|entries| {
                let devices = self.num_logical_devices();
                Ok(meshwork_checkpoint::write_checkpoint(dir, devices, entries, metadata)?)
            })
        } else {
            Ok(())
        };
        self.sync()?;
        written
    }

    /// Saves every variable as step `step` of `manager`'s directory (with `metadata`
    /// in the index). A manager serves a strategy of one process.
    pub fn save_to(
        &self,
        manager: &mut CheckpointManager,
        step: usize,
        metadata: &Value,
    ) -> Result<PathBuf> {
        if self.is_multi_process() {
            return Err(Error::Variable {
                variable: String::new(),
                problem: "a checkpoint manager serves a single-process strategy; with several \
                          processes use Strategy::save_checkpoint"
                    .into(),
            });
        }
        let entries = self.checkpoint_entries()?;
        Ok(manager.save(step, metadata, self.num_logical_devices(), entries)?)
    }

    /// Every variable's distinct shards, over the logical devices.
    fn checkpoint_entries(&self) -> Result<Vec<CheckpointEntry>> {
        let states = self.states();
        states
            .iter()
            .map(|s| {
                let value = saved_value(s)?;
                let shards = ops::shard(&value, &s.sharding)?;
                Ok(CheckpointEntry {
                    name: s.name.clone(),
                    dtype: s.dtype,
                    shape: s.shape.clone(),
                    hlo: s.sharding.hlo().clone(),
                    shards: s
                        .index
                        .iter()
                        .zip(shards)
                        .filter(|(index, _)| index.replica_id == 0)
                        .map(|(index, shard)| {
                            (index.device.0 as usize, index.ranges.clone(), shard)
                        })
                        .collect(),
                })
            })
            .collect()
    }

    /// Restores every variable of this strategy from `dir`, resharding each onto the
    /// strategy's current layout. Refuses (changing nothing) a missing index, a file
    /// whose size or checksum differs from the index, or a variable that is missing or
    /// has another dtype or shape.
    pub fn restore_checkpoint(&self, dir: impl AsRef<Path>) -> Result<()> {
        let wanted: Vec<(String, DType, Vec<usize>)> =
            self.states().iter().map(|s| (s.name.clone(), s.dtype, s.shape.clone())).collect();
        let values = meshwork_checkpoint::read_checkpoint(dir.as_ref(), &wanted)?;
        for (v, value) in self.variables().iter().zip(&values) {
            self.assign_variable(v, value)?;
        }
        Ok(())
    }
}
