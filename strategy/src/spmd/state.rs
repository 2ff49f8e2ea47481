//! A compiled program's resident state away from its devices: sharded checkpoints
//! (saved on one mesh, restored onto another) and the seed's variable-reshard state
//! machine ([`ResidentState`]).
//!
//! A checkpoint of compiled state is the strategy's checkpoint format: each mesh
//! position writes the distinct regions it holds into its own safetensors file, the
//! index records each parameter's `HloSharding` over the positions, and a restore
//! verifies everything before it lays each value out in the restoring program's
//! layout — whatever mesh and layout saved it. Either side may be a strategy's
//! variables instead: the names are what match.

use std::path::Path;

use meshwork_sharding::{Mode, ReshardableVariable, Sharding, VariableFormat};
use meshwork_types::{DType, Element, Tensor};
use ndarray::ArrayD;
use serde_json::Value as Json;

use super::compiled::{Compiled, CompiledTrainStep};
use crate::{Error, Result};
use meshwork_checkpoint::{CheckpointEntry as Entry, CheckpointManager};

/// A resident parameter (by index) and its parts, by mesh position.
type Parts = (usize, Vec<Tensor>);

/// The name a training step's step count is saved under (TensorFlow keeps its
/// optimizer's `iter` as a checkpointed variable too).
pub const STEP_VARIABLE: &str = "optimizer.step";

/// One resident parameter in the seed's state machine, by dtype.
#[derive(Debug, Clone, PartialEq)]
enum Var {
    F32(ReshardableVariable<f32>),
    F64(ReshardableVariable<f64>),
    I32(ReshardableVariable<i32>),
    I64(ReshardableVariable<i64>),
    Bool(ReshardableVariable<bool>),
}

macro_rules! each {
    ($v:expr, |$x:ident| $e:expr) => {
        match $v {
            Var::F32($x) => $e,
            Var::F64($x) => $e,
            Var::I32($x) => $e,
            Var::I64($x) => $e,
            Var::Bool($x) => $e,
        }
    };
}

/// Program tensors (one dtype) as arrays, in a [`Var`] of `format`.
fn var_of(
    dtype: DType,
    shape: &[usize],
    parts: Vec<Tensor>,
    format: VariableFormat,
) -> Result<Var> {
    fn arrays<T: Element>(dtype: DType, parts: Vec<Tensor>) -> Result<Vec<ArrayD<T>>> {
        parts
            .into_iter()
            .map(|t| {
                T::take(t).map_err(|other| Error::DTypeMismatch {
                    what: "a resident parameter's parts",
                    expected: dtype,
                    actual: other.dtype(),
                })
            })
            .collect()
    }
    macro_rules! go {
        ($variant:ident, $t:ty) => {
            Var::$variant(ReshardableVariable::from_shards(
                shape.to_vec(),
                arrays::<$t>(dtype, parts)?,
                format,
                Mode::Strict,
            )?)
        };
    }
    Ok(match dtype {
        DType::F32 => go!(F32, f32),
        DType::F64 => go!(F64, f64),
        DType::I32 => go!(I32, i32),
        DType::I64 => go!(I64, i64),
        DType::Bool => go!(Bool, bool),
        other => return Err(Error::Compiled { problem: format!("a resident {other} value") }),
    })
}

fn tensor_of<T: Element>(a: &ArrayD<T>) -> Tensor {
    T::wrap(a.clone())
}

impl Var {
    fn dtype(&self) -> DType {
        match self {
            Var::F32(_) => DType::F32,
            Var::F64(_) => DType::F64,
            Var::I32(_) => DType::I32,
            Var::I64(_) => DType::I64,
            Var::Bool(_) => DType::Bool,
        }
    }

    fn format(&self) -> &VariableFormat {
        each!(self, |v| v.format())
    }

    fn reshard(&mut self, format: VariableFormat) -> Result<bool> {
        Ok(each!(self, |v| v.reshard(format)?))
    }

    /// The whole value.
    fn value(&self) -> Result<Tensor> {
        Ok(each!(self, |v| tensor_of(&v.value()?)))
    }

