//! Mirrored variables: one copy per replica (and per logical device that holds it),
//! kept in sync on write or reduced on read, under TensorFlow's aggregation rules.

use meshwork_executor::Tensor;
use meshwork_sharding::{HloSharding, ShardIndex, Sharding};
use meshwork_types::{DType, DeviceId, Shape, TensorSpec};

use crate::ops;
use crate::{Error, Result};

/// When the replicas' copies agree (`tf.VariableSynchronization`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Synchronization {
    /// ON_WRITE.
    #[default]
    Auto,
    /// Every write is aggregated so all copies stay equal.
    OnWrite,
    /// Copies differ; a cross-replica read aggregates them.
    OnRead,
    /// Refused under a strategy (TF's error).
    None,
}

/// How replicas' writes (or reads, for sync-on-read) combine (`tf.VariableAggregation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Aggregation {
    /// No aggregation: every replica must write the same value (meshwork refuses a
    /// write that would make mirrored copies diverge; TF lets them diverge).
    #[default]
    None,
    /// The sum over replicas.
    Sum,
    /// The mean over replicas (float dtypes only).
    Mean,
    /// Replica 0's value.
    OnlyFirstReplica,
}

/// Where a variable's data lives among a replica's logical devices.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Layout {
    /// A whole copy on every logical device; or on the logical device of the enclosing
    /// [`Strategy::logical_device_scope`](crate::Strategy::logical_device_scope).
    #[default]
    Replicated,
    /// Split along each dim into that many pieces over the logical devices
    /// (`experimental_split_to_logical_devices`, with its checks).
    Split(Vec<usize>),
    /// A whole copy on one logical device (`experimental_assign_to_logical_device`).
    OnDevice(usize),
}

/// A variables' format for [`Strategy::reshard_variables`](crate::Strategy::reshard_variables)
/// (the seed's format key): the default (a whole copy on every logical device), or a
/// layout named by a key; two formats with one key are the same format.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Format {
    /// The default, unsharded layout.
    Default,
    /// `layout`, named `key`.
    Sharded {
        /// The format key (not empty).
        key: String,
        /// The layout.
        layout: Layout,
    },
}

/// How a variable is created.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct VariableOptions {
    /// Synchronisation.
    pub synchronization: Synchronization,
    /// Aggregation.
    pub aggregation: Aggregation,
    /// Layout over the logical devices.
    pub layout: Layout,
}

/// A handle to a strategy's variable.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Variable {
    pub(crate) id: usize,
    pub(crate) name: String,
}

impl Variable {
    /// The variable's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// A variable's state in a strategy.
#[derive(Debug, Clone)]
pub(crate) struct VarState {
    pub(crate) name: String,
    pub(crate) sync: Synchronization,
    pub(crate) aggregation: Aggregation,
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<usize>,
    /// The layout over logical devices `0..L`.
    pub(crate) sharding: Sharding,
    pub(crate) index: Vec<ShardIndex>,
    /// `[replica][shard]`, shards in index-map order.
    pub(crate) values: Vec<Vec<Tensor>>,
    /// The reshard state: the format key of the current layout (`None` = default).
    pub(crate) format: Option<String>,
}

impl VarState {
    /// A variable of `value` laid out by `layout` over `logical` devices, copied to
    /// `replicas` replicas.
    pub(crate) fn new(
        name: &str,
        options: &VariableOptions,
        value: Tensor,
        replicas: usize,
        logical: usize,
    ) -> Result<VarState> {
        let sync = match options.synchronization {
            Synchronization::None => return Err(Error::SyncNone { variable: name.into() }),
            Synchronization::Auto => Synchronization::OnWrite,
            s => s,
        };
        let dtype = value.dtype();
        if options.aggregation == Aggregation::Mean && !is_float(dtype) {
            return Err(Error::MeanNonFloat { variable: name.into(), dtype });
        }
        let shape = value.shape().to_vec();
        let sharding = layout_sharding(&options.layout, &shape, logical)?;
        let index = sharding.index_map(&shape, meshwork_sharding::Mode::Strict)?;
        let shards = ops::shard(&value, &sharding)?;
        Ok(VarState {
            name: name.into(),
            sync,
            aggregation: options.aggregation,
            dtype,
            shape,
            sharding,
            index,
            values: vec![shards; replicas],
            // A variable created in a non-default layout is in a format of its own.
            format: (options.layout != Layout::Replicated).then(|| format!("{:?}", options.layout)),
        })
    }