    /// The shards (index-map order), or the whole value alone in the default format.
    fn shards(&self) -> Result<Vec<Tensor>> {
        each!(self, |v| match v.shards() {
            Some(s) => Ok(s.iter().map(tensor_of).collect()),
            None => Ok(vec![self.value()?]),
        })
    }
}

/// The resident state of a compiled program off its devices: each resident parameter
/// as a variable of the seed's reshard state machine (TensorFlow's
/// `TPUReshardVariables`), holding the data in the format it is in — the compiled
/// program's sharded layout, named by its [`Compiled::format_key`], or the default
/// (whole, unsharded) format.
///
/// [`Compiled::put_state`] moves it into another compiled program's format: nothing
/// happens when the keys are equal; otherwise each variable is unsharded, then
/// sharded into the new layout, and only then recorded in it — so a failure leaves
/// every variable whole and in a format it really is in. This is how resident state
/// moves between meshes and layouts in one process (a checkpoint does it across
/// processes and time).
#[derive(Debug, Clone, PartialEq)]
pub struct ResidentState {
    vars: Vec<(String, Var)>,
    step: Option<usize>,
}

impl ResidentState {
    /// The parameters it holds, in order.
    pub fn names(&self) -> Vec<&str> {
        self.vars.iter().map(|(n, _)| n.as_str()).collect()
    }

    fn var(&self, name: &str) -> Result<&Var> {
        self.vars.iter().find(|(n, _)| n == name).map(|(_, v)| v).ok_or_else(|| Error::Compiled {
            problem: format!("the resident state holds no parameter {name}"),
        })
    }

    /// Parameter `name`'s whole value (assembled if sharded).
    pub fn value(&self, name: &str) -> Result<Tensor> {
        self.var(name)?.value()
    }

    /// The format key parameter `name` is in (`None`: the default, unsharded format).
    pub fn format_key(&self, name: &str) -> Result<Option<&str>> {
        Ok(match self.var(name)?.format() {
            VariableFormat::Default => None,
            VariableFormat::Sharded { key, .. } => Some(key),
        })
    }

    /// A training step's step count, if the state is a training step's.
    pub fn step(&self) -> Option<usize> {
        self.step
    }

    /// Moves every parameter into the default, unsharded format (the seed's reshard
    /// to the default key). Returns whether anything moved.
    pub fn to_default(&mut self) -> Result<bool> {
        let mut moved = false;
        for (_, v) in &mut self.vars {
            moved |= v.reshard(VariableFormat::Default)?;
        }
        Ok(moved)
    }
}

impl Compiled<'_> {
    /// The format key of this program's resident layout: its mesh and each resident
    /// parameter's layout over it. Two compiled programs with one key lay their
    /// resident state out alike, so moving state between them moves nothing.
    pub fn format_key(&self) -> String {
        let part = self.partitioned();
        let mesh = part.mesh();
        let mut key = format!("{mesh} devices {:?}", mesh.devices());
        for k in self.resident_params() {
            let p = &part.global().params()[k];
            key.push_str(&format!("; {} {} {}", p.name, p.spec, part.inputs()[k].display(mesh)));
        }
        key
    }

    /// Resident parameter `k`'s layout as a sharding over mesh positions (in which
    /// order its index map lists the parts).
    fn sharding_of(&self, k: usize) -> Result<Sharding> {
        let part = self.partitioned();
        let rank = part.global().params()[k].spec.shape.rank();
        Ok(part.inputs()[k].to_named(part.mesh())?.to_sharding(rank)?)
    }

    /// The resident state, copied off the devices, in this program's format.
    pub fn state(&self) -> Result<ResidentState> {
        let key = self.format_key();
        let mut vars = Vec::new();
        for (k, parts) in self.snapshot()? {
            let p = &self.partitioned().global().params()[k];
            let format =
                VariableFormat::Sharded { key: key.clone(), sharding: self.sharding_of(k)? };
            let var = var_of(p.spec.dtype, p.spec.shape.dims(), parts, format)?;
            vars.push((p.name.clone(), var));
        }
        Ok(ResidentState { vars, step: None })
    }

    /// Puts `state` on the devices: each resident parameter moved into this program's
    /// format by the seed's state machine (nothing moves when the state is in it
    /// already, [`format_key`](Self::format_key)), then its parts placed. Every
    /// resident parameter must be in `state`, of its dtype and shape; if anything is
    /// refused, the devices are unchanged and `state` holds the same values (each
    /// variable in its old format or in this one). Returns whether any data moved
    /// between layouts.
    pub fn put_state(&self, state: &mut ResidentState) -> Result<bool> {
        let resident = self.resident_params();
        let params = self.partitioned().global().params();
        let mut at = Vec::with_capacity(resident.len());
        for &k in &resident {
            let p = &params[k];
            let j = state.vars.iter().position(|(n, _)| *n == p.name).ok_or_else(|| {
                Error::Compiled { problem: format!("the state holds no parameter {}", p.name) }
            })?;
            let v = &state.vars[j].1;
            let shape = each!(v, |x| x.shape().to_vec());
            if v.dtype() != p.spec.dtype || shape != p.spec.shape.dims() {
                return Err(Error::Compiled {
                    problem: format!(
                        "the state's {} is {}{:?}, the program's is {}",
                        p.name,
                        v.dtype(),
                        shape,
                        p.spec
                    ),
                });
            }
            at.push(j);
        }
        let key = self.format_key();
        let mut moved = false;
        for (&k, &j) in resident.iter().zip(&at) {
            let format =
                VariableFormat::Sharded { key: key.clone(), sharding: self.sharding_of(k)? };
            moved |= state.vars[j].1.reshard(format)?;
        }
        let mut parts = Vec::with_capacity(resident.len());
        for (&k, &j) in resident.iter().zip(&at) {
            parts.push((k, state.vars[j].1.shards()?));
        }
        self.install(parts)?;
        Ok(moved)
    }

    /// The checkpoint entries of the resident parameters: each mesh position's
    /// distinct regions, over the mesh's positions
    /// ([`mesh().size()`](meshwork_sharding::Mesh::size) of them).
    pub fn checkpoint_entries(&self) -> Result<Vec<Entry>> {
        self.snapshot()?
            .into_iter()
            .map(|(k, parts)| {
                let mut parts: Vec<Option<Tensor>> = parts.into_iter().map(Some).collect();
                self.entry_of(k, &mut |r| Ok(parts.get_mut(r).and_then(Option::take)))
            })
            .collect()
    }

    /// The checkpoint entries of the parts this process's positions hold (every
    /// position's, in one process): each resident parameter's regions whose first
    /// holder is one of them. No collective.
    fn local_entries(&self) -> Result<Vec<Entry>> {
        let local = self.exe.local();
        let _busy = super::compiled::lock(&self.busy);
        self.resident_params()
            .into_iter()
            .map(|k| {
                let name = &self.partitioned().global().params()[k].name;
                self.entry_of(k, &mut |r| {
                    if !local.contains(&r) {
                        return Ok(None);
                    }
                    let part = self.exe.fetch(r, k)?.ok_or_else(|| Error::Compiled {
                        problem: format!("resident parameter {name} was never set"),
                    })?;
                    Ok(Some(part))
                })
            })
            .collect()
    }

    /// Resident parameter `k`'s checkpoint entry: the distinct regions of its layout
    /// (each its first holder's), of those positions `r` whose part `part(r)` gives.
    fn entry_of(
        &self,
        k: usize,
        part: &mut dyn FnMut(usize) -> Result<Option<Tensor>>,
    ) -> Result<Entry> {
        let p = &self.partitioned().global().params()[k];
        if p.spec.dtype == DType::Bool {
            return Err(Error::Compiled {
                problem: format!("{} is bool: checkpoints hold numbers", p.name),
            });
        }
        let sharding = self.sharding_of(k)?;
        let index = sharding.index_map(p.spec.shape.dims(), Mode::Strict)?;
        let mut shards = Vec::new();
        for (r, entry) in index.into_iter().enumerate() {
            if entry.replica_id != 0 {
                continue;
            }
            if let Some(t) = part(r)? {
                shards.push((r, entry.ranges, t));
            }
        }
        Ok(Entry {
            name: p.name.clone(),
            dtype: p.spec.dtype,
            shape: p.spec.shape.dims().to_vec(),
            hlo: sharding.hlo().clone(),
            shards,
        })
    }

    /// Saves step `step` into `manager` from every process at once (each process's
    /// [`CheckpointManager`], process 0's [open](CheckpointManager::open) and the
    /// others' [joined](CheckpointManager::join)): each writes the regions its
    /// positions hold (no gathering of values), the processes exchange what they
    /// wrote, and process 0 commits the step once every part is durable. Every
    /// process returns the same outcome; a failure anywhere leaves no step.
    fn save_spread(
        &self,
        manager: &mut CheckpointManager,
        step: usize,
        extra: Vec<Entry>,
        metadata: &Json,
    ) -> Result<std::path::PathBuf> {
        let strategy = self.strategy;
        let runtime = strategy.runtime();
        let process = runtime.first_replica() / runtime.devices().max(1);
        let n = self.partitioned().mesh().size();
        let local = self.exe.local();
        let written = self.local_entries().and_then(|mut entries| {
            // Position 0's process writes the replicated extras (the step count).
            if local.contains(&0) {
                entries.extend(extra);
            } else {
                entries.extend(extra.into_iter().map(|e| Entry { shards: Vec::new(), ..e }));
            }
            Ok(manager.write_part(step, process, local.clone(), n, entries)?)
        });
        let said = match &written {
            Ok(part) => [&[1u8][..], &part.to_bytes()].concat(),
            Err(e) => [&[0u8][..], e.to_string().as_bytes()].concat(),
        };
        let everyone = match strategy.all_gather_bytes(&said) {
            Ok(everyone) => everyone,
            Err(e) => {
                if let Ok(part) = &written {
                    manager.abandon(part);
                }
                return Err(e);
            }
        };
        let failure = everyone.iter().enumerate().find(|(_, b)| b.first() != Some(&1));
        if let Some((q, said)) = failure {
            if let Ok(part) = &written {
                manager.abandon(part);
            }
            let why = String::from_utf8_lossy(said.get(1..).unwrap_or_default()).into_owned();
            return Err(Error::Checkpoint(meshwork_checkpoint::Error::Save {
                path: manager.root().to_path_buf(),
                step,
                problem: format!("process {q} could not write its part: {why}"),
            }));
        }
        let committed = if process == 0 {
            let parts = everyone
                .iter()
                .enumerate()
                .map(|(q, b)| {
                    let part =
                        meshwork_checkpoint::WrittenPart::from_bytes(&b[1..], manager.root())?;
                    Ok((q, part))
                })
                .collect::<Result<Vec<_>>>();
            parts.and_then(|parts| Ok(manager.commit_parts(step, metadata, n, parts)?))
        } else {
            Ok(manager.root().join(meshwork_checkpoint::step_name(step)))
        };
        let said = match &committed {
            Ok(_) => vec![1u8],
            Err(e) => [&[0u8][..], e.to_string().as_bytes()].concat(),
        };
        let everyone = strategy.all_gather_bytes(&said)?;
        match everyone.first() {
            Some(b) if b.first() == Some(&1) => committed,
            other => {
                committed?;
                let why = other.and_then(|b| b.get(1..)).unwrap_or_default();
                Err(Error::Checkpoint(meshwork_checkpoint::Error::Save {
                    path: manager.root().to_path_buf(),
                    step,
                    problem: format!(
                        "process 0 could not commit it: {}",
                        String::from_utf8_lossy(why)
                    ),
                }))
            }
        }
    }

    /// Writes the checkpoint; across processes every process gathers the parts,
    /// process 0 writes, and all return once it has (as a strategy's checkpoint).
    fn write(&self, dir: &Path, extra: Vec<Entry>, metadata: Option<&Json>) -> Result<()> {
        let mut entries = self.checkpoint_entries()?;
        entries.extend(extra);
        let n = self.partitioned().mesh().size();
        let strategy = self.strategy;
        if !strategy.is_multi_process() {
            return Ok(meshwork_checkpoint::write_checkpoint(dir, n, entries, metadata)?);
        }
        let written = if strategy.runtime().first_replica() == 0 {
            meshwork_checkpoint::write_checkpoint(dir, n, entries, metadata).map_err(Error::from)
        } else {
            Ok(())
        };
        // Every process returns once process 0 has written, and fails if it failed.
        let everywhere = strategy.all_agree(written.is_ok())?;
        written?;
        if !everywhere {
            return Err(Error::Compiled {
                problem: format!("process 0 could not write the checkpoint {}", dir.display()),
            });
        }
        Ok(())
    }

    /// Saves the resident parameters as a sharded checkpoint in `dir` (a new or empty
    /// directory; anything else is refused untouched): mesh position `r` writes the
    /// regions it holds (once per region) to `shard-r.safetensors`, the index last.
    /// [`restore_checkpoint`](Self::restore_checkpoint) on any mesh and layout, or a
    /// strategy's, reads it back. Across processes every process calls it: the parts
    /// are gathered, process 0 writes, and all return once it has (an error in every
    /// process if it could not). Restoring across processes has every process read
    /// `dir` itself: a directory all of them see.
    pub fn save_checkpoint(&self, dir: impl AsRef<Path>) -> Result<()> {
        self.write(dir.as_ref(), Vec::new(), None)
    }

    /// [`save_checkpoint`](Self::save_checkpoint) with `metadata` in the index.
    pub fn save_checkpoint_with_metadata(
        &self,
        dir: impl AsRef<Path>,
        metadata: &Json,
    ) -> Result<()> {
        self.write(dir.as_ref(), Vec::new(), Some(metadata))
    }

    /// Restores every resident parameter from the checkpoint in `dir` (saved on any
    /// mesh, by a compiled program or a strategy), laid out in this program's layout.
    /// Verifies everything first: a missing parameter, another dtype or shape, a
    /// damaged file changes nothing.
    pub fn restore_checkpoint(&self, dir: impl AsRef<Path>) -> Result<()> {
        let values = self.read(dir.as_ref(), &[])?.0;
        self.install(values)?;
        Ok(())
    }

    /// Reads the resident parameters (split into parts) and `extra` variables from
    /// `dir`.
    fn read(
        &self,
        dir: &Path,
        extra: &[(String, DType, Vec<usize>)],
    ) -> Result<(Vec<Parts>, Vec<Tensor>)> {
        let params = self.partitioned().global().params();
        let resident = self.resident_params();
        let mut wanted: Vec<(String, DType, Vec<usize>)> = resident
            .iter()
            .map(|&k| {
                let p = &params[k];
                (p.name.clone(), p.spec.dtype, p.spec.shape.dims().to_vec())
            })
            .collect();
        if self.strategy.is_multi_process() {
            // Each process reads the boxes its own positions hold, no more.
            let local = self.exe.local();
            let mut boxes = Vec::with_capacity(resident.len());
            let mut owners = Vec::with_capacity(resident.len());
            for &k in &resident {
                let p = &params[k];
                let index = self.sharding_of(k)?.index_map(p.spec.shape.dims(), Mode::Strict)?;
                let mut distinct: Vec<Vec<std::ops::Range<usize>>> = Vec::new();
                let mut of = Vec::with_capacity(index.len());
                for (r, e) in index.into_iter().enumerate() {
                    if !local.contains(&r) {
                        of.push(None);
                        continue;
                    }
                    let at = distinct.iter().position(|b| *b == e.ranges).unwrap_or_else(|| {
                        distinct.push(e.ranges.clone());
                        distinct.len() - 1
                    });
                    of.push(Some(at));
                }
                boxes.push(distinct);
                owners.push(of);
            }
            // The extras (the step count) whole, read as boxes too: nothing else of
            // the checkpoint is read.
            let n = wanted.len();
            wanted.extend(extra.iter().cloned());
            boxes.extend(
                extra.iter().map(|(_, _, shape)| vec![shape.iter().map(|&d| 0..d).collect()]),
            );
            let mut read = meshwork_checkpoint::read_checkpoint_parts(dir, &wanted, &boxes)?;
            let extra: Vec<Tensor> = read.split_off(n).into_iter().flatten().collect();
            let mut parts = Vec::with_capacity(resident.len());
            for ((&k, got), of) in resident.iter().zip(read).zip(owners) {
                let dtype = params[k].spec.dtype;
                let per = of
                    .into_iter()
                    .map(|at| match at {
                        Some(i) => Ok(got[i].clone()),
                        None => Ok(Tensor::zeros(dtype, &[0])?),
                    })
                    .collect::<Result<Vec<_>>>()?;
                parts.push((k, per));
            }
            return Ok((parts, extra));
        }
        wanted.extend(extra.iter().cloned());
        let mut values = meshwork_checkpoint::read_checkpoint(dir, &wanted)?;
        let extra = values.split_off(resident.len());
        let mut parts = Vec::with_capacity(resident.len());
        for (&k, value) in resident.iter().zip(values) {
            parts.push((k, self.split_resident(k, &value)?));
        }

        Ok((parts, extra))
    }
}