    /// The shard logical device `l` holds, if it holds one.
    pub(crate) fn shard_of(&self, l: usize) -> Option<usize> {
        self.index.iter().position(|s| s.device == DeviceId(l as u32))
    }

    /// Replica `r`'s whole value.
    pub(crate) fn value_of(&self, r: usize) -> Result<Tensor> {
        ops::assemble(&self.values[r], &self.sharding, &self.shape)
    }

    /// The value a cross-replica read sees.
    pub(crate) fn read(&self) -> Result<Tensor> {
        if self.sync == Synchronization::OnWrite {
            return self.value_of(0);
        }
        let n = self.values.len();
        match self.aggregation {
            Aggregation::None => Err(Error::ReadNone { variable: self.name.clone() }),
            Aggregation::OnlyFirstReplica => self.value_of(0),
            Aggregation::Sum | Aggregation::Mean => {
                let mut acc = self.value_of(0)?;
                for r in 1..n {
                    acc = ops::add(&acc, &self.value_of(r)?)?;
                }
                Ok(if self.aggregation == Aggregation::Mean {
                    ops::divide(&acc, n as f64)?
                } else {
                    acc
                })
            }
        }
    }

    /// Checks `value` against the whole variable.
    pub(crate) fn check(&self, value: &Tensor) -> Result<()> {
        check_spec(&self.name, value, self.dtype, &self.shape)
    }

    /// Lays `value` out on every replica (a cross-replica assign).
    pub(crate) fn set_all(&mut self, value: &Tensor) -> Result<()> {
        self.check(value)?;
        let shards = ops::shard(value, &self.sharding)?;
        self.values.iter_mut().for_each(|v| *v = shards.clone());
        Ok(())
    }

    /// Moves the data to `sharding` (over the same logical devices), through the
    /// sharding crate's plan; changes nothing on failure.
    pub(crate) fn relayout(&mut self, sharding: Sharding) -> Result<()> {
        let plan = meshwork_sharding::ReshardPlan::new(
            &self.sharding,
            &sharding,
            &self.shape,
            meshwork_sharding::Mode::Strict,
        )?;
        let values = self
            .values
            .iter()
            .map(|shards| ops::apply_plan(&plan, shards))
            .collect::<Result<Vec<_>>>()?;
        self.index = sharding.index_map(&self.shape, meshwork_sharding::Mode::Strict)?;
        self.sharding = sharding;
        self.values = values;
        Ok(())
    }
}

pub(crate) fn is_float(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F64)
}

pub(crate) fn spec(dtype: DType, shape: &[usize]) -> String {
    Shape::new(shape)
        .map(|s| TensorSpec::new(dtype, s).to_string())
        .unwrap_or_else(|_| format!("{dtype}{shape:?}"))
}

pub(crate) fn check_spec(name: &str, value: &Tensor, dtype: DType, shape: &[usize]) -> Result<()> {
    if value.dtype() != dtype || value.shape() != shape {
        return Err(Error::VariableValue {
            variable: name.into(),
            expected: spec(dtype, shape),
            actual: spec(value.dtype(), value.shape()),
        });
    }
    Ok(())
}

/// The sharding over logical devices `0..logical` of a layout.
pub(crate) fn layout_sharding(
    layout: &Layout,
    shape: &[usize],
    logical: usize,
) -> Result<Sharding> {
    let hlo = match layout {
        Layout::Replicated => meshwork_sharding::replicate_to_logical_devices(),
        Layout::Split(dims) => meshwork_sharding::split_to_logical_devices(shape, dims, logical)?,
        Layout::OnDevice(id) => meshwork_sharding::assign_to_logical_device(*id, logical)?,
    };
    logical_sharding(hlo, logical)
}

pub(crate) fn logical_sharding(hlo: HloSharding, logical: usize) -> Result<Sharding> {
    Ok(Sharding::new(hlo, (0..logical as u32).map(DeviceId).collect())?)
}