fn step_entry(steps: usize) -> Result<Entry> {
    let count = i64::try_from(steps).map_err(|_| Error::Compiled {
        problem: format!("a step count of {steps} does not fit a checkpoint's i64"),
    })?;
    let t = Tensor::i64(&[], vec![count])?;
    Ok(Entry {
        name: STEP_VARIABLE.to_string(),
        dtype: DType::I64,
        shape: Vec::new(),
        hlo: meshwork_sharding::HloSharding::Replicated,
        shards: vec![(0, Vec::new(), t)],
    })
}

impl CompiledTrainStep<'_> {
    /// The weights and optimizer state, copied off the devices, with the step count.
    pub fn state(&self) -> Result<ResidentState> {
        let mut s = self.compiled.state()?;
        s.step = Some(self.steps);
        Ok(s)
    }

    /// Puts `state` (weights, optimizer state and step count; from any mesh and
    /// layout) on the devices: [`Compiled::put_state`]. Returns whether any data moved
    /// between layouts.
    pub fn put_state(&mut self, state: &mut ResidentState) -> Result<bool> {
        let step = state.step.ok_or_else(|| Error::Compiled {
            problem: "the state has no step count (not a training step's)".into(),
        })?;
        let moved = self.compiled.put_state(state)?;
        self.steps = step;
        Ok(moved)
    }

    /// Saves the weights, the optimizer state and the step count (as the i64 scalar
    /// [`STEP_VARIABLE`]) as a sharded checkpoint in `dir`:
    /// [`Compiled::save_checkpoint`].
    pub fn save_checkpoint(&self, dir: impl AsRef<Path>) -> Result<()> {
        self.compiled.write(dir.as_ref(), vec![step_entry(self.steps)?], None)
    }

    /// [`save_checkpoint`](Self::save_checkpoint) with `metadata` in the index.
    pub fn save_checkpoint_with_metadata(
        &self,
        dir: impl AsRef<Path>,
        metadata: &Json,
    ) -> Result<()> {
        self.compiled.write(dir.as_ref(), vec![step_entry(self.steps)?], Some(metadata))
    }

    /// Saves the weights, the optimizer state and the step count as step `step` of
    /// `manager`'s directory, with `metadata` in the index. Across processes every
    /// process calls it with its own manager (process 0's opened, the others'
    /// [joined](CheckpointManager::join)): each writes the parts its positions hold,
    /// and process 0 commits the step once all are durable (its index names the
    /// process that wrote each file).
    pub fn save_to(
        &self,
        manager: &mut CheckpointManager,
        step: usize,
        metadata: &Json,
    ) -> Result<std::path::PathBuf> {
        if self.compiled.strategy.is_multi_process() {
            let extra = vec![step_entry(self.steps)?];
            return self.compiled.save_spread(manager, step, extra, metadata);
        }
        let mut entries = self.compiled.checkpoint_entries()?;
        entries.push(step_entry(self.steps)?);
        let n = self.compiled.partitioned().mesh().size();
        Ok(manager.save(step, metadata, n, entries)?)
    }

    /// Restores the weights, optimizer state and step count from `dir` (saved on any
    /// mesh), verifying everything before anything changes.
    pub fn restore_checkpoint(&mut self, dir: impl AsRef<Path>) -> Result<()> {
        let extra = [(STEP_VARIABLE.to_string(), DType::I64, Vec::new())];
        let (parts, extra) = self.compiled.read(dir.as_ref(), &extra)?;
        let saved = extra[0].as_array::<i64>().and_then(|a| a.iter().next().copied());
        let step = saved.and_then(|s| usize::try_from(s).ok()).ok_or_else(|| Error::Compiled {
            problem: format!("the saved step count {saved:?} is not a count of steps"),
        })?;
        self.compiled.install(parts)?;
        self.steps = step;
        Ok(())
    }
}
